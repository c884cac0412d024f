"""Greedy (or sampled) generation with a compressed cache, and one prefill shared by many
budget configurations (compress + decode vmapped over configurations)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import llama, sharding
from kvjax.model.config import ModelConfig

Array = jax.Array


@dataclasses.dataclass
class Generation:
  tokens: np.ndarray  # [B, N] (or [K, B, N] for K configurations)
  memory: dict  # cache bytes, and the full cache's for comparison
  budget_LH: np.ndarray  # the allocation actually used, per batch row


def to_left_padding(input_ids: np.ndarray, attention_mask: np.ndarray, pad_id: int = 0):
  """Right- (or mixed-) padded rows moved so every row's real tokens end at the last column."""
  ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
  out_ids, out_mask = np.full_like(ids, pad_id), np.zeros_like(mask)
  for r in range(ids.shape[0]):
    real = ids[r][mask[r]]
    if real.size:
      out_ids[r, -real.size :], out_mask[r, -real.size :] = real, True
  return out_ids, out_mask.astype(np.int32)


def check_policy(policy: policies.Policy | str, options: dict | None = None) -> policies.Policy:
  """The policy that generating with ``policy`` (an object, or a registered name such as
  ``"full"``) and ``options`` would use, or the ``ValueError`` it would raise, before any model
  is loaded (:func:`kvjax.policies.build`)."""
  return policies.build(policy, **dict(options or {}))


@functools.partial(jax.jit, static_argnames=("cfg", "request"))
def _prefill(cfg, params, ids, mask, request: policies.EvidenceRequest):
  """The jitted prefill: one compile per shape and (static, hashable) evidence request."""
  return llama.prefill(cfg, params, ids, mask, request)


def check_evidence(policy: policies.Policy, evidence, cfg: ModelConfig, input_ids, attention_mask):
  """The caller's data evidence for ``policy`` on a batch (``qfilters_LGD``,
  ``retrieval_heads_LG``, HeadKV's ``head_scores_LH``, ``reconstruction_attn_LGT`` as
  ``[L, B, G, T]`` over the caller's columns, or ``[L, G, T]`` for every row), moved to the left
  padding the model runs with; ``ValueError`` when a field the policy needs is missing or has
  the wrong shape."""
  ids = np.asarray(input_ids)
  B, T = ids.shape
  given = {} if evidence is None else evidence
  if not isinstance(given, dict):
    raise ValueError(f"evidence: expected a dict of evidence fields, got {type(given).__name__}")
  data = set(cache_lib.SHARED_EVIDENCE) | set(cache_lib.ROW_EVIDENCE)
  unknown = sorted(set(given) - data)
  if unknown:
    raise ValueError(
      f"evidence: {unknown} are not caller-given evidence; expected some of {sorted(data)} "
      "(the model computes the rest)"
    )
  _check_head_scores(policy, given.get("head_scores_LH"))
  missing = sorted((policy.evidence_fields & data) - {k for k, v in given.items() if v is not None})
  if missing:
    raise ValueError(
      f"evidence: policy {policy.label!r} needs {missing}; pass evidence={{...}} "
      "(kvjax.model.calibrate computes them from the model)"
    )
  out = dict(given)
  recon = out.get("reconstruction_attn_LGT")
  if recon is not None:
    arr = np.asarray(recon, np.float32)
    L, G = cfg.num_layers, cfg.num_kv_heads
    if arr.shape == (L, G, T):
      arr = np.broadcast_to(arr[:, None], (L, B, G, T))
    if arr.shape != (L, B, G, T):
      raise ValueError(
        f"evidence: reconstruction_attn_LGT has shape {arr.shape}, expected [L, B, G, T] = "
        f"{(L, B, G, T)} or [L, G, T] = {(L, G, T)}"
      )
    mask = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    moved = np.zeros_like(arr)
    for r in range(B):  # the columns to_left_padding moves
      real = np.flatnonzero(mask[r])
      if real.size:
        moved[:, r, :, T - real.size :] = arr[:, r][..., real]
    out["reconstruction_attn_LGT"] = moved
  L, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  cache_lib.check_evidence(out, L=L, B=B, G=G, T=T, D=D, Hq=cfg.num_heads)
  return out or None


@functools.partial(jax.jit, static_argnames=("cfg", "spec0"))
def _allocation(cfg, pre, spec0, budget, evidence=None):
  """Every row's ``budget_LH`` (to size the cache before compressing), compiled once per shape:
  budgets are traced data."""
  spec = dataclasses.replace(spec0, capacity=1)
  return cache_lib.compress(cfg, pre, spec, budget, evidence=evidence).budget


def capacity_bucket(n: int) -> int:
  """``n`` slots rounded up to one of four sizes per octave (at least 8): a new largest budget
  rarely changes the cache's static shape, so it rarely compiles the decoder again, and the
  buffer is at most 25 % larger than needed."""
  if n <= 8:
    return 8
  quantum = 1 << max(int(n - 1).bit_length() - 3, 0)
  return -(-n // quantum) * quantum


def _check_head_scores(policy: policies.Policy, head_scores) -> None:
  """HeadKV needs positive head importances: all-zero scores would silently leave every head
  with only its window (any policy that reads ``head_scores_LH``)."""
  if "head_scores_LH" not in policy.evidence_fields:
    return
  if head_scores is None:
    raise ValueError(
      f"head_scores: policy {policy.label!r} (HeadKV's allocation) needs per-head importance "
      "scores; pass evidence={'head_scores_LH': [L, H] scores}"
    )
  arr = np.asarray(head_scores, np.float64)
  if arr.ndim != 2 or not np.isfinite(arr).all() or (arr < 0).any() or arr.sum() <= 0:
    raise ValueError(
      f"head_scores: expected finite non-negative [L, H] scores with a positive sum, got "
      f"shape {arr.shape}, sum {arr.sum() if arr.size else 0.0}"
    )


def _check_overflow(cache) -> None:
  if cache.overflow is not None and bool(np.asarray(cache.overflow).any()):
    raise RuntimeError("cache: a row needed more slots than the capacity; tokens would be lost")


def _capacity(policy: policies.Policy, budget_max: int, T: int, new: int) -> int:
  """Slots per row: the largest budget rounded up to a :func:`capacity_bucket` (never past what
  the sequence can fill), plus the generated tokens for prefill-time policies."""
  if not policy.requires_budget:  # the full cache
    return T + new
  every = policy.decode_every
  if every:  # re-compressed to the budget every `every` tokens: at most budget + every
    return min(min(capacity_bucket(budget_max), T + new) + min(every, new), T + new)
  if policy.evicts_each_step:
    return max(min(capacity_bucket(budget_max), T + new), 1)
  return min(capacity_bucket(budget_max), T) + new


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "new", "temperature"))
def _compress_and_decode(cfg, params, pre, spec, budget, first, new, temperature, rng, evidence):
  """The compiled core of :func:`generate`: compress the prefill ``pre`` under ``budget`` (traced
  data) into a cache of ``spec``, then decode ``new`` tokens from ``first``. Tokens ``[B, new]``
  and the final cache. ``evidence``: caller-given data fields (:func:`check_evidence`)."""
  cache = cache_lib.compress(cfg, pre, spec, budget, rng=rng, evidence=evidence)
  B, T = pre.valid.shape
  start_pos = pre.valid.sum(-1).astype(jnp.int32)  # next RoPE position per row

  def step(carry, i):
    cache, token, rng = carry
    rng, sub = jax.random.split(rng)
    logits, cache = cache_lib.decode_step(
      cfg, params, spec, cache, token, start_pos + i, T + i, step=i
    )
    return (cache, _pick(logits, temperature, sub), rng), token

  (cache, last, _), tokens = jax.lax.scan(step, (cache, first, rng), jnp.arange(new - 1))
  tokens = jnp.concatenate([tokens, last[None]], 0) if new > 1 else first[None]
  return tokens.T, cache


