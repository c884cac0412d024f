"""DMS (dense prefill): evict the scores below a threshold, once they leave a sliding window."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax.policies.checks import check_int
from kvjax.policies.wrappers import Wrapper, check_base

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class DMS(Wrapper):
  """DMS's threshold eviction over any scorer (kvpress ``DMSPress``, dense prefill).

  Paper: Łańcucki et al., "Inference-Time Hyper-Scaling with KV Cache Compression" (Dynamic
  Memory Sparsification, arXiv 2506.05345). Reference: kvpress 0.5.5
  ``presses/dms_press.py::DMSPress``, which, like this class, uses a given scorer instead of
  the paper's trained eviction decisions.

  The last ``sliding_window`` positions are kept; an older position is kept when its base score
  is at least ``threshold``. The budget comes from the data: each head keeps
  ``min(budget, count)``, ``count`` its positions scoring ``>= threshold`` plus the window
  (:meth:`budgets`), so a budget ``>= T`` applies the threshold alone and a smaller one caps a
  head (a real cache of that capacity). The threshold is traced data (a pytree leaf): a sweep
  over thresholds compiles once.

  Differences from kvpress:

  * Prefill only: kvpress's ``decoding=True`` (scoring each generated token as it leaves the
    window) is not offered.
  * Positions the base protects (``+inf``: SnapKV's window, sinks) are always kept; kvpress's
    scorers pad them with their largest score + 1, which a larger threshold evicts.
  * The kept count per head is capped by the budget (kvpress: uncapped, masked in a full-size
    cache).
  * Padding (``evidence.valid_T``) never counts.

  Attributes:
    base: the budget-free prefill scorer (kvpress ``press``).
    threshold: keep the positions scoring ``>= threshold`` (kvpress ``threshold``); a float,
      traced or concrete; ``None`` fails at allocation.
    sliding_window: the recent positions always kept (kvpress ``sliding_window_size``, 128).
  """

  threshold: float | None = None
  sliding_window: int = 128

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "DMS", given_budget=True)
    check_int("sliding_window", self.sliding_window, 0)
    if self.threshold is not None:
      budgets_lib.check_real("threshold", self.threshold, low=-float("inf"))

  @property
  def data_options(self) -> tuple[str, ...]:
    """``("threshold",)``: a traced leaf in a sweep."""
    return ("threshold",)

  @property
  def windowed(self) -> bool:
    """True: the sliding window is protected inside every budget."""
    return True

  @property
  def window_field(self) -> str | None:
    """``"sliding_window"``."""
    return "sliding_window"

  def protected_window(self, evidence) -> int:
    """``sliding_window``."""
    return self.sliding_window

  def score(self, evidence):
    """The base's grouped scores, the last ``sliding_window`` positions ``+inf``."""
    s = self.grouped(self.base.score(evidence)).astype(jnp.float32)
    return scores_lib.protect(s, recent=min(self.sliding_window, s.shape[-1]))

  def budgets(self, evidence, scores_LHT, budget):
    """``min(budget, count)`` per head, ``count`` the positions scoring ``>= threshold``.

    Args:
      evidence: reads ``valid_T`` (padding never counts).
      scores_LHT: the grouped scores ``[L, H, T]`` (:meth:`score`, window protected).
      budget: a cap, a scalar, ``[L]`` or ``[L, H]`` (``>= T``: none).

    Returns:
      ``budget_LH`` int32 ``[L, H]``.

    Raises:
      ValueError: ``threshold`` is ``None``, or a budget :meth:`Policy.budgets` refuses.
    """
    if self.threshold is None:
      raise ValueError(f"threshold: policy {self.label!r} needs a score threshold, got None")
    cap_LH = super().budgets(evidence, scores_LHT, budget)
    T = scores_LHT.shape[-1]
    valid_T = jnp.ones(T, bool) if evidence.valid_T is None else evidence.valid_T
    count_LH = (valid_T[None, None, :] & (scores_LHT >= self.threshold)).sum(-1, dtype=jnp.int32)
    return jnp.minimum(cap_LH, count_LH)
