"""RestoreKV: KVzip's selection with learned restore tokens appended to the prompt (kvpress
``RestoreKVPress``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import scores as scores_lib
from kvjax.policies.methods import KVzip

Array = jax.Array

RESTORE_TOKENS = 8  # kvpress: the published adapters' restore embeddings


def last_valid(valid_T: Array | None, T: int, n: int) -> Array:
  """The last ``n`` real positions of a row, wherever its padding lies.

  Args:
    valid_T: the row's real positions ``[T]`` (``None``: every position is real).
    T: the row's positions.
    n: how many of the last real positions to mark.

  Returns:
    A bool mask ``[T]``.
  """
  if valid_T is None:
    return jnp.arange(T) >= T - n
  real = valid_T.astype(jnp.int32)
  from_end = jnp.cumsum(real[::-1])[::-1]  # real positions at or after each one
  return valid_T.astype(bool) & (from_end <= n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreKV(KVzip):
  """RestoreKV: KVzip's pooled selection over a prompt that ends in ``restore_tokens`` learned
  tokens, which every head keeps inside its budget.

  Paper: RestoreKV (arXiv 2608.01247). Reference: kvpress 0.5.5
  ``presses/restorekv_press.py::RestoreKVPress`` (a ``KVzipPress``). Before eviction, ``n``
  learned restore embeddings (8) read the full cache in one pass through the model with a LoRA
  adapter on (:func:`kvjax.model.restorekv.restore_kv`); their keys and values are appended
  after the prompt, at positions ``T .. T + n - 1``, and KVzip evicts from the context alone.
  The budget is matched: kvpress raises the compression ratio by ``n / T`` so that the restore
  slots come out of the same budget. Here the prompt the policy scores holds the restore tokens
  as its last ``n`` real positions (:func:`kvjax.model.restorekv.append_restore`), scored
  ``+inf`` like the sinks, so the pooled ``L * H * budget`` keeps all ``L * H * n`` of them and
  ``L * H * (budget - n)`` context pairs.

  Differences from kvpress: the adapter is trained here (:mod:`kvjax.model.restorekv`) and
  loaded from a file by path (kvpress downloads ``higokri/RestoreKV-<model>``); the budget
  counts the restore slots (kvpress: ``compression_ratio + n / T`` of the context pruned,
  which differs from ``int(T * (1 - ratio)) - n`` kept by rounding).
  """

  restore_tokens: int = RESTORE_TOKENS

  def __post_init__(self):
    super().__post_init__()
    scores_lib.check_count("restore_tokens", self.restore_tokens)
    if self.restore_tokens < 1:
      raise ValueError(f"restore_tokens: expected a positive int, got {self.restore_tokens!r}")

  def min_budget(self, window: int) -> int:
    """The restore tokens plus one context token.

    Args:
      window: the protected window (none here).

    Returns:
      ``restore_tokens + 1``.
    """
    return self.restore_tokens + 1

  def _low_budget_message(self, low: int, floor: int) -> str:
    return (
      f"budget: {low} < {floor}; {self.label!r} holds its {self.restore_tokens} restore tokens "
      "inside each head's budget and needs a context token besides"
    )

  def score(self, evidence):
    """KVzip's scores with the last ``restore_tokens`` real positions (the restore tokens)
    protected (``+inf``), above the sinks (the largest finite score): kvpress never scores the
    restore tokens, so a budget too small for both evicts sinks first."""
    kvzip = super().score(evidence)
    kvzip = jnp.where(jnp.isposinf(kvzip), jnp.finfo(jnp.float32).max, kvzip)
    last = last_valid(evidence.valid_T, kvzip.shape[-1], self.restore_tokens)
    return jnp.where(last, jnp.inf, kvzip)
