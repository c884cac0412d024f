"""Budget sweeps from a declared grid: grouped by static structure, vmapped, sharded, resumable.

A sweep is a base configuration plus a grid; each configuration is a prefill-time selection of
the prompt of a synthetic world, judged by the attention generation will pay to the prompt
(``retained_mass``, ``oracle_gap``, ``fact_recall``, the cache's size: :data:`METRICS`). The
sweep is three modules, by role:

* :mod:`kvjax.lab.grid`: what a sweep is: its axes and their vocabularies (the ``policy`` axis
  names any registered policy the sweep can score, :func:`sweepable`; the ``schedule`` and
  ``head_alloc`` axes name :mod:`kvjax.policies` allocators, :data:`SCHEDULES`,
  :data:`HEAD_ALLOCS`, a user's after :func:`register_schedule` / :func:`register_head_alloc`),
  the grid's expansion, ``config_id`` and the validation of a configuration;
* :mod:`kvjax.lab.groups`: one group's pure functions: the world's evidence it reads (the lab's
  modelled keys and the world's values too, for the groups that read them), the allocation
  (fast paths, and the :class:`kvjax.policies.Allocator` protocol for any other allocator), the
  prefix sums and the metrics;
* this module: the :class:`Engine` that evaluates groups, the run directory (``results.csv``,
  resumable) and :func:`best_per_budget`. Its names, and the two others' public ones, are
  importable from here.

Every metric is a sum over kept positions, so each configuration is a gather into prefix sums of
one sort (``docs/concepts.md``, "compute shared work once"): scores, each head's sort and Ada-KV's pooled
table (built from that sort) are computed once per score set (the groups of one scenario,
scorer and scorer options share them); CAKE's statistics and the oracle's order depend on the
world alone and are computed once per world; budgets are data, and a group of thousands of
configurations is one ``jit(vmap(...))`` compile evaluated chunk by chunk (bounded memory). With
several devices the configuration axis is sharded over a ``Mesh`` with ``NamedSharding``; with
several processes (:mod:`kvjax.distributed`) that mesh spans every device of every process, each
chunk's rows are gathered, and process 0 alone writes the run directory. Results are appended to
``results.csv`` chunk by chunk; rerunning computes only the missing ``config_id``\\ s.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import pathlib
from collections.abc import Callable

import jax
import numpy as np
import pandas as pd
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from kvjax import budgets as budgets_lib
from kvjax import distributed, policies, rundir, select
from kvjax.lab.grid import (
  ALLOCATOR_AXES,
  ALLOCATOR_DATA_AXES,
  DATA_FIELDS,
  FIELDS,
  FLOAT_FIELDS,
  HEAD_ALLOCS,
  RATIO,
  SCHEDULES,
  STATIC_FIELDS,
  SWEEP_EVIDENCE,
  GroupKey,
  allocation_window,
  allocators,
  config_id,
  expand,
  group_key,
  register_head_alloc,
  register_schedule,
  resolve_ratios,
  sweep_policy,
  sweep_problem,
  sweepable,
  unregister_head_alloc,
  unregister_schedule,
  validate,
)
from kvjax.lab.groups import (
  FAST_HEAD_ALLOCS,
  FAST_SCHEDULES,
  METRICS,
  GroupFunctions,
  WorldEvidence,
  cake_rows,
  descending_mass,
  fast,
  group_evidence,
  group_scores,
  layer_capacity,
  make_group,
  oracle_prefix,
  oracle_prefix_from,
  policy_prefixes,
  policy_scores,
  round_capacity,
  scores_and_table,
  scores_key,
  single_config_fn,
  sort_depth,
  stack_data,
  sweep_evidence,
  table_depth,
  table_rows,
  world_evidence,
)

__all__ = [
  "ALLOCATOR_AXES",
  "ALLOCATOR_DATA_AXES",
  "BYTES_PER_VALUE",
  "COMPILATION_CACHE_ENV",
  "DATA_FIELDS",
  "FAST_HEAD_ALLOCS",
  "FAST_SCHEDULES",
  "FIELDS",
  "FLOAT_FIELDS",
  "HEAD_ALLOCS",
  "METRICS",
  "CONFIG_FIELDS",
  "RATIO",
  "RATIO_RESULT_COLUMNS",
  "RESULT_COLUMNS",
  "RESULT_DTYPE",
  "RESULT_NUMBERS",
  "RESULT_TEXT",
  "SCHEDULES",
  "STATIC_FIELDS",
  "SWEEP_EVIDENCE",
  "Engine",
  "GroupFunctions",
  "GroupKey",
  "ScoreSet",
  "WorldEvidence",
  "allocation_window",
  "allocators",
  "best_per_budget",
  "check_engine_options",
  "compilation_cache_dir",
  "config_id",
  "default_compilation_cache_dir",
  "cake_rows",
  "descending_mass",
  "enable_compilation_cache",
  "expand",
  "grid_signature",
  "group_key",
  "group_scores",
  "layer_capacity",
  "make_group",
  "oracle_prefix",
  "oracle_prefix_from",
  "policy_prefixes",
  "policy_scores",
  "prepare",
  "read_results",
  "register_head_alloc",
  "register_schedule",
  "resolve_ratios",
  "result_columns",
  "round_capacity",
  "run",
  "scores_and_table",
  "scores_key",
  "shared_identity",
  "single_config_fn",
  "sort_depth",
  "stack_data",
  "sweep_evidence",
  "sweep_policy",
  "sweep_problem",
  "sweepable",
  "table_depth",
  "table_rows",
  "unregister_head_alloc",
  "unregister_schedule",
  "validate",
  "world_evidence",
]

Array = jax.Array

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
  """``(configuration axis sharding, replicated sharding, devices)`` over every device, of every
  process in a multi-process run (``None`` shardings on one device)."""
  devices = jax.devices()
  if len(devices) == 1:
    return None, None, 1
  mesh = Mesh(np.asarray(devices), ("c",))
  return NamedSharding(mesh, PartitionSpec("c")), NamedSharding(mesh, PartitionSpec()), len(devices)


@dataclasses.dataclass
class ScoreSet:
  """What the groups of one :func:`scores_key` share: their scores ``[L, H, P]`` and each
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
  computed on first use and kept for the engine's life: every sweep of that world shares it. A
  group's names (policy, schedule, head allocation) are resolved when it first compiles:
  register a user's pieces before the engine evaluates them (:func:`run` builds a new engine).
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
    # keyed by the built policy (a frozen, hashable object), not its name: a name registered
    # again for another policy compiles anew (jit shares its traces across engines)
    self._scores = jax.jit(policy_scores, static_argnums=0)
    self._scores_and_table = jax.jit(scores_and_table, static_argnums=(0, 1, 3, 4, 5))
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
    """The arrays a group reads (:func:`~kvjax.lab.groups.group_evidence`: H2O column sums,
    HeadKV head scores, modelled keys and values only when its policy or allocators read them).
    On several devices they are placed once on every device (replicated) and reused by every
    group and chunk, so no call copies the shared state again."""
    arrays = group_evidence(self.world_evidence(key.scenario), key)
    if self.replicated is None:
      return arrays
    for name, a in arrays.items():
      if (key.scenario, name) not in self._placed:
        self._placed[(key.scenario, name)] = distributed.put(a, self.replicated)
    return {name: self._placed[(key.scenario, name)] for name in arrays}

  def cake_statistics(self, key: GroupKey) -> tuple[Array, Array]:
    """CAKE's statistics of the world's window rows (:func:`kvjax.budgets.cake_statistics`):
    budget-free and policy-free, so computed once per world and window, for every sweep."""
    attn = self.evidence(key)["attn"]
    rows = cake_rows(key, attn)
    name = (key.scenario, "cake_statistics", rows)
    if name not in self._world_state:
      self._world_state[name] = self._cake_statistics(attn, rows)
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
    """The group's budget-free scores (:func:`group_scores`; ``None`` for a policy with data
    options), compiled once per policy."""
    policy = sweep_policy(key)
    if policy.data_options:
      return None
    return self._scores(policy, self.evidence(key))

  def score_set(
    self, key: GroupKey, table_capacity: int | None = None
  ) -> tuple[ScoreSet, Array | None]:
    """The group's :class:`ScoreSet` and, for a ``table_capacity``, Ada-KV's pooled table of its
    scores (:meth:`pooled_table`; ``None`` without). The scores, each head's order and the
    table's first try are one program (:func:`scores_and_table`)."""
    dims = self.world_evidence(key.scenario).world.dims
    H, P = dims.num_heads, dims.prompt_len
    cap = (
      None if table_capacity is None else table_rows(table_capacity, allocation_window(key), H, P)
    )
    if cap is None:
      return ScoreSet(self.scores(key)), None
    depth = table_depth(cap, allocation_window(key), P)
    scores, order, table, exact = self._scores_and_table(
      sweep_policy(key),
      allocation_window(key),
      self.evidence(key),
      cap,
      depth,
      sort_depth(depth, P),
    )
    shared = ScoreSet(scores, order)
    if bool(exact):
      return shared, table
    return shared, self.pooled_table(shared, allocation_window(key), cap, min(P, 2 * depth))

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
      yield chunk, distributed.put(stack_data(chunk, size), self.sharding)

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
      if fast(allocators(key)[1], policies.AdaKV) and not sweep_policy(key).data_options:
        P = self.world_evidence(key.scenario).world.dims.prompt_len
        cap = layer_capacity(key, self.capacity, P)
        table_cap[scores_key(key)] = max(table_cap.get(scores_key(key), 0), cap)
    chunks, tops = {}, {}
    for key, members in groups.items():  # pass 1: allocations only
      fns = self.group_fns(key)
      ev = self.evidence(key)
      skey = scores_key(key)
      if skey not in sets:  # one scoring (and Ada-KV table) per score set, shared
        sets[skey], tables[skey] = self.score_set(key, table_cap.get(skey))
      layers, heads = allocators(key)
      table = tables.get(skey) if fast(heads, policies.AdaKV) else None
      stats = self.cake_statistics(key) if fast(layers, policies.CakeLayers) else None
      states[key] = fns["prepare"](ev, sets[skey].scores, table, stats)
      chunks[key] = list(self._chunks(members))  # stacked once for both passes
      for _, data in chunks[key]:  # dispatched now, read once every group is dispatched
        tops.setdefault(skey, []).append(fns["max_budget"](states[key], data))
    del tables
    tops = distributed.to_host(tops, "gathering the largest budgets")
    deepest = {skey: max(int(t.max()) for t in ts) for skey, ts in tops.items()}
    ordered_cache, oracle = {}, {}
    last = {scores_key(key): key for key in groups}  # each score set's last group
    pending = None  # the chunk dispatched last: its rows are built while the next one runs
    for key in groups:  # pass 2: one sort per score set, then gathers
      fns = self.group_fns(key)
      P = self.world_evidence(key.scenario).world.dims.prompt_len
      skey = scores_key(key)
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
    out = distributed.to_host(out, f"gathering the rows of group {key}")
    if np.any(out["overflow"][: len(chunk)]):
      raise RuntimeError(f"sweep: a budget exceeded the sort depth {cap} in group {key}")
    below = np.flatnonzero(out["below_window"][: len(chunk)])
    if below.size:  # the rule policies.Policy.check_allocation applies to every allocator
      cfg = chunk[int(below[0])]
      raise ValueError(
        f"{cfg['schedule']}/{cfg['head_alloc']}: the allocation of budget {cfg['budget']} gives "
        f"a row fewer slots than the protected window of {allocation_window(key)} of policy "
        f"{key.policy!r}; expected every row's budget >= the window"
      )
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
      if cfg.get(RATIO) is not None:  # a ratio sweep's rows say the ratio beside its budget
        row[RATIO] = cfg[RATIO]
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
# the header of results.csv, in the order Engine rows are written; a sweep over a ratio axis adds
# each configuration's ratio
RESULT_COLUMNS = ("config_id", *FIELDS, *METRICS, "budget_profile")
RATIO_RESULT_COLUMNS = (*RESULT_COLUMNS, RATIO)
# what a sweep config must hold (a config file's field left out is named, not an AttributeError)
CONFIG_FIELDS = ("base", "grid", "world", "chunk_size", "bytes_per_value")


