"""KVzip's and KVCompose's reconstruction attention: the context read again after itself.

* :func:`kvzip_template`, :func:`kvzip_chunks`: KVzip's reconstruction prompt;
  :class:`KVzipOptions`: its other options, passed on together;
* :func:`kvzip_evidence` -> ``reconstruction_attn_LGT``: KVzip (Kim et al., 2025, arXiv
  2505.23416) as kvpress 0.5.5's ``KVzipPress`` computes it;
* :func:`kvcompose_evidence` -> ``reconstruction_attn_LHT``: KVCompose (arXiv 2509.05165) as
  kvpress 0.5.5's ``KVComposePress`` computes it;
* :func:`kvzip_corpus`: text rows and a template for training on KVzip's scores (KVzap's
  surrogate, Fast KVzip's gates, RestoreKV's adapter).

Every pass here is a plain layer loop (``lax.scan`` over the stacked layers) built on the
public functions of :mod:`kvjax.model.llama`, with dense attention up to
:data:`DENSE_CONTEXT` tokens. Softmax and scores are fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import llama, passes, training
from kvjax.model.config import ModelConfig
from kvjax.scores import PRECISION

Array = jax.Array


DENSE_CONTEXT = 4096  # longer contexts are prefilled by llama.prefill (no [T, T] matrix)
KVZIP_FIRST = "\n\nRepeat the previous context exactly."
KVZIP_LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True)
class KVzipTemplate:
  """KVzip's reconstruction prompt in token ids (kvpress's ``KVzipPress.prepare``).

  ``first_ids``: "\\n\\nRepeat the previous context exactly." (the first chunk);
  ``later_ids``: "\\n\\nRepeat the part of the previous context exactly, starting with" (later
  chunks, followed by the previous chunk's last 8 tokens); ``suffix_ids``: the chat template's
  text after the user turn (its assistant header), or "\\n" without a chat template;
  ``prefix_length``: how many context tokens come before the user content (the chat template's
  header, 0 without one): they are not reconstructed and keep score 0.
  """

  first_ids: tuple[int, ...]
  later_ids: tuple[int, ...]
  suffix_ids: tuple[int, ...]
  prefix_length: int = 0


@dataclasses.dataclass(frozen=True)
class KVzipOptions:
  """KVzip's scoring options besides its template (kvpress ``KVzipPress``'s), of
  :func:`kvzip_evidence` and of every function that runs it on the caller's behalf;
  :func:`kvzip_evidence` checks them.

  Attributes:
    chunk_size: context tokens per reconstruction chunk (2048).
    n_sink: the first context tokens every repeat query also attends to (4).
    plus: whether to apply KVzip+'s normalisation.
  """

  chunk_size: int = 2048
  n_sink: int = 4
  plus: bool = False

  @classmethod
  def from_settings(cls, settings) -> KVzipOptions:
    """The options ``settings`` holds (:func:`kvjax.model.training.from_settings`), unchecked:
    :func:`kvzip_evidence` checks them."""
    return training.from_settings(cls, settings)


def check_kvzip_options(name: str, options) -> KVzipOptions:
  """``options``, or the defaults for ``None``.

  Args:
    name: the argument's name, for the error.
    options: a :class:`KVzipOptions` or ``None``.

  Returns:
    The options.

  Raises:
    ValueError: for anything else.
  """
  options = KVzipOptions() if options is None else options
  if not isinstance(options, KVzipOptions):
    raise ValueError(f"{name}: expected a KVzipOptions or None, got {options!r:.80}")
  return options


def kvzip_template(tokenizer, *, prefix_text: str = "", suffix_text: str = "\n") -> KVzipTemplate:
  """Builds a :class:`KVzipTemplate` from a tokenizer.

  The texts are encoded without special tokens, as kvpress's ``add_special_tokens=False``.
  kvpress splits the model's chat template around a dummy user turn into ``prefix_text`` and
  ``suffix_text``; kvjax's tokenizers carry no chat template, so pass them (defaults: kvpress's
  choice for models without one).

  Args:
    tokenizer: a tokenizer with ``encode``.
    prefix_text: the chat template's text before the user content (its length becomes
      ``prefix_length``).
    suffix_text: the chat template's text after the user turn.

  Returns:
    The template in token ids.
  """
  enc = tokenizer.encode
  return KVzipTemplate(
    first_ids=tuple(enc(KVZIP_FIRST)),
    later_ids=tuple(enc(KVZIP_LATER)),
    suffix_ids=tuple(enc(suffix_text)),
    prefix_length=len(enc(prefix_text)) if prefix_text else 0,
  )


def check_template(
  template,
  cfg: ModelConfig,
  T: int,
  read=("first_ids", "later_ids", "suffix_ids"),
  verb="reconstruct",
) -> int:
  """Checks a :class:`KVzipTemplate` against a model and a ``T``-token context.

  Args:
    template: the template.
    cfg: the model's config (its vocabulary).
    T: the context's length.
    read: the template's id fields the caller reads (each one row, possibly empty).
    verb: what the context's tokens after the prefix are for, for the error.

  Returns:
    ``template.prefix_length``.

  Raises:
    ValueError: for a ``template`` that is not a :class:`KVzipTemplate`, ids outside the
      vocabulary, or a ``prefix_length`` that is not an int ``>= 0`` or leaves nothing.
  """
  if not isinstance(template, KVzipTemplate):
    raise ValueError(f"template: expected a KVzipTemplate, got {type(template).__name__}")
  for name in read:
    ids_1T = np.asarray(getattr(template, name), np.int64).reshape(1, -1)
    llama.check_token_ids(f"template.{name}", ids_1T, cfg.vocab_size, min_len=0)
  prefix = training.check_int("template.prefix_length", template.prefix_length, 0)
  if prefix >= T:
    raise ValueError(
      f"template.prefix_length: {prefix} leaves nothing of the {T}-token context to {verb}"
    )
  return prefix


def kvzip_chunks(
  context_BT: np.ndarray, template: KVzipTemplate, chunk_size: int, prev_postfix_size: int = 8
) -> list[tuple[int, int, np.ndarray]]:
  """Cuts the context into KVzip's reconstruction chunks (``KVzipPress.prepare`` and ``_chunk_fn``).

  The context after the template's prefix is cut into ``chunk_size`` pieces, each asked back as
  ``prompt + suffix + chunk``.

  Args:
    context_BT: the context ids ``[B, T]``.
    template: the reconstruction prompt (:func:`kvzip_template`).
    chunk_size: context tokens per chunk.
    prev_postfix_size: the previous chunk's last tokens that follow the later chunks' prompt.

  Returns:
    A list of ``(start, end, repeat_ids_BQ)``, one per chunk, the ids int32.
  """
  B, T = context_BT.shape
  out, start, prev = [], template.prefix_length, None
  while start < T:
    end = min(start + chunk_size, T)
    chunk = context_BT[:, start:end]
    if prev is None:
      q = np.broadcast_to(np.asarray(template.first_ids, np.int32), (B, len(template.first_ids)))
    else:
      later = np.broadcast_to(
        np.asarray(template.later_ids, np.int32), (B, len(template.later_ids))
      )
      q = np.concatenate([later, prev[:, -prev_postfix_size:]], 1)
    suffix = np.broadcast_to(
      np.asarray(template.suffix_ids, np.int32), (B, len(template.suffix_ids))
    )
    out.append((start, end, np.concatenate([q, suffix, chunk], 1).astype(np.int32)))
    prev, start = chunk, end
  return out


def value_output_norms(cfg: ModelConfig, p: dict, v_BGND: Array) -> Array:
  """``||W_O^h v||_2`` per query head, fp32 ``[B, Hq, N]`` (kvpress
  ``KVzipPress._compute_value_output_norm``: each query head's slice of ``o_proj`` applied to
  the values of its KV head, no ``o_proj`` bias).

  Args:
    cfg: the model's config.
    p: one layer's parameters (``wo`` is read).
    v_BGND: values ``[B, G, N, D]``.

  Returns:
    fp32 norms ``[B, Hq, N]``.
  """
  G, R, D = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  wo = p["wo"].astype(jnp.float32).reshape(G, R, D, -1)
  out = jnp.einsum("grdj,bgnd->bgrnj", wo, v_BGND.astype(jnp.float32), precision=PRECISION)
  B, N = v_BGND.shape[0], v_BGND.shape[2]
  return jnp.linalg.norm(out, axis=-1).reshape(B, G * R, N)


def repeat_allowed(cfg: ModelConfig, B: int, Q: int, T: int) -> tuple[Array, Array]:
  """Where ``Q`` tokens read after a ``T``-token cached context sit, and what they see.

  Args:
    cfg: the model's config (its sliding window).
    B: rows.
    Q: the tokens read after the context.
    T: the context's length.

  Returns:
    ``(pos_BQ, allowed_BQK)``: their positions ``T .. T+Q-1`` and the model's causal mask over
    the context and themselves (``K = T + Q``).
  """
  pos_q = passes.positions(B, Q, T)
  pos_k = passes.positions(B, T + Q)
  allowed = llama.causal_allowed(
    pos_q, pos_k, jnp.ones((B, T + Q), bool), pos_q, pos_k, cfg.sliding_window
  )
  return pos_q, allowed


def read_after_context(cfg: ModelConfig, p: dict, x_BQd: Array, pos_BQ, k_ctx, v_ctx, allowed):
  """One layer's attention of tokens read after a cached context (the model's forward).

  Args:
    cfg: the model's config.
    p: the layer's parameters.
    x_BQd: the layer's input.
    pos_BQ: the tokens' positions (:func:`repeat_allowed`).
    k_ctx: the context's post-RoPE keys ``[B, G, T, D]``.
    v_ctx: the context's values ``[B, G, T, D]``.
    allowed: the mask ``[B, Q, T + Q]`` (:func:`repeat_allowed`).

  Returns:
    ``(q, k, v, probs, attn)``: the tokens' queries, keys and values, the attention
    probabilities over the context and themselves, and the attention's output.
  """
  q, k, v = llama.project_qkv(cfg, p, x_BQd, pos_BQ)
  k_all = jnp.concatenate([k_ctx, k.astype(k_ctx.dtype)], 2)
  v_all = jnp.concatenate([v_ctx, v.astype(v_ctx.dtype)], 2)
  probs = llama.attention_probs(q, k_all, allowed)
  return q, k, v, probs, llama.attend(probs, v_all)


def chunk_allowed(B: int, Q: int, sink: int, n: int) -> Array:
  """KVzip's subsampled mask: ``Q`` repeat queries see ``sink`` sinks and an ``n``-token chunk,
  and causally themselves, bool ``[B, Q, sink + n + Q]``.

  Args:
    B: rows.
    Q: repeat queries.
    sink: the sink tokens.
    n: the chunk's tokens.

  Returns:
    The mask.
  """
  tri = jnp.tril(jnp.ones((Q, Q), bool))
  return jnp.broadcast_to(
    jnp.concatenate([jnp.ones((Q, sink + n), bool), tri], 1), (B, Q, sink + n + Q)
  )


def chunk_keys(t_BGTD: Array, new_BGQD: Array, start, n: int, sink: int) -> Array:
  """KVzip's subsampled keys (or values): the ``sink`` first context tokens, the chunk
  ``[start, start + n)`` and the repeat tokens' own.

  Args:
    t_BGTD: the context's keys (or values).
    new_BGQD: the repeat tokens' keys (or values), cast to the context's dtype.
    start: the chunk's first token (may be traced).
    n: the chunk's tokens.
    sink: the sink tokens.

  Returns:
    ``[B, G, sink + n + Q, D]``.
  """
  chunk = jax.lax.dynamic_slice_in_dim(t_BGTD, start, n, 2)
  return jnp.concatenate([t_BGTD[:, :, :sink], chunk, new_BGQD.astype(t_BGTD.dtype)], 2)


def _reconstruct(cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ, start, n, sink, plus):
  """One reconstruction pass over the cached context: the repeat tokens at positions
  ``T .. T+Q-1`` attend to the whole context and causally to themselves (the model's forward);
  beside it, KVzip's score of the chunk ``[start, start + n)`` per layer ``[L, B, G, n]``
  (``start`` traced, so that equal chunks share one compile; ``sink = min(n_sink, start)``)."""
  B, Q = repeat_BQ.shape
  pos_q, allowed = repeat_allowed(cfg, B, Q, keys_LBGTD.shape[3])
  sub_allowed = chunk_allowed(B, Q, sink, n)

  def layer(x, inputs):
    p, k_ctx, v_ctx = inputs
    q, k, v, _, out = read_after_context(cfg, p, x, pos_q, k_ctx, v_ctx, allowed)
    attn = llama.attention_probs(q, chunk_keys(k_ctx, k, start, n, sink), sub_allowed)
    if plus:
      h = llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps).astype(jnp.float32)
      attn = attn / jnp.linalg.norm(h, axis=-1)[:, None, :, None]
      norms = value_output_norms(cfg, p, chunk_keys(v_ctx, v, start, n, sink))
      attn = attn * norms[:, :, None, :]
    score = attn[..., sink : sink + n].max(2)  # max over the repeat queries
    score = score.reshape(B, cfg.num_kv_heads, cfg.num_groups, n).max(2)  # and the group
    x = llama.output_and_mlp(cfg, p, x, out)
    return x, score

  stacks = (llama.stacked(params), keys_LBGTD, values_LBGTD)
  _, scores = jax.lax.scan(layer, llama.embed_tokens(cfg, params, repeat_BQ), stacks)
  return scores


def _context_kv(cfg: ModelConfig, params: dict, ids_BT: Array):
  """The context pass: post-RoPE keys and values ``[L, B, G, T, D]`` of a dense causal forward
  (what ``KVzipPress`` finds in the cache after the model's own prefill)."""
  B, T = ids_BT.shape
  pos = passes.positions(B, T)
  allowed = passes.causal_allowed(cfg, B, T)

  def layer(x, p):
    q, k, v = llama.project_qkv(cfg, p, x, pos)
    x = llama.output_and_mlp(cfg, p, x, llama.attend(llama.attention_probs(q, k, allowed), v))
    return x, (k, v)

  _, (k, v) = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return k, v


_context_kv_jit = jax.jit(_context_kv, static_argnums=0)
_reconstruct_jit = jax.jit(_reconstruct, static_argnums=(0, 6, 7, 8))


def kvzip_evidence(
  model,
  context_ids,
  template: KVzipTemplate,
  *,
  options: KVzipOptions | None = None,
) -> Array:
  """Computes KVzip's ``reconstruction_attn_LGT`` of a context, as kvpress 0.5.5's ``KVzipPress``.

  The context is prefilled once (a dense causal pass); then, chunk by chunk
  (:func:`kvzip_chunks`, ``chunk_size`` 2048), the model reads ``prompt + suffix + chunk`` after
  the cached context (positions ``T ..``, the cache put back to the context after each chunk).
  At every layer the repeat queries (post-RoPE) take a softmax over a *subsample* of keys: the
  first ``min(n_sink, start)`` context tokens, the chunk being reconstructed and the repeat
  tokens themselves (causal among them); the score of each chunk key is the maximum of that
  attention over the repeat queries and the GQA group. ``plus`` is KVzip+'s normalisation (rows
  divided by the norm of the attention input, columns times ``||W_O^h v||``). Tokens before
  ``template.prefix_length`` are never reconstructed and stay 0; the policy's sink protection
  (kvpress: the first ``n_sink`` scores set to the maximum + 1) belongs to the scorer. The
  prefill costs about twice a plain one (the context plus its repetition).
  Differs: batches of several unpadded rows (kvpress: batch 1); the model's sliding window is
  applied to the forward pass (the score ignores it, as kvpress).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    template: the reconstruction prompt (:func:`kvzip_template`).
    options: ``chunk_size``, ``n_sink`` and ``plus`` (:class:`KVzipOptions`; ``None``: the
      defaults).

  Returns:
    fp32 scores ``[L, G, T]`` for a context ``[T]``, ``[L, B, G, T]`` for a batch.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule (in the
      context or the template), ``options`` that are not a :class:`KVzipOptions`, a
      ``chunk_size`` below 1, a negative ``n_sink``, a ``template`` that is not a
      :class:`KVzipTemplate`, or a ``prefix_length`` that leaves nothing to reconstruct.
  """
  cfg, params = model.cfg, model.params()
  ids = passes.ids_2d("context_ids", context_ids, cfg)
  single = np.ndim(context_ids) == 1
  options = check_kvzip_options("options", options)
  chunk_size = training.check_int("chunk_size", options.chunk_size)
  n_sink = training.check_int("n_sink", options.n_sink, 0)
  B, T = ids.shape
  check_template(template, cfg, T)
  if T <= DENSE_CONTEXT:
    keys, values = _context_kv_jit(cfg, params, jnp.asarray(ids))
  else:  # the memory-bounded prefill (tiled attention) for long contexts
    pre = llama.prefill(cfg, params, jnp.asarray(ids), jnp.ones((B, T), jnp.int32))
    keys, values = pre.keys, pre.values
  out = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, T), jnp.float32)
  for start, end, repeat in kvzip_chunks(ids, template, chunk_size):
    sink = min(n_sink, start)
    s = _reconstruct_jit(
      cfg, params, keys, values, jnp.asarray(repeat), start, end - start, sink, bool(options.plus)
    )
    out = out.at[..., start:end].set(s)
  return out[:, 0] if single else out


