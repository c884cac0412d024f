"""Evidence that needs the model itself: Q-Filters' directions, DuoAttention's head gates and
KVzip's and KVCompose's reconstruction attention, as data the policies read
(``kvjax.policies.Evidence``).

* :func:`qfilters` -> ``qfilters_LGD``: Q-Filters (Godey et al., 2025, arXiv 2503.02812), the
  official ``make_filters.py`` of ``NathanGodey/qfilters``.
* :func:`duo_attention_pattern` -> ``retrieval_heads_LG``: DuoAttention (Xiao et al., 2024, arXiv
  2410.10819), the official optimisation of ``mit-han-lab/duo-attention`` (``duo_attn/train.py``,
  ``duo_attn/patch/llama.py``, ``duo_attn/data.py``) in a small form, and two cheap proxies:
  kvpress 0.5.5's ``duo_attention_on_the_fly`` and each head's distant attention mass.
* :func:`kvzip_evidence` -> ``reconstruction_attn_LGT``: KVzip (Kim et al., 2025, arXiv
  2505.23416) as kvpress 0.5.5's ``KVzipPress`` computes it.
* :func:`kvcompose_evidence` -> ``reconstruction_attn_LHT``: KVCompose (arXiv 2509.05165) as
  kvpress 0.5.5's ``KVComposePress`` computes it (the context read again after itself).

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
from kvjax.model import llama
from kvjax.model.config import ModelConfig
from kvjax.scores import PRECISION

Array = jax.Array

# --------------------------------------------------------------------------- checks


def _check_int(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
  return int(value)


def _check_positive(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f"{name}: expected a positive number, got {value!r}")
  return float(value)


def _ids_2d(name: str, ids, cfg: ModelConfig) -> np.ndarray:
  """``ids`` as ``[B, T]`` int32 token ids (a 1-D row becomes one row), checked."""
  arr = np.asarray(ids)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or arr.shape[1] == 0:
    raise ValueError(f"{name}: expected token ids [B, T] or [T], got shape {arr.shape}")
  return llama.check_token_ids(name, arr, cfg.vocab_size)


def _rows(name: str, ids, cfg: ModelConfig) -> list[np.ndarray]:
  """A sequence of 1-D id rows (different lengths allowed) or a ``[B, T]`` array, checked."""
  if isinstance(ids, (list, tuple)) and ids and np.ndim(ids[0]) == 1:
    return [_ids_2d(f"{name}[{i}]", r, cfg)[0] for i, r in enumerate(ids)]
  return list(_ids_2d(name, ids, cfg))


# --------------------------------------------------------------------------- shared layer loop


def _positions(B: int, T: int, start: int = 0) -> Array:
  return jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))


def _causal_allowed(cfg: ModelConfig, B: int, T: int) -> Array:
  """``[B, T, T]`` causal mask of an unpadded prompt (with the model's sliding window)."""
  pos = _positions(B, T)
  return llama.causal_allowed(pos, pos, jnp.ones((B, T), bool), pos, pos, cfg.sliding_window)


def _pre_rope(cfg: ModelConfig, p: dict, h_BTd: Array):
  """Pre-RoPE queries ``[B, Hq, T, D]`` and keys ``[B, G, T, D]`` of normed hidden states
  (q/k bias and Qwen3's q/k norm included): kvpress's ``get_prerope_query_states``."""
  B, T, _ = h_BTd.shape
  q, k = llama.matmul(h_BTd, p["wq"]), llama.matmul(h_BTd, p["wk"])
  if cfg.qkv_bias:
    q, k = q + llama.along_last(p["bq"], 3), k + llama.along_last(p["bk"], 3)
  q = q.reshape(B, T, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
  k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
  if cfg.qk_norm:
    q = llama.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = llama.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  return q, k


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
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)

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
  cfg: ModelConfig,
  params: dict,
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
    cfg: the model's config.
    params: the parameter pytree.
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
  ids = _ids_2d("calibration_ids", calibration_ids, cfg)
  n = _check_int("num_svd_samples", num_svd_samples)
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


def qfilters(
  cfg: ModelConfig,
  params: dict,
  calibration_ids,
  *,
  num_svd_samples: int = 3000,
  seed: int = 0,
  across_processes: bool = False,
) -> Array:
  """Computes ``qfilters_LGD``: :func:`qfilter_directions` averaged over each KV head's GQA group.

  The query heads ``g * R .. g * R + R - 1`` are averaged, not renormalised, exactly as
  ``make_filters.py`` (``reshape(num_k_heads, -1, D).mean(-2)``); with one query head per KV
  head they stay unit vectors. The score is ``-<k, f>`` (kvpress's ``QFilterPress``).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    calibration_ids: calibration token ids ``[B, T]`` (or one row ``[T]``).
    num_svd_samples: queries drawn per layer for the SVD.
    seed: the seed of the draw.
    across_processes: split the rows over the processes (:func:`qfilter_directions`).

  Returns:
    fp32 filters ``[L, G, D]``.

  Raises:
    ValueError: as :func:`qfilter_directions`.
  """
  dirs_LHD = qfilter_directions(
    cfg,
    params,
    calibration_ids,
    num_svd_samples=num_svd_samples,
    seed=seed,
    across_processes=across_processes,
  )
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
  rows, length = _check_int("num_rows", num_rows), _check_int("length", length)
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
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)

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
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)

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
  cfg: ModelConfig,
  params: dict,
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
    cfg: the model's config.
    params: the parameter pytree.
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
  ids = _ids_2d("ids_BT", ids_BT, cfg)
  B, T = ids.shape
  n_sink = _check_int("n_sink", n_sink, 0)
  batch = _check_int("batch", batch)
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
  pos = _positions(B, T)
  causal = _causal_allowed(cfg, B, T)
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
    ids = _ids_2d(f"examples[{i}] ids", ex[0], cfg)
    labels = np.asarray(ex[1]).astype(bool).reshape(1, -1)
    if ids.shape[0] != 1 or labels.shape != ids.shape or not labels.any():
      raise ValueError(
        f"examples[{i}]: expected 1-D ids and a label mask of the same length with at least one "
        f"label, got shapes {np.shape(ex[0])} and {np.shape(ex[1])}"
      )
    out.append((ids, labels))
  return out


