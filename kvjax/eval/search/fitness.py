"""Fitness of allocations over a population: the retained attention mass and the next-token KL.

Both fitnesses are sums over kept positions, so each reads prefix sums of one sort
(``docs/concepts.md``, "compute shared work once"): a policy's scores order each head's
positions once, the future attention is summed along that order once, and any allocation is then
a gather. A :class:`MassTable` holds those prefix sums; :func:`retained_mass` evaluates one
allocation on it, and a population is one ``jit(vmap)`` of it.

* :func:`lab_table` (:func:`lab_tables` with the :class:`RuleEvidence` a named allocator's space
  reads): the synthetic lab's world of one scenario (its window rows score, its future
  mass judges: the sweep's ``retained_mass``, :mod:`kvjax.lab.groups`);
* :func:`model_table` (:func:`model_tables`, likewise): a real model's calibration prompts, one
  prefill each, whose window rows hold both the policy's observation window (the last ``window`` prompt queries) and the
  attention of a continuation of ``future`` tokens to the prompt (the oracle's evidence); a
  query-agnostic scorer (KeyDiff) reads the prompt's keys and values from the same prefill;
* :func:`kl_data` and :func:`population_kl`: the real objective, the next-token KL divergence
  of the full model's continuations after compression against the full cache, every candidate
  of a population one configuration of one :func:`kvjax.model.answers.answer_prefilled` call
  (``answer_configs`` over a prefill shared by every generation);
* :func:`accuracy_data` and :func:`population_accuracy`: task accuracy (RULER's tasks on a real
  model, as EvolKV's fitness), the population again one configuration axis of one
  ``answer_prefilled`` call over the evaluation's own prefill of the examples.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import policies, select
from kvjax.eval import grouping
from kvjax.lab import groups, synthetic
from kvjax.model import answers, decoding, llama
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
  the lower position, as :func:`kvjax.select.top_mask`).

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RuleEvidence:
  """What a named allocator's search space reads from the calibration data
  (:mod:`kvjax.eval.search.allocator_spaces`), mean over the calibration rows.

  Attributes:
    scores_LHP: the policy's scores ``[L, H, P]`` (Ada-KV's split; ``H``: the policy's score
      heads, the KV heads under ``num_kv_heads``).
    entropy_L: CAKE's entropy ``[L]`` over the policy's window rows
      (:func:`kvjax.budgets.cake_statistics`); NaN when the window has fewer than 2 rows.
    var_L: CAKE's variance ``[L]``, likewise.
  """

  scores_LHP: Array
  entropy_L: Array
  var_L: Array

  @property
  def statistics(self) -> tuple[Array, Array]:
    """CAKE's ``(entropy_L, var_L)``."""
    return self.entropy_L, self.var_L


@functools.partial(jax.jit, static_argnums=(2,))
def rule_evidence(scores_BLHP: Array, attn_BLHWP: Array, window: int) -> RuleEvidence:
  """The :class:`RuleEvidence` of rows ``B``: their mean scores and mean CAKE statistics over
  the last ``window`` rows of each row's window attention (NaN statistics below 2 rows)."""
  scores = jnp.asarray(scores_BLHP, jnp.float32).mean(0)
  L = scores.shape[0]
  if window < 2 or attn_BLHWP.shape[3] < window:
    nan = jnp.full((L,), jnp.nan, jnp.float32)
    return RuleEvidence(scores, nan, nan)
  stats = jax.vmap(lambda a: budgets_lib.cake_statistics(a, window))(
    jnp.asarray(attn_BLHWP, jnp.float32)
  )
  return RuleEvidence(scores, stats[0].mean(0), stats[1].mean(0))


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
  return lab_tables(scenario, world_cfg, policy)[0]


