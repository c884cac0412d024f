"""Fast KVzip's evidence: small per-layer gates, trained on KVzip's scores, that score every KV
pair from its attention input (Fast KVzip, Kim, Han and Yun, NAVER AI Lab, arXiv 2601.17668;
kvpress 0.5.5 ``presses/fastkvzip_press.py::FastKVzipPress`` and the official training code of
``Janghyun1230/FastKVzip``: ``optim.py``, ``utils.py``, ``load_data.py``, ``prefill/feature.py``).

* :func:`gate_scores`: the gates (kvpress ``FastKVzipGate``, a "low-rank sink attention") applied
  to attention inputs;
* :func:`gate_targets` -> ``(X_NLd, y_NLG)``: the training pairs, each context position's
  attention input at every layer and its KVzip score per KV head
  (:func:`kvjax.model.reconstruction.kvzip_evidence`), as ``prefill/feature.py`` collects them;
* :func:`train_gates`: the official ``optim.py`` with optax (binary cross-entropy, SGD with
  momentum 0.9 at 0.2, its step schedule, batches of 1000 positions), checkpointed with orbax;
* :func:`save` / :func:`load`: an ``.npz`` file with a json header, checked against the model;
* :func:`fastkvzip_evidence` -> ``fastkvzip_LGT``, the evidence
  :class:`kvjax.policies.fastkvzip.FastKVzip` reads.

The gates of one model are a dict of arrays stacked over layers (``L`` layers, model dim ``d``,
``G`` KV heads, ``R`` query heads per KV head, gate dim ``D`` 16, ``S`` 16 sink keys):

* ``wq [L, d, G*R*D]``, ``bq [L, G*R*D]``: ``q_proj`` (torch's ``weight`` transposed, its bias);
* ``wk [L, d, G*D]``: ``k_proj`` (no bias);
* ``q_norm [L, D]``, ``k_norm [L, D]``: the scales of ``Qwen3RMSNorm`` (eps 1e-6);
* ``k_base [L, G, S, D]``: the learned sink keys (kvpress ``[G, 1, S, D]`` per layer);
* ``b [L, G, R]``: the logit bias (kvpress ``[G, 1, R]`` per layer).

The model passes are plain layer loops (``lax.scan`` over the stacked layers) built on the public
functions of :mod:`kvjax.model.llama`, with dense attention; gates and scores are fp32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import distributed, policies, rundir
from kvjax.model import llama, npzfile, training
from kvjax.model.config import ModelConfig
from kvjax.model.reconstruction import KVzipTemplate, kvzip_evidence
from kvjax.policies.fastkvzip import FastKVzip
from kvjax.policies.methods import KVzip
from kvjax.scores import PRECISION

Array = jax.Array

DIM, SINK = 16, 16  # optim.py's --dim and --sink (the released gates' "q{R}_dim16_sink16")
EPS = 1e-6  # Qwen3RMSNorm's default eps, which FastKVzipGate's norms keep
FORMAT = "kvjax.fastkvzip/1"
PARAM_KEYS = ("wq", "bq", "wk", "q_norm", "k_norm", "k_base", "b")
# optim.py's fixed training recipe
LR, MOMENTUM, MAX_STEPS, BATCH_SIZE, TEST_FREQ, TEST_EVERY = 0.2, 0.9, 5000, 1000, 50, 100
ACC_THRESHOLD = 0.05  # utils.acc_fn's threshold


# --------------------------------------------------------------------------- the gates


def expected_shapes(L: int, d: int, G: int, R: int, dim: int = DIM, sink: int = SINK) -> dict:
  """The gates' shapes for a model.

  Args:
    L: layers.
    d: the model dim (the attention input's width).
    G: KV heads.
    R: query heads per KV head (kvpress ``ngroup``).
    dim: the gate's head dim (kvpress ``output_dim``, 16).
    sink: the learned sink keys per KV head (16).

  Returns:
    ``{name: shape}`` in the layout of this module's docstring.
  """
  return {
    "wq": (L, d, G * R * dim),
    "bq": (L, G * R * dim),
    "wk": (L, d, G * dim),
    "q_norm": (L, dim),
    "k_norm": (L, dim),
    "k_base": (L, G, sink, dim),
    "b": (L, G, R),
  }


def shapes_of(gates: dict) -> dict[str, tuple[int, ...]]:
  """Each array's shape.

  Args:
    gates: the gates.

  Returns:
    ``{name: shape}``.
  """
  return {k: tuple(np.shape(v)) for k, v in gates.items()}


def dims_of(gates: dict) -> dict[str, int]:
  """The sizes the gates were built for, read from their shapes.

  Args:
    gates: the gates (every key of :data:`PARAM_KEYS`).

  Returns:
    ``{"L", "d", "G", "R", "dim", "sink"}``.
  """
  L, G, sink, dim = np.shape(gates["k_base"])
  return {
    "L": L,
    "d": np.shape(gates["wq"])[1],
    "G": G,
    "R": np.shape(gates["b"])[-1],
    "dim": dim,
    "sink": sink,
  }


def model_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
  """``(L, d, G, R)`` of a model: what its gates must fit.

  Args:
    cfg: the model's config.

  Returns:
    Layers, model dim, KV heads and query heads per KV head.
  """
  return cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.num_groups


def init_gates(seed: int, L: int, d: int, G: int, R: int, *, dim: int = DIM, sink: int = SINK):
  """Untrained gates, as ``optim.py``'s ``Weight`` starts: torch ``nn.Linear``'s default
  initialisation (``U(-1/sqrt(d), 1/sqrt(d))`` for ``q_proj``'s weight and bias and
  ``k_proj``'s weight), norm scales 1, sink keys and bias 0. The draws come from numpy's
  generator (torch's in the official code): the same distribution, other numbers.

  Args:
    seed: the generator's seed.
    L: layers.
    d: the model dim.
    G: KV heads.
    R: query heads per KV head.
    dim: the gate's head dim.
    sink: the sink keys per KV head.

  Returns:
    The gates, a dict of fp32 arrays.
  """
  shapes = expected_shapes(L, d, G, R, dim, sink)
  rng = np.random.default_rng(seed)
  bound = 1.0 / math.sqrt(d)
  out = {k: rng.uniform(-bound, bound, shapes[k]) for k in ("wq", "bq", "wk")}
  out |= {k: np.ones(shapes[k]) for k in ("q_norm", "k_norm")}
  out |= {k: np.zeros(shapes[k]) for k in ("k_base", "b")}
  return {k: jnp.asarray(out[k], jnp.float32) for k in PARAM_KEYS}


def _head_norm(x: Array, scale_LD: Array) -> Array:
  """``Qwen3RMSNorm`` over the last axis, ``scale_LD`` broadcast from the layer axis."""
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
  return scale_LD.reshape(scale_LD.shape[:1] + (1,) * (x.ndim - 2) + scale_LD.shape[1:]) * x


@jax.jit
def gate_scores(gates: dict, h_LTd) -> Array:
  """The gates' scores of attention inputs (kvpress ``FastKVzipGate.forward``).

  Per layer and position, with ``q = q_norm(h W_q + b_q)`` split into ``[G, R, D]`` and
  ``k = k_norm(h W_k)`` into ``[G, D]``:
  ``logit_r = <k, q_r> / sqrt(D) + b_r``, ``base_{s,r} = <k_base_s, q_r> / sqrt(D)`` and
  ``score = mean_r 1 / (1 + sum_s exp(base_{s,r} - logit_r))``, in ``(0, 1)``: a softmax in
  which the position's own key competes with ``S`` learned sink keys for its queries. Computed
  as ``sigmoid(-logsumexp_s(base - logit))``, the same value without overflow.

  Args:
    gates: the gates.
    h_LTd: attention inputs ``[L, ..., d]`` (any axes between the layer and the model dim).

  Returns:
    fp32 scores ``[L, G, ...]``.
  """
  x = jnp.asarray(h_LTd, jnp.float32)
  dims = dims_of(gates)
  G, R, D = dims["G"], dims["R"], dims["dim"]
  L, mid = x.shape[0], x.shape[1:-1]
  x = x.reshape(L, -1, x.shape[-1])
  q = jnp.einsum("lnd,ldk->lnk", x, gates["wq"], precision=PRECISION) + gates["bq"][:, None]
  q = _head_norm(q.reshape(L, -1, G, R, D), gates["q_norm"])
  k = jnp.einsum("lnd,ldk->lnk", x, gates["wk"], precision=PRECISION)
  k = _head_norm(k.reshape(L, -1, G, D), gates["k_norm"])
  scale = 1.0 / math.sqrt(D)
  logit = jnp.einsum("lngd,lngrd->lngr", k, q, precision=PRECISION) * scale + gates["b"][:, None]
  base = jnp.einsum("lgsd,lngrd->lngsr", gates["k_base"], q, precision=PRECISION) * scale
  z = jax.nn.logsumexp(base - logit[:, :, :, None, :], axis=3)  # [L, N, G, R]
  score = jax.nn.sigmoid(-z).mean(-1)  # the group mean: [L, N, G]
  return jnp.moveaxis(score.reshape(L, *mid, G), -1, 1)


# --------------------------------------------------------------------------- training data


def attention_inputs(cfg: ModelConfig, params: dict, ids_BT, mask_BT=None) -> Array:
  """Every layer's attention inputs over a (left-)padded prompt: the hidden states after each
  layer's input norm, what kvpress's hook reads as ``hidden_states`` and what
  ``prefill/feature.py`` saves.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    ids_BT: token ids ``[B, T]``.
    mask_BT: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 ``[L, B, T, d]``.
  """
  ids = jnp.asarray(ids_BT, jnp.int32)
  mask = jnp.ones(ids.shape, jnp.int32) if mask_BT is None else jnp.asarray(mask_BT)
  return _inputs_jit(cfg, params, ids, mask)


def _inputs(cfg: ModelConfig, params: dict, ids_BT: Array, mask_BT: Array) -> Array:
  B, T = ids_BT.shape
  pos = llama.positions_from_mask(mask_BT)
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  allowed = llama.causal_allowed(pos, pos, mask_BT.astype(bool), index, index, cfg.sliding_window)

  def layer(x, p):
    h = llama.norm(cfg, x, p["attn_norm"]).astype(jnp.float32)
    x, _ = llama.dense_layer(cfg, p, x, pos, allowed)
    return x, h

  _, h = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return h


_inputs_jit = jax.jit(_inputs, static_argnums=0)


def gate_targets(
  cfg: ModelConfig,
  params: dict,
  context_ids,
  template: KVzipTemplate,
  *,
  chunk_size: int = 2048,
  n_sink: int = 4,
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
    cfg: the model's config.
    params: the parameter pytree.
    context_ids: the contexts ``[T]`` or ``[B, T]`` (equal lengths, unpadded).
    template: the reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    chunk_size: context tokens per reconstruction chunk.
    n_sink: the first context tokens every repeat query also attends to.

  Returns:
    ``(X_NLd, y_NLG)`` fp32 numpy arrays, ``N = B * (T - prefix_length)``, context by context
    in position order.

  Raises:
    ValueError: as :func:`kvjax.model.reconstruction.kvzip_evidence` (ids, template, sizes).
  """
  y = kvzip_evidence(cfg, params, context_ids, template, chunk_size=chunk_size, n_sink=n_sink)
  ids = np.asarray(context_ids)
  ids = ids[None] if ids.ndim == 1 else ids
  y = y[:, None] if y.ndim == 3 else y  # [L, B, G, T]
  h = attention_inputs(cfg, params, ids)  # [L, B, T, d]
  prefix = template.prefix_length
  X = np.asarray(h[:, :, prefix:]).transpose(1, 2, 0, 3)  # [B, n, L, d]
  y = np.asarray(y[..., prefix:]).transpose(1, 3, 0, 2)  # [B, n, L, G]
  return X.reshape(-1, *X.shape[2:]), y.reshape(-1, *y.shape[2:])


def _check_xy(X_NLd, y_NLG) -> tuple[np.ndarray, np.ndarray]:
  X, y = np.asarray(X_NLd, np.float32), np.asarray(y_NLG, np.float32)
  if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2] or X.shape[0] == 0:
    raise ValueError(
      f"X_NLd, y_NLG: expected [N, L, d] and [N, L, G] with the same N, L > 0, got {X.shape} "
      f"and {y.shape}"
    )
  if not (np.isfinite(X).all() and np.isfinite(y).all()):
    raise ValueError("X_NLd, y_NLG: expected finite values")
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
  pred = gate_scores(gates, jnp.swapaxes(X_NLd, 0, 1))  # [L, G, N]
  target = jnp.moveaxis(y_NLG, 0, 2)
  return bce(pred, target).mean(-1).sum(-1)


def loss(gates: dict, X_NLd: Array, y_NLG: Array) -> Array:
  """``optim.py``'s objective: the layers' losses summed (:func:`layer_losses`).

  Args:
    gates: the gates.
    X_NLd: attention inputs ``[N, L, d]``.
    y_NLG: KVzip scores ``[N, L, G]``.

  Returns:
    The fp32 scalar.
  """
  return layer_losses(gates, X_NLd, y_NLG).sum()


def accuracy(gates: dict, X_NLd: Array, y_NLG: Array) -> Array:
  """``utils.acc_fn`` of each layer: how often the gate and KVzip agree on ``score >= 0.05``.

  Args:
    gates: the gates.
    X_NLd: attention inputs ``[N, L, d]``.
    y_NLG: KVzip scores ``[N, L, G]``.

  Returns:
    fp32 ``[L]``.
  """
  pred = gate_scores(gates, jnp.swapaxes(X_NLd, 0, 1))
  target = jnp.moveaxis(y_NLG, 0, 2)
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
  pred = gate_scores(gates, jnp.swapaxes(X, 0, 1))  # [L, G, N]
  per_row = bce(pred, jnp.moveaxis(y, 0, 2))
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


# --------------------------------------------------------------------------- files


def save(path: str | pathlib.Path, gates: dict, meta: dict | None = None) -> pathlib.Path:
  """Writes gates as an ``.npz`` file: the arrays and a json header (``format``, ``shapes`` and
  the caller's ``meta``, e.g. the model's name and the training data).

  Args:
    path: the file to write.
    gates: the gates.
    meta: json-serialisable facts to keep with them.

  Returns:
    The path written.
  """
  header = {
    **(meta or {}),
    "format": FORMAT,
    "shapes": {k: list(v) for k, v in shapes_of(gates).items()},
  }
  return npzfile.write(path, {k: gates[k] for k in PARAM_KEYS}, header)


def check_gates(gates, cfg: ModelConfig, where: str = "gates") -> None:
  """Checks that gates fit a model.

  Args:
    gates: the gates.
    cfg: the model (``num_layers``, ``hidden_size``, ``num_kv_heads``, ``num_groups``).
    where: what to name in the error (an argument, or a file).

  Raises:
    ValueError: naming ``where``: not a dict, a missing array, or shapes that do not fit.
  """
  if not isinstance(gates, dict):
    raise ValueError(f"{where}: expected a dict of gate arrays, got {type(gates).__name__}")
  missing = [k for k in PARAM_KEYS if k not in gates]
  if missing:
    raise ValueError(f"{where}: lacks the gate arrays {missing}")
  kb = np.shape(gates["k_base"])
  if len(kb) != 4:
    raise ValueError(f"{where}: k_base has shape {kb}, expected [L, G, sink, dim]")
  L, d, G, R = model_dims(cfg)
  want = expected_shapes(L, d, G, R, kb[3], kb[2])
  got = shapes_of({k: gates[k] for k in PARAM_KEYS})
  wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
  if wrong:
    said = ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in wrong.items())
    raise ValueError(f"{where}: does not fit this model (L={L}, d={d}, G={G}, R={R}): {said}")


def load(path: str | pathlib.Path, cfg: ModelConfig) -> tuple[dict, dict]:
  """Reads gates written by :func:`save` and checks them against a model.

  Args:
    path: the ``.npz`` file.
    cfg: the model the gates must fit.

  Returns:
    ``(gates, meta)``.

  Raises:
    ValueError: naming the file, for one that is missing or unreadable, lacks the header or an
      array, or holds shapes that do not fit ``cfg`` (each named with what it should be).
  """
  files, meta = npzfile.read(path, FORMAT, "Fast KVzip gates")
  where = f"path: {path} (model {meta.get('model')!r})"
  check_gates(files, cfg, where)
  return {k: jnp.asarray(files[k], jnp.float32) for k in PARAM_KEYS}, meta


# --------------------------------------------------------------------------- evidence


def _evidence(cfg, params, gates, ids_BT, mask_BT):
  return gate_scores(gates, _inputs(cfg, params, ids_BT, mask_BT))  # [L, G, B, T]


_evidence_jit = jax.jit(_evidence, static_argnums=0)


def fastkvzip_evidence(cfg: ModelConfig, params: dict, gates: dict, input_ids, attention_mask=None):
  """Computes Fast KVzip's ``fastkvzip_LGT`` of a prompt, as kvpress 0.5.5's ``FastKVzipPress``
  scores it during prefill (``_score_fast``: ``gates[layer](hidden_states)``).

  One dense causal forward over the prompt gives every layer's attention inputs (the hidden
  states after the layer's input norm, what kvpress's hook reads as ``hidden_states``); the
  gates map each to ``G`` scores in ``(0, 1)`` (:func:`gate_scores`). The sinks and the local
  window belong to the policy (:class:`kvjax.policies.fastkvzip.FastKVzip`). Padding positions
  get scores too; the policy's ``valid_T`` keeps them out.

  Differs from kvpress: batches of several left-padded rows (kvpress's gate squeezes a batch of
  one); fp32 gates (kvpress: the file's dtype); the forward is dense (``[B, Hq, T, T]`` per
  layer), so this suits prompts of a few thousand tokens.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    gates: the trained gates (:func:`load`, :func:`train_gates`).
    input_ids: the prompt ``[B, T]`` (left-padded when rows differ).
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 scores ``[L, B, G, T]``: ``evidence={"fastkvzip_LGT": ...}`` for ``km.generate``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a mask of
      another shape, or gates that do not fit the model (:func:`check_gates`).
  """
  ids = np.asarray(input_ids)
  if ids.ndim != 2 or ids.shape[1] == 0:
    raise ValueError(f"input_ids: expected token ids [B, T], got shape {ids.shape}")
  ids = llama.check_token_ids("input_ids", ids, cfg.vocab_size)
  mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
  if mask.shape != ids.shape:
    raise ValueError(f"attention_mask: expected shape {ids.shape}, got {mask.shape}")
  check_gates(gates, cfg)
  gates = {k: jnp.asarray(gates[k], jnp.float32) for k in PARAM_KEYS}
  out = _evidence_jit(cfg, params, gates, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
  return jnp.moveaxis(out, 2, 1)


# --------------------------------------------------------------------------- the experiment

COLUMNS = ("step", "train_loss", "test_loss", "train_acc", "test_acc")  # a history row


def compare_with_kvzip(c, cfg: ModelConfig, params: dict, gates: dict, rows, template) -> list:
  """On held-out contexts: the share of KVzip's kept pairs (pooled, half the context per head)
  that Fast KVzip's policy also keeps, and the time of each one's evidence.

  Args:
    c: the settings (``chunk_size``, ``n_sink``: KVzip's).
    cfg: the model's config.
    params: the parameter pytree.
    gates: the trained gates.
    rows: the held-out contexts ``[B, T]``.
    template: KVzip's reconstruction prompt.

  Returns:
    One dict per context: ``tokens``, ``overlap``, ``kvzip_s`` and ``fastkvzip_s``.
  """
  out = []
  for row in rows:
    kv, t_kvzip = training.timed(
      lambda row=row: kvzip_evidence(
        cfg, params, row, template, chunk_size=c.chunk_size, n_sink=c.n_sink
      )
    )
    ev, t_fast = training.timed(
      lambda row=row: fastkvzip_evidence(cfg, params, gates, row[None])[:, 0]
    )
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


def experiment(c, cfg: ModelConfig, params: dict, rows, template: KVzipTemplate, source: str):
  """Fast KVzip's gates of ``python -m experiments.fastkvzip``: every process calls it with the
  same arguments, process 0 writes the files.

  The training pairs of the first ``c.rows`` contexts (:func:`gate_targets`) are extracted batch
  by batch and saved (``targets/part_*.npz``, shared among the processes:
  :func:`kvjax.model.training.cached_parts`); the gates train data-parallel with orbax
  checkpoints (``gate_checkpoints/``, :func:`train_gates`); process 0 compares them with KVzip
  on the remaining (held-out) contexts (:func:`compare_with_kvzip`), writes
  ``fastkvzip_gates.npz`` and ``results.json`` (the loss curve, a constant-gate baseline, the
  comparison, the timings) and prints the final row and the run directory. Killed, the same
  call resumes.

  Args:
    c: the settings (``configs/fastkvzip.py``): ``workdir``, ``model``, ``dtype``, ``rows``,
      ``length``, ``batch_rows``, ``chunk_size``, ``n_sink``, ``prefix``, ``suffix`` and the
      :class:`GateConfig` fields.
    cfg: the model's config.
    params: the parameter pytree.
    rows: the contexts ``[rows + held out, T]``
      (:func:`kvjax.model.reconstruction.kvzip_corpus`).
    template: KVzip's reconstruction prompt.
    source: where the text comes from (kept in the files).

  Returns:
    The results (``results.json``) on process 0, ``None`` on the others.

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`), saved targets
      or checkpoints of other settings, or bad :class:`GateConfig` fields.
  """
  workdir = rundir.check_workdir(c.workdir)
  primary = distributed.is_primary()
  config = GateConfig.from_settings(c)
  if primary:
    workdir.mkdir(parents=True, exist_ok=True)
  rows, held_out = rows[: c.rows], rows[c.rows :]
  names = ("model", "dtype", "rows", "length", "batch_rows", "chunk_size", "n_sink")
  names += ("prefix", "suffix")  # saved parts are reused only by a run that computes the same
  identity = {k: getattr(c, k) for k in names} | {"rows_sum": int(np.sum(rows))}

  def part(i):
    part_rows = rows[i : i + c.batch_rows]
    return gate_targets(cfg, params, part_rows, template, chunk_size=c.chunk_size, n_sink=c.n_sink)

  t0 = time.perf_counter()
  data = training.cached_parts(
    workdir / "targets", len(rows), c.batch_rows, part, {"X": 0, "y": 0}, identity=identity
  )
  X, y = data["X"], data["y"]
  timings = {"targets": round(time.perf_counter() - t0, 2)}
  if primary:
    print(f"positions: {len(X)}; X {X.shape[1:]}, y {y.shape[1:]}, mean KVzip score {y.mean():.4f}")
  t0 = time.perf_counter()
  trained = train_gates(
    X,
    y,
    cfg.num_groups,
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
    "held_out": compare_with_kvzip(c, cfg, params, trained.gates, held_out, template),
    "timings_s": timings,
    "processes": distributed.process_count(),
  }
  meta = {k: getattr(c, k) for k in ("model", "rows", "length", "max_steps")}
  meta |= {"source": source, "test_loss": results["final"]["test_loss"]}
  save(workdir / "fastkvzip_gates.npz", trained.gates, meta)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(
    json.dumps({"initial_test_loss": trained.initial_test_loss, **baseline, **results["final"]})
  )
  print(f"run directory: {workdir.absolute()}")
  return results
