"""Budget sweeps from a declared grid: grouped by static structure, vmapped, sharded, resumable.

A sweep is a base configuration plus a grid (``product`` axes crossed with ``zip`` axes, the
``get_hyper`` idea of big_vision without its internal module). Each configuration is a
*prefill-time* selection of the prompt of a synthetic world, judged by the attention the
generated tokens will actually pay to the prompt (the "one-shot" view: kvpress's optimal pruning
is its oracle):

* ``retained_mass``: ``sum_{i in S} m_i`` with ``m_i`` the mean over generation steps of the full
  attention on prompt position ``i`` (mean over layers and heads);
* ``oracle_mass`` / ``oracle_gap``: the best ``b`` positions of ``m`` at the same ``budget_LH``;
* ``fact_recall``: share of the fact tokens generation queries that stay cached;
* ``cache_tokens`` / ``cache_bytes``: the compressed cache (K and V, ``bytes_per_value`` each).

The policy axis names any registered policy whose scores the sweep's world can compute
(:func:`sweepable`: the evidence of :data:`SWEEP_EVIDENCE`, its budget taken as given), a
user's after :func:`kvjax.policies.register` included; the ``schedule`` and ``head_alloc`` axes
name :mod:`kvjax.policies` allocators (:data:`SCHEDULES`, :data:`HEAD_ALLOCS`,
:func:`allocators`), their numbers swept as data.

All three are sums over kept positions, so each configuration is a gather into prefix sums of
one sort (DESIGN.md, "compute shared work once"): scores, each head's sort and Ada-KV's pooled
table (built from that sort) are computed once per score set (the groups of one scenario,
scorer and scorer options share them); CAKE's statistics and the oracle's order depend on the
world alone and are computed once per world; budgets are data, and a group of thousands of
configurations is one
``jit(vmap(...))`` compile evaluated chunk by chunk (bounded memory). With several devices the
configuration axis is sharded over a ``Mesh`` with ``NamedSharding``. Results are appended to
``results.csv`` chunk by chunk; rerunning computes only the missing ``config_id``\\ s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from kvjax import budgets as budgets_lib
from kvjax import policies, rundir, select
from kvjax import scores as scores_lib
from kvjax.lab import synthetic

Array = jax.Array

STATIC_FIELDS = (
  "scenario",
  "policy",
  "schedule",
  "head_alloc",
  "pyramid_mode",
  "window",
  "kernel",
  "pool",
)
DATA_FIELDS = ("budget", "beta", "alpha", "head_beta", "sinks", "tau1", "tau2")
FIELDS = STATIC_FIELDS + DATA_FIELDS
FLOAT_FIELDS = ("beta", "alpha", "head_beta", "tau1", "tau2")
# What the sweep's world gives a scorer: the prompt's window rows, H2O's column sums, the
# future attention (the oracle's) and a PRNG key. Any policy that reads no more, takes its
# budget as given (the schedule and head_alloc axes allocate) and scores without it can be
# swept by name, a user's registered one included (sweepable).
SWEEP_EVIDENCE = frozenset({"attn_window_LHWT", "column_sums_LHT", "future_attn_LHST", "rng"})
# The config's schedule and head_alloc axes name kvjax.policies allocators (names only here, at
# the boundary): a layer schedule, then a head allocation of each layer's budget.
SCHEDULES = {"uniform": policies.Uniform, "pyramid": policies.Pyramid, "cake": policies.CakeLayers}
HEAD_ALLOCS = {"uniform": policies.Uniform, "adakv": policies.AdaKV, "headkv": policies.HeadKV}
# the data axes that set each allocator's swept numbers, {allocator field: axis}
ALLOCATOR_AXES = {
  policies.Pyramid: {"beta": "beta"},
  policies.CakeLayers: {"tau1": "tau1", "tau2": "tau2"},
  policies.AdaKV: {"floor_alpha": "alpha"},
  policies.HeadKV: {"beta": "head_beta"},
}
METRICS = (
  "retained_mass",
  "oracle_mass",
  "oracle_gap",
  "fact_recall",
  "cache_tokens",
  "cache_bytes",
)


# --------------------------------------------------------------------------- the grid


def _axis_values(name: str, values, base) -> tuple:
  if name not in FIELDS:
    raise ValueError(f"grid: unknown axis {name!r}; expected one of {FIELDS}")
  if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)):
    values = (values,)
  if not values:
    raise ValueError(f"grid: axis {name!r} has no values")
  expected = type(base[name])
  for v in values:
    ok = isinstance(v, expected) or (expected is float and isinstance(v, int))
    if not ok or isinstance(v, bool):
      raise ValueError(
        f"grid: axis {name!r} value {v!r} is a {type(v).__name__}, expected {expected.__name__}"
      )
  return tuple(values)


def expand(grid, base) -> list[dict]:
  """``product`` axes crossed with the ``zip`` axes (zipped together) over ``base``.

  ``grid.product`` and ``grid.zip`` map field names to tuples of values. Returns one resolved
  dict per configuration, in a deterministic order.
  """
  product = {k: _axis_values(k, v, base) for k, v in dict(grid.get("product", {})).items()}
  zipped = {k: _axis_values(k, v, base) for k, v in dict(grid.get("zip", {})).items()}
  both = set(product) & set(zipped)
  if both:
    raise ValueError(f"grid: axes {sorted(both)} appear in both product and zip")
  lengths = {len(v) for v in zipped.values()}
  if len(lengths) > 1:
    raise ValueError(f"grid: zip axes have different lengths {sorted(lengths)}")
  zip_rows = list(zip(*zipped.values(), strict=True)) if zipped else [()]
  configs = []
  for prod in itertools.product(*product.values()):
    for zrow in zip_rows:
      cfg = {k: base[k] for k in FIELDS}
      cfg.update(zip(product, prod, strict=True))
      cfg.update(zip(zipped, zrow, strict=True))
      configs.append(cfg)
  if not configs or (not product and not zipped):
    raise ValueError("grid: empty grid; declare at least one product or zip axis")
  return configs


def config_id(cfg: dict) -> str:
  """Stable hash of a configuration's swept fields (independent of dict order)."""
  # float fields hash as floats, so 20 and 20.0 are one configuration
  typed = {k: float(cfg[k]) if k in FLOAT_FIELDS else cfg[k] for k in FIELDS}
  canonical = json.dumps(typed, sort_keys=True)
  return hashlib.sha1(canonical.encode()).hexdigest()[:12]


