"""Allocators: a total budget -> ``budget_LH``, as composable objects.

Any policy takes any allocator (``SnapKV(allocator=Pyramid())`` is PyramidKV), and a user's
allocator is one small frozen dataclass with a ``__call__``. The arithmetic lives in
:mod:`kvjax.budgets` (and :mod:`kvjax.select` for pooled selections); these objects only hold
the options and say what evidence they read.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select
from kvjax.policies.evidence import Evidence

Array = jax.Array


def check_budget_counts(budget):
  """Checks a budget's token counts: integer dtype and, when concrete, in ``[0, 2**31)``.

  The check comes before any cast, so ``np.int64(2**32 + 12)`` never wraps to 12.

  Args:
    budget: token counts, a number or array (concrete or traced).

  Returns:
    The counts as numpy (concrete) or the tracer.

  Raises:
    ValueError: a non-integer dtype, or concrete counts below 0 or not below ``2**31``.
  """
  arr = np.asarray(budget) if select.is_concrete(budget) else budget
  if arr.dtype != object and not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"budget: expected integer token counts, got dtype {arr.dtype}")
  if select.is_concrete(arr) and arr.dtype != object and arr.size and int(arr.min()) < 0:
    raise ValueError(f"budget: expected non-negative token counts, got {int(arr.min())}")
  return select.check_counts("budget", budget)


def as_budget_LH(budget, L: int, H: int) -> Array:
  """A scalar, ``[L]`` or ``[L, H]`` budget as ``budget_LH`` int32.

  Args:
    budget: token counts, a scalar, ``[L]`` (per layer) or ``[L, H]``.
    L: the layers.
    H: the heads.

  Returns:
    ``budget_LH`` int32 ``[L, H]``.

  Raises:
    ValueError: counts :func:`check_budget_counts` refuses, or a shape that is not a scalar,
      ``[L]`` or ``[L, H]``.
  """
  budget = check_budget_counts(budget)
  if select.is_concrete(budget):
    budget = np.asarray(budget, np.int32)
  budget = jnp.asarray(budget).astype(jnp.int32)
  if budget.ndim == 1:
    budget = budget[:, None]
  try:
    return jnp.broadcast_to(budget, (L, H))
  except ValueError:
    raise ValueError(
      f"budget: shape {budget.shape} is not a scalar, [L={L}] or [L={L}, H={H}]"
    ) from None


def _choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}: unknown value {value!r}; expected one of {choices}")


@dataclasses.dataclass(frozen=True)
class Allocator:
  """A rule from a total budget to ``budget_LH`` int32.

  Subclasses implement :meth:`__call__`.

  The ``window`` an allocator is given is always the policy's own protected window
  (:meth:`kvjax.policies.Policy.protected_window`: 0 for a policy that protects none), in the
  policy's :meth:`~kvjax.policies.Policy.budgets`, the lab, the model and the sweep alike. Its
  output is checked (:meth:`kvjax.policies.Policy.check_allocation`): an integer ``[L, H]``
  that gives no row of a windowed policy fewer slots than that window; the built-in allocators
  reserve the window in every budget, so only an allocator that does not (a high
  :class:`~kvjax.policies.PerLayer` ratio, a user's) meets the refusal.

  Class attributes, which a subclass sets:

  * ``needs``: the :class:`~kvjax.policies.Evidence` fields it reads besides the scores.
  * ``budget_ndim``: the largest budget rank it takes (0: a scalar, 1: ``[L]``, 2: ``[L, H]``).
  * ``keeps_all``: it keeps every position (a budget below ``T`` is then an error).
  * ``from_budget_alone``: its ``budget_LH`` follows from the budget and the shapes alone (no
    evidence, no scores), so a decoder may size each layer's buffers from it without
    compiling again for every input (``kvjax.model.cache.CacheSpec.layer_capacity``).
  """

  needs: ClassVar[frozenset[str]] = frozenset()
  budget_ndim: ClassVar[int] = 0
  keeps_all: ClassVar[bool] = False
  from_budget_alone: ClassVar[bool] = False

  def __call__(self, evidence: Evidence, scores_LHT: Array, budget, window: int) -> Array:
    """Allocates ``budget`` to the heads as ``budget_LH``.

    Args:
      evidence: what the policy observes (an allocator reads the fields in ``needs``).
      scores_LHT: the policy's grouped scores ``[L, H, T]``.
      budget: the total budget, a scalar, ``[L]`` or ``[L, H]`` (rank at most
        :attr:`max_budget_ndim`).
      window: the policy's protected window (0 when it protects none), reserved in every budget.

    Returns:
      ``budget_LH`` int32 ``[L, H]``.

    Raises:
      NotImplementedError: here; a subclass implements it.
      ValueError: (in a subclass) a budget it cannot take, or evidence it needs is ``None``.
    """
    raise NotImplementedError

  @property
  def max_budget_ndim(self) -> int:
    """The largest budget rank this allocator takes.

    ``budget_ndim``, unless its options narrow it.
    """
    return self.budget_ndim


@dataclasses.dataclass(frozen=True)
class Uniform(Allocator):
  """The budget as given.

  A scalar for every head, ``[L]`` per layer or an explicit ``[L, H]`` table.
  """

  budget_ndim: ClassVar[int] = 2
  from_budget_alone: ClassVar[bool] = True

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, _ = scores_LHT.shape
    return as_budget_LH(budget, L, H)


@dataclasses.dataclass(frozen=True)
class Pyramid(Allocator):
  """PyramidKV's layer schedule (:func:`kvjax.budgets.pyramid`): more budget in lower layers.

  ``beta`` 20 as the official code, ``pyramid_mode`` one of :data:`kvjax.budgets.PYRAMID_MODES`
  (``"legacy_floor"``: KVCache-Factory's integer arithmetic).
  """

  from_budget_alone: ClassVar[bool] = True
  beta: float = 20
  pyramid_mode: str = "legacy_floor"

  def __post_init__(self):
    _choice("pyramid_mode", self.pyramid_mode, budgets_lib.PYRAMID_MODES)
    budgets_lib.check_real("beta", self.beta, low=1.0)

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    layer_L = budgets_lib.pyramid(L, budget, window, T, beta=self.beta, mode=self.pyramid_mode)
    return budgets_lib.per_head(layer_L, H)


@dataclasses.dataclass(frozen=True)
class AdaKV(Allocator):
  """Ada-KV's head-adaptive split of each layer's budget by the scores.

  The split is :func:`kvjax.budgets.adakv`'s: ``floor_alpha`` 0.2 of it spread evenly,
  ``adakv_mode`` ``"official"`` or ``"kvpress"``; with ``pyramid_mode`` the layer budgets first
  follow PyramidKV's schedule (Ada-KV's ``pyram_mode``).
  """

  floor_alpha: float = 0.2
  normalize: bool = False
  adakv_mode: str = "official"
  pyramid_mode: str | None = None
  beta: float = 20

  def __post_init__(self):
    budgets_lib.check_real("floor_alpha", self.floor_alpha, low=0.0, high=1.0)
    if not isinstance(self.normalize, bool):
      raise ValueError(f"normalize: expected a bool, got {self.normalize!r}")
    _choice("adakv_mode", self.adakv_mode, budgets_lib.ADAKV_MODES)
    _choice("pyramid_mode", self.pyramid_mode, (None, *budgets_lib.PYRAMID_MODES))
    budgets_lib.check_real("beta", self.beta, low=1.0)

  @property
  def max_budget_ndim(self) -> int:
    """0 (a scalar) with ``pyramid_mode``, whose schedule spreads it; else 1 (``[L]``)."""
    return 0 if self.pyramid_mode else 1

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    if self.pyramid_mode:
      budget = budgets_lib.pyramid(L, budget, window, T, beta=self.beta, mode=self.pyramid_mode)
    return budgets_lib.adakv(
      scores_LHT,
      budget,
      window,
      floor_alpha=self.floor_alpha,
      normalize=self.normalize,
      mode=self.adakv_mode,
    )


@dataclasses.dataclass(frozen=True)
class HeadKV(Allocator):
  """HeadKV's static head budgets from each head's importance (:func:`kvjax.budgets.headkv`).

  The importance is ``evidence.head_scores_LH``; ``beta`` 1.5 (a pool of ``b // beta`` per head
  moves to the important heads), ``temp`` 1.0.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"head_scores_LH"})
  beta: float = 1.5
  temp: float = 1.0
  headkv_mode: str = "official"

  def __post_init__(self):
    budgets_lib.check_real("beta", self.beta, low=1.0, strict=True)  # b // beta needs beta > 1
    budgets_lib.check_real("temp", self.temp, low=0.0, strict=True)
    _choice("headkv_mode", self.headkv_mode, budgets_lib.HEADKV_MODES)

  def __call__(self, evidence, scores_LHT, budget, window):
    return budgets_lib.headkv(
      evidence.need("head_scores_LH", "headkv"),
      budget,
      window,
      beta=self.beta,
      temp=self.temp,
      mode=self.headkv_mode,
      q_len=scores_LHT.shape[-1],
    )