def _pick(logits_BV, temperature, rng):
  if temperature == 0:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  return jax.random.categorical(rng, logits_BV / temperature).astype(jnp.int32)


def check_token_ids(name: str, ids, vocab_size: int, *, min_len: int = 1) -> np.ndarray:
  """``ids`` as an int32 ``[batch, T]`` array, or a ``ValueError`` naming ``name``: integer ids
  in ``[0, vocab_size)`` (a gather would silently clamp or wrap anything else), at least one row
  and ``min_len`` columns."""
  arr = np.asarray(ids)
  if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < min_len:
    raise ValueError(
      f"{name}: expected [batch >= 1, T >= {min_len}] token ids, got shape {arr.shape}"
    )
  if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
    raise ValueError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = arr.min() if arr.min() < 0 else arr.max()
    raise ValueError(f"{name}: token id {int(bad)} is outside the vocabulary [0, {vocab_size})")
  return arr.astype(np.int32)


def _check_mask(attention_mask, shape) -> np.ndarray:
  """A 0/1 mask of ``shape`` with at least one real token per row."""
  if attention_mask is None:
    return np.ones(shape, np.int32)
  mask = np.asarray(attention_mask)
  if mask.shape != shape:
    raise ValueError(f"attention_mask: shape {mask.shape}, expected {shape}")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("attention_mask: expected 0/1 (or bool) values")
  empty = np.flatnonzero(mask.sum(-1) == 0)
  if empty.size:
    raise ValueError(
      f"attention_mask: row {int(empty[0])} has no real token; there is nothing to continue"
    )
  return mask.astype(np.int32)


def _check_temperature(temperature) -> float:
  t = float(temperature)
  if not np.isfinite(t) or t < 0:
    raise ValueError(f"temperature: expected a finite value >= 0 (0 = greedy), got {temperature!r}")
  return t


def _prepare(model, prompt_ids, attention_mask, policy, max_new_tokens):
  """Checks the prompt, then its one prefill for ``policy`` (an object) alone: what the policy's
  :meth:`~kvjax.policies.Policy.evidence_request` asks for, the window rows reduced to its
  scores in the layer scan where it reads them only through its window scorer. Returns
  ``(cfg, params, pre, window)`` with ``window`` the observation window (cut to the prompt)."""
  cfg: ModelConfig = model.cfg
  ids = check_token_ids("prompt_ids", prompt_ids, cfg.vocab_size)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
    raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
  mask = _check_mask(attention_mask, ids.shape)
  ids, mask = to_left_padding(ids, mask)  # left padding whichever side was given
  request = policy.evidence_request(ids.shape[1], reduce_rows=True)
  params = model.params()
  ids, mask = sharding.place_batch(params, ids, mask)  # over the model's mesh, if it has one
  pre = _prefill(cfg, params, ids, mask, request)
  return cfg, params, pre, request.window


def generate(
  model,
  prompt_ids,
  *,
  policy: policies.Policy | str = "full",
  budget=None,
  max_new_tokens: int = 32,
  attention_mask=None,
  temperature: float = 0.0,
  rng=None,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  **policy_options,
) -> Generation:
  """Generates ``max_new_tokens`` per row with ``policy`` (a :class:`kvjax.policies.Policy`, or a
  registered name built once with ``policy_options``) under ``budget`` (per head, window
  included; a scalar, ``[L]`` or ``[L, H]``). ``policy="full"`` (:class:`kvjax.policies.Full`)
  keeps everything.

  The prompt is compressed once after prefill; prefill-time policies then append (no eviction),
  decode-time policies evict as they go within ``budget``. Greedy by default (``temperature``
  0); ``rng`` seeds sampling and the random policy. ``attention_mask`` ``[B, T]`` marks each
  row's real tokens, padded on either side (rows run left-padded). ``layout``: the cache's
  heads (``"kv"`` or ``"query"``) or a :class:`kvjax.model.cache.Layout`; keys keep their
  original positions unless ``Layout(reindex=True)`` numbers them by rank inside the cache
  (official StreamingLLM's pos-shift).

  ``evidence`` holds the data a policy needs from outside the prompt: ``qfilters_LGD``
  ``[L, G, D]`` (Q-Filters), ``retrieval_heads_LG`` ``[L, G]`` (DuoAttention),
  ``reconstruction_attn_LGT`` ``[L, B, G, T]`` or ``[L, G, T]`` over the caller's columns
  (KVzip), as :mod:`kvjax.model.calibrate` computes them, and HeadKV's head importances
  ``head_scores_LH`` (``[L, Hq]``, or ``[L, G]`` at KV-head granularity). Policy options
  ``channel_ratio`` (ThinK's key channels, stored pruned) and ``decode_every=N`` (re-compress
  to the budget every ``N`` generated tokens) apply to any prefill scorer.
  """
  layout = cache_lib.as_layout(layout)
  temperature = _check_temperature(temperature)
  pol = policies.build(policy, **policy_options)
  _check_budget_given(pol, budget)
  cfg, params, pre, window = _prepare(model, prompt_ids, attention_mask, pol, max_new_tokens)
  T = pre.valid.shape[1]
  if pol.requires_budget:
    pol.check_budget(budget, window)
  ev = check_evidence(pol, evidence, cfg, prompt_ids, attention_mask)
  spec = cache_lib.CacheSpec(pol, 1, layout.heads, reindex=layout.reindex)
  cache_lib.check_spec(spec)
  budget_LH = None
  if pol.requires_budget:
    budget_LH = np.asarray(_allocation(cfg, pre, spec, budget, ev))
    pol.check_allocation(budget_LH)
  cap = _capacity(pol, int(budget_LH.max()) if budget_LH is not None else T, T, max_new_tokens)
  spec = dataclasses.replace(spec, capacity=cap, new_tokens=max_new_tokens)
  rng = jax.random.key(0) if rng is None else rng
  rng, first_rng = jax.random.split(rng)
  first = _pick(pre.logits[:, -1], float(temperature), first_rng)
  tokens, cache = _compress_and_decode(
    cfg, params, pre, spec, budget, first, max_new_tokens, float(temperature), rng, ev
  )
  _check_overflow(cache)
  itemsize = cache.keys.dtype.itemsize
  mem = cache_lib.memory(cache) | {
    "full_cache_bytes": cache_lib.full_cache_bytes(
      cfg, tokens.shape[0], T + max_new_tokens, itemsize
    )
  }
  return Generation(np.asarray(tokens), mem, np.asarray(cache.budget))


