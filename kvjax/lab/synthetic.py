"""A deterministic synthetic attention world: the lab of ``seed-kv-cache-policies.md``, made
multi-layer and multi-head.

A prompt of ``P`` tokens is followed by ``S`` generated tokens (``T = P + S`` positions). The
full-cache attention row of the query at position ``t`` for layer ``l`` and head ``h`` is a
mixture of four distributions over the causal prefix ``i <= t``, so every ingredient's mass is
known exactly:

1. **sink**: uniform over the first ``num_sinks`` tokens (StreamingLLM's attention sinks);
2. **recency**: ``exp(-(t - i) / tau)`` normalised over the prefix (exponentially decaying);
3. **fact**: uniform over the fact tokens active at that step (old prompt facts that become
   relevant at chosen generation steps); observation-window rows at the end of the prompt
   *preview* the facts that generation will need, with weight ``preview``;
4. **background**: ``softmax(beta_l * salience_lhi)`` over the prefix. ``beta_l`` rises with
   depth (PyramidKV's funneling: lower layers spread widely, upper layers concentrate on a few
   critical tokens), and the salient keys are the world's heavy hitters.

Mixture weights depend on the layer (upper layers put more mass on sinks) and on each head's
**role** (``local``: recency-heavy; ``retrieval``: fact-heavy; ``sink``: sink-heavy; ``mixed``).
When no fact is active the fact weight goes to the background. Under **topic drift** some
tokens generated early become salient and are re-read later, while the prompt facts stop being
queried. Values ``[L, H, T, D]`` let metrics measure the attention-output error.

Rows are generated one query at a time (:func:`attention_row`), so nothing of size
``[L, H, S, T]`` is ever held: the online simulation builds each row inside its scan.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.scores import PRECISION

Array = jax.Array

ROLES = ("mixed", "local", "retrieval", "sink")
MAX_FACTS = 4  # fact tables are padded to this many, so scenarios share compiled simulations
# the attention mixture's components, in the order of World.weights_LH4
MIXTURE_WEIGHTS = ("sink_weight", "recency_weight", "fact_weight", "background_weight")


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """Every ingredient of the world as a field (static: it defines shapes and structure)."""

  num_layers: int = 8
  num_heads: int = 8
  prompt_len: int = 512
  gen_steps: int = 128
  head_dim: int = 16
  window: int = 32  # observation window: the last `window` prompt rows
  seed: int = 0
  # 1. sinks
  num_sinks: int = 4
  sink_weight: float = 0.2
  # 2. recency
  recency_weight: float = 0.35
  recency_tau: float = 24.0
  # 3. facts: prompt positions, and the generation steps [start, end) when each is queried
  fact_positions: tuple[int, ...] = (60, 180, 300)
  fact_steps: tuple[tuple[int, int], ...] = ((10, 30), (50, 70), (90, 110))
  fact_weight: float = 0.3
  fact_span: int = 2  # each fact covers `fact_span` consecutive tokens
  preview: float = 0.3  # fact weight of the observation-window rows (the question previews it)
  fact_salience: float = 2.0  # facts are also salient keys (so accumulated attention finds them)
  # 4. background heavy hitters and funneling
  background_weight: float = 0.15
  salience_scale: float = 1.0
  beta_bottom: float = 0.5  # background concentration of layer 0
  beta_top: float = 3.0  # ... of the last layer
  sink_funnel: float = 1.0  # sink weight multiplier grows linearly to 1 + sink_funnel at the top
  # head roles: fractions of local / retrieval / sink heads (the rest are mixed)
  role_fractions: tuple[float, float, float] = (0.25, 0.25, 0.125)
  role_boost: float = 3.0
  # 5. topic drift: generated tokens that become salient and are re-read later
  drift_step: int = -1  # generation step where topic B starts (-1: no drift)
  drift_tokens: int = 8  # topic-B tokens generated right after drift_step
  drift_salience: float = 4.0

  @property
  def total_len(self) -> int:
    return self.prompt_len + self.gen_steps


def validate(cfg: WorldConfig) -> WorldConfig:
  """Raises ``ValueError`` naming the first bad field."""
  for name in ("num_layers", "num_heads", "prompt_len", "gen_steps", "head_dim", "window"):
    value = getattr(cfg, name)
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}: expected a positive int, got {value!r}")
  if cfg.window > cfg.prompt_len:
    raise ValueError(
      f"window: {cfg.window} is longer than the prompt (prompt_len={cfg.prompt_len})"
    )
  if not 0 <= cfg.num_sinks <= cfg.prompt_len:
    raise ValueError(f"num_sinks: expected 0..prompt_len={cfg.prompt_len}, got {cfg.num_sinks}")
  for name in (*MIXTURE_WEIGHTS, "preview"):
    if getattr(cfg, name) < 0:
      raise ValueError(f"{name}: expected a non-negative weight, got {getattr(cfg, name)}")
  if cfg.recency_tau <= 0:
    raise ValueError(f"recency_tau: expected a positive decay length, got {cfg.recency_tau}")
  if len(cfg.fact_positions) > MAX_FACTS:
    raise ValueError(f"fact_positions: at most {MAX_FACTS} facts, got {len(cfg.fact_positions)}")
  if len(cfg.fact_positions) != len(cfg.fact_steps):
    raise ValueError(
      f"fact_steps: {len(cfg.fact_steps)} intervals for {len(cfg.fact_positions)} fact_positions"
    )
  for pos in cfg.fact_positions:
    if not pos >= 0 or pos + cfg.fact_span > cfg.prompt_len - cfg.window:
      raise ValueError(
        f"fact_positions: {pos} is outside the prompt before the observation window "
        f"[0, {cfg.prompt_len - cfg.window - cfg.fact_span}]"
      )
  for start, end in cfg.fact_steps:
    if not 0 <= start < end <= cfg.gen_steps:
      raise ValueError(f"fact_steps: ({start}, {end}) is not inside [0, gen_steps={cfg.gen_steps}]")
  if cfg.fact_span < 1:
    raise ValueError(f"fact_span: expected >= 1, got {cfg.fact_span}")
  if sum(cfg.role_fractions) > 1 or min(cfg.role_fractions) < 0:
    raise ValueError(
      f"role_fractions: expected non-negative fractions summing to <= 1, got {cfg.role_fractions}"
    )
  drifts = cfg.drift_step >= 0  # -1: no drift, whatever drift_tokens says
  if drifts and (
    cfg.drift_step >= cfg.gen_steps or cfg.drift_step + cfg.drift_tokens > cfg.gen_steps
  ):
    raise ValueError(
      f"drift_step: {cfg.drift_step} + drift_tokens does not fit gen_steps={cfg.gen_steps}"
    )
  return cfg


@dataclasses.dataclass(frozen=True)
class Dims:
  """The static part of a world: its shapes. Everything else is data, so every scenario of the
  same shape shares one compiled simulation."""

  num_layers: int
  num_heads: int
  prompt_len: int
  gen_steps: int
  head_dim: int
  window: int

  @property
  def total_len(self) -> int:
    return self.prompt_len + self.gen_steps


@struct.dataclass
class World:
  """The generated world: per-key and per-head tables; rows come from :func:`attention_row`."""

  num_sinks: Array  # int32 scalar
  recency_tau: Array  # float32 scalar
  preview: Array  # float32 scalar
  salience_LHT: Array  # background logits before the layer's concentration beta
  beta_L: Array
  weights_LH4: Array  # mixture weights (sink, recency, fact, background) per layer and head
  roles_LH: Array  # index into ROLES
  fact_mask_FT: Array  # bool: positions covered by each fact
  fact_active_FS: Array  # bool: fact f queried at generation step s
  fact_preview_F: Array  # bool: the observation window previews fact f
  values_LHTD: Array
  dims: Dims = struct.field(pytree_node=False)


def _roles(cfg: WorldConfig, key: Array) -> Array:
  counts = [int(round(f * cfg.num_heads)) for f in cfg.role_fractions]
  per_layer = np.zeros(cfg.num_heads, np.int32)
  start = 0
  for role, count in enumerate(counts, start=1):
    per_layer[start : start + count] = role
    start += count
  perms = jax.vmap(lambda k: jax.random.permutation(k, jnp.asarray(per_layer)))(
    jax.random.split(key, cfg.num_layers)
  )
  return perms.astype(jnp.int32)


def _mixture_weights(cfg: WorldConfig, roles_LH: Array) -> Array:
  depth_L = jnp.linspace(0.0, 1.0, cfg.num_layers) if cfg.num_layers > 1 else jnp.zeros((1,))
  base = jnp.asarray([getattr(cfg, name) for name in MIXTURE_WEIGHTS], jnp.float32)
  w = jnp.broadcast_to(base, (cfg.num_layers, cfg.num_heads, 4))
  sink_scale = (1.0 + cfg.sink_funnel * depth_L)[:, None]
  w = w.at[..., 0].multiply(jnp.broadcast_to(sink_scale, roles_LH.shape))
  # role r (1: local, 2: retrieval, 3: sink) boosts component (recency, fact, sink)
  component = jnp.asarray([-1, 1, 2, 0])[roles_LH]
  boost = jnp.where(
    (jnp.arange(4)[None, None, :] == component[..., None]) & (roles_LH[..., None] > 0),
    cfg.role_boost,
    1.0,
  )
  return w * boost


def make_world(cfg: WorldConfig, *, values: bool = True) -> World:
  """Builds the world's static tables from ``cfg.seed`` (same seed, identical arrays).

  ``values=False`` leaves ``values_LHTD`` empty (``[L, H, T, 0]``) for callers that never read
  them (a sweep's evidence): they are the world's largest random draw. Every other table is
  the same either way.

  The random tables are drawn by one jitted program per configuration (the seed's key is
  traced, so every seed of a configuration shares it). Op by op, each of its few dozen
  operations was compiled, or read from the persistent compilation cache, on its first use in a
  process: the first world of ``L = H = 32, P = 8192`` in a fresh process took 2.5 s, now
  1.8-2.0 s (most of it loading the one program), and 0.26 s the next.
  """
  validate(cfg)
  T = cfg.total_len
  fact_mask = np.zeros((MAX_FACTS, T), bool)
  for f, pos in enumerate(cfg.fact_positions):
    fact_mask[f, pos : pos + cfg.fact_span] = True
  active = np.zeros((MAX_FACTS, cfg.gen_steps), bool)
  for f, (start, end) in enumerate(cfg.fact_steps):
    active[f, start:end] = True
  depth = np.linspace(0.0, 1.0, cfg.num_layers) if cfg.num_layers > 1 else np.zeros(1)
  beta = cfg.beta_bottom + (cfg.beta_top - cfg.beta_bottom) * depth
  noise, roles, values_LHTD = _random_tables(_draw_config(cfg), values, jax.random.key(cfg.seed))
  weights = _weights(_weights_config(cfg), roles)
  # scaled and added op by op: in one program with the draw, XLA:CPU folds the scale into the
  # draw's own factor and contracts multiplies and additions into fused multiply-adds, so some
  # values would move by an ulp or two from every world built before
  salience = cfg.salience_scale * noise
  salience = salience + cfg.fact_salience * jnp.asarray(fact_mask.any(0), jnp.float32)[None, None]
  if cfg.drift_step >= 0:
    start = cfg.prompt_len + cfg.drift_step
    drift = np.zeros(T, np.float32)
    drift[start : start + cfg.drift_tokens] = cfg.drift_salience
    salience = salience + jnp.asarray(drift)[None, None]
  return World(
    num_sinks=jnp.asarray(cfg.num_sinks, jnp.int32),
    recency_tau=jnp.asarray(cfg.recency_tau, jnp.float32),
    preview=jnp.asarray(cfg.preview, jnp.float32),
    salience_LHT=salience.astype(jnp.float32),
    beta_L=jnp.asarray(beta, jnp.float32),
    weights_LH4=weights,
    roles_LH=roles,
    fact_mask_FT=jnp.asarray(fact_mask),
    fact_active_FS=jnp.asarray(active),
    fact_preview_F=jnp.asarray(active.any(1)),
    values_LHTD=values_LHTD,
    dims=Dims(
      cfg.num_layers, cfg.num_heads, cfg.prompt_len, cfg.gen_steps, cfg.head_dim, cfg.window
    ),
  )


# The fields each compiled table program reads: every other field is reset to its default, so
# the scenarios of one world size share the random draw's program (the slowest to compile).
_DRAW_FIELDS = ("num_layers", "num_heads", "prompt_len", "gen_steps", "head_dim", "role_fractions")
_WEIGHT_FIELDS = ("num_layers", "num_heads", *MIXTURE_WEIGHTS, "sink_funnel", "role_boost")


def _draw_config(cfg: WorldConfig) -> WorldConfig:
  return WorldConfig(**{f: getattr(cfg, f) for f in _DRAW_FIELDS})


def _weights_config(cfg: WorldConfig) -> WorldConfig:
  return WorldConfig(**{f: getattr(cfg, f) for f in _WEIGHT_FIELDS})


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_tables(cfg: WorldConfig, values: bool, key: Array) -> tuple:
  """:func:`make_world`'s drawn tables from the seed's ``key`` (``cfg.seed`` is not read): the
  salience's standard normal draw ``[L, H, T]``, the roles and the values."""
  L, H, T = cfg.num_layers, cfg.num_heads, cfg.total_len
  k_sal, k_roles, k_val = jax.random.split(key, 3)
  roles = _roles(cfg, k_roles)
  values_LHTD = jax.random.normal(k_val, (L, H, T, cfg.head_dim if values else 0), jnp.float32)
  return jax.random.normal(k_sal, (L, H, T)), roles, values_LHTD


@functools.partial(jax.jit, static_argnums=0)
def _weights(cfg: WorldConfig, roles_LH: Array) -> Array:
  """The mixture weights of :func:`_mixture_weights`, compiled per scenario (a small program)."""
  return _mixture_weights(cfg, roles_LH)


def _normalise(x: Array, visible: Array) -> tuple[Array, Array]:
  """Distribution of ``x`` over ``visible`` positions, and whether any mass exists."""
  x = jnp.where(visible, x, 0.0)
  total = x.sum(-1, keepdims=True)
  return x / jnp.where(total > 0, total, 1.0), total[..., 0] > 0


def attention_row(world: World, t: Array) -> Array:
  """Full-cache attention of the query at position ``t`` (traced int): ``[L, H, T]`` float32.

  Each row is non-negative and sums to one over ``i <= t``; positions ``> t`` are zero.
  ``t`` in ``[P - W, P)`` gives observation-window rows (facts previewed), ``t >= P`` generation
  step ``t - P`` (facts active per ``fact_steps``).
  """
  cfg = world.dims
  T = cfg.total_len
  pos = jnp.arange(T)
  visible = jnp.broadcast_to(pos <= t, (cfg.num_layers, cfg.num_heads, T))
  is_sink = jnp.broadcast_to((pos < world.num_sinks).astype(jnp.float32), visible.shape)
  sink, _ = _normalise(is_sink, visible)
  decay = jnp.exp(-(t - pos).astype(jnp.float32) / world.recency_tau)
  recency, _ = _normalise(jnp.broadcast_to(decay, visible.shape), visible)
  step = t - cfg.prompt_len
  in_window = (t >= cfg.prompt_len - cfg.window) & (t < cfg.prompt_len)
  active_F = jnp.where(
    step >= 0,
    world.fact_active_FS[:, jnp.clip(step, 0, cfg.gen_steps - 1)],
    world.fact_preview_F & in_window,
  )
  fact_T = (world.fact_mask_FT & active_F[:, None]).any(0).astype(jnp.float32)
  fact, has_fact = _normalise(jnp.broadcast_to(fact_T, visible.shape), visible)
  logits = world.beta_L[:, None, None] * world.salience_LHT
  background = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  w = world.weights_LH4
  fact_w = jnp.where(has_fact, jnp.where(step >= 0, w[..., 2], world.preview), 0.0)
  sink_w = jnp.where(sink.sum(-1) > 0, w[..., 0], 0.0)
  weights = jnp.stack([sink_w, w[..., 1], fact_w, w[..., 3]], -1)
  weights = weights / weights.sum(-1, keepdims=True)
  comps = jnp.stack([sink, recency, fact, background], -2)
  return jnp.einsum("lhc,lhct->lht", weights, comps, precision=PRECISION)


def window_rows(world: World) -> Array:
  """The observation-window rows ``attn_LHWT``, queries ``P - W`` to ``P - 1``, over all ``T``."""
  cfg = world.dims
  ts = jnp.arange(cfg.prompt_len - cfg.window, cfg.prompt_len)
  rows = jax.lax.map(lambda t: attention_row(world, t), ts)
  return jnp.moveaxis(rows, 0, 2)


def prompt_column_sums(world: World) -> Array:
  """Attention each key receives from all ``P`` causal prompt queries (H2O's prefill evidence)."""
  cfg = world.dims

  def add(acc, t):
    return acc + attention_row(world, t), None

  zeros = jnp.zeros((cfg.num_layers, cfg.num_heads, cfg.total_len), jnp.float32)
  return jax.lax.scan(add, zeros, jnp.arange(cfg.prompt_len))[0]


def active_fact_positions(world: World, step: Array) -> Array:
  """Bool ``[T]``: the positions of the facts queried at generation step ``step``."""
  active_F = world.fact_active_FS[:, step]
  return (world.fact_mask_FT & active_F[:, None]).any(0)


def policy_problem(policy, refusals, provided: frozenset[str], provider: str) -> str | None:
  """The first reason a world cannot serve ``policy``, or ``None``.

  Args:
    policy: a :class:`kvjax.policies.Policy` object.
    refusals: ``(refused, why)`` pairs, in order: ``why`` is the reason when ``refused(policy)``.
    provided: the evidence fields the world provides.
    provider: what provides them, named in the reason, e.g. ``"the lab"``.

  Returns:
    The first refusal's reason; else, for a policy that reads an evidence field outside
    ``provided``, one naming those fields; else ``None``.
  """
  for refused, why in refusals:
    if refused(policy):
      return why
  missing = sorted(policy.evidence_fields - provided)
  if missing:
    fields = ", ".join(f"evidence.{f}" for f in missing)
    return f"it reads {fields}, which {provider} does not provide"
  return None


# --------------------------------------------------------------------------- scenarios

SCENARIOS: dict[str, dict] = {
  # chat: strong sinks, moderate recency, light facts
  "streaming_chat": dict(
    sink_weight=0.35, recency_weight=0.4, fact_weight=0.1, background_weight=0.15
  ),
  # long-context QA: far-back needles queried during generation and previewed by the question
  "needle_qa": dict(
    sink_weight=0.15,
    recency_weight=0.25,
    fact_weight=0.5,
    background_weight=0.1,
    preview=0.5,
    fact_positions=(40, 200, 330),
    fact_steps=((5, 40), (50, 85), (95, 125)),
  ),
  # diffuse: attention spread broadly and mostly local, weak sinks and facts
  "diffuse": dict(
    sink_weight=0.05,
    recency_weight=0.6,
    fact_weight=0.05,
    background_weight=0.3,
    beta_bottom=0.0,
    beta_top=0.3,
    fact_salience=0.0,
    preview=0.05,
    recency_tau=64.0,
  ),
  # topic drift: prompt facts stop mattering; tokens generated early become the new topic
  "topic_drift": dict(
    sink_weight=0.1,
    recency_weight=0.3,
    fact_weight=0.1,
    background_weight=0.5,
    fact_positions=(100,),
    fact_steps=((0, 16),),
    drift_step=16,
    drift_tokens=4,
    drift_salience=8.0,
    beta_bottom=1.0,
    beta_top=1.5,
  ),
  # funnel: lower layers near uniform, upper layers on sinks and a few critical tokens
  "funnel": dict(
    sink_weight=0.1,
    recency_weight=0.2,
    fact_weight=0.2,
    background_weight=0.5,
    beta_bottom=0.0,
    beta_top=5.0,
    sink_funnel=4.0,
    salience_scale=1.5,
  ),
}


def scenario(name: str, **overrides) -> WorldConfig:
  """The preset ``name`` (see :data:`SCENARIOS`) with ``overrides`` applied, validated."""
  if name not in SCENARIOS:
    raise ValueError(f"scenario: unknown scenario {name!r}; expected one of {tuple(SCENARIOS)}")
  fields = {f.name for f in dataclasses.fields(WorldConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"overrides: unknown world fields {unknown}")
  return validate(dataclasses.replace(WorldConfig(), **dict(SCENARIOS[name], **overrides)))


WORLD_SIZE_FIELDS = (
  "num_layers",
  "num_heads",
  "prompt_len",
  "gen_steps",
  "head_dim",
  "window",
  "seed",
)


def check_world_sizes(world_cfg) -> dict:
  """The size fields of a lab config's ``world``, checked before any world is made.

  Args:
    world_cfg: a mapping of some of :data:`WORLD_SIZE_FIELDS`.

  Returns:
    The sizes as a dict.

  Raises:
    ValueError: naming ``world`` for a field it does not know (a typo would be ignored), or
      ``world.<field>`` for a value that is not a positive int (``seed``: a non-negative one).
  """
  unknown = sorted(set(world_cfg) - set(WORLD_SIZE_FIELDS))
  if unknown:
    raise ValueError(f"world: unknown fields {unknown}; expected some of {WORLD_SIZE_FIELDS}")
  sizes = {k: world_cfg[k] for k in WORLD_SIZE_FIELDS if k in world_cfg}
  for k, v in sizes.items():
    low = 0 if k == "seed" else 1
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
      raise ValueError(f"world.{k}: expected an int >= {low}, got {v!r}")
  return sizes


def _drift_fits(cfg: WorldConfig, S: int) -> bool:
  return int(cfg.drift_step * S / cfg.gen_steps) + cfg.drift_tokens <= S


def world_config(name: str, world_cfg) -> WorldConfig:
  """Scenario ``name``'s preset with the size fields of a lab config (``config.world``).

  Args:
    name: a scenario of :data:`SCENARIOS`.
    world_cfg: a mapping of some of :data:`WORLD_SIZE_FIELDS` (:func:`check_world_sizes`).

  Returns:
    The validated :class:`WorldConfig`.

  Raises:
    ValueError: for an unknown scenario, a size :func:`check_world_sizes` refuses, a
      ``prompt_len`` without room for the scenario's facts before its observation window, a
      ``gen_steps`` too short for its topic drift, or a world :func:`validate` refuses.
  """
  sizes = check_world_sizes(world_cfg)
  cfg = scenario(name)
  # Presets place facts for the default 512-token prompt: rescale them to the requested sizes.
  fields = dict(sizes)
  P = sizes.get("prompt_len", cfg.prompt_len)
  S = sizes.get("gen_steps", cfg.gen_steps)
  W = sizes.get("window", cfg.window)
  if cfg.fact_positions and W <= P < W + cfg.fact_span:
    raise ValueError(
      f"world.prompt_len: {P} leaves no room for the facts of scenario {name!r} before the "
      f"observation window of {W} tokens; expected prompt_len >= {W + cfg.fact_span}"
    )
  if cfg.drift_step >= 0 and not _drift_fits(cfg, S):
    least = next(n for n in range(S, S + cfg.gen_steps + cfg.drift_tokens) if _drift_fits(cfg, n))
    raise ValueError(
      f"world.gen_steps: {S} steps cannot hold the topic drift of scenario {name!r} "
      f"({cfg.drift_tokens} tokens); expected gen_steps >= {least}"
    )
  fields["fact_positions"] = tuple(
    min(int(p * P / cfg.prompt_len), P - W - cfg.fact_span) for p in cfg.fact_positions
  )
  fields["fact_steps"] = tuple(
    (int(a * S / cfg.gen_steps), max(int(b * S / cfg.gen_steps), int(a * S / cfg.gen_steps) + 1))
    for a, b in cfg.fact_steps
  )
  if cfg.drift_step >= 0:
    fields["drift_step"] = int(cfg.drift_step * S / cfg.gen_steps)
  return validate(dataclasses.replace(cfg, **fields))
