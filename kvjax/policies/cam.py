"""Cache Merging (kvpress ``CAMPress``): while decoding, every ``decode_every`` generated tokens
the cache is cut to a target, and evicted values are merged into their kept sequential
neighbours by a Bernoulli draw on the slots' running attention sums.

Reference: kvpress 0.5.5 ``kvpress/presses/cam_press.py::CAMPress`` (CaM: Cache Merging for
Memory-efficient LLMs Inference, Zhang et al., ICML 2024, OpenReview LCTmppB165; kvpress cites
no arXiv id). :func:`cam_compress` is kvpress's compression step on one row's cache with static
sizes; :func:`cam_merge` is the same step over a fixed-capacity slot table (dynamic counts, as
the model's cache holds them); :class:`CaM` is the policy the model's cache runs
(:func:`kvjax.model.cache.recompress` calls its :meth:`CaM.decode_merge`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax import select
from kvjax.policies import methods
from kvjax.policies.checks import check_int
from kvjax.policies.combinators import PrefillDecoding
from kvjax.policies.core import Policy
from kvjax.policies.protocols import DecodeMerging

Array = jax.Array


def cam_compress(
  values_GnD: Array,
  attn_Gn: Array,
  scores_Gn: Array,
  uniform_Gk: Array,
  *,
  target_size: int,
  merge_budget: int,
) -> tuple[Array, Array]:
  """kvpress ``CAMPress.compress`` on one batch row, its Bernoulli draws given as uniforms.

  1. The base scores, averaged over the KV heads, choose one kept set for every head: the
     ``target_size`` best slots; the ``n - target_size`` others are evicted.
  2. The ``k`` best evicted slots (``k = uniform_Gk.shape[-1]``, kvpress's steps since the last
     compression; ties to the later slot) are merged, each into the ``merge_budget`` kept slots
     that follow it in slot order (fewer at the end of the cache).
  3. Per KV head, the merge probability is ``clip(A_i / mean_window(A), 0, 1)`` (``nan`` -> 0,
     ``inf`` -> 1) on the running attention sums ``A``; the merge happens when
     ``uniform < p`` (kvpress: ``torch.bernoulli(p)``, which is ``u < p`` on its own draws).
  4. A merged slot's value divided by its window's size is added to every slot of the window;
     the kept slots are gathered in slot order.

  Differences from kvpress: the randomness is the caller's uniforms (a golden comparison records
  kvpress's and passes them); slots are taken in the order given (kvpress's cache order, which
  is position order); a tie in the averaged scores goes to the lower slot (kvpress: ``topk``'s
  choice).

  Args:
    values_GnD: the row's cached values ``[G, n, D]`` in slot order.
    attn_Gn: the running attention sums of the decoded queries per KV head ``[G, n]`` (kvpress
      ``_running_attn_sum``: the group-mean softmax row of each decoded query, zero for slots
      not yet seen).
    scores_Gn: the base scorer's scores ``[G, n]`` (higher keeps).
    uniform_Gk: uniforms in ``[0, 1)`` ``[G, k]``, one per (KV head, merged slot).
    target_size: the slots kept (kvpress ``target_size``), at most ``n``.
    merge_budget: the kept neighbours each merged slot is spread over (kvpress 32).

  Returns:
    ``(kept [target_size] int32 slot indices ascending, values [G, target_size, D])``.
  """
  G, n, D = values_GnD.shape
  k = uniform_Gk.shape[-1]
  n_evict = n - target_size
  if n_evict <= 0:
    return jnp.arange(n, dtype=jnp.int32), values_GnD
  mean = scores_Gn.astype(jnp.float32).mean(0)  # [n]
  order = jnp.argsort(-mean, stable=True)  # best first, ties to the lower slot
  kept = jnp.sort(order[:target_size]).astype(jnp.int32)
  evicted = jnp.sort(order[target_size:])
  # the k best evicted, ties to the later slot: kvpress's flipped stable descending argsort
  flipped = mean[evicted][::-1]
  pick = jnp.argsort(-flipped, stable=True)[:k]
  merge = jnp.sort(evicted[n_evict - 1 - pick])  # [k]
  start = jnp.searchsorted(kept, merge, side="right")
  window = start[:, None] + jnp.arange(merge_budget)[None]  # [k, m]
  in_range = window < target_size
  targets = kept[jnp.minimum(window, target_size - 1)]  # [k, m] slots
  actual = in_range.sum(-1)  # [k]
  attn = attn_Gn.astype(jnp.float32)
  window_attn = jnp.where(in_range[None], attn[:, targets], 0.0)  # [G, k, m]
  mean_attn = window_attn.sum(-1) / jnp.maximum(actual, 1)[None]
  prob = attn[:, merge] / mean_attn
  prob = jnp.where(jnp.isnan(prob), 0.0, jnp.where(jnp.isinf(prob), 1.0, prob))
  prob = jnp.clip(prob, 0.0, 1.0)
  mask = (uniform_Gk < prob).astype(jnp.float32)  # [G, k]
  scale = jnp.where(actual[None] == 0, 0.0, mask / actual[None])
  contrib = values_GnD[:, merge].astype(jnp.float32) * scale[..., None]  # [G, k, D]
  contrib = jnp.where(in_range[None, :, :, None], contrib[:, :, None, :], 0.0)  # [G, k, m, D]
  onto = jax.nn.one_hot(targets, n, dtype=jnp.float32) * in_range[..., None]  # [k, m, n]
  added = jnp.einsum("gkmd,kmn->gnd", contrib, onto, precision=jax.lax.Precision.HIGHEST)
  values = (values_GnD.astype(jnp.float32) + added).astype(values_GnD.dtype)
  return kept, values[:, kept]


def merge_uniforms(seed: int, row, seen, shape: tuple[int, ...]) -> Array:
  """The uniforms of CaM's Bernoulli draws at one re-compression of one batch row.

  Keyed by ``(seed, row, seen)`` so a generation is reproducible and rows draw independently;
  the last axis is the merged slot in ascending slot order (kvpress's ``merge_indices`` order).

  Args:
    seed: the policy's seed.
    row: the batch row (an int or traced int).
    seen: the row's tokens seen at the re-compression, prompt and generated.
    shape: the draws' shape, ``[L, H, N]``.

  Returns:
    fp32 uniforms in ``[0, 1)`` of ``shape``.
  """
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), seen)
  return jax.random.uniform(key, shape, jnp.float32)


def check_draws(uniform, shape: tuple[int, ...], policy: str) -> Array:
  """Checks the uniforms a caller's ``draws`` returned against the shape CaM asks for.

  Args:
    uniform: what ``draws`` returned.
    shape: the shape asked for, ``[L, H, N]``.
    policy: the policy's label, for the error.

  Returns:
    The uniforms as fp32.

  Raises:
    ValueError: ``uniform`` is not a floating array of ``shape``.
  """
  got = jnp.shape(uniform)
  if got != tuple(shape) or not jnp.issubdtype(jnp.result_type(uniform), jnp.floating):
    raise ValueError(
      f"draws: policy {policy!r}'s draws returned {jnp.result_type(uniform)} {got}; expected "
      f"floating uniforms of shape {tuple(shape)} (layers, heads, decode_every)"
    )
  return jnp.asarray(uniform, jnp.float32)


def cam_merge(
  values_GCD: Array,
  attn_GC: Array,
  scores_GC: Array,
  valid_GC: Array,
  count,
  uniform_GN: Array,
  *,
  merge_budget: int,
) -> tuple[Array, Array]:
  """:func:`cam_compress` over a slot table: dynamic counts, static shapes.

  The slots are in position order (kvpress's cache order); empty ones (``valid_GC`` false in
  every head) are neither kept nor evicted. The head-mean score (over the heads holding the
  slot) chooses one kept set of ``min(count, filled)`` slots for every head, ties to the lower
  slot; of the evicted slots the ``N = uniform_GN.shape[-1]`` best (ties to the later slot) are
  merge candidates, each spread over the ``merge_budget`` kept slots that follow it with
  probability ``clip(A_i / mean_window(A), 0, 1)`` on the attention sums ``A``, drawn as
  ``uniform < p``. The windows are a ``[N, C]`` matrix instead of kvpress's gathers and
  ``scatter_add_``, equal up to fp32 rounding.

  Args:
    values_GCD: the slots' values ``[G, C, D]``.
    attn_GC: the slots' attention sums ``[G, C]``.
    scores_GC: the base scorer's scores ``[G, C]`` (higher keeps).
    valid_GC: bool ``[G, C]``, the filled slots.
    count: the slots kept (an int or traced int).
    uniform_GN: uniforms ``[G, N]``: candidate ``i`` (in ascending slot order) merges in head
      ``g`` when ``uniform_GN[g, i] < p``.
    merge_budget: the kept neighbours each merged slot is spread over (kvpress 32).

  Returns:
    ``(kept [C] bool, values [G, C, D])``: the shared kept slots and every slot's value after
    the merge (only the kept ones are meaningful).
  """
  G, C, D = values_GCD.shape
  N = uniform_GN.shape[-1]
  filled_C = valid_GC.any(0)
  held = valid_GC.sum(0)
  total = jnp.where(valid_GC, scores_GC.astype(jnp.float32), 0.0).sum(0)
  mean_C = jnp.where(filled_C, total / jnp.maximum(held, 1), -jnp.inf)
  count = jnp.minimum(jnp.asarray(count, jnp.int32), filled_C.sum())
  kept_C = select.top_mask(mean_C, count) & filled_C
  evicted_C = filled_C & ~kept_C
  slot = jnp.arange(C)
  # the N best evicted, ties to the later slot (kvpress's flipped stable descending argsort)
  key = jnp.where(evicted_C, mean_C, -jnp.inf)
  best = jnp.lexsort((-slot, -key))[:N]
  ok = jnp.arange(N) < evicted_C.sum()
  ascending = jnp.argsort(jnp.where(ok, best, C + jnp.arange(N)))
  merged_N, ok_N = best[ascending], ok[ascending]
  before_C = jnp.cumsum(kept_C)  # kept slots at or before each slot
  rank_C = before_C - 1  # a kept slot's rank among the kept
  start_N = before_C[merged_N]  # kvpress's searchsorted(kept, merge, right=True)
  window_NC = (
    ok_N[:, None]
    & kept_C[None]
    & (rank_C[None] >= start_N[:, None])
    & (rank_C[None] < start_N[:, None] + merge_budget)
  )
  actual_N = window_NC.sum(-1)
  attn = attn_GC.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  window_attn = jnp.einsum("nc,gc->gn", window_NC.astype(jnp.float32), attn, precision=hi)
  prob = attn[:, merged_N] / (window_attn / jnp.maximum(actual_N, 1)[None])
  prob = jnp.where(jnp.isnan(prob), 0.0, jnp.where(jnp.isinf(prob), 1.0, prob))
  prob = jnp.clip(prob, 0.0, 1.0)
  mask = (uniform_GN < prob) & ok_N[None]
  scale = jnp.where(actual_N[None] == 0, 0.0, mask / jnp.maximum(actual_N, 1)[None])  # [G, N]
  contrib = values_GCD[:, merged_N].astype(jnp.float32) * scale[..., None]  # [G, N, D]
  added = jnp.einsum("nc,gnd->gcd", window_NC.astype(jnp.float32), contrib, precision=hi)
  return kept_C, (values_GCD.astype(jnp.float32) + added).astype(values_GCD.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaM(DecodeMerging, PrefillDecoding):
  """Cache Merging while decoding (kvpress ``CAMPress``).

  Reference: kvpress 0.5.5 ``presses/cam_press.py::CAMPress``, a ``DecodingPress``: the prompt
  is kept whole (``prefill``, :class:`~kvjax.policies.Full` by default); every
  ``decode_every`` generated tokens (kvpress ``compression_interval``) the cache is cut to
  ``decode_budget`` slots (kvpress ``target_size``) by ``base``'s scores averaged over the KV
  heads (one kept set for every head), and the evicted slots' values are merged into the kept
  ones (:func:`cam_merge`). The model's cache carries each slot's attention summed over the
  generated queries (kvpress ``_running_attn_sum``: the group-mean softmax row of each query,
  the new token's own slot included) and prunes it with the slots.

  Differences from kvpress: the Bernoulli draws are ``uniform < p`` on ``draws`` (by default
  :func:`merge_uniforms`: jax's generator keyed by the seed, the row and the tokens seen;
  kvpress: ``torch.bernoulli``, whose uniforms a parity check passes as ``draws``); the merge candidates are the ``decode_every`` best evicted
  slots, which is kvpress's ``k`` (the steps since its last compression) whenever a
  compression evicts; a tie in the averaged scores goes to the lower slot (kvpress: ``topk``'s
  choice); heads holding different counts average a slot over the heads holding it.

  Attributes:
    base: the scorer (a budget-free prefill scorer; kvpress ``base_press``).
    merge_budget: the kept neighbours each merged slot is spread over (kvpress 32).
    seed: the seed of the Bernoulli draws.
    draws: the uniforms of the Bernoulli draws, a hashable callable ``(seed, row, seen, shape)
      -> [L, H, decode_every]`` floats in ``[0, 1)`` with :func:`merge_uniforms`'s arguments
      and meaning (a merge happens where the uniform is below its probability); ``None``:
      :func:`merge_uniforms`. A decode step compiles once per callable.
  """

  base: Policy
  prefill: Policy = dataclasses.field(default_factory=methods.Full)
  decoding: Policy | None = None
  decode_every: int | None = 512
  decode_budget: int | None = 2048
  merge_budget: int = 32
  seed: int = 0
  draws: Callable[..., Array] | None = None

  def __post_init__(self):
    if self.decoding is not None and self.decoding is not self.base:
      raise ValueError(f"decoding: CaM scores with base; expected None, got {self.decoding!r}")
    object.__setattr__(self, "decoding", self.base)
    super().__post_init__()
    if self.decode_budget is None:
      raise ValueError("decode_budget: expected an int >= 1 (kvpress target_size)")
    check_int("merge_budget", self.merge_budget, 1)
    check_int("seed", self.seed, 0)
    if self.draws is not None and not callable(self.draws):
      raise ValueError(
        f"draws: expected a callable (seed, row, seen, shape) -> uniforms or None, got "
        f"{self.draws!r}"
      )

  @property
  def options(self) -> dict:
    """The policy's own options."""
    out = {**super().options, "merge_budget": self.merge_budget, "seed": self.seed}
    return out if self.draws is None else {**out, "draws": self.draws}

  def decode_merge(self, values_LHCD, attn_sums_LHC, scores_LHC, valid_LHC, count_LH, *, row, seen):
    """:func:`cam_merge` on every layer of one row, with the uniforms of ``draws``.

    Args:
      values_LHCD: the slots' values ``[L, H, C, D]``.
      attn_sums_LHC: the slots' attention sums ``[L, H, C]``.
      scores_LHC: ``base``'s scores ``[L, H, C]``.
      valid_LHC: bool ``[L, H, C]``, the filled slots.
      count_LH: int32 ``[L, H]``, the slots each head keeps (the least of a layer's heads is
        the shared count).
      row: the batch row.
      seen: the row's tokens seen.

    Returns:
      ``(scores_LHC, values_LHCD)``: 0 on the shared kept slots and ``-inf`` elsewhere, and the
      merged values.

    Raises:
      ValueError: ``draws`` returns another shape than ``[L, H, decode_every]`` or no floats.
    """
    L, H, _, _ = values_LHCD.shape
    shape = (L, H, self.decode_every)
    draws = merge_uniforms if self.draws is None else self.draws
    uniform = draws(self.seed, row, seen, shape)
    if self.draws is not None:  # shapes are static: checked once, at trace time
      uniform = check_draws(uniform, shape, self.label)
    merge = jax.vmap(lambda *a: cam_merge(*a, merge_budget=self.merge_budget))
    kept_LC, values = merge(
      values_LHCD, attn_sums_LHC, scores_LHC, valid_LHC, count_LH.min(-1), uniform
    )
    scores = jnp.where(kept_LC[:, None, :], 0.0, -jnp.inf)
    return jnp.broadcast_to(scores, scores_LHC.shape), values
