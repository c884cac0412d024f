"""Budget sweeps from a config file; prints the run directory and the best configuration per budget.

  python -m experiments.sweep --config=configs/sweep_lab.py [--config.workdir=DIR]

Rerunning the same command with the same workdir resumes: only missing configurations run.
Several processes (one per host of a TPU slice or a SLURM job, or local ones with
``--coordinator=localhost:PORT --num_processes=N --process_id=I``) run one sweep together;
process 0 writes the run directory (``docs/multihost.md``).
"""

import datetime
import os
import pathlib

import matplotlib
import pandas as pd
from absl import app, flags

from configs import common
from kvjax import distributed, plotting
from kvjax.lab import sweep

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "sweep_lab.py"),
  "Sweep configuration.",
  lock_config=True,
)
_PLOTS = flags.DEFINE_bool("plots", True, "Write the PNG figures into the run directory.")
_FLAGS = common.define_distributed_flags()


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    _sweep()


def _sweep():
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  # unset: a fresh timestamped directory; "" is refused like everywhere (rundir.check_workdir)
  workdir = config.workdir
  if workdir is None:
    workdir = os.path.join("runs", "sweep-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  table = sweep.run(config, workdir)
  if not distributed.is_primary():  # process 0 owns the run directory and reports
    return
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
