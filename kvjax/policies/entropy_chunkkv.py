"""EntropyGatedChunkKV: ChunkKV whose important but spiky chunks keep only their best tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax import select
from kvjax.policies.checks import check_int
from kvjax.policies.protocols import Rescoring
from kvjax.policies.wrappers import Wrapper, check_base

Array = jax.Array

EPSILON = 1e-8  # kvpress's, in the entropy's normalisation and its log


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyGatedChunkKV(Rescoring, Wrapper):
  """ChunkKV gated by the entropy of each chunk's scores (kvpress ``EntropyGatedChunkKVPress``).

  Paper: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
  Long-Context LLM Inference" (arXiv 2502.00299); the entropy gate is kvpress's own extension.
  Reference: kvpress 0.5.5 ``presses/entropy_gated_chunkkv_press.py::EntropyGatedChunkKVPress``.

  Per layer, the base's grouped scores are summed over heads (``+inf`` protected positions
  enter as the layer's largest finite score + 1, as kvpress's scorers pad them) and cut into
  chunks of ``chunk`` tokens (a partial last chunk of ``T % chunk``). Each chunk has a mean
  score and a normalised entropy of its (min-rebased) token scores. Chunks are visited in
  decreasing mean; a chunk whose mean is at least the (lower) median and whose entropy is below
  the (lower) median is spiky and keeps only its ``low_entropy_chunk`` best tokens, any other
  chunk is kept whole, until the budget runs out; what the spiky chunks left unspent goes to
  the best remaining tokens. Exactly ``min(budget, T)`` tokens are kept, one set shared by the
  heads of a layer (each head row runs the gate under its own budget, so a ``[L, H]`` budget
  gives each head its own set).

  Differences from kvpress:

  * The budget is the kept count itself (kvpress: ``max(1, int(T * (1 - compression_ratio)))``).
  * Ties (equal chunk means, equal token scores) go to the lower position; kvpress leaves them
    to ``torch.argsort`` / ``torch.topk``.
  * A left-padded row's chunks start at its first real token and padding is never kept (kvpress:
    batch element 0 only).
  * Parity needs ``num_kv_heads`` set to the model's KV heads, as kvpress sums KV-head scores.

  Attributes:
    base: the budget-free prefill scorer (kvpress ``press``).
    chunk: the chunk length (kvpress ``chunk_length``, 10).
    low_entropy_chunk: tokens kept from a spiky chunk (kvpress ``low_entropy_chunk_length``, 4),
      ``1 <= low_entropy_chunk < chunk``.
  """

  chunk: int = 10
  low_entropy_chunk: int = 4

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "EntropyGatedChunkKV", given_budget=True)
    check_int("chunk", self.chunk, 2)
    check_int("low_entropy_chunk", self.low_entropy_chunk, 1)
    if self.low_entropy_chunk >= self.chunk:
      raise ValueError(
        f"low_entropy_chunk: expected 1 <= low_entropy_chunk < chunk={self.chunk}, "
        f"got {self.low_entropy_chunk}"
      )

  @property
  def windowed(self) -> bool:
    """False: the window's chunk competes like any other (kvpress pads it max + 1)."""
    return False

  def score(self, evidence):
    """The base's grouped scores summed over the heads of each layer, the same for every head."""
    s = self.grouped(self.base.score(evidence)).astype(jnp.float32)
    real = jnp.ones(s.shape[-1], bool) if evidence.valid_T is None else evidence.valid_T
    finite = jnp.where(jnp.isfinite(s) & real[None, None, :], s, -jnp.inf).max(
      axis=(1, 2), keepdims=True
    )
    summed = jnp.where(jnp.isposinf(s), finite + 1.0, s).sum(1, keepdims=True)
    return jnp.broadcast_to(summed, s.shape)

  def rescore(self, evidence, scores_LHT, budget_LH, capacity):
    """1 on the positions the entropy gate keeps under each row's budget, 0 elsewhere."""
    L, H, T = scores_LHT.shape
    valid_T = jnp.ones(T, bool) if evidence.valid_T is None else evidence.valid_T
    keep = gated_keep(
      scores_LHT.reshape(L * H, T),
      budget_LH.reshape(L * H),
      valid_T,
      chunk=self.chunk,
      low=self.low_entropy_chunk,
    )
    return keep.reshape(L, H, T).astype(jnp.float32)


