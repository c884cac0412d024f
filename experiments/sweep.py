"""Budget sweeps from a config file; prints the run directory and the best configuration per budget.

  python -m experiments.sweep --config=configs/sweep_lab.py [--config.workdir=DIR]

Rerunning the same command with the same workdir resumes: only missing configurations run.
"""

import datetime
import os
import pathlib

import matplotlib
import pandas as pd
from absl import app, flags

from configs import common
from kvjax import plotting
from kvjax.lab import sweep

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "sweep_lab.py"),
  "Sweep configuration.",
  lock_config=True,
)
_PLOTS = flags.DEFINE_bool("plots", True, "Write the PNG figures into the run directory.")


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  # unset: a fresh timestamped directory; "" is refused like everywhere (rundir.check_workdir)
  workdir = config.workdir
  if workdir is None:
    workdir = os.path.join("runs", "sweep-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  table = sweep.run(config, workdir)
  if _PLOTS.value:
    for name, fig in (
      ("metric_vs_budget.png", plotting.sweep_metric_vs_budget(table)),
      ("budget_profiles.png", plotting.budget_profiles(table)),
      ("pareto.png", plotting.pareto(table)),
    ):
      fig.savefig(os.path.join(workdir, name), dpi=110)
      plotting.close(fig)
  with pd.option_context("display.width", 200, "display.max_columns", 20):
    print(sweep.best_per_budget(table).round(4).to_string(index=False))
  print(f"run directory: {os.path.abspath(workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
