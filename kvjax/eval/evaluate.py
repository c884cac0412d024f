"""Accuracy against budget on the task suite, for every policy, with a real model and cache.

For each (task, context length) a fixed set of held-out examples is prefilled once for every
policy, ``batch`` examples at a time (all at once by default), and answered under every budget of
the grid at once (:func:`kvjax.model.answers.answer_prefilled`: compress and decode vmapped over
budgets), or under every kvpress compression ratio of ``config.ratios`` (each row holds its
ratio and the token budget it kept).
Each (task, length, policy) group appends its rows to ``results.csv`` as soon as its last batch
is done; a rerun skips the groups already there (like sweeps).
Besides accuracy, each row carries the teacher-forced next-token KL divergence between the full and
the compressed cache, ``KL(p_full || p_compressed)`` averaged over the scored answer tokens; the
K/V bytes the compressed context cache really held (counted from the cache, so a policy keeping
whole heads or layers shows what it kept, not its nominal budget) and their fraction of the full
cache's; 95 % intervals of accuracy (Wilson) and recall (seeded bootstrap,
:mod:`kvjax.eval.stats`); and every example's outcome, in order, so that the tables can pair
policies on the same examples.

The needle heatmap (accuracy over depth x context length, the PyramidKV and SnapKV papers'
figure) comes from the same machinery with ``depth`` fixed per cell. ``tables.md`` beside the
results holds their markdown tables (:mod:`kvjax.eval.report`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import pathlib
import time

import numpy as np
import pandas as pd

from kvjax import distributed, plotting, policies, rundir
from kvjax import model as km
from kvjax.eval import report, ruler, stats, tasks
from kvjax.model import answers as answers_lib
from kvjax.model import assets, calibrate, restorekv
from kvjax.model.tokenizer import HFTokenizer, PieceTokenizer
from kvjax.policies import evidence as evidence_lib

EVAL_SEED = 2**31  # training draws example seeds below 2**31: evaluation seeds never collide


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
        ans = answers_lib.answer_configs(model, P, A, np.array([1]), policy=FULL, answer_given=~S)
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
  the further prefill evidence the policies read (:func:`policy_needs`)."""
  q_len, n_len = shape or (max(e.question_len for e in exs), None)
  prompts, answers, scored = tasks.batch(exs, answer_len=n_len)
  return answers_lib.prefill_answers(
    model,
    prompts,
    answers,
    question_len=q_len,
    question=question,
    answer_given=~scored,  # given tokens and padding are fed, never scored
    window=window,
    oracle=oracle,
    needs=tuple(sorted(set(needs) & set(PREFILL_EVIDENCE))),
  )


# evidence beyond the prompt's attention and keys: computed by the prefill on request, measured
# once per run from the model (kvjax.model.calibrate, saved by experiments.calibrate), or per
# example by KVzip's second pass over the context
PREFILL_EVIDENCE = (
  "value_out_norms_LHT",
  "query_mean_LHD",
  "query_cov_LHDD",
  "window_queries_LHWD",
  "prerope_keys_LGTD",
  "queries_LHTD",
)
# the kinds a calibration file holds (declared with source="calibration")
CALIBRATION_EVIDENCE = evidence_lib.KindIndex(lambda k: k.source == "calibration", lambda k: k.doc)
CONTEXT_EVIDENCE = ("reconstruction_attn_LGT",)
# learned evidence: a trained model's file (the config field its kind names) applied to each
# batch's context; RestoreKV's adapter gives restore tokens rather than a kind of evidence
LEARNED_EVIDENCE = evidence_lib.KindIndex(lambda k: k.resource is not None, lambda k: k.resource)
RESTORE_RESOURCE = {restorekv.KEYS: "restorekv"}  # and restorekv.VALUES, from the same adapter


def _learned_fields() -> dict:
  """``{field: config field}`` of every learned kind and RestoreKV's restore tokens."""
  return {**LEARNED_EVIDENCE, **RESTORE_RESOURCE}