def train_duo_attention(
  cfg: ModelConfig,
  params: dict,
  examples,
  *,
  num_steps: int = 8,
  lr: float = 0.02,
  reg_weight: float = 0.05,
  initial_value: float = 1.0,
  sizes: tuple[int | None, int | None] = (None, None),
  batch_size: int = 1,
  across_processes: bool = False,
) -> DuoTraining:
  """Trains DuoAttention's gate per KV head, as ``duo_attn/train.py``.

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
    cfg: the model's config.
    params: the parameter pytree.
    examples: ``(ids_T, label_mask_T)`` pairs (:func:`duo_examples`); the label mask marks the
      question-and-answer tokens, where the hidden states are distilled.
    num_steps: optimisation steps.
    lr: the peak learning rate.
    reg_weight: the weight of the gate penalty.
    initial_value: the gates' starting value.
    sizes: the streaming pattern's ``(sink_size, recent_size)``, each ``None`` for
      :func:`duo_sizes` of the shortest example.
    batch_size: examples per step (the official: 1).
    across_processes: in a run of several processes (``kvjax.distributed``), data-parallel: each
      step's batch is placed on :func:`kvjax.distributed.process_mesh`, each process holding
      its share of the examples (round robin, padded with examples of weight 0), and the
      jitted step reduces the loss and the gradients across the processes; every process
      calls it with the same arguments and gets the same gates. The gates equal a one-process
      run's with the same ``batch_size`` up to the order of the sums.

  Returns:
    A :class:`DuoTraining` with the gates ``alpha_LG``, the loss history and the sizes used.

  Raises:
    ValueError: for malformed ``examples`` (ids breaking
      :func:`kvjax.model.llama.check_token_ids`'s rule, a label mask of another length or with
      no label), a ``num_steps`` that is not an int ``>= 1``, a non-positive ``lr``, a negative
      ``reg_weight`` or malformed ``sizes``.
  """
  data = _examples(examples, cfg)
  steps = _check_int("num_steps", num_steps)
  lr, reg_weight = _check_positive("lr", lr), float(reg_weight)
  if reg_weight < 0:
    raise ValueError(f"reg_weight: expected a number >= 0, got {reg_weight}")
  batch = _check_int("batch_size", batch_size)
  sink, recent = _sizes(sizes, min(ids.shape[1] for ids, _ in data))
  schedule = duo_schedule(lr, steps)
  alpha = jnp.full((cfg.num_layers, cfg.num_kv_heads), float(initial_value), jnp.float32)
  across = bool(across_processes) and distributed.process_count() > 1
  if batch > 1 or across:
    alpha, h = _train_duo_batched(
      cfg, params, data, alpha, steps, batch, (sink, recent), schedule, reg_weight, across
    )
    return DuoTraining(
      alpha_LG=np.clip(alpha, 0.0, 1.0),
      loss=h[:, 0],
      distill=h[:, 1],
      reg=h[:, 2],
      sink_size=sink,
      recent_size=recent,
    )
  state = _ADAM.init(alpha)
  masks = {}
  hist = []
  for s in range(steps):
    ids, labels = data[s % len(data)]
    T = ids.shape[1]
    if T not in masks:
      masks[T] = jnp.asarray(streaming_mask(T, sink, recent))
    alpha, state, aux = _duo_step(
      cfg, params, alpha, state, ids, labels, masks[T], reg_weight, schedule(s)
    )
    hist.append([float(a) for a in aux])
  h = np.asarray(hist, np.float32)
  return DuoTraining(
    alpha_LG=np.clip(np.asarray(alpha), 0.0, 1.0),
    loss=h[:, 0],
    distill=h[:, 1],
    reg=h[:, 2],
    sink_size=sink,
    recent_size=recent,
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


def _train_duo_batched(cfg, params, data, alpha, steps, batch, sizes, schedule, reg_weight, across):
  """:func:`train_duo_attention`'s loop for ``batch`` examples a step, data-parallel over the
  processes when ``across``: ``(alpha [L, G] numpy, history [steps, 3])``."""
  P = distributed.process_count() if across else 1
  rows = -(-batch // P) * P  # padded so that every process holds as many rows
  per = rows // P
  if across:
    mesh = distributed.process_mesh("batch")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    params = distributed.put(params, rep)
    state = distributed.put(jax.tree.map(np.asarray, _ADAM.init(alpha)), rep)
    alpha = distributed.put(np.asarray(alpha), rep)
    step = jax.jit(functools.partial(_duo_batch_step, cfg), out_shardings=(rep, rep, rep))
  else:
    rep = split = None
    state = _ADAM.init(alpha)
    step = jax.jit(functools.partial(_duo_batch_step, cfg))
  masks, hist = {}, []
  for s in range(steps):
    picks = [data[(s * batch + i) % len(data)] for i in range(batch)]
    T = max(ids.shape[1] for ids, _ in picks)
    ids_BT = np.zeros((rows, T), np.int32)
    labels_BT = np.zeros((rows, T), bool)
    weights_B = np.zeros(rows, np.float32)
    for i, (ids, labels) in enumerate(picks):
      r = (i % P) * per + i // P  # round robin: example i on process i % P
      ids_BT[r, : ids.shape[1]], labels_BT[r, : ids.shape[1]], weights_B[r] = ids[0], labels[0], 1
    if T not in masks:
      masks[T] = distributed.put(streaming_mask(T, *sizes), rep)
    alpha, state, aux = step(
      params,
      alpha,
      state,
      *distributed.put((ids_BT, labels_BT, weights_B), split),
      masks[T],
      distributed.put(np.float32(reg_weight), rep),
      distributed.put(np.asarray(schedule(s), np.float32), rep),
    )
    hist.append(distributed.to_host(aux, "gathering the DuoAttention loss").tolist())
  alpha = distributed.to_host(alpha, "gathering the DuoAttention gates")
  return np.asarray(alpha, np.float32), np.asarray(hist, np.float32)


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
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)
  R = cfg.num_groups
  rot = jnp.arange(q_len, dtype=jnp.int32)

  def layer(x, p):
    h = llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q_mean, k_mean = (t.mean(2, keepdims=True) for t in _pre_rope(cfg, p, h))
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
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)
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
  if not isinstance(sizes, tuple | list) or len(sizes) != 2:
    raise ValueError(f"sizes: expected (sink_size, recent_size), got {sizes!r}")
  default = duo_sizes(T)
  names = ("sink_size", "recent_size")
  return tuple(
    d if v is None else _check_int(n, v) for n, v, d in zip(names, sizes, default, strict=True)
  )


