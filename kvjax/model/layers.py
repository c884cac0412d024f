"""One decoder layer as pure functions over its parameters: RMSNorm, the q/k/v projections, the
output projection and gated MLP; the embeddings and the output head; the dense layer and the
attention maps it gives."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.model.attention import (
  attend,
  attention_probs,
  causal_allowed,
  layer_window,
  positions_from_mask,
  softcap_logits,
)
from kvjax.model.config import ModelConfig
from kvjax.model.rope import rope
from kvjax.model.stacking import layer_params, sliced_in_loop, stacked
from kvjax.scores import PRECISION

Array = jax.Array


# The parameters a matmul reads as its right operand (the projections, the MLP and an untied
# head): the ones :func:`with_matmul_dtype` stores in 16 bits for mixed precision.
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def matmul(x: Array, w: Array) -> Array:
  """Multiplies ``x @ w``: fp32 weights at :data:`kvjax.scores.PRECISION` (full fp32 on every
  backend); 16-bit weights on 16-bit operands, accumulated in fp32.

  A 16-bit weight makes the matmul read ``x`` in the weight's dtype and accumulate in fp32
  (``preferred_element_type``), as torch's oneDNN kernels and accelerators' MXUs and tensor cores
  do: the CPU's AVX-512 BF16 and AMX units run it, where an fp32 accumulate of bf16 operands
  left to XLA's default runs at fp32 speed or slower. The product comes back in ``x``'s dtype,
  so an fp32 residual stream stays fp32 (mixed precision, :func:`with_matmul_dtype`) and a bf16
  model stays bf16.

  Args:
    x: the left operand (activations).
    w: the right operand (a weight).

  Returns:
    The product ``x @ w``, in ``x``'s dtype.
  """
  if _is_16bit_float(w):
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)
  return jnp.matmul(x, w, precision=PRECISION)


def with_matmul_dtype(params: dict, dtype) -> dict:
  """Stores the matmuls' weights (:data:`MATMUL_WEIGHTS`) in ``dtype``, the rest unchanged.

  With fp32 parameters and ``dtype=jnp.bfloat16`` this is mixed precision: the embeddings, norms,
  residual stream, attention, softmax and KV cache stay fp32 while every projection and MLP
  matmul runs on bf16 operands with fp32 accumulation (:func:`matmul`): the CPU's bf16 units
  (AVX-512 BF16, AMX) or an accelerator's, at half the weights' memory.

  Args:
    params: the parameter pytree.
    dtype: the weights' new dtype (float32, bfloat16 or float16).

  Returns:
    The parameters with the matmul weights cast to ``dtype``.

  Raises:
    ValueError: for another ``dtype``.
  """
  dtype = check_weight_dtype("dtype", dtype)
  return {k: (v.astype(dtype) if k in MATMUL_WEIGHTS else v) for k, v in params.items()}


def check_weight_dtype(name: str, dtype) -> jnp.dtype:
  """Checks that ``dtype`` is one a model's weights may have.

  Args:
    name: the argument's name, for the error.
    dtype: the dtype asked for (a dtype, a type or its name).

  Returns:
    ``jnp.dtype(dtype)``: float32, bfloat16 or float16.

  Raises:
    ValueError: for another dtype, or something that is not a dtype.
  """
  try:
    found = jnp.dtype(dtype)
  except TypeError:
    found = None
  if found not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {dtype!r}")
  return found


def along_last(w: Array, ndim: int) -> Array:
  """Reshapes a vector over the last axis to broadcast explicitly against rank ``ndim``.

  Args:
    w: a vector ``[N]``.
    ndim: the rank of the array it will broadcast against.

  Returns:
    ``w`` shaped ``[1, ..., 1, N]`` with ``ndim`` axes.
  """
  return w.reshape((1,) * (ndim - 1) + (-1,))


def rms_norm(x: Array, weight: Array, eps: float, *, scale_in_fp32: bool = False) -> Array:
  """Applies HF ``LlamaRMSNorm``: normalise in fp32, cast back, then scale.

  With ``scale_in_fp32`` it is HF ``Gemma2RMSNorm`` instead: scaled in fp32, then cast (the
  weight given is the effective scale, ``1 + w``, as llama.cpp stores Gemma's norms).

  Args:
    x: activations ``[..., d]``.
    weight: the norm's scale ``[d]``.
    eps: the epsilon added to the mean square.
    scale_in_fp32: whether to scale before the cast back (Gemma) rather than after (Llama).

  Returns:
    ``weight`` times the activations normalised in fp32, in ``x``'s dtype.
  """
  h = x.astype(jnp.float32)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  if scale_in_fp32:
    return (along_last(weight, x.ndim).astype(jnp.float32) * h).astype(x.dtype)
  return along_last(weight, x.ndim) * h.astype(x.dtype)


def norm(cfg: ModelConfig, x: Array, weight: Array) -> Array:
  """Applies the model's RMSNorm (:func:`rms_norm`, Gemma's order when ``cfg.norm_scale_fp32``).

  Args:
    cfg: the model's config.
    x: activations ``[..., d]``.
    weight: the norm's scale ``[d]``.

  Returns:
    The normalised, scaled activations in ``x``'s dtype.
  """
  return rms_norm(x, weight, cfg.rms_norm_eps, scale_in_fp32=cfg.norm_scale_fp32)


def query_scale(cfg: ModelConfig) -> float:
  """Returns the factor queries are multiplied by so that ``q k^T / sqrt(D)`` is the model's
  attention logit (Gemma scales by ``query_pre_attn_scalar ** -0.5``; 1 elsewhere).

  Args:
    cfg: the model's config.

  Returns:
    ``sqrt(D / query_pre_attn_scalar)``, or 1.0.
  """
  if cfg.query_pre_attn_scalar is None:
    return 1.0
  return math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)


def project_heads(cfg: ModelConfig, p: dict, x_BTd: Array):
  """Projects hidden states to pre-RoPE queries, keys and values.

  Qwen3's and Gemma 3's q/k RMSNorm is applied (kvpress's ``get_prerope_query_states``), and
  Gemma's queries carry :func:`query_scale`, so every attention computed from them is the
  model's.

  Args:
    cfg: the model's config.
    p: one layer's parameters (:func:`layer_params`).
    x_BTd: the residual stream ``[B, T, d]`` (before the attention norm).

  Returns:
    ``(queries [B, Hq, T, D], keys [B, G, T, D], values [B, G, T, D])``, pre-RoPE.
  """
  B, T, _ = x_BTd.shape
  h = norm(cfg, x_BTd, p["attn_norm"])
  q, k, v = matmul(h, p["wq"]), matmul(h, p["wk"]), matmul(h, p["wv"])
  if cfg.qkv_bias:
    q, k, v = q + along_last(p["bq"], 3), k + along_last(p["bk"], 3), v + along_last(p["bv"], 3)

  def heads(t, n):
    return t.reshape(B, T, n, cfg.head_dim).transpose(0, 2, 1, 3)

  q, k, v = heads(q, cfg.num_heads), heads(k, cfg.num_kv_heads), heads(v, cfg.num_kv_heads)
  if cfg.qk_norm:
    q = norm(cfg, q, p["q_norm"])
    k = norm(cfg, k, p["k_norm"])
  if query_scale(cfg) != 1.0:
    q = q * jnp.asarray(query_scale(cfg), q.dtype)
  return q, k, v


def project_qkv(
  cfg: ModelConfig, p: dict, x_BTd: Array, positions_BT: Array, *, layer=None, seq_len=None
):
  """Projects hidden states to post-RoPE queries, keys and values.

  Args:
    cfg: the model's config.
    p: one layer's parameters (:func:`layer_params`).
    x_BTd: the residual stream ``[B, T, d]`` (before the attention norm).
    positions_BT: RoPE positions ``[B, T]``.
    layer: the layer's index (int or traced), needed when layers differ (``cfg.layer_types``:
      Gemma 2/3), so that no caller applies one layer's RoPE or window to all.
    seq_len: the length ``dynamic`` and ``longrope`` RoPE choose by (:func:`rope`).

  Returns:
    ``(queries [B, Hq, T, D], keys [B, G, T, D], values [B, G, T, D])``, queries and keys
    post-RoPE.

  Raises:
    ValueError: when layers differ and ``layer`` is ``None``.
  """
  q, k, v = project_heads(cfg, p, x_BTd)
  at = dict(layer=layer, seq_len=seq_len)
  return rope(q, positions_BT, cfg, **at), rope(k, positions_BT, cfg, **at), v


def kv_itemsize(cfg: ModelConfig, params: dict) -> int:
  """Returns the bytes per element of the keys and values the model caches (its projections' dtype).

  Args:
    cfg: the model's config.
    params: its parameter pytree.

  Returns:
    The itemsize of :func:`project_qkv`'s keys, found without computing anything.
  """
  x = jnp.zeros((1, 1, cfg.hidden_size), params["embed"].dtype)
  return jnp.dtype(qkv_dtypes(cfg, params, x, jnp.zeros((1, 1), jnp.int32))[1]).itemsize


def qkv_dtypes(cfg: ModelConfig, params: dict, x_BTd: Array, positions_BT: Array):
  """Finds the dtypes :func:`project_qkv` gives queries and keys/values (the model's), without
  computing anything.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    x_BTd: a residual stream ``[B, T, d]`` of the model's dtype (only its first position's
      shape and dtype are read).
    positions_BT: RoPE positions ``[B, T]`` (likewise).

  Returns:
    ``(query dtype, key/value dtype)``.
  """
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  p = {k: spec(v[0]) for k, v in stacked(params).items()}
  q, k, _ = jax.eval_shape(
    lambda p, x, pos: project_qkv(cfg, p, x, pos, layer=0),
    p,
    spec(x_BTd[:, :1]),
    spec(positions_BT[:, :1]),
  )
  return q.dtype, k.dtype


def output_and_mlp(cfg: ModelConfig, p: dict, x_BTd: Array, attn_BHTD: Array) -> Array:
  """Applies ``o_proj`` and the gated MLP to give the layer's residual stream.

  SwiGLU (Llama) or GeGLU with tanh GELU (Gemma); with ``cfg.sandwich_norms`` (Gemma 2/3,
  HF ``Gemma2DecoderLayer``) the attention and MLP outputs are normalised again
  (``post_attn_norm``, ``post_mlp_norm``) before each is added to the residual stream.

  Args:
    cfg: the model's config.
    p: one layer's parameters (:func:`layer_params`).
    x_BTd: the residual stream ``[B, T, d]`` entering the layer.
    attn_BHTD: the attention output ``[B, Hq, T, D]``.

  Returns:
    The residual stream ``[B, T, d]`` after ``o_proj`` and the MLP.
  """
  B, _, T, _ = attn_BHTD.shape
  o = matmul(attn_BHTD.transpose(0, 2, 1, 3).reshape(B, T, -1).astype(x_BTd.dtype), p["wo"])
  if cfg.o_bias:
    o = o + along_last(p["bo"], 3)
  if cfg.sandwich_norms:
    o = norm(cfg, o, p["post_attn_norm"])
  x = x_BTd + o
  h = norm(cfg, x, p["mlp_norm"])
  gate = matmul(h, p["w_gate"])
  gate = (
    jax.nn.gelu(gate, approximate=True) if cfg.mlp_activation == "gelu_tanh" else jax.nn.silu(gate)
  )
  out = matmul(gate * matmul(h, p["w_up"]), p["w_down"])
  if cfg.sandwich_norms:
    out = norm(cfg, out, p["post_mlp_norm"])
  return x + out


def embed_tokens(cfg: ModelConfig, params: dict, ids: Array) -> Array:
  """Looks up the residual stream's input: the token embeddings, Gemma's scaled.

  Gemma multiplies by ``sqrt(hidden_size)`` rounded to the weights' dtype (HF
  ``Gemma2TextScaledWordEmbedding``), so bf16 weights scale by the bf16 value.

  Args:
    cfg: the model's config.
    params: the parameter pytree (``embed`` is read).
    ids: token ids, any shape.

  Returns:
    The embeddings ``[*ids.shape, d]`` in the weights' dtype.
  """
  x = params["embed"][ids]
  if cfg.embed_scale:
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
  return x


def logits_of(cfg: ModelConfig, params: dict, x_BTd: Array) -> Array:
  """Computes fp32 logits from the final residual stream.

  The logits are rounded through the model dtype, as the matmul gives them; Gemma 2's are then
  soft-capped (``cfg.final_softcap``, :func:`softcap_logits`).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    x_BTd: the residual stream ``[B, T, d]`` after the last layer.

  Returns:
    fp32 logits ``[B, T, V]``.
  """
  h = norm(cfg, x_BTd, params["final_norm"])
  tied = cfg.tie_word_embeddings
  head = params["embed"] if tied else params["lm_head"]
  if jax.default_backend() == "cpu" and _is_16bit_float(head):
    logits = _logits_by_vocab_chunk(h, head, tied)
  else:
    logits = _head_matmul(h, head, tied)
  return softcap_logits(logits.astype(jnp.float32), cfg.final_softcap)


def _head_matmul(h_BTd: Array, head: Array, tied: bool) -> Array:
  """``h`` times the output head (``[V, d]`` tied embeddings, else ``[d, V]``), no transpose."""
  if tied:
    return jnp.einsum("btd,vd->btv", h_BTd, head, precision=PRECISION)
  return matmul(h_BTd, head)


def _logits_by_vocab_chunk(h_BTd: Array, head: Array, tied: bool, size: int = 8192) -> Array:
  """:func:`_head_matmul` a vocabulary chunk at a time (CPU: no fp32 copy of a 16-bit head;
  the last chunk is read from ``V - size`` and rewrites identical values)."""
  axis = 0 if tied else 1
  V = head.shape[axis]
  size = min(size, V)
  B, T, _ = h_BTd.shape

  def chunk(i, out):
    head_b, start = sliced_in_loop(head, jnp.minimum(i * size, V - size))
    part = _head_matmul(h_BTd, jax.lax.dynamic_slice_in_dim(head_b, start, size, axis), tied)
    return jax.lax.dynamic_update_slice_in_dim(out, part, start, 2)

  out = jnp.zeros((B, T, V), jnp.result_type(h_BTd, head))
  return jax.lax.fori_loop(0, -(-V // size), chunk, out)


def _is_16bit_float(a: Array) -> bool:
  return jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 2


def dense_layer(
  cfg: ModelConfig, p: dict, x_BTd: Array, positions_BT: Array, allowed, *, layer=None
) -> tuple:
  """Runs one decoder layer with one dense mask (training and attention maps).

  Args:
    cfg: the model's config.
    p: one layer's parameters (:func:`layer_params`).
    x_BTd: the residual stream ``[B, T, d]``.
    positions_BT: RoPE positions ``[B, T]``.
    allowed: the dense ``[B, T, T]`` mask of the keys each query may see (the layer's window
      applied: :func:`layer_window`).
    layer: the layer's index, needed when layers differ (:func:`project_qkv`).

  Returns:
    ``(x, probs)``: the new residual stream ``[B, T, d]`` and the layer's attention
    probabilities ``[B, Hq, T, T]``.
  """
  q, k, v = project_qkv(cfg, p, x_BTd, positions_BT, layer=layer)
  probs = attention_probs(q, k, allowed, softcap=cfg.attn_softcap)
  return output_and_mlp(cfg, p, x_BTd, attend(probs, v)), probs


def full_attention_maps(cfg, params, input_ids, attention_mask, layers) -> dict:
  """Computes the post-softmax attention of the requested layers (for plots).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    input_ids: token ids ``[B, T]``.
    attention_mask: the 0/1 mask ``[B, T]`` of the real tokens.
    layers: the layers to return maps of.

  Returns:
    ``{layer: [B, Hq, T, T]}`` attention probabilities.
  """
  B, T = input_ids.shape
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  index = jnp.broadcast_to(jnp.arange(T), (B, T))
  x = embed_tokens(cfg, params, input_ids)
  maps = {}
  for layer in range(cfg.num_layers):
    window = layer_window(cfg, layer)
    allowed = causal_allowed(positions, positions, valid, index, index, window)
    x, probs = dense_layer(cfg, layer_params(params, layer), x, positions, allowed, layer=layer)
    if layer in layers:
      maps[layer] = probs
    if layer >= max(layers):
      break
  return maps
