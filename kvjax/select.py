"""Selection: the only place in kvjax that turns scores and budgets into kept positions.

Semantics shared by every function here (``docs/concepts.md``, step 4):

* Higher score = keep. Each row keeps exactly ``min(budget, length)`` positions, where ``length`` is
  the number of valid (prefix) positions of the row, ``T`` by default.
* Ties go to the lower position, as ``lax.top_k`` and torch's ``topk`` on CPU both do, on every
  backend. ``-0.0`` and ``+0.0`` are equal scores (and tie).
* ``+inf`` is the "always keep" sentinel written by :func:`kvjax.scores.protect`; ``-inf`` is
  "keep only if the budget is larger than everything else". NaN is rejected.
* A budget of at least ``T`` keeps the whole row: the reference "no compression when the prompt is
  shorter than the budget" guard (SnapKV, PyramidKV, Ada-KV all return the cache untouched).
* Budgets are traced data. Only shapes and the capacity (the static upper bound on budgets below
  ``T``) are static, so a sweep over budget values compiles once.
* Counts (budgets, lengths, the capacity) are int32 token counts: concrete values are checked to
  lie in ``[0, 2**31)`` before any cast (``ValueError``, never a wrapped value). Traced values
  cannot be checked in Python: :func:`keep_mask` and :func:`compact` then keep what their
  docstrings say without a signal (a budget above the capacity keeps ``capacity`` entries);
  :func:`checked_keep_mask` and :func:`checked_compact` report NaN scores, negative budgets and
  budgets above the capacity under ``jit`` with ``checkify``.
* Keys are float32. float64 scores keep their own order: values float32 cannot tell apart or
  hold (``1e39`` would become ``+inf``, the keep-always marker) are selected by their float64
  ranks (:func:`float32_scores`).

The implementation is a threshold: each row keeps the entries above its
``min(budget, length)``-th best one, plus the tied entries up to that one's position (exact,
tie-consistent, no scatter; about 10x faster on CPU than a double argsort: ``docs/concepts.md``, "On CPU,
JAX sorts floats slowly"). On rows of 1024 positions or more with a capacity up to ``T / 8``
the threshold is found without ordering anything, by a bisection on the sortable keys with a
counting pass per step (:func:`count_threshold`; rows whose ``n``-th best is tied with the next
fall back); otherwise that entry comes from ``lax.top_k`` up to the static capacity ``C``.
:func:`ranks` still scatters the order (one table answers every budget). Deep orders
(``C > T / 8``) sort integer keys instead: a packed int64 sort on CPU, a two-key sort elsewhere,
with the same order.
Shape letters follow ``kvjax``'s key (``C`` capacity, ``K`` configurations); ``R`` is the rows
(every leading axis) flattened.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

Array = jax.Array

INT32_LIMIT = 2**31  # counts must satisfy 0 <= x < INT32_LIMIT before they are cast to int32


def is_concrete(*xs) -> bool:
  """Tells whether every value is known in Python (not traced).

  A concrete value can be validated in Python; a traced one (under ``jit`` or ``vmap``) cannot.

  Args:
    *xs: the values to test (arrays, Python numbers or tracers).

  Returns:
    True when none of ``xs`` is a ``jax.core.Tracer``.
  """
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_scores(scores) -> None:
  if not hasattr(scores, "ndim") or scores.ndim < 1:
    raise ValueError(f"scores: expected an array [..., T] with at least one axis, got {scores!r}")
  if not jnp.issubdtype(scores.dtype, jnp.floating):
    raise ValueError(f"scores: expected a floating dtype, got {scores.dtype}")
  if scores.shape[-1] < 1:
    raise ValueError(f"scores: expected at least one position, got shape {scores.shape}")
  if is_concrete(scores) and np.isnan(np.asarray(scores)).any():
    raise ValueError("scores: contains NaN; expected finite scores (or +/-inf sentinels)")


# float32 holds every integer up to 2**24 exactly: the largest row whose float64 scores can be
# replaced by their ranks without two ranks meeting
_EXACT_RANKS = 2**24


def float32_scores(scores):
  """Casts scores to floats whose float32 order is their own.

  These are the float32 keys every selection path orders by. float16, bfloat16 and float32
  scores convert exactly and are returned unchanged. float64 scores that convert exactly are
  cast. Others would not keep their order in float32: finite values beyond float32's range
  become ``+inf`` (the always-keep marker) and values closer than float32's precision become
  ties. Each row's scores are then replaced by their dense ranks (0 for the row's lowest finite
  score, up), ``+/-inf`` kept: the same order, ties and sentinels, so the selection is float64's
  own. Traced float64 scores (under ``jit`` with x64 enabled) are always ranked.

  Args:
    scores: floating scores ``[..., T]`` (already checked: no NaN).

  Returns:
    float32 (or narrower) scores of the same shape and order along the last axis.

  Raises:
    ValueError: for float64 rows longer than ``2**24`` positions whose cast is inexact, where
      float32 cannot hold distinct ranks.
  """
  if jnp.dtype(scores.dtype).itemsize <= 4:
    return scores
  if is_concrete(scores):
    host = np.asarray(scores)
    with np.errstate(over="ignore"):  # an overflow is what the comparison below detects
      cast = host.astype(np.float32)
    if np.array_equal(cast.astype(host.dtype), host):
      return cast
    xp = np
  else:
    host, xp = scores, jnp
  if scores.shape[-1] > _EXACT_RANKS:
    raise ValueError(
      f"scores: float64 rows of {scores.shape[-1]} positions do not keep their order in float32 "
      f"and are longer than the {_EXACT_RANKS} ranks float32 holds exactly; expected float32 "
      "scores, or float64 values that float32 represents"
    )
  ranks = _dense_ranks(host, xp)
  return xp.where(xp.isinf(host), host, ranks).astype(xp.float32)


def _dense_ranks(x, xp):
  """Each entry's place among the distinct values of its row (equal values share one), by
  ``xp`` (numpy on the host, jax.numpy under ``jit``)."""
  order = xp.argsort(x, axis=-1)
  ordered = xp.take_along_axis(x, order, axis=-1)
  steps = (ordered[..., 1:] != ordered[..., :-1]).astype(np.int32)  # -0.0 == +0.0: one value
  dense = xp.concatenate([xp.zeros(steps.shape[:-1] + (1,), np.int32), xp.cumsum(steps, -1)], -1)
  if xp is np:
    out = np.empty_like(dense)
    np.put_along_axis(out, order, dense, axis=-1)
    return out
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  flat = jnp.zeros((rows, x.shape[-1]), jnp.int32)
  row = jnp.arange(rows)[:, None]
  flat = flat.at[row, order.reshape(rows, -1)].set(dense.reshape(rows, -1), unique_indices=True)
  return flat.reshape(x.shape)


def _object_ints(name: str, arr: np.ndarray) -> None:
  """Python ints beyond int64 (numpy's ``object`` arrays) are out of range; anything else is not
  an integer at all."""
  values = list(arr.flat)
  if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    worst = max(values, key=abs)
    raise ValueError(f"{name}: {worst} does not fit int32; expected 0 <= {name} < 2**31")
  raise ValueError(f"{name}: expected integer counts, got {arr.tolist()!r}")


def check_counts(name: str, value, *, minimum: int = 0):
  """Validates integer counts (budgets, lengths, positions) before any cast to int32.

  The dtype must be an integer one (also for traced values: dtypes are static). Concrete values
  must lie in ``[minimum, 2**31)``, so that ``np.int64(2**32 + 12)`` never wraps to 12 and
  ``2**40`` never reaches JAX's converters.

  Args:
    name: the argument's name, quoted in error messages.
    value: the counts: a Python int, a numpy or JAX integer array, or a tracer.
    minimum: the smallest allowed count.

  Returns:
    A numpy array (concrete ``value``) or the tracer unchanged.

  Raises:
    ValueError: naming ``name``, for a non-integer dtype (traced or concrete), and for concrete
      counts below ``minimum`` or not below ``2**31``.
  """
  if not is_concrete(value):
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{name}: expected an integer array, got dtype {value.dtype}")
    return value
  arr = np.asarray(value)
  if arr.dtype == object:
    _object_ints(name, arr)
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name}: expected an integer array, got dtype {arr.dtype}")
  if arr.size:
    low, high = int(arr.min()), int(arr.max())
    if low < minimum:
      expected = "non-negative counts" if minimum == 0 else f"counts >= {minimum}"
      raise ValueError(f"{name}: expected {expected}, got minimum {low}")
    if high >= INT32_LIMIT:
      raise ValueError(f"{name}: {high} does not fit int32; expected 0 <= {name} < 2**31")
  return arr


def check_static_count(name: str, value, *, minimum: int = 1) -> int:
  """Validates a static (Python or numpy) int in ``[minimum, 2**31)``.

  Args:
    name: the argument's name, quoted in error messages.
    value: the count, a Python or numpy integer (not a bool, not traced).
    minimum: the smallest allowed value.

  Returns:
    ``value`` as a Python ``int``.

  Raises:
    ValueError: for a bool, a value that is not an integer, or one outside ``[minimum, 2**31)``.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise ValueError(f"{name}: expected a static int >= {minimum}, got {value!r}")
  if not minimum <= value < INT32_LIMIT:
    raise ValueError(f"{name}: expected a static int in [{minimum}, 2**31), got {value!r}")
  return int(value)


def _check_counts(name: str, value, batch_shape: tuple[int, ...]):
  """Validates an integer per-row count (budget or length) and returns it as int32."""
  value = check_counts(name, value)
  shape = np.shape(value)
  try:
    np.broadcast_shapes(shape, batch_shape)
  except ValueError:
    raise ValueError(
      f"{name}: shape {shape} does not broadcast to the row shape {batch_shape}"
    ) from None
  if len(np.broadcast_shapes(shape, batch_shape)) != len(batch_shape):
    raise ValueError(f"{name}: shape {shape} has more axes than the rows {batch_shape}")
  if is_concrete(value):
    value = np.asarray(value, np.int32)
  return jnp.broadcast_to(jnp.asarray(value).astype(jnp.int32), batch_shape)


def _check_capacity(capacity: int, budget, length, num_positions: int) -> None:
  if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
    raise ValueError(f"capacity: expected a positive static int, got {capacity!r}")
  if capacity >= INT32_LIMIT:
    raise ValueError(f"capacity: {capacity} does not fit int32; expected capacity < 2**31")
  if capacity >= num_positions or not is_concrete(budget):
    return
  # A budget in (capacity, length) cannot be honoured exactly: refuse instead of clamping.
  if not is_concrete(length):
    return
  budget, length = np.asarray(budget), np.asarray(length)
  over = (budget > capacity) & (budget < length)
  if over.any():
    raise ValueError(
      f"budget: {int(budget[over].max())} exceeds capacity={capacity} for a row of "
      f"length {int(length[over].max())}; expected budget <= capacity or budget >= length"
    )


def _iota(shape: tuple[int, ...]) -> Array:
  """int32 positions along the last axis, materialised at ``shape`` (no rank promotion)."""
  return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def uses_packed_sort() -> bool:
  """Tells whether deep orders use the packed int64 sort: on XLA:CPU only, decided at trace time.

  That sort is a CPU workaround (float and multi-operand sorts take XLA:CPU's slow path).
  Elsewhere the portable two-key integer sort gives the same order. Tests patch this function
  to run the portable path on CPU.

  Returns:
    True when JAX's default backend is ``"cpu"``.
  """
  return jax.default_backend() == "cpu"


_NEGATIVE_ZERO_BITS = -(2**31)  # the int32 bit pattern of float32 -0.0


def _unsigned_zero(x: Array) -> Array:
  """float32 ``x`` with ``-0.0`` replaced by ``+0.0``, so that the two zeros tie.

  Equal scores must go to the lower position, and ``-0.0`` is common (the key norm of a zero
  key, masked products), but ``lax.top_k`` orders ``+0.0`` above ``-0.0``. ``x + 0.0`` does not
  work (XLA folds the addition away), nor does ``where(x == 0, 0, x)``: XLA:CPU flushes
  subnormals in comparisons, which would zero them here but not in the integer sort paths.
  """
  i = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  i = jnp.where(i == _NEGATIVE_ZERO_BITS, jnp.zeros_like(i), i)
  return lax.bitcast_convert_type(i, jnp.float32)


def _sortable_int32(x: Array) -> Array:
  """An int32 whose signed order is the float32 order of ``x``, with ``-0.0 == +0.0``.

  Sign-magnitude to two's complement: both zeros map to 0, where the usual ``i ^ 0x7FFFFFFF``
  trick maps ``-0.0`` to -1, below ``+0.0``. Keys stay within ``[-(2**31 - 1), 2**31 - 1]``.
  """
  i = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  magnitude = i & 0x7FFFFFFF
  return jnp.where(i < 0, -magnitude, magnitude)


def sortable_int32(x: Array) -> Array:
  """Maps values to int32 keys whose signed order is their float32 order.

  ``-0.0 == +0.0`` and subnormals are exact: these are the keys every selection path orders by.
  The map is invertible except for the zero's sign.

  Args:
    x: floating array, cast to float32.

  Returns:
    int32 keys of ``x``'s shape, within ``[-(2**31 - 1), 2**31 - 1]``.
  """
  return _sortable_int32(x)


def _packed_sort_order(key: Array, k: int) -> Array:
  """First ``k`` positions by ``key`` descending, ties to the lower position (XLA:CPU).

  One single-operand int64 sort of ``(~key << 32) | position``: XLA:CPU's fast sort path.
  """
  with jax.enable_x64(True):
    position = lax.broadcasted_iota(jnp.int64, key.shape, key.ndim - 1)
    packed = (~key.astype(jnp.int64) << 32) | position
    return (jnp.sort(packed, axis=-1)[..., :k] & 0xFFFFFFFF).astype(jnp.int32)


def _two_key_sort_order(key: Array, k: int) -> Array:
  """First ``k`` positions by ``key`` descending, ties to the lower position (any backend).

  A two-operand sort on ``(~key, position)``, both keys: the pairs are distinct, so the order is
  total and needs no stability guarantee.
  """
  _, order = lax.sort((~key, _iota(key.shape)), dimension=key.ndim - 1, num_keys=2)
  return order[..., :k]


def descending_order(scores: Array, k: int) -> Array:
  """Finds the ``k`` best positions of each row, best first, ties to the lower position.

  ``-0.0`` and ``+0.0`` are equal scores. ``lax.top_k`` for shallow ``k``; past ``T / 8`` a sort
  of integer keys: on CPU a single-operand int64 sort of packed ``(score, position)`` keys,
  exact and about 5x faster than a full-depth ``top_k`` (``docs/concepts.md``: float and
  multi-operand sorts take XLA:CPU's slow path); elsewhere a two-key ``lax.sort``. Every path
  gives the same order.

  Args:
    scores: float scores ``[..., T]``, higher first.
    k: static number of positions per row, at most ``T``.

  Returns:
    int32 positions ``[..., k]``, best first.
  """
  num_positions = scores.shape[-1]
  if k * 8 <= num_positions or num_positions <= 256:
    return lax.top_k(_unsigned_zero(scores), k)[1].astype(jnp.int32)
  key = _sortable_int32(scores)
  if uses_packed_sort():
    return _packed_sort_order(key, k)
  return _two_key_sort_order(key, k)


def descending_values(x: Array, k: int) -> Array:
  """Returns the ``k`` largest values of each row, largest first.

  An oracle's prefix sums read these. No positions, so deep orders sort int32 keys (a
  single-operand sort) instead of packed ``(key, position)`` pairs. Equal values are
  interchangeable in a sum, so prefix sums of these equal those of the values gathered at
  :func:`descending_order`, bit for bit.

  Args:
    x: float values ``[..., T]``.
    k: static number of values per row, at most ``T``.

  Returns:
    The values ``[..., k]``, largest first: float32 past ``T / 8`` (a sort of keys), the dtype of
    ``x`` otherwise (``lax.top_k``).
  """
  if k * 8 <= x.shape[-1] or x.shape[-1] <= 256:
    return lax.top_k(x, k)[0]
  key = _sortable_int32(x)
  key = -jnp.sort(-key, axis=-1)[..., :k]  # keys lie in [-(2**31 - 1), 2**31 - 1]: no overflow
  bits = jnp.where(key < 0, (-key) | jnp.int32(-(2**31)), key)
  return lax.bitcast_convert_type(bits, jnp.float32)


def descending_order_by_layer(scores: Array, k: int) -> Array:
  """Computes :func:`descending_order` with each leading index (a layer) as its own sort op.

  The rows are independent, so the order is the same. XLA:CPU runs one sort op on one core but
  independent ones side by side: 0.19 s against 0.30 s for ``[32, 32, 8192]`` on 2 cores (the
  same CPU time).

  Args:
    scores: float scores ``[L, ..., T]``, split along the first axis.
    k: static number of positions per row, at most ``T``.

  Returns:
    int32 positions ``[L, ..., k]``, best first, as :func:`descending_order` gives them.
  """
  return jnp.concatenate([descending_order(x, k) for x in jnp.split(scores, len(scores))])


def _top_positions(scores: Array, length: Array, capacity: int) -> Array:
  """Positions of the ``capacity`` highest scores per row, best first, ties to the lower position.

  Positions at or beyond ``length`` are demoted below every valid position. When ``capacity``
  exceeds ``T`` the result is padded with ``T`` (an out-of-range "no position" marker).
  """
  num_positions = scores.shape[-1]
  valid = _iota(scores.shape) < length[..., None]
  scores = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
  k = min(capacity, num_positions)
  idx = descending_order(scores, k)
  # -inf scores at valid positions tie with the demoted invalid ones; lower positions win ties,
  # and every valid position is lower than every invalid one, so the order is exact.
  if capacity > num_positions:
    pad = jnp.full(idx.shape[:-1] + (capacity - num_positions,), num_positions, jnp.int32)
    idx = jnp.concatenate([idx.astype(jnp.int32), pad], axis=-1)
  return idx.astype(jnp.int32)


def _kept_slots(budget: Array, length: Array, capacity: int) -> Array:
  """Bool [..., C]: slot r of the ranked top list is kept iff r < min(budget, length)."""
  return _iota(budget.shape + (capacity,)) < jnp.minimum(budget, length)[..., None]


def _rank_impl(scores: Array, length: Array, capacity: int) -> Array:
  """int32 [..., T]: each position's rank among the row's top ``capacity`` (``capacity`` if not
  among them). One ``top_k`` plus one scatter; every budget is then a comparison."""
  num_positions = scores.shape[-1]
  cap = min(capacity, num_positions)
  idx = _top_positions(scores, length, cap)
  batch_shape = idx.shape[:-1]
  rows = int(np.prod(batch_shape, dtype=np.int64))
  idx_RC = idx.reshape(rows, cap)
  row_RC = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], idx_RC.shape)
  rank_RC = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[None, :], idx_RC.shape)
  out_RT = jnp.full((rows, num_positions), cap, jnp.int32)
  out_RT = out_RT.at[row_RC, idx_RC].set(rank_RC, mode="drop", unique_indices=True)
  return out_RT.reshape(batch_shape + (num_positions,))