def load_learned(config, needs, cfg) -> dict:
  """The trained surrogates the policies read, loaded from the config's files: ``kvzap`` (a
  KVzap surrogate, ``python -m experiments.kvzap``), ``fastkvzip`` (Fast KVzip's gates,
  ``python -m experiments.fastkvzip``) and ``restorekv`` (RestoreKV's adapter,
  ``python -m experiments.restorekv``), checked against the model; ``{}`` when none is read.

  Args:
    config: the evaluation config.
    needs: the evidence fields the policies read.
    cfg: the model's config.

  Returns:
    ``{"kvzap": surrogate, "fastkvzip": gates, "restorekv": adapter}`` for the ones needed.

  Raises:
    ValueError: naming the field, for a missing or unreadable file, or one trained for
      another model.
  """
  loaders = {k.resource: k.load for k in evidence_lib.evidence_kinds().values() if k.resource}
  loaders["restorekv"] = restorekv.load
  return {name: loaders[name](path, cfg)[0] for name, path in learned_paths(config, needs).items()}


def learned_paths(config, needs) -> dict:
  """The trained files the policies read (:data:`LEARNED_EVIDENCE`), checked to exist.

  Args:
    config: the evaluation config.
    needs: the evidence fields the policies read.

  Returns:
    ``{name: path}`` for the ones needed.

  Raises:
    ValueError: naming the config field, for a missing file.
  """
  out = {}
  for field, name in _learned_fields().items():
    if field not in needs:
      continue
    path = config.get(name)
    if not path or not pathlib.Path(path).is_file():
      raise ValueError(
        f"{name}: policies read {field}, from a trained file; run `python -m experiments.{name}` "
        f"and pass --config.{name}=DIR/<file>.npz (got {path!r})"
      )
    out[name] = path
  return out


def policy_needs(entries) -> set[str]:
  """The :class:`kvjax.policies.Evidence` fields the ``(label, policy)`` entries read, and
  RestoreKV's restore tokens (:func:`kvjax.model.restorekv.fields_read`)."""
  return set().union(
    *(policy.evidence_fields | restorekv.fields_read(policy) for _, policy in entries)
  )


def load_calibration(config, needs) -> dict:
  """``qfilters_LGD`` / ``retrieval_heads_LG`` / ExpectedAttentionStats' query statistics from
  ``config.calibration`` (the ``calibration.npz`` that ``python -m experiments.calibrate``
  writes; DuoAttention's gates of ``config.duo_method``), for the policies that read them; ``{}``
  when none does."""
  wanted = sorted(set(needs) & set(CALIBRATION_EVIDENCE))
  if not wanted:
    return {}
  path = config.get("calibration")
  if not path or not pathlib.Path(path).is_file():
    raise ValueError(
      f"calibration: policies read {wanted}, measured from the model; run `python -m "
      f"experiments.calibrate --config=configs/calibrate.py` and pass "
      f"--config.calibration=DIR/calibration.npz (got {path!r})"
    )
  names = {
    "qfilters_LGD": "qfilters_LGD",
    "retrieval_heads_LG": f"retrieval_heads_LG_{config.get('duo_method', 'official')}",
    "stats_query_mean_LHD": "stats_query_mean_LHD",
    "stats_query_cov_LHDD": "stats_query_cov_LHDD",
  }
  try:
    data = np.load(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"calibration: {path} is not a calibration.npz ({e})") from None
  with data:
    absent = [names[w] for w in wanted if names[w] not in data.files]
    if absent:
      raise ValueError(f"calibration: {path} has no {absent}; it has {sorted(data.files)}")
    return {w: np.asarray(data[names[w]]) for w in wanted}


