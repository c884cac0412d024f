"""kvpress's combinators as policies: presses in sequence, per chunk, per block, per phase.

* :class:`Composed`: scorers applied in sequence, each on the positions the previous kept
  (kvpress ``ComposedPress``).
* :class:`Chunked`: the budget spread evenly over fixed-size chunks of the prompt, each chunk
  ranked on its own (kvpress ``ChunkPress``, FINCH's chunking).
* :class:`Blockwise`: block-wise iterative selection (kvpress ``BlockPress``, KeyDiff's
  block prompt processing).
* :class:`PrefillDecoding` and :class:`RatioDecoding`: one policy for the prompt, another (or
  a growing target) for the re-compressions while decoding (kvpress ``PrefillDecodingPress``,
  ``DecodingPress``, ``CompressionRatioDecodingPress``).

A stage, chunk or block scores a subset of the prompt's positions on its own, so it reads
evidence that restricts to a subset: keys, values and CriticalKV's value norms per position
(:data:`RESTRICTABLE`), with the subset as the row's real positions (``valid_T``: KeyDiff's
anchor is the mean over the subset). Window-attention evidence does not restrict: kvpress
recomputes each chunk's window attention from that chunk's own last queries, which a prompt's
evidence does not hold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select
from kvjax.policies import allocators as alloc_lib
from kvjax.policies import methods
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.decode_policy import DecodePolicy
from kvjax.policies.evidence import Evidence, EvidenceRequest
from kvjax.policies.per_layer import n_kept
from kvjax.policies.protocols import Rescoring
from kvjax.policies.wrappers import Wrapper, check_base

Array = jax.Array

# per-position evidence a scorer may read on a subset of positions: field -> heads ("kv" or "q")
RESTRICTABLE = {"keys_LGTD": "kv", "values_LGTD": "kv", "value_out_norms_LHT": "q"}
# evidence without a position axis, shared by every subset: field -> heads
SHARED = {"qfilters_LGD": "kv"}


def check_restrictable(policy: Policy, role: str) -> None:
  """Checks that ``policy`` scores a subset of positions from restrictable evidence alone.

  Args:
    policy: the scorer.
    role: the option holding it, for the error.

  Raises:
    ValueError: ``policy`` is a decode-time policy, rescores, allocates its own budgets,
      protects a window, or reads evidence outside :data:`RESTRICTABLE` and :data:`SHARED`.
  """
  if not isinstance(policy, Policy):
    raise ValueError(f"{role}: expected a Policy, got {policy!r}")
  check_base(policy, role, given_budget=True)
  extra = sorted(set(policy.evidence_fields) - set(RESTRICTABLE) - set(SHARED))
  if extra or policy.windowed:
    raise ValueError(
      f"{role}: {policy.label!r} reads {extra or 'its observation window'}, which does not "
      f"restrict to a subset of positions; expected a scorer of {sorted(RESTRICTABLE)} "
      "(knorm, keydiff, qfilter)"
    )


def _rows(x: Array, kind: str, H: int) -> Array:
  """``[L, Hx, ...]`` evidence as ``[L * H, Hx / H or 1, ...]``: one row per scored head."""
  L, Hx = x.shape[:2]
  if Hx < H:  # a KV-head field under query-head scores: each query head reads its KV head
    x = jnp.repeat(x, H // Hx, axis=1)
    Hx = H
  return x.reshape((L * H, Hx // H) + x.shape[2:])


def restricted_scores(
  policy: Policy, evidence: Evidence, mask_LHT: Array, gqa: str = "mean"
) -> Array:
  """Scores each ``(layer, head)`` row on its own subset of positions.

  Each row's evidence is its slice of the :data:`RESTRICTABLE` fields with ``valid_T`` the
  row's subset; the scorer's heads inside a row (a KV head's query heads) are grouped by
  ``gqa``. Positions outside the subset score ``-inf``.

  Args:
    policy: a scorer :func:`check_restrictable` accepts.
    evidence: the prompt's evidence.
    mask_LHT: each row's subset, bool ``[L, H, T]`` (``H``: KV or query heads).
    gqa: how a row's several heads are grouped.

  Returns:
    fp32 scores ``[L, H, T]``.
  """
  L, H, T = mask_LHT.shape
  fields = {
    k: _rows(getattr(evidence, k), kind, H)
    for k, kind in {**RESTRICTABLE, **SHARED}.items()
    if getattr(evidence, k) is not None
  }

  def row(fields_row, valid_T):
    ev = Evidence(**{k: v[None] for k, v in fields_row.items()}, valid_T=valid_T)
    s = policy.score(ev)  # [1, heads of the row, T]
    return scores_lib.group(s, 1, gqa)[0, 0] if s.shape[1] != 1 else s[0, 0]

  out = jax.vmap(row)(fields, mask_LHT.reshape(L * H, T)).reshape(L, H, T)
  return jnp.where(mask_LHT, out, -jnp.inf)


def _valid_count(evidence: Evidence, T: int):
  return T if evidence.valid_T is None else evidence.valid_T.sum()


# --------------------------------------------------------------------------- Composed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Composed(Policy):
  """Scorers in sequence, each on the positions the previous kept (kvpress ``ComposedPress``).

  Reference: kvpress 0.5.5 ``presses/composed_press.py::ComposedPress``: each press compresses
  the cache the previous one left, with its own ``compression_ratio`` of that cache's length.
  Stage ``j`` before the last keeps ``n_j = max(1, int(n_{j-1} * (1 - compression_ratios[j])))``
  of the ``n_{j-1}`` positions the previous stages kept (``n_0``: the row's real positions);
  the last stage keeps ``min(budget, n_{S-1})`` of them: :meth:`budgets` caps the budget there,
  so exactly that many are kept. A last ``ThinK`` stage (one that keeps every token) becomes the
  policy's ``channel_ratio`` and ``channel_window``: ThinK on the kept keys, scored with its own
  window of queries, kvpress's ``ComposedPress([press, ThinKPress])``.

  The first stage is any budget-free prefill scorer (SnapKV included); a later stage scores the
  survivors of its row alone (:func:`restricted_scores`: KeyDiff's anchor is their mean), so it
  reads restrictable evidence only (:func:`check_restrictable`). The policy's ``num_kv_heads``
  and ``gqa`` group every stage's scores (a stage's own grouping options are not read).

  Differences from kvpress: the last stage's count is the budget in tokens (kvpress: its
  ``compression_ratio``); stages rank per row at the policy's granularity (query heads unless
  ``num_kv_heads``), ties to the lower position (kvpress: ``torch.topk`` per KV head); a later
  window-attention stage, which kvpress feeds the uncompressed attention (eager) or a causal
  mask misplaced on the compacted keys (sdpa), is refused; the first stage's protected window is
  not protected from later stages (``windowed`` is false), as in kvpress.

  Attributes:
    stages: the scorers, applied in order (at least one token stage).
    compression_ratios: kvpress's ratio of every token stage but the last, floats in ``[0, 1)``.
  """

  needs: ClassVar[frozenset[str]] = frozenset()
  stages: tuple[Policy, ...]
  compression_ratios: tuple[float, ...] = ()

  def __post_init__(self):
    for name in ("stages", "compression_ratios"):
      if isinstance(getattr(self, name), list):
        object.__setattr__(self, name, tuple(getattr(self, name)))
    stages = self.stages
    if not isinstance(stages, tuple) or not stages:
      raise ValueError(f"stages: expected a non-empty tuple of policies, got {stages!r}")
    for s in stages:
      if not isinstance(s, Policy):
        raise ValueError(f"stages: expected policies, got {s!r}")
    tokens = self.token_stages
    if not tokens:
      raise ValueError("stages: expected a token stage before ThinK, e.g. (SnapKV(), ThinK())")
    if any(isinstance(s.allocator, alloc_lib.KeepAll) for s in tokens):
      raise ValueError("stages: ThinK (every token kept) may only be the last stage")
    if len(tokens) < len(stages):
      ratio = stages[-1].channel_ratio
      if self.channel_ratio is not None and self.channel_ratio != ratio:
        raise ValueError(
          f"channel_ratio: {self.channel_ratio!r} disagrees with the ThinK stage's {ratio!r}"
        )
      object.__setattr__(self, "channel_ratio", ratio)
    super().__post_init__()
    check_base(tokens[0], "stages[0]", given_budget=True)
    if tokens[0].channel_ratio is not None or tokens[0].decode_every is not None:
      raise ValueError("stages: a stage's channel_ratio or decode_every is the Composed policy's")
    for i, s in enumerate(tokens[1:], 1):
      check_restrictable(s, f"stages[{i}]")
    ratios = self.compression_ratios
    if not isinstance(ratios, tuple) or len(ratios) != len(tokens) - 1:
      raise ValueError(
        f"compression_ratios: expected {len(tokens) - 1} ratios (one per token stage but the "
        f"last), got {ratios!r}"
      )
    for r in ratios:
      budgets_lib.check_real("compression_ratios", r, low=0.0, high=1.0)
      if r >= 1:
        raise ValueError(f"compression_ratios: expected floats in [0, 1), got {r!r}")

  @property
  def token_stages(self) -> tuple[Policy, ...]:
    """The stages that select tokens (all but a last ThinK)."""
    last = self.stages[-1]
    return self.stages[:-1] if isinstance(last.allocator, alloc_lib.KeepAll) else self.stages

  @property
  def channel_window(self) -> int | None:
    """The ThinK stage's ``channel_window`` (``None`` without one)."""
    return self.stages[-1].channel_window if len(self.token_stages) < len(self.stages) else None

  @property
  def evidence_fields(self) -> frozenset[str]:
    """Every stage's fields (and ThinK's for ``channel_ratio``)."""
    out = super().evidence_fields
    for s in self.stages:
      out |= s.evidence_fields
    return out

  @property
  def observation_window(self) -> int:
    """The largest observation window of the stages."""
    return max(s.observation_window for s in self.stages)

  @property
  def options(self) -> dict:
    """The policy's own options (the stages are objects)."""
    return {"compression_ratios": self.compression_ratios, **super().options}

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The request for every stage's evidence (window rows kept, never reduced)."""
    return super().evidence_request(T)

  def stage_counts(self, evidence: Evidence, T: int) -> list:
    """The counts ``n_1`` to ``n_{S-1}``: what each token stage but the last keeps (kvpress's counts)."""
    n, out = _valid_count(evidence, T), []
    for r in self.compression_ratios:
      n = n_kept(n, r, max_n=T)
      out.append(n)
    return out

  def survivors(self, evidence: Evidence) -> tuple[Array, Array | None]:
    """The last token stage's scores on the positions the earlier stages kept.

    Args:
      evidence: the prompt's evidence.

    Returns:
      ``(scores_LHT, kept_LHT)``: the last stage's scores (``-inf`` outside the survivors) and
      the survivors of the earlier stages (``None`` for one token stage).
    """
    tokens = self.token_stages
    s = self.grouped(tokens[0].score(evidence))
    L, H, T = s.shape
    if evidence.valid_T is not None:
      s = jnp.where(evidence.valid_T[None, None], s, -jnp.inf)
    kept = None
    for stage, n in zip(tokens[1:], self.stage_counts(evidence, T), strict=True):
      kept = select.top_mask(s, jnp.broadcast_to(jnp.asarray(n, jnp.int32), (L, H)))
      s = restricted_scores(stage, evidence, kept, self.gqa)
    return s, kept

  def score(self, evidence):
    """The last token stage's scores on the earlier stages' survivors (kvpress ``ComposedPress``)."""
    return self.survivors(evidence)[0]

  def scores(self, evidence):
    """:meth:`score`, already at the policy's granularity."""
    return self.score(evidence)

  def budgets(self, evidence, scores_LHT, budget):
    """The allocator's budget, capped by what the earlier stages kept."""
    budget_LH = super().budgets(evidence, scores_LHT, budget)
    counts = self.stage_counts(evidence, scores_LHT.shape[-1])
    return jnp.minimum(budget_LH, counts[-1]) if counts else budget_LH


