"""Greedy (or sampled) generation with a compressed cache, and one prefill shared by many
budget configurations (compress + decode vmapped over configurations); the checks and the
jitted prefill that :mod:`kvjax.model.answers` and :mod:`kvjax.model.logprobs` build on."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import llama, restorekv, sharding, stored
from kvjax.model.config import ModelConfig
from kvjax.policies import evidence as evidence_lib

Array = jax.Array


@dataclasses.dataclass
class Generation:
  """What :func:`generate` and :func:`generate_configs` return.

  Attributes:
    tokens: the generated tokens ``[B, N]`` (``[K, B, N]`` for ``K`` configurations).
    memory: the cache's bytes, and the full cache's for comparison.
    budget_LH: the allocation actually used, per batch row.
  """

  tokens: np.ndarray  # [B, N] (or [K, B, N] for K configurations)
  memory: dict  # cache bytes, and the full cache's for comparison
  budget_LH: np.ndarray  # the allocation actually used, per batch row


def to_left_padding(input_ids: np.ndarray, attention_mask: np.ndarray, pad_id: int = 0):
  """Moves right- (or mixed-) padded rows so that every row's real tokens end at the last column.

  Args:
    input_ids: token ids ``[B, T]``.
    attention_mask: the 0/1 (or bool) mask ``[B, T]`` of the real tokens.
    pad_id: the id written at the padded positions.

  Returns:
    ``(ids, mask)``: the left-padded ids and the int32 0/1 mask, both ``[B, T]``.
  """
  ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
  out_ids, out_mask = np.full_like(ids, pad_id), np.zeros_like(mask)
  for r in range(ids.shape[0]):
    real = ids[r][mask[r]]
    if real.size:
      out_ids[r, -real.size :], out_mask[r, -real.size :] = real, True
  return out_ids, out_mask.astype(np.int32)


def check_policy(policy: policies.Policy | str, options: dict | None = None) -> policies.Policy:
  """Builds the policy that generating with ``policy`` and ``options`` would use, before any model.

  The policy is built as the entry points build it (:func:`kvjax.policies.build`), so a policy
  they would refuse fails here before any model is loaded.

  Args:
    policy: a policy object, or a registered name such as ``"full"``.
    options: options for a registered name.

  Returns:
    The policy object.

  Raises:
    ValueError: the error generating would raise for this policy and options.
  """
  return policies.build(policy, **dict(options or {}))


@functools.partial(jax.jit, static_argnames=("cfg", "request"))
def jit_prefill(cfg, params, ids, mask, request: policies.EvidenceRequest):
  """Runs the jitted :func:`kvjax.model.llama.prefill`: one compile per shape and evidence request.

  Args:
    cfg: the model's config (static).
    params: the parameter pytree.
    ids: token ids ``[B, T]``.
    mask: the 0/1 mask ``[B, T]`` of the real tokens.
    request: the evidence to compute (static, hashable).

  Returns:
    The :class:`kvjax.model.llama.Prefill`.
  """
  return llama.prefill(cfg, params, ids, mask, request)


def computed_evidence(model, policy: policies.Policy, evidence, input_ids, attention_mask=None):
  """The caller's evidence and every kind ``policy`` reads that the caller did not give but
  whose declaration computes it from the model (:attr:`kvjax.policies.EvidenceKind.compute`).

  Args:
    model: the model.
    policy: the policy (an object).
    evidence: the caller's ``{kind: array}`` mapping, or ``None``.
    input_ids: the prompt's token ids ``[B, T]``, as the caller gave them.
    attention_mask: the caller's 0/1 mask ``[B, T]`` (``None``: every token is real).

  Returns:
    The mapping with the computed kinds added over the caller's columns (``evidence`` itself
    when nothing is computed).
  """
  if evidence is not None and not isinstance(evidence, dict):
    return evidence  # check_evidence names the type
  given = evidence or {}
  wanted = [
    name
    for name in sorted(policy.evidence_fields)
    if given.get(name) is None and evidence_lib.evidence_kind(name).compute is not None
  ]
  computed = {}
  for name in wanted:
    kind = evidence_lib.evidence_kind(name)
    if kind.resource is not None:  # a trained file the caller loads (the evaluation does)
      continue
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
    computed[name] = np.asarray(kind.compute(model, ids, mask), np.float32)
  return {**given, **computed} if computed else evidence


def check_evidence(
  policy: policies.Policy, evidence, cfg: ModelConfig, input_ids, attention_mask, *, model=None
):
  """Checks the caller's data evidence for ``policy`` on a batch and moves it to left padding.

  The data kinds (:data:`kvjax.model.cache.SHARED_EVIDENCE`, :data:`~kvjax.model.cache.ROW_EVIDENCE`)
  are shared by every row (``qfilters_LGD``, ``retrieval_heads_LG``, HeadKV's ``head_scores_LH``)
  or per row, ``[L, B, ...]`` over the caller's columns or ``[L, ...]`` for every row
  (``reconstruction_attn_LGT``, ``kvzap_LGT``, a kind declared outside kvjax); the per-row
  kinds are moved to the left padding the model runs with. With ``model``, the kinds the policy
  reads that a declaration computes are computed first (:func:`computed_evidence`).

  Args:
    policy: the policy (an object).
    evidence: the caller's ``{field: array}`` mapping, or ``None``.
    cfg: the model's config.
    input_ids: the prompt's token ids ``[B, T]``, as the caller gave them.
    attention_mask: the caller's 0/1 mask ``[B, T]`` (``None``: every token is real).
    model: the model, to compute the kinds that declare a computation (``None``: none).

  Returns:
    The checked evidence with the per-row fields left-padded, or ``None`` when empty.

  Raises:
    ValueError: when a field is not caller-given evidence, a field the policy needs is missing,
      HeadKV's head scores are not finite, non-negative with a positive sum, or a field has the
      wrong shape (:func:`kvjax.model.cache.check_evidence`).
  """
  if model is not None:
    evidence = computed_evidence(model, policy, evidence, input_ids, attention_mask)
  ids = np.asarray(input_ids)
  B, T = ids.shape
  given = {} if evidence is None else evidence
  if not isinstance(given, dict):
    raise ValueError(f"evidence: expected a dict of evidence fields, got {type(given).__name__}")
  data = {**cache_lib.SHARED_EVIDENCE, **cache_lib.ROW_EVIDENCE}
  unknown = sorted(set(given) - set(data) - set(restorekv.FIELDS))
  if unknown:
    raise ValueError(
      f"evidence: {unknown} are not caller-given evidence; expected some of {sorted(data)} "
      "(the prefill computes the other fields a policy reads, but not "
      f"{sorted(UNAVAILABLE_EVIDENCE)}, which no model entry point provides)"
    )
  _check_head_scores(policy, given.get("head_scores_LH"))
  missing = sorted(
    (policy.evidence_fields & set(data)) - {k for k, v in given.items() if v is not None}
  )
  if missing:
    raise ValueError(
      f"evidence: policy {policy.label!r} needs {missing}; pass evidence={{...}} "
      "(kvjax.model.calibrate computes them from the model)"
    )
  L, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  restore = restorekv.check_restore_evidence(policy, given, L=L, B=B, G=G, D=D)
  out = {k: v for k, v in given.items() if k not in restorekv.FIELDS}
  mask = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask, bool)
  sizes = dict(L=L, B=B, G=G, T=T, D=D, Hq=cfg.num_heads)
  for field in cache_lib.ROW_EVIDENCE:
    if out.get(field) is not None:
      out[field] = _row_evidence_left_padded(
        evidence_lib.evidence_kind(field), out[field], sizes, mask
      )
  cache_lib.check_evidence(out, **sizes)
  return {**out, **restore} or None


def _row_evidence_left_padded(kind, value, sizes: dict, mask: np.ndarray) -> np.ndarray:
  """A per-row kind ``[L, B, ...]`` (or ``[L, ...]`` for every row) with each row's real
  columns moved to the left padding the model runs with."""
  B = mask.shape[0]
  arr = np.asarray(value, np.float32)
  shapes = cache_lib.evidence_shapes(kind, **sizes)
  every_row = [s[:1] + s[2:] for s in shapes]
  if arr.shape in every_row:
    arr = np.broadcast_to(arr[:, None], arr.shape[:1] + (B,) + arr.shape[1:])
  if arr.shape not in shapes:
    want = " or ".join(
      f"{s} ([L, B, ...]) or {r} (every row)" for s, r in zip(shapes, every_row, strict=True)
    )
    raise ValueError(f"evidence: {kind.name} has shape {arr.shape}, expected {want}")
  if kind.key_axis is None:
    return np.array(arr)
  # the key axis last, each row's real columns to its end
  last = np.moveaxis(arr, arr.ndim + kind.key_axis, -1)
  moved = np.zeros_like(last)
  T = last.shape[-1]
  for r in range(B):  # the columns to_left_padding moves
    real = np.flatnonzero(mask[r])
    if real.size:
      moved[:, r, ..., T - real.size :] = last[:, r][..., real]
  return np.moveaxis(moved, -1, arr.ndim + kind.key_axis)


# Evidence that no model entry point can give a policy: the prefill does not compute it and
# ``evidence=`` does not take it. Each: what it is, and what to use instead.
UNAVAILABLE_EVIDENCE = {
  "legacy_column_sums_LHT": (
    "KVCache-Factory's legacy non-causal prefill column sums (queries before the window attend "
    "to later keys), which the model's causal prefill does not compute",
    "use 'h2o' (causal column sums, computed by the prefill), or run this policy on arrays: "
    "kvjax.policies.evidence_from_qk computes the legacy sums",
  ),
  "future_attn_LHST": (
    "the attention that tokens after the prompt pay to it, unknown before they are generated",
    "use kvjax.model.answer_configs, which computes it from the answer it is given",
  ),
}


def check_model_evidence(policy: policies.Policy, *, future: bool = False) -> None:
  """Refuses, before any work, a policy that reads evidence a model entry point cannot provide.

  Args:
    policy: the policy (an object).
    future: whether the entry point computes the future attention (the answers do).

  Raises:
    ValueError: naming the policy, the field, what it is and what to use instead.
  """
  for field, (what, instead) in UNAVAILABLE_EVIDENCE.items():
    if field in policy.evidence_fields and not (future and field == "future_attn_LHST"):
      raise ValueError(
        f"policy: {policy.label!r} reads {field}, {what}; it cannot be passed as evidence "
        f"either; {instead}"
      )


@functools.partial(jax.jit, static_argnames=("cfg", "spec0"))
def _allocation(cfg, pre, spec0, budget, evidence=None):
  """Every row's ``budget_LH`` (to size the cache before compressing), compiled once per shape:
  budgets are traced data."""
  spec = dataclasses.replace(spec0, capacity=1)
  return cache_lib.compress(cfg, pre, spec, budget, evidence=evidence).budget


def capacity_bucket(n: int) -> int:
  """Rounds ``n`` slots up to one of four sizes per octave (at least 8).

  A new largest budget then rarely changes the cache's static shape, so it rarely compiles the
  decoder again, and the buffer is at most 25 % larger than needed.

  Args:
    n: the slots needed.

  Returns:
    The bucketed capacity.
  """
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


def check_overflow(cache) -> None:
  """Refuses a cache in which a row needed more slots than its capacity.

  Args:
    cache: the cache (:class:`kvjax.model.cache.KVCache`).

  Raises:
    RuntimeError: when a row of ``cache`` overflowed (tokens would be lost).
  """
  if cache.overflow is not None and bool(np.asarray(cache.overflow).any()):
    raise RuntimeError("cache: a row needed more slots than the capacity; tokens would be lost")


def _capacity(policy: policies.Policy, budget_max: int, T: int, new: int) -> int:
  """Slots per row: the largest budget rounded up to a :func:`capacity_bucket` (never past what
  the sequence can fill), plus the generated tokens for prefill-time policies.

  A policy that re-compresses every ``decode_every`` tokens holds at most its
  :meth:`~kvjax.policies.Policy.decode_capacity` (the largest budget kept across
  re-compressions, plus ``decode_every``)."""
  every = policy.decode_every
  if every:  # re-compressed every `every` tokens: at most the largest kept count + every
    held = policy.decode_capacity(budget_max, T, new) - every
    return min(min(capacity_bucket(held), T + new) + min(every, new), T + new)
  if not policy.requires_budget:  # the full cache
    return T + new
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
  if new > 1:  # the decode loop reads the parameters and cache in its own form
    params, cache = cache_lib.per_layer(spec, params, cache)

  def step(carry, i):
    cache, token, rng = carry
    rng, sub = jax.random.split(rng)
    logits, cache = cache_lib.decode_step(
      cfg, params, spec, cache, token, start_pos + i, T + i, step=i
    )
    return (cache, _pick(logits, temperature, sub), rng), token

  (cache, last, _), tokens = jax.lax.scan(step, (cache, first, rng), jnp.arange(new - 1))
  tokens = jnp.concatenate([tokens, last[None]], 0) if new > 1 else first[None]
  return tokens.T, cache_lib.restacked(cache, spec.capacity)


def _layer_capacity(cfg, policy: policies.Policy, budget, T: int, new: int):
  """Each layer's slots while decoding one buffer per layer (``cache.per_layer``): its own
  largest budget's :func:`_capacity` (``budget``: the allocation, ``[L, H]`` or ``[B, L, H]``),
  so PyramidKV's upper layers read no empty slots. ``None`` (every layer the cache's capacity)
  where that would change nothing, where the allocation depends on the input (Ada-KV, HeadKV,
  CAKE: a capacity per layer would compile the decoder again for each prompt), for layers that
  differ (a sliding layer keeps its window), for re-compressing or channel-pruning policies, and
  off CPU, where the decode loop keeps the stacked cache (``cache.decodes_per_layer``)."""
  if budget is None or cfg.per_layer or policy.decode_every or policy.channel_ratio:
    return None
  if jax.default_backend() != "cpu" or not policy.allocator.from_budget_alone:
    return None
  per_layer = np.asarray(budget).reshape(-1, *budget.shape[-2:]).max((0, 2))
  caps = tuple(_capacity(policy, int(b), T, new) for b in per_layer)
  return None if len(set(caps)) == 1 else caps


def _pick(logits_BV, temperature, rng):
  if temperature == 0:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  return jax.random.categorical(rng, logits_BV / temperature).astype(jnp.int32)


# The largest cache an entry point allocates without being told to: an estimate above it is
# refused before any work (a runaway max_new_tokens would otherwise fill the host's memory for
# minutes). Raise it by assigning kvjax.model.decoding.MAX_CACHE_BYTES.
MAX_CACHE_BYTES = 64 * 2**30


def check_new_tokens(name: str, value) -> int:
  """Checks a count of tokens to generate or feed: an int ``>= 1``.

  Args:
    name: the argument's name, for the error.
    value: the count.

  Returns:
    ``value`` as an ``int``.

  Raises:
    ValueError: naming ``name`` and the value, for anything but an int in ``[1, 2**31)``.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
  if not 1 <= value < 2**31:
    raise ValueError(f"{name}: expected an int in [1, 2**31), got {value}")
  return int(value)


