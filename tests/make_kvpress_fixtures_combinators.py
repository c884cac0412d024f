"""Golden fixtures of kvpress 0.5.5's combinators and budget-shaping presses for kvjax tests.

A standalone script, not run by the test suite (kvjax never imports torch). It runs
``PerLayerCompressionPress``, ``ComposedPress``, ``ChunkPress`` and ``BlockPress`` over
SnapKV, KNorm and KeyDiff on the tiny seeded Llama of ``tests/make_kvpress_fixtures.py`` and
writes ``tests/fixtures/kvpress_0_5_5_combinators.npz``: the post-RoPE queries and keys the
layers cached under each attention implementation (``eager_queries_LHTD``, ``eager_keys_LGTD``,
``sdpa_*``; captured by a hook that runs before the press's, identical across the runs of one
implementation) and, per run, the positions kvpress kept (``<run>_keep_LGT``, recovered by
matching the compressed cache's keys to the originals). ChunkPress and BlockPress assert that no
attention weights are given, so they run under sdpa.

Run it in the kvpress venv from the repository root::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_combinators.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_kvpress_fixtures as base  # noqa: E402

OUT = Path(__file__).resolve().parent / "fixtures" / "kvpress_0_5_5_combinators.npz"
RATIO = 0.5
SNAP = {"window_size": 8, "kernel_size": 5}


def capture_hooks(model, store):
  """Forward hooks, registered before the press's, recording each layer's full cache."""
  from kvpress.utils import get_prerope_query_states
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

  def hook(module, args, kwargs, output):
    cache = kwargs["past_key_values"].layers[module.layer_idx]
    q = get_prerope_query_states(module, kwargs["hidden_states"])
    cos, sin = kwargs["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    store[module.layer_idx] = {
      "queries": q.detach().clone()[0].numpy(),
      "keys": cache.keys.detach().clone()[0].numpy(),
      "values": cache.values.detach().clone()[0].numpy(),
    }
    return output

  return [
    layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers
  ]


def kept(cache, store) -> np.ndarray:
  keep = np.zeros((base.LAYERS, base.G, base.T), dtype=bool)
  for layer in range(base.LAYERS):
    orig = torch.from_numpy(store[layer]["keys"])
    comp = cache.layers[layer].keys[0]
    for g in range(base.G):
      eq = (comp[g][:, None, :] == orig[g][None, :, :]).all(-1)
      assert (eq.sum(-1) == 1).all(), "a compressed key matches no unique original key"
      keep[layer, g, eq.float().argmax(-1).numpy()] = True
      assert keep[layer, g].sum() == comp.shape[1]
  return keep


def run(model, input_ids, press, attn):
  from transformers import DynamicCache

  model.set_attn_implementation(attn)
  store: dict = {}
  hooks = capture_hooks(model, store)
  try:
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
      model(input_ids, past_key_values=cache, use_cache=True)
  finally:
    for h in hooks:
      h.remove()
  return kept(cache, store), store


def main() -> int:
  base._setup_determinism()
  from kvpress import (
    BlockPress,
    ChunkPress,
    ComposedPress,
    KeyDiffPress,
    KnormPress,
    PerLayerCompressionPress,
    SnapKVPress,
  )

  model = base.build_model()
  input_ids = base.make_prompt()
  runs = {
    # name: (press, attention implementation, description)
    "per_layer_snapkv": (
      PerLayerCompressionPress(SnapKVPress(**SNAP), compression_ratios=[0.25, 0.75]),
      "eager",
      "PerLayerCompressionPress(SnapKVPress(window 8, kernel 5), [0.25, 0.75])",
    ),
    "per_layer_knorm": (
      PerLayerCompressionPress(KnormPress(), compression_ratios=[0.75, 0.5]),
      "eager",
      "PerLayerCompressionPress(KnormPress(), [0.75, 0.5])",
    ),
    "composed_snapkv_knorm": (
      ComposedPress([SnapKVPress(RATIO, **SNAP), KnormPress(RATIO)]),
      "eager",
      "ComposedPress([SnapKVPress(0.5, window 8, kernel 5), KnormPress(0.5)])",
    ),
    "composed_snapkv_keydiff": (
      ComposedPress([SnapKVPress(RATIO, **SNAP), KeyDiffPress(0.25)]),
      "eager",
      "ComposedPress([SnapKVPress(0.5, window 8, kernel 5), KeyDiffPress(0.25)])",
    ),
    "composed_knorm_keydiff": (
      ComposedPress([KnormPress(RATIO), KeyDiffPress(RATIO)]),
      "eager",
      "ComposedPress([KnormPress(0.5), KeyDiffPress(0.5)])",
    ),
    "chunk10_knorm": (
      ChunkPress(KnormPress(RATIO), chunk_length=10),
      "sdpa",
      "ChunkPress(KnormPress(0.5), chunk_length=10)",
    ),
    "chunk10_keydiff": (
      ChunkPress(KeyDiffPress(RATIO), chunk_length=10),
      "sdpa",
      "ChunkPress(KeyDiffPress(0.5), chunk_length=10)",
    ),
    "chunk16_keydiff": (
      ChunkPress(KeyDiffPress(RATIO), chunk_length=16),
      "sdpa",
      "ChunkPress(KeyDiffPress(0.5), chunk_length=16)",
    ),
    "block8_keydiff": (
      BlockPress(KeyDiffPress(RATIO), block_size=8),
      "sdpa",
      "BlockPress(KeyDiffPress(0.5), block_size=8)",
    ),
    "block5_keydiff": (
      BlockPress(KeyDiffPress(RATIO), block_size=5),
      "sdpa",
      "BlockPress(KeyDiffPress(0.5), block_size=5)",
    ),
    "block8_knorm": (
      BlockPress(KnormPress(RATIO), block_size=8),
      "sdpa",
      "BlockPress(KnormPress(0.5), block_size=8)",
    ),
  }
  arrays: dict[str, np.ndarray] = {}
  meta: dict = {
    "generator": "tests/make_kvpress_fixtures_combinators.py",
    "model": "the tiny Llama of tests/make_kvpress_fixtures.py (its build_model, make_prompt)",
    "versions": {"kvpress": base._dist_version("kvpress"), "torch": torch.__version__},
    "runs": {},
  }
  for name, (press, attn, desc) in runs.items():
    keep, store = run(model, input_ids, press, attn)
    arrays[f"{name}_keep_LGT"] = keep
    for key, suffix in (("queries", "LHTD"), ("keys", "LGTD")):
      value = np.stack([store[i][key] for i in range(base.LAYERS)]).astype(np.float32)
      field = f"{attn}_{key}_{suffix}"
      if field in arrays:  # every run of one attention implementation saw the same inputs
        np.testing.assert_array_equal(arrays[field], value, err_msg=name)
      arrays[field] = value
    meta["runs"][name] = {
      "press": desc,
      "attn_implementation": attn,
      "kept_per_head_LG": keep.sum(-1).tolist(),
    }
  arrays["meta_json"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
  for name, entry in meta["runs"].items():
    print(name, entry["kept_per_head_LG"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
