"""RestoreKV's adapter: ``python -m experiments.restorekv --config=configs/restorekv.py[:quick]``
fixes KVzip's kept context pairs of text rows, trains the restore embeddings and the LoRA
adapter by self-distillation from the full cache, and writes ``restorekv_adapter.npz`` and
``results.json`` into the workdir (:func:`kvjax.model.restorekv.experiment`): the test KL of the
untrained and the trained adapter, of KVzip alone over the whole budget (the baseline RestoreKV
must beat at equal memory), and the time of the restore pass against KVzip's reconstruction.
Killed, it resumes: the training data are saved per part (``data/*.npz``) and the training is
checkpointed with orbax every ``checkpoint_every`` steps (``checkpoints/``).

The text is Python's own reference prose (``pydoc_data.topics``, shipped with CPython:
:func:`kvjax.eval.streaming.reference_text`); the tiny model's word vocabulary reads the task
filler (:func:`kvjax.eval.tasks.haystack_ids`). One process: the training is not spread over
the processes of a cluster.
"""

import functools
import pathlib

import jax.numpy as jnp
from absl import app

from configs import common
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import reconstruction, restorekv

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "restorekv.py"),
  "RestoreKV adapter training configuration.",
  lock_config=True,
)

SOURCE = "pydoc_data.topics (CPython's reference prose) via kvjax.eval.streaming.reference_text"


def main(argv):
  del argv
  run(_CONFIG.value)


def run(c):
  """Loads the model and the text of config ``c`` (``configs/restorekv.py``: ``rows`` training
  rows, then ``eval_rows`` test rows, each ``length + continuation`` tokens after the chat
  template's header) and trains the adapter; writes the files."""
  model, _, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    text, source = dict(filler=functools.partial(tasks.haystack_ids, tok)), "task filler"
  else:  # every topic of the reference (about 150k characters, 35k SmolLM2 tokens)
    text, source = dict(text=streaming.reference_text(140_000)), SOURCE
  rows, template = reconstruction.kvzip_corpus(
    tok,
    c.rows + c.eval_rows,
    c.length + c.continuation,
    prefix_text=c.prefix,
    suffix_text=c.suffix,
    **text,
  )
  restorekv.experiment(c, model, rows, template, source)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
