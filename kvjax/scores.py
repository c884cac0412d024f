"""Scores: evidence -> ``scores_LHT`` (higher = keep), one pure function per method.

Each scorer follows one official implementation (``shared/reference/ALGORITHMS.md``); its
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
  """Validates a pooling kernel: a positive odd int (the references pad with ``kernel // 2``)."""
  if (
    isinstance(kernel, bool)
    or not isinstance(kernel, int)
    or not 1 <= kernel < select.INT32_LIMIT
    or kernel % 2 == 0
  ):
    raise ValueError(f"kernel: expected a positive odd integer below 2**31, got {kernel!r}")
  return kernel


def check_count(name: str, value):
  """A protection count (``sinks``, ``recent``, ``length``): an int or an int array, traced or
  concrete; when concrete, in ``[0, 2**31)``. Floats are refused (``sinks=2.5`` is not 2 sinks)."""
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
  """Causal fp32 softmax rows of the last ``W`` queries over all ``T`` keys: ``attn [L, Hq, W, T]``.

  The observation-window evidence of SnapKV / PyramidKV / Ada-KV / CAKE / TOVA
  (``softmax_fp32(Q[..., -w:, :] @ K^T / sqrt(d) + causal mask on the last w x w block)``): window
  query ``w`` sits at position ``T - W + w`` and sees keys ``<= T - W + w``. The softmax runs over
  the full key axis (window keys included), as in the references; only ``[L, Hq, W, T]`` is built,
  never ``T x T``. GQA: ``Hq`` must be a multiple of ``G``; query head ``h`` reads KV head
  ``h // (Hq // G)``. ``scale`` defaults to ``1 / sqrt(D)``.
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
  """Attention received by each key, summed over all prompt queries: ``[L, Hq, T]`` fp32.

  The H2O evidence (``attn_weights.sum over query rows``), computed in query blocks so memory
  stays ``O(T * block)`` per head. ``mask``:

  * ``"causal"``: query ``i`` sees keys ``<= i`` (official H2O, KVCache-Factory after commit
    9f9aa2e "Fix H2O causal masking", kvpress ``ObservedAttentionPress``).
  * ``"kvfactory_legacy"``: the KVCache-Factory ``H2OKVCluster`` behind the published PyramidKV
    table, whose causal mask was added only to the last ``window x window`` block, so queries
    before the window attend to *future* keys too.
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
  ``max_capacity_prompt``). ``sinks``, ``recent`` and ``length`` (valid prefix per row, default
  ``T``) may be ints or int arrays broadcastable to the rows, so they can be swept as data.
  Among protected positions that exceed a budget, the lower positions win (the select tie rule).
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
  """Same-length 1-D pooling over the last axis, stride 1, padding ``kernel // 2``.

  ``"max"`` pads with ``-inf`` (torch ``max_pool1d``); ``"avg"`` pads with zeros and divides by
  ``kernel`` (torch ``avg_pool1d`` with its default ``count_include_pad=True``), as SnapKV,
  PyramidKV, Ada-KV, CAKE and kvpress call them.
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
  """Query-head scores ``[..., Hq, T]`` -> KV-head scores ``[..., G, T]``.

  Query head ``h`` belongs to KV head ``h // (Hq // G)``. ``"mean"`` is kvpress's and Ada-KV's
  ``--gqa_func`` default; ``"max"`` and ``"sum"`` are KVCache-Factory's ``--gqa_score_agg``
  alternatives. Skip this step to keep the query-head granularity of the published tables.
  """
  _check_choice("how", how, GROUPINGS)
  Hq, T = scores_LHT.shape[-2:]
  rep = _check_gqa(Hq, num_kv_heads)
  grouped = scores_LHT.reshape(scores_LHT.shape[:-2] + (num_kv_heads, rep, T))
  return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[how](grouped, axis=-2)


# --------------------------------------------------------------------------- scorers


def recency(num_positions: int, batch_shape: tuple[int, ...] = ()) -> Array:
  """Sliding window: the score is the position itself, so top-``b`` keeps the last ``b`` tokens."""
  if (
    isinstance(num_positions, bool)
    or not isinstance(num_positions, int)
    or not 1 <= num_positions < select.INT32_LIMIT
  ):
    raise ValueError(f"num_positions: expected a positive int below 2**31, got {num_positions!r}")
  positions = jnp.arange(num_positions, dtype=jnp.float32)
  return jnp.broadcast_to(positions, tuple(batch_shape) + (num_positions,))


def streaming(num_positions: int, batch_shape: tuple[int, ...] = (), *, sinks=4) -> Array:
  """StreamingLLM: ``sinks`` initial tokens plus the most recent ones.

  ``sinks=4`` is ``StartRecentKVCache``'s ``start_size`` and kvpress ``StreamingLLMPress``'s
  ``n_sink``. With a budget ``b`` the kept set is ``[0, sinks) + [T - (b - sinks), T)``, which is
  also KVCache-Factory's prefill "StreamingLLM" with ``w = B - 4``. Position re-indexing inside the
  cache (the official pos-shift) is a cache option, not a score. ``sinks`` is an integer count
  ``>= 0`` (or a traced int array, as sweeps pass it): a float such as ``2.5`` raises
  ``ValueError`` instead of being truncated to 2.
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
  """SnapKV observation-window votes (``SnapKVCluster.update_kv``), window protected.

  ``votes = attn[..., -w:, :-w].sum(-2)``: each prefix key's attention from the ``w`` window
  queries, pooled over the non-window prefix only (length ``T - w``, padding ``kernel // 2``),
  then the window keys are appended as protected (``+inf``). Defaults are the SnapKV LongBench
  configs and KVCache-Factory runs (``k=7``, maxpool, sum); the ``init_snapkv`` defaults are
  ``k=5``, avgpool; kvpress ``SnapKVPress`` uses ``reduce="mean"``, ``k=5``, avgpool, then
  :func:`group` with ``"mean"``. ``window`` defaults to the number of rows ``W``.
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
  votes = prefix.sum(-2) if reduce == "sum" else prefix.mean(-2)
  pooled = pool1d(votes, kernel, pool)
  return jnp.concatenate([pooled, jnp.full(pooled.shape[:-1] + (window,), jnp.inf)], axis=-1)


def h2o_from_column_sums(column_sums_LHT: Array, *, form: str = "causal", recent=None) -> Array:
  """H2O heavy-hitter scores from accumulated attention (see :func:`attention_column_sums`).

  ``form``:

  * ``"causal"``: accumulated attention received, last ``recent`` positions protected (official
    ``H2OKVCache_LayerWise``: ``topk(hh_score[:, :T - recent]) + last recent``). Default
    ``recent=8``, KVCache-Factory's ``w`` (so "heavy:recent" is ``(B - 8):8``).
  * ``"kvfactory_legacy"``: identical scoring, fed the legacy non-causal column sums; ``recent=8``.
  * ``"kvpress"``: ``ObservedAttentionPress``: each column sum divided by the number of queries
    that see the key (``T, T-1, ..., 1``), which removes the bias toward early tokens; no
    protection (``recent=0``).
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
  """H2O scores from the prompt's queries and keys: column sums under ``form``'s mask, then
  :func:`h2o_from_column_sums`. ``form`` is ``"causal"``, ``"kvfactory_legacy"`` or ``"kvpress"``.
  """
  _check_choice("form", form, H2O_FORMS)
  mask = "kvfactory_legacy" if form == "kvfactory_legacy" else "causal"
  window = 8 if recent is None else recent
  sums = attention_column_sums(queries_LHTD, keys_LGTD, mask=mask, window=window, block=block)
  return h2o_from_column_sums(sums, form=form, recent=recent)