def result_columns(configs: list[dict]) -> tuple[str, ...]:
  """The header of a sweep's ``results.csv``: :data:`RATIO_RESULT_COLUMNS` when its
  configurations sweep ratios, else :data:`RESULT_COLUMNS`.

  Args:
    configs: the sweep's configurations.

  Returns:
    The column names.
  """
  return RATIO_RESULT_COLUMNS if any(c.get(RATIO) is not None for c in configs) else RESULT_COLUMNS


def _columns_on_disk(path: pathlib.Path) -> tuple[str, ...]:
  """The header a results file holds (a ratio sweep's has a ``ratio`` column)."""
  try:
    with pathlib.Path(path).open(errors="replace") as f:
      header = f.readline()
  except (FileNotFoundError, IsADirectoryError):
    return RESULT_COLUMNS
  fields = next(csv.reader([header.rstrip("\r\n")]), [])
  return RATIO_RESULT_COLUMNS if RATIO in fields else RESULT_COLUMNS


def read_results(path: str | pathlib.Path) -> pd.DataFrame:
  """The complete rows of a sweep's ``results.csv`` (``config_id`` kept as text): rows cut by an
  interruption, with a missing or non-finite metric, repeated headers and repeated
  configurations are left out (:func:`kvjax.rundir.read_rows`). A ratio sweep's rows have a
  ``ratio`` column."""
  return rundir.read_rows(
    path,
    dtype=RESULT_DTYPE,
    required=RESULT_TEXT,
    numeric=RESULT_NUMBERS,
    key="config_id",
    columns=_columns_on_disk(path),
  )


