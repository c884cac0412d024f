"""Markdown tables of an evaluation's ``results.csv`` (the README's real-model tables).

:func:`markdown` renders, from :data:`kvjax.eval.evaluate.COLUMNS` rows: the full cache's
accuracy per task and context length first (what the model can do at all), then, per question
mode, accuracy, RULER's recall, teacher-forced KL and the fraction of the full cache held against
budget per policy (means over tasks and lengths, equal weight per task), then the needle heatmap
(accuracy over depth x length).

Accuracies carry 95 % intervals (Wilson over the examples, :func:`kvjax.eval.stats.proportion_interval`;
recall, a mean of fractional scores: a seeded bootstrap over examples within each cell), and
each policy is compared with a reference (:data:`REFERENCE` unless chosen) on the examples they
share: the exact McNemar test for accuracy, a paired bootstrap for recall; ``*`` marks
``p < 0.05`` and ``**`` a difference that also survives Holm's adjustment over the table's
comparisons. Tables of results without per-example outcomes show the means alone.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvjax.eval import stats

FULL = "full"  # the label of the full cache's rows, every policy's reference
REFERENCE = "snapkv"  # the policy others are tested against when the config names none
ALPHA = 1 - stats.CONFIDENCE
# the per-example column behind each metric with an interval
EXAMPLES = {"accuracy": "example_correct", "recall": "example_recall"}
CELL = ["task", "length", "kind"]  # one set of examples (the kind holds a heatmap's depth)


def _cell(value: float, digits: int) -> str:
  return "" if pd.isna(value) else f"{value:.{digits}f}"


def frame_markdown(frame: pd.DataFrame, digits: int = 2, index_name: str | None = None) -> str:
  """A pivoted frame as a GitHub markdown table (index first); text cells as they are."""
  head = [index_name or str(frame.index.name or ""), *(str(c) for c in frame.columns)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key, row in frame.iterrows():
    label = " ".join(map(str, key)) if isinstance(key, tuple) else str(key)
    cells = [v if isinstance(v, str) else _cell(v, digits) for v in row]
    lines.append("| " + " | ".join([label, *cells]) + " |")
  return "\n".join(lines)


def per_example(value) -> np.ndarray | None:
  """Reads one row's per-example outcomes.

  Args:
    value: ``results.csv``'s space-separated ``example_*`` text, or a lone number as a CSV
      reader parses one example.

  Returns:
    The outcomes as floats, in example order; ``None`` when the row has none (NaN, empty).
  """
  if value is None or (not isinstance(value, str) and pd.isna(value)):
    return None
  text = str(value).split()
  return np.asarray([float(t) for t in text]) if text else None


def has_examples(table: pd.DataFrame, metric: str) -> bool:
  """Says whether ``table`` holds the per-example outcomes behind ``metric``'s intervals.

  Args:
    table: results rows.
    metric: a column name (only ``accuracy`` and ``recall`` have outcomes).

  Returns:
    Whether the outcome column is there (results written before it existed have none).
  """
  column = EXAMPLES.get(metric)
  return column is not None and column in table.columns


def summarize(rows: pd.DataFrame, metric: str = "accuracy") -> dict:
  """``metric`` over ``rows`` (cells: tasks, lengths), as the tables show it.

  Args:
    rows: results rows, each a cell of examples.
    metric: ``"accuracy"`` (a proportion of examples: the Wilson interval of the pooled examples
      for cells of one size, else a bootstrap) or ``"recall"`` (a mean of fractional scores: a
      seeded bootstrap over examples within each cell); any other column has no interval.

  Returns:
    ``{"mean", "low", "high", "n"}``: the equal-weight mean over the rows, the 95 % interval
    (NaN without per-example outcomes) and the examples behind it.
  """
  mean = float(rows[metric].mean()) if len(rows) else np.nan
  n = int(rows["n"].sum()) if "n" in rows.columns and len(rows) else 0
  low = high = np.nan
  if has_examples(rows, metric) and len(rows):
    groups = [per_example(v) for v in rows[EXAMPLES[metric]]]
    if all(g is not None for g in groups):
      interval = stats.proportion_interval if metric == "accuracy" else stats.bootstrap_interval
      low, high = interval(groups)
      n = sum(g.size for g in groups)
  return {"mean": mean, "low": low, "high": high, "n": n}


def paired_pvalue(rows: pd.DataFrame, reference: pd.DataFrame, metric: str = "accuracy") -> float:
  """The paired test of ``rows`` against ``reference`` on the examples they share.

  Cells (task, length, kind) present in both with the same number of examples are paired
  example by example (an evaluation draws the same examples for every policy of a cell).

  Args:
    rows: one policy's rows.
    reference: the reference policy's rows.
    metric: ``"accuracy"``: the exact McNemar test on the pooled per-example correct/incorrect
      pairs; ``"recall"``: the seeded paired bootstrap of per-example differences, resampled
      within each cell.

  Returns:
    The two-sided p-value; NaN when no cell is shared or the outcomes are missing.
  """
  if not (has_examples(rows, metric) and has_examples(reference, metric)):
    return np.nan
  column = EXAMPLES[metric]
  theirs = {tuple(r[c] for c in CELL): per_example(r[column]) for _, r in reference.iterrows()}
  mine_groups, their_groups = [], []
  for _, r in rows.iterrows():
    a, b = per_example(r[column]), theirs.get(tuple(r[c] for c in CELL))
    if a is not None and b is not None and a.size == b.size:
      mine_groups.append(a)
      their_groups.append(b)
  if not mine_groups:
    return np.nan
  if metric == "accuracy":
    return stats.mcnemar_exact(np.concatenate(mine_groups), np.concatenate(their_groups))
  return stats.paired_bootstrap_pvalue(mine_groups, their_groups)


def full_cache(table: pd.DataFrame) -> pd.DataFrame:
  """Full-cache accuracy, task x context length (the first question mode's rows)."""
  rows = _full_rows(table)
  return rows.pivot_table(index="task", columns="length", values="accuracy", aggfunc="mean")


def _full_rows(table: pd.DataFrame) -> pd.DataFrame:
  rows = table[(table["kind"] == "budget") & (table["policy"] == FULL)]
  return rows[rows["question"] == rows["question"].iloc[0]] if len(rows) else rows


def by_budget(table: pd.DataFrame, question: str, value: str = "accuracy") -> pd.DataFrame:
  """``value`` per policy x budget in one question mode, the mean over tasks and lengths; the
  full cache's column is its own mean (``full``), the policies in the order they were run."""
  rows = table[(table["kind"] == "budget") & (table["question"] == question)]
  budgets = rows[rows["policy"] != FULL]
  frame = budgets.pivot_table(index="policy", columns="budget", values=value, aggfunc="mean")
  order = [p for p in dict.fromkeys(budgets["policy"]) if p in frame.index]
  frame = frame.loc[order]
  full = rows[rows["policy"] == FULL][value].mean()
  frame.insert(0, FULL, np.full(len(frame), full))
  return frame


def resolve_reference(table: pd.DataFrame, reference: str | None) -> str | None:
  """Chooses the policy the tables test the others against.

  Args:
    table: results rows.
    reference: the config's choice (``None``: none made).

  Returns:
    ``reference`` when given, else :data:`REFERENCE` when the table has its rows, else ``None``.
  """
  if reference is not None:
    return reference
  return REFERENCE if (table["policy"] == REFERENCE).any() else None


def _rows_of(rows: pd.DataFrame, policy: str, budget) -> pd.DataFrame:
  """A policy's rows at one budget (the full cache's at every budget: it has one per length)."""
  mine = rows[rows["policy"] == policy]
  return mine if policy == FULL else mine[mine["budget"] == budget]


def interval_table(
  table: pd.DataFrame, question: str, metric: str = "accuracy", reference: str | None = None
) -> tuple[pd.DataFrame, str]:
  """``metric`` per policy x budget in one question mode with intervals and marks.

  Args:
    table: the results.
    question: the question mode.
    metric: ``"accuracy"`` or ``"recall"`` (:func:`summarize`).
    reference: the policy others are tested against (:func:`resolve_reference`; ``None``:
      :data:`REFERENCE` if it ran).

  Returns:
    ``(frame, note)``: text cells ``mean [low, high]`` with ``*`` (``p < 0.05``) or ``**``
    (also significant after Holm's adjustment over the table) against the reference, in
    :func:`by_budget`'s layout; ``note`` says the examples per cell, the interval and the test.
  """
  rows = table[(table["kind"] == "budget") & (table["question"] == question)]
  means = by_budget(table, question, metric)
  reference = resolve_reference(rows, reference)
  ref_rows = rows[rows["policy"] == reference] if reference is not None else rows.iloc[:0]
  cells, tests = {}, {}
  for policy in means.index:
    for budget in means.columns:
      mine = _rows_of(rows, FULL if budget == FULL else policy, budget)
      if not len(mine):
        continue
      cells[(policy, budget)] = summarize(mine, metric)
      if budget == FULL or policy == reference or not len(ref_rows):
        continue
      theirs = _rows_of(ref_rows, reference, budget)
      p = paired_pvalue(mine, theirs, metric)
      if not np.isnan(p):
        tests[(policy, budget)] = p
  adjusted = dict(zip(tests, stats.holm(list(tests.values()), ALPHA), strict=True))
  ns = {s["n"] for s in cells.values()}
  frame = means.astype(object)
  for policy in means.index:
    for budget in means.columns:
      s = cells.get((policy, budget))
      if s is None:
        frame.loc[policy, budget] = ""
        continue
      text = _cell(s["mean"], 2)
      if not np.isnan(s["low"]):
        text += f" [{s['low']:.2f}, {s['high']:.2f}]"
      if len(ns) > 1:
        text += f" n={s['n']}"
      p = tests.get((policy, budget))
      if p is not None and p < ALPHA:
        text += "**" if adjusted[(policy, budget)] else "*"
      frame.loc[policy, budget] = text
  how = "Wilson" if metric == "accuracy" else "seeded bootstrap over examples"
  note = f"95 % intervals: {how}"
  if len(ns) == 1:
    note += f", n = {ns.pop()} examples per cell"
  if reference is not None and len(ref_rows):
    test = "exact McNemar" if metric == "accuracy" else "paired bootstrap"
    note += (
      f"; against `{reference}` on the shared examples ({test}): * p < {ALPHA:g}, ** also after "
      f"Holm's adjustment over the {len(tests)} comparisons"
    )
  elif reference is not None:
    note += f"; the reference `{reference}` has no rows here"
  return frame, note


def grid_intervals(rows: pd.DataFrame, index: str, columns: str) -> tuple[pd.DataFrame, str]:
  """Accuracy over ``index`` x ``columns`` with each cell's Wilson interval.

  Args:
    rows: one policy's rows (the full cache's; a heatmap policy's).
    index: the rows' column (``"task"``, ``"depth"``).
    columns: the columns' column (``"length"``).

  Returns:
    ``(frame, note)``: text cells ``mean [low, high]``, and what the intervals are over.
  """
  means = rows.pivot_table(index=index, columns=columns, values="accuracy", aggfunc="mean")
  frame, ns = means.astype(object), set()
  for i in means.index:
    for j in means.columns:
      s = summarize(rows[(rows[index] == i) & (rows[columns] == j)], "accuracy")
      text = _cell(s["mean"], 2)
      if s["n"]:
        ns.add(s["n"])
      if not np.isnan(s["low"]):
        text += f" [{s['low']:.2f}, {s['high']:.2f}]"
      frame.loc[i, j] = text
  note = "95 % intervals: Wilson"
  if len(ns) == 1:
    note += f", n = {ns.pop()} examples per cell"
  return frame, note


def heatmap(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
  """The needle heatmap per policy: accuracy over depth (rows) x context length (columns)."""
  rows = table[table["kind"].str.startswith("heatmap")]
  return {
    policy: group.pivot_table(index="depth", columns="length", values="accuracy", aggfunc="mean")
    for policy, group in rows.groupby("policy", sort=False)
  }


def summary(table: pd.DataFrame, keys: list[str], metric: str = "accuracy") -> pd.DataFrame:
  """One row per value of ``keys`` with ``metric``'s mean and interval (:func:`summarize`:
  ``{metric}_lo``/``{metric}_hi``, NaN without outcomes), ``n`` and the mean memory held
  (``kv_bytes_held``, ``kv_fraction`` when the rows have them): what the figures draw.

  Args:
    table: results rows.
    keys: the columns to group by (the rows of each group are its cells).
    metric: ``"accuracy"``, ``"recall"`` or another column (no interval).

  Returns:
    The summary frame, groups in their first appearance's order.
  """
  out = []
  for key, rows in table.groupby(keys, sort=False):
    key = key if isinstance(key, tuple) else (key,)
    s = summarize(rows, metric)
    row = dict(zip(keys, key, strict=True))
    row |= {metric: s["mean"], f"{metric}_lo": s["low"], f"{metric}_hi": s["high"], "n": s["n"]}
    for column in ("kv_bytes_held", "kv_fraction"):
      if column in rows.columns:
        row[column] = float(rows[column].mean())
    out.append(row)
  return pd.DataFrame(out)


def plot_summaries(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
  """The summaries the figures of one question mode draw (:func:`kvjax.plotting.accuracy_figures`).

  Args:
    rows: one question mode's results rows.

  Returns:
    ``{"accuracy": ..., "recall": ...}``: each metric per (task, policy, budget) over lengths
    (the full cache per (task, policy), over every length), and ``"memory"``: accuracy and the
    memory held per (length, policy, budget) over tasks (:func:`summary`); empty without budget
    rows.
  """
  budget = rows[rows["kind"] == "budget"]
  if budget.empty:
    return {}
  full, rest = budget[budget["policy"] == FULL], budget[budget["policy"] != FULL]
  out = {}
  for metric in ("accuracy", "recall"):
    if metric in rows.columns:
      parts = [summary(rest, ["task", "policy", "budget"], metric)]
      if len(full):
        parts.append(summary(full, ["task", "policy"], metric))
      out[metric] = pd.concat(parts, ignore_index=True)
  memory = [summary(rest, ["length", "policy", "budget"], "accuracy")]
  if len(full):  # the full cache: one point per length
    memory.append(summary(full, ["length", "policy"], "accuracy"))
  out["memory"] = pd.concat(memory, ignore_index=True)
  return out


def markdown(table: pd.DataFrame, reference: str | None = None) -> str:
  """Every table of :mod:`kvjax.eval.report` for one ``results.csv``, as one markdown text.

  Args:
    table: the results.
    reference: the policy the others are tested against (``None``: :data:`REFERENCE` when it
      ran).

  Returns:
    The markdown text.
  """
  with_intervals = has_examples(table, "accuracy")
  if with_intervals:
    frame, note = grid_intervals(_full_rows(table), "task", "length")
    parts = [f"**Full-cache accuracy** (task x context length; {note})", "", frame_markdown(frame)]
  else:
    parts = [
      "**Full-cache accuracy** (task x context length)",
      "",
      frame_markdown(full_cache(table)),
    ]
  for q in dict.fromkeys(table.loc[table["kind"] == "budget", "question"]):
    for value, digits in (("accuracy", 2), ("recall", 2), ("kl", 3), ("kv_fraction", 3)):
      if value not in table.columns or (value == "recall" and not with_intervals):
        continue  # recall's table comes with its intervals
      title = f"**{value} vs budget, question `{q}`** (mean over tasks and lengths"
      if value == "kv_fraction":
        title = (
          f"**K/V held as a fraction of the full cache vs budget, question `{q}`** (counted "
          "from each compressed cache, mean over tasks and lengths"
        )
      if value in EXAMPLES and with_intervals:
        frame, note = interval_table(table, q, value, reference)
        title += f"; {note}"
      else:
        frame = by_budget(table, q, value)
      parts += ["", title + ")", "", frame_markdown(frame, digits, "policy")]
  heat = table[table["kind"].str.startswith("heatmap")]
  for policy, frame in heatmap(table).items():
    note = ""
    if with_intervals:
      frame, note = grid_intervals(heat[heat["policy"] == policy], "depth", "length")
      note = f"; {note}"
    parts += ["", f"**Needle heatmap, {policy}** (depth x length{note})", ""]
    parts.append(frame_markdown(frame, 2, "depth"))
  return "\n".join(parts) + "\n"
