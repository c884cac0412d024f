"""Feasible allocations from real vectors: the search space of an allocation search.

Every real vector maps to an integer allocation ``[L]`` or ``[L, G]`` whose entries sum to the
memory budget exactly, each at least the protected window + 1 and at most the prompt, so an
optimiser never sees an infeasible point (EvolKV, arXiv 2509.08315, searches layer budgets at a
fixed total). The map (:meth:`Space.allocate`) is a softmax over the free mass (the total above
every entry's floor), water-filled under each entry's cap, then largest-remainder rounding with
an exact integer repair. Low-dimensional rules (:data:`RULES`: PyramidKV's slope, a slope and a
curvature) give weights over layers from one or two parameters through the same map. Pure
``jnp``: :meth:`Space.allocate` vmaps over a population.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import select

Array = jax.Array

# parameters per rule: "free" is one logit per entry; the others are layer profiles (the same
# weight for every KV head of a layer)
RULES = ("free", "pyramid", "quadratic")
# logits are clipped here before the softmax: a population far out still maps to finite weights
LOGIT_LIMIT = 30.0


def _positive_int(name: str, value, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
    raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
  return int(value)


def check_shape(shape) -> tuple[int, ...]:
  """An allocation's shape: ``(L,)`` or ``(L, G)`` of positive ints.

  Raises:
    ValueError: another rank or a non-positive size.
  """
  shape = tuple(shape) if isinstance(shape, tuple | list) else shape
  if not isinstance(shape, tuple) or len(shape) not in (1, 2):
    raise ValueError(f"shape: expected (L,) or (L, G), got {shape!r}")
  for n in shape:
    _positive_int("shape", n)
  return tuple(int(n) for n in shape)


def ratio_budget(ratio: float, prompt_len: int) -> int:
  """kvpress's ``compression_ratio`` as a per-entry budget: ``int(prompt_len * (1 - ratio))``.

  Raises:
    ValueError: a ratio outside ``[0, 1)``.
  """
  if isinstance(ratio, bool) or not isinstance(ratio, float | int) or not 0.0 <= ratio < 1.0:
    raise ValueError(f"ratio: expected a compression ratio in [0, 1), got {ratio!r}")
  return int(prompt_len * (1.0 - ratio))


@dataclasses.dataclass(frozen=True)
class Space:
  """Integer allocations of one shape at one memory budget.

  Attributes:
    shape: ``(L,)`` per layer or ``(L, G)`` per layer and KV head.
    total: the memory budget, the allocation's exact sum (token slots over every entry).
    window: the protected window; every entry keeps at least ``window + 1``.
    prompt_len: every entry keeps at most the prompt.
    rule: how a parameter vector becomes weights (:data:`RULES`).
  """

  shape: tuple[int, ...]
  total: int
  window: int
  prompt_len: int
  rule: str = "free"
  # the rules this class accepts (a named allocator's space accepts its own name)
  rules: ClassVar[tuple[str, ...]] = RULES

  def __post_init__(self):
    object.__setattr__(self, "shape", check_shape(self.shape))
    _positive_int("prompt_len", self.prompt_len)
    _positive_int("window", self.window, low=0)
    _positive_int("total", self.total, low=0)
    if self.rule not in self.rules:
      raise ValueError(f"rule: unknown value {self.rule!r}; expected one of {self.rules}")
    if self.low > self.prompt_len:
      raise ValueError(
        f"window: {self.window} + 1 exceeds the prompt_len {self.prompt_len}; expected a window "
        "below the prompt"
      )
    n = self.size
    if self.total < n * self.low:
      raise ValueError(
        f"total: a memory budget of {self.total} slots is below the protected windows "
        f"({n} entries x (window {self.window} + 1) = {n * self.low}); expected at least that"
      )
    if self.total > n * self.prompt_len:
      raise ValueError(
        f"total: a memory budget of {self.total} slots exceeds the full cache "
        f"({n} entries x prompt_len {self.prompt_len} = {n * self.prompt_len})"
      )
    if self.total >= 2**31:
      raise ValueError(f"total: {self.total} does not fit int32; expected < 2**31")

  @classmethod
  def from_budget(
    cls, shape, budget: int, window: int, prompt_len: int, rule: str | None = None, **fields
  ):
    """The space whose total is ``budget`` slots per entry (uniform's memory).

    Args:
      shape: ``(L,)`` or ``(L, G)``.
      budget: tokens per entry.
      window: the protected window.
      prompt_len: the prompt.
      rule: one of the class's :attr:`rules` (default its first: ``"free"`` for :class:`Space`).
      **fields: a subclass's other fields (a named allocator's evidence and ranges).

    Raises:
      ValueError: as the constructor's.
    """
    budget = _positive_int("budget", budget, low=0)
    shape = check_shape(shape)
    rule = cls.rules[0] if rule is None else rule
    return cls(shape, budget * int(np.prod(shape)), window, prompt_len, rule, **fields)

  @classmethod
  def from_ratio(
    cls, shape, ratio: float, window: int, prompt_len: int, rule: str | None = None, **fields
  ):
    """The space at kvpress's compression ``ratio`` (:func:`ratio_budget` per entry).

    Raises:
      ValueError: a ratio outside ``[0, 1)``, and as the constructor's.
    """
    budget = ratio_budget(ratio, prompt_len)
    return cls.from_budget(shape, budget, window, prompt_len, rule, **fields)

  @property
  def size(self) -> int:
    """The entries of one allocation."""
    return int(np.prod(self.shape))

  @property
  def low(self) -> int:
    """Each entry's floor: the protected window and one more token."""
    return self.window + 1

  @property
  def mean_budget(self) -> float:
    """The average entry (the uniform allocation's budget when it divides)."""
    return self.total / self.size

  @property
  def num_params(self) -> int:
    """The parameters of one candidate under :attr:`rule`."""
    return {"free": self.size, "pyramid": 1, "quadratic": 2}[self.rule]

  def weights(self, params_N: Array) -> Array:
    """The positive weights over the entries (flat ``[size]``) of one parameter vector."""
    x = jnp.clip(jnp.nan_to_num(jnp.asarray(params_N, jnp.float32)), -LOGIT_LIMIT, LOGIT_LIMIT)
    if self.rule == "free":
      return jax.nn.softmax(x)
    L = self.shape[0]
    depth_L = 1.0 - 2.0 * jnp.arange(L, dtype=jnp.float32) / max(L - 1, 1)  # 1 at the bottom
    slope = jnp.tanh(x[0])  # a PyramidKV funnel for slope > 0, its inverse for slope < 0
    layer_L = 1.0 + slope * depth_L
    if self.rule == "quadratic":
      layer_L = layer_L + 0.5 * jnp.tanh(x[1]) * (depth_L**2 - jnp.mean(depth_L**2))
    layer_L = jnp.maximum(layer_L, 1e-3)
    per_entry = jnp.broadcast_to(layer_L.reshape((L,) + (1,) * (len(self.shape) - 1)), self.shape)
    return per_entry.reshape(-1) / per_entry.sum()

  def allocate(self, params_N: Array) -> Array:
    """The feasible integer allocation of one parameter vector.

    Args:
      params_N: ``[num_params]`` reals (NaN reads as 0, infinities as the clip).

    Returns:
      int32 budgets of :attr:`shape`, summing to :attr:`total`, each in
      ``[window + 1, prompt_len]``.
    """
    return self.from_weights(self.weights(params_N))

  def from_weights(self, weights_N: Array) -> Array:
    """The feasible allocation closest in shares to non-negative ``weights_N`` (flat)."""
    cap = self.prompt_len - self.low
    free = self.total - self.size * self.low
    shares = water_fill(weights_N, float(free), float(cap))
    extra = round_capped(shares, free, cap)
    return (self.low + extra).reshape(self.shape).astype(jnp.int32)

  def uniform(self) -> Array:
    """The uniform allocation of this memory (equal weights; remainder to the first entries)."""
    return self.from_weights(jnp.ones((self.size,), jnp.float32))

  def check_params(self, params_KN) -> np.ndarray:
    """A concrete population ``[K, num_params]`` (``K >= 1``).

    Raises:
      ValueError: another shape or an empty population.
    """
    arr = np.asarray(params_KN)
    if arr.ndim != 2 or arr.shape[1] != self.num_params:
      raise ValueError(
        f"params: expected a population [K, {self.num_params}], got shape {arr.shape}"
      )
    if arr.shape[0] == 0:
      raise ValueError("params: a population of 0 candidates; expected at least 1")
    return arr

  def allocate_population(self, params_KN) -> Array:
    """:meth:`allocate` over a population ``[K, num_params]``: ``[K, *shape]`` int32.

    Raises:
      ValueError: as :meth:`check_params`.
    """
    return jax.vmap(self.allocate)(jnp.asarray(self.check_params(params_KN), jnp.float32))


