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
  cannot be checked in Python: :func:`top_mask` and :func:`compact` then keep what their
  docstrings say without a signal (a budget above the capacity keeps ``capacity`` entries);
  :func:`checked_top_mask` and :func:`checked_compact` report NaN scores, negative budgets and
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

The package: :mod:`kvjax.select.validation` checks the inputs (in Python, and under ``jit`` with
``checkify``) and makes the float32 keys; :mod:`kvjax.select.threshold` holds the integer keys
and the count threshold; this module orders rows (:func:`descending_order`, whose sort path
:func:`uses_packed_sort` decides at trace time) and selects with them: masks, ranks, slots, the
pooled selection across heads and the checked forms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from ..checks import INT32_LIMIT, is_concrete
from ..checks import counts as check_counts
from ..checks import static_int as check_static_count
from .threshold import (
  COUNT_THRESHOLD_MIN_POSITIONS,
  TAIL_ROWS,
  count_threshold,
  order_keys,
  sortable_int32,
  uses_count_threshold,
)
from .validation import (
  check_scores,
  check_selection,
  check_slots,
  float32_scores,
  prepare,
  row_counts,
)

Array = jax.Array

__all__ = [
  "COUNT_THRESHOLD_MIN_POSITIONS",
  "INT32_LIMIT",
  "TAIL_ROWS",
  "check_counts",
  "check_selection",
  "check_static_count",
  "checked_compact",
  "checked_top_mask",
  "compact",
  "count_threshold",
  "descending_order",
  "descending_order_by_layer",
  "descending_values",
  "float32_scores",
  "is_concrete",
  "kept_count",
  "order_keys",
  "pooled_budgets",
  "pooled_count_table",
  "pooled_counts_from_ranks",
  "pooled_counts_from_table",
  "pooled_rank_table",
  "ranks",
  "sortable_int32",
  "top_mask",
  "top_mask_pooled",
  "uses_packed_sort",
]


def _iota(shape: tuple[int, ...]) -> Array:
  """int32 positions along the last axis, materialised at ``shape`` (no rank promotion)."""
  return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def uses_packed_sort() -> bool:
  """Tells whether deep orders use the packed int64 sort: on XLA:CPU only, decided at trace time.

  That sort is a CPU workaround (float and multi-operand sorts take XLA:CPU's slow path).
  Elsewhere the portable two-key integer sort gives the same order. Every ordering path reads it
  here at trace time, so tests patch ``kvjax.select.uses_packed_sort`` to run the portable path
  on CPU.

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
  key = sortable_int32(scores)
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
  key = sortable_int32(x)
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


# --------------------------------------------------------------------------- masks, ranks, slots


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


def _ordered_threshold(masked: Array, n: Array, k: int) -> Array:
  """Each row's top ``n`` (``0 <= n``, at most ``k``) as a comparison with its ``n``-th best
  entry, found in the row's first ``k`` in :func:`descending_order`.

  With ``(key*, pos*)`` the sortable key and position of that entry, the kept set is
  ``key > key*`` plus the tied ``key == key*`` at positions ``<= pos*``: ties enter the order by
  ascending position, so the kept ties are exactly those up to the last kept one. Keys are
  :func:`sortable_int32` (exact integer comparisons, ``-0.0 == +0.0``, no subnormal flushing),
  the order every selection path produces.
  """
  idx = descending_order(masked, k)
  last = jnp.take_along_axis(idx, jnp.clip(n - 1, 0, k - 1)[..., None], -1)
  key = sortable_int32(masked)
  threshold = jnp.take_along_axis(key, last, -1)
  return (key > threshold) | ((key == threshold) & (_iota(masked.shape) <= last))


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
  if uses_count_threshold(num_positions, k):
    keep = _top_n_fn(k)(masked, n)
  else:
    keep = _ordered_threshold(masked, n, k)
  keep = keep & (n > 0)[..., None]
  # Rows whose budget covers the whole valid prefix keep all of it (the no-compression guard),
  # even when the prefix is longer than the static capacity.
  return keep | ((budget >= length)[..., None] & valid)


def _mask_impl(scores: Array, budget: Array, length: Array, capacity: int) -> Array:
  return _threshold_mask(scores, budget, length, capacity)


def top_mask(scores: Array, budget, *, length=None, capacity: int | None = None) -> Array:
  """Marks the ``min(budget, length)`` highest scores of each row in a bool mask ``[..., T]``.

  Exactly ``min(budget, length)`` entries are True per row; ties go to the lower position.
  float64 scores are selected in their own order (:func:`float32_scores`).

  Concrete budgets and lengths are checked here; traced ones (under ``jit``) cannot be, and
  this unchecked path then answers without a signal: a budget in ``(capacity, length)`` keeps
  ``capacity`` entries, a negative budget keeps nothing, and a NaN score (traced) ranks above
  every number. :func:`checked_top_mask` is the same selection that reports each of these
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
  scores, budget, length, capacity = prepare(scores, budget, length, capacity)
  return _mask_jit(scores, budget, None if full_rows else length, capacity)


