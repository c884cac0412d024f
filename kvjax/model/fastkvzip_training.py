"""Fast KVzip's gates trained on KVzip's scores, as the official ``optim.py`` (Fast KVzip, arXiv
2601.17668; ``Janghyun1230/FastKVzip``: ``optim.py``, ``utils.py``, ``load_data.py``,
``prefill/feature.py``), with optax, checkpointed with orbax; :mod:`kvjax.model.fastkvzip`
re-exports these.

* :func:`gate_targets` -> ``(X_NLd, y_NLG)``: the training pairs, as ``prefill/feature.py``
  collects them; :func:`holdout_split`: the held-out positions;
* :func:`loss`, :func:`accuracy`, :func:`optimizer`: binary cross-entropy, SGD with momentum 0.9
  at 0.2 and its step schedule;
* :func:`train_gates`: the run (:class:`GateConfig`), batches of 1000 positions;
* :func:`experiment`: ``python -m experiments.fastkvzip``'s run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import checks, distributed, policies, rundir
from kvjax.model import passes, training
from kvjax.model.fastkvzip_gates import (
  DIM,
  SINK,
  fastkvzip_evidence,
  gate_scores,
  init_gates,
  save,
)
from kvjax.model.reconstruction import KVzipOptions, KVzipTemplate, kvzip_evidence
from kvjax.policies.fastkvzip import FastKVzip
from kvjax.policies.methods import KVzip

Array = jax.Array

# optim.py's fixed training recipe
LR, MOMENTUM, MAX_STEPS, BATCH_SIZE, TEST_FREQ, TEST_EVERY = 0.2, 0.9, 5000, 1000, 50, 100
ACC_THRESHOLD = 0.05  # utils.acc_fn's threshold


# --------------------------------------------------------------------------- training data


def gate_targets(
  model,
  context_ids,
  template: KVzipTemplate,
  *,
  kvzip: KVzipOptions | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Fast KVzip's training pairs of each context, as the official ``prefill/feature.py``.

  Each context is read once (a dense causal pass) for every layer's attention input ``h_k`` of
  each position ``k``, and its KVzip scores come from the context reconstruction
  (:func:`kvjax.model.reconstruction.kvzip_evidence`: the max over the repeat queries and the GQA
  group of their attention to ``k``, per KV head). Positions before ``template.prefix_length``
  (the chat template's header; the official code's system prompt) are not targets.

  Differs from the official code: KVzip's scores are kvpress's (``chunk_size`` 2048 and the
  first ``n_sink`` 4 context tokens in every reconstruction softmax; the official
  ``KVScore._get_score`` uses 2000-token chunks and the system prompt as sinks); fp32 (the
  official features are the model's dtype, bfloat16); the template comes pre-tokenised.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: the contexts ``[T]`` or ``[B, T]`` (equal lengths, unpadded).
    template: the reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    kvzip: KVzip's options (:class:`~kvjax.model.reconstruction.KVzipOptions`; ``None``: the
      defaults).

  Returns:
    ``(X_NLd, y_NLG)`` fp32 numpy arrays, ``N = B * (T - prefix_length)``, context by context
    in position order.

  Raises:
    ValueError: as :func:`kvjax.model.reconstruction.kvzip_evidence` (ids, template, sizes).
  """
  y = kvzip_evidence(model, context_ids, template, options=kvzip)
  ids = np.asarray(context_ids)
  ids = ids[None] if ids.ndim == 1 else ids
  y = y[:, None] if y.ndim == 3 else y  # [L, B, G, T]
  h = passes.attention_inputs(model, ids)  # [L, B, T, d]
  prefix = template.prefix_length
  X = np.asarray(h[:, :, prefix:]).transpose(1, 2, 0, 3)  # [B, n, L, d]
  y = np.asarray(y[..., prefix:]).transpose(1, 3, 0, 2)  # [B, n, L, G]
  return X.reshape(-1, *X.shape[2:]), y.reshape(-1, *y.shape[2:])


def _check_xy(X_NLd, y_NLG) -> tuple[np.ndarray, np.ndarray]:
  X, y = training.check_pairs(X_NLd, y_NLG)
  if y.min() < 0 or y.max() > 1:
    raise ValueError(
      f"y_NLG: expected KVzip scores in [0, 1] (binary cross-entropy targets), got values in "
      f"[{y.min()}, {y.max()}]"
    )
  return X, y


