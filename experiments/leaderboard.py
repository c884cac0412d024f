"""kvpress's leaderboard on RULER's synthetic tasks: ``python -m experiments.leaderboard
--config=configs/leaderboard.py[:quick|:full] [--config.workdir=DIR]`` runs (or resumes) the
grid of ``kvjax.eval.leaderboard`` and writes ``results.csv``, ``table.md`` (the mean RULER
score per method and ratio, each loop) and ``leaderboard.png`` into the workdir."""

import os
import pathlib
import time

import matplotlib
from absl import app

from configs import common
from kvjax.eval import leaderboard

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "leaderboard.py"),
  "Leaderboard configuration.",
  lock_config=True,
)


def markdown(summary) -> str:
  """``table.md``: per loop, one row per method, one column per ratio (mean score, percent)."""
  lines = []
  for loop, part in summary.groupby("loop", sort=False):
    wide = part.pivot(index="method", columns="ratio", values="score")
    ratios = list(wide.columns)
    lines += [f"### {loop}", "", "| method | " + " | ".join(f"{r:g}" for r in ratios) + " |"]
    lines.append("|---|" + "---|" * len(ratios))
    for method, row in wide.iterrows():
      cells = ["" if row[r] != row[r] else f"{row[r]:.1f}" for r in ratios]
      lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
  return "\n".join(lines)


def figure(summary):
  """Score against compression ratio, one line per method, a panel per loop."""
  import matplotlib.pyplot as plt

  loops = list(dict.fromkeys(summary["loop"]))
  fig, axes = plt.subplots(1, len(loops), figsize=(5.5 * len(loops), 4), squeeze=False)
  for ax, loop in zip(axes[0], loops, strict=True):
    part = summary[summary["loop"] == loop]
    for method, m in part.groupby("method"):
      ax.plot(m["ratio"], m["score"], marker="o", label=method)
    ax.set(title=f"RULER, query-{loop}", xlabel="compression ratio", ylabel="score (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  return fig


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  t0 = time.perf_counter()
  rows = leaderboard.run(config, config.workdir)
  summary = leaderboard.table(rows)
  out = pathlib.Path(config.workdir)
  (out / "table.md").write_text(markdown(summary))
  figure(summary).savefig(out / "leaderboard.png", dpi=110)
  print(markdown(summary))
  print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
  print(f"run directory: {os.path.abspath(config.workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
