"""RestoreKV's adapter: ``python -m experiments.restorekv --config=configs/restorekv.py[:quick]``
fixes KVzip's kept context pairs of text rows (:func:`kvjax.model.restorekv.training_data`),
trains the restore embeddings and the LoRA adapter by self-distillation from the full cache
(:func:`kvjax.model.restorekv.train_adapter`), and writes ``restorekv_adapter.npz``
(:func:`kvjax.model.restorekv.save`) and ``results.json`` into the workdir: the test KL of the
untrained and the trained adapter, of KVzip alone over the whole budget (the baseline RestoreKV
must beat at equal memory), and the time of the restore pass against KVzip's reconstruction.
Killed, it resumes: the training data are saved per part (``data/part_*.npz``) and the training
is checkpointed with orbax every ``checkpoint_every`` steps (``checkpoints/``).

The text is Python's own reference prose (``pydoc_data.topics``, shipped with CPython:
:func:`kvjax.eval.streaming.reference_text`); the tiny model's word vocabulary reads the task
filler (:func:`kvjax.eval.tasks.haystack_ids`). One process: the training is not spread over
the processes of a cluster.
"""

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from configs import common
from kvjax import rundir
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate, llama, restorekv

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "restorekv.py"),
  "RestoreKV adapter training configuration.",
  lock_config=True,
)

SOURCE = "pydoc_data.topics (CPython's reference prose) via kvjax.eval.streaming.reference_text"


def rows_and_template(c, tokenizer):
  """``[rows, head + length + continuation]`` text rows (the chat template's header first),
  KVzip's template, the context length and the source."""
  tok = getattr(tokenizer, "tok", tokenizer)
  n, width = c.rows + c.eval_rows, c.length + c.continuation
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    first = tuple(tasks.haystack_ids(tok, 6, seed=105))
    later = tuple(tasks.haystack_ids(tok, 7, seed=106))
    rows = np.stack([tasks.haystack_ids(tok, width, seed=s) for s in range(n)]).astype(np.int32)
    return rows, calibrate.KVzipTemplate(first, later, ()), c.length, "task filler"
  template = calibrate.kvzip_template(tok, prefix_text=c.prefix, suffix_text=c.suffix)
  head = np.asarray(tok.encode(c.prefix) if c.prefix else [], np.int32)
  # every topic of the reference (about 150k characters, 35k SmolLM2 tokens)
  ids = np.asarray(tok.encode(streaming.reference_text(140_000)), np.int32)
  if ids.size < n * width:
    raise ValueError(
      f"rows: the text gives {ids.size} tokens, fewer than ({c.rows} + {c.eval_rows}) x {width}"
    )
  body = ids[: n * width].reshape(n, width)
  rows = np.concatenate([np.broadcast_to(head, (n, head.size)), body], 1)
  return rows, template, head.size + c.length, SOURCE


def examples(c, cfg, params, rows, template, context, workdir, tokens, name):
  """The self-distillation examples of ``rows``, part by part, each part saved (a killed run
  skips the saved ones)."""
  parts = workdir / "data"
  parts.mkdir(exist_ok=True)
  out = []
  for i in range(0, len(rows), c.batch_rows):
    path = parts / f"{name}_{i:05d}.npz"
    if path.exists():
      with np.load(path) as f:
        out.append((f["context"], f["continuation"], f["keep"]))
      continue
    t0 = time.perf_counter()
    ctx, cont, keep = restorekv.training_data(
      cfg,
      params,
      rows[i : i + c.batch_rows],
      template,
      context=context,
      ratio=c.ratio,
      tokens=tokens,
      chunk_size=c.chunk_size,
      n_sink=c.n_sink,
      plus=c.plus,
    )
    np.savez(path.with_suffix(".tmp.npz"), context=ctx, continuation=cont, keep=keep)
    os.replace(path.with_suffix(".tmp.npz"), path)  # a part is whole or absent
    out.append((ctx, cont, keep))
    n = min(i + c.batch_rows, len(rows))
    print(f"{name}: rows {n}/{len(rows)} ({time.perf_counter() - t0:.1f} s)", flush=True)
  return tuple(np.concatenate([p[k] for p in out], axis=1 if k == 2 else 0) for k in range(3))