def holdout_split(N: int, every: int = TEST_EVERY) -> tuple[np.ndarray, np.ndarray]:
  """The training and test indices (``load_data.split_fn``: every ``every``-th example,
  1-based, is held out).

  Args:
    N: examples.
    every: the spacing of the held-out examples (100).

  Returns:
    ``(train_idx, test_idx)``.
  """
  every = training.check_int("test_every", every)
  test = (np.arange(N) + 1) % every == 0
  return np.flatnonzero(~test), np.flatnonzero(test)


# --------------------------------------------------------------------------- the loss


def bce(pred: Array, target: Array) -> Array:
  """torch ``F.binary_cross_entropy(reduction="none")``: logs clamped at -100.

  Args:
    pred: probabilities.
    target: targets in ``[0, 1]``.

  Returns:
    The elementwise loss.
  """
  log_p = jnp.maximum(jnp.log(pred), -100.0)
  log_q = jnp.maximum(jnp.log1p(-pred), -100.0)
  return -(target * log_p + (1.0 - target) * log_q)


def _scored(gates: dict, X_NLd: Array, y_NLG: Array) -> tuple[Array, Array]:
  """The gates' scores and KVzip's targets, both ``[L, G, N]``."""
  return gate_scores(gates, jnp.swapaxes(X_NLd, 0, 1)), jnp.moveaxis(y_NLG, 0, 2)


def layer_losses(gates: dict, X_NLd: Array, y_NLG: Array) -> Array:
  """``utils.loss_fn(type="cnt")`` of each layer: the binary cross-entropy between the gates'
  scores and KVzip's, averaged over the positions and summed over the KV heads.

  Args:
    gates: the gates.
    X_NLd: attention inputs ``[N, L, d]``.
    y_NLG: KVzip scores ``[N, L, G]``.

  Returns:
    fp32 ``[L]``.
  """
  pred, target = _scored(gates, X_NLd, y_NLG)
  return bce(pred, target).mean(-1).sum(-1)


def loss(gates: dict, X_NLd: Array, y_NLG: Array) -> Array:
  """``optim.py``'s objective: the layers' losses summed (:func:`layer_losses`).

  Args:
    gates, X_NLd, y_NLG: as :func:`layer_losses`.

  Returns:
    The fp32 scalar.
  """
  return layer_losses(gates, X_NLd, y_NLG).sum()


def accuracy(gates: dict, X_NLd: Array, y_NLG: Array) -> Array:
  """``utils.acc_fn`` of each layer: how often the gate and KVzip agree on ``score >= 0.05``.

  Args:
    gates, X_NLd, y_NLG: as :func:`layer_losses`.

  Returns:
    fp32 ``[L]``.
  """
  pred, target = _scored(gates, X_NLd, y_NLG)
  return ((pred >= ACC_THRESHOLD) == (target >= ACC_THRESHOLD)).mean((1, 2))


def lr_schedule(lr: float, max_steps: int) -> Callable:
  """``utils.lr_schedule`` times the rate: ``0.01 * step`` while ``step < 0.01 * max_steps``
  (a warm-up that climbs 0.01 a step whatever ``max_steps`` is, as the official code), then 1,
  0.5 from half of ``max_steps``, 0.25 from three quarters.

  Args:
    lr: the base rate (0.2).
    max_steps: the run's steps.

  Returns:
    An optax schedule (step -> rate).
  """

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    alpha = jnp.where(
      step < 0.01 * max_steps,
      0.01 * step,
      jnp.where(step >= 0.75 * max_steps, 0.25, jnp.where(step >= 0.5 * max_steps, 0.5, 1.0)),
    )
    return lr * alpha

  return schedule


def optimizer(lr: float = LR, max_steps: int = MAX_STEPS) -> optax.GradientTransformation:
  """``optim.py``'s optimiser: torch ``SGD(momentum=0.9)`` (no dampening, no weight decay) at
  :func:`lr_schedule`'s rate.

  Args:
    lr: the base rate.
    max_steps: the run's steps.

  Returns:
    The optax transformation.
  """
  return optax.sgd(lr_schedule(lr, max_steps), momentum=MOMENTUM)


# --------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class GateTraining:
  """:func:`train_gates`'s result.

  Attributes:
    gates: the trained gates.
    history: one row per logged step (every ``test_freq``): ``(step, train_loss, test_loss,
      train_acc, test_acc)``, each the mean over layers as ``optim.py`` prints it; the training
      loss and accuracy are the step's batch before its update, the test ones after it.
    initial_test_loss: the test loss of the untrained gates (mean over layers).
  """

  gates: dict
  history: tuple[tuple[float, float, float, float, float], ...]
  initial_test_loss: float


