"""A compression ratio per layer around any scorer: kvpress ``PerLayerCompressionPress``."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import select
from kvjax.policies import allocators as alloc_lib


def n_kept(n, compression_ratio: float, *, max_n: int | None = None):
  """kvpress's ``compute_n_kept``: ``max(1, int(n * (1 - compression_ratio)))``.

  Exact, as Python computes it in float64 (``int(640 * (1 - 0.9)) == 63``), for a static or
  concrete ``n``, and for a traced ``n`` given its static bound ``max_n`` (a table of the
  ``max_n + 1`` counts, computed on the host). A traced ``n`` without a bound (a decode-time
  target) is formed in fp32 with a nudge of ``1e-6 * n`` (``int(10 * 0.7) == 7`` as in Python;
  a product within that nudge below an integer rounds up).

  Args:
    n: the positions, an int or an int array (concrete or traced).
    compression_ratio: the fraction removed, a real in ``[0, 1)``.
    max_n: a static bound on a traced ``n`` (``None``: none known).

  Returns:
    The kept count (an int for a static ``n``, else int32 like ``n``).
  """
  keep = 1.0 - float(compression_ratio)
  if isinstance(n, int | np.integer):
    return max(1, int(int(n) * keep))
  if select.is_concrete(n):
    exact = np.floor(np.asarray(n).astype(np.float64) * keep)
    return jnp.asarray(np.maximum(exact, 1).astype(np.int32))
  n = jnp.asarray(n)
  if max_n is not None:
    table = jnp.asarray(_kept_table(keep, int(max_n)))
    return table[jnp.clip(n, 0, max_n)]
  kept = jnp.floor(n.astype(jnp.float32) * keep * (1 + 1e-6))
  return jnp.maximum(kept.astype(jnp.int32), 1)


@functools.lru_cache(maxsize=64)
def _kept_table(keep: float, max_n: int) -> np.ndarray:
  """``max(1, int(n * keep))`` for ``n`` in ``0..max_n``, in float64 as Python computes it."""
  n = np.arange(max_n + 1, dtype=np.float64)
  return np.maximum(np.floor(n * keep), 1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PerLayer(alloc_lib.Allocator):
  """A compression ratio per layer (kvpress ``PerLayerCompressionPress`` around any scorer).

  Reference: kvpress 0.5.5 ``presses/per_layer_compression_press.py::PerLayerCompressionPress``,
  which sets its scorer's ``compression_ratio`` to ``compression_ratios[layer]`` in each layer.

  Two forms:

  * ``relative=True`` (default): the total budget ``b`` is spread over the layers in proportion
    to their retained fractions: layer ``l`` keeps ``max(1, floor(b * (1 - r_l) / mean(1 - r)))``
    per head, so the mean budget stays ``b`` and a sweep over budgets keeps the layer shape.
    At ``b = T * (1 - mean(r))`` this is kvpress's count whenever the products are integers.
  * ``relative=False``: kvpress's count exactly, ``max(1, int(n * (1 - r_l)))`` in float64 as
    Python computes it (:func:`n_kept`), with ``n`` the row's real positions, capped by the
    given budget (a cache's capacity): pass a budget ``>= T`` for kvpress's numbers.

  Under a windowed policy (SnapKV) a layer's count must still hold the protected window: a
  ratio that leaves fewer is refused (:meth:`kvjax.policies.Policy.check_allocation`), where
  kvpress would keep part of the window.

  Differences from kvpress: the counts are token budgets under any kvjax scorer and any
  granularity, per head when the scorer's heads are query heads; kvpress leaves ragged
  per-layer caches that only its flash-attention path decodes, while kvjax's slot tables
  decode every layer's count. kvpress's ``compression_ratio`` property (the mean ratio) has no
  counterpart: the budget is given in tokens.

  Attributes:
    compression_ratios: the fraction of positions removed in each layer, one float in
      ``[0, 1)`` per layer (their count must be the scores' ``L``).
    relative: spread the given budget by the retained fractions (``True``) or keep kvpress's
      counts of the prompt capped by the budget (``False``).
  """

  budget_ndim: ClassVar[int] = 0
  compression_ratios: tuple[float, ...] = ()
  relative: bool = True

  def __post_init__(self):
    ratios = self.compression_ratios
    if isinstance(ratios, list):
      ratios = tuple(ratios)
      object.__setattr__(self, "compression_ratios", ratios)
    if not isinstance(ratios, tuple) or not ratios:
      raise ValueError(
        f"compression_ratios: expected a non-empty tuple of floats in [0, 1), got {ratios!r}"
      )
    for r in ratios:
      budgets_lib.check_real("compression_ratios", r, low=0.0, high=1.0)
      if r >= 1:
        raise ValueError(f"compression_ratios: expected floats in [0, 1), got {r!r}")
    # numpy or jax scalars are valid ratios; held as floats, so the allocator stays hashable
    object.__setattr__(self, "compression_ratios", tuple(float(r) for r in ratios))
    if not isinstance(self.relative, bool):
      raise ValueError(f"relative: expected a bool, got {self.relative!r}")

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    if len(self.compression_ratios) != L:
      raise ValueError(
        f"compression_ratios: {len(self.compression_ratios)} ratios for L={L} layers; "
        "expected one per layer"
      )
    b = alloc_lib.as_budget_LH(budget, L, H)[:, 0]
    if self.relative:
      keep_L = 1.0 - np.asarray(self.compression_ratios, np.float64)
      share_L = jnp.asarray(keep_L / keep_L.mean(), jnp.float32)
      budget_L = jnp.floor(b.astype(jnp.float32) * share_L * (1 + 1e-6)).astype(jnp.int32)
      budget_L = jnp.maximum(budget_L, 1)
    else:
      valid = evidence.valid_T
      n = T if valid is None else valid.sum()
      budget_L = jnp.stack(
        [jnp.asarray(n_kept(n, r, max_n=T), jnp.int32) for r in self.compression_ratios]
      )
      budget_L = jnp.minimum(budget_L, b)
    return jnp.broadcast_to(budget_L[:, None], (L, H)).astype(jnp.int32)