def cache_bytes(cfg: ModelConfig, *, slots: int, batch: int, heads: int, itemsize: int) -> int:
  """Counts the bytes of the keys and values of one cache of ``slots`` slots per head.

  Args:
    cfg: the model's config (layers, head dimension).
    slots: slots per (layer, row, head).
    batch: rows.
    heads: the cache's heads (KV heads, or query heads in the ``"query"`` layout).
    itemsize: bytes per element (:func:`kvjax.model.llama.kv_itemsize`).

  Returns:
    ``layers x 2 x heads x slots x head_dim x itemsize x batch``.
  """
  return cfg.num_layers * 2 * heads * slots * cfg.head_dim * itemsize * batch


def check_cache_bytes(
  cfg: ModelConfig,
  *,
  slots: int,
  batch: int,
  heads: int,
  itemsize: int,
  configs: int = 1,
  prompt_len: int,
  new: tuple[str, int] | None = None,
) -> None:
  """Refuses caches whose keys and values would exceed :data:`MAX_CACHE_BYTES`, before any work.

  Args:
    cfg: the model's config.
    slots: the slots per head each cache is sized to.
    batch: rows per cache.
    heads: the cache's heads.
    itemsize: bytes per element.
    configs: caches held at once (budget configurations).
    prompt_len: the prompt's tokens, for the error.
    new: ``(argument, count)`` of the tokens that grow the cache (``max_new_tokens``), if any.

  Raises:
    ValueError: naming the argument that grows the cache (else ``input_ids``), its value, the
      prompt length, the model's context and the limit, with how to raise it.
  """
  total = configs * cache_bytes(cfg, slots=slots, batch=batch, heads=heads, itemsize=itemsize)
  limit = MAX_CACHE_BYTES
  if total <= limit:
    return
  name, value = new if new is not None else ("input_ids", prompt_len)
  context = "unknown" if cfg.max_positions is None else f"{cfg.max_positions} positions"
  raise ValueError(
    f"{name}: {value} with a prompt of {prompt_len} tokens (model context: {context}) needs "
    f"caches of {slots} slots per head, {configs} configuration(s) x batch {batch}: "
    f"{total / 2**30:.1f} GiB of keys and values, above kvjax.model.decoding.MAX_CACHE_BYTES = "
    f"{limit / 2**30:.1f} GiB; expected fewer tokens, or raise the limit by assigning "
    "kvjax.model.decoding.MAX_CACHE_BYTES"
  )


