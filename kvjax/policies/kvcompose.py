"""KVCompose: composite tokens aligned across heads, from the attention of a second pass over the
context (kvpress ``KVComposePress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import select
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.checks import check_bool, check_choice, check_int
from kvjax.policies.core import Policy

Array = jax.Array

AGGREGATIONS = ("mean", "max")
BOOST = 1e9  # kvpress adds it to each row's keep_token_lower_bound best (sorted) scores


def _reduce(x: Array, how: str, axis: int) -> Array:
  return x.mean(axis) if how == "mean" else x.max(axis)


def kvcompose_scores(
  attn_LHT: Array,
  num_kv_heads: int,
  *,
  agg_group: str = "mean",
  add_mean_across_heads: bool = True,
  values_LGTD: Array | None = None,
) -> Array:
  """kvpress ``KVComposePress.compute_scores`` and ``enhance_scores`` per KV head ``[L, G, T]``.

  The per-query-head evidence reduced over each GQA group (``agg_group``), times ``||v_t||_2``
  when ``values_LGTD`` is given, then (``add_mean_across_heads``) plus the mean over the
  layer's KV heads.

  Args:
    attn_LHT: ``evidence.reconstruction_attn_LHT``, ``[L, Hq, T]``.
    num_kv_heads: ``G``; it must divide ``Hq``.
    agg_group: ``"mean"`` or ``"max"`` over each group's query heads.
    add_mean_across_heads: adds the mean over the layer's KV heads to every head.
    values_LGTD: the context's values ``[L, G, T, D]`` (``None``: no value norm).

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: ``num_kv_heads`` does not divide the query heads.
  """
  L, Hq, T = attn_LHT.shape
  G = num_kv_heads
  if Hq % G:
    raise ValueError(f"reconstruction_attn_LHT: {Hq} query heads are not a multiple of G={G}")
  s = _reduce(attn_LHT.astype(jnp.float32).reshape(L, G, Hq // G, T), agg_group, 2)
  if values_LGTD is not None:
    s = s * jnp.linalg.norm(values_LGTD.astype(jnp.float32), axis=-1)
  if add_mean_across_heads:
    s = s + s.mean(1, keepdims=True)
  return s


def _boosted_curves(scores_LHT: Array, keep_token_lower_bound: int) -> Array:
  """Each row sorted descending, ``BOOST`` added to its first ``keep_token_lower_bound``."""
  curves = -jnp.sort(-scores_LHT.astype(jnp.float32), axis=-1)
  T = curves.shape[-1]
  boost_T = jnp.where(jnp.arange(T) < keep_token_lower_bound, BOOST, 0.0).astype(jnp.float32)
  return curves + boost_T[None, None]


def composite_head_counts(scores_LHT: Array, total, *, keep_token_lower_bound: int = 0) -> Array:
  """Unstructured KVCompose counts: int32 ``[L, H]`` (kvpress ``important_per_head``).

  The ``total`` best entries pooled over every layer's and head's sorted scores (each row's
  first ``keep_token_lower_bound`` raised by 1e9), counted per row; ties to the lower row.

  Args:
    scores_LHT: the scores ``[L, H, T]``.
    total: the kept entries in all, an int (traced or concrete) in ``[0, L*H*T]``.
    keep_token_lower_bound: each row's best entries that go first.

  Returns:
    The per-head counts, int32 ``[L, H]``, summing to ``total``.
  """
  L, H, T = scores_LHT.shape
  flat = _boosted_curves(scores_LHT, keep_token_lower_bound).reshape(1, L * H, T)
  return select.pooled_budgets(flat, jnp.reshape(total, (1,))).reshape(L, H)


def composite_layer_counts(
  scores_LHT: Array, total, *, keep_token_lower_bound: int = 0, agg_head: str = "mean"
) -> Array:
  """Structured KVCompose counts: int32 ``[L]`` (kvpress ``important_per_layer``).

  Each layer's composite curve is the ``agg_head`` over its heads of their sorted scores (the
  first ``keep_token_lower_bound`` raised by 1e9); layer 0's curve is the elementwise max over
  every layer's; the ``total`` best entries over all layers are counted per layer (ties to the
  lower layer) and each count floored at ``max(1, keep_token_lower_bound)``.

  Args:
    scores_LHT: the scores ``[L, H, T]``.
    total: the kept entries in all, an int (traced or concrete) in ``[0, L*T]``.
    keep_token_lower_bound: the best entries of each curve that go first, and the floor.
    agg_head: ``"mean"`` or ``"max"`` over the heads' sorted scores.

  Returns:
    The per-layer counts, int32 ``[L]`` (their sum may exceed ``total`` by the floor).
  """
  L, H, T = scores_LHT.shape
  curves = -jnp.sort(-scores_LHT.astype(jnp.float32), axis=-1)
  layer_LT = _reduce(curves, agg_head, 1)
  boost_T = jnp.where(jnp.arange(T) < keep_token_lower_bound, BOOST, 0.0).astype(jnp.float32)
  layer_LT = layer_LT + boost_T[None]
  layer_LT = layer_LT.at[0].set(layer_LT.max(0))
  counts = select.pooled_budgets(layer_LT[None], jnp.reshape(total, (1,)))[0]
  return jnp.maximum(counts, max(1, keep_token_lower_bound)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Composite(alloc_lib.Allocator):
  """KVCompose's allocation: per-layer (structured) or per-head (unstructured) counts.

  From a per-head budget ``b``: structured, the ``L * min(b, T)`` best entries of the layers'
  composite curves (:func:`composite_layer_counts`: the ``agg_head`` over heads of their sorted
  scores, layer 0 the max over layers, each count at least ``max(1, keep_token_lower_bound)``),
  every head of a layer keeping that layer's count; unstructured, the ``L * H * min(b, T)``
  best entries of every head's sorted scores (:func:`composite_head_counts`). Each head then
  keeps its own best scores. kvpress's total is ``int(L * G * T * (1 - compression_ratio))``
  (``L * T * ...`` structured): the same as ``b = T * (1 - compression_ratio)`` when that is an
  integer.

  Attributes:
    structured: per-layer counts shared by the layer's heads (kvpress default), else per head.
    agg_head: ``"mean"`` or ``"max"``, the composite curve of a layer (structured only).
    keep_token_lower_bound: each curve's (or head's) best entries that go first; the floor of
      a structured layer's count is ``max(1, keep_token_lower_bound)``.
  """

  structured: bool = True
  agg_head: str = "mean"
  keep_token_lower_bound: int = 0

  def __post_init__(self):
    check_bool("structured", self.structured)
    check_choice("agg_head", self.agg_head, AGGREGATIONS)
    check_int("keep_token_lower_bound", self.keep_token_lower_bound, 0)

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, T = scores_LHT.shape
    b = jnp.minimum(alloc_lib.as_budget_LH(budget, L, H)[0, 0], T)
    if self.structured:
      counts_L = composite_layer_counts(
        scores_LHT,
        b * L,
        keep_token_lower_bound=self.keep_token_lower_bound,
        agg_head=self.agg_head,
      )
      return jnp.broadcast_to(counts_L[:, None], (L, H)).astype(jnp.int32)
    return composite_head_counts(
      scores_LHT, b * (L * H), keep_token_lower_bound=self.keep_token_lower_bound
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCompose(Policy):
  """KVCompose: attention of a second pass over the context, composite tokens across heads.

  Paper: "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens"
  (arXiv:2509.05165). Reference: kvpress 0.5.5 ``presses/kvcompose_press.py::KVComposePress``.
  The evidence ``evidence.reconstruction_attn_LHT`` is, per query head, the max over the
  queries of a second pass that reads the context again after itself of the attention each
  context key receives (:func:`kvjax.model.calibrate.kvcompose_evidence`). The scores reduce
  it over each GQA group (``agg_group``), optionally times ``||v||`` (``add_v_norm``), plus the
  mean over the layer's KV heads (``add_mean_across_heads``): per KV head ``[L, G, T]``. The
  default allocator :class:`Composite` turns a per-head budget into per-layer counts
  (structured: every head of a layer keeps the same count, the cache stays rectangular) or
  per-head counts (unstructured); each head keeps its own best scores.

  Differences from kvpress:

  * the budget: kvpress takes ``compression_ratio`` and keeps
    ``int(L * G * T * (1 - ratio))`` entries in all (structured: ``int(L * T * (1 - ratio))``
    composite tokens); kvjax takes a per-head budget ``b`` and pools ``L * G * min(b, T)``
    (``L * min(b, T)``); equal when ``T * (1 - ratio)`` is an integer.
  * ``agg_task`` is ``"max"`` (kvpress's default; the evidence is that max), not an option.
  * ``add_v_norm``: kvpress multiplies by the norms of every cached value after the second
    pass (``2T`` of them), which fails against the ``T`` scores; kvjax uses the context's
    values ``evidence.values_LGTD``.
  * the second pass reads the context itself or one prompt (``kvcompose_evidence``'s
    ``prompt_ids``); kvpress reads a list of prompts one after another.
  * ties in the pooled counts go to the lower layer (head), then position; kvpress's
    ``torch.topk`` leaves them unspecified.

  Attributes:
    agg_group: ``"mean"`` (kvpress) or ``"max"`` over each GQA group's query heads.
    add_v_norm: multiplies each score by its value's L2 norm (kvpress default ``False``).
    add_mean_across_heads: adds the mean over the layer's KV heads (kvpress default ``True``).
    num_kv_heads: the KV heads ``G`` of the grouping (``None``: from ``values_LGTD`` when
      present, else the evidence's query heads, one per group).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"reconstruction_attn_LHT"})
  allocator: alloc_lib.Allocator = Composite()
  agg_group: str = "mean"
  add_v_norm: bool = False
  add_mean_across_heads: bool = True

  def __post_init__(self):
    super().__post_init__()
    check_choice("agg_group", self.agg_group, AGGREGATIONS, self.label)
    check_bool("add_v_norm", self.add_v_norm)
    check_bool("add_mean_across_heads", self.add_mean_across_heads)

  @property
  def evidence_fields(self) -> frozenset[str]:
    """The evidence, with the values for ``add_v_norm``."""
    out = super().evidence_fields
    return out | {"values_LGTD"} if self.add_v_norm else out

  def _kv_heads(self, evidence) -> int:
    if self.num_kv_heads is not None:
      return self.num_kv_heads
    if evidence.values_LGTD is not None:
      return evidence.values_LGTD.shape[1]
    if evidence.keys_LGTD is not None:
      return evidence.keys_LGTD.shape[1]
    return evidence.need("reconstruction_attn_LHT", self.label).shape[1]

  def score(self, evidence):
    """KVCompose's enhanced scores per KV head (kvpress ``compute_scores``, ``enhance_scores``)."""
    attn = evidence.need("reconstruction_attn_LHT", self.label)
    values = evidence.need("values_LGTD", self.label) if self.add_v_norm else None
    return kvcompose_scores(
      attn,
      self._kv_heads(evidence),
      agg_group=self.agg_group,
      add_mean_across_heads=self.add_mean_across_heads,
      values_LGTD=values,
    )
