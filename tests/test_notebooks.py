"""Every notebook runs top to bottom in QUICK mode under plain papermill (as users run it, from the
notebooks folder; with KVJAX_FULL=1 also by nbclient from the repository root, with
papermill-style parameter injection) and matches its jupytext twin; Colab essentials are
present; the documentation's stored run of each is a clean run of its current code. (The
documentation's build is tested in ``tests/test_site.py``.)"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "docs"))
import pages  # noqa: E402  (docs/pages.py)

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LIMIT_S = 120  # the contract: each notebook under two minutes on a 2-core CPU
COLAB_CPU_WARNING = "Runtime > Change runtime type > TPU/GPU"


def _cells(nb):
  return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def test_there_are_five_notebooks_each_with_a_twin():
  assert len(NOTEBOOKS) == 5
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_language_info_and_kernelspec_survive_jupytext(path):
  """papermill reads the language from ``language_info`` (or the kernelspec) and starts the
  kernelspec's kernel; both must be in the .ipynb and come back from the .py twin, so that a
  ``jupytext --sync`` keeps them."""
  for nb in (nbformat.read(path, as_version=4), jupytext.read(path.with_suffix(".py"))):
    assert nb.metadata["language_info"]["name"] == "python", path.name
    assert nb.metadata["kernelspec"]["name"] == "python3", path.name
    assert nb.metadata["kernelspec"]["language"] == "python", path.name
  nbformat.validate(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_clones_the_repository_for_its_configs(path):
  """``configs/`` is no part of the wheel: on Colab the install cell clones the repository and
  works from there; the device cell moves from ``notebooks/`` to the repository root."""
  nb = nbformat.read(path, as_version=4)
  install = next(c for c in nb.cells if "skip-execution" in c.metadata.get("tags", ()))
  assert "git clone" in install.source and "%cd " in install.source, path.name
  assert "pip install -q -e ." in install.source, path.name
  device = _device_cell(nb)
  assert 'os.chdir("..")' in device.source, path.name


def _device_cell(nb):
  return next(c for c in nb.cells if c.cell_type == "code" and "jax.devices()" in c.source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_gpu_tpu_preset_and_hugging_face_login(path):
  """A ``PRESET`` parameter (``"auto"``: ``"full"`` on a GPU / TPU), forced to ``"quick"`` in
  QUICK mode; notebooks that load a model say how to log in for gated ones."""
  nb = nbformat.read(path, as_version=4)
  params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", ()))
  assert 'PRESET = "auto"' in params.source, path.name
  preset = [c for c in nb.cells if c.cell_type == "code" and 'PRESET = "full"' in c.source]
  assert len(preset) == 1, path.name
  assert 'jax.default_backend() != "cpu"' in preset[0].source, path.name
  assert 'if QUICK:\n  PRESET = "quick"' in preset[0].source, path.name
  if "MODEL" in params.source:
    notes = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "HF_TOKEN" in notes and "huggingface_hub import login" in notes, path.name


_DEVICE_PROBE = """
import contextlib, io, json, os, sys, types
out = {}
for name, source in json.loads(sys.stdin.read()).items():
  for colab in ("none", "env", "module"):
    for key in [k for k in os.environ if k.startswith("COLAB_")]:
      del os.environ[key]
    sys.modules.pop("google.colab", None)
    if colab == "env":
      os.environ["COLAB_RELEASE_TAG"] = "test"
    elif colab == "module":
      sys.modules["google.colab"] = types.ModuleType("google.colab")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      exec(source, {})
    out[f"{name}/{colab}"] = printed.getvalue()
