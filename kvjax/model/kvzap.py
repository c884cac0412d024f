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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import distributed
from kvjax.model import llama, npzfile
from kvjax.model.calibrate import KVzipTemplate
from kvjax.model.config import ModelConfig
from kvjax.model.kvgrad import value_output_norms
from kvjax.scores import PRECISION

Array = jax.Array

KINDS = ("linear", "mlp")
HIDDEN_DIM = 512  # kvzap/train.py's --hidden_dim
FORMAT = "kvjax.kvzap/1"


def _check_int(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
  return int(value)


def _check_positive(name: str, value, *, zero: bool = False) -> float:
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
    expected = "a finite float >= 0" if zero else "a finite float > 0"
    raise ValueError(f"{name}: expected {expected}, got {value!r}")
  return float(value)


# --------------------------------------------------------------------------- targets


def _attention_inputs(cfg: ModelConfig, p: dict, x_BTd: Array) -> Array:
  """The hidden states the attention module receives (after its input norm), fp32."""
  return llama.norm(cfg, x_BTd, p["attn_norm"]).astype(jnp.float32)


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
    h = _attention_inputs(cfg, p, x)
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
    template: :func:`kvjax.model.calibrate.kvzip_template` (``first_ids``, ``suffix_ids`` and
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
  cfg: ModelConfig,
  params: dict,
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
    cfg: the model's config.
    params: the parameter pytree.
    context_ids: the contexts ``[T]`` or ``[B, T]`` (equal lengths), each starting with
      ``template.prefix_length`` chat-template tokens that are not targets.
    template: the reconstruction prompt (:func:`kvjax.model.calibrate.kvzip_template`).
    n_tokens: positions drawn per context (``None``: all of them, in order).
    seed: the draw's seed.

  Returns:
    ``(X_NLd, y_NLG)`` fp32 numpy arrays, ``N = B * n_tokens``, context by context.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a
      ``template`` that is not a :class:`~kvjax.model.calibrate.KVzipTemplate`, a
      ``prefix_length`` that leaves nothing, or an ``n_tokens`` below 1 or above the positions.
  """
  ids = np.asarray(context_ids)
  ids = ids[None] if ids.ndim == 1 else ids
  if ids.ndim != 2 or ids.shape[1] == 0:
    raise ValueError(f"context_ids: expected token ids [B, T] or [T], got shape {ids.shape}")
  ids = llama.check_token_ids("context_ids", ids, cfg.vocab_size)
  if not isinstance(template, KVzipTemplate):
    raise ValueError(f"template: expected a KVzipTemplate, got {type(template).__name__}")
  for name in ("first_ids", "suffix_ids"):
    ids_1T = np.asarray(getattr(template, name), np.int64).reshape(1, -1)
    llama.check_token_ids(f"template.{name}", ids_1T, cfg.vocab_size, min_len=0)
  B, T = ids.shape
  prefix = _check_int("template.prefix_length", template.prefix_length, 0)
  if prefix >= T:
    raise ValueError(
      f"template.prefix_length: {prefix} leaves nothing of the {T}-token context to score"
    )
  n = T - prefix
  if n_tokens is not None:
    n_tokens = _check_int("n_tokens", n_tokens)
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


def _check_xy(X_NLd, y_NLG) -> tuple[np.ndarray, np.ndarray]:
  X, y = np.asarray(X_NLd, np.float32), np.asarray(y_NLG, np.float32)
  if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2] or X.shape[0] == 0:
    raise ValueError(
      f"X_NLd, y_NLG: expected [N, L, d] and [N, L, G] with the same N, L > 0, got {X.shape} "
      f"and {y.shape}"
    )
  if not (np.isfinite(X).all() and np.isfinite(y).all()):
    raise ValueError("X_NLd, y_NLG: expected finite values (a zero KVzip+ score has log -inf)")
  return X, y


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
  X, y = _check_xy(X_NLd, y_NLG)
  alpha = _check_positive("alpha", alpha, zero=True)
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
  if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
    raise ValueError(f"valid_fraction: expected a float in [0, 1), got {fraction!r}")
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


def _step(opt, params, state, X, y):
  loss, grads = jax.value_and_grad(_mlp_loss)(params, X, y)
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


def _weighted_loss(params, X, y, w):
  """:func:`mse` of a padded batch: the rows of weight 0 (padding) count for nothing."""
  s = Surrogate(params, "mlp")
  pred = jnp.moveaxis(apply(s, jnp.moveaxis(X, 1, 0)), (0, 1), (1, 2))  # [N, L, G]
  per_row = jnp.mean(jnp.square(pred - y), (1, 2))
  return (per_row * w).sum() / jnp.maximum(w.sum(), 1.0)


def _weighted_step(opt, params, state, X, y, w):
  loss, grads = jax.value_and_grad(_weighted_loss)(params, X, y, w)
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


def _batched_mse(surrogate, X, y, batch):
  if X.shape[0] == 0:
    return float("nan")
  total = 0.0
  for i in range(0, X.shape[0], batch):
    total += float(_mse_jit(surrogate, X[i : i + batch], y[i : i + batch])) * len(X[i : i + batch])
  return total / X.shape[0]


def _check_run(path: pathlib.Path, args: dict) -> None:
  """Records a checkpointed run's arguments; a resume with others is refused (its checkpoints
  belong to another run)."""
  record = path / "kvzap_run.json"
  if record.exists():
    saved = json.loads(record.read_text())
    differ = {k: (saved.get(k), v) for k, v in args.items() if saved.get(k) != v}
    if differ:
      said = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in differ.items())
      raise ValueError(
        f"checkpoint_dir: {path} holds a run with other arguments ({said}); use a fresh directory"
      )
  else:
    path.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(args, sort_keys=True))


def train_mlp(
  X_NLd,
  y_NLG,
  *,
  hidden_dim: int = HIDDEN_DIM,
  max_epochs: int = 15,
  lr: float = 5e-3,
  batch_size: int = 512,
  weight_decay: float = 0.01,
  valid_fraction: float = 0.05,
  seed: int = 42,
  checkpoint_dir: str | pathlib.Path | None = None,
  on_epoch: Callable[[int, float, float], None] | None = None,
  across_processes: bool = False,
) -> MLPTraining:
  """Trains KVzap's MLP surrogate, all layers at once (kvpress ``kvzap/train.py``
  ``train_mlp``: a skorch ``NeuralNetRegressor`` of ``KVzapModel``).

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
    hidden_dim: the MLP's width (512).
    max_epochs: epochs (15).
    lr: the peak learning rate (5e-3).
    batch_size: examples per step (512).
    weight_decay: AdamW's decoupled weight decay (torch's default 0.01).
    valid_fraction: the held-out share (0.05).
    seed: the seed of the initialisation, split and shuffles.
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    on_epoch: called after each epoch (after its checkpoint) with
      ``(epoch, train_loss, valid_loss)``; the default prints a progress line.
    across_processes: in a run of several processes (``kvjax.distributed``), data-parallel:
      every process calls it with the same data and arguments; each step's batch is placed on
      :func:`kvjax.distributed.process_mesh`, each process holding a slice of it, and the
      jitted step reduces the loss and the gradients across the processes. The checkpoints are
      orbax's multi-host ones (every process saves and restores; process 0 writes the
      replicated arrays and ``kvzap_run.json``), so ``checkpoint_dir`` must be the same
      directory for every process (a shared file system on several hosts). The result equals
      a one-process run's up to the order of the sums.

  Returns:
    The :class:`MLPTraining`.

  Raises:
    ValueError: for bad shapes or options, or a ``checkpoint_dir`` holding a run with other
      arguments or data shapes.
  """
  X, y = _check_xy(X_NLd, y_NLG)
  hidden_dim = _check_int("hidden_dim", hidden_dim)
  max_epochs = _check_int("max_epochs", max_epochs)
  batch_size = _check_int("batch_size", batch_size)
  lr = _check_positive("lr", lr)
  weight_decay = _check_positive("weight_decay", weight_decay, zero=True)
  train_idx, valid_idx = valid_split(X.shape[0], valid_fraction, seed)
  if train_idx.size == 0:
    raise ValueError(f"X_NLd: {X.shape[0]} examples leave none to train on")
  Xt, yt, Xv, yv = X[train_idx], y[train_idx], X[valid_idx], y[valid_idx]
  _, L, d = X.shape
  G = y.shape[2]
  steps_per_epoch = math.ceil(train_idx.size / batch_size)
  opt = mlp_optimizer(lr, max_epochs, steps_per_epoch, weight_decay)
  params = init_mlp(jax.random.PRNGKey(seed), L, d, G, hidden_dim).params
  state = opt.init(params)  # over the weights dict: orbax saves plain dicts and optax states
  step = jax.jit(lambda p, st, xb, yb: _step(opt, p, st, xb, yb))
  initial = _batched_mse(Surrogate(params, "mlp"), Xv, yv, batch_size)
  across = bool(across_processes) and distributed.process_count() > 1
  if across:
    P = distributed.process_count()
    mesh = distributed.process_mesh("batch")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    params = distributed.put(jax.tree.map(np.asarray, params), rep)
    state = distributed.put(jax.tree.map(np.asarray, state), rep)
    parallel = jax.jit(
      lambda p, st, xb, yb, wb: _weighted_step(opt, p, st, xb, yb, wb),
      out_shardings=(rep, rep, rep),
    )

    def step(p, st, xb, yb):
      n = xb.shape[0]
      rows = -(-n // P) * P  # padded so that every process holds as many rows
      pad = ((0, rows - n), (0, 0), (0, 0))
      w = (np.arange(rows) < n).astype(np.float32)
      batch = distributed.put((np.pad(xb, pad), np.pad(yb, pad), w), split)
      return parallel(p, st, *batch)

  train_loss, valid_loss, start = [], [], 0
  mngr = None
  if checkpoint_dir is not None:
    import orbax.checkpoint as ocp  # only checkpointed runs pay for orbax's import

    path = pathlib.Path(checkpoint_dir).absolute()
    run_args = {
      "hidden_dim": hidden_dim,
      "max_epochs": max_epochs,
      "lr": lr,
      "batch_size": batch_size,
      "weight_decay": weight_decay,
      "valid_fraction": valid_fraction,
      "seed": seed,
      "data_shape": [list(X.shape), list(y.shape)],
    }
    # process 0 checks and records the arguments; its refusal reaches every process
    distributed.on_primary(lambda: _check_run(path, run_args), "checking the checkpoints")
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    last = mngr.latest_step()
    if last is not None:
      like = {
        "params": params,
        "opt_state": state,
        "train_loss": np.zeros(last, np.float64),
        "valid_loss": np.zeros(last, np.float64),
      }
      item = mngr.restore(last, args=ocp.args.StandardRestore(like))
      params, state = item["params"], item["opt_state"]
      train_loss = [float(v) for v in item["train_loss"]]
      valid_loss = [float(v) for v in item["valid_loss"]]
      start = last
  if on_epoch is None:

    def on_epoch(epoch, tl, vl):
      print(f"kvzap mlp: epoch {epoch + 1}/{max_epochs} train {tl:.4f} valid {vl:.4f}", flush=True)

  for epoch in range(start, max_epochs):
    order = np.random.default_rng([seed, epoch]).permutation(train_idx.size)
    total = 0.0
    for i in range(0, order.size, batch_size):
      b = order[i : i + batch_size]
      if across:  # the host batch: step pads it and places each process's slice
        params, state, loss = step(params, state, Xt[b], yt[b])
        loss = distributed.to_host(loss, "gathering the MLP's loss")
      else:
        params, state, loss = step(params, state, jnp.asarray(Xt[b]), jnp.asarray(yt[b]))
      total += float(loss) * b.size
    train_loss.append(total / order.size)
    # the replicated parameters read locally: every process scores the validation set alone
    host = distributed.to_host(params, "gathering the MLP") if across else params
    valid_loss.append(_batched_mse(Surrogate(host, "mlp"), Xv, yv, batch_size))
    if mngr is not None:
      item = {
        "params": params,
        "opt_state": state,
        "train_loss": np.asarray(train_loss, np.float64),
        "valid_loss": np.asarray(valid_loss, np.float64),
      }
      mngr.save(epoch + 1, args=ocp.args.StandardSave(item))
      mngr.wait_until_finished()
    on_epoch(epoch, train_loss[-1], valid_loss[-1])
  if mngr is not None:
    mngr.close()
  if across:
    params = jax.tree.map(jnp.asarray, distributed.to_host(params, "gathering the MLP"))
  return MLPTraining(Surrogate(params, "mlp"), tuple(train_loss), tuple(valid_loss), initial)


# --------------------------------------------------------------------------- files


def save(path: str | pathlib.Path, surrogate: Surrogate, meta: dict | None = None) -> pathlib.Path:
  """Writes a surrogate as an ``.npz`` file: its weights and a json header (``format``,
  ``kind``, ``shapes`` and the caller's ``meta``, e.g. the model's name and the training data).

  Args:
    path: the file to write.
    surrogate: the surrogate.
    meta: json-serialisable facts to keep with it.

  Returns:
    The path written.
  """
  header = {
    **(meta or {}),
    "format": FORMAT,
    "kind": surrogate.kind,
    "shapes": {k: list(v) for k, v in surrogate.shapes.items()},
  }
  return npzfile.write(path, surrogate.params, header)


def load(path: str | pathlib.Path, cfg: ModelConfig) -> tuple[Surrogate, dict]:
  """Reads a surrogate written by :func:`save` and checks it against a model.

  Args:
    path: the ``.npz`` file.
    cfg: the model the surrogate must fit (``num_layers``, ``hidden_size``, ``num_kv_heads``).

  Returns:
    ``(surrogate, meta)``.

  Raises:
    ValueError: naming the file, for one that is missing or unreadable, lacks the header or a
      weight, has another kind, or weights whose shapes do not fit ``cfg``.
  """
  files, meta = npzfile.read(path, FORMAT, "KVzap surrogate")
  kind = meta.get("kind")
  if kind not in KINDS:
    raise ValueError(f"path: {path} has kind {kind!r}, expected one of {KINDS}")
  missing = [k for k in PARAM_KEYS[kind] if k not in files]
  if missing:
    raise ValueError(f"path: {path} lacks the {kind} weights {missing}")
  hidden = files["w1"].shape[-1] if kind == "mlp" else HIDDEN_DIM
  want = expected_shapes(kind, cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, hidden)
  wrong = {k: (files[k].shape, v) for k, v in want.items() if files[k].shape != v}
  if wrong:
    said = ", ".join(f"{k} {got} (expected {exp})" for k, (got, exp) in wrong.items())
    raise ValueError(
      f"path: {path} does not fit this model (L={cfg.num_layers}, d={cfg.hidden_size}, "
      f"G={cfg.num_kv_heads}; the file says model {meta.get('model')!r}): {said}"
    )
  params = {k: jnp.asarray(files[k], jnp.float32) for k in PARAM_KEYS[kind]}
  return Surrogate(params, kind), meta


# --------------------------------------------------------------------------- evidence


def _prompt_inputs(cfg: ModelConfig, params: dict, ids_BT: Array, mask_BT: Array) -> Array:
  """Every layer's attention inputs over a (left-)padded prompt ``[L, B, T, d]``."""
  B, T = ids_BT.shape
  pos = llama.positions_from_mask(mask_BT)
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  allowed = llama.causal_allowed(pos, pos, mask_BT.astype(bool), index, index, cfg.sliding_window)

  def layer(x, p):
    h = _attention_inputs(cfg, p, x)
    x, _ = llama.dense_layer(cfg, p, x, pos, allowed)
    return x, h

  _, h = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return h


