"""The examples of one (task, context length) and their answers under one policy: held-out
examples of the task suite (:func:`examples`), their one prefill shared by every policy
(:func:`prefill_examples`), a policy's rows over budgets or compression ratios
(:func:`evaluate_group`), the rows of several example batches merged into one group's
(:func:`merge_batches`) and finished with intervals (:func:`finish_row`); and the full cache's
own scores and HeadKV's retrieval-head measurement, which draw examples the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax import model as km
from kvjax import policies
from kvjax.eval import ruler, stats, tasks
from kvjax.eval.evidence_sources import PREFILL_EVIDENCE
from kvjax.model import answers as answers_lib
from kvjax.model import restorekv

EVAL_SEED = 2**31  # training draws example seeds below 2**31: evaluation seeds never collide
# kvjax's own generators, then RULER's synthetic tasks
ALL_TASKS = tuple(tasks.TASKS) + tuple(ruler.TASKS)


def examples(task: str, tokenizer, length: int, count: int, options: dict, *, depth=None, seed=0):
  """``count`` held-out examples of one task (seeds above every training seed): kvjax's own
  generators (:mod:`kvjax.eval.tasks`) or RULER's synthetic tasks (:mod:`kvjax.eval.ruler`)."""
  make = ruler.generate if task in ruler.TASKS else tasks.generate
  return [
    make(
      task, tokenizer, length=length, seed=EVAL_SEED + seed * 100_003 + i, depth=depth, **options
    )
    for i in range(count)
  ]


def kl_divergence(logp_full_BNV: np.ndarray, logp_BNV: np.ndarray, scored_BN: np.ndarray) -> float:
  """Mean over scored answer tokens of ``KL(p_full || p)`` (nats)."""
  p = np.exp(logp_full_BNV)
  kl_BN = (p * (logp_full_BNV - logp_BNV)).sum(-1)
  return float(kl_BN[scored_BN].mean())


def accuracy(exs, predicted_BN: np.ndarray) -> np.ndarray:
  """Each example's task score (bool ``[B]``) from the predicted answer tokens."""
  return np.asarray(
    [tasks.score(e, p[: e.answer.size]) for e, p in zip(exs, predicted_BN, strict=False)]
  )


def recall(exs, predicted_BN: np.ndarray) -> np.ndarray:
  """Each example's RULER ``string_match_all`` (float ``[B]``, :func:`kvjax.tasks.recall`)."""
  return np.asarray(
    [tasks.recall(e, p[: e.answer.size]) for e, p in zip(exs, predicted_BN, strict=False)]
  )


def head_retrieval_scores(
  model, tokenizer, *, length: int = 512, count: int = 16, span: int = 2
) -> np.ndarray:
  """HeadKV head importance ``[L, G]`` (KV-head layout: the mean over each query group).

  A named variant of the retrieval-head test (Wu et al. 2024, which HeadKV's scores come from):
  on single-needle examples, a head's score is its attention mass, at the query that emits the
  answer, within ``span`` tokens of the needle's value. The original counts a hit only when the
  head's top key *is* the copied token; the tiny model reads the value from the token after it
  (a previous-token composition), so the exact test scores every head zero.
  """
  cfg = model.cfg
  exs = examples("single_needle", tokenizer, length, count, {}, seed=7)
  prompts = np.stack([e.prompt for e in exs])
  request = policies.EvidenceRequest(window=1)
  pre = km.prefill(cfg, model.params(), prompts, np.ones_like(prompts), request)
  row_LBHT = np.asarray(pre.attn_window[..., -1, :])
  at_B = np.asarray([e.needle_at[0] for e in exs])
  near_BT = np.abs(np.arange(length)[None, :] - at_B[:, None]) <= span
  mass_LH = (row_LBHT * near_BT[None, :, None, :]).sum(-1).mean(1)
  return mass_LH.reshape(cfg.num_layers, cfg.num_kv_heads, cfg.num_groups).mean(-1)


def full_cache_scores(model, tokenizer, lengths, count: int, task_options: dict, seed: int = 1):
  """``{"accuracy": {length: {task: score}}, "recall": {...}}`` with the full cache on ``count``
  held-out examples each (``recall``: RULER's partial-credit ``string_match_all``)."""
  out = {"accuracy": {}, "recall": {}}
  for length in lengths:
    for metric in out.values():
      metric[str(length)] = {}
    for task, opts in task_options.items():
      exs = examples(task, tokenizer, length, count, dict(opts), seed=seed)
      oks, found = [], []
      for start in range(0, count, 8):  # batches of 8 bound memory at long contexts
        part = exs[start : start + 8]
        P, A, S = tasks.batch(part)
        question = answers_lib.Question(answer_given=~S)
        ans = answers_lib.answer_configs(model, P, A, np.array([1]), policy=FULL, question=question)
        oks.append(accuracy(part, ans.predicted[0]))
        found.append(recall(part, ans.predicted[0]))
      out["accuracy"][str(length)][task] = float(np.concatenate(oks).mean())
      out["recall"][str(length)][task] = float(np.concatenate(found).mean())
  return out