@dataclasses.dataclass(frozen=True)
class CakeLayers(Allocator):
  """CAKE's layer preference from the window rows' entropy and variance.

  The schedule is :func:`kvjax.budgets.cake`'s, with temperatures ``tau1`` and ``tau2`` 1.0. The
  preference is measured on the protected window's rows; under a policy that protects no window
  (``window`` 0) on every observation row of the evidence, with nothing reserved.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"attn_window_LHWT"})
  tau1: float = 1.0
  tau2: float = 1.0

  def __post_init__(self):
    budgets_lib.check_real("tau1", self.tau1, low=0.0, strict=True)
    budgets_lib.check_real("tau2", self.tau2, low=0.0, strict=True)

  def __call__(self, evidence, scores_LHT, budget, window):
    attn = evidence.need("attn_window_LHWT", "cake")
    if window:
      layer_L = budgets_lib.cake(attn, budget, window, self.tau1, self.tau2)
    else:  # a policy that protects no window: every observation row measures, none is reserved
      rows = attn.shape[2]
      if rows < 2:
        raise ValueError(
          f"attn_window_LHWT: CAKE's variance over window queries needs >= 2 rows, got {rows}"
        )
      statistics = budgets_lib.cake_statistics(attn, rows)
      T = attn.shape[-1]
      layer_L = budgets_lib.cake_from_statistics(statistics, budget, 0, T, self.tau1, self.tau2)
    return budgets_lib.per_head(layer_L, scores_LHT.shape[1])


def heads_like(x_LG: Array, num_heads: int) -> Array:
  """A per-KV-head ``[L, G]`` table at the scores' granularity (repeated over GQA groups).

  Args:
    x_LG: the table, ``[L, G]``.
    num_heads: the scores' heads (``G`` or a multiple of it).

  Returns:
    ``[L, num_heads]``: each KV head's entry repeated over its query heads (``x_LG`` itself
    when ``num_heads == G``).

  Raises:
    ValueError: ``G`` does not divide ``num_heads``.
  """
  G = x_LG.shape[1]
  if num_heads == G:
    return x_LG
  if num_heads % G:
    raise ValueError(f"retrieval_heads: G={G} KV heads do not divide the scores' {num_heads} heads")
  return jnp.repeat(x_LG, num_heads // G, axis=1)


@dataclasses.dataclass(frozen=True)
class DuoSplit(Allocator):
  """DuoAttention: retrieval heads keep all ``T``; the lowest gates are streaming heads.

  The ``round(L * G * head_compression_ratio)`` lowest gates (``evidence.retrieval_heads_LG``)
  are streaming heads that keep ``budget``.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"retrieval_heads_LG"})
  head_compression_ratio: float = 0.5

  def __post_init__(self):
    budgets_lib.check_real("head_compression_ratio", self.head_compression_ratio, low=0.0, high=1.0)

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    gates = evidence.need("retrieval_heads_LG", "duo_attention")
    streaming = scores_lib.duo_streaming_heads(gates, self.head_compression_ratio)
    budget_LH = as_budget_LH(budget, L, H)
    return jnp.where(heads_like(streaming, H), budget_LH, T).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Pooled(Allocator):
  """KVzip's selection pooled across heads: ``L * H * budget`` over every layer and head at once.

  That is kvpress's default; with ``layerwise``, ``H * budget`` per layer.
  """

  layerwise: bool = False

  def __post_init__(self):
    if not isinstance(self.layerwise, bool):
      raise ValueError(f"layerwise: expected a bool, got {self.layerwise!r}")

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    b = jnp.minimum(as_budget_LH(budget, L, H)[:, 0], T)  # a scalar budget: every row the same
    if self.layerwise:
      return select.pooled_budgets(scores_LHT, b * H)
    flat = scores_LHT.reshape(1, L * H, T)
    return select.pooled_budgets(flat, b[:1] * (L * H)).reshape(L, H)


