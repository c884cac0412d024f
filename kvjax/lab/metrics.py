"""Metrics of a cache against the full-cache attention it approximates.

Per query row ``a_t`` (full cache, over positions ``<= t``) and kept set ``S_t``:

* retained mass ``R_t(S_t) = sum_{i in S_t} a_{t,i}`` (the essay's first instrument);
* the oracle's ``R*_t(b)``: the sum of the top ``b`` entries of ``a_t`` (the best any set of
  ``b`` positions can do), and the gap ``R* - R``;
* attention-output error ``||o - o_hat||_2`` with ``o = sum_i a_i v_i`` and ``o_hat`` the output
  attention renormalised over ``S_t`` computes (``o - o_hat = (1 - R)(o_bar - o_hat)``, so it is
  bounded by ``2 (1 - R) max ||v||``);
* active-fact recall: the fraction of the queried fact tokens still cached;
* budget use: kept slots / budget.

Everything is per (layer, head); :func:`summarize` averages over steps, per layer and overall.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.scores import PRECISION

Array = jax.Array


@struct.dataclass
class StepMetrics:
  """Per-(layer, head) metrics of one step (a leading step axis once stacked by a scan)."""

  retained: Array
  oracle: Array
  error: Array
  fact_hits: Array
  fact_total: Array
  used: Array


def oracle_mass(row_LHT: Array, budget_LH: Array, capacity: int) -> Array:
  """``R*(B)``: sum of the ``min(B, capacity)`` largest entries of each row (prefix sums of one
  ``top_k``, so every budget up to ``capacity`` is a gather)."""
  k = min(capacity, row_LHT.shape[-1])
  top = jax.lax.top_k(row_LHT, k)[0]
  prefix = jnp.concatenate([jnp.zeros(top.shape[:-1] + (1,)), jnp.cumsum(top, -1)], -1)
  return jnp.take_along_axis(prefix, jnp.clip(budget_LH, 0, k)[..., None], -1)[..., 0]


def step_metrics(
  row_LHT: Array,
  values_LHTD: Array,
  pos_LHC: Array,
  valid_LHC: Array,
  budget_LH: Array,
  fact_T: Array,
  capacity: int,
) -> tuple[StepMetrics, Array]:
  """Metrics of one step for a cache holding ``pos_LHC`` (where ``valid_LHC``).

  Returns the metrics and the renormalised kept attention ``a_hat_LHC`` (what the compressed
  cache's softmax actually computes; decode-time policies accumulate it).
  """
  kept_a = jnp.where(valid_LHC, jnp.take_along_axis(row_LHT, pos_LHC, -1), 0.0)
  retained = kept_a.sum(-1)
  a_hat = kept_a / jnp.where(retained > 0, retained, 1.0)[..., None]
  out_full = jnp.einsum("lht,lhtd->lhd", row_LHT, values_LHTD, precision=PRECISION)
  kept_v = jnp.take_along_axis(values_LHTD, pos_LHC[..., None], -2)
  out_hat = jnp.einsum("lhb,lhbd->lhd", a_hat, kept_v, precision=PRECISION)
  hits = jnp.take_along_axis(jnp.broadcast_to(fact_T, row_LHT.shape), pos_LHC, -1) & valid_LHC
  metrics = StepMetrics(
    retained=retained,
    oracle=oracle_mass(row_LHT, budget_LH, capacity),
    error=jnp.linalg.norm(out_full - out_hat, axis=-1),
    fact_hits=hits.sum(-1).astype(jnp.float32),
    fact_total=jnp.broadcast_to(fact_T.sum().astype(jnp.float32), retained.shape),
    used=valid_LHC.sum(-1) / jnp.maximum(budget_LH, 1),
  )
  return metrics, a_hat


def summarize(m: StepMetrics) -> dict[str, float | np.ndarray]:
  """Means over steps ``[S, L, H]`` -> overall scalars and per-layer arrays.

  ``fact_recall`` counts only steps that query a fact (NaN if none does).
  """
  retained = np.asarray(m.retained)
  gap = np.asarray(m.oracle) - retained
  hits, total = np.asarray(m.fact_hits), np.asarray(m.fact_total)
  recall_L = np.where(
    total.sum((0, 2)) > 0, hits.sum((0, 2)) / np.maximum(total.sum((0, 2)), 1), np.nan
  )
  return {
    "retained_mass": float(retained.mean()),
    "oracle_mass": float(np.asarray(m.oracle).mean()),
    "oracle_gap": float(gap.mean()),
    "output_error": float(np.asarray(m.error).mean()),
    "fact_recall": float(hits.sum() / total.sum()) if total.sum() > 0 else float("nan"),
    "budget_use": float(np.asarray(m.used).mean()),
    "retained_mass_L": retained.mean((0, 2)),
    "oracle_gap_L": gap.mean((0, 2)),
    "fact_recall_L": recall_L,
  }
