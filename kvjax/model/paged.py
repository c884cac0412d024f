"""A per-head paged cache for decoding: each head reads its own slots, not its layer's largest.

The stacked cache (:class:`~kvjax.model.cache.KVCache`) gives every head of a layer the same
capacity, so under a per-head allocation (Ada-KV, HeadKV) or a per-layer one (PyramidKV) a step
reads every head up to the largest budget. :class:`PagedCache` holds the compressed cache as
one pool of pages ``[X, P, D]`` shared by every layer; row ``(l, r)`` (layer ``l``, ``r = b * G +
g``) owns ``ceil((held + new_tokens) / P)`` consecutive pages listed in ``pages_LRM[l, r]``, its
held slots first and room for the tokens to come after them. A decode step appends each row's
new key and value at slot ``length_LR[l, r]`` and attends through
:func:`kvjax.model.ragged.ragged_decode_attention`, which reads the pages up to each row's length
and nothing else: the bytes a step reads are :func:`bytes_read`, each head's own.

:func:`uses_paged` says when :func:`kvjax.model.generate` decodes this way: on TPU and GPU when
the budgets differ across heads or layers (the ragged kernels exist there), never on CPU by
default: there the XLA path gathers every row's ``max_pages`` (reading the padding anyway) and
the stacked step, split by layer, is the tuned one; ``Layout(paged=True)`` forces it on any platform, ``Layout(paged=False)`` refuses it.
Prefill-time policies only: a decode-time policy evicts inside its row's slot table, which this
layout does not index.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks, policies
from kvjax.model import llama, ragged
from kvjax.model.budget_checks import capacity_bucket
from kvjax.model.cache_layout import CacheSpec, KVCache
from kvjax.model.config import ModelConfig

Array = jax.Array

# slots per page: the ragged kernels' (a bf16 TPU tile's rows, a power of two for Triton)
PAGE = ragged.PAGE
# the platforms with a ragged kernel (``ragged.ragged_decode_attention``'s ``platform_dependent``)
KERNEL_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
PLATFORMS = ("cpu",) + KERNEL_PLATFORMS

__all__ = [
  "KERNEL_PLATFORMS",
  "PAGE",
  "PLATFORMS",
  "PagedCache",
  "bytes_read",
  "decode_step",
  "from_stacked",
  "memory",
  "pool_size",
  "uses_paged",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """A compressed cache held in pages, each (layer, batch row, KV head) row its own.

  Attributes:
    keys: the pool of key pages ``[X, P, D]`` (every layer's), post-RoPE.
    values: the pool of value pages ``[X, P, D]``.
    positions: int32 ``[X, P]``, each slot's original position.
    pages: int32 ``[L, R, M]``, row ``(l, r)``'s pages in slot order; entries past its own pages
      name the pool's last page, a spare nothing holds.
    length: int32 ``[L, R]``, the slots each row holds (its first ones).
    room: int32 ``[L, R]``, the slots each row's pages hold (``length`` may grow to it).
    overflow: bool ``[B]``, set when a row needed more slots than its pages (tokens lost).
  """

  keys: Array
  values: Array
  positions: Array
  pages: Array
  length: Array
  room: Array
  overflow: Array


def check_platform(platform: str) -> str:
  """Returns ``platform`` when it is one of :data:`PLATFORMS`.

  Args:
    platform: a platform's name (``jax.default_backend()``'s).

  Returns:
    ``platform``.

  Raises:
    ValueError: for another name.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"platform: expected one of {PLATFORMS}, got {platform!r}")
  return platform


def uses_paged(
  cfg: ModelConfig, spec: CacheSpec, budget_LH, paged: bool | None, platform: str
) -> bool:
  """Whether a generation decodes over a :class:`PagedCache`.

  Args:
    cfg: the model's config.
    spec: the cache's static choices (its policy, layout, re-indexing and re-compression).
    budget_LH: the allocation (``[L, H]`` or ``[B, L, H]``, concrete), or ``None`` (full).
    paged: the layout's choice (:class:`kvjax.model.cache.Layout`): ``None`` automatic, ``True``
      forced, ``False`` never.
    platform: the platform the step runs on (``jax.default_backend()``), one of
      :data:`PLATFORMS`.

  Returns:
    With ``paged=None``: on a platform of :data:`KERNEL_PLATFORMS`, for a prefill-time policy
    whose budgets differ across heads or layers; otherwise ``paged``.

  Raises:
    ValueError: for an unknown ``platform``, or ``paged=True`` with a cache this layout cannot
      hold (naming what stands in the way).
  """
  check_platform(platform)
  if paged is False:
    return False
  blocker = _blocker(cfg, spec)
  if paged:
    if blocker:
      raise ValueError(f"layout: paged=True cannot hold this cache: {blocker}")
    return True
  if blocker or budget_LH is None or platform not in KERNEL_PLATFORMS:
    return False
  return bool(np.ptp(np.asarray(budget_LH)) > 0)