def _registered(name: str) -> bool:
  try:
    policies.registry.factory(name)
  except ValueError:
    return False
  return True


def validate(cfg: dict, dims: synthetic.Dims | None) -> None:
  """Names the offending field of one configuration (sizes are checked when ``dims`` is given)."""
  checks = (
    ("scenario", cfg["scenario"] in synthetic.SCENARIOS, tuple(synthetic.SCENARIOS)),
    ("policy", _registered(cfg["policy"]), None),
    ("schedule", cfg["schedule"] in SCHEDULES, tuple(SCHEDULES)),
    ("head_alloc", cfg["head_alloc"] in HEAD_ALLOCS, tuple(HEAD_ALLOCS)),
    ("pyramid_mode", cfg["pyramid_mode"] in budgets_lib.PYRAMID_MODES, budgets_lib.PYRAMID_MODES),
    ("pool", cfg["pool"] in scores_lib.POOLS, scores_lib.POOLS),
  )
  for name, ok, choices in checks:
    if not ok:
      choices = sweepable() if choices is None else choices
      raise ValueError(f"{name}: unknown value {cfg[name]!r}; expected one of {choices}")
  scores_lib.check_kernel(cfg["kernel"])
  key = group_key(cfg)
  problem = sweep_problem(sweep_policy(key))
  if problem is not None:
    raise ValueError(
      f"policy: {cfg['policy']!r} cannot be swept: {problem}; expected one of {sweepable()}"
    )
  if dims is None:
    return
  if not 1 <= cfg["window"] <= dims.window:
    raise ValueError(
      f"window: {cfg['window']} outside 1..{dims.window} (the world's observation window)"
    )
  if not cfg["window"] < cfg["budget"] <= dims.prompt_len:
    raise ValueError(
      f"budget: {cfg['budget']} does not fit the world: expected window={cfg['window']} < "
      f"budget <= prompt_len={dims.prompt_len}"
    )
  data_checks = (
    ("beta", cfg["beta"] >= 1, "PyramidKV's beta >= 1"),
    ("alpha", 0 <= cfg["alpha"] <= 1, "Ada-KV's floor_alpha in [0, 1]"),
    ("head_beta", cfg["head_beta"] > 1, "HeadKV's beta > 1"),
    ("tau1", cfg["tau1"] > 0, "a positive CAKE temperature"),
    ("tau2", cfg["tau2"] > 0, "a positive CAKE temperature"),
    ("sinks", 0 <= cfg["sinks"] < cfg["budget"], "0 <= sinks < budget"),
  )
  for name, ok, expected in data_checks:
    if not ok:
      raise ValueError(f"{name}: {cfg[name]!r} is invalid; expected {expected}")
  layers, heads = allocators(key)
  if isinstance(layers, policies.CakeLayers) and cfg["window"] < 2:
    raise ValueError(
      f"window: CAKE's variance over window queries needs window >= 2, got {cfg['window']}"
    )
  if heads.max_budget_ndim == 0 and not isinstance(layers, policies.Uniform):
    raise ValueError(
      f"schedule: {type(heads).__name__} allocates across layers itself; got {cfg['schedule']!r}"
    )


# --------------------------------------------------------------------------- evidence


