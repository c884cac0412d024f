"""Accuracy vs budget: ``python experiments/eval.py --config=configs/eval.py
--config.workdir=DIR`` writes ``DIR/results.csv`` (task, length, policy, budget, accuracy, kl, ...)
and the figures beside it. Interrupt and rerun: finished groups are kept, the rest are run."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from kvjax import evaluate  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval.py")
)


def main(argv):
  del argv
  config = _CONFIG.value
  table = evaluate.run(config, config.workdir)
  summary = (
    table[table["kind"] == "budget"]
    .pivot_table(index=["task", "policy"], columns="budget", values="accuracy", aggfunc="mean")
    .round(2)
  )
  print(summary.to_string())
  print(f"results: {config.workdir}/results.csv")


if __name__ == "__main__":
  app.run(main)