# The count threshold (:func:`count_threshold`) selects rows of at least this many positions: at
# 1024 positions and capacity 128 it took 6.3 ms against the top_k path's 7.8 over 32 x 32 rows
# (8192 positions, capacity 512: 135 against 254 ms).
COUNT_THRESHOLD_MIN_POSITIONS = 1024
# counts accumulate in int16 over blocks of 256 positions (2.7 ms a pass over [1024, 8192],
# against 3.9 ms in one int16 sum per row and 23 ms in int32: XLA:CPU vectorises the former)
_COUNT_BLOCK = 256
# once at most this many rows are unsettled, they are gathered and bisected alone
TAIL_ROWS = 32


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
  return lax.bitcast_convert_type(_sortable_int32(x), jnp.uint32) ^ jnp.uint32(0x80000000)


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
  _check_scores(masked)
  masked = float32_scores(masked)
  n = _check_counts("n", n, masked.shape[:-1])
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


def _ordered_threshold(masked: Array, n: Array, k: int) -> Array:
  """Each row's top ``n`` (``0 <= n``, at most ``k``) as a comparison with its ``n``-th best
  entry, found in the row's first ``k`` in :func:`descending_order`.

  With ``(key*, pos*)`` the sortable key and position of that entry, the kept set is
  ``key > key*`` plus the tied ``key == key*`` at positions ``<= pos*``: ties enter the order by
  ascending position, so the kept ties are exactly those up to the last kept one. Keys are
  :func:`_sortable_int32` (exact integer comparisons, ``-0.0 == +0.0``, no subnormal flushing),
  the order every selection path produces.
  """
  idx = descending_order(masked, k)
  last = jnp.take_along_axis(idx, jnp.clip(n - 1, 0, k - 1)[..., None], -1)
  key = _sortable_int32(masked)
  threshold = jnp.take_along_axis(key, last, -1)
  return (key > threshold) | ((key == threshold) & (_iota(masked.shape) <= last))


