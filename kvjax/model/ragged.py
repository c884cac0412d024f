"""Ragged per-head decode attention: one query step against each (batch row, KV head)'s own held
slots, read in pages, a Pallas kernel for TPU (Mosaic) and GPU (Triton) with an XLA reference.

The stacked cache (:class:`kvjax.model.cache.KVCache`) gives every head of a layer one capacity,
so a head whose budget is below its layer's largest (Ada-KV, HeadKV) is padded, and a decode step
reads the padding. Here each (batch row, KV head) is a *row* ``r = b * G + g`` of its own
(:class:`Pages`): its slots sit in pages of ``page`` slots (``keys [num_pages, page, D]``)
listed in its page table (``table [R, max_pages]``), and its length ``length[r]`` says how many
of its first slots it holds (Ada-KV's official code hands flash-attn one variable-length sequence per head the same way).
The kernel reads pages ``0 .. ceil(length / page) - 1`` of each row and nothing else; the query
heads of a GQA group (``q_RGD [R, Hq / G, D]``) share their row's pages.

:func:`ragged_decode_attention` picks the kernel for the platform it is lowered for
(``lax.platform_dependent``: Mosaic on TPU, Triton on CUDA and ROCm, :func:`reference` elsewhere,
the CPU default); ``backend`` forces one, and ``interpret=True`` runs a kernel in the Pallas
interpreter on any device (how the tests check it on CPU). :func:`pack_rows` builds the layout
from a stacked layer's slot tables (on the host, where the page counts are static).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

Array = jax.Array

BACKENDS = ("auto", "tpu", "gpu", "xla")
# slots per page: a multiple of 16 (a bf16 TPU tile's rows) and a power of two (Triton's blocks)
PAGE = 128
# the logit of a slot the query does not see; finite so that a page with no visible slot keeps
# its running maximum finite (its probabilities are zeroed explicitly)
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """Rows of slots held in pages: what the kernel reads.

  Row ``r`` holds its first ``length[r]`` slots, slot ``s`` at ``keys[table[r, s // page], s %
  page]``.

  Attributes:
    keys: the pages of keys ``[num_pages, page, D]`` (post-RoPE); ``page`` a power of two >= 16.
    values: the pages of values, the keys' shape.
    table: int32 ``[R, max_pages]``, each row's pages in slot order (entries past its length are
      not read; any valid page index).
    length: int32 ``[R]``, the slots each row holds, ``0 .. max_pages * page``.
    positions: int32 ``[num_pages, page]``, each slot's position (for a sliding window), or
      ``None``.
  """

  keys: Array
  values: Array
  table: Array
  length: Array
  positions: Array | None = None

  @property
  def page(self) -> int:
    """Slots per page."""
    return self.keys.shape[1]


def _check(q_RGD, pages: Pages, query_pos_R, window):
  """Raises a ``ValueError`` naming the argument for shapes that do not fit together."""
  if q_RGD.ndim != 3:
    raise ValueError(f"q_RGD: expected [R, Hq / G, D], got shape {q_RGD.shape}")
  R, _, D = q_RGD.shape
  keys = pages.keys
  if keys.ndim != 3 or keys.shape[2] != D:
    raise ValueError(f"pages.keys: expected [num_pages, page, {D}], got shape {keys.shape}")
  if pages.values.shape != keys.shape:
    raise ValueError(
      f"pages.values: expected the keys' shape {keys.shape}, got {pages.values.shape}"
    )
  page = keys.shape[1]
  if page % 16 or page & (page - 1):
    raise ValueError(f"pages.keys: a page of {page} slots; expected a power of two >= 16")
  if pages.table.ndim != 2 or pages.table.shape[0] != R:
    raise ValueError(f"pages.table: expected [{R}, max_pages], got shape {pages.table.shape}")
  if pages.length.shape != (R,):
    raise ValueError(f"pages.length: expected shape ({R},), got {pages.length.shape}")
  if window is not None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
      raise ValueError(f"window: expected an int >= 1 or None, got {window!r}")
    if pages.positions is None or query_pos_R is None:
      raise ValueError("window: needs pages.positions and query_pos_R (the slots' and query's)")
    if pages.positions.shape != keys.shape[:2]:
      raise ValueError(f"pages.positions: expected {keys.shape[:2]}, got {pages.positions.shape}")
    if query_pos_R.shape != (R,):
      raise ValueError(f"query_pos_R: expected shape ({R},), got {query_pos_R.shape}")


def check_lengths(length_R, pages_RM, page: int) -> None:
  """Checks concrete lengths against the page tables' capacity (traced lengths cannot be).

  Args:
    length_R: each row's held slots (concrete).
    pages_RM: the page tables ``[R, max_pages]``.
    page: slots per page.

  Raises:
    ValueError: for a negative length or one above ``max_pages * page``.
  """
  length = np.asarray(length_R)
  cap = pages_RM.shape[1] * page
  bad = (length < 0) | (length > cap)
  if bad.any():
    r = int(np.argmax(bad))
    raise ValueError(f"pages.length: row {r} holds {int(length[r])} slots; expected 0..{cap}")


def reference(q_RGD, pages: Pages, *, softcap=None, query_pos_R=None, window=None) -> Array:
  """The ragged attention in plain XLA: each row's pages gathered, a masked fp32 softmax.

  Args:
    q_RGD: as :func:`ragged_decode_attention`.
    pages: as :func:`ragged_decode_attention`.
    softcap: as :func:`ragged_decode_attention`.
    query_pos_R: as :func:`ragged_decode_attention`.
    window: as :func:`ragged_decode_attention`.

  Returns:
    fp32 ``[R, Hq / G, D]``; a row holding no visible slot gives zeros.
  """
  keys_NPD, values_NPD, pages_RM, length_R = pages.keys, pages.values, pages.table, pages.length
  R, Gq, D = q_RGD.shape
  M, P = pages_RM.shape[1], keys_NPD.shape[1]
  k = keys_NPD[pages_RM].reshape(R, M * P, D).astype(jnp.float32)
  v = values_NPD[pages_RM].reshape(R, M * P, D).astype(jnp.float32)
  logits = jnp.einsum(
    "rgd,rsd->rgs", q_RGD.astype(jnp.float32), k, precision=jax.lax.Precision.HIGHEST
  ) / math.sqrt(D)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  visible = jnp.arange(M * P)[None, :] < length_R[:, None]
  if window is not None:
    pos = pages.positions[pages_RM].reshape(R, M * P)
    visible = visible & (query_pos_R[:, None] - pos < window)
  logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(visible.any(-1)[:, None, None], probs, 0.0)
  return jnp.einsum("rgs,rsd->rgd", probs, v, precision=jax.lax.Precision.HIGHEST)


def _page_update(q, k, v, visible, m, l, acc, *, softcap, dot):
  """One page of the online softmax: the running max ``m [Gq, 1]``, sum ``l [Gq, 1]`` and output
  ``acc [Gq, D]`` after the page's keys ``k`` and values ``v`` ``[P, D]`` (``visible [1, P]``)."""
  D = q.shape[-1]
  k, v = k.astype(jnp.float32), v.astype(jnp.float32)
  if dot:  # the MXU (TPU)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  else:  # a group of Hq / G < 16 queries is below Triton's smallest dot: broadcast and reduce
    s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)
  s = s * (1.0 / math.sqrt(D))
  if softcap is not None:
    s = jnp.tanh(s / softcap) * softcap
  s = jnp.where(visible, s, MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
  p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
  alpha = jnp.exp(m - m_new)
  l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
  if dot:
    pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  else:
    pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
  return m_new, l_new, alpha * acc + pv


def _finish(l, acc):
  return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


def _tpu_call(
  q_RGD, keys_NPD, values_NPD, pages_RM, length_R, pos_NP, qpos_R, *, softcap, window, interpret
):
  """Mosaic: a grid over (row, page); the page table and lengths prefetched into SMEM pick each
  step's page, and a step past the row's length re-names its last page (no copy) and is
  skipped."""
  from jax.experimental.pallas import tpu as pltpu

  R, Gq, D = q_RGD.shape
  _, P, _ = keys_NPD.shape
  M = pages_RM.shape[1]

  def page_of(r, j, pages, length, qpos):
    last = jnp.maximum(jax.lax.div(length[r] + P - 1, P) - 1, 0)
    return pages[r, jnp.minimum(j, last)]

  def kernel(pages, length, qpos, q_ref, k_ref, v_ref, pos_ref, o_ref, m_sc, l_sc, acc_sc):
    r, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
      m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    n = length[r]

    @pl.when(j * P < n)
    def _():
      slot = j * P + jax.lax.broadcasted_iota(jnp.int32, (1, P), 1)
      visible = slot < n
      if window is not None:
        visible = visible & (qpos[r] - pos_ref[0] < window)
      m, l_, acc = _page_update(
        q_ref[0].astype(jnp.float32),
        k_ref[0],
        v_ref[0],
        visible,
        m_sc[...],
        l_sc[...],
        acc_sc[...],
        softcap=softcap,
        dot=True,
      )
      m_sc[...], l_sc[...], acc_sc[...] = m, l_, acc

    @pl.when(j == M - 1)
    def _():
      o_ref[0] = _finish(l_sc[...], acc_sc[...]).astype(o_ref.dtype)

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=3,
    grid=(R, M),
    in_specs=[
      pl.BlockSpec((1, Gq, D), lambda r, j, *_: (r, 0, 0)),
      pl.BlockSpec((1, P, D), lambda r, j, *s: (page_of(r, j, *s), 0, 0)),
      pl.BlockSpec((1, P, D), lambda r, j, *s: (page_of(r, j, *s), 0, 0)),
      pl.BlockSpec((1, 1, P), lambda r, j, *s: (page_of(r, j, *s), 0, 0)),
    ],
    out_specs=pl.BlockSpec((1, Gq, D), lambda r, j, *_: (r, 0, 0)),
    scratch_shapes=[
      pltpu.VMEM((Gq, 1), jnp.float32),
      pltpu.VMEM((Gq, 1), jnp.float32),
      pltpu.VMEM((Gq, D), jnp.float32),
    ],
  )
  return pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((R, Gq, D), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name="kvjax_ragged_decode_tpu",
  )(pages_RM, length_R, qpos_R, q_RGD, keys_NPD, values_NPD, pos_NP[:, None, :])


