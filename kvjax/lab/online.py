"""Online simulation: a policy applied at every generation step of a synthetic world, inside
``lax.scan``, with a fixed-capacity slot table per (layer, head).

Cache semantics (the same for every policy, so budgets compare):

* The prompt (``P`` tokens) is compressed once at the end of prefill by the policy itself
  (:mod:`kvjax.policies`: its scores, allocator and selection scores) to its ``budget_LH``.
* At generation step ``s`` (position ``t = P + s``) the new token joins the cache, then the cache
  is cut back to ``budget_LH`` with the information the policy had *before* attending (the new
  token is always kept), and the query attends to exactly ``min(budget, t + 1)`` positions,
  itself included. (Official H2O/TOVA evict after attending with a cache of ``budget - 1``
  old tokens: the same thing.)
* Decode-time policies (:class:`kvjax.policies.DecodePolicy`: sliding window, StreamingLLM,
  H2O, TOVA, a user's own) evict every step by their own state machine, the one the model's
  cache runs: :meth:`~kvjax.policies.DecodePolicy.init_state` from the prompt's kept slots,
  :meth:`~kvjax.policies.DecodePolicy.keep_scores` before each step,
  :meth:`~kvjax.policies.DecodePolicy.observe` of the attention the compressed cache paid
  (official H2O's accumulated attention over its own compressed rows, TOVA's previous row
  averaged over heads).
* Prefill-time policies (SnapKV, PyramidKV, Ada-KV, CAKE, random, ...) select once; the lab's
  cache then pins the prompt positions their vote selected and keeps a rolling recent window
  (the essay's "high-vote prompt positions plus a rolling recent window"): the lab's cache
  semantics (:class:`PinnedPrompt`), not the policy's.
* A policy that reads future attention (:attr:`~kvjax.policies.Policy.reads_future`, the oracle)
  keeps the top ``b`` of the true current row (not realisable; the upper bound).
* Attention-free prefill scorers (``knorm``, ``keydiff``, ``lagkv``) read the world's *modelled*
  keys (:mod:`kvjax.lab.keys`, a stated hypothesis, not measured keys) and its values over the
  prompt (:func:`key_evidence`); like every prefill policy they pin what they selected and roll
  the rest. They protect no observation window, so unlike SnapKV their recent tokens are only
  those they happened to select.

Any policy whose evidence the lab provides can be replayed (:func:`can_replay`), a user's
registered or unregistered one included. Selection always goes through :mod:`kvjax.select`.
Rows are generated inside the scan, so no ``[L, H, S, T]`` array exists; the cache map
``[S, L, H, C]`` is recorded on request.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import checks, policies, select
from kvjax.lab import keys as keys_lib
from kvjax.lab import metrics as metrics_lib
from kvjax.lab import synthetic

Array = jax.Array

# The evidence the lab gives a policy: the prompt's window rows, H2O's column sums and a PRNG key
# (prompt_evidence), the modelled keys and the world's values (key_evidence), and, for a
# policy that reads the future, the true row of every step (the oracle's replay).
LAB_EVIDENCE = frozenset(
  {
    "attn_window_LHWT",
    "column_sums_LHT",
    "rng",
    "keys_LGTD",
    "values_LGTD",
    "future_attn_LHST",
  }
)


# what the lab's cache (whole tokens, the prompt compressed once, no merging) cannot replay
_REPLAY_REFUSALS = (
  (lambda p: p.channel_ratio, "it prunes key channels (channel_ratio)"),
  (lambda p: p.decode_every is not None, "it re-compresses every decode_every tokens"),
  (lambda p: p.merges, "it merges evicted values into kept ones"),
)


def replay_problem(policy: policies.Policy) -> str | None:
  """Why the lab cannot replay ``policy``, or ``None`` when it can."""
  refusals = [
    (test, f"{why}, which the lab's cache does not model") for test, why in _REPLAY_REFUSALS
  ]
  return synthetic.policy_problem(policy, refusals, LAB_EVIDENCE, "the lab")


def can_replay(policy: policies.Policy | str) -> bool:
  """Whether the lab replays ``policy`` (an object or a registered name): every evidence field
  it reads is one of :data:`LAB_EVIDENCE`, and it has no ``channel_ratio`` or ``decode_every``
  (the lab's cache holds whole tokens and compresses the prompt once)."""
  return replay_problem(policies.build(policy)) is None


def replayable() -> tuple[str, ...]:
  """The registered names the lab replays (:func:`can_replay` of each with its defaults), a
  user's registered since included; a factory that cannot build without options is left out."""
  return policies.names_where(can_replay)


LAB_POLICIES = replayable()  # the built-in replayable names (for messages and tests)


@struct.dataclass
class Trace:
  """What a simulation produced: per-step metrics ``[S, L, H]`` and, optionally, the cache map."""

  metrics: metrics_lib.StepMetrics
  budget_LH: Array
  positions_SLHC: Array | None = None
  valid_SLHC: Array | None = None


@struct.dataclass
class _Slots:
  pos: Array  # [L, H, C] int32 original positions
  valid: Array  # [L, H, C] bool
  state: Array | None  # [L, H, C] float32: the cache's per-slot state (None: stateless)


@dataclasses.dataclass(frozen=True)
class PinnedPrompt:
  """The lab's cache for a prefill-time policy, with a decode policy's three methods: the
  prompt positions the policy selected before the last ``window`` prompt tokens stay pinned
  (state 1); every other slot (the selected window, then each generated token) rolls by
  recency."""

  pinned_before: int  # P - window: selected positions below it are pinned

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    return jnp.where(kept_LHC, (idx_LHC < self.pinned_before).astype(jnp.float32), 0.0)

  def observe(self, state_HC, attn_HC):
    return state_HC

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return jnp.where(state_HC > 0, jnp.inf, positions_HC.astype(jnp.float32))


def rolling_window(policy: policies.Policy, dims: synthetic.Dims) -> int:
  """The recent window a prefill-time policy's cache rolls: its own protected window (the
  option named by its ``window_field``), else the world's observation window."""
  field = policy.window_field
  return (getattr(policy, field) if field else None) or dims.window


def lab_cache(policy: policies.Policy, dims: synthetic.Dims):
  """What evicts while decoding: a decode-time policy itself, else the lab's
  :class:`PinnedPrompt` cache around the prompt's selection."""
  if policy.evicts_each_step:
    return policy
  return PinnedPrompt(dims.prompt_len - rolling_window(policy, dims))


@jax.jit
def prompt_evidence(world: synthetic.World, rng: Array) -> policies.Evidence:
  """What prefill can observe: the observation-window rows and H2O's prompt column sums, both
  over the ``P`` prompt positions (compute once per world, share across policies)."""
  P = world.dims.prompt_len
  return policies.Evidence(
    attn_window_LHWT=synthetic.window_rows(world)[..., :P],
    column_sums_LHT=synthetic.prompt_column_sums(world)[..., :P],
    rng=rng,
  )


def needs_keys(policy: policies.Policy | str) -> bool:
  """Whether ``policy`` (an object or a name) reads keys or values (the lab then models them,
  :mod:`.keys`)."""
  return bool({"keys_LGTD", "values_LGTD"} & policies.build(policy).evidence_fields)


def key_evidence(
  world: synthetic.World,
  evidence: policies.Evidence,
  geometry: keys_lib.KeyGeometry | None = None,
  *,
  seed: int = 0,
) -> policies.Evidence:
  """``evidence`` with the prompt's modelled keys and the world's values, ``keys_LGTD`` and
  ``values_LGTD`` ``[L, H, P, D]`` (lab heads are KV heads), for the attention-free scorers.
  ``geometry`` is the key model's knobs (default :class:`~kvjax.lab.keys.KeyGeometry`);
  ``seed`` should be the world's seed."""
  P = world.dims.prompt_len
  keys_LHTD = keys_lib.world_keys(world, geometry, seed=seed)
  return evidence.replace(
    keys_LGTD=keys_LHTD[..., :P, :], values_LGTD=world.values_LHTD[..., :P, :]
  )


def check_budget(world: synthetic.World, budget_LH) -> np.ndarray:
  """A concrete ``[L, H]`` budget that fits the world, or ``ValueError`` naming ``budget``."""
  cfg = world.dims
  b = np.asarray(budget_LH)
  if b.shape != (cfg.num_layers, cfg.num_heads):
    raise ValueError(f"budget: shape {b.shape}, expected [L={cfg.num_layers}, H={cfg.num_heads}]")
  if b.min() < 1:
    raise ValueError(f"budget: {int(b.min())} < 1; the current token always needs a slot")
  if b.max() > cfg.total_len:
    raise ValueError(
      f"budget: {int(b.max())} is larger than the world (T={cfg.total_len} positions)"
    )
  return b


def allocate(world: synthetic.World, policy: policies.Policy | str, budget, evidence=None) -> Array:
  """The policy's ``budget_LH`` on this world's prompt: its allocator's (PyramidKV, Ada-KV,
  CAKE allocate; the others broadcast ``budget``). A policy that keeps every position (the full
  cache) keeps every position of the world."""
  policy = policies.build(policy)
  L, H = world.dims.num_layers, world.dims.num_heads
  if policy.allocator.keeps_all:
    return jnp.full((L, H), world.dims.total_len, jnp.int32)
  if not policy.allocates:
    return policies.as_budget_LH(budget, L, H)
  evidence = prompt_evidence(world, jax.random.key(0)) if evidence is None else evidence
  scores = policy.scores(evidence)
  return policy.budgets(evidence, scores, budget)


def simulate(
  world: synthetic.World,
  policy: policies.Policy | str,
  budget,
  *,
  capacity: int | None = None,
  record_map: bool = False,
  seed: int = 0,
  evidence: policies.Evidence | None = None,
  geometry: keys_lib.KeyGeometry | None = None,
  **options,
) -> Trace:
  """Runs ``policy`` over the world's generation.

  Args:
    world: the synthetic world.
    policy: a :class:`~kvjax.policies.Policy`, or a registered name built with ``options``
      (:func:`kvjax.policies.build`; a name means the registry's defaults, e.g. H2O's
      ``recent=8``). It must be replayable (:func:`can_replay`).
    budget: a scalar, ``[L]`` or ``[L, H]`` per-head budget (window and sinks included);
      allocating policies turn it into their own ``budget_LH``.
    capacity: static slot count (default: the largest budget).
    record_map: record the cache map ``[S, L, H, C]``.
    seed: seeds the random policy and the modelled keys.
    evidence: :func:`prompt_evidence`, to share the prefill evidence across policies.
    geometry: the key model for a policy that reads keys (:func:`needs_keys`): it gets them
      from :func:`key_evidence` under ``geometry`` when ``evidence`` has none or ``geometry`` is
      given; otherwise it reads the keys already in ``evidence``.
    **options: the policy's options (with a name only).

  Returns:
    The :class:`Trace`.

  Raises:
    ValueError: for a policy the lab cannot replay, a budget or capacity that does not fit the
      world, a decode-time hook (``init_state``, ``observe``, ``keep_scores``) returning another
      shape than the slots' ``[L, H, C]`` (raised while tracing, with the policy and hook
      named), and keep scores holding NaN (:func:`check_keep_scores`).
  """
  policy = _replayable_policy(policy, options)
  evidence = _world_evidence(world, policy, evidence, geometry, seed)
  b = _checked_allocation(world, policy, budget, evidence)
  capacity = _checked_capacity(capacity, [b])
  trace, nan_step = _simulate(
    world, policy, jnp.asarray(b, jnp.int32), evidence, capacity, record_map
  )
  check_keep_scores(policy, nan_step)
  return trace


def _replayable_policy(policy, options) -> policies.Policy:
  """``policy`` built with ``options``, or ``ValueError`` when the lab cannot replay it."""
  policy = policies.build(policy, **options)
  why = replay_problem(policy)
  if why is not None:
    raise ValueError(
      f"name: policy {policy.label!r} is not simulated in the lab: {why}; expected a "
      f"replayable policy, e.g. one of {replayable()}"
    )
  return policy


def _world_evidence(world, policy, evidence, geometry, seed) -> policies.Evidence:
  """The evidence ``policy`` reads on ``world``: :func:`prompt_evidence` unless given, with the
  modelled keys when it reads keys (:func:`simulate`'s ``geometry`` rule)."""
  if evidence is None:
    evidence = prompt_evidence(world, jax.random.key(seed))
  if needs_keys(policy) and (evidence.keys_LGTD is None or geometry is not None):
    evidence = key_evidence(world, evidence, geometry, seed=seed)
  return evidence


def _checked_allocation(world, policy, budget, evidence) -> np.ndarray:
  """The policy's concrete ``[L, H]`` budget on ``world``, each check of :func:`simulate`
  passed."""
  policy.check_budget(budget, policy.protected_window(evidence))
  b = check_budget(world, allocate(world, policy, budget, evidence))
  policy.check_allocation(b)
  return b


def _checked_capacity(capacity, allocations) -> int:
  """``capacity`` (default: the largest of ``allocations``), or ``ValueError`` when it cannot
  hold one of them."""
  largest = max(int(b.max()) for b in allocations)
  capacity = largest if capacity is None else int(capacity)
  if capacity < largest:
    raise ValueError(f"capacity: {capacity} is smaller than the largest budget {largest}")
  return capacity


def simulate_batch(
  worlds,
  policy: policies.Policy | str,
  budgets,
  *,
  capacity: int | None = None,
  record_map: bool = False,
  seed: int = 0,
  evidence=None,
  geometry: keys_lib.KeyGeometry | None = None,
  **options,
) -> list[list[Trace]]:
  """Runs ``policy`` on every world at every budget: :func:`simulate` of each (world, budget)
  case, to the bit at the same ``capacity``. One compiled program replays every budget of a
  world at once (``jax.vmap`` over the budgets; the world's attention rows and the oracle's
  ranking are computed once for all of them) and serves every world of the same shapes; it is
  compiled once per (policy, capacity, shapes, number of budgets) and reused by later calls.
  (Worlds are not stacked into one program: on CPU that compiles slower, runs no faster and
  moves the metrics by float rounding.)

  Args:
    worlds: a sequence of synthetic worlds.
    policy: as for :func:`simulate`.
    budgets: a sequence of budgets (each as :func:`simulate`'s ``budget``), run on every world.
    capacity: static slot count shared by every case (default: the largest allocation over
      every case, so one program serves them all).
    record_map: record the cache map ``[S, L, H, C]`` of each case.
    seed: as for :func:`simulate`.
    evidence: ``None`` or one :func:`prompt_evidence` per world.
    geometry: as for :func:`simulate`.
    **options: the policy's options (with a name only).

  Returns:
    ``traces[i][j]``: the :class:`Trace` of world ``i`` at budget ``j``.

  Raises:
    ValueError: whatever :func:`simulate` refuses in any case (every case is checked before any
      is replayed), and ``evidence`` not one per world.
  """
  worlds, budgets = list(worlds), list(budgets)
  policy = _replayable_policy(policy, options)
  evidence = [None] * len(worlds) if evidence is None else list(evidence)
  if len(evidence) != len(worlds):
    raise ValueError(
      f"evidence: {len(evidence)} entries for {len(worlds)} worlds; expected one per world"
    )
  evidence = [
    _world_evidence(w, policy, e, geometry, seed) for w, e in zip(worlds, evidence, strict=True)
  ]
  allocations = [
    [_checked_allocation(w, policy, budget, e) for budget in budgets]
    for w, e in zip(worlds, evidence, strict=True)
  ]
  if not budgets:
    return [[] for _ in worlds]
  capacity = _checked_capacity(capacity, [b for row in allocations for b in row])
  traces = []
  for world, ev, allocation in zip(worlds, evidence, allocations, strict=True):
    budget_BLH = jnp.asarray(np.stack(allocation), jnp.int32)
    batched, nan_B = _simulate_budgets(world, policy, budget_BLH, ev, capacity, record_map)
    for nan_step in np.asarray(nan_B):
      check_keep_scores(policy, nan_step)
    traces.append([jax.tree.map(lambda x, j=j: x[j], batched) for j in range(len(budgets))])
  return traces


@functools.partial(jax.jit, static_argnames=("policy", "capacity", "record_map"))
def _simulate_budgets(world, policy, budget_BLH, evidence, capacity, record_map):
  """:func:`_simulate` at every budget of ``budget_BLH`` (vmapped: what does not depend on the
  budget, the world's rows among it, is computed once)."""
  return jax.vmap(lambda b: _simulate(world, policy, b, evidence, capacity, record_map))(budget_BLH)


def check_keep_scores(policy: policies.Policy, nan_step) -> None:
  """Refuses a replay in which the cache's ``keep_scores`` held NaN at a kept slot: a NaN cannot
  be ranked, so what it evicted would be arbitrary (the model's cache refuses it too).

  Args:
    policy: the replayed policy, for the error.
    nan_step: the first generation step whose keep scores held NaN, ``-1`` for none; a traced
      one (a replay inside the caller's ``jit``) is not checked.

  Raises:
    ValueError: naming the policy and the step, for a concrete ``nan_step >= 0``.
  """
  if not checks.is_concrete(nan_step):
    return
  step = int(nan_step)
  if step >= 0:
    raise ValueError(
      f"keep_scores: policy {policy.label!r} returned NaN for a cached slot at generation step "
      f"{step}, which cannot be ranked; expected finite keep scores (or +-inf to force a slot "
      "in or out)"
    )


@functools.partial(jax.jit, static_argnames=("policy", "capacity", "record_map"))
def _simulate(world, policy, budget_LH, evidence, capacity, record_map):
  cfg = world.dims
  oracle = policy.reads_future
  cache = None if oracle else lab_cache(policy, cfg)
  if oracle:  # reads the true row at every step: nothing selected at prefill
    zeros = jnp.zeros(budget_LH.shape + (capacity,), jnp.int32)
    slots = _Slots(zeros, zeros > 0, None)
  else:
    slots = _prefill(policy, cache, budget_LH, evidence, capacity)

  def step(carry, s):
    slots, nan_step = carry
    t = cfg.prompt_len + s
    row = synthetic.attention_row(world, t)
    if oracle:
      pos, valid = select.compact(row, budget_LH, capacity, length=jnp.full(budget_LH.shape, t + 1))
      slots = _Slots(pos, valid, slots.state)
    else:
      slots, nan = _evict(cache, slots, budget_LH, t, capacity)
      nan_step = jnp.where((nan_step < 0) & nan, s, nan_step)
    fact_T = synthetic.active_fact_positions(world, s)
    m, a_hat = metrics_lib.step_metrics(
      row, world.values_LHTD, slots.pos, slots.valid, budget_LH, fact_T, capacity
    )
    if slots.state is not None:  # the attention the compressed cache paid
      state = policies.checked_observe(cache, slots.state, a_hat)
      slots = slots.replace(state=jnp.where(slots.valid, state, 0.0))
    out = (m, slots.pos, slots.valid) if record_map else (m,)
    return (slots, nan_step), out

  (_, nan_step), outs = jax.lax.scan(step, (slots, jnp.int32(-1)), jnp.arange(cfg.gen_steps))
  if record_map:
    return Trace(outs[0], budget_LH, outs[1], outs[2]), nan_step
  return Trace(outs[0], budget_LH), nan_step


def _prefill(policy, cache, budget_LH, evidence, capacity) -> _Slots:
  """Compresses the prompt with the policy's own scores and selection scores; the cache's
  initial per-slot state."""
  scores_LHT = policy.scores(evidence)
  selection = policy.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
  pos, valid = select.compact(selection, budget_LH, capacity)
  state = policies.checked_init_state(cache, evidence, scores_LHT, pos, valid)
  if state is not None:
    state = jnp.where(valid, state, 0.0)
  return _Slots(pos, valid, state)


def _evict(cache, slots: _Slots, budget_LH, t, capacity) -> tuple[_Slots, Array]:
  """Keeps each row's best ``budget - 1`` slots (by the cache's keep scores, what it knew before
  step ``t``) and admits token ``t`` into the next free slot: the new token is always cached,
  even when protected tokens (sinks, probation, pins) alone could fill the budget. Also says
  whether a kept slot's keep score was NaN (the ranking is then arbitrary)."""
  pos, valid, state = slots.pos, slots.valid, slots.state
  score = policies.checked_keep_scores(cache, state, pos, t, budget_LH)
  nan = (jnp.isnan(score) & valid).any()
  score = jnp.where(valid, score, -jnp.inf)
  room = jnp.minimum(budget_LH - 1, valid.sum(-1))
  idx, kept = select.compact(score, room, capacity)  # ascending positions, valid slots first
  take = functools.partial(jnp.take_along_axis, indices=idx, axis=-1)
  new_slot = jax.nn.one_hot(room, capacity, dtype=bool)  # the first free slot after the kept
  pos = jnp.where(new_slot, t, jnp.where(kept, take(pos), 0))
  if state is not None:
    state = jnp.where(kept, take(state), 0.0)  # a new slot's state starts at 0
  return _Slots(pos.astype(jnp.int32), kept | new_slot, state), nan