def duo_attention_pattern(
  cfg: ModelConfig,
  params: dict,
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
    cfg: the model's config.
    params: the parameter pytree.
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
  if method not in DUO_METHODS:
    raise ValueError(f"method: expected one of {DUO_METHODS}, got {method!r}")
  if method == "official":
    return train_duo_attention(cfg, params, examples, sizes=sizes, **train_options).alpha_LG
  if train_options:
    raise ValueError(f"{sorted(train_options)[0]}: only method='official' trains")
  if method == "kvpress_on_the_fly":
    if calibration_ids is None:
      raise ValueError("calibration_ids: method='kvpress_on_the_fly' needs calibration text ids")
    rows = _rows("calibration_ids", calibration_ids, cfg)
    q_len = _check_int("q_len", q_len)
    total = sum(np.asarray(_on_the_fly_jit(cfg, params, jnp.asarray(r[None]), q_len)) for r in rows)
    return (total / len(rows)).astype(np.float32)
  data = _examples(examples, cfg)
  total = 0.0
  for ids, labels in data:
    sink, recent = _sizes(sizes, ids.shape[1])
    stream = jnp.asarray(streaming_mask(ids.shape[1], sink, recent))
    total = total + np.asarray(_distant_mass_jit(cfg, params, ids, labels, stream))
  return (total / len(data)).astype(np.float32)


# --------------------------------------------------------------------------- KVzip

DENSE_CONTEXT = 4096  # longer contexts are prefilled by llama.prefill (no [T, T] matrix)
KVZIP_FIRST = "\n\nRepeat the previous context exactly."
KVZIP_LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True)
class KVzipTemplate:
  """KVzip's reconstruction prompt in token ids (kvpress's ``KVzipPress.prepare``).

  ``first_ids``: "\\n\\nRepeat the previous context exactly." (the first chunk);
  ``later_ids``: "\\n\\nRepeat the part of the previous context exactly, starting with" (later
  chunks, followed by the previous chunk's last 8 tokens); ``suffix_ids``: the chat template's
  text after the user turn (its assistant header), or "\\n" without a chat template;
  ``prefix_length``: how many context tokens come before the user content (the chat template's
  header, 0 without one): they are not reconstructed and keep score 0.
  """

  first_ids: tuple[int, ...]
  later_ids: tuple[int, ...]
  suffix_ids: tuple[int, ...]
  prefix_length: int = 0