@dataclasses.dataclass(frozen=True)
class KeepAll(Allocator):
  """Every position of every head (ThinK alone prunes key channels, not tokens)."""

  keeps_all: ClassVar[bool] = True
  from_budget_alone: ClassVar[bool] = True

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    return jnp.full((L, H), T, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Layered(Allocator):
  """A layer schedule, then a head allocation of each layer's budget.

  ``layers`` turns the total budget into per-layer budgets (its ``budget_LH``'s first column),
  ``heads`` splits each layer's among its heads (it must take a ``[L]`` budget, as
  :class:`AdaKV` does). CAKE's layer preference with Ada-KV's head split is
  ``Layered(CakeLayers(), AdaKV())``.
  """

  layers: Allocator = Uniform()
  heads: Allocator = Uniform()

  def __post_init__(self):
    for name, value in (("layers", self.layers), ("heads", self.heads)):
      if not isinstance(value, Allocator):
        raise ValueError(f"{name}: expected an Allocator, got {value!r}")
    if self.heads.max_budget_ndim < 1:
      raise ValueError(
        f"heads: {type(self.heads).__name__} allocates across layers itself; expected a head "
        "allocation that takes a budget per layer (Uniform, AdaKV)"
      )

  @property
  def needs(self) -> frozenset[str]:  # type: ignore[override]
    """The evidence both allocators read."""
    return self.layers.needs | self.heads.needs

  @property
  def from_budget_alone(self) -> bool:  # type: ignore[override]
    """Whether both allocators follow from the budget alone."""
    return self.layers.from_budget_alone and self.heads.from_budget_alone

  @property
  def max_budget_ndim(self) -> int:
    """The layer schedule's largest budget rank."""
    return self.layers.max_budget_ndim

  def __call__(self, evidence, scores_LHT, budget, window):
    budget_L = self.layers(evidence, scores_LHT, budget, window)[:, 0]
    return self.heads(evidence, scores_LHT, budget_L, window)