def _gpu_call(
  q_RGD, keys_NPD, values_NPD, pages_RM, length_R, pos_NP, qpos_R, *, softcap, window, interpret
):
  """Triton: one program per row, looping over the row's own pages (a dynamic trip count), each
  page loaded through the row's page table."""
  from jax.experimental.pallas import triton as plgpu

  R, Gq, D = q_RGD.shape
  _, P, _ = keys_NPD.shape
  M = pages_RM.shape[1]
  if Gq & (Gq - 1) or D & (D - 1):
    raise ValueError(f"q_RGD: Triton needs powers of two for Hq / G and D, got {Gq} and {D}")

  def kernel(pages_ref, length_ref, qpos_ref, q_ref, k_ref, v_ref, pos_ref, o_ref):
    r = pl.program_id(0)
    n = length_ref[r]
    q = q_ref[0].astype(jnp.float32)

    def body(j, carry):
      m, l_, acc = carry
      page = pages_ref[r, j]
      visible = (j * P + jnp.arange(P))[None, :] < n
      if window is not None:
        visible = visible & (qpos_ref[r] - pos_ref[page][None, :] < window)
      return _page_update(
        q, k_ref[page], v_ref[page], visible, m, l_, acc, softcap=softcap, dot=False
      )

    init = (
      jnp.full((Gq, 1), MASK_VALUE, jnp.float32),
      jnp.zeros((Gq, 1), jnp.float32),
      jnp.zeros((Gq, D), jnp.float32),
    )
    _, l_, acc = jax.lax.fori_loop(0, jnp.minimum(jax.lax.div(n + P - 1, P), M), body, init)
    o_ref[0] = _finish(l_, acc).astype(o_ref.dtype)

  whole = pl.BlockSpec()  # the whole array: the kernel picks its pages and scalars itself
  return pl.pallas_call(
    kernel,
    grid=(R,),
    in_specs=[
      whole,
      whole,
      whole,
      pl.BlockSpec((1, Gq, D), lambda r: (r, 0, 0)),
      whole,
      whole,
      whole,
    ],
    out_specs=pl.BlockSpec((1, Gq, D), lambda r: (r, 0, 0)),
    out_shape=jax.ShapeDtypeStruct((R, Gq, D), jnp.float32),
    # Triton, not Mosaic GPU: Mosaic GPU needs Hopper, Colab's T4, L4 and A100 are older
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="kvjax_ragged_decode_gpu",
  )(pages_RM, length_R, qpos_R, q_RGD, keys_NPD, values_NPD, pos_NP)