@dataclasses.dataclass
class WorldEvidence:
  """Everything a group needs from one scenario, computed once."""

  world: synthetic.World
  attn_window_LHWP: Array
  future_mass_LHP: Array
  fact_P: Array
  calibration_cfg: synthetic.WorldConfig | None = None  # HeadKV's calibration world (next seed)
  _column_sums: Array | None = None
  _head_scores: Array | None = None

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
  world = synthetic.make_world(cfg, values=False)  # the sweep's metrics never read values
  P = cfg.prompt_len
  m, facts = _future_mass(world)
  return WorldEvidence(
    world=world,
    attn_window_LHWP=_window_rows(world)[..., :P],
    future_mass_LHP=m,
    fact_P=facts,
    calibration_cfg=dataclasses.replace(cfg, seed=cfg.seed + 1),
  )


# --------------------------------------------------------------------------- one group


@dataclasses.dataclass(frozen=True)
class GroupKey:
  scenario: str
  policy: str
  schedule: str
  head_alloc: str
  pyramid_mode: str
  window: int
  kernel: int
  pool: str


def group_key(cfg: dict) -> GroupKey:
  return GroupKey(*(cfg[f] for f in STATIC_FIELDS))


def sweep_policy(key: GroupKey, data: dict | None = None) -> policies.Policy:
  """The group's policy: its name built with the static axes it takes (``window`` as its
  protected window, ``kernel``, ``pool``: :func:`kvjax.policies.accepted_options`) and, given a
  configuration's ``data``, its data options from it (StreamingLLM's sink count, traced)."""
  options = policies.accepted_options(
    key.policy, window=key.window, kernel=key.kernel, pool=key.pool
  )
  policy = policies.make(key.policy, **options)
  if data is None or not policy.data_options:
    return policy
  return policies.make(key.policy, **options, **{k: data[k] for k in policy.data_options})


def sweep_problem(policy: policies.Policy) -> str | None:
  """Why the sweep cannot score ``policy``, or ``None`` when it can (:func:`sweepable`)."""
  missing = sorted(policy.evidence_fields - SWEEP_EVIDENCE)
  if missing:
    fields = ", ".join(f"evidence.{f}" for f in missing)
    return f"it reads {fields}, which the sweep's world does not provide"
  if policy.allocates:
    return "it allocates its own budgets; sweep its scorer under the schedule and head_alloc axes"
  if policy.rescores:
    return "its selection scores depend on the budget"
  axes = [k for k in policy.data_options if k not in DATA_FIELDS]
  if axes:
    return f"its data options {axes} are not sweep axes (expected some of {DATA_FIELDS})"
  return None


def sweepable() -> tuple[str, ...]:
  """The registered names the sweep scores (with their defaults), a user's included."""
  out = []
  for name in policies.names():
    try:
      policy = policies.make(name)
    except (TypeError, ValueError):
      continue
    if sweep_problem(policy) is None:
      out.append(name)
  return tuple(out)


def _allocator(cls: type, key: GroupKey, data: dict | None) -> policies.Allocator:
  fields = {}
  if data is not None:
    fields = {f: data[axis] for f, axis in ALLOCATOR_AXES.get(cls, {}).items()}
  if issubclass(cls, policies.Pyramid):
    fields["pyramid_mode"] = key.pyramid_mode
  return cls(**fields)


def allocators(
  key: GroupKey, data: dict | None = None
) -> tuple[policies.Allocator, policies.Allocator]:
  """A configuration's ``(layer schedule, head allocation)`` as :mod:`kvjax.policies`
  allocators: ``Uniform``, ``Pyramid(beta, pyramid_mode)`` or ``CakeLayers(tau1, tau2)``, then
  ``Uniform``, ``AdaKV(floor_alpha)`` or ``HeadKV(beta)``. Their numbers come from the
  configuration's ``data`` (traced under ``vmap``); without it, their defaults (the group's
  static structure, what the engine dispatches on)."""
  return (
    _allocator(SCHEDULES[key.schedule], key, data),
    _allocator(HEAD_ALLOCS[key.head_alloc], key, data),
  )


def _policy_scores(key: GroupKey, ev: dict, data: dict | None) -> Array:
  """Scores over the ``P`` prompt positions. Budget-free, so computed once per group under
  ``vmap``, except for a policy with data-valued options (StreamingLLM's sink count), whose
  options come from the configuration ``data``."""
  evidence = policies.Evidence(
    attn_window_LHWT=ev["attn"],
    column_sums_LHT=ev.get("column_sums"),
    future_attn_LHST=ev["mass"][:, :, None, :],
    rng=jax.random.key(0),
  )
  return sweep_policy(key, data).scores(evidence)


