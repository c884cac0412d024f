"""Write your own: a prefill scorer, a decode-time evictor with its own state, and an allocator.

Each is one small frozen dataclass; :func:`kvjax.policies.register` names it for config files,
sweeps and evaluations. ``tests/test_write_your_own.py`` runs all three through every entry
point of kvjax and checks what they keep against numpy.
"""

import dataclasses

import jax.numpy as jnp

from kvjax import policies, scores


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueNorm(policies.Policy):
  """Keep the positions whose values have the largest L2 norm, and the first ``sinks``."""

  needs = frozenset({"values_LGTD"})
  sinks: int = 4

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
      raise ValueError(f"sinks: expected an int >= 0, got {self.sinks!r}")

  def score(self, evidence):
    norms_LGT = jnp.linalg.norm(evidence.values_LGTD.astype(jnp.float32), axis=-1)
    return scores.protect(norms_LGT, sinks=self.sinks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecayedH2O(policies.DecodePolicy):
  """H2O that forgets: each slot's attention decays by ``decay`` per generated token; the last
  ``recent`` positions are on probation."""

  needs = frozenset({"column_sums_LHT"})
  decay: float = 0.9
  recent: int = 4

  def score(self, evidence):  # the prompt's selection: heavy hitters plus the recent window
    return scores.protect(evidence.column_sums_LHT, recent=self.recent)

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    num_heads = idx_LHC.shape[-2]
    return policies.gather_slots(evidence.column_sums_LHT, idx_LHC, kept_LHC, num_heads)

  def observe(self, state_HC, attn_HC):
    return self.decay * state_HC + attn_HC

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return jnp.where(positions_HC > t - self.recent, jnp.inf, state_HC)


@dataclasses.dataclass(frozen=True)
class LayerRamp(policies.Allocator):
  """Layer budgets rising linearly from ``low`` x the budget in the first layer to
  ``2 - low`` x in the last (never below the protected window + 1)."""

  low: float = 0.5

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, _ = scores_LHT.shape
    scale_L = jnp.linspace(self.low, 2.0 - self.low, L)
    budget_L = jnp.maximum(jnp.floor(budget * scale_L), window + 1).astype(jnp.int32)
    return jnp.broadcast_to(budget_L[:, None], (L, H))


def register() -> None:
  """Names the three for config files, sweeps and evaluations."""
  policies.register("value_norm", ValueNorm, overwrite=True)
  policies.register("decayed_h2o", DecayedH2O, overwrite=True)
  policies.register(
    "value_norm_ramp", lambda **o: ValueNorm(allocator=LayerRamp(), **o), overwrite=True
  )
