"""Non-causal chunked attention column sums times ``||v||`` (kvpress ``NonCausalAttnPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.leverage import HIGHEST, valid_mask, znorm

Array = jax.Array

PAD_LOGIT = -1e-9  # kvpress's fill for padded key columns (not -inf: padded keys keep weight)


def row_span(valid_T: Array) -> tuple[Array, Array]:
  """Locates a row's real positions, one contiguous block (left or right padding).

  Args:
    valid_T: bool ``[T]``, the row's real positions.

  Returns:
    ``(first, count)``: the first real position and the number of real positions (int32).
  """
  return jnp.argmax(valid_T).astype(jnp.int32), valid_T.sum().astype(jnp.int32)


def chunked_column_sums(q_LHTD: Array, k_LGTD: Array, chunk: int, n: Array) -> Array:
  """kvpress ``NonCausalAttnPress.non_causal_chunked_attn`` on the first ``n`` positions.

  The sequence is cut into chunks of ``chunk`` positions; inside each chunk every query attends
  to every key of the chunk (no causal mask, no ``1/sqrt(D)`` scaling, fp32 softmax), and the
  probabilities are summed over the queries. In the chunk holding position ``n - 1``, the
  positions ``>= n`` are kvpress's zero padding: their query rows get logits 0 (uniform rows,
  summed in too) and their key columns the logit ``-1e-9``. Positions ``>= n`` score junk.

  Args:
    q_LHTD: post-RoPE queries ``[L, Hq, T, D]``.
    k_LGTD: post-RoPE keys ``[L, G, T, D]``.
    chunk: the chunk size (static).
    n: the real positions, an int (traced or not) ``<= T``.

  Returns:
    fp32 column sums per query head ``[L, Hq, T]``.
  """
  L, Hq, T, D = q_LHTD.shape
  k_LHTD = jnp.repeat(k_LGTD, Hq // k_LGTD.shape[1], axis=1)
  chunks = -(-T // chunk)
  pad = ((0, 0), (0, 0), (0, chunks * chunk - T), (0, 0))
  q = jnp.pad(q_LHTD.astype(jnp.float32), pad).reshape(L, Hq, chunks, chunk, D)
  k = jnp.pad(k_LHTD.astype(jnp.float32), pad).reshape(L, Hq, chunks, chunk, D)
  dots = jnp.einsum("lhcqd,lhckd->lhcqk", q, k, precision=HIGHEST)
  pos = jnp.arange(chunks * chunk).reshape(chunks, chunk)
  last = (pos // chunk) == (n - 1) // chunk
  padded = last & (pos >= n)  # [chunks, chunk]
  dots = jnp.where(padded[None, None, :, :, None], 0.0, dots)
  dots = jnp.where(padded[None, None, :, None, :], PAD_LOGIT, dots)
  attn = jax.nn.softmax(dots, axis=-1)
  return attn.sum(-2).reshape(L, Hq, chunks * chunk)[..., :T]


def noncausal_zscores(q_LHTD: Array, k_LGTD: Array, v_LGTD: Array, chunk: int, n: Array) -> Array:
  """kvpress ``NonCausalAttnPress.score`` on the first ``n`` positions: the chunked column sums
  averaged over each KV head's query heads, times ``||v||``, average-pooled over 3 positions
  (zero padded, divided by 3), z-scored per layer (:func:`~kvjax.policies.leverage.znorm`).

  Args:
    q_LHTD: post-RoPE queries ``[L, Hq, T, D]``.
    k_LGTD: post-RoPE keys ``[L, G, T, D]``.
    v_LGTD: values ``[L, G, T, D]``.
    chunk: the chunk size (static).
    n: the real positions (the first ``n``), an int (traced or not).

  Returns:
    fp32 scores ``[L, G, T]`` (0 at positions ``>= n``).
  """
  L, G, T, _ = k_LGTD.shape
  sums = chunked_column_sums(q_LHTD, k_LGTD, chunk, n)
  attn_LGT = sums.reshape(L, G, -1, T).mean(2)
  real_T = jnp.arange(T) < n
  s = jnp.where(
    real_T[None, None], attn_LGT * jnp.linalg.norm(v_LGTD.astype(jnp.float32), axis=-1), 0.0
  )
  padded = jnp.pad(s, ((0, 0), (0, 0), (1, 1)))
  pooled = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3.0
  return znorm(pooled, real_T)


def aligned(fn, valid_T: Array | None, T: int, *xs_T: Array) -> Array:
  """Runs ``fn`` on a row's real positions moved to the front, and moves the result back.

  Args:
    fn: called as ``fn(n, *xs)`` with ``n`` the real count and each ``x`` rolled along its
      key axis (-2); returns ``[..., T]``.
    valid_T: bool ``[T]``, the row's real positions (``None``: every position).
    T: the positions.
    *xs_T: the per-position arrays, key axis -2.

  Returns:
    ``fn``'s result rolled back along its last axis to the row's own positions.
  """
  first, n = row_span(valid_mask(valid_T, T))
  if valid_T is None:
    return fn(jnp.int32(T), *xs_T)
  out = fn(n, *(jnp.roll(x, -first, axis=-2) for x in xs_T))
  return jnp.roll(out, first, axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NonCausalAttention(Policy):
  """Non-causal chunked attention received per key, times ``||v||``, z-normalised per layer.

  Paper: Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
  Approximate Leverage Scores" (arXiv:2507.08143). Reference: kvpress 0.5.5
  ``presses/non_causal_attention_press.py::NonCausalAttnPress``. The prompt is cut into chunks
  of ``chunk_size`` positions; inside a chunk each post-RoPE query (``evidence.queries_LHTD``)
  attends to every key of the chunk, future ones included, with unscaled logits ``q . k`` and
  an fp32 softmax; each key's received attention is summed over the chunk's queries, averaged
  over the query heads of its KV head, multiplied by ``||v||``, average-pooled over 3 positions
  (zero padding counted, as ``F.avg_pool1d(kernel_size=3, padding=1)``) and z-scored over the
  layer's heads and positions (unbiased std, clamped at 1e-6). kvpress's padding of the last
  chunk is reproduced: its padded queries have all-zero logits (uniform rows, summed in) and its
  padded keys the logit ``-1e-9``. Scores are per KV head ``[L, G, T]``; no protected positions.

  Differences from kvpress:

  * kvpress z-scores over the whole batch; kvjax over one prompt. A padded row (``valid_T``)
    is scored as its unpadded prompt: chunks count from its first real token.

  Attributes:
    chunk_size: the chunk length (kvpress default 256).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"queries_LHTD", "keys_LGTD", "values_LGTD"})
  chunk_size: int = 256

  def __post_init__(self):
    super().__post_init__()
    check_int("chunk_size", self.chunk_size, 1)

  def score(self, evidence):
    """Z-scored non-causal chunked attention times ``||v||`` (kvpress ``NonCausalAttnPress``)."""
    q = evidence.need("queries_LHTD", self.label)
    k = evidence.need("keys_LGTD", self.label)
    v = evidence.need("values_LGTD", self.label)
    check_heads(q, k, self.label)

    def fn(n, q, k, v):
      return noncausal_zscores(q, k, v, self.chunk_size, n)

    return aligned(fn, evidence.valid_T, k.shape[2], q, k, v)


def check_heads(q_LHTD: Array, k_LGTD: Array, policy: str) -> None:
  """Checks that the queries fit the keys: ``Hq`` a multiple of ``G``, the same ``L, T, D``.

  Args:
    q_LHTD: the queries ``[L, Hq, T, D]``.
    k_LGTD: the keys ``[L, G, T, D]``.
    policy: the policy's label, named in the error.

  Raises:
    ValueError: naming both shapes when they do not fit.
  """
  if (
    q_LHTD.ndim != 4
    or q_LHTD.shape[1] % k_LGTD.shape[1]
    or (q_LHTD.shape[2:] != k_LGTD.shape[2:] or q_LHTD.shape[0] != k_LGTD.shape[0])
  ):
    raise ValueError(
      f"evidence: policy {policy!r} expected queries_LHTD [L, Hq, T, D] with Hq a multiple of "
      f"the keys' G, matching keys_LGTD {k_LGTD.shape}; got {q_LHTD.shape}"
    )