# --------------------------------------------------------------------------- KVCompose


def _repeat_attention(cfg, params, keys_LBGTD, values_LBGTD, repeat_BQ):
  """The second pass of KVCompose: ``repeat_BQ`` at positions ``T .. T+Q-1`` after the cached
  context (full causal softmax over the context and themselves, the model's forward); per layer
  the max over those queries of the attention each context key receives, per query head
  ``[L, B, Hq, T]``."""
  B, Q = repeat_BQ.shape
  T = keys_LBGTD.shape[3]
  pos_q, allowed = repeat_allowed(cfg, B, Q, T)

  def layer(x, inputs):
    p, k_ctx, v_ctx = inputs
    _, _, _, probs, out = read_after_context(cfg, p, x, pos_q, k_ctx, v_ctx, allowed)
    score = probs[..., :T].astype(jnp.float32).max(2)  # probs: [B, Hq, Q, T + Q]
    x = llama.output_and_mlp(cfg, p, x, out)
    return x, score

  stacks = (llama.stacked(params), keys_LBGTD, values_LBGTD)
  _, scores = jax.lax.scan(layer, llama.embed_tokens(cfg, params, repeat_BQ), stacks)
  return scores


_repeat_attention_jit = jax.jit(_repeat_attention, static_argnums=0)