def _allocate(key: GroupKey, d: dict, shared: dict, dims, layer_cap: int) -> Array:
  """``budget_LH`` of one configuration: the fast path of each allocator (CAKE from the world's
  shared statistics, Ada-KV from the score set's pooled table)."""
  L, H, P = dims.num_layers, dims.num_heads, dims.prompt_len
  b = d["budget"]
  layers, heads = allocators(key, d)
  if isinstance(heads, policies.HeadKV):  # across layers and heads at once
    return budgets_lib.headkv(
      shared["head_scores"],
      b,
      key.window,
      beta=heads.beta,
      temp=heads.temp,
      mode=heads.headkv_mode,
      q_len=P,
    )
  if isinstance(layers, policies.Uniform):
    budget_L = jnp.full((L,), b, jnp.int32)
  elif isinstance(layers, policies.Pyramid):
    budget_L = budgets_lib.pyramid(L, b, key.window, P, beta=layers.beta, mode=layers.pyramid_mode)
  elif isinstance(layers, policies.CakeLayers):
    budget_L = budgets_lib.cake_from_statistics(
      shared["cake_stats"], b, key.window, P, layers.tau1, layers.tau2
    )
  else:
    raise ValueError(f"schedule: the sweep has no layer schedule for {layers!r}")
  if isinstance(heads, policies.Uniform):
    return budgets_lib.per_head(budget_L, H)
  if isinstance(heads, policies.AdaKV):
    return budgets_lib.adakv(
      shared["scores"],
      budget_L,
      key.window,
      floor_alpha=heads.floor_alpha,
      normalize=heads.normalize,
      mode=heads.adakv_mode,
      capacity=layer_cap,
      table=shared["adakv_table"],
    )
  raise ValueError(f"head_alloc: the sweep has no head allocation for {heads!r}")


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
  layer gets up to ``2 (B - w) + w``; CAKE and HeadKV can give a layer the whole prompt."""
  layers, heads = allocators(key)
  if not isinstance(heads, (policies.Uniform, policies.AdaKV)):  # HeadKV: across layers too
    return prompt_len
  cap = prompt_len
  if isinstance(layers, policies.Uniform):
    cap = max_budget
  elif isinstance(layers, policies.Pyramid):
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
  cake = isinstance(layers, policies.CakeLayers)  # shares the world's CAKE statistics
  adakv = isinstance(heads, policies.AdaKV)  # shares the score set's pooled table

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
      cake_stats = budgets_lib.cake_statistics(ev["attn"], key.window)
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
        adakv_table = budgets_lib.adakv_table(state["scores"], key.window, layer_cap)
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
        state, scores=scores, adakv_table=budgets_lib.adakv_table(scores, key.window, layer_cap)
      )
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


# --------------------------------------------------------------------------- the engine


BYTES_PER_VALUE = (1, 2, 4)  # int8/fp8, bf16/fp16, fp32 caches
# the persistent compilation cache lives in kvjax.rundir (shared with the evaluation); these
# names stay importable from here
COMPILATION_CACHE_ENV = rundir.COMPILATION_CACHE_ENV
compilation_cache_dir = rundir.compilation_cache_dir
default_compilation_cache_dir = rundir.default_compilation_cache_dir
enable_compilation_cache = rundir.enable_compilation_cache


def check_engine_options(*, capacity, chunk_size, bytes_per_value) -> None:
  """Validates the engine's static options (before anything runs or is written)."""
  for name, value in (("capacity", capacity), ("chunk_size", chunk_size)):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value < 2**31:
      raise ValueError(f"{name}: expected an int in [1, 2**31), got {value!r}")
  if (
    isinstance(bytes_per_value, bool)
    or not isinstance(bytes_per_value, int | np.integer)
    or bytes_per_value not in BYTES_PER_VALUE
  ):
    raise ValueError(
      f"bytes_per_value: expected an int in {BYTES_PER_VALUE} (bytes per cached value), got "
      f"{bytes_per_value!r}"
    )


def _sharding():
  """``(configuration axis sharding, replicated sharding, devices)`` over every device (``None``
  shardings on one device)."""
  devices = jax.devices()
  if len(devices) == 1:
    return None, None, 1
  mesh = Mesh(np.asarray(devices), ("c",))
  return NamedSharding(mesh, PartitionSpec("c")), NamedSharding(mesh, PartitionSpec()), len(devices)


def stack_data(members: list[dict], size: int) -> dict:
  padded = members + [members[-1]] * (size - len(members))  # pad: one shape, one compile
  out = {}
  for f in DATA_FIELDS:
    dtype = np.int32 if f in ("budget", "sinks") else np.float32
    out[f] = np.asarray([c[f] for c in padded], dtype)
  return out


def _scores_key(key: GroupKey) -> tuple:
  """Groups that share scores (and so one sort): same world, scorer and scorer options."""
  return (key.scenario, key.policy, key.window, key.kernel, key.pool)


def group_scores(key: GroupKey, ev: dict) -> Array | None:
  """The budget-free scores ``[L, H, P]`` of a group's policy (``None`` when they depend on the
  configuration's data: StreamingLLM's sink count). Equal for every group of one
  :func:`_scores_key`, so an engine computes them once per score set."""
  if sweep_policy(key).data_options:
    return None
  return _policy_scores(key, ev, None)


