"""A search from a config: evidence, space, search, baselines, the allocation file and figures.

:func:`run` is what ``python -m experiments.search --config=configs/search.py[:quick]`` runs: it
builds the calibration and held-out evidence (the lab's worlds of two seeds, or a model's
calibration and held-out prompts), the :class:`~kvjax.eval.search.space.Space` at the memory
budget (tokens per entry, or a compression ratio), runs the search (resumable from its
``workdir``), judges the found allocation and the hand-made baselines of the same memory on the
held-out evidence, and writes ``allocation.npz`` (read by
:class:`kvjax.policies.searched.Searched`), ``summary.json``, ``history.csv`` and
``search.png`` into ``workdir``.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvjax import policies, rundir
from kvjax.eval import tasks
from kvjax.eval.search import fitness, optimise, results
from kvjax.eval.search.space import Space
from kvjax.model import loading

SOURCES = ("lab", "tiny")
SHAPES = ("L", "LG")
CONFIG_FIELDS = (
  "source",
  "shape",
  "policy",
  "window",
  "budget",
  "ratio",
  "rule",
  "optimiser",
  "population",
  "generations",
  "seed",
  "std_init",
  "lab",
  "model",
)


def _choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}: unknown value {value!r}; expected one of {choices}")


def lab_evidence(config) -> tuple[fitness.MassTable, fitness.MassTable, dict, dict]:
  """The lab's calibration and held-out tables (worlds of two seeds), the model identity and
  the calibration's identity."""
  lab = config.lab
  if lab.calibration_seed == lab.held_out_seed:
    raise ValueError(
      f"lab.held_out_seed: {lab.held_out_seed} equals lab.calibration_seed; expected "
      "held-out data apart from the calibration data"
    )
  policy = fitness.lab_policy(config.policy, config.window)
  world = dict(lab.world)
  cal = fitness.lab_table(lab.scenario, world | {"seed": lab.calibration_seed}, policy)
  held = fitness.lab_table(lab.scenario, world | {"seed": lab.held_out_seed}, policy)
  L, H = cal.prefix_LHP.shape[:2]
  model = results.model_identity(f"lab:{lab.scenario}", L, H, H)
  calibration = {"source": "lab", "scenario": lab.scenario, "world": world}
  calibration |= {"seed": lab.calibration_seed, "held_out_seed": lab.held_out_seed}
  return cal, held, model, calibration


def model_rows(tokenizer, task: str, prompt_len: int, seeds) -> np.ndarray:
  """Calibration rows of a task: each example's prompt and the first answer tokens after it
  (as many as the shortest answer of the set), ``[B, prompt_len + M]`` int32."""
  examples = [tasks.generate(task, tokenizer, length=prompt_len, seed=int(s)) for s in seeds]
  m = min(len(e.answer) for e in examples)
  return np.stack([np.concatenate([e.prompt, e.answer[:m]]) for e in examples]).astype(np.int32)


