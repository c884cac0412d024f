"""Budgets: a total budget -> ``budget_LH`` (or ``budget_L``) int32, every budget counting the
protected tokens (sinks, observation window) too, as ``max_capacity_prompt`` does upstream.

Every allocator is written in ``jnp`` so budgets, ``beta``, ``alpha`` and ``q_len`` can be traced
data (a sweep vmaps over them); the shape-defining arguments (``num_layers``, ``num_heads``,
``capacity``) are static Python ints. Concrete inputs are validated at the boundary and raise
``ValueError``; a budget that would leave a row empty raises instead of silently keeping nothing
(kvpress issues #227/#264/#277). Token counts (budgets, windows, ``q_len``, capacities) must be
integers in ``[0, 2**31)`` before any cast to int32 (:func:`kvjax.select.check_counts`), and
evidence (head scores, attention) must be finite. A concrete budget whose schedule arithmetic
would leave int32 (PyramidKV's ``2 (budget - w)`` when the prompt is longer still) raises too;
traced budgets cannot be checked and must stay below ``2**30``.

References (the methods catalogue, ``docs/methods.md``): KVCache-Factory
``PyramidKVCluster`` (legacy integer arithmetic), kvpress ``PyramidKVPress.get_layer_budget``,
Ada-KV ``AdaptiveSnapKVCluster``, kvpress ``AdaKVPress``, HeadKV ``ReasonSnapKVCluster``, CAKE
``CakeprefillKVCache`` + ``adjust_budgets``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import scores as scores_lib
from kvjax import select

Array = jax.Array

PYRAMID_MODES = ("legacy_floor", "kvpress", "exact_total")
ADAKV_MODES = ("official", "kvpress")
HEADKV_MODES = ("official", "kvfactory")


# --------------------------------------------------------------------------- validation helpers


def _check_static_int(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
  if value >= select.INT32_LIMIT:
    raise ValueError(f"{name}: {value} does not fit int32; expected 0 <= {name} < 2**31")
  return int(value)


def _int32(value) -> Array:
  """A validated count (numpy or traced) as int32, cast only after :func:`_check_count`."""
  if select.is_concrete(value):
    return jnp.asarray(np.asarray(value, np.int32))
  return jnp.asarray(value).astype(jnp.int32)


def _check_count(name: str, value):
  """An integer token count (int or int array, concrete or traced) in ``[0, 2**31)``."""
  return select.check_counts(name, value)


def check_real(
  name: str, value, low: float, *, strict: bool = False, high: float | None = None
) -> None:
  """Validates a real-valued option when it is concrete; traced values pass through (they are data).

  A concrete value must be finite and ``>= low`` (``> low`` when ``strict``), and ``<= high``
  when given.

  Args:
    name: the option's name, quoted in error messages.
    value: a real number or array, concrete or traced.
    low: the lower bound.
    strict: excludes ``low`` itself.
    high: an optional upper bound (inclusive).

  Raises:
    ValueError: for a concrete value that is not a real number, not finite, or out of bounds.
  """
  if not select.is_concrete(value):
    return
  arr = np.asarray(value)
  if arr.dtype == object or not (
    np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
  ):
    raise ValueError(f"{name}: expected a real number, got {value!r}")
  arr = arr.astype(np.float64)
  ok = np.isfinite(arr) & ((arr > low) if strict else (arr >= low))
  if high is not None:
    ok &= arr <= high
  if not np.all(ok):
    bound = f"{name} > {low}" if strict else f"{name} >= {low}"
    if high is not None:
      bound = f"{low} <= {name} <= {high}"
    raise ValueError(f"{name}: expected a finite value with {bound}, got {value!r}")


def _check_finite(name: str, x) -> None:
  if select.is_concrete(x) and not np.isfinite(np.asarray(x, np.float64)).all():
    raise ValueError(f"{name}: contains NaN or inf; expected finite values")


def _check_nonneg(name: str, value):
  """Rejects negative concrete values (ints or arrays); traced values pass through."""
  if select.is_concrete(value) and np.any(np.asarray(value) < 0):
    raise ValueError(f"{name}: expected a non-negative budget, got {np.asarray(value).tolist()}")


def _check_choice(name: str, value: str, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}: unknown value {value!r}; expected one of {tuple(choices)}")


def _check_window(budget, window) -> None:
  _check_count("window", window)
  if select.is_concrete(budget, window) and np.any(np.asarray(budget) < np.asarray(window)):
    raise ValueError(
      f"budget: {np.asarray(budget).tolist()} is smaller than the protected window "
      f"{np.asarray(window).tolist()}; every budget counts the window, expected budget >= window"
    )


def _check_not_empty(name: str, budgets: Array, q_len) -> Array:
  """A row that would keep nothing of a non-empty prompt is a bug upstream; here it is an error."""
  if select.is_concrete(budgets, q_len) and np.any(
    (np.asarray(budgets) <= 0) & (np.asarray(q_len) > 0)
  ):
    raise ValueError(
      f"{name}: the allocation {np.asarray(budgets).tolist()} leaves a row with no cache; "
      "expected a larger budget (or a non-zero window)"
    )
  return budgets


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
  num_layers = _check_static_int("num_layers", num_layers)
  num_heads = _check_static_int("num_heads", num_heads)
  budget = _check_int_budget("budget", budget)
  return jnp.broadcast_to(_int32(budget), (num_layers, num_heads))


def _check_int_budget(name: str, value):
  """Budgets are token counts: integer dtype (no silent truncation of 5.5), and when concrete in
  ``[0, 2**31)`` (no wrap of ``np.int64(2**32 + 12)`` to 12). Returns the checked value."""
  arr = np.asarray(value) if select.is_concrete(value) else value
  if arr.dtype != object and not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{name}: expected integer token counts, got dtype {arr.dtype}")
  return _check_count(name, value)


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
  budget_L = _int32(_check_int_budget("budget", budget_L))
  if budget_L.ndim != 1:
    raise ValueError(f"budget: expected a per-layer budget [L], got shape {budget_L.shape}")
  num_heads = _check_static_int("num_heads", num_heads)
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
  num_layers = _check_static_int("num_layers", num_layers)
  num_heads = _check_static_int("num_heads", num_heads)
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
  if arr.size and arr.max() >= select.INT32_LIMIT:
    raise ValueError(f"table: {arr.max()} does not fit int32; expected budgets < 2**31")
  return jnp.asarray(arr, jnp.int32)


def round_to_total(weights_L: Array, total) -> Array:
  """Rounds non-negative reals to ints that sum to exactly ``total`` (largest remainder).

  ``weights_L`` must already sum to ``total`` (up to float error). The leftover units go to the
  largest fractional parts, ties to the lower index (via :func:`kvjax.select.keep_mask`).

  Args:
    weights_L: non-negative floats ``[N]`` that sum to ``total``.
    total: the integer target.

  Returns:
    int32 counts ``[N]``.

  Raises:
    ValueError: for a total that is not an integer count or (when concrete) is negative or
      beyond int32.
  """
  total = _int32(_check_count("total", total))
  floors = jnp.floor(weights_L)
  deficit = total - floors.sum().astype(jnp.int32)
  extra = select.keep_mask(weights_L - floors, jnp.clip(deficit, 0, weights_L.shape[-1]))
  return floors.astype(jnp.int32) + extra.astype(jnp.int32)


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
  num_layers = _check_static_int("num_layers", num_layers)
  _check_choice("mode", mode, PYRAMID_MODES)
  if num_layers < 2 and mode != "exact_total":
    raise ValueError(
      f"num_layers: PyramidKV's {mode!r} schedule divides by num_layers - 1 and is undefined "
      f"for num_layers={num_layers}; expected num_layers >= 2, or mode='exact_total' (which "
      "gives one layer the budget itself)"
    )
  if mode == "kvpress":  # kvpress derives a float budget from a ratio; the others count tokens
    check_real("budget", budget, 0.0)
    if select.is_concrete(budget) and np.any(np.asarray(budget) >= select.INT32_LIMIT):
      raise ValueError(f"budget: {budget!r} does not fit int32; expected 0 <= budget < 2**31")
  else:
    budget = _check_int_budget("budget", budget)
  _check_count("q_len", q_len)
  _check_window(budget, window)
  check_real("beta", beta, 1.0)
  if select.is_concrete(budget, window, q_len):
    # the schedule's integer arithmetic reaches 2 (budget - w) (and L (budget - w) for
    # exact_total): refuse what int32 cannot hold, when the schedule applies (q_len >= budget)
    applies = np.asarray(q_len) >= np.asarray(budget)
    reach = np.asarray(budget, np.float64) - np.asarray(window, np.float64)
    reach = reach * (num_layers if mode == "exact_total" else 2)
    if np.any(applies & (reach >= select.INT32_LIMIT)):
      raise ValueError(
        f"budget: {np.asarray(budget).tolist()} is too large for PyramidKV's int32 arithmetic "
        f"at q_len={np.asarray(q_len).tolist()}; expected (budget - window) * "
        f"{num_layers if mode == 'exact_total' else 2} < 2**31"
      )
  fn = {"legacy_floor": _pyramid_legacy, "kvpress": _pyramid_kvpress, "exact_total": _pyramid_exact}
  out = fn[mode](num_layers, budget, window, q_len, beta)
  return _check_not_empty("budget", out, q_len)


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


# --------------------------------------------------------------------------- Ada-KV


def _int_product(count, factor) -> Array:
  """``int(count * factor)`` as upstream computes it: exactly in float64 on the host when both
  are concrete (float32 can land one below an integer, e.g. ``90 * 0.7``), float32 under trace."""
  if select.is_concrete(count, factor):
    return jnp.asarray(np.floor(np.asarray(count, np.float64) * float(factor)), jnp.float32)
  return jnp.floor(jnp.asarray(count, jnp.float32) * factor)


def _top_sum(scores_LHT: Array, count, capacity: int) -> Array:
  """Sum of each row's ``count`` largest scores (``count <= capacity``)."""
  top = jax.lax.top_k(scores_LHT, capacity)[0]
  keep = jax.lax.broadcasted_iota(jnp.int32, top.shape, top.ndim - 1) < count[..., None]
  return jnp.where(keep, top, 0.0).sum(-1)


