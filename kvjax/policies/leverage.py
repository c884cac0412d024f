"""Approximate statistical leverage of the pre-RoPE keys (kvpress ``LeverageScorePress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.evidence import Evidence

Array = jax.Array

JITTERS = (1e-2, 1e-1, 1.0, 10.0, 100.0)  # kvpress chol_with_jitter(jitter=1e-2, max_tries=5)
HIGHEST = jax.lax.Precision.HIGHEST


def valid_mask(valid_T: Array | None, T: int) -> Array:
  """Returns a row's real positions as a mask.

  Args:
    valid_T: bool ``[T]`` or ``None`` (every position is real).
    T: the positions.

  Returns:
    bool ``[T]``.
  """
  return jnp.ones((T,), bool) if valid_T is None else valid_T.astype(bool)


def znorm(scores_LGT: Array, valid_T: Array) -> Array:
  """Z-scores per layer over its heads and real positions.

  kvpress: ``(s - s.mean()) / s.std().clamp_min(1e-6)``, the unbiased std over every head and
  position of the layer.

  Args:
    scores_LGT: the scores ``[L, G, T]``.
    valid_T: bool ``[T]``, the real positions (padding enters no statistic).

  Returns:
    fp32 ``[L, G, T]``: the z-scores, 0 at padding.
  """
  G = scores_LGT.shape[1]
  w = jnp.broadcast_to(valid_T[None, None], scores_LGT.shape)
  count = jnp.maximum(G * valid_T.sum(), 2).astype(jnp.float32)
  x = jnp.where(w, scores_LGT, 0.0)
  mean = x.sum((1, 2), keepdims=True) / count
  var = jnp.where(w, (scores_LGT - mean) ** 2, 0.0).sum((1, 2), keepdims=True) / (count - 1)
  return jnp.where(w, (scores_LGT - mean) / jnp.maximum(jnp.sqrt(var), 1e-6), 0.0)


def draw_sketch(seed: int, shape: tuple[int, ...]) -> Array:
  """Draws standard normal numbers from ``jax.random.key(seed)``.

  Args:
    seed: the seed.
    shape: the shape drawn.

  Returns:
    fp32 draws of ``shape``.
  """
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def sketch_of(evidence: Evidence, seed: int, shape: tuple[int, ...], policy: str) -> Array:
  """Returns the Gaussian sketch: ``evidence.sketch_LGDK`` if given, else seeded draws.

  Args:
    evidence: the evidence (its ``sketch_LGDK`` may be ``None``).
    seed: the seed of :func:`draw_sketch` when the evidence has no sketch.
    shape: ``(L, G, D, K)``; a given sketch's ``G`` may be 1 (shared by the heads).
    policy: the policy's label, named in the error.

  Returns:
    fp32 ``[L, G or 1, D, K]`` raw N(0, 1) draws.

  Raises:
    ValueError: a given sketch whose shape does not fit ``shape``.
  """
  sketch = evidence.sketch_LGDK
  if sketch is None:
    return draw_sketch(seed, shape)
  L, G, D, K = shape
  if sketch.ndim != 4 or sketch.shape[0] != L or sketch.shape[1] not in (1, G):
    raise ValueError(
      f"evidence: policy {policy!r} expected sketch_LGDK [{L}, {G} or 1, {D}, {K}], "
      f"got {sketch.shape}"
    )
  if sketch.shape[2:] != (D, K):
    raise ValueError(
      f"evidence: policy {policy!r} expected sketch_LGDK [{L}, {G} or 1, {D}, {K}] "
      f"(K = its sketch dimension), got {sketch.shape}"
    )
  return sketch.astype(jnp.float32)


def cholesky_with_jitter(gram_LGKK: Array) -> Array:
  """Factors Gram matrices with kvpress's adaptive jitter (``chol_with_jitter``).

  The first jitter in :data:`JITTERS` whose factor succeeds for every head of the layer is used
  (one jitter per layer, as kvpress's per-call ``info.all()``); when none succeeds, the last.

  Args:
    gram_LGKK: symmetric Gram matrices ``[L, G, K, K]``.

  Returns:
    The lower Cholesky factors ``[L, G, K, K]`` (NaN where even the last jitter fails).
  """
  eye = jnp.eye(gram_LGKK.shape[-1], dtype=gram_LGKK.dtype)
  jitter_J = jnp.asarray(JITTERS, gram_LGKK.dtype)
  # One batched factorisation of every jittered matrix: separate Cholesky calls run side by side
  # on XLA:CPU's threads, and concurrent LAPACK calls can hang the process.
  tries = jnp.linalg.cholesky(
    gram_LGKK[None] + jitter_J[:, None, None, None, None] * eye[None, None, None]
  )
  ok_JL = jnp.isfinite(tries).all((2, 3, 4))
  first_L = jnp.where(ok_JL.any(0), jnp.argmax(ok_JL, axis=0), len(JITTERS) - 1)
  return jnp.take_along_axis(tries, first_L[None, :, None, None, None], axis=0)[0]


def leverage_scores(prerope_keys_LGTD: Array, sketch_LGDK: Array, valid_T: Array) -> Array:
  """kvpress ``LeverageScorePress.compute_leverage_scores``: ``diag(X (X^T X)^-1 X^T)`` of the
  sequence-centred keys sketched on the right, ``X = (K - mean_t K) Phi``, clamped at 0.

  ``Phi = sketch / sqrt(k)``; the Gram matrix is symmetrised and factored with kvpress's
  adaptive jitter (:data:`JITTERS`). Only the real positions (``valid_T``) enter the mean and
  the Gram matrix; the others score 0.

  Args:
    prerope_keys_LGTD: pre-RoPE keys ``[L, G, T, D]``.
    sketch_LGDK: standard normal draws ``[L, G or 1, D, k]``.
    valid_T: bool ``[T]``, the real positions.

  Returns:
    fp32 leverage ``[L, G, T]``.
  """
  k = prerope_keys_LGTD.astype(jnp.float32)
  w = valid_T[None, None, :, None]
  mean = jnp.where(w, k, 0.0).sum(2, keepdims=True) / jnp.maximum(valid_T.sum(), 1)
  phi = sketch_LGDK / math.sqrt(sketch_LGDK.shape[-1])
  x = jnp.where(w, jnp.matmul(k - mean, phi, precision=HIGHEST), 0.0)  # [L, G, T, k]
  xt = jnp.swapaxes(x, -1, -2)
  gram = jnp.matmul(xt, x, precision=HIGHEST)
  chol = cholesky_with_jitter(0.5 * (gram + jnp.swapaxes(gram, -1, -2)))
  solved = jax.scipy.linalg.cho_solve((chol, True), xt)  # [L, G, k, T]
  scores = (x * jnp.swapaxes(solved, -1, -2)).sum(-1)
  return jnp.where(valid_T[None, None], jnp.maximum(scores, 0.0), 0.0)


def leverage_zscores(prerope_keys_LGTD: Array, sketch_LGDK: Array, valid_T: Array) -> Array:
  """Computes kvpress ``LeverageScorePress.score``: leverage scores z-normalised per layer.

  Args:
    prerope_keys_LGTD: the keys before RoPE ``[L, G, T, D]``.
    sketch_LGDK: raw N(0, 1) sketch draws ``[L, G or 1, D, K]``.
    valid_T: bool ``[T]``, the real positions.

  Returns:
    fp32 ``[L, G, T]``: :func:`leverage_scores` through :func:`znorm`.
  """
  return znorm(leverage_scores(prerope_keys_LGTD, sketch_LGDK, valid_T), valid_T)


def check_sketch_dimension(value) -> None:
  """Checks ``sketch_dimension``, the sketch's width.

  Args:
    value: the option's value.

  Raises:
    ValueError: unless it is an int ``>= 1``.
  """
  check_int("sketch_dimension", value, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeverageScore(Policy):
  """Approximate leverage scores of the pre-RoPE keys, z-normalised per layer.

  Paper: Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
  Approximate Leverage Scores" (arXiv:2507.08143). Reference: kvpress 0.5.5
  ``presses/leverage_press.py::LeverageScorePress``. Each KV head's pre-RoPE keys
  (``evidence.prerope_keys_LGTD``) are centred over the sequence and sketched on the right by a
  Gaussian ``Phi = N(0, 1) / sqrt(sketch_dimension)`` (``[D, sketch_dimension]`` per layer and
  KV head); the score is ``diag(X (X^T X)^-1 X^T)`` through a Cholesky solve with kvpress's
  adaptive jitter (1e-2, then x10, five tries), clamped at 0, then z-scored over the layer's
  heads and positions (unbiased std, clamped at 1e-6). Scores are per KV head ``[L, G, T]``, as
  kvpress's. No protected positions.

  Differences from kvpress:

  * the sketch: kvpress draws ``torch.randn`` inside ``score`` (a new draw per call and layer);
    kvjax reads the draws from ``evidence.sketch_LGDK`` (``[L, G, D, sketch_dimension]``, the raw
    N(0, 1) values) when given, else draws them from ``jax.random.key(seed)``, so a run is
    reproducible. The golden test feeds kvpress's recorded draws.
  * when all five jitters fail, kvpress raises; kvjax keeps the last try's factor (the layer's
    scores may then be NaN).
  * kvpress z-scores over the whole batch; kvjax over one prompt (its real positions, for a
    padded row).

  Attributes:
    sketch_dimension: the Gaussian sketch's width ``k`` (kvpress default 48).
    seed: the seed of the sketch drawn when the evidence carries none.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"prerope_keys_LGTD"})
  sketch_dimension: int = 48
  seed: int = 0

  def __post_init__(self):
    super().__post_init__()
    check_sketch_dimension(self.sketch_dimension)
    check_int("seed", self.seed, 0)

  def score(self, evidence):
    """Z-scored leverage of the pre-RoPE keys per KV head (kvpress ``LeverageScorePress``)."""
    keys = evidence.need("prerope_keys_LGTD", self.label)
    L, G, T, D = keys.shape
    sketch = sketch_of(evidence, self.seed, (L, G, D, self.sketch_dimension), self.label)
    return leverage_zscores(keys, sketch, valid_mask(evidence.valid_T, T))