# the full cache: every policy's reference row, labelled report.FULL in the tables
FULL = policies.make("full")


def policy_entry(entry) -> tuple[str, policies.Policy]:
  """A config's policy entry ``{"label": ..., "policy": name, **options}`` as ``(label,
  policy)``, the policy built (and its options validated) once."""
  entry = dict(entry)
  label = entry.pop("label")
  return label, policies.make(entry.pop("policy"), **entry)


def prefill_examples(
  model,
  exs,
  *,
  question="in_window",
  window=policies.DEFAULT_WINDOW,
  oracle=True,
  shape=None,
  needs=(),
) -> answers_lib.Prefilled:
  """The examples' one prefill, shared by every policy and budget that answers them
  (:func:`kvjax.model.answers.prefill_answers`). ``shape = (question_len, answer_len)`` feeds
  that many trailing prompt tokens through the cache and pads answers to that length (see
  :func:`shared_shape`); by default the examples' own longest question and answer. ``needs``:
  the further prefill evidence the policies read
  (:func:`kvjax.eval.evidence_sources.policy_needs`)."""
  q_len, n_len = shape or (max(e.question_len for e in exs), None)
  prompts, answers, scored = tasks.batch(exs, answer_len=n_len)
  return answers_lib.prefill_answers(
    model,
    prompts,
    answers,
    # given tokens and padding are fed, never scored
    question=answers_lib.Question(q_len, question, answer_given=~scored),
    window=window,
    oracle=oracle,
    needs=tuple(sorted(set(needs) & set(PREFILL_EVIDENCE))),
  )


def shared_shape(example_sets) -> tuple[int, int]:
  """``(question_len, answer_len)`` covering every set of examples: with it, every task at one
  context length has the same shapes, so each policy compiles once for all of them (instead of
  once per task). A named variant of the protocol: a task whose question is shorter than the
  longest feeds that many more trailing context tokens through the cache uncompressed (they are
  kept, like the question), and its answer is padded (padding is fed, never scored)."""
  q = max(e.question_len for exs in example_sets for e in exs)
  n = max(e.answer.size for exs in example_sets for e in exs)
  return q, n


def policy_window(entries) -> int:
  """The observation window a shared prefill keeps for the ``(label, policy)`` entries.

  Args:
    entries: the ``(label, policy)`` pairs one prefill serves.

  Returns:
    The most window rows any of the policies reads (the reference's by default).
  """
  return max([policies.DEFAULT_WINDOW, *(policy.observation_window for _, policy in entries)])


@dataclasses.dataclass(frozen=True)
class Shared:
  """What every policy answering one batch of examples shares.

  Attributes:
    prefilled: the examples' one prefill (:func:`prefill_examples`).
    full: the full cache's answers from it (the ``"answers"`` of :func:`evaluate_group` under
      :data:`FULL`), the reference of each row's KL; ``None``: KL is NaN.
  """

  prefilled: answers_lib.Prefilled
  full: answers_lib.Answers | None = None


