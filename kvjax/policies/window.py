"""Window scorers: policies that read the observation window's rows only through
:meth:`WindowPolicy.score_rows`, so a prefill may reduce each layer's rows to scores as it forms
them (:class:`WindowScorer`, the reduction a prefill takes as a static argument)."""

from __future__ import annotations

import dataclasses

import jax

from kvjax.policies.core import Policy
from kvjax.policies.evidence import Evidence, EvidenceRequest

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class WindowScorer:
  """A policy's :meth:`WindowPolicy.score_rows`, bound to the policy.

  Equal (and hashing equal) for equal policies, so a jitted prefill that takes it as a static
  argument compiles once per policy.
  """

  policy: Policy

  def __call__(self, attn_LHWT: Array) -> Array:
    """Reduces window rows to scores with the policy's :meth:`WindowPolicy.score_rows`.

    Args:
      attn_LHWT: window rows ``[., H, W, T]``.

    Returns:
      Scores ``[., H, T]``.
    """
    return self.policy.score_rows(attn_LHWT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowPolicy(Policy):
  """A policy that reads the window rows through :meth:`score_rows` only.

  SnapKV's votes, TOVA's last row: independent per layer, so a prefill may reduce each layer's
  rows to scores as it forms them (``evidence.window_scores_LHT``).
  """

  def score_rows(self, attn_LHWT: Array) -> Array:
    """Reduces window rows to scores, independently per leading index.

    The method a subclass writes; :meth:`score` reads ``evidence.window_scores_LHT`` when a
    prefill formed them already, else applies this to ``evidence.attn_window_LHWT``.

    Args:
      attn_LHWT: window rows ``[., H, W, T]``: causal softmax rows of the last ``W`` queries.

    Returns:
      Scores ``[., H, T]``.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.score_rows")

  def score(self, evidence: Evidence) -> Array:
    """Scores from the prefill's reduced rows if present, else :meth:`score_rows` of the rows."""
    if evidence.window_scores_LHT is not None:
      return evidence.window_scores_LHT
    return self.score_rows(evidence.need("attn_window_LHWT", self.label))

  def window_scorer(self):
    """This policy's :class:`WindowScorer`."""
    return WindowScorer(self)

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The request; with ``reduce_rows``, the scores in place of the window rows.

    The rows stay when the allocator reads them too (CAKE's).
    """
    request = super().evidence_request(T)
    # the rows are read by score_rows alone, unless the allocator reads them too (CAKE's)
    if reduce_rows and "attn_window_LHWT" not in self.allocator.needs:
      request = dataclasses.replace(request, window_scores=self.window_scorer())
    return request
