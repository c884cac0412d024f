"""Test configuration: strict broadcasting catches accidental [L, H] vs [L, H, T] broadcasts."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("MPLBACKEND", "Agg")  # headless figures in tests and the notebooks they run

# Tests check values, not speed: XLA's CPU backend compiles the suite's thousands of small
# programs faster at LLVM optimisation level 0 (measured on 2 cores: the whole suite 19m11s ->
# 14m22s, every test passing) and with its older LLVM fusion emitters instead of the MLIR ones
# (tests/test_streaming.py and test_cache.py: 98 s -> 73 s, user time 115 s -> 73 s; a run from a
# warm compilation cache takes 66 s, so the MLIR pipeline was most of the compile time). The
# subprocesses tests start inherit them (forced_devices_env keeps them); benchmarks and
# experiments never read this file. KVJAX_TEST_XLA_DEFAULT=1 keeps XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if os.environ.get("KVJAX_TEST_XLA_DEFAULT", "0") != "1":
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent compilation cache for the run, which the subprocesses that tests start (entry
# points, resumed sweeps, notebooks) inherit: they compile the programs the in-process tests
# already compiled, and the module-scoped jax.clear_caches() below would otherwise recompile
# them too. From an empty cache it cut tests/test_sweep.py from 3m39s to 2m22s of CPU time.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="kvjax-tests-jax-cache-")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def forced_devices_env(count: int = 8) -> dict:
  """The environment of a subprocess that sees ``count`` forced host devices (this run's other
  XLA flags kept)."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
  return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")


import gc  # noqa: E402

import pytest  # noqa: E402

from kvjax import model as km  # noqa: E402

# CI runs the quick mode; KVJAX_FULL=1 also runs the tests marked ``@pytest.mark.slow``
FULL = os.environ.get("KVJAX_FULL", "0") == "1"
SLOW_REASON = "slow: runs with KVJAX_FULL=1"


def pytest_collection_modifyitems(config, items):
  """Skips the tests marked ``slow`` unless ``KVJAX_FULL=1``: the one place that reads the mark."""
  if FULL:
    return
  skip = pytest.mark.skip(reason=SLOW_REASON)
  for item in items:
    if item.get_closest_marker("slow") is not None:
      item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Spreads the run over every core, one test file per worker (``-n auto --dist loadfile``),
  where pytest-xdist is loaded and the command line chose no distribution itself; ``-p no:xdist``
  runs in one process. (In ``addopts`` these options would be unknown without the plugin.)"""
  if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
    return  # no plugin, or an xdist worker (which must not start workers of its own)
  option = config.option
  if option.numprocesses is None and not option.tx and option.dist == "no":
    option.numprocesses = "auto"
    option.dist = "loadfile"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Frees each module's compiled XLA programs: the whole suite compiles thousands of them, and
  keeping them all mapped made XLA's CPU compiler crash late in the run."""
  yield
  jax.clear_caches()
  gc.collect()


# the five Llama-family checkpoints of tests/hf_models.py, one module-scoped model each
FAMILY_NAMES = (
  "llama3_gqa_untied",
  "llama_mha_tied",
  "mistral_gqa",
  "qwen2_bias_tied",
  "qwen3_qknorm",
)


# the families that the per-policy decoding matrices run on in CI's quick mode (GQA with llama3
# RoPE scaling and untied embeddings; QK-norm); KVJAX_FULL=1 runs every family. The logits parity
# and cache tests run on all five either way.
QUICK_FAMILIES = ("llama3_gqa_untied", "qwen3_qknorm")


def family_params(quick: tuple[str, ...] = QUICK_FAMILIES) -> list:
  """The :func:`family` fixture's names for ``parametrize("family", ..., indirect=True)``: the
  families outside ``quick`` marked slow."""
  return [
    pytest.param(name, marks=() if name in quick else pytest.mark.slow) for name in FAMILY_NAMES
  ]


def family_rows(values) -> list:
  """``(family, value)`` params of a family-by-value matrix, for ``parametrize(("family", ...),
  ..., indirect=["family"])``: row ``i`` runs in quick mode on ``QUICK_FAMILIES[i % 2]`` only, so
  every value and every quick family stays covered at half the cost; the other pairs are slow."""
  rows = []
  for name in FAMILY_NAMES:  # family by family: each loads once
    for i, value in enumerate(values):
      quick = name == QUICK_FAMILIES[i % len(QUICK_FAMILIES)]
      rows.append(pytest.param(name, value, marks=() if quick else pytest.mark.slow))
  return rows


def quick_families_only(name: str) -> None:
  """Skips a family-by-policy check outside :data:`QUICK_FAMILIES` in quick mode, for a test that
  takes the :func:`family` fixture's own params (``family_params()`` marks them instead)."""
  if not FULL and name not in QUICK_FAMILIES:
    pytest.skip(f"{name}: {SLOW_REASON} (quick mode runs {QUICK_FAMILIES})")


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request, tmp_path_factory):
  """``(name, transformers model, kvjax model, config)`` of one tiny checkpoint family."""
  hf_models = pytest.importorskip("hf_models")  # needs torch and transformers
  hf, path = hf_models.make_checkpoint(tmp_path_factory, request.param)
  model, cfg = km.load(path)
  return request.param, hf, model, cfg
