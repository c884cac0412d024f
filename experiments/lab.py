"""The main job: every policy on every lab scenario; prints the table and the run directory,
which holds the tables, one figure per scenario and ``lab.html``, the figure made interactive
(``--config.explorer=False`` skips it).

python -m experiments.lab --config=configs/lab.py[:scenario] [--config.budget=64]
python -m experiments.lab --config=configs/lab_keys.py[:quick]  (attention-free scorers on
  modelled keys: retained mass and fact recall per budget, and the difference to the
  attention-based policy `versus`, SnapKV)
"""

import datetime
import importlib.util
import logging
import os
import pathlib
from concurrent import futures

import matplotlib
import pandas as pd
from absl import app

from configs import common
from kvjax import lab, rundir
from kvjax.lab import explorer, suite

# What the main job's tables hold (``kvjax.lab.metrics``), each a mean over the generated steps,
# layers and heads; the per-policy progress lines print retained_mass as R.
METRICS = {
  "retained_mass": "share of the full cache's attention the kept tokens hold (R above; 1: lossless)",
  "oracle_gap": "the best set of the same size's retained mass minus the policy's (0 is optimal)",
  "output_error": "L2 error of the attention output against the full cache's (0 is lossless)",
  "fact_recall": "share of the facts being asked about still in the cache (1: all of them)",
}

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "lab.py"),
  "Lab configuration.",
  lock_config=True,
)


def print_tables(pivot: pd.DataFrame) -> None:
  """One policy x scenario table per metric of ``pivot`` (:func:`kvjax.lab.pivot`), each under
  its definition, so that no line is wider than a terminal."""
  for metric in pivot.columns.get_level_values(0).unique():
    print(f"\n{metric}: {METRICS.get(metric, '')}")
    print(pivot[metric].rename_axis(index=None, columns=None).to_string())


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  # jax reports at INFO each accelerator plugin it probed and did not find (libtpu on a CPU
  # machine); the run says which devices it uses where that matters
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
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
      if importlib.util.find_spec("plotly") is None:  # lab.html is written after the run
        raise ValueError("explorer: lab.html needs plotly (pip install plotly); or explorer=False")
    print(
      f"{len(config.policies)} policies, {len(config.scenarios)} scenarios, a budget of "
      f"{config.budget} per layer and head.\nEach line: scenario, policy, R = the retained mass "
      "(share of the full cache's\nattention the kept tokens hold), seconds taken"
    )
    out = suite.prepare_workdir(config, workdir)
    replays = suite.simulate_scenarios(config, built=built)
    # the page's replays run on the other threads while this one draws the figures
    with futures.ThreadPoolExecutor(suite.default_workers()) as pool:
      page = None
      if config.explorer:
        page = explorer.start_replays(config, built, replays=replays, executor=pool)
      table = suite.write_run(config, out, replays)
      print_tables(lab.pivot(table))
      if page is not None:
        print()
        data = explorer.explorer_data(config, built, replays=replays, started=page)
        print("interactive figure:", explorer.write_html(data, out / "lab.html"))
  print(f"run directory: {os.path.abspath(workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
