"""Fast KVzip: gates trained on KVzip's scores score every KV pair from its attention input
(kvpress ``FastKVzipPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy

Array = jax.Array

FIELD = "fastkvzip_LGT"
LONG_CONTEXT = 32000  # FastKVzipPress: from this many tokens the window is window_size
PROTECTED = 1.0  # what kvpress writes over the sinks and the window: above every gate score


def window_lengths(T: int, window_ratio: float, window_size: int) -> np.ndarray:
  """The protected local window of a context of each length ``n`` from 0 to ``T``.

  As kvpress ``FastKVzipPress._score_fast``: ``max(1, int(n * window_ratio))`` below 32000
  tokens, ``window_size`` from there; computed on the host in double precision, as Python does.

  Args:
    T: the longest length.
    window_ratio: the window's share of a short context.
    window_size: the window of a long context.

  Returns:
    int32 ``[T + 1]``.
  """
  n = np.arange(T + 1)
  short = np.maximum(1, np.floor(n * float(window_ratio))).astype(np.int64)
  return np.where(n < LONG_CONTEXT, short, window_size).astype(np.int32)


def fastkvzip_scores(
  fastkvzip_LGT: Array,
  *,
  sinks: int = 4,
  window_ratio: float = 0.02,
  window_size: int = 4096,
  valid_T: Array | None = None,
) -> Array:
  """kvpress ``FastKVzipPress``'s scores: the gates' scores with the first ``sinks`` positions
  and the local window set to 1.0.

  Args:
    fastkvzip_LGT: ``evidence.fastkvzip_LGT``, ``[L, G, T]`` in ``(0, 1)``.
    sinks: the protected first positions (kvpress ``n_sink``).
    window_ratio: the window's share of a context under 32000 tokens.
    window_size: the window from 32000 tokens on.
    valid_T: the row's real positions, bool ``[T]``, real ones first (``None``: all real): the
      context length ``n`` is their count and the window ends at ``n``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: evidence that is not a floating rank-3 array, or a ``sinks`` that is negative,
      not an integer or beyond int32.
  """
  if getattr(fastkvzip_LGT, "ndim", None) != 3 or not jnp.issubdtype(
    fastkvzip_LGT.dtype, jnp.floating
  ):
    shape = getattr(fastkvzip_LGT, "shape", type(fastkvzip_LGT).__name__)
    raise ValueError(f"{FIELD}: expected a floating array [L, G, T], got {shape}")
  scores_lib.check_count("sinks", sinks)
  T = fastkvzip_LGT.shape[-1]
  n = T if valid_T is None else jnp.sum(valid_T).astype(jnp.int32)
  window = jnp.asarray(window_lengths(T, window_ratio, window_size))[n]
  pos = jnp.arange(T, dtype=jnp.int32)
  protected = (pos < sinks) | ((pos >= n - window) & (pos < n))
  return jnp.where(protected, PROTECTED, fastkvzip_LGT.astype(jnp.float32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FastKVzip(Policy):
  """Fast KVzip: trained gates' estimate of KVzip's score of every KV pair, sinks and a local
  window kept.

  Paper: Kim, Han and Yun, Fast KVzip: Efficient and Accurate LLM Inference with Gated KV
  Eviction (NAVER AI Lab, arXiv 2601.17668). Reference: kvpress 0.5.5
  ``presses/fastkvzip_press.py::FastKVzipPress``; the gates are trained as the official
  ``Janghyun1230/FastKVzip`` ``optim.py`` does (:mod:`kvjax.model.fastkvzip`). The evidence
  ``evidence.fastkvzip_LGT`` (:func:`kvjax.model.fastkvzip.fastkvzip_evidence`) is, per layer,
  KV head and position, the gate ``mean_r 1 / (1 + sum_s exp(<k_base_s, q_r> - <k, q_r> - b_r))``
  of low-rank queries ``q_r`` and key ``k`` projected from the position's attention input,
  against 16 learned sink keys ``k_base``. The first ``sinks`` (4) positions and the last
  ``max(1, int(n * window_ratio))`` (2 %) of an ``n``-token context (``window_size`` 4096 from
  32000 tokens on) score 1.0, above every gate score. The default allocator
  :class:`~kvjax.policies.Pooled` selects once over every layer and head, as kvpress
  (``Pooled(layerwise=True)``: the same count in every layer, kvpress ``layerwise=True``).

  Differences from kvpress:

  * the gates are trained here on shipped text and loaded from a file by path; kvpress
    downloads ``Jang-Hyun/Fast-KVzip`` from the Hugging Face hub (released for a few models).
  * the budget: kvpress takes ``compression_ratio`` and prunes ``int(L * G * T * ratio)`` pairs
    (``int(G * T * ratio)`` per layer with ``layerwise``); kvjax takes a per-head budget ``b``
    and keeps ``L * G * min(b, T)`` (``G * min(b, T)`` per layer): the same when ``T * ratio``
    is an integer. The protected positions count inside it, as in kvpress.
  * prefill only, as kvpress (its hook skips decoding); the official code's decoding-time
    eviction (``math/``) and its chunked prefill are not offered.
  * kvjax evicts the pruned pairs from a real cache; kvpress masks them in attention
    (``masked_key_indices``).
  * ties go to the lower layer, head and position; ``torch.topk`` leaves them unspecified.

  Attributes:
    sinks: the protected first positions (kvpress ``n_sink``, 4).
    window_ratio: the protected window's share of a context under 32000 tokens (0.02).
    window_size: the protected window from 32000 tokens on (4096).
  """

  needs: ClassVar[frozenset[str]] = frozenset({FIELD})
  allocator: alloc_lib.Allocator = alloc_lib.Pooled()
  sinks: int = 4
  window_ratio: float = 0.02
  window_size: int = 4096

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("sinks", self.sinks)
    budgets_lib.check_real("window_ratio", self.window_ratio, low=0.0, high=1.0)
    check_int("window_size", self.window_size, 1)

  def score(self, evidence):
    """The gates' scores, the sinks and the local window set to 1.0 (kvpress
    ``FastKVzipPress._score_fast``)."""
    return fastkvzip_scores(
      evidence.need(FIELD, self.label),
      sinks=self.sinks,
      window_ratio=self.window_ratio,
      window_size=self.window_size,
      valid_T=evidence.valid_T,
    )
