"""Budgets checked before any work and the caches they size: budgets and kvpress's compression
ratios, the allocation a budget gives each row, the cache's capacity and its bytes (refused above
:data:`kvjax.model.decoding.MAX_CACHE_BYTES` by :func:`kvjax.model.decoding.check_cache_bytes`),
counts of tokens, and a cache that overflowed.

Re-exported by :mod:`kvjax.model.decoding`, whose names these are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies, select
from kvjax.model import cache as cache_lib
from kvjax.model.config import ModelConfig

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "spec0"))
def allocation(cfg, pre, spec0, budget, evidence=None):
  """Computes every row's ``budget_LH``, to size the cache before compressing.

  Compiled once per shape: budgets are traced data.

  Args:
    cfg: the model's config (static).
    pre: the prefill's outputs.
    spec0: the cache's static choices (its capacity is not read).
    budget: the budget, as :func:`kvjax.model.cache.compress` takes it.
    evidence: the checked caller-given evidence, or ``None``.

  Returns:
    The allocation ``[B, L, H]``.
  """
  spec = dataclasses.replace(spec0, capacity=1)
  return cache_lib.compress(cfg, pre, spec, budget, evidence=evidence).budget


def checked_allocation(cfg, pre, spec, policy: policies.Policy, budget, evidence):
  """Computes the allocation of a compressing policy and checks it (``policy.check_allocation``).

  Args:
    cfg: the model's config.
    pre: the prefill's outputs.
    spec: the cache's static choices.
    policy: the policy (an object).
    budget: the checked budget.
    evidence: the checked caller-given evidence, or ``None``.

  Returns:
    The allocation ``[B, L, H]`` as a numpy array, or ``None`` for a policy that takes no
    budget.

  Raises:
    ValueError: for an allocation the policy refuses.
  """
  if not policy.requires_budget:
    return None
  budget_LH = np.asarray(allocation(cfg, pre, spec, budget, evidence))
  check_nan_scores(budget_LH)
  policy.check_allocation(budget_LH)  # every row holds the policy's declared window
  return budget_LH


def capacity_bucket(n: int) -> int:
  """Rounds ``n`` slots up to one of four sizes per octave (at least 8).

  A new largest budget then rarely changes the cache's static shape, so it rarely compiles the
  decoder again, and the buffer is at most 25 % larger than needed.

  Args:
    n: the slots needed.

  Returns:
    The bucketed capacity.
  """
  if n <= 8:
    return 8
  quantum = 1 << max(int(n - 1).bit_length() - 3, 0)
  return -(-n // quantum) * quantum


def cache_capacity(policy: policies.Policy, budget_max: int, T: int, new: int) -> int:
  """Counts the slots per row of a cache: the largest budget rounded up to a
  :func:`capacity_bucket` (never past what the sequence can fill), plus the generated tokens for
  prefill-time policies.

  A policy that re-compresses every ``decode_every`` tokens holds at most its
  :meth:`~kvjax.policies.Policy.decode_capacity` (the largest budget kept across
  re-compressions, plus ``decode_every``).

  Args:
    policy: the policy (an object).
    budget_max: the largest budget of any (row, layer, head).
    T: the prompt's tokens.
    new: the tokens decoded or fed after it.

  Returns:
    The capacity.
  """
  every = policy.decode_every
  if every:  # re-compressed every `every` tokens: at most the largest kept count + every
    held = policy.decode_capacity(budget_max, T, new) - every
    return min(min(capacity_bucket(held), T + new) + min(every, new), T + new)
  if not policy.requires_budget:  # the full cache
    return T + new
  if policy.evicts_each_step:
    return max(min(capacity_bucket(budget_max), T + new), 1)
  return min(capacity_bucket(budget_max), T) + new


def check_nan_scores(budget_BLH) -> None:
  """Refuses an allocation in which a compression marked NaN scores
  (:data:`kvjax.model.cache.NAN_SCORES`).

  Args:
    budget_BLH: a compression's budgets ``[..., B, L, H]``.

  Raises:
    ValueError: naming the first (batch row, layer, head) whose scores held NaN.
  """
  bad = np.argwhere(np.asarray(budget_BLH) == cache_lib.NAN_SCORES)
  if bad.size:
    raise ValueError(
      f"scores: the policy's scores held NaN at (batch row, layer, head) "
      f"{tuple(int(i) for i in bad[0][-3:])}, which cannot be ranked; expected finite "
      "scores (or +-inf to force a position in or out)"
    )


def check_overflow(cache) -> None:
  """Refuses a cache in which a row needed more slots than its capacity, or whose policy's
  scores held NaN (a NaN cannot be ranked, so what it kept would be arbitrary).

  Args:
    cache: the cache (:class:`kvjax.model.cache.KVCache`).

  Raises:
    ValueError: when the policy's prompt scores held NaN for a row (its budget is
      :data:`kvjax.model.cache.NAN_SCORES`).
    RuntimeError: when a row of ``cache`` overflowed (tokens would be lost) or a decode-time
      policy's ``keep_scores`` held NaN.
  """
  budget = getattr(cache, "budget", None)
  if budget is not None and select.is_concrete(budget):
    check_nan_scores(budget)
  if cache.overflow is not None and bool(np.asarray(cache.overflow).any()):
    raise RuntimeError(
      "cache: a row needed more slots than the capacity, or a decode-time policy's "
      "keep_scores held NaN; tokens would be lost"
    )


def check_new_tokens(name: str, value) -> int:
  """Checks a count of tokens to generate or feed: an int ``>= 1``.

  Args:
    name: the argument's name, for the error.
    value: the count.

  Returns:
    ``value`` as an ``int``.

  Raises:
    ValueError: naming ``name`` and the value, for anything but an int in ``[1, 2**31)``.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
  if not 1 <= value < 2**31:
    raise ValueError(f"{name}: expected an int in [1, 2**31), got {value}")
  return int(value)


