"""Accuracy vs budget: ``python -m experiments.eval --config=configs/eval.py
--config.workdir=DIR`` writes ``DIR/results.csv`` (task, length, policy, budget, ratio, accuracy
with its 95 % interval, kl, the K/V bytes each compressed cache held, every example's outcome,
...; ``--config.ratios="(0.5,0.75)" --config.budgets="()"`` for compression ratios),
``tables.md`` (intervals, and paired tests against ``--config.reference``, SnapKV by default) and
the figures beside it. Interrupt and rerun: finished groups are kept, the rest are run.

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes split each group's
policies and process 0 writes the run directory (:func:`kvjax.eval.evaluate.run`)."""

import pathlib

import matplotlib
from absl import app

from configs import common
from kvjax import distributed, rundir
from kvjax.eval import evaluate

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval.py")
)
_FLAGS = common.define_distributed_flags()


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(config):
  """Evaluates ``config`` into its workdir; process 0 prints the tables.

  Args:
    config: the config (``configs/eval.py``).
  """
  matplotlib.use("Agg")  # figures go to files
  evaluate.validate_config(config)
  rundir.check_workdir(config.workdir)  # "" would be the current directory: refused
  cache = rundir.enable_compilation_cache(config.get("compilation_cache", None))
  if distributed.is_primary():
    print(f"persistent compilation cache: {cache or 'off'}")
  evaluate.run(config, config.workdir)
  if not distributed.is_primary():
    return
  print((pathlib.Path(config.workdir) / "tables.md").read_text())
  print(f"results: {config.workdir}/results.csv (tables: tables.md, figures beside them)")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
