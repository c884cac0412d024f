"""One group of a sweep: the world's evidence it reads and the pure functions it compiles.

A sweep's configurations are *prefill-time* selections of the prompt of a synthetic world,
judged by the attention the generated tokens will actually pay to the prompt (the "one-shot"
view: kvpress's optimal pruning is its oracle):

* ``retained_mass``: ``sum_{i in S} m_i`` with ``m_i`` the mean over generation steps of the full
  attention on prompt position ``i`` (mean over layers and heads);
* ``oracle_mass`` / ``oracle_gap``: the best ``b`` positions of ``m`` at the same ``budget_LH``;
* ``fact_recall``: share of the fact tokens generation queries that stay cached;
* ``cache_tokens`` / ``cache_bytes``: the compressed cache (K and V, ``bytes_per_value`` each).

All three are sums over kept positions, so each configuration is a gather into prefix sums of
one sort (``docs/concepts.md``, "compute shared work once"). This module holds the pure pieces:

* :class:`WorldEvidence`: what a scenario's world gives (window rows, future mass, facts; and on
  first use H2O's column sums, HeadKV's head scores, the lab's modelled keys and the world's
  values: built only for the groups that read them);
* :func:`make_group`: a group's functions (``prepare``, ``allocate``, ``order``, ``metrics``),
  budgets as data; each allocator by the engine's fast path when it has one (the shared CAKE
  statistics, Ada-KV's pooled table: :data:`FAST_SCHEDULES`, :data:`FAST_HEAD_ALLOCS`), any
  other through the :class:`kvjax.policies.Allocator` protocol, vmapped like the rest;
* the shared work of a score set (:func:`group_scores`, :func:`scores_and_table`, the prefix
  sums) and the sizes it is computed to (:func:`layer_capacity`, :func:`round_capacity`,
  :func:`table_depth`).

:mod:`kvjax.lab.sweep`'s engine calls them; :mod:`kvjax.lab.grid` defines the configurations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import policies, select
from kvjax.lab import online, synthetic
from kvjax.lab.grid import DATA_FIELDS, GroupKey, allocation_window, allocators, sweep_policy

Array = jax.Array

METRICS = (
  "retained_mass",
  "oracle_mass",
  "oracle_gap",
  "fact_recall",
  "cache_tokens",
  "cache_bytes",
)

# --------------------------------------------------------------------------- the world's evidence


@dataclasses.dataclass
class WorldEvidence:
  """Everything a group needs from one scenario, computed once: the window rows, the future
  mass and the facts at once; H2O's column sums, HeadKV's head scores, the modelled keys and the
  world's values on first use (only a group that reads them pays for them)."""

  world: synthetic.World  # built without values (values=False): most groups never read them
  attn_window_LHWP: Array
  future_mass_LHP: Array
  fact_P: Array
  calibration_cfg: synthetic.WorldConfig | None = None  # HeadKV's calibration world (next seed)
  config: synthetic.WorldConfig | None = None  # the world's own (its seed keys the key model)
  _column_sums: Array | None = None
  _head_scores: Array | None = None
  _keys: Array | None = None
  _values: Array | None = None

  @property
  def column_sums_LHP(self) -> Array:
    if self._column_sums is None:
      P = self.world.dims.prompt_len
      self._column_sums = synthetic.prompt_column_sums(self.world)[..., :P]
    return self._column_sums

  @property
  def head_scores_LH(self) -> Array:
    """HeadKV's retrieval-head scores, measured offline on a calibration world (next seed):
    the attention each head pays to the queried facts, averaged over the steps that query one."""
    if self._head_scores is None:
      # built only when a HeadKV group asks: the other groups never pay for a second world
      world = synthetic.make_world(self.calibration_cfg, values=False)
      self._head_scores = _retrieval_scores(world)
    return self._head_scores

  @property
  def keys_LHPD(self) -> Array:
    """The prompt's modelled keys ``[L, H, P, D]``, the lab's (:func:`kvjax.lab.online.key_evidence`
    with the default :class:`~kvjax.lab.keys.KeyGeometry` and the world's seed): what key norm,
    KeyDiff and LagKV read in the lab's replay."""
    if self._keys is None:
      evidence = online.key_evidence(self.world, policies.Evidence(), seed=self.config.seed)
      self._keys = evidence.keys_LGTD
    return self._keys

  @property
  def values_LHPD(self) -> Array:
    """The world's values over the prompt ``[L, H, P, D]``, as the lab's
    :func:`kvjax.lab.online.key_evidence` gives them (what LagKV or a value-norm scorer reads)."""
    if self._values is None:
      P = self.world.dims.prompt_len
      # the world again, with its values this time: the same seed draws the same tables
      self._values = synthetic.make_world(self.config).values_LHTD[..., :P, :]
    return self._values


