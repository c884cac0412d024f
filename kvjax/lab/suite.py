"""The attention-policy lab: every policy on every scenario, a summary table and the figures.

:func:`run` is what ``experiments/lab.py`` calls; notebooks call it too. It returns the summary
as a ``pandas.DataFrame`` and writes ``summary.csv``, ``layers.csv`` and one PNG per scenario
(:func:`kvjax.plotting.lab_figure`) into the run directory.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import numpy as np
import pandas as pd

from kvjax import plotting
from kvjax.lab import metrics, online, synthetic

SUMMARY_COLUMNS = (
  "scenario",
  "policy",
  "budget",
  "retained_mass",
  "oracle_gap",
  "output_error",
  "fact_recall",
  "budget_use",
  "oracle_mass",
)


def validate_config(config) -> None:
  """Names the offending field for an unknown scenario or policy, or a bad budget."""
  for s in config.scenarios:
    if s not in synthetic.SCENARIOS:
      raise ValueError(
        f"scenarios: unknown scenario {s!r}; expected some of {tuple(synthetic.SCENARIOS)}"
      )
  for p in config.policies:
    if p not in online.LAB_POLICIES:
      raise ValueError(
        f"policies: unknown lab policy {p!r}; expected some of {online.LAB_POLICIES}"
      )
  if not config.scenarios or not config.policies:
    raise ValueError("scenarios/policies: expected at least one of each")
  T = config.world.prompt_len + config.world.gen_steps
  if not 1 <= config.budget <= T:
    raise ValueError(f"budget: {config.budget} does not fit the world (1..T={T})")
  if config.figure_policy and config.figure_policy not in config.policies:
    raise ValueError(f"figure_policy: {config.figure_policy!r} is not among the policies run")


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


def simulate_scenario(scenario: str, config, log=print) -> ScenarioRun:
  """All policies of ``config`` on one scenario (the figure's attention maps recorded)."""
  world = synthetic.make_world(synthetic.world_config(scenario, config.world))
  step = pick_step(world, config.figure_step)
  evidence = online.prompt_evidence(world, jax.random.key(config.world.seed))
  rows, traces = [], {}
  for name in config.policies:
    start = time.perf_counter()
    trace = online.simulate(world, name, config.budget, record_map=True, evidence=evidence)
    summary = metrics.summarize(trace.metrics)
    traces[name] = (trace, summary)
    rows.append(
      dict(scenario=scenario, policy=name, budget=config.budget)
      | {k: summary[k] for k in SUMMARY_COLUMNS[3:]}
      | {"layer_retained": summary["retained_mass_L"].tolist()}
    )
    log(
      f"  {scenario:15s} {name:16s} R={summary['retained_mass']:.3f} ({time.perf_counter() - start:.1f}s)"
    )
  return ScenarioRun(scenario, world, step, traces, rows)


def figure(sim: ScenarioRun, config, step: int | None = None):
  """The essay's four-panel figure of a simulated scenario (at ``step``, default the config's)."""
  focus = config.figure_policy or ("snapkv" if "snapkv" in sim.traces else next(iter(sim.traces)))
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


def run_scenario(scenario: str, config, workdir: pathlib.Path | None, log=print) -> list[dict]:
  """All policies on one scenario; returns summary rows (and writes the figure)."""
  sim = simulate_scenario(scenario, config, log)
  if workdir is not None:
    fig = figure(sim, config)
    fig.savefig(workdir / f"{scenario}.png", dpi=110)
    plotting.close(fig)
  return sim.rows


def summary_tables(rows: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
  """Summary rows -> ``(summary [SUMMARY_COLUMNS], per-layer retained mass)``."""
  table = pd.DataFrame(rows)
  layers = table[["scenario", "policy", "layer_retained"]].explode("layer_retained")
  layers["layer"] = layers.groupby(["scenario", "policy"]).cumcount()
  return table.drop(columns="layer_retained")[list(SUMMARY_COLUMNS)], layers


def run(config, workdir: str | pathlib.Path | None, log=print) -> pd.DataFrame:
  """Runs the lab described by ``config`` (``configs/lab.py``); returns the summary table."""
  validate_config(config)
  out = None
  if workdir is not None:
    out = pathlib.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.to_json_best_effort(indent=2))
  rows = []
  for scenario in config.scenarios:
    rows += run_scenario(scenario, config, out, log)
  table, layers = summary_tables(rows)
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