def _uses_count_threshold(num_positions: int, k: int) -> bool:
  return num_positions >= COUNT_THRESHOLD_MIN_POSITIONS and k * 8 <= num_positions


@functools.cache
def _top_n_fn(k: int):
  """``(masked, n) -> top n mask``: :func:`count_threshold`, or the ordered top ``k`` when a row
  cannot settle (one ``lax.cond`` for the batch). Under ``vmap`` with the scores shared and only
  ``n`` batched (a sweep over budgets), one ordered top ``k`` serves every configuration (its
  batching rule), where the bisection would count each configuration's rows anew."""

  @jax.custom_batching.custom_vmap
  def top_n(masked, n):
    lo, ok = count_threshold(masked, n)
    return lax.cond(
      ok, lambda: order_keys(masked) >= lo[..., None], lambda: _ordered_threshold(masked, n, k)
    )

  @top_n.def_vmap
  def rule(axis_size, in_batched, masked, n):
    masked_batched, n_batched = in_batched
    if not n_batched:
      n = jnp.broadcast_to(n, (axis_size,) + n.shape)
    if not masked_batched:
      return jax.vmap(lambda n: _ordered_threshold(masked, n, k))(n), True
    return top_n(masked, n), True

  return top_n


def _threshold_mask(scores: Array, budget: Array, length: Array, capacity: int) -> Array:
  """Each row's top ``min(budget, length)`` with the no-compression guard: by
  :func:`count_threshold` on long rows with a shallow capacity, else :func:`_ordered_threshold`.
  """
  num_positions = scores.shape[-1]
  if length is None:  # every position is a candidate: no masking pass
    valid, masked = True, scores.astype(jnp.float32)
    length = jnp.full(budget.shape, num_positions, jnp.int32)
  else:
    valid = _iota(scores.shape) < length[..., None]
    masked = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
  k = min(capacity, num_positions)
  n = jnp.minimum(budget, length)
  if _uses_count_threshold(num_positions, k):
    keep = _top_n_fn(k)(masked, n)
  else:
    keep = _ordered_threshold(masked, n, k)
  keep = keep & (n > 0)[..., None]
  # Rows whose budget covers the whole valid prefix keep all of it (the no-compression guard),
  # even when the prefix is longer than the static capacity.
  return keep | ((budget >= length)[..., None] & valid)


