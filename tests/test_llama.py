"""kvjax.model.llama: logits and greedy tokens against transformers, the prefill's evidence,
bf16, Mistral's sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import (
  NEW,
  hf_generate,
  make_checkpoint_cached,
  prompt,
  tiny_hf,
  torch,
)

from kvjax import model as km


def test_logits_and_greedy_tokens_match_transformers(family):
  name, hf, model, cfg = family
  ids = prompt(T=40, B=2)
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(ids)))
  assert np.abs(ours - ref).max() <= 1e-4, name
  np.testing.assert_array_equal(
    km.generate(model, ids[:1], max_new_tokens=NEW).tokens, hf_generate(hf, ids[:1])
  )


def test_prefill_evidence_is_consistent_with_full_attention_maps():
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  ids = prompt(T=37, B=2)
  mask = np.ones_like(ids)
  mask[1, :5] = 0  # a left-padded row
  pre = km.prefill(
    cfg,
    model.params(),
    jnp.asarray(ids),
    jnp.asarray(mask),
    window=6,
    column_sums=True,
    full_attention_layers=(0, 1),
    block=8,
  )
  for layer in (0, 1):
    maps = np.asarray(pre.full_attention[layer])  # [B, Hq, T, T]
    real = mask.astype(bool)
    np.testing.assert_allclose(
      maps.sum(-1)[real[:, None, :].repeat(cfg.num_heads, 1)], 1.0, atol=1e-5
    )
    assert (maps[1][..., :5] == 0).all(), "padding receives no attention"
    np.testing.assert_allclose(np.asarray(pre.attn_window[layer]), maps[:, :, -6:], atol=1e-6)
    sums = (maps * real[:, None, :, None]).sum(-2)
    np.testing.assert_allclose(np.asarray(pre.column_sums[layer]), sums, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(pre.key_norms), np.linalg.norm(np.asarray(pre.keys), axis=-1), rtol=1e-6
  )


def test_bfloat16_model_tracks_float32():
  _, path = make_checkpoint_cached()
  m32, _ = km.load(path)
  m16, _ = km.load(path, dtype=jnp.bfloat16)
  ids = jnp.asarray(prompt(T=24))
  l32, l16 = np.asarray(m32(ids)), np.asarray(m16(ids))
  assert l16.dtype == np.float32 and np.abs(l32 - l16).max() < 0.1 * np.abs(l32).max()


def test_mistral_sliding_window_applies_during_decoding(tmp_path):
  hf = tiny_hf("Mistral", sliding_window=8)
  hf.save_pretrained(tmp_path)
  model, _ = km.load(tmp_path)
  ids = prompt(T=24)
  out = km.generate(model, ids, max_new_tokens=8).tokens
  seq = np.concatenate([ids, out], 1)
  teacher = np.asarray(model(jnp.asarray(seq))).argmax(-1)[0, 23:31]
  np.testing.assert_array_equal(out[0], teacher)


def test_every_matmul_asks_for_full_fp32_precision():
  # TPUs and TF32 GPUs would otherwise compute fp32 matmuls at reduced precision
  model, cfg, _ = km.load_tiny()
  prefill = jax.make_jaxpr(
    lambda ids: km.prefill(cfg, model.params(), ids, window=4, column_sums=True)
  )(jnp.zeros((1, 8), jnp.int32))
  text = str(prefill)
  assert text.count("dot_general") > 5
  assert text.count("dot_general") == text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)")


def test_prefill_computes_the_last_logits_only_unless_asked():
  model, cfg, _ = km.load_tiny()
  ids = jnp.asarray(np.random.default_rng(0).integers(4, 100, (2, 20)), jnp.int32)
  last = km.prefill(cfg, model.params(), ids).logits
  every = km.prefill(cfg, model.params(), ids, logits="all").logits
  assert last.shape == (2, 1, cfg.vocab_size) and every.shape == (2, 20, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(every[:, -1]), atol=1e-5)
  with pytest.raises(ValueError, match="logits"):
    km.prefill(cfg, model.params(), ids, logits="first")
