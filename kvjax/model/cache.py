"""A real compressed KV cache: fixed-capacity slot tables per (layer, batch row, head).

``keys``/``values`` are ``[L, B, H, C, D]`` buffers sized by the capacity ``C`` (``H`` = KV heads,
or query heads for the query-head layout of the published tables), with original positions and
a validity mask per slot. Attention masks empty slots, never evicted keys: an evicted key is
gone. Per-layer and per-head budgets decode correctly because every row is its own slot table.

* :func:`compress` turns a prefill (:func:`kvjax.model.llama.prefill`) into a cache with any
  registry policy and allocation, through :func:`kvjax.select.compact` (the only selection).
* :func:`decode_step` runs one token through the model against the cache. Prefill-time policies
  (SnapKV, PyramidKV, Ada-KV, HeadKV, CAKE, ...) and the full cache append without eviction, as
  the official code does; decode-time policies (``sliding_window``, ``streaming_llm``, ``h2o``,
  ``tova``) admit the new token and evict to stay within budget before attending.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import policies, select
from kvjax import scores as scores_lib
from kvjax.model import llama
from kvjax.model.config import ModelConfig

Array = jax.Array

LAYOUTS = ("kv", "query")


def check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


@struct.dataclass
class KVCache:
  keys: Array  # [L, B, H, C, D] post-RoPE, original positions
  values: Array  # [L, B, H, C, D]
  positions: Array  # [L, B, H, C] int32
  valid: Array  # [L, B, H, C] bool
  budget: Array  # [B, L, H] int32: slots each row may hold
  scores: Array | None = None  # [L, B, H, C] decode-time evidence (H2O sums, TOVA's last row)
  # set when a row needed more slots than the capacity (a budget above it, or appends past it):
  # callers raise on it instead of silently dropping tokens
  overflow: Array | None = None  # [B] bool


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Static choices of a compressed cache."""

  policy: policies.Policy
  capacity: int
  layout: str = "kv"  # "kv": per KV head; "query": per query head (K/V repeated, 4x for Llama 3)
  recent: int = 8  # H2O's probation window during decoding
  reindex: bool = False  # StreamingLLM's positions: keys stored pre-RoPE, rotated by cache rank

  @property
  def decode_time(self) -> bool:
    return self.policy.name != "full" and policies.acts_at_decode(self.policy.name)


def memory(cache: KVCache) -> dict:
  """Bytes of the cache: allocated buffers, K/V actually held, bookkeeping."""
  kv_itemsize = cache.keys.dtype.itemsize
  D = cache.keys.shape[-1]
  held = int(cache.valid.sum()) * 2 * D * kv_itemsize
  allocated = 2 * cache.keys.size * kv_itemsize
  book = (
    cache.positions.size * 4
    + cache.valid.size
    + (0 if cache.scores is None else cache.scores.size * 4)
  )
  return {"kv_bytes_held": held, "kv_bytes_allocated": allocated, "bookkeeping_bytes": book}


def full_cache_bytes(cfg: ModelConfig, batch: int, length: int, itemsize: int) -> int:
  """Bytes of an uncompressed cache of ``length`` tokens (K and V, every KV head)."""
  return cfg.num_layers * batch * cfg.num_kv_heads * length * cfg.head_dim * 2 * itemsize


def _batch_first(x):
  return None if x is None else jnp.moveaxis(x, 1, 0)


def _evidence_per_row(pre: llama.Prefill) -> policies.Evidence:
  """The prefill's evidence with the batch axis first (to ``vmap`` over rows)."""
  return policies.Evidence(
    attn_window_LHWT=_batch_first(pre.attn_window),
    column_sums_LHT=_batch_first(pre.column_sums),
    keys_LGTD=_batch_first(pre.keys),
    future_attn_LHST=_batch_first(pre.future_attn),
  )


