"""Every compiled entry point lowers for TPU and CUDA on this CPU (kvjax.eval.export_check):
abstract Llama-3.1-8B-shaped arguments in bf16 at 32k tokens; a host callback put into the
decode step fails, naming the entry point and the platform."""

import jax
import numpy as np
import pytest

from kvjax.eval import export_check
from kvjax.model import cache as cache_lib

# the 8B layer shapes over 2 layers in the quick run: the layers are a scan, so lowering 2 checks
# what lowering 32 does (the full matrix, 32 layers at batch 1 and 8, is marked slow)
QUICK = (
  "prefill:window_rows",
  "prefill:query_stats",
  "compress:adakv_snapkv",
  "compress:think",
  "decode_step:stacked",
  "decode_step:per_layer",
  "generate:snapkv",
  "answers:h2o",
  "select:compact",
  "ragged_decode",
  "decode_step:paged",
  "lab:sweep_metrics",
)


def test_quick_entry_points_lower_for_tpu_and_cuda():
  results = export_check.check(QUICK, num_layers=2, batches=(8,))
  assert len(results) == 2 * len(QUICK)
  assert not export_check.failures(results), export_check.failures(results)
  assert jax.default_backend() == "cpu"  # the backend answer is restored
  text = export_check.table(results)
  assert "| ragged_decode | ok | ok |" in text
  assert "| decode_step:paged | ok | ok |" in text


@pytest.mark.slow
def test_every_entry_point_lowers_at_8b():
  results = export_check.check()
  assert {r.entry for r in results} == set(export_check.ENTRY_POINTS)
  assert not export_check.failures(results), export_check.failures(results)


def test_host_callback_in_decode_step_fails(monkeypatch):
  step = cache_lib.decode_step

  def with_callback(*args, **kwargs):
    logits, cache = step(*args, **kwargs)
    host = jax.pure_callback(np.negative, jax.ShapeDtypeStruct(logits.shape, logits.dtype), logits)
    return logits + host, cache

  monkeypatch.setattr(cache_lib, "decode_step", with_callback)
  results = export_check.check(["decode_step:stacked"], num_layers=2, batches=(1,))
  assert [r.ok for r in results] == [False, False]
  lines = export_check.failures(results)
  assert lines[0].startswith("decode_step:stacked on tpu")
  assert lines[1].startswith("decode_step:stacked on cuda")
  # jax refuses a host callback lowered for a platform the host lacks
  assert all("lowering platform" in line for line in lines)


def test_bad_input():
  with pytest.raises(ValueError, match="platforms: 'metal'"):
    export_check.check(["select:compact"], platforms=("metal",))
  with pytest.raises(ValueError, match="entries: unknown"):
    export_check.check(["prefil"])
  with pytest.raises(ValueError, match="batch"):
    export_check.Shapes(export_check.llama31_8b(2), 0)
