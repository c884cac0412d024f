"""Fitness of allocations, vmapped over a population: the retained attention mass.

Both fitnesses are sums over kept positions, so each reads prefix sums of one sort
(``docs/concepts.md``, "compute shared work once"): a policy's scores order each head's
positions once, the future attention is summed along that order once, and any allocation is then
a gather. A :class:`MassTable` holds those prefix sums; :func:`retained_mass` evaluates one
allocation on it, and a population is one ``jit(vmap)`` of it.

* :func:`lab_table`: the synthetic lab's world of one scenario (its window rows score, its future
  mass judges: the sweep's ``retained_mass``, :mod:`kvjax.lab.groups`);
* :func:`model_table`: a real model's calibration prompts, one prefill each, whose window rows
  hold both the policy's observation window (the last ``window`` prompt queries) and the
  attention of a continuation of ``future`` tokens to the prompt (the oracle's evidence).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies, select
from kvjax.lab import groups, synthetic
from kvjax.model import llama
from kvjax.policies.allocators import heads_like

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MassTable:
  """What every allocation of one evidence set reads.

  Attributes:
    prefix_LHP: ``[L, H, P + 1]`` prefix sums of the future mass along the policy's order of
      each head's positions (mean over calibration rows).
    total_LH: ``[L, H]`` each head's whole future mass (what a budget ``>= P`` keeps).
  """

  prefix_LHP: Array
  total_LH: Array

  @property
  def prompt_len(self) -> int:
    return self.prefix_LHP.shape[-1] - 1

  @property
  def heads(self) -> int:
    return self.prefix_LHP.shape[1]


def mass_table(scores_LHP: Array, mass_LHP: Array) -> MassTable:
  """Prefix sums of ``mass_LHP`` along each head's order of ``scores_LHP`` (best first, ties to
  the lower position, as :func:`kvjax.select.keep_mask`).

  Args:
    scores_LHP: a policy's scores ``[L, H, P]``.
    mass_LHP: the future attention on each prompt position ``[L, H, P]``.

  Returns:
    The :class:`MassTable`.
  """
  P = scores_LHP.shape[-1]
  order = select.descending_order(scores_LHP, P)
  sorted_mass = jnp.take_along_axis(mass_LHP, order, -1)
  zeros = jnp.zeros(sorted_mass.shape[:-1] + (1,), sorted_mass.dtype)
  prefix = jnp.concatenate([zeros, jnp.cumsum(sorted_mass, -1)], -1)
  return MassTable(prefix, mass_LHP.sum(-1))


def budget_heads(budget, heads: int) -> Array:
  """An ``[L]`` or ``[L, G]`` allocation at ``heads`` heads per layer (each KV head's budget
  repeated over its query heads; ``G`` must divide ``heads``)."""
  budget = jnp.asarray(budget, jnp.int32)
  if budget.ndim == 1:
    return jnp.broadcast_to(budget[:, None], budget.shape + (heads,))
  return heads_like(budget, heads)


def retained_mass(table: MassTable, budget) -> Array:
  """The future attention mass one allocation keeps, mean over layers and heads.

  Args:
    table: the :class:`MassTable`.
    budget: an ``[L]`` or ``[L, G]`` allocation (window included).

  Returns:
    A float32 scalar.
  """
  budget_LH = budget_heads(budget, table.heads)
  P = table.prompt_len
  n = jnp.clip(budget_LH, 0, P)[..., None]
  kept = jnp.take_along_axis(table.prefix_LHP, n, -1)[..., 0]
  return jnp.where(budget_LH >= P, table.total_LH, kept).mean()


def population_fitness(table: MassTable, budgets_K) -> Array:
  """:func:`retained_mass` of every allocation of a population ``[K, L(, G)]``: ``[K]``."""
  return jax.vmap(retained_mass, in_axes=(None, 0))(table, budgets_K)


# --------------------------------------------------------------------------- the lab


def lab_policy(name: str, window: int) -> policies.Policy:
  """A registered policy with its protected ``window`` (the sweep's way of building one)."""
  return policies.make(name, **policies.accepted_options(name, window=window))


def lab_table(scenario: str, world_cfg, policy: policies.Policy) -> MassTable:
  """The :class:`MassTable` of a scenario's world under ``policy``'s scores.

  Args:
    scenario: a lab scenario (:func:`kvjax.lab.synthetic.scenario`).
    world_cfg: the world's size fields and ``seed`` (a dict or ``ConfigDict``); another seed is
      another world (calibration and held-out worlds differ by seed).
    policy: a policy the lab's world can score (window rows, column sums, future rows).

  Returns:
    The table, at the world's ``[L, H, P]``.
  """
  ev = groups.world_evidence(scenario, world_cfg)
  arrays = {"attn": ev.attn_window_LHWP, "mass": ev.future_mass_LHP, "fact": ev.fact_P}
  fields = policy.evidence_fields
  if "column_sums_LHT" in fields:
    arrays["column_sums"] = ev.column_sums_LHP
  scores = groups.policy_scores(policy, arrays)
  return jax.jit(mass_table)(scores, ev.future_mass_LHP)


def lab_dims(scenario: str, world_cfg) -> synthetic.WorldConfig:
  """The world config a scenario's lab table is built from (its ``num_layers``, ``num_heads``,
  ``prompt_len``)."""
  return synthetic.world_config(scenario, world_cfg)


# --------------------------------------------------------------------------- a real model


def check_calibration(ids, prompt_len: int, name: str = "ids") -> np.ndarray:
  """Calibration token ids ``[B, T]``: a prompt of ``prompt_len`` and a continuation after it.

  Raises:
    ValueError: not a non-empty integer ``[B, T]`` with ``0 < prompt_len < T``.
  """
  arr = np.asarray(ids)
  if arr.ndim != 2 or arr.shape[0] == 0 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name}: expected integer token ids [B, T] with B >= 1, got {arr.shape}")
  if not 0 < prompt_len < arr.shape[1]:
    raise ValueError(
      f"prompt_len: {prompt_len} outside (0, {arr.shape[1]}); expected a prompt followed by a "
      "continuation in each row"
    )
  return arr