@jax.jit
def _future_mass(world: synthetic.World) -> tuple[Array, Array]:
  dims = world.dims

  def add(acc, s):
    row = synthetic.attention_row(world, dims.prompt_len + s)
    fact = synthetic.active_fact_positions(world, s)
    return (acc[0] + row[..., : dims.prompt_len], acc[1] | fact[: dims.prompt_len]), None

  init = (
    jnp.zeros((dims.num_layers, dims.num_heads, dims.prompt_len)),
    jnp.zeros(dims.prompt_len, bool),
  )
  (total, facts), _ = jax.lax.scan(add, init, jnp.arange(dims.gen_steps))
  return total / dims.gen_steps, facts


# jitted: eager, its lax.map runs op by op (3.5 s against 1.3 s at L=H=32, P=8192)
_window_rows = jax.jit(synthetic.window_rows)


@jax.jit
def _retrieval_scores(world: synthetic.World) -> Array:
  dims = world.dims

  def add(acc, s):
    row = synthetic.attention_row(world, dims.prompt_len + s)
    fact = synthetic.active_fact_positions(world, s)
    return acc + jnp.where(fact, row, 0.0).sum(-1), None

  total, _ = jax.lax.scan(
    add, jnp.zeros((dims.num_layers, dims.num_heads)), jnp.arange(dims.gen_steps)
  )
  return total / dims.gen_steps + 1e-6  # strictly positive importances


def world_evidence(scenario: str, world_cfg) -> WorldEvidence:
  cfg = synthetic.world_config(scenario, world_cfg)
  world = synthetic.make_world(cfg, values=False)  # the metrics never read values (few scorers do)
  P = cfg.prompt_len
  m, facts = _future_mass(world)
  return WorldEvidence(
    world=world,
    attn_window_LHWP=_window_rows(world)[..., :P],
    future_mass_LHP=m,
    fact_P=facts,
    calibration_cfg=dataclasses.replace(cfg, seed=cfg.seed + 1),
    config=cfg,
  )


# --------------------------------------------------------------------------- a group's evidence


# the fields of WorldEvidence a group reads, by the Evidence field that carries them: the window
# rows, the future mass and the facts always; the others only when its policy or allocators read
# them (the evidence dict a group's functions take, under these short names)
OPTIONAL_EVIDENCE = {
  "column_sums_LHT": ("column_sums", "column_sums_LHP"),
  "head_scores_LH": ("head_scores", "head_scores_LH"),
  "keys_LGTD": ("keys", "keys_LHPD"),
  "values_LGTD": ("values", "values_LHPD"),
}


def evidence_fields(key: GroupKey) -> frozenset[str]:
  """The :class:`~kvjax.policies.Evidence` fields a group reads: its policy's and its
  allocators'."""
  layers, heads = allocators(key)
  return sweep_policy(key).evidence_fields | layers.needs | heads.needs


def group_evidence(ev: WorldEvidence, key: GroupKey) -> dict:
  """The arrays a group reads from its world (:data:`OPTIONAL_EVIDENCE` only when needed), by
  short name: ``attn``, ``mass``, ``fact`` and any of ``column_sums``, ``head_scores``, ``keys``,
  ``values``."""
  arrays = {"attn": ev.attn_window_LHWP, "mass": ev.future_mass_LHP, "fact": ev.fact_P}
  fields = evidence_fields(key)
  for field, (name, attribute) in OPTIONAL_EVIDENCE.items():
    if field in fields:  # a property: computed (once per world) by the first group that reads it
      arrays[name] = getattr(ev, attribute)
  return arrays


def sweep_evidence(ev: dict) -> policies.Evidence:
  """A group's arrays (:func:`group_evidence`) as the :class:`~kvjax.policies.Evidence` a policy
  or an allocator reads: the future mass as one future row (the oracle's), a fixed PRNG key."""
  return policies.Evidence(
    attn_window_LHWT=ev["attn"],
    column_sums_LHT=ev.get("column_sums"),
    future_attn_LHST=ev["mass"][:, :, None, :],
    head_scores_LH=ev.get("head_scores"),
    keys_LGTD=ev.get("keys"),
    values_LGTD=ev.get("values"),
    rng=jax.random.key(0),
  )


