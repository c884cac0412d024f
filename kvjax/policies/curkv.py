"""CurDKV: key and value leverage approximated by squared norms (kvpress ``CURPress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies.checks import check_bool, check_choice, check_int
from kvjax.policies.core import Policy
from kvjax.policies.leverage import HIGHEST, sketch_of
from kvjax.policies.noncausal import aligned

Array = jax.Array

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
PROJECTION = 20  # kvpress CURPress's random projection width r


def local_normalised(x_LGT: Array, window: int, n: Array) -> Array:
  """Divides each value by the sum of its window of ``window`` positions.

  Windows start at position 0; the positions ``>= n`` count as 0 (kvpress's zero padding).

  Args:
    x_LGT: the values ``[L, G, T]``.
    window: the window's length in positions.
    n: the row's real positions (traced int).

  Returns:
    fp32 ``[L, G, T]``: the locally normalised values, 0 at positions ``>= n``.
  """
  L, G, T = x_LGT.shape
  real_T = jnp.arange(T) < n
  chunks = -(-T // window)
  x = jnp.pad(jnp.where(real_T[None, None], x_LGT, 0.0), ((0, 0), (0, 0), (0, chunks * window - T)))
  x = x.reshape(L, G, chunks, window)
  total = x.sum(-1, keepdims=True)
  out = (x / jnp.where(total > 0, total, 1.0)).reshape(L, G, -1)[..., :T]
  return jnp.where(real_T[None, None], out, 0.0)


def cur_scores(
  keys_LGTD: Array,
  values_LGTD: Array,
  n: Array,
  *,
  sinks: int,
  leverage_type: str,
  local_window: int | None,
  sketch_LGDK: Array | None = None,
) -> Array:
  """kvpress ``CURPress.score`` on the first ``n`` positions.

  ``k2 = ||k||^2`` and ``v2 = ||v||^2`` (after the projection ``x @ (sketch / sqrt(r))`` when a
  sketch is given), each normalised within windows of ``local_window`` positions (``None``:
  not), combined by ``leverage_type`` (``k2``, ``v2``, ``(k2 + v2) / 2`` or ``k2 * v2``),
  normalised to sum 1 over the positions; the first ``sinks`` positions are ``+inf``.

  Args:
    keys_LGTD: post-RoPE keys ``[L, G, T, D]``.
    values_LGTD: values ``[L, G, T, D]``.
    n: the real positions (the first ``n``), an int (traced or not).
    sinks: protected first positions.
    leverage_type: one of :data:`LEVERAGE_TYPES`.
    local_window: the normalisation window, or ``None``.
    sketch_LGDK: standard normal draws ``[L, G or 1, D, r]``, or ``None`` (no projection).

  Returns:
    fp32 scores ``[L, G, T]`` (0 at positions ``>= n``, but for protected sinks).
  """
  k = keys_LGTD.astype(jnp.float32)
  v = values_LGTD.astype(jnp.float32)
  if sketch_LGDK is not None:
    g = sketch_LGDK / math.sqrt(sketch_LGDK.shape[-1])
    k, v = jnp.matmul(k, g, precision=HIGHEST), jnp.matmul(v, g, precision=HIGHEST)
  T = k.shape[2]
  real_T = jnp.arange(T) < n
  k2 = jnp.where(real_T[None, None], (k * k).sum(-1), 0.0)
  v2 = jnp.where(real_T[None, None], (v * v).sum(-1), 0.0)
  if local_window is not None:
    k2, v2 = local_normalised(k2, local_window, n), local_normalised(v2, local_window, n)
  s = {
    "key": lambda: k2,
    "value": lambda: v2,
    "kv_avg": lambda: (k2 + v2) / 2,
    "kv_product": lambda: k2 * v2,
  }[leverage_type]()
  total = s.sum(-1, keepdims=True)
  s = s / jnp.where(total > 0, total, 1.0)
  return jnp.where((jnp.arange(T) < sinks)[None, None], jnp.inf, s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurDKV(Policy):
  """CurDKV: key and value leverage approximated by locally normalised squared norms.

  Paper: "CurDKV: Value-Guided KV Compression for LLMs via Approximated CUR Decomposition"
  (arXiv:2509.15038). Reference: kvpress 0.5.5 ``presses/cur_press.py::CURPress``. Per KV head,
  ``k2 = ||k||^2`` of the post-RoPE keys and ``v2 = ||v||^2``, optionally after a random
  projection ``x @ G`` with ``G = N(0, 1) / sqrt(20)`` ``[D, 20]`` per layer, shared by the
  layer's heads, keys and values (``random_projection``); each normalised within windows of
  ``local_window`` positions (``use_local_approximation``), combined by ``leverage_type``
  (``k2 * v2`` by default), normalised to sum 1 over the prompt; the first ``sinks`` positions
  are protected. Scores are per KV head ``[L, G, T]``.

  Differences from kvpress:

  * the projection's draws: kvpress calls ``torch.randn`` inside ``score``; kvjax reads
    ``evidence.sketch_LGDK`` (``[L, 1, D, 20]``, the raw N(0, 1) values) when given, else draws
    them from ``jax.random.key(seed)``. The golden test feeds kvpress's recorded draws.
  * protection: kvpress writes 1.0 for the sinks (at least any other normalised score, a tie
    only if one position holds all the mass); kvjax ``+inf``.
  * a padded row (``valid_T``) is scored as its unpadded prompt: windows count from its first
    real token.

  Attributes:
    sinks: protected first positions (kvpress ``num_sinks``, 4).
    leverage_type: ``"key"``, ``"value"``, ``"kv_avg"`` or ``"kv_product"`` (the default).
    random_projection: project keys and values on 20 random directions first (kvpress
      ``use_random_leverage``, False).
    use_local_approximation: normalise within windows (kvpress default True).
    local_window: the window (kvpress ``local_window_size``, 16).
    seed: the seed of the projection drawn when the evidence carries none.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"keys_LGTD", "values_LGTD"})
  sinks: int = 4
  leverage_type: str = "kv_product"
  random_projection: bool = False
  use_local_approximation: bool = True
  local_window: int = 16
  seed: int = 0

  def __post_init__(self):
    super().__post_init__()
    check_int("sinks", self.sinks, 0)
    check_choice("leverage_type", self.leverage_type, LEVERAGE_TYPES, self.label)
    check_bool("random_projection", self.random_projection)
    check_bool("use_local_approximation", self.use_local_approximation)
    check_int("local_window", self.local_window, 1)
    check_int("seed", self.seed, 0)

  def score(self, evidence):
    """Normalised key/value leverage per KV head, sinks protected (kvpress ``CURPress``)."""
    k = evidence.need("keys_LGTD", self.label)
    v = evidence.need("values_LGTD", self.label)
    L, G, T, D = k.shape
    sketch = None
    if self.random_projection:
      sketch = sketch_of(evidence, self.seed, (L, 1, D, PROJECTION), self.label)
    window = self.local_window if self.use_local_approximation else None

    def fn(n, k, v):
      return cur_scores(
        k,
        v,
        n,
        sinks=self.sinks,
        leverage_type=self.leverage_type,
        local_window=window,
        sketch_LGDK=sketch,
      )

    return aligned(fn, evidence.valid_T, T, k, v)