def _check_budget_given(policy: policies.Policy, budget) -> None:
  """A budget for a compressing policy, none for the full cache."""
  if not policy.requires_budget and budget is not None:
    raise ValueError(
      f"budget: the full cache keeps everything; got budget={budget!r}, expected None"
    )
  if policy.requires_budget and budget is None:
    raise ValueError("budget: required for a compressing policy")


def _check_config_budgets(budgets) -> Array:
  """A leading configuration axis of integer budgets (``[K]``, ``[K, L]`` or ``[K, L, H]``)."""
  arr = np.asarray(budgets)
  if not np.issubdtype(arr.dtype, np.integer) or arr.ndim < 1 or arr.shape[0] < 1:
    raise ValueError(
      "budgets: expected integer budgets with a non-empty leading config axis, "
      f"got {arr.dtype}{arr.shape}"
    )
  if arr.max() >= 2**31 or arr.min() < 0:
    raise ValueError(
      f"budgets: {int(arr.max() if arr.max() >= 2**31 else arr.min())} is outside "
      "[0, 2**31); expected int32 token counts"
    )
  return jnp.asarray(arr, jnp.int32)


def shard_configs(budgets_K: Array, params: dict | None = None) -> tuple[Array, int]:
  """The configuration axis spread over every device (a TPU slice, several GPUs, or forced host
  devices): ``budgets_K`` padded to a multiple of the device count by repeating its last row and
  placed with a ``NamedSharding`` over a one-axis ``Mesh``; the vmapped compress-and-decode then
  runs each device's share (GSPMD partitions it). Returns the budgets and the real ``K``.

  A model placed by :func:`kvjax.model.sharding.shard_model` already spreads its batch and
  weights over the devices: its configurations are replicated on that mesh (one mesh per
  program; GSPMD cannot mix two layouts of the same devices)."""
  devices = jax.devices()
  K = budgets_K.shape[0]
  model_mesh = sharding.model_mesh(params) if params is not None else None
  if model_mesh is not None:
    return jax.device_put(budgets_K, NamedSharding(model_mesh, PartitionSpec())), K
  if len(devices) == 1:
    return budgets_K, K
  padded = -(-K // len(devices)) * len(devices)
  if padded > K:
    extra = jnp.repeat(budgets_K[-1:], padded - K, axis=0)
    budgets_K = jnp.concatenate([budgets_K, extra], axis=0)
  mesh = Mesh(np.asarray(devices), ("k",))
  return jax.device_put(budgets_K, NamedSharding(mesh, PartitionSpec("k"))), K


def _configs_spec(cfg, pol, pre, budgets, window, layout, T, new, evidence):
  """Checks the budgets, then the cache spec (``layout``: a :class:`cache_lib.Layout`) sized for
  every configuration and their allocations ``[K, B, L, H]`` (shared by ``generate_configs``
  and ``answer_configs``)."""
  if pol.requires_budget:
    pol.check_budget(budgets, window)
  spec = cache_lib.CacheSpec(pol, 1, layout.heads, reindex=layout.reindex)
  cache_lib.check_spec(spec)
  alloc = jax.vmap(lambda b: _allocation(cfg, pre, spec, b, evidence))(budgets)
  cap = _capacity(pol, int(np.asarray(alloc).max()), T, new)
  return dataclasses.replace(spec, capacity=cap, new_tokens=new), alloc


def generate_configs(
  model,
  prompt_ids,
  budgets,
  *,
  policy: policies.Policy | str,
  max_new_tokens: int = 32,
  attention_mask=None,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  **policy_options,
) -> Generation:
  """One prefill shared by ``K`` budget configurations (``budgets``: ``[K]``, ``[K, L]`` or
  ``[K, L, H]``): compress + decode are vmapped over configurations, greedy. Tokens
  ``[K, B, N]``. ``policy``, ``attention_mask``, ``layout`` and ``evidence`` as
  :func:`generate`'s."""
  layout = cache_lib.as_layout(layout)
  pol = policies.build(policy, **policy_options)
  cfg, params, pre, window = _prepare(model, prompt_ids, attention_mask, pol, max_new_tokens)
  T = pre.valid.shape[1]
  budgets = _check_config_budgets(budgets)
  ev = check_evidence(pol, evidence, cfg, prompt_ids, attention_mask)
  spec, alloc = _configs_spec(cfg, pol, pre, budgets, window, layout, T, max_new_tokens, ev)
  first = jnp.argmax(pre.logits[:, -1], -1).astype(jnp.int32)
  key = jax.random.key(0)
  run = jax.vmap(
    lambda b: _compress_and_decode(cfg, params, pre, spec, b, first, max_new_tokens, 0.0, key, ev)
  )
  sharded, K = shard_configs(budgets, params)
  tokens, caches = jax.tree.map(lambda x: x[:K], run(sharded))
  _check_overflow(caches)
  itemsize = pre.keys.dtype.itemsize
  held_K = np.asarray(caches.valid).sum(axis=(1, 2, 3, 4)) * 2 * cfg.head_dim * itemsize
  mem = {"kv_bytes_held_per_config": held_K.tolist()}
  return Generation(np.asarray(tokens), mem, np.asarray(alloc))


def keep_mask(
  model,
  input_ids,
  policy: policies.Policy | str,
  budget,
  *,
  attention_mask=None,
  evidence=None,
  **options,
) -> np.ndarray:
  """Which prompt positions ``policy`` (an object, or a name built once with ``options``) keeps
  under ``budget`` on a real prompt: bool ``[L, B, H, T]``, per layer, batch row and head (for
  plots, and parity with other libraries).

  ``H`` is the policy's granularity: query heads by default (the published tables' layout), or
  KV heads with ``num_kv_heads=G`` (scores averaged over each group, as kvpress does). The
  window-based policies observe their ``window`` option's queries (default
  :data:`kvjax.policies.DEFAULT_WINDOW`). Rows are left-padded internally; the mask is returned
  in the caller's column order. ``evidence`` as :func:`generate`'s.
  """
  pol = policies.build(policy, **options)
  cfg, params, pre, obs_window = _prepare(model, input_ids, attention_mask, pol, 1)
  kv = pol.num_kv_heads
  if kv is not None and kv != cfg.num_kv_heads:
    raise ValueError(f"num_kv_heads: {kv} is not the model's {cfg.num_kv_heads} KV heads")
  layout = "kv" if kv is not None else "query"
  T = pre.valid.shape[1]
  if pol.requires_budget:
    pol.check_budget(budget, obs_window)
  ev = check_evidence(pol, evidence, cfg, input_ids, attention_mask)
  spec = cache_lib.CacheSpec(pol, T, layout)
  cache = cache_lib.compress(cfg, pre, spec, budget, evidence=ev)
  _check_overflow(cache)
  return _to_caller_columns(
    np.asarray(cache.positions), np.asarray(cache.valid), input_ids, attention_mask
  )


def _to_caller_columns(positions_LBHC, valid_LBHC, input_ids, attention_mask) -> np.ndarray:
  """Kept slots as a mask over each row's columns as the caller gave them: a slot's position is
  the rank of its token among the row's real tokens (whichever side was padded)."""
  ids = np.asarray(input_ids)
  mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
  L, B, H, _ = positions_LBHC.shape
  out = np.zeros((L, B, H, ids.shape[1]), bool)
  for b in range(B):
    real = np.flatnonzero(mask[b])
    pos, valid = positions_LBHC[:, b], valid_LBHC[:, b]
    lhs = np.nonzero(valid)
    out[lhs[0], b, lhs[1], real[pos[valid]]] = True
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def _stream_logprobs(cfg, params, pre, spec, budget, rest_BS):
  """Feeds ``rest_BS`` one token at a time through the cache compressed from ``pre``; returns
  the log-probability of each fed token given everything before it ``[B, S]``."""
  cache = cache_lib.compress(cfg, pre, spec, budget)
  B, T = pre.valid.shape
  first_logp = jax.nn.log_softmax(pre.logits[:, -1], -1)
  start_pos = pre.valid.sum(-1).astype(jnp.int32)

  def step(carry, i):
    cache, logp_BV = carry
    token = rest_BS[:, i]
    hit = jnp.take_along_axis(logp_BV, token[:, None], -1)[:, 0]
    logits, cache = cache_lib.decode_step(
      cfg, params, spec, cache, token, start_pos + i, T + i, step=i
    )
    return (cache, jax.nn.log_softmax(logits, -1)), hit

  (cache, _), hits = jax.lax.scan(step, (cache, first_logp), jnp.arange(rest_BS.shape[1]))
  return hits.T, cache.overflow


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def _stream_logprobs_configs(cfg, params, pre, spec, budgets_K, rest_BS):
  """:func:`_stream_logprobs` for ``K`` budgets in one scan (vmapped): each token's step reads
  the weights once for every configuration."""
  return jax.vmap(lambda b: _stream_logprobs(cfg, params, pre, spec, b, rest_BS))(budgets_K)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _teacher_forced_logprobs(cfg, params, ids_BT):
  logits = llama.prefill(cfg, params, ids_BT, jnp.ones_like(ids_BT), logits="all").logits
  logp_BTV = jax.nn.log_softmax(logits[:, :-1], -1)
  return jnp.take_along_axis(logp_BTV, ids_BT[:, 1:, None], -1)[..., 0]


def teacher_forced_logprobs(model, input_ids) -> np.ndarray:
  """``[B, T - 1]`` log-probabilities of tokens ``1..T-1`` given the tokens before them, from one
  causal forward: what :func:`stream_logprobs` with ``policy="full"`` reads token by token (an
  uncompressed cache evicts nothing, so the two agree; ``tests/test_decoding.py`` checks it),
  in one pass instead of ``T - 1`` decode steps."""
  ids = check_token_ids("input_ids", input_ids, model.cfg.vocab_size, min_len=2)
  params = model.params()
  (ids,) = sharding.place_batch(params, ids)
  return np.asarray(_teacher_forced_logprobs(model.cfg, params, ids))


def stream_logprobs(
  model,
  input_ids,
  *,
  policy: policies.Policy | str = "full",
  budget=None,
  prefix: int = 1,
  budgets=None,
  **policy_options,
) -> np.ndarray:
  """Teacher-forced log-probabilities of a long text read token by token through a cache:
  ``[B, T - prefix]``, the log-probability of token ``t`` given tokens ``< t`` as the cache
  holds them (StreamingLLM's perplexity experiment, Xiao et al. 2023, Fig. 3).

  The first ``prefix`` tokens are prefilled (and compressed under ``budget``); every later token
  goes through the jitted decode step, where a policy that acts while decoding (a
  :class:`kvjax.policies.DecodePolicy` such as ``sliding_window``, ``streaming_llm``, ``h2o``,
  ``tova``, or one with ``decode_every``) keeps within ``budget`` per head. ``policy`` is an
  object or a name built once with ``policy_options``; ``policy="full"`` keeps every token
  (``budget`` must then be ``None``). ``budgets`` (``[K]``,
  ``[K, L]`` or ``[K, L, H]``, instead of ``budget``) reads the text under ``K`` budgets in one
  scan (vmapped, one compile) and returns ``[K, B, T - prefix]``.
  """
  if budgets is not None and budget is not None:
    raise ValueError(f"budget: give budget or budgets, not both; got budget={budget!r}")
  ids = check_token_ids("input_ids", input_ids, model.cfg.vocab_size, min_len=2)
  if isinstance(prefix, bool) or not isinstance(prefix, int) or not 1 <= prefix < ids.shape[1]:
    raise ValueError(f"prefix: expected an int in [1, T={ids.shape[1]}), got {prefix!r}")
  pol = policies.build(policy, **policy_options)
  if not pol.requires_budget and budget is not None:
    raise ValueError(f"budget: the full cache keeps everything; got budget={budget!r}")
  if pol.requires_budget and not pol.acts_at_decode:
    raise ValueError(
      f"policy: {pol.label!r} selects once after the prompt; a stream needs a policy that acts "
      "while decoding (a decode-time policy such as 'sliding_window', 'streaming_llm', 'h2o', "
      "'tova', or decode_every=N) or the full cache"
    )
  cfg, params = model.cfg, model.params()
  T = ids.shape[1]
  head, rest = jnp.asarray(ids[:, :prefix]), jnp.asarray(ids[:, prefix:])
  request = pol.evidence_request(prefix, reduce_rows=True)
  pre = _prefill(cfg, params, head, jnp.ones_like(head), request)
  if budgets is not None:
    if not pol.requires_budget:
      raise ValueError(f"budgets: the full cache keeps everything; got budgets={budgets!r}")
    budget = _check_config_budgets(budgets)
  if not pol.requires_budget:
    capacity, budget = T, T
  else:
    pol.check_budget(budget, request.window)
    # decode_every (R-KV): the budget, plus the tokens read between two re-compressions
    capacity = int(np.max(budget)) + (pol.decode_every or 0)
  spec = cache_lib.CacheSpec(pol, capacity, "kv")
  if budgets is not None:
    logp, overflow = _stream_logprobs_configs(cfg, params, pre, spec, budget, rest)
    return np.asarray(logp)
  logp, overflow = _stream_logprobs(cfg, params, pre, spec, budget, rest)
  if not pol.requires_budget and bool(np.asarray(overflow).any()):
    raise RuntimeError("cache: the full cache overflowed its capacity")
  return np.asarray(logp)


# --------------------------------------------------------------------------- answers through the cache


@dataclasses.dataclass
class Answers:
  """Per-configuration predictions of an answer, every token predicted from the compressed cache.

  ``predicted [K, B, N]``: greedy tokens at the answer positions (given positions fed from the
  answer); ``logprobs [K, B, N, V]``: teacher-forced log-probabilities there (for KL
  divergences); ``budget_LH [K, B, L, H]``: the allocations.
  """

  predicted: np.ndarray
  logprobs: np.ndarray
  budget_LH: np.ndarray


def decoding_spec(spec: cache_lib.CacheSpec) -> cache_lib.CacheSpec:
  """The spec that decoding from a compressed cache actually depends on: a prefill-time policy
  (no decode-time eviction, no ``decode_every``, no ThinK) only appends during decoding, so every
  such policy decodes with one canonical spec and shares one compiled decoder per shape and
  capacity; decode-time policies keep their own."""
  if spec.decode_time or spec.decode_every or spec.channel_ratio:
    return spec
  return dataclasses.replace(spec, policy=policies.Full())


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def _compress_configs(cfg, pre, spec, budgets_K, evidence=None):
  """The ``K`` compressed caches, one per budget configuration (vmapped)."""
  return jax.vmap(lambda b: cache_lib.compress(cfg, pre, spec, b, evidence=evidence))(budgets_K)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "token_loop", "prefix"))
