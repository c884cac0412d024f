"""Scores: evidence -> ``scores_LHT`` (higher = keep), one pure function per method.

Each scorer follows one official implementation (the methods catalogue, ``docs/methods.md``); its
docstring names the reference and the keyword defaults are the reference defaults. Scores never
depend on budgets (that is :mod:`kvjax.budgets`), and nothing here selects (that is
:mod:`kvjax.select`). Softmax and accumulation run in fp32 whatever the input dtype.

Protection (sinks, the observation/recent window) is the score transform :func:`protect`, which
writes ``+inf``: protected positions are always selected first and count inside the budget, as in
every reference implementation (the window is part of ``max_capacity_prompt``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax import select

Array = jax.Array

# Every kvjax matmul (evidence, scores, the model) asks for full fp32 precision: TPUs otherwise
# compute fp32 matmuls in bf16 passes and Ampere/Hopper GPUs in TF32, which moves attention
# scores, breaks near-ties and the parity with the PyTorch references. bf16 operands run at
# native speed whatever this says.
PRECISION = lax.Precision.HIGHEST

POOLS = ("max", "avg")
REDUCES = ("sum", "mean")
GROUPINGS = ("mean", "max", "sum")
COLUMN_SUM_MASKS = ("causal", "kvfactory_legacy")
H2O_FORMS = ("causal", "kvfactory_legacy", "kvpress")


# --------------------------------------------------------------------------- validation helpers


def _check_array(name: str, x, ndim: int, letters: str):
  if not hasattr(x, "ndim") or x.ndim != ndim:
    shape = getattr(x, "shape", type(x).__name__)
    raise ValueError(f"{name}: expected a rank-{ndim} array [{', '.join(letters)}], got {shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
  if select.is_concrete(x) and not np.isfinite(np.asarray(x, np.float32)).all():
    raise ValueError(f"{name}: contains NaN or inf; expected finite values")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
  if value not in choices:
    raise ValueError(f"{name}: unknown value {value!r}; expected one of {tuple(choices)}")


def check_kernel(kernel) -> int:
  """Validates a pooling kernel: a positive odd int (the references pad with ``kernel // 2``).

  Args:
    kernel: the pooling width.

  Returns:
    ``kernel`` unchanged.

  Raises:
    ValueError: for a bool, a value that is not an int, an even kernel, or one outside
      ``[1, 2**31)``.
  """
  if (
    isinstance(kernel, bool)
    or not isinstance(kernel, int)
    or not 1 <= kernel < select.INT32_LIMIT
    or kernel % 2 == 0
  ):
    raise ValueError(f"kernel: expected a positive odd integer below 2**31, got {kernel!r}")
  return kernel


def check_count(name: str, value):
  """Validates a protection count (``sinks``, ``recent``, ``length``).

  An int or an int array, traced or concrete; when concrete, in ``[0, 2**31)``. Floats are
  refused (``sinks=2.5`` is not 2 sinks).

  Args:
    name: the argument's name, quoted in error messages.
    value: the count: an int or an int array, traced or concrete.

  Returns:
    A numpy array (concrete ``value``) or the tracer unchanged, as
    :func:`kvjax.select.check_counts` returns them.

  Raises:
    ValueError: for concrete counts that are negative, not integers or beyond int32, and traced
      arrays of a non-integer dtype.
  """
  if select.is_concrete(value):
    arr = np.asarray(value)
    if arr.dtype != object and np.issubdtype(arr.dtype, np.number) and np.any(arr < 0):
      raise ValueError(f"{name}: expected a non-negative count, got {value!r}")
    if arr.dtype != object and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{name}: expected an integer count (or an int array), got {value!r}")
  return select.check_counts(name, value)


def _check_window(window, num_positions: int) -> int:
  if isinstance(window, bool) or not isinstance(window, int) or window < 0:
    raise ValueError(f"window: expected a non-negative int, got {window!r}")
  if window > num_positions:
    raise ValueError(f"window: W={window} exceeds the number of positions T={num_positions}")
  return window


def _check_gqa(num_query_heads: int, num_kv_heads: int) -> int:
  if num_kv_heads < 1 or num_query_heads % num_kv_heads:
    raise ValueError(
      f"num_kv_heads: Hq={num_query_heads} query heads is not a multiple of "
      f"G={num_kv_heads} KV heads"
    )
  return num_query_heads // num_kv_heads


# --------------------------------------------------------------------------- window-row reductions


def sum_rows(x: Array) -> Array:
  """Sums the window-row axis of ``[..., W, T]`` as a tree of adds over static row slices.

  The result is ``x.sum(-2)`` up to the order of float additions (within 1e-6 relative here).

  Why: XLA:CPU fuses a reduction over a non-minor axis badly when its input is a slice
  (``attn[..., -w:, :-w]``, every window-row reader): 118 ms for SnapKV's votes of
  ``[32, 32, 8, 8184]`` against 11 ms for the adds, which fuse into one loop.

  Args:
    x: array ``[..., W, T]`` with ``W >= 1``.

  Returns:
    The row sums ``[..., T]``.
  """
  while x.shape[-2] > 1:
    n = x.shape[-2]
    half = lax.slice_in_dim(x, 0, n // 2, axis=x.ndim - 2) + lax.slice_in_dim(
      x, n // 2, 2 * (n // 2), axis=x.ndim - 2
    )
    if n % 2:  # the odd row joins the next level
      half = jnp.concatenate([half, lax.slice_in_dim(x, n - 1, n, axis=x.ndim - 2)], axis=-2)
    x = half
  return x[..., 0, :]


def mean_rows(x: Array) -> Array:
  """Averages the window-row axis of ``[..., W, T]`` (``x.mean(-2)``) by :func:`sum_rows`.

  Args:
    x: array ``[..., W, T]`` with ``W >= 1``.

  Returns:
    The row means ``[..., T]``.
  """
  return sum_rows(x) / x.shape[-2]


def var_rows(x: Array, ddof: int = 0) -> Array:
  """Computes the variance over the window-row axis of ``[..., W, T]`` by :func:`sum_rows`.

  ``x.var(-2, ddof=ddof)``, two-pass, as numpy and torch compute it.

  Args:
    x: array ``[..., W, T]`` with ``W >= 1``.
    ddof: delta degrees of freedom: the sum of squared deviations is divided by ``W - ddof``.

  Returns:
    The row variances ``[..., T]``.
  """
  centred = x - mean_rows(x)[..., None, :]
  return sum_rows(centred * centred) / (x.shape[-2] - ddof)


# --------------------------------------------------------------------------- evidence


def _grouped_logits(queries_LHWD: Array, keys_LGTD: Array, scale: float) -> Array:
  """fp32 logits [L, Hq, W, T]; query head h reads KV head ``h // (Hq // G)`` (HF ``repeat_kv``)."""
  L, Hq, W, D = queries_LHWD.shape
  G = keys_LGTD.shape[1]
  q_LGRWD = queries_LHWD.astype(jnp.float32).reshape(L, G, Hq // G, W, D)
  logits = jnp.einsum(
    "lgrwd,lgtd->lgrwt", q_LGRWD, keys_LGTD.astype(jnp.float32), precision=PRECISION
  )
  return (logits * scale).reshape(L, Hq, W, -1)


def _check_qk(queries, keys, q_name="queries", k_name="keys"):
  _check_array(q_name, queries, 4, "LHWD")
  _check_array(k_name, keys, 4, "LGTD")
  if queries.shape[0] != keys.shape[0] or queries.shape[-1] != keys.shape[-1]:
    raise ValueError(
      f"{k_name}: shape {keys.shape} does not match {q_name} {queries.shape} "
      "in layers L or head dim D"
    )
  _check_gqa(queries.shape[1], keys.shape[1])


def window_attention(queries_LHWD: Array, keys_LGTD: Array, *, scale: float | None = None) -> Array:
  """Computes the causal fp32 softmax rows of the last ``W`` queries over all ``T`` keys.

  The observation-window evidence of SnapKV / PyramidKV / Ada-KV / CAKE / TOVA
  (``softmax_fp32(Q[..., -w:, :] @ K^T / sqrt(d) + causal mask on the last w x w block)``): window
  query ``w`` sits at position ``T - W + w`` and sees keys ``<= T - W + w``. The softmax runs over
  the full key axis (window keys included), as in the references; only ``[L, Hq, W, T]`` is built,
  never ``T x T``. GQA: query head ``h`` reads KV head ``h // (Hq // G)``.

  Args:
    queries_LHWD: the last ``W`` prompt queries ``[L, Hq, W, D]``.
    keys_LGTD: the prompt's keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.
    scale: the logit scale; defaults to ``1 / sqrt(D)``.

  Returns:
    ``attn [L, Hq, W, T]``, fp32.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``; ``Hq`` not a multiple of
      ``G``; and ``W > T``.
  """
  _check_qk(queries_LHWD, keys_LGTD)
  W, D = queries_LHWD.shape[2:]
  T = keys_LGTD.shape[2]
  _check_window(W, T)
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
  return _window_attention(queries_LHWD, keys_LGTD, scale)


@functools.partial(jax.jit, static_argnames="scale")
def _window_attention(queries_LHWD, keys_LGTD, scale):
  W = queries_LHWD.shape[2]
  T = keys_LGTD.shape[2]
  logits = _grouped_logits(queries_LHWD, keys_LGTD, scale)
  visible_WT = jnp.arange(T)[None, :] <= (T - W + jnp.arange(W))[:, None]
  logits = jnp.where(jnp.broadcast_to(visible_WT, logits.shape), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


def attention_column_sums(
  queries_LHTD: Array,
  keys_LGTD: Array,
  *,
  mask: str = "causal",
  window: int = 8,
  block: int = 128,
  scale: float | None = None,
) -> Array:
  """Sums the attention each key receives over all prompt queries: ``[L, Hq, T]`` fp32.

  The H2O evidence (``attn_weights.sum over query rows``), computed in query blocks so memory
  stays ``O(T * block)`` per head. ``mask``:

  * ``"causal"``: query ``i`` sees keys ``<= i`` (official H2O, KVCache-Factory after commit
    9f9aa2e "Fix H2O causal masking", kvpress ``ObservedAttentionPress``).
  * ``"kvfactory_legacy"``: the KVCache-Factory ``H2OKVCluster`` behind the published PyramidKV
    table, whose causal mask was added only to the last ``window x window`` block, so queries
    before the window attend to *future* keys too.

  Args:
    queries_LHTD: every prompt query ``[L, Hq, T, D]``.
    keys_LGTD: the prompt's keys ``[L, G, T, D]``, one per query; ``Hq`` must be a multiple of
      ``G``.
    mask: ``"causal"`` or ``"kvfactory_legacy"`` (above).
    window: the size of ``"kvfactory_legacy"``'s causal block, an int in ``[0, T]``.
    block: queries per block, a positive int.
    scale: the logit scale; defaults to ``1 / sqrt(D)``.

  Returns:
    The column sums ``[L, Hq, T]``, fp32.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``, or keys that are not ``T``;
      ``Hq`` not a multiple of ``G``; an unknown ``mask``; a window that is not an int in
      ``[0, T]``; and a block that is not a positive int below ``2**31``.
  """
  _check_qk(queries_LHTD, keys_LGTD)
  _check_choice("mask", mask, COLUMN_SUM_MASKS)
  T, D = queries_LHTD.shape[2:]
  if keys_LGTD.shape[2] != T:
    raise ValueError(f"keys: expected T={T} keys (one per prompt query), got {keys_LGTD.shape[2]}")
  _check_window(window, T)
  if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block < select.INT32_LIMIT:
    raise ValueError(f"block: expected a positive int, got {block!r}")
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
  return _column_sums(queries_LHTD, keys_LGTD, mask, window, min(block, T), scale)


@functools.partial(jax.jit, static_argnames=("mask", "window", "block", "scale"))
def _column_sums(queries_LHTD, keys_LGTD, mask, window, block, scale):
  L, Hq, T, D = queries_LHTD.shape
  num_blocks = -(-T // block)
  pad = num_blocks * block - T
  q = jnp.pad(queries_LHTD, ((0, 0), (0, 0), (0, pad), (0, 0)))
  q_NLHbD = q.reshape(L, Hq, num_blocks, block, D).transpose(2, 0, 1, 3, 4)
  key_pos = jnp.arange(T)

  def one_block(args):
    q_LHbD, start = args
    query_pos = start + jnp.arange(block)
    visible = key_pos[None, :] <= query_pos[:, None]
    if mask == "kvfactory_legacy":
      visible = visible | (query_pos[:, None] < T - window)
    logits = _grouped_logits(q_LHbD, keys_LGTD, scale)
    logits = jnp.where(jnp.broadcast_to(visible, logits.shape), logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    real = jnp.broadcast_to((query_pos < T)[:, None], probs.shape)  # padded rows add nothing
    return jnp.where(real, probs, 0.0).sum(-2)

  starts = jnp.arange(num_blocks) * block
  return lax.map(one_block, (q_NLHbD, starts)).sum(0)


# --------------------------------------------------------------------------- score transforms


def protect(scores: Array, *, sinks=0, recent=0, length=None) -> Array:
  """Forces the first ``sinks`` and the last ``recent`` positions in by scoring them ``+inf``.

  Protected tokens count inside the budget (every reference appends the window inside
  ``max_capacity_prompt``). ``sinks``, ``recent`` and ``length`` may be ints or int arrays
  broadcastable to the rows, so they can be swept as data. Among protected positions that exceed
  a budget, the lower positions win (the select tie rule).

  Args:
    scores: scores ``[..., T]``.
    sinks: the number of initial positions protected in each row.
    recent: the number of last valid positions (those before ``length``) protected in each row.
    length: the valid prefix per row; defaults to ``T``.

  Returns:
    ``scores`` with the protected positions set to ``+inf``, same shape.

  Raises:
    ValueError: for scores without a last axis; counts that are negative, not integers or
      beyond int32 (when concrete); and a length above ``T``.
  """
  if not hasattr(scores, "ndim") or scores.ndim < 1:
    raise ValueError(f"scores: expected an array [..., T], got {scores!r}")
  T = scores.shape[-1]
  sinks, recent = check_count("sinks", sinks), check_count("recent", recent)
  if length is not None:
    length = check_count("length", length)
    if select.is_concrete(length) and np.any(np.asarray(length) > T):
      raise ValueError(f"length: {np.asarray(length).max()} exceeds T={T}")
  rows = scores.shape[:-1]

  def per_row(value):
    value = np.asarray(value, np.int32) if select.is_concrete(value) else value
    return jnp.broadcast_to(jnp.asarray(value).astype(jnp.int32), rows)[..., None]

  length = per_row(T if length is None else length)
  positions = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
  forced = (positions < per_row(sinks)) | (
    (positions >= length - per_row(recent)) & (positions < length)
  )
  return jnp.where(forced, jnp.inf, scores)


def pool1d(x: Array, kernel: int, how: str = "max") -> Array:
  """Pools over the last axis in 1-D: same length, stride 1, padding ``kernel // 2``.

  ``"max"`` pads with ``-inf`` (torch ``max_pool1d``); ``"avg"`` pads with zeros and divides by
  ``kernel`` (torch ``avg_pool1d`` with its default ``count_include_pad=True``), as SnapKV,
  PyramidKV, Ada-KV, CAKE and kvpress call them.

  Args:
    x: array ``[..., T]``.
    kernel: the window width, a positive odd int.
    how: ``"max"`` or ``"avg"``.

  Returns:
    The pooled array ``[..., T]``.

  Raises:
    ValueError: for a kernel that is not a positive odd int, and an unknown ``how``.
  """
  check_kernel(kernel)
  _check_choice("pool", how, POOLS)
  if kernel == 1:
    return x
  dims = (1,) * (x.ndim - 1) + (kernel,)
  strides = (1,) * x.ndim
  padding = ((0, 0),) * (x.ndim - 1) + ((kernel // 2, kernel // 2),)
  if how == "max":
    return lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, padding)
  return lax.reduce_window(x, 0.0, lax.add, dims, strides, padding) / kernel


def group(scores_LHT: Array, num_kv_heads: int, how: str = "mean") -> Array:
  """Reduces query-head scores ``[..., Hq, T]`` to KV-head scores ``[..., G, T]``.

  Query head ``h`` belongs to KV head ``h // (Hq // G)``. ``"mean"`` is kvpress's and Ada-KV's
  ``--gqa_func`` default; ``"max"`` and ``"sum"`` are KVCache-Factory's ``--gqa_score_agg``
  alternatives. Skip this step to keep the query-head granularity of the published tables.

  Args:
    scores_LHT: query-head scores ``[..., Hq, T]``.
    num_kv_heads: the number of KV heads ``G``; ``Hq`` must be a multiple of it.
    how: ``"mean"``, ``"max"`` or ``"sum"``.

  Returns:
    KV-head scores ``[..., G, T]``.

  Raises:
    ValueError: for an unknown ``how``, and ``Hq`` not a multiple of ``G``.
  """
  _check_choice("how", how, GROUPINGS)
  Hq, T = scores_LHT.shape[-2:]
  rep = _check_gqa(Hq, num_kv_heads)
  grouped = scores_LHT.reshape(scores_LHT.shape[:-2] + (num_kv_heads, rep, T))
  return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[how](grouped, axis=-2)


# --------------------------------------------------------------------------- scorers


def recency(num_positions: int, batch_shape: tuple[int, ...] = ()) -> Array:
  """Scores each position by its index, so that top-``b`` keeps the last ``b`` tokens.

  The sliding-window policy's scores.

  Args:
    num_positions: the number of positions ``T``.
    batch_shape: the leading shape of the rows.

  Returns:
    float32 scores ``[*batch_shape, T]``: ``0, 1, ..., T - 1`` in every row.

  Raises:
    ValueError: for a ``num_positions`` that is not an int in ``[1, 2**31)``.
  """
  if (
    isinstance(num_positions, bool)
    or not isinstance(num_positions, int)
    or not 1 <= num_positions < select.INT32_LIMIT
  ):
    raise ValueError(f"num_positions: expected a positive int below 2**31, got {num_positions!r}")
  positions = jnp.arange(num_positions, dtype=jnp.float32)
  return jnp.broadcast_to(positions, tuple(batch_shape) + (num_positions,))


def streaming(num_positions: int, batch_shape: tuple[int, ...] = (), *, sinks=4) -> Array:
  """Scores StreamingLLM's cache: ``sinks`` initial tokens plus the most recent ones.

  ``sinks=4`` is ``StartRecentKVCache``'s ``start_size`` and kvpress ``StreamingLLMPress``'s
  ``n_sink``. With a budget ``b`` the kept set is ``[0, sinks) + [T - (b - sinks), T)``, which is
  also KVCache-Factory's prefill "StreamingLLM" with ``w = B - 4``. Position re-indexing inside the
  cache (the official pos-shift) is a cache option, not a score.

  Args:
    num_positions: the number of positions ``T``.
    batch_shape: the leading shape of the rows.
    sinks: the number of initial tokens kept, an integer count ``>= 0`` (or a traced int array,
      as sweeps pass it).

  Returns:
    float32 scores ``[*batch_shape, T]``: the positions (:func:`recency`), the sinks ``+inf``.

  Raises:
    ValueError: for a ``sinks`` that is negative or not an integer (a float such as ``2.5``
      raises instead of being truncated to 2), and a ``num_positions`` :func:`recency` refuses.
  """
  sinks = check_count("sinks", sinks)
  return protect(recency(num_positions, batch_shape), sinks=sinks)


def snapkv(
  attn_LHWT: Array,
  *,
  kernel: int = 7,
  pool: str = "max",
  reduce: str = "sum",
  window: int | None = None,
) -> Array:
  """Scores SnapKV's observation-window votes (``SnapKVCluster.update_kv``), window protected.

  ``votes = attn[..., -w:, :-w].sum(-2)``: each prefix key's attention from the ``w`` window
  queries, pooled over the non-window prefix only (length ``T - w``, padding ``kernel // 2``),
  then the window keys are appended as protected (``+inf``). Defaults are the SnapKV LongBench
  configs and KVCache-Factory runs (``k=7``, maxpool, sum); the ``init_snapkv`` defaults are
  ``k=5``, avgpool; kvpress ``SnapKVPress`` uses ``reduce="mean"``, ``k=5``, avgpool, then
  :func:`group` with ``"mean"``.

  Args:
    attn_LHWT: the window attention ``[L, H, W, T]`` (:func:`window_attention`).
    kernel: the pooling width ``k``, a positive odd int.
    pool: ``"max"`` or ``"avg"``.
    reduce: ``"sum"`` or ``"mean"`` over the window rows.
    window: the window ``w``, ``1 <= w <= W``; defaults to the number of rows ``W``.

  Returns:
    fp32 scores ``[L, H, T]``, the last ``window`` positions ``+inf``.

  Raises:
    ValueError: for attention that is not a floating rank-4 array, or (when concrete) contains
      NaN or inf; a kernel that is not a positive odd int; an unknown ``pool`` or ``reduce``;
      and a window outside ``[1, W]`` or above ``T``.
  """
  _check_array("attn", attn_LHWT, 4, "LHWT")
  check_kernel(kernel)
  _check_choice("pool", pool, POOLS)
  _check_choice("reduce", reduce, REDUCES)
  W, T = attn_LHWT.shape[2:]
  window = W if window is None else window
  _check_window(window, T)
  if window < 1 or window > W:
    raise ValueError(f"window: expected 1 <= window <= W={W} observation rows, got {window}")
  return _snapkv(attn_LHWT, kernel, pool, reduce, window)


@functools.partial(jax.jit, static_argnames=("kernel", "pool", "reduce", "window"))
def _snapkv(attn_LHWT, kernel, pool, reduce, window):
  T = attn_LHWT.shape[-1]
  prefix = attn_LHWT[..., -window:, : T - window].astype(jnp.float32)
  votes = sum_rows(prefix) if reduce == "sum" else mean_rows(prefix)
  pooled = pool1d(votes, kernel, pool)
  return jnp.concatenate([pooled, jnp.full(pooled.shape[:-1] + (window,), jnp.inf)], axis=-1)


def h2o_from_column_sums(column_sums_LHT: Array, *, form: str = "causal", recent=None) -> Array:
  """Scores H2O heavy hitters from accumulated attention (see :func:`attention_column_sums`).

  ``form``:

  * ``"causal"``: accumulated attention received, last ``recent`` positions protected (official
    ``H2OKVCache_LayerWise``: ``topk(hh_score[:, :T - recent]) + last recent``). Default
    ``recent=8``, KVCache-Factory's ``w`` (so "heavy:recent" is ``(B - 8):8``).
  * ``"kvfactory_legacy"``: identical scoring, fed the legacy non-causal column sums; ``recent=8``.
  * ``"kvpress"``: ``ObservedAttentionPress``: each column sum divided by the number of queries
    that see the key (``T, T-1, ..., 1``), which removes the bias toward early tokens; no
    protection (``recent=0``).

  Args:
    column_sums_LHT: the column sums ``[L, H, T]``.
    form: ``"causal"``, ``"kvfactory_legacy"`` or ``"kvpress"`` (above).
    recent: the number of last positions protected (an int, or an int array broadcastable to the
      rows); defaults to ``form``'s (above).

  Returns:
    fp32 scores ``[L, H, T]``.

  Raises:
    ValueError: for column sums that are not a floating rank-3 array, or (when concrete) contain
      NaN or inf; an unknown ``form``; and a ``recent`` that is negative, not an integer, or (an
      int) above ``T``.
  """
  _check_array("column_sums", column_sums_LHT, 3, "LHT")
  _check_choice("form", form, H2O_FORMS)
  T = column_sums_LHT.shape[-1]
  scores = column_sums_LHT.astype(jnp.float32)
  if form == "kvpress":
    scores = scores / jnp.arange(T, 0, -1, dtype=jnp.float32)[None, None, :]
  recent = (0 if form == "kvpress" else 8) if recent is None else recent
  if isinstance(recent, int):
    _check_window(recent, T)
  return protect(scores, recent=recent)


def h2o(
  queries_LHTD: Array,
  keys_LGTD: Array,
  *,
  form: str = "causal",
  recent=None,
  block: int = 128,
) -> Array:
  """Scores H2O from the prompt's queries and keys.

  Column sums under ``form``'s mask (:func:`attention_column_sums`), then
  :func:`h2o_from_column_sums`.

  Args:
    queries_LHTD: every prompt query ``[L, Hq, T, D]``.
    keys_LGTD: the prompt's keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.
    form: ``"causal"``, ``"kvfactory_legacy"`` or ``"kvpress"``.
    recent: the number of last positions protected, an int (also the legacy mask's window);
      defaults to 8, or 0 under ``"kvpress"``.
    block: queries per block of the column sums, a positive int.

  Returns:
    fp32 scores ``[L, Hq, T]``.

  Raises:
    ValueError: for an unknown ``form``, and the inputs :func:`attention_column_sums` and
      :func:`h2o_from_column_sums` refuse.
  """
  _check_choice("form", form, H2O_FORMS)
  mask = "kvfactory_legacy" if form == "kvfactory_legacy" else "causal"
  window = 8 if recent is None else recent
  sums = attention_column_sums(queries_LHTD, keys_LGTD, mask=mask, window=window, block=block)
  return h2o_from_column_sums(sums, form=form, recent=recent)


def tova(attn_last_LHT: Array) -> Array:
  """Scores TOVA (``TOVACache.reduce``): the last query's attention row averaged over all heads.

  TOVA is a layer-wise policy: one index set serves every KV head. No sink or window protection.

  Args:
    attn_last_LHT: the last query's attention ``[L, H, T]``.

  Returns:
    fp32 scores ``[L, H, T]``, the same row for every head.

  Raises:
    ValueError: for attention that is not a floating rank-3 array, or (when concrete) contains
      NaN or inf.
  """
  _check_array("attn_last", attn_last_LHT, 3, "LHT")
  mean_L1T = attn_last_LHT.astype(jnp.float32).mean(-2, keepdims=True)
  return jnp.broadcast_to(mean_L1T, attn_last_LHT.shape)


def knorm(keys_LGTD: Array) -> Array:
  """Scores keys by their negated norm (kvpress ``KnormPress``), so low-norm keys are kept.

  The score is ``-||k||_2`` in fp32.

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys that are not a floating rank-4 array, or (when concrete) contain NaN
      or inf.
  """
  _check_array("keys", keys_LGTD, 4, "LGTD")
  return -jnp.linalg.norm(keys_LGTD.astype(jnp.float32), axis=-1)


def random(key: Array, shape: tuple[int, ...]) -> Array:
  """Draws uniform random scores (kvpress ``RandomPress``): the floor every policy must beat.

  Args:
    key: a ``jax.random`` key.
    shape: the scores' shape ``[..., T]``.

  Returns:
    float32 scores in ``[0, 1)`` of ``shape``.

  Raises:
    ValueError: for an empty shape or a dimension below 1.
  """
  if not shape or any(int(n) < 1 for n in shape):
    raise ValueError(f"shape: expected positive dimensions [..., T], got {shape!r}")
  return jax.random.uniform(key, tuple(shape), jnp.float32)


def oracle(future_attn_LHST: Array) -> Array:
  """Scores the oracle upper bound: the attention future queries actually pay, summed over them.

  For a one-shot selection this is kvpress's "optimal pruning" (top-``b`` of ``sum_t a_{t,i}``);
  with a single future row it is the per-step oracle ``R*_t(b)`` (top-``b`` of ``a_t``).

  Args:
    future_attn_LHST: the attention of the ``S`` future queries ``[L, H, S, T]``.

  Returns:
    fp32 scores ``[L, H, T]``.

  Raises:
    ValueError: for attention that is not a floating rank-4 array, or (when concrete) contains
      NaN or inf.
  """
  _check_array("future_attn", future_attn_LHST, 4, "LHST")
  return future_attn_LHST.astype(jnp.float32).sum(-2)


def cake(
  attn_LHWT: Array, *, gamma: float = 200.0, kernel: int = 5, window: int | None = None
) -> Array:
  """Scores CAKE's eviction (``CakeprefillKVCache``): the window mean plus ``gamma`` times variance.

  ``mean_q(A) + gamma * var_q(A)`` over the window queries for each prefix key,
  ``avg_pool1d(k=5)``, window protected. CAKE reduces over the GQA group with the mean afterwards
  (:func:`group`). ``var`` is torch's default unbiased variance.

  Args:
    attn_LHWT: the window attention ``[L, H, W, T]`` (:func:`window_attention`).
    gamma: the variance's weight, finite and ``>= 0``.
    kernel: the average pooling width, a positive odd int.
    window: the window ``w``, ``1 <= w <= W``; defaults to the number of rows ``W``.

  Returns:
    fp32 scores ``[L, H, T]``, the last ``window`` positions ``+inf``.

  Raises:
    ValueError: for attention that is not a floating rank-4 array, or (when concrete) contains
      NaN or inf; a kernel that is not a positive odd int; a concrete ``gamma`` that is negative
      or not finite; and a window outside ``[1, W]`` or above ``T``.
  """
  _check_array("attn", attn_LHWT, 4, "LHWT")
  check_kernel(kernel)
  if select.is_concrete(gamma) and not np.all(np.isfinite(gamma) & (np.asarray(gamma) >= 0)):
    raise ValueError(f"gamma: expected a finite weight >= 0, got {gamma!r}")
  W, T = attn_LHWT.shape[2:]
  window = W if window is None else window
  _check_window(window, T)
  if not 1 <= window <= W:
    raise ValueError(f"window: expected 1 <= window <= W={W} observation rows, got {window}")
  prefix = attn_LHWT[..., -window:, : T - window].astype(jnp.float32)
  var = var_rows(prefix, ddof=1) if window > 1 else jnp.zeros_like(prefix[..., 0, :])
  pooled = pool1d(mean_rows(prefix) + gamma * var, kernel, "avg")
  return jnp.concatenate([pooled, jnp.full(pooled.shape[:-1] + (window,), jnp.inf)], axis=-1)


# --------------------------------------------------------------------------- issue 15's methods


def _check_static_int(name: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or not value >= low:
    raise ValueError(f"{name}: expected a static int >= {low}, got {value!r}")
  if value >= select.INT32_LIMIT:
    raise ValueError(f"{name}: {value} does not fit int32; expected {name} < 2**31")
  return int(value)


def _check_ratio(name: str, value, *, high_open: bool = True) -> float:
  ok = isinstance(value, int | float | np.floating) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or not (0.0 <= value < 1.0 if high_open else value <= 1):
    bound = "[0, 1)" if high_open else "[0, 1]"
    raise ValueError(f"{name}: expected a static float in {bound}, got {value!r}")
  return float(value)


def _check_same(name: str, x, ref_name: str, ref, axes: Sequence[int]) -> None:
  if tuple(x.shape[a] for a in axes) != tuple(ref.shape[a] for a in axes):
    raise ValueError(f"{name}: shape {x.shape} does not match {ref_name} {ref.shape}")


def _check_valid(valid_T, T: int) -> Array:
  """``valid_T`` (bool ``[T]``: the row's real positions; ``None``: all of them) as an array."""
  if valid_T is None:
    return jnp.ones((T,), bool)
  if getattr(valid_T, "shape", None) != (T,):
    shape = getattr(valid_T, "shape", valid_T)
    raise ValueError(f"valid_T: expected bool [T={T}] (the row's real positions), got {shape}")
  return jnp.asarray(valid_T, bool)


def keydiff(keys_LGTD: Array, valid_T: Array | None = None) -> Array:
  """Scores KeyDiff (kvpress ``KeyDiffPress.score``): ``-cos(k_t, anchor)`` per KV head.

  ``anchor = mean_t(k_t / max(||k_t||, 1e-12))`` (``F.normalize`` then the mean over the
  prompt); the cosine is ``k . a / sqrt(max(||k||^2 ||a||^2, 1e-16))`` (torch
  ``cosine_similarity``, eps 1e-8). Keys least like the average key are kept. Attention-free, no
  protection. (The paper's block-wise iteration is kvpress ``BlockPress``, not this scorer.)

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    valid_T: bool ``[T]``, the row's real positions (a padded batch row); the anchor is their
      mean, as the unpadded prompt's. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys that are not a floating rank-4 array, or (when concrete) contain NaN or
      inf, and a ``valid_T`` that is not ``[T]``.
  """
  _check_array("keys", keys_LGTD, 4, "LGTD")
  return _keydiff(keys_LGTD, _check_valid(valid_T, keys_LGTD.shape[2]))


@jax.jit
def _keydiff(keys_LGTD, valid_T):
  k = keys_LGTD.astype(jnp.float32)
  norm = jnp.linalg.norm(k, axis=-1, keepdims=True)
  unit = jnp.where(valid_T[None, None, :, None], k / jnp.maximum(norm, 1e-12), 0.0)
  anchor = unit.sum(axis=2, keepdims=True) / jnp.maximum(valid_T.sum(), 1)
  w12 = (k * anchor).sum(-1)
  w1, w2 = (k * k).sum(-1), (anchor * anchor).sum(-1)
  return -w12 / jnp.sqrt(jnp.maximum(w1 * w2, 1e-16))


def _lag_state_scores(x_LGPRD: Array) -> Array:
  """LagKV's ``_get_states_score``: each lag chunk min/max-normalised by the next chunk, std
  over channels (unbiased, as torch), softmax over the chunk's tokens: ``[L, G, P - 1, R]``."""
  ref, v = x_LGPRD[:, :, 1:], x_LGPRD[:, :, :-1]
  low, high = ref.min(-2, keepdims=True), ref.max(-2, keepdims=True)
  span = high - low
  # kvpress divides by zero (NaN) for a channel constant over the reference chunk; that channel
  # contributes 0 here instead, so one degenerate channel cannot poison the selection.
  normed = jnp.where(span > 0, (v - low) / jnp.where(span > 0, span, 1.0), 0.0)
  return jax.nn.softmax(normed.std(-1, ddof=1), axis=-1)


def lagkv(keys_LGTD: Array, values_LGTD: Array, *, lag: int = 128, sinks: int = 4) -> Array:
  """Scores LagKV per KV head (kvpress ``LagKVPress.score``, ``cross_scoring=False``).

  The prompt after the ``sinks`` is cut into ``P = (T - sinks) // lag`` chunks of ``lag``
  tokens; each chunk but the last is scored against the next one (its lag reference) by
  :func:`_lag_state_scores` on keys and on values, averaged; the score is the token's rank
  inside its chunk divided by ``lag`` (``argsort().argsort() / lag``), so every chunk keeps its
  share. The sinks and the tail (the last full chunk plus the ``(T - sinks) % lag`` remainder)
  are protected (``+inf``; kvpress writes 1, above every rank). A prompt shorter than
  ``sinks + 2 * lag`` is not compressed by LagKV: kvpress then scores the sinks 1 and the rest
  by recency, i.e. StreamingLLM's order, which this returns. Ranks repeat across chunks, so ties
  go to the lower position (the select rule, as torch's CPU ``topk``).

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    values_LGTD: the values, ``[L, G, T, D]`` with the keys' ``L``, ``G`` and ``T``.
    lag: the chunk length, a static int ``>= 1``.
    sinks: the number of initial tokens protected, a static int ``>= 0``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys or values that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; values whose ``L``, ``G`` or ``T`` differ from the keys'; and a
      ``lag`` or ``sinks`` that is not a static int in range.
  """
  _check_array("keys", keys_LGTD, 4, "LGTD")
  _check_array("values", values_LGTD, 4, "LGTD")
  _check_same("values", values_LGTD, "keys", keys_LGTD, (0, 1, 2))
  lag = _check_static_int("lag", lag, 1)
  sinks = _check_static_int("sinks", sinks, 0)
  L, G, T, _ = keys_LGTD.shape
  if sinks + 2 * lag > T:
    return streaming(T, (L, G), sinks=min(sinks, T))
  return _lagkv(keys_LGTD, values_LGTD, lag, sinks)


@functools.partial(jax.jit, static_argnames=("lag", "sinks"))
def _lagkv(keys_LGTD, values_LGTD, lag, sinks):
  L, G, T, _ = keys_LGTD.shape
  end = sinks + ((T - sinks) // lag) * lag
  P = (end - sinks) // lag

  def chunks(x):
    x = x[:, :, sinks:end].astype(jnp.float32)
    return x.reshape(L, G, P, lag, x.shape[-1])

  score = (_lag_state_scores(chunks(keys_LGTD)) + _lag_state_scores(chunks(values_LGTD))) / 2
  rank = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1).astype(jnp.float32) / lag
  body = rank.reshape(L, G, (P - 1) * lag)
  return jnp.concatenate(
    [jnp.full((L, G, sinks), jnp.inf), body, jnp.full((L, G, T - sinks - (P - 1) * lag), jnp.inf)],
    axis=-1,
  )


def average_rope(
  inv_freq, start: int, n_future: int = 512, *, attention_scaling: float = 1.0
) -> Array:
  """Builds kvpress ``ExpectedAttentionPress.apply_avg_rope``'s matrix ``R [D, D]`` (fp32).

  The mean over positions ``start .. start + n_future - 1`` of the RoPE rotation (HF
  ``rotate_half`` layout: ``R = cos I + sin P`` with ``P = [[0, -I], [I, 0]]``), so ``R @ q`` is
  the average rotated query.

  Args:
    inv_freq: the model's ``[D / 2]`` RoPE inverse frequencies (after any rope scaling).
    start: the first future position: the prompt length ``T``.
    n_future: the number of future positions averaged.
    attention_scaling: multiplies cos and sin, as HF's rotary embedding does.

  Returns:
    The fp32 matrix ``R [D, D]``.

  Raises:
    ValueError: for frequencies that are not a finite non-empty ``[D / 2]`` vector, a ``start``
      that is not a static int ``>= 0``, and an ``n_future`` that is not a static int ``>= 1``.
  """
  inv = np.asarray(inv_freq, np.float32)
  if inv.ndim != 1 or not inv.size or not np.isfinite(inv).all():
    raise ValueError(f"inv_freq: expected finite [D / 2] frequencies, got shape {inv.shape}")
  start = _check_static_int("start", start, 0)
  n_future = _check_static_int("n_future", n_future, 1)
  return _average_rope(jnp.asarray(inv), start, n_future, float(attention_scaling))


@functools.partial(jax.jit, static_argnames=("start", "n_future", "attention_scaling"))
def _average_rope(inv, start, n_future, attention_scaling):
  half = inv.shape[0]
  positions = jnp.arange(start, start + n_future, dtype=jnp.float32)
  freqs = positions[:, None] * inv[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [n, D]
  cos, sin = jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling
  eye = jnp.eye(half, dtype=jnp.float32)
  zero = jnp.zeros((half, half), jnp.float32)
  perm = jnp.block([[zero, -eye], [eye, zero]])
  rot = cos[:, None, :] * jnp.eye(2 * half, dtype=jnp.float32)[None] + sin[:, None, :] * perm[None]
  return rot.mean(0)


def expected_query_stats(
  prerope_queries_LHTD: Array, avg_rope_DD: Array, n_sink: int = 4
) -> tuple[Array, Array]:
  """Computes ExpectedAttention's query statistics (kvpress ``get_query_statistics``).

  The pre-RoPE prompt queries after the first ``n_sink`` tokens (outliers) give the mean ``mu``
  and the covariance ``sum (q - mu)(q - mu)^T / N`` (divided by the count ``N = T - n_sink``, not
  ``N - 1``), then both are rotated by the average RoPE ``R`` (:func:`average_rope` with
  ``start = T``): ``mu R^T`` and ``R cov R^T``.

  Args:
    prerope_queries_LHTD: the pre-RoPE prompt queries ``[L, Hq, T, D]``.
    avg_rope_DD: the average RoPE ``R [D, D]`` (:func:`average_rope`).
    n_sink: the number of initial tokens left out, a static int ``>= 0`` below ``T``.

  Returns:
    ``(query_mean_LHD, query_cov_LHDD)``: fp32 ``[L, Hq, D]`` and ``[L, Hq, D, D]``.

  Raises:
    ValueError: for queries or ``R`` that are not floating arrays of rank 4 and 2, or (when
      concrete) contain NaN or inf; an ``R`` that is not ``[D, D]``; and an ``n_sink`` that is
      not a static int in ``[0, T)``.
  """
  _check_array("prerope_queries", prerope_queries_LHTD, 4, "LHTD")
  _check_array("avg_rope", avg_rope_DD, 2, "DD")
  D, T = prerope_queries_LHTD.shape[-1], prerope_queries_LHTD.shape[2]
  if avg_rope_DD.shape != (D, D):
    raise ValueError(f"avg_rope: expected shape ({D}, {D}), got {avg_rope_DD.shape}")
  n_sink = _check_static_int("n_sink", n_sink, 0)
  if n_sink >= T:
    raise ValueError(f"prerope_queries: T={T} tokens, expected more than n_sink={n_sink}")
  q = prerope_queries_LHTD[:, :, n_sink:].astype(jnp.float32)
  mu = q.mean(2)
  c = q - mu[:, :, None, :]
  cov = jnp.einsum("lhsi,lhsj->lhij", c, c, precision=PRECISION) / q.shape[2]
  rope = avg_rope_DD.astype(jnp.float32)
  mu = jnp.einsum("lhd,ed->lhe", mu, rope, precision=PRECISION)
  cov = jnp.einsum("ij,lhjk,mk->lhim", rope, cov, rope, precision=PRECISION)
  return mu, cov


def expected_attention(
  query_mean_LHD: Array,
  query_cov_LHDD: Array | None,
  keys_LGTD: Array,
  values_LGTD: Array | None,
  *,
  sinks: int = 4,
  use_covariance: bool = True,
  use_vnorm: bool = True,
  epsilon: float = 0.0,
  valid_T: Array | None = None,
) -> Array:
  """Scores expected attention (kvpress ``ExpectedAttentionPress.score``) per KV head ``[L, G, T]``.

  For the keys after the ``sinks``: ``z = mu . k / sqrt(D) + k^T cov k / (2 D)`` (the second term
  when ``use_covariance``), softmax over those positions per query head, mean over each GQA
  group, then ``(p + epsilon) * ||v||_2`` when ``use_vnorm``. The first ``sinks`` positions are
  protected (``+inf``; kvpress pads them with the max + 1).

  Args:
    query_mean_LHD: the future queries' mean ``[L, Hq, D]`` (:func:`expected_query_stats`, the
      model's future-query statistics).
    query_cov_LHDD: their covariance ``[L, Hq, D, D]`` (:func:`expected_query_stats`); may be
      ``None`` without ``use_covariance``.
    keys_LGTD: the keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.
    values_LGTD: the values ``[L, G, T, D]``; may be ``None`` without ``use_vnorm``.
    sinks: the number of initial positions protected, a static int in ``[0, T)``.
    use_covariance: adds the covariance term to ``z``.
    use_vnorm: multiplies by the value norms.
    epsilon: added to ``p`` before the value norms multiply it.
    valid_T: bool ``[T]``, the row's real positions (a padded batch row): the softmax runs over
      them only, as over the unpadded prompt, and padding scores 0. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for arrays that are not floating of the expected rank, or (when concrete)
      contain NaN or inf; shapes that disagree; ``Hq`` not a multiple of ``G``; a ``sinks``
      that is not a static int in ``[0, T)``; a missing covariance (``use_covariance``) or
      missing values (``use_vnorm``); and a ``valid_T`` that is not ``[T]``.
  """
  _check_array("query_mean", query_mean_LHD, 3, "LHD")
  _check_array("keys", keys_LGTD, 4, "LGTD")
  L, Hq, D = query_mean_LHD.shape
  G, T = keys_LGTD.shape[1:3]
  if keys_LGTD.shape[0] != L or keys_LGTD.shape[-1] != D:
    raise ValueError(f"keys: shape {keys_LGTD.shape} does not match query_mean {(L, Hq, D)}")
  _check_gqa(Hq, G)
  sinks = _check_static_int("sinks", sinks, 0)
  if sinks >= T:
    raise ValueError(f"keys: T={T} tokens, expected more than sinks={sinks}")
  if use_covariance:
    if query_cov_LHDD is None:
      raise ValueError("query_cov: expected [L, Hq, D, D] when use_covariance=True, got None")
    _check_array("query_cov", query_cov_LHDD, 4, "LHDD")
    if query_cov_LHDD.shape != (L, Hq, D, D):
      raise ValueError(f"query_cov: expected shape {(L, Hq, D, D)}, got {query_cov_LHDD.shape}")
  if use_vnorm:
    if values_LGTD is None:
      raise ValueError("values: expected [L, G, T, D] when use_vnorm=True, got None")
    _check_array("values", values_LGTD, 4, "LGTD")
    _check_same("values", values_LGTD, "keys", keys_LGTD, (0, 1, 2))
  return _expected_attention(
    query_mean_LHD,
    query_cov_LHDD if use_covariance else None,
    keys_LGTD,
    values_LGTD if use_vnorm else None,
    epsilon,
    _check_valid(valid_T, T),
    sinks,
  )


@functools.partial(jax.jit, static_argnames="sinks")
def _expected_attention(
  query_mean_LHD, query_cov_LHDD, keys_LGTD, values_LGTD, epsilon, valid_T, sinks
):
  L, Hq, D = query_mean_LHD.shape
  G, T = keys_LGTD.shape[1:3]
  rep = Hq // G
  use_covariance, use_vnorm = query_cov_LHDD is not None, values_LGTD is not None
  k = jnp.repeat(keys_LGTD[:, :, sinks:].astype(jnp.float32), rep, axis=1)  # HF repeat_kv
  z = jnp.einsum("lhd,lhtd->lht", query_mean_LHD.astype(jnp.float32), k, precision=PRECISION)
  z = z / math.sqrt(D)
  if use_covariance:
    cov = query_cov_LHDD.astype(jnp.float32)
    z = z + jnp.einsum("lhti,lhij,lhtj->lht", k, cov, k, precision=PRECISION) / D / 2
  real = valid_T[None, None, sinks:]
  p = jnp.where(real, jax.nn.softmax(jnp.where(real, z, -jnp.inf), axis=-1), 0.0)
  p = p.reshape(L, G, rep, T - sinks).mean(2)
  if use_vnorm:
    vnorm = jnp.linalg.norm(values_LGTD[:, :, sinks:].astype(jnp.float32), axis=-1)
    p = (p + epsilon) * vnorm
  return jnp.concatenate([jnp.full((L, G, sinks), jnp.inf), p], axis=-1)


def group_norms(value_out_norms_LHT: Array, num_heads: int) -> Array:
  """Brings CriticalKV's ``||W_O v||_1`` to the scores' head granularity.

  Query heads as given, or the mean over each GQA group for KV-head scores (kvpress
  ``vwl1norm``).

  Args:
    value_out_norms_LHT: the norms per query head ``[L, Hq, T]``.
    num_heads: the scores' number of heads: ``Hq``, or ``G`` for KV-head scores.

  Returns:
    fp32 norms ``[L, num_heads, T]``.

  Raises:
    ValueError: for norms that are not a floating rank-3 array, or (when concrete) contain NaN
      or inf, and ``Hq`` not a multiple of ``num_heads``.
  """
  _check_array("value_out_norms", value_out_norms_LHT, 3, "LHT")
  if value_out_norms_LHT.shape[1] == num_heads:
    return value_out_norms_LHT.astype(jnp.float32)
  return group(value_out_norms_LHT.astype(jnp.float32), num_heads, "mean")


def critical(
  scores_LHT: Array, value_out_norms_LHT: Array, first_stage_LHT: Array, *, epsilon: float = 1e-4
) -> Array:
  """Scores CriticalKV's second stage (kvpress ``CriticalKVPress.score``).

  ``(s + epsilon) * ||W_O v||_1`` with the first-stage positions forced in (``+inf``; kvpress
  writes ``finfo.max``). Positions the base scorer protected (``+inf``) stay protected.

  Args:
    scores_LHT: the base scores ``[L, H, T]``.
    value_out_norms_LHT: ``||W_O v||_1`` per query head ``[L, Hq, T]``, averaged over each GQA
      group for KV-head scores (:func:`group_norms`).
    first_stage_LHT: bool ``[L, H, T]``, the base scores' top
      ``max(1, floor(first_stage_ratio * b))`` per row, chosen by the caller from the budget
      (:mod:`kvjax.policies`).
    epsilon: added to the scores before the norms multiply them.

  Returns:
    fp32 scores ``[L, H, T]``.

  Raises:
    ValueError: for scores that are not a floating ``[L, H, T]`` array; norms that are not a
      floating rank-3 array, or (when concrete) contain NaN or inf; and norms whose grouped
      shape differs from the scores'.
  """
  _check_scores_3d(scores_LHT)
  norms = group_norms(value_out_norms_LHT, scores_LHT.shape[1])
  if norms.shape != scores_LHT.shape:
    raise ValueError(
      f"value_out_norms: shape {norms.shape} does not match scores {scores_LHT.shape}"
    )
  s = scores_LHT.astype(jnp.float32)
  # +inf stays protected and -inf (padding) stays out whatever the norm (0 * inf would be NaN)
  rescaled = jnp.where(jnp.isinf(s), s, (s + epsilon) * norms)
  return jnp.where(first_stage_LHT, jnp.inf, rescaled)


def chunkkv(scores_LHT: Array, *, chunk: int = 20, valid_T: Array | None = None) -> Array:
  """Scores ChunkKV (kvpress ``ChunkKVPress.compress``): whole chunks ranked by their summed score.

  One kept set is shared by every head. Per layer the scores are summed over heads (``+inf``
  protected positions enter as the layer's largest finite score + 1, as kvpress's scorers pad
  them), each chunk of ``chunk`` tokens is scored by its mean (the partial last chunk by the mean
  of its ``T % chunk`` tokens) and the chunks are ranked (ties to the lower chunk). The returned
  order takes the best chunk, then the next, and inside a chunk the tokens by their summed
  score, so a budget that is a sum of chunk lengths keeps exactly kvpress's chunks, and any other
  budget keeps whole best chunks plus the best tokens of the next one (kvpress rounds the kept
  count to whole chunks instead: ``max(1, int(n_chunks * (1 - ratio)))`` chunks).

  Args:
    scores_LHT: the base scores ``[L, H, T]``.
    chunk: the chunk length, a static int ``>= 1``.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): chunks start at
      its first real token, as in the unpadded prompt, and the padding forms a last chunk of its
      own. ``None``: every position.

  Returns:
    fp32 order scores ``[L, H, T]`` (higher = keep). ``T < chunk`` returns ``scores_LHT`` as is,
    in fp32 (kvpress delegates to the base press).

  Raises:
    ValueError: for scores that are not a floating ``[L, H, T]`` array, a ``chunk`` that is not
      a static int ``>= 1``, and a ``valid_T`` that is not ``[T]``.
  """
  _check_scores_3d(scores_LHT)
  chunk = _check_static_int("chunk", chunk, 1)
  L, H, T = scores_LHT.shape
  if chunk > T:
    return scores_LHT.astype(jnp.float32)
  return _chunkkv(scores_LHT, _check_valid(valid_T, T), chunk)


@functools.partial(jax.jit, static_argnames="chunk")
def _chunkkv(scores_LHT, valid_T, chunk):
  L, H, T = scores_LHT.shape
  s = scores_LHT.astype(jnp.float32)
  real = valid_T[None, None, :]
  finite = jnp.where(jnp.isfinite(s) & real, s, -jnp.inf).max(axis=(1, 2), keepdims=True)
  s = jnp.where(jnp.isposinf(s), finite + 1.0, s).sum(1)  # [L, T]
  n_chunks = -(-T // chunk)  # chunk n_chunks holds the padding
  start = jnp.argmax(valid_T)  # the first real token (left padding)
  chunk_T = jnp.where(valid_T, (jnp.arange(T) - start) // chunk, n_chunks)
  sizes = jax.ops.segment_sum(valid_T.astype(jnp.float32), chunk_T, n_chunks + 1)
  sums = jax.ops.segment_sum(jnp.where(valid_T[None, :], s, 0.0).T, chunk_T, n_chunks + 1).T
  # the mean of each chunk's real tokens (a partial last chunk's own); empty chunks rank last
  sizes = sizes[None, :]
  chunk_scores = jnp.where(sizes > 0, sums / jnp.maximum(sizes, 1.0), -jnp.inf)[:, :n_chunks]
  chunk_scores = jnp.concatenate([chunk_scores, jnp.full((L, 1), -jnp.inf)], axis=1)
  chunk_rank = _ranks_desc(chunk_scores)  # 0 = best; the padding's chunk last
  # rank inside each chunk: a stable sort on (chunk, -score)
  order = jnp.lexsort((-s, jnp.broadcast_to(chunk_T, s.shape)), axis=-1)
  # ``order`` lists the real positions chunk by chunk from index 0 (every chunk but the last is
  # whole; the padding comes last), so position order[j] has inner rank j % chunk
  inner = (
    jnp.zeros_like(order)
    .at[jnp.arange(L)[:, None], order]
    .set(jnp.broadcast_to(jnp.arange(T) % chunk, order.shape))
  )
  key = (n_chunks - jnp.take_along_axis(chunk_rank, jnp.broadcast_to(chunk_T, s.shape), -1)) * chunk
  key = jnp.where(valid_T[None, :], key + (chunk - inner), -jnp.inf)  # padding is never kept
  return jnp.broadcast_to(key.astype(jnp.float32)[:, None, :], (L, H, T))


def _check_scores_3d(scores_LHT) -> None:
  if not hasattr(scores_LHT, "ndim") or scores_LHT.ndim != 3:
    raise ValueError(f"scores: expected [L, H, T], got {getattr(scores_LHT, 'shape', scores_LHT)}")
  if not jnp.issubdtype(scores_LHT.dtype, jnp.floating):
    raise ValueError(f"scores: expected a floating dtype, got {scores_LHT.dtype}")


def _ranks_desc(x_LN: Array) -> Array:
  """Rank of each entry of a row, best first, ties to the lower index (stable)."""
  order = jnp.argsort(-x_LN, axis=-1, stable=True)
  N = x_LN.shape[-1]
  return jnp.zeros_like(order).at[jnp.arange(x_LN.shape[0])[:, None], order].set(jnp.arange(N))


def qfilter(keys_LGTD: Array, qfilters_LGD: Array) -> Array:
  """Scores Q-Filters (kvpress ``QFilterPress.score``): ``-<k_t, f>`` per KV head ``[L, G, T]``.

  ``f`` is the layer's filter direction for that KV head. No protection.

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    qfilters_LGD: the filter directions ``[L, G, D]``.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for keys or filters that are not floating arrays of rank 4 and 3, or (when
      concrete) contain NaN or inf, and filters that are not ``[L, G, D]``.
  """
  _check_array("keys", keys_LGTD, 4, "LGTD")
  _check_array("qfilters", qfilters_LGD, 3, "LGD")
  L, G, _, D = keys_LGTD.shape
  if qfilters_LGD.shape != (L, G, D):
    raise ValueError(f"qfilters: expected shape {(L, G, D)}, got {qfilters_LGD.shape}")
  f = qfilters_LGD.astype(jnp.float32)
  return -jnp.einsum("lgtd,lgd->lgt", keys_LGTD.astype(jnp.float32), f, precision=PRECISION)


def duo_streaming_heads(retrieval_heads_LG: Array, head_compression_ratio: float = 0.5) -> Array:
  """Chooses DuoAttention's streaming heads ``[L, G]`` (kvpress ``DuoAttentionPress``).

  As ``post_init_from_model``: the ``round(L * G * head_compression_ratio)`` (Python's
  half-to-even round) lowest gates over all layers and heads, ties to the lower flat index
  (numpy's ``argsort``). Retrieval heads (False) keep the whole cache.

  Args:
    retrieval_heads_LG: DuoAttention's gates per layer and KV head ``[L, G]``.
    head_compression_ratio: the share of heads made streaming, a static float in ``[0, 1]``.

  Returns:
    bool ``[L, G]``, True for the streaming heads.

  Raises:
    ValueError: for gates that are not a floating rank-2 array, or (when concrete) contain NaN
      or inf, and a ratio that is not a static float in ``[0, 1]``.
  """
  _check_array("retrieval_heads", retrieval_heads_LG, 2, "LG")
  ratio = _check_ratio("head_compression_ratio", head_compression_ratio, high_open=False)
  L, G = retrieval_heads_LG.shape
  return _duo_streaming_heads(retrieval_heads_LG, round(L * G * ratio))


@functools.partial(jax.jit, static_argnames="n_pruned")
def _duo_streaming_heads(retrieval_heads_LG, n_pruned):
  L, G = retrieval_heads_LG.shape
  flat = retrieval_heads_LG.astype(jnp.float32).reshape(-1)
  rank = jnp.zeros(L * G, jnp.int32).at[jnp.argsort(flat, stable=True)].set(jnp.arange(L * G))
  return (rank < n_pruned).reshape(L, G)


def kvzip(reconstruction_attn_LGT: Array, *, sinks: int = 4) -> Array:
  """Scores KVzip (kvpress ``KVzipPress.compress_post``) from the reconstruction attention.

  The reconstruction attention (max over the "repeat the context" queries and the GQA group,
  :mod:`kvjax.model.calibrate`), with the first ``sinks`` positions protected (``+inf``; kvpress
  writes the global max + 1). The budget split across layers and heads is the policy's
  (:mod:`kvjax.policies`, ``kvzip``).

  Args:
    reconstruction_attn_LGT: the reconstruction attention ``[L, G, T]``.
    sinks: the number of initial positions protected.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for attention that is not a floating rank-3 array, or (when concrete) contains
      NaN or inf, and a ``sinks`` that is negative, not an integer or beyond int32.
  """
  _check_array("reconstruction_attn", reconstruction_attn_LGT, 3, "LGT")
  sinks = check_count("sinks", sinks)
  return protect(reconstruction_attn_LGT.astype(jnp.float32), sinks=sinks)


def think_channel_scores(window_queries_LHWD: Array, keys_LGTD: Array) -> Array:
  """Scores ThinK's key channels (kvpress ``ThinKPress.compress``): ``[L, G, D]`` fp32.

  ``mean_w(q^2)`` of the last ``W`` post-RoPE prompt queries (kvpress ``window_size=32``),
  averaged over each GQA group, times ``mean_t(k^2)`` of the keys (the cached keys the channels
  are pruned from; in ``ComposedPress([press, ThinKPress])`` those the sequence press kept).

  Args:
    window_queries_LHWD: the last ``W`` post-RoPE prompt queries ``[L, Hq, W, D]``.
    keys_LGTD: the cached keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.

  Returns:
    fp32 channel scores ``[L, G, D]``.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``; and ``Hq`` not a multiple of
      ``G``.
  """
  _check_qk(window_queries_LHWD, keys_LGTD, "window_queries")
  L, Hq, _, D = window_queries_LHWD.shape
  G = keys_LGTD.shape[1]
  q2 = jnp.square(window_queries_LHWD.astype(jnp.float32)).mean(2)
  q2 = q2.reshape(L, G, Hq // G, D).mean(2)
  return q2 * jnp.square(keys_LGTD.astype(jnp.float32)).mean(2)


def think_channel_mask(channel_scores_LGD: Array, channel_ratio: float) -> Array:
  """Chooses ThinK's kept key channels: bool ``[L, G, D]``.

  The ``int(D * channel_ratio)`` lowest-scoring channels of each KV head are pruned (kvpress
  ``key_scores.topk(n_pruned, largest=False)``), ties pruning the lower channel. Keys keep
  ``D - int(D * channel_ratio)`` channels (kvpress zeroes the others; the cache may drop them).

  Args:
    channel_scores_LGD: the channel scores ``[L, G, D]`` (:func:`think_channel_scores`).
    channel_ratio: the share of channels pruned, a static float in ``[0, 1)``.

  Returns:
    bool ``[L, G, D]``, True for the kept channels.

  Raises:
    ValueError: for scores that are not a floating rank-3 array, or (when concrete) contain NaN
      or inf, and a ratio that is not a static float in ``[0, 1)``.
  """
  _check_array("channel_scores", channel_scores_LGD, 3, "LGD")
  ratio = _check_ratio("channel_ratio", channel_ratio)
  n_pruned = int(channel_scores_LGD.shape[-1] * ratio)
  pruned = select.keep_mask(-channel_scores_LGD.astype(jnp.float32), jnp.int32(n_pruned))
  return ~pruned


def key_similarity_redundancy(
  keys_LGTD: Array, *, threshold: float = 0.5, valid_T: Array | None = None
) -> Array:
  """Scores R-KV's redundancy (official ``cal_similarity``, ``retain_direction="last"``).

  Cosine similarity between the keys (``k / (||k|| + 1e-8)``), diagonal zeroed; in each row
  ``i`` the last key ``j`` with similarity above ``threshold`` is exempted (its entry zeroed;
  with no such key, entry ``j = 0`` is zeroed, as upstream); then the mean over rows, softmax
  over the keys.

  Args:
    keys_LGTD: the keys ``[L, G, T, D]``.
    threshold: the cosine similarity above which a key can be a row's exempted key.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): padding takes no
      part (its rows and columns are dropped, upstream's ``j = 0`` is the first real key), so a
      padded row scores its keys as the unpadded prompt does. ``None``: every position.

  Returns:
    fp32 redundancy ``[L, G, T]`` (higher = more redundant); padding scores 0.

  Raises:
    ValueError: for keys that are not a floating rank-4 array, or (when concrete) contain NaN or
      inf, and a ``valid_T`` that is not ``[T]``.
  """
  _check_array("keys", keys_LGTD, 4, "LGTD")
  return _key_similarity_redundancy(keys_LGTD, threshold, _check_valid(valid_T, keys_LGTD.shape[2]))


@jax.jit
def _key_similarity_redundancy(keys_LGTD, threshold, valid_T):
  start = jnp.argmax(valid_T)  # the first real key

  def one_layer(keys_GTD):  # one [G, T, T] similarity at a time, as upstream (per layer)
    k = keys_GTD.astype(jnp.float32)
    k = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    cos = jnp.einsum("gid,gjd->gij", k, k, precision=PRECISION)
    T = cos.shape[-1]
    pair = valid_T[:, None] & valid_T[None, :]
    cos = jnp.where((jnp.eye(T, dtype=bool) | ~pair)[None], 0.0, cos)
    column = lax.broadcasted_iota(jnp.int32, cos.shape, 2)
    last = jnp.max(jnp.where(cos > threshold, column, start), axis=-1)  # [G, T]
    cos = jnp.where(column == last[..., None], 0.0, cos)
    mean = cos.sum(-2) / jnp.maximum(valid_T.sum(), 1)
    return jax.nn.softmax(jnp.where(valid_T[None, :], mean, -jnp.inf), axis=-1)

  return lax.map(one_layer, keys_LGTD)


def rkv(
  window_queries_LHWD: Array,
  keys_LGTD: Array,
  *,
  window: int = 8,
  kernel: int = 7,
  mix_lambda: float = 0.07,
  threshold: float = 0.5,
  valid_T: Array | None = None,
) -> Array:
  """Scores R-KV: ``lambda * importance - (1 - lambda) * redundancy``, ``[L, G, T]``.

  The reference is arXiv 2505.24133 (official ``rkv/compression/r1_kv.py``, ported verbatim in
  ``FlashInfer/rkv/algo.py``). Importance: the logits of the last ``window`` queries (max over
  each GQA group, before the softmax), softmax over the prefix keys ``[0, T - window)`` only,
  mean over the window queries, ``max_pool1d(kernel, padding kernel // 2)``. Redundancy:
  :func:`key_similarity_redundancy` over all ``T`` keys, restricted to the prefix. The last
  ``window`` positions are protected (upstream keeps them on top of the ``budget - window``
  best). Upstream re-compresses every 128 generated tokens (``divide_length``), which the
  registry's ``decode_every`` carries.

  Args:
    window_queries_LHWD: the last ``W`` prompt queries ``[L, Hq, W, D]``.
    keys_LGTD: the keys ``[L, G, T, D]``; ``Hq`` must be a multiple of ``G``.
    window: the number of last queries read and of last positions protected, a static int with
      ``window <= W`` and ``window < T``; default 8.
    kernel: the max pooling width, a positive odd int; default 7.
    mix_lambda: the importance's weight ``lambda``; default 0.07.
    threshold: the similarity threshold of :func:`key_similarity_redundancy`; default 0.5.
    valid_T: bool ``[T]``, the row's real positions (a left-padded batch row): padding takes no
      part in either term and scores 0. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``, the last ``window`` positions ``+inf``.

  Raises:
    ValueError: for queries or keys that are not floating rank-4 arrays, or (when concrete)
      contain NaN or inf; shapes that disagree in ``L`` or ``D``; ``Hq`` not a multiple of
      ``G``; a kernel that is not a positive odd int; a window that is not a static int in
      ``[1, min(W, T - 1)]``; and a ``valid_T`` that is not ``[T]``.
  """
  _check_qk(window_queries_LHWD, keys_LGTD, "window_queries")
  check_kernel(kernel)
  L, Hq, W, D = window_queries_LHWD.shape
  G, T = keys_LGTD.shape[1:3]
  window = _check_static_int("window", window, 1)
  if window > W or window >= T:
    raise ValueError(
      f"window: {window} needs window <= W={W} observation queries and window < T={T} keys"
    )
  valid = _check_valid(valid_T, T)
  return _rkv(window_queries_LHWD, keys_LGTD, valid, mix_lambda, threshold, window, kernel)


@functools.partial(jax.jit, static_argnames=("window", "kernel"))
def _rkv(window_queries_LHWD, keys_LGTD, valid_T, mix_lambda, threshold, window, kernel):
  L, Hq, W, D = window_queries_LHWD.shape
  G, T = keys_LGTD.shape[1:3]
  q = window_queries_LHWD[:, :, W - window :].astype(jnp.float32).reshape(L, G, Hq // G, window, D)
  k = keys_LGTD[:, :, : T - window].astype(jnp.float32)
  logits = jnp.einsum("lgrwd,lgtd->lgrwt", q, k, precision=PRECISION) / math.sqrt(D)
  # left padding: the window is the row's last real tokens
  prefix = valid_T[None, None, None, : T - window]
  logits = jnp.where(prefix, logits.max(2), -jnp.inf)
  attn = jnp.where(prefix, jax.nn.softmax(logits, axis=-1), 0.0).mean(-2)  # [L, G, T - window]
  importance = pool1d(attn, kernel, "max")  # attention >= 0: padding's 0 never wins a max
  redundancy = _key_similarity_redundancy(keys_LGTD, threshold, valid_T)[..., : T - window]
  body = importance * mix_lambda - redundancy * (1 - mix_lambda)
  return jnp.concatenate([body, jnp.full((L, G, window), jnp.inf)], axis=-1)