def cache_heads(cfg: ModelConfig, layout: str) -> int:
  """Counts the cache's heads in ``layout``: query heads for ``"query"``, else KV heads.

  Args:
    cfg: the model's config.
    layout: ``"kv"`` or ``"query"``.

  Returns:
    The number of heads.
  """
  return cfg.num_heads if layout == "query" else cfg.num_kv_heads


def slots_bound(policy: policies.Policy, budget, T: int, new: int) -> int:
  """Bounds the slots per head that decoding after a prompt gives ``policy``, before any work.

  The bound is the cache's size when the allocator keeps the budget as given, the full ``T``
  otherwise (an allocator may give a head up to the prompt).

  Args:
    policy: the policy (an object).
    budget: the budget (already checked).
    T: the prompt's tokens.
    new: the tokens decoded after it.

  Returns:
    An upper bound on the slots per head.
  """
  known = policy.requires_budget and not policy.allocates
  budget_max = int(np.max(budget)) if known and np.size(budget) else T
  return _capacity(policy, budget_max, T, new)


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


def _checked_prompt(model, prompt_ids, attention_mask, new: int, name: str = "prompt_ids"):
  """The prompt's ids and 0/1 mask, checked (ids, mask, and the prompt's longest row plus
  ``new`` tokens within the model's context), as left-padded numpy arrays."""
  cfg: ModelConfig = model.cfg
  ids = llama.check_token_ids(name, prompt_ids, cfg.vocab_size)
  mask = _check_mask(attention_mask, ids.shape)
  longest = int(mask.sum(-1).max())
  llama.check_context(cfg, longest, new, name=name)
  return to_left_padding(ids, mask)  # left padding whichever side was given