# --------------------------------------------------------------------------- one group


def policy_scores(policy: policies.Policy, ev: dict) -> Array:
  """A built policy's scores ``[L, H, P]`` on a group's arrays (:func:`sweep_evidence`)."""
  return policy.scores(sweep_evidence(ev))


def _policy_scores(key: GroupKey, ev: dict, data: dict | None) -> Array:
  """Scores over the ``P`` prompt positions. Budget-free, so computed once per group under
  ``vmap``, except for a policy with data-valued options (StreamingLLM's sink count), whose
  options come from the configuration ``data``."""
  return policy_scores(sweep_policy(key, data), ev)


# The allocators the engine computes by its own fast paths (CAKE from the world's shared
# statistics, Ada-KV from the score set's pooled table, the others in closed form); any other
# allocator, a user's or a subclass of these (which may override __call__), is called through
# the Allocator protocol.
FAST_SCHEDULES = (policies.Uniform, policies.Pyramid, policies.CakeLayers)
FAST_HEAD_ALLOCS = (policies.Uniform, policies.AdaKV, policies.HeadKV)


def fast(allocator: policies.Allocator, cls: type) -> bool:
  """Whether the engine's fast path for ``cls`` computes ``allocator``: exactly that class."""
  return type(allocator) is cls


def generic(key: GroupKey) -> bool:
  """Whether a group calls an allocator through the protocol (no fast path for it)."""
  layers, heads = allocators(key)
  return type(layers) not in FAST_SCHEDULES or type(heads) not in FAST_HEAD_ALLOCS


def cake_rows(key: GroupKey, attn_LHWP: Array) -> int:
  """The window rows CAKE's layer preference is measured on (:class:`kvjax.policies.CakeLayers`'
  rule): the protected window's, or every observation row for a policy that protects none."""
  return allocation_window(key) or attn_LHWP.shape[2]


def _allocated(allocator: policies.Allocator, ev: dict, scores_LHP, budget, key, dims) -> Array:
  """``allocator(evidence, scores, budget, window)`` as an int32 ``budget_LH`` (the slow path:
  any allocator, as :class:`kvjax.policies.Layered` composes them)."""
  L, H = dims.num_layers, dims.num_heads
  out = allocator(sweep_evidence(ev), scores_LHP, budget, allocation_window(key))
  try:
    return policies.as_budget_LH(out, L, H)
  except ValueError as e:
    raise ValueError(f"allocator: {type(allocator).__name__} returned no budget_LH: {e}") from e


def _allocate(key: GroupKey, d: dict, shared: dict, dims, layer_cap: int) -> Array:
  """``budget_LH`` of one configuration: the fast path of each allocator that has one (CAKE from
  the world's shared statistics, Ada-KV from the score set's pooled table), the protocol for any
  other: the schedule's first column is each layer's budget, which the head allocation splits
  (an allocator that takes a scalar budget only, as HeadKV, allocates across layers itself)."""
  L, H, P = dims.num_layers, dims.num_heads, dims.prompt_len
  b = d["budget"]
  layers, heads = allocators(key, d)
  if fast(heads, policies.HeadKV):  # across layers and heads at once
    return budgets_lib.headkv(
      shared["head_scores"],
      b,
      allocation_window(key),
      beta=heads.beta,
      temp=heads.temp,
      mode=heads.headkv_mode,
      q_len=P,
    )
  if heads.max_budget_ndim == 0 and type(heads) not in FAST_HEAD_ALLOCS:
    return _allocated(heads, shared["ev"], shared["scores"], b, key, dims)
  if fast(layers, policies.Uniform):
    budget_L = jnp.full((L,), b, jnp.int32)
  elif fast(layers, policies.Pyramid):
    budget_L = budgets_lib.pyramid(
      L, b, allocation_window(key), P, beta=layers.beta, mode=layers.pyramid_mode
    )
  elif fast(layers, policies.CakeLayers):
    budget_L = budgets_lib.cake_from_statistics(
      shared["cake_stats"], b, allocation_window(key), P, layers.tau1, layers.tau2
    )
  else:
    budget_L = _allocated(layers, shared["ev"], shared["scores"], b, key, dims)[:, 0]
  if fast(heads, policies.Uniform):
    return budgets_lib.per_head(budget_L, H)
  if fast(heads, policies.AdaKV):
    return budgets_lib.adakv(
      shared["scores"],
      budget_L,
      allocation_window(key),
      floor_alpha=heads.floor_alpha,
      normalize=heads.normalize,
      mode=heads.adakv_mode,
      capacity=layer_cap,
      table=shared["adakv_table"],
    )
  return _allocated(heads, shared["ev"], shared["scores"], budget_L, key, dims)