def _mask_impl(scores: Array, budget: Array, length: Array, capacity: int) -> Array:
  return _threshold_mask(scores, budget, length, capacity)


def _prepare(scores, budget, length, capacity):
  _check_scores(scores)
  scores = float32_scores(scores)
  batch_shape = scores.shape[:-1]
  num_positions = scores.shape[-1]
  budget = _check_counts("budget", budget, batch_shape)
  if length is None:
    length = jnp.full(batch_shape, num_positions, jnp.int32)
  else:
    length = _check_counts("length", length, batch_shape)
    if is_concrete(length) and length.size and int(np.max(np.asarray(length))) > num_positions:
      raise ValueError(f"length: {int(np.max(length))} exceeds T={num_positions}")
  if capacity is None:
    capacity = num_positions
  _check_capacity(capacity, budget, length, num_positions)
  return scores, budget, length, int(capacity)


def keep_mask(scores: Array, budget, *, length=None, capacity: int | None = None) -> Array:
  """Marks the ``min(budget, length)`` highest scores of each row in a bool mask ``[..., T]``.

  Exactly ``min(budget, length)`` entries are True per row; ties go to the lower position.
  float64 scores are selected in their own order (:func:`float32_scores`).

  Concrete budgets and lengths are checked here; traced ones (under ``jit``) cannot be, and
  this unchecked path then answers without a signal: a budget in ``(capacity, length)`` keeps
  ``capacity`` entries, a negative budget keeps nothing, and a NaN score (traced) ranks above
  every number. :func:`checked_keep_mask` is the same selection that reports each of these
  under ``jit``.

  Args:
    scores: float [..., T], higher = keep.
    budget: int, broadcastable to ``scores.shape[:-1]`` (e.g. ``budget_LH`` for ``scores_LHT``).
    length: optional int per row: only positions ``< length`` are candidates (a causal prefix or
      a padded prompt). Defaults to ``T``.
    capacity: static upper bound on the budgets below ``T`` (default ``T``). Pass the largest
      budget of a sweep: ``top_k`` then costs ``O(T log capacity)`` instead of a full sort.

  Returns:
    The kept positions, bool ``[..., T]``.

  Raises:
    ValueError: for scores that are not floating, empty or NaN (when concrete); budgets or
      lengths that are not integers, negative, beyond int32 or do not broadcast to the rows; a
      length above ``T``; a capacity that is not a positive static int; and a concrete budget
      in ``(capacity, length)``, which the capacity cannot honour.
  """
  full_rows = length is None
  scores, budget, length, capacity = _prepare(scores, budget, length, capacity)
  return _mask_jit(scores, budget, None if full_rows else length, capacity)