def _prefill(model, ids, mask, policy, evidence=None):
  """The prompt's one prefill for ``policy`` (an object) alone: what the policy's
  :meth:`~kvjax.policies.Policy.evidence_request` asks for, the window rows reduced to its
  scores in the layer scan where it reads them only through its window scorer; RestoreKV's
  restore tokens, when the checked ``evidence`` holds them, appended after the prompt
  (:func:`kvjax.model.restorekv.append_restore`). Returns ``(cfg, params, pre, evidence)``."""
  cfg: ModelConfig = model.cfg
  request = policy.evidence_request(ids.shape[1], reduce_rows=True)
  params = model.params()
  ids, mask = sharding.place_batch(params, ids, mask)  # over the model's mesh, if it has one
  pre, evidence = restorekv.append_restore(jit_prefill(cfg, params, ids, mask, request), evidence)
  return cfg, params, pre, evidence


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
  ratio=None,
  **policy_options,
) -> Generation:
  """Generates ``max_new_tokens`` tokens per row through a cache compressed with ``policy``.

  ``policy="full"`` (:class:`kvjax.policies.Full`) keeps everything. The prompt is compressed
  once after prefill; prefill-time policies then append (no eviction), decode-time policies
  evict as they go within ``budget``. Greedy by default (``temperature`` 0); rows run
  left-padded. Keys keep their original positions unless ``Layout(reindex=True)`` numbers them
  by rank inside the cache (official StreamingLLM's pos-shift).

  Policy options ``channel_ratio`` (ThinK's key channels, stored pruned) and ``decode_every=N``
  (re-compress to the budget every ``N`` generated tokens) apply to any prefill scorer.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``.
    policy: a :class:`kvjax.policies.Policy`, or a registered name built once with
      ``policy_options``.
    budget: slots per head, window included: a scalar, ``[L]`` or ``[L, H]`` (``None`` for the
      full cache).
    max_new_tokens: tokens to generate per row.
    attention_mask: ``[B, T]`` 0/1 mask of each row's real tokens, padded on either side.
    temperature: the sampling temperature (0: greedy).
    rng: a PRNG key that seeds sampling and the random policy.
    layout: the cache's heads (``"kv"`` or ``"query"``) or a
      :class:`kvjax.model.cache.Layout`.
    evidence: the data a policy needs from outside the prompt: ``qfilters_LGD`` ``[L, G, D]``
      (Q-Filters), ``retrieval_heads_LG`` ``[L, G]`` (DuoAttention), ``reconstruction_attn_LGT``
      ``[L, B, G, T]`` or ``[L, G, T]`` over the caller's columns (KVzip), as
      :mod:`kvjax.model.calibrate` computes them, and HeadKV's head importances
      ``head_scores_LH`` (``[L, Hq]``, or ``[L, G]`` at KV-head granularity).
    ratio: instead of ``budget``, kvpress's ``compression_ratio``: the fraction of each row's
      prompt tokens removed, each head keeping ``int(T_row * (1 - ratio))`` slots
      (:func:`ratio_budgets`; traced data like a budget).
    **policy_options: options of a registered policy name.

  Returns:
    A :class:`Generation`: tokens ``[B, max_new_tokens]``, the cache's memory (with the full
    cache's for comparison) and the allocation used per row.

  Raises:
    ValueError: before any work, for bad ids (:func:`kvjax.model.llama.check_token_ids`), a
      mask, temperature, layout, budget, policy or evidence it cannot run with, a prompt plus
      ``max_new_tokens`` past the model's context (``cfg.max_positions``), or a cache estimate
      above :data:`MAX_CACHE_BYTES`.
    RuntimeError: when a row needed more slots than its cache held.
  """
  layout = cache_lib.as_layout(layout)
  temperature = _check_temperature(temperature)
  new = check_new_tokens("max_new_tokens", max_new_tokens)
  pol = policies.build(policy, **policy_options)
  check_model_evidence(pol)
  cfg = model.cfg
  ids, mask = _checked_prompt(model, prompt_ids, attention_mask, new)
  B, T = ids.shape
  budget, ev, spec = _checked_run(
    model, pol, budget, ratio, layout, evidence, prompt_ids, attention_mask, mask
  )
  params = model.params()
  itemsize = llama.kv_itemsize(cfg, params)
  check_cache_bytes(
    cfg,
    slots=slots_bound(pol, budget, T, new),
    batch=B,
    heads=cache_heads(cfg, layout.heads),
    itemsize=itemsize,
    prompt_len=T,
    new=("max_new_tokens", new),
  )
  cfg, params, pre, ev = _prefill(model, ids, mask, pol, ev)
  T = pre.valid.shape[1]  # the prompt, and any restore tokens appended
  budget_LH = None
  if pol.requires_budget:
    budget_LH = np.asarray(_allocation(cfg, pre, spec, budget, ev))
    pol.check_allocation(budget_LH)
  cap = _capacity(pol, int(budget_LH.max()) if budget_LH is not None else T, T, new)
  spec = dataclasses.replace(
    spec, capacity=cap, new_tokens=new, layer_capacity=_layer_capacity(cfg, pol, budget_LH, T, new)
  )
  rng = jax.random.key(0) if rng is None else rng
  rng, first_rng = jax.random.split(rng)
  first = _pick(pre.logits[:, -1], float(temperature), first_rng)
  tokens, cache = _compress_and_decode(
    cfg, params, pre, spec, budget, first, new, float(temperature), rng, ev
  )
  check_overflow(cache)
  sliding = llama.is_sliding(cfg) if cfg.per_layer else None
  mem = cache_lib.memory(cache, sliding) | {
    "full_cache_bytes": cache_lib.full_cache_bytes(cfg, tokens.shape[0], T + new, itemsize)
  }
  return Generation(np.asarray(tokens), mem, np.asarray(cache.budget))


