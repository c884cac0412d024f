"""The evidence of window-row scorers: the window attention, the attention column sums (H2O), and
reductions over the window rows; :data:`PRECISION`, the precision of every kvjax matmul."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import checks

Array = jax.Array

# Every kvjax matmul (evidence, scores, the model) asks for full fp32 precision: TPUs otherwise
# compute fp32 matmuls in bf16 passes and Ampere/Hopper GPUs in TF32, which moves attention
# scores, breaks near-ties and the parity with the PyTorch references. bf16 operands run at
# native speed whatever this says.
PRECISION = lax.Precision.HIGHEST

COLUMN_SUM_MASKS = ("causal", "kvfactory_legacy")


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
  checks.queries_keys(queries_LHWD, keys_LGTD)
  W, D = queries_LHWD.shape[2:]
  T = keys_LGTD.shape[2]
  checks.window(W, T)
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
  checks.queries_keys(queries_LHTD, keys_LGTD)
  checks.choice("mask", mask, COLUMN_SUM_MASKS)
  T, D = queries_LHTD.shape[2:]
  if keys_LGTD.shape[2] != T:
    raise ValueError(f"keys: expected T={T} keys (one per prompt query), got {keys_LGTD.shape[2]}")
  window = checks.window(window, T)
  block = checks.static_int("block", block, 1)
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
