"""Wrappers: combinators over any budget-free prefill scorer (kvpress's CriticalKVPress,
CriticalAdaKVPress and ChunkKVPress take any ScorerPress; these take any :class:`Policy`).

A wrapper holds its ``base`` policy and declares what the base declares (``critical.sinks``
is ``critical.base.sinks``, ``critical.window`` is ``critical.base.window``); the base's other
options are read on the base (``critical.base.kernel``). Its own fields are its options and the
common ones (grouping, ``channel_ratio``, ``decode_every``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.decode_policy import DecodePolicy
from kvjax.policies.evidence import EvidenceRequest
from kvjax.policies.protocols import Rescoring
from kvjax.policies.window import WindowScorer

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wrapper(Policy):
  """A policy over ``base``: by default it scores, protects and observes as the base does."""

  needs: ClassVar[frozenset[str]] = frozenset()  # the base's, through evidence_fields
  base: Policy

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.base, Policy):
      raise ValueError(f"base: expected a Policy, got {self.base!r}")

  # what the base declares, the wrapper declares: it reads nothing else of the base

  @property
  def sinks(self) -> int | None:
    """The base's declared sinks."""
    return self.base.sinks

  @property
  def window(self) -> int | None:
    """The base's declared window."""
    return self.base.window

  @property
  def restore_tokens(self) -> int | None:
    """The base's declared restore tokens."""
    return self.base.restore_tokens

  @property
  def recent(self):
    """The base's ``recent`` option, the one its ``window_field`` names for a heavy-hitter base
    (a caller reads the option ``window_field`` names).

    Raises:
      AttributeError: the base has no ``recent`` option.
    """
    return self.base.recent

  @property
  def windowed(self) -> bool:
    """Whether the base protects its observation window."""
    return self.base.windowed

  @property
  def window_field(self) -> str | None:
    """The base's window option."""
    return self.base.window_field

  @property
  def data_options(self) -> tuple[str, ...]:
    """``()``: a wrapper's options stay static (pytree aux data)."""
    return ()

  @property
  def evidence_fields(self) -> frozenset[str]:
    """The wrapper's fields and the base's."""
    return super().evidence_fields | self.base.evidence_fields

  @property
  def options(self) -> dict:
    """The base's options, then the wrapper's own."""
    own = super().options
    return {**self.base.options, **own}

  def score(self, evidence):
    """The base's scores."""
    return self.base.score(evidence)

  def score_rows(self, attn_LHWT: Array) -> Array:
    """Reduces window rows to scores as the base does.

    Args:
      attn_LHWT: window rows ``[., H, W, T]``.

    Returns:
      The base's :meth:`~kvjax.policies.WindowPolicy.score_rows` scores ``[., H, T]``.

    Raises:
      AttributeError: the base reads no window rows through ``score_rows``.
    """
    return self.base.score_rows(attn_LHWT)

  def window_scorer(self):
    """A :class:`WindowScorer` of the wrapper when the base has one, else ``None``."""
    return None if self.base.window_scorer() is None else WindowScorer(self)

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The request; with ``reduce_rows``, the scores in place of the window rows.

    Only when the base reduces its rows (:meth:`window_scorer`) and the allocator does not read
    them.
    """
    request = super().evidence_request(T)
    scorer = self.window_scorer()
    if reduce_rows and scorer is not None and "attn_window_LHWT" not in self.allocator.needs:
      request = dataclasses.replace(request, window_scores=scorer)
    return request


def check_base(base: Policy, wrapper: str, *, given_budget: bool = False) -> None:
  """Checks that ``base`` is a budget-free prefill scorer a wrapper can take.

  Args:
    base: the policy to wrap.
    wrapper: the wrapper's name, for the error.
    given_budget: also require a base that takes its budget as given (no allocator of its own).

  Raises:
    ValueError: ``base`` is a decode-time policy or rescores, or (with ``given_budget``)
      allocates its own budgets.
  """
  if isinstance(base, DecodePolicy) or base.rescores:
    raise ValueError(
      f"base: {wrapper} wraps {base.label!r}, which is not a budget-free prefill scorer; "
      "expected a prefill scorer such as snapkv"
    )
  if given_budget and base.allocates:
    raise ValueError(
      f"base: {wrapper} over {base.label!r}: expected a base that takes its budget as given"
    )


# --------------------------------------------------------------------------- CriticalKV


def _first_stage(scores_LHT, count_LH, capacity):
  T = scores_LHT.shape[-1]
  capacity = T if capacity is None else capacity
  count_LH = jnp.minimum(count_LH, capacity)  # a budget >= T keeps everything anyway
  return select.top_mask(scores_LHT, count_LH, capacity=capacity)


def _stage_one_count(budget_LH, ratio, floor_one):
  count = jnp.floor(budget_LH.astype(jnp.float32) * ratio).astype(jnp.int32)
  if floor_one:  # kvpress: ``max(1, count)`` whenever the first stage is on
    count = jnp.where(jnp.asarray(ratio) > 0, jnp.maximum(count, 1), count)
  return count


@dataclasses.dataclass(frozen=True, kw_only=True)
class Critical(Rescoring, Wrapper):
  """kvpress ``CriticalKVPress`` over ``base``: two stages, the second weighted by ``||W_O v||_1``.

  Stage 1 keeps the base scores' top ``max(1, floor(first_stage_ratio * b))``; stage 2 ranks
  the rest by ``(s + epsilon) * ||W_O v||_1``. Protected positions (``+inf``) stay in: kvpress
  pads SnapKV's window with the max + 1, which stage 2 rescales, so with a first stage smaller
  than the window kvpress can drop window tokens; kvjax never does.
  """

  epsilon: float = 1e-4
  first_stage_ratio: float = 0.5

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "CriticalKV")
    budgets_lib.check_real("epsilon", self.epsilon, low=0.0)
    budgets_lib.check_real("first_stage_ratio", self.first_stage_ratio, low=0.0, high=1.0)

  @property
  def evidence_fields(self):
    """The base's fields plus ``value_out_norms_LHT``."""
    return super().evidence_fields | {"value_out_norms_LHT"}

  def rescore(self, evidence, scores_LHT, budget_LH, capacity):
    """CriticalKV's two stages under ``budget_LH`` (kvpress ``CriticalKVPress``)."""
    norms = evidence.need("value_out_norms_LHT", self.label)
    count = _stage_one_count(budget_LH, self.first_stage_ratio, floor_one=True)
    first = _first_stage(scores_LHT, count, capacity)
    return scores_lib.critical(scores_LHT, norms, first, epsilon=self.epsilon)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticalAdaKV(Critical):
  """kvpress ``CriticalAdaKVPress`` over ``base``: kvpress's Ada-KV split, then CriticalKV's stages.

  kvpress's Ada-KV split (``floor_alpha`` 0.2), then each head's safeguard top
  ``max(1, int(b * floor_alpha))`` and stage-1 top ``int(first_stage_ratio * b_h)`` forced, the
  rest ranked by ``(s + epsilon) * ||W_O v||_1``.
  """

  floor_alpha: float = 0.2

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "CriticalAdaKV", given_budget=True)
    # kvpress's Ada-KV split; a windowed base's window only bounds the budget from below
    split = alloc_lib.AdaKV(floor_alpha=self.floor_alpha, adakv_mode="kvpress")
    object.__setattr__(self, "allocator", split)

  @property
  def options(self) -> dict:
    """The options, without the Ada-KV split's (kvpress's, fixed)."""
    out = super().options
    for key in ("normalize", "adakv_mode", "pyramid_mode", "beta"):
      out.pop(key, None)  # the split is kvpress's, fixed
    return out

  def rescore(self, evidence, scores_LHT, budget_LH, capacity):
    """The safeguard, stage-1 and stage-2 ranking (kvpress ``CriticalAdaKVPress``)."""
    norms = evidence.need("value_out_norms_LHT", self.label)
    L, H, T = scores_LHT.shape
    n_kept_L = budget_LH.sum(-1) // H  # kvpress's counts sum exactly to H * min(b, T)
    alpha = self.floor_alpha
    n_safe_L = jnp.floor(n_kept_L.astype(jnp.float32) * alpha).astype(jnp.int32)
    n_safe_L = jnp.where(
      jnp.asarray(alpha) > 0, jnp.where(n_kept_L > 0, jnp.maximum(n_safe_L, 1), 0), n_safe_L
    )
    safe = _first_stage(scores_LHT, jnp.broadcast_to(n_safe_L[:, None], (L, H)), capacity)
    boosted = jnp.where(safe, jnp.inf, scores_LHT)
    count = _stage_one_count(budget_LH, self.first_stage_ratio, floor_one=False)
    first = _first_stage(boosted, count, capacity)
    return scores_lib.critical(boosted, norms, first, epsilon=self.epsilon)


