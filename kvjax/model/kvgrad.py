"""KVgrad's evidence: input x gradient attribution of each KV pair to the final hidden states,
over KVzip's context reconstruction (kvpress 0.5.5 ``presses/kvgrad_press.py::KVgradPress``).

:func:`kvgrad_evidence` -> ``kvgrad_LGT``, the evidence :class:`kvjax.policies.kvgrad.KVgrad`
reads. The context is prefilled once; then, chunk by chunk (KVzip's reconstruction prompt,
:func:`kvjax.model.reconstruction.kvzip_chunks`), the model reads ``prompt + suffix + chunk`` after the
cached context, and the score of each context KV pair ``c`` of the chunk at layer ``l`` is

  ``S_{l,c} = max_{p, r} A^l_{p,r,c} * ||W_O^{l,r} v^l_c||_2 * ||d Phi / d a^l_p||_2``

with ``A`` KVzip's reconstruction attention of query head ``r`` (of the KV head of ``c``),
``||W_O v||`` the signal the pair writes into the residual stream, ``a^l_p`` the attention
output that layer ``l`` adds to the residual stream of probe token ``p`` and
``Phi = sum_p ||h^L_p||^2`` over the last decoder layer's hidden states (before the final norm).
The gradient is ``jax.grad`` of ``Phi`` with respect to a zero offset added to every layer's
attention output (the same derivative kvpress reads from ``attention_output.grad``); the cached
context keys and values are constants of the replay, as kvpress detaches them.

Every replay is a plain layer loop (``lax.scan`` over the stacked layers, each layer
rematerialised in the backward pass) built on the public functions of :mod:`kvjax.model.llama`,
with dense attention over ``T + Q`` keys. Softmax, gradients and scores are fp32 (the
gradient in the model dtype, then cast, as kvpress).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import llama, passes, training
from kvjax.model.config import ModelConfig
from kvjax.model.reconstruction import (
  KVzipOptions,
  KVzipTemplate,
  check_kvzip_options,
  check_template,
  chunk_allowed,
  chunk_keys,
  kvzip_chunks,
  read_after_context,
  repeat_allowed,
  value_output_norms,  # shared with KVzip+ (reconstruction) and KVzap; kvgrad.X reaches it
)

Array = jax.Array

CHUNK_SIZE, N_SINK = 512, 4  # kvpress KVgradPress's chunk_size and (KVzipPress's) n_sink
OPTIONS = KVzipOptions(chunk_size=CHUNK_SIZE, n_sink=N_SINK)  # kvgrad_evidence's defaults


def replay(cfg: ModelConfig, params: dict, keys_LBGTD, values_LBGTD, repeat_BQ, offsets_LBQd):
  """The reconstruction pass and its objective, differentiable in ``offsets_LBQd``.

  ``repeat_BQ`` at positions ``T .. T+Q-1`` reads the cached context (full causal softmax over
  the context and itself, the model's forward with its sliding window); ``offsets_LBQd[l]`` is
  added to layer ``l``'s attention output, so the gradient of ``Phi`` with respect to it is
  ``d Phi / d a^l``. Each layer is rematerialised in the backward pass (``jax.checkpoint``).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    keys_LBGTD: the context's post-RoPE keys ``[L, B, G, T, D]`` (constants).
    values_LBGTD: the context's values ``[L, B, G, T, D]`` (constants).
    repeat_BQ: the reconstruction ids ``[B, Q]``.
    offsets_LBQd: the offsets ``[L, B, Q, d]`` (zeros: the model's own forward).

  Returns:
    ``(Phi, xs_LBQd)``: ``Phi = sum ||h^L||^2`` fp32 over every row and probe token, and the
    residual stream entering each layer (the input of its attention norm).
  """
  B, Q = repeat_BQ.shape
  pos_q, allowed = repeat_allowed(cfg, B, Q, keys_LBGTD.shape[3])

  @jax.checkpoint
  def layer(x, inputs):
    p, k_ctx, v_ctx, offset = inputs
    *_, attn = read_after_context(cfg, p, x, pos_q, k_ctx, v_ctx, allowed)
    # output_and_mlp adds o_proj's output to its residual input: the offset rides along with it
    return llama.output_and_mlp(cfg, p, x + offset.astype(x.dtype), attn), x

  stacks = (llama.stacked(params), keys_LBGTD, values_LBGTD, offsets_LBQd)
  h, xs = jax.lax.scan(layer, llama.embed_tokens(cfg, params, repeat_BQ), stacks)
  return jnp.square(h.astype(jnp.float32)).sum(), xs


def _chunk_scores(cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ, start, n, sink):
  """KVgrad's scores of the chunk ``[start, start + n)`` ``[L, B, G, n]`` (``start`` traced so
  equal chunks share one compile; ``sink = min(n_sink, start)``)."""
  B, Q = repeat_BQ.shape
  L, T, d = cfg.num_layers, keys_LBGTD.shape[3], params["embed"].shape[-1]
  offsets = jnp.zeros((L, B, Q, d), params["embed"].dtype)
  grads, xs = jax.grad(replay, argnums=5, has_aux=True)(
    cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ, offsets
  )
  grad_norms_LBQ = jnp.linalg.norm(grads.astype(jnp.float32), axis=-1)
  pos_q = passes.positions(B, Q, T)
  sub_allowed = chunk_allowed(B, Q, sink, n)

  def layer(_, inputs):
    p, x, k_ctx, v_ctx, g_BQ = inputs
    q, k, _ = llama.project_qkv(cfg, p, x, pos_q)
    sub_k = chunk_keys(k_ctx, k, start, n, sink)
    attn = llama.attention_probs(q, sub_k, sub_allowed)[..., sink : sink + n]  # [B, Hq, Q, n]
    v_norm = value_output_norms(cfg, p, jax.lax.dynamic_slice_in_dim(v_ctx, start, n, 2))
    s = attn * v_norm[:, :, None, :] * g_BQ[:, None, :, None]
    s = s.max(2).reshape(B, cfg.num_kv_heads, cfg.num_groups, n).max(2)  # max over p, group
    return None, s

  stacks = (llama.stacked(params), xs, keys_LBGTD, values_LBGTD, grad_norms_LBQ)
  _, scores = jax.lax.scan(layer, None, stacks)
  return scores


def _context_kv(cfg: ModelConfig, params: dict, ids_BT: Array):
  pre = llama.prefill(cfg, params, ids_BT)
  return pre.keys, pre.values


_context_kv_jit = jax.jit(_context_kv, static_argnums=0)
_chunk_scores_jit = jax.jit(_chunk_scores, static_argnums=(0, 6, 7))


def kvgrad_evidence(
  model,
  context_ids,
  template: KVzipTemplate,
  *,
  options: KVzipOptions = OPTIONS,
) -> Array:
  """Computes KVgrad's ``kvgrad_LGT`` of a context, as kvpress 0.5.5's ``KVgradPress``.

  The context is prefilled once (:func:`kvjax.model.llama.prefill`); then, chunk by chunk
  (:func:`kvjax.model.reconstruction.kvzip_chunks`, ``chunk_size`` 512), the model reads
  ``prompt + suffix + chunk`` after the cached context (positions ``T ..``, the cache read but
  never extended, as kvpress's ``read_only_cache``). One backward pass gives
  ``||d Phi / d a^l_p||_2`` for every layer ``l`` and probe token ``p`` (:func:`replay`:
  ``Phi = sum_p ||h^L_p||^2``, ``a^l_p`` the attention output layer ``l`` writes into the
  residual stream). At every layer the probe queries (post-RoPE) take KVzip's softmax over a
  subsample of keys: the first ``min(n_sink, start)`` context tokens, the chunk ``[start, end)``
  and the probe tokens themselves (causal among them); the score of chunk key ``c`` of KV head
  ``g`` is the max over the probe tokens ``p`` and the group's query heads ``r`` of
  ``A_{r,p,c} * ||W_O^r v_c||_2 * ||d Phi / d a_p||_2``. Tokens before
  ``template.prefix_length`` are never reconstructed and stay 0; the policy's sink protection
  (kvpress: the first ``n_sink`` scores set to the maximum + 1) belongs to the scorer. Cost: the
  prefill, then per chunk one forward and one backward pass over ``Q`` probe tokens against
  ``T + Q`` keys (each layer recomputed in the backward pass), and the subsampled attention.

  Differs from kvpress:

  * batches of several unpadded rows (kvpress: batch 1); ``Phi`` sums over the rows, which do
    not interact, so each row's scores are its own;
  * the gradient is taken with respect to a zero offset on each layer's attention output
    (kvpress: ``retain_grad`` on the attention module's output), the same derivative;
  * the model's sliding window applies to the replay (the subsampled attention ignores it, as
    kvpress);
  * the template comes pre-tokenised (:func:`kvjax.model.reconstruction.kvzip_template`): kvpress
    builds it from the model's tokenizer and chat template.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    template: the reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    options: ``chunk_size``, context tokens per replay, and ``n_sink``, the first context tokens
      every probe query also attends to (:class:`~kvjax.model.reconstruction.KVzipOptions`;
      :data:`OPTIONS`, kvpress's 512 and 4, also for ``None``); ``plus`` must stay ``False``.

  Returns:
    fp32 scores ``[L, G, T]`` for a context ``[T]``, ``[L, B, G, T]`` for a batch.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule (in the
      context or the template), ``options`` that are not a
      :class:`~kvjax.model.reconstruction.KVzipOptions` or ask for ``plus``, a ``chunk_size``
      below 1, a negative ``n_sink``, a ``template`` that is not a
      :class:`~kvjax.model.reconstruction.KVzipTemplate`, or a ``prefix_length`` that leaves
      nothing to reconstruct.
  """
  cfg, params = model.cfg, model.params()
  single = np.ndim(context_ids) == 1
  ids = passes.ids_2d("context_ids", context_ids, cfg)
  options = check_kvzip_options("options", OPTIONS if options is None else options)
  if options.plus:
    raise ValueError(
      f"options.plus: expected False (KVgrad has no KVzip+ normalisation), got {options.plus!r}"
    )
  chunk_size = training.check_int("chunk_size", options.chunk_size, 1)
  n_sink = training.check_int("n_sink", options.n_sink, 0)
  B, T = ids.shape
  check_template(template, cfg, T)
  keys, values = _context_kv_jit(cfg, params, jnp.asarray(ids, jnp.int32))
  out = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, T), jnp.float32)
  for start, end, repeat in kvzip_chunks(ids, template, chunk_size):
    s = _chunk_scores_jit(
      cfg, params, keys, values, jnp.asarray(repeat), start, end - start, min(n_sink, start)
    )
    out = out.at[..., start:end].set(s)
  return out[:, 0] if single else out
