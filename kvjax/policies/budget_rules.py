"""The budget checks every policy inherits: what a budget must hold for a policy to keep
something, before any ``jit`` (:meth:`BudgetRules.check_budget`) and inside
:meth:`~kvjax.policies.Policy.budgets`."""

from __future__ import annotations

import jax.numpy as jnp
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

  def check_budget(self, budget, window: int, T: int | None = None, *, ratio=None) -> None:
    """Checks a concrete budget array that the policy must run with.

    Every entry point calls this one check before any ``jit``.

    Args:
      budget: the budget, a concrete array or number of token counts (any shape).
      window: the protected window (:meth:`min_budget`).
      T: the prompt positions, checked for a policy that keeps every token (``None``: not
        checked).
      ratio: the caller's ``ratio`` when ``budget`` was derived from it (the error then names
        the ratio, the argument the caller gave); ``None``: the caller gave ``budget``.

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
      low = int(arr.min())
      if ratio is not None:
        raise ValueError(
          f"ratio: {ratio!r} keeps {low} tokens of a row, below the {floor} that {self.label!r} "
          f"needs (its window of {window} and a selected token); expected a smaller ratio"
          if self.windowed
          else f"ratio: {ratio!r} keeps {low} tokens of a row, below the {floor} that "
          f"{self.label!r} needs; expected a smaller ratio"
        )
      raise ValueError(
        f"budget: {low} is below {floor} for {self.label!r} "
        f"(every budget counts the window of {window} and needs a selected token)"
        if self.windowed
        else self._low_budget_message(low, floor)
      )
    if T is not None and arr.size and self.allocator.keeps_all and arr.min() < T:
      message = self._keeps_all_message(int(arr.min()), T)
      if ratio is not None:
        message = f"ratio: {ratio!r} keeps fewer than every token; " + message
      raise ValueError(message)

  def _keeps_all_message(self, low: int, T: int) -> str:
    return (
      f"budget: {low} < T={T}, but policy {self.label!r} keeps every token (the full cache; "
      "ThinK prunes key channels, not tokens); expected budget >= T, or channel_ratio on a "
      "token policy, e.g. make('snapkv', channel_ratio=0.5)"
    )

  def check_allocation(self, budget_LH, window: int | None = None) -> None:
    """Checks a concrete allocation the policy can hold.

    The rule every allocator's output follows: no row of a windowed policy holds fewer slots
    than its protected window (an allocator reserves the window in every budget, as
    PyramidKV's schedule, Ada-KV, HeadKV and CAKE do by construction; one that does not, such
    as :class:`~kvjax.policies.PerLayer` at a high layer ratio, is refused here rather than
    evicting part of the window). An entry point that computed the allocation under ``jit``
    calls this on the concrete result. TOVA overrides it (one index set per layer) and calls
    this one.

    Args:
      budget_LH: the allocation, ``[..., L, H]`` (a leading row axis allowed).
      window: the protected window; ``None``: the declared ``window`` of a windowed policy
        (0, nothing checked, for a policy that protects none or whose window comes from the
        evidence).

    Raises:
      ValueError: a row of a windowed policy with fewer slots than its protected window.
    """
    if window is None:
      window = (self.window or 0) if self.windowed else 0
    b = np.asarray(budget_LH)
    if not self.windowed or not window or not b.size or b.min() >= window:
      return
    where = np.unravel_index(int(np.argmin(b)), b.shape)
    at = ", ".join(f"{axis}={int(i)}" for axis, i in zip("BLH"[-len(where) :], where, strict=True))
    raise ValueError(
      f"allocator: {type(self.allocator).__name__} gives {at} {int(b.min())} slots, fewer than "
      f"the protected window of {window} of policy {self.label!r}; expected every row's budget "
      f">= {window} (a larger budget, or an allocator that reserves the window)"
    )

  def checked_budget_LH(self, budget_LH, L: int, H: int, window: int):
    """Checks an allocator's output: an integer ``[L, H]``, and :meth:`check_allocation`'s rule
    when concrete (under ``jit`` the entry point checks the concrete allocation).

    Args:
      budget_LH: what the allocator returned.
      L: the layers.
      H: the heads.
      window: the window the allocator reserved.

    Returns:
      ``budget_LH`` as int32 ``[L, H]``.

    Raises:
      ValueError: not an integer array of shape ``[L, H]``, or a concrete one
        :meth:`check_allocation` refuses.
    """
    name = type(self.allocator).__name__
    shape, dtype = getattr(budget_LH, "shape", None), getattr(budget_LH, "dtype", None)
    if shape is None or tuple(shape) != (L, H) or not np.issubdtype(dtype, np.integer):
      raise ValueError(
        f"allocator: {name} of policy {self.label!r} returned "
        f"{f'{dtype} {tuple(shape)}' if shape is not None else repr(budget_LH)}; expected "
        f"integer budget_LH of shape [L={L}, H={H}]"
      )
    if select.is_concrete(budget_LH):
      self.check_allocation(budget_LH, window)
    return jnp.asarray(budget_LH).astype(jnp.int32)

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
