"""Generate golden fixtures for kvpress 0.5.5's leverage, non-causal attention, Compactor and CUR
presses (kvjax ``LeverageScore``, ``NonCausalAttention``, ``Compactor``, ``CurDKV``).

A standalone script, NOT run by the test suite (kvjax never imports torch). It runs the presses
on the tiny random Llama checkpoint ``tests/fixtures/kvpress_tiny_llama`` (eager attention) with
the prompt ``input_ids_T`` of ``tests/fixtures/kvpress_0_5_5.npz`` and writes
``tests/fixtures/kvpress_0_5_5_linalg.npz``. Run it from the repository root in the kvpress venv
(torch 2.13.0+cpu, transformers 5.2.0, kvpress 0.5.5)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_linalg.py

Randomness: ``LeverageScorePress`` draws its Gaussian sketch and ``CURPress`` (with
``use_random_leverage``) its projection with ``torch.randn`` inside ``score``. The script wraps
``torch.randn`` to record every draw (the raw N(0, 1) values, before kvpress's ``1/sqrt(k)``
scaling); kvjax takes them as ``evidence.sketch_LGDK``.

What it records (L layers, Hq query heads, G kv heads, T tokens, D head dim):

* ``prerope_keys_LGTD``: ``get_prerope_key_states(module, hidden_states)`` (leverage's input);
* ``queries_LHTD``: the post-RoPE queries (``get_prerope_query_states`` then RoPE, as
  ``NonCausalAttnPress.score`` forms them); ``keys_LGTD`` / ``values_LGTD``: the cache's;
* ``<name>_scores_LGT``: ``press.score(...)``'s output; ``<name>_keep_LGT``: the positions kvpress
  kept at compression_ratio 0.5 (recovered from the compressed cache);
* ``<name>_sketch_LGDK``: the recorded draws (leverage: ``[L, G, D, k]``; CUR: ``[L, 1, D, 20]``);
* ``meta_json``: every press's class and arguments, and the smallest top-k margin.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
PROMPT = HERE / "fixtures" / "kvpress_0_5_5.npz"
OUT = HERE / "fixtures" / "kvpress_0_5_5_linalg.npz"
RATIO = 0.5
SEED = 11


def presses():
  from kvpress import CompactorPress, CURPress, LeverageScorePress, NonCausalAttnPress

  r = {"compression_ratio": RATIO}
  return [
    ("leverage", LeverageScorePress, r),
    ("leverage_k8", LeverageScorePress, {**r, "sketch_dimension": 8}),
    ("noncausal", NonCausalAttnPress, r),
    ("noncausal_c16", NonCausalAttnPress, {**r, "chunk_size": 16}),
    ("noncausal_c20", NonCausalAttnPress, {**r, "chunk_size": 20}),
    ("compactor", CompactorPress, r),
    ("compactor_c16_b03", CompactorPress, {**r, "chunk_size": 16, "blending": 0.3}),
    ("cur", CURPress, r),
    ("cur_key", CURPress, {**r, "leverage_type": "key"}),
    ("cur_value", CURPress, {**r, "leverage_type": "value"}),
    ("cur_kv_avg", CURPress, {**r, "leverage_type": "kv_avg"}),
    ("cur_global", CURPress, {**r, "use_local_approximation": False}),
    ("cur_w10", CURPress, {**r, "local_window_size": 10, "num_sinks": 2}),
    ("cur_random", CURPress, {**r, "use_random_leverage": True}),
  ]


def run(model, input_ids, press):
  """Runs the press, recording per layer its score, its inputs and every ``torch.randn`` draw."""
  from kvpress.utils import get_prerope_key_states, get_prerope_query_states
  from transformers import DynamicCache
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

  rec = {"scores": {}, "inputs": {}, "draws": []}
  orig_score, orig_randn = press.score, torch.randn

  def randn(*args, **kwargs):
    out = orig_randn(*args, **kwargs)
    rec["draws"].append(out.detach().clone())
    return out

  def score(module, hidden_states, keys, values, attentions, kwargs):
    out = orig_score(module, hidden_states, keys, values, attentions, kwargs)
    layer = module.layer_idx
    rec["scores"][layer] = out.detach().clone()[0]
    q = get_prerope_query_states(module, hidden_states)
    cos, sin = kwargs["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    rec["inputs"][layer] = {
      "prerope_keys": get_prerope_key_states(module, hidden_states).detach().clone()[0],
      "queries": q.detach().clone()[0],
      "keys": keys.detach().clone()[0],
      "values": values.detach().clone()[0],
    }
    return out

  press.score = score
  torch.randn = randn
  try:
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
      model(input_ids, past_key_values=cache, use_cache=True)
  finally:
    torch.randn = orig_randn
  return cache, rec


def kept_from_cache(cache, rec, L, G, T) -> np.ndarray:
  keep = np.zeros((L, G, T), dtype=bool)
  for layer in range(L):
    orig = rec["inputs"][layer]["keys"]
    comp = cache.layers[layer].keys[0]
    for g in range(G):
      eq = (comp[g][:, None, :] == orig[g][None, :, :]).all(-1)
      assert (eq.sum(-1) == 1).all(), "compressed key does not match a unique original key"
      keep[layer, g, eq.float().argmax(-1).numpy()] = True
  return keep


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(SEED)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import kvpress
  import transformers
  from kvpress.utils import compute_n_kept
  from transformers import LlamaForCausalLM

  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("eager")
  ids = np.load(PROMPT)["input_ids_T"]
  input_ids = torch.from_numpy(ids.astype(np.int64))[None]
  cfg = model.config
  L, G, T = cfg.num_hidden_layers, cfg.num_key_value_heads, input_ids.shape[1]
  n_kept = compute_n_kept(T, RATIO)
  arrays: dict[str, np.ndarray] = {"input_ids_T": ids}
  meta = {
    "generator": "tests/make_kvpress_fixtures_linalg.py",
    "versions": {
      "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (eager attention)",
    "prompt": "input_ids_T (from tests/fixtures/kvpress_0_5_5.npz)",
    "n_kept": n_kept,
    "presses": {},
  }
  inputs = None
  for name, cls, kw in presses():
    press = cls(**kw)
    cache, rec = run(model, input_ids, press)
    keep = kept_from_cache(cache, rec, L, G, T)
    scores = np.stack([rec["scores"][i].float().numpy() for i in range(L)])
    top = np.zeros_like(keep)
    for i in range(L):
      idx = torch.from_numpy(scores[i]).topk(n_kept, dim=-1).indices.numpy()
      for g in range(G):
        top[i, g, idx[g]] = True
    assert (top == keep).all(), name
    margins = [
      float(scores[i, g][keep[i, g]].min() - scores[i, g][~keep[i, g]].max())
      for i in range(L)
      for g in range(G)
    ]
    if inputs is None:
      inputs = rec["inputs"]
      for key in ("prerope_keys", "queries", "keys", "values"):
        suffix = "_LHTD" if key == "queries" else "_LGTD"
        arrays[key + suffix] = np.stack([inputs[i][key].numpy() for i in range(L)])
    else:
      for i in range(L):
        for key, value in rec["inputs"][i].items():
          assert torch.equal(value, inputs[i][key]), (name, key)
    arrays[f"{name}_scores_LGT"] = scores.astype(np.float32)
    arrays[f"{name}_keep_LGT"] = keep
    entry = {"class": cls.__name__, "args": kw, "min_topk_margin": min(margins)}
    if rec["draws"]:
      assert len(rec["draws"]) == L, (name, len(rec["draws"]))
      draws = [d[0] if d.dim() == 4 else d[None] for d in rec["draws"]]  # [G, D, k] / [1, D, r]
      arrays[f"{name}_sketch_LGDK"] = np.stack([d.numpy() for d in draws]).astype(np.float32)
      entry["sketch"] = f"{name}_sketch_LGDK: torch.randn draws per layer, before 1/sqrt(k)"
    meta["presses"][name] = entry
  arrays["meta_json"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
  for name, entry in meta["presses"].items():
    print(f"  {name}: margin {entry['min_topk_margin']:.3g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