def _checked_run(model, pol, budget, ratio, layout, evidence, input_ids, attention_mask, mask):
  """The budget (or the rows' budgets under ``ratio``), the caller's evidence and the cache's
  spec (capacity still 1) of one compression, each checked before any work."""
  T = mask.shape[-1]
  budget = _ratio_or_budget(pol, budget, ratio, mask)
  _check_budget_given(pol, budget)
  if ratio is None:
    budget = _budget_free(pol, budget, T)
  if pol.requires_budget:
    _check_row_budgets(pol, budget, mask, ratio is not None)
  ev = check_evidence(pol, evidence, model.cfg, input_ids, attention_mask, model=model)
  spec = cache_lib.CacheSpec(
    pol,
    1,
    layout.heads,
    reindex=layout.reindex,
    row_budgets=ratio is not None,
    compress_sliding=layout.compress_sliding,
  )
  cache_lib.check_spec(spec)
  return budget, ev, spec


def ratio_budgets(ratio, lengths_B) -> np.ndarray:
  """Each row's budget under kvpress's ``compression_ratio``: ``int(T_row * (1 - ratio))``.

  kvpress 0.5.5 ``kvpress/utils.py::compute_n_kept`` (in float64, as Python computes it), with
  each row's own real tokens as its ``T``.

  Args:
    ratio: the fraction of the prompt removed, a float in ``[0, 1)``.
    lengths_B: each row's real prompt tokens ``[B]``.

  Returns:
    int32 budgets ``[B]``.

  Raises:
    ValueError: for a ratio that is not a real number in ``[0, 1)``.
  """
  expected = "expected a float in [0, 1) (kvpress compression_ratio)"
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
    raise ValueError(f"ratio: {expected}, got {ratio!r}")
  r = float(ratio)
  if not 0.0 <= r < 1.0:
    raise ValueError(f"ratio: {expected}, got {r!r}")
  return np.asarray([int(int(n) * (1 - r)) for n in np.asarray(lengths_B)], np.int32)


def _ratio_or_budget(pol: policies.Policy, budget, ratio, mask):
  """The budget a call runs with: ``budget``, or the rows' budgets under ``ratio``."""
  if ratio is None:
    return budget
  if budget is not None:
    raise ValueError(
      f"ratio: {ratio!r} given with budget {budget!r}; expected a budget or a ratio, not both"
    )
  if not pol.requires_budget:
    raise ValueError(f"ratio: policy {pol.label!r} takes no budget; expected ratio=None")
  return ratio_budgets(ratio, np.asarray(mask).sum(-1))


