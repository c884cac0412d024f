"""Questions answered from a compressed context (:func:`answer_context`), without reading the
context again: the question fed through the compressed cache, then the answer decoded greedily.

Re-exported by :mod:`kvjax.model.decoding`, whose names these are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import cache as cache_lib
from kvjax.model import llama, stored
from kvjax.model.budget_checks import check_new_tokens, check_overflow


@dataclasses.dataclass(frozen=True)
class Answer:
  """What :func:`answer_context` returns.

  Attributes:
    tokens: the generated tokens ``[B, N]`` (greedy).
    logprobs: each generated token's log-probability ``[B, N]`` (fp32).
  """

  tokens: np.ndarray
  logprobs: np.ndarray


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
  continue each row's context (as :func:`~kvjax.model.decoding.generate` feeds generated
  tokens: a prefill-time policy appends, a decode-time one evicts within its budget), then
  ``max_new_tokens`` are decoded greedily. ``context`` is not changed: it answers the next
  question from the same compressed state.

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
