"""Merge-on-evict (kvpress ``MergingPress``): each evicted value folded into its most
cosine-similar kept neighbour at compression; keys kept as they are.

Reference: kvpress 0.5.5 ``kvpress/presses/merging_press.py::MergingPress`` (inspired by Token
Merging, Bolya et al., ICLR 2023, arXiv 2210.09461, and D2O, Wan et al. 2024, arXiv 2406.13035).
The model's cache calls :meth:`Merging.merge` (the :meth:`~kvjax.policies.Policy.merge` hook)
after the selection, before it gathers the kept values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax.policies.protocols import ValueMerging
from kvjax.policies.wrappers import Wrapper, check_base

Array = jax.Array

EPS = 1e-6  # kvpress's _EPS: the norms' floor and the weights' denominator


def _lerp(a: Array, b: Array, w: Array) -> Array:
  """``torch.lerp``'s two branches (so a quantile between equal values is exact)."""
  return jnp.where(w < 0.5, a + w * (b - a), b - (b - a) * (1 - w))


def _quantile(x: Array, member: Array, q: float) -> Array:
  """``torch.quantile(x[member], q)`` (linear) per row of ``[..., T]``; ``-inf`` entries give
  ``nan`` as torch's interpolation does."""
  n = member.sum(-1, keepdims=True)
  ordered = jnp.sort(jnp.where(member, x, jnp.inf), axis=-1)  # members first, ascending
  rank = jnp.float32(q) * (n - 1).astype(jnp.float32)
  lo = jnp.floor(rank).astype(jnp.int32)
  hi = jnp.minimum(jnp.ceil(rank).astype(jnp.int32), jnp.maximum(n - 1, 0))
  a = jnp.take_along_axis(ordered, lo, -1)
  b = jnp.take_along_axis(ordered, hi, -1)
  return _lerp(a, b, rank - lo.astype(jnp.float32))


def merge_values(
  keys_HTD: Array,
  values_HTD: Array,
  keep_HT: Array,
  valid_HT: Array | None = None,
  *,
  similarity_threshold: float = 0.0,
  merge_fraction: float = 1.0,
) -> Array:
  """kvpress ``MergingPress.merge`` over one head's positions (any leading axes).

  For each evicted position ``t``: its most cosine-similar kept key ``s`` (keys in fp32, norms
  floored at ``1e-6``), merged when ``sim >= similarity_threshold`` and (``merge_fraction < 1``)
  ``sim`` is at least the ``1 - merge_fraction`` quantile of the evicted positions' similarities
  (those failing the threshold as ``-inf``, torch's linear quantile: a ``nan`` threshold, so no
  merge, when it interpolates at one of them), with weight
  ``w = max(sim, 0) * |v_t| / (|v_t| + |v_s| + 1e-6)``. Each kept value that received any
  weight becomes ``(v_s + sum w v_t) / (1 + sum w)`` (fp32 accumulation); keys are unchanged.

  Differences from kvpress: padded positions (``valid_HT`` false) are neither evicted nor kept;
  a similarity tie goes to the lower kept position (kvpress: the first in ``topk`` order); the
  weighted sums are a matrix product (kvpress: ``scatter_add_``), equal up to fp32 rounding.
  The similarity matrix is ``[..., T, T]``: the caller bounds the leading axes it passes at once.

  Args:
    keys_HTD: post-RoPE keys ``[..., T, D]``.
    values_HTD: values ``[..., T, D]``.
    keep_HT: bool ``[..., T]``, the kept positions.
    valid_HT: bool, broadcastable to ``keep_HT``, the real positions (``None``: all).
    similarity_threshold: the least cosine similarity that merges (kvpress default 0.0).
    merge_fraction: the fraction of the evicted positions, by similarity, that merge (1.0).

  Returns:
    The values ``[..., T, D]`` in ``values_HTD``'s dtype, the kept positions' merged.
  """
  valid = jnp.ones_like(keep_HT) if valid_HT is None else jnp.broadcast_to(valid_HT, keep_HT.shape)
  keep = keep_HT & valid
  evict = valid & ~keep
  hi = jax.lax.Precision.HIGHEST
  k = keys_HTD.astype(jnp.float32)
  k = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), EPS)
  sim = jnp.einsum("...td,...sd->...ts", k, k, precision=hi)
  sim = jnp.where(keep[..., None, :], sim, -jnp.inf)
  target = jnp.argmax(sim, axis=-1)  # [..., T]: ties to the lower kept position
  max_sim = jnp.max(sim, axis=-1)
  ok = evict & (max_sim >= similarity_threshold)
  if merge_fraction < 1.0:
    gated = jnp.where(ok, max_sim, -jnp.inf)
    cut = _quantile(gated, evict, 1.0 - merge_fraction)
    ok = ok & (max_sim >= cut)
  v = values_HTD.astype(jnp.float32)
  norms = jnp.linalg.norm(v, axis=-1)
  target_norm = jnp.take_along_axis(norms, target, -1)
  w = jnp.where(ok, jnp.maximum(max_sim, 0.0), 0.0) * norms / (norms + target_norm + EPS)
  onto = jnp.where(ok[..., None], jax.nn.one_hot(target, keep.shape[-1]), 0.0) * w[..., None]
  acc = jnp.einsum("...ts,...td->...sd", onto, v, precision=hi)
  weight = onto.sum(-2)  # [..., T] per kept position
  merged = ((v + acc) / (1.0 + weight)[..., None]).astype(values_HTD.dtype)
  return jnp.where((keep & (weight > 0))[..., None], merged, values_HTD)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Merging(ValueMerging, Wrapper):
  """kvpress ``MergingPress`` over ``base``: the base selects, the cache merges.

  The kept set is the base's (scores, grouping and allocation unchanged); at compression the
  model's cache folds each evicted value into its most cosine-similar kept neighbour
  (:func:`merge_values`) before it gathers the kept values. Keys are kept as they are (RoPE-safe).

  Reference: kvpress 0.5.5 ``kvpress/presses/merging_press.py::MergingPress``. Differences:

  * The base is any budget-free prefill scorer with any allocator (kvpress: a ``ScorerPress``
    under a compression ratio; per-head and per-layer budgets merge per head).
  * Merging happens where the cache compresses the prompt (:func:`kvjax.model.cache.compress`);
    analysis paths that only compute kept masks (``keep_mask``, the lab) see the base's choice.
    ``decode_every`` is refused (kvpress's ``DecodingPress`` takes no ``MergingPress``).
  * The differences of :func:`merge_values` (padding, ties, summation order).

  Attributes:
    similarity_threshold: the least cosine similarity that merges, in ``[0, 1]`` (0.0).
    merge_fraction: the fraction of evicted positions, by similarity, that merge, in
      ``(0, 1]`` (1.0).
  """

  similarity_threshold: float = 0.0
  merge_fraction: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    check_base(self.base, "Merging")
    budgets_lib.check_real("similarity_threshold", self.similarity_threshold, low=0.0, high=1.0)
    budgets_lib.check_real("merge_fraction", self.merge_fraction, low=0.0, strict=True, high=1.0)
    if self.decode_every is not None or self.base.decode_every is not None:
      raise ValueError(
        "decode_every: Merging merges at the prompt's compression only; expected None"
      )

  def merge(self, keys_LHTD, values_LHTD, keep_LHT, valid_LHT):
    """Folds the evicted values into the kept ones (:func:`merge_values`)."""
    return merge_values(
      keys_LHTD,
      values_LHTD,
      keep_LHT,
      valid_LHT,
      similarity_threshold=self.similarity_threshold,
      merge_fraction=self.merge_fraction,
    )
