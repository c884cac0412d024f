"""RestoreKV's evidence: learned restore tokens that read the full cache once through a LoRA
adapter, and whose keys and values join KVzip's compressed cache (RestoreKV, arXiv 2608.01247;
kvpress 0.5.5 ``presses/restorekv_press.py::RestoreKVPress``).

* :class:`Adapter`: the trained part, ``N`` restore embeddings and a LoRA adapter (rank ``r``)
  on the attention projections;
* :func:`restore_kv`: the one LoRA-adapted pass of the restore embeddings after a prefilled
  prompt (kvpress ``append_restore_tokens``), giving their keys and values per layer;
* :func:`restorekv_evidence`: KVzip's reconstruction attention and the restore keys and values
  of a context, the evidence :class:`kvjax.policies.RestoreKV` runs on;
* :func:`append_restore`: a prefill's outputs with the restore tokens appended, which every
  model entry point does before compressing;
* :func:`training_data`, :func:`distillation_loss`, :func:`train_adapter`: the adapter trained
  by self-distillation from the full-cache teacher, with optax, checkpointed with orbax;
* :func:`save` / :func:`load`: an ``.npz`` file with a json header, checked against the model.

kvpress loads published adapters (PEFT LoRA for Llama-3.1-8B-Instruct and Qwen3-8B) from the
Hugging Face hub; their training recipe is not part of kvpress. What kvjax chooses, where the
reference is silent: LoRA on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (PEFT's
initialisation: ``A`` Kaiming-uniform, ``B`` zero, scaling ``alpha / r``), restore embeddings
started from the embeddings of random vocabulary tokens, and a loss that is the KL divergence
of the compressed cache's next-token distributions from the full cache's over the text that
follows each training context (Adam, gradients clipped to norm 1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from kvjax import policies, rundir
from kvjax.model import cache as cache_lib
from kvjax.model import llama, npzfile, training
from kvjax.model.config import ModelConfig
from kvjax.model.reconstruction import KVzipTemplate, kvzip_evidence
from kvjax.policies.methods import KVzip
from kvjax.policies.restorekv import RESTORE_TOKENS, RestoreKV

Array = jax.Array

FORMAT = "kvjax.restorekv/1"
TARGETS = ("wq", "wk", "wv", "wo")  # the attention projections (kvpress: the adapter's choice)
PEFT_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
RANK, ALPHA = 8, 16.0
KEYS, VALUES = "restore_keys_LGND", "restore_values_LGND"
FIELDS = (KEYS, VALUES)  # the caller-given evidence this module adds to a prompt
LR, BATCH_SIZE, MAX_STEPS, CLIP = 1e-3, 4, 300, 1.0


@struct.dataclass
class Adapter:
  """RestoreKV's trained part for one model.

  Attributes:
    embeddings: the restore tokens' input embeddings ``[N, d]``.
    lora_a: per target projection (:data:`TARGETS`), ``A [L, in, r]``.
    lora_b: per target projection, ``B [L, r, out]``: the projection's weight becomes
      ``W + alpha / r * A @ B`` during the restore pass.
    alpha: LoRA's ``alpha`` (static).
  """

  embeddings: Array
  lora_a: dict
  lora_b: dict
  alpha: float = struct.field(pytree_node=False, default=ALPHA)

  @property
  def tokens(self) -> int:
    """The restore tokens ``N``."""
    return int(self.embeddings.shape[0])

  @property
  def rank(self) -> int:
    """LoRA's rank ``r``."""
    return int(next(iter(self.lora_a.values())).shape[-1])

  @property
  def scaling(self) -> float:
    """``alpha / r``, PEFT's scaling of ``A @ B``."""
    return self.alpha / self.rank


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """Each target projection's ``(in, out)``.

  Args:
    cfg: the model's config.

  Returns:
    ``{target: (in, out)}`` for :data:`TARGETS`.
  """
  d, D = cfg.hidden_size, cfg.head_dim
  q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
  return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}


def expected_shapes(cfg: ModelConfig, tokens: int, rank: int) -> dict[str, tuple[int, ...]]:
  """The arrays an adapter of ``tokens`` restore tokens and LoRA rank ``rank`` holds.

  Args:
    cfg: the model's config.
    tokens: restore tokens ``N``.
    rank: LoRA's rank ``r``.

  Returns:
    ``{"embeddings": (N, d), "a_<target>": (L, in, r), "b_<target>": (L, r, out)}``.
  """
  L = cfg.num_layers
  out = {"embeddings": (tokens, cfg.hidden_size)}
  for t, (i, o) in target_shapes(cfg).items():
    out[f"a_{t}"], out[f"b_{t}"] = (L, i, rank), (L, rank, o)
  return out


def _arrays(adapter: Adapter) -> dict:
  out = {"embeddings": adapter.embeddings}
  for t in TARGETS:
    out[f"a_{t}"], out[f"b_{t}"] = adapter.lora_a[t], adapter.lora_b[t]
  return out


