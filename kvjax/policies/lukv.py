"""LU-KV: per-layer, per-KV-head budgets from a precomputed budget curve, around any scorer."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import scores as scores_lib
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.methods import ExpectedAttention
from kvjax.policies.wrappers import Wrapper, check_base

Array = jax.Array

CURVE_ROWS = 99  # one row per compression ratio 0.01 .. 0.99 (LU-KV's curve files)


def _as_table(curve) -> tuple:
  arr = np.asarray(curve, dtype=np.float64)
  if arr.ndim != 3 or arr.shape[0] != CURVE_ROWS or not arr.shape[1] or not arr.shape[2]:
    raise ValueError(
      f"curve: expected prune ratios [{CURVE_ROWS}, L, G] (row i: compression ratio "
      f"(i + 1) / 100), got shape {arr.shape}"
    )
  if not np.isfinite(arr).all():
    raise ValueError("curve: expected finite prune ratios")
  return tuple(tuple(tuple(float(v) for v in g) for g in layer) for layer in arr)


@dataclasses.dataclass(frozen=True)
class BudgetCurve(alloc_lib.Allocator):
  """LU-KV's budget curve: each layer's and KV head's kept count from a table of prune ratios.

  ``curve[i, l, g]`` is the fraction of KV head ``g`` of layer ``l`` to prune at compression
  ratio ``(i + 1) / 100`` (kvpress ``LUKVPress._budget_curves``, LU-KV's ``.npy`` files). For a
  budget ``b`` of ``T`` positions the row is ``round(100 * (T - b) / T) - 1`` clipped to
  ``[0, 98]`` (kvpress: ``round(100 * compression_ratio) - 1``, the same row when
  ``T * (1 - compression_ratio)`` is the integer count ``b``), and a budget ``>= T`` keeps
  everything. Each head's ideal count ``(1 - ratio) * T`` (ratio clipped to ``[0, 1]``) is
  floored, the layer's total ``round(sum)`` (clipped to ``[G, G * T]``) is reached by giving one
  more to the largest fractional parts (ties to the lower head), and each count is clipped to
  ``[1, T]`` (kvpress ``LUKVPress.compress``). Query-head scores repeat each KV head's count over
  its group.

  The curve is data, computed elsewhere (LU-KV's offline global optimisation over calibration
  contexts, ``evaluation/curve_data/generate_curve.sh`` of the official code); kvjax does not
  compute it. It is stored as a static nested tuple (hashable), a compile-time constant.

  Attributes:
    curve: prune ratios ``[99, L, G]`` (an array or nested sequences); ``None`` fails when
      allocating.
  """

  curve: Any = None

  def __post_init__(self):
    if self.curve is not None:
      object.__setattr__(self, "curve", _as_table(self.curve))

  @property
  def table(self) -> np.ndarray:
    """The curve as float32 ``[99, L, G]``."""
    if self.curve is None:
      raise ValueError("curve: LU-KV needs its budget curve [99, L, G], got None")
    return np.asarray(self.curve, np.float32)

  def row(self, budget, T: int) -> Array:
    """The curve's row for ``budget`` kept of ``T`` positions (int32, traced or concrete)."""
    num = (T - jnp.clip(jnp.asarray(budget, jnp.int32), 0, T)) * 100
    quo, rem = num // T, num % T
    up = (2 * rem > T) | ((2 * rem == T) & (quo % 2 == 1))  # round half to even, exactly
    return jnp.clip(quo + up.astype(jnp.int32) - 1, 0, CURVE_ROWS - 1)

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    table = self.table
    if table.shape[1] != L:
      raise ValueError(f"curve: {table.shape[1]} layers, the scores have L={L}")
    b = alloc_lib.as_budget_LH(budget, 1, 1)[0, 0]
    prune_LG = jnp.asarray(table)[self.row(b, T)]
    count_LG = curve_counts(prune_LG, T)
    count_LG = jnp.where(b >= T, T, count_LG)
    return alloc_lib.heads_like(count_LG, H).astype(jnp.int32)


def curve_counts(prune_LG: Array, T: int) -> Array:
  """Kept counts per layer and KV head from prune ratios (kvpress ``LUKVPress.compress``).

  Args:
    prune_LG: prune ratios ``[L, G]``.
    T: the positions.

  Returns:
    int32 ``[L, G]``: floored ideal counts, one more for the largest fractional parts up to the
    layer's rounded total, clipped to ``[1, T]``.
  """
  G = prune_LG.shape[1]
  ideal = jnp.clip(1.0 - prune_LG.astype(jnp.float32), 0.0, 1.0) * T
  total = jnp.clip(jnp.round(ideal.sum(-1, keepdims=True)), G, G * T).astype(jnp.int32)
  base = jnp.floor(ideal).astype(jnp.int32)
  remainder = total - base.sum(-1, keepdims=True)
  frac = ideal - base
  order = jnp.argsort(-frac, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)  # the inverse permutation: each head's rank
  base = base + (rank < jnp.minimum(remainder, G)).astype(jnp.int32)
  return jnp.clip(base, 1, T)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LUKV(Wrapper):
  """LU-KV (kvpress ``LUKVPress``): a scorer under a precomputed per-head budget curve.

  Paper: "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV
  Cache Eviction" (LU-KV, arXiv 2602.08585). Reference: kvpress 0.5.5
  ``presses/lukv_press.py::LUKVPress``; official code github.com/baidu-baige/LU-KV.

  The base's grouped scores with the first ``sinks`` and last ``recent`` positions protected,
  under :class:`BudgetCurve` (each layer's and KV head's kept count from the curve's row for the
  budget); ties to the lower position, as kvpress's stable sort. The default base is
  ExpectedAttention with ``epsilon=2e-2`` (kvpress's default press, whose curve LU-KV ships).

  Differences from kvpress:

  * The curve is given (``allocator=BudgetCurve(curve=...)``); kvpress downloads LU-KV's curve
    for Llama-3.1-8B-Instruct from GitHub. The curve is not computed here.
  * The budget is the mean kept count per head, ``T * (1 - compression_ratio)``; it picks the
    curve's row (:class:`BudgetCurve`).
  * kvpress's ``sink`` and ``window`` are ``sinks`` and ``recent`` (kvjax's ``window`` is an
    observation window); protected positions are ``+inf`` (kvpress: the largest score + 1).

  Attributes:
    base: the budget-free prefill scorer (kvpress ``press``).
    sinks: initial positions protected (kvpress ``sink``, 4).
    recent: last positions protected (kvpress ``window``, 1).
  """

  base: Policy = dataclasses.field(default_factory=lambda: ExpectedAttention(epsilon=2e-2))
  allocator: alloc_lib.Allocator = BudgetCurve()
  sinks: int = 4
  recent: int = 1

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "LUKV", given_budget=True)
    check_int("sinks", self.sinks, 0)
    check_int("recent", self.recent, 0)

  def score(self, evidence):
    """The base's grouped scores, ``sinks`` first and ``recent`` last positions ``+inf``."""
    s = self.grouped(self.base.score(evidence)).astype(jnp.float32)
    T = s.shape[-1]
    return scores_lib.protect(s, sinks=min(self.sinks, T), recent=min(self.recent, T))
