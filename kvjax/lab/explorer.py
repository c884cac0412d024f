"""The essay's interactive figure as one self-contained HTML page (no kernel, no network).

:func:`explorer_data` replays every lab policy on every scenario over a grid of budgets and keeps
what the four panels draw; :func:`write_html` writes it with plotly.js inlined and a small script
whose controls (scenario, budget, generated step) redraw the panels:

1. retained attention mass over the generated tokens, one line per policy;
2. the cache map at the chosen step (share of (layer, head) rows holding each position), the old
   facts marked in red, the ones queried at that step drawn stronger;
3. the full attention row at that step (mean over layers and heads) in gray, and the part the
   focus policy keeps in purple;
4. retained mass by layer (the funnel).

The page is what ``python -m experiments.lab`` writes as ``lab.html``; the documentation embeds
it. Maps and rows are stored at a sample of steps and, for long worlds, summed over position bins,
so the page stays a few megabytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from concurrent import futures

import jax
import numpy as np

from kvjax.lab import online, suite, synthetic

# Enough steps for the slider to feel continuous, few enough to keep the page small.
MAX_STEPS = 24
# Positions per cache-map column above this many positions.
MAX_BINS = 320


def budget_grid(config, built: dict) -> tuple[int, ...]:
  """The budgets the page offers: ``config.explorer_budgets`` if set, else multiples of
  ``config.budget`` (3/4, 1 and 2) that every policy of ``built`` can run (each budget replays
  every policy on every scenario once more).

  Args:
    config: the lab config (``configs/lab.py``).
    built: the built policies (:func:`kvjax.lab.suite.build_policies`).

  Returns:
    The sorted budgets.

  Raises:
    ValueError: an explicit budget that some policy refuses or that exceeds the world.
  """
  T = config.world.prompt_len + config.world.gen_steps
  floor = max(p.min_budget(config.world.window) for p in built.values())
  explicit = tuple(config.get("explorer_budgets", ()) or ())
  if explicit:
    for b in explicit:
      if isinstance(b, bool) or not isinstance(b, int) or not floor <= b <= T:
        raise ValueError(
          f"explorer_budgets: {b!r} is not a budget every policy runs; expected integers in "
          f"[{floor}, {T}]"
        )
    return tuple(sorted(set(explicit)))
  grid = {int(config.budget * k) // 4 for k in (3, 4, 8)}
  return tuple(sorted(b for b in grid if floor <= b <= T)) or (int(config.budget),)


def _binned(x: np.ndarray, width: int) -> np.ndarray:
  """Sums ``x [..., T]`` over consecutive bins of ``width`` positions (the last one padded)."""
  pad = (-x.shape[-1]) % width
  x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, width).sum(-1)


# The cache map's shares are drawn in MAP_LEVELS + 1 gray levels, one character per cell
# ("0" + level: printable, no quote or slash), which keeps the page a few megabytes.
MAP_LEVELS = 40


def _encode_levels(share: np.ndarray) -> str:
  return "".join(chr(48 + int(v)) for v in np.rint(np.asarray(share) * MAP_LEVELS))


def _round(x, digits: int = 3):
  """Floats with ``digits`` significant digits, as nested lists (the page's JSON stays small)."""
  return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(np.asarray(x)).tolist()


def _scenario(world: synthetic.World, traces: dict, budgets, focus: str) -> dict:
  """The page's entry for one scenario from its replays ``traces[budget][policy]`` (each with
  its cache map recorded)."""
  dims = world.dims
  P, T, S = dims.prompt_len, dims.total_len, dims.gen_steps
  width = math.ceil(T / MAX_BINS)
  steps = np.unique(np.linspace(0, S - 1, min(S, MAX_STEPS)).round().astype(int))
  rows_SLHT = np.stack([np.asarray(synthetic.attention_row(world, P + s)) for s in steps])
  facts_T = np.asarray(world.fact_mask_FT).any(0)
  active = [np.flatnonzero(np.asarray(synthetic.active_fact_positions(world, s))) for s in steps]
  per_budget = {}
  for budget in budgets:
    entry = {"mass": {}, "mean": {}, "layer": {}, "map": {}}
    for name, trace in traces[budget].items():
      retained_SLH = np.asarray(trace.metrics.retained)
      entry["mass"][name] = _round(retained_SLH.mean((1, 2)))
      entry["mean"][name] = round(float(retained_SLH.mean()), 4)
      entry["layer"][name] = _round(retained_SLH.mean((0, 2)))
      pos = np.asarray(trace.positions_SLHC)[steps]
      valid = np.asarray(trace.valid_SLHC)[steps]
      # an empty slot (pos 0, not valid) writes to a spare column, never over a kept position 0
      kept_SLHT = np.zeros((len(steps), *pos.shape[1:3], T + 1), bool)
      np.put_along_axis(kept_SLHT, np.where(valid, pos, T), True, axis=-1)
      kept_SLHT = kept_SLHT[..., :T]
      share = _binned(kept_SLHT.mean((1, 2)), width) / width
      entry["map"][name] = [_encode_levels(row) for row in share]
      if name == focus:
        entry["kept"] = _round(_binned((rows_SLHT * kept_SLHT).mean((1, 2)), width), 2)
    per_budget[str(budget)] = entry
  return {
    "prompt_len": P,
    "total_len": T,
    "bin": width,
    "steps": steps.tolist(),
    "facts": np.flatnonzero(facts_T).tolist(),
    "active": [a.tolist() for a in active],
    "row": _round(_binned(rows_SLHT.mean((1, 2)), width)),
    "budgets": per_budget,
  }


def focus_policy(config, built: dict) -> str:
  """The policy whose kept attention the row panel draws: ``config.figure_policy``, else SnapKV
  when it runs, else the first policy (as the lab's static figure)."""
  if config.figure_policy:
    return config.figure_policy
  return suite.DEFAULT_FIGURE_POLICY if suite.DEFAULT_FIGURE_POLICY in built else next(iter(built))


@dataclasses.dataclass
class PageReplays:
  """The page's replays (:func:`start_replays`): the scenarios' worlds, the budgets replayed and
  the one taken from the main run, and per policy its traces ``[world][budget]`` (futures while
  they run)."""

  names: tuple[str, ...]
  worlds: list
  budgets: tuple[int, ...]
  to_run: list[int]
  reused: int | None
  per_policy: list
  start: float

  def traces(self) -> list:
    """Per policy its traces ``[world][budget]``, waiting for those still running."""
    return [r.result() if isinstance(r, futures.Future) else r for r in self.per_policy]


def start_replays(
  config,
  built: dict,
  *,
  replays: dict | None = None,
  executor: futures.Executor | None = None,
  workers: int | None = None,
  log=print,
) -> PageReplays:
  """Replays every policy on every scenario at every budget of :func:`budget_grid`: one
  :func:`kvjax.lab.online.simulate_batch` per policy (one compiled program replays all the
  budgets of a world and serves every world).

  Args:
    config: the lab config (``configs/lab.py``), validated.
    built: the built policies by label (:func:`kvjax.lab.suite.build_policies`).
    replays: the main run's replays at ``config.budget`` by scenario
      (:func:`kvjax.lab.suite.simulate_scenarios`), used for that budget instead of replaying
      it again (the same numbers to the page's rounding).
    executor: where the policies' replays run (returning at once; :meth:`PageReplays.traces`
      waits); default: here, on ``workers`` threads (:func:`kvjax.lab.suite.map_threads`).
    workers: as above.
    log: progress messages.

  Returns:
    The :class:`PageReplays`, for :func:`explorer_data`'s ``started``.

  Raises:
    ValueError: ``replays`` missing a scenario of ``config``.
  """
  budgets = budget_grid(config, built)
  seed = config.world.seed
  names = tuple(config.scenarios)
  reused = config.budget if replays is not None and config.budget in budgets else None
  if reused is not None and any(s not in replays for s in names):
    raise ValueError(f"replays: expected every scenario of {names}, got {list(replays)}")
  worlds = [synthetic.make_world(synthetic.world_config(name, config.world)) for name in names]
  evidence = [online.prompt_evidence(world, jax.random.key(seed)) for world in worlds]
  to_run = [b for b in budgets if b != reused]
  log(
    f"lab.html: replaying {len(built)} policies x {len(names)} scenarios at budgets {to_run}"
    + (f" ({reused}: the run's)" if reused is not None else "")
    + "..."
  )

  def replay(policy) -> list[list]:
    return online.simulate_batch(
      worlds, policy, to_run, record_map=True, evidence=evidence, seed=seed
    )

  policies_ = list(built.values()) if to_run else []
  if executor is None:
    per_policy = suite.map_threads(replay, policies_, workers)
  else:
    per_policy = [executor.submit(replay, policy) for policy in policies_]
  return PageReplays(names, worlds, budgets, to_run, reused, per_policy, time.perf_counter())


def explorer_data(
  config,
  built: dict,
  *,
  focus: str | None = None,
  log=print,
  replays: dict | None = None,
  workers: int | None = None,
  started: PageReplays | None = None,
) -> dict:
  """Everything the page draws, for every scenario of ``config`` and every budget of
  :func:`budget_grid`.

  Args:
    config: the lab config (``configs/lab.py``), validated.
    built: the built policies by label (:func:`kvjax.lab.suite.build_policies`).
    focus: the policy whose kept attention the row panel draws (one of ``built``; default
      :func:`focus_policy`).
    log: progress messages.
    replays: the main run's replays at ``config.budget`` (:func:`start_replays`).
    workers: threads replaying policies at once (default
      :func:`kvjax.lab.suite.default_workers`).
    started: :func:`start_replays`' result when the caller started them (``workers`` is then
      unused; ``replays`` the same as there).

  Returns:
    A JSON-serialisable dict: ``policies``, ``focus``, ``budgets``, ``default_budget`` and one
    entry per scenario (:func:`write_html` reads it).
  """
  focus = focus_policy(config, built) if focus is None else focus
  if focus not in built:
    raise ValueError(f"focus: {focus!r} is not among the policies {list(built)}")
  if started is None:
    started = start_replays(config, built, replays=replays, workers=workers, log=log)
  if started.reused is not None and replays is None:
    raise ValueError("replays: the replays started reuse the run's; expected them here too")
  per_policy = started.traces()
  scenarios = {}
  for i, (name, world) in enumerate(zip(started.names, started.worlds, strict=True)):
    traces = {b: {} for b in started.budgets}
    for p, label in enumerate(built):
      for j, b in enumerate(started.to_run):
        traces[b][label] = per_policy[p][i][j]
      if started.reused is not None:
        traces[started.reused][label] = replays[name].traces[label][0]
    scenarios[name] = _scenario(world, traces, started.budgets, focus)
  log(f"lab.html: data in {time.perf_counter() - started.start:.0f} s")
  default = min(started.budgets, key=lambda b: abs(b - config.budget))
  return {
    "policies": list(built),
    "focus": focus,
    "budgets": list(started.budgets),
    "default_budget": default,
    "map_levels": MAP_LEVELS,
    "scenarios": scenarios,
  }


def _plotly_js() -> str:
  try:
    from plotly.offline import get_plotlyjs  # noqa: PLC0415
  except ImportError:
    raise ImportError("writing lab.html needs plotly: pip install plotly") from None
  return get_plotlyjs()


def write_html(data: dict, path: str | pathlib.Path, *, title: str = "kvjax policy lab") -> str:
  """Writes the self-contained page of :func:`explorer_data`; returns its path.

  Args:
    data: :func:`explorer_data`'s result.
    path: where to write the HTML file.
    title: the page title.

  Returns:
    The path written, as a string.
  """
  path = pathlib.Path(path)
  page = (
    _TEMPLATE.replace("__TITLE__", title)
    .replace("__PLOTLY__", _plotly_js())
    .replace("__DATA__", json.dumps(data, separators=(",", ":")))
  )
  path.write_text(page, encoding="utf-8")
  return str(path)


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 12px; color: #222; }
  #controls { display: flex; gap: 24px; align-items: center; flex-wrap: wrap; margin-bottom: 8px; }
  #controls label { font-size: 14px; }
  #panels { display: grid; grid-template-columns: 1fr 1fr; gap: 4px; }
  .panel { height: 360px; }
  #note { font-size: 13px; color: #555; max-width: 70em; }
</style>
<script>__PLOTLY__</script>
</head>
<body>
<div id="controls">
  <label>scenario <select id="scenario"></select></label>
  <label>budget per head <input id="budget" type="range" min="0" step="1">
    <span id="budget-value"></span></label>
  <label>generated step <input id="step" type="range" min="0" step="1">
    <span id="step-value"></span></label>
</div>
<div id="panels">
  <div id="mass" class="panel"></div><div id="map" class="panel"></div>
  <div id="row" class="panel"></div><div id="layer" class="panel"></div>
</div>
<p id="note">Retained attention mass is the share of each generated token's full attention that
the cache still holds. Red lines mark old facts; the ones the chosen step queries are drawn
stronger. The row panel shows the full attention distribution in gray and the part the focus
policy keeps in purple.</p>
<script>
const DATA = __DATA__;
const $ = (id) => document.getElementById(id);
const scenarioSel = $("scenario"), budgetIn = $("budget"), stepIn = $("step");
for (const name of Object.keys(DATA.scenarios)) {
  const o = document.createElement("option"); o.value = o.textContent = name;
  scenarioSel.appendChild(o);
}
budgetIn.max = DATA.budgets.length - 1;
budgetIn.value = DATA.budgets.indexOf(DATA.default_budget);
const layout = (title, x, y, extra) => Object.assign({
  title: {text: title, font: {size: 14}}, margin: {l: 60, r: 10, t: 36, b: 40},
  xaxis: {title: {text: x}}, yaxis: {title: {text: y}}, legend: {font: {size: 10}},
}, extra || {});
function draw() {
  const sc = DATA.scenarios[scenarioSel.value];
  const budget = DATA.budgets[+budgetIn.value];
  const b = sc.budgets[String(budget)];
  stepIn.max = sc.steps.length - 1;
  if (+stepIn.value > sc.steps.length - 1) stepIn.value = sc.steps.length - 1;
  const k = +stepIn.value, step = sc.steps[k];
  $("budget-value").textContent = budget;
  $("step-value").textContent = step;
  const pos = (n) => Array.from({length: n}, (_, i) => i * sc.bin);
  const marks = sc.facts.map((p) => {
    const on = sc.active[k].includes(p);
    return {type: "line", x0: p, x1: p, yref: "paper", y0: 0, y1: 1,
            line: {color: "red", width: on ? 2.5 : 1}, opacity: on ? 0.9 : 0.35};
  });
  const now = {type: "line", x0: sc.prompt_len + step, x1: sc.prompt_len + step, yref: "paper",
               y0: 0, y1: 1, line: {color: "steelblue", width: 1}};
  Plotly.react("mass", DATA.policies.map((p) => ({
      y: b.mass[p], name: `${p} (${b.mean[p].toFixed(2)})`, mode: "lines"})),
    layout("Retained attention mass", "generated token", "retained mass R_t", {
      shapes: [{type: "line", x0: step, x1: step, yref: "paper", y0: 0, y1: 1,
                line: {dash: "dot", color: "black", width: 1}}]}));
  const z = DATA.policies.map((p) => Array.from(b.map[p][k], (c) => c.charCodeAt(0) - 48));
  Plotly.react("map", [{z: z, x: pos(z[0].length), y: DATA.policies, type: "heatmap",
      colorscale: "Greys", reversescale: true, zmin: 0, zmax: DATA.map_levels, showscale: false}],
    layout(`Cache map at step ${step} (share of layer-heads holding it)`, "position", "",
           {shapes: marks.concat([now]), margin: {l: 110, r: 10, t: 36, b: 40},
            yaxis: {autorange: "reversed"}}));
  Plotly.react("row", [
      {x: pos(sc.row[k].length), y: sc.row[k], type: "bar", name: "full attention",
       marker: {color: "#b3b3b3"}},
      {x: pos(b.kept[k].length), y: b.kept[k], type: "bar", name: `kept by ${DATA.focus}`,
       marker: {color: "rebeccapurple"}}],
    layout(`Attention row at step ${step}`, "position", "attention (mean over layers, heads)",
           {barmode: "overlay", bargap: 0, yaxis: {type: "log", title: {text: "attention"}}}));
  Plotly.react("layer", DATA.policies.map((p) => ({
      y: b.layer[p], name: p, mode: "lines+markers"})),
    layout("Retained mass by layer", "layer", "mean retained mass",
           {xaxis: {title: {text: "layer"}, dtick: 1}}));
}
for (const el of [scenarioSel, budgetIn, stepIn]) el.addEventListener("input", draw);
stepIn.value = Math.floor((DATA.scenarios[scenarioSel.value].steps.length - 1) / 2);
draw();
</script>
</body>
</html>
"""