def _check_row_budgets(pol: policies.Policy, budget, mask, per_row: bool) -> None:
  """The budget check of every entry point; per-row budgets against each row's length."""
  T = np.asarray(mask).shape[-1]
  if not per_row:
    pol.check_budget(budget, pol.evidence_request(T).window, T)
    return
  for n, b in zip(np.asarray(mask).sum(-1), np.asarray(budget), strict=True):
    pol.check_budget(np.asarray(b), pol.evidence_request(int(n)).window, int(n))


@dataclasses.dataclass(frozen=True)
class Answer:
  """What :func:`answer_context` returns.

  Attributes:
    tokens: the generated tokens ``[B, N]`` (greedy).
    logprobs: each generated token's log-probability ``[B, N]`` (fp32).
  """

  tokens: np.ndarray
  logprobs: np.ndarray


_compress_jit = jax.jit(cache_lib.compress, static_argnames=("cfg", "spec"))


def compress_context(
  model,
  context_ids,
  *,
  policy: policies.Policy | str = "full",
  budget=None,
  ratio=None,
  attention_mask=None,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  rng=None,
  **policy_options,
) -> stored.CompressedContext:
  """Prefills and compresses a context once, for questions asked later (kvpress's
  query-agnostic use: the context is compressed before any question is known).

  The result answers any number of questions (:func:`answer_context`), in this process or after
  :meth:`~kvjax.model.stored.CompressedContext.save` and
  :func:`~kvjax.model.stored.load` in another.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: token ids ``[B, T]``, one context per row.
    policy: a policy object, or a registered name built once with ``policy_options``.
    budget: slots per head, window included (``None``: the full cache, or with ``ratio``).
    ratio: instead of ``budget``, kvpress's ``compression_ratio`` (:func:`ratio_budgets`).
    attention_mask: ``[B, T]`` 0/1 mask of each row's real tokens.
    layout: the cache's heads or a :class:`kvjax.model.cache.Layout`.
    evidence: caller-given evidence, as :func:`generate`'s.
    rng: a PRNG key for random policies.
    **policy_options: options of a registered policy name.

  Returns:
    The :class:`kvjax.model.stored.CompressedContext`.

  Raises:
    ValueError: before any work, as :func:`generate`'s, and for ThinK's ``channel_ratio``
      (its generated keys need slots sized at compression).
    RuntimeError: when a row needed more slots than its cache held.
  """
  layout = cache_lib.as_layout(layout)
  pol = policies.build(policy, **policy_options)
  check_model_evidence(pol)
  if pol.channel_ratio:
    raise ValueError(
      f"policy: {pol.label!r} prunes key channels (ThinK), whose generated keys need slots "
      "sized at compression; expected a policy without channel_ratio"
    )
  cfg = model.cfg
  ids, mask = _checked_prompt(model, context_ids, attention_mask, 0, "context_ids")
  B, T = ids.shape
  budget, ev, spec = _checked_run(
    model, pol, budget, ratio, layout, evidence, context_ids, attention_mask, mask
  )
  params = model.params()
  check_cache_bytes(
    cfg,
    slots=slots_bound(pol, budget, T, 0),
    batch=B,
    heads=cache_heads(cfg, layout.heads),
    itemsize=llama.kv_itemsize(cfg, params),
    prompt_len=T,
  )
  cfg, params, pre, ev = _prefill(model, ids, mask, pol, ev)
  T = pre.valid.shape[1]  # the context, and any restore tokens appended
  budget_max = T
  if pol.requires_budget:
    budget_LH = np.asarray(_allocation(cfg, pre, spec, budget, ev))
    pol.check_allocation(budget_LH)
    budget_max = int(budget_LH.max())
  spec = dataclasses.replace(spec, capacity=max(_capacity(pol, budget_max, T, 0), 1))
  rng = jax.random.key(0) if rng is None else rng
  cache = _compress_jit(cfg, pre, spec, budget, rng=rng, evidence=ev)
  check_overflow(cache)
  return stored.CompressedContext(
    cache,
    dataclasses.replace(spec, row_budgets=False),
    np.asarray(restorekv.next_positions(pre)),
    stored.model_fingerprint(cfg, params),
  )


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "new"))
def _answer(cfg, params, spec, cache, question_BQ, next_pos_B, new):
  Q = question_BQ.shape[1]
  params, cache = cache_lib.per_layer(spec, params, cache)  # the form the decode loop reads

  def feed(cache, i):
    pos = next_pos_B + i
    logits, cache = cache_lib.decode_step(
      cfg, params, spec, cache, question_BQ[:, i], pos, pos, step=i
    )
    return cache, logits

  cache, logits_QBV = jax.lax.scan(feed, cache, jnp.arange(Q))

  def gen(carry, i):
    cache, logits = carry
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    token = jnp.argmax(logp, -1).astype(jnp.int32)
    chosen = jnp.take_along_axis(logp, token[:, None], -1)[:, 0]
    pos = next_pos_B + Q + i
    logits, cache = cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos, step=Q + i)
    return (cache, logits), (token, chosen)

  (cache, _), (tokens, logps) = jax.lax.scan(gen, (cache, logits_QBV[-1]), jnp.arange(new))
  return tokens.T, logps.T, cache_lib.restacked(cache)