def init_adapter(
  cfg: ModelConfig,
  params: dict,
  *,
  tokens: int = RESTORE_TOKENS,
  rank: int = RANK,
  alpha: float = ALPHA,
  seed: int = 0,
) -> Adapter:
  """An untrained adapter: the restore pass equals the base model's.

  PEFT's LoRA initialisation (``A`` Kaiming-uniform with ``a = sqrt(5)``, so bounded by
  ``1 / sqrt(in)``; ``B`` zero); the restore embeddings are copies of the embeddings of
  ``tokens`` vocabulary entries drawn with ``seed`` (as prompt tuning starts).

  Args:
    cfg: the model's config.
    params: the parameter pytree (its ``embed`` table is read).
    tokens: restore tokens ``N`` (kvpress's adapters: 8).
    rank: LoRA's rank ``r``.
    alpha: LoRA's ``alpha``.
    seed: the draw's seed.

  Returns:
    The fp32 :class:`Adapter`.

  Raises:
    ValueError: for ``tokens`` or ``rank`` that is not a positive int, or ``alpha`` that is not
      positive.
  """
  tokens, rank = training.check_int("tokens", tokens), training.check_int("rank", rank)
  alpha = training.check_float("alpha", alpha)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, tokens)
  embeddings = jnp.asarray(np.asarray(params["embed"], np.float32)[ids])
  lora_a, lora_b = {}, {}
  for t, (i, o) in target_shapes(cfg).items():
    bound = 1.0 / math.sqrt(i)
    a = rng.uniform(-bound, bound, (cfg.num_layers, i, rank))
    lora_a[t] = jnp.asarray(a, jnp.float32)
    lora_b[t] = jnp.zeros((cfg.num_layers, rank, o), jnp.float32)
  return Adapter(embeddings, lora_a, lora_b, alpha)


def check_adapter(adapter, cfg: ModelConfig, where: str = "adapter") -> None:
  """Checks that an adapter fits a model.

  Args:
    adapter: the :class:`Adapter`.
    cfg: the model.
    where: what to name in the error (an argument, or a file).

  Raises:
    ValueError: naming ``where``: not an :class:`Adapter`, a missing target, or shapes that do
      not fit the model.
  """
  if not isinstance(adapter, Adapter):
    raise ValueError(f"{where}: expected a kvjax.model.restorekv.Adapter, got {adapter!r:.80}")
  for part in ("lora_a", "lora_b"):
    missing = [t for t in TARGETS if t not in getattr(adapter, part)]
    if missing:
      raise ValueError(f"{where}: {part} lacks the targets {missing}")
  emb = np.shape(adapter.embeddings)
  if len(emb) != 2:
    raise ValueError(f"{where}: embeddings have shape {emb}, expected [N, d]")
  rank = np.shape(adapter.lora_a["wq"])[-1]
  want = expected_shapes(cfg, emb[0], rank)
  got = {k: tuple(np.shape(v)) for k, v in _arrays(adapter).items()}
  wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
  if wrong:
    said = ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in wrong.items())
    raise ValueError(
      f"{where}: does not fit this model (L={cfg.num_layers}, d={cfg.hidden_size}, "
      f"Hq={cfg.num_heads}, G={cfg.num_kv_heads}, D={cfg.head_dim}): {said}"
    )


def adapted_params(params: dict, adapter: Adapter) -> dict:
  """The model's parameters with the adapter merged: ``W + alpha / r * A @ B`` per target.

  Args:
    params: the parameter pytree.
    adapter: the :class:`Adapter`.

  Returns:
    The parameter pytree of the restore pass (the targets in their own dtype).
  """
  out = dict(params)
  for t in TARGETS:
    delta = jnp.einsum("lir,lro->lio", adapter.lora_a[t], adapter.lora_b[t])
    w = params[t]
    out[t] = (w.astype(jnp.float32) + adapter.scaling * delta).astype(w.dtype)
  return out


def _held(pre: llama.Prefill, valid_LBGT: Array | None = None) -> tuple:
  """A prefill's keys and values as one held segment of :func:`kvjax.model.cache.extend`."""
  L, B, G, T = pre.keys.shape[:4]
  valid = jnp.broadcast_to(pre.valid[None, :, None, :], (L, B, G, T))
  if valid_LBGT is not None:
    valid = valid & valid_LBGT
  positions = jnp.broadcast_to(pre.positions[None, :, None, :], (L, B, G, T))
  return (pre.keys, pre.values, valid, positions)


def next_positions(pre: llama.Prefill) -> Array:
  """Each row's next RoPE position: its real tokens' count (rows are left-padded).

  Args:
    pre: a prefill's outputs.

  Returns:
    int32 positions ``[B]``.
  """
  return pre.valid.sum(-1).astype(jnp.int32)


