"""kvpress's leaderboard protocol: RULER's synthetic tasks answered by generation under
compression ratios, in the query-agnostic and the query-aware loop, scored as RULER scores.

Reference: kvpress 0.5.5's evaluation (``evaluation/evaluate.py`` and its leaderboard: RULER at
4k tokens, compression ratios 0.25 / 0.5 / 0.75 / 0.875, the mean score per method and ratio)
and RULER's scoring (:func:`kvjax.eval.ruler.score`).

* **query-agnostic** (kvpress's default): the context is compressed before the question is seen
  (:func:`kvjax.model.decoding.compress_context` at the ratio), then the question and answer
  prefix are fed through the compressed cache and the answer is decoded greedily
  (:func:`kvjax.model.decoding.answer_context`);
* **query-aware**: the context and the question (with the answer prefix) are compressed
  together, the question observed by the policy's window, then the prompt's last token is fed
  through the compressed cache and the answer decoded (the ratio counts every prompt token but
  that last one).

Each row is one (task, example, method, ratio, loop): RULER's per-example score (in percent),
the cache's held K/V bytes and their fraction of the full cache.

With ``separate_queries`` a sample that asks several keys in one question (``niah_multiquery``)
asks each key as a question of its own (:attr:`kvjax.eval.ruler.RulerSample.queries`): in the
query-agnostic loop the context is prefilled and compressed once and every question is answered
from that one compressed cache (:func:`answer_queries`); its score is ``string_match_all`` over
the questions. In the query-aware loop each question is compressed with the context it sees.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pandas as pd

from kvjax import model as km
from kvjax import policies, rundir
from kvjax.eval import evaluate, ruler
from kvjax.model import cache as cache_lib
from kvjax.model import llama

LOOPS = ("agnostic", "aware")
COLUMNS = (
  "task",
  "example",
  "method",
  "ratio",
  "loop",
  "score",
  "kv_bytes_held",
  "kv_fraction",
  "seconds",
)
KEY = ("task", "example", "method", "ratio", "loop")
# fields that change no result: a resume may change them
NOT_IDENTITY = ("workdir",)


@dataclasses.dataclass(frozen=True)
class Method:
  """A leaderboard entry: a label, a registered policy with its options, and the loops it runs.

  Attributes:
    label: the row's ``method``.
    policy: a registered policy name.
    options: its options.
    loops: the loops it runs (kvpress runs the question-window presses query-aware too).
  """

  label: str
  policy: str
  options: tuple = ()
  loops: tuple[str, ...] = ("agnostic",)

  def build(self) -> policies.Policy:
    """The policy object."""
    return policies.make(self.policy, **dict(self.options))


@dataclasses.dataclass(frozen=True)
class Cell:
  """What one leaderboard row is computed under: a method's policy at a ratio in a loop.

  Attributes:
    policy: the policy object (``full``: ratio 0, the uncompressed cache).
    ratio: kvpress's compression ratio.
    loop: ``"agnostic"`` or ``"aware"``.
    max_new_tokens: tokens to generate (per question), an int >= 1 (``None``: RULER's for the
      task; :func:`check_max_new_tokens`).
  """

  policy: policies.Policy
  ratio: float
  loop: str
  max_new_tokens: int | None = None


def methods_of(config) -> tuple[Method, ...]:
  """The config's ``methods`` as :class:`Method` objects, each built once to check it.

  Args:
    config: the leaderboard config.

  Returns:
    The methods.

  Raises:
    ValueError: for no methods, a method that is not a dict with ``label`` and ``policy``, a
      duplicate label, an unknown or repeated loop, or a policy that cannot be built.
  """
  if not len(config.methods):
    raise ValueError("methods: the list is empty; expected at least one")
  out, seen = [], set()
  for m in config.methods:
    m = dict(m)
    if "label" not in m or "policy" not in m:
      raise ValueError(f"methods: {m!r} needs 'label' and 'policy'")
    label, name = m.pop("label"), m.pop("policy")
    loops = tuple(m.pop("loops", ("agnostic",)))
    bad = [x for x in loops if x not in LOOPS]
    if bad:
      raise ValueError(f"methods: {label!r} has loops {bad}; expected some of {LOOPS}")
    if len(set(loops)) != len(loops):
      raise ValueError(f"methods: {label!r} repeats a loop in {list(loops)}; expected each once")
    if label in seen:
      raise ValueError(f"methods: the label {label!r} is given twice")
    seen.add(label)
    method = Method(label, name, tuple(sorted(m.items())), loops)
    method.build()
    out.append(method)
  return tuple(out)


def check_config(config) -> None:
  """Refuses a config the run cannot do, before any work (and before the run directory is
  claimed).

  Args:
    config: the leaderboard config.

  Raises:
    ValueError: naming the field: an empty, repeated or unknown task, an empty or repeated
      ratio (two ratios equal to 6 decimals, as rows are keyed, are one) or one outside
      ``[0, 1)``, a length or example count that is not a positive int, a seed that is not an
      int, a ``max_new_tokens`` that is neither ``None`` (the task's default) nor an int >= 1,
      a ``separate_queries`` or ``shared_question_len`` that is not a bool, or an empty list
      of methods or a bad method.
  """
  rundir.require_fields(
    config,
    ("model", "tasks", "length", "examples", "ratios", "methods", "workdir", "seed"),
    "configs/leaderboard.py",
  )
  for name in ("tasks", "ratios", "methods"):
    if isinstance(config[name], str) or not hasattr(config[name], "__len__"):
      raise ValueError(f"{name}: expected a list, got {config[name]!r}")
    if not len(config[name]):
      raise ValueError(f"{name}: the list is empty; expected at least one")
  for task in config.tasks:
    if task not in ruler.TASKS:
      raise ValueError(f"tasks: {task!r} is not one of {ruler.TASKS}")
  _refuse_repeats("tasks", list(config.tasks), list(config.tasks))
  for name in ("length", "examples"):
    v = config[name]
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
      raise ValueError(f"{name}: expected a positive int, got {v!r}")
  if isinstance(config.seed, bool) or not isinstance(config.seed, int | np.integer):
    raise ValueError(f"seed: expected an int, got {config.seed!r}")
  for r in config.ratios:
    number = isinstance(r, int | float | np.integer | np.floating) and not isinstance(r, bool)
    if not number or not 0 <= r < 1:
      raise ValueError(f"ratios: {r!r} is not a compression ratio in [0, 1)")
  _refuse_repeats("ratios", list(config.ratios), [ratio_key(r) for r in config.ratios])
  check_max_new_tokens(config.get("max_new_tokens", None))
  for option in ("separate_queries", "shared_question_len"):
    value = config.get(option, False)
    if not isinstance(value, bool):
      raise ValueError(f"{option}: expected a bool, got {value!r}")
  methods_of(config)


def ratio_key(ratio) -> float:
  """A ratio as rows are keyed (6 decimals): two ratios of one key are one ratio."""
  return round(float(ratio), 6)


def _refuse_repeats(name: str, values: list, keys: list) -> None:
  first = {}
  for value, key in zip(values, keys, strict=True):
    if key in first:
      raise ValueError(
        f"{name}: {value!r} repeats {first[key]!r}; expected each once (a repeat would run "
        "and write its rows twice)"
      )
    first[key] = value


def check_max_new_tokens(value) -> int | None:
  """``max_new_tokens`` as the leaderboard takes it: ``None`` for RULER's count of the task, or
  an int >= 1 (0 is refused, never read as the default).

  Args:
    value: the option.

  Returns:
    ``value`` as an int, or ``None``.

  Raises:
    ValueError: for anything else.
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(
      f"max_new_tokens: expected None (the task's default) or an int >= 1, got {value!r}"
    )
  return int(value)


def identity(config) -> dict:
  """What identifies a leaderboard run: its config, but ``separate_queries`` and
  ``shared_question_len`` only when set (a run of the plain protocol is the same run with or
  without the fields).

  Args:
    config: the leaderboard config.

  Returns:
    The plain dict :func:`kvjax.rundir.signature` hashes.
  """
  plain = rundir.plain(config.to_dict())
  for option in ("separate_queries", "shared_question_len"):
    if not plain.get(option):
      plain.pop(option, None)
  return plain


def _text(tokenizer, ids) -> str:
  """Decoded tokens, cut at the first end of sequence (kvpress stops generating there)."""
  ids = [int(t) for t in ids]
  eos = getattr(tokenizer, "eos_id", None)
  if eos is not None and eos in ids:
    ids = ids[: ids.index(eos)]
  return tokenizer.decode(ids)


def answer(model, tokenizer, sample: ruler.RulerSample, cell: Cell, fed_len: int | None = None):
  """One example's generated answer in ``cell`` (its policy, ratio and loop).

  Args:
    model: the model.
    tokenizer: its tokenizer.
    sample: the RULER example (:func:`kvjax.eval.ruler.sample`).
    cell: the policy, ratio, loop and tokens to generate.
    fed_len: the query-agnostic loop's fed tail, at least the question's length (``None``: the
      question and answer prefix alone). Longer, it feeds that many more of the context's last
      tokens uncompressed with them (:func:`shared_question_len`).

  Returns:
    ``(text, kv_bytes_held, kv_fraction)``.

  Raises:
    ValueError: for a ``max_new_tokens`` that is neither ``None`` nor an int >= 1, or a
      ``fed_len`` shorter than the question or not shorter than the prompt.
  """
  given = check_max_new_tokens(cell.max_new_tokens)
  ex = sample.example
  new = given or ruler.TOKENS_TO_GENERATE[ruler.KIND[sample.task]]
  prompt = ex.prompt[None].astype(np.int32)
  # agnostic: the question and answer prefix come after the compression; aware: only the last
  # prompt token does (the compressed prompt holds the question, its window observes it)
  q = ex.question_len if cell.loop == "agnostic" else 1
  if fed_len is not None and cell.loop == "agnostic":
    if not ex.question_len <= fed_len < ex.prompt.size:
      raise ValueError(
        f"fed_len: {fed_len} tokens, expected at least the question's {ex.question_len} and "
        f"fewer than the prompt's {ex.prompt.size}"
      )
    q = int(fed_len)
  (text,), held, frac = _compress_and_answer(
    model, tokenizer, prompt[:, :-q], [prompt[:, -q:]], cell, new
  )
  return text, held, frac


def answer_queries(model, tokenizer, sample: ruler.RulerSample, cell: Cell):
  """A multi-query example's answers, each asked key a question of its own
  (:attr:`kvjax.eval.ruler.RulerSample.queries`), in ``cell`` (its policy, ratio and loop).

  Query-agnostic: the context is prefilled and compressed once
  (:func:`kvjax.model.decoding.compress_context`) and every question is answered from that
  compressed cache (:func:`kvjax.model.decoding.answer_context`, which leaves it unchanged), as
  kvpress's users compress a context once for several questions. Query-aware: each question is
  compressed with the context, as its own prompt.

  Args:
    model: the model.
    tokenizer: its tokenizer.
    sample: the RULER example, with :attr:`~kvjax.eval.ruler.RulerSample.queries`.
    cell: the policy, ratio, loop and tokens to generate per question.

  Returns:
    ``(texts, references, kv_bytes_held, kv_fraction)``: one generated text and one reference
    tuple per question, the K/V bytes each compressed cache held (the mean over the
    compressions) and their fraction of the full cache.

  Raises:
    ValueError: for a sample without separate queries, or a ``max_new_tokens`` that is neither
      ``None`` nor an int >= 1.
  """
  if not sample.queries:
    raise ValueError(
      f"sample: {sample.task!r} asks one question; expected a sample with several queries "
      "(niah_multiquery)"
    )
  new = (
    check_max_new_tokens(cell.max_new_tokens) or ruler.TOKENS_TO_GENERATE[ruler.KIND[sample.task]]
  )
  prompt = sample.example.prompt[None].astype(np.int32)
  context = prompt[:, : prompt.shape[1] - sample.example.question_len]
  questions = [query.ids[None].astype(np.int32) for query in sample.queries]
  refs = [query.outputs for query in sample.queries]
  if cell.loop == "agnostic":  # one compression, every question from it
    texts, held, frac = _compress_and_answer(model, tokenizer, context, questions, cell, new)
    return texts, refs, held, frac
  texts, helds, fracs = [], [], []
  for question in questions:  # query-aware: each question's own prompt, compressed
    seen = np.concatenate([context, question], 1)
    (text,), held, frac = _compress_and_answer(
      model, tokenizer, seen[:, :-1], [seen[:, -1:]], cell, new
    )
    texts.append(text)
    helds.append(held)
    fracs.append(frac)
  return texts, refs, int(np.mean(helds)), float(np.mean(fracs))


def shared_question_len(samples) -> int:
  """The query-agnostic loop's fed tail shared by ``samples`` (with ``shared_question_len``):
  the longest question and answer prefix among them.

  With one fed length every task of a context length compresses a context of one shape and
  feeds one question shape, so each method and ratio compiles once for all tasks that generate
  as many tokens instead of once per task (on a CPU the compiles cost about as much as the
  answers). A named variant of the
  protocol, as :func:`kvjax.eval.evaluate.shared_shape` is: a task whose question is shorter
  feeds that many of its context's last tokens uncompressed with it (kept, outside the ratio).

  Args:
    samples: the run's RULER samples.

  Returns:
    The fed length, in tokens.
  """
  return max(s.example.question_len for s in samples)


def _compress_and_answer(model, tokenizer, context_ids, questions, cell, new):
  """``(texts, kv_bytes_held, kv_fraction)``: ``context_ids`` ``[1, T]`` compressed once under
  ``cell``'s policy at its ratio, then each of ``questions`` (``[1, Q]`` each) answered from
  it."""
  budget = km.Ratio(float(cell.ratio)) if cell.policy.requires_budget else None
  ctx = km.compress_context(model, context_ids, policy=cell.policy, budget=budget)
  texts = [
    _text(tokenizer, km.answer_context(model, ctx, q, max_new_tokens=new).tokens[0])
    for q in questions
  ]
  held = cache_lib.memory(ctx.cache)["kv_bytes_held"]
  itemsize = llama.kv_itemsize(model.cfg, model.params())
  full = cache_lib.full_cache_bytes(model.cfg, 1, context_ids.shape[1], itemsize)
  return texts, int(held), float(held / full)


def run(config, workdir, *, model=None, tokenizer=None, log=print) -> pd.DataFrame:
  """Runs (or resumes) the leaderboard grid into ``workdir``.

  Rows already in ``results.csv`` are skipped; every finished row is appended at once, so a
  killed run resumes with nothing lost or repeated. The directory is locked while the run holds
  it and claimed by its configuration (``leaderboard.json``).

  Args:
    config: the leaderboard config (``configs/leaderboard.py``).
    workdir: the run directory.
    model: the loaded model (``None``: loaded from ``config.model``).
    tokenizer: its tokenizer.
    log: a print-like callable for progress.

  Returns:
    Every row (resumed and new).

  Raises:
    ValueError: for a config :func:`check_config` refuses, or a workdir holding another run.
  """
  check_config(config)
  rundir.check_workdir(workdir)
  methods = methods_of(config)
  if model is None:
    model, _, tokenizer = evaluate.load_model(config.model)
  with rundir.lock(workdir):
    path = rundir.check_workdir(workdir) / "results.csv"
    sig = rundir.signature(identity(config))
    out = rundir.claim(
      workdir,
      "leaderboard.json",
      sig,
      has_results=rundir.holds_data(path),
      not_identity=NOT_IDENTITY,
    )
    path = out / "results.csv"
    table = rundir.read_rows(path, dtype={"task": str, "method": str, "loop": str}, columns=COLUMNS)
    done = {
      (r.task, int(r.example), r.method, ratio_key(r.ratio), r.loop) for r in table.itertuples()
    }
    separate = bool(config.get("separate_queries", False))
    fed_len = None
    if config.get("shared_question_len", False):
      fed_len = shared_question_len(
        [
          ruler.sample(task, tokenizer, length=config.length, seed=config.seed + i)
          for task in config.tasks
          for i in range(config.examples)
        ]
      )
    for task in config.tasks:
      for i in range(config.examples):
        sample = ruler.sample(task, tokenizer, length=config.length, seed=config.seed + i)
        for m in methods:
          pol = m.build()
          ratios = config.ratios if pol.requires_budget else (0.0,)
          for r in ratios:
            for loop in m.loops:
              key = (task, i, m.label, ratio_key(r), loop)
              if key in done:
                continue
              t0 = time.perf_counter()
              cell = Cell(pol, r, loop, config.get("max_new_tokens"))
              if separate and sample.queries:  # each key its own question of one context
                texts, refs, held, frac = answer_queries(model, tokenizer, sample, cell)
              else:
                text, held, frac = answer(model, tokenizer, sample, cell, fed_len)
                texts, refs = [text], [sample.outputs]
              score = ruler.score(task, texts, refs)
              row = dict(
                task=task,
                example=i,
                method=m.label,
                ratio=float(r),
                loop=loop,
                score=score,
                kv_bytes_held=held,
                kv_fraction=round(frac, 6),
                seconds=round(time.perf_counter() - t0, 2),
              )
              rundir.append_rows(path, [row])
              log(f"{task} #{i} {m.label} r={r} {loop}: {score:.1f} ({frac:.3f} of the cache)")
    return rundir.read_rows(path, dtype={"task": str, "method": str, "loop": str}, columns=COLUMNS)


def table(rows: pd.DataFrame) -> pd.DataFrame:
  """kvpress's leaderboard table: the mean score (over tasks and examples) per method, loop and
  ratio, with the mean fraction of the cache held.

  Args:
    rows: the run's rows.

  Returns:
    One row per (loop, method, ratio): ``score`` (mean, percent), ``n`` (examples) and
    ``kv_fraction``.
  """
  g = rows.groupby(["loop", "method", "ratio"], sort=True)
  return g.agg(
    score=("score", "mean"), n=("score", "size"), kv_fraction=("kv_fraction", "mean")
  ).reset_index()
