"""A Llama-family decoder in flax nnx (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3).

Parameters are stacked over layers (``[L, ...]``) so the forward pass is a ``lax.scan`` over
layers (one compiled layer, fast compiles). The math lives in pure functions over the
parameter pytree (``params = nnx.state(model)``), which the prefill, the compressed-cache decode
and ``vmap`` over cache configurations all share; :class:`Llama` is the nnx module holding them.

Conventions follow Hugging Face ``transformers``: RMSNorm in fp32 then cast, RoPE with
``rotate_half`` (non-interleaved halves) and Llama 3 frequency scaling, GQA query head ``h``
reading KV head ``h // (Hq // G)``, SwiGLU MLP, Qwen2 q/k/v bias, Qwen3 per-head q/k RMSNorm
before RoPE, tied or untied embeddings. Softmax is always fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax.model.config import ModelConfig
from kvjax.scores import PRECISION

Array = jax.Array


# --------------------------------------------------------------------------- the module


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
    self.w_gate, self.w_up, self.w_down = normal(L, d, F), normal(L, d, F), normal(L, F, d)
    self.final_norm = ones(d)
    if not cfg.tie_word_embeddings:
      self.lm_head = normal(d, cfg.vocab_size)

  def params(self) -> dict:
    """The parameter pytree the pure functions read."""
    return {k: v[...] for k, v in nnx.to_pure_dict(nnx.state(self, nnx.Param)).items()}

  def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
    """Logits ``[batch, T, vocab]`` of a full causal forward pass."""
    return forward(self.cfg, self.params(), input_ids, attention_mask)


# --------------------------------------------------------------------------- building blocks


def matmul(x: Array, w: Array) -> Array:
  """``x @ w`` at :data:`kvjax.scores.PRECISION` (full fp32 on every backend)."""
  return jnp.matmul(x, w, precision=PRECISION)


def along_last(w: Array, ndim: int) -> Array:
  """A vector over the last axis, shaped to broadcast explicitly against rank ``ndim``."""
  return w.reshape((1,) * (ndim - 1) + (-1,))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  """HF ``LlamaRMSNorm``: normalise in fp32, cast back, then scale."""
  h = x.astype(jnp.float32)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  return along_last(weight, x.ndim) * h.astype(x.dtype)


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies ``[D/2]`` (float64 on the host), with Llama 3 scaling."""
  D = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
  if cfg.rope_type != "llama3":
    return inv
  old = cfg.rope_original_max_positions
  low_wavelen = old / cfg.rope_low_freq_factor
  high_wavelen = old / cfg.rope_high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
  smooth = (old / wavelen - cfg.rope_low_freq_factor) / (
    cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def rope(x_BHTD: Array, positions_BT: Array, cfg: ModelConfig) -> Array:
  """Rotary embedding of ``[B, N, T, D]`` heads at per-row positions ``[B, T]``."""
  return rope_at(x_BHTD, jnp.broadcast_to(positions_BT[:, None], x_BHTD.shape[:-1]), cfg)


def rope_at(x: Array, positions: Array, cfg: ModelConfig) -> Array:
  """Rotary embedding of ``x [..., C, D]`` at ``positions [..., C]`` (any leading axes; negative
  positions undo a rotation: RoPE is a rotation, ``rope_at(rope_at(x, p), -p) == x``)."""
  inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv.reshape((1,) * positions.ndim + (-1,))
  angles = jnp.concatenate([angles, angles], -1)
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


# parameters outside the layer stack (everything else is stacked over a leading layer axis)
UNSTACKED = ("embed", "final_norm", "lm_head")


def stacked(params: dict) -> dict:
  """The per-layer parameters, each ``[L, ...]``: what the layer scan iterates over."""
  return {k: v for k, v in params.items() if k not in UNSTACKED}


def layer_params(params: dict, layer) -> dict:
  """One layer's slice of the stacked parameters."""
  return {k: v[layer] for k, v in stacked(params).items()}


def project_qkv(cfg: ModelConfig, p: dict, x_BTd: Array, positions_BT: Array):
  """Post-RoPE queries ``[B, Hq, T, D]``, keys ``[B, G, T, D]`` and values ``[B, G, T, D]``."""
  B, T, _ = x_BTd.shape
  h = rms_norm(x_BTd, p["attn_norm"], cfg.rms_norm_eps)
  q, k, v = matmul(h, p["wq"]), matmul(h, p["wk"]), matmul(h, p["wv"])
  if cfg.qkv_bias:
    q, k, v = q + along_last(p["bq"], 3), k + along_last(p["bk"], 3), v + along_last(p["bv"], 3)

  def heads(t, n):
    return t.reshape(B, T, n, cfg.head_dim).transpose(0, 2, 1, 3)

  q, k, v = heads(q, cfg.num_heads), heads(k, cfg.num_kv_heads), heads(v, cfg.num_kv_heads)
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  return rope(q, positions_BT, cfg), rope(k, positions_BT, cfg), v


def attention_probs(q_BHQD, k_BGTD, allowed) -> Array:
  """fp32 softmax of ``q k^T / sqrt(D)`` over allowed keys: ``[B, Hq, Q, K]`` (GQA grouped).

  ``allowed`` is ``[B, Q, K]`` (shared by every head: prefill) or ``[B, G, Q, K]`` (per KV head:
  a compressed cache, whose rows hold different slots). Fully masked rows give zeros.
  """
  B, Hq, Q, D = q_BHQD.shape
  G = k_BGTD.shape[1]
  allowed = allowed[:, None] if allowed.ndim == 3 else allowed
  allowed = allowed[:, :, None]  # [B, G or 1, 1, Q, K]
  q = q_BHQD.astype(jnp.float32).reshape(B, G, Hq // G, Q, D)
  logits = jnp.einsum(
    "bgrqd,bgkd->bgrqk", q, k_BGTD.astype(jnp.float32), precision=PRECISION
  ) / math.sqrt(D)
  logits = jnp.where(allowed, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(allowed.any(-1, keepdims=True), probs, 0.0)
  return probs.reshape(B, Hq, Q, -1)


def attend(probs_BHQT: Array, v_BGTD: Array) -> Array:
  """Attention output ``[B, Hq, Q, D]`` from probabilities and grouped values."""
  B, Hq, Q, K = probs_BHQT.shape
  G = v_BGTD.shape[1]
  p = probs_BHQT.reshape(B, G, Hq // G, Q, K)
  out = jnp.einsum("bgrqk,bgkd->bgrqd", p, v_BGTD.astype(jnp.float32), precision=PRECISION)
  return out.reshape(B, Hq, Q, -1)


def output_and_mlp(cfg: ModelConfig, p: dict, x_BTd: Array, attn_BHTD: Array) -> Array:
  """Residual stream after ``o_proj`` and the SwiGLU MLP."""
  B, _, T, _ = attn_BHTD.shape
  o = matmul(attn_BHTD.transpose(0, 2, 1, 3).reshape(B, T, -1).astype(x_BTd.dtype), p["wo"])
  if cfg.o_bias:
    o = o + along_last(p["bo"], 3)
  x = x_BTd + o
  h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
  return x + matmul(jax.nn.silu(matmul(h, p["w_gate"])) * matmul(h, p["w_up"]), p["w_down"])


def logits_of(cfg: ModelConfig, params: dict, x_BTd: Array) -> Array:
  h = rms_norm(x_BTd, params["final_norm"], cfg.rms_norm_eps)
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return matmul(h, head).astype(jnp.float32)


def dense_layer(cfg: ModelConfig, p: dict, x_BTd: Array, positions_BT: Array, allowed) -> tuple:
  """One decoder layer with one dense mask ``allowed`` (``[B, T, T]``): the new residual stream
  and the layer's attention probabilities ``[B, Hq, T, T]`` (training and attention maps)."""
  q, k, v = project_qkv(cfg, p, x_BTd, positions_BT)
  probs = attention_probs(q, k, allowed)
  return output_and_mlp(cfg, p, x_BTd, attend(probs, v)), probs


def positions_from_mask(attention_mask_BT: Array) -> Array:
  """HF-style positions of a (left-)padded batch: ``cumsum(mask) - 1``, 0 on padding."""
  return jnp.maximum(jnp.cumsum(attention_mask_BT, -1) - 1, 0).astype(jnp.int32)


def causal_allowed(q_pos_BQ, k_pos_BT, k_valid_BT, q_index_BQ, k_index_BT, sliding_window=None):
  """Which keys each query may see: valid, not in the future (by index), within the window."""
  allowed = k_valid_BT[:, None, :] & (k_index_BT[:, None, :] <= q_index_BQ[:, :, None])
  if sliding_window is not None:
    allowed = allowed & (q_pos_BQ[:, :, None] - k_pos_BT[:, None, :] < sliding_window)
  return allowed


# --------------------------------------------------------------------------- full forward


def forward(
  cfg: ModelConfig,
  params: dict,
  input_ids: Array,
  attention_mask: Array | None = None,
  *,
  block: int = 256,
) -> Array:
  """Full causal forward: logits ``[B, T, V]`` (queries processed in blocks of ``block``)."""
  return prefill(cfg, params, input_ids, attention_mask, block=block, logits="all").logits


LOGITS = ("last", "all")


@struct.dataclass
class Prefill:
  """What one pass over a prompt returns: logits, the full post-RoPE K/V and the evidence.

  Attributes:
    logits: ``[B, 1, V]`` fp32 at the last position (``[B, T, V]`` with ``logits="all"``).
    keys, values: ``[L, B, G, T, D]`` (keys post-RoPE, at their original positions).
    positions, valid: ``[B, T]`` RoPE positions and the non-padding mask.
    key_norms: ``[L, B, G, T]`` (key norm's evidence).
    attn_window: ``[L, B, Hq, W, T]`` fp32, the last ``W`` query rows (no ``T x T`` matrix).
    column_sums: ``[L, B, Hq, T]`` attention received from all valid queries (H2O).
    full_attention: ``{layer: [B, Hq, T, T]}`` for plots, on request.
    future_attn: ``[L, B, Hq, S, T]`` attention of later queries (the oracle's evidence; set by
      the caller that has them).
  """

  logits: Array
  keys: Array
  values: Array
  positions: Array
  valid: Array
  key_norms: Array
  attn_window: Array | None = None
  column_sums: Array | None = None
  full_attention: dict | None = None
  future_attn: Array | None = None


def prefill(
  cfg: ModelConfig,
  params: dict,
  input_ids: Array,
  attention_mask: Array | None = None,
  *,
  window: int = 0,
  column_sums: bool = False,
  full_attention_layers: tuple[int, ...] = (),
  block: int = 256,
  logits: str = "last",
) -> Prefill:
  """One pass over the prompt: a :class:`Prefill` with logits, K/V and the requested evidence.

  ``window`` asks for the last ``window`` query rows, ``column_sums`` for H2O's attention sums
  (accumulated block by block: memory ``O(T * block)``), ``full_attention_layers`` for full
  maps of those layers. ``logits="last"`` (the default) computes the last position's logits
  only (``[B, 1, V]``: all that generation reads; ``[B, T, V]`` fp32 would be 16 GiB at 32k
  tokens and a 128k vocabulary), ``"all"`` every position's.
  """
  if logits not in LOGITS:
    raise ValueError(f"logits: expected one of {LOGITS}, got {logits!r}")
  B, T = input_ids.shape
  if attention_mask is None:
    attention_mask = jnp.ones((B, T), jnp.int32)
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  index = jnp.broadcast_to(jnp.arange(T), (B, T))
  x = params["embed"][input_ids]
  block = min(block, T)
  num_blocks = -(-T // block)

  def layer(x, p):
    q, k, v = project_qkv(cfg, p, x, positions)
    q_pad = jnp.pad(q, ((0, 0), (0, 0), (0, num_blocks * block - T), (0, 0)))

    def one_block(carry, start):
      q_b = jax.lax.dynamic_slice_in_dim(q_pad, start, block, axis=2)
      q_index = start + jnp.broadcast_to(jnp.arange(block), (B, block))
      q_pos = jnp.take_along_axis(positions, jnp.minimum(q_index, T - 1), -1)
      allowed = causal_allowed(q_pos, positions, valid, q_index, index, cfg.sliding_window)
      probs = attention_probs(q_b, k, allowed)
      real = jnp.take_along_axis(valid, jnp.minimum(q_index, T - 1), -1) & (q_index < T)
      probs = jnp.where(real[:, None, :, None], probs, 0.0)
      return carry + probs.sum(-2) if column_sums else carry, attend(probs, v)

    sums0 = jnp.zeros((B, cfg.num_heads, T), jnp.float32)
    sums, outs = jax.lax.scan(one_block, sums0, jnp.arange(num_blocks) * block)
    out = outs.transpose(1, 2, 0, 3, 4).reshape(B, cfg.num_heads, num_blocks * block, -1)[:, :, :T]
    ys = {"keys": k, "values": v}
    if column_sums:
      ys["column_sums"] = sums
    if window:
      q_index = jnp.broadcast_to(jnp.arange(T - window, T), (B, window))
      allowed = causal_allowed(
        positions[:, -window:], positions, valid, q_index, index, cfg.sliding_window
      )
      ys["attn_window"] = attention_probs(q[:, :, -window:], k, allowed)
    return output_and_mlp(cfg, p, x, out), ys

  x, ys = jax.lax.scan(layer, x, stacked(params))
  maps = None
  if full_attention_layers:
    maps = full_attention_maps(cfg, params, input_ids, attention_mask, full_attention_layers)
  return Prefill(
    logits=logits_of(cfg, params, x if logits == "all" else x[:, -1:]),
    positions=positions,
    valid=valid,
    key_norms=jnp.linalg.norm(ys["keys"].astype(jnp.float32), axis=-1),
    full_attention=maps,
    **ys,
  )


def full_attention_maps(cfg, params, input_ids, attention_mask, layers) -> dict:
  """``{layer: [B, Hq, T, T]}`` post-softmax attention of the requested layers (for plots)."""
  B, T = input_ids.shape
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  index = jnp.broadcast_to(jnp.arange(T), (B, T))
  x = params["embed"][input_ids]
  maps = {}
  for layer in range(cfg.num_layers):
    allowed = causal_allowed(positions, positions, valid, index, index, cfg.sliding_window)
    x, probs = dense_layer(cfg, layer_params(params, layer), x, positions, allowed)
    if layer in layers:
      maps[layer] = probs
    if layer >= max(layers):
      break
  return maps
