"""Online simulation: a policy applied at every generation step of a synthetic world, inside
``lax.scan``, with a fixed-capacity slot table per (layer, head).

Cache semantics (the same for every policy, so budgets compare):

* The prompt (``P`` tokens) is compressed once at the end of prefill by the policy's registry
  entry (:mod:`kvjax.policies`) to its ``budget_LH``.
* At generation step ``s`` (position ``t = P + s``) the new token joins the cache, then the cache
  is cut back to ``budget_LH`` with the information the policy had *before* attending (the new
  token is always kept), and the query attends to exactly ``min(budget, t + 1)`` positions,
  itself included. (Official H2O/TOVA evict after attending with a cache of ``budget - 1``
  old tokens: the same thing.)
* Decode-time policies evict every step: ``sliding_window`` and ``streaming_llm`` by position
  (sinks protected), ``h2o`` by attention accumulated over its own compressed rows (official
  ``H2OKVCache_LayerWise``) with the last ``recent`` tokens on probation (default: half the
  budget, official H2O's 1:1 heavy:recent split), ``tova`` by the
  previous row averaged over heads (``TOVACache``).
* Prefill-time policies (``snapkv``, ``pyramidkv``, ``adakv_*``, ``cake``, ``random``) pin the
  prompt positions their vote selected and keep a rolling recent window (the essay's
  "high-vote prompt positions plus a rolling recent window").
* ``oracle`` keeps the top ``b`` of the true current row (not realisable; the upper bound).
* Attention-free prefill scorers (``knorm``, ``keydiff``, ``lagkv``) read the world's *modelled*
  keys (:mod:`kvjax.lab.keys`, a stated hypothesis, not measured keys) and its values over the
  prompt (:func:`key_evidence`); like every prefill policy they pin what they selected and roll
  the rest. They protect no observation window, so unlike SnapKV their recent tokens are only
  those they happened to select.

Selection always goes through :mod:`kvjax.select`. Rows are generated inside the scan, so no
``[L, H, S, T]`` array exists; the cache map ``[S, L, H, C]`` is recorded on request.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies, select
from kvjax import scores as scores_lib
from kvjax.lab import keys as keys_lib
from kvjax.lab import metrics as metrics_lib
from kvjax.lab import synthetic

Array = jax.Array

LAB_POLICIES = policies.replayable()


@struct.dataclass
class Trace:
  """What a simulation produced: per-step metrics ``[S, L, H]`` and, optionally, the cache map."""

  metrics: metrics_lib.StepMetrics
  budget_LH: Array
  positions_SLHC: Array | None = None
  valid_SLHC: Array | None = None


@struct.dataclass
class _Slots:
  pos: Array  # [L, H, C] int32 original positions
  valid: Array  # [L, H, C] bool
  aux: Array  # [L, H, C] float32: accumulated attention (h2o), last row (tova), pinned (prefill)


@jax.jit
def prompt_evidence(world: synthetic.World, rng: Array) -> policies.Evidence:
  """What prefill can observe: the observation-window rows and H2O's prompt column sums, both
  over the ``P`` prompt positions (compute once per world, share across policies)."""
  P = world.dims.prompt_len
  return policies.Evidence(
    attn_window_LHWT=synthetic.window_rows(world)[..., :P],
    column_sums_LHT=synthetic.prompt_column_sums(world)[..., :P],
    rng=rng,
  )


def needs_keys(name: str) -> bool:
  """Whether policy ``name`` reads keys or values (the lab then models them, :mod:`.keys`)."""
  return bool({"keys_LGTD", "values_LGTD"} & set(policies.spec(name).needs))


def key_evidence(
  world: synthetic.World,
  evidence: policies.Evidence,
  geometry: keys_lib.KeyGeometry | None = None,
  *,
  seed: int = 0,
) -> policies.Evidence:
  """``evidence`` with the prompt's modelled keys and the world's values, ``keys_LGTD`` and
  ``values_LGTD`` ``[L, H, P, D]`` (lab heads are KV heads), for the attention-free scorers.
  ``geometry`` is the key model's knobs (default :class:`~kvjax.lab.keys.KeyGeometry`);
  ``seed`` should be the world's seed."""
  P = world.dims.prompt_len
  keys_LHTD = keys_lib.world_keys(world, geometry, seed=seed)
  return evidence.replace(
    keys_LGTD=keys_LHTD[..., :P, :], values_LGTD=world.values_LHTD[..., :P, :]
  )