# --------------------------------------------------------------------------- ChunkKV


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkKV(Wrapper):
  """kvpress ``ChunkKVPress`` over ``base``: whole chunks of ``chunk`` (20) positions kept.

  Chunks are ranked by their summed (grouped) score; one kept set shared by every head of a
  layer.
  """

  chunk: int = 20

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "ChunkKV", given_budget=True)
    check_int("chunk", self.chunk, 1)

  @property
  def windowed(self) -> bool:
    """False: the window's chunk competes like any other (kvpress pads it max + 1)."""
    return False  # the window's chunk competes like any other (kvpress pads it max + 1)

  def score(self, evidence):
    """The base's grouped scores summed per chunk (kvpress ``ChunkKVPress``)."""
    scores = self.grouped(self.base.score(evidence))
    return scores_lib.chunkkv(scores, chunk=self.chunk, valid_T=evidence.valid_T)


# --------------------------------------------------------------------------- select once


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectOnce(Wrapper):
  """A decode-time policy's scores, selected once after the prompt.

  The cache is then appended to, as a prefill scorer's: kvpress's StreamingLLMPress and
  TOVAPress act this way.
  """

  def __post_init__(self):
    super().__post_init__()
    if self.base.rescores:
      raise ValueError(f"base: {self.base.label!r} rescores; expected a budget-free scorer")