def restore_kv(cfg: ModelConfig, params: dict, adapter: Adapter, pre: llama.Prefill):
  """The restore tokens' keys and values after a prefilled prompt (kvpress
  ``RestoreKVPress.append_restore_tokens``).

  The ``N`` restore embeddings go through the model with the adapter merged
  (:func:`adapted_params`), at positions ``T_row .. T_row + N - 1`` of each row, each attending
  to every real prompt token and causally to the restore tokens before it; each layer's keys
  (post-RoPE) and values of them are what the cache keeps.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter`.
    pre: the prompt's prefill (:func:`kvjax.model.llama.prefill`, left-padded rows).

  Returns:
    ``(keys, values)``, each ``[L, B, G, N, D]`` in the cache's dtype.
  """
  B = pre.keys.shape[1]
  N = adapter.tokens
  pos_BN = next_positions(pre)[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
  x_BNd = jnp.broadcast_to(adapter.embeddings[None], (B, N, adapter.embeddings.shape[-1]))
  x_BNd = x_BNd.astype(params["embed"].dtype)
  out = cache_lib.extend(
    cfg,
    adapted_params(params, adapter),
    (_held(pre),),
    x_BNd,
    pos_BN,
    appended=True,
    logits_from=N,
  )
  keys, values = out[2][:2]
  return keys, values


@functools.partial(jax.jit, static_argnums=0)
def _evidence_jit(cfg, params, adapter, ids_BT):
  return restore_kv(cfg, params, adapter, llama.prefill(cfg, params, ids_BT))


def restorekv_evidence(
  cfg: ModelConfig,
  params: dict,
  adapter: Adapter,
  context_ids,
  template: KVzipTemplate,
  *,
  chunk_size: int = 2048,
  n_sink: int = 4,
  plus: bool = False,
) -> dict:
  """Computes RestoreKV's evidence of a context: KVzip's reconstruction attention
  (:func:`kvjax.model.reconstruction.kvzip_evidence`) and the restore tokens' keys and values
  (:func:`restore_kv`).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the trained :class:`Adapter` (:func:`load`, :func:`train_adapter`).
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    template: KVzip's reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    chunk_size: context tokens per reconstruction chunk (KVzip's, 2048).
    n_sink: the first context tokens every repeat query also attends to (KVzip's, 4).
    plus: KVzip+'s normalisation (kvpress ``kvzip_plus_normalization``, the ``_plus``
      adapters).

  Returns:
    A dict of ``reconstruction_attn_LGT`` ``[L, B, G, T]``, ``restore_keys_LGND`` and
    ``restore_values_LGND`` ``[L, B, G, N, D]`` (without the ``B`` axis for a ``[T]``
    context): ``evidence=`` for ``km.generate`` with the ``restorekv`` policy.

  Raises:
    ValueError: as :func:`kvjax.model.reconstruction.kvzip_evidence`, and for an adapter that does
      not fit the model (:func:`check_adapter`).
  """
  check_adapter(adapter, cfg)
  attn = kvzip_evidence(
    cfg, params, context_ids, template, chunk_size=chunk_size, n_sink=n_sink, plus=plus
  )
  return {"reconstruction_attn_LGT": attn, **restore_evidence(cfg, params, adapter, context_ids)}


def restore_evidence(cfg: ModelConfig, params: dict, adapter: Adapter, context_ids) -> dict:
  """The restore tokens' keys and values after a context (:func:`restore_kv` after a prefill
  of it), without KVzip's scores.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the trained :class:`Adapter`.
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.

  Returns:
    A dict of fp32 ``restore_keys_LGND`` and ``restore_values_LGND`` ``[L, B, G, N, D]``
    (without the ``B`` axis for a ``[T]`` context).

  Raises:
    ValueError: for an adapter that does not fit the model, or ids that are not ``[T]`` or
      ``[B, T]`` tokens of the vocabulary.
  """
  check_adapter(adapter, cfg)
  ids = np.asarray(context_ids)
  single = ids.ndim == 1
  if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
    raise ValueError(f"context_ids: expected token ids [T] or [B, T], got shape {ids.shape}")
  ids = llama.check_token_ids("context_ids", ids[None] if single else ids, cfg.vocab_size)
  keys, values = _evidence_jit(cfg, params, adapter, jnp.asarray(ids, jnp.int32))
  keys, values = jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32)
  if single:
    keys, values = keys[:, 0], values[:, 0]
  return {KEYS: keys, VALUES: values}


def fields_read(policy) -> frozenset[str]:
  """The restore fields ``policy`` reads from the caller besides its
  :attr:`~kvjax.policies.Policy.evidence_fields` (RestoreKV's restore tokens; none for others).

  Args:
    policy: a policy object.

  Returns:
    :data:`FIELDS` for a policy with ``restore_tokens``, else the empty set.
  """
  return frozenset(FIELDS) if getattr(policy, "restore_tokens", None) else frozenset()


# --------------------------------------------------------------------------- the model's cache