def _cumsum(x: Array, block: int = 32) -> Array:
  """``jnp.cumsum(x, -1)`` as running sums within blocks of ``block`` (unrolled adds, which
  XLA:CPU vectorises across rows) plus each block's offset: half ``jnp.cumsum``'s time on
  [32, 32, 1536] here. The additions run in another order (same sums within float rounding)."""
  n = x.shape[-1]
  pad = -n % block
  y = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(x.shape[:-1] + (-1, block))
  running = [y[..., 0]]
  for i in range(1, block):
    running.append(running[-1] + y[..., i])
  inner = jnp.stack(running, -1)
  totals = inner[..., -1]
  offsets = jnp.cumsum(totals, -1) - totals
  return (inner + offsets[..., None]).reshape(x.shape[:-1] + (n + pad,))[..., :n]


def _prefix(values_LHC: Array) -> Array:
  zeros = jnp.zeros(values_LHC.shape[:-1] + (1,), values_LHC.dtype)
  return jnp.concatenate([zeros, _cumsum(values_LHC)], -1)


def policy_prefixes(ev: dict, order_LHD: Array, order_cap: int) -> dict:
  """Prefix sums of the future mass and of the fact indicator along a policy's order (the first
  ``order_cap`` of ``order_LHD``, each head's positions best first), and their totals: what
  every budget of a score set reads."""
  idx = order_LHD[..., :order_cap]
  m = ev["mass"]
  fact = jnp.broadcast_to(ev["fact"].astype(jnp.float32), m.shape)
  return {
    "mass_prefix": _prefix(jnp.take_along_axis(m, idx, -1)),
    "fact_prefix": _prefix(jnp.take_along_axis(fact, idx, -1)),
    "mass_total": m.sum(-1),
    "fact_total": jnp.broadcast_to(ev["fact"].astype(jnp.float32).sum(), m.shape[:-1]),
  }


def oracle_prefix(mass_LHP: Array, order_cap: int) -> Array:
  """The oracle's prefix sums: each head's ``order_cap`` largest masses, largest first."""
  return _prefix(select.descending_values(mass_LHP, order_cap))


def descending_mass(mass_LHP: Array) -> Array:
  """Each head's future masses, all ``P`` of them, largest first: the oracle's order, which
  depends on the world alone (an engine sorts it once per world, one sort per layer: see
  :func:`kvjax.select.descending_order_by_layer`). A prefix of it is :func:`kvjax.select.descending_values`
  at any depth past ``P / 8`` (the same sort), and holds the same values as its ``top_k`` below, so
  :func:`oracle_prefix_from` equals :func:`oracle_prefix`."""
  P = mass_LHP.shape[-1]
  return jnp.concatenate(
    [select.descending_values(m, P) for m in jnp.split(mass_LHP, len(mass_LHP))]
  )


def oracle_prefix_from(descending_LHP: Array, order_cap: int) -> Array:
  """:func:`oracle_prefix` from the world's :func:`descending_mass`."""
  return _prefix(descending_LHP[..., :order_cap])


def layer_capacity(key: GroupKey, max_budget: int, prompt_len: int) -> int:
  """Static bound on any layer's per-head budget before head allocation: PyramidKV's bottom
  layer gets up to ``2 (B - w) + w``; CAKE, HeadKV and any allocator without a fast path can
  give a layer the whole prompt."""
  layers, heads = allocators(key)
  if not (fast(heads, policies.Uniform) or fast(heads, policies.AdaKV)):  # across layers too
    return prompt_len
  cap = prompt_len
  if fast(layers, policies.Uniform):
    cap = max_budget
  elif fast(layers, policies.Pyramid):
    cap = 2 * max_budget + 1
  return min(cap, prompt_len)


