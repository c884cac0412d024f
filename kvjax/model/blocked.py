"""The prefill's tiled attention: ``block`` queries x ``block`` keys at a time, flash-style.

Tiles above the causal diagonal and behind a sliding window are never read; the softmax is
fp32 and exact to rounding. One pass with an online softmax gives the output; with column sums
(H2O's evidence) a first pass finds each query's normaliser and a second forms the normalised
rows tile by tile. The window rows (the last ``W`` queries over every key) are written the same
way. :func:`fused_chunk` is the alternative kernel, :func:`jax.nn.dot_product_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import scores as scores_lib
from kvjax.model.attention import causal_allowed, layer_window, softcap_logits
from kvjax.model.stacking import sliced_in_loop
from kvjax.scores import PRECISION

Array = jax.Array


@struct.dataclass
class _Rows:
  """A tile's queries: indices and RoPE positions ``[B, Q]``; ``real`` (``[B, Q]`` or None)
  marks the rows that count (valid queries of the chunk), the others get zero attention."""

  index: Array
  pos: Array
  real: Array | None


class Keys:
  """One layer's keys and values inside the prefill's ``[L, B, G, T, D]`` outputs, read a tile
  of ``size`` keys at a time.

  Attributes:
    keys, values: the outputs ``[L, B, G, T, D]`` (post-RoPE keys).
    positions, valid: the keys' RoPE positions and validity ``[B, T]``.
    layer: the layer read (an int or a traced scalar).
    size: keys per tile.
    T: the prompt's length.
  """

  def __init__(self, keys_LBGTD, values_LBGTD, positions_BT, valid_BT, layer, size: int):
    self.keys, self.values, self.layer, self.size = keys_LBGTD, values_LBGTD, layer, size
    self.positions, self.valid = positions_BT, valid_BT
    self.T = positions_BT.shape[1]

  def tile(self, start):
    """Reads the tile of keys from ``start``.

    Args:
      start: the first key's index (traced), at most ``T - size``.

    Returns:
      ``(keys [B, G, size, D], values [B, G, size, D], positions [B, size], valid [B, size])``.
    """
    _, B, G, _, D = self.keys.shape
    kv, start = sliced_in_loop((self.keys, self.values), start)
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
  q_BGRQD,
  rows: _Rows,
  keys: Keys,
  s,
  sliding_window,
  fresh_only=True,
  softcap=None,
  operands=jnp.float32,
):
  """fp32 ``q k^T / sqrt(D)`` of the key tile from ``s`` (``-inf`` where not allowed), the
  product of ``operands``-typed queries and keys accumulated in fp32.

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
    "bgrqd,bgkd->bgrqk",
    q_BGRQD.astype(operands),
    k.astype(operands),
    precision=PRECISION,
    preferred_element_type=jnp.float32,
  ) / math.sqrt(q_BGRQD.shape[-1])
  logits = softcap_logits(logits, softcap)
  return start, allowed, jnp.where(allowed[:, None, None], logits, -jnp.inf), v


def _finite(m: Array) -> Array:
  """A running maximum usable as a shift: 0 where no key was allowed yet."""
  return jnp.where(jnp.isneginf(m), 0.0, m)


