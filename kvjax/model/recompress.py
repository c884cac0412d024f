"""Re-compression while decoding (``decode_every``, kvpress ``DecodingPress``): the cache's slots
scored again with the window of generated queries and cut back to the decode budget.

Re-exported by :mod:`kvjax.model.cache`, whose names these are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies, select
from kvjax.model import llama
from kvjax.model.cache_layout import CacheSpec, KVCache
from kvjax.model.compression import selection_scores, to_layout
from kvjax.model.config import ModelConfig

Array = jax.Array


def _right_aligned(t: Array, order_LBHC: Array) -> Array:
  index = order_LBHC if t.ndim == 4 else order_LBHC[..., None]
  return jnp.take_along_axis(t, index, axis=3)


def _slot_attention(cfg, cache: KVCache, keys_LBHCD, positions_LBHC, valid_LBHC) -> Array:
  """The window of generated queries over the slots: causal by original position, fp32,
  ``[L, B, Hq, W, C]``."""
  L, B, H, C, _ = keys_LBHCD.shape
  q = cache.queries  # [L, B, Hq, W, D]
  q_pos = cache.query_pos  # [B, W]
  allowed = (
    valid_LBHC[:, :, :, None, :]
    & (positions_LBHC[:, :, :, None, :] <= q_pos[None, :, None, :, None])
    & (q_pos >= 0)[None, :, None, :, None]
  )  # [L, B, H, W, C]
  if cfg.sliding_window is not None:  # each layer's window (Mistral's every layer, Gemma's sliding)
    window_L = jnp.asarray(
      np.where(llama.is_sliding(cfg), cfg.sliding_window, llama.FULL_WINDOW), jnp.int32
    )
    behind = q_pos[None, :, None, :, None] - positions_LBHC[:, :, :, None, :]
    allowed = allowed & (behind < window_L[:, None, None, None, None])
  flat = lambda t: t.reshape((L * B,) + t.shape[2:])  # noqa: E731
  probs = llama.attention_probs(flat(q), flat(keys_LBHCD), flat(allowed), softcap=cfg.attn_softcap)
  return probs.reshape((L, B) + probs.shape[1:])


def recompress(cfg: ModelConfig, params: dict, spec: CacheSpec, cache: KVCache) -> KVCache:
  """Re-compresses the cache to its budget, as kvpress ``DecodingPress``'s compression step.

  Every (layer, row, head) keeps its ``min(decode budget, filled)`` best slots under the
  policy's :meth:`~kvjax.policies.Policy.decode_scores`, over everything it holds (prompt and
  generated tokens), as ``DecodingPress.compress`` hands the whole cache to its base press with
  the target size as budget. The decode budget is
  :meth:`~kvjax.policies.Policy.decode_budgets` of the prompt's budgets and the row's tokens
  seen (its last RoPE position + 1): the prompt's budgets for a plain policy, ``decode_budget``
  or a fraction of the tokens seen for :class:`~kvjax.policies.PrefillDecoding` and
  :class:`~kvjax.policies.RatioDecoding` (the caller sizes the capacity for it:
  :meth:`~kvjax.policies.Policy.decode_capacity`; appends past it flag overflow).

  The evidence is rebuilt over the slots in position order (right-aligned per head, so a
  scorer's protected recent window is the most recent tokens and empty slots play the part of
  left padding): keys and values as cached, CriticalKV's value norms from ``W_O``, and the
  attention of the last ``W`` generated queries (``W = min(window, decode_every)``: kvpress's
  buffer of hidden states is cleared at each compression), causal by original position. Unlike
  kvpress (which rotates every buffered query by the current token's position embedding), each
  query keeps its own RoPE position. The evidence fields and window are the
  :attr:`~kvjax.policies.Policy.decode_policy`'s; a budget-dependent last stage (CriticalKV)
  applies when the policy re-compresses with its own scorer.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    spec: the cache's static choices.
    cache: the cache, with its window of generated queries.

  Returns:
    The re-compressed :class:`KVCache`.
  """
  L, B, H, C, _ = cache.keys.shape
  fill = cache.valid.sum(-1)
  # empty slots first, then the valid prefix in position order
  order = (jnp.arange(C)[None, None, None] + fill[..., None]) % C
  keys, values = _right_aligned(cache.keys, order), _right_aligned(cache.values, order)
  positions, valid = _right_aligned(cache.positions, order), _right_aligned(cache.valid, order)
  decoder = spec.policy.decode_policy
  needs = decoder.evidence_fields
  # the window of generated queries oldest first (a ring: slot = step % W)
  chrono = jnp.argsort(cache.query_pos[0])
  win = cache.replace(
    queries=jnp.take(cache.queries, chrono, axis=3), query_pos=jnp.take(cache.query_pos, chrono, 1)
  )
  fields = {"keys_LGTD": keys, "values_LGTD": values}
  if "attn_window_LHWT" in needs:
    fields["attn_window_LHWT"] = _slot_attention(cfg, win, keys, positions, valid)
  if "value_out_norms_LHT" in needs:
    wo = llama.stacked(params)["wo"]
    fields["value_out_norms_LHT"] = jax.vmap(lambda w, v: llama.value_out_norms(cfg, {"wo": w}, v))(
      wo, values
    )
  if "window_queries_LHWD" in needs:
    fields["window_queries_LHWD"] = win.queries
  rows = {k: jnp.moveaxis(v, 1, 0) for k, v in fields.items()}
  shared = {} if cache.evidence is None else cache.evidence
  rngs = jax.random.split(jax.random.fold_in(jax.random.key(1), cache.query_pos.max()), B)

  seen_B = cache.query_pos.max(-1) + 1  # each row's tokens seen: its last RoPE position + 1
  merges = spec.policy.merges_while_decoding
  attn = _right_aligned(cache.attn_sums, order) if merges else jnp.zeros((L, B, H, C))

  def one(row, valid_HC, budget_LH, rng, seen, attn_HC, b):
    # the slots any layer and head holds: exact when every head holds the same count (a uniform
    # prompt budget, CaM), as kvpress's caches always do; empty slots play the part of left
    # padding
    ev = policies.Evidence(rng=rng, valid_T=valid_HC.any((0, 1)), **row, **shared)
    scores = spec.policy.decode_scores(ev)
    if scores.shape[1] != H:
      scores = to_layout(scores, H, cfg)
    if decoder is spec.policy:  # its own scorer: its budget-dependent last stage (CriticalKV)
      scores = selection_scores(spec, ev, scores, valid_HC, budget_LH)
    else:
      scores = jnp.where(valid_HC, scores, -jnp.inf)
    count = jnp.minimum(spec.policy.decode_budgets(budget_LH, seen), valid_HC.sum(-1))
    vals = row["values_LGTD"]
    if merges:  # CaM: one kept set (the finite scores), evicted values merged into it
      scores, vals = spec.policy.decode_merge(
        vals, attn_HC, scores, valid_HC, count, row=b, seen=seen
      )
      count = jnp.minimum(count, jnp.isfinite(scores).sum(-1))
    idx, kept = select.compact(scores, count, C)
    return idx, kept, vals

  idx, kept, values = jax.vmap(one)(
    rows,
    jnp.moveaxis(valid, 1, 0),
    cache.budget,
    rngs,
    seen_B,
    jnp.moveaxis(attn, 1, 0),
    jnp.arange(B),
  )
  idx, kept, values = jnp.moveaxis(idx, 0, 1), jnp.moveaxis(kept, 0, 1), jnp.moveaxis(values, 0, 1)
  out = cache.replace(
    keys=jnp.where(kept[..., None], _right_aligned(keys, idx), 0).astype(keys.dtype),
    values=jnp.where(kept[..., None], _right_aligned(values, idx), 0).astype(cache.values.dtype),
    positions=jnp.where(kept, _right_aligned(positions, idx), 0),
    valid=kept,
  )
  if merges:
    out = out.replace(attn_sums=jnp.where(kept, _right_aligned(attn, idx), 0.0))
  return out
