"""The evaluation's run loop: :func:`run` claims the workdir, answers every (task, length,
question) group's examples under every policy (:func:`kvjax.eval.grouping.evaluate_group`),
appends each group's rows to ``results.csv`` as soon as it is complete (:data:`COLUMNS`; a rerun
skips the groups already there, :func:`complete_groups`), then writes the needle heatmap's rows,
``tables.md`` and the figures. In a run of several processes the groups' policies are shared
among them and their rows gathered (:func:`gathered_groups`).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import pathlib
import time

import jax
import numpy as np
import pandas as pd

from kvjax import distributed, plotting, policies, rundir
from kvjax.eval import report
from kvjax.eval.evidence_sources import context_evidence, policy_needs
from kvjax.eval.grouping import (
  FULL,
  Shared,
  evaluate_group,
  example_batches,
  finish_row,
  head_retrieval_scores,
  merge_batches,
  policy_window,
  prefill_examples,
)
from kvjax.eval.run_setup import (
  NOT_IDENTITY,
  Prepared,
  config_entries,
  config_ratios,
  length_shapes,
  prepare,
  question_modes,
  validate_config,
)
from kvjax.model import Ratio, assets


def _measured_head(policy: policies.Policy, head, prepared: Prepared):
  """HeadKV's retrieval-head scores once a policy reads them: ``head`` when measured already
  (once per run), else measured now for a policy that reads them, else ``None``."""
  if "head_scores_LH" in policy.evidence_fields and head is None:
    return head_retrieval_scores(prepared.model, prepared.tokenizer)
  return head


def _head_evidence(head) -> dict:
  """HeadKV's measured importances as caller-given evidence (once measured)."""
  return {} if head is None else {"head_scores_LH": head}


def _prefilled(prepared: Prepared, exs, entries, question: str, shape=None) -> tuple:
  """``(prefilled, evidence)``: the examples' one prefill for every policy of ``entries``
  (:func:`kvjax.eval.grouping.prefill_examples`, with the widest window and the further evidence
  they read) and the caller-given evidence they read: the calibration and what is computed from
  the batch's context (:func:`kvjax.eval.evidence_sources.context_evidence`)."""
  needs = policy_needs(entries)
  prefilled = prefill_examples(
    prepared.model,
    exs,
    question=question,
    window=policy_window(entries),
    oracle=any(policy.reads_future for _, policy in entries),
    shape=shape,
    needs=needs,
  )
  evidence = prepared.calibration | context_evidence(
    prepared.model, exs, shape, prepared.template, needs, prepared.learned
  )
  return prefilled, evidence


def _read_results(path) -> pd.DataFrame:
  """``results.csv`` with the per-example outcomes as written (one example's ``"1"`` is no
  number to round-trip)."""
  return rundir.read_rows(path, dtype=dict.fromkeys(EXAMPLE_COLUMNS, str))


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
  # every process holds process 0's config and code before any work (another seed would
  # compute on other examples, and process 0 would write those rows as its own)
  shared = {k: config[k] for k in config if k not in ("workdir", *NOT_IDENTITY)}
  identity = distributed.run_identity(rundir.plain(shared), devices=jax.device_count())
  distributed.check_same(identity, "evaluation")
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
  entries = config_entries(config)
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
  model, sets = prepared.model, prepared.sets
  head = None  # HeadKV's retrieval-head scores, measured once per run
  shapes = length_shapes(config, sets)
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
          prefilled, evidence = _prefilled(prepared, exs, entries, q, shapes[length])
          full = evaluate_group(model, exs, [length], FULL, Shared(prefilled))
          shared = Shared(prefilled, full["answers"])
          for label, policy in mine:
            head = _measured_head(policy, head, prepared)
            if policy is FULL:  # its own reference: KL exactly 0; nothing removed
              removed = {"ratio": 0.0} if ratios else {}
              res = full | {"rows": [r | {"kl": 0.0} | removed for r in full["rows"]]}
            else:
              values = groups[(task, length, label, "budget", q)]
              by_ratio = bool(ratios) and policy.requires_budget
              res = evaluate_group(
                model,
                exs,
                Ratio(values) if by_ratio else values,
                policy,
                shared,
                evidence=evidence | _head_evidence(head),
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
  if primary:
    return _read_results(path)
  # process 0's table is every process's
  return pd.read_csv(io.StringIO(text), dtype=dict.fromkeys(EXAMPLE_COLUMNS, str))


def _finish(config, prepared, path, done, head, log, modes, ratios) -> None:
  """The heatmap's rows, then ``tables.md`` and the figures from ``results.csv`` (process 0)."""
  out = pathlib.Path(path).parent
  _heatmap(config, prepared, path, done, head, log)
  table = _read_results(path)
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


def _heatmap(config, prepared: Prepared, path, done, head, log):
  """Needle accuracy over depth x length for each heatmap policy at one budget (in the config's
  first question mode), on the examples :func:`prepare` drew."""
  h = config.heatmap
  if not h.policies:
    return head
  q = question_modes(config)[0]
  entries = dict(config_entries(config))
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
      prefilled, evidence = _prefilled(prepared, exs, chosen, q)
      for label, policy in chosen:
        budget = h.budget if policy.requires_budget else length
        head = _measured_head(policy, head, prepared)
        res = evaluate_group(
          prepared.model,
          exs,
          [budget],
          policy,
          Shared(prefilled),
          evidence=evidence | _head_evidence(head),
        )
        (r,) = res["rows"]
        meta = dict(task=h.task, length=length, policy=label, kind=kind, question=q, depth=d)
        row = meta | finish_row(r)
        rundir.append_rows(path, [_ordered(row | {"seconds": 0.0})])
      log(f"heatmap length {length} depth {d:g}: done")
  return head
