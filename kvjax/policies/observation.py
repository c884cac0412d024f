"""What a policy observes, which every policy inherits: the evidence fields it reads and the
request a prefill computes for it (:meth:`Observation.evidence_request`, the one mapping from a
policy's needs to the prefill's work)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.evidence import DEFAULT_WINDOW, EvidenceRequest


class Observation:
  """The evidence a policy reads and the prefill's request for it.

  A mixin of :class:`~kvjax.policies.Policy`: it reads the policy's declared ``needs`` and
  ``window``, its ``allocator``, ``channel_ratio`` and ``channel_window``. A policy with other needs (a combinator's
  stages, a wrapper's base) overrides :attr:`evidence_fields` and :attr:`observation_window`.
  """

  @property
  def evidence_fields(self) -> frozenset[str]:
    """Every :class:`Evidence` field it reads: ``needs``, its allocator's, ThinK's."""
    out = frozenset(self.needs) | self.allocator.needs
    if self.channel_ratio:
      out |= {"window_queries_LHWD", "keys_LGTD"}
    return out

  @property
  def observation_window(self) -> int:
    """Observation queries its evidence is formed from: ``window``, else the default."""
    return self.window or DEFAULT_WINDOW

  @property
  def reads_future(self) -> bool:
    """Whether it reads future attention (the oracle: an upper bound, not a realisable cache)."""
    return "future_attn_LHST" in self.evidence_fields

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """What a prefill of ``T`` prompt tokens computes for it: :attr:`evidence_fields` with
    ``min(observation_window, T)`` window rows, and at least ``min(channel_window, T)`` window
    queries for ThinK's channels.

    Args:
      T: the prompt's length.
      reduce_rows: keep a :class:`WindowPolicy`'s scores instead of its rows (ignored here).

    Returns:
      The :class:`EvidenceRequest`.

    Raises:
      ValueError: :attr:`evidence_fields` names a field :class:`Evidence` lacks.
    """
    request = EvidenceRequest.for_fields(self.evidence_fields, min(self.observation_window, T))
    if self.channel_ratio and self.channel_window:
      queries = max(request.window_queries, min(self.channel_window, T))
      request = dataclasses.replace(request, window_queries=queries)
    return request

  def window_scorer(self):
    """A hashable reduction of one layer's window rows to scores (:class:`WindowPolicy`'s), or
    ``None`` here."""
    return None
