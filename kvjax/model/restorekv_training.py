"""RestoreKV's adapter trained by self-distillation from the full-cache teacher, with optax,
checkpointed with orbax (:mod:`kvjax.model.restorekv` re-exports these).

* :func:`training_data`: the examples, KVzip's kept context pairs fixed once;
* :func:`distillation_loss`, :func:`mean_loss`: the KL divergence of the compressed cache's
  next-token distributions from the full cache's over the text that follows each context;
* :func:`train_adapter`: Adam, gradients clipped to norm 1 (:class:`AdapterConfig`);
* :func:`experiment`: ``python -m experiments.restorekv``'s run.
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

from kvjax import checks, policies, rundir
from kvjax.model import cache as cache_lib
from kvjax.model import llama, training
from kvjax.model.config import ModelConfig
from kvjax.model.reconstruction import (
  KVzipOptions,
  KVzipTemplate,
  check_kvzip_options,
  kvzip_evidence,
)
from kvjax.model.restorekv_adapter import (
  ALPHA,
  RANK,
  Adapter,
  held_segment,
  init_adapter,
  restore_kv,
  save,
  trained_fraction,
)
from kvjax.policies.methods import KVzip
from kvjax.policies.restorekv import RESTORE_TOKENS, RestoreKV

Array = jax.Array

LR, BATCH_SIZE, MAX_STEPS, CLIP = 1e-3, 4, 300, 1.0


def training_data(
  model,
  rows_BT,
  template: KVzipTemplate,
  *,
  context: int,
  ratio: float,
  tokens: int = RESTORE_TOKENS,
  kvzip: KVzipOptions | None = None,
):
  """The self-distillation examples of text rows: each row's first ``context`` tokens are the
  context, the rest the text the student and the teacher both predict; the context pairs
  RestoreKV keeps at ``ratio`` are fixed once (KVzip's scores do not depend on the adapter).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    rows_BT: unpadded text rows ``[B, T]`` with ``T > context``.
    template: KVzip's reconstruction prompt.
    context: the context tokens of each row.
    ratio: kvpress's ``compression_ratio`` the restore tokens are trained for: each head keeps
      ``int(context * (1 - ratio))`` slots on average, the restore tokens among them.
    tokens: restore tokens ``N`` (0: KVzip alone over the whole budget, the baseline that
      :func:`distillation_loss` scores without an adapter).
    kvzip: KVzip's options (``None``: the defaults) for its scores
      (:func:`kvjax.model.reconstruction.kvzip_evidence`); ``n_sink`` is also the policy's
      ``sinks``.

  Returns:
    ``(context_BT, continuation_BM, keep_LBGT)``: int32 ids and the bool kept context pairs.

  Raises:
    ValueError: for rows not longer than ``context``, a ratio outside ``[0, 1)``, ``kvzip``
      that is not a :class:`~kvjax.model.reconstruction.KVzipOptions`, or a budget that leaves
      no context pair besides the restore tokens.
  """
  rows = np.asarray(rows_BT, np.int32)
  context = training.check_int("context", context)
  if rows.ndim != 2 or rows.shape[1] <= context:
    raise ValueError(
      f"rows_BT: expected [B, T] rows longer than context={context}, got shape {rows.shape}"
    )
  ok = isinstance(ratio, (int, float, np.floating)) and not isinstance(ratio, bool)
  if not ok or not 0.0 <= float(ratio) < 1.0:
    raise ValueError(
      f"ratio: expected a float in [0, 1) (kvpress compression_ratio), got {ratio!r}"
    )
  budget = int(context * (1 - float(ratio)))
  if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
    raise ValueError(f"tokens: expected a non-negative int, got {tokens!r}")
  kvzip = check_kvzip_options("kvzip", kvzip)
  sinks = kvzip.n_sink
  policy = RestoreKV(restore_tokens=tokens, sinks=sinks) if tokens else KVzip(sinks=sinks)
  policy.check_budget(budget, 0)
  ctx, cont = rows[:, :context], rows[:, context:]
  attn = np.asarray(kvzip_evidence(model, ctx, template, options=kvzip))
  L, B, G, T = attn.shape
  keep = np.zeros((L, B, G, T), bool)
  for b in range(B):
    scores = np.concatenate([attn[:, b], np.zeros((L, G, tokens), np.float32)], -1)
    mask = policy.keep_mask(policies.Evidence(reconstruction_attn_LGT=jnp.asarray(scores)), budget)
    keep[:, b] = np.asarray(mask)[..., :T]
  return ctx, cont, keep


def _log_softmax(logits):
  return jax.nn.log_softmax(logits.astype(jnp.float32), -1)


def distillation_loss(
  cfg: ModelConfig, params: dict, adapter: Adapter | None, context_BT, continuation_BM, keep_LBGT
) -> Array:
  """The mean KL divergence of the compressed cache's next-token distributions from the full
  cache's, over the continuation tokens.

  The teacher reads the continuation after the full context (positions ``T ..``); the student
  after the kept context pairs and the restore tokens (positions ``T + N ..``, as at inference).
  Only the restore keys and values depend on the adapter.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter` (``None``: the kept context pairs alone, KVzip's cache).
    context_BT: context ids ``[B, T]`` (unpadded).
    continuation_BM: the text that follows ``[B, M]``.
    keep_LBGT: the context pairs the compressed cache keeps.

  Returns:
    The scalar loss (nats per continuation token).
  """
  pre = jax.lax.stop_gradient(llama.prefill(cfg, params, context_BT))
  B, M = continuation_BM.shape
  T = context_BT.shape[1]
  steps = jnp.arange(M, dtype=jnp.int32)[None]
  teacher, _ = cache_lib.extend(cfg, params, (held_segment(pre),), continuation_BM, T + steps)
  p_log = jax.lax.stop_gradient(_log_softmax(teacher))
  if adapter is None:
    student, _ = cache_lib.extend(
      cfg, params, (held_segment(pre, keep_LBGT),), continuation_BM, T + steps
    )
    return (jnp.exp(p_log) * (p_log - _log_softmax(student))).sum(-1).mean()
  N = adapter.tokens
  keys, values = restore_kv(cfg, params, adapter, pre)
  L, _, G = keys.shape[:3]
  restored = (
    keys,
    values,
    jnp.ones((L, B, G, N), bool),
    jnp.broadcast_to(T + jnp.arange(N, dtype=jnp.int32), (L, B, G, N)),
  )
  student, _ = cache_lib.extend(
    cfg, params, (held_segment(pre, keep_LBGT), restored), continuation_BM, T + N + steps
  )
  return (jnp.exp(p_log) * (p_log - _log_softmax(student))).sum(-1).mean()


def optimizer(lr: float = LR, clip: float = CLIP) -> optax.GradientTransformation:
  """Adam at a constant ``lr`` after clipping the gradients' global norm to ``clip``.

  Args:
    lr: the learning rate.
    clip: the largest global gradient norm.

  Returns:
    The optax transformation.
  """
  return optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr))


@dataclasses.dataclass(frozen=True)
class AdapterTraining:
  """:func:`train_adapter`'s result.

  Attributes:
    adapter: the trained :class:`Adapter`.
    history: one row per logged step: ``(step, train_loss, test_loss)``, the training loss of
      the step's batch before its update, the test loss after it (nan without test rows).
    initial_test_loss: the untrained adapter's test loss.
  """

  adapter: Adapter
  history: tuple[tuple[float, float, float], ...]
  initial_test_loss: float


_loss_jit = jax.jit(distillation_loss, static_argnums=0)


def mean_loss(cfg: ModelConfig, params: dict, adapter: Adapter | None, data, batch: int) -> float:
  """The mean :func:`distillation_loss` over examples, in batches weighted by their size.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter` (``None``: KVzip's kept pairs alone).
    data: ``(context_BT, continuation_BM, keep_LBGT)`` (:func:`training_data`), or ``None``.
    batch: examples per call.

  Returns:
    The mean loss (nan for ``data=None``).

  Raises:
    ValueError: for a ``batch`` that is not an int ``>= 1``.
  """
  if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
    raise ValueError(f"batch: expected an int >= 1 of examples per call, got {batch!r}")
  if data is None:
    return float("nan")
  ctx, cont, keep = data
  total = 0.0
  for i in range(0, len(ctx), batch):
    part = (ctx[i : i + batch], cont[i : i + batch], keep[:, i : i + batch])
    total += float(_loss_jit(cfg, params, adapter, *part)) * len(part[0])
  return total / len(ctx)


@dataclasses.dataclass(frozen=True)
class AdapterConfig(training.TrainConfig):
  """:func:`train_adapter`'s hyperparameters, each checked when made.

  Attributes:
    lr: Adam's learning rate.
    batch_size: examples per step.
    seed: the seed of the initialisation and the shuffles.
    tokens: restore tokens ``N``.
    rank: LoRA's rank.
    alpha: LoRA's ``alpha``.
    max_steps: optimiser steps.
    log_every: steps between log rows (the last step is logged too).
    checkpoint_every: steps between checkpoints.
  """

  lr: float = training.float_field(LR)
  batch_size: int = training.int_field(BATCH_SIZE)
  tokens: int = training.int_field(RESTORE_TOKENS)
  rank: int = training.int_field(RANK)
  alpha: float = training.float_field(ALPHA)
  max_steps: int = training.int_field(MAX_STEPS)
  log_every: int = training.int_field(10)
  checkpoint_every: int = training.int_field(50)


def _check_examples(name: str, data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  ctx, cont, keep = (np.asarray(a) for a in data)
  if ctx.ndim != 2 or cont.ndim != 2 or keep.shape[1:2] != ctx.shape[:1] or len(cont) != len(ctx):
    raise ValueError(
      f"{name}: expected (context [B, T], continuation [B, M], keep [L, B, G, T]), got shapes "
      f"{ctx.shape}, {cont.shape}, {keep.shape}"
    )
  return ctx, cont, keep


def train_adapter(
  model,
  train,
  config: AdapterConfig | None = None,
  *,
  test=None,
  checkpoint_dir: str | pathlib.Path | None = None,
  on_log: Callable[[tuple], None] | None = None,
  **options,
) -> AdapterTraining:
  """Trains RestoreKV's adapter by self-distillation (:func:`distillation_loss`), with
  :func:`kvjax.model.training.run`.

  The restore embeddings and LoRA's ``A`` and ``B`` are trained, the model frozen. Each step
  draws ``batch_size`` training examples; the examples are reshuffled whenever a pass over them
  starts (each pass's order depends only on ``seed`` and the pass). With a ``checkpoint_dir``
  the adapter, the optimiser state and the log are saved with orbax every
  ``checkpoint_every`` steps and at the end, and a later call with the same arguments resumes
  from the last checkpoint: the result equals an uninterrupted run's.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    train: ``(context_BT, continuation_BM, keep_LBGT)`` (:func:`training_data`).
    config: the hyperparameters (``None``: :class:`AdapterConfig`'s defaults).
    test: held-out examples of the same form, scored every ``log_every`` steps (``None``: no
      test loss).
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    on_log: called with each log row (after any checkpoint of that step); the default prints a
      progress line.
    **options: :class:`AdapterConfig` fields, over ``config`` (``max_steps=12``, ...).

  Returns:
    The :class:`AdapterTraining`.

  Raises:
    ValueError: for options that are not positive, fewer training examples than
      ``batch_size``, examples whose arrays disagree in shape, or a ``checkpoint_dir`` holding
      a run with other arguments.
  """
  cfg, params = model.cfg, model.params()
  c = AdapterConfig.make(config, **options)
  ctx, cont, keep = _check_examples("train", train)
  if len(ctx) < c.batch_size:
    raise ValueError(f"batch_size: {c.batch_size} is more than the {len(ctx)} training examples")
  adapter = init_adapter(cfg, params, tokens=c.tokens, rank=c.rank, alpha=c.alpha, seed=c.seed)
  opt = optimizer(c.lr)
  jitted = jax.jit(  # the model's parameters are an argument, not a closure (jit folds those)
    training.optax_step(lambda a, p, *batch: distillation_loss(cfg, p, a, *batch), opt)
  )

  def row(i, before, after, losses, batch):
    return (i, losses[-1][0], mean_loss(cfg, params, after, test, c.batch_size))

  loop = training.Loop(
    name="restorekv",
    units=c.max_steps,
    columns=("step", "train_loss", "test_loss"),
    batches=training.passes(len(ctx), c.batch_size, c.seed, sort=True),
    batch=lambda i, b: (ctx[b], cont[b], keep[:, b]),
    step=lambda a, st, *batch: jitted(a, st, params, *batch),
    row=row,
    log_every=c.log_every,
    log_last=True,
    checkpoint_every=c.checkpoint_every,
  )
  initial = mean_loss(cfg, params, adapter, test, c.batch_size)
  if on_log is None:

    def on_log(row):
      print(
        f"restorekv: [{int(row[0]):5d}/{c.max_steps}] KL {row[1]:.4f} (test {row[2]:.4f})",
        flush=True,
      )

  run = training.run(
    loop,
    adapter,
    opt.init(adapter),
    checkpoint_dir=checkpoint_dir,
    record={**c.record(), "data_shape": [list(a.shape) for a in (ctx, cont, keep)]},
    on_log=on_log,
  )
  return AdapterTraining(run.params, run.history, initial)


# --------------------------------------------------------------------------- the experiment


def restore_timings(c, model, adapter: Adapter, row, template) -> dict:
  """The restore pass (a prefill and the ``N`` tokens) against KVzip's reconstruction evidence.

  Args:
    c: the settings (``chunk_size``, ``n_sink``, ``plus``: KVzip's).
    model: the model (:class:`kvjax.model.llama.Llama`).
    adapter: the :class:`Adapter`.
    row: one context ``[T]``.
    template: KVzip's reconstruction prompt.

  Returns:
    ``{"tokens", "restore_pass_s", "kvzip_evidence_s"}``.
  """
  cfg, params = model.cfg, model.params()
  ids = jnp.asarray(row[None])
  restore = jax.jit(lambda p, a, x: restore_kv(cfg, p, a, llama.prefill(cfg, p, x)))
  _, t_restore = training.timed(lambda: restore(params, adapter, ids))
  _, t_kvzip = training.timed(
    lambda: kvzip_evidence(model, row, template, options=KVzipOptions.from_settings(c))
  )
  return {"tokens": int(row.size), "restore_pass_s": t_restore, "kvzip_evidence_s": t_kvzip}


def experiment(c, model, rows, template: KVzipTemplate, source: str):
  """RestoreKV's adapter of ``python -m experiments.restorekv`` (one process).

  Each row is a context of ``template.prefix_length + c.length`` tokens and the continuation
  after it; the first ``c.rows`` rows train, the others test. The self-distillation examples
  (:func:`training_data`: KVzip's kept pairs at ``c.ratio``, fixed once) are built part by part
  and saved (``data/*.npz``, :func:`kvjax.model.training.cached_parts`): the training and test
  examples with ``c.tokens`` restore tokens, and the test examples of KVzip alone over the whole
  budget (the baseline RestoreKV must beat at equal memory). The adapter trains with orbax
  checkpoints (``checkpoints/``, :func:`train_adapter`); ``restorekv_adapter.npz`` and
  ``results.json`` (the test KL of the untrained and the trained adapter and of KVzip alone,
  the loss curve, the time of the restore pass against KVzip's reconstruction) are written and
  summarised on stdout. Killed, the same call resumes.

  Args:
    c: the settings (``configs/restorekv.py``): ``workdir``, ``model``, ``dtype``, ``rows``,
      ``length``, ``continuation``, ``batch_rows``, ``ratio``, ``chunk_size``, ``n_sink``,
      ``plus``, ``prefix``, ``suffix`` and the :class:`AdapterConfig` fields.
    model: the model (:class:`kvjax.model.llama.Llama`).
    rows: the text rows ``[rows + test rows, header + length + continuation]``
      (:func:`kvjax.model.reconstruction.kvzip_corpus`).
    template: KVzip's reconstruction prompt.
    source: where the text comes from (kept in the files).

  Returns:
    The results (``results.json``).

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`), saved data or
      checkpoints of other settings, or bad :class:`AdapterConfig` fields.
  """
  cfg, params = model.cfg, model.params()
  workdir = rundir.check_workdir(c.workdir)
  config = AdapterConfig.from_settings(c)
  workdir.mkdir(parents=True, exist_ok=True)
  context = template.prefix_length + c.length
  names = ("model", "dtype", "rows", "length", "continuation", "batch_rows", "ratio", "tokens")
  names += ("chunk_size", "n_sink", "plus", "prefix", "suffix")
  identity = {k: getattr(c, k) for k in names} | {"rows_sum": int(np.sum(rows))}
  kvzip = KVzipOptions.from_settings(c)

  def examples(part_rows, tokens: int, name: str):
    """The self-distillation examples of ``part_rows``, part by part, each part saved."""

    def part(i):
      return training_data(
        model,
        part_rows[i : i + c.batch_rows],
        template,
        context=context,
        ratio=c.ratio,
        tokens=tokens,
        kvzip=kvzip,
      )

    names = {"context": 0, "continuation": 0, "keep": 1}
    data = training.cached_parts(
      workdir / "data", len(part_rows), c.batch_rows, part, names,
      prefix=name, identity=identity, label=f"{name}: rows",
    )  # fmt: skip
    return tuple(data[k] for k in names)

  train_rows, test_rows = rows[: c.rows], rows[c.rows :]
  t0 = time.perf_counter()
  train = examples(train_rows, c.tokens, "train")
  test = examples(test_rows, c.tokens, "test")
  baseline = examples(test_rows, 0, "kvzip")
  spent = {"data": round(time.perf_counter() - t0, 2)}
  print(f"examples: {len(train[0])} train, {len(test[0])} test; context {context} tokens")
  t0 = time.perf_counter()
  trained = train_adapter(model, train, config, test=test, checkpoint_dir=workdir / "checkpoints")
  spent["training"] = round(time.perf_counter() - t0, 2)
  results = {
    "model": c.model,
    "source": source,
    "context_tokens": context,
    "continuation_tokens": c.continuation,
    "ratio": c.ratio,
    "restore_tokens": c.tokens,
    "rank": c.rank,
    "trained_fraction": trained_fraction(trained.adapter, params),
    "test_kl_untrained": trained.initial_test_loss,
    "test_kl_trained": trained.history[-1][2],
    "test_kl_kvzip_alone": mean_loss(cfg, params, None, baseline, c.batch_size),
    "history": [list(r) for r in trained.history],
    "timing": restore_timings(c, model, trained.adapter, test_rows[0, :context], template),
    "seconds": spent,
  }
  meta = {k: getattr(c, k) for k in ("model", "rows", "ratio", "max_steps")}
  meta |= {"source": source, "context": context, "test_kl": results["test_kl_trained"]}
  save(
    workdir / "restorekv_adapter.npz",
    trained.adapter,
    meta,
    identity=checks.model_identity(cfg, params),
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  keys = ("test_kl_untrained", "test_kl_trained", "test_kl_kvzip_alone", "trained_fraction")
  print(json.dumps({k: results[k] for k in keys} | results["timing"]))
  print(f"run directory: {workdir.absolute()}")
  return results
