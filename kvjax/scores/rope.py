"""ExpectedAttention: the average RoPE rotation of future positions, the statistics of the
future queries it rotates, and the attention they are expected to pay each key."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks
from kvjax.scores.attention import PRECISION

Array = jax.Array


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
  start = checks.static_int("start", start, 0)
  n_future = checks.static_int("n_future", n_future, 1)
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
  checks.float_array("prerope_queries", prerope_queries_LHTD, 4, "LHTD")
  checks.float_array("avg_rope", avg_rope_DD, 2, "DD")
  D, T = prerope_queries_LHTD.shape[-1], prerope_queries_LHTD.shape[2]
  if avg_rope_DD.shape != (D, D):
    raise ValueError(f"avg_rope: expected shape ({D}, {D}), got {avg_rope_DD.shape}")
  n_sink = checks.static_int("n_sink", n_sink, 0)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttentionOptions:
  """The options of kvpress ``ExpectedAttentionPress`` (its defaults).

  Attributes:
    sinks: the number of initial positions protected, a static int in ``[0, T)`` (4).
    use_covariance: adds the covariance term to the expected logits (True).
    use_vnorm: multiplies by the value norms (True).
    epsilon: added to the expected attention before the value norms multiply it (0.0).
  """

  sinks: int = 4
  use_covariance: bool = True
  use_vnorm: bool = True
  epsilon: float = 0.0


def expected_attention(
  query_mean_LHD: Array,
  query_cov_LHDD: Array | None,
  keys_LGTD: Array,
  values_LGTD: Array | None,
  *,
  options: ExpectedAttentionOptions | None = None,
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
    options: ``sinks``, ``use_covariance``, ``use_vnorm`` and ``epsilon``
      (:class:`ExpectedAttentionOptions`; ``None``: kvpress's defaults).
    valid_T: bool ``[T]``, the row's real positions (a padded batch row): the softmax runs over
      them only, as over the unpadded prompt, and padding scores 0. ``None``: every position.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: for arrays that are not floating of the expected rank, or (when concrete)
      contain NaN or inf; shapes that disagree; ``Hq`` not a multiple of ``G``; ``options``
      that are not :class:`ExpectedAttentionOptions`; a ``sinks`` that is not a static int in
      ``[0, T)``; a missing covariance (``use_covariance``) or missing values (``use_vnorm``);
      and a ``valid_T`` that is not ``[T]``.
  """
  options = ExpectedAttentionOptions() if options is None else options
  if not isinstance(options, ExpectedAttentionOptions):
    raise ValueError(f"options: expected ExpectedAttentionOptions or None, got {options!r}")
  checks.float_array("query_mean", query_mean_LHD, 3, "LHD")
  checks.float_array("keys", keys_LGTD, 4, "LGTD")
  L, Hq, D = query_mean_LHD.shape
  G, T = keys_LGTD.shape[1:3]
  if keys_LGTD.shape[0] != L or keys_LGTD.shape[-1] != D:
    raise ValueError(f"keys: shape {keys_LGTD.shape} does not match query_mean {(L, Hq, D)}")
  checks.gqa(Hq, G)
  sinks = checks.static_int("sinks", options.sinks, 0)
  if sinks >= T:
    raise ValueError(f"keys: T={T} tokens, expected more than sinks={sinks}")
  if options.use_covariance:
    if query_cov_LHDD is None:
      raise ValueError("query_cov: expected [L, Hq, D, D] when use_covariance=True, got None")
    checks.float_array("query_cov", query_cov_LHDD, 4, "LHDD")
    if query_cov_LHDD.shape != (L, Hq, D, D):
      raise ValueError(f"query_cov: expected shape {(L, Hq, D, D)}, got {query_cov_LHDD.shape}")
  if options.use_vnorm:
    if values_LGTD is None:
      raise ValueError("values: expected [L, G, T, D] when use_vnorm=True, got None")
    checks.float_array("values", values_LGTD, 4, "LGTD")
    checks.same_dims("values", values_LGTD, "keys", keys_LGTD, (0, 1, 2))
  return _expected_attention(
    query_mean_LHD,
    query_cov_LHDD if options.use_covariance else None,
    keys_LGTD,
    values_LGTD if options.use_vnorm else None,
    options.epsilon,
    checks.valid_positions(valid_T, T),
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
