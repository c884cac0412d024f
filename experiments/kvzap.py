"""KVzap's surrogates: ``python -m experiments.kvzap --config=configs/kvzap.py[:quick]``
extracts KVzip+ targets from shipped text with :func:`kvjax.model.kvzap.kvzap_targets`, fits the
ridge surrogate and trains the MLP surrogate (kvpress ``kvzap/train.py``'s recipe), and writes
``kvzap_linear.npz``, ``kvzap_mlp.npz`` (:func:`kvjax.model.kvzap.save`) and ``results.json``
into the workdir. Killed, it resumes: the targets are saved per batch of contexts
(``targets/part_*.npz``) and the MLP is checkpointed with orbax every epoch
(``mlp_checkpoints/``).

Started on every process of a cluster (``kvjax.distributed``: ``--coordinator``,
``--num_processes``, ``--process_id``, or SLURM / a TPU slice), the processes share the work:
each extracts its share of every round of target batches (process 0 saves the parts), the MLP
trains data-parallel (each step's batch spread over the processes) with orbax's multi-host
checkpoints, and process 0 fits the ridge surrogate and writes the files.

The text is Python's own reference prose (``pydoc_data.topics``, shipped with CPython:
:func:`kvjax.eval.streaming.reference_text`, which Q-Filters' calibration also reads); the tiny
model's word vocabulary reads the task filler (:func:`kvjax.eval.tasks.haystack_ids`).
"""

import json
import os
import pathlib
import time

import jax.numpy as jnp
import numpy as np
from absl import app

from configs import common
from kvjax import distributed, rundir
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate, kvzap

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "kvzap.py"),
  "KVzap training configuration.",
  lock_config=True,
)
_FLAGS = common.define_distributed_flags()

SOURCE = "pydoc_data.topics (CPython's reference prose) via kvjax.eval.streaming.reference_text"


def contexts_and_template(c, tokenizer):
  """``[rows, T]`` contexts (the chat template's header first) and KVzip's template."""
  tok = getattr(tokenizer, "tok", tokenizer)  # raw ids for the template (no leading space)
  if c.model == "tiny":  # the word vocabulary cannot spell KVzip's prompt: filler words instead
    first = tuple(tasks.haystack_ids(tok, 6, seed=105))
    rows = np.stack([tasks.haystack_ids(tok, c.length, seed=s) for s in range(c.rows)])
    return rows.astype(np.int32), calibrate.KVzipTemplate(first, (), ()), "task filler"
  template = calibrate.kvzip_template(tok, prefix_text=c.prefix, suffix_text=c.suffix)
  head = np.asarray(tok.encode(c.prefix) if c.prefix else [], np.int32)
  ids = np.asarray(tok.encode(streaming.reference_text(6 * c.rows * c.length)), np.int32)
  if ids.size < c.rows * c.length:
    raise ValueError(f"rows: the text gives {ids.size} tokens, fewer than {c.rows} x {c.length}")
  body = ids[: c.rows * c.length].reshape(c.rows, c.length)
  rows = np.concatenate([np.broadcast_to(head, (c.rows, head.size)), body], 1)
  return rows, template, SOURCE


def _load_part(path):
  with np.load(path) as f:
    return f["X"], f["y"]


def _from_primary(value, what):
  """Process 0's array on every process (it alone reads the run directory)."""
  if distributed.process_count() == 1:
    return value
  mine = value if distributed.is_primary() else np.zeros(0, np.float32)
  return distributed.gather_arrays(mine, what)[0]