def prepare(config) -> tuple[list[dict], Engine]:
  """Validates the whole sweep ``config`` (its options, grid and every configuration against the
  world) and returns ``(configs, engine)``; nothing is written anywhere."""
  rundir.require_fields(config, CONFIG_FIELDS, "configs/sweep_lab.py")
  check_engine_options(
    capacity=1, chunk_size=config.chunk_size, bytes_per_value=config.bytes_per_value
  )
  compilation_cache_dir(config.get("compilation_cache", None))  # validates the setting
  configs = expand(config.grid, config.base)
  for cfg in configs:
    validate(cfg, None)
  configs = resolve_ratios(configs, config.world)  # a ratio axis: each budget from its prompt
  first: dict[str, dict] = {}
  for cfg in configs:
    twin = first.setdefault(config_id(cfg), cfg)
    if twin is not cfg:
      raise ValueError(
        f"grid: the grid repeats the configuration {cfg} (config_id {config_id(cfg)}); "
        "expected each configuration once"
      )
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


def shared_identity(config) -> dict:
  """What every process of one sweep must hold alike (:func:`kvjax.distributed.check_same`):
  the fields of :func:`grid_signature` and ``chunk_size`` (it sets the gathers every process
  joins), with the code and the device count (:func:`kvjax.distributed.run_identity`). The
  workdir and the compilation cache may differ by host.

  Args:
    config: the sweep config.

  Returns:
    The identity.
  """
  fields = json.loads(grid_signature(config)) | {"chunk_size": config.chunk_size}
  return distributed.run_identity(fields, devices=jax.device_count())


