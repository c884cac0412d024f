"""Integer keys in the float32 order of the scores, and the count threshold: each row's top ``n``
found by a bisection on those keys, with a counting pass per step and nothing ordered.

On rows of :data:`COUNT_THRESHOLD_MIN_POSITIONS` positions or more with a capacity up to
``T / 8``, :func:`kvjax.select.top_mask` takes this path (:func:`uses_count_threshold`); rows
whose ``n``-th best is tied with the next fall back to an ordered top ``k``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.checks import is_concrete
from kvjax.select.validation import check_scores, float32_scores, row_counts

Array = jax.Array

# The count threshold (:func:`count_threshold`) selects rows of at least this many positions: at
# 1024 positions and capacity 128 it took 6.3 ms against the top_k path's 7.8 over 32 x 32 rows
# (8192 positions, capacity 512: 135 against 254 ms).
COUNT_THRESHOLD_MIN_POSITIONS = 1024
# counts accumulate in int16 over blocks of 256 positions (2.7 ms a pass over [1024, 8192],
# against 3.9 ms in one int16 sum per row and 23 ms in int32: XLA:CPU vectorises the former)
_COUNT_BLOCK = 256
# once at most this many rows are unsettled, they are gathered and bisected alone
TAIL_ROWS = 32


def sortable_int32(x: Array) -> Array:
  """Maps values to int32 keys whose signed order is their float32 order.

  ``-0.0 == +0.0`` and subnormals are exact: these are the keys every selection path orders by.
  Sign-magnitude to two's complement: both zeros map to 0, where the usual ``i ^ 0x7FFFFFFF``
  trick maps ``-0.0`` to -1, below ``+0.0``. The map is invertible except for the zero's sign.

  Args:
    x: floating array, cast to float32.

  Returns:
    int32 keys of ``x``'s shape, within ``[-(2**31 - 1), 2**31 - 1]``.
  """
  i = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  magnitude = i & 0x7FFFFFFF
  return jnp.where(i < 0, -magnitude, magnitude)


def order_keys(x: Array) -> Array:
  """Maps values to uint32 keys in their float32 order.

  These are :func:`sortable_int32`'s keys as uint32 in the same order (the sign bit flipped):
  what :func:`count_threshold` bisects and compares, unsigned so that its midpoints never
  overflow.

  Args:
    x: floating array, cast to float32.

  Returns:
    uint32 keys of ``x``'s shape.
  """
  return lax.bitcast_convert_type(sortable_int32(x), jnp.uint32) ^ jnp.uint32(0x80000000)


def uses_count_threshold(num_positions: int, k: int) -> bool:
  """Tells whether a row of ``T`` positions and a top list of ``k`` take the count threshold.

  Args:
    num_positions: the row's length ``T``.
    k: the static depth of the ordered fallback (the capacity, at most ``T``).

  Returns:
    True for ``T >= COUNT_THRESHOLD_MIN_POSITIONS`` and ``k <= T / 8``.
  """
  return num_positions >= COUNT_THRESHOLD_MIN_POSITIONS and k * 8 <= num_positions


def _count_blocks(x: Array) -> Array:
  """float32 ``x [..., T]`` as ``[..., N, block]`` for :func:`_count_at_least`, padded with
  ``-inf``. A pad is counted only by a probe at or below the key of ``-inf``, and a row whose
  ``lo`` ends there does not settle (:func:`count_threshold`), so pads never change a result."""
  T = x.shape[-1]
  pad = -T % _COUNT_BLOCK
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
  return x.reshape(x.shape[:-1] + (-1, _COUNT_BLOCK))


def _count_at_least(x_blocks: Array, probe: Array) -> Array:
  """int32 ``count(key(x) >= probe)`` per row, the keys recomputed in the counting pass (cheaper
  than writing them out once: a fresh 32 MiB buffer costs 15-18 ms here)."""
  hits = order_keys(x_blocks) >= probe[..., None, None]
  return jnp.sum(hits, -1, dtype=jnp.int16).astype(jnp.int32).sum(-1)


def count_threshold(masked: Array, n: Array) -> tuple[Array, Array]:
  """Finds, per row, a key with exactly ``n`` entries at or above it.

  The result ``(lo, ok)`` makes ``order_keys(masked) >= lo[..., None]`` each row's top ``n``
  without ordering anything.

  A bisection on the keys (:func:`order_keys`) keeps ``count(u >= lo) >= n > count(u > hi)``
  and stops a row when ``count(u >= lo) == n``: one counting pass over the rows per step, until
  ``lo`` falls between the row's ``n``-th and ``(n + 1)``-th best keys (about 20 steps for 8192
  normal scores, 27 for the slowest of 1024 such rows; at most 32). Exact whenever it settles,
  since the ``n`` entries at or above ``lo`` are then the top ``n`` in any tie order. Rows with
  ``n = 0`` keep nothing and always settle.

  Args:
    masked: float scores ``[..., T]``, the positions that are not candidates set to ``-inf``.
    n: int counts per row, broadcastable to ``masked.shape[:-1]``, in ``[0, T]``.

  Returns:
    ``(lo, ok)``: the uint32 keys ``lo`` (the row shape), and a bool scalar ``ok``, False when
    some row (with ``n >= 1``) cannot settle: its ``n``-th and ``(n + 1)``-th best are tied (ties
    must then go to the lower position), or ``lo`` reaches ``-inf`` (masked positions would be
    kept).

  Raises:
    ValueError: for NaN or non-float scores (when concrete), and for counts that are negative,
      above ``T`` or do not broadcast to the rows.
  """
  check_scores(masked)
  masked = float32_scores(masked)
  n = row_counts("n", n, masked.shape[:-1])
  if is_concrete(n) and n.size and int(np.max(np.asarray(n))) > masked.shape[-1]:
    raise ValueError(f"n: {int(np.max(np.asarray(n)))} exceeds T={masked.shape[-1]}")
  empty = n < 1
  shape = n.shape
  n_R = jnp.maximum(n, 1).reshape(-1)
  blocks = _count_blocks(masked.astype(jnp.float32))
  blocks = blocks.reshape((-1,) + blocks.shape[-2:])
  R = n_R.shape[0]
  state = (
    jnp.zeros((R,), jnp.uint32),
    jnp.full((R,), 0xFFFFFFFF, jnp.uint32),
    jnp.full((R,), masked.shape[-1], jnp.int32),
  )
  if R > 2 * TAIL_ROWS:
    # all rows until at most TAIL_ROWS remain unsettled, then those rows alone: the last steps
    # (a few rows whose n-th and (n + 1)-th keys are close) no longer count every row
    state = _bisect(blocks, n_R, state, more_than=TAIL_ROWS)
    rows = jnp.nonzero(_unsettled(n_R, *state), size=TAIL_ROWS, fill_value=R)[0]
    tail = tuple(jnp.take(x, rows, axis=0, mode="clip") for x in state)
    n_tail = jnp.take(n_R, rows, mode="clip")
    tail = (*tail[:2], jnp.where(rows < R, tail[2], n_tail))  # padding rows: settled
    tail = _bisect(jnp.take(blocks, rows, axis=0, mode="clip"), n_tail, tail)
    state = tuple(x.at[rows].set(t, mode="drop") for x, t in zip(state, tail, strict=True))
  else:
    state = _bisect(blocks, n_R, state)
  lo, _, c_lo = (x.reshape(shape) for x in state)
  ok = ((c_lo == jnp.maximum(n, 1)) & (lo > order_keys(jnp.float32(-jnp.inf)))) | empty
  return lo, ok.all()


def _unsettled(n_R: Array, lo: Array, hi: Array, c_lo: Array) -> Array:
  return (c_lo > n_R) & (lo < hi)


def _bisect(blocks_RNB: Array, n_R: Array, state: tuple, more_than: int = 0) -> tuple:
  """Bisection steps of :func:`count_threshold` over rows ``[R, N, block]`` while more than
  ``more_than`` rows are unsettled. ``state``: ``(lo, hi, c_lo)`` with
  ``count(u >= lo) = c_lo >= n > count(u > hi)``; a step counts ``u >= probe`` at the midpoint
  and moves ``lo`` up or ``hi`` down to it."""

  def step(state):
    lo, hi, c_lo = state
    probe = lo + ((hi - lo) >> 1) + jnp.uint32(1)  # in (lo, hi]: no uint32 overflow
    count = _count_at_least(blocks_RNB, probe)
    go = _unsettled(n_R, *state)
    up, down = go & (count >= n_R), go & (count < n_R)
    return (
      jnp.where(up, probe, lo),
      jnp.where(down, probe - jnp.uint32(1), hi),
      jnp.where(up, count, c_lo),
    )

  return lax.while_loop(lambda state: _unsettled(n_R, *state).sum() > more_than, step, state)