def evaluate_group(
  model,
  exs,
  budgets,
  policy: policies.Policy,
  shared: Shared | None = None,
  *,
  evidence=None,
  timings=None,
) -> dict:
  """One (task, length, policy) group: per-budget accuracy and KL.

  Args:
    model: the model.
    exs: the group's examples (one batch of them).
    budgets: the token budgets, or a :class:`kvjax.model.Ratio` of kvpress compression ratios
      of the compressed context, all answered by one compiled program; each row then holds its
      ratio and the token budget it kept (:func:`kvjax.model.answers.budgets_of`).
    policy: the policy.
    shared: the examples' prefill and the full cache's answers (:class:`Shared`); ``None``: a
      prefill of the group's own, the question in the observation window
      (:func:`prefill_examples`' defaults), and no KL.
    evidence: the caller-given evidence fields (calibration, KVzip's reconstruction attention,
      HeadKV's ``head_scores_LH``); the policy gets those it reads.
    timings: a dict that gets the seconds of the compression and of the answers added
      (:func:`kvjax.model.answers.answer_prefilled`).

  Returns:
    ``{"rows": one row per budget, "answers": the answers, "scored": scored answer tokens}``.

  Raises:
    ValueError: for no budget, and as :func:`kvjax.model.answers.answer_prefilled`.
  """
  budgets, ratios = km.decoding.split_ratio(budgets)
  if ratios is None and len(budgets) == 0:
    raise ValueError(f"budgets: no budget to evaluate for policy {policy.label!r}")
  prefilled, full = (None, None) if shared is None else (shared.prefilled, shared.full)
  n_len = None
  if prefilled is not None:  # answers as wide as the prefill's (see prefill_examples)
    n_len = prefilled.inputs_BM.shape[1] - prefilled.question_len + 1
  _, answers, scored = tasks.batch(exs, answer_len=n_len)
  if prefilled is None:
    window = policy_window([("", policy)])
    prefilled = prefill_examples(model, exs, window=window, oracle=policy.reads_future)
  reads = policy.evidence_fields | restorekv.fields_read(policy)
  given = {k: v for k, v in (evidence or {}).items() if k in reads}
  budgets_K, ratios_K = answers_lib.budgets_of(
    policy, budgets, ratios, prefilled.pre.valid.shape[1]
  )
  out = answers_lib.answer_prefilled(
    model, prefilled, budgets_K, policy=policy, evidence=given or None, timings=timings
  )
  rows = []
  for c, b in enumerate(np.asarray(budgets_K)):
    ok, found = accuracy(exs, out.predicted[c]), recall(exs, out.predicted[c])
    kl = kl_divergence(full.logprobs[0], out.logprobs[c], scored) if full is not None else np.nan
    # per scored token (mqar's per-query accuracy, as Zoology reports it)
    tokens = float((out.predicted[c] == answers)[scored].mean())
    rows.append(
      dict(
        budget=int(b),
        ratio=np.nan if ratios_K is None else float(ratios_K[c]),
        accuracy=float(ok.mean()),
        recall=float(found.mean()),
        token_accuracy=tokens,
        kl=kl,
        n=len(exs),
        # per example: every example of a group has the same context, so the same full cache
        kv_bytes_held=float(out.kv_bytes_held[c]) / len(exs),
        kv_fraction=float(out.kv_bytes_held[c]) / out.full_cache_bytes,
        example_correct=np.asarray(ok, bool),
        example_recall=np.asarray(found, float),
      )
    )
  return {"rows": rows, "answers": out, "scored": int(scored.sum())}


def merge_batches(parts: list[dict]) -> list[dict]:
  """One group's rows from its example batches (:func:`evaluate_group` results): accuracy,
  recall and memory weighted by examples, token accuracy and KL by scored answer tokens, the
  per-example outcomes concatenated in order, so the rows equal those of one batch of all the
  examples."""
  tokens = np.asarray([p["scored"] for p in parts], float)
  by_examples = ("accuracy", "recall", "kv_bytes_held", "kv_fraction")
  rows = []
  for per_batch in zip(*(p["rows"] for p in parts), strict=True):
    n = np.asarray([r["n"] for r in per_batch], float)
    row = dict(per_batch[0], n=int(n.sum()))
    weights = [(key, n) for key in by_examples] + [("token_accuracy", tokens), ("kl", tokens)]
    for key, weight in weights:
      row[key] = float(np.dot([r[key] for r in per_batch], weight) / weight.sum())
    for key in ("example_correct", "example_recall"):
      row[key] = np.concatenate([r[key] for r in per_batch])
    rows.append(row)
  return rows


def finish_row(row: dict) -> dict:
  """A merged row as ``results.csv`` holds it: accuracy's Wilson interval and recall's seeded
  bootstrap interval (:mod:`kvjax.eval.stats`) from the per-example outcomes, which are written
  as space-separated values in example order (:func:`kvjax.eval.report.per_example` reads
  them back).

  Args:
    row: a row of :func:`merge_batches` (its ``example_correct`` and ``example_recall`` arrays).

  Returns:
    The row with ``accuracy_lo``/``accuracy_hi``, ``recall_lo``/``recall_hi`` and the outcomes
    as text.
  """
  correct = np.asarray(row["example_correct"], bool)
  found = np.asarray(row["example_recall"], float)
  acc_lo, acc_hi = stats.wilson_interval(int(correct.sum()), correct.size)
  rec_lo, rec_hi = stats.bootstrap_interval([found])
  return row | dict(
    accuracy_lo=acc_lo,
    accuracy_hi=acc_hi,
    recall_lo=rec_lo,
    recall_hi=rec_hi,
    example_correct=" ".join("1" if c else "0" for c in correct),
    # string_match_all's fractions k / needles: 6 significant digits hold them exactly enough
    example_recall=" ".join(f"{v:.6g}" for v in found),
  )


def example_batches(exs: list, size: int | None) -> list[list]:
  """``exs`` in consecutive batches of ``size`` examples (``None``: one batch)."""
  size = size or len(exs)
  return [exs[i : i + size] for i in range(0, len(exs), size)]