def compress(
  cfg: ModelConfig, pre: llama.Prefill, spec: CacheSpec, budget, *, head_scores=None, rng=None
) -> KVCache:
  """A cache of capacity ``spec.capacity`` from prefill outputs ``pre`` under ``budget``
  (scalar, ``[L]`` or ``[L, H]``), per batch row (allocations may differ between rows)."""
  L, B, G, T, D = pre.keys.shape
  rng = jax.random.key(0) if rng is None else rng
  keys, values = pre.keys, pre.values
  if spec.layout == "query":
    keys, values = (jnp.repeat(t, cfg.num_groups, axis=2) for t in (keys, values))
  H = keys.shape[2]

  def one(ev, valid_T, rng_b):
    ev = ev.replace(rng=rng_b)
    if head_scores is not None:
      ev = ev.replace(head_scores_LH=head_scores)
    if spec.policy.name == "full":
      scores = jnp.broadcast_to(jnp.where(valid_T, 0.0, -jnp.inf), (L, H, T))
      budget_LH = jnp.full((L, H), T, jnp.int32)
    else:
      scores = spec.policy.scores(ev)
      if spec.policy.name == "streaming_llm":  # sinks are the first *real* tokens of the row
        pad = T - valid_T.sum()
        scores = scores_lib.streaming(T, scores.shape[:2], sinks=pad + spec.policy.opts["sinks"])
      if scores.shape[1] != H:
        scores = _to_layout(scores, H, cfg)
      # allocators see padding as zero evidence (Ada-KV's normalisation sums rows); only the
      # selection sees it as never-keep
      budget_LH = spec.policy.budgets(ev, jnp.where(valid_T, scores, 0.0), budget)
      scores = jnp.where(valid_T, scores, -jnp.inf)
    count = jnp.minimum(budget_LH, valid_T.sum())
    idx, kept = select.compact(scores, count, spec.capacity)
    state = _decode_state(spec, ev, scores, idx, kept, H)
    overflow = (count > spec.capacity).any() | (budget_LH < 0).any()
    return idx, kept, budget_LH, state, overflow

  idx, kept, budget_LH, state, overflow = jax.vmap(one)(
    _evidence_per_row(pre), pre.valid, jax.random.split(rng, B)
  )
  idx_L, kept_L = jnp.moveaxis(idx, 0, 1), jnp.moveaxis(kept, 0, 1)  # [L, B, H, C]
  gather = lambda t: jnp.take_along_axis(t, idx_L[..., None], axis=3)  # noqa: E731
  positions = jnp.take_along_axis(
    jnp.broadcast_to(pre.positions[None, :, None, :], (L, B, H, T)), idx_L, axis=3
  )
  kept_keys = gather(keys)
  if spec.reindex:  # store pre-RoPE keys: undo each key's rotation at its original position
    kept_keys = llama.rope_at(kept_keys, -positions, cfg)
  return KVCache(
    keys=jnp.where(kept_L[..., None], kept_keys, 0).astype(keys.dtype),
    values=jnp.where(kept_L[..., None], gather(values), 0).astype(values.dtype),
    positions=jnp.where(kept_L, positions, 0),
    valid=kept_L,
    budget=budget_LH,
    scores=None if state is None else jnp.moveaxis(state, 0, 1),
    overflow=overflow,
  )


def _to_layout(scores_LHT, H, cfg):
  """Query-head scores to the cache's heads (KV heads: mean over each group, as kvpress)."""
  if scores_LHT.shape[1] == cfg.num_heads and cfg.num_kv_heads == H:
    return scores_lib.group(scores_LHT, H, "mean")
  if scores_LHT.shape[1] == cfg.num_kv_heads and cfg.num_heads == H:
    return jnp.repeat(scores_LHT, cfg.num_groups, axis=1)
  raise ValueError(f"scores: {scores_LHT.shape[1]} heads cannot map to the cache's {H} heads")


def _decode_state(spec: CacheSpec, ev: policies.Evidence, scores_LHT, idx, kept, H):
  if spec.policy.name == "h2o":
    sums = ev.column_sums_LHT
    if sums.shape[1] != H:
      sums = sums.reshape(sums.shape[0], H, -1, sums.shape[-1]).mean(2)
    return jnp.where(kept, jnp.take_along_axis(sums, idx, -1), 0.0)
  if spec.policy.name == "tova":
    return jnp.where(kept, jnp.take_along_axis(scores_LHT, idx, -1), 0.0)
  return None


def _eviction_scores(spec: CacheSpec, positions, scores, pos_B) -> Array:
  """Decode-time keep scores of the current slots (higher = keep); H2O's probation covers the
  ``recent`` positions before the new token's."""
  name = spec.policy.name
  recency = positions.astype(jnp.float32)
  if name == "streaming_llm":
    return jnp.where(positions < spec.policy.opts["sinks"], jnp.inf, recency)
  if name == "h2o":
    return jnp.where(positions > pos_B[:, None, None] - spec.recent, jnp.inf, scores)
  if name == "tova":
    return scores
  return recency


def _admit(spec: CacheSpec, slots: dict, budget_BH, pos_B):
  """Where the new token goes in each row: ``(slot [B, H], slots')`` with the bookkeeping
  (positions, validity, decode-time scores) updated; decode-time policies evict to make room."""
  positions, valid = slots["positions"], slots["valid"]
  C = valid.shape[-1]
  fill = valid.sum(-1)
  if spec.decode_time:
    keep_old = _eviction_scores(spec, positions, slots.get("scores"), pos_B)
    keep_old = jnp.where(valid, keep_old, -jnp.inf)
    # room for the new token: keep the best `budget - 1` current slots (select.keep_mask)
    room = jnp.minimum(jnp.minimum(budget_BH, C) - 1, fill)
    valid = select.keep_mask(keep_old, room) & valid
    slot = jnp.argmin(valid, axis=-1)  # the first slot not kept: evicted, or empty
  else:  # append; past the capacity the row is flagged (the caller sizes C for every token)
    slot = jnp.minimum(fill, C - 1)
    slots = dict(slots, overflow=slots["overflow"] | (fill >= C).any(-1))
  onehot = jax.nn.one_hot(slot, C, dtype=bool)  # [B, H, C]
  out = dict(
    slots, positions=jnp.where(onehot, pos_B[:, None, None], positions), valid=valid | onehot
  )
  if spec.decode_time and slots.get("scores") is not None:
    out["scores"] = jnp.where(onehot | ~out["valid"], 0.0, slots["scores"])
  return slot, out


