"""The methods, one class each: scorers that select once after the prompt, and decode-time
evictors with their state machines. The reference each follows is in its docstring and in
the methods catalogue (``docs/methods.md``); the registered names and their defaults are in
:mod:`kvjax.policies.registry`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_bool, check_choice, check_int, check_window
from kvjax.policies.core import Policy
from kvjax.policies.decode_policy import DecodePolicy, gather_slots
from kvjax.policies.evidence import Evidence, EvidenceRequest
from kvjax.policies.protocols import Rescoring
from kvjax.policies.window import WindowPolicy

Array = jax.Array


def _recency(evidence: Evidence, policy: str) -> Array:
  L, H, T = evidence.positions_shape(policy)
  return scores_lib.recency(T, (L, H))


# --------------------------------------------------------------------------- the full cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Full(Policy):
  """The uncompressed cache: every position of every head, no budget.

  The baseline every policy is measured against.
  """

  needs: ClassVar[frozenset[str]] = frozenset()
  requires_budget: ClassVar[bool] = False
  allocator: alloc_lib.Allocator = alloc_lib.KeepAll()

  def __post_init__(self):
    super().__post_init__()
    if self.channel_ratio is not None or self.decode_every is not None:
      raise ValueError(
        "options: the full cache keeps every token and every key channel; expected no "
        f"channel_ratio or decode_every, got {self.channel_ratio!r}, {self.decode_every!r}"
      )

  @property
  def observation_window(self) -> int:
    """0: the full cache observes nothing."""
    return 0

  def score(self, evidence):
    """Zeros: every position is kept alike."""
    return jnp.zeros(evidence.positions_shape(self.label), jnp.float32)

  def budgets(self, evidence, scores_LHT, budget):
    """``T`` for every head; a given budget is checked (it must keep every token)."""
    if budget is not None:  # a given budget is checked (it must keep every token)
      return super().budgets(evidence, scores_LHT, budget)
    L, H, T = scores_LHT.shape
    return jnp.full((L, H), T, jnp.int32)


# --------------------------------------------------------------------------- decode-time evictors


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindow(DecodePolicy):
  """The last ``budget`` tokens."""

  needs: ClassVar[frozenset[str]] = frozenset()

  def score(self, evidence):
    """The positions' recency."""
    return _recency(evidence, self.label)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(DecodePolicy):
  """StreamingLLM (Xiao et al. 2023, ``StartRecentKVCache``): sinks plus the most recent tokens.

  ``sinks`` initial tokens (4) plus the most recent ones; the sinks are a row's first real
  tokens.
  """

  needs: ClassVar[frozenset[str]] = frozenset()
  data_options: ClassVar[tuple[str, ...]] = ("sinks",)
  sinks: int = 4

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("sinks", self.sinks)

  def score(self, evidence):
    """Recency, the first ``sinks`` positions protected (``StartRecentKVCache``)."""
    L, H, T = evidence.positions_shape(self.label)
    return scores_lib.streaming(T, (L, H), sinks=self.sinks)

  def scores_row(self, evidence):
    """As :meth:`score`, the sinks counted from the row's first real token."""
    shape = self.scores(evidence).shape
    if evidence.valid_T is None:
      return scores_lib.streaming(shape[-1], shape[:2], sinks=self.sinks)
    pad = shape[-1] - evidence.valid_T.sum()
    return scores_lib.streaming(shape[-1], shape[:2], sinks=pad + self.sinks)

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    """Recency, the first ``sinks`` positions protected."""
    recency = positions_HC.astype(jnp.float32)
    return jnp.where(positions_HC < self.sinks, jnp.inf, recency)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeavyHitters(Policy):
  """H2O's heavy hitters selected once after the prompt (:func:`kvjax.scores.h2o_from_column_sums`).

  ``form`` ``"causal"`` (accumulated attention, the last ``recent`` protected) or
  ``"kvfactory_legacy"`` (KVCache-Factory's published non-causal column sums).
  """

  window_field: ClassVar[str | None] = "recent"
  form: str = "causal"
  recent: int | None = 8

  def __post_init__(self):
    super().__post_init__()
    check_choice("form", self.form, scores_lib.H2O_FORMS, self.label)
    if self.recent is not None:
      scores_lib.check_count("recent", self.recent)

  @property
  def evidence_fields(self):
    """The base fields plus the column sums its ``form`` reads."""
    sums = "legacy_column_sums_LHT" if self.form == "kvfactory_legacy" else "column_sums_LHT"
    return super().evidence_fields | {sums}

  needs: ClassVar[frozenset[str]] = frozenset()

  def score(self, evidence):
    """H2O's column sums under ``form``, the last ``recent`` protected."""
    field = "legacy_column_sums_LHT" if self.form == "kvfactory_legacy" else "column_sums_LHT"
    sums = evidence.need(field, self.label)
    recent = 0 if self.recent is None else self.recent
    return scores_lib.h2o_from_column_sums(sums, form=self.form, recent=recent)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObservedAttention(HeavyHitters):
  """kvpress ``ObservedAttentionPress``: each column sum divided by the queries that see the key.

  No position is protected.
  """

  window_field: ClassVar[str | None] = None
  form: str = "kvpress"
  recent: int | None = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(Rescoring, HeavyHitters, DecodePolicy):
  """H2O (Zhang et al. 2023, ``H2OKVCache_LayerWise``): heavy hitters by accumulated attention.

  Heavy hitters by the attention the compressed cache receives, accumulated at every step, the
  last ``recent`` tokens on probation (8, KVCache-Factory's window; ``None``: half of each
  head's budget, the official 1:1 heavy:recent split).
  """

  @property
  def rescores(self) -> bool:
    """Whether the recent window is half of each head's budget (``recent=None``)."""
    return self.recent is None

  def rescore(self, evidence, scores_LHT, budget_LH, capacity):
    """The scores with the last ``budget_LH // 2`` positions protected (the official split)."""
    return scores_lib.protect(scores_LHT, recent=budget_LH // 2)

  def min_budget(self, window):
    """``recent + 1`` (1 with ``recent=None``)."""
    return 1 if self.recent is None else int(self.recent) + 1

  def _low_budget_message(self, low, floor):
    return (
      f"budget: {low} must exceed H2O's recent window ({self.recent}) so that heavy hitters "
      "have slots"
    )

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    """The prompt's column sums at the kept slots."""
    sums = evidence.need("column_sums_LHT", self.label)
    return gather_slots(sums, idx_LHC, kept_LHC, idx_LHC.shape[-2])

  def observe(self, state_HC, attn_HC):
    """The state plus the step's attention (H2O's accumulation)."""
    return state_HC + attn_HC

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    """The accumulated attention, the last ``recent`` positions protected."""
    recent = budget_H[..., None] // 2 if self.recent is None else self.recent
    return jnp.where(positions_HC > t - recent, jnp.inf, state_HC)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TOVA(WindowPolicy, DecodePolicy):
  """TOVA (Oren et al. 2024, ``TOVACache``): the last query's attention, averaged over heads.

  The average runs over the heads of a layer; layer-wise, so every head of a layer holds the
  same positions.
  """

  def score_rows(self, attn_LHWT):
    """The last row's attention averaged over the heads (``TOVACache``)."""
    return scores_lib.tova(attn_LHWT[:, :, -1, :])

  def check_allocation(self, budget_LH, window: int | None = None) -> None:
    """Checks that every head of a layer has the same budget (one index set per layer).

    Args:
      budget_LH: the allocation, ``[L, H]``.
      window: the protected window (:meth:`BudgetRules.check_allocation`).

    Raises:
      ValueError: two heads of a layer have different budgets.
    """
    super().check_allocation(budget_LH, window)
    b = np.asarray(budget_LH)
    if (b != b[..., :1]).any():
      raise ValueError(
        "budget: TOVA is layer-wise; expected the same budget for every head of a layer"
      )

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    """The prompt's scores at the kept slots."""
    return gather_slots(scores_LHT, idx_LHC, kept_LHC, idx_LHC.shape[-2])

  def observe(self, state_HC, attn_HC):
    # every head of a layer holds the same positions in the same slots: a mean over heads
    """The step's attention averaged over the layer's heads."""
    return jnp.broadcast_to(attn_HC.mean(-2, keepdims=True), attn_HC.shape)

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    """The last step's head-averaged attention."""
    return state_HC


# --------------------------------------------------------------------------- window scorers


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(WindowPolicy):
  """SnapKV (Li et al. 2024, ``SnapKVCluster.update_kv``): the window queries' votes for each key.

  The votes for each prefix key, pooled (:func:`kvjax.scores.snapkv`), the window protected.
  With an allocator it is PyramidKV (:class:`~kvjax.policies.Pyramid`), Ada-KV
  (:class:`~kvjax.policies.AdaKV`) or HeadKV (:class:`~kvjax.policies.HeadKV`).
  """

  windowed: ClassVar[bool] = True
  window_field: ClassVar[str | None] = "window"
  kernel: int = 7
  pool: str = "max"
  reduce: str = "sum"
  window: int | None = None

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_kernel(self.kernel)
    check_choice("pool", self.pool, scores_lib.POOLS, self.label)
    check_choice("reduce", self.reduce, scores_lib.REDUCES, self.label)
    check_window(self.window, self.label)

  def score_rows(self, attn_LHWT):
    """SnapKV's pooled window votes (:func:`kvjax.scores.snapkv`)."""
    return scores_lib.snapkv(
      attn_LHWT, kernel=self.kernel, pool=self.pool, reduce=self.reduce, window=self.window
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CAKE(Policy):
  """CAKE (Qin et al. 2025, ``CakeprefillKVCache``): ``mean + gamma * var`` of the window rows.

  Pooled, the window protected, under CAKE's layer preference
  (:class:`~kvjax.policies.CakeLayers`).
  """

  windowed: ClassVar[bool] = True
  window_field: ClassVar[str | None] = "window"
  allocator: alloc_lib.Allocator = alloc_lib.CakeLayers()
  gamma: float = 200.0
  kernel: int = 5
  window: int | None = None

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_kernel(self.kernel)
    budgets_lib.check_real("gamma", self.gamma, low=0.0)
    check_window(self.window, self.label)

  def score(self, evidence):
    """CAKE's ``mean + gamma * var`` of the window rows, pooled (:func:`kvjax.scores.cake`)."""
    attn = evidence.need("attn_window_LHWT", self.label)
    return scores_lib.cake(attn, gamma=self.gamma, kernel=self.kernel, window=self.window)


# --------------------------------------------------------------------------- other scorers


@dataclasses.dataclass(frozen=True, kw_only=True)
class KNorm(Policy):
  """Key norm (kvpress ``KnormPress``): the lowest ``||k||`` kept."""

  needs: ClassVar[frozenset[str]] = frozenset({"keys_LGTD"})

  def score(self, evidence):
    """Minus the key norm, ``-||k||_2`` (kvpress ``KnormPress``)."""
    return scores_lib.knorm(evidence.need("keys_LGTD", self.label))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Random(Policy):
  """Uniform random scores (kvpress ``RandomPress``): the floor every policy must beat."""

  needs: ClassVar[frozenset[str]] = frozenset({"rng"})

  def score(self, evidence):
    """Uniform random scores from ``evidence.rng`` (kvpress ``RandomPress``)."""
    shape = evidence.positions_shape(self.label)
    return scores_lib.random(evidence.need("rng", self.label), shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Oracle(Policy):
  """Future attention (an upper bound, not realisable): kvpress's optimal pruning."""

  needs: ClassVar[frozenset[str]] = frozenset({"future_attn_LHST"})

  def score(self, evidence):
    """The future queries' attention (:func:`kvjax.scores.oracle`)."""
    return scores_lib.oracle(evidence.need("future_attn_LHST", self.label))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDiff(Policy):
  """kvpress ``KeyDiffPress``: the keys least like the mean normalised key."""

  needs: ClassVar[frozenset[str]] = frozenset({"keys_LGTD"})

  def score(self, evidence):
    """Minus each key's cosine with the mean normalised key (kvpress ``KeyDiffPress``)."""
    return scores_lib.keydiff(evidence.need("keys_LGTD", self.label), evidence.valid_T)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LagKV(Policy):
  """kvpress ``LagKVPress``: each chunk's K/V spread against the next ``lag`` chunk.

  Ranked inside the chunk; ``sinks`` (4) and the tail chunk kept.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"keys_LGTD", "values_LGTD"})
  lag: int = 128
  sinks: int = 4

  def __post_init__(self):
    super().__post_init__()
    check_int("lag", self.lag, 1)
    scores_lib.check_count("sinks", self.sinks)

  def score(self, evidence):
    """LagKV's in-chunk ranks of the K/V spread (kvpress ``LagKVPress``)."""
    keys = evidence.need("keys_LGTD", self.label)
    values = evidence.need("values_LGTD", self.label)
    return scores_lib.lagkv(keys, values, lag=self.lag, sinks=self.sinks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttention(Policy):
  """kvpress ``ExpectedAttentionPress``: the softmax of the expected logits of future queries.

  The expectation is over the mean and covariance of the pre-RoPE prompt queries, RoPE averaged
  over the next 512 positions (computed by the model), times ``||v||``; ``sinks`` (4) kept.
  """

  needs: ClassVar[frozenset[str]] = frozenset(
    {"query_mean_LHD", "query_cov_LHDD", "keys_LGTD", "values_LGTD"}
  )
  sinks: int = 4
  use_covariance: bool = True
  use_vnorm: bool = True
  epsilon: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("sinks", self.sinks)
    check_bool("use_covariance", self.use_covariance)
    check_bool("use_vnorm", self.use_vnorm)
    budgets_lib.check_real("epsilon", self.epsilon, low=0.0)

  def evidence_request(self, T, *, reduce_rows=False) -> EvidenceRequest:
    """The base request, its query statistics skipping ``sinks`` tokens (kvpress ``n_sink``)."""
    return dataclasses.replace(super().evidence_request(T), n_sink=int(self.sinks))

  def score(self, evidence):
    """Expected attention times ``||v||`` (kvpress ``ExpectedAttentionPress``)."""
    name = self.label
    cov = evidence.need("query_cov_LHDD", name) if self.use_covariance else None
    values = evidence.need("values_LGTD", name) if self.use_vnorm else None
    return scores_lib.expected_attention(
      evidence.need("query_mean_LHD", name),
      cov,
      evidence.need("keys_LGTD", name),
      values,
      options=scores_lib.ExpectedAttentionOptions(
        sinks=self.sinks,
        use_covariance=self.use_covariance,
        use_vnorm=self.use_vnorm,
        epsilon=self.epsilon,
      ),
      valid_T=evidence.valid_T,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QFilter(Policy):
  """kvpress ``QFilterPress``: ``-<k, f>`` with the calibrated Q-Filter direction per KV head.

  The direction ``f`` is ``evidence.qfilters_LGD`` (:mod:`kvjax.model.calibrate`).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"keys_LGTD", "qfilters_LGD"})

  def score(self, evidence):
    """``-<k, f>`` per KV head (kvpress ``QFilterPress``)."""
    keys = evidence.need("keys_LGTD", self.label)
    return scores_lib.qfilter(keys, evidence.need("qfilters_LGD", self.label))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DuoAttention(Policy):
  """kvpress ``DuoAttentionPress``: streaming heads keep sinks and recent tokens.

  Streaming heads (:class:`~kvjax.policies.DuoSplit`) keep ``sinks`` sinks + ``budget - sinks``
  recent tokens (kvpress ``sink_size + recent_size``); retrieval heads keep everything.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"retrieval_heads_LG", "keys_LGTD"})
  data_options: ClassVar[tuple[str, ...]] = ("sinks",)
  allocator: alloc_lib.Allocator = alloc_lib.DuoSplit()
  sinks: int = 128

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("sinks", self.sinks)

  def score(self, evidence):
    """Recency with ``sinks`` protected, per KV head (kvpress ``DuoAttentionPress``)."""
    gates = evidence.need("retrieval_heads_LG", self.label)
    T = evidence.positions_shape(self.label)[2]
    return scores_lib.streaming(T, gates.shape, sinks=self.sinks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzip(Policy):
  """kvpress ``KVzipPress``: the max attention of the context-reconstruction queries.

  ``sinks`` (4) kept, one selection pooled over every layer and head
  (:class:`~kvjax.policies.Pooled`).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"reconstruction_attn_LGT"})
  allocator: alloc_lib.Allocator = alloc_lib.Pooled()
  sinks: int = 4

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("sinks", self.sinks)

  def score(self, evidence):
    """The reconstruction attention, ``sinks`` protected (kvpress ``KVzipPress``)."""
    attn = evidence.need("reconstruction_attn_LGT", self.label)
    return scores_lib.kvzip(attn, sinks=self.sinks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThinK(Policy):
  """kvpress ``ThinKPress`` alone: every token kept, the least important key channels pruned.

  The ``int(D * channel_ratio)`` least important key channels are pruned, scored with the last
  ``channel_window`` queries of the prompt (kvpress ``window_size``, 32), also as the last stage
  of :class:`~kvjax.policies.Composed` whatever the token stages observe (give any policy
  ``channel_ratio`` to compose it with its own observation window's queries).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"window_queries_LHWD", "keys_LGTD"})
  allocator: alloc_lib.Allocator = alloc_lib.KeepAll()
  channel_ratio: float | None = 0.5
  channel_window: int = 32

  def __post_init__(self):
    super().__post_init__()
    check_int("channel_window", self.channel_window, 1)
    object.__setattr__(self, "channel_window", int(self.channel_window))  # hashable, as given

  def score(self, evidence):
    """Recency (every token is kept; ThinK prunes channels, not tokens)."""
    return _recency(evidence, self.label)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RKV(Policy):
  """R-KV (official code): pooled window attention mixed with the key-cosine redundancy.

  ``mix_lambda`` (0.07) times the pooled window attention minus the rest times the key-cosine
  redundancy, ``window`` (8) kept; re-compresses every ``decode_every`` (128) generated tokens.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"window_queries_LHWD", "keys_LGTD"})
  windowed: ClassVar[bool] = True
  window_field: ClassVar[str | None] = "window"
  window: int | None = 8
  kernel: int = 7
  mix_lambda: float = 0.07
  threshold: float = 0.5
  decode_every: int | None = 128

  def __post_init__(self):
    super().__post_init__()
    check_window(self.window, self.label)
    scores_lib.check_kernel(self.kernel)
    budgets_lib.check_real("mix_lambda", self.mix_lambda, low=0.0, high=1.0)
    budgets_lib.check_real("threshold", self.threshold, low=-1.0, high=1.0)

  def score(self, evidence):
    """R-KV's mix of importance and redundancy (:func:`kvjax.scores.rkv`, official code)."""
    return scores_lib.rkv(
      evidence.need("window_queries_LHWD", self.label),
      evidence.need("keys_LGTD", self.label),
      window=self.window,
      kernel=self.kernel,
      mix_lambda=self.mix_lambda,
      threshold=self.threshold,
      valid_T=evidence.valid_T,
    )