def kvzip_template(tokenizer, *, prefix_text: str = "", suffix_text: str = "\n") -> KVzipTemplate:
  """Builds a :class:`KVzipTemplate` from a tokenizer.

  The texts are encoded without special tokens, as kvpress's ``add_special_tokens=False``.
  kvpress splits the model's chat template around a dummy user turn into ``prefix_text`` and
  ``suffix_text``; kvjax's tokenizers carry no chat template, so pass them (defaults: kvpress's
  choice for models without one).

  Args:
    tokenizer: a tokenizer with ``encode``.
    prefix_text: the chat template's text before the user content (its length becomes
      ``prefix_length``).
    suffix_text: the chat template's text after the user turn.

  Returns:
    The template in token ids.
  """
  enc = tokenizer.encode
  return KVzipTemplate(
    first_ids=tuple(enc(KVZIP_FIRST)),
    later_ids=tuple(enc(KVZIP_LATER)),
    suffix_ids=tuple(enc(suffix_text)),
    prefix_length=len(enc(prefix_text)) if prefix_text else 0,
  )


def kvzip_chunks(
  context_BT: np.ndarray, template: KVzipTemplate, chunk_size: int, prev_postfix_size: int = 8
) -> list[tuple[int, int, np.ndarray]]:
  """Cuts the context into KVzip's reconstruction chunks (``KVzipPress.prepare`` and ``_chunk_fn``).

  The context after the template's prefix is cut into ``chunk_size`` pieces, each asked back as
  ``prompt + suffix + chunk``.

  Args:
    context_BT: the context ids ``[B, T]``.
    template: the reconstruction prompt (:func:`kvzip_template`).
    chunk_size: context tokens per chunk.
    prev_postfix_size: the previous chunk's last tokens that follow the later chunks' prompt.

  Returns:
    A list of ``(start, end, repeat_ids_BQ)``, one per chunk, the ids int32.
  """
  B, T = context_BT.shape
  out, start, prev = [], template.prefix_length, None
  while start < T:
    end = min(start + chunk_size, T)
    chunk = context_BT[:, start:end]
    if prev is None:
      q = np.broadcast_to(np.asarray(template.first_ids, np.int32), (B, len(template.first_ids)))
    else:
      later = np.broadcast_to(
        np.asarray(template.later_ids, np.int32), (B, len(template.later_ids))
      )
      q = np.concatenate([later, prev[:, -prev_postfix_size:]], 1)
    suffix = np.broadcast_to(
      np.asarray(template.suffix_ids, np.int32), (B, len(template.suffix_ids))
    )
    out.append((start, end, np.concatenate([q, suffix, chunk], 1).astype(np.int32)))
    prev, start = chunk, end
  return out