def decode_step(
  cfg: ModelConfig, params: dict, spec: CacheSpec, cache: KVCache, token_B, pos_B, t_B
):
  """One generated token through every layer: ``(logits [B, V], updated cache)``.

  ``pos_B`` is the token's RoPE position (original positions), ``t_B`` its index in the
  sequence. The K/V buffers ride in the layer loop's carry and only the new token's slot is
  written (an in-place scatter), so a step reads the cache once and writes ``O(B H D)``.
  """
  B = token_B.shape[0]
  x = params["embed"][token_B][:, None, :]
  stacked = llama.stacked(params)
  slots = {"positions": cache.positions, "valid": cache.valid}
  if cache.scores is not None:
    slots["scores"] = cache.scores
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  budget_LBH = jnp.moveaxis(cache.budget, 0, 1)
  H = cache.keys.shape[2]
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
  h_idx = jnp.broadcast_to(jnp.arange(H)[None, :], (B, H))

  def layer(carry, inputs):
    x, keys_all, values_all = carry
    p, lslots, budget_BH, l = inputs
    q, k, v = llama.project_qkv(cfg, p, x, pos_B[:, None])
    if spec.layout == "query":
      k, v = jnp.repeat(k, cfg.num_groups, 1), jnp.repeat(v, cfg.num_groups, 1)
    if spec.reindex:
      k = llama.rope_at(k, -jnp.broadcast_to(pos_B[:, None, None], k.shape[:-1]), cfg)
    slot, lslots = _admit(spec, dict(lslots, overflow=jnp.zeros((B,), bool)), budget_BH, pos_B)
    layer_overflow = lslots.pop("overflow")
    keys_all = keys_all.at[l, b_idx, h_idx, slot].set(k[:, :, 0].astype(keys_all.dtype))
    values_all = values_all.at[l, b_idx, h_idx, slot].set(v[:, :, 0].astype(values_all.dtype))
    keys, values = keys_all[l], values_all[l]
    if spec.reindex:
      q, keys = _reindexed(cfg, q, keys, lslots["positions"], lslots["valid"], pos_B)
    visible = lslots["valid"]
    if cfg.sliding_window is not None:  # Mistral: keys older than the window are not attended
      visible = visible & (pos_B[:, None, None] - lslots["positions"] < cfg.sliding_window)
    probs = llama.attention_probs(q, keys, visible[:, :, None, :])  # [B, Hq, 1, C]
    out = llama.attend(probs, values)  # the query layout is the case G = Hq
    if spec.decode_time and "scores" in lslots:
      lc = dict(lslots, keys=keys)
      lslots = dict(lslots, scores=_observe(spec, lc, probs, cfg))
    carry = (llama.output_and_mlp(cfg, p, x, out), keys_all, values_all)
    return carry, (lslots, layer_overflow)

  L = cfg.num_layers
  (x, keys_all, values_all), (new_slots, layer_overflow) = jax.lax.scan(
    layer, (x, cache.keys, cache.values), (stacked, slots, budget_LBH, jnp.arange(L))
  )
  logits = llama.logits_of(cfg, params, x)[:, 0]
  overflow = overflow | layer_overflow.any(0)
  return logits, cache.replace(keys=keys_all, values=values_all, overflow=overflow, **new_slots)


def _reindexed(cfg, q_BHq1D, keys_BHCD, positions_BHC, valid_BHC, pos_B):
  """StreamingLLM's pos-shift (``llama_pos_shift_attention_forward``): cached (pre-RoPE) keys are
  rotated by their rank inside the cache (0..n-1 in position order) and the query by its own
  rank ``n - 1``, so positions never exceed the cache size."""
  rank = (
    valid_BHC[:, :, None, :] & (positions_BHC[:, :, None, :] < positions_BHC[:, :, :, None])
  ).sum(-1)
  keys = llama.rope_at(keys_BHCD, rank, cfg)
  n_BH = valid_BHC.sum(-1)  # each head's cache length: the query's own rank is n - 1
  n_BHq = jnp.repeat(n_BH, q_BHq1D.shape[1] // n_BH.shape[1], axis=1)
  q_pos = (n_BHq - 1 - pos_B[:, None])[..., None]  # rotate from the true position to the rank
  return llama.rope_at(q_BHq1D, q_pos, cfg), keys


def _observe(spec: CacheSpec, lc, probs_BHq1C, cfg) -> Array:
  """H2O accumulates the attention its own compressed cache received; TOVA keeps the row,
  averaged over all heads of the layer."""
  B, Hq, _, C = probs_BHq1C.shape
  H = lc["keys"].shape[1]
  per_head = probs_BHq1C[:, :, 0].reshape(B, H, Hq // H, C).mean(2)
  if spec.policy.name == "h2o":
    return lc["scores"] + per_head
  # TOVA is layer-wise: every head holds the same positions in the same slots (generate
  # enforces uniform per-layer budgets for it), so the layer's mean row is a mean over heads.
  return jnp.broadcast_to(per_head.mean(1, keepdims=True), per_head.shape)
