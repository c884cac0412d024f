"""The checks of a selection's inputs: scores, per-row counts and the capacity in Python (concrete
values), the same data under ``jit`` with ``checkify`` (:func:`check_selection`), and the float32
keys every selection path orders by (:func:`float32_scores`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from kvjax import checks
from kvjax.checks import INT32_LIMIT, is_concrete

Array = jax.Array


def check_scores(scores) -> None:
  """Checks selection scores: floating ``[..., T]`` with ``T >= 1``, no NaN when concrete.

  Args:
    scores: the scores.

  Raises:
    ValueError: for a value without a last axis, a non-floating dtype, no position, and
      (concrete) NaN scores.
  """
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


def row_counts(name: str, value, batch_shape: tuple[int, ...]) -> Array:
  """Checks an integer per-row count (a budget or a length) and broadcasts it to the rows.

  Args:
    name: the argument's name, quoted in error messages.
    value: the counts, an int or an int array, concrete or traced.
    batch_shape: the rows' shape (the scores' leading axes).

  Returns:
    int32 counts ``batch_shape``.

  Raises:
    ValueError: for counts that :func:`kvjax.checks.counts` refuses, and a shape that does not
      broadcast to the rows or has more axes.
  """
  value = checks.counts(name, value)
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
  if not checks.is_int(capacity) or capacity < 1:
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


def prepare(scores, budget, length, capacity) -> tuple[Array, Array, Array, int]:
  """Checks a selection's inputs and brings them to the form the jitted selection takes.

  Args:
    scores: floating scores ``[..., T]``.
    budget: int budgets, broadcastable to the rows ``scores.shape[:-1]``.
    length: int lengths per row, or ``None`` for ``T``.
    capacity: the static capacity, or ``None`` for ``T``.

  Returns:
    ``(scores, budget, length, capacity)``: the float32 keys (:func:`float32_scores`), int32
    budgets and lengths of the row shape, and the capacity as a Python ``int``.

  Raises:
    ValueError: for scores that are not floating, empty or NaN (when concrete); budgets or
      lengths that are not integers, negative, beyond int32 or do not broadcast to the rows; a
      length above ``T``; a capacity that is not a positive static int; and a concrete budget
      in ``(capacity, length)``, which the capacity cannot honour.
  """
  check_scores(scores)
  scores = float32_scores(scores)
  batch_shape = scores.shape[:-1]
  num_positions = scores.shape[-1]
  budget = row_counts("budget", budget, batch_shape)
  if length is None:
    length = jnp.full(batch_shape, num_positions, jnp.int32)
  else:
    length = row_counts("length", length, batch_shape)
    if is_concrete(length) and length.size and int(np.max(np.asarray(length))) > num_positions:
      raise ValueError(f"length: {int(np.max(length))} exceeds T={num_positions}")
  if capacity is None:
    capacity = num_positions
  _check_capacity(capacity, budget, length, num_positions)
  return scores, budget, length, int(capacity)


def check_slots(budget, length, capacity: int) -> None:
  """Checks that ``capacity`` slots hold every row's ``min(budget, length)`` kept positions.

  Args:
    budget: concrete int budgets per row.
    length: concrete int lengths per row.
    capacity: the number of slots.

  Raises:
    ValueError: for a row that keeps more positions than the slots hold.
  """
  need = np.minimum(np.asarray(budget), np.asarray(length))
  if need.size and int(need.max()) > capacity:
    raise ValueError(
      f"capacity: {capacity} slots cannot hold {int(need.max())} kept positions "
      "(min(budget, length)); expected capacity >= the largest budget"
    )


def check_selection(
  scores: Array, budget: Array, length: Array, capacity: int, *, slots: bool
) -> None:
  """Adds ``checkify`` checks of a selection's data, under ``jit`` inside a ``checkify.checkify``.

  Reports NaN scores, negative budgets, lengths outside ``[0, T]``, and budgets the capacity
  cannot honour: for a mask (``slots=False``) a budget in ``(capacity, length)``, for the compact
  form (``slots=True``) ``min(budget, length) > capacity``.

  Args:
    scores: float scores ``[..., T]``.
    budget: the int32 per-row budgets (:func:`kvjax.select.top_mask`'s validated argument).
    length: the int32 per-row lengths (:func:`kvjax.select.top_mask`'s validated argument).
    capacity: static capacity of the selection.
    slots: True for the compact form (:func:`kvjax.select.compact`), False for a mask.
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
