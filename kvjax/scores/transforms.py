"""Score transforms: protection (:func:`protect`, ``+inf``), pooling over positions
(:func:`pool1d`) and the reduction of query heads to KV heads (:func:`group`), with the checks
of their kernel and counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax import checks

Array = jax.Array

POOLS = ("max", "avg")
GROUPINGS = ("mean", "max", "sum")


def check_kernel(kernel) -> int:
  """Validates a pooling kernel: a positive odd int (the references pad with ``kernel // 2``).

  Args:
    kernel: the pooling width.

  Returns:
    ``kernel`` as a Python ``int``.

  Raises:
    ValueError: for a bool, a value that is not a Python or numpy integer, an even kernel, or one
      outside ``[1, 2**31)``.
  """
  if not checks.is_int(kernel) or not 1 <= kernel < checks.INT32_LIMIT or kernel % 2 == 0:
    raise ValueError(f"kernel: expected a positive odd integer below 2**31, got {kernel!r}")
  return int(kernel)


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
  if checks.is_concrete(value):
    arr = np.asarray(value)
    if arr.dtype != object and np.issubdtype(arr.dtype, np.number) and np.any(arr < 0):
      raise ValueError(f"{name}: expected a non-negative count, got {value!r}")
    if arr.dtype != object and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{name}: expected an integer count (or an int array), got {value!r}")
  return checks.counts(name, value)


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
    if checks.is_concrete(length) and np.any(np.asarray(length) > T):
      raise ValueError(f"length: {np.asarray(length).max()} exceeds T={T}")
  rows = scores.shape[:-1]

  def per_row(value):
    value = np.asarray(value, np.int32) if checks.is_concrete(value) else value
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
  kernel = check_kernel(kernel)
  checks.choice("pool", how, POOLS)
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
  checks.choice("how", how, GROUPINGS)
  Hq, T = scores_LHT.shape[-2:]
  rep = checks.gqa(Hq, num_kv_heads)
  grouped = scores_LHT.reshape(scores_LHT.shape[:-2] + (num_kv_heads, rep, T))
  return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[how](grouped, axis=-2)
