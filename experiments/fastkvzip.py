"""Fast KVzip's gates: ``python -m experiments.fastkvzip --config=configs/fastkvzip.py[:quick]``
extracts KVzip scores and attention inputs from shipped text, trains the gates as the official
``optim.py``, and writes ``fastkvzip_gates.npz`` and ``results.json`` into the workdir, with the
share of KVzip's kept pairs that the gates keep on held-out contexts and the time of both
evidences (:func:`kvjax.model.fastkvzip.experiment`). Killed, it resumes: the targets are saved
per batch of contexts (``targets/part_*.npz``) and the training is checkpointed with orbax every
``checkpoint_every`` steps (``gate_checkpoints/``).

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
each extracts its share of every round of target batches (process 0 saves the parts), the gates
train data-parallel with orbax's multi-host checkpoints, and process 0 compares with KVzip on
the held-out contexts and writes the files.

The text is Python's own reference prose (``pydoc_data.topics``, shipped with CPython:
:func:`kvjax.eval.streaming.reference_text`, which Q-Filters' calibration also reads); the tiny
model's word vocabulary reads the task filler (:func:`kvjax.eval.tasks.haystack_ids`).
"""

import functools
import pathlib

import jax.numpy as jnp
from absl import app

from configs import common
from kvjax import distributed
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import fastkvzip, reconstruction

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "fastkvzip.py"),
  "Fast KVzip gate training configuration.",
  lock_config=True,
)
_FLAGS = common.define_distributed_flags()

SOURCE = "pydoc_data.topics (CPython's reference prose) via kvjax.eval.streaming.reference_text"


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(c):
  """Loads the model and the text of config ``c`` (``configs/fastkvzip.py``: ``rows`` training
  contexts, then ``eval_rows`` held out) and trains the gates; every process calls it, process
  0 compares with KVzip and writes the files."""
  model, _, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  n = c.rows + c.eval_rows
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    text, source = dict(filler=functools.partial(tasks.haystack_ids, tok)), "task filler"
  else:  # a longer reference adds whole topics at its end: the first rows' tokens stay the same
    text, source = dict(text=streaming.reference_text(6 * n * c.length)), SOURCE
  rows, template = reconstruction.kvzip_corpus(
    tok, n, c.length, prefix_text=c.prefix, suffix_text=c.suffix, **text
  )
  fastkvzip.experiment(c, model, rows, template, source)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