def check_budget(world: synthetic.World, budget_LH) -> np.ndarray:
  """A concrete ``[L, H]`` budget that fits the world, or ``ValueError`` naming ``budget``."""
  cfg = world.dims
  b = np.asarray(budget_LH)
  if b.shape != (cfg.num_layers, cfg.num_heads):
    raise ValueError(f"budget: shape {b.shape}, expected [L={cfg.num_layers}, H={cfg.num_heads}]")
  if b.min() < 1:
    raise ValueError(f"budget: {int(b.min())} < 1; the current token always needs a slot")
  if b.max() > cfg.total_len:
    raise ValueError(
      f"budget: {int(b.max())} is larger than the world (T={cfg.total_len} positions)"
    )
  return b


def allocate(world: synthetic.World, policy: policies.Policy, budget, evidence=None) -> Array:
  """The policy's ``budget_LH`` on this world's prompt (PyramidKV, Ada-KV, CAKE allocate; the
  others broadcast ``budget``)."""
  evidence = prompt_evidence(world, jax.random.key(0)) if evidence is None else evidence
  scores = policy.scores(evidence)
  return policy.budgets(evidence, scores, budget)


def simulate(
  world: synthetic.World,
  name: str,
  budget,
  *,
  capacity: int | None = None,
  record_map: bool = False,
  seed: int = 0,
  evidence: policies.Evidence | None = None,
  geometry: keys_lib.KeyGeometry | None = None,
  **options,
) -> Trace:
  """Runs policy ``name`` (a :data:`LAB_POLICIES` registry name) over the world's generation.

  ``budget`` is a scalar, ``[L]`` or ``[L, H]`` per-head budget (window and sinks included);
  allocating policies turn it into their own ``budget_LH``. ``capacity`` (static slot count)
  defaults to the largest budget. Pass ``evidence`` (:func:`prompt_evidence`) to share the
  prefill evidence across policies; ``seed`` seeds the random policy and the modelled keys.
  A policy that reads keys (:func:`needs_keys`) gets them from :func:`key_evidence` under
  ``geometry`` when ``evidence`` has none or ``geometry`` is given; otherwise it reads the keys
  already in ``evidence``.
  """
  if name not in LAB_POLICIES:
    raise ValueError(
      f"name: policy {name!r} is not simulated in the lab; expected one of {LAB_POLICIES}"
    )
  recent = options.pop("recent", None) if name == "h2o" else None
  policy = policies.make(name, **options)
  if evidence is None:
    evidence = prompt_evidence(world, jax.random.key(seed))
  if needs_keys(name) and (evidence.keys_LGTD is None or geometry is not None):
    evidence = key_evidence(world, evidence, geometry, seed=seed)
  if not policies.allocates(name):
    L, H = world.dims.num_layers, world.dims.num_heads
    budget_LH = policies.as_budget_LH(budget, L, H)
  else:
    budget_LH = allocate(world, policy, budget, evidence)
  b = check_budget(world, budget_LH)
  capacity = int(b.max()) if capacity is None else int(capacity)
  if capacity < b.max():
    raise ValueError(f"capacity: {capacity} is smaller than the largest budget {int(b.max())}")
  # Official H2O splits the cache 1:1 between heavy hitters and recent tokens
  # (heavy_ratio = recent_ratio); KVCache-Factory's recent=8 is a prefill-only setting.
  recent_LH = b // 2 if recent is None else np.full(b.shape, recent)
  if np.any(recent_LH < 0) or np.any(recent_LH > b):
    raise ValueError(f"recent: expected 0 <= recent <= budget, got {recent!r}")
  return _simulate(
    world,
    policy,
    jnp.asarray(b, jnp.int32),
    jnp.asarray(recent_LH, jnp.int32),
    evidence,
    capacity,
    record_map,
  )


