"""Search spaces over a named allocator's few parameters: the search tunes PyramidKV's ``beta``,
Ada-KV's ``floor_alpha`` or CAKE's temperatures instead of a free per-layer or per-head split.

Each space is a :class:`~kvjax.eval.search.space.Space` (the same shape, memory ``total``, window
and prompt) whose parameter vector is the allocator's parameters in an unconstrained form: each
real ``x`` maps into the parameter's bounds by a sigmoid (on a log scale for ``beta`` and the
temperatures), so ``x = 0`` is the middle of the range and :meth:`AllocatorSpace.encode` gives
the vector of known values. :meth:`AllocatorSpace.allocate` calls the allocator itself
(:mod:`kvjax.budgets`) on evidence fixed at construction (the calibration data's mean scores for
Ada-KV, its entropy and variance statistics for CAKE), so at those parameters it gives the
allocator's own budgets. When those budgets are not feasible in the space (Ada-KV's official caps
need not sum to the layer's total; CAKE and a steep pyramid can leave an entry at the bare window),
the space's map (:meth:`~kvjax.eval.search.space.Space.from_weights`) gives the feasible
allocation nearest in shares, so the optimiser still never sees an infeasible point.

The allocation is static: the allocator reads the calibration evidence once, the search tunes
its parameters, and the result is one fixed allocation, as a free search's is (an adaptive
allocator recomputes per prompt at inference; the searched parameters can be given to it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax.eval.search.space import LOGIT_LIMIT, Space

Array = jax.Array

# the named allocators' spaces (a config's ``rule``)
ALLOCATOR_RULES = ("pyramid_beta", "adakv", "cake")


@dataclasses.dataclass(frozen=True)
class Bound:
  """One searched parameter: its name, range and scale.

  Attributes:
    name: the allocator's argument.
    low: the smallest value.
    high: the largest value.
    log: a log-scale map (``x = 0`` at the geometric middle).
  """

  name: str
  low: float
  high: float
  log: bool = False

  def value(self, x: Array) -> Array:
    """The parameter's value at the real ``x`` (NaN reads as 0, the middle)."""
    t = jax.nn.sigmoid(jnp.clip(jnp.nan_to_num(x), -LOGIT_LIMIT, LOGIT_LIMIT))
    if self.log:
      lo, hi = math.log(self.low), math.log(self.high)
      return jnp.clip(jnp.exp(lo + (hi - lo) * t), self.low, self.high)
    return self.low + (self.high - self.low) * t

  def encode(self, value: float) -> float:
    """The real ``x`` whose :meth:`value` is ``value`` (within float32).

    Raises:
      ValueError: a value outside ``[low, high]``.
    """
    if not self.low <= value <= self.high:
      raise ValueError(f"{self.name}: {value!r} outside [{self.low}, {self.high}]")
    if self.log:
      t = (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
    else:
      t = (value - self.low) / (self.high - self.low)
    t = min(max(t, 1e-12), 1 - 1e-12)
    return float(np.clip(math.log(t / (1 - t)), -LOGIT_LIMIT, LOGIT_LIMIT))


def check_range(name: str, bounds, floor: float, ceiling: float = math.inf, *, strict=False):
  """A parameter range ``(low, high)`` of finite reals with ``floor <= low < high <= ceiling``
  (``floor < low`` when ``strict``).

  Raises:
    ValueError: naming ``name``, the value and what was expected.
  """
  expected = f"expected (low, high) with {floor} {'<' if strict else '<='} low < high <= {ceiling}"
  if not isinstance(bounds, tuple | list) or len(bounds) != 2:
    raise ValueError(f"{name}: {bounds!r}; {expected}")
  for v in bounds:
    if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not math.isfinite(v):
      raise ValueError(f"{name}: {bounds!r}; {expected}")
  low, high = (float(v) for v in bounds)
  if (low <= floor if strict else low < floor) or not low < high or high > ceiling:
    raise ValueError(f"{name}: {bounds!r}; {expected}")
  return low, high


@dataclasses.dataclass(frozen=True, eq=False)
class AllocatorSpace(Space):
  """A named allocator's parameters as a search space (the base of the spaces below).

  The memory must give every entry the same whole budget (``total`` a multiple of the
  entries): the allocators split a per-layer (per-head) budget. Subclasses name their
  :meth:`bounds` and compute :meth:`budgets` from the decoded parameters.
  """

  rules: ClassVar[tuple[str, ...]] = ALLOCATOR_RULES
  # the allocator's own default arguments (its hand-made setting, a baseline)
  defaults: ClassVar[dict[str, float]] = {}
  # the calibration evidence the space reads: (the RuleEvidence attribute, the space's field)
  evidence: ClassVar[tuple[str, str] | None] = None
  # the smallest protected window the allocator's evidence is defined for
  min_window: ClassVar[int] = 0

  def __post_init__(self):
    super().__post_init__()
    if self.total % self.size:
      raise ValueError(
        f"total: {self.total} slots over {self.size} entries; expected a multiple of the "
        f"entries (the allocator splits one whole budget per entry)"
      )

  @property
  def budget(self) -> int:
    """The per-entry budget the allocator splits (window included)."""
    return self.total // self.size

  def bounds(self) -> tuple[Bound, ...]:
    """The searched parameters, in the vector's order."""
    raise NotImplementedError

  @property
  def num_params(self) -> int:
    """The parameters of one candidate: the allocator's searched arguments."""
    return len(self.bounds())

  def decode(self, params_N: Array) -> dict[str, Array]:
    """The allocator's arguments at one parameter vector: ``{name: value}``."""
    x = jnp.asarray(params_N, jnp.float32)
    return {b.name: b.value(x[i]) for i, b in enumerate(self.bounds())}

  def encode(self, **values: float) -> np.ndarray:
    """The parameter vector of the allocator's arguments ``values`` (every one named).

    Raises:
      ValueError: a missing or unknown name, or a value outside its bounds.
    """
    names = [b.name for b in self.bounds()]
    if sorted(values) != sorted(names):
      raise ValueError(f"values: got {sorted(values)}; expected exactly {names}")
    return np.asarray([b.encode(float(values[b.name])) for b in self.bounds()], np.float32)

  def default_params(self) -> np.ndarray | None:
    """The vector of the allocator's :attr:`defaults`, or ``None`` when one is out of bounds."""
    if not all(b.low <= self.defaults[b.name] <= b.high for b in self.bounds()):
      return None
    return self.encode(**self.defaults)

  def values(self, params_N) -> dict[str, float]:
    """:meth:`decode` as plain floats (what an allocation file records)."""
    return {k: float(v) for k, v in self.decode(jnp.asarray(params_N, jnp.float32)).items()}

  def budgets(self, values: dict[str, Array]) -> Array:
    """The allocator's own budgets of the space's shape at the decoded ``values``."""
    raise NotImplementedError

  def allocate(self, params_N: Array) -> Array:
    """The allocator's budgets at one parameter vector, made feasible (:meth:`feasible`).

    Args:
      params_N: ``[num_params]`` reals.

    Returns:
      int32 budgets of :attr:`shape`, summing to :attr:`total`, each in
      ``[window + 1, prompt_len]``.
    """
    return self.feasible(self.budgets(self.decode(params_N)))

  def feasible(self, budget: Array) -> Array:
    """``budget`` itself when it is feasible (its sum the total, each entry in bounds); else the
    feasible allocation nearest in shares to its slots above the floor."""
    a = jnp.asarray(budget, jnp.int32).reshape(self.shape)
    ok = (a.sum() == self.total) & (a.min() >= self.low) & (a.max() <= self.prompt_len)
    above = jnp.clip(a - self.low, 0, self.prompt_len - self.low).astype(jnp.float32)
    return jnp.where(ok, a, self.from_weights(above.reshape(-1)))

  def uniform(self) -> Array:
    """The uniform allocation of this memory."""
    return jnp.full(self.shape, self.budget, jnp.int32)


def _per_entry(layer_L: Array, shape) -> Array:
  """An ``[L]`` layer schedule at the space's shape (repeated over KV heads for ``[L, G]``)."""
  if len(shape) == 1:
    return layer_L
  return budgets_lib.per_head(layer_L, shape[1])


@dataclasses.dataclass(frozen=True, eq=False)
class PyramidSpace(AllocatorSpace):
  """PyramidKV's layer funnel, one parameter: ``beta``, the ratio of the mean layer's budget to
  the top layer's (1: uniform; PyramidKV's code hard-codes 20).

  The budgets are :func:`kvjax.budgets.pyramid`'s at ``mode`` (``"exact_total"`` by default,
  whose layers sum to the memory exactly), repeated over KV heads for ``[L, G]``. Reference:
  PyramidKV (Cai et al., arXiv 2406.02069; github.com/Zefan-Cai/KVCache-Factory,
  ``PyramidKVCluster``).

  Attributes:
    beta_range: ``(low, high)`` searched on a log scale, ``1 <= low < high``.
    pyramid_mode: one of :data:`kvjax.budgets.PYRAMID_MODES`.
  """

  rule: str = "pyramid_beta"
  rules: ClassVar[tuple[str, ...]] = ("pyramid_beta",)
  defaults: ClassVar[dict[str, float]] = {"beta": 20.0}
  beta_range: tuple[float, float] = (1.0, 100.0)
  pyramid_mode: str = "exact_total"

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "beta_range", check_range("beta_range", self.beta_range, 1.0))
    if self.pyramid_mode not in budgets_lib.PYRAMID_MODES:
      raise ValueError(
        f"pyramid_mode: unknown value {self.pyramid_mode!r}; expected one of "
        f"{budgets_lib.PYRAMID_MODES}"
      )
    if self.pyramid_mode != "exact_total" and self.shape[0] < 2:
      raise ValueError(
        f"shape: {self.shape}; pyramid_mode {self.pyramid_mode!r} needs at least 2 layers"
      )

  def bounds(self) -> tuple[Bound, ...]:
    return (Bound("beta", *self.beta_range, log=True),)

  def budgets(self, values):
    L = self.shape[0]
    layer_L = budgets_lib.pyramid(
      L, self.budget, self.window, self.prompt_len, beta=values["beta"], mode=self.pyramid_mode
    )
    return _per_entry(layer_L, self.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class AdaKVSpace(AllocatorSpace):
  """Ada-KV's head-wise adaptive split, one parameter: ``floor_alpha``, the share of each head's
  budget kept whatever the pooling (Ada-KV's default 0.2).

  Each layer's budget ``G * budget`` is split over its KV heads by :func:`kvjax.budgets.adakv`
  on ``scores_LGP`` (a policy's scores at KV-head granularity, mean over the calibration rows);
  shape ``(L, G)`` only. The searched ``floor_alpha`` is traced data, so the floor
  ``int(b * alpha)`` is the allocator's float32 form (a concrete call computes it in float64;
  the two differ only where ``b * alpha`` lies within float32 rounding of an integer). Reference:
  Ada-KV (Feng et al., arXiv 2407.11550; github.com/FFY0/AdaKV, ``AdaptiveSnapKVCluster``;
  kvpress ``AdaKVPress``).

  Attributes:
    scores_LGP: the scores ``[L, G, prompt_len]`` (finite), the last ``window`` positions the
      protected window.
    alpha_range: ``(low, high)`` within ``[0, 1]``, searched on a linear scale.
    adakv_mode: ``"official"`` or ``"kvpress"`` (:data:`kvjax.budgets.ADAKV_MODES`).
    normalize: Ada-KV's score scaling (``"official"``).
  """

  rule: str = "adakv"
  rules: ClassVar[tuple[str, ...]] = ("adakv",)
  defaults: ClassVar[dict[str, float]] = {"floor_alpha": 0.2}
  evidence: ClassVar[tuple[str, str] | None] = ("scores_LHP", "scores_LGP")
  scores_LGP: Array | None = None
  alpha_range: tuple[float, float] = (0.0, 1.0)
  adakv_mode: str = "official"
  normalize: bool = False

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "alpha_range", check_range("alpha_range", self.alpha_range, 0.0, 1.0))
    if len(self.shape) != 2:
      raise ValueError(
        f"shape: {self.shape}; Ada-KV splits each layer over its heads, expected (L, G)"
      )
    if self.scores_LGP is None:
      raise ValueError("scores_LGP: None; expected the scores [L, G, prompt_len]")
    scores = np.asarray(self.scores_LGP)
    if scores.shape != (*self.shape, self.prompt_len):
      raise ValueError(
        f"scores_LGP: shape {scores.shape}; expected {(*self.shape, self.prompt_len)} "
        "(the space's shape and prompt_len)"
      )
    if np.isnan(scores).any():
      raise ValueError("scores_LGP: contains NaN; expected scores to rank positions by")
    if self.adakv_mode not in budgets_lib.ADAKV_MODES:
      raise ValueError(
        f"adakv_mode: unknown value {self.adakv_mode!r}; expected one of {budgets_lib.ADAKV_MODES}"
      )
    if not isinstance(self.normalize, bool):
      raise ValueError(f"normalize: expected a bool, got {self.normalize!r}")
    object.__setattr__(self, "scores_LGP", jnp.asarray(scores, jnp.float32))

  def bounds(self) -> tuple[Bound, ...]:
    return (Bound("floor_alpha", *self.alpha_range),)

  def budgets(self, values):
    return budgets_lib.adakv(
      self.scores_LGP,
      self.budget,
      self.window,
      floor_alpha=values["floor_alpha"],
      normalize=self.normalize,
      mode=self.adakv_mode,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class CakeSpace(AllocatorSpace):
  """CAKE's layer preference ``H^(1/tau1) V^(1/tau2)``, two parameters: the temperatures
  ``tau1`` (entropy) and ``tau2`` (variance), which CAKE tunes per model (its
  ``config/model2tau.json``).

  The budgets are :func:`kvjax.budgets.cake_from_statistics`' on ``statistics`` (the
  calibration rows' mean :func:`kvjax.budgets.cake_statistics`), repeated over KV heads for
  ``[L, G]``. Reference: CAKE (Qin et al., ICLR 2025, arXiv 2503.12491;
  github.com/antgroup/cakekv, ``CakeprefillKVCache``).

  Attributes:
    statistics: ``(entropy_L, var_L)``, finite and non-negative, with a positive preference.
    tau_range: ``(low, high)`` with ``0 < low < high``, both temperatures searched on a log
      scale.
  """

  rule: str = "cake"
  rules: ClassVar[tuple[str, ...]] = ("cake",)
  defaults: ClassVar[dict[str, float]] = {"tau1": 1.0, "tau2": 1.0}
  evidence: ClassVar[tuple[str, str] | None] = ("statistics", "statistics")
  min_window: ClassVar[int] = 2  # CAKE's variance over the window's queries
  statistics: tuple | None = None
  tau_range: tuple[float, float] = (0.25, 4.0)

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(
      self, "tau_range", check_range("tau_range", self.tau_range, 0.0, strict=True)
    )
    if not isinstance(self.statistics, tuple | list) or len(self.statistics) != 2:
      raise ValueError(
        f"statistics: {type(self.statistics).__name__}; expected (entropy_L, var_L) "
        "(kvjax.budgets.cake_statistics)"
      )
    L = self.shape[0]
    stats = tuple(np.asarray(s, np.float64) for s in self.statistics)
    for name, s in zip(("entropy_L", "var_L"), stats, strict=True):
      if s.shape != (L,) or not np.isfinite(s).all() or (s < 0).any():
        raise ValueError(
          f"statistics: {name} of shape {s.shape} with min {s.min() if s.size else None}; "
          f"expected finite non-negative values [{L}]"
        )
    if not (stats[0] * stats[1]).sum() > 0:
      raise ValueError(
        "statistics: CAKE's layer preferences are all 0; expected window queries whose "
        "attention varies"
      )
    object.__setattr__(self, "statistics", tuple(jnp.asarray(s, jnp.float32) for s in stats))

  def bounds(self) -> tuple[Bound, ...]:
    return (Bound("tau1", *self.tau_range, log=True), Bound("tau2", *self.tau_range, log=True))

  def budgets(self, values):
    layer_L = budgets_lib.cake_from_statistics(
      self.statistics, self.budget, self.window, self.prompt_len, values["tau1"], values["tau2"]
    )
    return _per_entry(layer_L, self.shape)


SPACES = {"pyramid_beta": PyramidSpace, "adakv": AdaKVSpace, "cake": CakeSpace}