def water_fill(weights_N: Array, free: float, cap: float) -> Array:
  """Splits ``free`` in proportion to ``weights_N`` with no share above ``cap``.

  A capped share's excess goes to the uncapped ones by their weights, again until none exceeds
  its cap (at most ``N`` rounds; ``free <= N * cap`` makes it feasible).

  Args:
    weights_N: non-negative weights ``[N]`` (all zero reads as equal weights).
    free: the mass to split.
    cap: the largest share.

  Returns:
    float32 shares ``[N]`` in ``[0, cap]`` summing to ``free`` (up to rounding).
  """
  w = jnp.maximum(jnp.nan_to_num(weights_N.astype(jnp.float32)), 0.0)
  w = jnp.where(w.sum() > 0, w, jnp.ones_like(w))
  n = w.shape[0]

  def shares(fixed):
    rest = jnp.maximum(free - cap * fixed.sum(), 0.0)
    wsum = jnp.where(fixed, 0.0, w).sum()
    share = jnp.where(wsum > 0, rest * w / jnp.maximum(wsum, 1e-30), 0.0)
    return jnp.where(fixed, cap, share)

  def body(_, fixed):
    return fixed | (shares(fixed) > cap)

  fixed = jax.lax.fori_loop(0, n, body, jnp.zeros((n,), bool))
  return jnp.clip(shares(fixed), 0.0, cap)


