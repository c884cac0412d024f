"""SimLayerKV: lazy layers keep their initial and recent tokens, the other layers keep all."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy

Array = jax.Array

# kvpress's recommended lazy_threshold per model family (SimLayerKVPress's docstring)
LAZY_THRESHOLDS = {"llama3": 0.9, "llama2": 0.65, "mistral": 0.8, "qwen": 0.85}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimLayerKV(Policy):
  """SimLayerKV's lazy layers (kvpress ``SimLayerKVPress``): a per-layer keep-all-or-stream choice.

  Paper: Zhang et al., "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction"
  (arXiv 2410.13846). Reference: kvpress 0.5.5 ``presses/simlayerkv_press.py::SimLayerKVPress``.

  A layer is lazy when the attention of the last ``n_last`` queries, averaged over them and
  every query head, puts more than ``lazy_threshold`` of its mass on the ``sinks`` initial and
  the ``n_recent`` most recent keys before those queries. A lazy layer keeps the ``sinks``
  initial tokens and the last ``n_recent - n_last`` ones; any other layer keeps all ``T``.

  The budget is the lazy layers' kept count, ``sinks + n_recent - n_last`` (a scalar, traced or
  concrete): kvpress's ``n_recent`` is ``budget - sinks + n_last``, so kvpress's defaults
  ``n_initial=4, n_recent=1024, n_last=1`` are ``budget=1027``. The layer budgets, ``budget``
  or ``T``, come from the window rows (:meth:`budgets`); every head of a layer gets the same.

  Differences from kvpress:

  * The budget stands for kvpress's ``n_recent`` (above); the kept sets are kvpress's.
  * ``lazy_threshold`` also takes a model family (:data:`LAZY_THRESHOLDS`, kvpress's
    recommendations: ``"llama3"`` 0.9, ``"llama2"`` 0.65, ``"mistral"`` 0.8, ``"qwen"`` 0.85).
  * A left-padded row counts its initial tokens from its first real token.
  * Laziness reads the prefill's window rows (the last ``n_last`` of them; kvpress recomputes
    them from the hidden states), so a prompt of ``T <= budget + 2 * n_last`` tokens (kvpress:
    ``T <= n_initial + n_recent + n_last``) is kept whole, as in kvpress.

  Attributes:
    lazy_threshold: a float in ``[0, 1]`` or a family of :data:`LAZY_THRESHOLDS` (1.0, kvpress's
      default, makes no layer lazy).
    n_last: the last queries whose attention decides laziness (kvpress ``n_last``, 1).
    sinks: initial tokens a lazy layer keeps (kvpress ``n_initial``, 4).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"attn_window_LHWT"})
  lazy_threshold: float | str = 1.0
  n_last: int = 1
  sinks: int = 4

  def __post_init__(self):
    super().__post_init__()
    t = self.lazy_threshold
    if isinstance(t, str):
      if t not in LAZY_THRESHOLDS:
        raise ValueError(
          f"lazy_threshold: unknown family {t!r}; expected a float in [0, 1] or one of "
          f"{sorted(LAZY_THRESHOLDS)}"
        )
    else:
      budgets_lib.check_real("lazy_threshold", t, low=0.0, high=1.0)
    check_int("n_last", self.n_last, 1)
    check_int("sinks", self.sinks, 0)
    if not isinstance(self.allocator, alloc_lib.Uniform):
      raise ValueError(
        f"allocator: {self.label!r} chooses its layer budgets from the attention; expected the "
        f"default Uniform(), got {type(self.allocator).__name__}"
      )

  @property
  def threshold(self) -> float:
    """The lazy threshold as a float (a family's recommendation resolved)."""
    t = self.lazy_threshold
    return LAZY_THRESHOLDS[t] if isinstance(t, str) else t

  @property
  def allocates(self) -> bool:
    """True: a layer that is not lazy keeps all ``T`` (a cache sizes its rows for ``T``)."""
    return True

  @property
  def observation_window(self) -> int:
    """``n_last``: the rows laziness reads."""
    return self.n_last

  def score(self, evidence):
    """StreamingLLM's order: ``sinks`` initial tokens protected, then the most recent."""
    L, H, T = evidence.positions_shape(self.label)
    return scores_lib.streaming(T, (L, H), sinks=self.sinks)

  def min_budget(self, window: int) -> int:
    """``sinks + 1``: a lazy layer keeps its initial tokens and at least one recent one."""
    return self.sinks + 1

  def _low_budget_message(self, low, floor):
    return (
      f"budget: {low} < {floor} for {self.label!r}; a lazy layer keeps sinks={self.sinks} "
      "initial tokens and at least one recent token"
    )

  def lazy_layers(self, evidence, budget) -> Array:
    """Which layers are lazy under ``budget`` (kvpress ``SimLayerKVPress.is_lazy``).

    Args:
      evidence: reads ``attn_window_LHWT`` (its last ``n_last`` rows) and ``valid_T``.
      budget: the lazy layers' kept count, a scalar (traced or concrete).

    Returns:
      bool ``[L]``.

    Raises:
      ValueError: the window rows are missing or fewer than ``n_last``.
    """
    attn = evidence.need("attn_window_LHWT", self.label)
    W, T = attn.shape[2:]
    if self.n_last > W:
      raise ValueError(
        f"evidence: {self.label!r} reads the last n_last={self.n_last} window rows, got W={W}"
      )
    valid_T = jnp.ones(T, bool) if evidence.valid_T is None else evidence.valid_T
    start = jnp.argmax(valid_T)
    n_recent = budget - self.sinks + self.n_last
    t = jnp.arange(T)
    cut = T - self.n_last  # kvpress drops the last n_last key columns
    initial = (t >= start) & (t < start + self.sinks)
    recent = (t >= cut - n_recent) & (t < cut)
    rows = attn[:, :, W - self.n_last :].astype(jnp.float32).mean((1, 2))  # [L, T]
    mass = jnp.where((initial | recent)[None, :], rows, 0.0).sum(-1)
    long_enough = valid_T.sum() > budget + 2 * self.n_last
    return (mass > self.threshold) & long_enough & (self.threshold < 1.0)

  def budgets(self, evidence, scores_LHT, budget):
    """``budget`` for the lazy layers, ``T`` for the others, every head of a layer alike.

    Args:
      evidence: the window rows (:meth:`lazy_layers`).
      scores_LHT: the grouped scores ``[L, H, T]``.
      budget: the lazy layers' kept count, a scalar.

    Returns:
      ``budget_LH`` int32 ``[L, H]``.

    Raises:
      ValueError: a budget that is not a scalar count, or a concrete one below ``sinks + 1``.
    """
    L, H, T = scores_LHT.shape
    if np.ndim(budget) != 0:
      raise ValueError(
        f"budget: {self.label!r} takes the lazy layers' kept count, a scalar; got shape "
        f"{np.shape(budget)}"
      )
    b = alloc_lib.as_budget_LH(budget, 1, 1)[0, 0]
    if select.is_concrete(budget) and int(budget) < self.sinks + 1:
      raise ValueError(self._low_budget_message(int(budget), self.sinks + 1))
    lazy_L = self.lazy_layers(evidence, b)
    return jnp.broadcast_to(jnp.where(lazy_L, b, T)[:, None], (L, H)).astype(jnp.int32)
