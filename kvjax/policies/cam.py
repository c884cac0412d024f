"""CaM's merge-then-prune step (kvpress ``CAMPress``): evicted values merged into their kept
sequential neighbours by a Bernoulli mask, then pruned.

Reference: kvpress 0.5.5 ``kvpress/presses/cam_press.py::CAMPress.compress`` (CaM: Cache Merging
for Memory-efficient LLMs Inference, Zhang et al., ICML 2024, OpenReview LCTmppB165; kvpress
cites no arXiv id). This module holds the compression step as a pure function over one row's
cache; the model's cache does not run it yet (it needs the running attention sums of the
decoded queries over the slots and a periodic re-compression that shares one kept set across
the KV heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
