"""Teacher-forced log-probabilities of a text read token by token through a compressed cache
(StreamingLLM's perplexity experiment), and the full-cache reference from one causal forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import decoding, llama, sharding


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def _stream_logprobs(cfg, params, pre, spec, budget, rest_BS):
  """Feeds ``rest_BS`` one token at a time through the cache compressed from ``pre``; returns
  the log-probability of each fed token given everything before it ``[B, S]``."""
  cache = cache_lib.compress(cfg, pre, spec, budget)
  B, T = pre.valid.shape
  first_logp = jax.nn.log_softmax(pre.logits[:, -1], -1)
  start_pos = pre.valid.sum(-1).astype(jnp.int32)
  params, cache = cache_lib.per_layer(spec, params, cache)  # the form the decode loop reads

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
  """Computes the log-probabilities of tokens ``1..T-1`` given the tokens before them in one pass.

  One causal forward gives what :func:`stream_logprobs` with ``policy="full"`` reads token by
  token (an uncompressed cache evicts nothing, so the two agree; ``tests/test_decoding.py``
  checks it), in one pass instead of ``T - 1`` decode steps.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    input_ids: token ids ``[B, T]``, ``T >= 2``.

  Returns:
    fp32 log-probabilities ``[B, T - 1]``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule (``T >= 2``)
      or longer than the model's context.
  """
  ids = llama.check_token_ids("input_ids", input_ids, model.cfg.vocab_size, min_len=2)
  llama.check_context(model.cfg, ids.shape[1])
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
  """Computes teacher-forced log-probabilities of a long text read token by token through a cache.

  The log-probability of token ``t`` is given tokens ``< t`` as the cache holds them
  (StreamingLLM's perplexity experiment, Xiao et al. 2023, Fig. 3). The first ``prefix`` tokens
  are prefilled (and compressed under ``budget``); every later token goes through the jitted
  decode step, where a policy that acts while decoding (a :class:`kvjax.policies.DecodePolicy`
  such as ``sliding_window``, ``streaming_llm``, ``h2o``, ``tova``, or one with
  ``decode_every``) keeps within ``budget`` per head.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    input_ids: token ids ``[B, T]``, ``T >= 2``.
    policy: a policy object or a name built once with ``policy_options``; ``"full"`` keeps every
      token.
    budget: slots per head (``None`` for ``policy="full"``).
    prefix: the tokens prefilled before the stream, in ``[1, T)``.
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets, instead of ``budget``: the text is
      read under ``K`` budgets in one scan (vmapped, one compile).
    **policy_options: options of a registered policy name.

  Returns:
    Log-probabilities ``[B, T - prefix]``, or ``[K, B, T - prefix]`` with ``budgets``.

  Raises:
    ValueError: before any work, for ids breaking :func:`kvjax.model.llama.check_token_ids`'s
      rule (``T >= 2``) or longer than the model's context, a prefix, policy or budget it cannot
      run with, both ``budget`` and ``budgets``, or caches above
      :data:`kvjax.model.decoding.MAX_CACHE_BYTES`.
    RuntimeError: when the full cache overflows its capacity.
  """
  if budgets is not None and budget is not None:
    raise ValueError(f"budget: give budget or budgets, not both; got budget={budget!r}")
  ids = llama.check_token_ids("input_ids", input_ids, model.cfg.vocab_size, min_len=2)
  llama.check_context(model.cfg, ids.shape[1])
  if isinstance(prefix, bool) or not isinstance(prefix, int) or not 1 <= prefix < ids.shape[1]:
    raise ValueError(f"prefix: expected an int in [1, T={ids.shape[1]}), got {prefix!r}")
  pol = policies.build(policy, **policy_options)
  if not pol.requires_budget and budget is not None and pol.decode_every:
    # a budget-free policy re-compressing while decoding (RatioDecoding over the full prompt):
    # a budget keeping every prefix token selects the same; it is checked, then dropped
    pol.check_budget(budget, pol.evidence_request(prefix).window, prefix)
    budget = None
  if not pol.requires_budget and budget is not None:
    raise ValueError(f"budget: the full cache keeps everything; got budget={budget!r}")
  if pol.requires_budget and not pol.acts_at_decode:
    raise ValueError(
      f"policy: {pol.label!r} selects once after the prompt; a stream needs a policy that acts "
      "while decoding (a decode-time policy such as 'sliding_window', 'streaming_llm', 'h2o', "
      "'tova', or decode_every=N) or the full cache"
    )
  decoding.check_model_evidence(pol)
  cfg, params = model.cfg, model.params()
  B, T = ids.shape
  request = pol.evidence_request(prefix, reduce_rows=True)
  if budgets is not None:
    if not pol.requires_budget:
      raise ValueError(f"budgets: the full cache keeps everything; got budgets={budgets!r}")
    budget = decoding.check_config_budgets(budgets)
  if not pol.requires_budget:
    capacity, budget = T, T
    if pol.decode_every:  # the prefix kept whole, then re-compressed (RatioDecoding)
      capacity = min(pol.decode_capacity(prefix, prefix, T - prefix), T)
  else:
    pol.check_budget(budget, request.window)
    # decode_every (R-KV): the largest budget kept across re-compressions (the prompt's, a
    # PrefillDecoding's decode_budget, a RatioDecoding's last target), plus the tokens read
    # between two re-compressions
    capacity = pol.decode_capacity(int(np.max(budget)), prefix, T - prefix)
  decoding.check_cache_bytes(
    cfg,
    slots=capacity,
    batch=B,
    heads=cfg.num_kv_heads,
    itemsize=llama.kv_itemsize(cfg, params),
    configs=1 if budgets is None else budget.shape[0],
    prompt_len=T,
  )
  head, rest = jnp.asarray(ids[:, :prefix]), jnp.asarray(ids[:, prefix:])
  pre = decoding.jit_prefill(cfg, params, head, jnp.ones_like(head), request)
  spec = cache_lib.CacheSpec(pol, capacity, "kv")
  if budgets is not None:
    logp, overflow = _stream_logprobs_configs(cfg, params, pre, spec, budget, rest)
    return np.asarray(logp)
  logp, overflow = _stream_logprobs(cfg, params, pre, spec, budget, rest)
  if not pol.requires_budget and bool(np.asarray(overflow).any()):
    raise RuntimeError("cache: the full cache overflowed its capacity")
  return np.asarray(logp)
