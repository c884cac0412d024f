"""Accuracy vs budget: ``python -m experiments.eval --config=configs/eval.py
--config.workdir=DIR`` writes ``DIR/results.csv`` (task, length, policy, budget, ratio, accuracy
with its 95 % interval, kl, the K/V bytes each compressed cache held, every example's outcome,
...; ``--config.ratios="(0.5,0.75)" --config.budgets="()"`` for compression ratios),
``tables.md`` (intervals, and paired tests against ``--config.reference``, SnapKV by default) and
the figures beside it. Interrupt and rerun: finished groups are kept, the rest are run."""

import pathlib

import matplotlib
from absl import app

from configs import common
from kvjax import rundir
from kvjax.eval import evaluate

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval.py")
)


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  evaluate.validate_config(config)
  rundir.check_workdir(config.workdir)  # "" would be the current directory: refused
  cache = rundir.enable_compilation_cache(config.get("compilation_cache", None))
  print(f"persistent compilation cache: {cache or 'off'}")
  evaluate.run(config, config.workdir)
  print((pathlib.Path(config.workdir) / "tables.md").read_text())
  print(f"results: {config.workdir}/results.csv (tables: tables.md, figures beside them)")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