def _weighted_layer_losses(gates, X, y, w):
  """:func:`layer_losses` of a padded batch: the rows of weight 0 (padding) count for nothing."""
  per_row = bce(*_scored(gates, X, y))
  return ((per_row * w).sum(-1) / jnp.maximum(w.sum(), 1.0)).sum(-1)


def _objective(gates, X, y):
  per_layer = layer_losses(gates, X, y)
  return per_layer.sum(), per_layer.mean()


def _weighted_objective(gates, X, y, w):
  per_layer = _weighted_layer_losses(gates, X, y, w)
  return per_layer.sum(), per_layer.mean()


def _evaluate(gates, X, y, batch: int) -> tuple[float, float]:
  """Mean-over-layers loss and accuracy over ``X`` in batches (nan when empty)."""
  if X.shape[0] == 0:
    return float("nan"), float("nan")
  losses, accs = 0.0, 0.0
  for i in range(0, X.shape[0], batch):
    xb, yb = jnp.asarray(X[i : i + batch]), jnp.asarray(y[i : i + batch])
    n = xb.shape[0]
    losses += float(_layer_losses_jit(gates, xb, yb).mean()) * n
    accs += float(_accuracy_jit(gates, xb, yb).mean()) * n
  return losses / X.shape[0], accs / X.shape[0]


_layer_losses_jit = jax.jit(layer_losses)
_accuracy_jit = jax.jit(accuracy)


@dataclasses.dataclass(frozen=True)
class GateConfig(training.TrainConfig):
  """:func:`train_gates`'s hyperparameters (the official ``optim.py``'s), each checked when made.

  Attributes:
    lr: the base learning rate (0.2).
    batch_size: positions per step (1000).
    seed: the seed of the initialisation and the shuffles.
    dim: the gate's head dim (16).
    sink: the learned sink keys per KV head (16).
    max_steps: optimiser steps (5000).
    test_freq: steps between log rows (50).
    test_every: the spacing of the held-out positions (100).
    checkpoint_every: steps between checkpoints (500).
  """

  lr: float = training.float_field(LR)
  batch_size: int = training.int_field(BATCH_SIZE)
  dim: int = training.int_field(DIM)
  sink: int = training.int_field(SINK)
  max_steps: int = training.int_field(MAX_STEPS)
  test_freq: int = training.int_field(TEST_FREQ)
  test_every: int = training.int_field(TEST_EVERY)
  checkpoint_every: int = training.int_field(500)


def _print_row(max_steps: int) -> Callable[[tuple], None]:
  def on_log(row):
    if distributed.is_primary():
      step, tl, vl, ta, va = row
      print(
        f"fastkvzip gates: [{int(step):5d}/{max_steps}] loss: {tl:.3f} ({vl:.3f}) "
        f"acc: {ta * 100:.1f}% ({va * 100:.1f}%)",
        flush=True,
      )

  return on_log