def _timed(fn):
  """``(result, seconds)`` of a second call (the first one compiles)."""
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def timings(c, cfg, params, adapter, row, template):
  """The restore pass (a prefill and the N tokens) against KVzip's reconstruction evidence."""
  ids = jnp.asarray(row[None])
  restore = jax.jit(lambda p, a, x: restorekv.restore_kv(cfg, p, a, llama.prefill(cfg, p, x)))
  _, t_restore = _timed(lambda: restore(params, adapter, ids))
  _, t_kvzip = _timed(
    lambda: calibrate.kvzip_evidence(
      cfg, params, row, template, chunk_size=c.chunk_size, n_sink=c.n_sink, plus=c.plus
    )
  )
  return {"tokens": int(row.size), "restore_pass_s": t_restore, "kvzip_evidence_s": t_kvzip}


def main(argv):
  del argv
  run(_CONFIG.value)


def run(c):
  """Builds the examples and trains the adapter of config ``c``; writes the files.

  Args:
    c: the config (``configs/restorekv.py``).
  """
  workdir = rundir.check_workdir(c.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  model, cfg, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  params = model.params()
  rows, template, context, source = rows_and_template(c, tokenizer)
  train_rows, test_rows = rows[: c.rows], rows[c.rows :]
  t0 = time.perf_counter()
  train = examples(c, cfg, params, train_rows, template, context, workdir, c.tokens, "train")
  test = examples(c, cfg, params, test_rows, template, context, workdir, c.tokens, "test")
  baseline = examples(c, cfg, params, test_rows, template, context, workdir, 0, "kvzip")
  spent = {"data": round(time.perf_counter() - t0, 2)}
  print(f"examples: {len(train[0])} train, {len(test[0])} test; context {context} tokens")

  t0 = time.perf_counter()
  trained = restorekv.train_adapter(
    cfg,
    params,
    train,
    test=test,
    tokens=c.tokens,
    rank=c.rank,
    alpha=c.alpha,
    lr=c.lr,
    max_steps=c.max_steps,
    batch_size=c.batch_size,
    log_every=c.log_every,
    seed=c.seed,
    checkpoint_dir=workdir / "checkpoints",
    checkpoint_every=c.checkpoint_every,
  )
  spent["training"] = round(time.perf_counter() - t0, 2)
  kvzip_kl = restorekv.mean_loss(cfg, params, None, baseline, c.batch_size)
  results = {
    "model": c.model,
    "source": source,
    "context_tokens": context,
    "continuation_tokens": c.continuation,
    "ratio": c.ratio,
    "restore_tokens": c.tokens,
    "rank": c.rank,
    "trained_fraction": restorekv.trained_fraction(trained.adapter, params),
    "test_kl_untrained": trained.initial_test_loss,
    "test_kl_trained": trained.history[-1][2],
    "test_kl_kvzip_alone": kvzip_kl,
    "history": [list(r) for r in trained.history],
    "timing": timings(c, cfg, params, trained.adapter, test_rows[0, :context], template),
    "seconds": spent,
  }
  meta = {
    "model": c.model,
    "source": source,
    "rows": c.rows,
    "context": context,
    "ratio": c.ratio,
    "max_steps": c.max_steps,
    "test_kl": results["test_kl_trained"],
  }
  restorekv.save(workdir / "restorekv_adapter.npz", trained.adapter, meta)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  keys = ("test_kl_untrained", "test_kl_trained", "test_kl_kvzip_alone", "trained_fraction")
  print(json.dumps({k: results[k] for k in keys} | results["timing"]))
  print(f"run directory: {workdir.absolute()}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
