"""Sliding and global layers in the compressed cache (Gemma 2/3): by default a sliding layer keeps
its window's most recent tokens, as kvpress skips it, and the policy (scores, budgets, PyramidKV's
schedule) runs over the global layers alone; ``Layout(compress_sliding=True)`` compresses every
layer alike."""

import pathlib
import tempfile

import numpy as np
import pytest
from hf_models import prompt, tiny_family

from kvjax import model as km
from kvjax import policies

S, F = "sliding_attention", "full_attention"
TYPES = [S, F, S, F, S]


@pytest.fixture(scope="module")
def gemma3():
  hf = tiny_family("gemma3", num_hidden_layers=5, layer_types=TYPES)
  path = pathlib.Path(tempfile.mkdtemp())
  hf.save_pretrained(path)
  model, cfg = km.load(path)
  assert cfg.sliding_window == 8 and tuple(cfg.layer_types) == tuple(TYPES)
  return model, cfg


def _mask(model, ids, policy, budget, *, sliding=False, attention_mask=None, **options):
  """The compressed cache's positions and validity ``[L, B, G, C]`` of a left-padded batch."""
  pol = policies.make(policy, num_kv_heads=model.cfg.num_kv_heads, **options)
  mask = np.ones_like(ids) if attention_mask is None else attention_mask
  ids, mask = km.decoding.to_left_padding(ids, mask)
  request = pol.evidence_request(ids.shape[1])
  pre = km.decoding.jit_prefill(model.cfg, model.params(), ids, mask, request)
  spec = km.cache.CacheSpec(pol, ids.shape[1], "kv", compress_sliding=sliding)
  cache = km.cache.compress(model.cfg, pre, spec, budget)
  return np.asarray(cache.positions), np.asarray(cache.valid)


def _kept(positions, valid, l, b, h):
  return np.sort(positions[l, b, h][valid[l, b, h]])


def test_sliding_layers_keep_their_window_and_global_layers_the_policys_choice(gemma3):
  model, cfg = gemma3
  ids = prompt(T=40, B=2, seed=3)
  mask = np.ones_like(ids)
  mask[1, :10] = 0  # row 1: 30 real tokens, left-padded after to_left_padding
  pos, valid = _mask(model, ids, "snapkv", 12, window=4, attention_mask=mask)
  all_pos, all_valid = _mask(model, ids, "snapkv", 12, window=4, attention_mask=mask, sliding=True)
  sliding = km.llama.is_sliding(cfg)
  for b, n in ((0, 40), (1, 30)):
    for h in range(cfg.num_kv_heads):
      for l in range(cfg.num_layers):
        got = _kept(pos, valid, l, b, h)
        if sliding[l]:  # the (real) tokens the next one attends to: the window's last 7
          np.testing.assert_array_equal(got, np.arange(n - 7, n))
        else:  # SnapKV selects per layer: the same as when every layer is compressed
          np.testing.assert_array_equal(got, _kept(all_pos, all_valid, l, b, h))
          assert len(got) == 12
  # compressing every layer: the sliding layers hold the policy's 12, not their window's 7
  assert all_valid[sliding].sum(-1).max() == 12


def test_pyramidkv_schedules_the_global_layers_only(gemma3):
  model, cfg = gemma3
  ids = prompt(T=40, B=1, seed=4)
  sliding = km.llama.is_sliding(cfg)
  _, valid = _mask(model, ids, "pyramidkv", 12, window=4)
  _, every = _mask(model, ids, "pyramidkv", 12, window=4, sliding=True)
  glob = valid[~sliding, 0].sum(-1)  # [2 global layers, G]
  # the schedule's total over the global layers is theirs: 12 per layer and head on average
  assert glob.sum() == 12 * glob.size
  assert (glob[0] > glob[1]).all()  # a pyramid: the lower global layer holds more
  # over all five layers the same two layers get other budgets
  assert (every[~sliding, 0].sum(-1) != glob).any()


def test_generation_reports_sliding_and_global_memory(gemma3):
  model, cfg = gemma3
  ids = prompt(T=40, B=1, seed=5)
  out = km.generate(model, ids, policy="snapkv", budget=12, window=4, max_new_tokens=4)
  mem = out.memory
  assert mem["kv_bytes_held_sliding"] + mem["kv_bytes_held_global"] == mem["kv_bytes_held"]
  slot = 2 * cfg.head_dim * 4 * cfg.num_kv_heads  # fp32 K and V of one token, all KV heads
  n_sliding, n_global = 3, 2
  # 3 generated tokens are fed after the prompt (the 4th is sampled last)
  assert mem["kv_bytes_held_sliding"] == n_sliding * (7 + 3) * slot
  assert mem["kv_bytes_held_global"] == n_global * (12 + 3) * slot
  with pytest.raises(ValueError, match="compress_sliding: expected a bool"):
    km.cache.Layout(compress_sliding="yes")
