"""The generated parts of the documentation: the methods catalogue, the API reference's pages,
the notebooks' pages and the lab's interactive page.

``docs/conf.py`` calls :func:`prepare` before Sphinx reads the sources; it computes nothing.
The notebooks' pages are stored runs (``docs/notebooks/*.ipynb``: each notebook run with its
default parameters, cleaned of noise, with the command, machine and date in its metadata), and
the lab page is written from stored data (``docs/_static/lab_data.json.gz``). Both are
refreshed by hand::

  python docs/pages.py notebooks [NAME ...]   # the notebooks' default runs (minutes each)
  python docs/pages.py lab                    # the lab page's data (configs/lab.py:quick)
"""

from __future__ import annotations

import datetime
import gzip
import importlib
import inspect
import json
import os
import pathlib
import pkgutil
import re
import sys
import tempfile
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = DOCS / "notebooks"
LAB_PAGE = DOCS / "_static" / "lab.html"
# The lab page's data, computed by `python docs/pages.py lab` (minutes) and stored, so that a
# build only writes the page around them.
LAB_DATA = DOCS / "_static" / "lab_data.json.gz"
LAB_CONFIG = "quick"
LIMIT_S = 1800  # a notebook's default run on a CPU
# The kernel's matplotlib backend: figures become image outputs, as Jupyter shows them (a
# headless MPLBACKEND=Agg in the environment would leave the pages without figures).
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


# The API reference: one page per public package and one per module inside it.
API = DOCS / "_autosummary"
API_PACKAGES = (
  "kvjax.select",
  "kvjax.scores",
  "kvjax.budgets",
  "kvjax.policies",
  "kvjax.model",
  "kvjax.lab",
  "kvjax.eval",
  "kvjax.rundir",
  "kvjax.plotting",
  "kvjax.distributed",
)


def _modules(package: str) -> list[str]:
  """``package`` and every module below it, the package first."""
  module = importlib.import_module(package)
  names = [package]
  for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
    names += _modules(f"{package}.{info.name}")
  return names


def _public(module) -> list[str]:
  """The classes and functions ``module`` offers: those of its ``__all__``, else those it defines
  whose names do not start with ``_`` (submodules have pages of their own)."""
  names = getattr(module, "__all__", None)
  if names is None:
    names = [
      n
      for n, v in vars(module).items()
      if not n.startswith("_")
      and (inspect.isclass(v) or inspect.isfunction(v))
      and v.__module__ == module.__name__
    ]
  # constants are left out: the docstring autodoc finds for one is its type's
  return [n for n in names if inspect.isclass(v := getattr(module, n)) or inspect.isroutine(v)]


def api_members() -> dict[str, tuple[list[str], list[str]]]:
  """Where each public object is documented: ``module -> (own, elsewhere)``, ``own`` the names
  documented on the module's page, ``elsewhere`` the full names of the objects it offers that
  another page documents. An object is documented once: on its package's page when the package
  exports it, else in the module that defines it, else in the first module that offers it."""
  modules = {name: importlib.import_module(name) for p in API_PACKAGES for name in _modules(p)}
  home: dict[int, str] = {}
  for name, module in modules.items():  # the packages' exports first
    if hasattr(module, "__path__") and hasattr(module, "__all__"):
      for n in _public(module):
        home.setdefault(id(getattr(module, n)), f"{name}.{n}")
  for name, module in modules.items():  # then where each object is defined
    for n in _public(module):
      obj = getattr(module, n)
      if getattr(obj, "__module__", None) == name:
        home.setdefault(id(obj), f"{name}.{n}")
  out = {}
  for name, module in modules.items():
    own, elsewhere = [], []
    for n in _public(module):
      full = home.setdefault(id(getattr(module, n)), f"{name}.{n}")
      (own if full == f"{name}.{n}" else elsewhere).append(n if full == f"{name}.{n}" else full)
    out[name] = (own, elsewhere)
  return out


def _api_page(name: str, own: list[str], elsewhere: list[str], children: list[str]) -> str:
  lines = [name, "=" * len(name), "", f".. automodule:: {name}", "   :no-members:", ""]
  if children:
    lines += [".. toctree::", "   :maxdepth: 1", "   :caption: Modules", ""]
    lines += [f"   {c}" for c in children] + [""]
  if elsewhere:
    lines += ["Also offered here, documented on the page each name links to:", ""]
    lines += [".. autosummary::", "   :nosignatures:", ""] + [f"   {e}" for e in elsewhere]
    lines += [""]
  if own:
    lines += [f".. currentmodule:: {name}", "", ".. autosummary::", "   :nosignatures:", ""]
    lines += [f"   {n}" for n in own] + [""]
    module = importlib.import_module(name)
    for n in own:
      kind = "autoclass" if inspect.isclass(getattr(module, n)) else "autofunction"
      lines += [f".. {kind}:: {n}", ""]
  return "\n".join(lines)


