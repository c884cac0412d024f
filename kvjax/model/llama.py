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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax import policies
from kvjax import scores as scores_lib
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


def check_token_ids(name: str, ids, vocab_size: int, *, min_len: int = 1):
  """Checks a batch of token ids against the one rule shared by every model entry point.

  The rule: an integer dtype (bools refused), two axes ``[B, T]`` with ``B >= 1`` and
  ``T >= min_len``, values in ``[0, vocab_size)`` (an embedding gather would silently clamp
  anything else). Shapes and dtypes are static, so traced ids are checked for them too; their
  values are not known in Python and pass unchecked.

  Args:
    name: the argument's name, for the error.
    ids: token ids (array-like or traced).
    vocab_size: the model's vocabulary size.
    min_len: the fewest positions per row.

  Returns:
    Concrete ids as an int32 numpy array ``[B, T]``; traced ids unchanged.

  Raises:
    ValueError: naming ``name``, the shape, dtype or id and what was expected.
  """
  traced = isinstance(ids, jax.core.Tracer)
  arr = ids if traced else np.asarray(ids)
  if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < min_len:
    raise ValueError(
      f"{name}: expected token ids [batch >= 1, T >= {min_len}], got shape {tuple(arr.shape)}"
    )
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
  if traced:
    return ids
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = int(arr.min() if arr.min() < 0 else arr.max())
    raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
  return arr.astype(np.int32)


def check_context(
  cfg: ModelConfig,
  length: int,
  new: int = 0,
  *,
  name: str = "input_ids",
  new_name: str = "max_new_tokens",
) -> None:
  """Refuses a sequence longer than the model's context (``cfg.max_positions``).

  Positions past the context were never trained and give answers without a warning. Nothing is
  checked when the context is unknown (``None``).

  Args:
    cfg: the model's config.
    length: the prompt's tokens (its longest row).
    new: tokens generated or fed after the prompt (``max_new_tokens``, an answer).
    name: the prompt's argument.
    new_name: the argument that asked for the ``new`` tokens.

  Raises:
    ValueError: when ``length + new > cfg.max_positions``, naming the prompt when it alone is
      too long, else ``new_name`` with the most it may be.
  """
  limit = cfg.max_positions
  if limit is None or length + new <= limit:
    return
  if not new:
    raise ValueError(
      f"{name}: a prompt of {length} tokens is longer than the model's context of {limit} "
      f"positions (max_positions); expected at most {limit} tokens"
    )
  if length >= limit:
    raise ValueError(
      f"{name}: a prompt of {length} tokens leaves no room in the model's context of {limit} "
      f"positions (max_positions) for the {new} tokens of {new_name}; expected a prompt of at "
      f"most {limit - 1} tokens"
    )
  raise ValueError(
    f"{new_name}: {new} tokens after a prompt of {length} tokens make {length + new}, past the "
    f"model's context of {limit} positions (max_positions); expected {new_name} <= "
    f"{limit - length} for this prompt"
  )


# --------------------------------------------------------------------------- building blocks


def matmul(x: Array, w: Array) -> Array:
  """Multiplies ``x @ w`` at :data:`kvjax.scores.PRECISION` (full fp32 on every backend).

  Args:
    x: the left operand.
    w: the right operand.

  Returns:
    The product ``x @ w``.
  """
  return jnp.matmul(x, w, precision=PRECISION)


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


FULL_WINDOW = 2**30  # a global layer's window where a traced layer picks one: never binding


def is_sliding(cfg: ModelConfig) -> np.ndarray:
  """Says which layers attend within ``cfg.sliding_window`` only.

  Args:
    cfg: the model's config.

  Returns:
    bool ``[L]``: every layer when the window is uniform (Mistral, Phi-3), the
    ``"sliding_attention"`` layers of ``cfg.layer_types`` (Gemma 2/3), none without a window.
  """
  if cfg.sliding_window is None:
    return np.zeros(cfg.num_layers, bool)
  if cfg.layer_types is None:
    return np.ones(cfg.num_layers, bool)
  return np.array([t == "sliding_attention" for t in cfg.layer_types])


def layer_window(cfg: ModelConfig, layer=None):
  """Returns the sliding window of one layer, as :func:`causal_allowed` takes it.

  Args:
    cfg: the model's config.
    layer: the layer's index: an int, a traced scalar, or ``None`` when the layers are alike.

  Returns:
    ``None`` (no window), an int, or, for a traced layer of a model whose layers differ, a
    traced int32 that is :data:`FULL_WINDOW` on global layers.

  Raises:
    ValueError: when the layers differ (``cfg.layer_types``) and ``layer`` is ``None``.
  """
  if not cfg.per_layer or cfg.sliding_window is None:
    return cfg.sliding_window
  if layer is None:
    raise ValueError(
      f"layer: the {cfg.family} layers differ in their window (layer_types); pass the layer index"
    )
  sliding = is_sliding(cfg)
  if isinstance(layer, (int, np.integer)):
    return cfg.sliding_window if sliding[layer] else None
  return jnp.where(jnp.asarray(sliding)[layer], cfg.sliding_window, FULL_WINDOW).astype(jnp.int32)


def _default_inv(theta: float, D: int) -> np.ndarray:
  return 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))


def inv_frequencies(cfg: ModelConfig, seq_len: int | None = None, *, local: bool = False):
  """Computes RoPE inverse frequencies ``[D/2]`` (float64 on the host) as transformers does.

  ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` per ``cfg.rope_type``: ``default``;
  ``linear`` (divided by the factor); ``dynamic`` (NTK: the base grows as
  ``(factor * seq_len / max_positions - factor + 1) ** (D / (D - 2))`` once ``seq_len`` passes
  ``max_position_embeddings``); ``yarn`` (interpolated below ``beta_slow`` rotations,
  extrapolated above ``beta_fast``, a linear ramp between); ``longrope`` (divided per frequency
  by ``long_factor`` when ``seq_len`` passes the pretraining context, else ``short_factor``);
  ``llama3`` (Llama 3.1's smoothed band). Gemma 3's sliding layers (``local``) use default
  RoPE at ``cfg.rope_local_theta``.

  Args:
    cfg: the model's config (``head_dim``, ``rope_theta`` and the ``rope_*`` fields).
    seq_len: the sequence length ``dynamic`` and ``longrope`` choose by (``None``: as at
      transformers' init, the unscaled or short set); the other types ignore it.
    local: the sliding layers' frequencies (Gemma 3) rather than the global layers'.

  Returns:
    The inverse frequencies ``[D/2]`` as a float64 numpy array.
  """
  D = cfg.head_dim
  if local and cfg.rope_local_theta is not None:
    return _default_inv(cfg.rope_local_theta, D)
  inv = _default_inv(cfg.rope_theta, D)
  kind = cfg.rope_type
  if kind == "linear":
    return inv / cfg.rope_factor
  if kind == "dynamic":
    return _dynamic_inv(cfg, np, np.float64(max(seq_len or 0, cfg.rope_original_max_positions)))
  if kind == "yarn":
    return _yarn_inv(cfg, inv)
  if kind == "longrope":
    long = seq_len is not None and seq_len > cfg.rope_original_max_positions
    factors = cfg.rope_long_factor if long else cfg.rope_short_factor
    return inv / np.asarray(factors, np.float64)
  if kind == "llama3":
    return _llama3_inv(cfg, inv)
  return inv


def _dynamic_inv(cfg: ModelConfig, xp, seq_len):
  """Dynamic NTK's frequencies at ``seq_len`` (already at least ``max_position_embeddings``),
  with numpy or jax.numpy (``xp``): transformers ``_compute_dynamic_ntk_parameters``."""
  D, factor, old = cfg.head_dim, cfg.rope_factor, cfg.rope_original_max_positions
  base = cfg.rope_theta * ((factor * seq_len / old) - (factor - 1)) ** (D / (D - 2))
  return 1.0 / (base ** (xp.arange(0, D, 2, dtype=seq_len.dtype) / D))