def check_calibration(calibration: dict, cfg, path) -> None:
  """``ValueError`` naming ``calibration`` when its arrays (:func:`load_calibration`) were
  measured on another model: ``qfilters_LGD`` must be ``[layers, KV heads, head_dim]``,
  ``retrieval_heads_LG`` ``[layers, KV heads]`` and the query statistics ``[layers, query
  heads, head_dim(, head_dim)]`` of ``cfg``."""
  L, G, D, Hq = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  shapes = {
    "qfilters_LGD": (L, G, D),
    "retrieval_heads_LG": (L, G),
    "stats_query_mean_LHD": (L, Hq, D),
    "stats_query_cov_LHDD": (L, Hq, D, D),
  }
  heads = {
    "qfilters_LGD": "layers, KV heads, head_dim",
    "retrieval_heads_LG": "layers, KV heads",
    "stats_query_mean_LHD": "layers, query heads, head_dim",
    "stats_query_cov_LHDD": "layers, query heads, head_dim, head_dim",
  }
  for name, value in calibration.items():
    if name in shapes and tuple(np.shape(value)) != shapes[name]:
      raise ValueError(
        f"calibration: {path} holds {name} of shape {tuple(np.shape(value))}, expected "
        f"{shapes[name]} ({heads[name]}) of "
        "the evaluated model; calibrate this model (python -m experiments.calibrate)"
      )


def kvzip_template(tok, model_name: str) -> calibrate.KVzipTemplate:
  """KVzip's "repeat the context" prompt in the model's ids (the tiny model's word vocabulary
  cannot spell it: filler words stand in, as in ``experiments.calibrate``)."""
  raw = getattr(tok, "tok", tok)
  if model_name == "tiny":
    first, later = (tuple(tasks.haystack_ids(raw, n, seed=99 + n)) for n in (6, 10))
    return calibrate.KVzipTemplate(first, later, suffix_ids=())
  return calibrate.kvzip_template(raw)


def context_evidence(model, exs, shape, template, needs, learned=None) -> dict:
  """The evidence computed from each batch's context columns (all but the fed question tail),
  ``[L, B, ...]``, for the policies that read it: KVzip's ``reconstruction_attn_LGT`` (its
  second pass), every kind whose declaration computes it (KVzap's ``kvzap_LGT`` and Fast
  KVzip's ``fastkvzip_LGT`` with the ``learned`` files of :func:`load_learned`, a kind declared
  outside kvjax with its own ``compute``), and RestoreKV's restore tokens after the context
  (``restore_keys_LGND``, ``restore_values_LGND``)."""
  computed = {
    name: kind
    for name, kind in evidence_lib.evidence_kinds().items()
    if name in needs and kind.compute is not None
  }
  wanted = set(needs) & ({"reconstruction_attn_LGT", *RESTORE_RESOURCE} | set(computed))
  if not wanted:
    return {}
  q_len = (shape or (max(e.question_len for e in exs), None))[0]
  prompts, _, _ = tasks.batch(exs)
  context = prompts[:, : prompts.shape[1] - q_len]
  cfg, params, out = model.cfg, model.params(), {}
  if "reconstruction_attn_LGT" in wanted:
    attn = calibrate.kvzip_evidence(cfg, params, context, template)
    out["reconstruction_attn_LGT"] = np.asarray(attn)
  mask = np.ones(context.shape, np.int32)
  for name, kind in computed.items():
    extra = () if kind.resource is None else (learned[kind.resource],)
    out[name] = np.asarray(kind.compute(model, context, mask, *extra), np.float32)
  if restorekv.KEYS in wanted:
    restored = restorekv.restore_evidence(cfg, params, learned["restorekv"], context)
    out.update({k: np.asarray(v) for k, v in restored.items()})
  return out


def shared_shape(example_sets) -> tuple[int, int]:
  """``(question_len, answer_len)`` covering every set of examples: with it, every task at one
  context length has the same shapes, so each policy compiles once for all of them (instead of
  once per task). A named variant of the protocol: a task whose question is shorter than the
  longest feeds that many more trailing context tokens through the cache uncompressed (they are
  kept, like the question), and its answer is padded (padding is fed, never scored)."""
  q = max(e.question_len for exs in example_sets for e in exs)
  n = max(e.answer.size for exs in example_sets for e in exs)
  return q, n