def write_api(directory: pathlib.Path = API) -> list[str]:
  """Writes the API reference's pages (a page whose text is unchanged is left alone, so Sphinx
  rebuilds only what changed; a page no module needs any more is removed); returns the
  packages' page names, which ``api.md`` lists."""
  members = api_members()
  directory.mkdir(parents=True, exist_ok=True)
  pages = {}
  for name, (own, elsewhere) in members.items():
    children = [m for m in members if m.rsplit(".", 1)[0] == name]
    pages[name] = _api_page(name, own, elsewhere, children)
  for path in directory.glob("*.rst"):
    if path.stem not in pages:
      path.unlink()
  for name, text in pages.items():
    path = directory / f"{name}.rst"
    if not path.exists() or path.read_text() != text:
      path.write_text(text)
  return list(API_PACKAGES)


def executed_path(source: pathlib.Path) -> pathlib.Path:
  """Where the stored run of the notebook ``source`` lives (``docs/notebooks/``)."""
  return EXECUTED / source.name


def code_sources(nb) -> list[str]:
  """The code cells' sources of ``nb``, papermill's injected parameters left out: what a stored
  run must share with its notebook."""
  return [
    c.source.strip()
    for c in nb.cells
    if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", ())
  ]


# Lines of a stored run's stderr that say nothing about the notebook: tqdm's warning that
# ipywidgets is missing (with the interpreter's path), absl/JAX's probing of absent backends,
# the kernel's transport warning.
_NOISE = re.compile(
  r"TqdmWarning|from \.autonotebook import tqdm|notebook_tqdm|warnings\.warn\(|"
  r"Unable to initialize backend|An NVIDIA GPU may be present|"
  r"Kernel is running over TCP|Platform '\w+' is experimental"
)
# ml_collections prints a config's tuples as YAML tags
_YAML_TUPLE = re.compile(r" ?!!python/tuple")


def _clean_text(text: str) -> str:
  return _YAML_TUPLE.sub("", text).replace(str(ROOT) + "/", "")


def _as_shown(text: str) -> str:
  """``text`` as a terminal leaves it: of each line rewritten with carriage returns (a progress
  bar), its last state."""
  lines = text.split("\n")
  return "\n".join(next((p for p in reversed(x.split("\r")) if p), "") for x in lines)


def clean(nb) -> None:
  """Strips a run's noise in place: stderr lines of :data:`_NOISE`, progress bars' intermediate
  states, ``!!python/tuple`` YAML tags, the repository's absolute path; hides papermill's
  injected parameters (readers see the notebook's own parameters cell)."""
  for cell in nb.cells:
    tags = cell.metadata.setdefault("tags", [])
    if "injected-parameters" in tags and "remove-cell" not in tags:
      tags.append("remove-cell")
    outputs = []
    for out in cell.get("outputs", []):
      if out.get("output_type") == "stream":
        last = outputs[-1] if outputs else None
        if last is not None and last.get("output_type") == "stream" and last.name == out.name:
          outputs.pop()  # one stream output per run of them, so a bar's states meet
          out.text = last.text + out.text
        lines = _as_shown(out.text).splitlines(keepends=True)
        if out.name == "stderr":
          lines = [x for x in lines if not _NOISE.search(x)]
        out.text = _clean_text("".join(lines))
        if not out.text.strip():
          continue
      elif "text/plain" in out.get("data", {}):
        out.data["text/plain"] = _clean_text(out.data["text/plain"])
      outputs.append(out)
    if cell.cell_type == "code":
      cell.outputs = outputs
  for key in ("input_path", "output_path"):
    nb.metadata.get("papermill", {}).pop(key, None)
  nb.metadata.get("papermill", {}).pop("environment_variables", None)


def store(executed: str | pathlib.Path, source: pathlib.Path, run: dict) -> pathlib.Path:
  """Stores papermill's run of ``source`` as its documentation page, cleaned (:func:`clean`),
  with ``run`` (``command``, ``machine``, ``date``, ``seconds``) in its metadata."""
  nb = nbformat.read(str(executed), as_version=4)
  clean(nb)
  nb.metadata["kvjax_run"] = run
  EXECUTED.mkdir(parents=True, exist_ok=True)
  out = executed_path(source)
  nbformat.write(nb, str(out))
  return out


