"""A real compressed KV cache: fixed-capacity slot tables per (layer, batch row, head).

``keys``/``values`` are ``[L, B, H, C, D]`` buffers sized by the capacity ``C`` (``H`` = KV heads,
or query heads for the query-head layout of the published tables), with original positions and
a validity mask per slot. Attention masks empty slots, never evicted keys: an evicted key is
gone. Per-layer and per-head budgets decode correctly because every row is its own slot table.

* :func:`compress` turns a prefill (:func:`kvjax.model.llama.prefill`) into a cache with any
  policy object (:class:`kvjax.policies.Policy`) and allocation, through
  :func:`kvjax.select.compact` (the only selection).
* :func:`decode_step` runs one token through the model against the cache (stacked, or held one
  buffer per layer for a loop of steps on CPU: :func:`per_layer`). Prefill-time policies
  (SnapKV, PyramidKV, Ada-KV, HeadKV, CAKE, ...) and the full cache append without eviction, as
  the official code does; decode-time policies (:class:`kvjax.policies.DecodePolicy`: sliding
  window, StreamingLLM, H2O, TOVA, a user's own) admit the new token and evict to stay within
  budget before attending, running the policy's own state machine (``init_state``, ``observe``,
  ``keep_scores``) over the slots.
* ``decode_every=N`` (a policy option) re-compresses a prefill scorer's cache to its budget
  every ``N`` generated tokens (kvpress ``DecodingPress``; R-KV's buffer of 128), inside the
  jitted decode with a fixed capacity ``budget + N``: :func:`recompress`.
  :class:`kvjax.policies.PrefillDecoding` and :class:`kvjax.policies.RatioDecoding` (kvpress
  ``PrefillDecodingPress``, ``CompressionRatioDecodingPress``) re-compress there with their
  decoding scorer to their own decode budgets (``Policy.decode_scores``,
  ``Policy.decode_budgets``, ``Policy.decode_capacity``).
* ``channel_ratio`` (a policy option) prunes key channels as ThinK does, with a real saving:
  the prompt's kept keys are stored ``[L, B, H, C, D_keep]`` with their channel indices
  ``[L, B, H, D_keep]``; generated tokens keep full keys (``new_keys [L, B, H, N, D]``), as
  kvpress (which zeroes channels of the compressed keys only) and the official ThinK do.

This module holds the decode step and the per-layer form of the cache; the rest is written in
:mod:`~kvjax.model.cache_layout` (the types, layouts, evidence kinds and memory),
:mod:`~kvjax.model.compression` (:func:`compress`, ThinK's channels),
:mod:`~kvjax.model.recompress` (:func:`recompress`) and :mod:`~kvjax.model.feeding`
(:func:`extend`), and re-exported here: every name is reached as ``cache.X``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies, select
from kvjax import scores as scores_lib
from kvjax.model import llama
from kvjax.model.cache_layout import (
  DECODE_EVIDENCE,
  LAYOUTS,
  NAN_SCORES,
  ROW_EVIDENCE,
  SHARED_EVIDENCE,
  CacheSpec,
  KVCache,
  Layout,
  as_layout,
  check_decode_every,
  check_evidence,
  check_layout,
  check_spec,
  evidence_shapes,
  fold_configs,
  full_cache_bytes,
  memory,
  with_room,
)
from kvjax.model.compression import (
  compress,
  head_scores_to_layout,
  prune_channels,
  rotated_query_stats,
  sliding_layers,
  think_channels,
)
from kvjax.model.config import ModelConfig
from kvjax.model.feeding import appends_only, extend, extend_logits, held_kv
from kvjax.model.recompress import recompress

Array = jax.Array

__all__ = [
  "NAN_SCORES",
  "CacheSpec",
  "DECODE_BLOCK",
  "DECODE_EVIDENCE",
  "KVCache",
  "LAYOUTS",
  "Layout",
  "PER_LAYER_FIELDS",
  "PER_LAYER_MAX_BYTES",
  "ROW_EVIDENCE",
  "SHARED_EVIDENCE",
  "appends_only",
  "as_layout",
  "check_decode_every",
  "check_evidence",
  "check_layout",
  "check_spec",
  "compress",
  "decode_step",
  "decodes_per_layer",
  "evidence_shapes",
  "extend",
  "extend_logits",
  "fold_configs",
  "full_cache_bytes",
  "head_scores_to_layout",
  "held_kv",
  "held_layer_attention",
  "layer_attention",
  "memory",
  "per_layer",
  "prune_channels",
  "recompress",
  "restacked",
  "rotated_query_stats",
  "sliding_layers",
  "slot_attention_of_layer",
  "think_channels",
  "with_room",
]


def _think_probs(cfg, q_BHq1D, keys_BHCK, new_keys_BHND, channels_BHK, visible_BHC) -> Array:
  """Attention ``[B, Hq, 1, C]`` over ThinK's pruned prompt slots and the generated tokens' full
  keys: the query at its cache head's kept channels against the first (the pruned channels
  would meet kvpress's zeros), the whole query against the second; one fp32 softmax."""
  B, Hq, _, D = q_BHq1D.shape
  H = keys_BHCK.shape[1]
  q = q_BHq1D.reshape(B, H, Hq // H, 1, D)
  q_kept = jnp.take_along_axis(q, channels_BHK[:, :, None, None, :], axis=-1)
  logits = jnp.concatenate(
    [
      llama.attention_logits(
        q_kept.reshape(B, Hq, 1, -1), keys_BHCK, head_dim=D, softcap=cfg.attn_softcap
      ),
      llama.attention_logits(q_BHq1D, new_keys_BHND, softcap=cfg.attn_softcap),
    ],
    axis=-1,
  )
  return llama.masked_softmax(logits, visible_BHC[:, :, None, :])


def _admit(spec: CacheSpec, slots: dict, budget_BH, pos_B):
  """Where the new token goes in each row: ``(slot [B, H], slots')`` with the bookkeeping
  (positions, validity, decode-time scores) updated; decode-time policies evict to make room."""
  positions, valid = slots["positions"], slots["valid"]
  C = valid.shape[-1]
  fill = valid.sum(-1)
  if spec.decode_time:  # the policy's keep scores before the token at pos_B joins
    keep_old = policies.checked_keep_scores(
      spec.policy, slots.get("scores"), positions, pos_B[:, None, None], budget_BH
    )
    # NaN keep scores cannot be ranked: the row is flagged, never evicted from arbitrarily
    slots = dict(slots, overflow=slots["overflow"] | (jnp.isnan(keep_old) & valid).any((-2, -1)))
    keep_old = jnp.where(valid, keep_old, -jnp.inf)
    # room for the new token: keep the best `budget - 1` current slots (select.top_mask)
    room = jnp.minimum(jnp.minimum(budget_BH, C) - 1, fill)
    valid = select.top_mask(keep_old, room) & valid
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


# slots per block of the decode step's attention: a block of K or V ([B, H, 2048, D], 8 MiB at
# B=4, H=4, D=64 in fp32) stays in the last-level cache between its copy out of the stacked
# [L, ...] buffer and the contraction that reads it (2048 measured faster than 1024 and 4096)
DECODE_BLOCK = 2048


def _held_blocks(visible_BHC: Array, block: int, n: int) -> tuple[Array, Array]:
  """The blocks of :data:`DECODE_BLOCK` slots that hold a visible slot of some row and head:
  ``(first, stop)``, block ``i`` read for ``first <= i < stop``. The blocks before the first
  visible slot and after the last hold nothing the query sees: a sliding window's old slots, a
  layer whose budget is below the capacity (PyramidKV), the room a cache keeps for the tokens
  still to come."""
  C = visible_BHC.shape[-1]
  slot = jnp.arange(C, dtype=jnp.int32)
  first = jnp.min(jnp.where(visible_BHC, slot, C - 1)) // block
  stop = (jnp.max(jnp.where(visible_BHC, slot + 1, 0)) + block - 1) // block
  return jnp.minimum(first, n - 1), jnp.minimum(stop, n)


def _carried_as_bits(dtype) -> bool:
  """Whether the decode step carries K/V of ``dtype`` as their bits (``uint16``): XLA:CPU
  slices and scatters 16-bit floats in fp32, converting the whole stacked ``[L, B, H, C, D]``
  cache to fp32 and back around every layer's scatter (``docs/benchmarks.md`` has the cost)."""
  return jax.default_backend() == "cpu" and jnp.dtype(dtype).itemsize == 2


def _as_bits(x: Array, bits: bool) -> Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x


def _as_float(x: Array, dtype) -> Array:
  """``x`` in ``dtype``, from its bits when it is carried as bits (:func:`_carried_as_bits`)."""
  if x.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
    return jax.lax.bitcast_convert_type(x, dtype)
  return x


def layer_attention(
  cfg: ModelConfig, q_BHq1D: Array, keys_BHCD: Array, values_BHCD: Array, visible_BHC: Array
) -> tuple[Array, Array]:
  """Computes one decode query's attention over one layer's slots, read whole.

  ``llama.attention_probs`` and ``llama.attend`` over the layer's own buffers: what the decode
  step runs over a cache held one buffer per layer (:func:`per_layer`), and over a stacked
  cache of one block (:func:`slot_attention_of_layer`).

  Args:
    cfg: the model's config (its attention soft-cap).
    q_BHq1D: the query ``[B, Hq, 1, D]``, post-RoPE.
    keys_BHCD: the layer's keys ``[B, H, C, D]``.
    values_BHCD: the layer's values ``[B, H, C, D]``.
    visible_BHC: ``[B, H, C]`` bool, the slots the query may see.

  Returns:
    ``(probs [B, Hq, 1, C], out [B, Hq, 1, D])``, fp32; a row with no visible slot gives zeros.
  """
  probs = llama.attention_probs(
    q_BHq1D, keys_BHCD, visible_BHC[:, :, None, :], softcap=cfg.attn_softcap
  )
  return probs, llama.attend(probs, values_BHCD)


def held_layer_attention(
  cfg: ModelConfig, q_BHq1D: Array, keys_BHDC: Array, values_BHCD: Array, visible_BHC: Array
) -> tuple[Array, Array]:
  """Computes one decode query's attention over one layer's keys held slots-last.

  :func:`layer_attention` over ``keys_BHDC`` (the keys ``[B, H, D, C]``, as :func:`per_layer`
  holds them), equal up to float rounding. With the slots last the logits are one
  ``[Hq / H, D] x [D, C]`` product per head, the shape of ``p v``: XLA:CPU runs it near a
  reduction's speed, where ``q k^T`` over ``[B, H, C, D]`` keys takes about 3.6x as long
  (``docs/benchmarks.md``).

  Args:
    cfg: the model's config (its attention soft-cap).
    q_BHq1D: the query ``[B, Hq, 1, D]``, post-RoPE.
    keys_BHDC: the layer's keys, slots last ``[B, H, D, C]``.
    values_BHCD: the layer's values ``[B, H, C, D]``.
    visible_BHC: ``[B, H, C]`` bool, the slots the query may see.

  Returns:
    ``(probs [B, Hq, 1, C], out [B, Hq, 1, D])``, fp32; a row with no visible slot gives zeros.
  """
  B, Hq, _, D = q_BHq1D.shape
  H, C = keys_BHDC.shape[1], keys_BHDC.shape[3]
  q = q_BHq1D.astype(jnp.float32).reshape(B, H, Hq // H, D)
  logits = jnp.einsum(
    "bhrd,bhdc->bhrc", q, keys_BHDC.astype(jnp.float32), precision=scores_lib.PRECISION
  )
  logits = llama.softcap_logits(logits / float(np.sqrt(D)), cfg.attn_softcap)
  probs = llama.masked_softmax(logits.reshape(B, H, Hq // H, 1, C), visible_BHC[:, :, None, :])
  return probs, llama.attend(probs, values_BHCD)


def slot_attention_of_layer(
  cfg: ModelConfig,
  q_BHq1D: Array,
  keys_all: Array,
  values_all: Array,
  l,
  visible_BHC: Array,
  kv_dtype=None,
) -> tuple[Array, Array]:
  """Computes one decode query's attention over layer ``l``'s slots of the stacked K/V.

  The same as ``llama.attention_probs`` and ``llama.attend`` over ``keys_all[l]`` and
  ``values_all[l]``, up to float rounding. Slicing layer ``l`` out whole copies ``2 C D`` floats
  per row and head before the contraction reads them again (XLA:CPU's contractions read
  materialised operands), three passes over memory where one is needed; read in blocks of
  :data:`DECODE_BLOCK` slots, each copied block is still in cache when it is contracted, and
  blocks that hold no visible slot are not read (:func:`_held_blocks`). The logits of a block
  are ``k q^T``, the block as the contraction's left operand (XLA:CPU packs a right operand
  before it multiplies: ``q k^T`` copies each block once more); each is a dot product over
  ``D``, as ``attention_logits``'s, summed in another order; the output sums the blocks'
  partial products. A cache of one block attends over the layer's slots whole, through
  ``llama.attention_probs``.

  Args:
    cfg: the model's config (its attention soft-cap).
    q_BHq1D: the query ``[B, Hq, 1, D]``, post-RoPE.
    keys_all: the stacked keys ``[L, B, H, C, D]``.
    values_all: the stacked values ``[L, B, H, C, D]``.
    l: the layer (an int or a traced scalar).
    visible_BHC: ``[B, H, C]`` bool, the slots the query may see.
    kv_dtype: the K/V's dtype when ``keys_all`` and ``values_all`` hold its bits (``uint16``),
      as the decode step carries a 16-bit cache on CPU; ``None``: their own dtype.

  Returns:
    ``(probs [B, Hq, 1, C], out [B, Hq, 1, D])``, fp32; a row with no visible slot gives zeros.
  """
  _, B, H, C, D = keys_all.shape
  Hq = q_BHq1D.shape[1]
  n = -(-C // DECODE_BLOCK)
  kv_dtype = keys_all.dtype if kv_dtype is None else kv_dtype
  if n == 1:  # one block: the layer's slots whole, as the attention over a layer reads them
    keys, values = _as_float(keys_all[l], kv_dtype), _as_float(values_all[l], kv_dtype)
    return layer_attention(cfg, q_BHq1D, keys, values, visible_BHC)
  block = -(-C // n)  # n equal blocks: the last overlaps the one before by fewer than n slots
  q = q_BHq1D.astype(jnp.float32).reshape(B, H, Hq // H, D)
  first, stop = _held_blocks(visible_BHC, block, n)

  def start(i):  # the last block ends at C
    return jnp.minimum(i * block, C - block)

  def logits_block(i, logits):
    k = jax.lax.dynamic_slice(keys_all, (l, 0, 0, start(i), 0), (1, B, H, block, D))[0]
    k = _as_float(k, kv_dtype).astype(jnp.float32)
    x = jnp.einsum("bgkd,bgrd->bgkr", k, q, precision=scores_lib.PRECISION)
    return jax.lax.dynamic_update_slice(logits, x, (0, 0, start(i), 0))

  # slots in blocks not read keep logit 0: none is visible, so the softmax masks them all
  logits = jax.lax.fori_loop(first, stop, logits_block, jnp.zeros((B, H, C, Hq // H), jnp.float32))
  logits = llama.softcap_logits(jnp.swapaxes(logits, 2, 3) / float(np.sqrt(D)), cfg.attn_softcap)
  probs = llama.masked_softmax(logits[:, :, :, None], visible_BHC[:, :, None, :])  # [B,Hq,1,C]
  p = probs.reshape(B, H, Hq // H, C)

  def out_block(i, acc):
    v = jax.lax.dynamic_slice(values_all, (l, 0, 0, start(i), 0), (1, B, H, block, D))[0]
    v = _as_float(v, kv_dtype)
    p_i = jax.lax.dynamic_slice(p, (0, 0, 0, start(i)), (B, H, Hq // H, block))
    # slots the block before already counted (the overlapping last block) count once
    p_i = jnp.where(start(i) + jnp.arange(block) >= i * block, p_i, 0.0)
    return acc + jnp.einsum(
      "bgrk,bgkd->bgrd", p_i, v.astype(jnp.float32), precision=scores_lib.PRECISION
    )

  out = jax.lax.fori_loop(first, stop, out_block, jnp.zeros((B, H, Hq // H, D), jnp.float32))
  return probs, out.reshape(B, Hq, 1, D)


def decode_step(
  cfg: ModelConfig,
  params: dict,
  spec: CacheSpec,
  cache: KVCache,
  token_B,
  pos_B,
  t_B,
  step=None,
):
  """Runs one generated token through every layer against the cache.

  The K/V buffers ride in the layer loop's carry (on CPU a 16-bit cache as its bits,
  :func:`_carried_as_bits`) and only the new token's slot is written (an in-place scatter), so a
  step reads the cache once and writes ``O(B H D)``; each layer's attention reads its slots in
  blocks (:func:`slot_attention_of_layer`). Over parameters and a cache held one buffer per
  layer (:func:`per_layer`) the layers are unrolled, each reading its own weights and slots whole
  (:func:`layer_attention`). Prefill-time policies append; decode-time policies admit the token
  and evict to stay within budget.

  Args:
    cfg: the model's config.
    params: the parameter pytree (stacked, or split by layer with the cache: :func:`per_layer`).
    spec: the cache's static choices.
    cache: the cache (stacked, or held one buffer per layer: :func:`per_layer`).
    token_B: the token per row ``[B]``.
    pos_B: the token's RoPE position per row ``[B]`` (original positions).
    t_B: the token's index in the sequence (not read by the step: slots come from the cache).
    step: a scalar, the generated tokens before this one (the same for every row); it drives
      ``decode_every`` (after the step that makes ``step + 1`` a multiple of ``N`` the cache is
      re-compressed by :func:`recompress`, under a ``lax.cond``, so nothing retraces) and
      ThinK's slots.

  Returns:
    ``(logits [B, V], cache)``: fp32 logits and the updated cache.

  Raises:
    ValueError: when ``decode_every`` or ThinK needs ``step`` and it is ``None``, or for a cache
      held one buffer per layer under a spec that re-compresses or re-indexes.
  """
  if isinstance(cache.keys, tuple):  # one buffer per layer (per_layer)
    if spec.decode_every or spec.reindex:
      raise ValueError(
        f"cache: held one buffer per layer (cache.per_layer), which spec {spec!r} cannot decode "
        "(it re-compresses or re-indexes); expected the stacked cache"
      )
    return _decode_step_per_layer(cfg, params, spec, cache, token_B, pos_B)
  B = token_B.shape[0]
  x = llama.embed_tokens(cfg, params, token_B)[:, None, :]
  stacked = llama.stacked(params)
  slots = {"positions": cache.positions, "valid": cache.valid}
  if cache.scores is not None:
    slots["scores"] = cache.scores
  if cache.attn_sums is not None:
    slots["attn_sums"] = cache.attn_sums
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  budget_LBH = jnp.moveaxis(cache.budget, 0, 1)
  H = cache.keys.shape[2]
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
  h_idx = jnp.broadcast_to(jnp.arange(H)[None, :], (B, H))
  think = cache.new_keys is not None
  if (spec.decode_every or think) and step is None:
    raise ValueError("step: decode_every and ThinK place tokens by step count; pass the step")

  def layer(carry, inputs):
    x, keys_all, values_all, new_all = carry
    p, lslots, budget_BH, l, ch = inputs
    q, k, v = _token_qkv(cfg, spec, p, x, pos_B, l)
    lslots = dict(lslots, overflow=jnp.zeros((B,), bool))
    if think:  # generated token `step` in slot C_prompt + step, its full key in new_keys
      slot, lslots = _admit_generated(cache, lslots, pos_B, step)
      at = jnp.minimum(step, new_all.shape[3] - 1)
      new_all = new_all.at[l, :, :, at].set(k[:, :, 0].astype(new_all.dtype))
    else:
      slot, lslots = _admit(spec, lslots, budget_BH, pos_B)
      keys_all = keys_all.at[l, b_idx, h_idx, slot].set(_as_bits(k[:, :, 0].astype(kv_dtype), bits))
    layer_overflow = lslots.pop("overflow")
    values_all = values_all.at[l, b_idx, h_idx, slot].set(
      _as_bits(v[:, :, 0].astype(cache.values.dtype), bits)
    )
    visible = _visible(cfg, l, lslots, pos_B)
    if think or spec.reindex:  # these read the layer's keys whole (pruned, or rotated)
      keys, values = _as_float(keys_all[l], kv_dtype), _as_float(values_all[l], kv_dtype)
      q_att = q
      if spec.reindex:
        q_att, keys = _reindexed(cfg, q, keys, lslots["positions"], lslots["valid"], pos_B)
      if think:
        probs = _think_probs(cfg, q_att, keys, new_all[l], ch, visible)
      else:
        probs = llama.attention_probs(
          q_att, keys, visible[:, :, None, :], softcap=cfg.attn_softcap
        )  # [B, Hq, 1, C]
      out = llama.attend(probs, values)  # the query layout is the case G = Hq
    else:
      probs, out = slot_attention_of_layer(cfg, q, keys_all, values_all, l, visible, kv_dtype)
    lslots = _observed(spec, lslots, probs, H)
    carry = (llama.output_and_mlp(cfg, p, x, out), keys_all, values_all, new_all)
    return carry, (lslots, layer_overflow, q[:, :, 0] if spec.decode_every else None)

  L = cfg.num_layers
  kv_dtype = cache.keys.dtype
  bits = _carried_as_bits(kv_dtype) and cache.values.dtype == kv_dtype
  carry = (x, _as_bits(cache.keys, bits), _as_bits(cache.values, bits), cache.new_keys)
  xs = (stacked, slots, budget_LBH, jnp.arange(L), cache.channels)
  (x, keys_all, values_all, new_all), (new_slots, layer_overflow, q_LBHD) = jax.lax.scan(
    layer, carry, xs
  )
  logits = llama.logits_of(cfg, params, x)[:, 0]
  overflow = overflow | layer_overflow.any(0)
  cache = cache.replace(
    keys=_as_float(keys_all, kv_dtype),
    values=_as_float(values_all, cache.values.dtype),
    new_keys=new_all,
    overflow=overflow,
    **new_slots,
  )
  if spec.decode_every:
    cache = _remember_query(cache, q_LBHD, pos_B, step)
    cache = jax.lax.cond(
      (step + 1) % spec.decode_every == 0,
      lambda c: recompress(cfg, params, spec, c),
      lambda c: c,
      cache,
    )
  return logits, cache


def _token_qkv(cfg: ModelConfig, spec: CacheSpec, p: dict, x, pos_B, l):
  """The new token's query, key and value at layer ``l``, in the cache's layout (keys before
  RoPE for a re-indexing cache)."""
  q, k, v = llama.project_qkv(cfg, p, x, pos_B[:, None], layer=l)
  if spec.layout == "query":
    k, v = jnp.repeat(k, cfg.num_groups, 1), jnp.repeat(v, cfg.num_groups, 1)
  if spec.reindex:
    k = llama.rope_at(
      k, jnp.broadcast_to(pos_B[:, None, None], k.shape[:-1]), cfg, layer=l, inverse=True
    )
  return q, k, v


def _visible(cfg: ModelConfig, l, lslots: dict, pos_B) -> Array:
  """The slots of layer ``l`` the query at ``pos_B`` sees: the held ones, within the layer's
  window (Mistral's, or a Gemma sliding layer's) when it has one."""
  visible = lslots["valid"]
  window = llama.layer_window(cfg, l)
  if window is not None:  # keys older than the window are not attended
    visible = visible & (pos_B[:, None, None] - lslots["positions"] < window)
  return visible


def _observed(spec: CacheSpec, lslots: dict, probs, H: int) -> dict:
  """The layer's slot state after the token's attention ``probs``: a decode-time policy's scores
  (``observe``), and CaM's attention sums (the new token's own slot included: it was empty)."""
  if spec.decode_time and "scores" in lslots:
    state = policies.checked_observe(spec.policy, lslots["scores"], _per_cache_head(probs, H))
    lslots = dict(lslots, scores=state)
  if "attn_sums" in lslots:
    lslots = dict(lslots, attn_sums=lslots["attn_sums"] + _per_cache_head(probs, H))
  return lslots


def _written(buf: Array, slot_BH: Array, new_BHD: Array, slots_last: bool = False) -> Array:
  """``buf`` (``[B, H, C, D]``, or ``[B, H, D, C]`` with ``slots_last``) with each row and
  head's ``new`` vector in its ``slot`` (in place when ``buf`` is donated); a 16-bit buffer is
  written as its bits on CPU (:func:`_carried_as_bits`)."""
  B, H = slot_BH.shape
  bits = _carried_as_bits(buf.dtype)
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
  h_idx = jnp.broadcast_to(jnp.arange(H)[None, :], (B, H))
  new = _as_bits(new_BHD.astype(buf.dtype), bits)
  at = (b_idx, h_idx, slice(None), slot_BH) if slots_last else (b_idx, h_idx, slot_BH)
  return _as_float(_as_bits(buf, bits).at[at].set(new), buf.dtype)


PER_LAYER_FIELDS = ("keys", "values", "positions", "valid", "scores", "attn_sums")

# the most bytes of per-layer weights and cache that per_layer copies (per configuration under
# vmap): the split holds a second copy of both while the decode loop runs, so above this a loop
# keeps the stacked step
PER_LAYER_MAX_BYTES = 4 << 30


def decodes_per_layer(spec: CacheSpec, cache: KVCache) -> bool:
  """Whether a loop of decode steps runs faster over the cache held one buffer per layer.

  On CPU it does: XLA:CPU's contractions read materialised operands, so the stacked step copies
  every block of K and V it reads, and each layer's weights, out of the ``[L, ...]`` buffers
  (``docs/benchmarks.md`` has the measurements); over one buffer per layer, unrolled, each layer
  reads its own K and V in place. Re-compressing caches (``decode_every``), ThinK's pruned keys
  and re-indexed positions keep the stacked step.

  Args:
    spec: the cache's static choices.
    cache: the stacked cache.

  Returns:
    Whether the backend and the cache allow the split; :func:`per_layer` splits where this
    holds and the copies fit in :data:`PER_LAYER_MAX_BYTES`.
  """
  return (
    jax.default_backend() == "cpu"
    and not spec.decode_every
    and not spec.reindex
    and cache.new_keys is None
    and cache.channels is None
  )


def per_layer(spec: CacheSpec, params: dict, cache: KVCache) -> tuple[dict, KVCache]:
  """The parameters and cache as a loop of decode steps reads them fastest.

  :func:`decode_step` runs over either form, to the same result up to float rounding (the
  stacked step reads a long layer in blocks); :func:`restacked` returns the cache to the
  ``[L, ...]`` form the rest of the library reads. Splitting copies the cache and the
  per-layer weights once, and both copies live while the loop runs, so above
  :data:`PER_LAYER_MAX_BYTES` of them the loop keeps the stacked form. With
  ``spec.layer_capacity``, layer ``l``'s buffers keep their first
  ``layer_capacity[l]`` slots; a row holding a token past them is flagged in ``overflow``
  (callers raise on it), never dropped silently.

  Args:
    spec: the cache's static choices.
    params: the parameter pytree.
    cache: the stacked cache (its held slots first in each row, as :func:`compress` and the
      appends leave them).

  Returns:
    ``(params, cache)``: where :func:`decodes_per_layer` and the copies fit, the parameters
    split by layer (``llama.unstacked_params``) and the cache whose ``keys``, ``values``,
    ``positions``, ``valid`` (and ``scores``, ``attn_sums`` when held) are tuples of ``L``
    per-layer arrays, the keys held slots-last (``[B, H, D, C_l]``:
    :func:`held_layer_attention`); otherwise both as given.

  Raises:
    ValueError: for a ``spec.layer_capacity`` without one entry in ``[1, C]`` per layer.
  """
  if isinstance(cache.keys, tuple) or not decodes_per_layer(spec, cache):
    return params, cache
  split = [getattr(cache, name) for name in PER_LAYER_FIELDS]
  copied = jax.tree.leaves([llama.stacked(params), split])
  if sum(int(np.prod(t.shape)) * jnp.dtype(t.dtype).itemsize for t in copied) > PER_LAYER_MAX_BYTES:
    return params, cache
  L, B, _, C = cache.valid.shape
  caps = spec.layer_capacity or (C,) * L
  if len(caps) != L or max(caps) > C or min(caps) < 1:
    raise ValueError(
      f"spec.layer_capacity: expected {L} layers' capacities in [1, {C}] slots, got {caps!r}"
    )
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  for l, cap in enumerate(caps):
    if cap < C:  # a held slot past the layer's capacity: flagged, never dropped silently
      overflow = overflow | cache.valid[l, :, :, cap:].any((-2, -1))

  def split(name):
    t = getattr(cache, name)
    if t is None:
      return None
    # each layer's [B, H, C, ...], its slot axis 2; the keys slots-last
    layers = (jax.lax.slice_in_dim(t[l], 0, caps[l], axis=2) for l in range(L))
    return tuple(jnp.swapaxes(t, 2, 3) if name == "keys" else t for t in layers)

  cache = cache.replace(overflow=overflow, **{name: split(name) for name in PER_LAYER_FIELDS})
  return llama.unstacked_params(params), cache


def restacked(cache: KVCache, capacity: int | None = None) -> KVCache:
  """The cache in its stacked ``[L, ...]`` form (the inverse of :func:`per_layer`).

  Args:
    cache: a cache, stacked or held one buffer per layer.
    capacity: the slots of the stacked cache (the spec's ``capacity``), at least the longest
      layer's; ``None``: the longest layer's.

  Returns:
    The stacked cache (``cache`` itself when it is stacked); layers held with fewer slots
    (``spec.layer_capacity``) are padded with empty ones.

  Raises:
    ValueError: for a ``capacity`` below the longest layer's slots.
  """
  if not isinstance(cache.keys, tuple):
    return cache
  longest = max(t.shape[2] for t in cache.valid)
  if capacity is not None and (
    isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < longest
  ):
    raise ValueError(
      f"capacity: expected an int >= {longest} (the longest layer), got {capacity!r}"
    )
  C = longest if capacity is None else int(capacity)

  def stack(name):
    layers = getattr(cache, name)
    if layers is None:
      return None
    if name == "keys":  # held slots-last by per_layer
      layers = [jnp.swapaxes(t, 2, 3) for t in layers]
    axis = 2  # the slot axis of [B, H, C, ...]
    widths = [[(0, 0)] * t.ndim for t in layers]
    for w, t in zip(widths, layers, strict=True):
      w[axis] = (0, C - t.shape[axis])
    return jnp.stack([jnp.pad(t, w) for t, w in zip(layers, widths, strict=True)])

  return cache.replace(**{name: stack(name) for name in PER_LAYER_FIELDS})


def _decode_step_per_layer(cfg, params, spec: CacheSpec, cache: KVCache, token_B, pos_B):
  """:func:`decode_step` over a cache held one buffer per layer (:func:`per_layer`): the layers
  unrolled, each reading its own parameters, K (slots-last) and V whole
  (:func:`held_layer_attention`) and writing the new token's K and V into its own buffers."""
  B = token_B.shape[0]
  H = cache.keys[0].shape[1]
  x = llama.embed_tokens(cfg, params, token_B)[:, None, :]
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  held = [name for name in PER_LAYER_FIELDS if getattr(cache, name) is not None]
  out = {name: [] for name in held}
  for l in range(cfg.num_layers):
    p = llama.layer_params(params, l)
    q, k, v = _token_qkv(cfg, spec, p, x, pos_B, l)
    lslots = {name: getattr(cache, name)[l] for name in held if name not in ("keys", "values")}
    lslots["overflow"] = overflow
    slot, lslots = _admit(spec, lslots, cache.budget[:, l], pos_B)
    overflow = lslots.pop("overflow")
    keys = _written(cache.keys[l], slot, k[:, :, 0], slots_last=True)
    values = _written(cache.values[l], slot, v[:, :, 0])
    probs, attn = held_layer_attention(cfg, q, keys, values, _visible(cfg, l, lslots, pos_B))
    lslots = _observed(spec, lslots, probs, H)
    x = llama.output_and_mlp(cfg, p, x, attn)
    for name, t in dict(lslots, keys=keys, values=values).items():
      out[name].append(t)
  logits = llama.logits_of(cfg, params, x)[:, 0]
  return logits, cache.replace(overflow=overflow, **{n: tuple(t) for n, t in out.items()})


def _admit_generated(cache: KVCache, slots: dict, pos_B, step):
  """ThinK's admission: generated token ``step`` takes slot ``C_prompt + step`` in every row
  (flagged as overflow past the reserved slots)."""
  B, H = slots["valid"].shape[:2]
  Cp, N = cache.keys.shape[3], cache.new_keys.shape[3]
  slot = jnp.full((B, H), Cp + jnp.minimum(step, N - 1), jnp.int32)
  onehot = jax.nn.one_hot(slot, slots["valid"].shape[-1], dtype=bool)
  return slot, dict(
    slots,
    positions=jnp.where(onehot, pos_B[:, None, None], slots["positions"]),
    valid=slots["valid"] | onehot,
    overflow=slots["overflow"] | jnp.broadcast_to(step >= N, (B,)),
  )


def _remember_query(cache: KVCache, q_LBHD: Array, pos_B: Array, step) -> KVCache:
  """The step's post-RoPE queries into the ring of the last ``W`` generated ones."""
  W = cache.queries.shape[3]
  at = jnp.asarray(step, jnp.int32) % W
  queries = jax.lax.dynamic_update_index_in_dim(
    cache.queries, q_LBHD[:, :, :, None].astype(cache.queries.dtype), at, 3
  )
  query_pos = jax.lax.dynamic_update_index_in_dim(
    cache.query_pos, pos_B[:, None].astype(jnp.int32), at, 1
  )
  return cache.replace(queries=queries, query_pos=query_pos)


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


def _per_cache_head(probs_BHq1C: Array, H: int) -> Array:
  """One step's attention ``[B, Hq, 1, C]`` per cache head ``[B, H, C]``: the mean over the
  query heads reading it (the query layout, ``H = Hq``, is unchanged)."""
  B, Hq, _, C = probs_BHq1C.shape
  return probs_BHq1C[:, :, 0].reshape(B, H, Hq // H, C).mean(2)
