"""Accuracy vs budget: ``python -m experiments.eval --config=configs/eval.py
--config.workdir=DIR`` writes ``DIR/results.csv`` (task, length, policy, budget, accuracy, kl, ...)
and the figures beside it. Interrupt and rerun: finished groups are kept, the rest are run."""

import pathlib

import matplotlib
from absl import app
from ml_collections import config_flags

from kvjax import rundir
from kvjax.eval import evaluate

_CONFIG = config_flags.DEFINE_config_file(
  "config", str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval.py")
)


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  evaluate.validate_config(config)
  cache = rundir.enable_compilation_cache(config.get("compilation_cache", None))
  print(f"persistent compilation cache: {cache or 'off'}")
  evaluate.run(config, config.workdir)
  print((pathlib.Path(config.workdir) / "tables.md").read_text())
  print(f"results: {config.workdir}/results.csv (tables: tables.md, figures beside them)")


if __name__ == "__main__":
  app.run(main)
