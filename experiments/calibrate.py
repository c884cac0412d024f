"""Model-made evidence: ``python -m experiments.calibrate --config=configs/calibrate.py[:quick]``
computes Q-Filters' directions, ExpectedAttentionStats' query statistics, DuoAttention's gates
(each ``duo_methods``) and KVzip's reconstruction attention with :mod:`kvjax.model.calibrate`,
and writes ``calibration.npz`` (``qfilters_LGD``, ``stats_query_mean_LHD``,
``stats_query_cov_LHDD``, ``retrieval_heads_LG_<method>``, ``reconstruction_attn_LGT``, the
DuoAttention loss curve) and ``timings.json`` into the workdir.

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
Q-Filters' and the query statistics' rows are split among them and gathered, DuoAttention's
distillation is data-parallel (each step's ``duo_batch`` examples spread over the processes, the
gradients reduced across them), and process 0 alone computes the cheap proxies and KVzip's
evidence and writes the files."""

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from configs import common
from kvjax import distributed, rundir
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "calibrate.py"),
  "Calibration configuration.",
  lock_config=True,
)
_FLAGS = common.define_distributed_flags()


def _timed(timings, name, fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  timings[name] = round(time.perf_counter() - t0, 2)
  print(f"{name}: {timings[name]} s")
  return out


def _text_ids(config, tokenizer, rows, length):
  """Rows of the reference prose (the tiny word vocabulary reads the task filler instead)."""
  if config.model == "tiny":
    return np.stack([tasks.haystack_ids(tokenizer, length, seed=s) for s in range(rows)])
  text = streaming.reference_text(6 * rows * length)
  return calibrate.calibration_rows(getattr(tokenizer, "tok", tokenizer), text, rows, length)


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(c):
  """Computes the evidence of config ``c``; every process calls it, process 0 writes the files.

  Args:
    c: the config (``configs/calibrate.py``).
  """
  rundir.check_workdir(c.workdir)  # "" would be the current directory: refused
  primary = distributed.is_primary()
  if primary:
    os.makedirs(c.workdir, exist_ok=True)
  model, cfg, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  params = model.params()
  out, timings = {}, {}

  rows = _text_ids(c, tokenizer, c.qfilter_rows, c.qfilter_length)
  out["qfilters_LGD"] = _timed(
    timings,
    "qfilters",
    lambda: calibrate.qfilters(
      cfg, params, rows, num_svd_samples=c.num_svd_samples, seed=c.seed, across_processes=True
    ),
  )
  # ExpectedAttentionStats: the query moments of the same rows (kvpress: 100 BookSum chapters)
  out["stats_query_mean_LHD"], out["stats_query_cov_LHDD"] = _timed(
    timings,
    "query_stats",
    lambda: calibrate.query_stats(cfg, params, rows, n_sink=c.stats_n_sink, across_processes=True),
  )

  exs = [
    tasks.generate(
      c.duo_task,
      tokenizer,
      length=c.duo_length,
      seed=c.seed + i,
      num_pairs=c.duo_num_pairs,
      num_queries=c.duo_num_queries,
    )
    for i in range(c.duo_examples)
  ]
  examples = calibrate.duo_examples(exs)
  texts = _text_ids(c, tokenizer, c.duo_otf_rows, c.qfilter_length)
  for method in c.duo_methods:
    if method != "official" and not primary:  # the proxies are one cheap pass: process 0's
      continue
    t0 = time.perf_counter()
    if method == "official":
      trained = calibrate.train_duo_attention(
        cfg,
        params,
        examples,
        num_steps=c.duo_steps,
        lr=c.duo_lr,
        reg_weight=c.duo_reg_weight,
        batch_size=c.duo_batch,
        across_processes=True,
      )
      gates = trained.alpha_LG
      out["duo_loss"], out["duo_distill"] = trained.loss, trained.distill
      out["duo_sink_recent"] = (trained.sink_size, trained.recent_size)
    elif method == "kvpress_on_the_fly":
      gates = calibrate.duo_attention_pattern(cfg, params, method=method, calibration_ids=texts)
    else:
      gates = calibrate.duo_attention_pattern(cfg, params, examples, method=method)
    out[f"retrieval_heads_LG_{method}"] = gates
    timings[f"duo_{method}"] = round(time.perf_counter() - t0, 2)
    print(f"duo_{method}: {timings[f'duo_{method}']} s")
  if not primary:  # KVzip's evidence is one context: process 0 computes it and writes
    return

  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    first, later = (tuple(tasks.haystack_ids(tok, n, seed=99 + n)) for n in (6, 10))
    template = calibrate.KVzipTemplate(first, later, suffix_ids=())
  else:
    template = calibrate.kvzip_template(tok, prefix_text=c.kvzip_prefix, suffix_text=c.kvzip_suffix)
  head = tok.encode(c.kvzip_prefix) if c.kvzip_prefix else []
  body = _text_ids(c, tokenizer, 1, c.kvzip_length - len(head))[0]
  context = np.concatenate([np.asarray(head, np.int32), body])
  out["kvzip_context_T"] = context
  out["reconstruction_attn_LGT"] = _timed(
    timings,
    "kvzip",
    lambda: calibrate.kvzip_evidence(cfg, params, context, template, chunk_size=c.kvzip_chunk_size),
  )

  np.savez(os.path.join(c.workdir, "calibration.npz"), **{k: np.asarray(v) for k, v in out.items()})
  with open(os.path.join(c.workdir, "timings.json"), "w") as f:
    json.dump(
      {
        "model": c.model,
        "timings_s": timings,
        "backend": jax.default_backend(),
        "processes": distributed.process_count(),
      },
      f,
    )
  for key in sorted(k for k in out if k.startswith("retrieval_heads_LG_")):
    gates = np.asarray(out[key])
    print(
      f"{key}: {int((gates > 0.5).sum())} of {gates.size} heads above 0.5, mean {gates.mean():.3f}"
    )
  print(f"run directory: {os.path.abspath(c.workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
