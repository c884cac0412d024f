"""A Llama-family decoder in flax nnx (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Gemma 2,
Gemma 3 text, Phi-3).

Parameters are stacked over layers (``[L, ...]``) so the forward pass is a ``lax.scan`` over
layers (one compiled layer, fast compiles). The math lives in pure functions over the
parameter pytree (``params = nnx.state(model)``), which the prefill, the compressed-cache decode
and ``vmap`` over cache configurations all share; :class:`Llama` is the nnx module holding them.

Conventions follow Hugging Face ``transformers``: RMSNorm in fp32 then cast, RoPE with
``rotate_half`` (non-interleaved halves) and Llama 3 frequency scaling, GQA query head ``h``
reading KV head ``h // (Hq // G)``, SwiGLU MLP, Qwen2 q/k/v bias, Qwen3 per-head q/k RMSNorm
before RoPE, tied or untied embeddings. Softmax is always fp32. Gemma 2/3 add sliding and
global layers (``cfg.layer_types``: a layer's window and RoPE come from its index), attention
and final soft-capping, ``query_pre_attn_scalar``, GeGLU, norms after attention and MLP, RMSNorm
scaled in fp32 by ``1 + w`` (stored with the 1 added) and embeddings times ``sqrt(d)``; Phi-3's
fused projections are split when loaded. RoPE scalings are transformers'
``ROPE_INIT_FUNCTIONS`` (:func:`inv_frequencies`).

The math is split by concern, every name re-exported here (``llama.prefill``, ``llama.rope_at``):
:mod:`~kvjax.model.checks` (token ids and the context), :mod:`~kvjax.model.stacking` (the
parameters over layers), :mod:`~kvjax.model.rope`, :mod:`~kvjax.model.attention` (masks,
softmax, the output), :mod:`~kvjax.model.blocked` (the prefill's tiled attention),
:mod:`~kvjax.model.layers` (one decoder layer, the embeddings and the head) and
:mod:`~kvjax.model.prefilling` (the prefill and its evidence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.model.attention import (
  FULL_WINDOW,
  attend,
  attention_logits,
  attention_probs,
  causal_allowed,
  is_sliding,
  layer_window,
  masked_softmax,
  positions_from_mask,
  segments_attention,
  softcap_logits,
)
from kvjax.model.checks import check_context, check_token_ids
from kvjax.model.config import ModelConfig
from kvjax.model.layers import (
  MATMUL_WEIGHTS,
  along_last,
  dense_layer,
  embed_tokens,
  full_attention_maps,
  kv_itemsize,
  logits_of,
  matmul,
  norm,
  output_and_mlp,
  project_heads,
  project_qkv,
  query_scale,
  rms_norm,
  with_matmul_dtype,
)
from kvjax.model.prefilling import (
  ATTENTION,
  CHUNK,
  LOGITS,
  NO_EVIDENCE,
  Prefill,
  PrefillPlan,
  empty_moments,
  moments_mean_cov,
  prefill,
  rotate_moments,
  update_moments,
  value_out_norms,
)
from kvjax.model.rope import average_rope, inv_frequencies, rope, rope_at, rope_tables
from kvjax.model.stacking import UNSTACKED, layer_params, stacked, unstacked_params

Array = jax.Array

__all__ = [
  "ATTENTION",
  "CHUNK",
  "FULL_WINDOW",
  "LOGITS",
  "NO_EVIDENCE",
  "UNSTACKED",
  "Llama",
  "Prefill",
  "PrefillPlan",
  "along_last",
  "attend",
  "attention_logits",
  "attention_probs",
  "average_rope",
  "causal_allowed",
  "check_context",
  "check_token_ids",
  "dense_layer",
  "embed_tokens",
  "empty_moments",
  "forward",
  "full_attention_maps",
  "inv_frequencies",
  "is_sliding",
  "kv_itemsize",
  "layer_params",
  "layer_window",
  "logits_of",
  "masked_softmax",
  "matmul",
  "MATMUL_WEIGHTS",
  "with_matmul_dtype",
  "moments_mean_cov",
  "norm",
  "output_and_mlp",
  "positions_from_mask",
  "prefill",
  "project_heads",
  "project_qkv",
  "query_scale",
  "rms_norm",
  "rope",
  "rope_at",
  "rope_tables",
  "rotate_moments",
  "segments_attention",
  "softcap_logits",
  "stacked",
  "unstacked_params",
  "update_moments",
  "value_out_norms",
]


class Llama(nnx.Module):
  """Parameters of a Llama-family decoder, stacked over layers; ``model(input_ids)`` -> logits."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    L, d, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def normal(*shape, scale=0.02):
      return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))

    def ones(*shape):
      return nnx.Param(jnp.ones(shape, dtype))

    def zeros(*shape):
      return nnx.Param(jnp.zeros(shape, dtype))

    self.embed = normal(cfg.vocab_size, d)
    self.attn_norm = ones(L, d)
    self.wq, self.wk, self.wv = normal(L, d, q_dim), normal(L, d, kv_dim), normal(L, d, kv_dim)
    self.wo = normal(L, q_dim, d)
    if cfg.qkv_bias:
      self.bq, self.bk, self.bv = zeros(L, q_dim), zeros(L, kv_dim), zeros(L, kv_dim)
    if cfg.o_bias:
      self.bo = zeros(L, d)
    if cfg.qk_norm:
      self.q_norm, self.k_norm = ones(L, cfg.head_dim), ones(L, cfg.head_dim)
    self.mlp_norm = ones(L, d)
    if cfg.sandwich_norms:
      self.post_attn_norm, self.post_mlp_norm = ones(L, d), ones(L, d)
    self.w_gate, self.w_up, self.w_down = normal(L, d, F), normal(L, d, F), normal(L, F, d)
    self.final_norm = ones(d)
    if not cfg.tie_word_embeddings:
      self.lm_head = normal(d, cfg.vocab_size)

  def params(self) -> dict:
    """Returns the parameter pytree that the pure functions of this module read.

    Returns:
      A dict of the module's parameters by name (``embed``, ``wq``, ...), as arrays.
    """
    return {k: v[...] for k, v in nnx.to_pure_dict(nnx.state(self, nnx.Param)).items()}

  def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
    """Computes the logits ``[batch, T, vocab]`` of a full causal forward pass.

    Args:
      input_ids: token ids ``[batch, T]`` (:func:`check_token_ids`'s rule; traced ids are checked
        for shape and dtype only).
      attention_mask: optional ``[batch, T]`` 0/1 mask of the real tokens.

    Returns:
      fp32 logits ``[batch, T, vocab]``.

    Raises:
      ValueError: ids that break :func:`check_token_ids`'s rule, or a prompt longer than the
        model's context (:func:`check_context`).
    """
    input_ids = check_token_ids("input_ids", input_ids, self.cfg.vocab_size)
    check_context(self.cfg, input_ids.shape[1])
    return forward(self.cfg, self.params(), input_ids, attention_mask)


def forward(
  cfg: ModelConfig,
  params: dict,
  input_ids: Array,
  attention_mask: Array | None = None,
  *,
  block: int = 256,
) -> Array:
  """Runs a full causal forward pass, queries processed in blocks of ``block``.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    input_ids: token ids ``[B, T]``.
    attention_mask: optional ``[B, T]`` 0/1 mask of the real tokens.
    block: queries (and keys) per attention tile.

  Returns:
    fp32 logits ``[B, T, V]``.

  Raises:
    ValueError: as :func:`prefill`.
  """
  return prefill(
    cfg, params, input_ids, attention_mask, plan=PrefillPlan(block), logits="all"
  ).logits
