"""Integer budgets from real ones: largest-remainder rounding to an exact total
(:func:`round_to_total`) and CAKE's capped adjustment (:func:`adjust_budgets`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import checks, select
from kvjax.budgets.tokens import as_int32

Array = jax.Array


def round_to_total(weights_L: Array, total) -> Array:
  """Rounds non-negative reals to ints that sum to exactly ``total`` (largest remainder).

  ``weights_L`` must already sum to ``total`` (up to float error). The leftover units go to the
  largest fractional parts, ties to the lower index (via :func:`kvjax.select.top_mask`).

  Args:
    weights_L: non-negative floats ``[N]`` that sum to ``total``.
    total: the integer target.

  Returns:
    int32 counts ``[N]``.

  Raises:
    ValueError: for a total that is not an integer count or (when concrete) is negative or
      beyond int32.
  """
  total = as_int32(checks.counts("total", total))
  floors = jnp.floor(weights_L)
  deficit = total - floors.sum().astype(jnp.int32)
  extra = select.top_mask(weights_L - floors, jnp.clip(deficit, 0, weights_L.shape[-1]))
  return floors.astype(jnp.int32) + extra.astype(jnp.int32)


def adjust_budgets(budgets_L: Array, total, seq_len) -> Array:
  """Applies CAKE's ``adjust_budgets``: integer budgets capped at ``seq_len`` that sum to ``total``.

  Truncates to int, caps at ``seq_len`` and hands the excess to the uncapped layers (remainder to
  the lowest indices), then forces the exact ``total`` by adding to layers below ``seq_len`` (or
  removing from layers above 1), remainder to the lowest indices.

  Args:
    budgets_L: real budgets per layer ``[L]``.
    total: the integer target sum.
    seq_len: the cap per layer, an integer count.

  Returns:
    int32 budgets ``[L]``.

  Raises:
    ValueError: for a ``total`` or ``seq_len`` that is not an integer count or (when concrete)
      is negative or beyond int32, and concrete budgets that are not finite.
  """
  total = as_int32(checks.counts("total", total))
  seq_len = as_int32(checks.counts("seq_len", seq_len))
  checks.finite("budgets", budgets_L)
  b = jnp.trunc(budgets_L).astype(jnp.int32)
  excess = jnp.maximum(b - seq_len, 0).sum()
  b = jnp.minimum(b, seq_len)
  b = _spread(b, excess, b < seq_len)
  diff = total - b.sum()
  valid = jnp.where(diff > 0, b < seq_len, b > 1)
  return _spread(b, jnp.abs(diff), valid, sign=jnp.sign(diff))


def _spread(b, amount, valid, sign=1):
  """Adds ``amount`` evenly over ``valid`` entries, the remainder to the first valid ones."""
  num_valid = valid.sum()
  safe = jnp.maximum(num_valid, 1)
  rank = jnp.cumsum(valid) - 1
  add = jnp.where(valid, amount // safe + (rank < amount % safe), 0)
  return jnp.where(num_valid > 0, b + sign * add, b).astype(jnp.int32)
