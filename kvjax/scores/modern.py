"""The scorers of the later kvpress-era methods: KeyDiff, LagKV, CriticalKV, ChunkKV, Q-Filters,
DuoAttention's head choice, KVzip, ThinK's key channels and R-KV."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import checks, select
from kvjax.scores.attention import PRECISION
from kvjax.scores.classic import streaming
from kvjax.scores.transforms import check_count, check_kernel, group, pool1d, protect

Array = jax.Array


def keydiff(keys_LGTD: Array, valid_T: Array | None = None) -> Array:
  """Scores KeyDiff (kvpress ``KeyDiffPress.score``): ``-cos(k_t, anchor)`` per KV head.

  ``anchor = mean_t(k_t / max(||k_t||, 1e-12))`` (``F.normalize`` then the mean over the
  prompt); the cosine is ``k . a / sqrt(max(||k||^2 ||a||^2, 1e-16))`` (torch
  ``cosine_similarity``, eps 1e-8). Keys least like the average key are kept. Attention-free, no
  protection. (The paper's block-wise iteration is kvpress ``BlockPress``, not this scorer.)

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    valid_T: bool ``[T]``, the row's real positions (a padded batch row); the anchor is their
      mean, as the unpadded prompt's. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys that are not a floating rank-4 array, or (when concrete) contain NaN or
      inf, and a ``valid_T`` that is not ``[T]``.
  """
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
  return _keydiff(keys_LGTD, checks.valid_positions(valid_T, keys_LGTD.shape[2]))


@jax.jit
def _keydiff(keys_LGTD, valid_T):
  k = keys_LGTD.astype(jnp.float32)
  norm = jnp.linalg.norm(k, axis=-1, keepdims=True)
  unit = jnp.where(valid_T[None, None, :, None], k / jnp.maximum(norm, 1e-12), 0.0)
  anchor = unit.sum(axis=2, keepdims=True) / jnp.maximum(valid_T.sum(), 1)
  w12 = (k * anchor).sum(-1)
  w1, w2 = (k * k).sum(-1), (anchor * anchor).sum(-1)
  return -w12 / jnp.sqrt(jnp.maximum(w1 * w2, 1e-16))


def _lag_state_scores(x_LGPRD: Array) -> Array:
  """LagKV's ``_get_states_score``: each lag chunk min/max-normalised by the next chunk, std
  over channels (unbiased, as torch), softmax over the chunk's tokens: ``[L, G, P - 1, R]``."""
  ref, v = x_LGPRD[:, :, 1:], x_LGPRD[:, :, :-1]
  low, high = ref.min(-2, keepdims=True), ref.max(-2, keepdims=True)
  span = high - low
  # kvpress divides by zero (NaN) for a channel constant over the reference chunk; that channel
  # contributes 0 here instead, so one degenerate channel cannot poison the selection.
  normed = jnp.where(span > 0, (v - low) / jnp.where(span > 0, span, 1.0), 0.0)
  return jax.nn.softmax(normed.std(-1, ddof=1), axis=-1)


def lagkv(keys_LGTD: Array, values_LGTD: Array, *, lag: int = 128, sinks: int = 4) -> Array:
  """Scores LagKV per KV head (kvpress ``LagKVPress.score``, ``cross_scoring=False``).

  The prompt after the ``sinks`` is cut into ``P = (T - sinks) // lag`` chunks of ``lag``
  tokens; each chunk but the last is scored against the next one (its lag reference) by
  :func:`_lag_state_scores` on keys and on values, averaged; the score is the token's rank
  inside its chunk divided by ``lag`` (``argsort().argsort() / lag``), so every chunk keeps its
  share. The sinks and the tail (the last full chunk plus the ``(T - sinks) % lag`` remainder)
  are protected (``+inf``; kvpress writes 1, above every rank). A prompt shorter than
  ``sinks + 2 * lag`` is not compressed by LagKV: kvpress then scores the sinks 1 and the rest
  by recency, i.e. StreamingLLM's order, which this returns. Ranks repeat across chunks, so ties
  go to the lower position (the select rule, as torch's CPU ``topk``).

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    values_LGTD: the values, ``[L, G, T, D]`` with the keys' ``L``, ``G`` and ``T``.
    lag: the chunk length, a static int ``>= 1``.
    sinks: the number of initial tokens protected, a static int ``>= 0``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys or values that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; values whose ``L``, ``G`` or ``T`` differ from the keys'; and a
      ``lag`` or ``sinks`` that is not a static int in range.
  """
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
  checks.float_array("values", values_LGTD, 4, "LGTD")
  checks.same_dims("values", values_LGTD, "keys", keys_LGTD, (0, 1, 2))
  lag = checks.static_int("lag", lag, 1)
  sinks = checks.static_int("sinks", sinks, 0)
  L, G, T, _ = keys_LGTD.shape
  if sinks + 2 * lag > T:
    return streaming(T, (L, G), sinks=min(sinks, T))
  return _lagkv(keys_LGTD, values_LGTD, lag, sinks)


@functools.partial(jax.jit, static_argnames=("lag", "sinks"))
def _lagkv(keys_LGTD, values_LGTD, lag, sinks):
  L, G, T, _ = keys_LGTD.shape
  end = sinks + ((T - sinks) // lag) * lag
  P = (end - sinks) // lag

  def chunks(x):
    x = x[:, :, sinks:end].astype(jnp.float32)
    return x.reshape(L, G, P, lag, x.shape[-1])

  score = (_lag_state_scores(chunks(keys_LGTD)) + _lag_state_scores(chunks(values_LGTD))) / 2
  rank = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1).astype(jnp.float32) / lag
  body = rank.reshape(L, G, (P - 1) * lag)
  return jnp.concatenate(
    [jnp.full((L, G, sinks), jnp.inf), body, jnp.full((L, G, T - sinks - (P - 1) * lag), jnp.inf)],
    axis=-1,
  )


def group_norms(value_out_norms_LHT: Array, num_heads: int) -> Array:
  """Brings CriticalKV's ``||W_O v||_1`` to the scores' head granularity.

  Query heads as given, or the mean over each GQA group for KV-head scores (kvpress
  ``vwl1norm``).

  Args:
    value_out_norms_LHT: the norms per query head ``[L, Hq, T]``.
    num_heads: the scores' number of heads: ``Hq``, or ``G`` for KV-head scores.

  Returns:
    fp32 norms ``[L, num_heads, T]``.

  Raises:
    ValueError: for norms that are not a floating rank-3 array, or (when concrete) contain NaN
      or inf, and ``Hq`` not a multiple of ``num_heads``.
  """
  checks.float_array("value_out_norms", value_out_norms_LHT, 3, "LHT")
  if value_out_norms_LHT.shape[1] == num_heads:
    return value_out_norms_LHT.astype(jnp.float32)
  return group(value_out_norms_LHT.astype(jnp.float32), num_heads, "mean")


def critical(
  scores_LHT: Array, value_out_norms_LHT: Array, first_stage_LHT: Array, *, epsilon: float = 1e-4
) -> Array:
  """Scores CriticalKV's second stage (kvpress ``CriticalKVPress.score``).

  ``(s + epsilon) * ||W_O v||_1`` with the first-stage positions forced in (``+inf``; kvpress
  writes ``finfo.max``). Positions the base scorer protected (``+inf``) stay protected.

  Args:
    scores_LHT: the base scores ``[L, H, T]``.
    value_out_norms_LHT: ``||W_O v||_1`` per query head ``[L, Hq, T]``, averaged over each GQA
      group for KV-head scores (:func:`group_norms`).
    first_stage_LHT: bool ``[L, H, T]``, the base scores' top
      ``max(1, floor(first_stage_ratio * b))`` per row, chosen by the caller from the budget
      (:mod:`kvjax.policies`).
    epsilon: added to the scores before the norms multiply them.

  Returns:
    fp32 scores ``[L, H, T]``.

  Raises:
    ValueError: for scores that are not a floating ``[L, H, T]`` array; norms that are not a
      floating rank-3 array, or (when concrete) contain NaN or inf; and norms whose grouped
      shape differs from the scores'.
  """
  _check_scores_3d(scores_LHT)
  norms = group_norms(value_out_norms_LHT, scores_LHT.shape[1])
  if norms.shape != scores_LHT.shape:
    raise ValueError(
      f"value_out_norms: shape {norms.shape} does not match scores {scores_LHT.shape}"
    )
  s = scores_LHT.astype(jnp.float32)
  # +inf stays protected and -inf (padding) stays out whatever the norm (0 * inf would be NaN)
  rescaled = jnp.where(jnp.isinf(s), s, (s + epsilon) * norms)
  return jnp.where(first_stage_LHT, jnp.inf, rescaled)


def chunkkv(scores_LHT: Array, *, chunk: int = 20, valid_T: Array | None = None) -> Array:
  """Scores ChunkKV (kvpress ``ChunkKVPress.compress``): whole chunks ranked by their summed score.

  One kept set is shared by every head. Per layer the scores are summed over heads (``+inf``
  protected positions enter as the layer's largest finite score + 1, as kvpress's scorers pad
  them), each chunk of ``chunk`` tokens is scored by its mean (the partial last chunk by the mean
  of its ``T % chunk`` tokens) and the chunks are ranked (ties to the lower chunk). The returned
  order takes the best chunk, then the next, and inside a chunk the tokens by their summed
  score, so a budget that is a sum of chunk lengths keeps exactly kvpress's chunks, and any other
  budget keeps whole best chunks plus the best tokens of the next one (kvpress rounds the kept
  count to whole chunks instead: ``max(1, int(n_chunks * (1 - ratio)))`` chunks).

  Args:
    scores_LHT: the base scores ``[L, H, T]``.
    chunk: the chunk length, a static int ``>= 1``.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): chunks start at
      its first real token, as in the unpadded prompt, and the padding forms a last chunk of its
      own. ``None``: every position.

  Returns:
    fp32 order scores ``[L, H, T]`` (higher = keep). ``T < chunk`` returns ``scores_LHT`` as is,
    in fp32 (kvpress delegates to the base press).

  Raises:
    ValueError: for scores that are not a floating ``[L, H, T]`` array, a ``chunk`` that is not
      a static int ``>= 1``, and a ``valid_T`` that is not ``[T]``.
  """
  _check_scores_3d(scores_LHT)
  chunk = checks.static_int("chunk", chunk, 1)
  L, H, T = scores_LHT.shape
  if chunk > T:
    return scores_LHT.astype(jnp.float32)
  return _chunkkv(scores_LHT, checks.valid_positions(valid_T, T), chunk)


@functools.partial(jax.jit, static_argnames="chunk")
def _chunkkv(scores_LHT, valid_T, chunk):
  L, H, T = scores_LHT.shape
  s = scores_LHT.astype(jnp.float32)
  real = valid_T[None, None, :]
  finite = jnp.where(jnp.isfinite(s) & real, s, -jnp.inf).max(axis=(1, 2), keepdims=True)
  s = jnp.where(jnp.isposinf(s), finite + 1.0, s).sum(1)  # [L, T]
  n_chunks = -(-T // chunk)  # chunk n_chunks holds the padding
  start = jnp.argmax(valid_T)  # the first real token (left padding)
  chunk_T = jnp.where(valid_T, (jnp.arange(T) - start) // chunk, n_chunks)
  sizes = jax.ops.segment_sum(valid_T.astype(jnp.float32), chunk_T, n_chunks + 1)
  sums = jax.ops.segment_sum(jnp.where(valid_T[None, :], s, 0.0).T, chunk_T, n_chunks + 1).T
  # the mean of each chunk's real tokens (a partial last chunk's own); empty chunks rank last
  sizes = sizes[None, :]
  chunk_scores = jnp.where(sizes > 0, sums / jnp.maximum(sizes, 1.0), -jnp.inf)[:, :n_chunks]
  chunk_scores = jnp.concatenate([chunk_scores, jnp.full((L, 1), -jnp.inf)], axis=1)
  chunk_rank = _ranks_desc(chunk_scores)  # 0 = best; the padding's chunk last
  # rank inside each chunk: a stable sort on (chunk, -score)
  order = jnp.lexsort((-s, jnp.broadcast_to(chunk_T, s.shape)), axis=-1)
  # ``order`` lists the real positions chunk by chunk from index 0 (every chunk but the last is
  # whole; the padding comes last), so position order[j] has inner rank j % chunk
  inner = (
    jnp.zeros_like(order)
    .at[jnp.arange(L)[:, None], order]
    .set(jnp.broadcast_to(jnp.arange(T) % chunk, order.shape))
  )
  key = (n_chunks - jnp.take_along_axis(chunk_rank, jnp.broadcast_to(chunk_T, s.shape), -1)) * chunk
  key = jnp.where(valid_T[None, :], key + (chunk - inner), -jnp.inf)  # padding is never kept
  return jnp.broadcast_to(key.astype(jnp.float32)[:, None, :], (L, H, T))


def _check_scores_3d(scores_LHT) -> None:
  checks.rank("scores", scores_LHT, "LHT")
  if not jnp.issubdtype(scores_LHT.dtype, jnp.floating):
    raise ValueError(f"scores: expected a floating dtype, got {scores_LHT.dtype}")


def _ranks_desc(x_LN: Array) -> Array:
  """Rank of each entry of a row, best first, ties to the lower index (stable)."""
  order = jnp.argsort(-x_LN, axis=-1, stable=True)
  N = x_LN.shape[-1]
  return jnp.zeros_like(order).at[jnp.arange(x_LN.shape[0])[:, None], order].set(jnp.arange(N))


def qfilter(keys_LGTD: Array, qfilters_LGD: Array) -> Array:
  """Scores Q-Filters (kvpress ``QFilterPress.score``): ``-<k_t, f>`` per KV head ``[L, G, T]``.

  ``f`` is the layer's filter direction for that KV head. No protection.

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    qfilters_LGD: the filter directions ``[L, G, D]``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys or filters that are not floating arrays of rank 4 and 3, or (when
      concrete) contain NaN or inf, and filters that are not ``[L, G, D]``.
  """
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
  checks.float_array("qfilters", qfilters_LGD, 3, "LGD")
  L, G, _, D = keys_LGTD.shape
  if qfilters_LGD.shape != (L, G, D):
    raise ValueError(f"qfilters: expected shape {(L, G, D)}, got {qfilters_LGD.shape}")
  f = qfilters_LGD.astype(jnp.float32)
  return -jnp.einsum("lgtd,lgd->lgt", keys_LGTD.astype(jnp.float32), f, precision=PRECISION)


def duo_streaming_heads(retrieval_heads_LG: Array, head_compression_ratio: float = 0.5) -> Array:
  """Chooses DuoAttention's streaming heads ``[L, G]`` (kvpress ``DuoAttentionPress``).

  As ``post_init_from_model``: the ``round(L * G * head_compression_ratio)`` (Python's
  half-to-even round) lowest gates over all layers and heads, ties to the lower flat index
  (numpy's ``argsort``). Retrieval heads (False) keep the whole cache.

  Args:
    retrieval_heads_LG: DuoAttention's gates per layer and KV head ``[L, G]``.
    head_compression_ratio: the share of heads made streaming, a static float in ``[0, 1]``.

  Returns:
    bool ``[L, G]``, True for the streaming heads.

  Raises:
    ValueError: for gates that are not a floating rank-2 array, or (when concrete) contain NaN
      or inf, and a ratio that is not a static float in ``[0, 1]``.
  """
  checks.float_array("retrieval_heads", retrieval_heads_LG, 2, "LG")
  ratio = checks.ratio("head_compression_ratio", head_compression_ratio, high_open=False)
  L, G = retrieval_heads_LG.shape
  return _duo_streaming_heads(retrieval_heads_LG, round(L * G * ratio))


@functools.partial(jax.jit, static_argnames="n_pruned")
def _duo_streaming_heads(retrieval_heads_LG, n_pruned):
  L, G = retrieval_heads_LG.shape
  flat = retrieval_heads_LG.astype(jnp.float32).reshape(-1)
  rank = jnp.zeros(L * G, jnp.int32).at[jnp.argsort(flat, stable=True)].set(jnp.arange(L * G))
  return (rank < n_pruned).reshape(L, G)


def kvzip(reconstruction_attn_LGT: Array, *, sinks: int = 4) -> Array:
  """Scores KVzip (kvpress ``KVzipPress.compress_post``) from the reconstruction attention.

  The reconstruction attention (max over the "repeat the context" queries and the GQA group,
  :mod:`kvjax.model.calibrate`), with the first ``sinks`` positions protected (``+inf``; kvpress
  writes the global max + 1). The budget split across layers and heads is the policy's
  (:mod:`kvjax.policies`, ``kvzip``).

  Args:
    reconstruction_attn_LGT: the reconstruction attention ``[L, G, T]``.
    sinks: the number of initial positions protected.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for attention that is not a floating rank-3 array, or (when concrete) contains
      NaN or inf, and a ``sinks`` that is negative, not an integer or beyond int32.
  """
  checks.float_array("reconstruction_attn", reconstruction_attn_LGT, 3, "LGT")
  sinks = check_count("sinks", sinks)
  return protect(reconstruction_attn_LGT.astype(jnp.float32), sinks=sinks)


def think_channel_scores(window_queries_LHWD: Array, keys_LGTD: Array) -> Array:
  """Scores ThinK's key channels (kvpress ``ThinKPress.compress``): ``[L, G, D]`` fp32.

  ``mean_w(q^2)`` of the last ``W`` post-RoPE prompt queries (kvpress ``window_size=32``),
  averaged over each GQA group, times ``mean_t(k^2)`` of the keys (the cached keys the channels
  are pruned from; in ``ComposedPress([press, ThinKPress])`` those the sequence press kept).

  Args:
    window_queries_LHWD: the last ``W`` post-RoPE prompt queries ``[L, Hq, W, D]``.
    keys_LGTD: the cached keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.

  Returns:
    fp32 channel scores ``[L, G, D]``.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``; and ``Hq`` not a multiple of
      ``G``.
  """
  checks.queries_keys(window_queries_LHWD, keys_LGTD, "window_queries")
  L, Hq, _, D = window_queries_LHWD.shape
  G = keys_LGTD.shape[1]
  q2 = jnp.square(window_queries_LHWD.astype(jnp.float32)).mean(2)
  q2 = q2.reshape(L, G, Hq // G, D).mean(2)
  return q2 * jnp.square(keys_LGTD.astype(jnp.float32)).mean(2)


def think_channel_mask(channel_scores_LGD: Array, channel_ratio: float) -> Array:
  """Chooses ThinK's kept key channels: bool ``[L, G, D]``.

  The ``int(D * channel_ratio)`` lowest-scoring channels of each KV head are pruned (kvpress
  ``key_scores.topk(n_pruned, largest=False)``), ties pruning the lower channel. Keys keep
  ``D - int(D * channel_ratio)`` channels (kvpress zeroes the others; the cache may drop them).

  Args:
    channel_scores_LGD: the channel scores ``[L, G, D]`` (:func:`think_channel_scores`).
    channel_ratio: the share of channels pruned, a static float in ``[0, 1)``.

  Returns:
    bool ``[L, G, D]``, True for the kept channels.

  Raises:
    ValueError: for scores that are not a floating rank-3 array, or (when concrete) contain NaN
      or inf, and a ratio that is not a static float in ``[0, 1)``.
  """
  checks.float_array("channel_scores", channel_scores_LGD, 3, "LGD")
  ratio = checks.ratio("channel_ratio", channel_ratio)
  n_pruned = int(channel_scores_LGD.shape[-1] * ratio)
  pruned = select.top_mask(-channel_scores_LGD.astype(jnp.float32), jnp.int32(n_pruned))
  return ~pruned


def key_similarity_redundancy(
  keys_LGTD: Array, *, threshold: float = 0.5, valid_T: Array | None = None
) -> Array:
  """Scores R-KV's redundancy (official ``cal_similarity``, ``retain_direction="last"``).

  Cosine similarity between the keys (``k / (||k|| + 1e-8)``), diagonal zeroed; in each row
  ``i`` the last key ``j`` with similarity above ``threshold`` is exempted (its entry zeroed;
  with no such key, entry ``j = 0`` is zeroed, as upstream); then the mean over rows, softmax
  over the keys.

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    threshold: the cosine similarity above which a key can be a row's exempted key.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): padding takes no
      part (its rows and columns are dropped, upstream's ``j = 0`` is the first real key), so a
      padded row scores its keys as the unpadded prompt does. ``None``: every position.

  Returns:
    fp32 redundancy ``[L, G, T]`` (higher = more redundant); padding scores 0.

  Raises:
    ValueError: for keys that are not a floating rank-4 array, or (when concrete) contain NaN or
      inf, and a ``valid_T`` that is not ``[T]``.
  """
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
  return _key_similarity_redundancy(
    keys_LGTD, threshold, checks.valid_positions(valid_T, keys_LGTD.shape[2])
  )


@jax.jit
def _key_similarity_redundancy(keys_LGTD, threshold, valid_T):
  start = jnp.argmax(valid_T)  # the first real key

  def one_layer(keys_GTD):  # one [G, T, T] similarity at a time, as upstream (per layer)
    k = keys_GTD.astype(jnp.float32)
    k = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    cos = jnp.einsum("gid,gjd->gij", k, k, precision=PRECISION)
    T = cos.shape[-1]
    pair = valid_T[:, None] & valid_T[None, :]
    cos = jnp.where((jnp.eye(T, dtype=bool) | ~pair)[None], 0.0, cos)
    column = lax.broadcasted_iota(jnp.int32, cos.shape, 2)
    last = jnp.max(jnp.where(cos > threshold, column, start), axis=-1)  # [G, T]
    cos = jnp.where(column == last[..., None], 0.0, cos)
    mean = cos.sum(-2) / jnp.maximum(valid_T.sum(), 1)
    return jax.nn.softmax(jnp.where(valid_T[None, :], mean, -jnp.inf), axis=-1)

  return lax.map(one_layer, keys_LGTD)


def rkv(
  window_queries_LHWD: Array,
  keys_LGTD: Array,
  *,
  window: int = 8,
  kernel: int = 7,
  mix_lambda: float = 0.07,
  threshold: float = 0.5,
  valid_T: Array | None = None,
) -> Array:
  """Scores R-KV: ``lambda * importance - (1 - lambda) * redundancy``, ``[L, G, T]``.

  The reference is arXiv 2505.24133 (official ``rkv/compression/r1_kv.py``, ported verbatim in
  ``FlashInfer/rkv/algo.py``). Importance: the logits of the last ``window`` queries (max over
  each GQA group, before the softmax), softmax over the prefix keys ``[0, T - window)`` only,
  mean over the window queries, ``max_pool1d(kernel, padding kernel // 2)``. Redundancy:
  :func:`key_similarity_redundancy` over all ``T`` keys, restricted to the prefix. The last
  ``window`` positions are protected (upstream keeps them on top of the ``budget - window``
  best). Upstream re-compresses every 128 generated tokens (``divide_length``), which the
  registry's ``decode_every`` carries.

  Args:
    window_queries_LHWD: the last ``W`` prompt queries ``[L, Hq, W, D]``.
    keys_LGTD: the keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.
    window: the number of last queries read and of last positions protected, a static int with
      ``window <= W`` and ``window < T``; default 8.
    kernel: the max pooling width, a positive odd int; default 7.
    mix_lambda: the importance's weight ``lambda``; default 0.07.
    threshold: the similarity threshold of :func:`key_similarity_redundancy`; default 0.5.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): padding takes no
      part in either term and scores 0. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``, the last ``window`` positions ``+inf``.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``; ``Hq`` not a multiple of
      ``G``; a kernel that is not a positive odd int; a window that is not a static int in
      ``[1, min(W, T - 1)]``; and a ``valid_T`` that is not ``[T]``.
  """
  checks.queries_keys(window_queries_LHWD, keys_LGTD, "window_queries")
  kernel = check_kernel(kernel)
  L, Hq, W, D = window_queries_LHWD.shape
  G, T = keys_LGTD.shape[1:3]
  window = checks.static_int("window", window, 1)
  if window > W or window >= T:
    raise ValueError(
      f"window: {window} needs window <= W={W} observation queries and window < T={T} keys"
    )
  valid = checks.valid_positions(valid_T, T)
  return _rkv(window_queries_LHWD, keys_LGTD, valid, mix_lambda, threshold, window, kernel)


@functools.partial(jax.jit, static_argnames=("window", "kernel"))
def _rkv(window_queries_LHWD, keys_LGTD, valid_T, mix_lambda, threshold, window, kernel):
  L, Hq, W, D = window_queries_LHWD.shape
  G, T = keys_LGTD.shape[1:3]
  q = window_queries_LHWD[:, :, W - window :].astype(jnp.float32).reshape(L, G, Hq // G, window, D)
  k = keys_LGTD[:, :, : T - window].astype(jnp.float32)
  logits = jnp.einsum("lgrwd,lgtd->lgrwt", q, k, precision=PRECISION) / math.sqrt(D)
  # left padding: the window is the row's last real tokens
  prefix = valid_T[None, None, None, : T - window]
  logits = jnp.where(prefix, logits.max(2), -jnp.inf)
  attn = jnp.where(prefix, jax.nn.softmax(logits, axis=-1), 0.0).mean(-2)  # [L, G, T - window]
  importance = pool1d(attn, kernel, "max")  # attention >= 0: padding's 0 never wins a max
  redundancy = _key_similarity_redundancy(keys_LGTD, threshold, valid_T)[..., : T - window]
  body = importance * mix_lambda - redundancy * (1 - mix_lambda)
  return jnp.concatenate([body, jnp.full((L, G, window), jnp.inf)], axis=-1)