def _answer_configs(
  cfg, params, spec, caches_K, valid_BT, inputs_BN, given_BN, token_loop=False, prefix=0
):
  """Decodes the answer twice from each of the ``K`` compressed caches (vmapped): greedy (given
  positions fed from the answer) and teacher-forced (every position fed from the answer). Jitted
  apart from the compression, with :func:`decoding_spec`, so that prefill-time policies share
  the compiled decoder; a cache that decoding only appends to is answered without a token loop
  (:func:`_answer_at_once`), a decode-time policy's token by token, both passes in one scan.

  The first ``prefix`` fed tokens (the question) are given in every row, so the two passes feed
  them alike: they go through the cache once, and the passes part after them (the same tokens,
  logits and cache as two full passes; it saves the question's share of the work, about half of
  an evaluation's decoding). With a prefix, the outputs start at its last token, whose
  prediction is the first answer token's: ``N - prefix + 1`` positions."""
  B, T = valid_BT.shape
  start_pos = valid_BT.sum(-1).astype(jnp.int32)
  N = inputs_BN.shape[1]
  P = int(prefix)
  if not 0 <= P <= N:  # the question is fed first: it cannot be longer than what is fed
    raise ValueError(f"prefix: expected 0 <= prefix <= {N} fed tokens, got {prefix}")

  if cache_lib.appends_only(spec) and not token_loop:
    # the K caches as one batch of K * B rows: vmapped over K, each layer scan inside (the
    # question, the teacher-forced pass, every greedy round) would first move K behind the layer
    # axis, a copy of all K caches per call (0.6 s of 2.4 s for a question after 4 x 8 caches
    # of 1,026 slots of SmolLM2); folded, the caches are copied once
    K = caches_K.keys.shape[0]
    tiled = [jnp.tile(x, (K,) + (1,) * (x.ndim - 1)) for x in (start_pos, inputs_BN, given_BN)]
    folded = cache_lib.fold_configs(caches_K)
    greedy, logp, answered = _answer_at_once(cfg, params, spec, folded, *tiled, P)
    overflow = answered.overflow.reshape(K, B)
    return (
      greedy.reshape(K, B, -1),
      logp.reshape(K, B, *logp.shape[1:]),
      dataclasses.replace(caches_K, overflow=overflow),
    )

  def step_of(teacher):
    def step(carry, i):
      cache, prev = carry
      token = jnp.where(teacher | given_BN[:, i], inputs_BN[:, i], prev)
      logits, cache = cache_lib.decode_step(
        cfg, params, spec, cache, token, start_pos + i, T + i, step=i
      )
      pred = jnp.argmax(logits, -1).astype(jnp.int32)
      return (cache, pred), (jax.nn.log_softmax(logits, -1), pred)

    return step

  def one(cache0):
    # the given prefix once, then both passes in one scan (vmapped over `teacher`): each step
    # reads the weights once for both
    (cache1, prev), (logp0, pred0) = jax.lax.scan(
      step_of(True), (cache0, inputs_BN[:, 0]), jnp.arange(P)
    )

    def run(teacher):
      (cache, _), (logp, pred) = jax.lax.scan(step_of(teacher), (cache1, prev), jnp.arange(P, N))
      return cache, logp, pred

    caches, logp, pred = jax.vmap(run)(jnp.asarray([False, True]))
    cache = jax.tree.map(lambda x: x[0], caches)
    overflow = caches.overflow.any(0)
    # from the prefix's last token on (all of them without a prefix)
    greedy = jnp.concatenate([pred0[P - 1 :], pred[0]], axis=0).T
    teacher = jnp.concatenate([logp0[P - 1 :], logp[1]], axis=0).transpose(1, 0, 2)
    return greedy, teacher, dataclasses.replace(cache, overflow=overflow)

  return jax.vmap(one)(caches_K)