def train_gates(
  X_NLd,
  y_NLG,
  num_query_groups: int,
  config: GateConfig | None = None,
  *,
  checkpoint_dir: str | pathlib.Path | None = None,
  on_log: Callable[[tuple], None] | None = None,
  across_processes: bool = False,
  **options,
) -> GateTraining:
  """Trains Fast KVzip's gates, every layer at once, as the official ``optim.py``, with
  :func:`kvjax.model.training.run`.

  The loss is :func:`loss` (binary cross-entropy against KVzip's scores, ``type="cnt"``),
  minimised by :func:`optimizer` (SGD, momentum 0.9, ``lr`` 0.2 under :func:`lr_schedule`) for
  ``max_steps`` (5000) steps of ``batch_size`` (1000) positions; the positions are reshuffled
  whenever a pass over them starts (``step % (N_train // batch_size) == 0``; the last partial
  batch is never drawn). :func:`holdout_split` holds out every 100th position; every ``test_freq``
  (50) steps the training batch's and the test set's loss and accuracy are logged.

  With a ``checkpoint_dir`` the gates, the optimiser state and the log are saved with orbax
  every ``checkpoint_every`` steps and at the end, and a later call with the same arguments
  resumes from the last checkpoint: the result equals an uninterrupted run's (each pass's
  shuffle depends only on ``seed`` and the pass).

  Differs from the official code: the initialisation and shuffles use numpy's generator
  (torch's there), so the same data gives a different but equally distributed run;
  fp32 (the official features are bfloat16); ``optim.py``'s forward adds the bias ``b`` twice
  (``logit += self.b.unsqueeze(2)`` twice) while every inference path (its own
  ``prefill/attention/gate.py``, kvpress's ``FastKVzipGate``) adds it once: here training and
  inference both add it once, so the trained gates score as they were trained.

  Args:
    X_NLd: attention inputs ``[N, L, d]`` (:func:`gate_targets`).
    y_NLG: KVzip scores ``[N, L, G]`` in ``[0, 1]``.
    num_query_groups: query heads per KV head (``R``, kvpress ``ngroup``).
    config: the hyperparameters (``None``: :class:`GateConfig`'s defaults).
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    on_log: called with each log row (after any checkpoint of that step); the default prints a
      progress line as ``optim.py`` on process 0.
    across_processes: in a run of several processes (``kvjax.distributed``), data-parallel
      (:class:`kvjax.model.training.DataParallel`): every process calls it with the same data
      and arguments. The checkpoints are orbax's multi-host ones, so ``checkpoint_dir`` must
      be the same directory for every process. The result equals a one-process run's up to the
      order of the sums.
    **options: :class:`GateConfig` fields, over ``config`` (``max_steps=30``, ...).

  Returns:
    The :class:`GateTraining`.

  Raises:
    ValueError: for bad shapes, targets outside ``[0, 1]``, options that are not positive,
      fewer training positions than ``batch_size``, or a ``checkpoint_dir`` holding a run with
      other arguments or data shapes.
  """
  c = GateConfig.make(config, **options)
  X, y = _check_xy(X_NLd, y_NLG)
  R = training.check_int("num_query_groups", num_query_groups)
  train_idx, test_idx = holdout_split(X.shape[0], c.test_every)
  if train_idx.size < c.batch_size:
    raise ValueError(
      f"batch_size: {c.batch_size} is more than the {train_idx.size} training positions"
    )
  Xt, yt, Xv, yv = X[train_idx], y[train_idx], X[test_idx], y[test_idx]
  _, L, d = X.shape
  opt = optimizer(c.lr, c.max_steps)
  gates = init_gates(c.seed, L, d, y.shape[2], R, dim=c.dim, sink=c.sink)
  state = opt.init(gates)
  initial = _evaluate(gates, Xv, yv, c.batch_size)[0]
  par = training.DataParallel(across_processes, "the gates")

  def row(i, before, after, losses, batch):
    xb, yb = (jnp.asarray(a) for a in batch)
    # the step's batch before its update, as optim.py; the replicated gates read locally
    train_acc = float(_accuracy_jit(par.local(before), xb, yb).mean())
    test_loss, test_acc = _evaluate(par.local(after), Xv, yv, c.batch_size)
    return (i, losses[-1][0], test_loss, train_acc, test_acc)

  loop = training.Loop(
    name="fastkvzip",
    units=c.max_steps,
    columns=("step", "train_loss", "test_loss", "train_acc", "test_acc"),
    batches=training.passes(train_idx.size, c.batch_size, c.seed),
    batch=lambda i, b: (Xt[b], yt[b]),
    step=par.step(
      training.optax_step(_objective, opt, has_aux=True),
      training.optax_step(_weighted_objective, opt, has_aux=True),
    ),
    row=row,
    log_every=c.test_freq,
    checkpoint_every=c.checkpoint_every,
  )
  run = training.run(
    loop,
    par.place(gates),
    par.place(state),
    checkpoint_dir=checkpoint_dir,
    record={**c.record(), "num_query_groups": R, "data_shape": [list(X.shape), list(y.shape)]},
    on_log=on_log or _print_row(c.max_steps),
  )
  gates = jax.tree.map(jnp.asarray, par.local(run.params)) if par.across else run.params
  return GateTraining(gates, run.history, initial)


# --------------------------------------------------------------------------- the experiment

COLUMNS = ("step", "train_loss", "test_loss", "train_acc", "test_acc")  # a history row


def compare_with_kvzip(c, model, gates: dict, rows, template) -> list:
  """On held-out contexts: the share of KVzip's kept pairs (pooled, half the context per head)
  that Fast KVzip's policy also keeps, and the time of each one's evidence.

  Args:
    c: the settings (``chunk_size``, ``n_sink``: KVzip's).
    model: the model (:class:`kvjax.model.llama.Llama`).
    gates: the trained gates.
    rows: the held-out contexts ``[B, T]``.
    template: KVzip's reconstruction prompt.

  Returns:
    One dict per context: ``tokens``, ``overlap``, ``kvzip_s`` and ``fastkvzip_s``.
  """
  kvzip = KVzipOptions.from_settings(c)
  out = []
  for row in rows:
    kv, t_kvzip = training.timed(
      lambda row=row: kvzip_evidence(model, row, template, options=kvzip)
    )
    ev, t_fast = training.timed(lambda row=row: fastkvzip_evidence(model, gates, row[None])[:, 0])
    budget = row.size // 2
    ref = np.asarray(KVzip().keep_mask(policies.Evidence(reconstruction_attn_LGT=kv), budget))
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