def model_evidence(config, shape: str):
  """The tiny model's calibration and held-out tables (task prompts of disjoint seeds)."""
  mc = config.model
  model, cfg, tok = loading.load_tiny()
  kv = {"num_kv_heads": cfg.num_kv_heads, "gqa": "mean"} if shape == "LG" else {}
  policy = fitness.lab_policy(config.policy, config.window)
  if kv:
    policy = policies.make(config.policy, **(_options(config) | kv))
  cal_seeds = range(mc.calibration_seed, mc.calibration_seed + mc.rows)
  held_seeds = range(mc.held_out_seed, mc.held_out_seed + mc.rows)
  if set(cal_seeds) & set(held_seeds):
    raise ValueError(
      f"model.held_out_seed: {mc.held_out_seed} overlaps the calibration seeds "
      f"{list(cal_seeds)}; expected held-out prompts apart from the calibration prompts"
    )
  cal_ids = model_rows(tok, mc.task, mc.prompt_len, cal_seeds)
  held_ids = model_rows(tok, mc.task, mc.prompt_len, held_seeds)
  cal = fitness.model_table(model, cal_ids, mc.prompt_len, policy)
  held = fitness.model_table(model, held_ids, mc.prompt_len, policy)
  identity = results.model_identity("tiny", cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
  calibration = {"source": "tiny", "task": mc.task, "prompt_len": mc.prompt_len}
  calibration |= {"seeds": list(cal_seeds), "held_out_seeds": list(held_seeds)}
  calibration["ids"] = results.data_identity(cal_ids)
  return cal, held, identity, calibration


def _options(config) -> dict:
  return policies.accepted_options(config.policy, window=config.window)


def check_config(config) -> None:
  """Validates a search config before anything runs.

  Raises:
    ValueError: a missing field, an unknown source, shape, rule or optimiser, both or neither
      of ``budget`` and ``ratio``, and the optimiser's options (:func:`optimise.check_options`).
  """
  rundir.require_fields(config, CONFIG_FIELDS, "configs/search.py")
  _choice("source", config.source, SOURCES)
  _choice("shape", config.shape, SHAPES)
  if (config.budget is None) == (config.ratio is None):
    raise ValueError(
      f"budget: {config.budget!r} with ratio {config.ratio!r}; expected exactly one of a budget "
      "per entry (tokens) and a compression ratio"
    )
  optimise.check_options(config.optimiser, config.population, config.generations, config.std_init)


def space_of(config, table: fitness.MassTable, num_kv_heads: int) -> Space:
  """The config's :class:`Space` over the table's layers (and KV heads, shape ``"LG"``)."""
  L = table.prefix_LHP.shape[0]
  shape = (L,) if config.shape == "L" else (L, num_kv_heads)
  P = table.prompt_len
  if config.ratio is not None:
    return Space.from_ratio(shape, float(config.ratio), config.window, P, config.rule)
  return Space.from_budget(shape, int(config.budget), config.window, P, config.rule)


def run(config, workdir, *, log: Callable = print, stop_after: int | None = None) -> dict | None:
  """Runs (or resumes) the search of ``config`` into ``workdir``; its summary.

  Args:
    config: a search config (``configs/search.py``).
    workdir: the run directory (checkpoints, the allocation file, the summary, figures).
    log: where progress lines go.
    stop_after: stop after this generation (an interruption, for tests).

  Returns:
    The summary (``summary.json``), or ``None`` when stopped early.

  Raises:
    ValueError: as :func:`check_config`, the space's and the evidence's checks.
  """
  check_config(config)
  rundir.check_workdir(workdir)
  out = pathlib.Path(workdir)
  if config.source == "lab":
    cal, held, model, calibration = lab_evidence(config)
  else:
    cal, held, model, calibration = model_evidence(config, config.shape)
  space = space_of(config, cal, model["num_kv_heads"])
  evaluate = optimise.population_call(space, fitness.retained_mass, cal)
  result = optimise.run(
    evaluate,
    space,
    optimiser=config.optimiser,
    population=config.population,
    generations=config.generations,
    seed=config.seed,
    std_init=float(config.std_init),
    checkpoint_dir=out / "checkpoints",
    stop_after=stop_after,
    log=log,
    progress=True,
  )
  if result is None:
    return None
  judged = judge(result.allocation, space, cal, held)
  head = results.header(
    result,
    space,
    model=model,
    calibration=calibration,
    held_out=judged["searched"]["held_out"],
    ratio=None if config.ratio is None else float(config.ratio),
    policy=config.policy,
    baselines={k: v for k, v in judged.items() if k != "searched"},
  )
  path = results.save_allocation(out / "allocation.npz", result, head)
  pd.DataFrame(result.history).rename_axis("generation").to_csv(out / "history.csv")
  summary = {"allocation_file": str(path.resolve()), "judged": judged, "header": head}
  (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_plain))
  fig = figure(result, space, results.baselines(space), judged)
  fig.savefig(out / "search.png", dpi=110)
  plt.close(fig)
  return summary


def _plain(x):
  return np.asarray(x).tolist()


def judge(allocation, space: Space, cal: fitness.MassTable, held: fitness.MassTable) -> dict:
  """Calibration and held-out retained mass of the found allocation and of every baseline of the
  same memory (``best_hand_made``: the baseline best on calibration, as a user would pick)."""
  rows = {"searched": allocation} | results.baselines(space)
  judged = {}
  for name, a in rows.items():
    a = jnp.asarray(a)
    judged[name] = {
      "calibration": float(fitness.retained_mass(cal, a)),
      "held_out": float(fitness.retained_mass(held, a)),
      "allocation": np.asarray(a).tolist(),
    }
  hand = {k: v for k, v in judged.items() if k != "searched"}
  best = max(hand, key=lambda k: hand[k]["calibration"])
  judged["best_hand_made"] = {"name": best} | hand[best]
  return judged


def figure(result: optimise.SearchResult, space: Space, hand: dict, judged: dict):
  """The fitness curve (best so far and each generation's mean, with the best hand-made
  schedule's calibration fitness) and the found allocation beside PyramidKV's (bars per layer,
  or heat maps per layer and KV head)."""
  fig, axes = plt.subplots(1, 3 if len(space.shape) == 2 else 2, figsize=(13, 3.8))
  g = np.arange(1, len(result.history["best"]) + 1)
  axes[0].plot(g, result.history["best"], label="best so far")
  axes[0].plot(g, result.history["mean"], label="generation mean")
  best = judged["best_hand_made"]
  axes[0].axhline(best["calibration"], color="gray", ls="--", label=f"{best['name']}")
  axes[0].set(xlabel="generation", ylabel="retained mass (calibration)", title=result.optimiser)
  axes[0].legend(fontsize=8)
  pyramid = hand.get("pyramid_beta20", hand["uniform"])
  a = np.asarray(result.allocation)
  if a.ndim == 1:
    x = np.arange(len(a))
    axes[1].bar(x - 0.2, a, 0.4, label="searched")
    axes[1].bar(x + 0.2, pyramid, 0.4, label="PyramidKV")
    axes[1].set(xlabel="layer", ylabel="budget (tokens)", title="allocation")
    axes[1].legend(fontsize=8)
  else:
    for ax, table, title in ((axes[1], a, "searched"), (axes[2], pyramid, "PyramidKV")):
      im = ax.imshow(table.T, aspect="auto", vmin=space.low, vmax=max(a.max(), pyramid.max()))
      ax.set(xlabel="layer", ylabel="KV head", title=title)
      fig.colorbar(im, ax=ax)
  fig.tight_layout()
  return fig