def answer_context(
  model, context: stored.CompressedContext, question_ids, *, max_new_tokens: int = 32
) -> Answer:
  """Answers a question from a compressed context, without reading the context again.

  The question's tokens are fed one by one through the compressed cache at the positions that
  continue each row's context (as :func:`generate` feeds generated tokens: a prefill-time
  policy appends, a decode-time one evicts within its budget), then ``max_new_tokens`` are
  decoded greedily. ``context`` is not changed: it answers the next question from the same
  compressed state.

  Args:
    model: the model the context was compressed with.
    context: the :class:`kvjax.model.stored.CompressedContext`.
    question_ids: token ids ``[B, Q]``, one question per context row (no padding).
    max_new_tokens: tokens to generate per row.

  Returns:
    An :class:`Answer`: tokens and their log-probabilities ``[B, max_new_tokens]``.

  Raises:
    ValueError: for question ids that are not ``[B, Q]`` in the vocabulary with the context's
      ``B`` rows, a context made by another model, or a question plus answer past the model's
      context length.
    RuntimeError: when a row needed more slots than its cache held.
  """
  cfg = model.cfg
  new = check_new_tokens("max_new_tokens", max_new_tokens)
  q = llama.check_token_ids("question_ids", question_ids, cfg.vocab_size)
  B = context.cache.keys.shape[1]
  if q.shape[0] != B:
    raise ValueError(
      f"question_ids: {q.shape[0]} rows for a context of {B}; expected one question per row"
    )
  params = model.params()
  mine = stored.model_fingerprint(cfg, params)
  if mine != context.model:
    differs = {k: (context.model.get(k), v) for k, v in mine.items() if context.model.get(k) != v}
    raise ValueError(f"context: compressed by another model; differs (context, model): {differs}")
  Q = q.shape[1]
  llama.check_context(cfg, int(np.max(context.next_pos_B)) + Q, new, name="question_ids")
  cache = cache_lib.with_room(context.cache, Q + new)
  spec = dataclasses.replace(context.spec, capacity=context.spec.capacity + Q + new)
  tokens, logps, cache = _answer(
    cfg, params, spec, cache, jnp.asarray(q), jnp.asarray(context.next_pos_B), new
  )
  check_overflow(cache)
  return Answer(np.asarray(tokens), np.asarray(logps))


def _budget_free(policy: policies.Policy, budget, T: int):
  """A budget given to a policy that takes none but re-compresses while decoding
  (:class:`kvjax.policies.RatioDecoding` over the full prompt): checked to keep every prompt
  token, then dropped (``None``: the same selection); any other budget as given."""
  if policy.requires_budget or budget is None or not policy.decode_every:
    return budget
  policy.check_budget(budget, policy.evidence_request(T).window, T)
  return None


def _check_budget_given(policy: policies.Policy, budget) -> None:
  """A budget for a compressing policy, none for the full cache (one that keeps every prompt
  token for a budget-free policy re-compressing while decoding: :func:`_budget_free`)."""
  if not policy.requires_budget and budget is not None and not policy.decode_every:
    raise ValueError(
      f"budget: the full cache keeps everything; got budget={budget!r}, expected None"
    )
  if policy.requires_budget and budget is None:
    raise ValueError("budget: required for a compressing policy")


def check_config_budgets(budgets) -> Array:
  """Checks budgets with a leading configuration axis (``[K]``, ``[K, L]`` or ``[K, L, H]``).

  Args:
    budgets: integer budgets with a non-empty leading axis.

  Returns:
    The budgets as an int32 array.

  Raises:
    ValueError: for non-integer budgets, no (or an empty) leading axis, or values outside
      ``[0, 2**31)``.
  """
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
  """Spreads the configuration axis over every device of this process.

  The devices are a TPU host's chips, several GPUs, or forced host devices: this process's own
  (``jax.local_devices()``), so that in a run of several processes each evaluates its own share
  without the others (an evaluation splits its policies across processes). ``budgets_K`` is padded to
  a multiple of the device count by repeating its last row and placed with a ``NamedSharding``
  over a one-axis ``Mesh``; the vmapped compress-and-decode then runs each device's share
  (GSPMD partitions it). A model placed by
  :func:`kvjax.model.sharding.shard_model` already spreads its batch and weights over the
  devices: its configurations are replicated on that mesh (one mesh per program; GSPMD cannot
  mix two layouts of the same devices).

  Args:
    budgets_K: the budgets ``[K, ...]``.
    params: the model's parameters, to find its mesh (``None``: no model mesh).

  Returns:
    ``(budgets, K)``: the placed (possibly padded) budgets and the real ``K``.
  """
  devices = jax.local_devices()
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


