"""Model-made evidence: ``python -m experiments.calibrate --config=configs/calibrate.py[:quick]``
computes Q-Filters' directions, ExpectedAttentionStats' query statistics, DuoAttention's gates
(each ``duo_methods``) and KVzip's reconstruction attention with :mod:`kvjax.model.calibrate`,
and writes ``calibration.npz`` (``qfilters_LGD``, ``stats_query_mean_LHD``,
``stats_query_cov_LHDD``, ``retrieval_heads_LG_<method>``, ``reconstruction_attn_LGT``, the
DuoAttention loss curve) and ``timings.json`` into the workdir
(:func:`kvjax.model.calibrate.experiment`).

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
Q-Filters' and the query statistics' rows are split among them and gathered, DuoAttention's
distillation is data-parallel (each step's ``duo_batch`` examples spread over the processes, the
gradients reduced across them), and process 0 alone computes the cheap proxies and KVzip's
evidence and writes the files."""

import pathlib

import jax.numpy as jnp
import numpy as np
from absl import app

from configs import common
from kvjax import distributed
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "calibrate.py"),
  "Calibration configuration.",
  lock_config=True,
)
_FLAGS = common.define_distributed_flags()


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(c):
  """Loads the model and the text of config ``c`` (``configs/calibrate.py``) and computes the
  evidence; every process calls it, process 0 writes the files."""
  model, _, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)

  def texts(rows, length):  # the reference prose (the tiny word vocabulary: the task filler)
    if c.model == "tiny":
      return np.stack([tasks.haystack_ids(tokenizer, length, seed=s) for s in range(rows)])
    return calibrate.calibration_rows(
      tok, streaming.reference_text(6 * rows * length), rows, length
    )

  kw = dict(length=c.duo_length, num_pairs=c.duo_num_pairs, num_queries=c.duo_num_queries)
  exs = [
    tasks.generate(c.duo_task, tokenizer, seed=c.seed + i, **kw) for i in range(c.duo_examples)
  ]
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    first, later = (tuple(tasks.haystack_ids(tok, n, seed=99 + n)) for n in (6, 10))
    template = calibrate.KVzipTemplate(first, later, suffix_ids=())
  else:
    template = calibrate.kvzip_template(tok, prefix_text=c.kvzip_prefix, suffix_text=c.kvzip_suffix)
  head = np.asarray(tok.encode(c.kvzip_prefix) if c.kvzip_prefix else [], np.int32)
  context = np.concatenate([head, texts(1, c.kvzip_length - head.size)[0]])
  examples = calibrate.duo_examples(exs)
  calibrate.experiment(c, model, texts, examples, context, template)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