def _wov_norms(cfg: ModelConfig, p: dict, v_BGSD: Array) -> Array:
  """``||W_O^h v||_2`` per query head ``[B, Hq, S]`` (KVzip+'s ``_compute_value_output_norm``)."""
  G, R, D = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  wo = p["wo"].astype(jnp.float32).reshape(G, R, D, -1)
  out = jnp.einsum("grdj,bgsd->bgrsj", wo, v_BGSD.astype(jnp.float32), precision=PRECISION)
  B, S = v_BGSD.shape[0], v_BGSD.shape[2]
  return jnp.linalg.norm(out, axis=-1).reshape(B, G * R, S)


def _reconstruct(cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ, start, n, sink, plus):
  """One reconstruction pass over the cached context: the repeat tokens at positions
  ``T .. T+Q-1`` attend to the whole context and causally to themselves (the model's forward);
  beside it, KVzip's score of the chunk ``[start, start + n)`` per layer ``[L, B, G, n]``
  (``start`` traced, so that equal chunks share one compile; ``sink = min(n_sink, start)``)."""
  B, Q = repeat_BQ.shape
  T = keys_LBGTD.shape[3]
  pos_q = _positions(B, Q, T)
  pos_k = _positions(B, T + Q)
  allowed = llama.causal_allowed(
    pos_q, pos_k, jnp.ones((B, T + Q), bool), pos_q, pos_k, cfg.sliding_window
  )
  tri = jnp.tril(jnp.ones((Q, Q), bool))
  sub_allowed = jnp.broadcast_to(
    jnp.concatenate([jnp.ones((Q, sink + n), bool), tri], 1), (B, Q, sink + n + Q)
  )

  def layer(x, inputs):
    p, k_ctx, v_ctx = inputs
    q, k, v = llama.project_qkv(cfg, p, x, pos_q)
    k_all = jnp.concatenate([k_ctx, k.astype(k_ctx.dtype)], 2)
    v_all = jnp.concatenate([v_ctx, v.astype(v_ctx.dtype)], 2)
    probs = llama.attention_probs(q, k_all, allowed)

    def pick(t, new):  # the scored keys (or values): sinks, the chunk, the repeat tokens
      chunk = jax.lax.dynamic_slice_in_dim(t, start, n, 2)
      return jnp.concatenate([t[:, :, :sink], chunk, new.astype(t.dtype)], 2)

    attn = llama.attention_probs(q, pick(k_ctx, k), sub_allowed)  # [B, Hq, Q, S]
    if plus:
      h = llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps).astype(jnp.float32)
      attn = attn / jnp.linalg.norm(h, axis=-1)[:, None, :, None]
      attn = attn * _wov_norms(cfg, p, pick(v_ctx, v))[:, :, None, :]
    score = attn[..., sink : sink + n].max(2)  # max over the repeat queries
    score = score.reshape(B, cfg.num_kv_heads, cfg.num_groups, n).max(2)  # and the group
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v_all))
    return x, score

  stacks = (llama.stacked(params), keys_LBGTD, values_LBGTD)
  _, scores = jax.lax.scan(layer, llama.embed_tokens(cfg, params, repeat_BQ), stacks)
  return scores