def configs_spec(cfg, pol, pre, budgets, window, layout, T, new, evidence):
  """Sizes the cache spec for every configuration and computes their allocations.

  The budgets are checked first. Shared by :func:`generate_configs` and
  :func:`kvjax.model.answers.answer_configs`.

  Args:
    cfg: the model's config.
    pol: the policy (an object).
    pre: the shared prefill's outputs.
    budgets: the checked budgets ``[K, ...]``.
    window: the observation window the budgets must hold.
    layout: a :class:`kvjax.model.cache.Layout`.
    T: the prompt's (context's) tokens.
    new: tokens decoded or fed after it.
    evidence: the checked caller-given evidence, or ``None``.

  Returns:
    ``(spec, alloc)``: the :class:`kvjax.model.cache.CacheSpec` sized for every configuration
    and the allocations ``[K, B, L, H]``.

  Raises:
    ValueError: for budgets the policy refuses, or a spec
      :func:`kvjax.model.cache.check_spec` refuses.
  """
  if pol.requires_budget:
    pol.check_budget(budgets, window, T)
  spec = cache_lib.CacheSpec(
    pol, 1, layout.heads, reindex=layout.reindex, compress_sliding=layout.compress_sliding
  )
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
  """Generates greedily under ``K`` budget configurations from one shared prefill.

  Compress and decode are vmapped over the configurations.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``.
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets.
    policy: as :func:`generate`'s.
    max_new_tokens: tokens to generate per row.
    attention_mask: as :func:`generate`'s.
    layout: as :func:`generate`'s.
    evidence: as :func:`generate`'s.
    **policy_options: options of a registered policy name.

  Returns:
    A :class:`Generation`: tokens ``[K, B, N]``, the K/V bytes held per configuration and the
    allocations ``[K, B, L, H]``.

  Raises:
    ValueError: as :func:`generate`'s, before any work; the cache estimate counts the ``K``
      configurations.
    RuntimeError: when a row needed more slots than its cache held.
  """
  layout = cache_lib.as_layout(layout)
  new = check_new_tokens("max_new_tokens", max_new_tokens)
  pol = policies.build(policy, **policy_options)
  check_model_evidence(pol)
  cfg = model.cfg
  ids, mask = _checked_prompt(model, prompt_ids, attention_mask, new)
  B, T = ids.shape
  budgets = check_config_budgets(budgets)
  window = pol.evidence_request(T).window
  if pol.requires_budget or pol.decode_every:  # a budget-free one's must keep every token
    pol.check_budget(budgets, window, T)
  ev = check_evidence(pol, evidence, cfg, prompt_ids, attention_mask, model=model)
  check_cache_bytes(
    cfg,
    slots=slots_bound(pol, budgets, T, new),
    batch=B,
    heads=cache_heads(cfg, layout.heads),
    itemsize=llama.kv_itemsize(cfg, model.params()),
    configs=budgets.shape[0],
    prompt_len=T,
    new=("max_new_tokens", new),
  )
  cfg, params, pre, ev = _prefill(model, ids, mask, pol, ev)
  spec, alloc = configs_spec(cfg, pol, pre, budgets, window, layout, pre.valid.shape[1], new, ev)
  first = jnp.argmax(pre.logits[:, -1], -1).astype(jnp.int32)
  key = jax.random.key(0)
  run = jax.vmap(
    lambda b: _compress_and_decode(cfg, params, pre, spec, b, first, new, 0.0, key, ev)
  )
  sharded, K = shard_configs(budgets, params)
  tokens, caches = jax.tree.map(lambda x: x[:K], run(sharded))
  check_overflow(caches)
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
  ratio=None,
  **options,
) -> np.ndarray:
  """Computes which prompt positions ``policy`` keeps under ``budget`` on a real prompt.

  The mask is per layer, batch row and head, for plots and parity with other libraries. ``H``
  is the policy's granularity: query heads by default (the published tables' layout), or KV heads
  with ``num_kv_heads=G`` (scores averaged over each group, as kvpress does). The window-based
  policies observe their ``window`` option's queries (default
  :data:`kvjax.policies.DEFAULT_WINDOW`). Rows are left-padded internally; the mask is returned
  in the caller's column order.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    input_ids: token ids ``[B, T]``.
    policy: a policy object, or a name built once with ``options``.
    budget: slots per head: a scalar, ``[L]`` or ``[L, H]`` (``None`` with ``ratio``).
    attention_mask: optional ``[B, T]`` 0/1 mask of the real tokens.
    evidence: as :func:`generate`'s.
    ratio: instead of ``budget``, kvpress's ``compression_ratio`` (:func:`ratio_budgets`).
    **options: options of a registered policy name (``num_kv_heads``, ``window``, ...).

  Returns:
    A bool mask ``[L, B, H, T]``.

  Raises:
    ValueError: as :func:`generate`'s, before any work, for ``input_ids`` (a prompt longer than
      the model's context included).
    RuntimeError: when a row needed more slots than its cache held.
  """
  pol = policies.build(policy, **options)
  check_model_evidence(pol)
  cfg = model.cfg
  kv = pol.num_kv_heads
  if kv is not None and kv != cfg.num_kv_heads:
    raise ValueError(f"num_kv_heads: {kv} is not the model's {cfg.num_kv_heads} KV heads")
  layout = "kv" if kv is not None else "query"
  ids, mask = _checked_prompt(model, input_ids, attention_mask, 0, "input_ids")
  B, T = ids.shape
  budget = _ratio_or_budget(pol, budget, ratio, mask)
  if pol.requires_budget:
    _check_row_budgets(pol, budget, mask, ratio is not None)
  ev = check_evidence(pol, evidence, cfg, input_ids, attention_mask, model=model)
  heads = cache_heads(cfg, layout)
  itemsize = llama.kv_itemsize(cfg, model.params())
  check_cache_bytes(cfg, slots=T, batch=B, heads=heads, itemsize=itemsize, prompt_len=T)
  cfg, params, pre, ev = _prefill(model, ids, mask, pol, ev)
  spec = cache_lib.CacheSpec(pol, pre.valid.shape[1], layout, row_budgets=ratio is not None)
  cache = cache_lib.compress(cfg, pre, spec, budget, evidence=ev)
  check_overflow(cache)
  positions = np.asarray(cache.positions)
  # the prompt's own slots (appended restore tokens sit at positions past each row's prompt)
  prompt = positions < mask.sum(-1)[None, :, None, None]
  return _to_caller_columns(positions, np.asarray(cache.valid) & prompt, input_ids, attention_mask)


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