def machine() -> str:
  """This machine in a few words: CPU model and count, JAX's backend."""
  import jax  # noqa: PLC0415

  model = "CPU"
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  if cpuinfo.exists():
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
    model = found[1].strip() if found else model
  return f"{os.cpu_count()} x {model}, JAX {jax.__version__} on {jax.default_backend()}"


def run_notebook(source: pathlib.Path, *, quick: bool = False) -> pathlib.Path:
  """Runs ``source`` under papermill as a user would (from the notebooks folder, its default
  parameters; ``quick``: ``QUICK = True``), figures inline, and stores the run."""
  import papermill  # noqa: PLC0415  (only a run needs it)

  backend = os.environ.get("MPLBACKEND")
  os.environ["MPLBACKEND"] = INLINE_BACKEND  # the kernel inherits it
  try:
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp) / source.name
      start = time.time()
      papermill.execute_notebook(
        str(source),
        str(out),
        parameters={"QUICK": True} if quick else {},
        cwd=str(source.parent),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=LIMIT_S,
      )
      command = f"python docs/pages.py notebooks {source.stem}" + (" --quick" * quick)
      run = dict(
        command=command,
        machine=machine(),
        date=datetime.date.today().isoformat(),
        seconds=round(time.time() - start),
      )
      return store(out, source, run)
  finally:
    if backend is None:
      del os.environ["MPLBACKEND"]
    else:
      os.environ["MPLBACKEND"] = backend


def lab_data(config_name: str = LAB_CONFIG) -> dict:
  """The lab page's data on ``configs/lab.py:<config_name>`` (a few minutes on 2 cores)."""
  from configs import lab as lab_config  # noqa: PLC0415
  from kvjax.lab import explorer, suite  # noqa: PLC0415

  config = lab_config.get_config(config_name)
  return explorer.explorer_data(config, suite.validate_config(config))


def write_lab_data(data: dict, path: pathlib.Path = LAB_DATA) -> pathlib.Path:
  """Stores the lab page's data (gzipped JSON; ``mtime=0`` so equal data give equal bytes)."""
  text = json.dumps(data, separators=(",", ":"), sort_keys=False).encode()
  path.write_bytes(gzip.compress(text, mtime=0))
  return path


def read_lab_data(path: pathlib.Path = LAB_DATA) -> dict:
  return json.loads(gzip.decompress(path.read_bytes()))


def lab_page(path: pathlib.Path = LAB_PAGE) -> pathlib.Path:
  """The lab's interactive page, from the stored data (:data:`LAB_DATA`): writing it takes a
  moment, computing the data minutes."""
  from kvjax.lab import explorer  # noqa: PLC0415

  path.parent.mkdir(parents=True, exist_ok=True)
  explorer.write_html(read_lab_data(), path)
  return path


def prepare() -> None:
  """Writes the catalogue, the API pages and the lab page, and puts each notebook's stored run
  where its page is read (a notebook without one renders from its source, without outputs).
  Nothing is computed: the stored runs and lab data are refreshed by this file's command line."""
  import catalogue  # noqa: PLC0415  (docs/ is on the path of a build)

  catalogue.write(DOCS / "methods_catalogue.md")
  write_api()
  EXECUTED.mkdir(parents=True, exist_ok=True)
  for source in NOTEBOOKS:
    if not executed_path(source).exists():
      executed_path(source).write_bytes(source.read_bytes())
  lab_page()


def main(argv: list[str]) -> None:
  """``python docs/pages.py notebooks [NAME ...] [--quick]``: runs the notebooks (all, or those
  whose names start with a NAME) with their default parameters and stores the runs as their
  pages; ``python docs/pages.py lab``: recomputes the lab page's data."""
  sys.path.insert(0, str(ROOT))  # configs/ lives at the repository root
  if argv[:1] == ["lab"]:
    write_lab_data(lab_data())
    LAB_PAGE.unlink(missing_ok=True)
    print(lab_page())
  elif argv[:1] == ["notebooks"]:
    names = [a for a in argv[1:] if not a.startswith("--")]
    for source in NOTEBOOKS:
      if not names or any(source.stem.startswith(n) for n in names):
        print(run_notebook(source, quick="--quick" in argv), flush=True)
  else:
    raise SystemExit(main.__doc__)


if __name__ == "__main__":
  main(sys.argv[1:])