def adakv(
  scores_LHT: Array,
  budget,
  window: int,
  *,
  floor_alpha: float = 0.2,
  normalize: bool = False,
  mode: str = "official",
  capacity: int | None = None,
  table: Array | None = None,
) -> Array:
  """Computes Ada-KV's head-adaptive budgets ``[L, H]`` int32 (window included) from head scores.

  The layer total is ``H * budget``. ``mode``:

  * ``"official"`` (Ada-KV ``AdaptiveSnapKVCluster``): ``b = budget - w``; global top ``H * b``
    of the layer's prefix scores (each head's scores scaled by ``sum(top-b) / sum(all)`` when
    ``normalize``) gives counts ``c_h``; ``cap_h = round(c_h (1 - alpha) + int(b * alpha))``
    (half to even) plus ``w``. As upstream, the caps need not sum exactly to ``H * b``. No
    compression (``T``) when ``b > T - w``. Defaults: ``alpha = 0.2``, ``normalize`` off
    (KVCache-Factory and HeadKV runs use ``normalize=True``).
  * ``"kvpress"`` (``AdaKVPress``): each head force-keeps its top ``max(int(budget * alpha), 1)``,
    then the layer keeps its best ``H * budget`` scores across heads: counts sum exactly to
    ``H * budget``. Window protection comes from the scores (``+inf``).

  Args:
    scores_LHT: the pooled SnapKV-style scores over all ``T`` positions ``[L, H, T]`` (the last
      ``window`` positions are the protected window; their values are ignored in
      ``"official"``).
    budget: the per-head ``max_capacity_prompt``, an integer token count: a scalar, or ``[L]``
      for a layer schedule such as Ada-KV's ``pyram_mode``.
    window: the protected window ``w``, an int in ``[0, T]``.
    floor_alpha: ``alpha``, the share of each head's budget it keeps whatever the pooling, in
      ``[0, 1]``.
    normalize: scales each head's scores as above (``"official"``).
    mode: ``"official"`` or ``"kvpress"`` (above).
    capacity: static bound on ``budget`` for the top-k (default ``T``).
    table: the :func:`adakv_table` of these scores, to share one pooled selection across many
      budgets.

  Returns:
    int32 budgets ``[L, H]``, window included.

  Raises:
    ValueError: for an unknown ``mode``; scores that are not ``[L, H, T]``; a window that is not
      an int in ``[0, T]``; a ``floor_alpha`` outside ``[0, 1]``; a ``normalize`` that is not a
      bool; a budget that is not an integer count, is negative, beyond int32 or below the
      window; a capacity that is not a static int in ``[1, 2**31)``; a concrete budget above a
      capacity below ``T``; and an allocation that leaves a head with no cache under a positive
      budget.
  """
  _check_choice("mode", mode, ADAKV_MODES)
  if not hasattr(scores_LHT, "ndim") or scores_LHT.ndim != 3:
    raise ValueError(f"scores: expected [L, H, T], got {getattr(scores_LHT, 'shape', scores_LHT)}")
  L, H, T = scores_LHT.shape
  if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= T:
    raise ValueError(f"window: expected an int in [0, T={T}], got {window!r}")
  check_real("floor_alpha", floor_alpha, 0.0, high=1.0)
  if not isinstance(normalize, bool):
    raise ValueError(f"normalize: expected a bool, got {normalize!r}")
  budget = _check_int_budget("budget", budget)
  _check_window(budget, window)
  capacity = T if capacity is None else _check_static_int("capacity", capacity)
  if select.is_concrete(budget) and np.any(np.asarray(budget) > capacity) and capacity < T:
    raise ValueError(f"budget: {budget!r} exceeds capacity={capacity}")
  budget_L = jnp.broadcast_to(_int32(budget), (L,))
  if mode == "kvpress":
    out = _adakv_kvpress(scores_LHT, budget_L, floor_alpha, min(capacity, T))
  else:
    out = _adakv_official(
      scores_LHT, budget_L, window, floor_alpha, normalize, min(capacity, T), table
    )
  # A head that wins nothing (no floor, no window) under a positive budget would be left empty.
  return _check_not_empty("budget", out, jnp.where(budget_L[:, None] > 0, T, 0))


