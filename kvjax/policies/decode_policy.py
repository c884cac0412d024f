"""Decode-time evictors: :class:`DecodePolicy`, a small state machine over the cache's slots that
the model's cache and the lab's online replay both run, and :func:`gather_slots`, which reads
per-position evidence at the kept slots for a state's start."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.core import Policy
from kvjax.policies.evidence import Evidence

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePolicy(Policy):
  """A decode-time evictor: the cache is cut back to the budget after every generated token.

  After the prompt's selection, every generated token joins the cache and the cache is cut back
  to the budget by :meth:`keep_scores` (the new token always stays).

  A small state machine over the cache's slots, run alike by the model's cache
  (:mod:`kvjax.model.cache`) and the lab's online replay (:mod:`kvjax.lab.online`). Shapes are
  ``[..., H, C]`` (the lab: ``[L, H, C]``; the model, one layer at a time: ``[B, H, C]``).
  """

  def __post_init__(self):
    super().__post_init__()
    if self.decode_every is not None:
      raise ValueError(
        f"decode_every: policy {self.label!r} evicts at every step already; expected None"
      )

  @property
  def evicts_each_step(self) -> bool:
    """True: it evicts at every generated token."""
    return True

  def init_state(
    self, evidence: Evidence, scores_LHT: Array, idx_LHC: Array, kept_LHC: Array
  ) -> Array | None:
    """The per-slot state of the prompt's kept slots, or ``None`` for a policy without state.

    Args:
      evidence: the prompt's evidence.
      scores_LHT: the prompt's grouped scores ``[L, H, T]``.
      idx_LHC: the kept slots' positions, int32 ``[L, H, C]``.
      kept_LHC: which slots hold a kept position, bool ``[L, H, C]``.

    Returns:
      The state ``[L, H, C]`` fp32, or ``None`` (here).
    """
    return None

  def observe(self, state_HC: Array, attn_HC: Array) -> Array:
    """The state after a step whose query paid ``attn_HC`` to each slot.

    A new slot's state starts at 0.

    Args:
      state_HC: the state before the step, ``[..., H, C]``.
      attn_HC: the attention the step's query paid to each slot, per cache head (the mean over
        its query heads), ``[..., H, C]``.

    Returns:
      The state after the step, ``[..., H, C]`` (here ``state_HC`` unchanged).
    """
    return state_HC

  def keep_scores(self, state_HC: Array | None, positions_HC: Array, t, budget_H: Array) -> Array:
    """Keep scores of the current slots before token ``t`` joins.

    Higher keeps, ``+inf`` protects; the cache keeps each head's ``budget_H`` best slots. Here
    the positions themselves (the most recent tokens).

    Args:
      state_HC: the state (:meth:`observe`), or ``None`` for a policy without state.
      positions_HC: the slots' positions, ``[..., H, C]``.
      t: the joining token's position, broadcastable to ``[..., 1, 1]``.
      budget_H: each head's budget, ``[..., H]``.

    Returns:
      Keep scores fp32 ``[..., H, C]``.
    """
    return positions_HC.astype(jnp.float32)


def gather_slots(x_LHT: Array, idx_LHC: Array, kept_LHC: Array, num_heads: int) -> Array:
  """Reads ``x`` at the kept slots' positions (0 elsewhere).

  Its heads are first averaged down to ``num_heads`` (query-head evidence for a KV-head cache).

  Args:
    x_LHT: per-position values ``[L, Hq, T]``.
    idx_LHC: the slots' positions, int32 ``[L, H, C]``.
    kept_LHC: which slots hold a kept position, bool ``[L, H, C]``.
    num_heads: ``H``, the cache's heads (it must divide ``Hq``).

  Returns:
    ``[L, H, C]``: ``x`` at each kept slot's position, 0 in the other slots.
  """
  if x_LHT.shape[1] != num_heads:
    x_LHT = x_LHT.reshape(x_LHT.shape[0], num_heads, -1, x_LHT.shape[-1]).mean(2)
  return jnp.where(kept_LHC, jnp.take_along_axis(x_LHT, idx_LHC, -1), 0.0)


# --------------------------------------------------------------------------- checked hooks


def _label(policy) -> str:
  return policy.label if isinstance(policy, Policy) else type(policy).__name__


def check_decode_output(out, shape: tuple[int, ...], policy, hook: str) -> None:
  """Checks what a decode-time hook returned against the shape it promises.

  Shapes are static under ``jit``, so the check runs once, when the step is traced, and a wrong
  output is reported with the policy and the hook named instead of failing in a broadcast.

  Args:
    out: the hook's output.
    shape: the shape it promises (the slots' ``[..., H, C]``).
    policy: the policy (or the object whose hook ran), for the error.
    hook: the hook's name, for the error.

  Raises:
    ValueError: ``out`` is not an array of ``shape``.
  """
  got = None if out is None else tuple(jnp.shape(out))
  if got != tuple(shape):
    what = "None" if got is None else f"shape {got}"
    raise ValueError(
      f"{hook}: policy {_label(policy)!r} returned {what}; expected shape {tuple(shape)}, one "
      "value per cache slot ([..., heads, slots])"
    )


def checked_init_state(policy, evidence, scores_LHT, idx_LHC, kept_LHC) -> Array | None:
  """``policy.init_state``, its state checked against the slots' ``[L, H, C]``.

  Args:
    policy: a decode-time policy (:meth:`DecodePolicy.init_state`).
    evidence: the prompt's evidence.
    scores_LHT: the prompt's grouped scores ``[L, H, T]``.
    idx_LHC: the kept slots' positions, int32 ``[L, H, C]``.
    kept_LHC: which slots hold a kept position, bool ``[L, H, C]``.

  Returns:
    The state ``[L, H, C]``, or ``None`` for a policy without state.

  Raises:
    ValueError: the state is not ``None`` and not ``[L, H, C]``.
  """
  state = policy.init_state(evidence, scores_LHT, idx_LHC, kept_LHC)
  if state is not None:
    check_decode_output(state, jnp.shape(idx_LHC), policy, "init_state")
  return state


def checked_observe(policy, state_HC, attn_HC) -> Array:
  """``policy.observe``, the new state checked against the state's shape.

  Args:
    policy: a decode-time policy (:meth:`DecodePolicy.observe`).
    state_HC: the state before the step, ``[..., H, C]``.
    attn_HC: the attention paid to each slot, ``[..., H, C]``.

  Returns:
    The state after the step, ``[..., H, C]``.

  Raises:
    ValueError: the new state's shape differs from ``state_HC``'s.
  """
  state = policy.observe(state_HC, attn_HC)
  check_decode_output(state, jnp.shape(state_HC), policy, "observe")
  return state


def checked_keep_scores(policy, state_HC, positions_HC, t, budget_H) -> Array:
  """``policy.keep_scores``, checked against the slots' ``[..., H, C]``.

  Args:
    policy: a decode-time policy (:meth:`DecodePolicy.keep_scores`).
    state_HC: the state, or ``None``.
    positions_HC: the slots' positions, ``[..., H, C]``.
    t: the joining token's position.
    budget_H: each head's budget, ``[..., H]``.

  Returns:
    Keep scores ``[..., H, C]``.

  Raises:
    ValueError: the scores' shape differs from ``positions_HC``'s.
  """
  scores = policy.keep_scores(state_HC, positions_HC, t, budget_H)
  check_decode_output(scores, jnp.shape(positions_HC), policy, "keep_scores")
  return scores
