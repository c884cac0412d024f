"""KVzap's surrogates: ``python -m experiments.kvzap --config=configs/kvzap.py[:quick]``
extracts KVzip+ targets from shipped text with :func:`kvjax.model.kvzap.kvzap_targets`, fits the
ridge surrogate and trains the MLP surrogate (kvpress ``kvzap/train.py``'s recipe), and writes
``kvzap_linear.npz``, ``kvzap_mlp.npz`` (:func:`kvjax.model.kvzap.save`) and ``results.json``
into the workdir. Killed, it resumes: the targets are saved per batch of contexts
(``targets/part_*.npz``) and the MLP is checkpointed with orbax every epoch
(``mlp_checkpoints/``).

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
from kvjax import rundir
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate, kvzap

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "kvzap.py"),
  "KVzap training configuration.",
  lock_config=True,
)

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


def extract(c, cfg, params, rows, template, workdir):
  """The targets, batch by batch, each batch saved (a killed run skips the saved ones)."""
  parts = workdir / "targets"
  parts.mkdir(exist_ok=True)
  # saved parts are reused only by a run that would compute the same ones
  identity = {
    k: c[k] for k in ("model", "dtype", "rows", "length", "n_tokens", "batch_rows", "seed")
  }
  identity.update(prefix=c.prefix, suffix=c.suffix, rows_sum=int(rows.sum()))
  record = parts / "targets.json"
  if record.exists() and json.loads(record.read_text()) != identity:
    raise ValueError(
      f"workdir: {parts} holds targets of other settings ({record.read_text()}); use a fresh "
      "workdir"
    )
  record.write_text(json.dumps(identity))
  Xs, ys = [], []
  for i in range(0, len(rows), c.batch_rows):
    path = parts / f"part_{i:05d}.npz"
    if path.exists():
      with np.load(path) as f:
        X, y = f["X"], f["y"]
    else:
      t0 = time.perf_counter()
      X, y = kvzap.kvzap_targets(
        cfg, params, rows[i : i + c.batch_rows], template, n_tokens=c.n_tokens, seed=c.seed + i
      )
      np.savez(path.with_suffix(".tmp.npz"), X=X, y=y)
      os.replace(path.with_suffix(".tmp.npz"), path)  # a part is whole or absent
      dt = time.perf_counter() - t0
      print(f"targets: contexts {i + len(X) // c.n_tokens}/{len(rows)} ({dt:.1f} s)", flush=True)
    Xs.append(X)
    ys.append(y)
  return np.concatenate(Xs), np.concatenate(ys)


def main(argv):
  del argv
  c = _CONFIG.value
  workdir = rundir.check_workdir(c.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  model, cfg, tokenizer = evaluate.load_model(c.model, dtype=jnp.dtype(c.dtype))
  params = model.params()
  rows, template, source = contexts_and_template(c, tokenizer)
  t0 = time.perf_counter()
  X, y = extract(c, cfg, params, rows, template, workdir)
  timings = {"targets": round(time.perf_counter() - t0, 2)}
  n_test = c.test_rows * c.n_tokens  # the first contexts, as kvzap/train.py's test split
  X_train, X_test, y_train, y_test = X[n_test:], X[:n_test], y[n_test:], y[:n_test]
  print(f"examples: {len(X_train)} train, {len(X_test)} test; X {X.shape[1:]}, y {y.shape[1:]}")

  t0 = time.perf_counter()
  linear = kvzap.fit_linear(X_train, y_train, alpha=c.ridge_alpha)
  timings["linear"] = round(time.perf_counter() - t0, 2)
  t0 = time.perf_counter()
  run = kvzap.train_mlp(
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
  )
  timings["mlp"] = round(time.perf_counter() - t0, 2)

  Xt, yt = jnp.asarray(X_test), jnp.asarray(y_test)
  results = {
    "model": c.model,
    "source": source,
    "examples": {"train": len(X_train), "test": len(X_test)},
    "test_mse": {
      "mean_predictor": float(np.mean(np.square(y_test - y_train.mean(0)))),
      "linear": float(kvzap.mse(linear, Xt, yt)),
      "mlp": float(kvzap.mse(run.surrogate, Xt, yt)),
    },
    "mlp_train_loss": list(run.train_loss),
    "mlp_valid_loss": [run.initial_valid_loss, *run.valid_loss],
    "timings_s": timings,
  }
  meta = {
    "model": c.model,
    "source": source,
    "rows": c.rows,
    "length": c.length,
    "n_tokens": c.n_tokens,
  }
  for kind, s in (("linear", linear), ("mlp", run.surrogate)):
    kvzap.save(workdir / f"kvzap_{kind}.npz", s, {**meta, "test_mse": results["test_mse"][kind]})
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(json.dumps(results["test_mse"]))
  print(f"run directory: {workdir.absolute()}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