def ranks(scores: Array, *, length=None, capacity: int | None = None) -> Array:
  """Ranks every position in its row, best first, ties to the lower position.

  Positions outside the top ``capacity`` (default ``T``) or beyond ``length`` get rank
  ``capacity`` (or more). ``keep_mask(scores, b) == ranks(scores) < min(b, length)`` for every
  ``b <= capacity``, so a sweep computes the ranks once and answers every budget with a
  comparison (or a prefix sum of the sorted metric).

  Args:
    scores: float ``[..., T]``, higher = keep.
    length: optional int per row: only positions ``< length`` are candidates. Defaults to ``T``.
    capacity: static number of ranks computed, the largest budget the ranks answer (default
      ``T``).

  Returns:
    int32 ranks ``[..., T]``, 0 for the best position of each row.

  Raises:
    ValueError: for scores that are not floating, empty or NaN (when concrete); lengths that are
      not integers, negative, beyond int32, above ``T`` or do not broadcast to the rows; and a
      capacity that is not a positive static int.
  """
  scores, _, length, capacity = _prepare(scores, jnp.zeros((), jnp.int32), length, capacity)
  return _rank_jit(scores, length, capacity)


def compact(scores: Array, budget, capacity: int, *, length=None) -> tuple[Array, Array]:
  """Lists the kept positions of each row in ``C = capacity`` static slots.

  For ``scores_LHT`` the result is ``(idx_LHC, valid_LHC)``. The valid slots hold the kept
  positions in ascending order and come first; invalid slots hold 0 (a safe gather index) and
  must be masked by ``valid``. The set equals :func:`keep_mask`'s. ``min(budget, length)`` must
  fit the ``capacity``: traced inputs are not checked and keep the first ``capacity`` slots (the
  model cache flags it as ``overflow``; :func:`checked_compact` reports it). This is the layout
  of :mod:`kvjax.model.cache`.

  Args:
    scores: float ``[..., T]``, higher = keep.
    budget: int, broadcastable to ``scores.shape[:-1]``.
    capacity: static number of slots ``C``, at least the largest ``min(budget, length)``.
    length: optional int per row: only positions ``< length`` are candidates. Defaults to ``T``.

  Returns:
    ``(idx, valid)``: int32 positions ``[..., C]`` and the bool ``[..., C]`` that marks the valid
    slots.

  Raises:
    ValueError: for scores that are not floating, empty or NaN (when concrete); budgets or
      lengths that are not integers, negative, beyond int32 or do not broadcast to the rows; a
      length above ``T``; a capacity that is not a positive static int; and concrete inputs
      whose ``min(budget, length)`` does not fit the ``capacity``.
  """
  scores, budget, length, capacity = _prepare(scores, budget, length, capacity)
  if is_concrete(budget) and is_concrete(length):
    _check_slots(budget, length, capacity)
  return _compact_jit(scores, budget, length, capacity)