def extract(c, cfg, params, rows, template, workdir):
  """The targets, batch by batch, each batch saved (a killed run skips the saved ones). Over
  several processes each round of batches is split among them (one each) and process 0 saves
  them; every process returns every target."""
  parts = workdir / "targets"
  # saved parts are reused only by a run that would compute the same ones
  identity = {
    k: c[k] for k in ("model", "dtype", "rows", "length", "n_tokens", "batch_rows", "seed")
  }
  identity.update(prefix=c.prefix, suffix=c.suffix, rows_sum=int(rows.sum()))
  record = parts / "targets.json"
  starts = list(range(0, len(rows), c.batch_rows))

  def claim():
    parts.mkdir(exist_ok=True)
    if record.exists() and json.loads(record.read_text()) != identity:
      raise ValueError(
        f"workdir: {parts} holds targets of other settings ({record.read_text()}); use a fresh "
        "workdir"
      )
    record.write_text(json.dumps(identity))
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
      X, y = kvzap.kvzap_targets(
        cfg, params, rows[i : i + c.batch_rows], template, n_tokens=c.n_tokens, seed=c.seed + i
      )
      Xs.append(X)
      ys.append(y)
      dt = time.perf_counter() - t0
      print(f"targets: contexts {i + len(X) // c.n_tokens}/{len(rows)} ({dt:.1f} s)", flush=True)
    Xs = distributed.gather_shares(Xs, len(round_), "gathering the targets")
    ys = distributed.gather_shares(ys, len(round_), "gathering the targets")
    for i, X, y in zip(round_, Xs, ys, strict=True):
      got[i] = (X, y)
      if distributed.is_primary():
        path = parts / f"part_{i:05d}.npz"
        np.savez(path.with_suffix(".tmp.npz"), X=X, y=y)
        os.replace(path.with_suffix(".tmp.npz"), path)  # a part is whole or absent
  for i in sorted(done):
    X, y = _load_part(parts / f"part_{i:05d}.npz") if distributed.is_primary() else (None, None)
    got[i] = (_from_primary(X, "sharing the saved targets"), _from_primary(y, "sharing them"))
  return tuple(np.concatenate([got[i][k] for i in starts]) for k in (0, 1))


def main(argv):
  del argv
  distributed.maybe_initialize(_FLAGS)  # first: before anything runs on a device
  with distributed.fail_fast():
    run(_CONFIG.value)


def run(c):
  """Extracts the targets and trains both surrogates of config ``c``; every process calls it,
  process 0 writes the files.

  Args:
    c: the config (``configs/kvzap.py``).
  """
  workdir = rundir.check_workdir(c.workdir)
  primary = distributed.is_primary()
  if primary:
    workdir.mkdir(parents=True, exist_ok=True)
  model, cfg, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  params = model.params()
  rows, template, source = contexts_and_template(c, tokenizer)
  t0 = time.perf_counter()
  X, y = extract(c, cfg, params, rows, template, workdir)
  timings = {"targets": round(time.perf_counter() - t0, 2)}
  n_test = c.test_rows * c.n_tokens  # the first contexts, as kvzap/train.py's test split
  X_train, X_test, y_train, y_test = X[n_test:], X[:n_test], y[n_test:], y[:n_test]
  if primary:
    print(f"examples: {len(X_train)} train, {len(X_test)} test; X {X.shape[1:]}, y {y.shape[1:]}")

  def on_epoch(epoch, tl, vl):
    if primary:
      print(
        f"kvzap mlp: epoch {epoch + 1}/{c.max_epochs} train {tl:.4f} valid {vl:.4f}", flush=True
      )
    distributed.fault_point()  # after the epoch's checkpoint: the tests kill a process here

  t0 = time.perf_counter()
  trained = kvzap.train_mlp(
    X_train,
    y_train,
    hidden_dim=c.hidden_dim,
    max_epochs=c.max_epochs,
    lr=c.lr,
    batch_size=c.batch_size,
    weight_decay=c.weight_decay,
    valid_fraction=c.valid_fraction,
    seed=c.seed,
    checkpoint_dir=workdir / "mlp_checkpoints",
    on_epoch=on_epoch,
    across_processes=True,
  )
  timings["mlp"] = round(time.perf_counter() - t0, 2)
  if not primary:  # process 0 fits the ridge surrogate (one closed form) and writes
    return
  t0 = time.perf_counter()
  linear = kvzap.fit_linear(X_train, y_train, alpha=c.ridge_alpha)
  timings["linear"] = round(time.perf_counter() - t0, 2)

  Xt, yt = jnp.asarray(X_test), jnp.asarray(y_test)
  results = {
    "model": c.model,
    "source": source,
    "examples": {"train": len(X_train), "test": len(X_test)},
    "test_mse": {
      "mean_predictor": float(np.mean(np.square(y_test - y_train.mean(0)))),
      "linear": float(kvzap.mse(linear, Xt, yt)),
      "mlp": float(kvzap.mse(trained.surrogate, Xt, yt)),
    },
    "mlp_train_loss": list(trained.train_loss),
    "mlp_valid_loss": [trained.initial_valid_loss, *trained.valid_loss],
    "timings_s": timings,
    "processes": distributed.process_count(),
  }
  meta = {
    "model": c.model,
    "source": source,
    "rows": c.rows,
    "length": c.length,
    "n_tokens": c.n_tokens,
  }
  for kind, s in (("linear", linear), ("mlp", trained.surrogate)):
    kvzap.save(workdir / f"kvzap_{kind}.npz", s, {**meta, "test_mse": results["test_mse"][kind]})
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(json.dumps(results["test_mse"]))
  print(f"run directory: {workdir.absolute()}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