def tova(attn_last_LHT: Array) -> Array:
  """TOVA (``TOVACache.reduce``): the last query's attention row averaged over all heads.

  Returns ``[L, H, T]`` with the same row for every head: TOVA is a layer-wise policy, one index
  set serves every KV head. No sink or window protection.
  """
  _check_array("attn_last", attn_last_LHT, 3, "LHT")
  mean_L1T = attn_last_LHT.astype(jnp.float32).mean(-2, keepdims=True)
  return jnp.broadcast_to(mean_L1T, attn_last_LHT.shape)


def knorm(keys_LGTD: Array) -> Array:
  """Key norm (kvpress ``KnormPress``): ``-||k||_2`` in fp32, so low-norm keys are kept."""
  _check_array("keys", keys_LGTD, 4, "LGTD")
  return -jnp.linalg.norm(keys_LGTD.astype(jnp.float32), axis=-1)


def random(key: Array, shape: tuple[int, ...]) -> Array:
  """Uniform random scores (kvpress ``RandomPress``): the floor every policy must beat."""
  if not shape or any(int(n) < 1 for n in shape):
    raise ValueError(f"shape: expected positive dimensions [..., T], got {shape!r}")
  return jax.random.uniform(key, tuple(shape), jnp.float32)


def oracle(future_attn_LHST: Array) -> Array:
  """Oracle upper bound: the attention the future queries will actually pay, summed over them.

  For a one-shot selection this is kvpress's "optimal pruning" (top-``b`` of ``sum_t a_{t,i}``);
  with a single future row it is the per-step oracle ``R*_t(b)`` (top-``b`` of ``a_t``).
  """
  _check_array("future_attn", future_attn_LHST, 4, "LHST")
  return future_attn_LHST.astype(jnp.float32).sum(-2)


def cake(
  attn_LHWT: Array, *, gamma: float = 200.0, kernel: int = 5, window: int | None = None
) -> Array:
  """CAKE eviction score (``CakeprefillKVCache``): ``mean_q(A) + gamma * var_q(A)`` over the window
  queries for each prefix key, ``avg_pool1d(k=5)``, window protected. CAKE reduces over the GQA
  group with the mean afterwards (:func:`group`). ``var`` is torch's default unbiased variance.
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
  var = prefix.var(-2, ddof=1) if window > 1 else jnp.zeros_like(prefix[..., 0, :])
  pooled = pool1d(prefix.mean(-2) + gamma * var, kernel, "avg")
  return jnp.concatenate([pooled, jnp.full(pooled.shape[:-1] + (window,), jnp.inf)], axis=-1)