def _evidence(cfg, params, surrogate, ids_BT, mask_BT):
  return apply(surrogate, _prompt_inputs(cfg, params, ids_BT, mask_BT))  # [L, G, B, T]


_evidence_jit = jax.jit(_evidence, static_argnums=0)


def kvzap_evidence(
  cfg: ModelConfig, params: dict, surrogate: Surrogate, input_ids, attention_mask=None
) -> Array:
  """Computes KVzap's ``kvzap_LGT`` of a prompt, as kvpress 0.5.5's ``KVzapPress.score``.

  One dense causal forward over the prompt gives every layer's attention inputs (the hidden
  states after the layer's input norm, what kvpress's hook reads as ``hidden_states``); the
  surrogate maps each to ``G`` scores. Padding positions get scores too; the policy's
  ``valid_T`` keeps them out.

  Differs from kvpress: the surrogate runs in fp32 (kvpress casts it to the model's dtype); the
  forward is dense (``[B, Hq, T, T]`` per layer), so this suits calibration-sized prompts.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    surrogate: the trained surrogate (:func:`load`, :func:`fit_linear`, :func:`train_mlp`).
    input_ids: the prompt ``[B, T]`` (left-padded when rows differ).
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 scores ``[L, B, G, T]``: ``evidence={"kvzap_LGT": ...}`` for ``km.generate``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a mask of
      another shape, or a surrogate that is not a :class:`Surrogate` of this model's shapes.
  """
  ids = np.asarray(input_ids)
  if ids.ndim != 2 or ids.shape[1] == 0:
    raise ValueError(f"input_ids: expected token ids [B, T], got shape {ids.shape}")
  ids = llama.check_token_ids("input_ids", ids, cfg.vocab_size)
  mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
  if mask.shape != ids.shape:
    raise ValueError(f"attention_mask: expected shape {ids.shape}, got {mask.shape}")
  if not isinstance(surrogate, Surrogate):
    raise ValueError(f"surrogate: expected a Surrogate, got {type(surrogate).__name__}")
  hidden = surrogate.shapes["w1"][-1] if surrogate.kind == "mlp" else HIDDEN_DIM
  want = expected_shapes(surrogate.kind, cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, hidden)
  if surrogate.shapes != want:
    raise ValueError(f"surrogate: shapes {surrogate.shapes} do not fit this model, expected {want}")
  out = _evidence_jit(cfg, params, surrogate, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
  return jnp.moveaxis(out, 2, 1)