def model_table(model, ids, prompt_len: int, policy: policies.Policy) -> MassTable:
  """The :class:`MassTable` of a real model's calibration rows under ``policy``.

  One prefill of the rows ``[B, T]`` asks for the window rows of the last
  ``window + T - prompt_len`` queries: the first ``window`` are the policy's observation window
  over the prompt (causal: equal to a prefill of the prompt alone), the others the continuation's
  attention to the prompt, whose mean over continuation tokens and rows is the future mass. The
  heads are the policy's granularity (query heads, or KV heads with ``num_kv_heads``, the mass
  then averaged over each group's query heads).

  Args:
    model: a :class:`kvjax.model.Llama`.
    ids: token ids ``[B, T]``, every row a prompt of ``prompt_len`` tokens and its continuation.
    prompt_len: the prompt's tokens.
    policy: a window policy (SnapKV and its kin: it reads the window rows only).

  Returns:
    The table, mean over rows, at ``[L, H, prompt_len]``.

  Raises:
    ValueError: ids :func:`check_calibration` refuses, or a policy that reads more than the
      window rows.
  """
  arr = check_calibration(ids, prompt_len)
  extra = set(policy.evidence_fields) - {"attn_window_LHWT"}
  if extra:
    raise ValueError(
      f"policy: {type(policy).__name__} reads {sorted(extra)}; the model fitness gives window "
      "rows only (a window policy: SnapKV, PyramidKV's scorer, ...)"
    )
  window = int(policy.window or 0)
  if window < 1 or window > prompt_len:
    raise ValueError(f"policy: window {window} outside [1, prompt_len={prompt_len}]")
  future = arr.shape[1] - prompt_len
  request = policies.EvidenceRequest(window=window + future)
  pre = jax.jit(llama.prefill, static_argnums=(0, 4))(
    model.cfg, model.params(), jnp.asarray(arr, jnp.int32), None, request
  )
  rows_LBHWT = pre.attn_window.astype(jnp.float32)[..., :prompt_len]
  return _model_table(policy, rows_LBHWT, window, model.cfg.num_kv_heads)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _model_table(policy, rows_LBHWT, window: int, num_kv_heads: int) -> MassTable:
  def one_row(rows_LHWT):
    evidence = policies.Evidence(attn_window_LHWT=rows_LHWT[:, :, :window])
    scores = policy.scores(evidence)
    mass = rows_LHWT[:, :, window:].mean(2)
    if scores.shape[1] != mass.shape[1]:  # KV-head granularity: a group's mean mass
      L, H, P = mass.shape
      mass = mass.reshape(L, num_kv_heads, H // num_kv_heads, P).mean(2)
    return mass_table(scores, mass)

  tables = jax.lax.map(one_row, jnp.moveaxis(rows_LBHWT, 1, 0))
  return jax.tree.map(lambda x: x.mean(0), tables)