def cache_bytes(cfg: ModelConfig, *, slots: int, batch: int, heads: int, itemsize: int) -> int:
  """Counts the bytes of the keys and values of one cache of ``slots`` slots per head.

  Args:
    cfg: the model's config (layers, head dimension).
    slots: slots per (layer, row, head).
    batch: rows.
    heads: the cache's heads (KV heads, or query heads in the ``"query"`` layout).
    itemsize: bytes per element (:func:`kvjax.model.llama.kv_itemsize`).

  Returns:
    ``layers x 2 x heads x slots x head_dim x itemsize x batch``.
  """
  return cfg.num_layers * 2 * heads * slots * cfg.head_dim * itemsize * batch


def cache_heads(cfg: ModelConfig, layout: str) -> int:
  """Counts the cache's heads in ``layout``: query heads for ``"query"``, else KV heads.

  Args:
    cfg: the model's config.
    layout: ``"kv"`` or ``"query"``.

  Returns:
    The number of heads.
  """
  return cfg.num_heads if layout == "query" else cfg.num_kv_heads


def slots_bound(policy: policies.Policy, budget, T: int, new: int) -> int:
  """Bounds the slots per head that decoding after a prompt gives ``policy``, before any work.

  The bound is the cache's size when the allocator keeps the budget as given, the full ``T``
  otherwise (an allocator may give a head up to the prompt).

  Args:
    policy: the policy (an object).
    budget: the budget (already checked).
    T: the prompt's tokens.
    new: the tokens decoded after it.

  Returns:
    An upper bound on the slots per head.
  """
  known = policy.requires_budget and not policy.allocates
  budget_max = int(np.max(budget)) if known and np.size(budget) else T
  return cache_capacity(policy, budget_max, T, new)


