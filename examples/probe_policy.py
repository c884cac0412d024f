"""A method that needs evidence kvjax does not compute: each token scored by a linear probe on
the layer's input hidden states, the probe fitted with optax.

The kind ``probe_LGT`` is declared here, with how a model computes it; ``tests/test_probe_policy.py``
runs the policy through ``keep_mask``, ``generate``, ``answer_configs`` and an evaluation config.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

import kvjax.model as km
from kvjax import policies, scores


@dataclasses.dataclass(frozen=True, eq=False)
class Probe:
  """A linear probe per layer and KV head on each position's attention input."""

  w_LdG: jax.Array
  b_LG: jax.Array

  def apply(self, h_LBTd):
    return jnp.einsum("lbtd,ldg->lbgt", h_LBTd, self.w_LdG) + self.b_LG[:, None, :, None]

  def __call__(self, model, input_ids, attention_mask):  # the kind's compute: [L, B, G, T]
    return self.apply(km.attention_inputs(model, input_ids, attention_mask))


def fit_probe(model, input_ids, steps: int = 100, lr: float = 1e-2) -> Probe:
  """Fits the probe to the log attention each position receives (H2O's column sums, averaged
  over each KV head's query group) with optax's Adam."""
  cfg, ids = model.cfg, jnp.asarray(input_ids)
  request = policies.EvidenceRequest(column_sums=True)
  sums = km.prefill(cfg, model.params(), ids, jnp.ones_like(ids), request).column_sums
  L, B, _, T = sums.shape
  target = jnp.log(sums.reshape(L, B, cfg.num_kv_heads, -1, T).mean(3) + 1e-6)
  h_LBTd = km.attention_inputs(model, ids)
  params = (jnp.zeros((L, cfg.hidden_size, cfg.num_kv_heads)), jnp.zeros((L, cfg.num_kv_heads)))
  opt = optax.adam(lr)

  @jax.jit
  def step(p, state):
    grads = jax.grad(lambda p: jnp.mean((Probe(*p).apply(h_LBTd) - target) ** 2))(p)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(p, updates), state

  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return Probe(*params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeKV(policies.Policy):
  """Keep the positions the probe scores highest, and the first ``sinks``."""

  needs = frozenset({"probe_LGT"})
  sinks: int = 4

  def score(self, evidence):
    return scores.protect(evidence.need("probe_LGT", self.label), sinks=self.sinks)


def declare(probe: Probe) -> None:
  """Declares ``probe_LGT`` (computed by ``probe``) and names the policy ``probe_kv``."""
  doc = "a linear probe's score of each position's attention input"
  policies.declare_evidence(policies.EvidenceKind("probe_LGT", doc, compute=probe), overwrite=True)
  policies.register("probe_kv", ProbeKV, overwrite=True)
