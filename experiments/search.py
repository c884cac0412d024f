"""Allocation search from a config; prints the run directory and the held-out table.

  python -m experiments.search --config=configs/search.py[:quick] [--config.workdir=DIR]

Rerunning the same command with the same workdir resumes from the last generation's checkpoint
(an interrupted search ends as an uninterrupted one would). The run directory holds
``allocation.npz`` (``kvjax.policies.searched.Searched(path)`` reads it), ``summary.json``,
``history.csv`` and ``search.png`` (``docs/allocation_search.md``).
"""

import datetime
import os
import pathlib

import matplotlib
from absl import app

from configs import common
from kvjax.eval.search import runner

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "search.py"),
  "Search configuration.",
  lock_config=True,
)


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  workdir = config.workdir
  if workdir is None:
    workdir = os.path.join("runs", "search-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  summary = runner.run(config, workdir)
  judged = summary["judged"]
  # the retained mass, and each further objective a run judged (KL, task accuracy)
  extra = [k for k in ("held_out_kl", "held_out_accuracy") if k in judged["searched"]]
  head = "".join(f" {k.replace('_', '-'):>18}" for k in extra)
  print(f"{'allocation':<18} {'calibration':>12} {'held-out':>10}{head}")
  for name, row in judged.items():
    label = f"{name} ({row['name']})" if name == "best_hand_made" else name
    cells = "".join(f" {row[k]:>18.6f}" for k in extra)
    print(f"{label:<18} {row['calibration']:>12.6f} {row['held_out']:>10.6f}{cells}")
  if summary["header"].get("parameters"):
    print(f"parameters found: {summary['header']['parameters']}")
  if "full_cache" in summary:
    print(f"full cache: {summary['full_cache']}")
  print(f"allocation file: {summary['allocation_file']}")
  print(f"run directory: {os.path.abspath(workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
