"""FINCH: SnapKV-style votes of the question's queries, the question found by a delimiter."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import select
from kvjax.policies.checks import check_bool, check_window
from kvjax.policies.core import Policy
from kvjax.policies.evidence import DEFAULT_WINDOW

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finch(Policy):
  """FINCH (kvpress ``FinchPress``): the question's queries vote for the context keys.

  Paper: Corallo and Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for Large
  Language Models" (TACL 2024, doi 10.1162/tacl_a_00716; no arXiv id). Reference: kvpress 0.5.5
  ``presses/finch_press.py::FinchPress``.

  The prompt is ``context + question``; the observation window is the question, whose length
  kvpress reads from a delimiter token between the two (the delimiter itself is dropped from
  the prompt). Each context key's score is the attention of the ``question_len`` last queries,
  each row multiplied by its query's position ``p`` (``normalize_scores``: kvpress's
  "non-zero count", ``p``, not ``p + 1``), averaged over those rows; the question's own keys
  are protected (``+inf``). No pooling. kvpress's GQA mean over each KV head's query heads is
  ``num_kv_heads=G`` (``gqa="mean"``).

  The window comes from the data while kvjax's window rows have a static count ``W``: the
  evidence holds the last ``window`` rows (a static upper bound) and ``question_len`` (the
  delimiter's distance from the end, given per prompt and traced data: a pytree leaf, so a new
  question length never retraces) masks the rows before the question. Inside ``jit`` it is
  clipped to ``[1, W]``; a concrete one is checked.

  Differences from kvpress:

  * The question's length is given (``question_len``), not found by a delimiter token in the
    token ids; the prompt the policy sees has no delimiter, as kvpress's model sees none.
  * The budget is the kept count (kvpress: ``int(T * (1 - compression_ratio))``); a budget below
    ``question_len`` keeps the question's first tokens (kvpress: ``topk``'s choice among ties).
  * kvpress's ``chunk_length`` (a top-k per chunk of the prompt) is not offered; kvpress's
    ``rerotate_keys`` is the cache's layout (``cache.Layout(..., reindex=True)``), not a score.
  * A left-padded row's positions count from its first real token.

  Attributes:
    question_len: the question's length in tokens (the window); ``None``: the whole observation
      window is the question (the prompt's last ``window`` tokens, as SnapKV's window).
    window: the window rows the prefill computes, a static upper bound of ``question_len``
      (``None``: ``question_len`` when it is a concrete int, else 32).
    normalize_scores: multiply each row by its query's position (kvpress ``normalize_scores``).
  """

  needs: ClassVar[frozenset[str]] = frozenset({"attn_window_LHWT"})
  data_options: ClassVar[tuple[str, ...]] = ("question_len",)
  question_len: int | None = None
  window: int | None = None
  normalize_scores: bool = True

  def __post_init__(self):
    super().__post_init__()
    check_window(self.window, self.label)
    check_bool("normalize_scores", self.normalize_scores)
    q = self.question_len
    if q is not None and select.is_concrete(q):
      if isinstance(q, bool) or not float(q).is_integer() or int(q) < 1:
        raise ValueError(f"question_len: expected an int >= 1 (the question's tokens), got {q!r}")
      if self.window is not None and int(q) > self.window:
        raise ValueError(f"question_len: {int(q)} exceeds window={self.window} window rows")

  @property
  def observation_window(self) -> int:
    """``window``, else a concrete ``question_len``, else 32."""
    if self.window is not None:
      return self.window
    q = self.question_len
    if q is not None and select.is_concrete(q):
      return int(q)
    return DEFAULT_WINDOW

  def score(self, evidence):
    """The question rows' position-weighted mean attention, the question protected."""
    attn = evidence.need("attn_window_LHWT", self.label)
    W, T = attn.shape[2:]
    q = min(W, T - 1) if self.question_len is None else self.question_len
    if select.is_concrete(q) and not 1 <= int(q) <= min(W, T - 1):
      raise ValueError(
        f"question_len: expected 1 <= question_len <= min(W={W}, T - 1={T - 1}), got {int(q)}"
      )
    valid_T = jnp.ones(T, bool) if evidence.valid_T is None else evidence.valid_T
    return finch_scores(attn, q, valid_T, normalize=self.normalize_scores)


def finch_scores(attn_LHWT: Array, question_len, valid_T: Array, *, normalize: bool) -> Array:
  """FINCH's scores (kvpress ``FinchPress.score`` before its GQA mean).

  Args:
    attn_LHWT: causal softmax rows of the last ``W`` queries over the ``T`` keys.
    question_len: the question's length, an int or traced int, clipped to ``[1, W]``.
    valid_T: the row's real positions, bool ``[T]`` (left padding).
    normalize: multiply each row by its query's position in the unpadded prompt.

  Returns:
    fp32 ``[L, H, T]``: the context keys' scores, the last ``question_len`` keys ``+inf``.
  """
  W, T = attn_LHWT.shape[2:]
  q = jnp.clip(jnp.asarray(question_len, jnp.int32), 1, W)
  pad = T - valid_T.sum()
  w = jnp.arange(W)
  position_W = (T - W + w - pad).astype(jnp.float32)
  weight_W = jnp.where(w >= W - q, position_W if normalize else 1.0, 0.0)
  votes = jnp.einsum(
    "lhwt,w->lht", attn_LHWT.astype(jnp.float32), weight_W, precision=jax.lax.Precision.HIGHEST
  )
  votes = votes / q
  question_T = jnp.arange(T) >= T - q
  return jnp.where(question_T[None, None, :], jnp.inf, votes)
