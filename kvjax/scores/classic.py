"""The scorers of the window and heavy-hitter methods and of the baselines: recency,
StreamingLLM, SnapKV, H2O, TOVA, K-norm, random, the oracle and CAKE."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks
from kvjax.scores.attention import attention_column_sums, mean_rows, sum_rows, var_rows
from kvjax.scores.transforms import POOLS, check_count, check_kernel, pool1d, protect

Array = jax.Array

REDUCES = ("sum", "mean")
H2O_FORMS = ("causal", "kvfactory_legacy", "kvpress")


def recency(num_positions: int, batch_shape: tuple[int, ...] = ()) -> Array:
  """Scores each position by its index, so that top-``b`` keeps the last ``b`` tokens.

  The sliding-window policy's scores.

  Args:
    num_positions: the number of positions ``T``.
    batch_shape: the leading shape of the rows.

  Returns:
    float32 scores ``[*batch_shape, T]``: ``0, 1, ..., T - 1`` in every row.

  Raises:
    ValueError: for a ``num_positions`` that is not a static int in ``[1, 2**31)``.
  """
  num_positions = checks.static_int("num_positions", num_positions, 1)
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
  checks.float_array("attn", attn_LHWT, 4, "LHWT")
  kernel = check_kernel(kernel)
  checks.choice("pool", pool, POOLS)
  checks.choice("reduce", reduce, REDUCES)
  window = _observation_window(attn_LHWT, window)
  return _snapkv(attn_LHWT, kernel, pool, reduce, window)


@functools.partial(jax.jit, static_argnames=("kernel", "pool", "reduce", "window"))
def _snapkv(attn_LHWT, kernel, pool, reduce, window):
  prefix = _window_prefix(attn_LHWT, window)
  votes = sum_rows(prefix) if reduce == "sum" else mean_rows(prefix)
  return _with_window(pool1d(votes, kernel, pool), window)


def _observation_window(attn_LHWT: Array, window) -> int:
  """The window ``w`` of a window-row scorer: ``W`` by default, in ``[1, W]`` and ``<= T``."""
  W, T = attn_LHWT.shape[2:]
  window = checks.window(W if window is None else window, T)
  if not 1 <= window <= W:
    raise ValueError(f"window: expected 1 <= window <= W={W} observation rows, got {window}")
  return window


def _window_prefix(attn_LHWT: Array, window: int) -> Array:
  """The last ``window`` rows over the prefix keys ``[0, T - window)``, fp32."""
  T = attn_LHWT.shape[-1]
  return attn_LHWT[..., -window:, : T - window].astype(jnp.float32)


def _with_window(pooled: Array, window: int) -> Array:
  """Prefix scores ``[..., T - w]`` with the ``w`` window positions appended as ``+inf``."""
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
  checks.float_array("column_sums", column_sums_LHT, 3, "LHT")
  checks.choice("form", form, H2O_FORMS)
  T = column_sums_LHT.shape[-1]
  scores = column_sums_LHT.astype(jnp.float32)
  if form == "kvpress":
    scores = scores / jnp.arange(T, 0, -1, dtype=jnp.float32)[None, None, :]
  recent = (0 if form == "kvpress" else 8) if recent is None else recent
  if isinstance(recent, int | np.integer):  # a static count (bools too: the check refuses them)
    recent = checks.window(recent, T)
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
  checks.choice("form", form, H2O_FORMS)
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
  checks.float_array("attn_last", attn_last_LHT, 3, "LHT")
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
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
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
  checks.float_array("future_attn", future_attn_LHST, 4, "LHST")
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
  checks.float_array("attn", attn_LHWT, 4, "LHWT")
  kernel = check_kernel(kernel)
  if checks.is_concrete(gamma) and not np.all(np.isfinite(gamma) & (np.asarray(gamma) >= 0)):
    raise ValueError(f"gamma: expected a finite weight >= 0, got {gamma!r}")
  window = _observation_window(attn_LHWT, window)
  prefix = _window_prefix(attn_LHWT, window)
  var = var_rows(prefix, ddof=1) if window > 1 else jnp.zeros_like(prefix[..., 0, :])
  return _with_window(pool1d(mean_rows(prefix) + gamma * var, kernel, "avg"), window)