def check_restore_evidence(policy, evidence: dict, *, L: int, B: int, G: int, D: int) -> dict:
  """Checks the restore keys and values a caller gives with ``policy``.

  Args:
    policy: the policy (a :class:`kvjax.policies.RestoreKV` reads them; no other policy does).
    evidence: the caller's evidence mapping.
    L: layers.
    B: batch rows.
    G: KV heads.
    D: the head dimension.

  Returns:
    A dict of fp32 ``restore_keys_LGND`` and ``restore_values_LGND`` ``[L, B, G, N, D]``
    (broadcast to every row when ``[L, G, N, D]`` was given), or ``{}`` when the policy reads
    none.

  Raises:
    ValueError: naming the field: a policy that reads none given them, RestoreKV without
      them, shapes that differ from the model's or from each other, a count of restore tokens
      other than the policy's ``restore_tokens``, or values that are not finite.
  """
  n = getattr(policy, "restore_tokens", None)
  given = {k: evidence.get(k) for k in FIELDS if evidence.get(k) is not None}
  if n is None:
    if given:
      raise ValueError(
        f"evidence: {sorted(given)} are RestoreKV's restore tokens; policy {policy.label!r} "
        "does not read them (expected the restorekv policy, or no restore fields)"
      )
    return {}
  missing = [k for k in FIELDS if k not in given]
  if missing:
    raise ValueError(
      f"evidence: policy {policy.label!r} needs {missing}; pass "
      "evidence=kvjax.model.restorekv.restorekv_evidence(...)"
    )
  out = {}
  for k, v in given.items():
    arr = np.asarray(v, np.float32)
    if arr.ndim == 4:
      arr = np.broadcast_to(arr[:, None], (arr.shape[0], B, *arr.shape[1:]))
    if arr.ndim != 5 or arr.shape[:3] != (L, B, G) or arr.shape[4] != D:
      raise ValueError(
        f"evidence: {k} has shape {np.shape(v)}, expected [L, B, G, N, D] = "
        f"({L}, {B}, {G}, N, {D}) or [L, G, N, D]"
      )
    if arr.shape[3] != n:
      raise ValueError(
        f"evidence: {k} holds {arr.shape[3]} restore tokens, but policy {policy.label!r} has "
        f"restore_tokens={n}"
      )
    if not np.isfinite(arr).all():
      raise ValueError(f"evidence: {k} has non-finite values")
    out[k] = jnp.asarray(arr)
  return out


# Prefill fields with a key axis, and where it is (the restore tokens get zeros there)
_PREFILL_KEY_AXIS = {
  "attn_window": -1,
  "window_scores": -1,
  "column_sums": -1,
  "future_attn": -1,
  "value_out_norms": -1,
  "prerope_keys": -2,
  "queries": -2,
}


def _zeros_after(x: Array, n: int, axis: int) -> Array:
  pad = [(0, 0)] * x.ndim
  pad[axis % x.ndim] = (0, n)
  return jnp.pad(x, pad)


