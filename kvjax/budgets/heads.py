"""Head-adaptive budgets: Ada-KV's pooled allocation from the scores (and the tables that share
one pooled selection across budgets), and HeadKV's static allocation from head importances."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks, select
from kvjax.budgets.tokens import as_int32, covers_window, int_budget, not_empty

Array = jax.Array

ADAKV_MODES = ("official", "kvpress")
HEADKV_MODES = ("official", "kvfactory")


# --------------------------------------------------------------------------- Ada-KV


def _int_product(count, factor) -> Array:
  """``int(count * factor)`` as upstream computes it: exactly in float64 on the host when both
  are concrete (float32 can land one below an integer, e.g. ``90 * 0.7``), float32 under trace."""
  if checks.is_concrete(count, factor):
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
  checks.choice("mode", mode, ADAKV_MODES)
  checks.rank("scores", scores_LHT, "LHT")
  L, H, T = scores_LHT.shape
  if not checks.is_int(window) or not 0 <= window <= T:
    raise ValueError(f"window: expected an int in [0, T={T}], got {window!r}")
  window = int(window)
  checks.real("floor_alpha", floor_alpha, 0.0, high=1.0)
  if not isinstance(normalize, bool):
    raise ValueError(f"normalize: expected a bool, got {normalize!r}")
  budget = int_budget("budget", budget)
  covers_window(budget, window)
  capacity = T if capacity is None else checks.static_int("capacity", capacity)
  if checks.is_concrete(budget) and np.any(np.asarray(budget) > capacity) and capacity < T:
    raise ValueError(f"budget: {budget!r} exceeds capacity={capacity}")
  budget_L = jnp.broadcast_to(as_int32(budget), (L,))
  if mode == "kvpress":
    out = _adakv_kvpress(scores_LHT, budget_L, floor_alpha, min(capacity, T))
  else:
    out = _adakv_official(
      scores_LHT, budget_L, window, floor_alpha, normalize, min(capacity, T), table
    )
  # A head that wins nothing (no floor, no window) under a positive budget would be left empty.
  return not_empty("budget", out, jnp.where(budget_L[:, None] > 0, T, 0))


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
  if H * (cap * H + 1) >= checks.INT32_LIMIT:
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
  forced = select.top_mask(
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
  checks.choice("mode", mode, HEADKV_MODES)
  if checks.is_concrete(head_scores_LH):
    host = np.asarray(head_scores_LH)
    if not checks.is_real_dtype(host.dtype):
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
  checks.real("beta", beta, 1.0, strict=True)
  checks.real("temp", temp, 0.0, strict=True)
  budget = int_budget("budget", budget)
  covers_window(budget, window)
  for name, value in (("budget", budget), ("window", window)):
    if np.ndim(value) != 0:
      raise ValueError(
        f"{name}: expected a scalar (HeadKV's per-head base), got shape {np.shape(value)}"
      )
  if q_len is not None:
    q_len = checks.counts("q_len", q_len)
  L, H = scores.shape
  if checks.is_concrete(head_scores_LH, budget, window, beta, temp):
    if q_len is not None and checks.is_concrete(q_len) and int(budget) > int(q_len):
      return jnp.full((L, H), int(q_len), jnp.int32)  # the no-compression guard
    caps = _headkv_host(np.asarray(head_scores_LH, np.float64), budget, window, beta, temp, mode)
  else:
    caps = _headkv_traced(scores, budget, window, beta, temp, mode)
  if q_len is None:
    return caps
  return jnp.where(as_int32(budget) > as_int32(q_len), as_int32(q_len), caps).astype(jnp.int32)


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
  if caps.max() >= checks.INT32_LIMIT:
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
