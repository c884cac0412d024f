"""Rotary position embeddings: transformers' frequencies per RoPE scaling, the rotation
(``rotate_half`` halves), and the mean rotation over future positions (ExpectedAttention)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig

Array = jax.Array


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


def average_rope(cfg: ModelConfig, start_B: Array, n_future: int, layer=None) -> Array:
  """Computes the mean RoPE matrix over each row's next ``n_future`` positions.

  kvpress ``ExpectedAttentionPress.apply_avg_rope``: ``R = mean(cos I + sin P)`` with ``P`` the
  ``rotate_half`` matrix, ``cos``/``sin`` indexed by the column, as its broadcast does; cos and
  sin are unscaled. :func:`kvjax.scores.average_rope` builds the same matrix for one static
  start from given frequencies; this one takes a start per row, traced or not, and the
  frequencies of a layer that may be traced too (the prefill's layer scan), all inside ``jit``.

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
