"""A compression ratio per layer around any scorer: kvpress ``PerLayerCompressionPress``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax.policies import allocators as alloc_lib


def n_kept(n, compression_ratio: float):
  """kvpress's ``compute_n_kept``: ``max(1, int(n * (1 - compression_ratio)))``.

  Exact (Python's double) for a static ``n``; for a traced ``n`` the product is formed in fp32
  with a nudge of ``1e-6 * n``, so ``int(10 * 0.7) == 7`` as in Python.

  Args:
    n: the positions, an int or a traced int array.
    compression_ratio: the fraction removed, a float in ``[0, 1)``.

  Returns:
    The kept count (an int for a static ``n``, else int32 like ``n``).
  """
  if isinstance(n, int | np.integer):
    return max(1, int(int(n) * (1.0 - compression_ratio)))
  n = jnp.asarray(n)
  kept = jnp.floor(n.astype(jnp.float32) * (1.0 - compression_ratio) * (1 + 1e-6))
  return jnp.maximum(kept.astype(jnp.int32), 1)


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
  * ``relative=False``: kvpress's count exactly, ``max(1, int(n * (1 - r_l)))`` with ``n`` the
    row's real positions, capped by the given budget (a cache's capacity): pass a budget
    ``>= T`` for kvpress's numbers.

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
      budget_L = jnp.stack([jnp.asarray(n_kept(n, r), jnp.int32) for r in self.compression_ratios])
      budget_L = jnp.minimum(budget_L, b)
    return jnp.broadcast_to(budget_L[:, None], (L, H)).astype(jnp.int32)