def check_config_budgets(budgets) -> Array:
  """Checks budgets with a leading configuration axis (``[K]``, ``[K, L]`` or ``[K, L, H]``).

  Args:
    budgets: integer budgets with a non-empty leading axis.

  Returns:
    The budgets as an int32 array.

  Raises:
    ValueError: for non-integer budgets, no (or an empty) leading axis, or values outside
      ``[0, 2**31)``.
  """
  arr = np.asarray(budgets)
  if not np.issubdtype(arr.dtype, np.integer) or arr.ndim < 1 or arr.shape[0] < 1:
    raise ValueError(
      "budgets: expected integer budgets with a non-empty leading config axis, "
      f"got {arr.dtype}{arr.shape}"
    )
  if arr.max() >= 2**31 or arr.min() < 0:
    raise ValueError(
      f"budgets: {int(arr.max() if arr.max() >= 2**31 else arr.min())} is outside "
      "[0, 2**31); expected int32 token counts"
    )
  return jnp.asarray(arr, jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Ratio:
  """kvpress's ``compression_ratio``, given where a budget goes (``budget=Ratio(0.5)``).

  Each row keeps ``int(T_row * (1 - value))`` slots per head of its ``T_row`` real prompt tokens
  (:func:`ratio_budgets`, kvpress 0.5.5 ``compute_n_kept``). The slots are traced data like a
  budget, so every ratio shares one compiled program. Where a call takes ``K`` configurations
  (:func:`kvjax.model.answers.answer_configs`), ``value`` is ``[K]`` ratios.

  Attributes:
    value: the fraction of the prompt removed, a float in ``[0, 1)`` (or ``[K]`` of them).
  """

  value: object

  def __repr__(self) -> str:
    return f"Ratio({self.value!r})"


def split_ratio(budget) -> tuple:
  """Splits what a caller gave as a budget into ``(budget, ratio)``.

  Args:
    budget: a budget (a scalar, ``[L]``, ``[L, H]``, ``[K, ...]``, or ``None``) or a
      :class:`Ratio`.

  Returns:
    ``(None, ratio)`` for a :class:`Ratio`, else ``(budget, None)``.
  """
  if isinstance(budget, Ratio):
    return None, budget.value
  return budget, None


def ratio_budgets(ratio, lengths_B) -> np.ndarray:
  """Each row's budget under kvpress's ``compression_ratio``: ``int(T_row * (1 - ratio))``.

  kvpress 0.5.5 ``kvpress/utils.py::compute_n_kept`` (in float64, as Python computes it), with
  each row's own real tokens as its ``T``.

  Args:
    ratio: the fraction of the prompt removed, a float in ``[0, 1)``.
    lengths_B: each row's real prompt tokens ``[B]``.

  Returns:
    int32 budgets ``[B]``.

  Raises:
    ValueError: for a ratio that is not a real number in ``[0, 1)``.
  """
  expected = "expected a float in [0, 1) (kvpress compression_ratio)"
  real = np.ndim(ratio) == 0 and np.issubdtype(np.asarray(ratio).dtype, np.number)
  if isinstance(ratio, bool) or not real or np.asarray(ratio).dtype == bool:
    raise ValueError(f"ratio: {expected}, got {ratio!r}")
  r = float(ratio)
  if not 0.0 <= r < 1.0:
    raise ValueError(f"ratio: {expected}, got {r!r}")
  return np.asarray([int(int(n) * (1 - r)) for n in np.asarray(lengths_B)], np.int32)


def ratio_or_budget(pol: policies.Policy, budget, ratio, mask):
  """Gives the budget a call runs with: ``budget``, or the rows' budgets under ``ratio``.

  Args:
    pol: the policy (an object).
    budget: the caller's budget, or ``None``.
    ratio: kvpress's ``compression_ratio``, or ``None``.
    mask: the 0/1 mask ``[B, T]`` of the real tokens.

  Returns:
    ``budget``, or :func:`ratio_budgets` of each row's length.

  Raises:
    ValueError: for a ratio with a budget, or a ratio for a policy that takes no budget.
  """
  if ratio is None:
    return budget
  if budget is not None:
    raise ValueError(
      f"ratio: {ratio!r} given with budget {budget!r}; expected a budget or a ratio, not both"
    )
  if not pol.requires_budget:
    raise ValueError(f"ratio: policy {pol.label!r} takes no budget; expected ratio=None")
  return ratio_budgets(ratio, np.asarray(mask).sum(-1))


def check_row_budgets(pol: policies.Policy, budget, mask, per_row: bool, ratio=None) -> None:
  """Checks a budget as every entry point does; per-row budgets against each row's length.

  Args:
    pol: the policy (an object).
    budget: the budget, with a leading ``[B]`` axis when ``per_row``.
    mask: the 0/1 mask ``[B, T]`` of the real tokens.
    per_row: whether ``budget`` holds one budget per row.
    ratio: the compression ratio the rows' budgets come from (named in the error), or ``None``.

  Raises:
    ValueError: for a budget the policy refuses (``pol.check_budget``).
  """
  T = np.asarray(mask).shape[-1]
  if not per_row:
    pol.check_budget(budget, pol.evidence_request(T).window, T)
    return
  for n, b in zip(np.asarray(mask).sum(-1), np.asarray(budget), strict=True):
    pol.check_budget(np.asarray(b), pol.evidence_request(int(n)).window, int(n), ratio=ratio)


def _budget_free(policy: policies.Policy, budget, T: int):
  """A budget given to a policy that takes none but re-compresses while decoding
  (:class:`kvjax.policies.RatioDecoding` over the full prompt): checked to keep every prompt
  token, then dropped (``None``: the same selection); any other budget as given."""
  if policy.requires_budget or budget is None or not policy.decode_every:
    return budget
  policy.check_budget(budget, policy.evidence_request(T).window, T)
  return None


def _check_budget_given(policy: policies.Policy, budget) -> None:
  """A budget for a compressing policy, none for the full cache (one that keeps every prompt
  token for a budget-free policy re-compressing while decoding: :func:`_budget_free`)."""
  if not policy.requires_budget and budget is not None and not policy.decode_every:
    raise ValueError(
      f"budget: the full cache keeps everything; got budget={budget!r}, expected None"
    )
  if policy.requires_budget and budget is None:
    raise ValueError("budget: required for a compressing policy")


def checked_budget(pol: policies.Policy, budget, ratio, mask):
  """Checks the budget of one compression before any work and gives the one it runs with.

  Args:
    pol: the policy (an object).
    budget: the caller's budget, or ``None``.
    ratio: kvpress's ``compression_ratio`` instead of ``budget``, or ``None``.
    mask: the 0/1 mask ``[B, T]`` of the real tokens.

  Returns:
    The budget (the rows' budgets under ``ratio``; ``None`` for a budget-free policy).

  Raises:
    ValueError: for a budget the policy refuses, a budget for the full cache, none for a
      compressing policy, or a ratio :func:`ratio_or_budget` refuses.
  """
  T = mask.shape[-1]
  budget = ratio_or_budget(pol, budget, ratio, mask)
  _check_budget_given(pol, budget)
  if ratio is None:
    budget = _budget_free(pol, budget, T)
  if pol.requires_budget:
    check_row_budgets(pol, budget, mask, ratio is not None, ratio=ratio)
  return budget