def round_capacity(max_budget: int, prompt_len: int, quantum: int = 256) -> int:
  """The sort depth for budgets up to ``max_budget``: rounded up (with slack) so a handful of
  static shapes serve every sweep, and never beyond the prompt."""
  return min(prompt_len, -(-(max_budget + 1) // quantum) * quantum)


@dataclasses.dataclass(frozen=True)
class GroupFunctions:
  """The pure functions of one static structure (see :func:`make_group`)."""

  prepare: Callable  # evidence -> allocation state (scores, Ada-KV table, CAKE statistics, ...)
  allocate: Callable  # (state, data) -> budget_LH
  order: Callable  # (evidence, scores, order_cap) -> prefix sums in this policy's order
  metrics: Callable  # (state, ordered, data, order_cap) -> metrics


def make_group(
  key: GroupKey, dims: synthetic.Dims, max_budget: int, bytes_per_value: int
) -> GroupFunctions:
  """A group's functions. Everything budget-free (scores, Ada-KV's pooled count table, CAKE's
  statistics, the sort and its prefix sums) is computed once; a configuration is an allocation
  and a few gathers. Evidence is an argument, never a closure, so XLA does not constant-fold the
  sort. StreamingLLM's scores depend on its (data) sink count, so it sorts per configuration.
  """
  P = dims.prompt_len
  layer_cap = layer_capacity(key, max_budget, P)
  per_config_scores = bool(sweep_policy(key).data_options)
  layers, heads = allocators(key)
  cake = fast(layers, policies.CakeLayers)  # shares the world's CAKE statistics
  adakv = fast(heads, policies.AdaKV)  # shares the score set's pooled table
  protocol = generic(key)  # an allocator called through the protocol (it may read the scores)
  window = allocation_window(key)

  def prepare(
    ev: dict,
    scores_LHP: Array | None = None,
    adakv_table: Array | None = None,
    cake_stats: tuple | None = None,
  ) -> dict:
    """The group's budget-free state. ``scores_LHP`` (:func:`group_scores`) and Ada-KV's
    ``adakv_table`` of them (for a layer capacity of at least this group's: a deeper table
    answers every pooled budget the same) may be shared by the groups that score alike, and
    CAKE's ``cake_stats`` (:func:`kvjax.budgets.cake_statistics` of the window rows) by every
    CAKE group of a scenario; each is computed here when not given. With all of them given
    this only assembles a dict (no array work): the engine calls it unjitted, since a jitted
    call would copy the evidence it passes through (512 MiB of window rows at L=H=32,
    P=8192)."""
    if cake and cake_stats is None:
      cake_stats = budgets_lib.cake_statistics(ev["attn"], cake_rows(key, ev["attn"]))
    state = {
      "ev": ev,
      "head_scores": ev.get("head_scores"),
      "cake_stats": cake_stats if cake else None,
      "scores": None,
      "adakv_table": None,
    }
    if not per_config_scores:
      state["scores"] = _policy_scores(key, ev, None) if scores_LHP is None else scores_LHP
      if adakv and adakv_table is None:
        adakv_table = budgets_lib.adakv_table(state["scores"], window, layer_cap)
      state["adakv_table"] = adakv_table if adakv else None
    return state

  def scores_of(state, d):
    if per_config_scores:
      return _policy_scores(key, state["ev"], d)
    return state["scores"]

  def allocate(state: dict, d: dict) -> Array:
    if per_config_scores and adakv:
      scores = scores_of(state, d)
      state = dict(
        state, scores=scores, adakv_table=budgets_lib.adakv_table(scores, window, layer_cap)
      )
    elif per_config_scores and protocol:
      state = dict(state, scores=scores_of(state, d))
    return _allocate(key, d, state, dims, layer_cap)

  def order(ev: dict, scores_LHP, order_cap: int) -> dict:
    idx = select.descending_order(scores_LHP, order_cap)
    prefixes = policy_prefixes(ev, idx, order_cap)
    return prefixes | {"oracle_prefix": oracle_prefix(ev["mass"], order_cap)}

  def metrics(state: dict, ordered: dict, d: dict, order_cap: int) -> dict:
    if per_config_scores:
      ordered = order(state["ev"], scores_of(state, d), order_cap)
    budget_LH = allocate(state, d)
    n = jnp.minimum(budget_LH, order_cap)[..., None]
    full = budget_LH >= P  # the no-compression guard: everything stays

    def at(prefix, total):
      return jnp.where(full, total, jnp.take_along_axis(prefix, n, -1)[..., 0])

    retained = at(ordered["mass_prefix"], ordered["mass_total"])
    oracle = at(ordered["oracle_prefix"], ordered["mass_total"])
    hits = at(ordered["fact_prefix"], ordered["fact_total"])
    tokens = jnp.minimum(budget_LH, P).sum()
    return {
      "retained_mass": retained.mean(),
      "oracle_mass": oracle.mean(),
      "oracle_gap": (oracle - retained).mean(),
      "fact_recall": hits.sum() / jnp.maximum(ordered["fact_total"].sum(), 1.0),
      "cache_tokens": tokens,
      "cache_bytes": tokens * 2 * dims.head_dim * bytes_per_value,
      "budget_L": budget_LH.mean(-1),
      # a budget past the sort depth would be silently clamped: the engine checks this flag
      "overflow": jnp.any(((budget_LH > order_cap) & ~full) | (budget_LH < 0)),
      # a row below the policy's protected window (the engine refuses it, as a policy does)
      "below_window": jnp.any(budget_LH < window),
    }

  return GroupFunctions(prepare, allocate, order, metrics)


def single_config_fn(
  key: GroupKey, dims: synthetic.Dims, max_budget: int, bytes_per_value: int = 2
):
  """One configuration end to end, ``(evidence, data) -> metrics``, sorting the whole prompt
  (the loop baseline and the reference the vmapped sweep is tested against)."""
  fns = make_group(key, dims, max_budget, bytes_per_value)
  P = dims.prompt_len

  def single(ev, d):
    state = fns.prepare(ev)
    scores = state["scores"] if state["scores"] is not None else jnp.zeros(ev["mass"].shape)
    return fns.metrics(state, fns.order(ev, scores, P), d, P)

  return single


def stack_data(members: list[dict], size: int) -> dict:
  """The data axes of ``members`` as arrays of ``size`` rows (padded with the last member), what
  a group's vmapped functions take."""
  padded = members + [members[-1]] * (size - len(members))  # pad: one shape, one compile
  out = {}
  for f in DATA_FIELDS:
    dtype = np.int32 if f in ("budget", "sinks") else np.float32
    out[f] = np.asarray([c[f] for c in padded], dtype)
  return out


# --------------------------------------------------------------------------- shared work


def scores_key(key: GroupKey) -> tuple:
  """Groups that share scores (and so one sort): same world, scorer and scorer options."""
  return (key.scenario, key.policy, key.window, key.kernel, key.pool)


def group_scores(key: GroupKey, ev: dict) -> Array | None:
  """The budget-free scores ``[L, H, P]`` of a group's policy (``None`` when they depend on the
  configuration's data: StreamingLLM's sink count). Equal for every group of one
  :func:`scores_key`, so an engine computes them once per score set."""
  policy = sweep_policy(key)
  if policy.data_options:
    return None
  return policy_scores(policy, ev)


def scores_and_table(
  policy: policies.Policy, window: int, ev: dict, capacity: int, depth: int, order_depth: int
) -> tuple[Array, Array, Array, Array]:
  """A score set's scores (:func:`policy_scores` of its built ``policy``, which has no data
  options), each head's order of them ``order_depth`` deep, and
  :func:`kvjax.budgets.adakv_table_from_order` at ``depth`` for the protected ``window``:
  ``(scores, order, table, exact)`` in one program (the sort reads the scores as they are made):
  about a fifth less time than three calls at L=H=32, P=8192."""
  scores_LHP = policy_scores(policy, ev)
  order_LHN = select.descending_order_by_layer(scores_LHP, order_depth)
  table, exact = budgets_lib.adakv_table_from_order(scores_LHP, order_LHN, window, capacity, depth)
  return scores_LHP, order_LHN, table, exact


def sort_depth(depth: int, prompt_len: int) -> int:
  """The depth to sort to for the first ``depth`` of each head's order: past ``P / 8``
  :func:`kvjax.select.descending_order` sorts everything anyway, so keep all of it."""
  return prompt_len if 8 * depth > prompt_len else depth


def table_rows(capacity: int, window: int, num_heads: int, prompt_len: int) -> int | None:
  """The rows of Ada-KV's pooled table for budgets up to ``capacity`` (as
  :func:`kvjax.budgets.adakv_table` sizes it: at most the ``P - window`` selectable positions, at
  least 1), or ``None`` where its pooled ranks would not fit int32 (no table then, as there)."""
  cap = max(min(capacity, prompt_len - window), 1)
  return None if num_heads * (cap * num_heads + 1) >= select.INT32_LIMIT else cap


def table_depth(capacity: int, window: int, prompt_len: int) -> int:
  """The first pooled depth of :func:`kvjax.budgets.adakv_table_from_order` for a table of
  ``capacity`` rows: twice the capacity (a head may win more than its share; measured 1.6x at
  L=H=32, P=8192)."""
  return round_capacity(2 * capacity + window, prompt_len)