def experiment(c, model, rows, template: KVzipTemplate, source: str):
  """Fast KVzip's gates of ``python -m experiments.fastkvzip``: every process calls it with the
  same arguments, process 0 writes the files.

  The training pairs of the first ``c.rows`` contexts (:func:`gate_targets`) are extracted batch
  by batch and saved (``targets/part_*.npz``, shared among the processes:
  :func:`kvjax.model.training.saved_targets`); the gates train data-parallel with orbax
  checkpoints (``gate_checkpoints/``, :func:`train_gates`); process 0 compares them with KVzip
  on the remaining (held-out) contexts (:func:`compare_with_kvzip`), writes
  ``fastkvzip_gates.npz`` and ``results.json`` (the loss curve, a constant-gate baseline, the
  comparison, the timings) and prints the final row and the run directory. Killed, the same
  call resumes.

  Args:
    c: the settings (``configs/fastkvzip.py``): ``workdir``, ``model``, ``dtype``, ``rows``,
      ``length``, ``batch_rows``, ``chunk_size``, ``n_sink``, ``prefix``, ``suffix`` and the
      :class:`GateConfig` fields.
    model: the model (:class:`kvjax.model.llama.Llama`).
    rows: the contexts ``[rows + held out, T]``
      (:func:`kvjax.model.reconstruction.kvzip_corpus`).
    template: KVzip's reconstruction prompt, of the targets and of the comparison.
    source: where the text comes from (kept in the files).

  Returns:
    The results (``results.json``) on process 0, ``None`` on the others (which extract the
    targets and train, then return).

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`), bad
      :class:`GateConfig` fields, or saved targets (:func:`kvjax.model.training.saved_targets`) or
      checkpoints of other settings.
  """
  workdir = rundir.check_workdir(c.workdir)
  primary = distributed.is_primary()
  config = GateConfig.from_settings(c)
  rows, held_out = rows[: c.rows], rows[c.rows :]
  names = ("model", "dtype", "rows", "length", "batch_rows", "chunk_size", "n_sink")
  names += ("prefix", "suffix")  # saved parts are reused only by a run that computes the same
  kvzip = KVzipOptions.from_settings(c)

  def part(part_rows, _):
    return gate_targets(model, part_rows, template, kvzip=kvzip)

  data, seconds = training.saved_targets(c, workdir, rows, names, part)
  X, y = data["X"], data["y"]
  timings = {"targets": seconds}
  if primary:
    print(f"positions: {len(X)}; X {X.shape[1:]}, y {y.shape[1:]}, mean KVzip score {y.mean():.4f}")
  t0 = time.perf_counter()
  trained = train_gates(
    X,
    y,
    model.cfg.num_groups,
    config,
    checkpoint_dir=workdir / "gate_checkpoints",
    across_processes=True,
  )
  timings["training"] = round(time.perf_counter() - t0, 2)
  if not primary:  # process 0 compares with KVzip on the held-out contexts and writes
    return None
  _, test_idx = holdout_split(len(X), config.test_every)
  train_mean = np.delete(y, test_idx, 0).mean(0)  # [L, G]
  baseline = {  # a constant gate at each head's mean KVzip score, and "always below 0.05"
    "mean_predictor_test_loss": float(
      np.asarray(bce(jnp.asarray(train_mean), jnp.asarray(y[test_idx]))).mean(0).sum(-1).mean()
    ),
    "majority_test_acc": float((y[test_idx] < ACC_THRESHOLD).mean()),
  }
  results = {
    "model": c.model,
    "source": source,
    "positions": len(X),
    "initial_test_loss": trained.initial_test_loss,
    **baseline,
    "final": dict(zip(COLUMNS, trained.history[-1], strict=True)),
    "history": np.asarray(trained.history).tolist(),
    "held_out": compare_with_kvzip(c, model, trained.gates, held_out, template),
    "timings_s": timings,
    "processes": distributed.process_count(),
  }
  meta = {k: getattr(c, k) for k in ("model", "rows", "length", "max_steps")}
  meta |= {"source": source, "test_loss": results["final"]["test_loss"]}
  save(
    workdir / "fastkvzip_gates.npz",
    trained.gates,
    meta,
    identity=checks.model_identity(model.cfg, model.params()),
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(
    json.dumps({"initial_test_loss": trained.initial_test_loss, **baseline, **results["final"]})
  )
  print(f"run directory: {workdir.absolute()}")
  return results