def _pv(probs_BGRQK: Array, v_BGKD: Array, operands=jnp.float32) -> Array:
  return jnp.einsum(
    "bgrqk,bgkd->bgrqd",
    probs_BGRQK.astype(operands),
    v_BGKD.astype(operands),
    precision=PRECISION,
    preferred_element_type=jnp.float32,
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


def _attend_block(q_BGRQD, tile, lo, count, size, sums_BHT, operands=jnp.float32):
  """One query block's attention output ``[B, G, R, Q, D]`` over ``count`` key tiles from
  ``lo``, and ``sums_BHT`` with the block's probabilities added (unless None); the online pass
  multiplies ``operands``-typed probabilities and values (the exact pass stays fp32)."""
  B, G, R, Q, D = q_BGRQD.shape
  o0 = jnp.zeros((B, G, R, Q, D), jnp.float32)
  if sums_BHT is None:  # one pass with an online softmax (flash attention)

    def online(j, carry):
      m, norm, o = carry
      _, _, logits, v = tile(lo + j * size)
      new = jnp.maximum(m, logits.max(-1))
      shift = _finite(new)
      scale, e = jnp.exp(m - shift), jnp.exp(logits - shift[..., None])
      return new, norm * scale + e.sum(-1), o * scale[..., None] + _pv(e, v, operands)

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


def attend_chunk(
  q_BHQD,
  c0,
  keys: Keys,
  sums_BHT,
  block,
  sliding_window,
  softcap=None,
  operands=jnp.float32,
):
  """Computes the attention output of the queries ``[c0, c0 + n)``, ``block`` at a time, over
  the keys before them; tiles above the diagonal or behind the window are never read.

  Args:
    q_BHQD: the chunk's post-RoPE queries ``[B, Hq, n, D]`` (``n`` static).
    c0: the chunk's first index in the prompt (traced).
    keys: the layer's keys and values (:class:`Keys`), the chunk's written in.
    sums_BHT: column sums ``[B, Hq, T]`` to add the chunk's probabilities to, or ``None`` for
      the one-pass online softmax.
    block: queries per tile.
    sliding_window: the layer's window (:func:`kvjax.model.attention.layer_window`).
    softcap: the attention soft-capping (``cfg.attn_softcap``); ``None``: none.
    operands: the dtype the one-pass output's two matmuls (``q k^T``, ``p v``) read their
      operands in, accumulated in fp32 (``PrefillPlan.attention_dtype``); with ``sums_BHT``
      every product stays fp32, so the evidence is exact.

  Returns:
    ``(out [B, Hq, n, D] fp32, sums_BHT with the chunk's rows added, or None)``.
  """
  B, Hq, n, D = q_BHQD.shape
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
    dtype = operands if sums is None else jnp.float32
    tile = functools.partial(
      _tile_logits,
      q_b.astype(dtype),
      rows,
      keys,
      sliding_window=sliding_window,
      softcap=softcap,
      operands=dtype,
    )
    o, sums = _attend_block(q_b, tile, lo, count, keys.size, sums, dtype)
    return sums, o

  sums, o = jax.lax.scan(one, sums_BHT, (jnp.arange(num), q_blocks))
  o = jnp.moveaxis(o, 0, 3).reshape(B, Hq, num * size, D)[:, :, :n]
  return o, sums


def fused_chunk(q_BHQD, c0, n, keys, sliding_window, implementation) -> Array:
  """Computes the attention output of the queries ``[c0, c0 + n)`` with
  :func:`jax.nn.dot_product_attention` over all the layer's keys, in the queries' dtype.

  Args:
    q_BHQD: the chunk's post-RoPE queries ``[B, Hq, n, D]``.
    c0: the chunk's first index in the prompt (traced).
    n: the chunk's length (static).
    keys: the layer's keys and values (:class:`Keys`), the chunk's written in.
    sliding_window: the layer's window (:func:`kvjax.model.attention.layer_window`).
    implementation: ``"xla"`` or ``"cudnn"``, as :func:`jax.nn.dot_product_attention` takes it.

  Returns:
    fp32 output ``[B, Hq, n, D]``; zero for a query with no allowed key.
  """
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


def window_rows(cfg, q_BHWD, keys: Keys, win, at) -> Array:
  """Writes layer ``l``'s window rows (the last ``W`` queries over every key) into ``win``, tile
  by tile, from an fp32 softmax.

  Args:
    cfg: the model's config.
    q_BHWD: the window's post-RoPE queries ``[B, Hq, W, D]``.
    keys: the layer's keys and values (:class:`Keys`, the prefill's outputs with the layer
      written), its tile size the keys per tile.
    win: the rows' output ``[N, B, Hq, W, T]``.
    at: the index of ``win``'s first axis to write.

  Returns:
    ``win`` with the rows written at ``at``, in its dtype.
  """
  B, Hq, W, D = q_BHWD.shape
  positions, T, G = keys.positions, keys.T, cfg.num_kv_heads
  rows = _Rows(jnp.broadcast_to(jnp.arange(T - W, T), (B, W)), positions[:, T - W :], None)
  q = q_BHWD.astype(jnp.float32).reshape(B, G, Hq // G, W, D)
  window = layer_window(cfg, keys.layer)
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