def adakv_table(scores_LHT: Array, window: int, capacity: int) -> Array | None:
  """Tabulates official Ada-KV's pooled counts for every per-head budget up to ``capacity``.

  Row ``m`` holds the per-head counts among the layer's ``m * H`` best prefix scores (the window
  excluded), ``cap = min(capacity, T - w)``. Ada-KV pools ``H * b`` entries, a multiple of
  ``H``, so ``cap + 1`` rows answer every budget: ``O(L H T)``, read from
  :func:`kvjax.select.pooled_rank_table` (one pooled sort) rather than the ``O(L H^2 T)``
  cumulative one-hot of every pooled rank.

  Args:
    scores_LHT: the scores ``[L, H, T]``, the last ``window`` positions the protected window.
    window: the protected window ``w``, a static int.
    capacity: the largest per-head budget the table answers, a static int.

  Returns:
    int32 counts ``[L, cap + 1, H]``, or ``None`` when the rank codes would not fit int32
    (``H * (cap H + 1) >= 2**31``): :func:`adakv` then selects per budget.

  Raises:
    ValueError: for NaN prefix scores (when concrete), and a window that leaves no prefix.
  """
  L, H, T = scores_LHT.shape
  cap = max(min(capacity, T - window), 1)
  if H * (cap * H + 1) >= select.INT32_LIMIT:
    return None
  ranks_LN = select.pooled_rank_table(scores_LHT[..., : T - window].astype(jnp.float32), cap * H)
  totals_M = jnp.arange(cap + 1, dtype=jnp.int32) * H
  counts_MLH = jax.vmap(
    lambda n: select.pooled_counts_from_ranks(ranks_LN, jnp.broadcast_to(n, (L,)), H)
  )(totals_M)
  return jnp.moveaxis(counts_MLH, 0, 1)


