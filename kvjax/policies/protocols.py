"""Optional protocols a policy opts into by subclassing: a budget-dependent last score stage,
merge-on-evict at compression, merging while decoding.

Each is a mixin listed before the policy class it extends
(``class MyPolicy(policies.Rescoring, policies.Policy)``). :class:`~kvjax.policies.Policy`
declares which one a policy speaks (:attr:`~kvjax.policies.Policy.rescores`,
:attr:`~kvjax.policies.Policy.merges`, :attr:`~kvjax.policies.Policy.merges_while_decoding`)
from its classes, and its callers (the selection, the model's cache, the lab) call a
protocol's hook only on a policy that speaks it. A decode-time state machine is the
:class:`~kvjax.policies.DecodePolicy` subclass.
"""

from __future__ import annotations

import jax

Array = jax.Array


class ProtocolDefaults:
  """Which optional protocols a policy speaks: none here; each protocol's mixin says ``True``.

  A mixin of :class:`~kvjax.policies.Policy`; a combinator that takes them from the policies it
  holds (:class:`~kvjax.policies.PrefillDecoding`) overrides the properties.
  """

  @property
  def rescores(self) -> bool:
    """Whether the selection's scores depend on the budget (:class:`Rescoring`)."""
    return False

  @property
  def merges(self) -> bool:
    """Whether the cache folds evicted values into kept ones (:class:`ValueMerging`)."""
    return False

  @property
  def merges_while_decoding(self) -> bool:
    """Whether a re-compression merges evicted values (:class:`DecodeMerging`); the model's
    cache then carries each slot's attention sums."""
    return False


class Rescoring:
  """A budget-dependent last score stage (CriticalKV's first stage, H2O's half-budget window).

  :meth:`~kvjax.policies.Policy.selection_scores` ranks :meth:`rescore`'s scores instead of the
  grouped scores.
  """

  @property
  def rescores(self) -> bool:
    """True: the selection's scores depend on the budget."""
    return True

  def rescore(self, evidence, scores_LHT: Array, budget_LH: Array, capacity) -> Array:
    """The scores the selection ranks under ``budget_LH``.

    Args:
      evidence: the evidence the scores came from.
      scores_LHT: the grouped scores ``[L, H, T]`` (:meth:`~kvjax.policies.Policy.scores`).
      budget_LH: each head's budget, int32 ``[L, H]``.
      capacity: the selection's static capacity (``None``: ``T``).

    Returns:
      Scores ``[L, H, T]`` for :mod:`kvjax.select`.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.rescore")


class ValueMerging:
  """Merge-on-evict at compression (kvpress ``MergingPress``: :class:`~kvjax.policies.Merging`).

  The model's cache (:func:`kvjax.model.cache.compress`) calls :meth:`merge` after the
  selection, on the prompt's keys and values at the cache's heads, before it gathers the kept
  values; only the kept positions' values are read back.
  """

  @property
  def merges(self) -> bool:
    """True: the cache folds evicted values into kept ones."""
    return True

  def merge(self, keys_LHTD: Array, values_LHTD: Array, keep_LHT: Array, valid_LHT: Array) -> Array:
    """Folds the evicted positions' values into the kept ones.

    Args:
      keys_LHTD: post-RoPE keys ``[..., H, T, D]`` (any leading axes: layers, batch rows).
      values_LHTD: values ``[..., H, T, D]``.
      keep_LHT: bool ``[..., H, T]``, the kept positions.
      valid_LHT: bool, broadcastable to ``keep_LHT``: the real (not padded) positions.

    Returns:
      The values ``[..., H, T, D]``.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.merge")


class DecodeMerging:
  """Merging while decoding (kvpress ``CAMPress``: :class:`~kvjax.policies.CaM`).

  At each re-compression the model's cache (:func:`kvjax.model.cache.recompress`) calls
  :meth:`decode_merge` on one batch row's slots in position order, after
  :meth:`~kvjax.policies.Policy.decode_scores` and before the selection, and carries each
  slot's attention sums for it.
  """

  @property
  def merges_while_decoding(self) -> bool:
    """True: a re-compression folds evicted values into kept ones."""
    return True

  def decode_merge(
    self,
    values_LHCD: Array,
    attn_sums_LHC: Array,
    scores_LHC: Array,
    valid_LHC: Array,
    count_LH: Array,
    *,
    row,
    seen,
  ) -> tuple[Array, Array]:
    """Folds a re-compression's evicted values into kept ones.

    The cache then keeps the ``count_LH`` best slots under the scores it returns and gathers
    the values it returns.

    Args:
      values_LHCD: the slots' values ``[L, H, C, D]``.
      attn_sums_LHC: fp32 ``[L, H, C]``: each slot's attention summed over the generated
        queries (the mean over the query heads reading the cache head), zero for empty slots.
      scores_LHC: the decoding scorer's scores ``[L, H, C]``, ``-inf`` on empty slots.
      valid_LHC: bool ``[L, H, C]``, the filled slots.
      count_LH: int32 ``[L, H]``, the slots each head keeps.
      row: the batch row (a traced int), for reproducible random draws.
      seen: the row's tokens seen, prompt and generated (a traced int).

    Returns:
      ``(scores_LHC, values_LHCD)``: the scores the selection ranks and the values it gathers.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.decode_merge")


# each protocol's hook: a policy class defining it must subclass the protocol
HOOKS = {"rescore": Rescoring, "merge": ValueMerging, "decode_merge": DecodeMerging}


def check_hooks(cls: type) -> None:
  """Checks that a policy class defining a protocol's hook subclasses that protocol.

  A hook outside its protocol would never be called; this makes that a ``TypeError`` at class
  creation instead.

  Args:
    cls: the policy class being created.

  Raises:
    TypeError: ``cls`` defines ``rescore``, ``merge`` or ``decode_merge`` without subclassing
      :class:`Rescoring`, :class:`ValueMerging` or :class:`DecodeMerging`.
  """
  for hook, protocol in HOOKS.items():
    if hook in vars(cls) and not issubclass(cls, protocol):
      raise TypeError(
        f"{cls.__name__}.{hook}: a policy that defines {hook} opts into its protocol; "
        f"expected class {cls.__name__}(policies.{protocol.__name__}, ...)"
      )
