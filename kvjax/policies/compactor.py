"""Compactor: leverage scores blended with non-causal attention (kvpress ``CompactorPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.leverage import check_sketch_dimension, leverage_zscores, sketch_of
from kvjax.policies.noncausal import aligned, check_heads, noncausal_zscores

Array = jax.Array


def _compactor_scores(
  prerope_keys_LGTD: Array,
  q_LHTD: Array,
  k_LGTD: Array,
  v_LGTD: Array,
  sketch_LGDK: Array,
  n: Array,
  *,
  sinks: int,
  recent: int,
  chunk: int,
  blending,
) -> Array:
  """kvpress ``CompactorPress.score`` on the first ``n`` positions.

  The first ``min(sinks, n)`` and the last ``min(recent, n - that)`` positions are protected
  (``+inf``); the positions between them are scored alone, as a sequence of their own:
  ``blending * leverage + non-causal attention`` (each z-scored over that middle part).

  Args:
    prerope_keys_LGTD: pre-RoPE keys ``[L, G, T, D]``.
    q_LHTD: post-RoPE queries ``[L, Hq, T, D]``.
    k_LGTD: post-RoPE keys ``[L, G, T, D]``.
    v_LGTD: values ``[L, G, T, D]``.
    sketch_LGDK: standard normal draws ``[L, G or 1, D, k]``.
    n: the real positions (the first ``n``), an int (traced or not).
    sinks: protected first positions.
    recent: protected last positions.
    chunk: the non-causal attention's chunk size.
    blending: the leverage scores' weight (a float, or traced).

  Returns:
    fp32 scores ``[L, G, T]``.
  """
  T = k_LGTD.shape[2]
  left = jnp.minimum(sinks, n)
  right = jnp.minimum(recent, jnp.maximum(0, n - left))
  m = n - left - right
  shift = lambda x: jnp.roll(x, -left, axis=-2)  # noqa: E731
  pk, q, k, v = (shift(x) for x in (prerope_keys_LGTD, q_LHTD, k_LGTD, v_LGTD))
  middle_T = jnp.arange(T) < m
  lev = leverage_zscores(pk, sketch_LGDK, middle_T)
  attn = noncausal_zscores(q, k, v, chunk, m)
  s = jnp.roll(blending * lev + attn, left, axis=-1)
  t = jnp.arange(T)
  protected = (t < left) | ((t >= n - right) & (t < n))
  return jnp.where(protected[None, None], jnp.inf, s).astype(jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compactor(Policy):
  """Compactor: z-scored leverage of the pre-RoPE keys, blended into non-causal attention.

  Paper: Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
  Approximate Leverage Scores" (arXiv:2507.08143). Reference: kvpress 0.5.5
  ``presses/compactor_press.py::CompactorPress`` (composed of ``LeverageScorePress`` and
  ``NonCausalAttnPress``: :class:`~kvjax.policies.leverage.LeverageScore`,
  :class:`~kvjax.policies.noncausal.NonCausalAttention`). The first ``sinks`` and the last
  ``recent`` prompt positions are protected; the positions between them are scored as a
  sequence of their own (its own centring, sketch, chunks and z-scores):
  ``blending * leverage_z + noncausal_attention_z``. Scores are per KV head ``[L, G, T]``.
  It reads ``evidence.prerope_keys_LGTD``, ``queries_LHTD``, ``keys_LGTD``, ``values_LGTD`` and,
  when given, ``sketch_LGDK``.

  Differences from kvpress:

  * ``blending``: kvpress's default ``None`` means ``compression_ratio`` (a prefill ratio known
    to the press); a kvjax score does not depend on the budget, so ``blending`` is a number,
    default 0.5 (kvpress's value at compression_ratio 0.5); set it to the ratio you run at to
    follow kvpress at other ratios.
  * protection: kvpress pads the protected positions with the layer's largest score (a tie with
    the best middle position); kvjax scores them ``+inf``.
  * the sketch, the jitter's failure and the z-scores over one prompt: as
    :class:`~kvjax.policies.leverage.LeverageScore` and
    :class:`~kvjax.policies.noncausal.NonCausalAttention`.

  Attributes:
    sinks: protected first positions (kvpress ``sink_size_start``, 8).
    recent: protected last positions (kvpress ``sink_size_end``, 4).
    chunk_size: the non-causal attention's chunk length (256).
    sketch_dimension: the leverage sketch's width (48).
    blending: the leverage scores' weight (0.5).
    seed: the seed of the sketch drawn when the evidence carries none.
  """

  needs: ClassVar[frozenset[str]] = frozenset(
    {"prerope_keys_LGTD", "queries_LHTD", "keys_LGTD", "values_LGTD"}
  )
  sinks: int = 8
  recent: int = 4
  chunk_size: int = 256
  sketch_dimension: int = 48
  blending: float = 0.5
  seed: int = 0

  def __post_init__(self):
    super().__post_init__()
    check_int("sinks", self.sinks, 0)
    check_int("recent", self.recent, 0)
    check_int("chunk_size", self.chunk_size, 1)
    check_sketch_dimension(self.sketch_dimension)
    budgets_lib.check_real("blending", self.blending, low=0.0)
    check_int("seed", self.seed, 0)

  def score(self, evidence):
    """Protected sinks and recent tokens, ``blending * leverage + attention`` between them."""
    name = self.label
    pk = evidence.need("prerope_keys_LGTD", name)
    q = evidence.need("queries_LHTD", name)
    k = evidence.need("keys_LGTD", name)
    v = evidence.need("values_LGTD", name)
    check_heads(q, k, name)
    L, G, T, D = k.shape
    sketch = sketch_of(evidence, self.seed, (L, G, D, self.sketch_dimension), name)

    def fn(n, pk, q, k, v):
      return _compactor_scores(
        pk,
        q,
        k,
        v,
        sketch,
        n,
        sinks=self.sinks,
        recent=self.recent,
        chunk=self.chunk_size,
        blending=self.blending,
      )

    return aligned(fn, evidence.valid_T, T, pk, q, k, v)
