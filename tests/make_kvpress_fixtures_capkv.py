"""Generate golden fixtures for kvpress 0.5.5's ``CapPress`` and ``KVComposePress`` (kvjax
``CapKV`` and ``KVCompose``).

A standalone script, NOT run by the test suite (kvjax never imports torch). It runs the presses
on the tiny random Llama checkpoint ``tests/fixtures/kvpress_tiny_llama`` (eager attention) with
the prompt ``input_ids_T`` of ``tests/fixtures/kvpress_0_5_5.npz`` and writes
``tests/fixtures/kvpress_0_5_5_capkv.npz``. Run it from the repository root in the kvpress venv
(torch 2.13.0+cpu, transformers 5.2.0, kvpress 0.5.5)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_capkv.py

What it records (L layers, Hq query heads, G kv heads, T tokens, D head dim):

* ``keys_LGTD`` / ``values_LGTD``: the cache's keys and values as ``CapPress.score`` sees them;
* ``<name>_anchor_LHD``: ``CapPress._query_anchor`` (the mean pre-RoPE query after ``n_sink``
  tokens, rotated by the average RoPE matrix of the next ``n_future_positions`` positions);
* ``<name>_scores_LGT``: ``CapPress.score``'s output; ``<name>_keep_LGT``: the positions kvpress
  kept at compression_ratio 0.5 (recovered from the compressed cache);
* ``reconstruction_attn_LHT``: ``KVComposePress``'s per-query-head evidence, the max over the
  second pass's queries (the context read again after itself) of the attention each context
  key receives;
* ``<name>_scores_LGT`` (KVCompose: after ``enhance_scores``), ``<name>_keep_LGT`` (its
  ``important_mask_per_kv_head``), ``<name>_per_layer_L`` and ``<name>_per_head_LG`` (its
  ``important_per_layer`` and ``important_per_head``);
* ``meta_json``: every press's class and arguments, and ``n_kept`` per head.
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
OUT = HERE / "fixtures" / "kvpress_0_5_5_capkv.npz"
RATIO = 0.5


def cap_presses():
  r = {"compression_ratio": RATIO}
  return [
    ("capkv", r),
    ("capkv_t2_s2_f64", {**r, "tau": 2.0, "n_sink": 2, "n_future_positions": 64}),
    ("capkv_eps", {**r, "epsilon": 1e-2}),
  ]


def compose_presses():
  r = {"compression_ratio": RATIO}
  return [
    ("kvcompose", r),
    ("kvcompose_unstructured", {**r, "structured": False}),
    ("kvcompose_max_max", {**r, "agg_group": "max", "agg_head": "max"}),
    ("kvcompose_nomean", {**r, "add_mean_across_heads": False}),
    ("kvcompose_lb8", {**r, "keep_token_lower_bound": 8}),
    ("kvcompose_unstructured_lb8", {**r, "structured": False, "keep_token_lower_bound": 8}),
    ("kvcompose_r08", {"compression_ratio": 0.8}),
    ("kvcompose_unstructured_r08", {"compression_ratio": 0.8, "structured": False}),
    ("kvcompose_r08_lb8", {"compression_ratio": 0.8, "keep_token_lower_bound": 8}),
    (
      "kvcompose_unstructured_r08_lb8",
      {"compression_ratio": 0.8, "structured": False, "keep_token_lower_bound": 8},
    ),
    ("kvcompose_r095", {"compression_ratio": 0.95}),
  ]


def run_cap(model, input_ids, press):
  from transformers import DynamicCache

  rec = {"scores": {}, "keys": {}, "values": {}, "anchor": {}}
  orig = press.score

  def score(module, hidden_states, keys, values, attentions, kwargs):
    out = orig(module, hidden_states, keys, values, attentions, kwargs)
    layer = module.layer_idx
    rec["scores"][layer] = out.detach().clone()[0]
    rec["keys"][layer] = keys.detach().clone()[0]
    rec["values"][layer] = values.detach().clone()[0]
    rec["anchor"][layer] = press._query_anchor(module, hidden_states).detach().clone()[0]
    return out

  press.score = score
  cache = DynamicCache(config=model.config)
  with torch.no_grad(), press(model):
    model(input_ids, past_key_values=cache, use_cache=True)
  return cache, rec


def kept_from_cache(cache, keys, L, G, T) -> np.ndarray:
  keep = np.zeros((L, G, T), dtype=bool)
  for layer in range(L):
    orig = keys[layer]
    comp = cache.layers[layer].keys[0]
    for g in range(G):
      eq = (comp[g][:, None, :] == orig[g][None, :, :]).all(-1)
      assert (eq.sum(-1) == 1).all(), "compressed key does not match a unique original key"
      keep[layer, g, eq.float().argmax(-1).numpy()] = True
  return keep


def run_compose(model, input_ids, press):
  from transformers import DynamicCache

  rec = {}
  orig_prepare = press.prepare_important_masks

  def prepare():
    rec["evidence"] = torch.stack(
      [torch.stack([a.transform().clone() for a in layer]) for layer in press.task_aggregators]
    )
    orig_prepare()
    rec["scores"] = press.scores.detach().clone()
    rec["keep"] = torch.stack([torch.stack(m) for m in press.important_mask_per_kv_head])
    rec["per_layer"] = np.asarray(press.important_per_layer).copy()
    rec["per_head"] = np.asarray(press.important_per_head).copy()

  press.prepare_important_masks = prepare
  cache = DynamicCache(config=model.config)
  with torch.no_grad(), press(model):
    model(input_ids, past_key_values=cache, use_cache=True)
  return rec


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(0)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import transformers
  from kvpress.presses.cap_press import CapPress
  from kvpress.presses.kvcompose_press import KVComposePress
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
    "generator": "tests/make_kvpress_fixtures_capkv.py",
    "versions": {
      "kvpress": "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (eager attention)",
    "prompt": "input_ids_T (from tests/fixtures/kvpress_0_5_5.npz)",
    "n_kept": n_kept,
    "presses": {},
  }
  for name, kw in cap_presses():
    cache, rec = run_cap(model, input_ids, CapPress(**kw))
    keep = kept_from_cache(cache, rec["keys"], L, G, T)
    scores = np.stack([rec["scores"][i].float().numpy() for i in range(L)])
    if "keys_LGTD" not in arrays:
      arrays["keys_LGTD"] = np.stack([rec["keys"][i].numpy() for i in range(L)])
      arrays["values_LGTD"] = np.stack([rec["values"][i].numpy() for i in range(L)])
    arrays[f"{name}_anchor_LHD"] = np.stack([rec["anchor"][i].numpy() for i in range(L)])
    arrays[f"{name}_scores_LGT"] = scores.astype(np.float32)
    arrays[f"{name}_keep_LGT"] = keep
    margins = [
      float(scores[i, g][keep[i, g]].min() - scores[i, g][~keep[i, g]].max())
      for i in range(L)
      for g in range(G)
    ]
    meta["presses"][name] = {"class": "CapPress", "args": kw, "min_topk_margin": min(margins)}
  for name, kw in compose_presses():
    rec = run_compose(model, input_ids, KVComposePress(**kw))
    evidence = rec["evidence"].float().numpy()
    if "reconstruction_attn_LHT" not in arrays:
      arrays["reconstruction_attn_LHT"] = evidence
    else:
      np.testing.assert_array_equal(arrays["reconstruction_attn_LHT"], evidence)
    arrays[f"{name}_scores_LGT"] = rec["scores"].float().numpy()
    arrays[f"{name}_keep_LGT"] = rec["keep"].numpy()
    arrays[f"{name}_per_layer_L"] = rec["per_layer"].astype(np.int32)
    arrays[f"{name}_per_head_LG"] = rec["per_head"].astype(np.int32)
    meta["presses"][name] = {"class": "KVComposePress", "args": kw}
  arrays["meta_json"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
  for name, entry in meta["presses"].items():
    print(f"  {name}: {entry}")
  for name, _ in compose_presses():
    print(name, arrays[f"{name}_per_layer_L"], arrays[f"{name}_per_head_LG"].tolist())
  return 0


if __name__ == "__main__":
  sys.exit(main())