def ranks(scores: Array, *, length=None, capacity: int | None = None) -> Array:
  """Ranks every position in its row, best first, ties to the lower position.

  Positions outside the top ``capacity`` (default ``T``) or beyond ``length`` get rank
  ``capacity`` (or more). ``top_mask(scores, b) == ranks(scores) < min(b, length)`` for every
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
  scores, _, length, capacity = prepare(scores, jnp.zeros((), jnp.int32), length, capacity)
  return _rank_jit(scores, length, capacity)


def compact(scores: Array, budget, capacity: int, *, length=None) -> tuple[Array, Array]:
  """Lists the kept positions of each row in ``C = capacity`` static slots.

  For ``scores_LHT`` the result is ``(idx_LHC, valid_LHC)``. The valid slots hold the kept
  positions in ascending order and come first; invalid slots hold 0 (a safe gather index) and
  must be masked by ``valid``. The set equals :func:`top_mask`'s. ``min(budget, length)`` must
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
  scores, budget, length, capacity = prepare(scores, budget, length, capacity)
  if is_concrete(budget) and is_concrete(length):
    check_slots(budget, length, capacity)
  return _compact_jit(scores, budget, length, capacity)


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


# --------------------------------------------------------------------------- pooled selection


def _flatten_heads(scores_LHT: Array) -> Array:
  if scores_LHT.ndim < 2:
    raise ValueError(f"scores: expected [..., H, T] for pooled selection, got {scores_LHT.shape}")
  return scores_LHT.reshape(scores_LHT.shape[:-2] + (-1,))


