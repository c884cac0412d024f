"""Trains the tiny retrieval model: ``python -m experiments.train --config=configs/train_tiny.py
--workdir=DIR``. Kill it and run the same command again: it resumes from the last checkpoint.
``--export=DIR`` then writes the final parameters as a Hugging Face style checkpoint
(``config.json``, ``model.safetensors``, ``tokenizer.json``) like the one shipped in
``kvjax/assets/tiny``, with a ``card.json`` of its measurements and training phases (``--after``:
the workdirs of the earlier phases this run continues)."""

import json
import os
import pathlib

import jax
from absl import app, flags

from configs import common
from kvjax.eval import card as card_lib
from kvjax.eval import tasks, train

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "train_tiny.py")
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/kvjax_train", "checkpoints and metrics.jsonl")
_EXPORT = flags.DEFINE_string("export", None, "write the trained model here when done")
_AFTER = flags.DEFINE_list("after", [], "workdirs of the earlier training phases, for the card")
_MEASURE = flags.DEFINE_integer("measure", 50, "held-out examples per task and length for the card")


def main(argv):
  del argv
  state = train.train(_CONFIG.value, _WORKDIR.value)
  if _EXPORT.value:
    card_lib.export(_CONFIG.value, state.params, _EXPORT.value)
    card = card_lib.measure(_EXPORT.value, count=_MEASURE.value)
    phases = [card_lib.phase_record(d) for d in [*_AFTER.value, _WORKDIR.value]]
    hardware = f"{os.cpu_count()}-core {jax.default_backend()}, jax {jax.__version__}"
    card |= {"phases": phases, "hardware": hardware, "task_options": tasks.EVAL_OPTIONS}
    card_lib.export(_CONFIG.value, state.params, _EXPORT.value, **card)
    print(json.dumps(card, indent=1))
    print(f"exported to {_EXPORT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
