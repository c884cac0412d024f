"""KVzap's evidence: a small trained surrogate from each position's attention input to its
KVzip+ scores (KVzap, arXiv 2601.07891; kvpress 0.5.5 ``presses/kvzap_press.py::KVzapPress`` and
its training code ``kvzap/train.py`` and ``kvzap/data.py``).

* :func:`kvzap_targets` -> ``(X_NLd, y_NLG)``: KVzip+'s log scores of the context positions in
  one dense causal pass over ``context + "Repeat the previous context exactly." + context``
  (kvpress ``KVzapDataCollector``), with the attention inputs that predict them;
* :func:`fit_linear` (ridge, as scikit-learn's ``Ridge()``) and :func:`train_mlp` (optax, as
  ``kvzap/train.py``'s skorch regressor) -> a :class:`Surrogate`;
* :func:`save` / :func:`load`: an ``.npz`` file with a json header;
* :func:`kvzap_evidence` -> ``kvzap_LGT``, the evidence :class:`kvjax.policies.kvzap.KVzap`
  reads: the surrogate applied to the prompt's attention inputs.

The passes are plain layer loops (``lax.scan`` over the stacked layers) built on the public
functions of :mod:`kvjax.model.llama`, with dense attention; scores are fp32.
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

from kvjax import checks, distributed, rundir
from kvjax.model import learned_io, llama, passes, training
from kvjax.model.config import ModelConfig
from kvjax.model.kvgrad import value_output_norms
from kvjax.model.reconstruction import KVzipTemplate, check_template
from kvjax.scores import PRECISION

Array = jax.Array

KINDS = ("linear", "mlp")
HIDDEN_DIM = 512  # kvzap/train.py's --hidden_dim
FORMAT = "kvjax.kvzap/1"


# --------------------------------------------------------------------------- targets


def _repeat_pass(cfg: ModelConfig, params: dict, ids_BS: Array, prompt: tuple, repeat: tuple):
  """One dense causal pass over ``ids_BS``; per layer the attention inputs at the prompt
  positions ``[p0, p1)`` and KVzip+'s score of each of them: the maximum over the repeated
  prompt's queries ``[r0, r1)`` and the GQA group of
  ``attn[q, k] / ||h_q|| * ||W_O^h v_k||`` (``[L, B, n, d]`` and ``[L, B, G, n]``)."""
  B, S = ids_BS.shape
  p0, p1 = prompt
  r0, r1 = repeat
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  allowed = llama.causal_allowed(pos, pos, jnp.ones((B, S), bool), pos, pos, cfg.sliding_window)

  def layer(x, p):
    h = passes.layer_attention_inputs(cfg, p, x)
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    probs = llama.attention_probs(q, k, allowed, softcap=cfg.attn_softcap)  # [B, Hq, S, S]
    rows = probs[:, :, r0:r1, p0:p1].astype(jnp.float32)
    rows = rows / jnp.linalg.norm(h[:, r0:r1], axis=-1)[:, None, :, None]
    rows = rows * value_output_norms(cfg, p, v[:, :, p0:p1])[:, :, None, :]
    score = rows.max(2).reshape(B, cfg.num_kv_heads, cfg.num_groups, p1 - p0).max(2)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v))
    return x, (h[:, p0:p1], score)

  _, (h, score) = jax.lax.scan(
    layer, llama.embed_tokens(cfg, params, ids_BS), llama.stacked(params)
  )
  return h, score


_repeat_pass_jit = jax.jit(_repeat_pass, static_argnums=(0, 3, 4))


def repeat_ids(context_BT: np.ndarray, template: KVzipTemplate) -> tuple[np.ndarray, tuple, tuple]:
  """KVzap's training prompt in token ids: the context, KVzip's first question, the assistant
  header and the context again.

  As kvpress ``repeat_prompt_tokenization``'s ``user: <prompt>\\n\\nRepeat the previous context
  exactly`` then ``assistant: <prompt>``.

  Args:
    context_BT: the contexts ``[B, T]``, each starting with the template's
      ``prefix_length`` chat-template tokens.
    template: :func:`kvjax.model.reconstruction.kvzip_template` (``first_ids``, ``suffix_ids`` and
      ``prefix_length`` are read).

  Returns:
    ``(ids_BS, (p0, p1), (r0, r1))``: the int32 ids and the prompt's and its repetition's
    positions.
  """
  B, T = context_BT.shape
  prefix = template.prefix_length
  ask = np.asarray(template.first_ids + template.suffix_ids, np.int32)
  ids = np.concatenate(
    [context_BT, np.broadcast_to(ask, (B, ask.size)), context_BT[:, prefix:]], 1
  ).astype(np.int32)
  r0 = T + ask.size
  return ids, (prefix, T), (r0, r0 + T - prefix)


def kvzap_targets(
  model,
  context_ids,
  template: KVzipTemplate,
  *,
  n_tokens: int | None = None,
  seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """KVzap's training pairs of each context, as kvpress 0.5.5's ``kvzap/data.py``.

  Each context is read once, densely and causally, followed by KVzip's question and the
  context again (:func:`repeat_ids`). At every layer ``l`` the target of context position
  ``k`` and KV head ``g`` is KVzip+'s score
  ``y = log max_{q, r} attn^r[q, k] / ||h_q|| * ||W_O^r v_k||`` over the repeated context's
  queries ``q`` and the group's query heads ``r`` (``h_q`` the attention input of ``q``), and
  its feature is the attention input ``h_k`` (the hidden state after the layer's input norm).
  ``n_tokens`` positions are drawn per context (kvpress ``torch.randperm(...)[:n_tokens]``).

  Differs from kvpress: the prompt is tokenised in pieces (the context, the question and the
  assistant header of ``template``, the context) where kvpress tokenises the chat template's
  text at once and finds the pieces by character offsets; the context is not ``strip()``-ed; the
  scores are fp32 (kvpress: the model's dtype, bfloat16 in ``train.py``); the sampling uses
  numpy's generator, not torch's; the model's sliding window applies.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: the contexts ``[T]`` or ``[B, T]`` (equal lengths), each starting with
      ``template.prefix_length`` chat-template tokens that are not targets.
    template: the reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    n_tokens: positions drawn per context (``None``: all of them, in order).
    seed: the draw's seed.

  Returns:
    ``(X_NLd, y_NLG)`` fp32 numpy arrays, ``N = B * n_tokens``, context by context.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a
      ``template`` that is not a :class:`~kvjax.model.reconstruction.KVzipTemplate`, a
      ``prefix_length`` that leaves nothing, or an ``n_tokens`` below 1 or above the positions.
  """
  cfg, params = model.cfg, model.params()
  ids = passes.ids_2d("context_ids", context_ids, cfg)
  B, T = ids.shape
  prefix = check_template(template, cfg, T, ("first_ids", "suffix_ids"), "score")
  n = T - prefix
  if n_tokens is not None:
    n_tokens = training.check_int("n_tokens", n_tokens)
    if n_tokens > n:
      raise ValueError(f"n_tokens: {n_tokens} is more than the context's {n} positions")
  full, prompt, repeat = repeat_ids(ids, template)
  h, score = _repeat_pass_jit(cfg, params, jnp.asarray(full), prompt, repeat)
  X = np.asarray(h).transpose(1, 2, 0, 3)  # [B, n, L, d]
  y = np.log(np.asarray(score)).transpose(1, 3, 0, 2)  # [B, n, L, G]
  if n_tokens is not None:
    rng = np.random.default_rng(seed)
    pick = np.stack([rng.permutation(n)[:n_tokens] for _ in range(B)])
    X = np.take_along_axis(X, pick[:, :, None, None], 1)
    y = np.take_along_axis(y, pick[:, :, None, None], 1)
  return X.reshape(-1, *X.shape[2:]), y.reshape(-1, *y.shape[2:])


# --------------------------------------------------------------------------- the surrogate


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Surrogate:
  """KVzap's per-layer surrogate (kvpress ``KVzapModel``), every weight stacked over layers.

  ``kind="linear"``: ``params = {"w": [L, d, G], "b": [L, G]}``; ``kind="mlp"``:
  ``{"w1": [L, d, H], "b1": [L, H], "w2": [L, H, G], "b2": [L, G]}`` (Linear, exact GELU,
  Linear). Weights are stored ``[in, out]``: torch's ``nn.Linear.weight`` transposed.
  """

  params: dict
  kind: str = dataclasses.field(default="mlp", metadata=dict(static=True))

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Each weight's shape."""
    return {k: tuple(np.shape(v)) for k, v in self.params.items()}


PARAM_KEYS = {"linear": ("w", "b"), "mlp": ("w1", "b1", "w2", "b2")}


def expected_shapes(kind: str, L: int, d: int, G: int, hidden: int = HIDDEN_DIM) -> dict:
  """The weights' shapes of a surrogate.

  Args:
    kind: ``"linear"`` or ``"mlp"``.
    L: layers.
    d: the model dim.
    G: KV heads.
    hidden: the MLP's width.

  Returns:
    ``{name: shape}``, in :class:`Surrogate`'s layout.
  """
  if kind == "linear":
    return {"w": (L, d, G), "b": (L, G)}
  return {"w1": (L, d, hidden), "b1": (L, hidden), "w2": (L, hidden, G), "b2": (L, G)}


def check_surrogate(surrogate, cfg: ModelConfig, where: str = "surrogate") -> None:
  """Checks that ``surrogate`` is a :class:`Surrogate` whose weights fit ``cfg``'s
  ``num_layers``, ``hidden_size`` and ``num_kv_heads`` (any MLP width).

  Args:
    surrogate: the surrogate.
    cfg: the model's config.
    where: what the error names (a file's path and model, for :func:`load`).

  Raises:
    ValueError: naming ``where``, for another type or weights of other shapes.
  """
  if not isinstance(surrogate, Surrogate):
    raise ValueError(f"{where}: expected a Surrogate, got {type(surrogate).__name__}")
  got = surrogate.shapes
  hidden = got["w1"][-1] if surrogate.kind == "mlp" else HIDDEN_DIM
  want = expected_shapes(surrogate.kind, cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, hidden)
  if got != want:
    names = [*want, *(k for k in got if k not in want)]
    said = ", ".join(
      f"{k} {got.get(k)} (expected {want.get(k)})" for k in names if got.get(k) != want.get(k)
    )
    raise ValueError(
      f"{where}: does not fit this model (L={cfg.num_layers}, d={cfg.hidden_size}, "
      f"G={cfg.num_kv_heads}): {said}"
    )


def apply(surrogate: Surrogate, X_LTd: Array) -> Array:
  """The surrogate's scores (kvpress ``KVzapPress.score``: ``kvzap_model.layers[l](h)``).

  Args:
    surrogate: the trained surrogate.
    X_LTd: attention inputs ``[L, ..., d]`` (any axes between the layer and the model dim).

  Returns:
    fp32 scores ``[L, G, ...]``.
  """
  p = surrogate.params
  x = jnp.asarray(X_LTd, jnp.float32)
  if surrogate.kind == "linear":
    out = jnp.einsum("l...d,ldg->l...g", x, p["w"], precision=PRECISION)
    out = out + jnp.expand_dims(p["b"], tuple(range(1, x.ndim - 1)))
  else:
    hid = jnp.einsum("l...d,ldh->l...h", x, p["w1"], precision=PRECISION)
    hid = jax.nn.gelu(
      hid + jnp.expand_dims(p["b1"], tuple(range(1, x.ndim - 1))), approximate=False
    )
    out = jnp.einsum("l...h,lhg->l...g", hid, p["w2"], precision=PRECISION)
    out = out + jnp.expand_dims(p["b2"], tuple(range(1, x.ndim - 1)))
  return jnp.moveaxis(out, -1, 1)


def init_mlp(key: Array, L: int, d: int, G: int, hidden: int = HIDDEN_DIM) -> Surrogate:
  """An untrained MLP surrogate, torch ``nn.Linear``'s default initialisation
  (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weights and biases).

  Args:
    key: the PRNG key.
    L: layers.
    d: the model dim.
    G: KV heads.
    hidden: the MLP's width.

  Returns:
    The surrogate, fp32.
  """
  k = jax.random.split(key, 4)

  def u(key, shape, fan_in):
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)

  shapes = expected_shapes("mlp", L, d, G, hidden)
  fans = {"w1": d, "b1": d, "w2": hidden, "b2": hidden}
  params = {name: u(k[i], shapes[name], fans[name]) for i, name in enumerate(PARAM_KEYS["mlp"])}
  return Surrogate(params, "mlp")


def fit_linear(X_NLd, y_NLG, *, alpha: float = 1.0) -> Surrogate:
  """KVzap's linear surrogate: a ridge regression per layer (kvpress ``kvzap/train.py``
  ``train_linear``: scikit-learn ``Ridge()``, ``alpha=1.0`` with an intercept).

  The closed form scikit-learn's dense solver computes: with ``X`` and ``y`` centred by their
  means, ``W = (Xc^T Xc + alpha I)^-1 Xc^T yc`` and ``b = mean(y) - mean(X) W`` (float64).

  Args:
    X_NLd: attention inputs ``[N, L, d]`` (:func:`kvzap_targets`).
    y_NLG: KVzip+ log scores ``[N, L, G]``.
    alpha: the ridge penalty (not applied to the intercept).

  Returns:
    A ``"linear"`` :class:`Surrogate` (fp32).

  Raises:
    ValueError: for arrays of mismatched or wrong shapes, non-finite values or a negative
      ``alpha``.
  """
  X, y = training.check_pairs(X_NLd, y_NLG, " (a zero KVzip+ score has log -inf)")
  alpha = training.check_float("alpha", alpha, zero=True)
  ws, bs = [], []
  for layer in range(X.shape[1]):
    x, t = X[:, layer].astype(np.float64), y[:, layer].astype(np.float64)
    xm, tm = x.mean(0), t.mean(0)
    xc, tc = x - xm, t - tm
    w = np.linalg.solve(xc.T @ xc + alpha * np.eye(x.shape[1]), xc.T @ tc)
    ws.append(w)
    bs.append(tm - xm @ w)
  params = {
    "w": jnp.asarray(np.stack(ws), jnp.float32),
    "b": jnp.asarray(np.stack(bs), jnp.float32),
  }
  return Surrogate(params, "linear")


# --------------------------------------------------------------------------- MLP training


def valid_split(N: int, fraction: float = 0.05, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
  """The training and validation indices (skorch ``ValidSplit(0.05, random_state=42)``: a
  seeded shuffle, ``ceil(fraction * N)`` held out).

  Args:
    N: examples.
    fraction: the validation share, in ``[0, 1)``.
    seed: the shuffle's seed.

  Returns:
    ``(train_idx, valid_idx)``.
  """
  fraction = _check_fraction("valid_fraction", fraction)
  perm = np.random.default_rng(seed).permutation(N)
  n_valid = math.ceil(fraction * N)
  return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


def epoch_schedule(lr: float, max_epochs: int, steps_per_epoch: int) -> Callable:
  """Cosine annealing stepped per epoch (torch ``CosineAnnealingLR(T_max=max_epochs)`` stepped
  once an epoch, as skorch's ``LRScheduler``): epoch ``e`` trains at
  ``lr * (1 + cos(pi * e / max_epochs)) / 2``.

  Args:
    lr: the first epoch's rate.
    max_epochs: the annealing period ``T_max``.
    steps_per_epoch: optimiser steps per epoch.

  Returns:
    An optax schedule (step -> rate).
  """

  def schedule(step):
    epoch = step // steps_per_epoch
    return lr * 0.5 * (1.0 + jnp.cos(jnp.pi * epoch / max_epochs))

  return schedule


def mlp_optimizer(
  lr: float, max_epochs: int, steps_per_epoch: int, weight_decay: float = 0.01
) -> optax.GradientTransformation:
  """``kvzap/train.py``'s optimiser: global-norm clipping at 1.0 (skorch
  ``GradientNormClipping``), then AdamW (torch defaults: betas 0.9/0.999, eps 1e-8, weight decay
  0.01 on every weight) at :func:`epoch_schedule`'s rate.

  Args:
    lr: the peak rate.
    max_epochs: the schedule's period.
    steps_per_epoch: optimiser steps per epoch.
    weight_decay: AdamW's decoupled weight decay.

  Returns:
    The optax transformation.
  """
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(
      epoch_schedule(lr, max_epochs, steps_per_epoch),
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      weight_decay=weight_decay,
    ),
  )


def mse(surrogate: Surrogate, X_NLd: Array, y_NLG: Array) -> Array:
  """The mean squared error over every example, layer and head (torch ``nn.MSELoss()``).

  Args:
    surrogate: the surrogate.
    X_NLd: attention inputs ``[N, L, d]``.
    y_NLG: targets ``[N, L, G]``.

  Returns:
    The fp32 scalar loss.
  """
  pred = jnp.moveaxis(apply(surrogate, jnp.moveaxis(X_NLd, 1, 0)), (0, 1), (1, 2))  # [N, L, G]
  return jnp.mean(jnp.square(pred - y_NLG))


@dataclasses.dataclass(frozen=True)
class MLPTraining:
  """:func:`train_mlp`'s result.

  Attributes:
    surrogate: the trained MLP.
    train_loss: the mean training loss of each epoch (the epoch's batches' mean, weighted by
      their sizes, as skorch's ``train_loss``).
    valid_loss: the validation MSE after each epoch (skorch's ``valid_loss``).
    initial_valid_loss: the validation MSE before training.
  """

  surrogate: Surrogate
  train_loss: tuple[float, ...]
  valid_loss: tuple[float, ...]
  initial_valid_loss: float


@jax.jit
def _mse_jit(surrogate, X, y):
  return mse(surrogate, X, y)


def _mlp_loss(params, X, y):
  return mse(Surrogate(params, "mlp"), X, y)


def _weighted_loss(params, X, y, w):
  """:func:`mse` of a padded batch: the rows of weight 0 (padding) count for nothing."""
  s = Surrogate(params, "mlp")
  pred = jnp.moveaxis(apply(s, jnp.moveaxis(X, 1, 0)), (0, 1), (1, 2))  # [N, L, G]
  per_row = jnp.mean(jnp.square(pred - y), (1, 2))
  return (per_row * w).sum() / jnp.maximum(w.sum(), 1.0)


def _batched_mse(surrogate, X, y, batch):
  if X.shape[0] == 0:
    return float("nan")
  total = 0.0
  for i in range(0, X.shape[0], batch):
    total += float(_mse_jit(surrogate, X[i : i + batch], y[i : i + batch])) * len(X[i : i + batch])
  return total / X.shape[0]


def _check_fraction(name: str, value) -> float:
  if not (isinstance(value, (int, float)) and 0 <= value < 1):
    raise ValueError(f"{name}: expected a float in [0, 1), got {value!r}")
  return float(value)


@dataclasses.dataclass(frozen=True)
class MLPConfig(training.TrainConfig):
  """:func:`train_mlp`'s hyperparameters (kvpress ``kvzap/train.py``'s), each checked when made.

  Attributes:
    lr: the peak learning rate (5e-3).
    batch_size: examples per step (512).
    seed: the seed of the initialisation, split and shuffles (42).
    hidden_dim: the MLP's width (512).
    max_epochs: epochs (15).
    weight_decay: AdamW's decoupled weight decay (torch's default 0.01).
    valid_fraction: the held-out share (0.05), in ``[0, 1)``.
  """

  lr: float = training.float_field(5e-3)
  batch_size: int = training.int_field(512)
  seed: int = training.int_field(42, minimum=0)
  hidden_dim: int = training.int_field(HIDDEN_DIM)
  max_epochs: int = training.int_field(15)
  weight_decay: float = training.float_field(0.01, zero=True)
  valid_fraction: float = training.config_field(0.05, _check_fraction)


def _print_epoch(max_epochs: int) -> Callable[[int, float, float], None]:
  def on_epoch(epoch, tl, vl):
    if distributed.is_primary():
      print(f"kvzap mlp: epoch {epoch + 1}/{max_epochs} train {tl:.4f} valid {vl:.4f}", flush=True)

  return on_epoch


def train_mlp(
  X_NLd,
  y_NLG,
  config: MLPConfig | None = None,
  *,
  checkpoint_dir: str | pathlib.Path | None = None,
  on_epoch: Callable[[int, float, float], None] | None = None,
  across_processes: bool = False,
  **options,
) -> MLPTraining:
  """Trains KVzap's MLP surrogate, all layers at once (kvpress ``kvzap/train.py``
  ``train_mlp``: a skorch ``NeuralNetRegressor`` of ``KVzapModel``), with
  :func:`kvjax.model.training.run`.

  MSE loss; :func:`mlp_optimizer` (AdamW ``lr`` 5e-3, weight decay 0.01, cosine annealing over
  ``max_epochs`` 15 stepped per epoch, global-norm clipping at 1.0); batches of 512 drawn from a
  fresh shuffle each epoch (the last one smaller); :func:`valid_split` holds out 5 %. With a
  ``checkpoint_dir`` the parameters, optimiser state and losses are saved with orbax after every
  epoch and a later call with the same arguments resumes from the last one: the result equals
  an uninterrupted run's (each epoch's shuffle depends only on ``seed`` and the epoch).

  Differs from kvpress: the initialisation and shuffles use JAX's and numpy's generators
  (torch's in kvpress), so the same data gives a different but equally distributed run; fp32
  (kvpress: the model's dtype); the validation split is a seeded permutation (skorch: scikit-
  learn's ``ShuffleSplit``).

  Args:
    X_NLd: attention inputs ``[N, L, d]``.
    y_NLG: KVzip+ log scores ``[N, L, G]``.
    config: the hyperparameters (``None``: :class:`MLPConfig`'s defaults).
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    on_epoch: called after each epoch (after its checkpoint) with
      ``(epoch, train_loss, valid_loss)``; the default prints a progress line on process 0.
    across_processes: in a run of several processes (``kvjax.distributed``), data-parallel
      (:class:`kvjax.model.training.DataParallel`): every process calls it with the same data
      and arguments. The checkpoints are orbax's multi-host ones (process 0 writes the
      replicated arrays and ``kvzap_run.json``), so ``checkpoint_dir`` must be the same
      directory for every process. The result equals a one-process run's up to the order of
      the sums.
    **options: :class:`MLPConfig` fields, over ``config`` (``hidden_dim=32``, ...).

  Returns:
    The :class:`MLPTraining`.

  Raises:
    ValueError: for bad shapes or options, or a ``checkpoint_dir`` holding a run with other
      arguments or data shapes.
  """
  c = MLPConfig.make(config, **options)
  X, y = training.check_pairs(X_NLd, y_NLG, " (a zero KVzip+ score has log -inf)")
  train_idx, valid_idx = valid_split(X.shape[0], c.valid_fraction, c.seed)
  if train_idx.size == 0:
    raise ValueError(f"X_NLd: {X.shape[0]} examples leave none to train on")
  Xt, yt, Xv, yv = X[train_idx], y[train_idx], X[valid_idx], y[valid_idx]
  _, L, d = X.shape
  steps_per_epoch = math.ceil(train_idx.size / c.batch_size)
  opt = mlp_optimizer(c.lr, c.max_epochs, steps_per_epoch, c.weight_decay)
  params = init_mlp(jax.random.PRNGKey(c.seed), L, d, y.shape[2], c.hidden_dim).params
  state = opt.init(params)  # over the weights dict: orbax saves plain dicts and optax states
  initial = _batched_mse(Surrogate(params, "mlp"), Xv, yv, c.batch_size)
  par = training.DataParallel(across_processes, "the MLP")

  def row(epoch, before, after, losses, batch):
    total = 0.0
    for loss, n in losses:
      total += float(loss) * n
    # the replicated parameters read locally: every process scores the validation set alone
    valid = _batched_mse(Surrogate(par.local(after), "mlp"), Xv, yv, c.batch_size)
    return (epoch, total / train_idx.size, valid)

  loop = training.Loop(
    name="kvzap",
    units=c.max_epochs,
    columns=("epoch", "train_loss", "valid_loss"),
    batches=training.epochs(train_idx.size, c.batch_size, c.seed),
    batch=lambda epoch, b: (Xt[b], yt[b]),
    step=par.step(
      training.optax_step(_mlp_loss, opt),
      training.optax_step(_weighted_loss, opt),
    ),
    row=row,
  )
  on_epoch = on_epoch or _print_epoch(c.max_epochs)
  run = training.run(
    loop,
    par.place(params),
    par.place(state),
    checkpoint_dir=checkpoint_dir,
    record={**c.record(), "data_shape": [list(X.shape), list(y.shape)]},
    on_log=lambda r: on_epoch(int(r[0]), r[1], r[2]),
  )
  params = jax.tree.map(jnp.asarray, par.local(run.params)) if par.across else run.params
  return MLPTraining(
    Surrogate(params, "mlp"),
    tuple(r[1] for r in run.history),
    tuple(r[2] for r in run.history),
    initial,
  )


# --------------------------------------------------------------------------- files


def save(
  path: str | pathlib.Path,
  surrogate: Surrogate,
  meta: dict | None = None,
  *,
  identity: dict | None = None,
) -> pathlib.Path:
  """Writes a surrogate as an ``.npz`` file (:func:`kvjax.model.learned_io.write`): its weights
  and a json header (``format``, ``kind``, ``shapes``, ``model_identity`` and the caller's
  ``meta``).

  Args:
    path: the file to write.
    surrogate: the surrogate.
    meta: json-serialisable facts to keep with it, e.g. the model's name and the training data.
    identity: :func:`kvjax.checks.model_identity` of the model it was trained on
      (:func:`kvjax.model.learned_io.write`).

  Returns:
    The path written.
  """
  return learned_io.write(
    path, surrogate.params, FORMAT, meta, identity=identity, kind=surrogate.kind
  )


def load(path: str | pathlib.Path, model, *, unverified=False) -> tuple[Surrogate, dict]:
  """Reads a surrogate written by :func:`save` and checks it against a model
  (:func:`kvjax.model.learned_io.load`): its kind, and its weights' shapes
  (:func:`check_surrogate`).

  Args:
    path, model, unverified: as :func:`kvjax.model.learned_io.load`.

  Returns:
    ``(surrogate, meta)``: fp32 weights.

  Raises:
    ValueError: as :func:`kvjax.model.learned_io.load`, naming the file, and for a kind that
      is not one of ``KINDS``.
  """
  cfg = model.cfg

  def surrogate(files, meta, where):
    kind = meta.get("kind")
    if kind not in KINDS:
      raise ValueError(f"path: {path} has kind {kind!r}, expected one of {KINDS}")
    missing = [k for k in PARAM_KEYS[kind] if k not in files]
    if missing:
      raise ValueError(f"path: {path} lacks the {kind} weights {missing}")
    built = Surrogate({k: jnp.asarray(files[k], jnp.float32) for k in PARAM_KEYS[kind]}, kind)
    check_surrogate(built, cfg, where)
    return built

  return learned_io.load(
    path, model, fmt=FORMAT, what="KVzap surrogate", build=surrogate, unverified=unverified
  )


# --------------------------------------------------------------------------- evidence


def kvzap_evidence(model, surrogate: Surrogate, input_ids, attention_mask=None) -> Array:
  """Computes KVzap's ``kvzap_LGT`` of a prompt, as kvpress 0.5.5's ``KVzapPress.score``.

  One dense causal forward over the prompt gives every layer's attention inputs (the hidden
  states after the layer's input norm, what kvpress's hook reads as ``hidden_states``); the
  surrogate maps each to ``G`` scores. Padding positions get scores too; the policy's
  ``valid_T`` keeps them out.

  Differs from kvpress: the surrogate runs in fp32 (kvpress casts it to the model's dtype); the
  forward is dense (``[B, Hq, T, T]`` per layer), so this suits calibration-sized prompts.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    surrogate: the trained surrogate (:func:`load`, :func:`fit_linear`, :func:`train_mlp`).
    input_ids: the prompt ``[B, T]`` (left-padded when rows differ).
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 scores ``[L, B, G, T]``: ``evidence={"kvzap_LGT": ...}`` for ``km.generate``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a mask of
      another shape, or a surrogate that does not fit the model (:func:`check_surrogate`).
  """
  ids, mask = passes.padded_prompt(model.cfg, input_ids, attention_mask)
  check_surrogate(surrogate, model.cfg)
  return passes.learned_scores(model, apply, surrogate, ids, mask)


# --------------------------------------------------------------------------- the experiment


def experiment(c, model, rows, template: KVzipTemplate, source: str):
  """KVzap's surrogates of ``python -m experiments.kvzap``: every process calls it with the
  same arguments, process 0 writes the files.

  The targets of ``rows`` (:func:`kvzap_targets`, ``n_tokens`` positions per context) are
  extracted batch by batch and saved (``targets/part_*.npz``, shared among the processes:
  :func:`kvjax.model.training.saved_targets`); the first ``test_rows`` contexts are held out (as
  ``kvzap/train.py``'s test split); the MLP trains data-parallel with orbax checkpoints
  (``mlp_checkpoints/``, :func:`train_mlp`), process 0 fits the ridge surrogate
  (:func:`fit_linear`) and writes ``kvzap_linear.npz``, ``kvzap_mlp.npz`` and ``results.json``
  (the test MSE of both and of the mean predictor, the loss curves, the timings). Killed, the
  same call resumes: the saved parts are read and the MLP resumes from its last checkpoint.
  Process 0 prints the test MSE and the run directory.

  Args:
    c: the settings (``configs/kvzap.py``): ``workdir``, ``model``, ``dtype``, ``rows``,
      ``length``, ``test_rows``, ``n_tokens``, ``batch_rows``, ``prefix``, ``suffix``,
      ``ridge_alpha`` and the :class:`MLPConfig` fields.
    model: the model (:class:`kvjax.model.llama.Llama`).
    rows: the contexts ``[rows, T]`` (:func:`kvjax.model.reconstruction.kvzip_corpus`).
    template: KVzip's reconstruction prompt.
    source: where the text comes from (kept in the files).

  Returns:
    The results (``results.json``) on process 0, ``None`` on the others.

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`), bad
      :class:`MLPConfig` fields, or saved targets (:func:`kvjax.model.training.saved_targets`) or
      checkpoints of other settings.
  """
  workdir = rundir.check_workdir(c.workdir)
  primary = distributed.is_primary()
  config = MLPConfig.from_settings(c)
  # saved parts are reused only by a run that would compute the same ones
  names = ("model", "dtype", "rows", "length", "n_tokens", "batch_rows", "seed", "prefix", "suffix")

  def part(part_rows, i):
    return kvzap_targets(model, part_rows, template, n_tokens=c.n_tokens, seed=c.seed + i)

  data, seconds = training.saved_targets(c, workdir, rows, names, part)
  timings = {"targets": seconds}
  n_test = c.test_rows * c.n_tokens  # the first contexts, as kvzap/train.py's test split
  X_train, X_test = data["X"][n_test:], data["X"][:n_test]
  y_train, y_test = data["y"][n_test:], data["y"][:n_test]
  if primary:
    print(
      f"examples: {len(X_train)} train, {len(X_test)} test; X {X_train.shape[1:]}, y {y_train.shape[1:]}"
    )
  t0 = time.perf_counter()
  trained = train_mlp(
    X_train, y_train, config, checkpoint_dir=workdir / "mlp_checkpoints", across_processes=True
  )
  timings["mlp"] = round(time.perf_counter() - t0, 2)
  if not primary:  # process 0 fits the ridge surrogate (one closed form) and writes
    return None
  t0 = time.perf_counter()
  linear = fit_linear(X_train, y_train, alpha=c.ridge_alpha)
  timings["linear"] = round(time.perf_counter() - t0, 2)
  Xt, yt = jnp.asarray(X_test), jnp.asarray(y_test)
  results = {
    "model": c.model,
    "source": source,
    "examples": {"train": len(X_train), "test": len(X_test)},
    "test_mse": {
      "mean_predictor": float(np.mean(np.square(y_test - y_train.mean(0)))),
      "linear": float(mse(linear, Xt, yt)),
      "mlp": float(mse(trained.surrogate, Xt, yt)),
    },
    "mlp_train_loss": list(trained.train_loss),
    "mlp_valid_loss": [trained.initial_valid_loss, *trained.valid_loss],
    "timings_s": timings,
    "processes": distributed.process_count(),
  }
  meta = {k: getattr(c, k) for k in ("model", "rows", "length", "n_tokens")} | {"source": source}
  identity = checks.model_identity(model.cfg, model.params())
  for kind, s in (("linear", linear), ("mlp", trained.surrogate)):
    fields = {**meta, "test_mse": results["test_mse"][kind]}
    save(workdir / f"kvzap_{kind}.npz", s, fields, identity=identity)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  print(json.dumps(results["test_mse"]))
  print(f"run directory: {workdir.absolute()}")
  return results
