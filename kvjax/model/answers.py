"""Answers through the compressed cache: a prompt's context compressed once per budget
configuration (vmapped), then the question and the answer decoded through each cache, greedy
and teacher-forced, from one prefill shared by every policy (:func:`prefill_answers`,
:func:`answer_prefilled`) or by one policy's configurations (:func:`answer_configs`)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks, policies
from kvjax.model import cache as cache_lib
from kvjax.model import decoding, llama, restorekv, sharding

Array = jax.Array


@dataclasses.dataclass
class Answers:
  """Per-configuration predictions of an answer, every token predicted from the compressed cache.

  ``predicted [K, B, N]``: greedy tokens at the answer positions (given positions fed from the
  answer); ``logprobs [K, B, N, V]``: teacher-forced log-probabilities there (for KL
  divergences); ``budget_LH [K, B, L, H]``: the allocations. ``kv_bytes_held [K]``: the keys
  and values each configuration's compressed context cache held over the ``B`` rows, counted
  from the cache (:func:`kvjax.model.cache.memory`), before the question and answer are fed;
  ``full_cache_bytes``: those of the uncompressed context's cache (every KV head, the same
  rows), so that ``kv_bytes_held / full_cache_bytes`` is the fraction of the full cache held.
  A policy keeping whole heads or layers counts what they really held, not its nominal budget.
  ``ratios [K]``: each configuration's compression ratio when the call's budgets were a
  :class:`~kvjax.model.decoding.Ratio` (``None`` for token budgets).
  """

  predicted: np.ndarray
  logprobs: np.ndarray
  budget_LH: np.ndarray
  kv_bytes_held: np.ndarray | None = None
  full_cache_bytes: int | None = None
  ratios: np.ndarray | None = None


def check_ratios(ratios) -> np.ndarray:
  """Checks compression ratios with a configuration axis: kvpress's ``compression_ratio``, each a
  float in ``[0, 1)``.

  Args:
    ratios: ``[K]`` ratios, the fraction of the context removed in each configuration.

  Returns:
    The ratios as a float64 array ``[K]``.

  Raises:
    ValueError: naming ``ratios`` and the value, for anything but a non-empty sequence of real
      numbers in ``[0, 1)`` (a bool, a string, NaN or 1.0 included).
  """
  expected = "expected a non-empty [K] sequence of floats in [0, 1) (kvpress compression_ratio)"
  values = (ratios,) if np.isscalar(ratios) else tuple(np.asarray(ratios, object).ravel())
  if np.ndim(ratios) != 1 or not values:
    raise ValueError(f"ratios: {expected}, got {ratios!r}")
  for r in values:
    real = isinstance(r, int | float | np.integer | np.floating) and not isinstance(r, bool)
    if not real or not 0.0 <= float(r) < 1.0:
      raise ValueError(f"ratios: {r!r} is not a compression ratio; {expected}")
  return np.asarray(values, np.float64)


def budgets_of(policy: policies.Policy, budgets, ratios, context_len: int):
  """The ``[K, ...]`` token budgets a call runs with: ``budgets`` as given, or each ratio's
  kvpress ``compute_n_kept`` over the ``context_len`` context tokens compressed,
  ``int(context_len * (1 - ratio))`` (:func:`kvjax.model.decoding.ratio_budgets`; every row of
  an unpadded prompt has the same length, so one budget per ratio). The budgets are traced data
  either way: every ratio of a call shares one compiled program.

  Args:
    policy: the policy (an object).
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets, or ``None`` with ``ratios``.
    ratios: ``[K]`` compression ratios, or ``None`` with ``budgets``.
    context_len: the context tokens compressed (the prompt less its re-fed question).

  Returns:
    ``(budgets, ratios)``: the checked int32 budgets and the float ratios ``[K]`` (``None``
    for token budgets).

  Raises:
    ValueError: naming the argument, for both or neither given, ratios
      :func:`check_ratios` refuses, ratios for a policy that takes no budget (the full cache),
      or a ratio that keeps fewer tokens than the policy's protected window.
  """
  if ratios is None:
    if budgets is None:
      raise ValueError("budgets: expected [K, ...] token budgets or Ratio([K]), got neither")
    return decoding.check_config_budgets(budgets), None
  if budgets is not None:
    raise ValueError(
      f"ratios: {ratios!r} given with budgets {budgets!r}; expected budgets or ratios, not both"
    )
  r_K = check_ratios(ratios)
  if not policy.requires_budget:
    raise ValueError(
      f"budgets: policy {policy.label!r} takes no budget; expected no Ratio "
      "(the full cache keeps every context token)"
    )
  b_K = np.concatenate([decoding.ratio_budgets(float(r), [context_len]) for r in r_K])
  window = min(policy.observation_window, context_len)
  for r, b in zip(r_K, b_K, strict=True):
    try:
      policy.check_budget(np.int32(b), window, context_len)
    except ValueError as e:
      raise ValueError(
        f"ratios: {float(r)!r} keeps {int(b)} of the {context_len} context tokens per head, "
        f"which policy {policy.label!r} refuses ({e}); expected a smaller ratio"
      ) from None
  return decoding.check_config_budgets(b_K), r_K


def decoding_spec(spec: cache_lib.CacheSpec) -> cache_lib.CacheSpec:
  """Returns the spec that decoding from a compressed cache actually depends on.

  A prefill-time policy (no decode-time eviction, no ``decode_every``, no ThinK) only appends
  during decoding, so every such policy decodes with one canonical spec and shares one compiled
  decoder per shape and capacity; decode-time policies keep their own.

  Args:
    spec: the cache's static choices.

  Returns:
    ``spec`` with the policy replaced by :class:`kvjax.policies.Full` for a prefill-time policy,
    else ``spec`` itself.
  """
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


@dataclasses.dataclass(frozen=True, eq=False)
class Question:
  """Where a prompt's question is, what the compression sees, and how the answer is fed
  (:func:`answer_configs`, :func:`prefill_answers`).

  Attributes:
    length: the prompt's last tokens that are the question; the rest is the context.
    mode: what the compression sees, one of :data:`QUESTION_MODES`: ``"in_window"`` (the whole
      prompt is prefilled; only context tokens are kept and the question is re-fed), ``"after"``
      (only the context is prefilled: kvpress's query-agnostic pipeline) or ``"compressed"``
      (the question is compressed with the context and ``length`` is taken as 1).
    answer_given: bool ``[B, N]``, the answer positions fed from the answer in the greedy pass
      (mqar's query keys; ``None``: none).
  """

  length: int = 1
  mode: str = "in_window"
  answer_given: object = None

  def __repr__(self) -> str:
    given = None if self.answer_given is None else np.shape(self.answer_given)
    return f"Question(length={self.length!r}, mode={self.mode!r}, answer_given={given})"


def as_question(question) -> Question:
  """Checks that ``question`` is a :class:`Question`.

  Args:
    question: a :class:`Question`, or ``None`` for ``Question()``.

  Returns:
    The :class:`Question`.

  Raises:
    ValueError: for anything else.
  """
  if question is None:
    return Question()
  if not isinstance(question, Question):
    raise ValueError(
      f"question: expected a kvjax.model.answers.Question (or None), got {question!r}"
    )
  return question


def _check_prefilled_evidence(pol: policies.Policy, prefilled: Prefilled) -> None:
  """``ValueError`` naming ``prefill_answers(needs=...)`` when the shared prefill lacks what the
  policy reads (ExpectedAttention's statistics must also match its ``n_sink``/``n_future``)."""
  wanted, held = pol.evidence_request(prefilled.seen_len), prefilled.request
  fields = {
    "value_out_norms": "value_out_norms_LHT",
    "query_stats": "query_mean_LHD",
    "window_queries": "window_queries_LHWD",
    "prerope_keys": "prerope_keys_LGTD",
    "queries": "queries_LHTD",
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
  question's window rows and attention sums stay as evidence, its keys, values and queries go."""

  def keys_axis(x):
    return None if x is None else x[..., :Tc]

  def positions_axis(x):  # [..., T, D] fields: the context's keys and queries
    return None if x is None else x[..., :Tc, :]

  return pre.replace(
    keys=pre.keys[..., :Tc, :],
    values=pre.values[..., :Tc, :],
    positions=pre.positions[:, :Tc],
    valid=pre.valid[:, :Tc],
    attn_window=keys_axis(pre.attn_window),
    column_sums=keys_axis(pre.column_sums),
    key_norms=keys_axis(pre.key_norms),
    value_out_norms=keys_axis(pre.value_out_norms),
    prerope_keys=positions_axis(pre.prerope_keys),
    queries=positions_axis(pre.queries),
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
  question: Question | None = None,
  window: int = policies.DEFAULT_WINDOW,
  oracle: bool = True,
  needs: tuple[str, ...] = (),
) -> Prefilled:
  """Runs the one prefill that :func:`answer_prefilled` answers from under any policy and budget.

  It computes window rows of the last ``window`` queries, H2O's column sums, keys and values,
  and (with ``oracle``) the full-cache attention of the fed queries.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``, the context then the question.
    answer_ids: token ids ``[B, N]``.
    question: the prompt's question and how the answer is fed (a :class:`Question`;
      ``None``: ``Question()``, a one-token question in the window).
    window: the window rows to hold (policies may use fewer).
    oracle: whether to compute the full-cache attention of the fed queries (the oracle's
      evidence).
    needs: further :class:`kvjax.policies.Evidence` fields to compute (``value_out_norms_LHT``,
      ``query_mean_LHD``/``query_cov_LHDD`` with kvpress's defaults, ``window_queries_LHWD`` for
      ``window`` queries): the policies that will answer list them in their
      :attr:`~kvjax.policies.Policy.evidence_fields`.

  Returns:
    A :class:`Prefilled`: the prefill's outputs cut to the context keys, what is fed through the
    cache afterwards, and the oracle's evidence when asked for.

  Raises:
    ValueError: before any work, for an unknown field in ``needs``, or as
      :func:`check_answer_inputs`.
  """
  needs = tuple(needs)
  policies.EvidenceRequest.for_fields(needs, 0)  # unknown fields fail before any work

  def request(seen_len: int) -> policies.EvidenceRequest:
    return policies.EvidenceRequest.for_fields(needs, min(int(window), seen_len))

  question = as_question(question)
  return _prefill_shared(model, prompt_ids, answer_ids, question, int(window), oracle, request)


def check_answer_inputs(model, prompt_ids, answer_ids, question: Question):
  """Checks the prompts and answers of :func:`prefill_answers` and :func:`answer_configs`.

  The check runs before any work.

  Args:
    model: the model (its vocabulary and context).
    prompt_ids: ``[B, T]`` token ids, ``T >= 2``.
    answer_ids: ``[B, N]`` token ids.
    question: the :class:`Question`.

  Returns:
    ``(prompt, answer, question_len, given)``: int32 ids, the question's length (1 for
    ``mode="compressed"``) and the bool ``[B, N]`` given-answer mask.

  Raises:
    ValueError: naming the argument, for ids breaking
      :func:`kvjax.model.llama.check_token_ids`'s rule, a batch mismatch, an unknown question
      mode, a question as long as the prompt, a mask of the wrong shape, or a prompt plus its
      answer longer than the model's context.
  """
  question = as_question(question)
  question_len, mode, answer_given = question.length, question.mode, question.answer_given
  vocab = model.cfg.vocab_size
  prompt = llama.check_token_ids("prompt_ids", prompt_ids, vocab, min_len=2)
  answer = llama.check_token_ids("answer_ids", answer_ids, vocab)
  if answer.shape[0] != prompt.shape[0]:
    raise ValueError(
      f"answer_ids: expected [batch={prompt.shape[0]}, N >= 1] token ids, got {answer.shape}"
    )
  # the prompt then the answer is the sequence the model reads
  llama.check_context(
    model.cfg, prompt.shape[1], answer.shape[1], name="prompt_ids", new_name="answer_ids"
  )
  if not isinstance(mode, str) or mode not in QUESTION_MODES:
    raise ValueError(f"question.mode: expected one of {QUESTION_MODES}, got {mode!r}")
  if mode == "compressed":
    question_len = 1
  if not checks.is_int(question_len) or not 1 <= question_len < prompt.shape[1]:
    raise ValueError(
      f"question.length: expected an int, 1 <= length < T={prompt.shape[1]}, got {question_len!r}"
    )
  given = np.zeros(answer.shape, bool) if answer_given is None else np.asarray(answer_given, bool)
  if given.shape != answer.shape:
    raise ValueError(f"question.answer_given: shape {given.shape}, expected {answer.shape}")
  return prompt, answer, question_len, given


def check_answer_memory(model, policy, budgets, layout: str, batch: int, Tc: int, M: int) -> None:
  """Refuses, before any work, caches above :data:`kvjax.model.decoding.MAX_CACHE_BYTES`.

  The estimate counts ``K`` caches of a ``Tc``-token context plus ``M`` fed tokens.

  Args:
    model: the model.
    policy: the policy (an object).
    budgets: the checked ``[K, ...]`` budgets.
    layout: the cache's heads (``"kv"`` or ``"query"``).
    batch: rows.
    Tc: context tokens compressed.
    M: tokens fed through each cache (the question and the answer but its last token).

  Raises:
    ValueError: as :func:`kvjax.model.decoding.check_cache_bytes`, naming ``answer_ids``.
  """
  cfg = model.cfg
  decoding.check_cache_bytes(
    cfg,
    slots=decoding.slots_bound(policy, budgets, Tc, M),
    batch=batch,
    heads=decoding.cache_heads(cfg, layout),
    itemsize=llama.kv_itemsize(cfg, model.params()),
    configs=int(np.shape(budgets)[0]),
    prompt_len=Tc,
    new=("answer_ids", M),
  )


def _prefill_shared(model, prompt_ids, answer_ids, question, window, oracle, request_of):
  """:func:`prefill_answers` with the evidence ``request_of(seen_len)`` (besides the shared
  window rows and column sums) for the :class:`Question` ``question``."""
  prompt, answer, question_len, given = check_answer_inputs(model, prompt_ids, answer_ids, question)
  B = answer.shape[0]
  Tc = prompt.shape[1] - question_len
  seen = prompt if question.mode == "in_window" else prompt[:, :Tc]
  cfg, params = model.cfg, model.params()
  w = min(window, seen.shape[1])
  # every policy's window rows (at most w) and H2O's column sums, plus what the policies ask for
  request = request_of(seen.shape[1]) | policies.EvidenceRequest(window=w, column_sums=True)
  fed = np.concatenate([prompt[:, Tc:], answer[:, :-1]], axis=1)
  feed = np.concatenate([np.ones((B, question_len), bool), given[:, :-1]], 1)
  # over the model's mesh, if it has one
  seen_j, inputs, feed = sharding.place_batch(params, seen, fed, feed)
  full = decoding.jit_prefill(cfg, params, seen_j, jnp.ones_like(seen_j), request)
  future = _future_attention(cfg, params, full, inputs, Tc) if oracle else None
  pre = _restrict(full, Tc)
  return Prefilled(pre, inputs, feed, question_len, w, seen.shape[1], future, request)


def answer_prefilled(
  model,
  prefilled: Prefilled,
  budgets=None,
  *,
  policy: policies.Policy | str,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  token_loop: bool = False,
  timings: dict | None = None,
  **policy_options,
) -> Answers:
  """Answers under ``K`` budget configurations of ``policy`` from one :func:`prefill_answers`.

  Every policy of an evaluation shares the prefill; nothing is prefilled here.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prefilled: the shared prefill (:func:`prefill_answers`).
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets, or
      :class:`~kvjax.model.decoding.Ratio` ``([K])``: kvpress compression ratios of the context
      (:func:`budgets_of`).
    policy: a policy object, or a name built once with ``policy_options``.
    layout: as :func:`kvjax.model.decoding.generate`'s.
    evidence: as :func:`kvjax.model.decoding.generate`'s, over the context's columns.
    token_loop: feed the answers token by token even where decoding only appends and they
      could go at once (the reference, and the baseline of ``experiments/bench_answers.py``; the
      results are the same).
    timings: a dict to which the wall-clock seconds of the two stages are added, under
      ``"compression"`` and ``"answers"`` (compilation included); the compressed caches are then
      waited for before the answers start (``None``: nothing is timed or waited for).
    **policy_options: options of a registered policy name.

  Returns:
    The :class:`Answers`: greedy predictions ``[K, B, N]``, teacher-forced log-probabilities
    ``[K, B, N, V]`` and the allocations ``[K, B, L, H]``.

  Raises:
    ValueError: before any work, for budgets or ratios (:func:`budgets_of`), a policy or
      evidence it cannot run with, or caches above
      :data:`kvjax.model.decoding.MAX_CACHE_BYTES`.
    RuntimeError: when a row needed more slots than its cache held.
  """
  layout = cache_lib.as_layout(layout)
  cfg, params = model.cfg, model.params()
  pol = policies.build(policy, **policy_options)
  decoding.check_model_evidence(pol, future=True)
  pre = prefilled.pre
  B, Tc = pre.valid.shape
  budgets, ratios = budgets_of(pol, *decoding.split_ratio(budgets), Tc)
  M = prefilled.inputs_BM.shape[1]
  window = min(pol.observation_window, prefilled.seen_len)
  if not pol.evidence_fields & {"attn_window_LHWT", "window_queries_LHWD"}:
    window = min(window, prefilled.window)  # reads no window rows (ExpectedAttention, ...)
  if window > prefilled.window:
    raise ValueError(
      f"window: policy {pol.label!r} needs {window} window rows, the prefill holds "
      f"{prefilled.window}; prefill with window >= {window}"
    )
  if pol.requires_budget:
    pol.check_budget(budgets, window, Tc)
  check_answer_memory(model, pol, budgets, layout.heads, B, Tc, M)
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
  ev = decoding.check_evidence(pol, evidence, cfg, np.zeros(pre.valid.shape, np.int32), None)
  pre, ev = restorekv.append_restore(pre, ev)  # RestoreKV's tokens follow the context
  spec, alloc = decoding.configs_spec(cfg, pol, pre, budgets, window, layout, M, ev)
  sharded, K = decoding.shard_configs(budgets, params)
  start = time.perf_counter()
  caches = _compress_configs(cfg, pre, spec, sharded, ev)
  if timings is not None:
    jax.block_until_ready(caches)
    start = _add_seconds(timings, "compression", start)
  held_K = _held_bytes(caches, K)
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
  decoding.check_overflow(caches)
  full = cache_lib.full_cache_bytes(cfg, B, Tc, llama.kv_itemsize(cfg, params))
  out = Answers(np.asarray(pred), np.asarray(logp), np.asarray(alloc), held_K, full, ratios)
  if timings is not None:
    _add_seconds(timings, "answers", start)
  return out


def _add_seconds(timings: dict, stage: str, start: float) -> float:
  """Adds the seconds since ``start`` to ``timings[stage]``; returns the time now."""
  now = time.perf_counter()
  timings[stage] = timings.get(stage, 0.0) + now - start
  return now


def _held_bytes(caches_K: cache_lib.KVCache, K: int) -> np.ndarray:
  """The K/V bytes each of the first ``K`` stacked compressed caches holds (int64 ``[K]``, over
  every row): :func:`kvjax.model.cache.memory` of each, so the count is the cache's own."""
  stacked = dataclasses.replace(caches_K, evidence=None)  # model-level evidence has no K axis
  held = [
    cache_lib.memory(jax.tree.map(lambda x, k=k: x[k], stacked))["kv_bytes_held"] for k in range(K)
  ]
  return np.asarray(held, np.int64)


def answer_configs(
  model,
  prompt_ids,
  answer_ids,
  budgets=None,
  *,
  policy: policies.Policy | str,
  question: Question | None = None,
  layout: cache_lib.Layout | str = "kv",
  evidence=None,
  **policy_options,
) -> Answers:
  """Predicts an answer after a prompt under ``K`` budget configurations with one shared prefill.

  The prompt's last ``question.length`` tokens are the question. The context (the rest) is
  compressed once per budget (vmapped); the question and then the answer are decoded through
  the compressed cache, so *every* answer token is predicted from it. ``question.mode`` says what
  the compression sees (:class:`Question`):

  * ``"in_window"`` (default): the whole prompt is prefilled, so the policies' evidence (SnapKV's
    observation window, H2O's sums) includes the question, but only context tokens are kept and
    the question is re-fed. Query-aware selection without the leak below.
  * ``"after"``: only the context is prefilled (kvpress's pipeline: query-agnostic compression).
  * ``"compressed"``: the official generate loop of SnapKV and PyramidKV: the question is
    compressed with the context (``question.length`` is then 1: only the last prompt token is
    re-fed). Caveat: question tokens kept in the cache carry what the model already retrieved
    during the full-attention prefill, so a policy can answer while evicting the needle.

  The greedy pass feeds the model's own prediction at each scored answer position and the answer
  at ``answer_given [B, N]`` positions (mqar's query keys); the teacher-forced pass feeds the
  answer everywhere (for KL divergences). Prefill-time policies hold the question tokens beyond
  the budget, like generated ones; decode-time policies (sliding window, StreamingLLM, H2O, TOVA)
  spend their budget on them as on any decoded token. ``policy="oracle"`` uses the full-cache
  attention of exactly the fed queries.

  In ``"in_window"`` mode the evidence is the full prompt's, cut to the context keys: window rows
  keep their original normalisation (their mass on question keys is not redistributed), and
  SnapKV-style policies protect the last ``window`` context positions (the question itself is
  re-fed, so it is always present).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    prompt_ids: token ids ``[B, T]``, the context then the question.
    answer_ids: token ids ``[B, N]``.
    budgets: ``[K]``, ``[K, L]`` or ``[K, L, H]`` budgets, or
      :class:`~kvjax.model.decoding.Ratio` ``([K])``: kvpress compression ratios (the fraction
      of the context removed), each keeping ``int(Tc * (1 - ratio))`` slots per head of the
      ``Tc`` context tokens compressed (:func:`budgets_of`). Ratios are data like budgets: every
      ratio of a call is answered by one compiled program.
    policy: a policy object, or a name built once with ``policy_options``.
    question: the prompt's question and how the answer is fed (a :class:`Question`;
      ``None``: ``Question()``).
    layout: as :func:`kvjax.model.decoding.generate`'s.
    evidence: as :func:`kvjax.model.decoding.generate`'s.
    **policy_options: options of a registered policy name.

  Returns:
    The :class:`Answers`: greedy predictions ``[K, B, N]``, teacher-forced log-probabilities
    ``[K, B, N, V]`` and the allocations ``[K, B, L, H]``.

  Raises:
    ValueError: before any work, as :func:`check_answer_inputs` (a prompt plus its answer past
      the model's context included), :func:`budgets_of` (both or neither of ``budgets`` and
      ``ratios``, a ratio outside ``[0, 1)``, ratios for the full cache) and
      :func:`answer_prefilled`.
    RuntimeError: when a row needed more slots than its cache held.
  """
  pol = policies.build(policy, **policy_options)
  decoding.check_model_evidence(pol, future=True)
  question = as_question(question)
  prompt, answer, q_len, _ = check_answer_inputs(model, prompt_ids, answer_ids, question)
  layout = cache_lib.as_layout(layout)
  Tc = prompt.shape[1] - q_len
  budgets, ratios = budgets_of(pol, *decoding.split_ratio(budgets), Tc)
  check_answer_memory(
    model, pol, budgets, layout.heads, prompt.shape[0], Tc, q_len + answer.shape[1] - 1
  )
  # the policy's own evidence; at least one window row (the shared prefill always holds some)
  window = max(pol.observation_window, 1)
  prefilled = _prefill_shared(
    model, prompt_ids, answer_ids, question, window, pol.reads_future, pol.evidence_request
  )
  # the kinds a declaration computes, over the context's columns (what the cache holds)
  evidence = decoding.computed_evidence(model, pol, evidence, np.asarray(prompt)[:, :Tc])
  out = answer_prefilled(model, prefilled, budgets, policy=pol, layout=layout, evidence=evidence)
  return dataclasses.replace(out, ratios=ratios)
