"""Tokens fed at once after held keys (:func:`extend`): a cache that decoding only appends to
gives the same logits as feeding the tokens one by one through the decode step.

Re-exported by :mod:`kvjax.model.cache`, whose names these are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import llama
from kvjax.model.cache_layout import CacheSpec, KVCache
from kvjax.model.config import ModelConfig


def appends_only(spec: CacheSpec) -> bool:
  """Says whether decoding with ``spec`` only appends to the compressed cache.

  That is a prefill-time policy or the full cache: no decode-time eviction, no re-compression,
  no ThinK, no re-indexing, so that tokens fed one by one see exactly what
  :func:`extend_logits` feeds them at once.

  Args:
    spec: the cache's static choices.

  Returns:
    ``True`` when decoding only appends.
  """
  return not (spec.decode_time or spec.decode_every or spec.channel_ratio or spec.reindex)


def held_kv(spec: CacheSpec, cache: KVCache) -> tuple:
  """Returns the held keys of a cache that decoding only appends to (:func:`appends_only`).

  These are the keys :func:`extend` feeds tokens after.

  Args:
    spec: the cache's static choices.
    cache: the cache.

  Returns:
    ``(keys, values, valid, positions)`` of the cache.

  Raises:
    ValueError: when decoding with ``spec`` does more than append, or the cache holds ThinK's
      generated keys.
  """
  if not appends_only(spec) or cache.new_keys is not None:
    raise ValueError(f"spec: feeding tokens at once needs a cache that only appends, got {spec}")
  return cache.keys, cache.values, cache.valid, cache.positions


def extend_logits(
  cfg: ModelConfig, params: dict, spec: CacheSpec, cache: KVCache, tokens_BM, pos_BM
):
  """Computes the logits of ``M`` tokens fed after the cache at once, without updating it.

  Each token attends to the cache's valid slots and causally to the fed tokens before it, which
  is what feeding them one by one through :func:`~kvjax.model.cache.decode_step` gives when
  decoding only appends (:func:`appends_only`). One pass over the weights for all ``M`` tokens
  instead of ``M`` passes: a decode step reads every weight to produce one row (memory-bound),
  this reads them once for ``B * M`` rows.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    spec: the cache's static choices.
    cache: the cache.
    tokens_BM: the fed tokens ``[B, M]``.
    pos_BM: the tokens' RoPE positions ``[B, M]``.

  Returns:
    fp32 logits ``[B, M, V]``.

  Raises:
    ValueError: as :func:`held_kv`.
  """
  logits, _ = extend(cfg, params, (held_kv(spec, cache),), tokens_BM, pos_BM)
  return logits


def extend(
  cfg: ModelConfig,
  params: dict,
  held: tuple,
  tokens_BM,
  pos_BM,
  *,
  probs=False,
  appended=False,
  logits_from: int = 0,
):
  """Feeds ``M`` tokens at once after keys and values held per layer and head.

  Each fed token attends to the valid held keys and causally to the fed tokens up to itself
  (Mistral's sliding window applies to both). The segments are never concatenated: each one's
  logits are formed against its own keys and its values weighted by its part of the one softmax
  over all of them, so a call reads the held cache once instead of copying it per layer (for an
  evaluation's ``K x B`` caches, gigabytes per call).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    held: the held segments, attended in order, each ``(keys [L, B, H, C, D], values, valid
      [L, B, H, C], positions [L, B, H, C])`` with keys post-RoPE at their original positions,
      per KV head or (the query layout, ``H = Hq``) per query head.
    tokens_BM: the fed tokens ``[B, M]``, or their input embeddings ``[B, M, d]`` (HF's
      ``inputs_embeds``: RestoreKV's learned restore tokens, which no vocabulary entry holds).
    pos_BM: their RoPE positions ``[B, M]``.
    probs: whether to return the softmax over held and fed keys cut to the first segment (the
      oracle's full-cache attention of future queries).
    appended: whether to also return the fed tokens' own segment, which later tokens are fed
      after by holding it as a second segment.
    logits_from: the logits of the fed tokens from this one on only (the LM head is a fifth of a
      small model's work per token; a prefix fed for its keys needs its last token's logits
      only).

  Returns:
    ``(logits [B, M - logits_from, V], attention [L, B, Hq, M, C] over the first held segment or
    None)``; with ``appended`` a third item, the fed tokens' segment ``(keys [L, B, H, M, D],
    values, valid, positions)``.
  """
  B, M = tokens_BM.shape[:2]
  # embeddings (ndim 3) are the residual stream's input as given
  x = tokens_BM if tokens_BM.ndim == 3 else llama.embed_tokens(cfg, params, tokens_BM)
  held = tuple(held)
  repeat_kv = held[0][0].shape[2] != cfg.num_kv_heads  # the query layout: one slot table per Hq

  def layer(x, inputs):
    p, segments, l = inputs  # per held segment: [B, H, C, D] keys and values, [B, H, C] masks
    q, k, v = llama.project_qkv(cfg, p, x, pos_BM, layer=l)
    if repeat_kv:
      k, v = jnp.repeat(k, cfg.num_groups, 1), jnp.repeat(v, cfg.num_groups, 1)
    H = segments[0][0].shape[1]
    dtype = segments[0][0].dtype
    fed_pos = jnp.broadcast_to(pos_BM[:, None], (B, H, M))
    fed = (k.astype(dtype), v.astype(dtype), jnp.ones((B, H, M), bool), fed_pos)
    parts = (*segments, fed)
    # the model's own causal mask over held then fed keys, per (row, head): held slots all come
    # before the fed tokens (index -1); Mistral's window applies by position to both
    k_pos = jnp.concatenate([s[3].astype(jnp.int32) for s in parts], -1)
    k_valid = jnp.concatenate([s[2] for s in parts], -1)
    held_len = k_pos.shape[-1] - M
    k_index = jnp.concatenate(
      [jnp.full((held_len,), -1, jnp.int32), jnp.arange(M, dtype=jnp.int32)]
    )
    allowed = llama.causal_allowed(
      fed_pos.reshape(B * H, M),
      k_pos.reshape(B * H, -1),
      k_valid.reshape(B * H, -1),
      jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B * H, M)),
      jnp.broadcast_to(k_index, (B * H, held_len + M)),
      llama.layer_window(cfg, l),
    ).reshape(B, H, M, held_len + M)
    bounds = np.cumsum([0] + [s[0].shape[2] for s in parts])
    out, attn = llama.segments_attention(
      q,
      [
        (s[0], s[1], allowed[..., a:b])
        for s, a, b in zip(parts, bounds[:-1], bounds[1:], strict=True)
      ],
      probs_of_first=probs,
      softcap=cfg.attn_softcap,
    )  # attn: [B, Hq, M, C], the first segment's part of the one softmax
    x = llama.output_and_mlp(cfg, p, x, out)
    return x, (attn, fed[:2] if appended else None)

  x, (attn_LBHMC, fed) = jax.lax.scan(
    layer, x, (llama.stacked(params), held, jnp.arange(cfg.num_layers))
  )
  logits = llama.logits_of(cfg, params, x[:, logits_from:])
  if not appended:
    return logits, attn_LBHMC
  positions = held[0][3]
  L, _, H = positions.shape[:3]
  pos_LBHM = jnp.broadcast_to(pos_BM[None, :, None], (L, B, H, M)).astype(positions.dtype)
  return logits, attn_LBHMC, (*fed, jnp.ones((L, B, H, M), bool), pos_LBHM)
