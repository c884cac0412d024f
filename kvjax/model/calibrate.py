"""Evidence that needs the model itself, as data the policies read (``kvjax.policies.Evidence``).

* :func:`qfilters` -> ``qfilters_LGD``: Q-Filters (Godey et al., 2025, arXiv 2503.02812), the
  official ``make_filters.py`` of ``NathanGodey/qfilters``;
* :func:`query_stats` -> ``stats_query_mean_LHD``, ``stats_query_cov_LHDD``: the query
  statistics of kvpress's ``ExpectedAttentionStatsPress``;
* :func:`duo_attention_pattern` -> ``retrieval_heads_LG``: DuoAttention's head gates
  (:mod:`kvjax.model.duo`);
* :func:`kvzip_evidence` -> ``reconstruction_attn_LGT`` and :func:`kvcompose_evidence` ->
  ``reconstruction_attn_LHT``: KVzip's and KVCompose's reconstruction attention
  (:mod:`kvjax.model.reconstruction`).

This module holds Q-Filters and the query statistics and re-exports the rest, so that
``calibrate.X`` reaches every calibration. Every pass is a plain layer loop (``lax.scan`` over
the stacked layers) built on the public functions of :mod:`kvjax.model.llama`, with dense
attention: calibration prompts are short. Softmax and scores are fp32. :func:`experiment` is
``python -m experiments.calibrate``'s run.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import distributed, rundir
from kvjax.model import llama, passes, training
from kvjax.model.config import ModelConfig
from kvjax.model.duo import (  # noqa: F401 (re-exported: calibrate.X reaches every calibration)
  DUO_METHODS,
  DUO_RECENT,
  DUO_SINK,
  DuoConfig,
  DuoTraining,
  duo_attention_pattern,
  duo_examples,
  duo_loss,
  duo_schedule,
  duo_sizes,
  duo_two_way,
  streaming_mask,
  train_duo_attention,
)
from kvjax.model.reconstruction import (  # noqa: F401 (re-exported, as above)
  DENSE_CONTEXT,
  KVZIP_FIRST,
  KVZIP_LATER,
  KVzipOptions,
  KVzipTemplate,
  kvcompose_evidence,
  kvzip_chunks,
  kvzip_corpus,
  kvzip_evidence,
  kvzip_template,
)

Array = jax.Array

# --------------------------------------------------------------------------- Q-Filters


def sampled_queries(cfg: ModelConfig, params: dict, ids_BT: Array, idx_LN: Array) -> Array:
  """Gathers post-RoPE queries at sampled ``(row, position)`` indices, a different draw per layer.

  The queries come from a dense causal forward of all rows at once (``[B, Hq, T, T]``
  probabilities per layer: calibration rows are short). :data:`sampled_queries_jit` is this
  function jitted with ``cfg`` static.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    ids_BT: calibration token ids ``[B, T]``.
    idx_LN: per layer, ``N`` indices into the flattened ``B * T`` positions (``row * T + t``).

  Returns:
    fp32 queries ``[L, Hq, N, D]``.
  """
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)

  def layer(x, inputs):
    p, idx = inputs
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    probs = llama.attention_probs(q, k, allowed)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v))
    flat = q.astype(jnp.float32).transpose(1, 0, 2, 3).reshape(cfg.num_heads, B * T, -1)
    return x, jnp.take(flat, idx, axis=1)

  _, q_LHND = jax.lax.scan(
    layer, llama.embed_tokens(cfg, params, ids_BT), (llama.stacked(params), idx_LN)
  )
  return q_LHND


sampled_queries_jit = jax.jit(sampled_queries, static_argnums=0)


def qfilter_directions(
  model,
  calibration_ids,
  *,
  num_svd_samples: int = 3000,
  seed: int = 0,
  across_processes: bool = False,
) -> Array:
  """Computes Q-Filters' direction per query head (unit vectors).

  As the official ``make_filters.py``: the post-RoPE queries of the calibration rows (every
  position, the first included), ``num_svd_samples`` of them drawn at random per layer
  (``argsort(rand)[:n]``, the same draw for every head of a layer; all when fewer), an SVD
  ``Q = U S V^T`` per head, and the filter ``-sign * V[:, 0]`` where ``sign`` is +1 when more than
  half of ``U[:, 0]`` is positive: most queries then project *negatively* on the filter, so that
  ``-<k, f>`` is large for the keys the queries favour. Differs: the model's own dtype (fp32 on
  CPU) instead of bf16 autocast, and numpy's generator for the draw.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    calibration_ids: calibration token ids ``[B, T]`` (or one row ``[T]``).
    num_svd_samples: queries drawn per layer for the SVD.
    seed: the seed of the draw.
    across_processes: in a run of several processes (``kvjax.distributed``), each process
      runs the forward of its share of the rows and the sampled queries are gathered (a
      collective: every process calls it with the same arguments); the same draw, the same
      directions as one process.

  Returns:
    fp32 directions ``[L, Hq, D]``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, or a
      ``num_svd_samples`` that is not an int ``>= 1``.
  """
  cfg, params = model.cfg, model.params()
  ids = passes.ids_2d("calibration_ids", calibration_ids, cfg)
  n = training.check_int("num_svd_samples", num_svd_samples)
  total = ids.size
  rng = np.random.default_rng(seed)
  idx_LN = np.stack([np.argsort(rng.random(total))[: min(n, total)] for _ in range(cfg.num_layers)])
  if across_processes and distributed.process_count() > 1:
    return _svd_filters(jnp.asarray(_shared_queries(cfg, params, ids, idx_LN)))
  q_LHND = sampled_queries_jit(cfg, params, jnp.asarray(ids), jnp.asarray(idx_LN, jnp.int32))
  return _svd_filters(q_LHND)


def _shared_queries(cfg: ModelConfig, params: dict, ids: np.ndarray, idx_LN: np.ndarray):
  """:func:`sampled_queries` of every row, each process running the forward of its share of
  the rows (:func:`kvjax.distributed.share`); the samples of the other rows are taken from
  their owners, so every process holds the whole ``[L, Hq, N, D]`` numpy array."""
  B, T = ids.shape
  mine = distributed.share(range(B))
  P = distributed.process_count()
  row_LN = idx_LN // T
  if mine:
    local = {r: j for j, r in enumerate(mine)}
    ours = (row_LN % P) == distributed.process_index()
    # an index into this process's rows; another process's samples read position 0 (dropped)
    local_idx = np.where(ours, np.vectorize(local.get)(np.where(ours, row_LN, mine[0])) * T, 0)
    local_idx = local_idx + np.where(ours, idx_LN % T, 0)
    q = sampled_queries_jit(cfg, params, jnp.asarray(ids[mine]), jnp.asarray(local_idx, jnp.int32))
    q = np.asarray(q)
  else:  # fewer rows than processes: nothing to run here
    q = np.zeros((cfg.num_layers, cfg.num_heads, idx_LN.shape[1], cfg.head_dim), np.float32)
  everyone = np.stack(distributed.gather_arrays(q, "gathering Q-Filters' sampled queries"))
  owner_LN = row_LN % P  # share's round robin: row r belongs to process r % P
  layers = np.arange(idx_LN.shape[0])[:, None]
  samples = np.arange(idx_LN.shape[1])[None, :]
  # [L, N, Hq, D] picked from each sample's owner, back to [L, Hq, N, D]
  picked = everyone.transpose(0, 1, 3, 2, 4)[owner_LN, layers, samples]
  return picked.transpose(0, 2, 1, 3)


@jax.jit
def _svd_filters(q_LHND: Array) -> Array:
  u, _, vh = jnp.linalg.svd(q_LHND, full_matrices=False)
  sign = jnp.where((u[..., 0] > 0).astype(jnp.float32).mean(-1) > 0.5, 1.0, -1.0)
  return -sign[..., None] * vh[..., 0, :]


def qfilters(model, calibration_ids, **options) -> Array:
  """Computes ``qfilters_LGD``: :func:`qfilter_directions` averaged over each KV head's GQA group.

  The query heads ``g * R .. g * R + R - 1`` are averaged, not renormalised, exactly as
  ``make_filters.py`` (``reshape(num_k_heads, -1, D).mean(-2)``); with one query head per KV
  head they stay unit vectors. The score is ``-<k, f>`` (kvpress's ``QFilterPress``).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    calibration_ids: calibration token ids ``[B, T]`` (or one row ``[T]``).
    **options: :func:`qfilter_directions`'s keywords (``num_svd_samples``, ``seed``,
      ``across_processes``), its defaults for those not given.

  Returns:
    fp32 filters ``[L, G, D]``.

  Raises:
    ValueError: as :func:`qfilter_directions`.
    TypeError: for an option :func:`qfilter_directions` does not take.
  """
  cfg = model.cfg
  dirs_LHD = qfilter_directions(model, calibration_ids, **options)
  L, _, D = dirs_LHD.shape
  return dirs_LHD.reshape(L, cfg.num_kv_heads, cfg.num_groups, D).mean(2)


def calibration_rows(tokenizer, text: str, num_rows: int, length: int) -> np.ndarray:
  """Cuts ``text`` into ``[num_rows, length]`` ids of consecutive stretches.

  Each row starts with ``bos`` when the tokenizer has one. Calibration text that ships offline:
  for example ``kvjax.eval.streaming.reference_text(6 * num_rows * length)`` (Python's pydoc
  topics; the official Q-Filters script reads 2048-token rows of fineweb).

  Args:
    tokenizer: a tokenizer with ``encode`` (and optionally ``bos_id``).
    text: the calibration text.
    num_rows: rows to return.
    length: tokens per row, ``bos`` included.

  Returns:
    int32 ids ``[num_rows, length]``.

  Raises:
    ValueError: for a ``num_rows`` or ``length`` that is not an int ``>= 1``, or a text that
      gives too few tokens.
  """
  rows, length = training.check_int("num_rows", num_rows), training.check_int("length", length)
  bos = getattr(tokenizer, "bos_id", None)
  body = length - (bos is not None)
  ids = tokenizer.encode(text)
  if len(ids) < rows * body:
    raise ValueError(f"text: gives {len(ids)} tokens, fewer than {rows * body} ({rows} rows)")
  out = np.asarray(ids[: rows * body], np.int32).reshape(rows, body)
  if bos is not None:
    out = np.concatenate([np.full((rows, 1), bos, np.int32), out], 1)
  return out


# --------------------------------------------------------------------------- query statistics


def _query_moments(cfg: ModelConfig, params: dict, ids_BT: Array, n_sink: int):
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)

  def layer(x, p):
    q_pre, _, _ = llama.project_heads(cfg, p, x)
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(llama.attention_probs(q, k, allowed), v))
    # every row's queries after its first n_sink, pooled: [Hq, B * (T - n_sink), D]
    flat = q_pre[:, :, n_sink:].astype(jnp.float32).transpose(1, 0, 2, 3)
    flat = flat.reshape(cfg.num_heads, -1, cfg.head_dim)
    return x, flat.sum(1)

  _, sums = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return sums


def _query_scatter(cfg: ModelConfig, params: dict, ids_BT: Array, mean_LHD: Array, n_sink: int):
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)

  def layer(x, inputs):
    p, mean = inputs
    q_pre, _, _ = llama.project_heads(cfg, p, x)
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(llama.attention_probs(q, k, allowed), v))
    flat = q_pre[:, :, n_sink:].astype(jnp.float32).transpose(1, 0, 2, 3)
    c = flat.reshape(cfg.num_heads, -1, cfg.head_dim) - mean[:, None]
    return x, jnp.einsum("hnd,hne->hde", c, c, precision=jax.lax.Precision.HIGHEST)

  _, scatter = jax.lax.scan(
    layer, llama.embed_tokens(cfg, params, ids_BT), (llama.stacked(params), mean_LHD)
  )
  return scatter


_query_moments_jit = jax.jit(_query_moments, static_argnums=(0, 3))
_query_scatter_jit = jax.jit(_query_scatter, static_argnums=(0, 4))


def query_stats(
  model,
  ids_BT,
  *,
  n_sink: int = 4,
  batch: int = 4,
  across_processes: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """Measures ExpectedAttention's query statistics on calibration rows.

  kvpress 0.5.5 ``presses/expected_attention_with_stats.py::collect_queries``: the pre-RoPE
  queries (after Qwen3's q-norm) of every row's positions from ``n_sink`` on, pooled over the
  rows; their mean and covariance (divided by ``N - 1``) per layer and query head. Two passes
  (the mean, then the centred scatter) over ``batch`` rows at a time keep memory at one batch's
  activations.

  Differences from kvpress: rows of equal token length (:func:`calibration_rows`; kvpress cuts
  each text to 1,000 characters, so its rows differ in length).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    ids_BT: calibration token ids ``[B, T]`` (:func:`calibration_rows`).
    n_sink: the first positions of each row left out (kvpress ``n_sink``, 4).
    batch: rows per forward.
    across_processes: in a run of several processes (``kvjax.distributed``), each process
      runs its share of the batches and the per-batch sums are gathered and added in the
      one-process order (a collective: every process calls it with the same arguments); the
      statistics are bit for bit a one-process run's.

  Returns:
    ``(mean [L, Hq, D], cov [L, Hq, D, D])`` float32 numpy arrays: the
    ``stats_query_mean_LHD`` / ``stats_query_cov_LHDD`` evidence of
    :class:`~kvjax.policies.ExpectedAttentionStats`.

  Raises:
    ValueError: for ids that are not ``[B, T]`` ints in the vocabulary, an ``n_sink`` that
      leaves fewer than 2 queries, or a ``batch`` that is not an int ``>= 1``.
  """
  cfg, params = model.cfg, model.params()
  ids = passes.ids_2d("ids_BT", ids_BT, cfg)
  B, T = ids.shape
  n_sink = training.check_int("n_sink", n_sink, 0)
  batch = training.check_int("batch", batch)
  N = B * (T - n_sink)
  if N < 2:
    raise ValueError(
      f"n_sink: {n_sink} leaves {N} queries of {B} rows of {T} tokens; expected at least 2"
    )
  chunks = [jnp.asarray(ids[i : i + batch]) for i in range(0, B, batch)]
  if across_processes and distributed.process_count() > 1:
    mine = distributed.share(chunks)
    # each batch's sum gathered as computed, then added in the one-process order
    sums = distributed.gather_shares(
      [np.asarray(_query_moments_jit(cfg, params, chunks[i], n_sink)) for i in mine],
      len(chunks),
      "gathering the query sums",
    )
    mean = (sum(np.asarray(v, np.float64) for v in sums) / N).astype(np.float32)
    scatters = distributed.gather_shares(
      [
        np.asarray(_query_scatter_jit(cfg, params, chunks[i], jnp.asarray(mean), n_sink))
        for i in mine
      ],
      len(chunks),
      "gathering the query scatter",
    )
    scatter = sum(np.asarray(v, np.float64) for v in scatters)
    return mean, (scatter / (N - 1)).astype(np.float32)
  total = sum(np.asarray(_query_moments_jit(cfg, params, c, n_sink), np.float64) for c in chunks)
  mean = (total / N).astype(np.float32)
  scatter = sum(
    np.asarray(_query_scatter_jit(cfg, params, c, jnp.asarray(mean), n_sink), np.float64)
    for c in chunks
  )
  return mean, (scatter / (N - 1)).astype(np.float32)


# --------------------------------------------------------------------------- the experiment


def _timed(timings: dict, name: str, fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  timings[name] = round(time.perf_counter() - t0, 2)
  print(f"{name}: {timings[name]} s")
  return out


def experiment(c, model, texts, examples, context, template) -> dict:
  """The model-made evidence of ``python -m experiments.calibrate``: every process calls it
  with the same arguments, process 0 writes the files.

  Q-Filters' directions (:func:`qfilters`) and the query statistics (:func:`query_stats`) of
  ``texts(qfilter_rows, qfilter_length)``, their rows shared among the processes;
  DuoAttention's gates by each of ``duo_methods`` (:func:`duo_attention_pattern`; the official
  training data-parallel, the proxies on process 0); KVzip's reconstruction attention of
  ``context`` (:func:`kvzip_evidence`, process 0). Process 0 writes ``calibration.npz`` and
  ``timings.json`` into ``workdir`` and prints the gates' summary and the run directory.

  Args:
    c: the settings (``configs/calibrate.py``).
    model: the model (:class:`kvjax.model.llama.Llama`).
    texts: ``(rows, length) -> [rows, length]`` token ids of calibration text.
    examples: DuoAttention's ``(ids_T, label_mask_T)`` pairs (:func:`duo_examples`).
    context: KVzip's context ids ``[T]``.
    template: KVzip's reconstruction prompt.

  Returns:
    The evidence (``calibration.npz``'s arrays) on process 0, ``None`` on the others.

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`).
  """
  workdir = rundir.check_workdir(c.workdir)  # "" would be the current directory: refused
  primary = distributed.is_primary()
  if primary:
    workdir.mkdir(parents=True, exist_ok=True)
  out, timings = {}, {}
  rows = texts(c.qfilter_rows, c.qfilter_length)
  out["qfilters_LGD"] = _timed(
    timings,
    "qfilters",
    lambda: qfilters(
      model, rows, num_svd_samples=c.num_svd_samples, seed=c.seed, across_processes=True
    ),
  )
  # ExpectedAttentionStats: the query moments of the same rows (kvpress: 100 BookSum chapters)
  out["stats_query_mean_LHD"], out["stats_query_cov_LHDD"] = _timed(
    timings,
    "query_stats",
    lambda: query_stats(model, rows, n_sink=c.stats_n_sink, across_processes=True),
  )
  for method in c.duo_methods:
    if method != "official" and not primary:  # the proxies are one cheap pass: process 0's
      continue
    t0 = time.perf_counter()
    if method == "official":
      config = DuoConfig(
        num_steps=c.duo_steps, lr=c.duo_lr, reg_weight=c.duo_reg_weight, batch_size=c.duo_batch
      )
      trained = train_duo_attention(model, examples, config, across_processes=True)
      gates = trained.alpha_LG
      out["duo_loss"], out["duo_distill"] = trained.loss, trained.distill
      out["duo_sink_recent"] = (trained.sink_size, trained.recent_size)
    elif method == "kvpress_on_the_fly":
      ids = texts(c.duo_otf_rows, c.qfilter_length)
      gates = duo_attention_pattern(model, method=method, calibration_ids=ids)
    else:
      gates = duo_attention_pattern(model, examples, method=method)
    out[f"retrieval_heads_LG_{method}"] = gates
    timings[f"duo_{method}"] = round(time.perf_counter() - t0, 2)
    print(f"duo_{method}: {timings[f'duo_{method}']} s")
  if not primary:  # KVzip's evidence is one context: process 0 computes it and writes
    return None
  out["kvzip_context_T"] = context
  out["reconstruction_attn_LGT"] = _timed(
    timings,
    "kvzip",
    lambda: kvzip_evidence(
      model, context, template, options=KVzipOptions(chunk_size=c.kvzip_chunk_size)
    ),
  )
  np.savez(workdir / "calibration.npz", **{k: np.asarray(v) for k, v in out.items()})
  facts = {"model": c.model, "timings_s": timings, "backend": jax.default_backend()}
  facts["processes"] = distributed.process_count()
  (workdir / "timings.json").write_text(json.dumps(facts))
  for key in sorted(k for k in out if k.startswith("retrieval_heads_LG_")):
    gates = np.asarray(out[key])
    print(
      f"{key}: {int((gates > 0.5).sum())} of {gates.size} heads above 0.5, mean {gates.mean():.3f}"
    )
  print(f"run directory: {workdir.absolute()}")
  return out