def _lower_median(x_C: Array, real_C: Array) -> Array:
  """``torch.median`` of the real entries: the lower of the two middle ones."""
  n = real_C.sum()
  return jnp.sort(jnp.where(real_C, x_C, jnp.inf))[jnp.maximum(n - 1, 0) // 2]


@functools.partial(jax.jit, static_argnames=("chunk", "low"))
def gated_keep(scores_RT: Array, budget_R: Array, valid_T: Array, *, chunk: int, low: int):
  """The entropy gate's kept positions per row (kvpress ``EntropyGatedChunkKVPress.compress``).

  Args:
    scores_RT: per-token scores, fp32 ``[R, T]`` (finite on the real positions).
    budget_R: each row's kept count, int ``[R]``.
    valid_T: the real positions, bool ``[T]``; chunks start at the first of them.
    chunk: the chunk length (static).
    low: tokens kept from an important, low-entropy chunk (static).

  Returns:
    Kept positions, bool ``[R, T]``: ``min(budget, real positions)`` per row.
  """
  T = scores_RT.shape[-1]
  n_chunks = -(-T // chunk)
  start = jnp.argmax(valid_T)
  chunk_T = jnp.where(valid_T, (jnp.arange(T) - start) // chunk, n_chunks)  # padding: its own
  segments = n_chunks + 1
  size_C = jax.ops.segment_sum(valid_T.astype(jnp.int32), chunk_T, segments)[:n_chunks]
  real_C = size_C > 0
  chunk_start_C = jnp.cumsum(size_C) - size_C

  def row(s_T, b):
    s_T = jnp.where(valid_T, s_T, 0.0)
    b = jnp.clip(b, 0, valid_T.sum())
    seg = functools.partial(jax.ops.segment_sum, segment_ids=chunk_T, num_segments=segments)
    mean_C = seg(s_T)[:n_chunks] / jnp.maximum(size_C, 1)
    low_C = jax.ops.segment_min(jnp.where(valid_T, s_T, jnp.inf), chunk_T, segments)[:n_chunks]
    shifted = s_T - jnp.minimum(jnp.append(low_C, 0.0)[chunk_T], 0.0)
    p = shifted / (jnp.append(seg(shifted)[:n_chunks], 1.0)[chunk_T] + EPSILON)
    h_C = -seg(jnp.where(valid_T, p * jnp.log(p + EPSILON), 0.0))[:n_chunks]
    log_size = jnp.log(jnp.maximum(size_C, 2).astype(jnp.float32))
    entropy_C = jnp.where(size_C > 1, jnp.clip(h_C / log_size, 0.0, 1.0), 0.0)
    spiky_C = (mean_C >= _lower_median(mean_C, real_C)) & (
      entropy_C < _lower_median(entropy_C, real_C)
    )
    cap_C = jnp.where(real_C, jnp.where(spiky_C, jnp.minimum(size_C, low), size_C), 0)
    order_C = jnp.argsort(-jnp.where(real_C, mean_C, -jnp.inf), stable=True)
    cap_sorted = cap_C[order_C]
    before = jnp.cumsum(cap_sorted) - cap_sorted
    alloc_C = jnp.zeros_like(cap_C).at[order_C].set(jnp.clip(b - before, 0, cap_sorted))
    # each token's rank inside its chunk, by score (ties to the lower position)
    by_score = jnp.lexsort((jnp.arange(T), -s_T, chunk_T))
    inner = jnp.zeros(T, jnp.int32).at[by_score].set(jnp.arange(T, dtype=jnp.int32))
    inner = inner - jnp.append(chunk_start_C, 0)[chunk_T]
    keep = valid_T & (inner < jnp.append(alloc_C, 0)[chunk_T])
    left = b - keep.sum()  # what the spiky chunks left unspent: the best remaining tokens
    rest = select.ranks(jnp.where(valid_T & ~keep, s_T, -jnp.inf))
    return keep | (valid_T & ~keep & (rest < left))

  return jax.vmap(row)(scores_RT.astype(jnp.float32), budget_R)
