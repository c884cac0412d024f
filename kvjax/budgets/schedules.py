"""Budgets per layer and head: uniform and explicit tables, and the layer schedules of PyramidKV
and CAKE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks
from kvjax import scores as scores_lib
from kvjax.budgets.rounding import adjust_budgets, round_to_total
from kvjax.budgets.tokens import as_int32, covers_window, int_budget, not_empty

Array = jax.Array

PYRAMID_MODES = ("legacy_floor", "kvpress", "exact_total")


# --------------------------------------------------------------------------- simple allocations


def uniform(num_layers: int, num_heads: int, budget) -> Array:
  """Gives every layer and head the same budget: ``budget_LH`` int32.

  Args:
    num_layers: the number of layers ``L``, a static int ``>= 1``.
    num_heads: the number of heads ``H``, a static int ``>= 1``.
    budget: the budget, an integer token count broadcastable to ``[L, H]``.

  Returns:
    int32 budgets ``[L, H]``.

  Raises:
    ValueError: for layer or head counts that are not static ints in ``[1, 2**31)``, and a
      budget that is not an integer count or (when concrete) is negative or beyond int32.
  """
  num_layers = checks.static_int("num_layers", num_layers)
  num_heads = checks.static_int("num_heads", num_heads)
  budget = int_budget("budget", budget)
  return jnp.broadcast_to(as_int32(budget), (num_layers, num_heads))


def per_head(budget_L, num_heads: int) -> Array:
  """Broadcasts a per-layer budget ``[L]`` to every head: ``budget_LH`` int32.

  Args:
    budget_L: integer token counts per layer ``[L]``.
    num_heads: the number of heads ``H``, a static int ``>= 1``.

  Returns:
    int32 budgets ``[L, H]``.

  Raises:
    ValueError: for a budget that is not an integer count, (when concrete) is negative or
      beyond int32, or is not ``[L]``, and a head count that is not a static int in
      ``[1, 2**31)``.
  """
  budget_L = as_int32(int_budget("budget", budget_L))
  if budget_L.ndim != 1:
    raise ValueError(f"budget: expected a per-layer budget [L], got shape {budget_L.shape}")
  num_heads = checks.static_int("num_heads", num_heads)
  return jnp.broadcast_to(budget_L[:, None], budget_L.shape + (num_heads,))


def from_table(table, num_layers: int, num_heads: int) -> Array:
  """Validates an explicit budget table from a config as ``budget_LH`` int32.

  Args:
    table: a scalar, a per-layer list ``[L]`` or a full ``[L][H]`` table of non-negative ints
      (integral floats are accepted).
    num_layers: the number of layers ``L``, a static int ``>= 1``.
    num_heads: the number of heads ``H``, a static int ``>= 1``.

  Returns:
    int32 budgets ``[L, H]``.

  Raises:
    ValueError: for layer or head counts that are not static ints in ``[1, 2**31)``, and a
      table that is not integral, not of one of the shapes above, negative or beyond int32.
  """
  num_layers = checks.static_int("num_layers", num_layers)
  num_heads = checks.static_int("num_heads", num_heads)
  arr = np.asarray(table)
  if arr.dtype == object or not (
    np.issubdtype(arr.dtype, np.integer)
    or (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)))
  ):
    raise ValueError(f"table: expected integer budgets, got {table!r}")
  if arr.ndim == 1 and arr.shape == (num_layers,):
    arr = np.broadcast_to(arr[:, None], (num_layers, num_heads))
  elif arr.ndim == 0:
    arr = np.broadcast_to(arr, (num_layers, num_heads))
  if arr.shape != (num_layers, num_heads):
    raise ValueError(
      f"table: shape {arr.shape} does not match [L={num_layers}, H={num_heads}] "
      f"(or [L={num_layers}] or a scalar)"
    )
  _check_nonneg("table", arr)
  if arr.size and arr.max() >= checks.INT32_LIMIT:
    raise ValueError(f"table: {arr.max()} does not fit int32; expected budgets < 2**31")
  return jnp.asarray(arr, jnp.int32)


def _check_nonneg(name: str, value):
  """Rejects negative concrete values (ints or arrays); traced values pass through."""
  if checks.is_concrete(value) and np.any(np.asarray(value) < 0):
    raise ValueError(f"{name}: expected a non-negative budget, got {np.asarray(value).tolist()}")


# --------------------------------------------------------------------------- PyramidKV


def pyramid(
  num_layers: int,
  budget,
  window,
  q_len,
  beta=20,
  mode: str = "legacy_floor",
) -> Array:
  """Computes PyramidKV's per-layer budgets ``[L]`` int32, **including** the window ``w``.

  Layer 0 (bottom) gets the most, layer ``L - 1`` the least: an arithmetic sequence whose mean is
  the uniform budget. ``mode``:

  * ``"legacy_floor"``: KVCache-Factory ``PyramidKVCluster.update_kv`` exactly: integer ``//``
    with divisor ``L - 1``; ``q_len < budget`` keeps everything (``q_len``); ``q_len <
    2 (budget - w)`` is uniform SnapKV (``budget``); otherwise ``max - l * step + w``. The floor
    makes long-prompt totals exceed ``L * budget`` at small budgets, as published.
  * ``"kvpress"``: kvpress ``get_layer_budget``: float division and ``round`` (half to even);
    falls back to uniform ``round(budget - w + w)`` unless ``q_len >= max >= min >= w``. kvpress
    derives ``budget = w + q_len * (1 - compression_ratio)``: pass that (a float) to reproduce it.
  * ``"exact_total"``: the same line in real numbers, rounded by largest remainder so the layers
    sum to exactly ``L * budget``; ``q_len < budget`` keeps everything.

  One layer: the references divide the layer step by ``L - 1`` (KVCache-Factory raises
  ``ZeroDivisionError``, kvpress too once the schedule applies), so ``"legacy_floor"`` and
  ``"kvpress"`` refuse ``num_layers < 2``; ``"exact_total"`` gives the single layer the budget
  itself (its line's mean), or ``q_len`` when the prompt fits.

  Args:
    num_layers: the number of layers ``L``, a static int (``>= 2`` except for
      ``"exact_total"``).
    budget: ``max_capacity_prompt`` (window included): an integer token count, or a real number
      ``>= 0`` for ``"kvpress"``.
    window: the protected window ``w``, counted inside every budget.
    q_len: the prompt length.
    beta: the ratio of the uniform share to the smallest layer's, a real ``>= 1``; ``beta=20`` is
      hard-coded upstream.
    mode: ``"legacy_floor"``, ``"kvpress"`` or ``"exact_total"`` (above).

  Returns:
    int32 budgets ``[L]``, window included.

  Raises:
    ValueError: for a ``num_layers`` that is not a static int in ``[1, 2**31)``, or below 2
      outside ``"exact_total"``; an unknown ``mode``; a budget, window or ``q_len`` that is not
      a valid count (a real budget only for ``"kvpress"``); a budget below the window; a
      ``beta`` below 1 or not finite; a concrete budget whose schedule arithmetic would leave
      int32 (``(budget - window) * 2``, or ``* L`` for ``"exact_total"``, at ``2**31`` or above
      when ``q_len >= budget``); and an allocation that leaves a row of a non-empty prompt with
      no cache.
  """
  num_layers = checks.static_int("num_layers", num_layers)
  checks.choice("mode", mode, PYRAMID_MODES)
  if num_layers < 2 and mode != "exact_total":
    raise ValueError(
      f"num_layers: PyramidKV's {mode!r} schedule divides by num_layers - 1 and is undefined "
      f"for num_layers={num_layers}; expected num_layers >= 2, or mode='exact_total' (which "
      "gives one layer the budget itself)"
    )
  if mode == "kvpress":  # kvpress derives a float budget from a ratio; the others count tokens
    checks.real("budget", budget, 0.0)
    if checks.is_concrete(budget) and np.any(np.asarray(budget) >= checks.INT32_LIMIT):
      raise ValueError(f"budget: {budget!r} does not fit int32; expected 0 <= budget < 2**31")
  else:
    budget = int_budget("budget", budget)
  checks.counts("q_len", q_len)
  covers_window(budget, window)
  checks.real("beta", beta, 1.0)
  if checks.is_concrete(budget, window, q_len):
    # the schedule's integer arithmetic reaches 2 (budget - w) (and L (budget - w) for
    # exact_total): refuse what int32 cannot hold, when the schedule applies (q_len >= budget)
    applies = np.asarray(q_len) >= np.asarray(budget)
    reach = np.asarray(budget, np.float64) - np.asarray(window, np.float64)
    reach = reach * (num_layers if mode == "exact_total" else 2)
    if np.any(applies & (reach >= checks.INT32_LIMIT)):
      raise ValueError(
        f"budget: {np.asarray(budget).tolist()} is too large for PyramidKV's int32 arithmetic "
        f"at q_len={np.asarray(q_len).tolist()}; expected (budget - window) * "
        f"{num_layers if mode == 'exact_total' else 2} < 2**31"
      )
  fn = {"legacy_floor": _pyramid_legacy, "kvpress": _pyramid_kvpress, "exact_total": _pyramid_exact}
  out = fn[mode](num_layers, budget, window, q_len, beta)
  return not_empty("budget", out, q_len)


def _pyramid_legacy(num_layers, budget, window, q_len, beta):
  budget, window, q_len = (jnp.asarray(x, jnp.int32) for x in (budget, window, q_len))
  avg = budget - window
  min_num = jnp.floor_divide(avg, beta).astype(jnp.int32)
  max_num = avg * 2 - min_num
  clipped = max_num >= q_len - window
  max_num = jnp.where(clipped, q_len - window, max_num)
  min_num = jnp.where(clipped, avg * 2 - max_num, min_num)
  steps = jnp.floor_divide(max_num - min_num, max(num_layers - 1, 1))
  layers = jnp.arange(num_layers, dtype=jnp.int32)
  pyramid_L = max_num - layers * steps + window
  out = jnp.where(q_len < avg * 2, budget, pyramid_L)
  return jnp.where(q_len < budget, q_len, out).astype(jnp.int32)


def _pyramid_kvpress(num_layers, budget, window, q_len, beta):
  budget, window, q_len, beta = (jnp.asarray(x, jnp.float32) for x in (budget, window, q_len, beta))
  avg = budget - window
  min_num = avg / beta
  max_num = avg * 2 - min_num
  clipped = max_num >= q_len - window
  max_num = jnp.where(clipped, q_len - window, max_num)
  min_num = jnp.where(clipped, avg * 2 - max_num, min_num)
  ok = (q_len >= max_num) & (max_num >= min_num) & (min_num >= window)
  steps = (max_num - min_num) / max(num_layers - 1, 1)
  layers = jnp.arange(num_layers, dtype=jnp.float32)
  pyramid_L = jnp.round(max_num - layers * steps)
  # kvpress's fallback is ``round(q_len * (1 - ratio))`` == ``round(budget - window)`` there.
  fallback = jnp.maximum(jnp.round(avg), 1.0)
  return jnp.where(ok, pyramid_L, fallback).astype(jnp.int32)


def _pyramid_exact(num_layers, budget, window, q_len, beta):
  budget_i, window_i, q_len_i = (jnp.asarray(x, jnp.int32) for x in (budget, window, q_len))
  full = q_len_i < budget_i  # keeps q_len (below), so any budget stands in: one within int32
  budget_i = jnp.where(full, window_i, budget_i)
  avg = (budget_i - window_i).astype(jnp.float32)
  min_num = avg / jnp.asarray(beta, jnp.float32)
  max_num = jnp.minimum(avg * 2 - min_num, (q_len_i - window_i).astype(jnp.float32))
  min_num = avg * 2 - max_num
  steps = (max_num - min_num) / max(num_layers - 1, 1)
  line_L = max_num - jnp.arange(num_layers, dtype=jnp.float32) * steps
  if num_layers == 1:
    line_L = jnp.broadcast_to(avg, (1,))
  # Rescale away float drift so the rounding target is exact, then add the window back.
  line_L = jnp.maximum(line_L, 0.0)
  line_L = line_L * (avg * num_layers) / jnp.maximum(line_L.sum(), 1e-9)
  selected_L = round_to_total(line_L, (budget_i - window_i) * num_layers)
  return jnp.where(full, q_len_i, selected_L + window_i).astype(jnp.int32)


# --------------------------------------------------------------------------- CAKE


def cake_statistics(attn_LHWT: Array, window: int) -> tuple[Array, Array]:
  """Computes CAKE's per-layer entropy ``H_l`` and variance ``V_l``: ``([L], [L])``.

  Both are taken on the window rows over the prefix keys ``A = attn[..., -w:, :-w]`` (not
  renormalised): ``H_l = -sum A log(A + 1e-10)`` over every head, row and key; ``V_l`` = the
  unbiased variance over the window queries, summed over heads and keys. Budget-free, so a sweep
  computes them once.

  Args:
    attn_LHWT: the window attention ``[L, H, W, T]``.
    window: the window ``w``.

  Returns:
    ``(entropy_L, var_L)``: fp32 ``[L]`` each.

  Raises:
    ValueError: for attention that is not ``[L, H, W, T]``, and concrete attention that is not
      finite (NaN would silently turn the allocation uniform).
  """
  checks.rank("attn", attn_LHWT, "LHWT")
  checks.finite("attn", attn_LHWT)
  T = attn_LHWT.shape[-1]
  A = attn_LHWT[..., -window:, : T - window].astype(jnp.float32)
  entropy_L = -(A * jnp.log(A + 1e-10)).sum((1, 2, 3))
  var_L = scores_lib.var_rows(A, ddof=1).sum((1, 2))
  return entropy_L, var_L


def cake_preference(attn_LHWT: Array, window: int, tau1=1.0, tau2=1.0) -> Array:
  """Computes CAKE's layer preference ``P_l = H_l^(1/tau1) * V_l^(1/tau2)`` ``[L]``.

  ``H_l`` and ``V_l`` are :func:`cake_statistics`'.

  Args:
    attn_LHWT: the window attention ``[L, H, W, T]``.
    window: the window ``w``.
    tau1: the entropy's temperature, a real ``> 0``.
    tau2: the variance's temperature, a real ``> 0``.

  Returns:
    fp32 preferences ``[L]``.

  Raises:
    ValueError: for temperatures that are not finite and positive, and the attention
      :func:`cake_statistics` refuses.
  """
  _check_taus(tau1, tau2)
  entropy_L, var_L = cake_statistics(attn_LHWT, window)
  return entropy_L ** (1.0 / tau1) * var_L ** (1.0 / tau2)


def cake(attn_LHWT: Array, budget, window: int, tau1=1.0, tau2=1.0) -> Array:
  """Computes CAKE's preference-proportional layer budgets ``[L]`` int32, window included.

  ``total = (budget - w) * L`` is split in proportion to :func:`cake_preference`, passed through
  :func:`adjust_budgets` with ``seq_len = T - w``, capped at ``T - w``, plus ``w``. No
  compression (``T``) while ``T <= budget + w`` (``CakeprefillKVCache``'s guard). This is the
  non-cascading mode.

  Args:
    attn_LHWT: the window attention ``[L, H, W, T]``.
    budget: the per-layer budget (window included), an integer token count.
    window: the window ``w``, an int in ``[2, min(W, T)]`` (CAKE's variance over window
      queries).
    tau1: the entropy's temperature, a real ``> 0``; default 1.
    tau2: the variance's temperature, a real ``> 0``; default 1. Upstream tunes both per model
      (``config/model2tau.json``, e.g. Llama-3.1-8B at budget 1024: ``(1.6, 0.4)``).

  Returns:
    int32 budgets ``[L]``, window included.

  Raises:
    ValueError: for attention that is not ``[L, H, W, T]`` or (when concrete) not finite; a
      window outside ``[2, min(W, T)]``; a budget that is not an integer count or is below the
      window; temperatures that are not finite and positive; and what
      :func:`cake_from_statistics` refuses.
  """
  checks.rank("attn", attn_LHWT, "LHWT")
  L, _, W, T = attn_LHWT.shape
  if not checks.is_int(window) or not 2 <= window <= min(W, T):
    raise ValueError(
      f"window: expected an int in [2, W={W}] (CAKE's variance over window queries), got {window!r}"
    )
  window = int(window)
  budget = int_budget("budget", budget)
  covers_window(budget, window)
  _check_taus(tau1, tau2)
  return cake_from_statistics(cake_statistics(attn_LHWT, window), budget, window, T, tau1, tau2)


def _check_taus(tau1, tau2) -> None:
  checks.real("tau1", tau1, 0.0, strict=True)
  checks.real("tau2", tau2, 0.0, strict=True)


def cake_from_statistics(statistics, budget, window: int, q_len: int, tau1=1.0, tau2=1.0) -> Array:
  """Computes :func:`cake` from precomputed :func:`cake_statistics`.

  What a sweep over budgets and temperatures shares.

  Args:
    statistics: ``(entropy_L, var_L)`` from :func:`cake_statistics`; finite when concrete.
    budget: the per-layer budget (window included), an integer token count.
    window: the window ``w``, a count.
    q_len: the prompt length ``T``.
    tau1: the entropy's temperature, a real ``> 0``.
    tau2: the variance's temperature, a real ``> 0``.

  Returns:
    int32 budgets ``[L]``, window included.

  Raises:
    ValueError: for concrete statistics that are not finite; a budget, window or ``q_len`` that
      is not a valid count; temperatures that are not finite and positive; concrete layer
      preferences that are not finite or do not have a positive sum; and an allocation that
      leaves a row with no cache.
  """
  entropy_L, var_L = statistics
  checks.finite("statistics", entropy_L)
  checks.finite("statistics", var_L)
  budget = int_budget("budget", budget)
  checks.counts("window", window)
  checks.counts("q_len", q_len)
  _check_taus(tau1, tau2)
  L, T = entropy_L.shape[0], q_len
  pref_L = entropy_L ** (1.0 / tau1) * var_L ** (1.0 / tau2)
  if checks.is_concrete(budget, q_len) and np.all(np.asarray(budget) >= T - window):
    return not_empty("budget", jnp.full((L,), T, jnp.int32), T)  # no compression
  if checks.is_concrete(pref_L):
    pref = np.asarray(pref_L, np.float64)
    if not (np.isfinite(pref).all() and pref.sum() > 0):
      raise ValueError(
        f"statistics: CAKE's layer preferences are {pref.tolist()}; expected finite preferences "
        "with a positive sum (window queries whose attention varies), to split the budget by"
      )
  # A budget of at least T - w keeps everything (below); capping it first keeps the arithmetic
  # within int32 for any budget.
  total = (jnp.minimum(as_int32(budget), T) - window) * L
  raw_L = pref_L / pref_L.sum() * total
  layer_L = jnp.minimum(adjust_budgets(raw_L, total, T - window), T - window) + window
  out = jnp.where(as_int32(budget) >= T - window, T, layer_L).astype(jnp.int32)
  return not_empty("budget", out, T)