def scores_and_table(
  key: GroupKey, ev: dict, capacity: int, depth: int, order_depth: int
) -> tuple[Array, Array, Array, Array]:
  """A score set's :func:`group_scores`, each head's order of them ``order_depth`` deep, and
  :func:`kvjax.budgets.adakv_table_from_order` at ``depth``: ``(scores, order, table, exact)``
  in one program (the sort reads the scores as they are made): about a fifth less time than
  three calls at L=H=32, P=8192."""
  scores_LHP = group_scores(key, ev)
  order_LHN = select.descending_order_by_layer(scores_LHP, order_depth)
  table, exact = budgets_lib.adakv_table_from_order(
    scores_LHP, order_LHN, key.window, capacity, depth
  )
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


@dataclasses.dataclass
class ScoreSet:
  """What the groups of one :func:`_scores_key` share: their scores ``[L, H, P]`` and each
  head's order of them (positions best first, as deep as some group needed so far)."""

  scores: Array | None
  order: Array | None = None


class Engine:
  """Evaluates configurations in two passes over their groups (one group = one static
  structure; scenarios share compiled code, their evidence being data):

  1. score each score set once (with Ada-KV groups, sort each head's scores and build the
     pooled table from that sort, as deep as the deepest group needs), then allocate every
     configuration (cheap, vmapped) to learn the largest per-head budget;
  2. sort each shared score set once, only as deep as that budget (or reuse the first pass's
     sort when it is deep enough), then evaluate every configuration chunk by chunk with one
     compiled ``jit(vmap)`` per group.

  What depends on the world alone (its evidence, CAKE's statistics, the oracle's order) is
  computed on first use and kept for the engine's life: every sweep of that world shares it.
  """

  def __init__(
    self,
    world_cfg,
    *,
    capacity: int,
    chunk_size: int = 256,
    bytes_per_value: int = 2,
    compilation_cache: str | None = None,
  ):
    check_engine_options(capacity=capacity, chunk_size=chunk_size, bytes_per_value=bytes_per_value)
    self.compilation_cache = enable_compilation_cache(compilation_cache)
    self.world_cfg = world_cfg
    self.capacity = capacity
    self.sharding, self.replicated, self.num_devices = _sharding()
    self.chunk_size = -(-chunk_size // self.num_devices) * self.num_devices
    self.bytes_per_value = bytes_per_value
    self._evidence: dict[str, WorldEvidence] = {}
    self._world_state: dict[tuple, object] = {}  # per world: CAKE statistics, the oracle's order
    self._placed: dict[tuple[str, str], Array] = {}  # replicated shared state (several devices)
    self.compiled: dict[GroupKey, dict[str, Callable]] = {}
    self._scores = jax.jit(group_scores, static_argnums=0)
    self._scores_and_table = jax.jit(scores_and_table, static_argnums=(0, 2, 3, 4))
    self._head_order = jax.jit(select.descending_order_by_layer, static_argnums=1)
    self._policy_prefixes = jax.jit(policy_prefixes, static_argnums=2)
    self._descending_mass = jax.jit(descending_mass)
    self._oracle_prefix = jax.jit(oracle_prefix_from, static_argnums=1)
    self._adakv_table = jax.jit(budgets_lib.adakv_table, static_argnums=(1, 2))
    self._adakv_table_from_order = jax.jit(
      budgets_lib.adakv_table_from_order, static_argnums=(2, 3, 4)
    )
    self._cake_statistics = jax.jit(budgets_lib.cake_statistics, static_argnums=1)

  def world_evidence(self, scenario: str) -> WorldEvidence:
    if scenario not in self._evidence:
      self._evidence[scenario] = world_evidence(scenario, self.world_cfg)
    return self._evidence[scenario]

  def evidence(self, key: GroupKey) -> dict:
    """The arrays a group reads (H2O column sums and HeadKV head scores only when needed). On
    several devices they are placed once on every device (replicated) and reused by every group
    and chunk, so no call copies the shared state again."""
    ev = self.world_evidence(key.scenario)
    arrays = {"attn": ev.attn_window_LHWP, "mass": ev.future_mass_LHP, "fact": ev.fact_P}
    if "column_sums_LHT" in sweep_policy(key).evidence_fields:
      arrays["column_sums"] = ev.column_sums_LHP
    if any("head_scores_LH" in a.needs for a in allocators(key)):
      arrays["head_scores"] = ev.head_scores_LH
    if self.replicated is None:
      return arrays
    for name, a in arrays.items():
      if (key.scenario, name) not in self._placed:
        self._placed[(key.scenario, name)] = jax.device_put(a, self.replicated)
    return {name: self._placed[(key.scenario, name)] for name in arrays}

  def cake_statistics(self, key: GroupKey) -> tuple[Array, Array]:
    """CAKE's statistics of the world's window rows (:func:`kvjax.budgets.cake_statistics`):
    budget-free and policy-free, so computed once per world and window, for every sweep."""
    name = (key.scenario, "cake_statistics", key.window)
    if name not in self._world_state:
      self._world_state[name] = self._cake_statistics(self.evidence(key)["attn"], key.window)
    return self._world_state[name]

  def descending_mass(self, key: GroupKey) -> Array:
    """The world's :func:`descending_mass` (the oracle's order), sorted once per world."""
    name = (key.scenario, "descending_mass")
    if name not in self._world_state:
      self._world_state[name] = self._descending_mass(self.evidence(key)["mass"])
    return self._world_state[name]

  def forget_world_state(self) -> None:
    """Drops the per-world state (CAKE's statistics, the oracle's order): the next sweep computes
    it again (what a sweep of a world not seen before pays; ``bench_sweep`` times it)."""
    self._world_state.clear()

  def scores(self, key: GroupKey) -> Array | None:
    """The group's budget-free scores (:func:`group_scores`), compiled once per structure."""
    return self._scores(dataclasses.replace(key, scenario=""), self.evidence(key))

  def score_set(
    self, key: GroupKey, table_capacity: int | None = None
  ) -> tuple[ScoreSet, Array | None]:
    """The group's :class:`ScoreSet` and, for a ``table_capacity``, Ada-KV's pooled table of its
    scores (:meth:`pooled_table`; ``None`` without). The scores, each head's order and the
    table's first try are one program (:func:`scores_and_table`)."""
    dims = self.world_evidence(key.scenario).world.dims
    H, P = dims.num_heads, dims.prompt_len
    cap = None if table_capacity is None else table_rows(table_capacity, key.window, H, P)
    if cap is None:
      return ScoreSet(self.scores(key)), None
    depth = table_depth(cap, key.window, P)
    structure = dataclasses.replace(key, scenario="")
    scores, order, table, exact = self._scores_and_table(
      structure, self.evidence(key), cap, depth, sort_depth(depth, P)
    )
    shared = ScoreSet(scores, order)
    if bool(exact):
      return shared, table
    return shared, self.pooled_table(shared, key.window, cap, min(P, 2 * depth))

  def group_fns(self, key: GroupKey) -> dict[str, Callable]:
    """Compiled functions of the group's static structure (each compiles once)."""
    structure = dataclasses.replace(key, scenario="")
    if structure not in self.compiled:
      dims = self.world_evidence(key.scenario).world.dims
      fns = make_group(structure, dims, self.capacity, self.bytes_per_value)
      self.compiled[structure] = {
        "fns": fns,
        "prepare": fns.prepare,  # assembles precomputed state: unjitted (see make_group)
        "max_budget": jax.jit(jax.vmap(fns.allocate, in_axes=(None, 0))),
        "metrics": jax.jit(jax.vmap(fns.metrics, in_axes=(None, None, 0, None)), static_argnums=3),
      }
    return self.compiled[structure]

  def chunk_shape(self, count: int) -> int:
    """The padded chunk size of a group of ``count`` configurations: ``chunk_size``, or for a
    smaller group the next power of two (a multiple of the device count), so that a group of
    167 in chunks of 1,000 computes 256 rows, not 1,000. Every chunk of a group has one shape
    (one compile per group), and a few sizes serve every sweep."""
    if count >= self.chunk_size:
      return self.chunk_size
    size = -(-(1 << (count - 1).bit_length()) // self.num_devices) * self.num_devices
    return min(self.chunk_size, size)

  def _chunks(self, members: list[dict]):
    size = self.chunk_shape(len(members))
    for start in range(0, len(members), self.chunk_size):
      chunk = members[start : start + self.chunk_size]
      data = stack_data(chunk, size)
      if self.sharding is not None:
        data = jax.device_put(data, self.sharding)
      yield chunk, data

  def pooled_table(
    self, shared: ScoreSet, window: int, capacity: int, depth: int | None = None
  ) -> Array | None:
    """Ada-KV's pooled table of a score set (:func:`kvjax.budgets.adakv_table_from_order`), from
    each head's order, which the score set keeps for its prefix sums. The pooled depth starts at
    :func:`table_depth` (or ``depth``) and doubles until the table is exact; past every depth,
    :func:`kvjax.budgets.adakv_table` pools everything."""
    L, H, P = shared.scores.shape
    cap = table_rows(capacity, window, H, P)
    if cap is None:
      return None
    depth = table_depth(cap, window, P) if depth is None else depth
    while True:
      if shared.order is None or shared.order.shape[-1] < depth:
        shared.order = self._head_order(shared.scores, sort_depth(depth, P))
      table, exact = self._adakv_table_from_order(shared.scores, shared.order, window, cap, depth)
      if bool(exact):
        return table
      if depth == P:  # a left-out window entry tied in (-inf or NaN scores): pool everything
        return self._adakv_table(shared.scores, window, capacity)
      depth = min(P, 2 * depth)

  def prefix_sums(self, key: GroupKey, shared: ScoreSet, cap: int, oracle: dict) -> dict:
    """The prefix sums a group's metrics read at sort depth ``cap``: the score set's, from the
    order it kept when deep enough (a prefix of a deeper order is the shallower order), and the
    oracle's, shared by every score set of the scenario."""
    if shared.order is None or shared.order.shape[-1] < cap:
      shared.order = self._head_order(shared.scores, cap)
    if (key.scenario, cap) not in oracle:
      oracle[(key.scenario, cap)] = self._oracle_prefix(self.descending_mass(key), cap)
    prefixes = self._policy_prefixes(self.evidence(key), shared.order, cap)
    return prefixes | {"oracle_prefix": oracle[(key.scenario, cap)]}

  def evaluate_groups(self, groups: dict[GroupKey, list[dict]]):
    """Yields ``(rows, n)`` per evaluated chunk for all ``groups`` (two passes, see above)."""
    states, sets, tables, table_cap = {}, {}, {}, {}
    for key in groups:  # the deepest Ada-KV table each score set needs
      if isinstance(allocators(key)[1], policies.AdaKV) and not sweep_policy(key).data_options:
        P = self.world_evidence(key.scenario).world.dims.prompt_len
        cap = layer_capacity(key, self.capacity, P)
        table_cap[_scores_key(key)] = max(table_cap.get(_scores_key(key), 0), cap)
    chunks, tops = {}, {}
    for key, members in groups.items():  # pass 1: allocations only
      fns = self.group_fns(key)
      ev = self.evidence(key)
      skey = _scores_key(key)
      if skey not in sets:  # one scoring (and Ada-KV table) per score set, shared
        sets[skey], tables[skey] = self.score_set(key, table_cap.get(skey))
      layers, heads = allocators(key)
      table = tables.get(skey) if isinstance(heads, policies.AdaKV) else None
      stats = self.cake_statistics(key) if isinstance(layers, policies.CakeLayers) else None
      states[key] = fns["prepare"](ev, sets[skey].scores, table, stats)
      chunks[key] = list(self._chunks(members))  # stacked once for both passes
      for _, data in chunks[key]:  # dispatched now, read once every group is dispatched
        tops.setdefault(skey, []).append(fns["max_budget"](states[key], data))
    del tables
    deepest = {skey: max(int(np.asarray(t).max()) for t in ts) for skey, ts in tops.items()}
    ordered_cache, oracle = {}, {}
    last = {_scores_key(key): key for key in groups}  # each score set's last group
    pending = None  # the chunk dispatched last: its rows are built while the next one runs
    for key in groups:  # pass 2: one sort per score set, then gathers
      fns = self.group_fns(key)
      P = self.world_evidence(key.scenario).world.dims.prompt_len
      skey = _scores_key(key)
      cap = round_capacity(deepest[skey], P)
      state = states.pop(key)
      ordered = None
      if state["scores"] is not None:
        if (skey, cap) not in ordered_cache:
          ordered_cache.clear()  # bounded memory: keep one score set's prefixes at a time
          ordered_cache[(skey, cap)] = self.prefix_sums(key, sets[skey], cap, oracle)
        ordered = ordered_cache[(skey, cap)]
      if last[skey] == key:
        del sets[skey]  # release the scores and their order (the prefixes hold what is read)
      for chunk, data in chunks.pop(key):
        out = fns["metrics"](state, ordered, data, cap)  # asynchronous: returns at once
        if pending is not None:
          yield self._finished(*pending)
        pending = (key, cap, chunk, out)
    if pending is not None:
      yield self._finished(*pending)

  def _finished(self, key: GroupKey, cap: int, chunk: list[dict], out: dict) -> list[dict]:
    """The rows of one evaluated chunk (waits for its metrics)."""
    out = jax.device_get(out)
    if np.any(out["overflow"][: len(chunk)]):
      raise RuntimeError(f"sweep: a budget exceeded the sort depth {cap} in group {key}")
    return self._rows(chunk, out)

  def evaluate(self, members: list[dict]):
    """Rows of one group's configurations, chunk by chunk."""
    yield from self.evaluate_groups({group_key(members[0]): members})

  @staticmethod
  def _rows(chunk: list[dict], out: dict) -> list[dict]:
    n = len(chunk)
    metrics = {k: np.asarray(out[k][:n], np.float64).tolist() for k in METRICS}  # one call each
    # rounded in float64, so that a profile reads 208.09, not float32's 208.08999633789062
    profiles = np.round(np.asarray(out["budget_L"][:n], np.float64), 2).tolist()
    rows = []
    for i, cfg in enumerate(chunk):
      row = {"config_id": config_id(cfg)} | {k: cfg[k] for k in FIELDS}
      row |= {k: metrics[k][i] for k in METRICS}
      row["budget_profile"] = json.dumps(profiles[i])
      rows.append(row)
    return rows


# --------------------------------------------------------------------------- results on disk


def grid_signature(config) -> str:
  """What identifies a sweep's results: its base, grid, world and byte size (not its workdir)."""
  return rundir.signature(
    {
      "base": config.base,
      "grid": config.grid,
      "world": config.world,
      "bytes_per_value": config.bytes_per_value,
    }
  )


RESULT_TEXT = ("config_id", *STATIC_FIELDS, "budget_profile")
RESULT_NUMBERS = (*DATA_FIELDS, "window", "kernel", *METRICS)
RESULT_DTYPE = {"config_id": str}


def read_results(path: str | pathlib.Path) -> pd.DataFrame:
  """The complete rows of a sweep's ``results.csv`` (``config_id`` kept as text): rows cut by an
  interruption, with a missing or non-finite metric, repeated headers and repeated
  configurations are left out (:func:`kvjax.rundir.read_rows`)."""
  return rundir.read_rows(
    path, dtype=RESULT_DTYPE, required=RESULT_TEXT, numeric=RESULT_NUMBERS, key="config_id"
  )


def prepare(config) -> tuple[list[dict], Engine]:
  """Validates the whole sweep ``config`` (its options, grid and every configuration against the
  world) and returns ``(configs, engine)``; nothing is written anywhere."""
  check_engine_options(
    capacity=1, chunk_size=config.chunk_size, bytes_per_value=config.bytes_per_value
  )
  compilation_cache_dir(config.get("compilation_cache", None))  # validates the setting
  configs = expand(config.grid, config.base)
  for cfg in configs:
    validate(cfg, None)
  ids = [config_id(c) for c in configs]
  if len(set(ids)) != len(ids):
    raise ValueError("grid: the grid repeats a configuration (duplicate config_id)")
  budgets = [c["budget"] for c in configs]
  if not all(0 < b < 2**31 for b in budgets):
    raise ValueError(f"budget: {budgets} outside [1, 2**31); expected int32 token counts")
  engine = Engine(
    config.world,
    capacity=max(budgets),
    chunk_size=config.chunk_size,
    bytes_per_value=config.bytes_per_value,
    compilation_cache=config.get("compilation_cache", None),
  )
  dims = engine.world_evidence(configs[0]["scenario"]).world.dims
  for cfg in configs:
    validate(cfg, dims)
  return configs, engine


def _check_finite(rows: list[dict]) -> None:
  for row in rows:
    bad = [k for k in METRICS if not np.isfinite(row[k])]
    if bad:
      raise RuntimeError(
        f"sweep: configuration {row['config_id']} gave non-finite {bad}: "
        f"{ {k: row[k] for k in bad} }; nothing of it was written"
      )


def run(
  config, workdir, *, log=print, progress: bool = True, lock_timeout: float = 0.0
) -> pd.DataFrame:
  """Runs (or resumes) the sweep ``config`` into ``workdir``; returns the full results table.

  The whole configuration is validated before anything is written. The run holds the
  directory's lock (:func:`kvjax.rundir.lock`): a second run into the same ``workdir`` raises
  :class:`kvjax.rundir.WorkdirLockedError` after waiting up to ``lock_timeout`` seconds. On
  resume the invalid lines of ``results.csv`` (cut short, non-finite metrics, repeated headers
  or configurations) are removed and their configurations run again.
  """
  configs, engine = prepare(config)
  ids = [config_id(c) for c in configs]
  with rundir.lock(workdir, timeout=lock_timeout) as out:
    rundir.claim(out, "sweep.json", grid_signature(config))
    (out / "config.json").write_text(config.to_json_best_effort(indent=2))
    path = out / "results.csv"
    table, dropped = rundir.repair_rows(
      path, dtype=RESULT_DTYPE, required=RESULT_TEXT, numeric=RESULT_NUMBERS, key="config_id"
    )
    if dropped:
      log(f"sweep: dropped {dropped} invalid or repeated lines of {path}")
    done = set(table.get("config_id", pd.Series(dtype=str)))
    todo = [c for c in configs if config_id(c) not in done]
    log(
      f"sweep: {len(configs)} configurations, {len(configs) - len(todo)} already in {path}, "
      f"{len(todo)} to run"
    )
    groups: dict[GroupKey, list[dict]] = {}
    for cfg in todo:
      groups.setdefault(group_key(cfg), []).append(cfg)
    with tqdm(total=len(todo), unit="cfg", disable=not progress, smoothing=0.1) as bar:
      for rows in engine.evaluate_groups(groups):
        _check_finite(rows)
        rundir.append_rows(path, rows)
        bar.update(len(rows))
    table = read_results(path)
  return table[table["config_id"].isin(set(ids))]


def best_per_budget(table: pd.DataFrame, metric: str = "retained_mass") -> pd.DataFrame:
  """The best realisable configuration at each budget (the oracle is the reference, not a
  candidate), with the oracle's mass at that configuration as ``oracle_gap``."""
  realisable = {name: not policies.make(name).reads_future for name in table["policy"].unique()}
  table = table[table["policy"].map(realisable).astype(bool)]
  if table.empty:
    return table
  idx = table.groupby("budget")[metric].idxmax()
  cols = [
    "budget",
    "policy",
    "schedule",
    "head_alloc",
    metric,
    "oracle_gap",
    "fact_recall",
    "cache_bytes",
  ]
  return table.loc[idx, cols].reset_index(drop=True)
