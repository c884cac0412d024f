"""The pieces the calibration passes share (:mod:`kvjax.model.calibrate`,
:mod:`kvjax.model.duo`, :mod:`kvjax.model.reconstruction`): checked token-id rows, the
positions and causal mask of an unpadded prompt, and the pre-RoPE queries and keys of a layer.

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
  """Positions ``start .. start + T - 1`` of ``B`` unpadded rows, int32 ``[B, T]``."""
  return jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))


def causal_allowed(cfg: ModelConfig, B: int, T: int) -> Array:
  """``[B, T, T]`` causal mask of an unpadded prompt (with the model's sliding window)."""
  pos = positions(B, T)
  return llama.causal_allowed(pos, pos, jnp.ones((B, T), bool), pos, pos, cfg.sliding_window)


def pre_rope(cfg: ModelConfig, p: dict, h_BTd: Array):
  """Pre-RoPE queries ``[B, Hq, T, D]`` and keys ``[B, G, T, D]`` of normed hidden states
  (q/k bias and Qwen3's q/k norm included): kvpress's ``get_prerope_query_states``.

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
