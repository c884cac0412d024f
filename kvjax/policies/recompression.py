"""Re-compression while decoding, which every policy inherits: kvpress ``DecodingPress``'s
``decode_every`` re-compresses the cache with the policy's own scorer, and a policy with another
scorer or other budgets for it (:class:`~kvjax.policies.PrefillDecoding`) overrides the hooks.

The model's cache (:func:`kvjax.model.cache.recompress`) reads :attr:`Recompression.decode_policy`
for the evidence it rebuilds over its slots, then :meth:`Recompression.decode_scores` and
:meth:`Recompression.decode_budgets`; it holds :meth:`Recompression.decode_capacity` slots.
"""

from __future__ import annotations

import jax

Array = jax.Array


class Recompression:
  """The hooks of a re-compression while decoding (``decode_every``), and whether a policy acts
  at decode time at all.

  A mixin of :class:`~kvjax.policies.Policy`: it reads the policy's ``decode_every`` and
  ``scores_row``.
  """

  @property
  def evicts_each_step(self) -> bool:
    """Whether it evicts at every generated token (:class:`~kvjax.policies.DecodePolicy`)."""
    return False

  @property
  def acts_at_decode(self) -> bool:
    """Whether it compresses while decoding (every step, or every ``decode_every`` tokens)."""
    return self.evicts_each_step or self.decode_every is not None

  @property
  def decode_policy(self):
    """The policy whose scorer re-compresses the cache while decoding (``decode_every``): this
    one. The model's cache rebuilds its evidence fields and observation window over the slots."""
    return self

  def decode_scores(self, evidence) -> Array:
    """Scores of the cache's slots at a re-compression (``decode_every``).

    The model's cache (:func:`kvjax.model.cache.recompress`) calls it on the evidence it rebuilds
    over its own slots; here the prompt's scorer on one row, :meth:`scores_row` (the empty slots
    come first and play the part of left padding, ``valid_T`` false: sinks count from the first
    held token). A policy with another scorer for the re-compressions
    (:class:`~kvjax.policies.combinators.PrefillDecoding`) overrides it.

    Args:
      evidence: the cache's evidence, its slots as positions.

    Returns:
      fp32 scores ``[L, H, T]``.
    """
    return self.scores_row(evidence)

  def decode_budgets(self, budget_LH: Array, seen) -> Array:
    """Each head's slots after a re-compression; here the prompt's budgets.

    Args:
      budget_LH: the prompt's budgets, int32 ``[L, H]``.
      seen: the tokens seen so far by the row, prompt and generated (an int or traced int).

    Returns:
      int32 ``[L, H]``: ``budget_LH`` here.
    """
    return budget_LH

  def decode_capacity(self, max_budget: int, T: int, new_tokens: int) -> int:
    """The most slots a row holds while decoding: after a re-compression, plus the tokens
    between two of them.

    Args:
      max_budget: the largest prompt budget of any head.
      T: the prompt's tokens.
      new_tokens: the tokens decoded after it.

    Returns:
      ``max_budget + decode_every`` here (``max_budget`` without ``decode_every``).
    """
    return max_budget + (self.decode_every or 0)