def _blocker(cfg: ModelConfig, spec: CacheSpec) -> str | None:
  """What keeps a cache out of the paged layout, or ``None``."""
  pol: policies.Policy = spec.policy
  if spec.layout != "kv":
    return f"its heads are {spec.layout!r} (expected 'kv')"
  if spec.decode_time or spec.decode_every:
    return f"{type(pol).__name__} evicts while decoding (a prefill-time policy is expected)"
  if spec.reindex or spec.channel_ratio or pol.merges_while_decoding:
    return "it re-indexes positions, prunes key channels or merges while decoding"
  if cfg.per_layer:
    return f"the {cfg.family} layers differ in their attention window"
  return None


def _check_page(page) -> int:
  if checks.static_int("page", page, 16) & (page - 1):
    raise ValueError(f"page: expected a power of two >= 16, got {page!r}")
  return int(page)


def pool_size(budget_LH, batch: int, new: int, page: int) -> int:
  """The pages a pool holds for an allocation: every row's own, and one spare.

  Counted from each layer's total, which a per-head allocation (Ada-KV, HeadKV) keeps whatever
  its split (so one compiled decoder serves every prompt): a layer's rows need at most
  ``total / P + R`` pages. The count is rounded up as a cache's capacity is
  (:func:`kvjax.model.budget_checks.capacity_bucket`, four sizes per octave), so that a new
  budget rarely compiles the decoder again.

  Args:
    budget_LH: the allocation, ``[L, H]`` or ``[B, L, H]`` (KV heads), concrete.
    batch: the rows ``B``.
    new: the tokens each row appends.
    page: slots per page.

  Returns:
    ``sum_l (sum_r (budget + new)) // P + L * R + 1``, bucketed.

  Raises:
    ValueError: for a batch below 1, negative new tokens, a page that is not a power of two
      >= 16, or a negative budget.
  """
  batch, new = checks.static_int("batch", batch, 1), checks.static_int("new", new, 0)
  page = _check_page(page)
  budget = np.asarray(budget_LH)
  if budget.ndim not in (2, 3) or (budget < 0).any():
    raise ValueError(f"budget_LH: expected [L, H] or [B, L, H] budgets >= 0, got {budget!r}")
  budget_BLH = np.broadcast_to(budget, (batch,) + budget.shape[-2:])
  L, R = budget_BLH.shape[1], batch * budget_BLH.shape[2]
  per_layer = (budget_BLH.astype(np.int64) + new).sum((0, 2))
  return capacity_bucket(int((per_layer // page).sum()) + L * R + 1)


def from_stacked(cache: KVCache, *, new: int, pool: int, page: int = PAGE) -> PagedCache:
  """Moves a compressed stacked cache into pages, each row's held slots first.

  Args:
    cache: the compressed cache (``[L, B, G, C, D]``).
    new: the tokens each row will append (each row gets room for them).
    pool: the pool's pages (:func:`pool_size`); rows that would need more flag ``overflow``.
    page: slots per page (a power of two >= 16).

  Returns:
    The :class:`PagedCache`; slots keep their order, so attention equals the stacked cache's to
    float rounding.

  Raises:
    ValueError: for negative new tokens, a pool below 1 page, or a page that is not a power of
      two >= 16.
  """
  new, pool = checks.static_int("new", new, 0), checks.static_int("pool", pool, 1)
  page = _check_page(page)
  L, B, G, C, D = cache.keys.shape
  R = B * G
  valid = cache.valid.reshape(L, R, C)
  held = valid.sum(-1, dtype=jnp.int32)
  n = jnp.maximum((held + new + page - 1) // page, 1)  # [L, R] pages per row
  flat = n.reshape(-1)
  first = (jnp.cumsum(flat) - flat).reshape(L, R)
  over = jnp.sum(flat) > pool - 1  # the last page is the spare
  M = -(-(C + new) // page)
  j = jnp.arange(M, dtype=jnp.int32)[None, None, :]
  pages = jnp.where(j < n[..., None], first[..., None] + j, pool - 1).astype(jnp.int32)
  rank = jnp.cumsum(valid, -1, dtype=jnp.int32) - 1
  dest = jnp.where(valid, first[..., None] * page + rank, pool * page).reshape(-1)

  def into_pool(x, width):
    out = jnp.zeros((pool * page,) + width, x.dtype)
    return out.at[dest].set(x.reshape((-1,) + width), mode="drop").reshape((pool, page) + width)

  return PagedCache(
    keys=into_pool(cache.keys, (D,)),
    values=into_pool(cache.values, (cache.values.shape[-1],)),
    positions=into_pool(cache.positions.astype(jnp.int32), ()),
    pages=pages,
    length=held,
    room=n * page,
    overflow=jnp.broadcast_to(over, (B,)),
  )


def decode_step(
  cfg: ModelConfig, params: dict, cache: PagedCache, token_B, pos_B, *, backend, interpret=False
):
  """Runs one generated token through every layer against a :class:`PagedCache`.

  Each layer appends the token's key and value at its rows' next slots and attends through
  :func:`kvjax.model.ragged.ragged_decode_attention` over the rows' own pages.

  Args:
    cfg: the model's config (layers alike: :func:`uses_paged`).
    params: the stacked parameter pytree.
    cache: the paged cache.
    token_B: the token per row ``[B]``.
    pos_B: its RoPE position per row ``[B]``.
    backend: the kernel (``ragged.BACKENDS``: ``"auto"`` picks by platform).
    interpret: run a Pallas kernel in the interpreter (any device; how CPU tests check them).

  Returns:
    ``(logits [B, V], cache)``.
  """
  B = token_B.shape[0]
  L, R, M = cache.pages.shape
  G, Hq, P = R // B, cfg.num_heads, cache.keys.shape[1]
  x = llama.embed_tokens(cfg, params, token_B)[:, None, :]
  pos_R = jnp.repeat(pos_B.astype(jnp.int32), G)
  window = llama.layer_window(cfg)
  rows = jnp.arange(R)

  def layer(carry, inputs):
    x, keys, values, positions = carry
    p, pages_RM, length_R, room_R, l = inputs
    q, k, v = llama.project_qkv(cfg, p, x, pos_B[:, None], layer=l)
    full_R = length_R >= room_R
    page_R = pages_RM[rows, jnp.minimum(length_R // P, M - 1)]
    # a full row's token goes to the spare page, which no row reads (the row flags overflow)
    at = (jnp.where(full_R, keys.shape[0] - 1, page_R), length_R % P)
    keys = keys.at[at].set(k.reshape(R, -1).astype(keys.dtype))
    values = values.at[at].set(v.reshape(R, -1).astype(values.dtype))
    positions = positions.at[at].set(pos_R)
    length_R = jnp.where(full_R, length_R, length_R + 1)
    held = ragged.Pages(keys, values, pages_RM, length_R, positions if window else None)
    out_RGD = ragged.ragged_decode_attention(
      q.reshape(R, Hq // G, -1),
      held,
      softcap=cfg.attn_softcap,
      query_pos_R=pos_R if window is not None else None,
      window=window,
      backend=backend,
      interpret=interpret,
    )
    x = llama.output_and_mlp(cfg, p, x, out_RGD.reshape(B, Hq, 1, -1))
    return (x, keys, values, positions), (length_R, full_R.reshape(B, G).any(-1))

  xs = (llama.stacked(params), cache.pages, cache.length, cache.room, jnp.arange(L))
  carry = (x, cache.keys, cache.values, cache.positions)
  (x, keys, values, positions), (length, full_LB) = jax.lax.scan(layer, carry, xs)
  logits = llama.logits_of(cfg, params, x)[:, 0]
  cache = dataclasses.replace(
    cache,
    keys=keys,
    values=values,
    positions=positions,
    length=length,
    overflow=cache.overflow | full_LB.any(0),
  )
  return logits, cache


def bytes_read(cache: PagedCache) -> int:
  """The K and V bytes one step reads from a paged cache: each row's pages up to its length.

  Args:
    cache: the paged cache (concrete).

  Returns:
    ``2 * sum(ceil(length / P)) * P * D * itemsize`` over every layer and row: the slots each head
    holds, rounded up to its last page.
  """
  P, D = cache.keys.shape[1:]
  return ragged.bytes_read(np.asarray(cache.length).reshape(-1), P, D, cache.keys.dtype.itemsize)


def memory(cache: PagedCache) -> dict:
  """Counts the bytes of a paged cache, as :func:`kvjax.model.cache.memory` counts a stacked one.

  Args:
    cache: the paged cache (concrete).

  Returns:
    ``{"kv_bytes_held", "kv_bytes_allocated", "bookkeeping_bytes", "kv_bytes_read"}``: the K/V
    of the held slots, the pool's, the positions, page tables and lengths, and the K/V one step
    reads (:func:`bytes_read`).
  """
  slot = (cache.keys.shape[-1] + cache.values.shape[-1]) * cache.keys.dtype.itemsize
  book = sum(x.size * x.dtype.itemsize for x in (cache.positions, cache.pages, cache.length))
  return {
    "kv_bytes_held": int(np.asarray(cache.length).sum()) * slot,
    "kv_bytes_allocated": (cache.keys.size + cache.values.size) * cache.keys.dtype.itemsize,
    "bookkeeping_bytes": int(book + cache.room.size * 4),
    "kv_bytes_read": bytes_read(cache),
  }