def top_mask_pooled(
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
    capacity: static upper bound on the pooled budgets below ``H*T``, as in :func:`top_mask`.

  Returns:
    The kept positions, bool ``[..., H, T]``.

  Raises:
    ValueError: for scores with fewer than two axes, not floating, empty or NaN (when
      concrete); budgets or lengths that are not integers, negative, beyond int32 or do not
      broadcast to the rows; and the capacity errors of :func:`top_mask`.
  """
  flat = _flatten_heads(scores_LHT)  # validates [..., H, T]
  check_scores(flat)
  num_heads, num_positions = scores_LHT.shape[-2:]
  # one layer's heads compete: float64 scores keep their order over the flattened layer
  scores_LHT = float32_scores(flat).reshape(scores_LHT.shape)
  if length is not None:
    length = row_counts("length", length, scores_LHT.shape[:-1])
    scores_LHT = jnp.where(_iota(scores_LHT.shape) < length[..., None], scores_LHT, -jnp.inf)
    total = length.sum(-1)
  else:
    total = None
  flat = _flatten_heads(scores_LHT)
  budget_L = row_counts("budget", budget_L, flat.shape[:-1])
  if total is not None:
    # Invalid positions carry -inf and must never be kept, so cap by the valid count.
    budget_L = jnp.minimum(budget_L, total)
  keep = top_mask(flat, budget_L, capacity=capacity)
  return keep.reshape(scores_LHT.shape[:-2] + (num_heads, num_positions))


def pooled_budgets(scores_LHT: Array, budget_L, *, capacity: int | None = None) -> Array:
  """Counts the entries each head keeps under :func:`top_mask_pooled`: int32 ``[..., H]``.

  The counts sum to ``budget_L``. Selecting each head's own top ``count_h`` reproduces the
  pooled set (up to exact ties across heads), which is how a real per-head cache stores a pooled
  selection.

  Args:
    scores_LHT: float scores ``[..., H, T]``, higher = keep.
    budget_L: int total per layer, broadcastable to ``scores_LHT.shape[:-2]``.
    capacity: static upper bound on the pooled budgets below ``H*T``, as in :func:`top_mask`.

  Returns:
    int32 per-head counts ``[..., H]``.

  Raises:
    ValueError: as :func:`top_mask_pooled`.
  """
  return top_mask_pooled(scores_LHT, budget_L, capacity=capacity).sum(-1, dtype=jnp.int32)


def _pooled_depth(scores_LHT: Array, max_total) -> tuple[int, int, int]:
  """``(H, T, n_max)`` of a pooled table, ``n_max = min(max_total, H*T)``, the scores checked."""
  check_scores(scores_LHT)
  if scores_LHT.ndim < 2:
    raise ValueError(f"scores: expected [..., H, T] for a pooled table, got {scores_LHT.shape}")
  num_heads, num_positions = scores_LHT.shape[-2:]
  return (
    num_heads,
    num_positions,
    min(check_static_count("max_total", max_total), num_heads * num_positions),
  )


def _clipped_totals(total, n_max: int) -> Array:
  """Pooled budgets as int32, clipped to a table's ``n_max``."""
  total = check_counts("total", total)  # in int32 range (concrete); the clip is documented
  return jnp.clip(jnp.asarray(total).astype(jnp.int32), 0, n_max)


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
  num_heads, num_positions, k = _pooled_depth(scores_LHT, max_total)
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
  n = _clipped_totals(total, n_max)
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
  num_heads, num_positions, k = _pooled_depth(scores_LHT, max_total)
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
  n = _clipped_totals(total, n_max)
  lead = table.shape[:-1]
  n = jnp.broadcast_to(n, lead)
  start_H = jnp.arange(num_heads, dtype=jnp.int32) * (n_max + 1)
  rows = int(np.prod(lead, dtype=np.int64))
  table_RN, n_R = table.reshape(rows, n_max), n.reshape(rows)

  def count(row_N, n):
    return jnp.searchsorted(row_N, start_H + n) - jnp.searchsorted(row_N, start_H)

  return jax.vmap(count)(table_RN, n_R).astype(jnp.int32).reshape(lead + (num_heads,))


# --------------------------------------------------------------------------- checked selection


def _checked_mask_impl(scores, budget, length, capacity):
  check_selection(scores, budget, length, capacity, slots=False)
  return _mask_impl(scores, budget, length, capacity)


def _checked_compact_impl(scores, budget, length, capacity):
  check_selection(scores, budget, length, capacity, slots=True)
  return _compact_impl(scores, budget, length, capacity)


_checked_mask_jit = jax.jit(checkify.checkify(_checked_mask_impl), static_argnames="capacity")


_checked_compact_jit = jax.jit(checkify.checkify(_checked_compact_impl), static_argnames="capacity")


def checked_top_mask(
  scores: Array, budget, *, length=None, capacity: int | None = None
) -> tuple[checkify.Error, Array]:
  """Runs :func:`top_mask` and also checks its traced data: ``(error, keep)``.

  Under ``jit`` a NaN score, a negative budget or a budget above the capacity cannot be seen in
  Python, and :func:`top_mask` then answers with no signal (a NaN ranks above every number, a
  negative budget keeps nothing). This opt-in form runs the :func:`check_selection` checks with
  ``jax.experimental.checkify``: call ``error.throw()`` (or read ``error.get()``) outside
  ``jit``. It can be called inside ``jit``; the error is a pytree to return from it.

  Args:
    scores: float [..., T], higher = keep.
    budget: int, broadcastable to ``scores.shape[:-1]``.
    length: optional int per row: only positions ``< length`` are candidates. Defaults to ``T``.
    capacity: static upper bound on the budgets below ``T`` (default ``T``).

  Returns:
    ``(error, keep)``: a ``checkify.Error`` and :func:`top_mask`'s bool ``[..., T]``.

  Raises:
    ValueError: at once for concrete bad input, as :func:`top_mask`.
  """
  scores, budget, length, capacity = prepare(scores, budget, length, capacity)
  return _checked_mask_jit(scores, budget, length, capacity=capacity)


def checked_compact(
  scores: Array, budget, capacity: int, *, length=None
) -> tuple[checkify.Error, tuple[Array, Array]]:
  """Runs :func:`compact` and also checks its traced data: ``(error, (idx, valid))``.

  As :func:`checked_top_mask`, and reports ``min(budget, length) > capacity`` (slots overflow).

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
  scores, budget, length, capacity = prepare(scores, budget, length, capacity)
  if is_concrete(budget) and is_concrete(length):
    check_slots(budget, length, capacity)
  return _checked_compact_jit(scores, budget, length, capacity=capacity)


def kept_count(keep: Array) -> Array:
  """Counts the kept positions of each row.

  Args:
    keep: bool mask ``[..., T]``.

  Returns:
    int32 counts ``[...]``.
  """
  return keep.sum(-1, dtype=jnp.int32)
