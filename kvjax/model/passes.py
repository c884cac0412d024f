"""The pieces the calibration passes and the learned scorers share.

The calibration passes (:mod:`kvjax.model.calibrate`, :mod:`kvjax.model.duo`,
:mod:`kvjax.model.reconstruction`) share checked token-id rows, the
positions and causal mask of an unpadded prompt, and the pre-RoPE queries and keys of a layer;
the learned scorers (:mod:`kvjax.model.kvzap`, :mod:`kvjax.model.fastkvzip`) share a
checked (left-)padded prompt, every layer's attention inputs over it (:func:`attention_inputs`,
the features of the learned scorers) and the jitted pass that scores them (:func:`learned_scores`).

Every pass built on them is a plain layer loop (``lax.scan`` over the stacked layers) of the
public functions of :mod:`kvjax.model.llama`, with dense attention: calibration prompts are
short.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import llama
from kvjax.model.config import ModelConfig

Array = jax.Array


def ids_2d(name: str, ids, cfg: ModelConfig) -> np.ndarray:
  """``ids`` as ``[B, T]`` int32 token ids (a 1-D row becomes one row), checked.

  Args:
    name: the argument, for the error.
    ids: ``[T]`` or ``[B, T]`` token ids.
    cfg: the model's config (its vocabulary).

  Returns:
    int32 ids ``[B, T]``.

  Raises:
    ValueError: naming ``name``, for another shape, an empty row or ids breaking
      :func:`kvjax.model.llama.check_token_ids`'s rule.
  """
  arr = np.asarray(ids)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or arr.shape[1] == 0:
    raise ValueError(f"{name}: expected token ids [B, T] or [T], got shape {arr.shape}")
  return llama.check_token_ids(name, arr, cfg.vocab_size)


def id_rows(name: str, ids, cfg: ModelConfig) -> list[np.ndarray]:
  """A sequence of 1-D id rows (different lengths allowed) or a ``[B, T]`` array, checked.

  Args:
    name: the argument, for the error.
    ids: the rows.
    cfg: the model's config.

  Returns:
    The rows, each int32 ``[T_i]``.

  Raises:
    ValueError: as :func:`ids_2d`, naming the row.
  """
  if isinstance(ids, (list, tuple)) and ids and np.ndim(ids[0]) == 1:
    return [ids_2d(f"{name}[{i}]", r, cfg)[0] for i, r in enumerate(ids)]
  return list(ids_2d(name, ids, cfg))


def positions(B: int, T: int, start: int = 0) -> Array:
  """The positions of ``B`` unpadded rows, from ``start`` to ``start + T - 1``.

  Args:
    B: rows.
    T: positions per row.
    start: the first position.

  Returns:
    int32 ``[B, T]``.
  """
  return jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))


def causal_allowed(cfg: ModelConfig, B: int, T: int) -> Array:
  """The causal mask of an unpadded prompt (with the model's sliding window).

  Args:
    cfg: the model's config.
    B: rows.
    T: positions per row.

  Returns:
    bool ``[B, T, T]``.
  """
  pos = positions(B, T)
  return llama.causal_allowed(pos, pos, jnp.ones((B, T), bool), pos, pos, cfg.sliding_window)


def pre_rope(cfg: ModelConfig, p: dict, h_BTd: Array):
  """The pre-RoPE queries and keys of a layer's normed hidden states.

  Queries ``[B, Hq, T, D]`` and keys ``[B, G, T, D]``, q/k bias and Qwen3's q/k norm included
  (kvpress's ``get_prerope_query_states``).

  Args:
    cfg: the model's config.
    p: one layer's parameters.
    h_BTd: the layer's normed hidden states.

  Returns:
    ``(q, k)``.
  """
  B, T, _ = h_BTd.shape
  q, k = llama.matmul(h_BTd, p["wq"]), llama.matmul(h_BTd, p["wk"])
  if cfg.qkv_bias:
    q, k = q + llama.along_last(p["bq"], 3), k + llama.along_last(p["bk"], 3)
  q = q.reshape(B, T, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
  k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
  if cfg.qk_norm:
    q = llama.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = llama.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  return q, k


def padded_prompt(
  cfg: ModelConfig, input_ids, attention_mask=None
) -> tuple[np.ndarray, np.ndarray]:
  """Checks a (left-)padded prompt and its mask.

  Args:
    cfg: the model's config.
    input_ids: token ids ``[B, T]``.
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    ``(ids, mask)`` as numpy arrays.

  Raises:
    ValueError: for ids that are not ``[B, T]`` with ``T >= 1`` or break
      :func:`kvjax.model.llama.check_token_ids`'s rule, or a mask of another shape.
  """
  ids = np.asarray(input_ids)
  if ids.ndim != 2 or ids.shape[1] == 0:
    raise ValueError(f"input_ids: expected token ids [B, T], got shape {ids.shape}")
  ids = llama.check_token_ids("input_ids", ids, cfg.vocab_size)
  mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
  if mask.shape != ids.shape:
    raise ValueError(f"attention_mask: expected shape {ids.shape}, got {mask.shape}")
  return ids, mask


def layer_attention_inputs(cfg: ModelConfig, p: dict, x_BTd: Array) -> Array:
  """The hidden states one layer's attention receives (after its input norm), fp32.

  Args:
    cfg: the model's config.
    p: the layer's parameters.
    x_BTd: the layer's input ``[B, T, d]``.

  Returns:
    fp32 ``[B, T, d]``.
  """
  return llama.norm(cfg, x_BTd, p["attn_norm"]).astype(jnp.float32)


def prompt_attention_inputs(cfg: ModelConfig, params: dict, ids_BT: Array, mask_BT: Array) -> Array:
  """Every layer's attention inputs (:func:`layer_attention_inputs`) over a (left-)padded prompt, in
  one dense causal pass; traceable (it runs inside its caller's ``jit``).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    ids_BT: token ids ``[B, T]``.
    mask_BT: ``[B, T]`` 0/1 of the real tokens.

  Returns:
    fp32 ``[L, B, T, d]``.
  """
  B, T = ids_BT.shape
  pos = llama.positions_from_mask(mask_BT)
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  allowed = llama.causal_allowed(pos, pos, mask_BT.astype(bool), index, index, cfg.sliding_window)

  def layer(x, p):
    h = layer_attention_inputs(cfg, p, x)
    x, _ = llama.dense_layer(cfg, p, x, pos, allowed)
    return x, h

  _, h = jax.lax.scan(layer, llama.embed_tokens(cfg, params, ids_BT), llama.stacked(params))
  return h


_inputs_jit = jax.jit(prompt_attention_inputs, static_argnums=0)


def attention_inputs(model, input_ids, attention_mask=None) -> Array:
  """Every layer's attention inputs over a (left-)padded prompt: the hidden states after each
  layer's input norm (what kvpress's hooks read as ``hidden_states`` and Fast KVzip's
  ``prefill/feature.py`` saves), the features of the learned scorers; one jitted dense causal
  pass (:func:`prompt_attention_inputs`).

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    input_ids: token ids ``[B, T]``.
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 ``[L, B, T, d]``.
  """
  ids = jnp.asarray(input_ids, jnp.int32)
  mask = jnp.ones(ids.shape, jnp.int32) if attention_mask is None else jnp.asarray(attention_mask)
  return _inputs_jit(model.cfg, model.params(), ids, mask)


def _learned_scores(cfg, params, score, component, ids_BT, mask_BT):  # [L, G, B, T]
  return score(component, prompt_attention_inputs(cfg, params, ids_BT, mask_BT))


_learned_scores_jit = jax.jit(_learned_scores, static_argnums=(0, 2))


def learned_scores(model, score, component, ids, mask) -> Array:
  """A learned scorer's scores of a prompt: ``score(component, h_LBTd)`` of every layer's
  attention inputs (:func:`prompt_attention_inputs`), in one jitted dense causal pass.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    score: ``(component, h_LBTd) -> [L, G, B, T]``, a module-level function (the jit's static
      key), e.g. :func:`kvjax.model.kvzap.apply`.
    component: its trained arrays, checked against the model.
    ids: the prompt ``[B, T]``, checked by :func:`padded_prompt`.
    mask: its ``[B, T]`` 0/1 mask of the real tokens (:func:`padded_prompt`).

  Returns:
    Scores ``[L, B, G, T]``, in the dtype ``score`` gives.
  """
  cfg, params = model.cfg, model.params()
  out = _learned_scores_jit(
    cfg, params, score, component, jnp.asarray(ids, jnp.int32), jnp.asarray(mask)
  )
  return jnp.moveaxis(out, 2, 1)