def round_capped(shares_N: Array, total: int, cap: int) -> Array:
  """Integers in ``[0, cap]`` summing to exactly ``total``, nearest ``shares_N``.

  Largest-remainder rounding (ties to the lower index, :func:`kvjax.select.top_mask`), then an
  integer repair of what float rounding left over: one slot at a time to the first entries with
  room (or from the first with any), so the total is exact whatever the floats did.

  Args:
    shares_N: reals ``[N]`` in ``[0, cap]`` summing to about ``total``.
    total: the exact integer sum, in ``[0, N * cap]``.
    cap: each entry's largest value.

  Returns:
    int32 ``[N]``.
  """
  floors = jnp.clip(jnp.floor(shares_N), 0, cap).astype(jnp.int32)
  room = floors < cap
  frac = jnp.where(room, shares_N - floors, -1.0)
  deficit = jnp.clip(total - floors.sum(), 0, room.sum())
  out = floors + select.top_mask(frac, deficit).astype(jnp.int32)
  return _repair(_repair(out, total, cap, 1), total, cap, -1)


def _repair(counts_N: Array, total: int, cap: int, sign: int) -> Array:
  """Moves ``counts_N`` toward ``total`` by ``sign`` (+1: add, -1: remove), repeatedly, one unit
  per eligible entry per round, first entries first."""

  def step(counts):
    gap = sign * (total - counts.sum())
    eligible = counts < cap if sign > 0 else counts > 0
    rank = jnp.cumsum(eligible) - 1
    move = eligible & (rank < jnp.maximum(gap, 0))
    return counts + sign * move.astype(jnp.int32)

  def cond(counts):
    gap = sign * (total - counts.sum())
    eligible = counts < cap if sign > 0 else counts > 0
    return (gap > 0) & eligible.any()

  return jax.lax.while_loop(cond, step, counts_N)
