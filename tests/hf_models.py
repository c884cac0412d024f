"""Tiny seeded transformers checkpoints shared by the model tests (torch and transformers are
test-only references)."""

import os
import pathlib
import tempfile

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 32


LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
}


FAMILIES = {
  "llama3_gqa_untied": ("Llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), 2),
  "llama_mha_tied": ("Llama", dict(tie_word_embeddings=True), 4),
  "mistral_gqa": ("Mistral", dict(sliding_window=4096), 2),
  "qwen2_bias_tied": ("Qwen2", dict(tie_word_embeddings=True), 2),
  "qwen3_qknorm": ("Qwen3", dict(head_dim=16), 2),
}


def tiny_hf(family: str, kv_heads: int = 2, **extra):
  """A seeded tiny transformers model of ``family`` (weights ~ N(0, 0.2^2): far from uniform
  attention, so positions and policies matter)."""
  torch.manual_seed(0)
  cfg = getattr(transformers, f"{family}Config")(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=kv_heads,
    max_position_embeddings=512,
    **extra,
  )
  hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.2)
  return hf


def make_checkpoint(tmp_path_factory, name):
  family, extra, kv_heads = FAMILIES[name]
  hf = tiny_hf(family, kv_heads, **extra)
  path = tmp_path_factory.mktemp(name)
  hf.save_pretrained(path)
  return hf, path


def prompt(T=40, B=1, seed=0):
  return np.random.default_rng(seed).integers(0, 128, size=(B, T)).astype(np.int32)


def hf_generate(hf, ids, new=NEW, mask=None):
  mask = np.ones_like(ids) if mask is None else mask  # else HF infers padding from pad_token_id
  kwargs = {"attention_mask": torch.tensor(mask)}
  with torch.no_grad():
    hf.generation_config.eos_token_id = None  # kvjax generates a fixed number of tokens
    out = hf.generate(
      torch.tensor(ids), max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs
    )
  return out.numpy()[:, ids.shape[1] :]


_CACHE = {}


def make_checkpoint_cached():
  if "ckpt" not in _CACHE:
    _, extra, _ = FAMILIES["llama3_gqa_untied"]
    hf = tiny_hf("Llama", head_dim=32, **extra)
    path = pathlib.Path(tempfile.mkdtemp())
    hf.save_pretrained(path)
    _CACHE["ckpt"] = (hf, path)
  return _CACHE["ckpt"]


# Gemma 2 / Gemma 3 / Phi-3: windows (8) shorter than the test prompts (40) so sliding layers
# really slide; soft-caps small enough to bind on these logits; Gemma 3's global layers with
# linear scaling (as its 4B+ checkpoints); Phi-3 with LongRoPE past a 32-token pretraining context
PHI3_LONGROPE = {
  "rope_type": "longrope",
  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
  "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
}
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8)
NEW_FAMILIES = {
  "gemma2": (
    "Gemma2",
    dict(
      GEMMA,
      num_hidden_layers=3,
      attn_logit_softcapping=4.0,
      final_logit_softcapping=6.0,
    ),
    2,
  ),
  "gemma3": (
    "Gemma3Text",
    dict(
      GEMMA,
      num_hidden_layers=3,
      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
      rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
      },
    ),
    2,
  ),
  "phi3": (
    "Phi3",
    dict(rope_parameters=PHI3_LONGROPE, original_max_position_embeddings=32),
    2,
  ),
}
CAUSAL_LM = {"Gemma3Text": "Gemma3ForCausalLM"}


def tiny_family(name: str, **overrides):
  """A seeded tiny transformers model of one of :data:`NEW_FAMILIES` (weights ~ N(0, 0.2^2));
  ``overrides`` replace config entries."""
  family, extra, kv_heads = NEW_FAMILIES[name]
  torch.manual_seed(0)
  extra = dict(extra, **overrides)
  cfg = getattr(transformers, f"{family}Config")(
    vocab_size=extra.pop("vocab_size", 128),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=extra.pop("num_hidden_layers", 2),
    num_attention_heads=4,
    num_key_value_heads=kv_heads,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    **extra,
  )
  hf = getattr(transformers, CAUSAL_LM.get(family, f"{family}ForCausalLM"))(cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.2)
  return hf


def family_checkpoint(name: str):
  """``(hf, path)``: :func:`tiny_family` saved once per test session."""
  key = ("family", name)
  if key not in _CACHE:
    hf = tiny_family(name)
    path = pathlib.Path(tempfile.mkdtemp())
    hf.save_pretrained(path)
    _CACHE[key] = (hf, path)
  return _CACHE[key]
