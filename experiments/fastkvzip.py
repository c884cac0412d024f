"""Fast KVzip's gates: ``python -m experiments.fastkvzip --config=configs/fastkvzip.py[:quick]``
extracts KVzip scores and attention inputs from shipped text with
:func:`kvjax.model.fastkvzip.gate_targets`, trains the gates as the official ``optim.py``
(:func:`kvjax.model.fastkvzip.train_gates`), and writes ``fastkvzip_gates.npz``
(:func:`kvjax.model.fastkvzip.save`) and ``results.json`` into the workdir, with the share of KVzip's kept pairs that the gates keep on
held-out contexts and the time of both evidences. Killed, it resumes:
the targets are saved per batch of contexts (``targets/part_*.npz``) and the training is
checkpointed with orbax every ``checkpoint_every`` steps (``gate_checkpoints/``).

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
each extracts its share of every round of target batches (process 0 saves the parts), the gates
train data-parallel (each step's batch spread over the processes) with orbax's multi-host
checkpoints, and process 0 compares with KVzip on the held-out contexts and writes the files.

The text is Python's own reference prose (``pydoc_data.topics``, shipped with CPython:
:func:`kvjax.eval.streaming.reference_text`, which Q-Filters' calibration also reads); the tiny
model's word vocabulary reads the task filler (:func:`kvjax.eval.tasks.haystack_ids`).
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
from kvjax import distributed, policies, rundir
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate, fastkvzip
from kvjax.policies.fastkvzip import FastKVzip

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "fastkvzip.py"),
  "Fast KVzip gate training configuration.",
  lock_config=True,
)
_FLAGS = common.define_distributed_flags()

COLUMNS = ("step", "train_loss", "test_loss", "train_acc", "test_acc")  # a history row
SOURCE = "pydoc_data.topics (CPython's reference prose) via kvjax.eval.streaming.reference_text"


def contexts_and_template(c, tokenizer):
  """``[rows, T]`` contexts (the chat template's header first), KVzip's template, the source."""
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    first = tuple(tasks.haystack_ids(tok, 6, seed=105))
    later = tuple(tasks.haystack_ids(tok, 7, seed=106))
    n = c.rows + c.eval_rows
    rows = np.stack([tasks.haystack_ids(tok, c.length, seed=s) for s in range(n)])
    return rows.astype(np.int32), calibrate.KVzipTemplate(first, later, ()), "task filler"
  template = calibrate.kvzip_template(tok, prefix_text=c.prefix, suffix_text=c.suffix)
  head = np.asarray(tok.encode(c.prefix) if c.prefix else [], np.int32)
  n = c.rows + c.eval_rows
  # a longer reference adds whole topics at its end: the first rows' tokens stay the same
  ids = np.asarray(tok.encode(streaming.reference_text(6 * n * c.length)), np.int32)
  if ids.size < n * c.length:
    raise ValueError(
      f"rows: the text gives {ids.size} tokens, fewer than ({c.rows} + {c.eval_rows}) x {c.length}"
    )
  body = ids[: n * c.length].reshape(n, c.length)
  rows = np.concatenate([np.broadcast_to(head, (n, head.size)), body], 1)
  return rows, template, SOURCE


def _timed(fn):
  """``(result, seconds)`` of a second call (the first one compiles)."""
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def compare_with_kvzip(c, cfg, params, gates, rows, template):
  """On held-out contexts: the share of KVzip's kept pairs (pooled, half the context per head)
  that Fast KVzip's policy also keeps, and the time of each one's evidence."""
  out = []
  for row in rows:
    kv, t_kvzip = _timed(
      lambda row=row: calibrate.kvzip_evidence(
        cfg, params, row, template, chunk_size=c.chunk_size, n_sink=c.n_sink
      )
    )
    ev, t_fast = _timed(
      lambda row=row: fastkvzip.fastkvzip_evidence(cfg, params, gates, row[None])[:, 0]
    )
    budget = row.size // 2
    ref = np.asarray(
      policies.KVzip().keep_mask(policies.Evidence(reconstruction_attn_LGT=kv), budget)
    )
    ours = np.asarray(FastKVzip().keep_mask(policies.Evidence(fastkvzip_LGT=ev), budget))
    overlap = float((ref & ours).sum() / ref.sum())
    out.append(
      {"tokens": int(row.size), "overlap": overlap, "kvzip_s": t_kvzip, "fastkvzip_s": t_fast}
    )
    print(
      f"held-out context ({row.size} tokens): {overlap:.3f} of KVzip's kept pairs kept; "
      f"evidence {t_fast:.2f} s (KVzip's reconstruction {t_kvzip:.2f} s)",
      flush=True,
    )
  return out


def _from_primary(value, what):
  """Process 0's array on every process (it alone reads the run directory)."""
  if distributed.process_count() == 1:
    return value
  mine = value if distributed.is_primary() else np.zeros(0, np.float32)
  return distributed.gather_arrays(mine, what)[0]


def extract(c, cfg, params, rows, template, workdir):
  """The training pairs, batch by batch, each batch saved (a killed run skips the saved ones).
  Over several processes each round of batches is split among them (one each) and process 0
  saves them; every process returns every pair."""
  parts = workdir / "targets"
  starts = list(range(0, len(rows), c.batch_rows))

  def claim():
    parts.mkdir(exist_ok=True)
    return [i for i in starts if (parts / f"part_{i:05d}.npz").exists()]

  done = set(distributed.on_primary(claim, "checking the saved targets"))
  todo = [i for i in starts if i not in done]
  got = {}
  for r in range(0, len(todo), distributed.process_count()):
    round_ = todo[r : r + distributed.process_count()]
    Xs, ys = [], []
    for j in distributed.share(round_):
      i = round_[j]
      t0 = time.perf_counter()
      X, y = fastkvzip.gate_targets(
        cfg, params, rows[i : i + c.batch_rows], template, chunk_size=c.chunk_size, n_sink=c.n_sink
      )
      Xs.append(X)
      ys.append(y)
      n = min(i + c.batch_rows, len(rows))
      print(f"targets: contexts {n}/{len(rows)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    Xs = distributed.gather_shares(Xs, len(round_), "gathering the targets")
    ys = distributed.gather_shares(ys, len(round_), "gathering the targets")
    for i, X, y in zip(round_, Xs, ys, strict=True):
      got[i] = (X, y)
      if distributed.is_primary():
        path = parts / f"part_{i:05d}.npz"
        np.savez(path.with_suffix(".tmp.npz"), X=X, y=y)
        os.replace(path.with_suffix(".tmp.npz"), path)  # a part is whole or absent
  for i in sorted(done):
    X = y = None
    if distributed.is_primary():
      with np.load(parts / f"part_{i:05d}.npz") as f:
        X, y = f["X"], f["y"]
    got[i] = (_from_primary(X, "sharing the saved targets"), _from_primary(y, "sharing them"))
  return tuple(np.concatenate([got[i][k] for i in starts]) for k in (0, 1))


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(c):
  """Extracts the pairs and trains the gates of config ``c``; every process calls it, process 0
  compares with KVzip and writes the files.

  Args:
    c: the config (``configs/fastkvzip.py``).
  """
  workdir = rundir.check_workdir(c.workdir)
  primary = distributed.is_primary()
  if primary:
    workdir.mkdir(parents=True, exist_ok=True)
  model, cfg, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  params = model.params()
  rows, template, source = contexts_and_template(c, tokenizer)
  rows, held_out = rows[: c.rows], rows[c.rows :]
  t0 = time.perf_counter()
  X, y = extract(c, cfg, params, rows, template, workdir)
  timings = {"targets": round(time.perf_counter() - t0, 2)}
  if primary:
    print(f"positions: {len(X)}; X {X.shape[1:]}, y {y.shape[1:]}, mean KVzip score {y.mean():.4f}")

  def on_log(row):
    if primary:
      step, tl, vl, ta, va = row
      print(
        f"fastkvzip gates: [{int(step):5d}/{c.max_steps}] loss: {tl:.3f} ({vl:.3f}) "
        f"acc: {ta * 100:.1f}% ({va * 100:.1f}%)",
        flush=True,
      )
    distributed.fault_point()  # after each log row (and its checkpoint): the tests kill here

  t0 = time.perf_counter()
  trained = fastkvzip.train_gates(
    X,
    y,
    cfg.num_groups,
    dim=c.dim,
    sink=c.sink,
    lr=c.lr,
    max_steps=c.max_steps,
    batch_size=c.batch_size,
    test_freq=c.test_freq,
    test_every=c.test_every,
    seed=c.seed,
    checkpoint_dir=workdir / "gate_checkpoints",
    checkpoint_every=c.checkpoint_every,
    on_log=on_log,
    across_processes=True,
  )
  timings["training"] = round(time.perf_counter() - t0, 2)
  if not primary:  # process 0 compares with KVzip on the held-out contexts and writes
    return
  history = np.asarray(trained.history)
  _, test_idx = fastkvzip.holdout_split(len(X), c.test_every)
  train_mean = np.delete(y, test_idx, 0).mean(0)  # [L, G]
  baseline = {  # a constant gate at each head's mean KVzip score, and "always below 0.05"
    "mean_predictor_test_loss": float(
      np.asarray(fastkvzip.bce(jnp.asarray(train_mean), jnp.asarray(y[test_idx])))
      .mean(0)
      .sum(-1)
      .mean()
    ),
    "majority_test_acc": float((y[test_idx] < fastkvzip.ACC_THRESHOLD).mean()),
  }
  comparison = compare_with_kvzip(c, cfg, params, trained.gates, held_out, template)
  results = {
    "model": c.model,
    "source": source,
    "positions": len(X),
    "initial_test_loss": trained.initial_test_loss,
    **baseline,
    "final": dict(zip(COLUMNS, trained.history[-1], strict=True)),
    "history": history.tolist(),
    "held_out": comparison,
    "timings_s": timings,
    "processes": distributed.process_count(),
  }
  meta = {
    "model": c.model,
    "source": source,
    "rows": c.rows,
    "length": c.length,
    "max_steps": c.max_steps,
    "test_loss": results["final"]["test_loss"],
  }
  fastkvzip.save(workdir / "fastkvzip_gates.npz", trained.gates, meta)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(
    json.dumps({"initial_test_loss": trained.initial_test_loss, **baseline, **results["final"]})
  )
  print(f"run directory: {workdir.absolute()}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