def _claim_and_read(config, out: pathlib.Path, ids: list[str], log, columns) -> list[int]:
  """Process 0's part of a run's start, holding the lock: claims ``out``, repairs its
  ``results.csv`` (of ``columns``) and returns the indices (into ``ids``) of the configurations
  left to run."""
  path = out / "results.csv"
  # chunk_size and compilation_cache are outside the signature: they change no result. The
  # device count is recorded but outside the identity: a resume on another count is reported,
  # its rows may differ from the first run's in the last float32 digit
  devices = jax.device_count()
  before = rundir.read_claim(out / "sweep.json")
  text = rundir.signature(json.loads(grid_signature(config)) | {"devices": devices})
  has_results = rundir.holds_data(path)
  rundir.claim(out, "sweep.json", text, has_results=has_results, not_identity=("devices",))
  if has_results and before is not None and before.get("devices", devices) != devices:
    log(
      f"sweep: resuming a run of {before['devices']} devices on {devices}: the new rows may "
      "differ from the first run's in the last float32 digit (reductions split otherwise)"
    )
  (out / "config.json").write_text(config.to_json_best_effort(indent=2))
  table, dropped = rundir.repair_rows(
    path,
    dtype=RESULT_DTYPE,
    required=RESULT_TEXT,
    numeric=RESULT_NUMBERS,
    key="config_id",
    columns=columns,
  )
  if dropped:
    log(f"sweep: dropped {dropped} invalid or repeated lines of {path}")
  done = set(table.get("config_id", pd.Series(dtype=str)))
  todo = [i for i, cid in enumerate(ids) if cid not in done]
  log(
    f"sweep: {len(ids)} configurations, {len(ids) - len(todo)} already in {path}, {len(todo)} to run"
  )
  return todo


