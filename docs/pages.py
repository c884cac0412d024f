"""The generated parts of the documentation: the methods catalogue, the notebooks executed in
QUICK mode (so every figure shows in the browser) and the lab's interactive page.

``docs/conf.py`` calls :func:`prepare` before Sphinx reads the sources; an executed notebook is
reused while it is newer than its source, so a build after ``tests/test_notebooks.py`` (which
hands its executed notebooks over through :func:`adopt`) executes nothing again.
"""

from __future__ import annotations

import os
import pathlib
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
  EXECUTED.mkdir(parents=True, exist_ok=True)
  for source in NOTEBOOKS:
    if execute_notebooks:
      if not is_fresh(source):
        execute(source)
    elif not executed_path(source).exists():
      executed_path(source).write_bytes(source.read_bytes())
  if execute_notebooks:
    lab_page()