def _answer_at_once(cfg, params, spec, cache0, start_pos_B, inputs_BN, given_BN, prefix=0):
  """:func:`_answer_configs` for a cache that decoding only appends to, without feeding tokens
  one by one. The ``prefix`` given tokens and the teacher-forced pass over the rest go in one
  :func:`kvjax.model.cache.extend` call, which also returns the prefix's keys and values. The
  greedy pass is its fixed point (Jacobi decoding): feed ``where(given, answer,
  previous prediction)``, predict every position at once, repeat until the fed tokens stop
  changing. Position ``i``'s prediction depends only on the tokens fed before it, so after ``k``
  rounds the first ``k`` fed tokens are the sequential loop's, and the fixed point (at most
  ``N - prefix`` rounds) is exactly its greedy decode; an answer the model gets right takes no
  round beyond the teacher-forced pass. Returns the cache with appends past its capacity
  flagged. The outputs start at the prefix's last token (see :func:`_answer_configs`)."""
  N = inputs_BN.shape[1]
  P = prefix
  pos_BN = start_pos_B[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]
  kv, prefix_kv = cache_lib.held_kv(spec, cache0), None
  logits, greedy = [], []  # the prefix's last position (if any), then the rest's
  first_B = inputs_BN[:, 0]  # fed first after the prefix unless given: its last prediction
  R = N - P
  fed_BR, given_BR, pos_BR = inputs_BN[:, P:], given_BN[:, P:], pos_BN[:, P:]
  teacher = None  # the teacher-forced pass's logits, when the prefix's call gave them
  if P:
    # with answers after it, the prefix and the teacher-forced pass are one call: every fed
    # token at once (the prefix's keys depend on nothing after them), one pass over the layers
    # and the held cache instead of two (and one program fewer to compile)
    M = N if R else P
    logits_BV, _, fed_kv = cache_lib.extend(
      cfg,
      params,
      (kv,),
      inputs_BN[:, :M],
      pos_BN[:, :M],
      appended=True,
      logits_from=P - 1,  # the prefix's own predictions are not outputs
    )
    prefix_kv = tuple(x[..., :P, :] if x.ndim == 5 else x[..., :P] for x in fed_kv)
    first_B = jnp.argmax(logits_BV[:, 0], -1).astype(jnp.int32)
    logits.append(logits_BV[:, :1])
    greedy.append(first_B[:, None])
    if R:
      teacher = logits_BV[:, 1:]

  def predict(fed):
    held = (kv,) if prefix_kv is None else (kv, prefix_kv)
    return cache_lib.extend(cfg, params, held, fed, pos_BR)[0]

  def feed(pred_BR):  # the sequential loop's token i: the answer's if given, else prediction i-1
    prev_BR = jnp.concatenate([first_B[:, None], pred_BR[:, :-1]], axis=1)
    return jnp.where(given_BR, fed_BR, prev_BR)

  def unsettled(state):
    fed, pred, rounds = state
    return (rounds < R) & jnp.any(feed(pred) != fed)

  def round_(state):
    _, pred, rounds = state
    fed = feed(pred)
    return fed, jnp.argmax(predict(fed), -1).astype(jnp.int32), rounds + 1

  if R:  # the teacher-forced pass, then greedy rounds from its predictions
    logits.append(predict(fed_BR) if teacher is None else teacher)
    pred0 = jnp.argmax(logits[-1], -1).astype(jnp.int32)
    greedy.append(jax.lax.while_loop(unsettled, round_, (fed_BR, pred0, jnp.int32(0)))[1])
  greedy_BN = jnp.concatenate(greedy, axis=1)
  logp_BNV = jax.nn.log_softmax(jnp.concatenate(logits, axis=1), -1)
  fill_LBH = cache0.valid.sum(-1)
  overflow_B = (fill_LBH + N > cache0.valid.shape[-1]).any((0, 2))
  if cache0.overflow is not None:
    overflow_B = overflow_B | cache0.overflow
  return greedy_BN, logp_BNV, dataclasses.replace(cache0, overflow=overflow_B)