def kvcompose_evidence(model, context_ids, prompt_ids=None) -> Array:
  """Computes KVCompose's ``reconstruction_attn_LHT`` of a context, as kvpress 0.5.5's
  ``KVComposePress``.

  The context is prefilled once (a dense causal pass); then ``prompt_ids`` (default: the
  context itself) is read after the cached context (positions ``T ..``) with the model's plain
  causal attention over the context and itself. The evidence of each context key is the maximum
  over those queries of the attention it receives, per query head (kvpress ``agg_task="max"``;
  the GQA group's reduction belongs to the scorer). The prefill costs about twice a plain one,
  and the second pass forms its attention rows ``[B, Hq, Q, T + Q]`` densely.
  Differs: batches of several unpadded rows (kvpress: batch 1); one prompt (kvpress reads a
  list of prompts one after another, the cache growing).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    prompt_ids: the second pass's ids ``[Q]`` or ``[B, Q]`` (``None``: the context).

  Returns:
    fp32 evidence ``[L, Hq, T]`` for a context ``[T]``, ``[L, B, Hq, T]`` for a batch.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, or prompt
      rows that do not match the context's.
  """
  cfg, params = model.cfg, model.params()
  ids = passes.ids_2d("context_ids", context_ids, cfg)
  single = np.ndim(context_ids) == 1
  B, T = ids.shape
  if prompt_ids is None:
    repeat = ids
  else:
    repeat = passes.ids_2d("prompt_ids", prompt_ids, cfg)
    if repeat.shape[0] == 1 and B > 1:
      repeat = np.broadcast_to(repeat, (B, repeat.shape[1]))
    if repeat.shape[0] != B:
      raise ValueError(f"prompt_ids: {repeat.shape[0]} rows, expected 1 or the context's {B}")
  if T <= DENSE_CONTEXT:
    keys, values = _context_kv_jit(cfg, params, jnp.asarray(ids))
  else:  # the memory-bounded prefill (tiled attention) for long contexts
    pre = llama.prefill(cfg, params, jnp.asarray(ids), jnp.ones((B, T), jnp.int32))
    keys, values = pre.keys, pre.values
  out = _repeat_attention_jit(cfg, params, keys, values, jnp.asarray(repeat, jnp.int32))
  return out[:, 0] if single else out


