"""KVzap's surrogates: ``python -m experiments.kvzap --config=configs/kvzap.py[:quick]``
extracts KVzip+ targets from shipped text, fits the ridge surrogate and trains the MLP
surrogate (kvpress ``kvzap/train.py``'s recipe), and writes ``kvzap_linear.npz``,
``kvzap_mlp.npz`` and ``results.json`` into the workdir (:func:`kvjax.model.kvzap.experiment`).
Killed, it resumes: the targets are saved per batch of contexts (``targets/part_*.npz``) and the
MLP is checkpointed with orbax every epoch (``mlp_checkpoints/``).

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
each extracts its share of every round of target batches (process 0 saves the parts), the MLP
trains data-parallel with orbax's multi-host checkpoints, and process 0 fits the ridge
surrogate and writes the files.

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
from kvjax.model import kvzap, reconstruction

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "kvzap.py"),
  "KVzap training configuration.",
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
  """Loads the model and the text of config ``c`` (``configs/kvzap.py``) and trains both
  surrogates; every process calls it, process 0 writes the files."""
  model, _, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    text, source = dict(filler=functools.partial(tasks.haystack_ids, tok)), "task filler"
  else:
    text, source = dict(text=streaming.reference_text(6 * c.rows * c.length)), SOURCE
  rows, template = reconstruction.kvzip_corpus(
    tok, c.rows, c.length, prefix_text=c.prefix, suffix_text=c.suffix, **text
  )
  kvzap.experiment(c, model, rows, template, source)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