def append_restore(pre: llama.Prefill, evidence: dict | None):
  """A prefill's outputs with the restore tokens appended after every row's prompt.

  The restore keys and values become ``N`` more positions (``T_row .. T_row + N - 1``, real),
  so every row's next position is ``T_row + N``, as in kvpress, where the question follows the
  restore tokens. The per-position evidence gets ``N`` zero columns there (the policy keeps the
  restore tokens whatever they score), and the key norms their keys' norms.

  Args:
    pre: the prompt's prefill (left-padded rows).
    evidence: the checked caller evidence (``restore_keys_LGND`` and ``restore_values_LGND``
      ``[L, B, G, N, D]`` among it), or ``None``.

  Returns:
    ``(pre, evidence)``: unchanged when the evidence holds no restore tokens; else the prefill
    over ``T + N`` positions and the evidence without the restore fields, its per-row fields
    over ``T + N`` positions.
  """
  if not evidence or KEYS not in evidence:
    return pre, evidence
  evidence = dict(evidence)
  keys, values = evidence.pop(KEYS), evidence.pop(VALUES)
  N = keys.shape[3]
  B = pre.valid.shape[0]
  pos_BN = next_positions(pre)[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
  fields = {
    "keys": jnp.concatenate([pre.keys, keys.astype(pre.keys.dtype)], 3),
    "values": jnp.concatenate([pre.values, values.astype(pre.values.dtype)], 3),
    "positions": jnp.concatenate([pre.positions, pos_BN.astype(pre.positions.dtype)], 1),
    "valid": jnp.concatenate([pre.valid, jnp.ones((B, N), pre.valid.dtype)], 1),
    "key_norms": jnp.concatenate(
      [
        pre.key_norms,
        jnp.linalg.norm(keys.astype(jnp.float32), axis=-1).astype(pre.key_norms.dtype),
      ],
      3,
    ),
  }
  for name, axis in _PREFILL_KEY_AXIS.items():
    value = getattr(pre, name)
    if value is not None:
      fields[name] = _zeros_after(value, N, axis)
  for name in cache_lib.ROW_EVIDENCE:
    if evidence.get(name) is not None:
      evidence[name] = _zeros_after(jnp.asarray(evidence[name]), N, -1)
  return pre.replace(**fields), evidence


# --------------------------------------------------------------------------- training


def training_data(
  cfg: ModelConfig,
  params: dict,
  rows_BT,
  template: KVzipTemplate,
  *,
  context: int,
  ratio: float,
  tokens: int = RESTORE_TOKENS,
  chunk_size: int = 2048,
  n_sink: int = 4,
  plus: bool = False,
):
  """The self-distillation examples of text rows: each row's first ``context`` tokens are the
  context, the rest the text the student and the teacher both predict; the context pairs
  RestoreKV keeps at ``ratio`` are fixed once (KVzip's scores do not depend on the adapter).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    rows_BT: unpadded text rows ``[B, T]`` with ``T > context``.
    template: KVzip's reconstruction prompt.
    context: the context tokens of each row.
    ratio: kvpress's ``compression_ratio`` the restore tokens are trained for: each head keeps
      ``int(context * (1 - ratio))`` slots on average, the restore tokens among them.
    tokens: restore tokens ``N`` (0: KVzip alone over the whole budget, the baseline that
      :func:`distillation_loss` scores without an adapter).
    chunk_size: KVzip's reconstruction chunk.
    n_sink: KVzip's sinks.
    plus: KVzip+'s normalisation.

  Returns:
    ``(context_BT, continuation_BM, keep_LBGT)``: int32 ids and the bool kept context pairs.

  Raises:
    ValueError: for rows not longer than ``context``, a ratio outside ``[0, 1)``, or a budget
      that leaves no context pair besides the restore tokens.
  """
  rows = np.asarray(rows_BT, np.int32)
  context = training.check_int("context", context)
  if rows.ndim != 2 or rows.shape[1] <= context:
    raise ValueError(
      f"rows_BT: expected [B, T] rows longer than context={context}, got shape {rows.shape}"
    )
  ok = isinstance(ratio, (int, float, np.floating)) and not isinstance(ratio, bool)
  if not ok or not 0.0 <= float(ratio) < 1.0:
    raise ValueError(
      f"ratio: expected a float in [0, 1) (kvpress compression_ratio), got {ratio!r}"
    )
  budget = int(context * (1 - float(ratio)))
  if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
    raise ValueError(f"tokens: expected a non-negative int, got {tokens!r}")
  policy = RestoreKV(restore_tokens=tokens, sinks=n_sink) if tokens else KVzip(sinks=n_sink)
  policy.check_budget(budget, 0)
  ctx, cont = rows[:, :context], rows[:, context:]
  attn = np.asarray(
    kvzip_evidence(cfg, params, ctx, template, chunk_size=chunk_size, n_sink=n_sink, plus=plus)
  )
  L, B, G, T = attn.shape
  keep = np.zeros((L, B, G, T), bool)
  for b in range(B):
    scores = np.concatenate([attn[:, b], np.zeros((L, G, tokens), np.float32)], -1)
    mask = policy.keep_mask(policies.Evidence(reconstruction_attn_LGT=jnp.asarray(scores)), budget)
    keep[:, b] = np.asarray(mask)[..., :T]
  return ctx, cont, keep


def _log_softmax(logits):
  return jax.nn.log_softmax(logits.astype(jnp.float32), -1)


def distillation_loss(
  cfg: ModelConfig, params: dict, adapter: Adapter | None, context_BT, continuation_BM, keep_LBGT
) -> Array:
  """The mean KL divergence of the compressed cache's next-token distributions from the full
  cache's, over the continuation tokens.

  The teacher reads the continuation after the full context (positions ``T ..``); the student
  after the kept context pairs and the restore tokens (positions ``T + N ..``, as at inference).
  Only the restore keys and values depend on the adapter.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter` (``None``: the kept context pairs alone, KVzip's cache).
    context_BT: context ids ``[B, T]`` (unpadded).
    continuation_BM: the text that follows ``[B, M]``.
    keep_LBGT: the context pairs the compressed cache keeps.

  Returns:
    The scalar loss (nats per continuation token).
  """
  pre = jax.lax.stop_gradient(llama.prefill(cfg, params, context_BT))
  B, M = continuation_BM.shape
  T = context_BT.shape[1]
  steps = jnp.arange(M, dtype=jnp.int32)[None]
  teacher, _ = cache_lib.extend(cfg, params, (_held(pre),), continuation_BM, T + steps)
  p_log = jax.lax.stop_gradient(_log_softmax(teacher))
  if adapter is None:
    student, _ = cache_lib.extend(cfg, params, (_held(pre, keep_LBGT),), continuation_BM, T + steps)
    return (jnp.exp(p_log) * (p_log - _log_softmax(student))).sum(-1).mean()
  N = adapter.tokens
  keys, values = restore_kv(cfg, params, adapter, pre)
  L, _, G = keys.shape[:3]
  restored = (
    keys,
    values,
    jnp.ones((L, B, G, N), bool),
    jnp.broadcast_to(T + jnp.arange(N, dtype=jnp.int32), (L, B, G, N)),
  )
  student, _ = cache_lib.extend(
    cfg, params, (_held(pre, keep_LBGT), restored), continuation_BM, T + N + steps
  )
  return (jnp.exp(p_log) * (p_log - _log_softmax(student))).sum(-1).mean()


def optimizer(lr: float = LR, clip: float = CLIP) -> optax.GradientTransformation:
  """Adam at a constant ``lr`` after clipping the gradients' global norm to ``clip``.

  Args:
    lr: the learning rate.
    clip: the largest global gradient norm.

  Returns:
    The optax transformation.
  """
  return optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr))