@functools.partial(jax.jit, static_argnames=("policy", "capacity", "record_map"))
def _simulate(world, policy, budget_LH, recent_LH, evidence, capacity, record_map):
  cfg = world.dims
  slots = _prefill(world, policy, budget_LH, recent_LH, evidence, capacity)

  def step(slots, s):
    t = cfg.prompt_len + s
    row = synthetic.attention_row(world, t)
    if policy.name == "oracle":
      pos, valid = select.compact(row, budget_LH, capacity, length=jnp.full(budget_LH.shape, t + 1))
      slots = _Slots(pos, valid, slots.aux)
    else:
      slots = _evict(policy, slots, budget_LH, recent_LH, t, capacity)
    fact_T = synthetic.active_fact_positions(world, s)
    m, a_hat = metrics_lib.step_metrics(
      row, world.values_LHTD, slots.pos, slots.valid, budget_LH, fact_T, capacity
    )
    slots = _observe(policy, slots, a_hat, cfg.total_len)
    out = (m, slots.pos, slots.valid) if record_map else (m,)
    return slots, out

  _, outs = jax.lax.scan(step, slots, jnp.arange(cfg.gen_steps))
  if record_map:
    return Trace(outs[0], budget_LH, outs[1], outs[2])
  return Trace(outs[0], budget_LH)


def _prefill(world, policy, budget_LH, recent_LH, evidence, capacity) -> _Slots:
  """Compresses the prompt with the policy's own scores; sets the per-slot state."""
  P = world.dims.prompt_len
  if policy.name == "oracle":
    L, H = budget_LH.shape
    zeros = jnp.zeros((L, H, capacity), jnp.int32)
    return _Slots(zeros, zeros > 0, jnp.zeros(zeros.shape, jnp.float32))
  if policy.name == "h2o":
    scores_LHT = scores_lib.h2o_from_column_sums(evidence.column_sums_LHT, recent=recent_LH)
  else:
    scores_LHT = policy.scores(evidence)
  pos, valid = select.compact(scores_LHT, budget_LH, capacity)
  gather = functools.partial(jnp.take_along_axis, indices=pos, axis=-1)
  if policy.name == "h2o":
    aux = gather(evidence.column_sums_LHT)
  elif policy.name == "tova":
    aux = gather(scores_LHT)
  elif not policies.acts_at_decode(policy.name):
    window = policy.opts.get("window") or world.dims.window
    aux = (pos < P - window).astype(jnp.float32)  # pinned by the vote; the window rolls
  else:
    aux = jnp.zeros(pos.shape, jnp.float32)
  return _Slots(pos, valid, jnp.where(valid, aux, 0.0))


def _evict(policy, slots: _Slots, budget_LH, recent_LH, t, capacity) -> _Slots:
  """Keeps each row's best ``budget - 1`` slots (by what the policy knew before step ``t``) and
  admits token ``t`` into the next free slot: the new token is always cached, even when
  protected tokens (sinks, probation, pins) alone could fill the budget."""
  pos, valid, aux = slots.pos, slots.valid, slots.aux
  recency = pos.astype(jnp.float32)
  opts = policy.opts
  if policy.name == "streaming_llm":
    score = jnp.where(pos < opts["sinks"], jnp.inf, recency)
  elif policy.name == "h2o":
    score = jnp.where(pos > t - recent_LH[..., None], jnp.inf, aux)
  elif policy.name == "tova":
    score = aux
  elif not policies.acts_at_decode(policy.name):
    score = jnp.where(aux > 0, jnp.inf, recency)
  else:
    score = recency
  score = jnp.where(valid, score, -jnp.inf)
  room = jnp.minimum(budget_LH - 1, valid.sum(-1))
  idx, kept = select.compact(score, room, capacity)  # ascending positions, valid slots first
  take = functools.partial(jnp.take_along_axis, indices=idx, axis=-1)
  new_slot = jax.nn.one_hot(room, capacity, dtype=bool)  # the first free slot after the kept
  pos = jnp.where(new_slot, t, jnp.where(kept, take(pos), 0))
  aux = jnp.where(kept, take(aux), 0.0)
  return _Slots(pos.astype(jnp.int32), kept | new_slot, aux)


def _observe(policy, slots: _Slots, a_hat_LHC, total_len) -> _Slots:
  """Decode-time evidence update after attending: H2O accumulates, TOVA remembers the row."""
  if policy.name == "h2o":
    return slots.replace(aux=slots.aux + a_hat_LHC)
  if policy.name == "tova":
    L, H, C = slots.pos.shape
    dense = jnp.zeros((L, H, total_len), jnp.float32)
    dense = dense.at[jnp.arange(L)[:, None, None], jnp.arange(H)[None, :, None], slots.pos].add(
      jnp.where(slots.valid, a_hat_LHC, 0.0)
    )
    mean_LT = dense.mean(1)
    row = jnp.take_along_axis(jnp.broadcast_to(mean_LT[:, None, :], dense.shape), slots.pos, -1)
    return slots.replace(aux=jnp.where(slots.valid, row, 0.0))
  return slots