# --------------------------------------------------------------------------- Chunked


def _chunked(x: Array, axis: int, chunk: int, n: int) -> Array:
  """Splits ``x``'s position ``axis`` into ``n`` chunks of ``chunk`` (zero-padded), chunks first."""
  axis = axis % x.ndim
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * chunk - x.shape[axis])
  x = jnp.pad(x, pad)
  x = x.reshape(x.shape[:axis] + (n, chunk) + x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Restricted(Wrapper):
  """A wrapper whose ``base`` scores subsets of the positions on their own: the base is checked
  by :func:`check_restrictable`, and a subset's share of the budget (not a window) bounds what
  it keeps."""

  def __post_init__(self):
    super().__post_init__()
    check_restrictable(self.base, "base")

  @property
  def windowed(self) -> bool:
    """False: the base protects no window."""
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunked(_Restricted):
  """``base`` scored and ranked in each fixed-size chunk on its own (kvpress ``ChunkPress``).

  Reference: kvpress 0.5.5 ``presses/chunk_press.py::ChunkPress`` (FINCH's chunking: Corallo &
  Papotti, "FINCH: Prompt-guided Key-Value Cache Compression", TACL 2024), which scores each
  ``chunk_length`` slice of the context with its scorer alone and keeps
  ``max(1, int(len_c * (1 - compression_ratio)))`` of each.

  Each chunk of ``chunk`` positions (from the row's first real token; the last may be shorter)
  is scored by ``base`` on its own evidence (:func:`restricted_scores`'s restriction: KeyDiff's
  anchor is the chunk's mean key), and each position's score is its rank in its chunk over the
  chunk's length, ``-(rank + 1) / len_c``. The budget ``b`` then keeps the positions ranked
  best in proportion to their chunk: chunk ``c`` keeps ``floor(len_c * b / T)`` and the remaining
  ``b - sum_c floor(len_c * b / T)`` go to the next-best fractions, ties to earlier chunks.
  Exactly ``min(b, T)`` are kept; the scores do not depend on the budget, so budgets stay data,
  per head.

  Differences from kvpress: the budget is tokens, ``b``, and its total is kept exactly (kvpress
  keeps ``sum_c max(1, int(len_c * (1 - r)))``, which equals ``b = T * (1 - r)`` when every
  ``len_c * (1 - r)`` is an integer, and can keep fewer or, through the floor of 1, more); a
  chunk may keep nothing under a budget below the chunk count; chunks start at the row's first
  real token; a window-attention base (kvpress recomputes each chunk's window attention from its
  last queries, rotated at the prompt's last positions) is refused.

  Attributes:
    base: the scorer of each chunk, reading restrictable evidence only
      (:func:`check_restrictable`: knorm, keydiff, ...).
    chunk: the chunk length (kvpress ``chunk_length``, 1024).
  """

  chunk: int = 1024

  def __post_init__(self):
    super().__post_init__()
    check_int("chunk", self.chunk, 1)

  def _chunk_scores(self, evidence: Evidence) -> Array:
    L, H, T = evidence.positions_shape(self.label)
    n = math.ceil(T / self.chunk)
    valid = jnp.ones((T,), bool) if evidence.valid_T is None else evidence.valid_T
    fields = {
      k: _chunked(getattr(evidence, k), -2 if k.endswith("TD") else -1, self.chunk, n)
      for k in RESTRICTABLE
      if getattr(evidence, k) is not None
    }
    shared = {k: getattr(evidence, k) for k in SHARED if getattr(evidence, k) is not None}
    valid_nC = _chunked(valid, 0, self.chunk, n)

    def one(fields_c, valid_c):
      return self.grouped(self.base.score(Evidence(**fields_c, **shared, valid_T=valid_c)))

    s = jax.vmap(one)(fields, valid_nC)  # [n, L, H, chunk]
    s = jnp.where(valid_nC[:, None, None], s, -jnp.inf)
    rank = select.ranks(jnp.moveaxis(s, 0, 2))  # [L, H, n, chunk]
    length_n = valid_nC.sum(-1).astype(jnp.float32)
    frac = (rank + 1).astype(jnp.float32) / jnp.maximum(length_n, 1.0)[None, None, :, None]
    out = jnp.where(valid_nC[None, None], -frac, -jnp.inf).reshape(L, -1, n * self.chunk)
    return out[..., :T]

  def score(self, evidence):
    """Each position's rank in its chunk over the chunk's length, negated (kvpress ``ChunkPress``)."""
    if evidence.valid_T is None:
      return self._chunk_scores(evidence)
    pad = evidence.valid_T.shape[-1] - evidence.valid_T.sum()
    return jnp.roll(self._chunk_scores(evidence.rolled(-pad)), pad, axis=-1)

  def scores(self, evidence):
    """:meth:`score`, already at the policy's granularity."""
    return self.score(evidence)

  def scores_row(self, evidence):
    """:meth:`score`: chunks already count from the row's first real token."""
    return self.score(evidence)


# --------------------------------------------------------------------------- Blockwise


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blockwise(Rescoring, _Restricted):
  """Block-wise iterative selection under ``base`` (kvpress ``BlockPress``).

  Reference: kvpress 0.5.5 ``presses/block_press.py::BlockPress``, simulating the block prompt
  processing of KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for
  Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364).

  With a budget ``b`` per row, the first ``b`` real positions are kept; then each block of
  ``block`` positions after them joins the kept ones, ``base`` scores that candidate set on its
  own (:func:`restricted_scores`: KeyDiff's anchor is the candidates' mean key) and the best
  ``b`` stay. Exactly ``min(b, T)`` are kept; a budget ``>= T`` keeps everything. The loop runs
  ``ceil(T / block)`` steps (a step past the prompt's end changes nothing), so budgets are data,
  per head, and never retrace.

  Differences from kvpress: the budget is tokens (kvpress ``int(T * (1 - compression_ratio))``);
  rows are ranked at the policy's granularity, ties to the lower position (kvpress: ``topk``
  per KV head); the base sees the candidates as a set (kvpress gathers them in its top-k order,
  which only an order-dependent scorer would notice); a window-attention base (kvpress
  recomputes the window attention from each block's last queries) is refused.

  Attributes:
    base: the scorer of each candidate set (:func:`check_restrictable`: knorm, keydiff, ...).
    block: the block length (kvpress ``block_size``, 128).
  """

  block: int = 128

  def __post_init__(self):
    super().__post_init__()
    check_int("block", self.block, 1)

  def rescore(self, evidence, scores_LHT, budget_LH, capacity):
    """The block-wise iteration's kept set as 1 (kept) and 0 (kvpress ``BlockPress``)."""
    L, H, T = scores_LHT.shape
    valid = jnp.ones((T,), bool) if evidence.valid_T is None else evidence.valid_T
    valid = valid[None, None]
    order_T = jnp.cumsum(valid, axis=-1) - 1  # each real position's rank among the real ones
    b = jnp.minimum(budget_LH, valid.sum())[..., None]  # [L, H, 1]
    kept = valid & (order_T < b)

    def step(k, kept):
      start = b + k * self.block
      block = valid & (order_T >= start) & (order_T < start + self.block)
      candidates = kept | block
      s = restricted_scores(self.base, evidence, candidates, self.gqa)
      return select.top_mask(s, b[..., 0]) & candidates

    kept = jax.lax.fori_loop(0, math.ceil(T / self.block), step, kept)
    return jnp.where(kept, 1.0, 0.0)


# --------------------------------------------------------------------------- decoding


def _check_prefill(policy, role: str) -> None:
  if not isinstance(policy, Policy):
    raise ValueError(f"{role}: expected a Policy, got {policy!r}")
  if isinstance(policy, DecodePolicy) or policy.decode_every is not None:
    raise ValueError(
      f"{role}: {policy.label!r} acts while decoding itself; expected a prefill scorer"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillDecoding(Policy):
  """One policy for the prompt, another re-compressing every ``decode_every`` generated tokens.

  Reference: kvpress 0.5.5 ``presses/prefill_decoding_press.py::PrefillDecodingPress`` with a
  ``presses/decoding_press.py::DecodingPress(base_press, compression_interval, target_size)``
  as its decoding press.

  The prompt's selection is ``prefill``'s under the budget (scores, allocator and selection all
  ``prefill``'s; :class:`~kvjax.policies.Full` for kvpress's ``prefilling_press=None``); after
  every ``decode_every`` generated tokens the cache is re-compressed by ``decoding``'s scores to
  ``decode_budget`` per head (:meth:`decode_budgets`: the prompt's budgets when ``None``), over
  every token it holds, as ``DecodingPress.compress`` hands its base press the whole cache.
  :meth:`recompress_keep` is that step on a cache's evidence.

  In the model's cache (``km.generate``, ``generate_configs``, ``stream_logprobs``) the
  re-compression (:func:`kvjax.model.cache.recompress`) reads :meth:`decode_scores` and
  :meth:`decode_budgets` over the evidence it rebuilds on its own slots (the fields and window
  of :attr:`decode_policy`, ``decoding``), keeps ``min(decode budget, filled)`` per head, and
  the cache holds :meth:`decode_capacity`, ``max(prompt budget, decode budget) +
  decode_every`` slots.

  Differences from kvpress: the budgets are tokens (kvpress's ``target_size`` is
  ``decode_budget``); ``DecodingPress`` also compresses when a step's query length reaches
  ``target_size`` (a multi-token decode step), which one-token decoding never meets; the
  decoding scorer ranks at the prompt policy's granularity (query heads unless its
  ``num_kv_heads``; the model's KV cache then takes each group's mean, as kvpress), ties to the
  lower position.

  Attributes:
    prefill: the prompt's policy (a prefill scorer, any allocator).
    decoding: the re-compression's scorer (a budget-free prefill scorer).
    decode_every: kvpress ``compression_interval``: generated tokens between re-compressions.
    decode_budget: kvpress ``target_size``: each head's slots after a re-compression
      (``None``: the prompt's budgets).
  """

  needs: ClassVar[frozenset[str]] = frozenset()
  prefill: Policy
  decoding: Policy
  decode_every: int | None = 512
  decode_budget: int | None = None

  def __post_init__(self):
    _check_prefill(self.prefill, "prefill")
    _check_prefill(self.decoding, "decoding")
    check_base(self.decoding, "decoding", given_budget=True)
    if self.decode_every is None:
      raise ValueError("decode_every: expected an int >= 1 (kvpress compression_interval)")
    if self.prefill.channel_ratio is not None:
      raise ValueError(
        "prefill: ThinK's channel_ratio prunes the prompt's keys once, which a re-compression "
        "while decoding cannot follow; expected a prefill policy without channel_ratio"
      )
    object.__setattr__(self, "allocator", self.prefill.allocator)
    super().__post_init__()
    if self.decode_budget is not None:
      check_int("decode_budget", self.decode_budget, 1)

  @property
  def requires_budget(self) -> bool:  # type: ignore[override]
    """Whether the prompt's policy takes a budget (not :class:`~kvjax.policies.Full`)."""
    return self.prefill.requires_budget

  @property
  def rescores(self) -> bool:
    """Whether the prompt's policy rescores under its budget (CriticalKV)."""
    return self.prefill.rescores

  @property
  def decode_policy(self) -> Policy:
    """``decoding``: its evidence and window are what a re-compression rebuilds."""
    return self.decoding

  @property
  def windowed(self) -> bool:
    """Whether the prompt's policy protects its window."""
    return self.prefill.windowed

  @property
  def evidence_fields(self) -> frozenset[str]:
    """Both policies' fields."""
    return self.prefill.evidence_fields | self.decoding.evidence_fields

  @property
  def observation_window(self) -> int:
    """The prompt's policy's: the prefill observes for it alone (a re-compression rebuilds the
    decoding scorer's window over the cache, :attr:`decode_policy`)."""
    return self.prefill.observation_window

  @property
  def options(self) -> dict:
    """The policy's own options (the two policies are objects)."""
    return {"decode_every": self.decode_every, "decode_budget": self.decode_budget}

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The request for both policies' evidence (window rows kept)."""
    return EvidenceRequest.for_fields(self.evidence_fields, min(self.observation_window, T))

  def protected_window(self, evidence):
    """The prompt's policy's protected window."""
    return self.prefill.protected_window(evidence)

  def score(self, evidence):
    """The prompt's policy's scores (kvpress's ``prefilling_press``)."""
    return self.prefill.score(evidence)

  def scores_row(self, evidence):
    """The prompt's policy's scores of one left-padded row (its sinks count from the row's
    first real token)."""
    return self.prefill.scores_row(evidence)

  def scores(self, evidence):
    """The prompt's policy's grouped scores."""
    return self.prefill.scores(evidence)

  def budgets(self, evidence, scores_LHT, budget):
    """The prompt's policy's budgets."""
    return self.prefill.budgets(evidence, scores_LHT, budget)

  def selection_scores(self, evidence, scores_LHT, budget_LH, *, capacity=None):
    """The prompt's policy's selection scores."""
    return self.prefill.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)

  def decode_scores(self, evidence: Evidence) -> Array:
    """The re-compression's scores over the cache's tokens (kvpress's ``decoding_press``).

    ``decoding`` scores the held slots as one row (:meth:`~kvjax.policies.Policy.scores_row`:
    the empty slots first, as left padding, so sinks count from the first held token).

    Args:
      evidence: the cache's evidence, its slots as positions (``valid_T``: the held slots).

    Returns:
      fp32 scores ``[L, H, T]`` at the prompt policy's granularity.
    """
    return self.prefill.grouped(self.decoding.scores_row(evidence))

  def decode_budgets(self, budget_LH: Array, seen) -> Array:
    """Each head's slots after a re-compression.

    Args:
      budget_LH: the prompt's budgets, int32 ``[L, H]``.
      seen: the tokens seen so far, prompt and generated (unused here).

    Returns:
      ``decode_budget`` for every head, or ``budget_LH`` when it is ``None``.
    """
    if self.decode_budget is None:
      return budget_LH
    return jnp.full_like(budget_LH, self.decode_budget)

  def decode_capacity(self, max_budget: int, T: int, new_tokens: int) -> int:
    """``max(max_budget, decode_budget) + decode_every``: the most slots a row holds.

    Args:
      max_budget: the largest prompt budget of any head.
      T: the prompt's tokens.
      new_tokens: the tokens decoded after it.

    Returns:
      The slots.
    """
    return max(max_budget, self.decode_budget or 0) + self.decode_every

  def recompress_keep(self, evidence: Evidence, budget_LH: Array, seen) -> Array:
    """The slots a re-compression keeps (kvpress ``DecodingPress.compress``).

    Args:
      evidence: the cache's evidence (``valid_T``: its filled slots).
      budget_LH: the prompt's budgets, int32 ``[L, H]``.
      seen: the tokens seen so far, prompt and generated (an int or traced int).

    Returns:
      Kept slots, bool ``[L, H, T]``: ``min(decode budget, filled)`` per head.
    """
    s = self.decode_scores(evidence)
    if evidence.valid_T is not None:
      s = jnp.where(evidence.valid_T[None, None], s, -jnp.inf)
      length = evidence.valid_T.sum()
    else:
      length = s.shape[-1]
    return select.top_mask(s, jnp.minimum(self.decode_budgets(budget_LH, seen), length))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RatioDecoding(PrefillDecoding):
  """Re-compression to a fixed fraction of every token seen (kvpress ``CompressionRatioDecodingPress``).

  Reference: kvpress 0.5.5
  ``presses/compression_ratio_decoding_press.py::CompressionRatioDecodingPress``: a
  ``DecodingPress`` whose target after ``seen`` tokens (prompt and generated, kvpress's
  ``position_ids.max() + 1``) is ``max(1, int(seen * (1 - compression_ratio)))``.

  The prompt's selection is ``prefill``'s (default: the full cache, kvpress's use of the press
  alone); every ``decode_every`` generated tokens the cache is re-compressed by ``decoding``'s
  scores to :meth:`decode_budgets`.

  ``seen`` is each row's own count (its last RoPE position + 1, padding excluded). The default
  :class:`~kvjax.policies.Full` prompt policy takes no budget: pass ``budget=None`` (or one
  ``>= T``, which keeps the same). The target grows with ``seen``, so the model's cache holds
  :meth:`decode_capacity` slots: the longest generation's target plus ``decode_every``.

  Differences from kvpress: as :class:`PrefillDecoding`'s.

  Attributes:
    compression_ratio: kvpress ``target_compression_ratio``, the fraction of the tokens seen
      that a re-compression removes, in ``[0, 1)``.
  """

  prefill: Policy = dataclasses.field(default_factory=methods.Full)
  compression_ratio: float = 0.5

  def __post_init__(self):
    super().__post_init__()
    budgets_lib.check_real("compression_ratio", self.compression_ratio, low=0.0, high=1.0)
    if self.compression_ratio >= 1:
      raise ValueError(
        f"compression_ratio: expected a float in [0, 1), got {self.compression_ratio!r}"
      )
    if self.decode_budget is not None:
      raise ValueError("decode_budget: the target follows compression_ratio; expected None")

  @property
  def options(self) -> dict:
    """The policy's own options."""
    return {**super().options, "compression_ratio": self.compression_ratio}

  def decode_budgets(self, budget_LH, seen):
    """``max(1, int(seen * (1 - compression_ratio)))`` for every head."""
    return jnp.broadcast_to(
      jnp.asarray(n_kept(seen, self.compression_ratio), jnp.int32), budget_LH.shape
    )

  def decode_capacity(self, max_budget: int, T: int, new_tokens: int) -> int:
    """The slots a row holds, ``max(max_budget, n_kept(T + new_tokens)) + decode_every``: the
    largest target of the generation (the targets grow with the tokens seen) plus the tokens
    between two re-compressions; the arguments are :meth:`PrefillDecoding.decode_capacity`'s."""
    return max(max_budget, n_kept(int(T + new_tokens), self.compression_ratio)) + self.decode_every