def _policy_window(entries) -> int:
  """The most window rows any of the policies reads (the reference's by default)."""
  return max([policies.DEFAULT_WINDOW, *(policy.observation_window for _, policy in entries)])


def _reads_head_scores(policy: policies.Policy) -> bool:
  return "head_scores_LH" in policy.evidence_fields


def _head_evidence(head) -> dict:
  """HeadKV's measured importances as caller-given evidence (once measured)."""
  return {} if head is None else {"head_scores_LH": head}


def evaluate_group(
  model,
  exs,
  budgets,
  policy: policies.Policy,
  *,
  full=None,
  question="in_window",
  prefilled=None,
  evidence=None,
  ratios=None,
) -> dict:
  """One (task, length, policy) group: per-budget accuracy and KL (``question``: see
  :func:`kvjax.model.answer_configs`), answered from ``prefilled`` (:func:`prefill_examples`)
  when given, else from a prefill of its own. ``evidence``: the caller-given evidence fields
  (calibration, KVzip's reconstruction attention, HeadKV's ``head_scores_LH``); the policy
  gets those it reads. ``ratios`` (with ``budgets=None``): kvpress compression ratios of the
  compressed context instead of token budgets, all answered by one compiled program; each row
  holds its ratio and the token budget it kept (:func:`kvjax.model.answers.budgets_of`)."""
  if ratios is None and len(budgets) == 0:
    raise ValueError(f"budgets: no budget to evaluate for policy {policy.label!r}")
  n_len = None
  if prefilled is not None:  # answers as wide as the prefill's (see prefill_examples)
    n_len = prefilled.inputs_BM.shape[1] - prefilled.question_len + 1
  _, answers, scored = tasks.batch(exs, answer_len=n_len)
  if prefilled is None:
    window = _policy_window([("", policy)])
    prefilled = prefill_examples(
      model, exs, question=question, window=window, oracle=policy.reads_future
    )
  reads = policy.evidence_fields | restorekv.fields_read(policy)
  given = {k: v for k, v in (evidence or {}).items() if k in reads}
  budgets_K, ratios_K = answers_lib.budgets_of(
    policy, budgets, ratios, prefilled.pre.valid.shape[1]
  )
  out = answers_lib.answer_prefilled(
    model, prefilled, budgets_K, policy=policy, evidence=given or None
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


def _model_fingerprint(name: str) -> str:
  """What identifies the evaluated weights: the shipped model's file hash (it changes when the
  model is retrained), else the name."""
  if name == "tiny":
    data = (assets.tiny_path() / "model.safetensors").read_bytes()
    return "tiny:" + hashlib.sha256(data).hexdigest()[:16]
  if name == assets.SMOLLM2:
    return f"{name}:{assets.SMOLLM2_FILE}"
  return name


def complete_groups(table: pd.DataFrame, path: pathlib.Path, expected: dict) -> set:
  """Groups ``(task, length, policy, kind, question)`` with all their rows; rows of a group cut
  by an interruption are dropped from the file (and the group reruns), so nothing is lost or
  doubled."""
  if table.empty:
    return set()
  keys = list(zip(*(table[c] for c in GROUP_COLUMNS), strict=True))
  counts = pd.Series(keys).value_counts().to_dict()
  done = {k for k, n in counts.items() if n == expected.get(k, 1)}
  if len(done) < len(counts):
    keep = [k in done for k in keys]
    rundir.write_rows(path, table[keep])
  return done


GROUP_COLUMNS = ["task", "length", "policy", "kind", "question"]
# what each row adds to a plain accuracy: memory held, intervals and per-example outcomes
MEMORY_COLUMNS = ["kv_bytes_held", "kv_fraction"]
INTERVAL_COLUMNS = ["accuracy_lo", "accuracy_hi", "recall_lo", "recall_hi"]
EXAMPLE_COLUMNS = ["example_correct", "example_recall"]
COLUMNS = [
  *GROUP_COLUMNS,
  "depth",
  "budget",
  "ratio",
  "accuracy",
  "recall",
  "token_accuracy",
  "kl",
  "n",
  *MEMORY_COLUMNS,
  *INTERVAL_COLUMNS,
  *EXAMPLE_COLUMNS,
  "seconds",
]


def check_results_columns(path: pathlib.Path) -> None:
  """Refuses, before the workdir's claim is touched, a ``results.csv`` whose header is not
  :data:`COLUMNS` (in any order): its rows cannot be resumed beside new ones (an older file
  lacks the memory held and the per-example outcomes, which only a rerun measures), so they are
  never mixed.

  Args:
    path: the results file (absent or empty: nothing to check).

  Raises:
    ValueError: naming ``workdir``, the columns missing and those unexpected.
  """
  if not rundir.holds_data(path):
    return
  with path.open(errors="replace") as f:
    header = f.readline()
  if not header.endswith("\n"):  # a header cut by a kill: rundir's readers judge it
    return
  found = next(csv.reader([header.rstrip("\r\n")]), [])
  missing = [c for c in COLUMNS if c not in found]
  extra = [c for c in found if c not in COLUMNS]
  if missing or extra:
    raise ValueError(
      f"workdir: {path} lacks the columns {missing}"
      + (f" and has {extra}" if extra else "")
      + f"; expected {COLUMNS} (written by another kvjax version: memory held and per-example "
      "outcomes need a rerun, so its rows are not resumed beside new ones); use a fresh workdir"
    )


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
# cache holds compiled programs, the reference policy only marks the tables. Everything else, model weights included, is the run's identity.
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
  entries = [policy_entry(e) for e in config.policies]
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
  another model or a length too short for a task fails with nothing written."""
  model, cfg, tok = load_model(config.model)
  entries = [policy_entry(e) for e in config.policies]
  needs = policy_needs(entries)
  calibration = load_calibration(config, needs)
  check_calibration(calibration, cfg, config.get("calibration"))
  learned = load_learned(config, needs, cfg)
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
  check_ratios_fit(config, entries, sets)
  return Prepared(model, cfg, tok, calibration, template, sets, heatmap, learned)


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
  shapes = {}
  for (task, length), exs in sets.items():
    if config.get("shared_shapes", False):
      if length not in shapes:
        shapes[length] = shared_shape([e for (_, n), e in sets.items() if n == length])
      q_len = shapes[length][0]
    else:
      q_len = max(e.question_len for e in exs)
    for label, policy in entries:
      if not policy.requires_budget:
        continue
      try:
        answers_lib.budgets_of(policy, None, ratios, length - q_len)
      except ValueError as e:
        raise ValueError(f"{e} (policy {label!r}, task {task!r} at {length} tokens)") from None


def run(config, workdir, *, log=print) -> pd.DataFrame:
  """Runs (or resumes) the evaluation ``config`` into ``workdir``; returns ``results.csv``.

  The config is validated, ``workdir`` checked (:func:`kvjax.rundir.check_workdir`: never
  empty) and the model loaded with every example drawn (:func:`prepare`) before anything is
  written; the run then holds the workdir's lock (:func:`kvjax.rundir.lock`), so a second run
  into the same directory refuses. ``eval.json`` records the config: a resume must agree with
  it outside :data:`NOT_IDENTITY`, and results without it are refused (:func:`kvjax.rundir.claim`).

  In a run of several processes (:func:`kvjax.distributed.maybe_initialize`) every process calls
  this with the same arguments: process 0 alone touches ``workdir`` (lock, claim, rows, tables,
  figures) and tells the others which groups are left; each (task, length, question) group's
  policies are split among the processes (:func:`kvjax.distributed.share`), each prefilling the
  group's examples once for its share; the finished rows are gathered and process 0 appends them
  in the one-process order, so ``results.csv`` equals a one-process run's but for the
  ``seconds`` column. Every process returns the whole table. A process that dies makes the
  others raise :class:`kvjax.distributed.PeerFailedError` at their next gather; the rows written
  so far stay, and the same command resumes."""
  validate_config(config)
  rundir.check_workdir(workdir)
  prepared = prepare(config)
  if distributed.process_count() == 1:
    with rundir.lock(workdir):
      return _run(config, workdir, prepared, log)
  if not distributed.is_primary():  # one log: process 0's
    log = _quiet
  with contextlib.ExitStack() as stack:
    distributed.on_primary(
      lambda: bool(stack.enter_context(rundir.lock(workdir))), "locking the run directory"
    )
    return _run(config, workdir, prepared, log)


def _quiet(*args, **kwargs) -> None:
  """A log that prints nothing (the processes other than process 0)."""


def _claim_and_read(config, workdir, expected: dict) -> list:
  """Claims ``workdir`` for ``config`` and reads which groups its ``results.csv`` completes
  (process 0's work), as JSON-able keys."""
  path = pathlib.Path(workdir) / "results.csv"
  check_results_columns(path)
  record = {k: config[k] for k in config if k != "workdir"}  # where is not what
  sig = rundir.signature(record | {"weights": _model_fingerprint(config.model)})
  has_results = rundir.holds_data(path)
  rundir.claim(workdir, "eval.json", sig, has_results=has_results, not_identity=NOT_IDENTITY)
  # the outcomes as written (one example's "1" is no number to round-trip)
  table = rundir.read_rows(path, dtype=dict.fromkeys(EXAMPLE_COLUMNS, str), columns=COLUMNS)
  if not table.empty and list(table.columns) != COLUMNS:
    raise ValueError(
      f"workdir: {path} has the columns {list(table.columns)}, expected {COLUMNS} (written by "
      "another kvjax version); use a fresh workdir"
    )
  return sorted(list(k) for k in complete_groups(table, path, expected))


def _to_json(part: dict) -> dict:
  """A batch's :func:`evaluate_group` result as :func:`merge_batches` reads it, JSON-able."""
  rows = [
    {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in r.items()} for r in part["rows"]
  ]
  return {"rows": rows, "scored": part["scored"]}


def _from_json(part: dict) -> dict:
  arrays = {"example_correct": bool, "example_recall": float}
  rows = [r | {k: np.asarray(r[k], t) for k, t in arrays.items()} for r in part["rows"]]
  return {"rows": rows, "scored": part["scored"]}


def gathered_groups(parts: dict, seconds: dict) -> tuple[dict, dict]:
  """Every process's finished groups of one (task, length, question), on every process.

  Args:
    parts: this process's ``{label: [evaluate_group result per example batch]}``.
    seconds: this process's ``{label: seconds}``.

  Returns:
    ``(parts, seconds)`` of every process's labels (this process's own in a one-process run).
  """
  if distributed.process_count() == 1:
    return parts, seconds
  mine = {label: ([_to_json(p) for p in ps], seconds[label]) for label, ps in parts.items()}
  everyone = {}
  for share in distributed.gather_json(mine, "gathering the evaluated groups"):
    everyone.update(share)
  return (
    {label: [_from_json(p) for p in ps] for label, (ps, _) in everyone.items()},
    {label: s for label, (_, s) in everyone.items()},
  )


def _run(config, workdir, prepared: Prepared, log) -> pd.DataFrame:
  path = pathlib.Path(workdir) / "results.csv"
  primary = distributed.is_primary()
  entries = [policy_entry(e) for e in config.policies]
  everyone = [(report.FULL, FULL), *entries]
  modes = question_modes(config)
  ratios = config_ratios(config)
  groups = {}  # (task, length, label, kind, question) -> budgets (or ratios)
  for task in config.tasks:
    for length in config.lengths:
      for label, policy in everyone:
        budgets = [b for b in config.budgets if b < length] if policy.requires_budget else [length]
        if ratios and policy.requires_budget:
          budgets = list(ratios)
        for q in modes:
          groups[(task, length, label, "budget", q)] = budgets
  expected = {k: len(v) for k, v in groups.items()}
  done = distributed.on_primary(
    lambda: _claim_and_read(config, workdir, expected), "claiming the run directory"
  )
  done = {tuple(k) for k in done}
  model, tok, sets = prepared.model, prepared.tokenizer, prepared.sets
  calibration, template = prepared.calibration, prepared.template
  window = _policy_window(entries)
  oracle = any(policy.reads_future for _, policy in entries)
  needs = policy_needs(entries)
  head = None  # HeadKV's retrieval-head scores, measured once per run
  shapes = {
    length: shared_shape([exs for (_, n), exs in sets.items() if n == length])
    if config.get("shared_shapes", False)
    else None
    for length in config.lengths
  }
  for task in config.tasks:
    for length in config.lengths:
      for q in modes:
        todo = [e for e in everyone if (task, length, e[0], "budget", q) not in done]
        if not todo:
          continue
        mine = [todo[i] for i in distributed.share(todo)]  # every one in one process
        batches = example_batches(sets[(task, length)], config.get("batch"))
        parts = {label: [] for label, _ in mine}
        seconds = dict.fromkeys(parts, 0.0)
        for exs in batches:
          t0 = time.time()  # one prefill per example for every policy, timed with the first
          prefilled = prefill_examples(
            model,
            exs,
            question=q,
            window=window,
            oracle=oracle,
            shape=shapes[length],
            needs=needs,
          )
          evidence = calibration | context_evidence(
            model, exs, shapes[length], template, needs, prepared.learned
          )
          full = evaluate_group(model, exs, [length], FULL, prefilled=prefilled)
          for label, policy in mine:
            if _reads_head_scores(policy) and head is None:
              head = head_retrieval_scores(model, tok)
            if policy is FULL:  # its own reference: KL exactly 0; nothing removed
              removed = {"ratio": 0.0} if ratios else {}
              res = full | {"rows": [r | {"kl": 0.0} | removed for r in full["rows"]]}
            else:
              values = groups[(task, length, label, "budget", q)]
              by_ratio = bool(ratios) and policy.requires_budget
              res = evaluate_group(
                model,
                exs,
                None if by_ratio else values,
                policy,
                full=full["answers"],
                prefilled=prefilled,
                evidence=evidence | _head_evidence(head),
                ratios=values if by_ratio else None,
              )
            parts[label].append(res)
            seconds[label] += time.time() - t0
            t0 = time.time()
        parts, seconds = gathered_groups(parts, seconds)
        if primary:  # the groups are complete: appended at once, in the one-process order
          for label, _ in todo:
            _append_group(path, (task, length, label, q), parts[label], seconds[label], log)
        distributed.fault_point()  # after each group's rows: the tests kill here

  def finish():  # process 0: the heatmap's rows, the tables and the figures; then the rows
    _finish(config, prepared, path, done, head, log, modes, ratios)
    return None if distributed.process_count() == 1 else path.read_text()

  text = distributed.on_primary(finish, "writing the heatmap, tables and figures")
  dtype = dict.fromkeys(EXAMPLE_COLUMNS, str)
  if primary:
    return rundir.read_rows(path, dtype=dtype)
  return pd.read_csv(io.StringIO(text), dtype=dtype)  # process 0's table is every process's


def _finish(config, prepared, path, done, head, log, modes, ratios) -> None:
  """The heatmap's rows, then ``tables.md`` and the figures from ``results.csv`` (process 0)."""
  out = pathlib.Path(path).parent
  calibration, template = prepared.calibration, prepared.template
  evidence = dict(calibration=calibration, template=template, learned=prepared.learned)
  _heatmap(config, prepared, path, done, head, log, evidence)
  table = rundir.read_rows(path, dtype=dict.fromkeys(EXAMPLE_COLUMNS, str))
  for q in modes:
    suffix = "" if len(modes) == 1 else f"_{q}"
    rows = table[table["question"] == q]
    plotting.accuracy_figures(rows, out, suffix=suffix, summaries=report.plot_summaries(rows))
  tables = report.markdown(ratio_view(table), reference=config.get("reference"))
  if ratios:
    tables = tables.replace(" vs budget, ", " vs compression ratio, ")
  (out / "tables.md").write_text(tables)


def ratio_view(table: pd.DataFrame) -> pd.DataFrame:
  """The results with each ratio row's ``budget`` replaced by its compression ratio, so that the
  tables of :mod:`kvjax.eval.report`, which pivot on ``budget``, have one column per ratio
  (a ratio's token budget differs per context length; its mean over lengths would not be one
  column). Rows without a ratio, and the full cache's, are as written.

  Args:
    table: the results (:data:`COLUMNS`).

  Returns:
    A copy, or ``table`` itself when no row has a ratio.
  """
  if "ratio" not in table.columns:
    return table
  mine = table["ratio"].notna() & (table["policy"] != report.FULL)
  if not mine.any():
    return table
  out = table.copy()
  out["budget"] = out["budget"].astype(float)
  out.loc[mine, "budget"] = out.loc[mine, "ratio"]
  return out


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


def _ordered(row: dict) -> dict:
  """A row's fields in :data:`COLUMNS`' order (a file's header is its first rows')."""
  return {c: row[c] for c in COLUMNS}


def _append_group(path, key, parts: list[dict], seconds: float, log) -> None:
  """Appends one complete (task, length, policy, question) group's rows and logs them."""
  task, length, label, q = key
  rows = [finish_row(r) for r in merge_batches(parts)]
  meta = dict(task=task, length=length, policy=label, kind="budget", question=q, depth=np.nan)
  rundir.append_rows(path, [_ordered(meta | r | {"seconds": round(seconds, 2)}) for r in rows])
  log(
    f"{task:18s} {length:5d} {q:9s} {label:16s} "
    + " ".join(f"{_axis(r)}:{r['accuracy']:.2f}" for r in rows)
  )


def _axis(row: dict) -> str:
  """A row's budget as the log shows it: ``r=0.5`` for a ratio, else the token count."""
  return f"r={row['ratio']:g}" if np.isfinite(row.get("ratio", np.nan)) else str(row["budget"])


def _heatmap(config, prepared: Prepared, path, done, head, log, data):
  """Needle accuracy over depth x length for each heatmap policy at one budget (in the config's
  first question mode), on the examples :func:`prepare` drew."""
  model, tok = prepared.model, prepared.tokenizer
  h = config.heatmap
  if not h.policies:
    return head
  q = question_modes(config)[0]
  entries = dict(policy_entry(e) for e in config.policies)
  for length in h.lengths:
    for d in h.depths:
      kind = f"heatmap@{d:g}"
      cells = [
        label
        for label in [report.FULL, *h.policies]
        if (h.task, length, label, kind, q) not in done
      ]
      if not cells:
        continue
      exs = prepared.heatmap[(length, d)]
      chosen = [(label, FULL if label == report.FULL else entries[label]) for label in cells]
      needs = policy_needs(chosen)
      prefilled = prefill_examples(
        model,
        exs,
        question=q,
        window=_policy_window(chosen),
        oracle=any(policy.reads_future for _, policy in chosen),
        needs=needs,
      )
      evidence = data["calibration"] | context_evidence(
        model, exs, None, data["template"], needs, data["learned"]
      )
      for label, policy in chosen:
        budget = h.budget if policy.requires_budget else length
        if _reads_head_scores(policy) and head is None:
          head = head_retrieval_scores(model, tok)
        res = evaluate_group(
          model,
          exs,
          [budget],
          policy,
          prefilled=prefilled,
          evidence=evidence | _head_evidence(head),
        )
        (r,) = res["rows"]
        meta = dict(task=h.task, length=length, policy=label, kind=kind, question=q, depth=d)
        row = meta | finish_row(r)
        rundir.append_rows(path, [_ordered(row | {"seconds": 0.0})])
      log(f"heatmap length {length} depth {d:g}: done")
  return head
