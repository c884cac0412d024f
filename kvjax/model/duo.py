"""DuoAttention's head gates, ``retrieval_heads_LG`` in [0, 1] (Xiao et al., 2024, arXiv
2410.10819): the official optimisation of ``mit-han-lab/duo-attention`` (``duo_attn/train.py``,
``duo_attn/patch/llama.py``, ``duo_attn/data.py``) in a small form, trained with
:func:`kvjax.model.training.run` (:func:`train_duo_attention`), and two cheap proxies: kvpress
0.5.5's ``duo_attention_on_the_fly`` and each head's distant attention mass
(:func:`duo_attention_pattern`).

Every pass here is a plain layer loop (``lax.scan`` over the stacked layers) built on the
public functions of :mod:`kvjax.model.llama`, with dense attention: calibration prompts are
short. Softmax and scores are fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import distributed
from kvjax.model import llama, passes, training
from kvjax.model.config import ModelConfig
from kvjax.scores import PRECISION

Array = jax.Array

# --------------------------------------------------------------------------- DuoAttention

DUO_METHODS = ("official", "kvpress_on_the_fly", "distant_mass")
DUO_SINK, DUO_RECENT = 128, 256  # the official training script's sizes (scripts/train.sh)


def streaming_mask(T: int, sink_size: int, recent_size: int) -> np.ndarray:
  """Builds a streaming head's mask, as the official ``generate_streaming_mask``.

  A key ``j`` is seen by query ``i`` when causal and ``j < sink_size`` or
  ``i - j < recent_size``.

  Args:
    T: the sequence length.
    sink_size: the sink tokens every query sees.
    recent_size: the recent tokens each query sees.

  Returns:
    A bool mask ``[T, T]``.
  """
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return (j <= i) & ((j < sink_size) | (i - j < recent_size))


def duo_sizes(T: int, sink_size: int = DUO_SINK, recent_size: int = DUO_RECENT) -> tuple[int, int]:
  """Chooses the sink and recent sizes of the streaming pattern for prompts of ``T`` tokens.

  The official 128 + 256 when they fill at most a quarter of the prompt (the official training
  prompts are 1k-32k tokens), else scaled by the same factor down to a quarter (at least 1 each),
  so that streaming heads still lose most of a short prompt. A named deviation for short CPU
  prompts.

  Args:
    T: the prompt length.
    sink_size: the full-size sink.
    recent_size: the full-size recent window.

  Returns:
    ``(sink_size, recent_size)``.
  """
  factor = min(1.0, T / (4 * (sink_size + recent_size)))
  return max(1, round(sink_size * factor)), max(1, round(recent_size * factor))


def _clamp01(x: Array) -> Array:
  """``clamp(x, 0, 1)`` with torch's gradient (1 on the closed interval, 0 outside); jnp.clip
  would halve it at the bounds, where the gates start."""
  return jnp.where((x >= 0) & (x <= 1), x, jax.lax.stop_gradient(jnp.clip(x, 0.0, 1.0)))


def duo_two_way(cfg: ModelConfig, params: dict, alpha_LG: Array, ids_BT: Array, stream_TT):
  """Runs the official two-way forward (``llama_duo_attention_forward_two_way``).

  The unchanged model (full attention, no gradient) runs beside the gated one, whose every head
  outputs ``(1 - a) * streaming + a * full`` with ``a`` its KV head's clamped gate and ``full``
  the *unchanged* branch's full-attention output at that layer (as the official code mixes).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    alpha_LG: the gates ``[L, G]`` (clamped to [0, 1] inside).
    ids_BT: token ids ``[B, T]``.
    stream_TT: the streaming heads' mask ``[T, T]`` (:func:`streaming_mask`).

  Returns:
    ``(full, gated)``: both final hidden states ``[B, T, d]`` fp32 (after the final norm:
    ``model.model``'s output).
  """
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  causal = passes.causal_allowed(cfg, B, T)
  stream = causal & jnp.asarray(stream_TT)[None]
  R = cfg.num_groups

  def layer(carry, inputs):
    x_f, x_s = carry
    p, alpha_G = inputs
    q, k, v = llama.project_qkv(cfg, p, x_f, pos)
    o_f = jax.lax.stop_gradient(llama.attend(llama.attention_probs(q, k, causal), v))
    q, k, v = llama.project_qkv(cfg, p, x_s, pos)
    o_s = llama.attend(llama.attention_probs(q, k, stream), v)
    a = jnp.repeat(_clamp01(alpha_G), R).reshape(1, -1, 1, 1)
    mixed = (1 - a) * o_s + a * o_f
    x_f = jax.lax.stop_gradient(llama.output_and_mlp(cfg, p, x_f, o_f))
    return (x_f, llama.output_and_mlp(cfg, p, x_s, mixed)), None

  x = llama.embed_tokens(cfg, params, ids_BT)
  (x_f, x_s), _ = jax.lax.scan(layer, (x, x), (llama.stacked(params), alpha_LG))
  norm = lambda h: llama.rms_norm(h, params["final_norm"], cfg.rms_norm_eps).astype(jnp.float32)  # noqa: E731
  return norm(x_f), norm(x_s)


def duo_loss(alpha_LG, cfg, params, ids_BT, labels_BT, stream_TT, reg_weight):
  """Computes the official DuoAttention loss: hidden-state distillation plus a gate penalty.

  The distillation is the hidden-state MSE (mean over the hidden size, summed over the label
  positions, divided by their count); the penalty is ``reg_weight`` times the mean absolute gate
  (``l1_loss``).

  Args:
    alpha_LG: the gates ``[L, G]`` (differentiated).
    cfg: the model's config.
    params: the parameter pytree.
    ids_BT: token ids ``[B, T]``.
    labels_BT: the label mask ``[B, T]`` (positions distilled).
    stream_TT: the streaming heads' mask ``[T, T]``.
    reg_weight: the weight of the gate penalty.

  Returns:
    ``(loss, (distill, reg))``.
  """
  h_f, h_s = duo_two_way(cfg, params, alpha_LG, ids_BT, stream_TT)
  mask = labels_BT.astype(jnp.float32)
  distill = (jnp.mean((h_f - h_s) ** 2, -1) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  reg = jnp.abs(alpha_LG).mean()
  return distill + reg_weight * reg, (distill, reg)


def duo_schedule(lr: float, num_steps: int):
  """Builds the official ``LambdaLR`` warm-up/decay schedule.

  ``lr * min(1, max((s+1)/w, 0.1), max((N-s)/w, 0.1))`` with ``w = N // 5`` (at least 1 here: the
  official divides by zero below 5 steps).

  Args:
    lr: the peak learning rate.
    num_steps: the total steps ``N``.

  Returns:
    ``schedule(step)``, the learning rate at a step (a jnp scalar).
  """
  w = max(num_steps // 5, 1)

  def schedule(step):
    s = jnp.asarray(step, jnp.float32)
    up, down = jnp.maximum((s + 1) / w, 0.1), jnp.maximum((num_steps - s) / w, 0.1)
    return lr * jnp.minimum(1.0, jnp.minimum(up, down))

  return schedule


@dataclasses.dataclass(frozen=True)
class DuoTraining:
  """What :func:`train_duo_attention` returns: the gates ``alpha_LG`` (clipped to [0, 1], as the
  official ``load_attn_pattern``), the loss per step and the sizes it trained with."""

  alpha_LG: np.ndarray
  loss: np.ndarray
  distill: np.ndarray
  reg: np.ndarray
  sink_size: int
  recent_size: int


def _examples(examples, cfg) -> list[tuple[np.ndarray, np.ndarray]]:
  if not isinstance(examples, (list, tuple)) or not examples:
    raise ValueError("examples: expected a non-empty sequence of (ids_T, label_mask_T) pairs")
  out = []
  for i, ex in enumerate(examples):
    if not isinstance(ex, (list, tuple)) or len(ex) != 2:
      raise ValueError(f"examples[{i}]: expected an (ids_T, label_mask_T) pair")
    ids = passes.ids_2d(f"examples[{i}] ids", ex[0], cfg)
    labels = np.asarray(ex[1]).astype(bool).reshape(1, -1)
    if ids.shape[0] != 1 or labels.shape != ids.shape or not labels.any():
      raise ValueError(
        f"examples[{i}]: expected 1-D ids and a label mask of the same length with at least one "
        f"label, got shapes {np.shape(ex[0])} and {np.shape(ex[1])}"
      )
    out.append((ids, labels))
  return out


def _check_sizes(name: str, sizes) -> tuple[int | None, int | None]:
  if not isinstance(sizes, tuple | list) or len(sizes) != 2:
    raise ValueError(f"{name}: expected (sink_size, recent_size), got {sizes!r}")
  names = ("sink_size", "recent_size")
  return tuple(
    None if v is None else training.check_int(n, v) for n, v in zip(names, sizes, strict=True)
  )


@dataclasses.dataclass(frozen=True)
class DuoConfig(training.TrainConfig):
  """:func:`train_duo_attention`'s hyperparameters (``duo_attn/train.py``'s), each checked when
  made.

  Attributes:
    lr: the peak learning rate (0.02, the released patterns').
    batch_size: examples per step (the official: 1).
    seed: unused (the examples are cycled in order).
    num_steps: optimisation steps.
    reg_weight: the weight of the gate penalty (0.05), ``>= 0``.
    initial_value: the gates' starting value (1.0).
    sizes: the streaming pattern's ``(sink_size, recent_size)``, each ``None`` for
      :func:`duo_sizes` of the shortest example.
  """

  lr: float = training.float_field(0.02)
  num_steps: int = training.int_field(8)
  reg_weight: float = training.float_field(0.05, zero=True)
  initial_value: float = training.config_field(1.0, training.check_finite)
  sizes: tuple = training.config_field((None, None), _check_sizes)


def train_duo_attention(
  model,
  examples,
  config: DuoConfig | None = None,
  *,
  across_processes: bool = False,
  **options,
) -> DuoTraining:
  """Trains DuoAttention's gate per KV head, as ``duo_attn/train.py``, with
  :func:`kvjax.model.training.run`.

  Gates start at ``initial_value`` (1.0), are clamped to [0, 1] before every step and inside the
  forward, and are trained by AdamW (betas 0.9/0.999, eps 1e-8, no weight decay: optax's
  ``scale_by_adam`` times the step's learning rate) at ``lr`` (0.02 in the released patterns)
  with the official warm-up/decay schedule (:func:`duo_schedule`) on :func:`duo_loss` with
  ``reg_weight`` 0.05; batch size 1, the ``examples`` cycled in order (the official shuffles a
  dataset of multi-passkey prompts). With ``batch_size`` ``b`` each step takes the next ``b``
  examples (cycled) and its loss is their mean (each example's distillation as at batch size
  1); shorter prompts are padded at the end, which the causal and streaming masks keep out of
  the earlier positions. Differs: a few steps on short prompts (the official runs
  2000 steps on 1k-32k tokens), fp32 instead of bf16 FSDP, no sequence parallelism.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    examples: ``(ids_T, label_mask_T)`` pairs (:func:`duo_examples`); the label mask marks the
      question-and-answer tokens, where the hidden states are distilled.
    config: the hyperparameters (``None``: :class:`DuoConfig`'s defaults).
    across_processes: in a run of several processes (``kvjax.distributed``), data-parallel: each
      step's batch is placed on :func:`kvjax.distributed.process_mesh`, each process holding
      its share of the examples (round robin, padded with examples of weight 0), and the
      jitted step reduces the loss and the gradients across the processes; every process
      calls it with the same arguments and gets the same gates. The gates equal a one-process
      run's with the same ``batch_size`` up to the order of the sums.
    **options: :class:`DuoConfig` fields, over ``config`` (``num_steps=6``, ...).

  Returns:
    A :class:`DuoTraining` with the gates ``alpha_LG``, the loss history and the sizes used.

  Raises:
    ValueError: for malformed ``examples`` (ids breaking
      :func:`kvjax.model.llama.check_token_ids`'s rule, a label mask of another length or with
      no label), or a bad :class:`DuoConfig` field (a ``num_steps`` that is not an int ``>= 1``,
      a non-positive ``lr``, a negative ``reg_weight``, malformed ``sizes``).
  """
  cfg, params = model.cfg, model.params()
  c = DuoConfig.make(config, **options)
  data = _examples(examples, cfg)
  sizes = _sizes(c.sizes, min(ids.shape[1] for ids, _ in data))
  schedule = duo_schedule(c.lr, c.num_steps)
  alpha = jnp.full((cfg.num_layers, cfg.num_kv_heads), c.initial_value, jnp.float32)
  par = training.DataParallel(across_processes, "the DuoAttention gates")
  if c.batch_size > 1 or par.across:
    step, batch = _batched_step(cfg, par.place(params), data, c, sizes, schedule, par)
  else:
    masks = {}

    def batch(s, picks):
      ids, labels = data[picks[0]]
      T = ids.shape[1]
      if T not in masks:
        masks[T] = jnp.asarray(streaming_mask(T, *sizes))
      return ids, labels, masks[T], c.reg_weight, schedule(s)

    step = functools.partial(_duo_step, cfg, params)
  loop = training.Loop(
    name="duo",
    units=c.num_steps,
    columns=("loss", "distill", "reg"),
    batches=training.cycled(len(data), c.batch_size),
    batch=batch,
    step=step,
    row=lambda s, before, after, losses, b: par.local(losses[-1][0]),
  )
  run = training.run(loop, par.place(alpha), par.place(_ADAM.init(alpha)), on_log=lambda r: None)
  h = np.asarray(run.history, np.float32)
  return DuoTraining(
    alpha_LG=np.clip(np.asarray(par.local(run.params), np.float32), 0.0, 1.0),
    loss=h[:, 0],
    distill=h[:, 1],
    reg=h[:, 2],
    sink_size=sizes[0],
    recent_size=sizes[1],
  )


# torch's AdamW with weight_decay=0 is Adam; the learning rate is applied per step (the schedule's
# value is data, so one compile serves every step and every call)
_ADAM = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)


@functools.partial(jax.jit, static_argnums=0)
def _duo_step(cfg, params, alpha, state, ids, labels, stream, reg_weight, lr):
  alpha = jnp.clip(alpha, 0.0, 1.0)  # the official clamp_ before each step
  grad_fn = jax.value_and_grad(duo_loss, has_aux=True)
  (loss, (distill, reg)), g = grad_fn(alpha, cfg, params, ids, labels, stream, reg_weight)
  updates, state = _ADAM.update(g, state, alpha)
  return alpha - lr * updates, state, (loss, distill, reg)


def _duo_batch_loss(alpha_LG, cfg, params, ids_BT, labels_BT, weights_B, stream_TT, reg_weight):
  """:func:`duo_loss` of a batch: each row's distillation as at batch size 1 (over its own
  label positions), their mean weighted by ``weights_B`` (0 for padding rows)."""
  h_f, h_s = duo_two_way(cfg, params, alpha_LG, ids_BT, stream_TT)
  mask = labels_BT.astype(jnp.float32)
  per_row = (jnp.mean((h_f - h_s) ** 2, -1) * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
  distill = (per_row * weights_B).sum() / jnp.maximum(weights_B.sum(), 1.0)
  reg = jnp.abs(alpha_LG).mean()
  return distill + reg_weight * reg, (distill, reg)


def _duo_batch_step(cfg, params, alpha, state, ids, labels, weights, stream, reg_weight, lr):
  alpha = jnp.clip(alpha, 0.0, 1.0)
  grad_fn = jax.value_and_grad(_duo_batch_loss, has_aux=True)
  (loss, (distill, reg)), g = grad_fn(alpha, cfg, params, ids, labels, weights, stream, reg_weight)
  updates, state = _ADAM.update(g, state, alpha)
  return alpha - lr * updates, state, jnp.stack([loss, distill, reg])


def _batched_step(cfg, params, data, c: DuoConfig, sizes, schedule, par: training.DataParallel):
  """:func:`train_duo_attention`'s step and batches for ``c.batch_size`` examples a step,
  data-parallel over the processes when ``par`` is: ``(step, batch)`` of
  :class:`kvjax.model.training.Loop`."""
  P = par.count
  rows = -(-c.batch_size // P) * P  # padded so that every process holds as many rows
  per = rows // P
  rep = par.replicated
  if par.across:
    jitted = jax.jit(functools.partial(_duo_batch_step, cfg), out_shardings=(rep, rep, rep))
  else:
    jitted = jax.jit(functools.partial(_duo_batch_step, cfg))
  masks = {}

  def batch(s, picks):
    picks = [data[i] for i in picks]
    T = max(ids.shape[1] for ids, _ in picks)
    ids_BT = np.zeros((rows, T), np.int32)
    labels_BT = np.zeros((rows, T), bool)
    weights_B = np.zeros(rows, np.float32)
    for i, (ids, labels) in enumerate(picks):
      r = (i % P) * per + i // P  # round robin: example i on process i % P
      ids_BT[r, : ids.shape[1]], labels_BT[r, : ids.shape[1]], weights_B[r] = ids[0], labels[0], 1
    if T not in masks:
      masks[T] = distributed.put(streaming_mask(T, *sizes), rep)
    return (
      *distributed.put((ids_BT, labels_BT, weights_B), par.sliced),
      masks[T],
      distributed.put(np.float32(c.reg_weight), rep),
      distributed.put(np.asarray(schedule(s), np.float32), rep),
    )

  return (lambda alpha, state, *b: jitted(params, alpha, state, *b)), batch


def duo_examples(examples) -> list[tuple[np.ndarray, np.ndarray]]:
  """Builds ``(ids_T, label_mask_T)`` training pairs from retrieval examples.

  The examples are ``kvjax.eval.tasks.Example`` objects, for instance
  ``tasks.generate("multi_query", tok, length=..., seed=i)`` (several keys hidden in a haystack,
  several asked at once): each pair is the prompt then its answer, labels on the question and
  answer tokens, as the official ``MultiplePasskeyRetrievalDataset`` labels its
  question-and-answer part. Differs from the official data: kvjax's task haystack instead of
  BookSum, its values instead of 32-word passkeys.

  Args:
    examples: ``tasks.Example`` objects (with ``prompt``, ``answer`` and ``question_len``).

  Returns:
    A list of ``(ids_T int32, label_mask_T bool)`` pairs.

  Raises:
    ValueError: for an example without ``prompt``, ``answer`` or ``question_len``.
  """
  out = []
  for i, ex in enumerate(examples):
    for name in ("prompt", "answer", "question_len"):
      if not hasattr(ex, name):
        raise ValueError(f"examples[{i}]: expected a tasks.Example (no {name!r})")
    ids = np.concatenate([np.asarray(ex.prompt), np.asarray(ex.answer)]).astype(np.int32)
    labels = np.zeros(ids.size, bool)
    labels[len(ex.prompt) - ex.question_len :] = True
    out.append((ids, labels))
  return out


def _on_the_fly_scores(cfg, params, ids_BT, q_len: int):
  """kvpress's ``duo_attention_on_the_fly`` for one text: per layer, the mean pre-RoPE query and
  key over the text's positions, repeated ``q_len`` times and rotated at positions
  ``0 .. q_len-1``; the last query's softmax over the ``q_len`` keys; the score is the mean of
  its cumulative sum (the area under the cumulated attention curve), averaged over each KV
  head's query heads. ``[L, G]``."""
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)
  R = cfg.num_groups
  rot = jnp.arange(q_len, dtype=jnp.int32)

  def layer(x, p):
    h = llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q_mean, k_mean = (t.mean(2, keepdims=True) for t in passes.pre_rope(cfg, p, h))
    q_last = llama.rope_at(q_mean, jnp.full((1, 1, 1), q_len - 1, jnp.int32), cfg)
    k_all = llama.rope_at(
      jnp.broadcast_to(k_mean, k_mean.shape[:2] + (q_len, cfg.head_dim)),
      jnp.broadcast_to(rot, (1, 1, q_len)),
      cfg,
    )
    probs = llama.attention_probs(q_last, k_all, jnp.ones((1, 1, q_len), bool))[0, :, 0]
    s = jnp.cumsum(probs, -1).mean(-1).reshape(cfg.num_kv_heads, R).mean(-1)
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(llama.attention_probs(q, k, allowed), v))
    return x, s

  _, s_LG = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return s_LG


