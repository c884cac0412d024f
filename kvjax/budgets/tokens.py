"""Token counts in budgets: integer budgets, budgets that count the protected window, allocations
that leave no row empty, and the cast to int32 once a count is checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks

Array = jax.Array


def as_int32(value) -> Array:
  """Casts a checked count (numpy or traced) to int32.

  Args:
    value: a count that :func:`kvjax.checks.counts` accepted (so within int32 when concrete).

  Returns:
    The count as an int32 array.
  """
  if checks.is_concrete(value):
    return jnp.asarray(np.asarray(value, np.int32))
  return jnp.asarray(value).astype(jnp.int32)


def int_budget(name: str, value):
  """Checks budgets as token counts: an integer dtype, and in ``[0, 2**31)`` when concrete.

  No silent truncation of ``5.5``, no wrap of ``np.int64(2**32 + 12)`` to 12.

  Args:
    name: the argument's name, quoted in error messages.
    value: the budgets, an int or an int array, concrete or traced.

  Returns:
    The checked budgets, as :func:`kvjax.checks.counts` returns them.

  Raises:
    ValueError: for a non-integer dtype, and concrete budgets that are negative or beyond int32.
  """
  arr = np.asarray(value) if checks.is_concrete(value) else value
  if arr.dtype != object and not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{name}: expected integer token counts, got dtype {arr.dtype}")
  return checks.counts(name, value)


def covers_window(budget, window) -> None:
  """Checks that every budget counts the protected window: ``budget >= window``.

  Args:
    budget: the budgets, concrete or traced.
    window: the protected window, an integer count.

  Raises:
    ValueError: for a window that is not an integer count, and concrete budgets below it.
  """
  checks.counts("window", window)
  if checks.is_concrete(budget, window) and np.any(np.asarray(budget) < np.asarray(window)):
    raise ValueError(
      f"budget: {np.asarray(budget).tolist()} is smaller than the protected window "
      f"{np.asarray(window).tolist()}; every budget counts the window, expected budget >= window"
    )


def not_empty(name: str, budgets: Array, q_len) -> Array:
  """Checks that an allocation leaves no row of a non-empty prompt without cache.

  A row that would keep nothing of a non-empty prompt is a bug upstream; here it is an error.

  Args:
    name: the argument quoted in the error message (the budget the allocation came from).
    budgets: the allocation.
    q_len: the prompt length, broadcastable to ``budgets``.

  Returns:
    ``budgets`` unchanged.

  Raises:
    ValueError: for a concrete allocation with a row ``<= 0`` where the prompt is not empty.
  """
  if checks.is_concrete(budgets, q_len) and np.any(
    (np.asarray(budgets) <= 0) & (np.asarray(q_len) > 0)
  ):
    raise ValueError(
      f"{name}: the allocation {np.asarray(budgets).tolist()} leaves a row with no cache; "
      "expected a larger budget (or a non-zero window)"
    )
  return budgets
