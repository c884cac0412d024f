"""The attention-policy lab: every policy on every scenario, a summary table and the figures.

:func:`run` is what ``experiments/lab.py`` calls; notebooks call it too. It returns the summary
as a ``pandas.DataFrame`` and writes ``summary.csv``, ``layers.csv`` and one PNG per scenario
(:func:`kvjax.plotting.lab_figure`) into the run directory. :func:`run_keys` is the
attention-free comparison (``configs/lab_keys.py``): knorm, KeyDiff and LagKV on the world's
modelled keys (:mod:`kvjax.lab.keys`) against attention-based policies.

A config names its policies (``config.policies``: registered names or
:class:`~kvjax.policies.Policy` objects) and gives options per name
(``config.policy_options``); :func:`build_policies` builds each once and every table labels it
by that name.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from concurrent import futures

import jax
import numpy as np
import pandas as pd

from kvjax import plotting, policies, rundir
from kvjax.lab import keys, metrics, online, synthetic

# the attention-row panel's policy when the config's ``figure_policy`` is "" and it runs (the
# essay's voter), else the first policy run
DEFAULT_FIGURE_POLICY = "snapkv"

# the metrics of a replay each table row holds (kvjax.lab.metrics.summarize), in column order
METRIC_COLUMNS = (
  "retained_mass",
  "oracle_gap",
  "output_error",
  "fact_recall",
  "budget_use",
  "oracle_mass",
)
SUMMARY_COLUMNS = ("scenario", "policy", "budget", *METRIC_COLUMNS)


def policy_label(policy: policies.Policy | str) -> str:
  """A config entry's name in the tables: the name itself, or an object's label."""
  return policy if isinstance(policy, str) else policy.label


def _options(config, name: str) -> dict:
  options = config.get("policy_options", None) or {}
  if name not in options:
    return {}
  entry = options[name]
  return entry.to_dict() if hasattr(entry, "to_dict") else dict(entry)


def build_policies(config) -> dict[str, policies.Policy]:
  """Each of ``config.policies`` built once (a name with its ``config.policy_options``, an
  object as it is), keyed by :func:`policy_label`. ``ValueError`` naming ``policies`` for an
  unknown name or one the lab cannot replay (:func:`kvjax.lab.online.can_replay`), naming
  ``policy_options`` for a bad option (those of policies not run are checked too)."""
  built = {}
  for name in config.get("policy_options", None) or {}:
    if name not in config.policies:  # unused here, but a typo should not pass silently
      try:
        policies.make(name, **_options(config, name))
      except ValueError as e:
        raise ValueError(f"policy_options: {name!r}: {e}") from None
  for entry in config.policies:
    label = policy_label(entry)
    if isinstance(entry, str):
      try:
        policies.registry.factory(entry)
      except ValueError:
        raise ValueError(
          f"policies: unknown lab policy {entry!r}; expected some of {online.replayable()}"
        ) from None
      try:
        policy = policies.make(entry, **_options(config, entry))
      except ValueError as e:
        raise ValueError(f"policy_options: {entry!r}: {e}") from None
    else:
      policy = policies.build(entry)
    problem = online.replay_problem(policy)
    if problem is not None:
      raise ValueError(
        f"policies: {label!r} is not a lab policy: {problem}; expected some of "
        f"{online.replayable()}"
      )
    built[label] = policy
  labels = [policy_label(entry) for entry in config.policies]
  repeated = sorted({label for label in labels if labels.count(label) > 1})
  if repeated:
    raise ValueError(f"policies: {repeated} appear more than once; expected distinct policies")
  return {label: built[label] for label in labels}


# what the lab's configs must hold (a field left out is named, not an AttributeError)
CONFIG_FIELDS = ("scenarios", "policies", "budget", "world", "figure_step", "figure_policy")
KEYS_CONFIG_FIELDS = (
  "scenarios",
  "policies",
  "budgets",
  "fact_distinctness",
  "key_model",
  "policy_options",
  "world",
)


def _distinct(name: str, values) -> None:
  """A repeated scenario, budget or value would run twice and break the tables' pivots."""
  values = list(values)
  repeated = sorted({repr(v) for v in values if values.count(v) > 1})
  if repeated:
    raise ValueError(
      f"{name}: {', '.join(repeated)} appear more than once; expected distinct values"
    )