def _context_kv(cfg: ModelConfig, params: dict, ids_BT: Array):
  """The context pass: post-RoPE keys and values ``[L, B, G, T, D]`` of a dense causal forward
  (what ``KVzipPress`` finds in the cache after the model's own prefill)."""
  B, T = ids_BT.shape
  pos = _positions(B, T)
  allowed = _causal_allowed(cfg, B, T)

  def layer(x, p):
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(llama.attention_probs(q, k, allowed), v))
    return x, (k, v)

  _, (k, v) = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return k, v


_context_kv_jit = jax.jit(_context_kv, static_argnums=0)
_reconstruct_jit = jax.jit(_reconstruct, static_argnums=(0, 6, 7, 8))


def kvzip_evidence(
  cfg: ModelConfig,
  params: dict,
  context_ids,
  template: KVzipTemplate,
  *,
  chunk_size: int = 2048,
  n_sink: int = 4,
  plus: bool = False,
) -> Array:
  """Computes KVzip's ``reconstruction_attn_LGT`` of a context, as kvpress 0.5.5's ``KVzipPress``.

  The context is prefilled once (a dense causal pass); then, chunk by chunk
  (:func:`kvzip_chunks`, ``chunk_size`` 2048), the model reads ``prompt + suffix + chunk`` after
  the cached context (positions ``T ..``, the cache put back to the context after each chunk).
  At every layer the repeat queries (post-RoPE) take a softmax over a *subsample* of keys: the
  first ``min(n_sink, start)`` context tokens, the chunk being reconstructed and the repeat
  tokens themselves (causal among them); the score of each chunk key is the maximum of that
  attention over the repeat queries and the GQA group. ``plus`` is KVzip+'s normalisation (rows
  divided by the norm of the attention input, columns times ``||W_O^h v||``). Tokens before
  ``template.prefix_length`` are never reconstructed and stay 0; the policy's sink protection
  (kvpress: the first ``n_sink`` scores set to the maximum + 1) belongs to the scorer. The
  prefill costs about twice a plain one (the context plus its repetition).
  Differs: batches of several unpadded rows (kvpress: batch 1); the model's sliding window is
  applied to the forward pass (the score ignores it, as kvpress).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    template: the reconstruction prompt (:func:`kvzip_template`).
    chunk_size: context tokens per reconstruction chunk.
    n_sink: the first context tokens every repeat query also attends to.
    plus: whether to apply KVzip+'s normalisation.

  Returns:
    fp32 scores ``[L, G, T]`` for a context ``[T]``, ``[L, B, G, T]`` for a batch.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule (in the
      context or the template), a ``chunk_size`` below 1, a negative ``n_sink``, a ``template``
      that is not a :class:`KVzipTemplate`, or a ``prefix_length`` that leaves nothing to
      reconstruct.
  """
  ids = _ids_2d("context_ids", context_ids, cfg)
  single = np.ndim(context_ids) == 1
  chunk_size = _check_int("chunk_size", chunk_size)
  n_sink = _check_int("n_sink", n_sink, 0)
  if not isinstance(template, KVzipTemplate):
    raise ValueError(f"template: expected a KVzipTemplate, got {type(template).__name__}")
  for name in ("first_ids", "later_ids", "suffix_ids"):  # one row, possibly empty
    ids_1T = np.asarray(getattr(template, name), np.int64).reshape(1, -1)
    llama.check_token_ids(f"template.{name}", ids_1T, cfg.vocab_size, min_len=0)
  B, T = ids.shape
  prefix = _check_int("template.prefix_length", template.prefix_length, 0)
  if prefix >= T:
    raise ValueError(
      f"template.prefix_length: {prefix} leaves nothing of the {T}-token context to reconstruct"
    )
  if T <= DENSE_CONTEXT:
    keys, values = _context_kv_jit(cfg, params, jnp.asarray(ids))
  else:  # the memory-bounded prefill (tiled attention) for long contexts
    pre = llama.prefill(cfg, params, jnp.asarray(ids), jnp.ones((B, T), jnp.int32))
    keys, values = pre.keys, pre.values
  out = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, T), jnp.float32)
  for start, end, repeat in kvzip_chunks(ids, template, chunk_size):
    sink = min(n_sink, start)
    s = _reconstruct_jit(
      cfg, params, keys, values, jnp.asarray(repeat), start, end - start, sink, bool(plus)
    )
    out = out.at[..., start:end].set(s)
  return out[:, 0] if single else out


