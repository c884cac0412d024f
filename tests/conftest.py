"""Test configuration: strict broadcasting catches accidental [L, H] vs [L, H, T] broadcasts."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("MPLBACKEND", "Agg")  # headless figures in tests and the notebooks they run

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def full_mode() -> bool:
  """Heavy checks run only with KVJAX_FULL=1 (CI runs the quick mode)."""
  return os.environ.get("KVJAX_FULL", "0") == "1"


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Frees each module's compiled XLA programs: the whole suite compiles thousands of them, and
  keeping them all mapped made XLA's CPU compiler crash late in the run."""
  yield
  jax.clear_caches()
  gc.collect()