def _check_names(config) -> dict[str, policies.Policy]:
  """Names the offending field for an unknown or repeated scenario or lab policy; the built
  policies."""
  _distinct("scenarios", config.scenarios)
  for s in config.scenarios:
    if s not in synthetic.SCENARIOS:
      raise ValueError(
        f"scenarios: unknown scenario {s!r}; expected some of {tuple(synthetic.SCENARIOS)}"
      )
  return build_policies(config)


def check_worlds(config) -> synthetic.WorldConfig:
  """Every scenario's world of ``config`` (:func:`kvjax.lab.synthetic.world_config`: the world
  settings, room for the scenario's facts and drift), checked before any world is made.

  Args:
    config: a lab config with ``scenarios`` (known ones) and ``world``.

  Returns:
    The first scenario's :class:`~kvjax.lab.synthetic.WorldConfig` (the sizes are shared).

  Raises:
    ValueError: naming the world field, or ``scenarios`` when there is none.
  """
  if not config.scenarios:
    raise ValueError("scenarios: expected at least one scenario")
  worlds = [synthetic.world_config(s, config.world) for s in config.scenarios]
  return worlds[0]


def validate_config(config) -> dict[str, policies.Policy]:
  """Names the offending field for an unknown scenario or policy, a bad policy option, bad world
  settings (:func:`check_worlds`), a budget or figure step that does not fit the world, or a
  field the config lacks (:data:`CONFIG_FIELDS`); returns the built policies
  (:func:`build_policies`). Nothing is computed or written before it passes."""
  rundir.require_fields(config, CONFIG_FIELDS, "configs/lab.py")
  built = _check_names(config)
  if not config.scenarios or not config.policies:
    raise ValueError("scenarios/policies: expected at least one of each")
  world = check_worlds(config)
  T = world.total_len
  budget = config.budget
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= T:
    raise ValueError(f"budget: {budget!r} does not fit the world (an int in 1..T={T})")
  step = config.figure_step
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step >= world.gen_steps:
    raise ValueError(
      f"figure_step: {step!r} is outside the {world.gen_steps} generation steps; expected an int "
      f"in [0, {world.gen_steps}) or -1 (the middle of the last fact's query window)"
    )
  if config.figure_policy and config.figure_policy not in built:
    raise ValueError(f"figure_policy: {config.figure_policy!r} is not among the policies run")
  return built