# --------------------------------------------------------------------------- KVCompose


def _repeat_attention(cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ):
  """The second pass of KVCompose: ``repeat_BQ`` at positions ``T .. T+Q-1`` after the cached
  context (full causal softmax over the context and themselves, the model's forward); per layer
  the max over those queries of the attention each context key receives, per query head
  ``[L, B, Hq, T]``."""
  B, Q = repeat_BQ.shape
  T = keys_LBGTD.shape[3]
  pos_q = _positions(B, Q, T)
  pos_k = _positions(B, T + Q)
  allowed = llama.causal_allowed(
    pos_q, pos_k, jnp.ones((B, T + Q), bool), pos_q, pos_k, cfg.sliding_window
  )

  def layer(x, inputs):
    p, k_ctx, v_ctx = inputs
    q, k, v = llama.project_qkv(cfg, p, x, pos_q)
    k_all = jnp.concatenate([k_ctx, k.astype(k_ctx.dtype)], 2)
    v_all = jnp.concatenate([v_ctx, v.astype(v_ctx.dtype)], 2)
    probs = llama.attention_probs(q, k_all, allowed)  # [B, Hq, Q, T + Q]
    score = probs[..., :T].astype(jnp.float32).max(2)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v_all))
    return x, score

  stacks = (llama.stacked(params), keys_LBGTD, values_LBGTD)
  _, scores = jax.lax.scan(layer, llama.embed_tokens(cfg, params, repeat_BQ), stacks)
  return scores


_repeat_attention_jit = jax.jit(_repeat_attention, static_argnums=0)


def kvcompose_evidence(cfg: ModelConfig, params: dict, context_ids, prompt_ids=None) -> Array:
  """Computes KVCompose's ``reconstruction_attn_LHT`` of a context, as kvpress 0.5.5's
  ``KVComposePress``.

  The context is prefilled once (a dense causal pass); then ``prompt_ids`` (default: the
  context itself) is read after the cached context (positions ``T ..``) with the model's plain
  causal attention over the context and itself. The evidence of each context key is the maximum
  over those queries of the attention it receives, per query head (kvpress ``agg_task="max"``;
  the GQA group's reduction belongs to the scorer). The prefill costs about twice a plain one,
  and the second pass forms its attention rows ``[B, Hq, Q, T + Q]`` densely.
  Differs: batches of several unpadded rows (kvpress: batch 1); one prompt (kvpress reads a
  list of prompts one after another, the cache growing).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    prompt_ids: the second pass's ids ``[Q]`` or ``[B, Q]`` (``None``: the context).

  Returns:
    fp32 evidence ``[L, Hq, T]`` for a context ``[T]``, ``[L, B, Hq, T]`` for a batch.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, or prompt
      rows that do not match the context's.
  """
  ids = _ids_2d("context_ids", context_ids, cfg)
  single = np.ndim(context_ids) == 1
  B, T = ids.shape
  if prompt_ids is None:
    repeat = ids
  else:
    repeat = _ids_2d("prompt_ids", prompt_ids, cfg)
    if repeat.shape[0] == 1 and B > 1:
      repeat = np.broadcast_to(repeat, (B, repeat.shape[1]))
    if repeat.shape[0] != B:
      raise ValueError(f"prompt_ids: {repeat.shape[0]} rows, expected 1 or the context's {B}")
  if T <= DENSE_CONTEXT:
    keys, values = _context_kv_jit(cfg, params, jnp.asarray(ids))
  else:  # the memory-bounded prefill (tiled attention) for long contexts
    pre = llama.prefill(cfg, params, jnp.asarray(ids), jnp.ones((B, T), jnp.int32))
    keys, values = pre.keys, pre.values
  out = _repeat_attention_jit(cfg, params, keys, values, jnp.asarray(repeat, jnp.int32))
  return out[:, 0] if single else out
