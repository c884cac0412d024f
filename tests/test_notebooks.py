"""Every notebook runs top to bottom in QUICK mode (papermill-style parameter injection, nbclient)
and matches its jupytext twin; Colab essentials are present."""

import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LIMIT_S = 120  # the contract: each notebook under two minutes on a 2-core CPU


def _cells(nb):
  return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def test_there_are_four_notebooks_each_with_a_twin():
  assert len(NOTEBOOKS) == 4
  for path in NOTEBOOKS:
    assert path.with_suffix(".py").exists(), path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_jupytext_twin_matches_and_outputs_are_stripped(path):
  nb = jupytext.read(path)
  twin = jupytext.read(path.with_suffix(".py"))
  assert _cells(nb) == _cells(twin), f"{path.name} and its .py twin differ: run jupytext --sync"
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.get("outputs") and cell.get("execution_count") is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_colab_badge_install_device_and_parameters_cells(path):
  nb = nbformat.read(path, as_version=4)
  assert "colab.research.google.com" in nb.cells[0].source
  assert nb.metadata.get("accelerator") == "TPU"
  tags = [tuple(c.metadata.get("tags", ())) for c in nb.cells]
  install = next(c for c, t in zip(nb.cells, tags, strict=False) if "skip-execution" in t)
  assert "pip install" in install.source
  assert any("jax.devices()" in c.source for c in nb.cells)
  params = [c for c, t in zip(nb.cells, tags, strict=False) if "parameters" in t]
  assert len(params) == 1 and "QUICK" in params[0].source


def _quick(nb, workdir):
  """Drops the install cells and injects ``QUICK = True`` (and a fresh ``WORKDIR`` where the
  notebook has one) after the parameters cell."""
  cells = []
  for cell in nb.cells:
    tags = cell.metadata.get("tags", ())
    if "skip-execution" in tags:
      continue
    cells.append(cell)
    if "parameters" in tags:
      source = "QUICK = True"
      if "WORKDIR" in cell.source:
        source += f"\nWORKDIR = {str(workdir)!r}"
      cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": ["injected"]}))
  nb.cells = cells
  return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_quick_mode(path, tmp_path, monkeypatch):
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = _quick(nbformat.read(path, as_version=4), tmp_path / "run")
  client = nbclient.NotebookClient(
    nb, timeout=LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  start = time.time()
  client.execute()  # raises CellExecutionError naming the failing cell
  elapsed = time.time() - start
  assert elapsed < LIMIT_S, f"{path.name} took {elapsed:.0f}s in QUICK mode"