@dataclasses.dataclass(frozen=True)
class AdapterTraining:
  """:func:`train_adapter`'s result.

  Attributes:
    adapter: the trained :class:`Adapter`.
    history: one row per logged step: ``(step, train_loss, test_loss)``, the training loss of
      the step's batch before its update, the test loss after it (nan without test rows).
    initial_test_loss: the untrained adapter's test loss.
  """

  adapter: Adapter
  history: tuple[tuple[float, float, float], ...]
  initial_test_loss: float


_loss_jit = jax.jit(distillation_loss, static_argnums=0)


def mean_loss(cfg: ModelConfig, params: dict, adapter: Adapter | None, data, batch: int) -> float:
  """The mean :func:`distillation_loss` over examples, in batches weighted by their size.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter` (``None``: KVzip's kept pairs alone).
    data: ``(context_BT, continuation_BM, keep_LBGT)`` (:func:`training_data`), or ``None``.
    batch: examples per call.

  Returns:
    The mean loss (nan for ``data=None``).

  Raises:
    ValueError: for a ``batch`` that is not an int ``>= 1``.
  """
  if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
    raise ValueError(f"batch: expected an int >= 1 of examples per call, got {batch!r}")
  if data is None:
    return float("nan")
  ctx, cont, keep = data
  total = 0.0
  for i in range(0, len(ctx), batch):
    part = (ctx[i : i + batch], cont[i : i + batch], keep[:, i : i + batch])
    total += float(_loss_jit(cfg, params, adapter, *part)) * len(part[0])
  return total / len(ctx)


@dataclasses.dataclass(frozen=True)
class AdapterConfig(training.TrainConfig):
  """:func:`train_adapter`'s hyperparameters, each checked when made.

  Attributes:
    lr: Adam's learning rate.
    batch_size: examples per step.
    seed: the seed of the initialisation and the shuffles.
    tokens: restore tokens ``N``.
    rank: LoRA's rank.
    alpha: LoRA's ``alpha``.
    max_steps: optimiser steps.
    log_every: steps between log rows (the last step is logged too).
    checkpoint_every: steps between checkpoints.
  """

  lr: float = training.float_field(LR)
  batch_size: int = training.int_field(BATCH_SIZE)
  tokens: int = training.int_field(RESTORE_TOKENS)
  rank: int = training.int_field(RANK)
  alpha: float = training.float_field(ALPHA)
  max_steps: int = training.int_field(MAX_STEPS)
  log_every: int = training.int_field(10)
  checkpoint_every: int = training.int_field(50)