QUESTION_MODES = ("in_window", "after", "compressed")


def _check_prefilled_evidence(pol: policies.Policy, prefilled: Prefilled) -> None:
  """``ValueError`` naming ``prefill_answers(needs=...)`` when the shared prefill lacks what the
  policy reads (ExpectedAttention's statistics must also match its ``n_sink``/``n_future``)."""
  wanted, held = pol.evidence_request(prefilled.seen_len), prefilled.request
  fields = {
    "value_out_norms": "value_out_norms_LHT",
    "query_stats": "query_mean_LHD",
    "window_queries": "window_queries_LHWD",
  }
  for arg, field in fields.items():
    if getattr(wanted, arg) and not getattr(held, arg):
      raise ValueError(
        f"prefilled: policy {pol.label!r} needs {field}; prefill with "
        f"prefill_answers(..., needs=({field!r},))"
      )
  if wanted.query_stats:
    for arg in ("n_sink", "n_future"):
      if getattr(wanted, arg) != getattr(held, arg):
        raise ValueError(
          f"prefilled: policy {pol.label!r} wants {arg}={getattr(wanted, arg)}, the prefill used "
          f"{getattr(held, arg)}"
        )


def _future_attention(cfg, params, pre: llama.Prefill, inputs_BM, Tc: int) -> Array:
  """The oracle's evidence: full-cache attention of every query fed through the cache (the
  question and the answer) over the ``Tc`` context positions, ``[L, B, Hq, M, Tc]``, from the
  prefill's own keys and values (:func:`kvjax.model.cache.extend`: the fed tokens only, not a
  second prefill of the whole sequence)."""
  L, B, G = pre.keys.shape[:3]
  valid = jnp.broadcast_to(pre.valid[None, :, None, :Tc], (L, B, G, Tc))
  positions = jnp.broadcast_to(pre.positions[None, :, None, :Tc], (L, B, G, Tc))
  kv = (pre.keys[..., :Tc, :], pre.values[..., :Tc, :], valid, positions)
  pos_BM = (
    pre.positions[:, Tc - 1 : Tc] + 1 + jnp.arange(inputs_BM.shape[1], dtype=jnp.int32)[None, :]
  )
  return _future_attention_jit(cfg, params, kv, inputs_BM, pos_BM)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _future_attention_jit(cfg, params, kv, inputs_BM, pos_BM):
  return cache_lib.extend(cfg, params, (kv,), inputs_BM, pos_BM, probs=True)[1]


