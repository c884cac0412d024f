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

The adapter, its restore pass and its files live in :mod:`kvjax.model.restorekv_adapter`, its
training and the experiment in :mod:`kvjax.model.restorekv_training`; this module gathers
RestoreKV's evidence and the model's cache, and re-exports both.

kvpress loads published adapters (PEFT LoRA for Llama-3.1-8B-Instruct and Qwen3-8B) from the
Hugging Face hub; their training recipe is not part of kvpress. What kvjax chooses, where the
reference is silent: LoRA on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (PEFT's
initialisation: ``A`` Kaiming-uniform, ``B`` zero, scaling ``alpha / r``), restore embeddings
started from the embeddings of random vocabulary tokens, and a loss that is the KL divergence
of the compressed cache's next-token distributions from the full cache's over the text that
follows each training context (Adam, gradients clipped to norm 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import cache as cache_lib
from kvjax.model import llama
from kvjax.model.reconstruction import KVzipOptions, KVzipTemplate, kvzip_evidence

# The adapter and its training live beside this module; restorekv.X reaches every part.
from kvjax.model.restorekv_adapter import (  # noqa: F401
  ALPHA,
  FORMAT,
  PEFT_MODULES,
  RANK,
  TARGETS,
  Adapter,
  adapted_params,
  check_adapter,
  expected_shapes,
  held_segment,
  init_adapter,
  load,
  next_positions,
  restore_kv,
  save,
  target_shapes,
  trained_fraction,
)
from kvjax.model.restorekv_training import (  # noqa: F401
  BATCH_SIZE,
  CLIP,
  LR,
  MAX_STEPS,
  AdapterConfig,
  AdapterTraining,
  distillation_loss,
  experiment,
  mean_loss,
  optimizer,
  restore_timings,
  train_adapter,
  training_data,
)

Array = jax.Array

KEYS, VALUES = "restore_keys_LGND", "restore_values_LGND"
FIELDS = (KEYS, VALUES)  # the caller-given evidence this module adds to a prompt


@functools.partial(jax.jit, static_argnums=0)
def _evidence_jit(cfg, params, adapter, ids_BT):
  return restore_kv(cfg, params, adapter, llama.prefill(cfg, params, ids_BT))


def restorekv_evidence(
  model,
  adapter: Adapter,
  context_ids,
  template: KVzipTemplate,
  *,
  kvzip: KVzipOptions | None = None,
) -> dict:
  """Computes RestoreKV's evidence of a context: KVzip's reconstruction attention
  (:func:`kvjax.model.reconstruction.kvzip_evidence`) and the restore tokens' keys and values
  (:func:`restore_kv`).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    adapter: the trained :class:`Adapter` (:func:`load`, :func:`train_adapter`).
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.
    template: KVzip's reconstruction prompt (:func:`kvjax.model.reconstruction.kvzip_template`).
    kvzip: KVzip's options (:class:`~kvjax.model.reconstruction.KVzipOptions`; ``None``: the
      defaults); ``plus`` for the ``_plus`` adapters (kvpress ``kvzip_plus_normalization``).

  Returns:
    A dict of ``reconstruction_attn_LGT`` ``[L, B, G, T]``, ``restore_keys_LGND`` and
    ``restore_values_LGND`` ``[L, B, G, N, D]`` (without the ``B`` axis for a ``[T]``
    context): ``evidence=`` for ``km.generate`` with the ``restorekv`` policy.

  Raises:
    ValueError: as :func:`kvjax.model.reconstruction.kvzip_evidence`, and for an adapter that does
      not fit the model (:func:`check_adapter`).
  """
  check_adapter(adapter, model.cfg)
  attn = kvzip_evidence(model, context_ids, template, options=kvzip)
  return {"reconstruction_attn_LGT": attn, **restore_evidence(model, adapter, context_ids)}


def restore_evidence(model, adapter: Adapter, context_ids) -> dict:
  """The restore tokens' keys and values after a context (:func:`restore_kv` after a prefill
  of it), without KVzip's scores.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    adapter: the trained :class:`Adapter`.
    context_ids: the context ``[T]``, or a ``[B, T]`` batch of unpadded rows.

  Returns:
    A dict of fp32 ``restore_keys_LGND`` and ``restore_values_LGND`` ``[L, B, G, N, D]``
    (without the ``B`` axis for a ``[T]`` context).

  Raises:
    ValueError: for an adapter that does not fit the model, or ids that are not ``[T]`` or
      ``[B, T]`` tokens of the vocabulary.
  """
  cfg, params = model.cfg, model.params()
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
