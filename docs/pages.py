"""The generated parts of the documentation: the methods catalogue, the API reference's pages,
the notebooks executed in QUICK mode (so every figure shows in the browser) and the lab's
interactive page.

``docs/conf.py`` calls :func:`prepare` before Sphinx reads the sources; an executed notebook is
reused while it is newer than its source, so a build after ``tests/test_notebooks.py`` (which
hands its executed notebooks over through :func:`adopt`) executes nothing again.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import pkgutil
import tempfile

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = DOCS / "notebooks"
LAB_PAGE = DOCS / "_static" / "lab.html"
LIMIT_S = 600
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
  return EXECUTED / source.name


def is_fresh(source: pathlib.Path) -> bool:
  """Whether an executed copy of ``source`` (papermill's, not a plain copy) is newer than it."""
  out = executed_path(source)
  if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
    return False
  return "papermill" in nbformat.read(str(out), as_version=4).metadata


def adopt(executed: str | pathlib.Path, source: pathlib.Path) -> pathlib.Path:
  """Stores a QUICK-mode run of ``source`` (papermill's output) as its documentation page: the
  injected-parameters cell is hidden (readers see the notebook's own parameters cell)."""
  nb = nbformat.read(str(executed), as_version=4)
  for cell in nb.cells:
    tags = cell.metadata.setdefault("tags", [])
    if "injected-parameters" in tags and "remove-cell" not in tags:
      tags.append("remove-cell")
  EXECUTED.mkdir(parents=True, exist_ok=True)
  out = executed_path(source)
  nbformat.write(nb, str(out))
  return out


def execute(source: pathlib.Path) -> pathlib.Path:
  """Runs ``source`` in QUICK mode under papermill (from the notebooks folder, as a user would)
  and adopts the result."""
  backend = os.environ.get("MPLBACKEND")
  os.environ["MPLBACKEND"] = INLINE_BACKEND  # the kernel inherits it
  try:
    return _execute(source)
  finally:
    if backend is None:
      del os.environ["MPLBACKEND"]
    else:
      os.environ["MPLBACKEND"] = backend


def _execute(source: pathlib.Path) -> pathlib.Path:
  import papermill  # noqa: PLC0415  (only a build that executes needs it)

  with tempfile.TemporaryDirectory() as tmp:
    parameters = {"QUICK": True}
    if "WORKDIR" in papermill.inspect_notebook(str(source)):
      parameters["WORKDIR"] = str(pathlib.Path(tmp) / "run")
    out = pathlib.Path(tmp) / source.name
    papermill.execute_notebook(
      str(source),
      str(out),
      parameters=parameters,
      cwd=str(source.parent),
      kernel_name="python3",
      progress_bar=False,
      execution_timeout=LIMIT_S,
    )
    return adopt(out, source)


def lab_page(path: pathlib.Path = LAB_PAGE) -> pathlib.Path:
  """The lab's interactive page on the quick world (``configs/lab.py:quick``), written once."""
  if path.exists():
    return path
  from configs import lab as lab_config  # noqa: PLC0415
  from kvjax.lab import explorer, suite  # noqa: PLC0415

  config = lab_config.get_config("quick")
  built = suite.validate_config(config)
  data = explorer.explorer_data(config, built)
  path.parent.mkdir(parents=True, exist_ok=True)
  explorer.write_html(data, path)
  return path


def prepare(*, execute_notebooks: bool = True) -> None:
  """Writes the catalogue, and (``execute_notebooks``) the stale notebook pages and the lab
  page; without execution the notebooks render from their sources, without outputs."""
  import catalogue  # noqa: PLC0415  (docs/ is on the path of a build)

  catalogue.write(DOCS / "methods_catalogue.md")
  write_api()
  EXECUTED.mkdir(parents=True, exist_ok=True)
  for source in NOTEBOOKS:
    if execute_notebooks:
      if not is_fresh(source):
        execute(source)
    elif not executed_path(source).exists():
      executed_path(source).write_bytes(source.read_bytes())
  if execute_notebooks:
    lab_page()
