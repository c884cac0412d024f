"""The budget checks every policy inherits: what a budget must hold for a policy to keep
something, before any ``jit`` (:meth:`BudgetRules.check_budget`) and inside
:meth:`~kvjax.policies.Policy.budgets`."""

from __future__ import annotations

import numpy as np

from kvjax import select
from kvjax.policies import allocators as alloc_lib


class BudgetRules:
  """The smallest budgets a policy runs with and the checks that refuse the others.

  A mixin of :class:`~kvjax.policies.Policy`: it reads the policy's ``label``, ``windowed``,
  ``allocator``, ``allocates`` and ``protected_window``. A policy with another floor overrides
  :meth:`min_budget` (and ``_low_budget_message``, its error); one that holds only some
  allocations overrides :meth:`check_allocation`.
  """

  def min_budget(self, window: int) -> int:
    """The smallest budget that keeps a selected token.

    Args:
      window: the protected window.

    Returns:
      ``window + 1`` for a windowed policy, else 1.
    """
    return window + 1 if self.windowed else 1

  def check_budget(self, budget, window: int, T: int | None = None) -> None:
    """Checks a concrete budget array that the policy must run with.

    Every entry point calls this one check before any ``jit``.

    Args:
      budget: the budget, a concrete array or number of token counts (any shape).
      window: the protected window (:meth:`min_budget`).
      T: the prompt positions, checked for a policy that keeps every token (``None``: not
        checked).

    Raises:
      ValueError: a budget that is non-integer, beyond int32, below :meth:`min_budget`, or, for
        a policy that keeps every token, below the ``T`` prompt positions.
    """
    arr = np.asarray(budget)
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"budget: expected integer token counts, got {arr.dtype}")
    if arr.size and arr.max() >= 2**31:
      raise ValueError(f"budget: {int(arr.max())} does not fit int32; expected < 2**31 tokens")
    floor = self.min_budget(window)
    if arr.size and arr.min() < floor:
      raise ValueError(
        f"budget: {int(arr.min())} is below {floor} for {self.label!r} "
        f"(every budget counts the window of {window} and needs a selected token)"
        if self.windowed
        else self._low_budget_message(int(arr.min()), floor)
      )
    if T is not None and arr.size and self.allocator.keeps_all and arr.min() < T:
      raise ValueError(self._keeps_all_message(int(arr.min()), T))

  def _keeps_all_message(self, low: int, T: int) -> str:
    return (
      f"budget: {low} < T={T}, but policy {self.label!r} keeps every token (the full cache; "
      "ThinK prunes key channels, not tokens); expected budget >= T, or channel_ratio on a "
      "token policy, e.g. make('snapkv', channel_ratio=0.5)"
    )

  def check_allocation(self, budget_LH) -> None:
    """Checks a concrete allocation the policy can hold; nothing here.

    TOVA overrides it: one index set per layer.

    Args:
      budget_LH: the allocation, ``[L, H]``.

    Raises:
      ValueError: (in an override) an allocation the policy cannot hold.
    """

  def _low_budget_message(self, low: int, floor: int) -> str:
    return f"budget: {low} < {floor}; every row needs at least one slot"

  def _check_budget(self, evidence, scores_LHT, budget) -> None:
    alloc_lib.as_budget_LH(budget, *scores_LHT.shape[:2])  # dtype, int32 range and shape
    if self.allocates:
      ndim = self.allocator.max_budget_ndim
      if np.ndim(budget) > ndim:
        expected = "a scalar or [L]" if ndim else "a scalar"
        raise ValueError(
          f"budget: policy {self.label!r} allocates its own budget_LH from one per-head budget; "
          f"expected {expected}, got shape {np.shape(budget)}"
        )
    if not select.is_concrete(budget) or not np.size(budget):
      return
    low = int(np.min(budget))
    if low < 1:
      raise ValueError(
        f"budget: {low} keeps nothing; expected a budget >= 1 for policy {self.label!r}"
      )
    T = scores_LHT.shape[-1]
    if self.allocator.keeps_all and low < T:
      raise ValueError(self._keeps_all_message(low, T))
    if self.windowed:
      window = self.protected_window(evidence)
      if low < window + 1:
        raise ValueError(
          f"budget: {low} does not exceed the protected window {window} of policy "
          f"{self.label!r}; expected budget >= window + 1 = {window + 1}"
        )
