"""What an evaluation run reads and checks before its workdir is touched: the config
(:func:`validate_config`: fields, tasks, lengths, budgets or compression ratios, policies,
question modes, the heatmap), the model (:func:`load_model`) and everything drawn from it
(:func:`prepare`: the calibration checked against the model, the trained surrogates, KVzip's
template, every example set), so that a bad config or a model that does not fit fails with
nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from kvjax import model as km
from kvjax import policies, rundir
from kvjax.eval import report, ruler
from kvjax.eval.evidence_sources import (
  CONTEXT_EVIDENCE,
  check_calibration,
  kvzip_template,
  learned_paths,
  load_calibration,
  load_learned,
  policy_needs,
)
from kvjax.eval.grouping import ALL_TASKS, examples, policy_entry, shared_shape
from kvjax.model import answers as answers_lib
from kvjax.model import assets
from kvjax.model.tokenizer import HFTokenizer, PieceTokenizer


def load_model(name: str, dtype=None):
  """``(model, cfg, tokenizer)``: ``"tiny"`` is the shipped model, ``"smollm2"`` the packaged
  SmolLM2-135M-Instruct (and any ``.gguf`` file: weights and tokenizer from the file); anything
  else is a local Hugging Face directory or, online, a hub id (``config.json``, safetensors,
  ``tokenizer.json``; the ``bos_token`` of ``tokenizer_config.json`` starts every prompt when
  there is one). ``dtype`` is the weights' (:func:`kvjax.model.load`'s default when ``None``)."""
  kw = {} if dtype is None else {"dtype": dtype}
  if name == "tiny":
    return km.load_tiny(**kw)
  if name == assets.SMOLLM2 or str(name).endswith(".gguf"):
    model, cfg = km.load(name, **kw)
    return model, cfg, PieceTokenizer(km.load_tokenizer(name))
  path = pathlib.Path(name)
  if not path.exists():
    path = _hub_snapshot(name)
  model, cfg = km.load(path, **kw)
  if not (path / "tokenizer.json").exists():
    raise ValueError(f"model: {name} has no tokenizer.json next to its weights")
  bos = None
  tc = path / "tokenizer_config.json"
  if tc.exists():
    bos = json.loads(tc.read_text()).get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
  return model, cfg, HFTokenizer(path / "tokenizer.json", bos_token=bos)


def _hub_snapshot(name: str) -> pathlib.Path:
  """The local snapshot of hub id ``name`` (``owner/model``), downloaded when needed;
  ``ValueError`` naming ``model`` for what is no hub id (a missing local path, a typo of a
  packaged name) and for an id the hub cannot give."""
  text = str(name)
  expected = (
    f"expected 'tiny', {assets.SMOLLM2!r}, a .gguf file, a local Hugging Face directory or a "
    "hub id 'owner/model'"
  )
  if (
    not text
    or pathlib.Path(text).is_absolute()
    or text.startswith((".", "~"))
    or text.count("/") != 1
  ):
    raise ValueError(f"model: {text!r} does not exist; {expected}")
  from huggingface_hub import snapshot_download  # noqa: PLC0415

  try:
    return pathlib.Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
  except Exception as e:  # offline, unknown id, gated repository: all name the model
    raise ValueError(
      f"model: {text!r} is no local path, and the hub did not give it ({type(e).__name__}: "
      f"{e}); {expected}"
    ) from e


def question_modes(config) -> tuple[str, ...]:
  """The config's question modes: ``question`` is one of
  :data:`kvjax.model.answers.QUESTION_MODES` or several joined by commas (the kvpress
  leaderboard reports query-aware ``in_window`` and query-agnostic ``after`` separately)."""
  modes = tuple(m.strip() for m in str(config.question).split(",") if m.strip())
  bad = [m for m in modes if m not in answers_lib.QUESTION_MODES]
  if not modes or bad or len(set(modes)) < len(modes):
    raise ValueError(
      f"question: {config.question!r} is not a comma-separated list of distinct modes from "
      f"{answers_lib.QUESTION_MODES}"
    )
  return modes


# what an evaluation config must hold (a config file's field left out is named, not an
# AttributeError deep inside the run)
CONFIG_FIELDS = (
  "model",
  "seed",
  "question",
  "tasks",
  "lengths",
  "examples",
  "budgets",
  "policies",
  "heatmap.task",
  "heatmap.policies",
  "heatmap.budget",
  "heatmap.lengths",
  "heatmap.depths",
  "heatmap.examples",
)

# Config fields that change no result, so a resume may change them (rundir.claim): the example
# batch size bounds memory (merged rows agree to float rounding, merge_batches), the compilation
# cache holds compiled programs, the reference policy only marks the tables. Everything else,
# model weights included, is the run's identity.
NOT_IDENTITY = ("batch", "compilation_cache", "reference")


def _distinct(name: str, values) -> None:
  repeated = sorted({repr(v) for v in values if list(values).count(v) > 1})
  if repeated:
    raise ValueError(
      f"{name}: {', '.join(repeated)} appear more than once; expected distinct values"
    )


def validate_config(config) -> None:
  """Every part of an evaluation config, before any work (and before the workdir is claimed):
  its fields (:data:`CONFIG_FIELDS`), tasks and their options, lengths, budgets, examples, the
  policies (at least one, by building each), labels, question modes, the heatmap and the
  compilation cache setting. What needs the model (that it loads, the calibration matches it,
  every length holds every task) :func:`prepare` checks."""
  rundir.require_fields(config, CONFIG_FIELDS, "configs/eval.py")
  question_modes(config)
  rundir.compilation_cache_dir(config.get("compilation_cache", None))
  for task in config.tasks:
    if task not in ALL_TASKS:
      raise ValueError(f"tasks: {task!r} is not one of {ALL_TASKS}")
  ratios = config_ratios(config)
  for name in ("lengths", "budgets"):
    values = tuple(config[name])
    if name == "budgets" and ratios:
      continue  # kept at () beside ratios (config_ratios)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
      raise ValueError(f"{name}: expected a non-empty tuple of positive ints, got {values!r}")
    _distinct(name, values)
  if (
    isinstance(config.examples, bool) or not isinstance(config.examples, int) or config.examples < 1
  ):
    raise ValueError(f"examples: expected a positive int, got {config.examples!r}")
  batch = config.get("batch")
  if batch is not None and (
    isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or config.examples % batch
  ):
    raise ValueError(
      f"batch: expected None or a positive divisor of examples={config.examples} (equal batches "
      f"compile once), got {batch!r}"
    )
  if not config.policies:  # the full cache alone would only measure itself
    raise ValueError(
      f"policies: expected at least one policy entry beside the full cache, got {config.policies!r}"
    )
  entries = config_entries(config)
  labels = [label for label, _ in entries]
  load_calibration(config, policy_needs(entries))
  learned_paths(config, policy_needs(entries))
  if len(set(labels)) < len(labels) or report.FULL in labels:
    raise ValueError(f"policies: labels must be distinct and not {report.FULL!r}, got {labels}")
  reference = config.get("reference")
  if reference is not None and reference not in (report.FULL, *labels):
    raise ValueError(
      f"reference: {reference!r} is not a policy label; expected one of "
      f"{[report.FULL, *labels]} (or None: {report.REFERENCE!r} when it runs)"
    )
  for length in config.lengths:
    if not ratios and not [b for b in config.budgets if b < length]:
      raise ValueError(
        f"budgets: none of {list(config.budgets)} is below the context length {length}"
      )
  h = config.heatmap
  for name in ("policies", "lengths", "depths"):
    _distinct(f"heatmap.{name}", tuple(h[name]))
  unknown = [p for p in h.policies if p not in labels]
  if unknown:
    raise ValueError(
      f"heatmap.policies: {unknown} are not policy labels; expected some of {labels}"
    )
  if h.policies:
    if h.task not in ALL_TASKS:
      raise ValueError(f"heatmap.task: {h.task!r} is not one of {ALL_TASKS}")
    if h.task in ruler.DEPTHLESS:
      raise ValueError(
        f"heatmap.task: {h.task!r} has no needle to place at a depth; expected one of "
        f"{tuple(t for t in ALL_TASKS if t not in ruler.DEPTHLESS)}"
      )
    if h.budget >= min(h.lengths):
      raise ValueError(
        f"heatmap.budget: {h.budget} must be below every heatmap length {list(h.lengths)}"
      )
    if any(not 0 <= d <= 1 for d in h.depths):
      raise ValueError(f"heatmap.depths: expected fractions in [0, 1], got {list(h.depths)}")


@dataclasses.dataclass
class Prepared:
  """What a run reads, made before its workdir is touched: the model, the calibration (checked
  against the model), KVzip's template, and every example set (``sets[(task, length)]``,
  ``heatmap[(length, depth)]``): drawing them checks that every length holds every task."""

  model: object
  cfg: object
  tokenizer: object
  calibration: dict
  template: object
  sets: dict
  heatmap: dict
  learned: dict = dataclasses.field(default_factory=dict)


def prepare(config) -> Prepared:
  """Loads the model of a validated ``config`` (:func:`validate_config`) and everything a run
  reads before the workdir is claimed, so that a model that does not load, a calibration of
  another model, a length too short for a task or too long for the model fails with nothing
  written."""
  model, cfg, tok = load_model(config.model)
  check_lengths_fit(config, cfg)
  entries = config_entries(config)
  needs = policy_needs(entries)
  calibration = load_calibration(config, needs)
  check_calibration(calibration, cfg, config.get("calibration"))
  learned = load_learned(config, needs, model)
  template = kvzip_template(tok, config.model) if set(needs) & set(CONTEXT_EVIDENCE) else None
  sets = {
    (task, length): examples(
      task, tok, length, config.examples, rundir.plain(opts), seed=config.seed
    )
    for task, opts in config.tasks.items()
    for length in config.lengths
  }
  h, heatmap = config.heatmap, {}
  if h.policies:
    opts = rundir.plain(config.tasks[h.task]) if h.task in config.tasks else {}
    heatmap = {
      (length, d): examples(h.task, tok, length, h.examples, opts, depth=d, seed=config.seed + 1)
      for length in h.lengths
      for d in h.depths
    }
  check_answers_fit(cfg, sets)
  check_answers_fit(cfg, {(h.task, n): exs for (n, _), exs in heatmap.items()}, "heatmap.lengths")
  check_ratios_fit(config, entries, sets)
  return Prepared(model, cfg, tok, calibration, template, sets, heatmap, learned)


def check_lengths_fit(config, cfg) -> None:
  """Refuses, before any example is drawn, a context length (``lengths``, ``heatmap.lengths``)
  longer than the model's context (``cfg.max_positions``; unknown: nothing is checked).

  Args:
    config: the evaluation config.
    cfg: the model's config.

  Raises:
    ValueError: naming the field, the length and the model's context.
  """
  limit = cfg.max_positions
  fields = {"lengths": config.lengths}
  if config.heatmap.policies:
    fields["heatmap.lengths"] = config.heatmap.lengths
  for name, lengths in fields.items():
    long = [n for n in lengths if limit is not None and n >= limit]
    if long:
      raise ValueError(
        f"{name}: {long} leave no room for an answer in the model's context of {limit} "
        f"positions (max_positions of {config.model!r}); expected lengths below {limit}"
      )


def check_answers_fit(cfg, sets, name: str = "lengths") -> None:
  """Refuses, before the workdir is touched, examples whose prompt and answer together pass the
  model's context (``cfg.max_positions``): the answer is fed after the prompt.

  Args:
    cfg: the model's config.
    sets: the example sets, ``{(task, length): examples}``.
    name: the config field of the lengths, for the error.

  Raises:
    ValueError: naming ``name``, the task, the length and the tokens needed.
  """
  limit = cfg.max_positions
  if limit is None:
    return
  for (task, length), exs in sets.items():
    need = max((e.prompt.size + e.answer.size for e in exs), default=0)
    if need > limit:
      raise ValueError(
        f"{name}: {length} tokens of {task!r} and its answer make {need}, past the model's "
        f"context of {limit} positions (max_positions); expected a length of at most "
        f"{length - (need - limit)}"
      )


def check_ratios_fit(config, entries, sets) -> None:
  """Refuses, before the workdir is touched, a ratio that leaves some policy fewer context
  tokens than it needs (its protected window) in some (task, length) cell.

  Args:
    config: the evaluation config.
    entries: the ``(label, policy)`` entries.
    sets: the example sets, ``{(task, length): examples}``.

  Raises:
    ValueError: naming ``ratios``, the ratio, the tokens it keeps and the policy
      (:func:`kvjax.model.answers.budgets_of`), with the cell.
  """
  ratios = config_ratios(config)
  if not ratios:
    return
  shapes = length_shapes(config, sets)
  for (task, length), exs in sets.items():
    q_len = (shapes[length] or (max(e.question_len for e in exs), None))[0]
    for label, policy in entries:
      if not policy.requires_budget:
        continue
      try:
        answers_lib.budgets_of(policy, None, ratios, length - q_len)
      except ValueError as e:
        raise ValueError(f"{e} (policy {label!r}, task {task!r} at {length} tokens)") from None


def config_ratios(config) -> tuple[float, ...]:
  """The config's compression ratios (``ratios``; empty: token budgets), checked.

  Args:
    config: the evaluation config (a config without the field has none).

  Returns:
    The ratios as floats, in the config's order.

  Raises:
    ValueError: naming ``ratios``, for a value that is not a float in ``[0, 1)``, a repeated
      ratio, or ratios given with token ``budgets`` (expected ``budgets=()``).
  """
  ratios = tuple(config.get("ratios", None) or ())
  if not ratios:
    return ()
  answers_lib.check_ratios(ratios)
  _distinct("ratios", ratios)
  if tuple(config.budgets):
    raise ValueError(
      f"ratios: {ratios} given with budgets {tuple(config.budgets)}; expected budgets or ratios, "
      "not both (set --config.budgets='()' to evaluate at ratios)"
    )
  return tuple(float(r) for r in ratios)


def config_entries(config) -> list[tuple[str, policies.Policy]]:
  """The config's policy entries as ``(label, policy)`` pairs, each built by
  :func:`kvjax.eval.grouping.policy_entry` (the full cache's reference not among them)."""
  return [policy_entry(e) for e in config.policies]


def length_shapes(config, sets) -> dict:
  """Each context length's ``(question_len, answer_len)`` under ``config.shared_shapes``.

  Args:
    config: the evaluation config (``shared_shapes`` off when absent).
    sets: the example sets, ``{(task, length): examples}``.

  Returns:
    ``{length: shape}``: the :func:`kvjax.eval.grouping.shared_shape` of every task's examples
    at that length, or ``None`` (each batch its own shapes) with ``shared_shapes`` off.
  """
  shared = config.get("shared_shapes", False)
  return {
    length: shared_shape([exs for (_, n), exs in sets.items() if n == length]) if shared else None
    for length in dict.fromkeys(n for _, n in sets)
  }
