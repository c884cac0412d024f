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

The package: :mod:`kvjax.budgets.schedules` (uniform budgets, explicit tables, and the layer
schedules of PyramidKV and CAKE), :mod:`kvjax.budgets.heads` (the head-adaptive Ada-KV and
HeadKV), :mod:`kvjax.budgets.rounding` (integer budgets with an exact total) and
:mod:`kvjax.budgets.tokens` (the checks of token counts in budgets). Every allocator is
reachable here, as ``budgets.pyramid``.
"""

from __future__ import annotations

import jax

from ..checks import real as check_real
from .heads import (
  ADAKV_MODES,
  HEADKV_MODES,
  adakv,
  adakv_table,
  adakv_table_from_order,
  headkv,
  headkv_scores_from_json,
)
from .rounding import (
  adjust_budgets,
  round_to_total,
)
from .schedules import (
  PYRAMID_MODES,
  cake,
  cake_from_statistics,
  cake_preference,
  cake_statistics,
  from_table,
  per_head,
  pyramid,
  uniform,
)

Array = jax.Array

__all__ = [
  "ADAKV_MODES",
  "HEADKV_MODES",
  "PYRAMID_MODES",
  "adakv",
  "adakv_table",
  "adakv_table_from_order",
  "adjust_budgets",
  "cake",
  "cake_from_statistics",
  "cake_preference",
  "cake_statistics",
  "check_real",
  "from_table",
  "headkv",
  "headkv_scores_from_json",
  "per_head",
  "pyramid",
  "round_to_total",
  "uniform",
]