_on_the_fly_jit = jax.jit(_on_the_fly_scores, static_argnums=(0, 3))


def _distant_mass(cfg, params, ids_BT, labels_BT, stream_TT):
  """Each KV head's attention mass outside sink + recent, paid by the label queries: mean over
  them and over the group. ``[L, G]``."""
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)
  far = (~jnp.asarray(stream_TT)).astype(jnp.float32)
  w = labels_BT.astype(jnp.float32)

  def layer(x, p):
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    probs = llama.attention_probs(q, k, allowed)
    mass = jnp.einsum("bhqk,qk->bhq", probs, far, precision=PRECISION)
    per_head = (mass * w[:, None]).sum((0, 2)) / w.sum()
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v))
    return x, per_head.reshape(cfg.num_kv_heads, -1).mean(-1)

  _, m_LG = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return m_LG


_distant_mass_jit = jax.jit(_distant_mass, static_argnums=0)


def _sizes(sizes, T: int) -> tuple[int, int]:
  """``(sink_size, recent_size)`` from ``sizes``, each ``None`` taken from :func:`duo_sizes` of
  ``T`` tokens."""
  given = _check_sizes("sizes", sizes)
  return tuple(d if v is None else v for v, d in zip(given, duo_sizes(T), strict=True))


def duo_attention_pattern(
  model,
  examples=None,
  *,
  method: str = "official",
  calibration_ids=None,
  q_len: int = 500,
  sizes: tuple[int | None, int | None] = (None, None),
  **train_options,
) -> np.ndarray:
  """Computes ``retrieval_heads_LG`` in [0, 1] (higher: more of a retrieval head), by ``method``.

  * ``"official"``: the trained gates of :func:`train_duo_attention` on ``examples``
    (``train_options``: ``num_steps``, ``lr``, ``reg_weight``, ``initial_value``).
  * ``"kvpress_on_the_fly"``: kvpress 0.5.5's ``duo_attention_on_the_fly`` (its "experimental"
    proxy), averaged over the rows of ``calibration_ids`` (kvpress: 50 BookSum chapters; here
    any text, for example :func:`calibration_rows`), ``q_len`` 500. kvpress makes streaming
    heads of the lowest scores, as the policy does.
  * ``"distant_mass"``: kvjax's cheap proxy, each KV head's attention mass outside sink +
    recent (:func:`duo_sizes`) paid by the question-and-answer queries of ``examples``,
    averaged over them and over the group, then over the examples.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    examples: ``(ids_T, label_mask_T)`` pairs (:func:`duo_examples`), for ``"official"`` and
      ``"distant_mass"``.
    method: one of :data:`DUO_METHODS`.
    calibration_ids: text ids (``[B, T]``, or a sequence of 1-D rows), for
      ``"kvpress_on_the_fly"``.
    q_len: the rotated positions of ``"kvpress_on_the_fly"``.
    sizes: ``(sink_size, recent_size)`` of the streaming pattern (``"official"`` and
      ``"distant_mass"``), each ``None`` for :func:`duo_sizes`.
    **train_options: options of :func:`train_duo_attention` (``"official"`` only).

  Returns:
    fp32 scores ``[L, G]`` in [0, 1].

  Raises:
    ValueError: for an unknown ``method``, training options with another method, missing or
      malformed ``calibration_ids`` or ``examples``, a ``q_len`` that is not an int ``>= 1``,
      or malformed ``sizes`` (and as :func:`train_duo_attention` for ``"official"``).
  """
  cfg, params = model.cfg, model.params()
  if method not in DUO_METHODS:
    raise ValueError(f"method: expected one of {DUO_METHODS}, got {method!r}")
  if method == "official":
    return train_duo_attention(model, examples, sizes=sizes, **train_options).alpha_LG
  if train_options:
    raise ValueError(f"{sorted(train_options)[0]}: only method='official' trains")
  if method == "kvpress_on_the_fly":
    if calibration_ids is None:
      raise ValueError("calibration_ids: method='kvpress_on_the_fly' needs calibration text ids")
    rows = passes.id_rows("calibration_ids", calibration_ids, cfg)
    q_len = training.check_int("q_len", q_len)
    total = sum(np.asarray(_on_the_fly_jit(cfg, params, jnp.asarray(r[None]), q_len)) for r in rows)
    return (total / len(rows)).astype(np.float32)
  data = _examples(examples, cfg)
  total = 0.0
  for ids, labels in data:
    sink, recent = _sizes(sizes, ids.shape[1])
    stream = jnp.asarray(streaming_mask(ids.shape[1], sink, recent))
    total = total + np.asarray(_distant_mass_jit(cfg, params, ids, labels, stream))
  return (total / len(data)).astype(np.float32)
