"""The main job: every policy on every lab scenario; prints the table and the run directory,
which holds the tables, one figure per scenario and ``lab.html``, the figure made interactive
(``--config.explorer=False`` skips it).

python -m experiments.lab --config=configs/lab.py[:scenario] [--config.budget=64]
python -m experiments.lab --config=configs/lab_keys.py[:quick]  (attention-free scorers on
  modelled keys: retained mass and fact recall per budget, and the difference to the
  attention-based policy `versus`, SnapKV)
"""

import datetime
import os
import pathlib

import matplotlib
import pandas as pd
from absl import app

from configs import common
from kvjax import lab, rundir
from kvjax.lab import explorer, suite

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "lab.py"),
  "Lab configuration.",
  lock_config=True,
)


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  # unset: a fresh timestamped directory; "" is refused like everywhere (rundir.check_workdir)
  workdir = config.workdir
  if workdir is None:
    workdir = os.path.join("runs", "lab-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  rundir.check_workdir(workdir)
  if "fact_distinctness" in config:  # configs/lab_keys.py
    table = lab.run_keys(config, workdir)
    with pd.option_context("display.width", 250, "display.max_columns", 40):
      for metric in ("retained_mass", "fact_recall"):
        print(f"\n{metric}\n" + lab.key_pivot(table, metric).to_string())
      if config.versus in set(table.policy):
        delta = lab.versus(table, config.versus)
        delta = delta[delta.policy.isin(table.policy[table.reads_keys])]  # attention-free
        print(f"\nminus {config.versus} (positive: the attention-free scorer wins)")
        print(
          delta.pivot_table(index=["budget", "policy"], columns=["scenario", "fact_distinctness"])
          .round(3)
          .to_string()
        )
  else:
    built = suite.validate_config(config)
    if config.explorer:
      explorer.budget_grid(config, built)  # a bad explorer_budgets fails before any work
    table = lab.run(config, workdir)
    with pd.option_context("display.width", 200, "display.max_columns", 40):
      print(lab.pivot(table).to_string())
    if config.explorer:
      data = explorer.explorer_data(config, built)
      print("interactive figure:", explorer.write_html(data, pathlib.Path(workdir) / "lab.html"))
  print(f"run directory: {os.path.abspath(workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