def ragged_decode_attention(
  q_RGD,
  pages: Pages,
  *,
  softcap: float | None = None,
  query_pos_R=None,
  window: int | None = None,
  backend: str = "auto",
  interpret: bool = False,
) -> Array:
  """One decode query per row against the row's own held slots, read in pages.

  Row ``r`` (a (batch row, KV head) pair, ``r = b * G + g``) holds its first ``pages.length[r]``
  slots (:class:`Pages`); its ``Hq / G`` query heads attend over those slots alone:
  ``softmax(q k^T / sqrt(D))`` in fp32 (soft-capped with ``softcap``), within ``window`` of the
  query's position when given. Pages past a row's length are never read, so a head's bytes per
  step are its own length's.

  Args:
    q_RGD: the queries ``[R, Hq / G, D]`` (post-RoPE), the group of each row's KV head.
    pages: the rows' slots (:class:`Pages`; with ``window``, their ``positions``).
    softcap: Gemma 2's attention soft-cap (``cfg.attn_softcap``), or ``None``.
    query_pos_R: int32 ``[R]``, the query's position (with ``window``).
    window: a sliding window: slots at ``query_pos - position >= window`` are not seen.
    backend: ``"auto"`` (the kernel of the platform lowered for: Mosaic on TPU, Triton on a GPU,
      :func:`reference` elsewhere), ``"tpu"``, ``"gpu"`` or ``"xla"``.
    interpret: run the chosen Pallas kernel in the interpreter (any device).

  Returns:
    fp32 ``[R, Hq / G, D]``; a row with no visible slot gives zeros.

  Raises:
    ValueError: for shapes that do not fit together, a page size that is not a power of two
      >= 16, a bad ``window``, a ``backend`` not in :data:`BACKENDS`, or concrete lengths
      outside ``0 .. max_pages * page`` (:func:`check_lengths`).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
  _check(q_RGD, pages, query_pos_R, window)
  if not isinstance(pages.length, jax.core.Tracer):
    check_lengths(pages.length, pages.table, pages.page)
  R = q_RGD.shape[0]
  pages_RM = jnp.asarray(pages.table, jnp.int32)
  length_R = jnp.asarray(pages.length, jnp.int32)
  pos_NP = (
    jnp.zeros(pages.keys.shape[:2], jnp.int32)
    if pages.positions is None
    else jnp.asarray(pages.positions, jnp.int32)
  )
  qpos_R = (
    jnp.zeros((R,), jnp.int32) if query_pos_R is None else jnp.asarray(query_pos_R, jnp.int32)
  )
  args = (q_RGD, pages.keys, pages.values, pages_RM, length_R, pos_NP, qpos_R)
  opts = dict(softcap=softcap, window=window)

  def xla(*a):
    q, k, v, table, length, pos, qpos = a
    rows = Pages(k, v, table, length, pos)
    return reference(q, rows, softcap=softcap, query_pos_R=qpos, window=window)

  tpu = functools.partial(_tpu_call, **opts, interpret=interpret)
  gpu = functools.partial(_gpu_call, **opts, interpret=interpret)
  if backend == "tpu":
    return tpu(*args)
  if backend == "gpu":
    return gpu(*args)
  if backend == "xla":
    return xla(*args)
  return jax.lax.platform_dependent(*args, tpu=tpu, cuda=gpu, rocm=gpu, default=xla)


def pack_rows(
  keys_BGCD,
  values_BGCD,
  length_BG,
  *,
  capacity_BG=None,
  page: int = PAGE,
  positions_BGC=None,
):
  """Packs a stacked layer's slot tables into the ragged layout, each row its own pages.

  Row ``b * G + g`` gets ``ceil(capacity_BG[b, g] / page)`` pages (at least one), so a head
  whose capacity is below its layer's largest holds no padding past its own last page. Runs on
  the host: the page counts decide the shapes.

  Args:
    keys_BGCD: keys ``[B, G, C, D]``, each row's held slots first.
    values_BGCD: values ``[B, G, C, D]``.
    length_BG: the slots each row holds ``[B, G]``.
    capacity_BG: each row's own capacity ``[B, G]`` (``None``: its length), ``length .. C``.
    page: slots per page (a power of two >= 16).
    positions_BGC: optional int32 slot positions ``[B, G, C]``, packed alike.

  Returns:
    The :class:`Pages` (``positions`` ``None`` without ``positions_BGC``); the last page is a
    spare the unused table entries name.

  Raises:
    ValueError: for a page that is not a power of two >= 16, or lengths or capacities outside
      ``0 .. C`` (a capacity below its length).
  """
  if isinstance(page, bool) or not isinstance(page, int) or page < 16 or page & (page - 1):
    raise ValueError(f"page: expected a power of two >= 16, got {page!r}")
  keys, values = np.asarray(keys_BGCD), np.asarray(values_BGCD)
  B, G, C, D = keys.shape
  length = np.asarray(length_BG).reshape(B * G)
  cap = length if capacity_BG is None else np.asarray(capacity_BG).reshape(B * G)
  if (length < 0).any() or (length > C).any():
    raise ValueError(f"length_BG: expected 0..{C} slots per row, got {np.asarray(length_BG)}")
  if (cap < length).any() or (cap > C).any():
    raise ValueError(f"capacity_BG: expected length..{C} per row, got {np.asarray(capacity_BG)}")
  n_pages = np.maximum((cap + page - 1) // page, 1)
  M, N = int(n_pages.max()), int(n_pages.sum()) + 1
  first = np.concatenate([[0], np.cumsum(n_pages)[:-1]])
  pages = np.full((B * G, M), N - 1, np.int32)
  k_out = np.zeros((N, page, D), keys.dtype)
  v_out = np.zeros((N, page, D), values.dtype)
  pos_out = np.zeros((N, page), np.int32)
  rows_k, rows_v = keys.reshape(B * G, C, D), values.reshape(B * G, C, D)
  rows_pos = None if positions_BGC is None else np.asarray(positions_BGC).reshape(B * G, C)
  for r in range(B * G):
    pages[r, : n_pages[r]] = first[r] + np.arange(n_pages[r])
    n = int(cap[r])
    flat = slice(first[r] * page, first[r] * page + n)
    k_out.reshape(N * page, D)[flat] = rows_k[r, :n]
    v_out.reshape(N * page, D)[flat] = rows_v[r, :n]
    if rows_pos is not None:
      pos_out.reshape(N * page)[flat] = rows_pos[r, :n]
  positions = None if rows_pos is None else jnp.asarray(pos_out)
  return Pages(
    jnp.asarray(k_out),
    jnp.asarray(v_out),
    jnp.asarray(pages),
    jnp.asarray(length.astype(np.int32)),
    positions,
  )


def bytes_read(length_R, page: int, D: int, itemsize: int) -> int:
  """The K and V bytes one step reads: each row's pages up to its length.

  Args:
    length_R: each row's held slots.
    page: slots per page.
    D: the head dim.
    itemsize: bytes per K/V element.

  Returns:
    ``2 * sum(ceil(length / page)) * page * D * itemsize``.
  """
  pages = (np.asarray(length_R) + page - 1) // page
  return int(2 * pages.sum() * page * D * itemsize)