# --------------------------------------------------------------------------- training text


def kvzip_corpus(
  tokenizer,
  num_rows: int,
  width: int,
  *,
  text: str | None = None,
  filler: Callable[..., list[int]] | None = None,
  prefix_text: str = "",
  suffix_text: str = "\n",
) -> tuple[np.ndarray, KVzipTemplate]:
  """Text rows and KVzip's template for training on KVzip's scores (KVzap's surrogate, Fast
  KVzip's gates, RestoreKV's adapter).

  From ``text`` (for example ``kvjax.eval.streaming.reference_text``'s prose): its first
  ``num_rows * width`` tokens cut into rows, each after the chat template's header
  ``prefix_text``, with :func:`kvzip_template`'s template. From ``filler`` instead (a word
  vocabulary that cannot spell KVzip's prompt, as the shipped tiny model's): row ``s`` is
  ``filler(width, seed=s)`` and the template's prompts are filler words too (``filler(6, seed=105)``,
  ``filler(7, seed=106)``, no suffix, no header).

  Args:
    tokenizer: a tokenizer with ``encode`` (raw ids: no leading space, no ``bos``).
    num_rows: rows.
    width: tokens per row after the header.
    text: the prose (exactly one of ``text`` and ``filler``).
    filler: ``(num_tokens, *, seed) -> ids``.
    prefix_text: the chat template's text before the user content.
    suffix_text: the chat template's text after the user turn.

  Returns:
    ``(rows, template)``: int32 ``[num_rows, header + width]`` and the template
    (``template.prefix_length`` is the header's length).

  Raises:
    ValueError: for both or neither of ``text`` and ``filler``, or a text that gives fewer
      than ``num_rows * width`` tokens.
  """
  num_rows, width = training.check_int("num_rows", num_rows), training.check_int("width", width)
  if (text is None) == (filler is None):
    raise ValueError("text, filler: expected exactly one of them")
  if filler is not None:
    rows = np.stack([filler(width, seed=s) for s in range(num_rows)]).astype(np.int32)
    return rows, KVzipTemplate(tuple(filler(6, seed=105)), tuple(filler(7, seed=106)), ())
  template = kvzip_template(tokenizer, prefix_text=prefix_text, suffix_text=suffix_text)
  head = np.asarray(tokenizer.encode(prefix_text) if prefix_text else [], np.int32)
  ids = np.asarray(tokenizer.encode(text), np.int32)
  if ids.size < num_rows * width:
    raise ValueError(f"text: gives {ids.size} tokens, fewer than {num_rows} rows x {width}")
  body = ids[: num_rows * width].reshape(num_rows, width)
  return np.concatenate([np.broadcast_to(head, (num_rows, head.size)), body], 1), template
