"""CAPKV's log-det capacity score from a historical-query anchor and the values (kvpress
``CapPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax.policies.checks import check_int
from kvjax.policies.core import Policy
from kvjax.policies.evidence import N_FUTURE, N_SINK, EvidenceRequest

Array = jax.Array

HIGHEST = jax.lax.Precision.HIGHEST


def _normalize(x: Array) -> Array:
  """``torch.nn.functional.normalize``: ``x / max(||x||_2, 1e-12)`` over the last axis."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def capkv_scores(
  query_anchor_LHD: Array,
  keys_LGTD: Array,
  values_LGTD: Array,
  *,
  sinks: int = N_SINK,
  tau: float = 5.0,
  epsilon: float = 1e-6,
  valid_T: Array | None = None,
) -> Array:
  """kvpress ``CapPress.score`` per KV head ``[L, G, T]``.

  For each query head ``h`` (its KV head's keys and values repeated) over the positions after
  the ``sinks``: ``stat_t = clamp(<q_hat, k_hat_t>, -1, 1)`` (the anchor and keys
  L2-normalised), ``w_t = exp(tau * stat_t - max_t tau * stat_t)``,
  ``A = I + sum_t (sqrt(w_t + epsilon) v_t)(sqrt(w_t + epsilon) v_t)^T`` and
  ``s_t = w_t * v_t^T A^-1 v_t`` (an fp32 solve); then the mean over each GQA group. The first
  ``sinks`` positions score ``+inf``.

  Args:
    query_anchor_LHD: the historical-query anchor ``[L, Hq, D]`` (``evidence.query_mean_LHD``).
    keys_LGTD: the cached (post-RoPE) keys ``[L, G, T, D]``.
    values_LGTD: the cached values ``[L, G, T, D]``.
    sinks: the protected first positions, a static int in ``[0, T)``.
    tau: the alignment temperature.
    epsilon: added to each weight inside the capacity matrix.
    valid_T: bool ``[T]``, the row's real positions (``None``: all); padding enters neither the
      max shift nor the capacity matrix and scores 0.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: ``T <= sinks`` or query heads that are not a multiple of the KV heads.
  """
  L, Hq, D = query_anchor_LHD.shape
  G, T = keys_LGTD.shape[1:3]
  if sinks >= T:
    raise ValueError(f"keys: T={T} tokens, expected more than sinks={sinks}")
  if Hq % G:
    raise ValueError(f"query_mean: {Hq} query heads are not a multiple of {G} KV heads")
  R = Hq // G
  valid = jnp.ones((T,), bool) if valid_T is None else valid_T.astype(bool)
  w_mask = valid[sinks:][None, None, None]  # [1, 1, 1, T']
  k = _normalize(keys_LGTD[:, :, sinks:].astype(jnp.float32))
  v = values_LGTD[:, :, sinks:].astype(jnp.float32)
  q = _normalize(query_anchor_LHD.astype(jnp.float32)).reshape(L, G, R, D)
  stat = jnp.clip(jnp.einsum("lgrd,lgtd->lgrt", q, k, precision=HIGHEST), -1.0, 1.0)
  logits = jnp.where(w_mask, tau * stat, -jnp.inf)
  logits = logits - logits.max(-1, keepdims=True)
  weights = jnp.where(w_mask, jnp.exp(logits), 0.0)  # [L, G, R, T']
  sqrt_w = jnp.where(w_mask, jnp.sqrt(weights + epsilon), 0.0)
  scaled = v[:, :, None] * sqrt_w[..., None]  # [L, G, R, T', D]
  capacity = jnp.eye(D, dtype=jnp.float32)[None, None, None] + jnp.einsum(
    "lgrtd,lgrte->lgrde", scaled, scaled, precision=HIGHEST
  )
  v_t = jnp.broadcast_to(jnp.swapaxes(v, -1, -2)[:, :, None], (L, G, R, D, v.shape[2]))
  solution = jnp.linalg.solve(capacity, v_t)  # [L, G, R, D, T']
  leverage = (v_t * solution).sum(-2)
  scores = (weights * leverage).mean(2)  # [L, G, T']
  scores = jnp.where(w_mask[0], scores, 0.0)
  protected = jnp.where(valid[:sinks], jnp.inf, 0.0)
  return jnp.concatenate([jnp.broadcast_to(protected, (L, G, sinks)), scores], axis=-1).astype(
    jnp.float32
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapKV(Policy):
  """CAPKV: the log-det capacity gain of each token under query-aligned weights.

  Paper: "CAPKV" (arXiv:2604.25975). Reference: kvpress 0.5.5
  ``presses/cap_press.py::CapPress``. With ``mu_q`` the historical-query anchor (the mean of the
  pre-RoPE prompt queries after the first ``sinks`` tokens, rotated by the average RoPE matrix
  of the next ``n_future`` positions: ``evidence.query_mean_LHD``, which the model's prefill
  computes for this policy's ``sinks`` and ``n_future``), each position after the sinks gets
  ``w_i = exp(tau * <k_i/|k_i|, mu_q/|mu_q|>)`` (clamped to ``[-1, 1]`` inside, shifted by the
  head's max), ``A = I + sum_i (w_i + epsilon) v_i v_i^T`` and the score
  ``s_i = w_i * v_i^T A^-1 v_i``, per query head, then the mean over each GQA group: scores per
  KV head ``[L, G, T]``. The first ``sinks`` positions are kept.

  Differences from kvpress:

  * the sinks score ``+inf``; kvpress pads them with the layer's max score + 1 (the same
    selection).
  * kvpress scores a batch and takes that max over it; kvjax scores one prompt (its real
    positions, for a padded row: padding is out of the max shift and the capacity matrix and
    scores 0).
  * the prefill that computes ``query_mean_LHD`` also computes the covariance
    (``query_cov_LHDD``, unread here).

  Attributes:
    sinks: the first positions kept and left out of the anchor (kvpress ``n_sink``, 4).
    tau: the alignment temperature (kvpress 5.0), a real number.
    n_future: the future positions the anchor's RoPE is averaged over (kvpress
      ``n_future_positions``, 512).
    epsilon: added to each weight in the capacity matrix (kvpress 1e-6), a real ``>= 0``.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"query_mean_LHD", "keys_LGTD", "values_LGTD"})
  sinks: int = N_SINK
  tau: float = 5.0
  n_future: int = N_FUTURE
  epsilon: float = 1e-6

  def __post_init__(self):
    super().__post_init__()
    check_int("sinks", self.sinks, 0)
    check_int("n_future", self.n_future, 1)
    if isinstance(self.tau, bool):
      raise ValueError(f"tau: expected a real number, got {self.tau!r}")
    budgets_lib.check_real("tau", self.tau, low=-float("inf"))
    if isinstance(self.epsilon, bool):
      raise ValueError(f"epsilon: expected a real number >= 0, got {self.epsilon!r}")
    budgets_lib.check_real("epsilon", self.epsilon, low=0.0)

  def evidence_request(self, T, *, reduce_rows=False) -> EvidenceRequest:
    """The base request, its query statistics after ``sinks`` tokens and over ``n_future``."""
    return dataclasses.replace(
      super().evidence_request(T), n_sink=self.sinks, n_future=self.n_future
    )

  def score(self, evidence):
    """CAPKV's capacity scores per KV head, ``sinks`` protected (kvpress ``CapPress``)."""
    name = self.label
    return capkv_scores(
      evidence.need("query_mean_LHD", name),
      evidence.need("keys_LGTD", name),
      evidence.need("values_LGTD", name),
      sinks=self.sinks,
      tau=self.tau,
      epsilon=self.epsilon,
      valid_T=evidence.valid_T,
    )