def adakv_table_from_order(
  scores_LHP: Array, order_LHN: Array, window: int, capacity: int, depth: int
) -> tuple[Array, Array]:
  """Computes :func:`adakv_table` of ``scores_LHP`` from each head's order: ``(table, exact)``.

  The layer's pooled order is taken over each head's ``depth`` best positions only (the window
  left out), a sort of ``[L, H * depth]`` instead of ``[L, H * (P - w)]``. That is exact when no
  head fills its share: if the ``cap H`` best of the union held a head's every kept entry, a
  better entry of that head could lie past the depth. Pooled ties go to the lower head, then the
  lower rank, which is the lower position (the order breaks ties by position), as in
  :func:`kvjax.select.pooled_rank_table`.

  Args:
    scores_LHP: the scores ``[L, H, P]``, the last ``window`` positions the protected window.
    order_LHN: each head's positions, best first (:func:`kvjax.select.descending_order`), at
      least ``depth`` deep.
    window: the protected window ``w``, a static int.
    capacity: the largest per-head budget the table answers, a static int.
    depth: how many of each head's best positions are pooled, in ``[cap, N]`` with
      ``cap = max(min(capacity, P - w), 1)``.

  Returns:
    ``(table, exact)``: the int32 counts ``[L, cap + 1, H]`` of :func:`adakv_table`, and a bool
    scalar, false when some head fills its share (or when a left-out window entry ranked among
    them: ``-inf`` or NaN scores); the caller then retries deeper.

  Raises:
    ValueError: for a ``depth`` outside ``[cap, N]``.
  """
  L, H, P = scores_LHP.shape
  cap = max(min(capacity, P - window), 1)
  if not cap <= depth <= order_LHN.shape[-1]:
    raise ValueError(
      f"depth: {depth} outside [cap={cap}, {order_LHN.shape[-1]}]: expected at least the "
      "table's capacity and at most the order's depth"
    )
  idx_LHD = order_LHN[..., :depth]
  kept_LHD = idx_LHD < P - window
  values = jnp.take_along_axis(scores_LHP.astype(jnp.float32), idx_LHD, -1)
  values = jnp.where(kept_LHD, values, -jnp.inf)
  flat_LN = select.descending_order_by_layer(values.reshape(L, H * depth), cap * H)
  head_LMB = (flat_LN // depth).reshape(L, cap, H)  # pooled ranks in blocks of H: one per row
  counts_LMH = (head_LMB[..., None] == jnp.arange(H)[None, None, None]).sum(-2, dtype=jnp.int32)
  zeros = jnp.zeros((L, 1, H), jnp.int32)
  table = jnp.concatenate([zeros, jnp.cumsum(counts_LMH, 1, dtype=jnp.int32)], 1)
  taken = jnp.take_along_axis(kept_LHD.reshape(L, H * depth), flat_LN, -1).all()
  filled = jnp.any(table[:, -1, :] >= kept_LHD.sum(-1))
  return table, taken & ((depth == P) | ~filled)


def _adakv_official(scores_LHT, budget_L, window, alpha, normalize, capacity, table=None):
  L, H, T = scores_LHT.shape
  if window == T:  # the whole prompt is the protected window: nothing to select or evict
    return jnp.full((L, H), T, jnp.int32)
  prefix_LHP = scores_LHT[..., : T - window].astype(jnp.float32)
  cap = max(min(capacity, T - window), 1)
  base_L = budget_L - window
  if normalize:
    count_LH = jnp.broadcast_to(jnp.minimum(base_L, cap)[:, None], (L, H))
    ratio_LH = _top_sum(prefix_LHP, count_LH, cap) / prefix_LHP.sum(-1)
    prefix_LHP = prefix_LHP * ratio_LH[..., None]
  pooled_L = jnp.minimum(base_L, T - window) * H  # no int32 overflow for huge budgets
  if table is None and not normalize:
    table = adakv_table(scores_LHT, window, capacity)
  if normalize or table is None:  # the scaling depends on the budget: one selection per budget
    counts_LH = select.pooled_budgets(prefix_LHP, pooled_L, capacity=min(cap * H, H * (T - window)))
  else:  # budget-free scores: one pooled sort, every budget a lookup (vmaps cheaply)
    rows_L = jnp.clip(jnp.minimum(base_L, T - window), 0, table.shape[1] - 1)
    counts_LH = jnp.take_along_axis(table, rows_L[:, None, None], axis=1)[:, 0, :]
  floor_L = _int_product(base_L, alpha)
  caps_LH = jnp.round(counts_LH * (1.0 - alpha) + floor_L[:, None]).astype(jnp.int32) + window
  return jnp.where((base_L > T - window)[:, None], T, caps_LH).astype(jnp.int32)


def _adakv_kvpress(scores_LHT, budget_L, alpha, capacity):
  L, H, T = scores_LHT.shape
  # A budget past T keeps every position either way; capping it keeps n_kept * H within int32.
  n_kept_L = jnp.minimum(budget_L, T)
  n_safe_L = jnp.floor(n_kept_L.astype(jnp.float32) * alpha).astype(jnp.int32)
  # kvpress: ``n_safe = max(1, n_safe) if n_kept > 0 else 0`` whenever alpha > 0.
  n_safe_L = jnp.where(
    jnp.asarray(alpha) > 0, jnp.where(n_kept_L > 0, jnp.maximum(n_safe_L, 1), 0), n_safe_L
  )
  forced = select.keep_mask(
    scores_LHT, jnp.broadcast_to(n_safe_L[:, None], (L, H)), capacity=capacity
  )
  boosted = jnp.where(forced, jnp.inf, scores_LHT)
  return select.pooled_budgets(boosted, n_kept_L * H, capacity=min(capacity * H, H * T))


# --------------------------------------------------------------------------- HeadKV


def headkv(
  head_scores_LH,
  budget,
  window,
  *,
  beta: float = 1.5,
  temp: float = 1.0,
  mode: str = "official",
  q_len=None,
) -> Array:
  """Computes HeadKV's static per-head budgets ``[L, H]`` int32 (window included).

  The head importances are normalised to sum 1, raised to ``temp``, renormalised; with ``b`` the
  per-head base: ``pool = (b // beta) * L * H``, ``cap = round(s * pool + b - b // beta) + w``
  (float floor division, half-to-even rounding), so budget moves across layers *and* heads.

  * ``"official"`` (HeadKV ``ReasonSnapKVCluster``): ``b = budget - w``; CLI default
    ``beta=1.5``, ``temp=1``.
  * ``"kvfactory"`` (KVCache-Factory ``run_longbench.py``): ``b = budget`` (window included) and
    no ``temp`` step; default there ``beta=1.01``.

  The total is ``L * H * budget`` up to rounding, as upstream.

  Args:
    head_scores_LH: one importance per (layer, query head) ``[L, H]``, e.g. the mean of HeadKV's
      retrieval(-reasoning) score lists (:func:`headkv_scores_from_json`): finite, non-negative,
      at least one positive.
    budget: the per-head budget, a scalar integer token count (window included).
    window: the protected window ``w``, a scalar count.
    beta: each head gives ``b // beta`` of its base ``b`` to the shared pool, a real ``> 1``.
    temp: the exponent applied to the normalised importances (``"official"``), a real ``> 0``.
    mode: ``"official"`` or ``"kvfactory"`` (above).
    q_len: the prompt length, optional: with it, a prompt no longer than the budget is not
      compressed (``q_len`` everywhere), HeadKV's ``base_capacity > q_len - w`` guard.

  Returns:
    int32 budgets ``[L, H]``, window included.

  Raises:
    ValueError: for an unknown ``mode``; head scores that are not real, not ``[L, H]``, not
      finite, negative or all zero; a ``beta`` not above 1 or a ``temp`` not above 0; a budget
      or window that is not a scalar count, or a budget below the window; a ``q_len`` that is
      not a count; and a head budget beyond int32 (concrete inputs).
  """
  _check_choice("mode", mode, HEADKV_MODES)
  if select.is_concrete(head_scores_LH):
    host = np.asarray(head_scores_LH)
    if host.dtype == object or not (
      np.issubdtype(host.dtype, np.floating) or np.issubdtype(host.dtype, np.integer)
    ):
      raise ValueError(f"head_scores: expected real head importances, got dtype {host.dtype}")
    host = host.astype(np.float64)
    if host.ndim != 2:
      raise ValueError(f"head_scores: expected [L, H], got shape {host.shape}")
    if not np.isfinite(host).all() or np.any(host < 0):
      raise ValueError("head_scores: expected finite non-negative head importances")
    if not host.sum() > 0:
      raise ValueError(
        "head_scores: all head importances are zero; expected at least one positive score "
        "(HeadKV normalises them to sum 1)"
      )
  scores = jnp.asarray(head_scores_LH, jnp.float32)
  if scores.ndim != 2:
    raise ValueError(f"head_scores: expected [L, H], got shape {scores.shape}")
  check_real("beta", beta, 1.0, strict=True)
  check_real("temp", temp, 0.0, strict=True)
  budget = _check_int_budget("budget", budget)
  _check_window(budget, window)
  for name, value in (("budget", budget), ("window", window)):
    if np.ndim(value) != 0:
      raise ValueError(
        f"{name}: expected a scalar (HeadKV's per-head base), got shape {np.shape(value)}"
      )
  if q_len is not None:
    q_len = _check_count("q_len", q_len)
  L, H = scores.shape
  if select.is_concrete(head_scores_LH, budget, window, beta, temp):
    if q_len is not None and select.is_concrete(q_len) and int(budget) > int(q_len):
      return jnp.full((L, H), int(q_len), jnp.int32)  # the no-compression guard
    caps = _headkv_host(np.asarray(head_scores_LH, np.float64), budget, window, beta, temp, mode)
  else:
    caps = _headkv_traced(scores, budget, window, beta, temp, mode)
  if q_len is None:
    return caps
  return jnp.where(_int32(budget) > _int32(q_len), _int32(q_len), caps).astype(jnp.int32)


def _headkv_host(scores, budget, window, beta, temp, mode) -> Array:
  """Upstream's float64 arithmetic and Python float floor division (``120 // 1.2 == 100.0``)."""
  L, H = scores.shape
  share = scores / scores.sum()
  base = float(budget)
  if mode == "official":
    share = share**temp
    share = share / share.sum()
    base = float(budget) - float(window)
  pooled = base // float(beta)
  caps = np.round(share * pooled * L * H + (base - pooled)) + int(window)
  if caps.max() >= select.INT32_LIMIT:
    raise ValueError(
      f"budget: HeadKV gives a head {int(caps.max())} tokens for budget {int(budget)}, which does "
      "not fit int32; expected a smaller budget (or pass q_len, the prompt length)"
    )
  return jnp.asarray(caps.astype(np.int64), jnp.int32)


def _headkv_traced(scores, budget, window, beta, temp, mode) -> Array:
  """The same formula under ``jit``/``vmap`` (float32: rare off-by-one against upstream)."""
  L, H = scores.shape
  share = scores / scores.sum()
  if mode == "official":
    share = share**temp
    share = share / share.sum()
    base = jnp.asarray(budget, jnp.float32) - jnp.asarray(window, jnp.float32)
  else:
    base = jnp.asarray(budget, jnp.float32)
  pooled = jnp.floor(base / beta)
  caps = jnp.round(share * pooled * L * H + (base - pooled)).astype(jnp.int32)
  return caps + jnp.asarray(window, jnp.int32)


def headkv_scores_from_json(path: str, num_layers: int, num_heads: int) -> np.ndarray:
  """Reads HeadKV's head-score file into ``[L, H]`` mean scores.

  The file holds one JSON dict ``"layer-head": [scores...]`` (on its first line); heads it does
  not list score 0.

  Args:
    path: the head-score file.
    num_layers: the number of layers ``L``.
    num_heads: the number of heads ``H``.

  Returns:
    float64 mean scores ``[L, H]``.

  Raises:
    ValueError: for a head outside ``[L, H]``.
  """
  with open(path) as f:
    head_lists = json.loads(f.readline())
  out = np.zeros((num_layers, num_heads), np.float64)
  for key, values in head_lists.items():
    layer, head = (int(x) for x in key.split("-"))
    if not (0 <= layer < num_layers and 0 <= head < num_heads):
      raise ValueError(f"path: head {key!r} outside [L={num_layers}, H={num_heads}]")
    out[layer, head] = np.mean(values)
  return out


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
  if not hasattr(attn_LHWT, "ndim") or attn_LHWT.ndim != 4:
    raise ValueError(f"attn: expected [L, H, W, T], got {getattr(attn_LHWT, 'shape', attn_LHWT)}")
  _check_finite("attn", attn_LHWT)
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
  total = _int32(_check_count("total", total))
  seq_len = _int32(_check_count("seq_len", seq_len))
  _check_finite("budgets", budgets_L)
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
  if not hasattr(attn_LHWT, "ndim") or attn_LHWT.ndim != 4:
    raise ValueError(f"attn: expected [L, H, W, T], got {getattr(attn_LHWT, 'shape', attn_LHWT)}")
  L, _, W, T = attn_LHWT.shape
  if not isinstance(window, int) or not 2 <= window <= min(W, T):
    raise ValueError(
      f"window: expected an int in [2, W={W}] (CAKE's variance over window queries), got {window!r}"
    )
  budget = _check_int_budget("budget", budget)
  _check_window(budget, window)
  _check_taus(tau1, tau2)
  return cake_from_statistics(cake_statistics(attn_LHWT, window), budget, window, T, tau1, tau2)


def _check_taus(tau1, tau2) -> None:
  check_real("tau1", tau1, 0.0, strict=True)
  check_real("tau2", tau2, 0.0, strict=True)


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
  _check_finite("statistics", entropy_L)
  _check_finite("statistics", var_L)
  budget = _check_int_budget("budget", budget)
  _check_count("window", window)
  _check_count("q_len", q_len)
  _check_taus(tau1, tau2)
  L, T = entropy_L.shape[0], q_len
  pref_L = entropy_L ** (1.0 / tau1) * var_L ** (1.0 / tau2)
  if select.is_concrete(budget, q_len) and np.all(np.asarray(budget) >= T - window):
    return _check_not_empty("budget", jnp.full((L,), T, jnp.int32), T)  # no compression
  if select.is_concrete(pref_L):
    pref = np.asarray(pref_L, np.float64)
    if not (np.isfinite(pref).all() and pref.sum() > 0):
      raise ValueError(
        f"statistics: CAKE's layer preferences are {pref.tolist()}; expected finite preferences "
        "with a positive sum (window queries whose attention varies), to split the budget by"
      )
  # A budget of at least T - w keeps everything (below); capping it first keeps the arithmetic
  # within int32 for any budget.
  total = (jnp.minimum(_int32(budget), T) - window) * L
  raw_L = pref_L / pref_L.sum() * total
  layer_L = jnp.minimum(adjust_budgets(raw_L, total, T - window), T - window) + window
  out = jnp.where(_int32(budget) >= T - window, T, layer_L).astype(jnp.int32)
  return _check_not_empty("budget", out, T)