def pick_step(world: synthetic.World, requested: int) -> int:
  """The figure's step: ``requested`` if >= 0, else the middle of the last fact's query window."""
  S = world.dims.gen_steps
  if requested >= 0:
    if requested >= S:
      raise ValueError(f"figure_step: {requested} is outside the {S} generation steps")
    return requested
  active = np.flatnonzero(np.asarray(world.fact_active_FS).any(0))
  return int(active[len(active) // 2]) if active.size else S // 2


@dataclasses.dataclass
class ScenarioRun:
  """One scenario simulated under every policy: the world, the figure's step, per-policy
  ``(trace, summary)`` and the summary rows."""

  scenario: str
  world: synthetic.World
  step: int
  traces: dict
  rows: list[dict]


def default_workers() -> int:
  """Threads that replay policies at once: one per CPU core (each replay is one compiled program
  run on one core; XLA compiles and runs outside the GIL)."""
  return max(1, os.cpu_count() or 1)


def simulate_scenario(scenario: str, config, log=print, built=None) -> ScenarioRun:
  """All policies of ``config`` on one scenario (the figure's attention maps recorded);
  ``built``: :func:`build_policies` of ``config`` when the caller has them."""
  return simulate_scenarios(config, log, built, scenarios=(scenario,), workers=1)[scenario]


def simulate_scenarios(
  config, log=print, built=None, *, scenarios=None, workers: int | None = None
) -> dict[str, ScenarioRun]:
  """:func:`simulate_scenario` of every scenario, the policies replayed on ``workers`` threads.

  Args:
    config: the lab config (``configs/lab.py``).
    log: progress messages, one line per replay.
    built: :func:`build_policies` of ``config`` when the caller has them.
    scenarios: the scenarios to run (default ``config.scenarios``).
    workers: threads replaying policies at once (default :func:`default_workers`); each replay
      is the same :func:`kvjax.lab.online.simulate` call whatever the threads, so the results
      do not depend on them.

  Returns:
    Each scenario's :class:`ScenarioRun`, in the order of ``scenarios``; its traces and rows in
    the order of the policies.
  """
  built = build_policies(config) if built is None else built
  scenarios = tuple(config.scenarios if scenarios is None else scenarios)
  worlds = {s: synthetic.make_world(synthetic.world_config(s, config.world)) for s in scenarios}
  key = jax.random.key(config.world.seed)
  evidence = {s: online.prompt_evidence(world, key) for s, world in worlds.items()}

  def replay(name: str) -> dict:
    """One policy on every scenario: one compiled program per slot count."""
    out = {}
    for scenario, world in worlds.items():
      start = time.perf_counter()
      trace = online.simulate(
        world, built[name], config.budget, record_map=True, evidence=evidence[scenario]
      )
      out[scenario] = (trace, metrics.summarize(trace.metrics))
      log(
        f"  {scenario:15s} {name:16s} R={out[scenario][1]['retained_mass']:.3f} "
        f"({time.perf_counter() - start:.1f}s)"
      )
    return out

  # the allocating policies first: their slot count differs by scenario, so they compile most
  order = sorted(built, key=lambda name: not built[name].allocates)
  start = time.perf_counter()
  log(f"replaying {len(built)} policies x {len(worlds)} scenarios...")
  by_policy = dict(zip(order, map_threads(replay, order, workers), strict=True))
  log(f"replayed in {time.perf_counter() - start:.0f} s")
  runs = {}
  for scenario, world in worlds.items():
    traces = {name: by_policy[name][scenario] for name in built}
    rows = [
      dict(scenario=scenario, policy=name, budget=config.budget)
      | {k: summary[k] for k in METRIC_COLUMNS}
      | {"layer_retained": summary["retained_mass_L"].tolist()}
      for name, (_, summary) in traces.items()
    ]
    runs[scenario] = ScenarioRun(
      scenario, world, pick_step(world, config.figure_step), traces, rows
    )
  return runs


def map_threads(fn, items: list, workers: int | None = None) -> list:
  """``[fn(item) for item in items]`` on ``workers`` threads (default :func:`default_workers`);
  the first error is raised once the running calls end, and the calls not started are
  cancelled."""
  workers = min(len(items), default_workers() if workers is None else workers)
  if workers <= 1:
    return [fn(item) for item in items]
  with futures.ThreadPoolExecutor(workers) as pool:
    pending = [pool.submit(fn, item) for item in items]
    try:
      return [f.result() for f in pending]
    except BaseException:
      for f in pending:
        f.cancel()
      raise


def figure(sim: ScenarioRun, config, step: int | None = None):
  """The essay's four-panel figure of a simulated scenario (at ``step``, default the config's)."""
  focus = config.figure_policy or (
    DEFAULT_FIGURE_POLICY if DEFAULT_FIGURE_POLICY in sim.traces else next(iter(sim.traces))
  )
  step = sim.step if step is None else pick_step(sim.world, step)
  world = sim.world
  return plotting.lab_figure(
    sim.traces,
    step,
    focus,
    prompt_len=world.dims.prompt_len,
    facts_T=np.asarray(world.fact_mask_FT).any(0),
    active_T=np.asarray(synthetic.active_fact_positions(world, step)),
    row_LHT=np.asarray(synthetic.attention_row(world, world.dims.prompt_len + step)),
    title=sim.scenario,
  )


def retained_by_head(sim: ScenarioRun) -> pd.DataFrame:
  """Retained attention mass per (policy, layer, head), mean over generation steps."""
  rows = []
  for name, (trace, _) in sim.traces.items():
    retained_LH = np.asarray(trace.metrics.retained).mean(0)
    for (layer, head), v in np.ndenumerate(retained_LH):
      rows.append(dict(policy=name, layer=layer, head=head, retained_mass=float(v)))
  return pd.DataFrame(rows)


def summary_tables(rows: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
  """Summary rows -> ``(summary [SUMMARY_COLUMNS], per-layer retained mass)``."""
  table = pd.DataFrame(rows)
  layers = table[["scenario", "policy", "layer_retained"]].explode("layer_retained")
  layers["layer"] = layers.groupby(["scenario", "policy"]).cumcount()
  return table.drop(columns="layer_retained")[list(SUMMARY_COLUMNS)], layers


def run(config, workdir: str | pathlib.Path | None, log=print) -> pd.DataFrame:
  """Runs the lab described by ``config`` (``configs/lab.py``); returns the summary table.
  ``workdir``: where the tables and figures go (``None``: nowhere; never empty,
  :func:`kvjax.rundir.check_workdir`)."""
  return run_with_replays(config, workdir, log)[0]


def run_with_replays(
  config, workdir: str | pathlib.Path | None, log=print, *, workers: int | None = None
) -> tuple[pd.DataFrame, dict[str, ScenarioRun]]:
  """:func:`run`, also returning each scenario's replays (:func:`simulate_scenarios`, on
  ``workers`` threads), e.g. for :func:`kvjax.lab.explorer.explorer_data`."""
  built = validate_config(config)
  out = prepare_workdir(config, workdir)
  sims = simulate_scenarios(config, log, built, workers=workers)
  return write_run(config, out, sims, log), sims


def prepare_workdir(config, workdir: str | pathlib.Path | None) -> pathlib.Path | None:
  """Creates the run directory (refusing a bad one, :func:`kvjax.rundir.check_workdir`) and
  writes ``config.json`` into it; ``None`` for no directory."""
  if workdir is None:
    return None
  out = rundir.check_workdir(workdir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(config.to_json_best_effort(indent=2))
  return out


def write_run(config, out: pathlib.Path | None, sims: dict, log=print) -> pd.DataFrame:
  """The summary table of :func:`simulate_scenarios`' runs; with a directory ``out``, also its
  figures (one per scenario), ``summary.csv`` and ``layers.csv``."""
  if out is not None:
    start = time.perf_counter()
    for scenario, sim in sims.items():
      fig = figure(sim, config)
      fig.savefig(out / f"{scenario}.png", dpi=110)
      plotting.close(fig)
    log(f"{len(sims)} figures drawn in {time.perf_counter() - start:.0f} s")
  table, layers = summary_tables([row for sim in sims.values() for row in sim.rows])
  if out is not None:
    table.to_csv(out / "summary.csv", index=False)
    layers.rename(columns={"layer_retained": "retained_mass"}).to_csv(
      out / "layers.csv", index=False
    )
  return table


def pivot(table: pd.DataFrame) -> pd.DataFrame:
  """Policy x scenario view of the four headline metrics, for printing."""
  metrics_cols = ["retained_mass", "oracle_gap", "output_error", "fact_recall"]
  return table.pivot(index="policy", columns="scenario", values=metrics_cols).round(3)


# --------------------------------------------------------------------------- attention-free scorers

KEY_COLUMNS = ("scenario", "fact_distinctness", "policy", "budget", "reads_keys", *METRIC_COLUMNS)


def validate_keys_config(config) -> dict[str, policies.Policy]:
  """:func:`validate_config`'s checks for ``configs/lab_keys.py``: the world
  (:func:`check_worlds`), budgets, the key model's knobs (:class:`~kvjax.lab.keys.KeyGeometry`
  names a bad one) and per-policy options (here only for policies run), repeated budgets or
  values; returns the built policies."""
  rundir.require_fields(config, KEYS_CONFIG_FIELDS, "configs/lab_keys.py")
  _distinct("budgets", config.budgets)
  _distinct("fact_distinctness", config.fact_distinctness)
  for name in config.policy_options:
    if name not in config.policies:
      raise ValueError(f"policy_options: {name!r} is not among the policies run")
  built = _check_names(config)
  if not config.scenarios or not config.policies or not config.budgets:
    raise ValueError("scenarios/policies/budgets: expected at least one of each")
  T = check_worlds(config).total_len
  for b in config.budgets:
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= T:
      raise ValueError(f"budgets: {b!r} does not fit the world (an int in 1..T={T})")
  if not config.fact_distinctness:
    raise ValueError("fact_distinctness: expected at least one value in [0, 1]")
  for fd in config.fact_distinctness:
    keys.KeyGeometry(**dict(config.key_model.to_dict(), fact_distinctness=fd))
  return built


def _key_rows(scenario: str, config, built: dict, log=print) -> list[dict]:
  """Every policy x budget on one scenario; the attention-free scorers once per
  ``fact_distinctness`` (their keys change), the others once (their rows are repeated)."""
  world = synthetic.make_world(synthetic.world_config(scenario, config.world))
  seed = config.world.seed
  evidence = online.prompt_evidence(world, jax.random.key(seed))
  capacity = max(config.budgets)  # one compiled simulation per policy for every budget
  rows = []
  for name, policy in built.items():
    reads = online.needs_keys(policy)
    for fd in config.fact_distinctness if reads else (None,):
      ev = evidence
      if reads:
        geometry = keys.KeyGeometry(**dict(config.key_model.to_dict(), fact_distinctness=fd))
        ev = online.key_evidence(world, evidence, geometry, seed=seed)
      for budget in config.budgets:
        start = time.perf_counter()
        trace = online.simulate(world, policy, budget, capacity=capacity, evidence=ev, seed=seed)
        s = metrics.summarize(trace.metrics)
        row = dict(scenario=scenario, policy=name, budget=budget, reads_keys=reads)
        row |= {k: s[k] for k in METRIC_COLUMNS}
        for f in (fd,) if reads else config.fact_distinctness:
          rows.append(dict(row, fact_distinctness=float(f)))
        log(
          f"  {scenario:15s} {name:14s} fd={'-' if fd is None else fd} b={budget:4d} "
          f"R={s['retained_mass']:.3f} recall={s['fact_recall']:.3f} "
          f"({time.perf_counter() - start:.1f}s)"
        )
  return rows


def run_keys(config, workdir: str | pathlib.Path | None, log=print) -> pd.DataFrame:
  """The attention-free lab (``configs/lab_keys.py``): scenarios x ``fact_distinctness`` x
  policies x budgets under the modelled keys of :mod:`kvjax.lab.keys`; returns the table
  [:data:`KEY_COLUMNS`] and writes ``summary.csv`` into ``workdir``."""
  built = validate_keys_config(config)
  if workdir is not None:
    rundir.check_workdir(workdir)
  rows = []
  for scenario in config.scenarios:
    rows += _key_rows(scenario, config, built, log)
  table = pd.DataFrame(rows)[list(KEY_COLUMNS)]
  if workdir is not None:
    out = pathlib.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.to_json_best_effort(indent=2))
    table.to_csv(out / "summary.csv", index=False)
  return table


def key_pivot(table: pd.DataFrame, metric: str = "retained_mass") -> pd.DataFrame:
  """(budget, policy) x (scenario, fact_distinctness) view of one metric, for printing."""
  return table.pivot_table(
    index=["budget", "policy"], columns=["scenario", "fact_distinctness"], values=metric
  ).round(3)


def versus(table: pd.DataFrame, baseline: str = "snapkv") -> pd.DataFrame:
  """Each policy's retained mass and fact recall minus ``baseline``'s on the same scenario,
  ``fact_distinctness`` and budget (positive: the policy wins)."""
  keys_ = ["scenario", "fact_distinctness", "budget"]
  base = table[table.policy == baseline].set_index(keys_)[["retained_mass", "fact_recall"]]
  other = table[table.policy != baseline].set_index(keys_)
  delta = other[["retained_mass", "fact_recall"]] - base.reindex(other.index).to_numpy()
  return delta.assign(policy=other.policy).reset_index().round(3)