def _table_text(path: pathlib.Path) -> str:
  return read_results(path).to_csv(index=False)


def run(
  config, workdir, *, log=print, progress: bool = True, lock_timeout: float = 0.0
) -> pd.DataFrame:
  """Runs (or resumes) the sweep ``config`` into ``workdir``; returns the full results table.

  The whole configuration, and ``workdir`` (:func:`kvjax.rundir.check_workdir`: never empty),
  are validated before anything is written. The run holds the directory's lock
  (:func:`kvjax.rundir.lock`): a second run into the same ``workdir`` raises
  :class:`kvjax.rundir.WorkdirLockedError` after waiting up to ``lock_timeout`` seconds. The
  directory's ``sweep.json`` (:func:`grid_signature`) must match, and results without it are
  refused (:func:`kvjax.rundir.claim`); it records the device count too, outside the identity:
  a resume on another count is logged (its rows may differ in the last float32 digit). On resume the invalid lines of ``results.csv`` (cut
  short, non-finite metrics, repeated headers or configurations) are removed and their
  configurations run again.

  In a run of several processes (:func:`kvjax.distributed.maybe_initialize`) every process calls
  this with the same arguments (checked first: a process holding another config, code or
  device count than process 0's stops every process with a ``ValueError`` naming the fields,
  :func:`shared_identity`): the configurations are sharded over the devices of every
  process, each chunk's rows are gathered, and process 0 alone touches ``workdir`` (lock, claim,
  rows); it reads what is done and tells the others what is left. The rows equal a one-process
  run's on the same number of devices, and every process returns the whole table. A process that
  dies makes the others raise :class:`kvjax.distributed.PeerFailedError` at their next gather;
  the rows written so far stay, and the same command resumes.
  """
  rundir.check_workdir(workdir)
  rundir.require_fields(config, CONFIG_FIELDS, "configs/sweep_lab.py")
  # every process the same config, code and devices, before any work (a process given another
  # grid would compute other rows, which process 0 would write under its own)
  distributed.check_same(shared_identity(config), "sweep")
  configs, engine = prepare(config)
  ids = [config_id(c) for c in configs]
  primary = distributed.is_primary()
  if not primary:  # one log, one progress bar: process 0's
    log, progress = (lambda *a, **k: None), False
  with contextlib.ExitStack() as stack:

    def start() -> list[int]:
      out = stack.enter_context(rundir.lock(workdir, timeout=lock_timeout))
      return _claim_and_read(config, out, ids, log, result_columns(configs))

    todo = [configs[i] for i in distributed.on_primary(start, "claiming the run directory")]
    path = pathlib.Path(workdir) / "results.csv"
    groups: dict[GroupKey, list[dict]] = {}
    for cfg in todo:
      groups.setdefault(group_key(cfg), []).append(cfg)
    with tqdm(total=len(todo), unit="cfg", disable=not progress, smoothing=0.1) as bar:
      for rows in engine.evaluate_groups(groups):
        _check_finite(rows)
        if primary:
          rundir.append_rows(path, rows)
        bar.update(len(rows))
        distributed.fault_point()
    if distributed.process_count() == 1:
      table = read_results(path)
    else:  # process 0's table, read under the lock, is every process's
      text = distributed.on_primary(lambda: _table_text(path), "reading results.csv")
      table = pd.read_csv(io.StringIO(text), dtype=RESULT_DTYPE)
  return table[table["config_id"].isin(set(ids))]


def best_per_budget(table: pd.DataFrame, metric: str = "retained_mass") -> pd.DataFrame:
  """The best realisable configuration at each budget (the oracle is the reference, not a
  candidate), with the oracle's mass at that configuration as ``oracle_gap``, and the ratio
  that set the budget in a ratio sweep."""
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
  if RATIO in table.columns:
    cols.insert(1, RATIO)
  return table.loc[idx, cols].reset_index(drop=True)