def _check_slots(budget, length, capacity: int) -> None:
  need = np.minimum(np.asarray(budget), np.asarray(length))
  if need.size and int(need.max()) > capacity:
    raise ValueError(
      f"capacity: {capacity} slots cannot hold {int(need.max())} kept positions "
      "(min(budget, length)); expected capacity >= the largest budget"
    )


def _compact_impl(scores, budget, length, capacity):
  num_positions = scores.shape[-1]
  idx = _top_positions(scores, length, capacity)
  valid = _kept_slots(budget, length, capacity)
  # Ascending order of the kept positions: an int32 sort of a short row (cheap), with invalid
  # slots pushed to the end by the sentinel T.
  idx = jnp.sort(jnp.where(valid, idx, num_positions), axis=-1)
  valid = idx < num_positions
  return jnp.where(valid, idx, 0), valid


_mask_jit = jax.jit(_mask_impl, static_argnames="capacity")
_rank_jit = jax.jit(_rank_impl, static_argnames="capacity")
_compact_jit = jax.jit(_compact_impl, static_argnames="capacity")


def _flatten_heads(scores_LHT: Array) -> Array:
  if scores_LHT.ndim < 2:
    raise ValueError(f"scores: expected [..., H, T] for pooled selection, got {scores_LHT.shape}")
  return scores_LHT.reshape(scores_LHT.shape[:-2] + (-1,))


def keep_mask_pooled(
  scores_LHT: Array, budget_L, *, length=None, capacity: int | None = None
) -> Array:
  """Selects across the heads of each layer under a per-layer total budget.

  Flattens ``[..., H, T]`` to ``[..., H*T]`` and keeps the ``budget_L`` best entries of each
  layer, so heads receive data-dependent counts (the Ada-KV / kvpress ``AdaKVPress`` pooling).
  Ties go to the lower head, then the lower position.

  Args:
    scores_LHT: float scores ``[..., H, T]``, higher = keep.
    budget_L: int total per layer, broadcastable to ``scores_LHT.shape[:-2]``.
    length: optional int per layer and head, broadcastable to ``scores_LHT.shape[:-1]``:
      excludes positions past each head's prefix. Defaults to ``T``.
    capacity: static upper bound on the pooled budgets below ``H*T``, as in :func:`keep_mask`.

  Returns:
    The kept positions, bool ``[..., H, T]``.

  Raises:
    ValueError: for scores with fewer than two axes, not floating, empty or NaN (when
      concrete); budgets or lengths that are not integers, negative, beyond int32 or do not
      broadcast to the rows; and the capacity errors of :func:`keep_mask`.
  """
  flat = _flatten_heads(scores_LHT)  # validates [..., H, T]
  _check_scores(flat)
  num_heads, num_positions = scores_LHT.shape[-2:]
  # one layer's heads compete: float64 scores keep their order over the flattened layer
  scores_LHT = float32_scores(flat).reshape(scores_LHT.shape)
  if length is not None:
    length = _check_counts("length", length, scores_LHT.shape[:-1])
    scores_LHT = jnp.where(_iota(scores_LHT.shape) < length[..., None], scores_LHT, -jnp.inf)
    total = length.sum(-1)
  else:
    total = None
  flat = _flatten_heads(scores_LHT)
  budget_L = _check_counts("budget", budget_L, flat.shape[:-1])
  if total is not None:
    # Invalid positions carry -inf and must never be kept, so cap by the valid count.
    budget_L = jnp.minimum(budget_L, total)
  keep = keep_mask(flat, budget_L, capacity=capacity)
  return keep.reshape(scores_LHT.shape[:-2] + (num_heads, num_positions))


def pooled_budgets(scores_LHT: Array, budget_L, *, capacity: int | None = None) -> Array:
  """Counts the entries each head keeps under :func:`keep_mask_pooled`: int32 ``[..., H]``.

  The counts sum to ``budget_L``. Selecting each head's own top ``count_h`` reproduces the
  pooled set (up to exact ties across heads), which is how a real per-head cache stores a pooled
  selection.

  Args:
    scores_LHT: float scores ``[..., H, T]``, higher = keep.
    budget_L: int total per layer, broadcastable to ``scores_LHT.shape[:-2]``.
    capacity: static upper bound on the pooled budgets below ``H*T``, as in :func:`keep_mask`.

  Returns:
    int32 per-head counts ``[..., H]``.

  Raises:
    ValueError: as :func:`keep_mask_pooled`.
  """
  return keep_mask_pooled(scores_LHT, budget_L, capacity=capacity).sum(-1, dtype=jnp.int32)