def _yarn_inv(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
  """YaRN's frequencies: transformers ``_compute_yarn_parameters``."""
  D, base, old = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_positions

  def correction_dim(rotations):
    return (D * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, D - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  return inv / cfg.rope_factor * (1 - extrapolation) + inv * extrapolation


def _llama3_inv(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
  """Llama 3.1's frequencies: transformers ``_compute_llama3_parameters``."""
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


def rope_tables(cfg: ModelConfig, *, layer=None, seq_len=None) -> tuple[Array, Array | float]:
  """Returns the inverse frequencies and the cos/sin scale one layer rotates with, inside ``jit``.

  ``dynamic`` and ``longrope`` choose by ``seq_len`` (transformers' ``dynamic_rope_update``:
  ``max(position_ids) + 1`` of the forward pass); yarn and longrope scale cos and sin by
  ``cfg.rope_attention_factor``. A model whose layers differ (Gemma 3) picks the sliding or
  global layers' tables by ``layer``.

  Args:
    cfg: the model's config.
    layer: the layer's index (int or traced); needed when ``cfg.layer_types`` is set.
    seq_len: a scalar (int or traced), the sequence length the frequencies are chosen for;
      ``None`` where the type does not read it.

  Returns:
    ``(inv_freq [D/2] fp32, scale)``: ``scale`` a Python float unless layers differ in it.

  Raises:
    ValueError: when the layers differ and ``layer`` is ``None``.
  """
  if cfg.per_layer and layer is None:
    raise ValueError(
      f"layer: the {cfg.family} layers differ in RoPE or window (layer_types); pass the layer index"
    )
  inv, scale = _global_tables(cfg, seq_len)
  if cfg.rope_local_theta is None:
    return inv, scale
  local = jnp.asarray(inv_frequencies(cfg, local=True), jnp.float32)
  sliding = np.array([t == "sliding_attention" for t in cfg.layer_types])  # whatever the window
  if isinstance(layer, (int, np.integer)):
    return (local, 1.0) if sliding[layer] else (inv, scale)
  pick = jnp.asarray(sliding)[layer]
  return jnp.where(pick, local, inv), jnp.where(pick, 1.0, scale)


def _global_tables(cfg: ModelConfig, seq_len) -> tuple[Array, float]:
  scale = cfg.rope_attention_factor
  if cfg.rope_type == "dynamic" and seq_len is not None:
    n = jnp.maximum(jnp.asarray(seq_len, jnp.float32), cfg.rope_original_max_positions)
    return _dynamic_inv(cfg, jnp, n).astype(jnp.float32), scale
  if cfg.rope_type == "longrope" and seq_len is not None:
    short = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    long = jnp.asarray(inv_frequencies(cfg, cfg.rope_original_max_positions + 1), jnp.float32)
    return jnp.where(seq_len > cfg.rope_original_max_positions, long, short), scale
  return jnp.asarray(inv_frequencies(cfg), jnp.float32), scale


def rope(
  x_BHTD: Array, positions_BT: Array, cfg: ModelConfig, *, layer=None, seq_len=None
) -> Array:
  """Applies the rotary embedding to heads ``[B, N, T, D]`` at per-row positions ``[B, T]``.

  Args:
    x_BHTD: heads ``[B, N, T, D]``.
    positions_BT: RoPE positions ``[B, T]``, shared by every head of a row.
    cfg: the model's config.
    layer: the layer's index (:func:`rope_tables`).
    seq_len: the length ``dynamic`` and ``longrope`` choose by (``None``:
      ``max(positions) + 1``, as transformers does per forward pass).

  Returns:
    The rotated heads ``[B, N, T, D]``.
  """
  positions = jnp.broadcast_to(positions_BT[:, None], x_BHTD.shape[:-1])
  return rope_at(x_BHTD, positions, cfg, layer=layer, seq_len=seq_len)


def rope_at(
  x: Array,
  positions: Array,
  cfg: ModelConfig,
  *,
  layer=None,
  seq_len=None,
  scaled: bool = True,
  inverse: bool = False,
) -> Array:
  """Applies the rotary embedding to ``x [..., C, D]`` at ``positions [..., C]`` (any leading axes).

  Negative positions rotate back: ``rope_at(rope_at(x, p), -p) == x`` when cos and sin are
  unscaled. yarn and longrope scale both by ``cfg.rope_attention_factor``; ``inverse=True``
  undoes ``rope_at(x, p)`` exactly for every type (rotates by ``-p`` with the frequencies ``p``
  was rotated with, and divides the scale out).

  Args:
    x: vectors ``[..., C, D]``.
    positions: their positions ``[..., C]``.
    cfg: the model's config.
    layer: the layer's index (:func:`rope_tables`; needed when ``cfg.layer_types`` is set).
    seq_len: the length ``dynamic`` and ``longrope`` choose by (``None``:
      ``max(|positions|) + 1``, the forward pass's choice for those positions).
    scaled: whether cos and sin carry the attention factor (transformers' ``attention_scaling``).
    inverse: undo the rotation at ``positions`` instead of applying it.

  Returns:
    The rotated vectors ``[..., C, D]`` in ``x``'s dtype.
  """
  if seq_len is None and cfg.rope_type in ("dynamic", "longrope"):
    seq_len = jnp.max(jnp.abs(positions)) + 1
  inv, scale = rope_tables(cfg, layer=layer, seq_len=seq_len)
  angles = positions.astype(jnp.float32)[..., None] * inv.reshape((1,) * positions.ndim + (-1,))
  if inverse:
    angles = -angles
  angles = jnp.concatenate([angles, angles], -1)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scaled and not (isinstance(scale, float) and scale == 1.0):
    factor = 1.0 / scale if inverse else scale
    cos, sin = cos * factor, sin * factor
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


# parameters outside the layer stack (everything else is stacked over a leading layer axis)
UNSTACKED = ("embed", "final_norm", "lm_head")


def stacked(params: dict) -> dict:
  """Selects the per-layer parameters, each ``[L, ...]``: what the layer scan iterates over.

  Args:
    params: the parameter pytree.

  Returns:
    The parameters other than :data:`UNSTACKED` (``embed``, ``final_norm``, ``lm_head``).
  """
  return {
    k: jnp.stack(v) if isinstance(v, tuple) else v for k, v in params.items() if k not in UNSTACKED
  }


def unstacked_params(params: dict) -> dict:
  """Splits each per-layer parameter into a tuple of its ``L`` layers' arrays.

  An unrolled layer loop reads layer ``l``'s arrays as they are; slicing the stacked ``[L, ...]``
  arrays copies them on XLA:CPU (``kvjax.model.cache.per_layer`` uses this form for a loop of
  decode steps). :func:`layer_params` and :func:`stacked` read either form.

  Args:
    params: the parameter pytree (stacked, or already split).

  Returns:
    The parameters, each of :func:`stacked`'s a tuple of ``L`` arrays.
  """
  return {
    k: v if k in UNSTACKED or isinstance(v, tuple) else tuple(v[l] for l in range(v.shape[0]))
    for k, v in params.items()
  }


def layer_params(params: dict, layer) -> dict:
  """Slices one layer out of the stacked parameters.

  Args:
    params: the parameter pytree (stacked, or split by :func:`unstacked_params`, then ``layer``
      an int).
    layer: the layer's index (an int or a traced scalar).

  Returns:
    The layer's parameters, each without the leading ``L`` axis.
  """
  return {k: v[layer] for k, v in stacked(params).items()}


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


def attention_probs(
  q_BHQD, k_BGTD, allowed, *, head_dim: int | None = None, softcap: float | None = None
) -> Array:
  """Computes the fp32 softmax of ``q k^T / sqrt(D)`` over allowed keys (GQA grouped).

  Fully masked rows give zeros.

  Args:
    q_BHQD: queries ``[B, Hq, Q, D]``.
    k_BGTD: keys grouped by KV head ``[B, G, K, D]``.
    allowed: ``[B, Q, K]`` (shared by every head: prefill) or ``[B, G, Q, K]`` (per KV head: a
      compressed cache, whose rows hold different slots).
    head_dim: the ``D`` of the scale when the channels given are fewer (ThinK's pruned keys: the
      dropped channels add 0 to ``q k^T``, the scale stays the model's); ``None``: the keys'.
    softcap: Gemma 2's attention soft-capping (``cfg.attn_softcap``; :func:`softcap_logits`).

  Returns:
    fp32 probabilities ``[B, Hq, Q, K]``.
  """
  logits = attention_logits(q_BHQD, k_BGTD, head_dim=head_dim, softcap=softcap)
  return masked_softmax(logits, allowed)


def attention_logits(
  q_BHQD, k_BGTD, *, head_dim: int | None = None, softcap: float | None = None
) -> Array:
  """Computes fp32 attention logits ``q k^T / sqrt(head_dim or D)`` grouped by KV head.

  Args:
    q_BHQD: queries ``[B, Hq, Q, D]``.
    k_BGTD: keys ``[B, G, K, D]``.
    head_dim: the ``D`` of the scale (``None``: the queries' last axis).
    softcap: Gemma 2's attention soft-capping (:func:`softcap_logits`); ``None``: none.

  Returns:
    fp32 logits ``[B, G, Hq / G, Q, K]``.
  """
  B, Hq, Q, D = q_BHQD.shape
  G = k_BGTD.shape[1]
  q = q_BHQD.astype(jnp.float32).reshape(B, G, Hq // G, Q, D)
  logits = jnp.einsum("bgrqd,bgkd->bgrqk", q, k_BGTD.astype(jnp.float32), precision=PRECISION)
  return softcap_logits(logits / math.sqrt(D if head_dim is None else head_dim), softcap)


def softcap_logits(logits: Array, cap: float | None) -> Array:
  """Soft-caps logits to ``(-cap, cap)``: ``cap * tanh(logits / cap)`` (HF Gemma 2's
  ``attn_logit_softcapping`` and ``final_logit_softcapping``).

  Args:
    logits: fp32 logits, any shape.
    cap: the cap; ``None`` leaves the logits unchanged.

  Returns:
    The capped logits.
  """
  if cap is None:
    return logits
  return jnp.tanh(logits / cap) * cap


def masked_softmax(logits_BGRQK: Array, allowed) -> Array:
  """Computes :func:`attention_probs`'s softmax of grouped logits over allowed keys.

  Args:
    logits_BGRQK: grouped logits ``[B, G, R, Q, K]`` (:func:`attention_logits`).
    allowed: ``[B, Q, K]`` or ``[B, G, Q, K]`` bool mask of the keys each query may see.

  Returns:
    fp32 probabilities ``[B, Hq, Q, K]``; zeros for rows with no allowed key.
  """
  B, G, R, Q, K = logits_BGRQK.shape
  allowed = allowed[:, None] if allowed.ndim == 3 else allowed
  allowed = allowed[:, :, None]  # [B, G or 1, 1, Q, K]
  logits = jnp.where(allowed, logits_BGRQK, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(allowed.any(-1, keepdims=True), probs, 0.0)
  return probs.reshape(B, G * R, Q, K)


def attend(probs_BHQT: Array, v_BGTD: Array) -> Array:
  """Computes the attention output from probabilities and grouped values.

  Args:
    probs_BHQT: attention probabilities ``[B, Hq, Q, K]``.
    v_BGTD: values grouped by KV head ``[B, G, K, D]``.

  Returns:
    fp32 attention output ``[B, Hq, Q, D]``.
  """
  B, Hq, Q, K = probs_BHQT.shape
  G = v_BGTD.shape[1]
  p = probs_BHQT.reshape(B, G, Hq // G, Q, K)
  out = jnp.einsum("bgrqk,bgkd->bgrqd", p, v_BGTD.astype(jnp.float32), precision=PRECISION)
  return out.reshape(B, Hq, Q, -1)


def segments_attention(q_BHQD, segments, *, probs_of_first=False, softcap=None):
  """Attends ``Q`` queries over several key segments with one softmax over all of them.

  The same attention as :func:`attention_logits`, :func:`masked_softmax` then :func:`attend` over
  the concatenated segments (a query with no allowed key gives 0), up to float rounding, in 0.6x
  their time on XLA:CPU with few queries (a question fed after a compressed cache: 27 vs 45 ms
  per layer for 4 x 8 caches of 1026 slots and 18 queries), because:

  * the logits are computed as ``k q^T`` (``[B, G, C, R Q]``; XLA:CPU's batched matmul runs it
    2.3x faster than ``q k^T`` when the queries are few), then transposed;
  * the segments are never concatenated: the softmax's maximum and normaliser are combined
    across them and each segment's values are weighted by its own part.

  Args:
    q_BHQD: queries ``[B, Hq, Q, D]``.
    segments: a sequence of ``(keys [B, G, C_i, D], values [B, G, C_i, D], allowed
      [B, G, Q, C_i])``, grouped by KV head (query head ``h`` reads group ``h // (Hq / G)``).
    probs_of_first: whether to return the probabilities over the first segment.
    softcap: Gemma 2's attention soft-capping (:func:`softcap_logits`); ``None``: none.

  Returns:
    ``(out [B, Hq, Q, D], probs [B, Hq, Q, C] over the first segment, or None)``, fp32.
  """
  B, Hq, Q, D = q_BHQD.shape
  G = segments[0][0].shape[1]
  R = Hq // G
  q = q_BHQD.astype(jnp.float32).reshape(B, G, R * Q, D) / math.sqrt(D)
  logits = []
  for k, _, allowed in segments:
    k_logits = jnp.einsum("bgnd,bgkd->bgkn", q, k.astype(jnp.float32), precision=PRECISION)
    k_logits = softcap_logits(k_logits, softcap)
    C = k.shape[2]
    allowed = jnp.broadcast_to(allowed[:, :, None], (B, G, R, Q, C)).reshape(B, G, R * Q, C)
    logits.append(jnp.where(allowed, jnp.swapaxes(k_logits, 2, 3), -jnp.inf))
  top = functools.reduce(jnp.maximum, [x.max(-1, keepdims=True) for x in logits])
  top = jnp.where(jnp.isneginf(top), 0.0, top)  # no allowed key: every exp is 0
  exps = [jnp.exp(x - top) for x in logits]
  norm = sum(e.sum(-1, keepdims=True) for e in exps)
  scale = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
  out = sum(
    jnp.einsum("bgnk,bgkd->bgnd", e, v.astype(jnp.float32), precision=PRECISION)
    for e, (_, v, _) in zip(exps, segments, strict=True)
  )
  first = (exps[0] * scale).reshape(B, Hq, Q, -1) if probs_of_first else None
  return (out * scale).reshape(B, Hq, Q, D), first


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
    head_b, start = _sliced_in_loop(head, jnp.minimum(i * size, V - size))
    part = _head_matmul(h_BTd, jax.lax.dynamic_slice_in_dim(head_b, start, size, axis), tied)
    return jax.lax.dynamic_update_slice_in_dim(out, part, start, 2)

  out = jnp.zeros((B, T, V), jnp.result_type(h_BTd, head))
  return jax.lax.fori_loop(0, -(-V // size), chunk, out)


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


def positions_from_mask(attention_mask_BT: Array) -> Array:
  """Computes HF-style positions of a (left-)padded batch: ``cumsum(mask) - 1``, 0 on padding.

  Args:
    attention_mask_BT: the 0/1 mask ``[B, T]`` of the real tokens.

  Returns:
    int32 positions ``[B, T]``.
  """
  return jnp.maximum(jnp.cumsum(attention_mask_BT, -1) - 1, 0).astype(jnp.int32)


def causal_allowed(q_pos_BQ, k_pos_BT, k_valid_BT, q_index_BQ, k_index_BT, sliding_window=None):
  """Says which keys each query may see: valid, not in the future (by index), within the window.

  Args:
    q_pos_BQ: the queries' RoPE positions ``[B, Q]``.
    k_pos_BT: the keys' RoPE positions ``[B, T]``.
    k_valid_BT: the keys' validity ``[B, T]``.
    q_index_BQ: the queries' indices in the sequence ``[B, Q]``.
    k_index_BT: the keys' indices in the sequence ``[B, T]``.
    sliding_window: the model's sliding window (``None``: none).

  Returns:
    A bool mask ``[B, Q, T]``.
  """
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


LOGITS = ("last", "all")
CHUNK = 2048  # prefill tokens per chunk: bounds the [B, chunk, F] MLP activations
ATTENTION = ("blocked", "xla", "cudnn")  # prefill's kernels for the attention output
NO_EVIDENCE = policies.EvidenceRequest()  # logits, keys and values only


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """How :func:`prefill` computes: its memory plan and kernels (static, hashable). None of these
  changes a value beyond rounding, but ``window_dtype`` stores the window rows narrower.

  Attributes:
    block: queries (and keys) per attention tile.
    chunk: prompt tokens per chunk of each layer (``None``: all at once).
    attention: the kernel of the attention output, one of :data:`ATTENTION`.
    window_dtype: the floating dtype the window rows are stored in.
  """

  block: int = 256
  chunk: int | None = CHUNK
  attention: str = "blocked"
  window_dtype: Any = jnp.float32


@struct.dataclass
class Prefill:
  """What one pass over a prompt returns: logits, the full post-RoPE K/V and the evidence.

  Attributes:
    logits: ``[B, 1, V]`` fp32 at the last position (``[B, T, V]`` with ``logits="all"``).
    keys, values: ``[L, B, G, T, D]`` (keys post-RoPE, at their original positions).
    positions, valid: ``[B, T]`` RoPE positions and the non-padding mask.
    key_norms: ``[L, B, G, T]`` (key norm's evidence).
    attn_window: ``[L, B, Hq, W, T]`` fp32 (or the plan's ``window_dtype``), the last ``W``
      query rows (no ``T x T`` matrix).
    window_scores: ``[L, B, Hq, T]`` fp32, the window rows already reduced to a policy's scores
      inside the layer scan (prefill's ``window_scores``; then ``attn_window`` is ``None``).
    window: ``W``, the observation queries behind ``attn_window`` or ``window_scores``
      (static; 0 when none were asked for).
    column_sums: ``[L, B, Hq, T]`` attention received from all valid queries (H2O).
    full_attention: ``{layer: [B, Hq, T, T]}`` for plots, on request.
    future_attn: ``[L, B, Hq, S, T]`` attention of later queries (the oracle's evidence; set by
      the caller that has them).
    value_out_norms: ``[L, B, Hq, T]`` fp32 CriticalKV's ``||W_O^h v_j||_1`` per query head, on
      request (0 on padding).
    query_mean, query_cov: ``[L, B, Hq, D]``, ``[L, B, Hq, D, D]`` fp32 ExpectedAttention's
      statistics of the pre-RoPE prompt queries, on request (:func:`query_statistics`).
    window_queries: ``[L, B, Hq, W, D]`` the last ``W`` post-RoPE queries (ThinK), on request.
    prerope_keys: ``[L, B, G, T, D]`` the keys before RoPE (leverage scores), on request.
    queries: ``[L, B, Hq, T, D]`` every position's post-RoPE queries (non-causal attention), on
      request.
  """

  logits: Array
  keys: Array
  values: Array
  positions: Array
  valid: Array
  key_norms: Array
  attn_window: Array | None = None
  window_scores: Array | None = None
  window: int = struct.field(pytree_node=False, default=0)
  column_sums: Array | None = None
  full_attention: dict | None = None
  future_attn: Array | None = None
  value_out_norms: Array | None = None
  query_mean: Array | None = None
  query_cov: Array | None = None
  window_queries: Array | None = None
  prerope_keys: Array | None = None
  queries: Array | None = None


def prefill(
  cfg: ModelConfig,
  params: dict,
  input_ids: Array,
  attention_mask: Array | None = None,
  request: policies.EvidenceRequest = NO_EVIDENCE,
  *,
  full_attention_layers: tuple[int, ...] = (),
  logits: str = "last",
  plan: PrefillPlan = PrefillPlan(),
) -> Prefill:
  """Runs one pass over the prompt, giving logits, K/V and the requested evidence.

  ``request`` (a :class:`kvjax.policies.EvidenceRequest`, static under ``jit``: what
  :meth:`kvjax.policies.Policy.evidence_request` asks for, or several policies' requests merged
  with ``|``) says which evidence to compute besides logits, keys and values; the default
  computes none. ``full_attention_layers`` asks for full maps of those layers.
  ``logits="last"`` (the default) computes the last position's logits only (``[B, 1, V]``: all
  that generation reads; ``[B, T, V]`` fp32 would be 16 GiB at 32k tokens and a 128k
  vocabulary), ``"all"`` every position's.

  ``plan`` (a :class:`PrefillPlan`) sets how it computes. Memory is bounded by two blockings,
  neither of which changes a value (fp32 softmax, exact to rounding). Each layer runs over the
  prompt ``chunk`` tokens at a time (``None``: all at once):
  projections, attention output and MLP of a chunk, its keys and values written in place, so
  the ``[B, chunk, F]`` MLP intermediates are the largest activations. Attention is tiled
  flash-style into ``block`` queries x ``block`` keys, skipping the tiles above the causal
  diagonal and, with ``cfg.sliding_window``, those behind the window. Without column sums
  (``request.column_sums``, H2O's) one pass with an online softmax gives the output; with them
  a first pass finds each query's normaliser and a second forms the normalised rows tile by
  tile, adding them into the column sums and the output. The window rows (the last
  ``request.window`` queries over all ``T`` keys) are written tile by tile into their
  ``[L, B, Hq, W, T]`` output, in ``window_dtype`` (fp32 by default; ``jnp.bfloat16`` halves
  the largest output, 8 GiB at 128k tokens for a 1B model, after an fp32 softmax).

  ``request.window_scores`` (a hashable callable, for example
  :meth:`kvjax.policies.Policy.window_scorer`) reduces each layer's window rows
  ``[B, Hq, W, T]`` (fp32, whatever ``window_dtype``) to scores ``[B, Hq, T]`` inside the layer
  scan, when the caller needs only a policy's scores: the output is ``window_scores``
  ``[L, B, Hq, T]`` and no ``attn_window`` (``W`` times smaller; the rows of one layer are the
  largest temporary).

  ``attention`` picks the kernel of the attention *output* when no column sums are asked for
  (with them, the exact second pass forms the output anyway): ``"blocked"`` (the tiles above),
  ``"xla"`` or ``"cudnn"`` (:func:`jax.nn.dot_product_attention` per chunk over all ``T`` keys
  with an explicit ``[B, 1, chunk, T]`` mask, in the model dtype; ``"cudnn"`` falls back to
  ``"blocked"`` off GPU or outside fp16/bf16). The evidence is computed exactly beside it. On
  CPU ``"xla"`` measured worse (1B shapes at 8k tokens: 6.3 GiB of temporaries against 0.4;
  2.3x slower at 2k tokens), hence the default.

  Evidence of issue 15's methods, each off by default (the memory plan above is unchanged):
  ``request.value_out_norms`` (CriticalKV's ``||W_O^h v_j||_1``, a head at a time,
  ``[L, B, Hq, T]``), ``request.query_stats`` (ExpectedAttention's query mean and covariance,
  accumulated chunk by chunk: :func:`query_statistics`; ``request.n_sink`` and
  ``request.n_future`` as kvpress's ``n_sink`` and ``n_future_positions``) and
  ``request.window_queries`` (the last ``window_queries`` post-RoPE queries, ThinK's channel
  evidence), ``request.prerope_keys`` (the keys before RoPE, ``[L, B, G, T, D]``) and
  ``request.queries`` (every position's post-RoPE queries, ``[L, B, Hq, T, D]``: as large as
  the keys times ``Hq / G``).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    input_ids: token ids ``[B, T]``.
    attention_mask: optional ``[B, T]`` 0/1 mask of the real tokens (left padding); ``None``:
      every token is real.
    request: the evidence to compute besides logits, keys and values.
    full_attention_layers: layers whose full ``[B, Hq, T, T]`` attention maps to return.
    logits: ``"last"`` or ``"all"`` positions' logits (:data:`LOGITS`).
    plan: the memory plan and kernels (:class:`PrefillPlan`: ``block``, ``chunk``,
      ``attention``, ``window_dtype``).

  Returns:
    A :class:`Prefill` with the logits, the post-RoPE keys and values, positions, validity and
    the requested evidence.

  Raises:
    ValueError: for ids breaking :func:`check_token_ids`'s rule (traced ids: their shape and
      dtype), a prompt longer than the model's context (:func:`check_context`), and arguments
      of the wrong kind.
  """
  if logits not in LOGITS:
    raise ValueError(f"logits: expected one of {LOGITS}, got {logits!r}")
  if not isinstance(plan, PrefillPlan):
    raise ValueError(f"plan: expected a kvjax.model.llama.PrefillPlan, got {plan!r}")
  block, chunk, attention, window_dtype = plan.block, plan.chunk, plan.attention, plan.window_dtype
  input_ids = check_token_ids("input_ids", input_ids, cfg.vocab_size)
  B, T = input_ids.shape
  check_context(cfg, T)
  _check_count("block", block)
  if chunk is not None:
    _check_count("chunk", chunk, "None or a positive int")
  if isinstance(attention_mask, policies.EvidenceRequest):
    raise ValueError("attention_mask: got an EvidenceRequest; pass it as request=")
  if not isinstance(request, policies.EvidenceRequest):
    raise ValueError(f"request: expected a kvjax.policies.EvidenceRequest, got {request!r}")
  window, window_queries = request.window, request.window_queries
  window_scores, query_stats = request.window_scores, request.query_stats
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 0 <= window <= T:
    raise ValueError(f"window: expected an int in [0, T={T}], got {window!r}")
  if not jnp.issubdtype(jnp.dtype(window_dtype), jnp.floating):
    raise ValueError(f"window_dtype: expected a floating dtype, got {window_dtype!r}")
  if window_scores is not None and (not callable(window_scores) or not window):
    raise ValueError(
      f"window_scores: expected a callable reducing window rows, with window >= 1; got "
      f"{window_scores!r} with window={window!r}"
    )
  if attention not in ATTENTION:
    raise ValueError(f"attention: expected one of {ATTENTION}, got {attention!r}")
  if (
    isinstance(window_queries, bool)
    or not isinstance(window_queries, (int, np.integer))
    or not 0 <= window_queries <= T
  ):
    raise ValueError(f"window_queries: expected an int in [0, T={T}], got {window_queries!r}")
  for name in ("column_sums", "value_out_norms", "query_stats", "prerope_keys", "queries"):
    if not isinstance(getattr(request, name), bool):
      raise ValueError(f"{name}: expected a bool, got {getattr(request, name)!r}")
  n_sink, n_future = request.n_sink, request.n_future
  if query_stats:
    _check_count("n_future", n_future)
    if isinstance(n_sink, bool) or not isinstance(n_sink, (int, np.integer)) or n_sink < 0:
      raise ValueError(f"n_sink: expected an int >= 0, got {n_sink!r}")
  if attention_mask is None:
    attention_mask = jnp.ones((B, T), jnp.int32)
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  x = embed_tokens(cfg, params, input_ids)
  sizes = dict(
    block=min(block, T),
    chunk=T if chunk is None else min(chunk, T),
    window=window,
    window_queries=window_queries,
    n_sink=n_sink if query_stats else None,
    window_scores=window_scores,
  )
  q_dtype, kv_dtype = _qkv_dtypes(cfg, params, x, positions)
  if attention == "cudnn" and (
    jax.default_backend() != "gpu" or q_dtype not in (jnp.bfloat16, jnp.float16)
  ):
    attention = "blocked"  # cuDNN's flash attention runs on NVIDIA GPUs in fp16/bf16 only
  if cfg.attn_softcap is not None:
    attention = "blocked"  # jax.nn.dot_product_attention has no soft-capping
  sizes["attention"] = attention
  L, G, Hq, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
  out = {
    "keys": jnp.zeros((L, B, G, T, D), kv_dtype),
    "values": jnp.zeros((L, B, G, T, D), kv_dtype),
    "key_norms": jnp.zeros((L, B, G, T), jnp.float32),
  }
  if request.column_sums:
    out["column_sums"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  if window and window_scores is not None:
    out["window_scores"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  elif window:
    out["attn_window"] = jnp.zeros((L, B, Hq, window, T), window_dtype)
  if window_queries:
    out["window_queries"] = jnp.zeros((L, B, Hq, window_queries, D), q_dtype)
  if request.prerope_keys:
    out["prerope_keys"] = jnp.zeros((L, B, G, T, D), kv_dtype)
  if request.queries:
    out["queries"] = jnp.zeros((L, B, Hq, T, D), q_dtype)
  if request.value_out_norms:
    out["value_out_norms"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  if query_stats:
    out["query_mean"] = jnp.zeros((L, B, Hq, D), jnp.float32)
    out["query_cov"] = jnp.zeros((L, B, Hq, D, D), jnp.float32)
    if not cfg.per_layer:  # else each layer's own (Gemma 3's sliding layers rotate differently)
      out["rope_mean"] = average_rope(cfg, valid.sum(-1), n_future)
  if query_stats and cfg.per_layer:
    sizes["n_future"] = n_future
  # dynamic and longrope RoPE choose by the longest row, as transformers' forward pass does
  seq_len = jnp.max(positions) + 1 if cfg.rope_type in ("dynamic", "longrope") else None

  def layer(carry, l):
    layers, l = _sliced_in_loop(stacked(params), l)
    p = {k: v[l] for k, v in layers.items()}
    return _layer(cfg, p, l, *carry, positions, valid, q_dtype, seq_len, **sizes), None

  (x, out), _ = jax.lax.scan(layer, (x, out), jnp.arange(L))
  out.pop("rope_mean", None)
  maps = None
  if full_attention_layers:
    maps = full_attention_maps(cfg, params, input_ids, attention_mask, full_attention_layers)
  return Prefill(
    logits=logits_of(cfg, params, x if logits == "all" else x[:, -1:]),
    positions=positions,
    valid=valid,
    full_attention=maps,
    window=window,
    **out,
  )


def _check_count(name: str, value, expected: str = "a positive int") -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def kv_itemsize(cfg: ModelConfig, params: dict) -> int:
  """Returns the bytes per element of the keys and values the model caches (its projections' dtype).

  Args:
    cfg: the model's config.
    params: its parameter pytree.

  Returns:
    The itemsize of :func:`project_qkv`'s keys, found without computing anything.
  """
  x = jnp.zeros((1, 1, cfg.hidden_size), params["embed"].dtype)
  return jnp.dtype(_qkv_dtypes(cfg, params, x, jnp.zeros((1, 1), jnp.int32))[1]).itemsize


def _qkv_dtypes(cfg: ModelConfig, params: dict, x_BTd: Array, positions_BT: Array):
  """The dtypes :func:`project_qkv` gives queries and keys/values (the model's)."""
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  p = {k: spec(v[0]) for k, v in stacked(params).items()}
  q, k, _ = jax.eval_shape(
    lambda p, x, pos: project_qkv(cfg, p, x, pos, layer=0),
    p,
    spec(x_BTd[:, :1]),
    spec(positions_BT[:, :1]),
  )
  return q.dtype, k.dtype


def _sliced_in_loop(tree, index):
  """``tree`` and ``index`` through an optimisation barrier on CPU, before a loop body slices
  the tree at the index. XLA's CPU backend computes 16-bit math in fp32 and converts a
  loop-invariant operand *before* the loop would slice it (an fp32 copy of every layer's weights
  at once: 4.6 GiB for a 1B model in bf16); behind the barrier the conversion fuses into the
  slice, one layer (or vocabulary chunk) at a time. Elsewhere it is the identity."""
  if jax.default_backend() != "cpu":
    return tree, index
  return jax.lax.optimization_barrier((tree, index))


def _is_16bit_float(a: Array) -> bool:
  return jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 2


@struct.dataclass
class _Rows:
  """A tile's queries: indices and RoPE positions ``[B, Q]``; ``real`` (``[B, Q]`` or None)
  marks the rows that count (valid queries of the chunk), the others get zero attention."""

  index: Array
  pos: Array
  real: Array | None


def _layer(
  cfg,
  p,
  l,
  x,
  out,
  positions,
  valid,
  q_dtype,
  seq_len,
  *,
  block,
  chunk,
  window,
  window_queries,
  n_sink,
  attention,
  window_scores,
  n_future=None,
):
  """One decoder layer over the whole prompt, ``chunk`` tokens at a time (residual stream, K/V
  and the per-token evidence updated in place), then its window rows (or their scores) and
  query statistics."""
  B, T, _ = x.shape
  Hq, D = cfg.num_heads, cfg.head_dim
  sums = jnp.zeros((B, Hq, T), jnp.float32) if "column_sums" in out else None
  wq = max(window, window_queries)
  q_win = jnp.zeros((B, Hq, wq, D), q_dtype) if wq else None
  moments = empty_moments(B, Hq, D) if n_sink is not None else None
  step = _chunk_step(cfg, p, l, positions, valid, block, attention, n_sink, seq_len)
  full, tail = divmod(T, chunk)
  state = (x, out, sums, q_win, moments)
  state = jax.lax.fori_loop(0, full, lambda i, s: step(i * chunk, chunk, s), state)
  if tail:
    state = step(full * chunk, tail, state)
  x, out, sums, q_win, moments = state
  put = lambda name, value: jax.lax.dynamic_update_index_in_dim(out[name], value, l, 0)  # noqa: E731
  if sums is not None:
    out = dict(out, column_sums=put("column_sums", sums))
  if window_queries:
    out = dict(out, window_queries=put("window_queries", q_win[:, :, wq - window_queries :]))
  if moments is not None:
    R = out["rope_mean"] if n_future is None else average_rope(cfg, valid.sum(-1), n_future, l)
    mean, cov = rotate_moments(R, *moments_mean_cov(moments))
    out = dict(out, query_mean=put("query_mean", mean), query_cov=put("query_cov", cov))
  if window:
    q = q_win[:, :, wq - window :]
    if window_scores is None:
      rows = _window_rows(cfg, q, out, l, out["attn_window"], l, positions, valid, block)
      out = dict(out, attn_window=rows)
    else:  # this layer's rows only, reduced before the next layer's are formed
      rows = jnp.zeros((1, B, Hq, window, T), jnp.float32)
      rows = _window_rows(cfg, q, out, l, rows, 0, positions, valid, block)
      out = dict(out, window_scores=put("window_scores", window_scores(rows[0])))
  return x, out


def _chunk_step(cfg, p, l, positions, valid, block, attention, n_sink=None, seq_len=None):
  """``step(c0, n, state)``: tokens ``[c0, c0 + n)`` of one layer (``n`` static)."""
  T = positions.shape[1]
  window = layer_window(cfg, l)

  def step(c0, n, state):
    x, out, sums, q_win, moments = state
    x_c = jax.lax.dynamic_slice_in_dim(x, c0, n, 1)
    pos_c = jax.lax.dynamic_slice_in_dim(positions, c0, n, 1)
    q_pre, k_pre, v = project_heads(cfg, p, x_c)
    at = dict(layer=l, seq_len=seq_len)
    q, k = rope(q_pre, pos_c, cfg, **at), rope(k_pre, pos_c, cfg, **at)
    k, v = k.astype(out["keys"].dtype), v.astype(out["values"].dtype)
    at = (l, 0, 0, c0, 0)
    out = dict(
      out,
      keys=jax.lax.dynamic_update_slice(out["keys"], k[None], at),
      values=jax.lax.dynamic_update_slice(out["values"], v[None], at),
      key_norms=jax.lax.dynamic_update_slice(
        out["key_norms"], jnp.linalg.norm(k.astype(jnp.float32), axis=-1)[None], at[:4]
      ),
    )
    if "prerope_keys" in out:
      k_pre = k_pre.astype(out["prerope_keys"].dtype)[None]
      out = dict(out, prerope_keys=jax.lax.dynamic_update_slice(out["prerope_keys"], k_pre, at))
    if "queries" in out:
      q_all = q.astype(out["queries"].dtype)[None]
      out = dict(out, queries=jax.lax.dynamic_update_slice(out["queries"], q_all, at))
    real_c = jax.lax.dynamic_slice_in_dim(valid, c0, n, 1)
    if "value_out_norms" in out:
      norms = jnp.where(real_c[:, None], value_out_norms(cfg, p, v), 0.0)
      out = dict(
        out,
        value_out_norms=jax.lax.dynamic_update_slice(out["value_out_norms"], norms[None], at[:4]),
      )
    if moments is not None:  # the row's real tokens after its first n_sink (left padding)
      moments = update_moments(moments, q_pre, real_c & (pos_c >= n_sink))
    keys = _Keys(out["keys"], out["values"], positions, valid, l, min(block, T))
    if attention == "blocked" or sums is not None:
      o, sums = _attend_chunk(q, c0, n, keys, sums, block, window, cfg.attn_softcap)
    else:
      o = _fused_chunk(q, c0, n, keys, window, attention)
    x = jax.lax.dynamic_update_slice_in_dim(x, output_and_mlp(cfg, p, x_c, o), c0, 1)
    if q_win is not None:  # the window's queries, wherever they fall in this chunk
      rows = T - q_win.shape[2] + jnp.arange(q_win.shape[2]) - c0
      inside = ((rows >= 0) & (rows < n)).reshape(1, 1, -1, 1)
      q_win = jnp.where(inside, jnp.take(q, jnp.clip(rows, 0, n - 1), axis=2), q_win)
    return x, out, sums, q_win, moments

  return step


# --------------------------------------------------------------------------- issue 15's evidence


def value_out_norms(cfg: ModelConfig, p: dict, v_BGTD: Array) -> Array:
  """Computes CriticalKV's ``||W_O^h v_j||_1`` per query head, fp32.

  Each query head's slice of ``o_proj`` is applied to the values of its KV head (kvpress
  ``CriticalKVPress.vwl1norm`` before its group mean; no ``o_proj`` bias), one head at a time so
  no ``[B, Hq, T, d]`` is formed.

  Args:
    cfg: the model's config.
    p: one layer's parameters (``wo`` is read).
    v_BGTD: the layer's values ``[B, G, T, D]``.

  Returns:
    fp32 norms ``[B, Hq, T]``.
  """
  Hq, D = cfg.num_heads, cfg.head_dim
  wo = p["wo"].reshape(Hq, D, -1)
  groups = Hq // v_BGTD.shape[1]

  def head(h):
    v = jnp.take(v_BGTD, h // groups, axis=1).astype(jnp.float32)  # [B, T, D]
    w = jax.lax.dynamic_index_in_dim(wo, h, 0, keepdims=False).astype(jnp.float32)
    return jnp.abs(matmul(v, w)).sum(-1)

  return jnp.moveaxis(jax.lax.map(head, jnp.arange(Hq)), 0, 1)


def empty_moments(B: int, H: int, D: int) -> tuple:
  """Returns the query moments before any query is seen.

  Args:
    B: rows.
    H: query heads.
    D: the head dimension.

  Returns:
    ``(count [B], mean [B, H, D], m2 [B, H, D, D])``, fp32 zeros.
  """
  f32 = jnp.float32
  return jnp.zeros((B,), f32), jnp.zeros((B, H, D), f32), jnp.zeros((B, H, D, D), f32)


def update_moments(moments: tuple, q_BHND: Array, weight_BN: Array) -> tuple:
  """Adds the queries where ``weight_BN`` is set to the running count, mean and centred moment.

  Chan et al.'s parallel update: each chunk's own mean and centred moment, then the correction
  ``delta delta^T n_a n_b / n``; stable where ``E[qq^T] - mu mu^T`` cancels, and never a
  per-token ``[D, D]``.

  Args:
    moments: ``(count [B], mean [B, H, D], m2 [B, H, D, D])`` so far (:func:`empty_moments`).
    q_BHND: the chunk's queries ``[B, H, N, D]``.
    weight_BN: which of them count ``[B, N]`` (bool or 0/1).

  Returns:
    The updated ``(count, mean, m2)``, fp32.
  """
  count, mean, m2 = moments
  w = weight_BN.astype(jnp.float32)
  q = q_BHND.astype(jnp.float32)
  n_b = w.sum(-1)
  c_mean = jnp.einsum("bhnd,bn->bhd", q, w, precision=PRECISION) / jnp.maximum(n_b, 1.0).reshape(
    -1, 1, 1
  )
  centred = (q - c_mean[:, :, None]) * w[:, None, :, None]
  c_m2 = jnp.einsum("bhnd,bhne->bhde", centred, centred, precision=PRECISION)
  total = count + n_b
  frac = jnp.where(total > 0, n_b / jnp.maximum(total, 1.0), 0.0)
  delta = c_mean - mean
  outer = jnp.einsum("bhd,bhe->bhde", delta, delta, precision=PRECISION)
  return (
    total,
    mean + delta * frac.reshape(-1, 1, 1),
    m2 + c_m2 + outer * (count * frac).reshape(-1, 1, 1, 1),
  )


def moments_mean_cov(moments: tuple) -> tuple[Array, Array]:
  """Computes the mean and covariance of the counted queries, dividing by the count.

  kvpress divides by the count too (``einsum(...) / h.shape[1]``, not ``count - 1``).

  Args:
    moments: ``(count [B], mean [B, H, D], m2 [B, H, D, D])`` (:func:`update_moments`).

  Returns:
    ``(mean [B, H, D], cov [B, H, D, D])``; zeros for a row with no query counted.
  """
  count, mean, m2 = moments
  return mean, m2 / jnp.maximum(count, 1.0).reshape(-1, 1, 1, 1)


def average_rope(cfg: ModelConfig, start_B: Array, n_future: int, layer=None) -> Array:
  """Computes the mean RoPE matrix over each row's next ``n_future`` positions.

  kvpress ``ExpectedAttentionPress.apply_avg_rope``: ``R = mean(cos I + sin P)`` with ``P`` the
  ``rotate_half`` matrix, ``cos``/``sin`` indexed by the column, as its broadcast does.

  Args:
    cfg: the model's config.
    start_B: each row's first future position ``[B]``.
    n_future: how many positions to average over (``start .. start + n_future - 1``).
    layer: the layer's index, needed when layers differ (:func:`rope_tables`).

  Returns:
    fp32 matrices ``R [B, D, D]``.
  """
  D = cfg.head_dim
  inv, _ = rope_tables(cfg, layer=layer)
  pos = (start_B[:, None] + jnp.arange(n_future)[None]).astype(jnp.float32)  # [B, F]
  angles = pos[..., None] * inv.reshape(1, 1, -1)
  angles = jnp.concatenate([angles, angles], -1)
  cos, sin = jnp.cos(angles).mean(1), jnp.sin(angles).mean(1)  # [B, D]
  half = D // 2
  eye = np.eye(half, dtype=np.float32)
  P = np.zeros((D, D), np.float32)
  P[half:, :half], P[:half, half:] = eye, -eye
  return cos[:, None, :] * jnp.eye(D)[None] + sin[:, None, :] * jnp.asarray(P)[None]


def rotate_moments(R_BDD: Array, mean_BHD: Array, cov_BHDD: Array) -> tuple[Array, Array]:
  """Rotates a mean and covariance by ``R``: ``mu R^T`` and ``R cov R^T``.

  As kvpress's ``matmul(mu, R.T)`` and ``R @ cov @ R.T``.

  Args:
    R_BDD: rotation matrices ``[B, D, D]`` (:func:`average_rope`).
    mean_BHD: means ``[B, H, D]``.
    cov_BHDD: covariances ``[B, H, D, D]``.

  Returns:
    ``(mean [B, H, D], cov [B, H, D, D])``, rotated.
  """
  mean = jnp.einsum("bhj,bij->bhi", mean_BHD, R_BDD, precision=PRECISION)
  cov = jnp.einsum("bij,bhjk,blk->bhil", R_BDD, cov_BHDD, R_BDD, precision=PRECISION)
  return mean, cov


def _fused_chunk(q_BHQD, c0, n, keys, sliding_window, implementation) -> Array:
  """The attention output ``[B, Hq, n, D]`` of queries ``[c0, c0 + n)`` from
  :func:`jax.nn.dot_product_attention` over the layer's keys (rows with no allowed key: zero)."""
  B, Hq, _, D = q_BHQD.shape
  k, v = (
    t[keys.layer].transpose(0, 2, 1, 3).astype(q_BHQD.dtype) for t in (keys.keys, keys.values)
  )
  allowed = (
    causal_allowed(
      jax.lax.dynamic_slice_in_dim(keys.positions, c0, n, 1),
      keys.positions,
      keys.valid,
      jnp.broadcast_to(c0 + jnp.arange(n), (B, n)),
      jnp.broadcast_to(jnp.arange(keys.T), (B, keys.T)),
      sliding_window,
    )
    & jax.lax.dynamic_slice_in_dim(keys.valid, c0, n, 1)[:, :, None]
  )
  o = jax.nn.dot_product_attention(
    q_BHQD.transpose(0, 2, 1, 3), k, v, mask=allowed[:, None], implementation=implementation
  )
  o = jnp.where(allowed.any(-1)[:, :, None, None], o.astype(jnp.float32), 0.0)
  return o.transpose(0, 2, 1, 3)


class _Keys:
  """Layer ``l``'s keys and values in the ``[L, B, G, T, D]`` outputs, read ``size`` at a time."""

  def __init__(self, keys_LBGTD, values_LBGTD, positions_BT, valid_BT, layer, size: int):
    self.keys, self.values, self.layer, self.size = keys_LBGTD, values_LBGTD, layer, size
    self.positions, self.valid = positions_BT, valid_BT
    self.T = positions_BT.shape[1]

  def tile(self, start):
    """Keys, values ``[B, G, size, D]``, positions and validity ``[B, size]`` from ``start``."""
    _, B, G, _, D = self.keys.shape
    kv, start = _sliced_in_loop((self.keys, self.values), start)
    k, v = (
      jax.lax.dynamic_slice(t, (self.layer, 0, 0, start, 0), (1, B, G, self.size, D))[0] for t in kv
    )
    pos = jax.lax.dynamic_slice_in_dim(self.positions, start, self.size, 1)
    return k, v, pos, jax.lax.dynamic_slice_in_dim(self.valid, start, self.size, 1)


def _first_key(positions_BT: Array, q_pos_B: Array, sliding_window: int | None):
  """The first key index a query at or after position ``q_pos_B`` may see (0 without a sliding
  window; positions never decrease along a row, so the keys inside the window are a suffix)."""
  if sliding_window is None:
    return 0
  first = jax.vmap(jnp.searchsorted)(positions_BT, q_pos_B - sliding_window + 1)
  return first.min().astype(jnp.int32)


def _tile_logits(
  q_BGRQD, rows: _Rows, keys: _Keys, s, sliding_window, fresh_only=True, softcap=None
):
  """fp32 ``q k^T / sqrt(D)`` of the key tile from ``s`` (``-inf`` where not allowed).

  The tile is read from ``min(s, T - size)`` so that it stays inside the prompt; with
  ``fresh_only`` its keys before ``s`` (the previous tile's) are masked, so that sums over tiles
  count every key once. Returns the start read, the allowed mask ``[B, Q, K]``, the logits
  ``[B, G, R, Q, K]`` and the values.
  """
  start = jnp.minimum(s, keys.T - keys.size)
  k, v, k_pos, k_valid = keys.tile(start)
  B = k.shape[0]
  k_index = jnp.broadcast_to(start + jnp.arange(keys.size), (B, keys.size))
  if fresh_only:
    k_valid = k_valid & (k_index >= s)
  allowed = causal_allowed(rows.pos, k_pos, k_valid, rows.index, k_index, sliding_window)
  if rows.real is not None:
    allowed = allowed & rows.real[:, :, None]
  logits = jnp.einsum(
    "bgrqd,bgkd->bgrqk", q_BGRQD, k.astype(jnp.float32), precision=PRECISION
  ) / math.sqrt(q_BGRQD.shape[-1])
  logits = softcap_logits(logits, softcap)
  return start, allowed, jnp.where(allowed[:, None, None], logits, -jnp.inf), v


def _finite(m: Array) -> Array:
  """A running maximum usable as a shift: 0 where no key was allowed yet."""
  return jnp.where(jnp.isneginf(m), 0.0, m)


def _pv(probs_BGRQK: Array, v_BGKD: Array) -> Array:
  return jnp.einsum(
    "bgrqk,bgkd->bgrqd", probs_BGRQK, v_BGKD.astype(jnp.float32), precision=PRECISION
  )


def _softmax_stats(tile, lo, count, size, shape_BGRQ):
  """Each query's softmax maximum and normaliser ``[B, G, R, Q]`` over ``count`` key tiles
  from ``lo`` (``tile(s)`` as :func:`_tile_logits`)."""

  def body(j, carry):
    m, norm = carry
    _, _, logits, _ = tile(lo + j * size)
    new = jnp.maximum(m, logits.max(-1))
    shift = _finite(new)
    return new, norm * jnp.exp(m - shift) + jnp.exp(logits - shift[..., None]).sum(-1)

  init = (jnp.full(shape_BGRQ, -jnp.inf), jnp.zeros(shape_BGRQ, jnp.float32))
  return jax.lax.fori_loop(0, count, body, init)


def _normalised(allowed, logits, m, norm) -> Array:
  """One tile's softmax probabilities from the rows' statistics (zero where not allowed)."""
  probs = jnp.exp(logits - m[..., None]) / norm[..., None]
  return jnp.where(allowed[:, None, None], probs, 0.0)


def _attend_block(q_BGRQD, tile, lo, count, size, sums_BHT):
  """One query block's attention output ``[B, G, R, Q, D]`` over ``count`` key tiles from
  ``lo``, and ``sums_BHT`` with the block's probabilities added (unless None)."""
  B, G, R, Q, D = q_BGRQD.shape
  o0 = jnp.zeros((B, G, R, Q, D), jnp.float32)
  if sums_BHT is None:  # one pass with an online softmax (flash attention)

    def online(j, carry):
      m, norm, o = carry
      _, _, logits, v = tile(lo + j * size)
      new = jnp.maximum(m, logits.max(-1))
      shift = _finite(new)
      scale, e = jnp.exp(m - shift), jnp.exp(logits - shift[..., None])
      return new, norm * scale + e.sum(-1), o * scale[..., None] + _pv(e, v)

    init = (jnp.full((B, G, R, Q), -jnp.inf), jnp.zeros((B, G, R, Q), jnp.float32), o0)
    _, norm, o = jax.lax.fori_loop(0, count, online, init)
    return jnp.where(norm[..., None] > 0, o / jnp.where(norm > 0, norm, 1.0)[..., None], 0.0), None

  m, norm = _softmax_stats(tile, lo, count, size, (B, G, R, Q))

  def second(j, carry):
    o, sums = carry
    start, allowed, logits, v = tile(lo + j * size)
    probs = _normalised(allowed, logits, m, norm)
    got = jax.lax.dynamic_slice_in_dim(sums, start, size, 2) + scores_lib.sum_rows(probs).reshape(
      B, G * R, -1
    )
    return o + _pv(probs, v), jax.lax.dynamic_update_slice_in_dim(sums, got, start, 2)

  return jax.lax.fori_loop(0, count, second, (o0, sums_BHT))


def _attend_chunk(q_BHQD, c0, n, keys: _Keys, sums_BHT, block, sliding_window, softcap=None):
  """Attention output ``[B, Hq, n, D]`` of the queries ``[c0, c0 + n)``, ``block`` at a time,
  over the keys before them (tiles above the diagonal or behind the window are never read),
  and the column sums with their rows added (unless None)."""
  B, Hq, _, D = q_BHQD.shape
  G = keys.keys.shape[2]
  R, size = Hq // G, min(block, n)
  num = -(-n // size)
  q = jnp.pad(q_BHQD, ((0, 0), (0, 0), (0, num * size - n), (0, 0))).astype(jnp.float32)
  q_blocks = jnp.moveaxis(q.reshape(B, G, R, num, size, D), 3, 0)
  end = c0 + n

  def one(sums, inputs):
    j, q_b = inputs
    q0 = c0 + j * size
    index = jnp.broadcast_to(q0 + jnp.arange(size), (B, size))
    inside = jnp.minimum(index, keys.T - 1)
    rows = _Rows(
      index=index,
      pos=jnp.take_along_axis(keys.positions, inside, -1),
      real=jnp.take_along_axis(keys.valid, inside, -1) & (index < end),
    )
    lo = _first_key(keys.positions, rows.pos[:, 0], sliding_window)
    count = (jnp.minimum(q0 + size, end) - lo + keys.size - 1) // keys.size
    tile = functools.partial(
      _tile_logits, q_b, rows, keys, sliding_window=sliding_window, softcap=softcap
    )
    o, sums = _attend_block(q_b, tile, lo, count, keys.size, sums)
    return sums, o

  sums, o = jax.lax.scan(one, sums_BHT, (jnp.arange(num), q_blocks))
  o = jnp.moveaxis(o, 0, 3).reshape(B, Hq, num * size, D)[:, :, :n]
  return o, sums


def _window_rows(cfg, q_BHWD, out, l, win, at, positions, valid, block) -> Array:
  """``win`` (``[., B, Hq, W, T]``) with layer ``l``'s rows (the last ``W`` queries over every
  key) written in at index ``at`` of its first axis, tile by tile, from an fp32 softmax."""
  B, Hq, W, D = q_BHWD.shape
  T = positions.shape[1]
  G = cfg.num_kv_heads
  keys = _Keys(out["keys"], out["values"], positions, valid, l, min(block, T))
  rows = _Rows(jnp.broadcast_to(jnp.arange(T - W, T), (B, W)), positions[:, T - W :], None)
  q = q_BHWD.astype(jnp.float32).reshape(B, G, Hq // G, W, D)
  window = layer_window(cfg, l)
  lo = _first_key(positions, rows.pos[:, 0], window)
  count = (T - lo + keys.size - 1) // keys.size
  tile = functools.partial(
    _tile_logits, q, rows, keys, sliding_window=window, softcap=cfg.attn_softcap
  )
  m, norm = _softmax_stats(tile, lo, count, keys.size, (B, G, Hq // G, W))

  def body(j, win):  # a clamped last tile rewrites its overlap with the same probabilities
    start, allowed, logits, _ = tile(lo + j * keys.size, fresh_only=False)
    probs = _normalised(allowed, logits, m, norm).reshape(B, Hq, W, -1).astype(win.dtype)
    return jax.lax.dynamic_update_slice(win, probs[None], (at, 0, 0, 0, start))

  return jax.lax.fori_loop(0, count, body, win)


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