print(json.dumps(out))
"""


def test_device_cell_warns_on_cpu_under_colab():
  """Each device cell, run on the CPU: silent outside Colab; a printed warning (not an error)
  naming Colab's runtime menu when ``COLAB_*`` variables are set or ``google.colab`` is
  imported."""
  cells = {p.stem: _device_cell(nbformat.read(p, as_version=4)).source for p in NOTEBOOKS}
  for name, source in cells.items():
    assert COLAB_CPU_WARNING in source, name
  env = {k: v for k, v in os.environ.items() if not k.startswith("COLAB_")}
  env["JAX_PLATFORMS"] = "cpu"
  probe = subprocess.run(
    [sys.executable, "-c", _DEVICE_PROBE],
    input=json.dumps(cells),
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=120,
    check=True,
  )
  printed = json.loads(probe.stdout.strip().splitlines()[-1])
  for name in cells:
    assert "backend: cpu" in printed[f"{name}/none"], name
    assert COLAB_CPU_WARNING not in printed[f"{name}/none"], name
    assert COLAB_CPU_WARNING in printed[f"{name}/env"], name
    assert COLAB_CPU_WARNING in printed[f"{name}/module"], name


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """One persistent compilation cache for the module's kernels, empty at first: each notebook's
  first run is timed cold (with KVJAX_FULL=1 the papermill runs reuse what the nbclient runs
  compiled)."""
  return tmp_path_factory.mktemp("jax_cache")


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


@pytest.mark.slow  # CI runs each notebook once, under papermill (below)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_quick_mode(path, tmp_path, monkeypatch, jax_cache):
  """nbclient, from the repository root, with papermill-style parameter injection."""
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_cache))
  nb = _quick(nbformat.read(path, as_version=4), tmp_path / "run")
  client = nbclient.NotebookClient(
    nb, timeout=LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  start = time.time()
  client.execute()  # raises CellExecutionError naming the failing cell
  elapsed = time.time() - start
  assert elapsed < LIMIT_S, f"{path.name} took {elapsed:.0f}s in QUICK mode"


# CI runs notebook 5 under KVJAX_FULL=1 only: its search is the allocation-search tests' own
PAPERMILL = [
  pytest.param(p, marks=pytest.mark.slow) if p.stem.startswith("05_") else p for p in NOTEBOOKS
]


@pytest.mark.parametrize("path", PAPERMILL, ids=lambda p: p.stem)
def test_papermill_runs_it_from_the_notebooks_folder(path, tmp_path, monkeypatch, jax_cache):
  """Plain papermill (``papermill X.ipynb out.ipynb -p QUICK True``, as Jupyter would, with the
  notebook's folder as the working directory; the run above starts from the repository root):
  the language comes from the metadata, the install cell is skipped, parameters are injected."""
  papermill = pytest.importorskip("papermill")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_cache))
  inferred = papermill.inspect_notebook(str(path))  # what `papermill --help-notebook` lists
  assert "QUICK" in inferred and "PRESET" in inferred, path.name
  parameters = {"QUICK": True}
  if "WORKDIR" in inferred:
    parameters["WORKDIR"] = str(tmp_path / "run")
  start = time.time()
  out = papermill.execute_notebook(
    str(path),
    str(tmp_path / path.name),
    parameters=parameters,
    cwd=str(path.parent),
    kernel_name="python3",
    progress_bar=False,
    execution_timeout=LIMIT_S,
  )  # raises PapermillExecutionError naming the failing cell
  elapsed = time.time() - start
  assert elapsed < LIMIT_S, f"{path.name} took {elapsed:.0f}s under papermill"
  tags = [tuple(c.metadata.get("tags", ())) for c in out.cells]
  injected = tags.index(("injected-parameters",))
  assert "parameters" in tags[injected - 1], path.name
  install = next(c for c, t in zip(out.cells, tags, strict=True) if "skip-execution" in t)
  assert install.execution_count is None and not install.outputs, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_documentation_shows_a_clean_run_of_the_current_code(path):
  """``docs/notebooks/`` holds each notebook's stored run (``python docs/pages.py notebooks
  NAME`` refreshes one): the same code cells, every cell run, a figure, the run's command,
  machine and date, and none of the noise :func:`pages.clean` strips."""
  stored_path = pages.executed_path(path)
  assert stored_path.exists(), f"no stored run: python docs/pages.py notebooks {path.stem}"
  stored = nbformat.read(stored_path, as_version=4)
  assert pages.code_sources(stored) == pages.code_sources(nbformat.read(path, as_version=4)), (
    f"{path.name} changed since its stored run: python docs/pages.py notebooks {path.stem}"
  )
  assert "papermill" in stored.metadata, path.name
  assert set(stored.metadata["kvjax_run"]) >= {"command", "machine", "date"}, path.name
  code = [c for c in stored.cells if c.cell_type == "code"]
  ran = [c for c in code if "skip-execution" not in c.metadata.get("tags", ())]
  assert all(c.execution_count is not None for c in ran), path.name
  outputs = [o for c in code for o in c.outputs]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure"
  assert not [o for o in outputs if o.output_type == "error"], path.name
  text = json.dumps([o for o in outputs if "image/png" not in o.get("data", {})])
  for noise in ("TqdmWarning", "!!python/tuple", "Unable to initialize backend", str(ROOT)):
    assert noise not in text, f"{path.name}: {noise!r} in its stored run"