def _restrict(pre: llama.Prefill, Tc: int) -> llama.Prefill:
  """Prefill outputs with the key axis cut to the first ``Tc`` positions (the context): the
  question's window rows and attention sums stay as evidence, its keys and values go."""

  def keys_axis(x):
    return None if x is None else x[..., :Tc]

  return pre.replace(
    keys=pre.keys[..., :Tc, :],
    values=pre.values[..., :Tc, :],
    positions=pre.positions[:, :Tc],
    valid=pre.valid[:, :Tc],
    attn_window=keys_axis(pre.attn_window),
    column_sums=keys_axis(pre.column_sums),
    key_norms=keys_axis(pre.key_norms),
    value_out_norms=keys_axis(pre.value_out_norms),
  )


@dataclasses.dataclass(frozen=True)
class Prefilled:
  """Prompts prefilled once, for every policy and budget that will answer them
  (:func:`prefill_answers`): the prefill's outputs cut to the context keys, what is fed through
  the cache afterwards, and the oracle's evidence when asked for."""

  pre: llama.Prefill
  inputs_BM: Array  # the question then the answer but its last token: fed through the cache
  feed_given_BM: Array  # fed from ``inputs_BM`` (else the model's own prediction)
  question_len: int
  window: int  # window rows held in ``pre.attn_window`` (policies may use fewer)
  seen_len: int  # prompt tokens the prefill saw (the whole prompt, or the context)
  future_attn: Array | None = None
  request: policies.EvidenceRequest = llama.NO_EVIDENCE  # the evidence the prefill computed


def prefill_answers(
  model,
  prompt_ids,
  answer_ids,
  *,
  question_len: int = 1,
  question: str = "in_window",
  answer_given=None,
  window: int = policies.DEFAULT_WINDOW,
  oracle: bool = True,
  needs: tuple[str, ...] = (),
) -> Prefilled:
  """The one prefill that :func:`answer_prefilled` answers from under any policy and budget:
  window rows of the last ``window`` queries, H2O's column sums, keys and values, and (with
  ``oracle``) the full-cache attention of the fed queries. See :func:`answer_configs` for
  ``question`` and ``answer_given``. ``needs`` names further :class:`kvjax.policies.Evidence`
  fields to compute (``value_out_norms_LHT``, ``query_mean_LHD``/``query_cov_LHDD`` with
  kvpress's defaults, ``window_queries_LHWD`` for ``window`` queries): the policies that will
  answer list them in their :attr:`~kvjax.policies.Policy.evidence_fields`."""
  needs = tuple(needs)
  policies.EvidenceRequest.for_fields(needs, 0)  # unknown fields fail before any work

  def request(seen_len: int) -> policies.EvidenceRequest:
    return policies.EvidenceRequest.for_fields(needs, min(int(window), seen_len))

  shape = (question_len, question, answer_given)
  return _prefill_shared(model, prompt_ids, answer_ids, shape, int(window), oracle, request)


def _prefill_shared(model, prompt_ids, answer_ids, shape, window, oracle, request_of):
  """:func:`prefill_answers` with the evidence ``request_of(seen_len)`` (besides the shared
  window rows and column sums); ``shape = (question_len, question, answer_given)``."""
  question_len, question, answer_given = shape
  prompt = check_token_ids("prompt_ids", prompt_ids, model.cfg.vocab_size, min_len=2)
  answer = check_token_ids("answer_ids", answer_ids, model.cfg.vocab_size)
  if answer.shape[0] != prompt.shape[0]:
    raise ValueError(
      f"answer_ids: expected [batch={prompt.shape[0]}, N >= 1] token ids, got {answer.shape}"
    )
  if question not in QUESTION_MODES:
    raise ValueError(f"question: expected one of {QUESTION_MODES}, got {question!r}")
  if question == "compressed":
    question_len = 1
  if not 1 <= question_len < prompt.shape[1]:
    raise ValueError(
      f"question_len: expected 1 <= question_len < T={prompt.shape[1]}, got {question_len}"
    )
  given = np.zeros(answer.shape, bool) if answer_given is None else np.asarray(answer_given, bool)
  if given.shape != answer.shape:
    raise ValueError(f"answer_given: shape {given.shape}, expected {answer.shape}")
  prompt, answer = prompt.astype(np.int32), answer.astype(np.int32)
  B = answer.shape[0]
  Tc = prompt.shape[1] - question_len
  seen = prompt if question == "in_window" else prompt[:, :Tc]
  cfg, params = model.cfg, model.params()
  w = min(window, seen.shape[1])
  # every policy's window rows (at most w) and H2O's column sums, plus what the policies ask for
  request = request_of(seen.shape[1]) | policies.EvidenceRequest(window=w, column_sums=True)
  fed = np.concatenate([prompt[:, Tc:], answer[:, :-1]], axis=1)
  feed = np.concatenate([np.ones((B, question_len), bool), given[:, :-1]], 1)
  # over the model's mesh, if it has one
  seen_j, inputs, feed = sharding.place_batch(params, seen, fed, feed)
  full = _prefill(cfg, params, seen_j, jnp.ones_like(seen_j), request)
  future = _future_attention(cfg, params, full, inputs, Tc) if oracle else None
  pre = _restrict(full, Tc)
  return Prefilled(pre, inputs, feed, question_len, w, seen.shape[1], future, request)


