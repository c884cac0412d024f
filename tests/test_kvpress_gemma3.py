"""kvpress 0.5.5 on a tiny random Gemma 3 against kvjax's default for models whose layers differ:
the global layers' kept sets equal kvpress's, and the sliding layers are left alone on both sides
(tests/make_kvpress_fixtures_gemma3.py records kvpress's)."""

from pathlib import Path

import numpy as np
import pytest

from kvjax import model as km

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def golden():
  z = np.load(FIXTURES / "kvpress_0_5_5_gemma3.npz")
  model, cfg = km.load(FIXTURES / "kvpress_tiny_gemma3")
  return z, model, cfg


@pytest.mark.parametrize(
  ("name", "policy", "options"),
  [("snapkv", "snapkv_kvpress", dict(window=4)), ("knorm", "knorm", {})],
)
def test_global_layers_keep_what_kvpress_keeps(golden, name, policy, options):
  z, model, cfg = golden
  ids = z["input_ids_T"][None]
  T = ids.shape[1]
  mask = km.keep_mask(model, ids, policy, int(T * 0.5), num_kv_heads=cfg.num_kv_heads, **options)[
    :, 0
  ]  # [L, G, T]
  sliding = km.llama.is_sliding(cfg)
  assert sliding.tolist() == [True, False, True, False, True]
  np.testing.assert_array_equal(mask[~sliding], z[f"{name}_keep_LGT"][~sliding])
  # the sliding layers: kvpress leaves transformers' window cache (7 tokens) as it is; kvjax
  # keeps the same last sliding_window - 1 tokens
  assert (z[f"{name}_sliding_len_L"][sliding] == z["plain_len_L"][sliding]).all()
  for layer in np.flatnonzero(sliding):
    for g in range(cfg.num_kv_heads):
      np.testing.assert_array_equal(np.flatnonzero(mask[layer, g]), np.arange(T - 7, T))
