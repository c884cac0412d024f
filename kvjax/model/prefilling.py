"""The prefill: one pass over a prompt giving logits, the post-RoPE keys and values, and the
evidence the policies ask for (window rows, column sums, query statistics, value norms, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies
from kvjax.model.attention import layer_window, positions_from_mask
from kvjax.model.blocked import Keys, attend_chunk, fused_chunk, window_rows
from kvjax.model.checks import check_context, check_token_ids
from kvjax.model.config import ModelConfig
from kvjax.model.layers import (
  check_weight_dtype,
  embed_tokens,
  full_attention_maps,
  logits_of,
  matmul,
  output_and_mlp,
  project_heads,
  qkv_dtypes,
)
from kvjax.model.rope import average_rope, rope
from kvjax.model.stacking import sliced_in_loop, stacked
from kvjax.scores import PRECISION

Array = jax.Array


LOGITS = ("last", "all")
CHUNK = 2048  # prefill tokens per chunk: bounds the [B, chunk, F] MLP activations
ATTENTION = ("blocked", "xla", "cudnn")  # prefill's kernels for the attention output
NO_EVIDENCE = policies.EvidenceRequest()  # logits, keys and values only


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """How :func:`prefill` computes: its memory plan and kernels (static, hashable). None of these
  changes a value beyond rounding, but ``window_dtype`` stores the window rows narrower and
  ``attention_dtype`` rounds the attention output's matmul operands.

  Attributes:
    block: queries (and keys) per attention tile.
    chunk: prompt tokens per chunk of each layer (``None``: all at once).
    attention: the kernel of the attention output, one of :data:`ATTENTION`.
    window_dtype: the floating dtype the window rows are stored in.
    attention_dtype: the dtype the blocked kernel's output matmuls (``q k^T`` and ``p v``)
      read their operands in, accumulated in fp32 with an fp32 softmax: ``jnp.bfloat16`` runs
      them on bf16 units (AVX-512 BF16 and AMX CPUs, accelerators), as flash attention does,
      at bf16's rounding of the attention output (evidence, column sums and window rows stay
      fp32); fp32 by default.
  """

  block: int = 256
  chunk: int | None = CHUNK
  attention: str = "blocked"
  window_dtype: Any = jnp.float32
  attention_dtype: Any = jnp.float32


@struct.dataclass
class Prefill:
  """What one pass over a prompt returns: logits, the full post-RoPE K/V and the evidence.

  Attributes:
    logits: ``[B, 1, V]`` fp32 at the last position (``[B, T, V]`` with ``logits="all"``).
    keys, values: ``[L, B, G, T, D]`` (keys post-RoPE, at their original positions).
    positions, valid: ``[B, T]`` RoPE positions and the non-padding mask.
    key_norms: ``[L, B, G, T]`` (key norm's evidence).
    attn_window: ``[L, B, Hq, W, T]`` fp32 (or the plan's ``window_dtype``), the last ``W``
      query rows (no ``T x T`` matrix).
    window_scores: ``[L, B, Hq, T]`` fp32, the window rows already reduced to a policy's scores
      inside the layer scan (prefill's ``window_scores``; then ``attn_window`` is ``None``).
    window: ``W``, the observation queries behind ``attn_window`` or ``window_scores``
      (static; 0 when none were asked for).
    column_sums: ``[L, B, Hq, T]`` attention received from all valid queries (H2O).
    full_attention: ``{layer: [B, Hq, T, T]}`` for plots, on request.
    future_attn: ``[L, B, Hq, S, T]`` attention of later queries (the oracle's evidence; set by
      the caller that has them).
    value_out_norms: ``[L, B, Hq, T]`` fp32 CriticalKV's ``||W_O^h v_j||_1`` per query head, on
      request (0 on padding).
    query_mean, query_cov: ``[L, B, Hq, D]``, ``[L, B, Hq, D, D]`` fp32 ExpectedAttention's
      statistics of the pre-RoPE prompt queries, on request (:func:`query_statistics`).
    window_queries: ``[L, B, Hq, W, D]`` the last ``W`` post-RoPE queries (ThinK), on request.
    prerope_keys: ``[L, B, G, T, D]`` the keys before RoPE (leverage scores), on request.
    queries: ``[L, B, Hq, T, D]`` every position's post-RoPE queries (non-causal attention), on
      request.
  """

  logits: Array
  keys: Array
  values: Array
  positions: Array
  valid: Array
  key_norms: Array
  attn_window: Array | None = None
  window_scores: Array | None = None
  window: int = struct.field(pytree_node=False, default=0)
  column_sums: Array | None = None
  full_attention: dict | None = None
  future_attn: Array | None = None
  value_out_norms: Array | None = None
  query_mean: Array | None = None
  query_cov: Array | None = None
  window_queries: Array | None = None
  prerope_keys: Array | None = None
  queries: Array | None = None


def prefill(
  cfg: ModelConfig,
  params: dict,
  input_ids: Array,
  attention_mask: Array | None = None,
  request: policies.EvidenceRequest = NO_EVIDENCE,
  *,
  full_attention_layers: tuple[int, ...] = (),
  logits: str = "last",
  plan: PrefillPlan = PrefillPlan(),
) -> Prefill:
  """Runs one pass over the prompt, giving logits, K/V and the requested evidence.

  ``request`` (a :class:`kvjax.policies.EvidenceRequest`, static under ``jit``: what
  :meth:`kvjax.policies.Policy.evidence_request` asks for, or several policies' requests merged
  with ``|``) says which evidence to compute besides logits, keys and values; the default
  computes none. ``full_attention_layers`` asks for full maps of those layers.
  ``logits="last"`` (the default) computes the last position's logits only (``[B, 1, V]``: all
  that generation reads; ``[B, T, V]`` fp32 would be 16 GiB at 32k tokens and a 128k
  vocabulary), ``"all"`` every position's.

  ``plan`` (a :class:`PrefillPlan`) sets how it computes. Memory is bounded by two blockings,
  neither of which changes a value (fp32 softmax, exact to rounding). Each layer runs over the
  prompt ``chunk`` tokens at a time (``None``: all at once):
  projections, attention output and MLP of a chunk, its keys and values written in place, so
  the ``[B, chunk, F]`` MLP intermediates are the largest activations. Attention is tiled
  flash-style into ``block`` queries x ``block`` keys, skipping the tiles above the causal
  diagonal and, with ``cfg.sliding_window``, those behind the window. Without column sums
  (``request.column_sums``, H2O's) one pass with an online softmax gives the output; with them
  a first pass finds each query's normaliser and a second forms the normalised rows tile by
  tile, adding them into the column sums and the output. The window rows (the last
  ``request.window`` queries over all ``T`` keys) are written tile by tile into their
  ``[L, B, Hq, W, T]`` output, in ``window_dtype`` (fp32 by default; ``jnp.bfloat16`` halves
  the largest output, 8 GiB at 128k tokens for a 1B model, after an fp32 softmax).

  ``request.window_scores`` (a hashable callable, for example
  :meth:`kvjax.policies.Policy.window_scorer`) reduces each layer's window rows
  ``[B, Hq, W, T]`` (fp32, whatever ``window_dtype``) to scores ``[B, Hq, T]`` inside the layer
  scan, when the caller needs only a policy's scores: the output is ``window_scores``
  ``[L, B, Hq, T]`` and no ``attn_window`` (``W`` times smaller; the rows of one layer are the
  largest temporary).

  ``attention`` picks the kernel of the attention *output* when no column sums are asked for
  (with them, the exact second pass forms the output anyway): ``"blocked"`` (the tiles above),
  ``"xla"`` or ``"cudnn"`` (:func:`jax.nn.dot_product_attention` per chunk over all ``T`` keys
  with an explicit ``[B, 1, chunk, T]`` mask, in the model dtype; ``"cudnn"`` falls back to
  ``"blocked"`` off GPU or outside fp16/bf16). The evidence is computed exactly beside it. On
  CPU ``"xla"`` measured worse (1B shapes at 8k tokens: 6.3 GiB of temporaries against 0.4;
  2.3x slower at 2k tokens), hence the default.

  Evidence of issue 15's methods, each off by default (the memory plan above is unchanged):
  ``request.value_out_norms`` (CriticalKV's ``||W_O^h v_j||_1``, a head at a time,
  ``[L, B, Hq, T]``), ``request.query_stats`` (ExpectedAttention's query mean and covariance,
  accumulated chunk by chunk: :func:`query_statistics`; ``request.n_sink`` and
  ``request.n_future`` as kvpress's ``n_sink`` and ``n_future_positions``) and
  ``request.window_queries`` (the last ``window_queries`` post-RoPE queries, ThinK's channel
  evidence), ``request.prerope_keys`` (the keys before RoPE, ``[L, B, G, T, D]``) and
  ``request.queries`` (every position's post-RoPE queries, ``[L, B, Hq, T, D]``: as large as
  the keys times ``Hq / G``).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    input_ids: token ids ``[B, T]``.
    attention_mask: optional ``[B, T]`` 0/1 mask of the real tokens (left padding); ``None``:
      every token is real.
    request: the evidence to compute besides logits, keys and values.
    full_attention_layers: layers whose full ``[B, Hq, T, T]`` attention maps to return.
    logits: ``"last"`` or ``"all"`` positions' logits (:data:`LOGITS`).
    plan: the memory plan and kernels (:class:`PrefillPlan`: ``block``, ``chunk``,
      ``attention``, ``window_dtype``, ``attention_dtype``).

  Returns:
    A :class:`Prefill` with the logits, the post-RoPE keys and values, positions, validity and
    the requested evidence.

  Raises:
    ValueError: for ids breaking :func:`check_token_ids`'s rule (traced ids: their shape and
      dtype), a prompt longer than the model's context (:func:`check_context`), and arguments
      of the wrong kind.
  """
  if logits not in LOGITS:
    raise ValueError(f"logits: expected one of {LOGITS}, got {logits!r}")
  if not isinstance(plan, PrefillPlan):
    raise ValueError(f"plan: expected a kvjax.model.llama.PrefillPlan, got {plan!r}")
  block, chunk, attention, window_dtype = plan.block, plan.chunk, plan.attention, plan.window_dtype
  attention_dtype = check_weight_dtype("attention_dtype", plan.attention_dtype)
  input_ids = check_token_ids("input_ids", input_ids, cfg.vocab_size)
  B, T = input_ids.shape
  check_context(cfg, T)
  _check_count("block", block)
  if chunk is not None:
    _check_count("chunk", chunk, "None or a positive int")
  if isinstance(attention_mask, policies.EvidenceRequest):
    raise ValueError("attention_mask: got an EvidenceRequest; pass it as request=")
  if not isinstance(request, policies.EvidenceRequest):
    raise ValueError(f"request: expected a kvjax.policies.EvidenceRequest, got {request!r}")
  window, window_queries = request.window, request.window_queries
  window_scores, query_stats = request.window_scores, request.query_stats
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 0 <= window <= T:
    raise ValueError(f"window: expected an int in [0, T={T}], got {window!r}")
  if not jnp.issubdtype(jnp.dtype(window_dtype), jnp.floating):
    raise ValueError(f"window_dtype: expected a floating dtype, got {window_dtype!r}")
  if window_scores is not None and (not callable(window_scores) or not window):
    raise ValueError(
      f"window_scores: expected a callable reducing window rows, with window >= 1; got "
      f"{window_scores!r} with window={window!r}"
    )
  if attention not in ATTENTION:
    raise ValueError(f"attention: expected one of {ATTENTION}, got {attention!r}")
  if attention_dtype != jnp.float32 and attention != "blocked":
    # only the blocked kernel reads narrower operands; another kernel would ignore the choice
    raise ValueError(
      f"plan: attention_dtype={attention_dtype.name} needs attention='blocked', got "
      f"attention={attention!r}"
    )
  if (
    isinstance(window_queries, bool)
    or not isinstance(window_queries, (int, np.integer))
    or not 0 <= window_queries <= T
  ):
    raise ValueError(f"window_queries: expected an int in [0, T={T}], got {window_queries!r}")
  for name in ("column_sums", "value_out_norms", "query_stats", "prerope_keys", "queries"):
    if not isinstance(getattr(request, name), bool):
      raise ValueError(f"{name}: expected a bool, got {getattr(request, name)!r}")
  n_sink, n_future = request.n_sink, request.n_future
  if query_stats:
    _check_count("n_future", n_future)
    if isinstance(n_sink, bool) or not isinstance(n_sink, (int, np.integer)) or n_sink < 0:
      raise ValueError(f"n_sink: expected an int >= 0, got {n_sink!r}")
  if attention_mask is None:
    attention_mask = jnp.ones((B, T), jnp.int32)
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  x = embed_tokens(cfg, params, input_ids)
  sizes = dict(
    block=min(block, T),
    chunk=T if chunk is None else min(chunk, T),
    window=window,
    window_queries=window_queries,
    n_sink=n_sink if query_stats else None,
    window_scores=window_scores,
    attention_dtype=attention_dtype,
  )
  q_dtype, kv_dtype = qkv_dtypes(cfg, params, x, positions)
  if attention == "cudnn" and (
    jax.default_backend() != "gpu" or q_dtype not in (jnp.bfloat16, jnp.float16)
  ):
    attention = "blocked"  # cuDNN's flash attention runs on NVIDIA GPUs in fp16/bf16 only
  if cfg.attn_softcap is not None:
    attention = "blocked"  # jax.nn.dot_product_attention has no soft-capping
  sizes["attention"] = attention
  L, G, Hq, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
  out = {
    "keys": jnp.zeros((L, B, G, T, D), kv_dtype),
    "values": jnp.zeros((L, B, G, T, D), kv_dtype),
    "key_norms": jnp.zeros((L, B, G, T), jnp.float32),
  }
  if request.column_sums:
    out["column_sums"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  if window and window_scores is not None:
    out["window_scores"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  elif window:
    out["attn_window"] = jnp.zeros((L, B, Hq, window, T), window_dtype)
  if window_queries:
    out["window_queries"] = jnp.zeros((L, B, Hq, window_queries, D), q_dtype)
  if request.prerope_keys:
    out["prerope_keys"] = jnp.zeros((L, B, G, T, D), kv_dtype)
  if request.queries:
    out["queries"] = jnp.zeros((L, B, Hq, T, D), q_dtype)
  if request.value_out_norms:
    out["value_out_norms"] = jnp.zeros((L, B, Hq, T), jnp.float32)
  if query_stats:
    out["query_mean"] = jnp.zeros((L, B, Hq, D), jnp.float32)
    out["query_cov"] = jnp.zeros((L, B, Hq, D, D), jnp.float32)
    if not cfg.per_layer:  # else each layer's own (Gemma 3's sliding layers rotate differently)
      out["rope_mean"] = average_rope(cfg, valid.sum(-1), n_future)
  if query_stats and cfg.per_layer:
    sizes["n_future"] = n_future
  # dynamic and longrope RoPE choose by the longest row, as transformers' forward pass does
  seq_len = jnp.max(positions) + 1 if cfg.rope_type in ("dynamic", "longrope") else None

  def layer(carry, l):
    layers, l = sliced_in_loop(stacked(params), l)
    p = {k: v[l] for k, v in layers.items()}
    return _layer(cfg, p, l, *carry, positions, valid, q_dtype, seq_len, **sizes), None

  (x, out), _ = jax.lax.scan(layer, (x, out), jnp.arange(L))
  out.pop("rope_mean", None)
  maps = None
  if full_attention_layers:
    maps = full_attention_maps(cfg, params, input_ids, attention_mask, full_attention_layers)
  return Prefill(
    logits=logits_of(cfg, params, x if logits == "all" else x[:, -1:]),
    positions=positions,
    valid=valid,
    full_attention=maps,
    window=window,
    **out,
  )


def _check_count(name: str, value, expected: str = "a positive int") -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _layer(
  cfg,
  p,
  l,
  x,
  out,
  positions,
  valid,
  q_dtype,
  seq_len,
  *,
  block,
  chunk,
  window,
  window_queries,
  n_sink,
  attention,
  window_scores,
  attention_dtype=jnp.float32,
  n_future=None,
):
  """One decoder layer over the whole prompt, ``chunk`` tokens at a time (residual stream, K/V
  and the per-token evidence updated in place), then its window rows (or their scores) and
  query statistics."""
  B, T, _ = x.shape
  Hq, D = cfg.num_heads, cfg.head_dim
  sums = jnp.zeros((B, Hq, T), jnp.float32) if "column_sums" in out else None
  wq = max(window, window_queries)
  q_win = jnp.zeros((B, Hq, wq, D), q_dtype) if wq else None
  moments = empty_moments(B, Hq, D) if n_sink is not None else None
  step = _chunk_step(
    cfg, p, l, positions, valid, block, attention, n_sink, seq_len, attention_dtype
  )
  full, tail = divmod(T, chunk)
  state = (x, out, sums, q_win, moments)
  state = jax.lax.fori_loop(0, full, lambda i, s: step(i * chunk, chunk, s), state)
  if tail:
    state = step(full * chunk, tail, state)
  x, out, sums, q_win, moments = state
  put = lambda name, value: jax.lax.dynamic_update_index_in_dim(out[name], value, l, 0)  # noqa: E731
  if sums is not None:
    out = dict(out, column_sums=put("column_sums", sums))
  if window_queries:
    out = dict(out, window_queries=put("window_queries", q_win[:, :, wq - window_queries :]))
  if moments is not None:
    R = out["rope_mean"] if n_future is None else average_rope(cfg, valid.sum(-1), n_future, l)
    mean, cov = rotate_moments(R, *moments_mean_cov(moments))
    out = dict(out, query_mean=put("query_mean", mean), query_cov=put("query_cov", cov))
  if window:
    q = q_win[:, :, wq - window :]
    keys = Keys(out["keys"], out["values"], positions, valid, l, min(block, T))
    if window_scores is None:
      out = dict(out, attn_window=window_rows(cfg, q, keys, out["attn_window"], l))
    else:  # this layer's rows only, reduced before the next layer's are formed
      rows = window_rows(cfg, q, keys, jnp.zeros((1, B, Hq, window, T), jnp.float32), 0)
      out = dict(out, window_scores=put("window_scores", window_scores(rows[0])))
  return x, out


def _chunk_step(
  cfg,
  p,
  l,
  positions,
  valid,
  block,
  attention,
  n_sink=None,
  seq_len=None,
  attention_dtype=jnp.float32,
):
  """``step(c0, n, state)``: tokens ``[c0, c0 + n)`` of one layer (``n`` static)."""
  T = positions.shape[1]
  window = layer_window(cfg, l)

  def step(c0, n, state):
    x, out, sums, q_win, moments = state
    x_c = jax.lax.dynamic_slice_in_dim(x, c0, n, 1)
    pos_c = jax.lax.dynamic_slice_in_dim(positions, c0, n, 1)
    q_pre, k_pre, v = project_heads(cfg, p, x_c)
    at = dict(layer=l, seq_len=seq_len)
    q, k = rope(q_pre, pos_c, cfg, **at), rope(k_pre, pos_c, cfg, **at)
    k, v = k.astype(out["keys"].dtype), v.astype(out["values"].dtype)
    at = (l, 0, 0, c0, 0)
    out = dict(
      out,
      keys=jax.lax.dynamic_update_slice(out["keys"], k[None], at),
      values=jax.lax.dynamic_update_slice(out["values"], v[None], at),
      key_norms=jax.lax.dynamic_update_slice(
        out["key_norms"], jnp.linalg.norm(k.astype(jnp.float32), axis=-1)[None], at[:4]
      ),
    )
    if "prerope_keys" in out:
      k_pre = k_pre.astype(out["prerope_keys"].dtype)[None]
      out = dict(out, prerope_keys=jax.lax.dynamic_update_slice(out["prerope_keys"], k_pre, at))
    if "queries" in out:
      q_all = q.astype(out["queries"].dtype)[None]
      out = dict(out, queries=jax.lax.dynamic_update_slice(out["queries"], q_all, at))
    real_c = jax.lax.dynamic_slice_in_dim(valid, c0, n, 1)
    if "value_out_norms" in out:
      norms = jnp.where(real_c[:, None], value_out_norms(cfg, p, v), 0.0)
      out = dict(
        out,
        value_out_norms=jax.lax.dynamic_update_slice(out["value_out_norms"], norms[None], at[:4]),
      )
    if moments is not None:  # the row's real tokens after its first n_sink (left padding)
      moments = update_moments(moments, q_pre, real_c & (pos_c >= n_sink))
    keys = Keys(out["keys"], out["values"], positions, valid, l, min(block, T))
    if attention == "blocked" or sums is not None:
      o, sums = attend_chunk(
        q, c0, keys, sums, block, window, cfg.attn_softcap, operands=attention_dtype
      )
    else:
      o = fused_chunk(q, c0, n, keys, window, attention)
    x = jax.lax.dynamic_update_slice_in_dim(x, output_and_mlp(cfg, p, x_c, o), c0, 1)
    if q_win is not None:  # the window's queries, wherever they fall in this chunk
      rows = T - q_win.shape[2] + jnp.arange(q_win.shape[2]) - c0
      inside = ((rows >= 0) & (rows < n)).reshape(1, 1, -1, 1)
      q_win = jnp.where(inside, jnp.take(q, jnp.clip(rows, 0, n - 1), axis=2), q_win)
    return x, out, sums, q_win, moments

  return step


# --------------------------------------------------------------------------- issue 15's evidence


def value_out_norms(cfg: ModelConfig, p: dict, v_BGTD: Array) -> Array:
  """Computes CriticalKV's ``||W_O^h v_j||_1`` per query head, fp32.

  Each query head's slice of ``o_proj`` is applied to the values of its KV head (kvpress
  ``CriticalKVPress.vwl1norm`` before its group mean; no ``o_proj`` bias), one head at a time so
  no ``[B, Hq, T, d]`` is formed.

  Args:
    cfg: the model's config.
    p: one layer's parameters (``wo`` is read).
    v_BGTD: the layer's values ``[B, G, T, D]``.

  Returns:
    fp32 norms ``[B, Hq, T]``.
  """
  Hq, D = cfg.num_heads, cfg.head_dim
  wo = p["wo"].reshape(Hq, D, -1)
  groups = Hq // v_BGTD.shape[1]

  def head(h):
    v = jnp.take(v_BGTD, h // groups, axis=1).astype(jnp.float32)  # [B, T, D]
    w = jax.lax.dynamic_index_in_dim(wo, h, 0, keepdims=False).astype(jnp.float32)
    return jnp.abs(matmul(v, w)).sum(-1)

  return jnp.moveaxis(jax.lax.map(head, jnp.arange(Hq)), 0, 1)


def empty_moments(B: int, H: int, D: int) -> tuple:
  """Returns the query moments before any query is seen.

  Args:
    B: rows.
    H: query heads.
    D: the head dimension.

  Returns:
    ``(count [B], mean [B, H, D], m2 [B, H, D, D])``, fp32 zeros.
  """
  f32 = jnp.float32
  return jnp.zeros((B,), f32), jnp.zeros((B, H, D), f32), jnp.zeros((B, H, D, D), f32)


def update_moments(moments: tuple, q_BHND: Array, weight_BN: Array) -> tuple:
  """Adds the queries where ``weight_BN`` is set to the running count, mean and centred moment.

  Chan et al.'s parallel update: each chunk's own mean and centred moment, then the correction
  ``delta delta^T n_a n_b / n``; stable where ``E[qq^T] - mu mu^T`` cancels, and never a
  per-token ``[D, D]``.

  Args:
    moments: ``(count [B], mean [B, H, D], m2 [B, H, D, D])`` so far (:func:`empty_moments`).
    q_BHND: the chunk's queries ``[B, H, N, D]``.
    weight_BN: which of them count ``[B, N]`` (bool or 0/1).

  Returns:
    The updated ``(count, mean, m2)``, fp32.
  """
  count, mean, m2 = moments
  w = weight_BN.astype(jnp.float32)
  q = q_BHND.astype(jnp.float32)
  n_b = w.sum(-1)
  c_mean = jnp.einsum("bhnd,bn->bhd", q, w, precision=PRECISION) / jnp.maximum(n_b, 1.0).reshape(
    -1, 1, 1
  )
  centred = (q - c_mean[:, :, None]) * w[:, None, :, None]
  c_m2 = jnp.einsum("bhnd,bhne->bhde", centred, centred, precision=PRECISION)
  total = count + n_b
  frac = jnp.where(total > 0, n_b / jnp.maximum(total, 1.0), 0.0)
  delta = c_mean - mean
  outer = jnp.einsum("bhd,bhe->bhde", delta, delta, precision=PRECISION)
  return (
    total,
    mean + delta * frac.reshape(-1, 1, 1),
    m2 + c_m2 + outer * (count * frac).reshape(-1, 1, 1, 1),
  )


def moments_mean_cov(moments: tuple) -> tuple[Array, Array]:
  """Computes the mean and covariance of the counted queries, dividing by the count.

  kvpress divides by the count too (``einsum(...) / h.shape[1]``, not ``count - 1``).

  Args:
    moments: ``(count [B], mean [B, H, D], m2 [B, H, D, D])`` (:func:`update_moments`).

  Returns:
    ``(mean [B, H, D], cov [B, H, D, D])``; zeros for a row with no query counted.
  """
  count, mean, m2 = moments
  return mean, m2 / jnp.maximum(count, 1.0).reshape(-1, 1, 1, 1)


def rotate_moments(R_BDD: Array, mean_BHD: Array, cov_BHDD: Array) -> tuple[Array, Array]:
  """Rotates a mean and covariance by ``R``: ``mu R^T`` and ``R cov R^T``.

  As kvpress's ``matmul(mu, R.T)`` and ``R @ cov @ R.T``.

  Args:
    R_BDD: rotation matrices ``[B, D, D]`` (:func:`average_rope`).
    mean_BHD: means ``[B, H, D]``.
    cov_BHDD: covariances ``[B, H, D, D]``.

  Returns:
    ``(mean [B, H, D], cov [B, H, D, D])``, rotated.
  """
  mean = jnp.einsum("bhj,bij->bhi", mean_BHD, R_BDD, precision=PRECISION)
  cov = jnp.einsum("bij,bhjk,blk->bhil", R_BDD, cov_BHDD, R_BDD, precision=PRECISION)
  return mean, cov
