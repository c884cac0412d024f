"""Keys for the synthetic world: a *model* of keys, stated as a hypothesis, not measured keys.

The lab's world (:mod:`kvjax.lab.synthetic`) defines attention rows and values but no keys, so
attention-free scorers (key norm, KeyDiff, LagKV) had nothing to read. This module derives keys
``[L, H, T, D]`` (lab heads are both query and KV heads, ``G = H``) from the world's own
structure, under one explicit modelling hypothesis: *the tokens that attention favours are
geometrically distinctive, unless they are disguised*. Each token gets a distinctiveness
``d_lht`` in ``[0, 1]``:

* **ordinary tokens** (``d = 0``): a shared per-head "background" direction ``u_lh`` plus
  isotropic noise, so they all look alike (high cosine to the mean key);
* **sinks** (the first ``num_sinks`` tokens): ``d = sink_distinctness`` (default 1);
* **heavy hitters**: what the world's background softmax favours. With ``p = softmax(beta_l *
  salience)`` over the prompt, ``d = clip(log(P * p) / heavy_log_ratio, 0, 1)``: a token that
  the background attends ``e^heavy_log_ratio`` times more than uniform is fully distinctive; a
  flat background (``beta = 0``, the diffuse scenario) makes no token distinctive. Topic-drift
  tokens are salient in the world, so they are distinctive too;
* **facts** (the needles of ``fact_mask_FT``): ``d = fact_distinctness``, the knob. At 1 a fact
  is as distinctive as a sink; at 0 it is disguised as an ordinary token (its salience no longer
  shows in its key), which is exactly what an attention-free scorer cannot see.

The direction of a key is ``normalise((1 - d) u + d v_i + n_i)`` with ``v_i`` a random unit
direction orthogonal to ``u`` and ``n_i`` noise of norm about ``key_noise``: its cosine to the
background is about ``(1 - d) / sqrt((1 - d)^2 + d^2)``. This is KeyDiff's hypothesis (Park et
al., "KeyDiff: Key Similarity-Based KV Cache Eviction", arXiv 2504.15364: keys least similar to
the mean key are the ones attention needs). Its norm is ``(1 - norm_contrast * d) *
exp(norm_noise * g)`` with ``g ~ N(0, 1)``: important keys are *short*, key norm's hypothesis
(Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv 2406.11430), with its own knob (``norm_contrast = 0``: norms carry no information).
LagKV (Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important", arXiv 2504.04704) needs no extra ingredient: it keeps tokens whose keys and values
leave the min/max range of the next lag chunk, and distinctive keys do; the values are the
world's own ``values_LHTD`` (random, so they carry no importance signal). The model has no RoPE
(real scorers read post-RoPE keys) and no query/key coupling: the world's attention rows do not
come from these keys, they are only made *consistent* with them by this hypothesis.

Everything is pure JAX and deterministic from ``seed`` (pass the world's seed,
``WorldConfig.seed``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.lab import synthetic

Array = jax.Array

_STREAM = 0x6B657973  # "keys": folds the seed so keys never share random bits with the world


@dataclasses.dataclass(frozen=True)
class KeyGeometry:
  """The knobs of the key model (static, hashable; validated on construction).

  Attributes:
    fact_distinctness: in ``[0, 1]``: 0 disguises the facts as ordinary keys, 1 makes them as
      distinctive as sinks.
    sink_distinctness: in ``[0, 1]``: the sinks' distinctiveness.
    heavy_log_ratio: ``> 0``: the log of the background-attention ratio to uniform at which a
      heavy hitter becomes fully distinctive.
    key_noise: ``>= 0``: the norm of the isotropic direction noise.
    norm_contrast: in ``[0, 1)``: a fully distinctive key's norm shrinks by this fraction (key
      norm's hypothesis); 0 leaves norms uninformative.
    norm_noise: ``>= 0``: log-normal spread of the norms.
  """

  fact_distinctness: float = 1.0
  sink_distinctness: float = 1.0
  heavy_log_ratio: float = 2.0
  key_noise: float = 0.3
  norm_contrast: float = 0.5
  norm_noise: float = 0.1

  def __post_init__(self):
    for name, low, high, closed in (
      ("fact_distinctness", 0.0, 1.0, True),
      ("sink_distinctness", 0.0, 1.0, True),
      ("norm_contrast", 0.0, 1.0, False),
    ):
      value = getattr(self, name)
      ok = _is_real(value) and low <= value and (value <= high if closed else value < high)
      if not ok:
        bracket = "]" if closed else ")"
        raise ValueError(f"{name}: expected a number in [{low}, {high}{bracket}, got {value!r}")
    if not (_is_real(self.heavy_log_ratio) and self.heavy_log_ratio > 0):
      raise ValueError(f"heavy_log_ratio: expected a number > 0, got {self.heavy_log_ratio!r}")
    for name in ("key_noise", "norm_noise"):
      value = getattr(self, name)
      if not (_is_real(value) and value >= 0):
        raise ValueError(f"{name}: expected a number >= 0, got {value!r}")


def _is_real(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def distinctiveness(world: synthetic.World, geometry: KeyGeometry | dict) -> Array:
  """``d_LHT`` in ``[0, 1]``: how unlike the background each key is (the module's hypothesis:
  sinks, the background's heavy hitters over the prompt, and facts at ``fact_distinctness``).
  ``geometry`` is a :class:`KeyGeometry` or a dict of its fields (traced values allowed)."""
  if isinstance(geometry, KeyGeometry):
    geometry = dataclasses.asdict(geometry)
  cfg = world.dims
  T, P = cfg.total_len, cfg.prompt_len
  pos_T = jnp.arange(T)
  logits_LHT = world.beta_L[:, None, None] * world.salience_LHT
  # the background softmax as prefill sees it (over the prompt); generated tokens are measured
  # against the same normaliser, so a salient drift token is distinctive as well
  log_norm_LH1 = jax.nn.logsumexp(logits_LHT[..., :P], axis=-1, keepdims=True)
  log_ratio_LHT = logits_LHT - log_norm_LH1 + jnp.log(float(P))
  heavy_LHT = jnp.clip(log_ratio_LHT / geometry["heavy_log_ratio"], 0.0, 1.0)
  fact_11T = world.fact_mask_FT.any(0)[None, None]
  d_LHT = jnp.where(fact_11T, geometry["fact_distinctness"], heavy_LHT)
  sink_11T = (pos_T < world.num_sinks)[None, None]
  return jnp.where(sink_11T, geometry["sink_distinctness"], d_LHT)


def world_keys(
  world: synthetic.World, geometry: KeyGeometry | None = None, *, seed: int = 0
) -> Array:
  """Modelled keys ``keys_LHTD`` fp32 for every position of ``world`` (see the module docstring
  for the hypothesis and its papers). ``seed`` (the world's seed) fixes the background
  directions, the distinctive directions and the noise: same world and seed, identical keys."""
  geometry = KeyGeometry() if geometry is None else geometry
  if not isinstance(geometry, KeyGeometry):
    raise ValueError(f"geometry: expected a KeyGeometry, got {type(geometry).__name__}")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed: expected an int (the world's seed), got {seed!r}")
  knobs = {f.name: jnp.float32(getattr(geometry, f.name)) for f in dataclasses.fields(geometry)}
  return _world_keys(world, knobs, jax.random.fold_in(jax.random.key(seed), _STREAM))


def _unit(x: Array) -> Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@jax.jit
def _world_keys(world: synthetic.World, knobs: dict, rng: Array) -> Array:
  """The keys with the knobs as traced data, so a sweep over them compiles once."""
  cfg = world.dims
  L, H, T, D = cfg.num_layers, cfg.num_heads, cfg.total_len, cfg.head_dim
  k_bg, k_dir, k_noise, k_norm = jax.random.split(rng, 4)
  u_LH1D = _unit(jax.random.normal(k_bg, (L, H, 1, D)))
  v_LHTD = jax.random.normal(k_dir, (L, H, T, D))
  v_LHTD = _unit(v_LHTD - (v_LHTD * u_LH1D).sum(-1, keepdims=True) * u_LH1D)
  noise_LHTD = knobs["key_noise"] / jnp.sqrt(float(D)) * jax.random.normal(k_noise, (L, H, T, D))
  d_LHT1 = distinctiveness(world, knobs)[..., None]
  direction_LHTD = _unit((1.0 - d_LHT1) * u_LH1D + d_LHT1 * v_LHTD + noise_LHTD)
  spread_LHT1 = jnp.exp(knobs["norm_noise"] * jax.random.normal(k_norm, (L, H, T, 1)))
  norm_LHT1 = (1.0 - knobs["norm_contrast"] * d_LHT1) * spread_LHT1
  return (norm_LHT1 * direction_LHTD).astype(jnp.float32)