def lab_tables(scenario: str, world_cfg, policy: policies.Policy) -> tuple[MassTable, RuleEvidence]:
  """:func:`lab_table` and the world's :class:`RuleEvidence` (what a named allocator's space
  reads: the policy's scores, CAKE's statistics over the policy's window rows)."""
  ev = groups.world_evidence(scenario, world_cfg)
  arrays = {"attn": ev.attn_window_LHWP, "mass": ev.future_mass_LHP, "fact": ev.fact_P}
  fields = policy.evidence_fields
  if "column_sums_LHT" in fields:
    arrays["column_sums"] = ev.column_sums_LHP
  scores = groups.policy_scores(policy, arrays)
  table = jax.jit(mass_table)(scores, ev.future_mass_LHP)
  attn = jnp.asarray(ev.attn_window_LHWP)[None]  # one row
  return table, rule_evidence(scores[None], attn, int(policy.window or 0))


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
    policy: a window policy (SnapKV and its kin) or one that reads the prompt's keys and
      values (:data:`MODEL_FIELDS`: KeyDiff, a query-agnostic scorer).

  Returns:
    The table, mean over rows, at ``[L, H, prompt_len]`` (``H``: the policy's score heads).

  Raises:
    ValueError: ids :func:`check_calibration` refuses, or a policy that reads evidence other
      than :data:`MODEL_FIELDS`.
  """
  return model_tables(model, ids, prompt_len, policy)[0]


def model_tables(
  model, ids, prompt_len: int, policy: policies.Policy
) -> tuple[MassTable, RuleEvidence]:
  """:func:`model_table` and the rows' :class:`RuleEvidence` (the policy's scores and CAKE's
  statistics over its observation window), from the same prefill.

  Raises:
    ValueError: as :func:`model_table`.
  """
  arr = check_calibration(ids, prompt_len)
  extra = set(policy.evidence_fields) - set(MODEL_FIELDS)
  if extra:
    raise ValueError(
      f"policy: {type(policy).__name__} reads {sorted(extra)}; the model fitness gives "
      f"{list(MODEL_FIELDS)} only (SnapKV and its kin, KeyDiff, ...)"
    )
  window = int(policy.window or 0)
  low = 1 if "attn_window_LHWT" in policy.evidence_fields else 0  # a window policy reads rows
  if window < low or window > prompt_len:
    raise ValueError(f"policy: window {window} outside [{low}, prompt_len={prompt_len}]")
  future = arr.shape[1] - prompt_len
  request = policies.EvidenceRequest(window=window + future)
  pre = jax.jit(llama.prefill, static_argnums=(0, 4))(
    model.cfg, model.params(), jnp.asarray(arr, jnp.int32), None, request
  )
  rows_LBHWT = pre.attn_window.astype(jnp.float32)[..., :prompt_len]
  kv = None
  if {"keys_LGTD", "values_LGTD"} & set(policy.evidence_fields):
    kv = (pre.keys[..., :prompt_len, :], pre.values[..., :prompt_len, :])
  table = _model_table(policy, rows_LBHWT, kv, window, model.cfg.num_kv_heads)
  return table, _model_rule_evidence(policy, rows_LBHWT, kv, window)


# the evidence the model fitness gives a policy: the window rows, and the prompt's keys and values
MODEL_FIELDS = ("attn_window_LHWT", "keys_LGTD", "values_LGTD")


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _model_table(policy, rows_LBHWT, kv, window: int, num_kv_heads: int) -> MassTable:
  def one_row(row):
    rows_LHWT, kv_row = row
    fields = {"attn_window_LHWT": rows_LHWT[:, :, :window]} if window else {}
    if kv_row is not None:
      fields |= {"keys_LGTD": kv_row[0], "values_LGTD": kv_row[1]}
    scores = policy.scores(policies.Evidence(**fields))
    mass = rows_LHWT[:, :, window:].mean(2)
    if scores.shape[1] != mass.shape[1]:  # KV-head granularity: a group's mean mass
      L, H, P = mass.shape
      mass = mass.reshape(L, num_kv_heads, H // num_kv_heads, P).mean(2)
    return mass_table(scores, mass)

  kv_B = None if kv is None else tuple(jnp.moveaxis(x, 1, 0) for x in kv)
  tables = jax.lax.map(one_row, (jnp.moveaxis(rows_LBHWT, 1, 0), kv_B))
  return jax.tree.map(lambda x: x.mean(0), tables)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _model_rule_evidence(policy, rows_LBHWT, kv, window: int) -> RuleEvidence:
  def one_row(row):
    rows_LHWT, kv_row = row
    fields = {"attn_window_LHWT": rows_LHWT[:, :, :window]} if window else {}
    if kv_row is not None:
      fields |= {"keys_LGTD": kv_row[0], "values_LGTD": kv_row[1]}
    return policy.scores(policies.Evidence(**fields))

  kv_B = None if kv is None else tuple(jnp.moveaxis(x, 1, 0) for x in kv)
  rows_BLHWT = jnp.moveaxis(rows_LBHWT, 1, 0)
  scores_BLHP = jax.lax.map(one_row, (rows_BLHWT, kv_B))
  return rule_evidence(scores_BLHP, rows_BLHWT[:, :, :, :window], window)


# --------------------------------------------------------------------------- the KL fitness


@dataclasses.dataclass(frozen=True)
class KLData:
  """What every allocation's KL fitness reads: the calibration rows prefilled once and the full
  cache's teacher-forced log-probabilities of their continuations.

  Attributes:
    prefilled: the shared prefill (:func:`kvjax.model.answers.prefill_answers`): the context is
      the ``prompt_len`` prompt tokens, the first continuation token is the re-fed question and
      the rest of the continuation is the answer whose next tokens are judged.
    reference_BNV: the full cache's log-probabilities ``[B, N, V]`` at the answer positions.
    prompt_len: the context every allocation compresses.
    heads: the heads of the policy's budgets (``[K, L, heads]`` per call).
  """

  prefilled: answers.Prefilled
  reference_BNV: np.ndarray
  prompt_len: int
  heads: int


def continuation(model, prompt_ids, future: int) -> np.ndarray:
  """The full model's greedy continuation of ``future`` tokens after each prompt ``[B, P]``:
  the reference continuation rows are ``concatenate([prompt_ids, continuation], 1)``.

  Raises:
    ValueError: ``future`` below 2 (a question token and at least one judged token).
  """
  if isinstance(future, bool) or not isinstance(future, int | np.integer) or future < 2:
    raise ValueError(f"future: expected an int >= 2, got {future!r}")
  gen = decoding.generate(model, np.asarray(prompt_ids), policy="full", max_new_tokens=future)
  return np.asarray(gen.tokens, np.int32)


def kl_data(model, ids, prompt_len: int, policy: policies.Policy) -> KLData:
  """The :class:`KLData` of calibration rows ``[B, T]`` (a prompt and its full-model
  continuation, :func:`continuation`): one prefill of the prompt (query-agnostic:
  ``question="after"``, the evidence sees the prompt alone, as :func:`model_table`'s does), the
  first continuation token fed as the question and the next ``T - prompt_len - 1`` judged.

  Args:
    model: a :class:`kvjax.model.Llama`.
    ids: token ids ``[B, T]``, ``T >= prompt_len + 2``.
    prompt_len: the prompt's tokens (the compressed context).
    policy: the scorer (its evidence fields are computed by the prefill).

  Returns:
    The data, with the full cache's log-probabilities (every entry's budget the whole prompt).

  Raises:
    ValueError: ids :func:`check_calibration` refuses or with fewer than 2 continuation tokens.
  """
  arr = check_calibration(ids, prompt_len)
  if arr.shape[1] - prompt_len < 2:
    raise ValueError(
      f"ids: {arr.shape[1] - prompt_len} continuation tokens after prompt_len {prompt_len}; "
      "expected at least 2 (a fed token and a judged one)"
    )
  window = max(int(policy.window or 0), 1)
  prefilled = answers.prefill_answers(
    model,
    arr[:, : prompt_len + 1],
    arr[:, prompt_len + 1 :],
    question=answers.Question(1, "after"),
    window=window,
    oracle=False,
    needs=tuple(sorted(policy.evidence_fields)),
  )
  full = answers.answer_prefilled(model, prefilled, [prompt_len], policy=policy)
  heads = np.asarray(full.budget_LH).shape[-1]
  return KLData(prefilled, np.asarray(full.logprobs[0], np.float32), prompt_len, heads)


def kl_divergence(reference_BNV, logprobs_KBNV) -> np.ndarray:
  """``KL(full || compressed)`` of each configuration, mean over rows and judged tokens: ``[K]``."""
  ref = jnp.asarray(reference_BNV, jnp.float32)[None]
  lp = jnp.asarray(logprobs_KBNV, jnp.float32)
  kl = (jnp.exp(ref) * (ref - lp)).sum(-1)
  return np.asarray(kl.mean((-1, -2)), np.float64)


def population_kl(model, data: KLData, policy: policies.Policy, budgets_K) -> np.ndarray:
  """The next-token KL of each allocation of a population ``[K, L(, G)]``: ``[K]``.

  One :func:`kvjax.model.answers.answer_prefilled` call whose configuration axis is the
  population (``budgets [K, L, H]``, each ``[L, G]`` entry repeated over its query heads).

  Args:
    model: the model :func:`kl_data` prefilled with.
    data: the :class:`KLData`.
    policy: the scorer.
    budgets_K: the allocations.

  Returns:
    float64 ``[K]``, lower is better (0: the full cache's predictions).
  """
  out = _answer_population(model, data, policy, jnp.asarray(budgets_K, jnp.int32))
  return kl_divergence(data.reference_BNV, out.logprobs)


def _answer_population(model, data, policy: policies.Policy, budgets_K) -> answers.Answers:
  """The answers of each allocation ``[K, L(, G)]`` from ``data.prefilled``: one call whose
  configuration axis is the population (each ``[L, G]`` entry repeated over its query heads)."""
  budgets_KLH = jax.vmap(lambda a: budget_heads(a, data.heads))(budgets_K)
  return answers.answer_prefilled(model, data.prefilled, np.asarray(budgets_KLH), policy=policy)


# --------------------------------------------------------------------------- task accuracy

# an example's score: the task's exact rule (RULER's niah: every value), or RULER's partial
# credit (string_match_all: the share of values found)
ACCURACY_METRICS = ("accuracy", "recall")


@dataclasses.dataclass(frozen=True)
class AccuracyData:
  """What every allocation's task-accuracy fitness reads: the examples prefilled once (the
  evaluation's own prefill, :func:`kvjax.eval.grouping.prefill_examples`) and the full cache's
  scores.

  Attributes:
    examples: the task examples (:class:`kvjax.eval.tasks.Example`; RULER's from
      :func:`kvjax.eval.ruler.generate`), prompts of one length.
    prefilled: their shared prefill (the question in the observation window, as the
      evaluation's default).
    context_len: the compressed context (the prompt less the longest question).
    heads: the heads of the policy's budgets.
    full: the full cache's score of each example ``[B]``.
    metric: one of :data:`ACCURACY_METRICS`.
  """

  examples: tuple
  prefilled: answers.Prefilled
  context_len: int
  heads: int
  full: np.ndarray
  metric: str


def _scores(data: AccuracyData, predicted_KBN) -> np.ndarray:
  fn = grouping.accuracy if data.metric == "accuracy" else grouping.recall
  return np.stack([np.asarray(fn(data.examples, p), np.float64) for p in predicted_KBN])


def accuracy_data(model, examples, policy: policies.Policy, metric: str = "accuracy"):
  """The :class:`AccuracyData` of task examples under ``policy``.

  Args:
    model: a :class:`kvjax.model.Llama`.
    examples: task examples with prompts of one length (RULER's, or kvjax's tasks').
    policy: the scorer (its evidence fields are computed by the prefill).
    metric: ``"accuracy"`` (the task's exact rule, what the evaluation reports) or
      ``"recall"`` (RULER's ``string_match_all``: partial credit, a smoother fitness).

  Returns:
    The data, with the full cache's scores.

  Raises:
    ValueError: no examples, prompts of different lengths, or an unknown metric.
  """
  exs = tuple(examples)
  if not exs:
    raise ValueError("examples: none; expected at least one task example")
  if metric not in ACCURACY_METRICS:
    raise ValueError(f"metric: unknown value {metric!r}; expected one of {ACCURACY_METRICS}")
  window = max(int(policy.window or 0), 1)
  prefilled = grouping.prefill_examples(
    model, exs, window=window, oracle=False, needs=tuple(sorted(policy.evidence_fields))
  )
  context = exs[0].prompt.size - max(e.question_len for e in exs)
  full = answers.answer_prefilled(model, prefilled, [context], policy=policy)
  heads = np.asarray(full.budget_LH).shape[-1]
  data = AccuracyData(exs, prefilled, context, heads, np.zeros(len(exs)), metric)
  return dataclasses.replace(data, full=_scores(data, np.asarray(full.predicted))[0])


def population_accuracy(model, data: AccuracyData, policy: policies.Policy, budgets_K):
  """The mean task score of each allocation of a population ``[K, L(, G)]``: ``[K]``.

  One :func:`kvjax.model.answers.answer_prefilled` call whose configuration axis is the
  population (each entry capped at the context: a larger budget keeps it all the same), every
  example scored by the evaluation's rule (:func:`kvjax.eval.grouping.accuracy`, or ``recall``).

  Args:
    model: the model :func:`accuracy_data` prefilled with.
    data: the :class:`AccuracyData`.
    policy: the scorer.
    budgets_K: the allocations.

  Returns:
    float64 ``[K]`` in ``[0, 1]``, higher is better.
  """
  b = jnp.minimum(jnp.asarray(budgets_K, jnp.int32), data.context_len)
  out = _answer_population(model, data, policy, b)
  return _scores(data, np.asarray(out.predicted)).mean(1)
