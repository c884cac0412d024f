"""Markdown tables of an evaluation's ``results.csv`` (the README's real-model tables).

:func:`markdown` renders, from :data:`kvjax.eval.evaluate.COLUMNS` rows: the full cache's
accuracy per task and context length first (what the model can do at all), then, per question
mode, accuracy and teacher-forced KL against budget per policy (means over tasks and lengths,
equal weight per task), then the needle heatmap (accuracy over depth x length).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

FULL = "full"  # the label of the full cache's rows, every policy's reference


def _cell(value: float, digits: int) -> str:
  return "" if pd.isna(value) else f"{value:.{digits}f}"


def frame_markdown(frame: pd.DataFrame, digits: int = 2, index_name: str | None = None) -> str:
  """A pivoted frame as a GitHub markdown table (index first)."""
  head = [index_name or str(frame.index.name or ""), *(str(c) for c in frame.columns)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key, row in frame.iterrows():
    label = " ".join(map(str, key)) if isinstance(key, tuple) else str(key)
    lines.append("| " + " | ".join([label, *(_cell(v, digits) for v in row)]) + " |")
  return "\n".join(lines)


def full_cache(table: pd.DataFrame) -> pd.DataFrame:
  """Full-cache accuracy, task x context length (the first question mode's rows)."""
  rows = table[(table["kind"] == "budget") & (table["policy"] == FULL)]
  rows = rows[rows["question"] == rows["question"].iloc[0]] if len(rows) else rows
  return rows.pivot_table(index="task", columns="length", values="accuracy", aggfunc="mean")


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


def heatmap(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
  """The needle heatmap per policy: accuracy over depth (rows) x context length (columns)."""
  rows = table[table["kind"].str.startswith("heatmap")]
  return {
    policy: group.pivot_table(index="depth", columns="length", values="accuracy", aggfunc="mean")
    for policy, group in rows.groupby("policy", sort=False)
  }


def markdown(table: pd.DataFrame) -> str:
  """Every table of :mod:`kvjax.eval.report` for one ``results.csv``, as one markdown text."""
  parts = ["**Full-cache accuracy** (task x context length)", "", frame_markdown(full_cache(table))]
  for q in dict.fromkeys(table.loc[table["kind"] == "budget", "question"]):
    for value, digits in (("accuracy", 2), ("kl", 3)):
      frame = by_budget(table, q, value)
      title = f"**{value} vs budget, question `{q}`** (mean over tasks and lengths)"
      parts += ["", title, "", frame_markdown(frame, digits, "policy")]
  for policy, frame in heatmap(table).items():
    parts += ["", f"**Needle heatmap, {policy}** (depth x length)", ""]
    parts.append(frame_markdown(frame, 2, "depth"))
  return "\n".join(parts) + "\n"