def _check_examples(name: str, data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  ctx, cont, keep = (np.asarray(a) for a in data)
  if ctx.ndim != 2 or cont.ndim != 2 or keep.shape[1:2] != ctx.shape[:1] or len(cont) != len(ctx):
    raise ValueError(
      f"{name}: expected (context [B, T], continuation [B, M], keep [L, B, G, T]), got shapes "
      f"{ctx.shape}, {cont.shape}, {keep.shape}"
    )
  return ctx, cont, keep


def train_adapter(
  cfg: ModelConfig,
  params: dict,
  train,
  config: AdapterConfig | None = None,
  *,
  test=None,
  checkpoint_dir: str | pathlib.Path | None = None,
  on_log: Callable[[tuple], None] | None = None,
  **options,
) -> AdapterTraining:
  """Trains RestoreKV's adapter by self-distillation (:func:`distillation_loss`), with
  :func:`kvjax.model.training.run`.

  The restore embeddings and LoRA's ``A`` and ``B`` are trained, the model frozen. Each step
  draws ``batch_size`` training examples; the examples are reshuffled whenever a pass over them
  starts (each pass's order depends only on ``seed`` and the pass). With a ``checkpoint_dir``
  the adapter, the optimiser state and the log are saved with orbax every
  ``checkpoint_every`` steps and at the end, and a later call with the same arguments resumes
  from the last checkpoint: the result equals an uninterrupted run's.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    train: ``(context_BT, continuation_BM, keep_LBGT)`` (:func:`training_data`).
    config: the hyperparameters (``None``: :class:`AdapterConfig`'s defaults).
    test: held-out examples of the same form, scored every ``log_every`` steps (``None``: no
      test loss).
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    on_log: called with each log row (after any checkpoint of that step); the default prints a
      progress line.
    **options: :class:`AdapterConfig` fields, over ``config`` (``max_steps=12``, ...).

  Returns:
    The :class:`AdapterTraining`.

  Raises:
    ValueError: for options that are not positive, fewer training examples than
      ``batch_size``, examples whose arrays disagree in shape, or a ``checkpoint_dir`` holding
      a run with other arguments.
  """
  c = AdapterConfig.make(config, **options)
  ctx, cont, keep = _check_examples("train", train)
  if len(ctx) < c.batch_size:
    raise ValueError(f"batch_size: {c.batch_size} is more than the {len(ctx)} training examples")
  adapter = init_adapter(cfg, params, tokens=c.tokens, rank=c.rank, alpha=c.alpha, seed=c.seed)
  opt = optimizer(c.lr)
  jitted = jax.jit(  # the model's parameters are an argument, not a closure (jit folds those)
    training.optax_step(lambda a, p, *batch: distillation_loss(cfg, p, a, *batch), opt)
  )

  def row(i, before, after, losses, batch):
    return (i, losses[-1][0], mean_loss(cfg, params, after, test, c.batch_size))

  loop = training.Loop(
    name="restorekv",
    units=c.max_steps,
    columns=("step", "train_loss", "test_loss"),
    batches=training.passes(len(ctx), c.batch_size, c.seed, sort=True),
    batch=lambda i, b: (ctx[b], cont[b], keep[:, b]),
    step=lambda a, st, *batch: jitted(a, st, params, *batch),
    row=row,
    log_every=c.log_every,
    log_last=True,
    checkpoint_every=c.checkpoint_every,
  )
  initial = mean_loss(cfg, params, adapter, test, c.batch_size)
  if on_log is None:

    def on_log(row):
      print(
        f"restorekv: [{int(row[0]):5d}/{c.max_steps}] KL {row[1]:.4f} (test {row[2]:.4f})",
        flush=True,
      )

  run = training.run(
    loop,
    adapter,
    opt.init(adapter),
    checkpoint_dir=checkpoint_dir,
    record={**c.record(), "data_shape": [list(a.shape) for a in (ctx, cont, keep)]},
    on_log=on_log,
  )
  return AdapterTraining(run.params, run.history, initial)


# --------------------------------------------------------------------------- files


def save(path: str | pathlib.Path, adapter: Adapter, meta: dict | None = None) -> pathlib.Path:
  """Writes an adapter as an ``.npz`` file: the arrays and a json header (``format``,
  ``alpha``, ``targets``, ``shapes`` and the caller's ``meta``, e.g. the model and the data).

  Args:
    path: the file to write.
    adapter: the :class:`Adapter`.
    meta: json-serialisable facts to keep with it.

  Returns:
    The path written.
  """
  arrays = _arrays(adapter)
  header = {
    **(meta or {}),
    "format": FORMAT,
    "alpha": float(adapter.alpha),
    "targets": list(TARGETS),
    "shapes": {k: list(np.shape(v)) for k, v in arrays.items()},
  }
  return npzfile.write(path, arrays, header)


def load(path: str | pathlib.Path, cfg: ModelConfig) -> tuple[Adapter, dict]:
  """Reads an adapter written by :func:`save` and checks it against a model.

  Args:
    path: the ``.npz`` file.
    cfg: the model the adapter must fit.

  Returns:
    ``(adapter, meta)``.

  Raises:
    ValueError: naming the file, for one that is missing or unreadable, lacks the header or an
      array, or holds shapes that do not fit ``cfg`` (each named with what it should be).
  """
  files, meta = npzfile.read(path, FORMAT, "RestoreKV adapter")
  where = f"path: {path} (model {meta.get('model')!r})"
  need = ["embeddings"] + [f"{p}_{t}" for t in TARGETS for p in ("a", "b")]
  missing = [k for k in need if k not in files]
  if missing:
    raise ValueError(f"{where}: lacks the arrays {missing}")
  adapter = Adapter(
    jnp.asarray(files["embeddings"]),
    {t: jnp.asarray(files[f"a_{t}"]) for t in TARGETS},
    {t: jnp.asarray(files[f"b_{t}"]) for t in TARGETS},
    float(meta.get("alpha", ALPHA)),
  )
  check_adapter(adapter, cfg, where)
  return adapter, meta


def trained_fraction(adapter: Adapter, params: dict) -> float:
  """The adapter's trained values as a fraction of the model's parameters.

  Args:
    adapter: the :class:`Adapter`.
    params: the parameter pytree.

  Returns:
    ``adapter values / model values``.
  """
  trained = sum(int(np.size(v)) for v in _arrays(adapter).values())
  total = sum(int(np.size(v)) for v in jax.tree.leaves(params))
  return trained / total


# --------------------------------------------------------------------------- the experiment


def restore_timings(c, cfg: ModelConfig, params: dict, adapter: Adapter, row, template) -> dict:
  """The restore pass (a prefill and the ``N`` tokens) against KVzip's reconstruction evidence.

  Args:
    c: the settings (``chunk_size``, ``n_sink``, ``plus``: KVzip's).
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter`.
    row: one context ``[T]``.
    template: KVzip's reconstruction prompt.

  Returns:
    ``{"tokens", "restore_pass_s", "kvzip_evidence_s"}``.
  """
  ids = jnp.asarray(row[None])
  restore = jax.jit(lambda p, a, x: restore_kv(cfg, p, a, llama.prefill(cfg, p, x)))
  _, t_restore = training.timed(lambda: restore(params, adapter, ids))
  _, t_kvzip = training.timed(
    lambda: kvzip_evidence(
      cfg, params, row, template, chunk_size=c.chunk_size, n_sink=c.n_sink, plus=c.plus
    )
  )
  return {"tokens": int(row.size), "restore_pass_s": t_restore, "kvzip_evidence_s": t_kvzip}


def experiment(c, cfg: ModelConfig, params: dict, rows, template: KVzipTemplate, source: str):
  """RestoreKV's adapter of ``python -m experiments.restorekv`` (one process).

  Each row is a context of ``template.prefix_length + c.length`` tokens and the continuation
  after it; the first ``c.rows`` rows train, the others test. The self-distillation examples
  (:func:`training_data`: KVzip's kept pairs at ``c.ratio``, fixed once) are built part by part
  and saved (``data/*.npz``, :func:`kvjax.model.training.cached_parts`): the training and test
  examples with ``c.tokens`` restore tokens, and the test examples of KVzip alone over the whole
  budget (the baseline RestoreKV must beat at equal memory). The adapter trains with orbax
  checkpoints (``checkpoints/``, :func:`train_adapter`); ``restorekv_adapter.npz`` and
  ``results.json`` (the test KL of the untrained and the trained adapter and of KVzip alone,
  the loss curve, the time of the restore pass against KVzip's reconstruction) are written and
  summarised on stdout. Killed, the same call resumes.

  Args:
    c: the settings (``configs/restorekv.py``): ``workdir``, ``model``, ``dtype``, ``rows``,
      ``length``, ``continuation``, ``batch_rows``, ``ratio``, ``chunk_size``, ``n_sink``,
      ``plus``, ``prefix``, ``suffix`` and the :class:`AdapterConfig` fields.
    cfg: the model's config.
    params: the parameter pytree.
    rows: the text rows ``[rows + test rows, header + length + continuation]``
      (:func:`kvjax.model.reconstruction.kvzip_corpus`).
    template: KVzip's reconstruction prompt.
    source: where the text comes from (kept in the files).

  Returns:
    The results (``results.json``).

  Raises:
    ValueError: for a refused ``workdir`` (:func:`kvjax.rundir.check_workdir`), saved data or
      checkpoints of other settings, or bad :class:`AdapterConfig` fields.
  """
  workdir = rundir.check_workdir(c.workdir)
  config = AdapterConfig.from_settings(c)
  workdir.mkdir(parents=True, exist_ok=True)
  context = template.prefix_length + c.length
  names = ("model", "dtype", "rows", "length", "continuation", "batch_rows", "ratio", "tokens")
  names += ("chunk_size", "n_sink", "plus", "prefix", "suffix")
  identity = {k: getattr(c, k) for k in names} | {"rows_sum": int(np.sum(rows))}

  def examples(part_rows, tokens: int, name: str):
    """The self-distillation examples of ``part_rows``, part by part, each part saved."""

    def part(i):
      return training_data(
        cfg,
        params,
        part_rows[i : i + c.batch_rows],
        template,
        context=context,
        ratio=c.ratio,
        tokens=tokens,
        chunk_size=c.chunk_size,
        n_sink=c.n_sink,
        plus=c.plus,
      )

    names = {"context": 0, "continuation": 0, "keep": 1}
    data = training.cached_parts(
      workdir / "data", len(part_rows), c.batch_rows, part, names,
      prefix=name, identity=identity, label=f"{name}: rows",
    )  # fmt: skip
    return tuple(data[k] for k in names)

  train_rows, test_rows = rows[: c.rows], rows[c.rows :]
  t0 = time.perf_counter()
  train = examples(train_rows, c.tokens, "train")
  test = examples(test_rows, c.tokens, "test")
  baseline = examples(test_rows, 0, "kvzip")
  spent = {"data": round(time.perf_counter() - t0, 2)}
  print(f"examples: {len(train[0])} train, {len(test[0])} test; context {context} tokens")
  t0 = time.perf_counter()
  trained = train_adapter(
    cfg, params, train, config, test=test, checkpoint_dir=workdir / "checkpoints"
  )
  spent["training"] = round(time.perf_counter() - t0, 2)
  results = {
    "model": c.model,
    "source": source,
    "context_tokens": context,
    "continuation_tokens": c.continuation,
    "ratio": c.ratio,
    "restore_tokens": c.tokens,
    "rank": c.rank,
    "trained_fraction": trained_fraction(trained.adapter, params),
    "test_kl_untrained": trained.initial_test_loss,
    "test_kl_trained": trained.history[-1][2],
    "test_kl_kvzip_alone": mean_loss(cfg, params, None, baseline, c.batch_size),
    "history": [list(r) for r in trained.history],
    "timing": restore_timings(c, cfg, params, trained.adapter, test_rows[0, :context], template),
    "seconds": spent,
  }
  meta = {k: getattr(c, k) for k in ("model", "rows", "ratio", "max_steps")}
  meta |= {"source": source, "context": context, "test_kl": results["test_kl_trained"]}
  save(workdir / "restorekv_adapter.npz", trained.adapter, meta)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  keys = ("test_kl_untrained", "test_kl_trained", "test_kl_kvzip_alone", "trained_fraction")
  print(json.dumps({k: results[k] for k in keys} | results["timing"]))
  print(f"run directory: {workdir.absolute()}")
  return results