def answer_prefilled(
  model,
  prefilled: Prefilled,
  budgets,
  *,
  policy: policies.Policy | str,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  token_loop: bool = False,
  **policy_options,
) -> Answers:
  """Answers under ``K`` budget configurations of ``policy`` (an object, or a name built once
  with ``policy_options``) from one :func:`prefill_answers` (every policy of an evaluation
  shares it; nothing is prefilled here). ``layout`` and ``evidence`` as :func:`generate`'s,
  the evidence over the context's columns. ``token_loop``: feed the answers token by token even
  where decoding only appends and they could go at once (the reference, and the baseline of
  ``experiments/bench_answers.py``; the results are the same)."""
  layout = cache_lib.as_layout(layout)
  budgets = _check_config_budgets(budgets)
  cfg, params = model.cfg, model.params()
  pol = policies.build(policy, **policy_options)
  pre = prefilled.pre
  window = min(pol.observation_window, prefilled.seen_len)
  if not pol.evidence_fields & {"attn_window_LHWT", "window_queries_LHWD"}:
    window = min(window, prefilled.window)  # reads no window rows (ExpectedAttention, ...)
  if window > prefilled.window:
    raise ValueError(
      f"window: policy {pol.label!r} needs {window} window rows, the prefill holds "
      f"{prefilled.window}; prefill with window >= {window}"
    )
  pre = pre.replace(attn_window=pre.attn_window[..., prefilled.window - max(window, 1) :, :])
  _check_prefilled_evidence(pol, prefilled)
  if pre.window_queries is not None:
    pre = pre.replace(
      window_queries=pre.window_queries[:, :, :, prefilled.window - max(window, 1) :]
    )
  if pol.reads_future:
    if prefilled.future_attn is None:
      raise ValueError("prefilled: the oracle needs prefill_answers(..., oracle=True)")
    pre = pre.replace(future_attn=prefilled.future_attn)
  Tc = pre.valid.shape[1]
  M = prefilled.inputs_BM.shape[1]
  ev = check_evidence(pol, evidence, cfg, np.zeros(pre.valid.shape, np.int32), None)
  spec, alloc = _configs_spec(cfg, pol, pre, budgets, window, layout, Tc, M, ev)
  sharded, K = shard_configs(budgets, params)
  caches = _compress_configs(cfg, pre, spec, sharded, ev)
  pred, logp, caches = _answer_configs(
    cfg,
    params,
    decoding_spec(spec),
    caches,
    pre.valid,
    prefilled.inputs_BM,
    prefilled.feed_given_BM,
    token_loop=bool(token_loop),
    prefix=prefilled.question_len,  # the question: given in every row
  )
  # predictions from the last question token on (the answer's; _answer_configs returns those)
  pred, logp, caches = jax.tree.map(lambda x: x[:K], (pred, logp, caches))
  _check_overflow(caches)
  return Answers(np.asarray(pred), np.asarray(logp), np.asarray(alloc))


def answer_configs(
  model,
  prompt_ids,
  answer_ids,
  budgets,
  *,
  policy: policies.Policy | str,
  question_len: int = 1,
  question: str = "in_window",
  answer_given=None,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  **policy_options,
) -> Answers:
  """Predicts ``answer_ids [B, N]`` after ``prompt_ids [B, T]`` under ``K`` budget configurations
  (``budgets``: ``[K]``, ``[K, L]`` or ``[K, L, H]``) with one shared prefill.

  The prompt's last ``question_len`` tokens are the question. The context (the rest) is
  compressed once per budget (vmapped); the question and then the answer are decoded through
  the compressed cache, so *every* answer token is predicted from it. ``question`` says what the
  compression sees:

  * ``"in_window"`` (default): the whole prompt is prefilled, so the policies' evidence (SnapKV's
    observation window, H2O's sums) includes the question, but only context tokens are kept and
    the question is re-fed. Query-aware selection without the leak below.
  * ``"after"``: only the context is prefilled (kvpress's pipeline: query-agnostic compression).
  * ``"compressed"``: the official generate loop of SnapKV and PyramidKV: the question is
    compressed with the context (``question_len`` is then 1: only the last prompt token is
    re-fed). Caveat: question tokens kept in the cache carry what the model already retrieved
    during the full-attention prefill, so a policy can answer while evicting the needle.

  The greedy pass feeds the model's own prediction at each scored answer position and the answer
  at ``answer_given [B, N]`` positions (mqar's query keys); the teacher-forced pass feeds the
  answer everywhere (for KL divergences). Prefill-time policies hold the question tokens beyond
  the budget, like generated ones; decode-time policies (sliding window, StreamingLLM, H2O, TOVA)
  spend their budget on them as on any decoded token. ``policy="oracle"`` uses the full-cache
  attention of exactly the fed queries. ``policy`` (an object, or a name built once with
  ``policy_options``), ``layout`` and ``evidence`` as :func:`generate`'s.

  In ``"in_window"`` mode the evidence is the full prompt's, cut to the context keys: window rows
  keep their original normalisation (their mass on question keys is not redistributed), and
  SnapKV-style policies protect the last ``window`` context positions (the question itself is
  re-fed, so it is always present).
  """
  pol = policies.build(policy, **policy_options)
  shape = (question_len, question, answer_given)
  # the policy's own evidence; at least one window row (the shared prefill always holds some)
  window = max(pol.observation_window, 1)
  prefilled = _prefill_shared(
    model, prompt_ids, answer_ids, shape, window, pol.reads_future, pol.evidence_request
  )
  return answer_prefilled(model, prefilled, budgets, policy=pol, layout=layout, evidence=evidence)