def pooled_count_table(scores_LHT: Array, max_total: int) -> Array:
  """Tabulates each head's share of every pooled budget: int32 ``[..., n_max + 1, H]``.

  Row ``n`` holds how many of the layer's ``n`` best entries (flattened over heads, ties to the
  lower head then position) fall in each head, for ``n <= n_max = min(max_total, H*T)``. One
  ``top_k`` answers every pooled budget: ``table[..., n, :]`` equals
  ``pooled_budgets(scores, n)``. This is what lets a sweep over thousands of Ada-KV budgets
  share a single selection.

  Args:
    scores_LHT: float scores ``[..., H, T]``, higher = keep.
    max_total: static largest pooled budget the table answers.

  Returns:
    The cumulative per-head counts, int32 ``[..., n_max + 1, H]``.

  Raises:
    ValueError: for scores that are not floating, empty, NaN (when concrete) or with fewer than
      two axes, and a ``max_total`` that is not a static int in ``[1, 2**31)``.
  """
  _check_scores(scores_LHT)
  if scores_LHT.ndim < 2:
    raise ValueError(f"scores: expected [..., H, T] for a pooled table, got {scores_LHT.shape}")
  num_heads, num_positions = scores_LHT.shape[-2:]
  k = min(check_static_count("max_total", max_total), num_heads * num_positions)
  idx = descending_order(float32_scores(_flatten_heads(scores_LHT)), k)
  onehot = jax.nn.one_hot(idx // num_positions, num_heads, dtype=jnp.int32)
  counts = jnp.cumsum(onehot, axis=-2, dtype=jnp.int32)
  zeros = jnp.zeros(counts.shape[:-2] + (1, num_heads), jnp.int32)
  return jnp.concatenate([zeros, counts], axis=-2)


def pooled_counts_from_table(table: Array, total) -> Array:
  """Reads per-head counts ``[..., H]`` of pooled budgets from a :func:`pooled_count_table`.

  Args:
    table: int32 ``[..., n_max + 1, H]`` from :func:`pooled_count_table`.
    total: int pooled budgets ``[...]``, clipped to ``n_max``.

  Returns:
    int32 per-head counts ``[..., H]``.

  Raises:
    ValueError: for totals that are not integers, or (when concrete) negative or beyond int32.
  """
  n_max = table.shape[-2] - 1
  total = check_counts("total", total)  # in int32 range (concrete); the clip is documented
  n = jnp.clip(jnp.asarray(total).astype(jnp.int32), 0, n_max)
  return jnp.take_along_axis(table, n[..., None, None], axis=-2)[..., 0, :]


def pooled_rank_table(scores_LHT: Array, max_total: int) -> Array:
  """Lists each head's places in its layer's pooled order, grouped by head: int32 ``[..., n_max]``.

  The layer's ``n_max = min(max_total, H*T)`` best entries (flattened over heads, ties to the
  lower head then position), entry ``r`` of head ``h`` coded ``h * (n_max + 1) + r`` and sorted
  ascending: ``O(H*T)`` per layer, where :func:`pooled_count_table` holds ``O(H^2 T)``. Answer a
  pooled budget with :func:`pooled_counts_from_ranks` (two ``searchsorted`` per head); the counts
  equal ``pooled_budgets(scores, n)`` for every ``n <= n_max``.

  Args:
    scores_LHT: float scores ``[..., H, T]``, higher = keep.
    max_total: static largest pooled budget the table answers.

  Returns:
    The sorted int32 codes ``[..., n_max]``.

  Raises:
    ValueError: for scores that are not floating, empty, NaN (when concrete) or with fewer than
      two axes; a ``max_total`` that is not a static int in ``[1, 2**31)``; and codes that do
      not fit int32: ``H * (n_max + 1) < 2**31`` is required.
  """
  _check_scores(scores_LHT)
  if scores_LHT.ndim < 2:
    raise ValueError(f"scores: expected [..., H, T] for a pooled table, got {scores_LHT.shape}")
  num_heads, num_positions = scores_LHT.shape[-2:]
  k = min(check_static_count("max_total", max_total), num_heads * num_positions)
  if num_heads * (k + 1) >= INT32_LIMIT:
    raise ValueError(
      f"max_total: {max_total} gives codes up to H * (n_max + 1) = {num_heads * (k + 1)}; "
      "expected H * (min(max_total, H*T) + 1) < 2**31"
    )
  idx = descending_order(float32_scores(_flatten_heads(scores_LHT)), k)
  codes = (idx // num_positions) * (k + 1) + _iota(idx.shape)
  return jnp.sort(codes, axis=-1)


def pooled_counts_from_ranks(table: Array, total, num_heads: int) -> Array:
  """Reads per-head counts ``[..., H]`` of pooled budgets from a :func:`pooled_rank_table`.

  Head ``h`` holds the codes in ``[h (n_max + 1), h (n_max + 1) + n)`` among the layer's ``n``
  best.

  Args:
    table: the sorted int32 codes ``[..., n_max]`` of :func:`pooled_rank_table`.
    total: int pooled budgets ``[...]``, broadcast to the table's leading shape and clipped to
      ``n_max``.
    num_heads: static number of heads ``H``.

  Returns:
    int32 per-head counts ``[..., H]``.

  Raises:
    ValueError: for a ``num_heads`` that is not a static int in ``[1, 2**31)``, and totals that
      are not integers, or (when concrete) negative or beyond int32.
  """
  n_max = table.shape[-1]
  num_heads = check_static_count("num_heads", num_heads)
  total = check_counts("total", total)  # in int32 range (concrete); the clip is documented
  n = jnp.clip(jnp.asarray(total).astype(jnp.int32), 0, n_max)
  lead = table.shape[:-1]
  n = jnp.broadcast_to(n, lead)
  start_H = jnp.arange(num_heads, dtype=jnp.int32) * (n_max + 1)
  rows = int(np.prod(lead, dtype=np.int64))
  table_RN, n_R = table.reshape(rows, n_max), n.reshape(rows)

  def count(row_N, n):
    return jnp.searchsorted(row_N, start_H + n) - jnp.searchsorted(row_N, start_H)

  return jax.vmap(count)(table_RN, n_R).astype(jnp.int32).reshape(lead + (num_heads,))


# --------------------------------------------------------------------------- checked selection


def check_selection(
  scores: Array, budget: Array, length: Array, capacity: int, *, slots: bool
) -> None:
  """Adds ``checkify`` checks of a selection's data, under ``jit`` inside a ``checkify.checkify``.

  Reports NaN scores, negative budgets, lengths outside ``[0, T]``, and budgets the capacity
  cannot honour: for a mask (``slots=False``) a budget in ``(capacity, length)``, for the compact
  form (``slots=True``) ``min(budget, length) > capacity``.

  Args:
    scores: float scores ``[..., T]``.
    budget: the int32 per-row budgets (:func:`keep_mask`'s validated argument).
    length: the int32 per-row lengths (:func:`keep_mask`'s validated argument).
    capacity: static capacity of the selection.
    slots: True for the compact form (:func:`compact`), False for a mask.
  """
  num_positions = scores.shape[-1]
  nan = jnp.isnan(scores.astype(jnp.float32))
  checkify.check(
    ~jnp.any(nan),
    "scores: contains {n} NaN; expected finite scores (or +/-inf sentinels)",
    n=nan.sum(dtype=jnp.int32),
  )
  checkify.check(
    jnp.all(budget >= 0),
    "budget: expected non-negative counts, got minimum {low}",
    low=jnp.min(budget, initial=0),
  )
  checkify.check(
    jnp.all((length >= 0) & (length <= num_positions)),
    f"length: expected counts in [0, T={num_positions}], got {{low}}..{{high}}",
    low=jnp.min(length, initial=0),
    high=jnp.max(length, initial=0),
  )
  if slots:
    need = jnp.minimum(budget, length)
    checkify.check(
      jnp.all(need <= capacity),
      f"capacity: {capacity} slots cannot hold {{need}} kept positions (min(budget, length)); "
      "expected capacity >= the largest budget",
      need=jnp.max(need, initial=0),
    )
  elif capacity < num_positions:
    over = (budget > capacity) & (budget < length)
    checkify.check(
      ~jnp.any(over),
      f"budget: {{budget}} exceeds capacity={capacity} for a row of length {{length}}; "
      "expected budget <= capacity or budget >= length",
      budget=jnp.max(jnp.where(over, budget, 0), initial=0),
      length=jnp.max(jnp.where(over, length, 0), initial=0),
    )


def _checked_mask_impl(scores, budget, length, capacity):
  check_selection(scores, budget, length, capacity, slots=False)
  return _mask_impl(scores, budget, length, capacity)


def _checked_compact_impl(scores, budget, length, capacity):
  check_selection(scores, budget, length, capacity, slots=True)
  return _compact_impl(scores, budget, length, capacity)


_checked_mask_jit = jax.jit(checkify.checkify(_checked_mask_impl), static_argnames="capacity")
_checked_compact_jit = jax.jit(checkify.checkify(_checked_compact_impl), static_argnames="capacity")


def checked_keep_mask(
  scores: Array, budget, *, length=None, capacity: int | None = None
) -> tuple[checkify.Error, Array]:
  """Runs :func:`keep_mask` and also checks its traced data: ``(error, keep)``.

  Under ``jit`` a NaN score, a negative budget or a budget above the capacity cannot be seen in
  Python, and :func:`keep_mask` then answers with no signal (a NaN ranks above every number, a
  negative budget keeps nothing). This opt-in form runs the :func:`check_selection` checks with
  ``jax.experimental.checkify``: call ``error.throw()`` (or read ``error.get()``) outside
  ``jit``. It can be called inside ``jit``; the error is a pytree to return from it.

  Args:
    scores: float [..., T], higher = keep.
    budget: int, broadcastable to ``scores.shape[:-1]``.
    length: optional int per row: only positions ``< length`` are candidates. Defaults to ``T``.
    capacity: static upper bound on the budgets below ``T`` (default ``T``).

  Returns:
    ``(error, keep)``: a ``checkify.Error`` and :func:`keep_mask`'s bool ``[..., T]``.

  Raises:
    ValueError: at once for concrete bad input, as :func:`keep_mask`.
  """
  scores, budget, length, capacity = _prepare(scores, budget, length, capacity)
  return _checked_mask_jit(scores, budget, length, capacity=capacity)


def checked_compact(
  scores: Array, budget, capacity: int, *, length=None
) -> tuple[checkify.Error, tuple[Array, Array]]:
  """Runs :func:`compact` and also checks its traced data: ``(error, (idx, valid))``.

  As :func:`checked_keep_mask`, and reports ``min(budget, length) > capacity`` (slots overflow).

  Args:
    scores: float ``[..., T]``, higher = keep.
    budget: int, broadcastable to ``scores.shape[:-1]``.
    capacity: static number of slots ``C``.
    length: optional int per row: only positions ``< length`` are candidates. Defaults to ``T``.

  Returns:
    ``(error, (idx, valid))``: a ``checkify.Error`` and :func:`compact`'s int32 positions and
    bool valid slots, both ``[..., C]``.

  Raises:
    ValueError: at once for concrete bad input, as :func:`compact`.
  """
  scores, budget, length, capacity = _prepare(scores, budget, length, capacity)
  if is_concrete(budget) and is_concrete(length):
    _check_slots(budget, length, capacity)
  return _checked_compact_jit(scores, budget, length, capacity=capacity)


def kept_count(keep: Array) -> Array:
  """Counts the kept positions of each row.

  Args:
    keep: bool mask ``[..., T]``.

  Returns:
    int32 counts ``[...]``.
  """
  return keep.sum(-1, dtype=jnp.int32)
