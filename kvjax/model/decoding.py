"""Greedy (or sampled) generation with a compressed cache, and one prefill shared by many
budget configurations (compress + decode vmapped over configurations); the checks and the
jitted prefill that :mod:`kvjax.model.answers` and :mod:`kvjax.model.logprobs` build on.

This module holds the entry points that prefill (:func:`generate`, :func:`generate_configs`,
:func:`keep_mask`, :func:`compress_context`), the jitted prefill and the cache-size limit; the
checks are written in :mod:`~kvjax.model.model_evidence` (the caller's evidence) and
:mod:`~kvjax.model.budget_checks` (budgets, ratios, capacities), the configuration axis in
:mod:`~kvjax.model.budget_configs` and :func:`answer_context` in
:mod:`~kvjax.model.context_answers`, and re-exported here: every name is reached as
``decoding.X``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import llama, paged, restorekv, sharding, stored
from kvjax.model.budget_checks import (
  Ratio,
  cache_bytes,
  cache_capacity,
  cache_heads,
  capacity_bucket,
  check_config_budgets,
  check_new_tokens,
  check_overflow,
  check_row_budgets,
  checked_allocation,
  checked_budget,
  ratio_budgets,
  ratio_or_budget,
  slots_bound,
  split_ratio,
)
from kvjax.model.budget_configs import configs_spec, shard_configs
from kvjax.model.config import ModelConfig
from kvjax.model.context_answers import Answer, answer_context
from kvjax.model.model_evidence import (
  UNAVAILABLE_EVIDENCE,
  check_evidence,
  check_model_evidence,
  computed_evidence,
)

Array = jax.Array

__all__ = [
  "GREEDY",
  "Answer",
  "Generation",
  "MAX_CACHE_BYTES",
  "Padded",
  "Ratio",
  "Sampling",
  "UNAVAILABLE_EVIDENCE",
  "answer_context",
  "cache_bytes",
  "cache_heads",
  "capacity_bucket",
  "check_cache_bytes",
  "check_config_budgets",
  "check_evidence",
  "check_model_evidence",
  "check_new_tokens",
  "check_overflow",
  "check_policy",
  "compress_context",
  "computed_evidence",
  "configs_spec",
  "generate",
  "generate_configs",
  "jit_prefill",
  "keep_mask",
  "ratio_budgets",
  "shard_configs",
  "slots_bound",
  "split_ratio",
  "to_left_padding",
  "unpadded",
]


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


@dataclasses.dataclass(frozen=True, eq=False)
class Padded:
  """A batch of prompts of different lengths: their token ids and the 0/1 mask of each row's
  real tokens (Hugging Face's ``input_ids`` with ``attention_mask``).

  Every entry point that takes a prompt's ids takes this instead for a padded batch, padded on
  either side; rows run left-padded, and what comes back is in the caller's columns.

  Attributes:
    ids: token ids ``[B, T]``.
    mask: the ``[B, T]`` 0/1 (or bool) mask of each row's real tokens.
  """

  ids: object
  mask: object

  def __repr__(self) -> str:
    return f"Padded(ids={np.shape(self.ids)}, mask={np.shape(self.mask)})"


def unpadded(prompt) -> tuple:
  """Splits a prompt into ``(ids, mask)``.

  Args:
    prompt: token ids ``[B, T]`` or a :class:`Padded` batch.

  Returns:
    A :class:`Padded` batch's ids and mask, or ``(prompt, None)`` for ids (every token real).
  """
  if isinstance(prompt, Padded):
    return prompt.ids, prompt.mask
  return prompt, None


@dataclasses.dataclass(frozen=True, eq=False)
class Sampling:
  """How :func:`generate` picks each token (gemma's ``sampling=``): the most likely at
  temperature 0, else a draw from ``softmax(logits / temperature)``.

  Attributes:
    temperature: 0 (greedy) or a finite positive temperature.
    rng: the PRNG key of the call's random draws, the sampled tokens and a random policy's
      scores (``None``: ``jax.random.key(0)``).

  Raises:
    ValueError: for a temperature that is negative, not finite or not a real number.
  """

  temperature: float = 0.0
  rng: object = None

  def __post_init__(self):
    t = self.temperature
    real = isinstance(t, int | float | np.integer | np.floating) and not isinstance(t, bool)
    if not real or not np.isfinite(t) or t < 0:
      raise ValueError(f"temperature: expected a finite value >= 0 (0 = greedy), got {t!r}")


GREEDY = Sampling()


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


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "new", "temperature", "pool"))
def _compress_and_decode_paged(
  cfg, params, pre, spec, budget, first, new, temperature, rng, evidence, pool
):
  """:func:`_compress_and_decode` over a :class:`~kvjax.model.paged.PagedCache` of ``pool``
  pages: the compressed cache moved into pages, each step reading each head's own slots.
  Tokens ``[B, new]``, the paged cache and the compression's allocation ``[B, L, H]``."""
  stacked = cache_lib.compress(cfg, pre, spec, budget, rng=rng, evidence=evidence)
  cache = paged.from_stacked(stacked, new=new, pool=pool)
  start_pos = pre.valid.sum(-1).astype(jnp.int32)

  def step(carry, i):
    cache, token, rng = carry
    rng, sub = jax.random.split(rng)
    logits, cache = paged.decode_step(cfg, params, cache, token, start_pos + i, backend="auto")
    return (cache, _pick(logits, temperature, sub), rng), token

  (cache, last, _), tokens = jax.lax.scan(step, (cache, first, rng), jnp.arange(new - 1))
  tokens = jnp.concatenate([tokens, last[None]], 0) if new > 1 else first[None]
  overflow = cache.overflow | stacked.overflow
  return tokens.T, dataclasses.replace(cache, overflow=overflow), stacked.budget


def _layer_capacity(cfg, policy: policies.Policy, budget, T: int, new: int):
  """Each layer's slots while decoding one buffer per layer (``cache.per_layer``): its own
  largest budget's :func:`cache_capacity` (``budget``: the allocation, ``[L, H]`` or ``[B, L, H]``),
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
  caps = tuple(cache_capacity(policy, int(b), T, new) for b in per_layer)
  return None if len(set(caps)) == 1 else caps


def _pick(logits_BV, temperature, rng):
  if temperature == 0:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  return jax.random.categorical(rng, logits_BV / temperature).astype(jnp.int32)


# The largest cache an entry point allocates without being told to: an estimate above it is
# refused before any work (a runaway max_new_tokens would otherwise fill the host's memory for
# minutes). Raise it by assigning kvjax.model.decoding.MAX_CACHE_BYTES.
MAX_CACHE_BYTES = 64 * 2**30


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


def _check_mask(attention_mask, shape) -> np.ndarray:
  """A 0/1 mask of ``shape`` with at least one real token per row."""
  if attention_mask is None:
    return np.ones(shape, np.int32)
  mask = np.asarray(attention_mask)
  if mask.shape != shape:
    raise ValueError(f"Padded.mask: shape {mask.shape}, expected the ids' {shape}")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("Padded.mask: expected 0/1 (or bool) values")
  empty = np.flatnonzero(mask.sum(-1) == 0)
  if empty.size:
    raise ValueError(
      f"Padded.mask: row {int(empty[0])} has no real token; there is nothing to continue"
    )
  return mask.astype(np.int32)


def _checked_prompt(model, prompt_ids, attention_mask, new: int, name: str = "prompt_ids"):
  """The prompt's ids and 0/1 mask, checked (ids, mask, and the prompt's longest row plus
  ``new`` tokens within the model's context), as left-padded numpy arrays."""
  cfg: ModelConfig = model.cfg
  ids = llama.check_token_ids(name, prompt_ids, cfg.vocab_size)
  mask = _check_mask(attention_mask, ids.shape)
  longest = int(mask.sum(-1).max())
  llama.check_context(cfg, longest, new, name=name)
  return to_left_padding(ids, mask)  # left padding whichever side was given


def _check_sampling(sampling) -> Sampling:
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling: expected a kvjax.model.decoding.Sampling, got {sampling!r}")
  return sampling


def _checked_generation(model, policy, options, prompt_ids, attention_mask, max_new_tokens):
  """The policy, the count of tokens to generate and the prompt of a generation, checked in
  that order before any work: ``(policy, new, ids, mask)``, the prompt left-padded."""
  new = check_new_tokens("max_new_tokens", max_new_tokens)
  pol = policies.build(policy, **options)
  check_model_evidence(pol)
  ids, mask = _checked_prompt(model, prompt_ids, attention_mask, new)
  return pol, new, ids, mask


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
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  sampling: Sampling = GREEDY,
  **policy_options,
) -> Generation:
  """Generates ``max_new_tokens`` tokens per row through a cache compressed with ``policy``.

  ``policy="full"`` (:class:`kvjax.policies.Full`) keeps everything. The prompt is compressed
  once after prefill; prefill-time policies then append (no eviction), decode-time policies
  evict as they go within ``budget``. Greedy by default (:data:`GREEDY`); rows run
  left-padded. Keys keep their original positions unless ``Layout(reindex=True)`` numbers them
  by rank inside the cache (official StreamingLLM's pos-shift).

  Policy options ``channel_ratio`` (ThinK's key channels, stored pruned) and ``decode_every=N``
  (re-compress to the budget every ``N`` generated tokens) apply to any prefill scorer.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``, or a :class:`Padded` batch (the ids and each row's
      0/1 mask of real tokens, padded on either side).
    policy: a :class:`kvjax.policies.Policy`, or a registered name built once with
      ``policy_options``.
    budget: slots per head, window included: a scalar, ``[L]`` or ``[L, H]`` (``None`` for the
      full cache); or a :class:`Ratio`, kvpress's ``compression_ratio``: the fraction of each
      row's prompt tokens removed, each head keeping ``int(T_row * (1 - ratio))`` slots
      (:func:`ratio_budgets`; traced data like a budget).
    max_new_tokens: tokens to generate per row.
    layout: the cache's heads (``"kv"`` or ``"query"``) or a
      :class:`kvjax.model.cache.Layout`.
    evidence: the data a policy needs from outside the prompt: ``qfilters_LGD`` ``[L, G, D]``
      (Q-Filters), ``retrieval_heads_LG`` ``[L, G]`` (DuoAttention), ``reconstruction_attn_LGT``
      ``[L, B, G, T]`` or ``[L, G, T]`` over the caller's columns (KVzip), as
      :mod:`kvjax.model.calibrate` computes them, and HeadKV's head importances
      ``head_scores_LH`` (``[L, Hq]``, or ``[L, G]`` at KV-head granularity).
    sampling: how each token is picked (:class:`Sampling`; :data:`GREEDY` by default), and the
      PRNG key of the call's random draws.
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
  sampling = _check_sampling(sampling)
  temperature, rng = sampling.temperature, sampling.rng
  prompt_ids, attention_mask = unpadded(prompt_ids)
  budget, ratio = split_ratio(budget)
  pol, new, ids, mask = _checked_generation(
    model, policy, policy_options, prompt_ids, attention_mask, max_new_tokens
  )
  cfg = model.cfg
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
  budget_LH = checked_allocation(cfg, pre, spec, pol, budget, ev)
  cap = cache_capacity(pol, int(budget_LH.max()) if budget_LH is not None else T, T, new)
  spec = dataclasses.replace(
    spec, capacity=cap, new_tokens=new, layer_capacity=_layer_capacity(cfg, pol, budget_LH, T, new)
  )
  rng = jax.random.key(0) if rng is None else rng
  rng, first_rng = jax.random.split(rng)
  first = _pick(pre.logits[:, -1], float(temperature), first_rng)
  if paged.uses_paged(cfg, spec, budget_LH, layout.paged, jax.default_backend()):
    held_LH = np.full((cfg.num_layers, cfg.num_kv_heads), T) if budget_LH is None else budget_LH
    pool = paged.pool_size(held_LH, B, new, paged.PAGE)
    tokens, pcache, used = _compress_and_decode_paged(
      cfg, params, pre, spec, budget, first, new, float(temperature), rng, ev, pool
    )
    check_overflow(pcache)
    mem = paged.memory(pcache) | {
      "full_cache_bytes": cache_lib.full_cache_bytes(cfg, tokens.shape[0], T + new, itemsize)
    }
    return Generation(np.asarray(tokens), mem, np.asarray(used))
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
  budget = checked_budget(pol, budget, ratio, mask)
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


_compress_jit = jax.jit(cache_lib.compress, static_argnames=("cfg", "spec"))


def compress_context(
  model,
  context_ids,
  *,
  policy: policies.Policy | str = "full",
  budget=None,
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
    context_ids: token ids ``[B, T]``, one context per row, or a :class:`Padded` batch.
    policy: a policy object, or a registered name built once with ``policy_options``.
    budget: slots per head, window included (``None``: the full cache), or a :class:`Ratio`.
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
  context_ids, attention_mask = unpadded(context_ids)
  budget, ratio = split_ratio(budget)
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
  budget_LH = checked_allocation(cfg, pre, spec, pol, budget, ev)
  budget_max = T if budget_LH is None else int(budget_LH.max())
  spec = dataclasses.replace(spec, capacity=max(cache_capacity(pol, budget_max, T, 0), 1))
  rng = jax.random.key(0) if rng is None else rng
  cache = _compress_jit(cfg, pre, spec, budget, rng=rng, evidence=ev)
  check_overflow(cache)
  return stored.CompressedContext(
    cache,
    dataclasses.replace(spec, row_budgets=False),
    np.asarray(restorekv.next_positions(pre)),
    stored.model_fingerprint(cfg, params),
  )


def generate_configs(
  model,
  prompt_ids,
  budgets,
  *,
  policy: policies.Policy | str,
  max_new_tokens: int = 32,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  **policy_options,
) -> Generation:
  """Generates greedily under ``K`` budget configurations from one shared prefill.

  Compress and decode are vmapped over the configurations.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``, or a :class:`Padded` batch.
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets.
    policy: as :func:`generate`'s.
    max_new_tokens: tokens to generate per row.
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
  prompt_ids, attention_mask = unpadded(prompt_ids)
  pol, new, ids, mask = _checked_generation(
    model, policy, policy_options, prompt_ids, attention_mask, max_new_tokens
  )
  cfg = model.cfg
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
  spec, alloc = configs_spec(cfg, pol, pre, budgets, window, layout, new, ev)
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
  evidence=None,
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
    input_ids: token ids ``[B, T]``, or a :class:`Padded` batch.
    policy: a policy object, or a name built once with ``options``.
    budget: slots per head: a scalar, ``[L]`` or ``[L, H]``, or a :class:`Ratio`.
    evidence: as :func:`generate`'s.
    **options: options of a registered policy name (``num_kv_heads``, ``window``, ...).

  Returns:
    A bool mask ``[L, B, H, T]``.

  Raises:
    ValueError: as :func:`generate`'s, before any work, for ``input_ids`` (a prompt longer than
      the model's context included).
    RuntimeError: when a row needed more slots than its cache held.
  """
  input_ids, attention_mask = unpadded(input_ids)
  budget, ratio = split_ratio(budget)
  pol = policies.build(policy, **options)
  check_model_evidence(pol)
  cfg = model.cfg
  kv = pol.num_kv_heads
  if kv is not None and kv != cfg.num_kv_heads:
    raise ValueError(f"num_kv_heads: {kv} is not the model's {cfg.num_kv_heads} KV heads")
  layout = "kv" if kv is not None else "query"
  ids, mask = _checked_prompt(model, input_ids, attention_mask, 0, "input_ids")
  B, T = ids.shape
  budget = ratio_or_budget(pol, budget, ratio, mask)
  if pol.requires_budget:
    check_row_budgets(pol, budget, mask, ratio is not None, ratio=ratio)
  ev = check_evidence(pol, evidence, cfg, input_ids, attention_mask, model=model)
  heads = cache_heads(cfg, layout)
  itemsize = llama.kv_itemsize(cfg, model.params())
  check_cache_bytes(cfg, slots=T, batch=B, heads=heads, itemsize=itemsize, prompt_len=T)
  cfg, params, pre, ev = _prefill(model, ids, mask, pol, ev)
  spec = cache_lib.CacheSpec(pol, pre.valid.shape[1], layout, row_budgets=ratio is not None)
  cache = cache_lib.compress(cfg, pre, spec, budget, evidence=ev)
  check_overflow(cache)
  if pol.requires_budget:  # every row holds the policy's declared window
    pol.check_allocation(np.asarray(cache.budget))
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
