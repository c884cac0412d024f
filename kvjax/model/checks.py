"""The checks every model entry point applies to its token ids and to the model's context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig


def check_token_ids(name: str, ids, vocab_size: int, *, min_len: int = 1):
  """Checks a batch of token ids against the one rule shared by every model entry point.

  The rule: an integer dtype (bools refused), two axes ``[B, T]`` with ``B >= 1`` and
  ``T >= min_len``, values in ``[0, vocab_size)`` (an embedding gather would silently clamp
  anything else). Shapes and dtypes are static, so traced ids are checked for them too; their
  values are not known in Python and pass unchecked.

  Args:
    name: the argument's name, for the error.
    ids: token ids (array-like or traced).
    vocab_size: the model's vocabulary size.
    min_len: the fewest positions per row.

  Returns:
    Concrete ids as an int32 numpy array ``[B, T]``; traced ids unchanged.

  Raises:
    ValueError: naming ``name``, the shape, dtype or id and what was expected.
  """
  traced = isinstance(ids, jax.core.Tracer)
  arr = ids if traced else np.asarray(ids)
  if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < min_len:
    raise ValueError(
      f"{name}: expected token ids [batch >= 1, T >= {min_len}], got shape {tuple(arr.shape)}"
    )
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
  if traced:
    return ids
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = int(arr.min() if arr.min() < 0 else arr.max())
    raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
  return arr.astype(np.int32)


def check_context(
  cfg: ModelConfig,
  length: int,
  new: int = 0,
  *,
  name: str = "input_ids",
  new_name: str = "max_new_tokens",
) -> None:
  """Refuses a sequence longer than the model's context (``cfg.max_positions``).

  Positions past the context were never trained and give answers without a warning. Nothing is
  checked when the context is unknown (``None``).

  Args:
    cfg: the model's config.
    length: the prompt's tokens (its longest row).
    new: tokens generated or fed after the prompt (``max_new_tokens``, an answer).
    name: the prompt's argument.
    new_name: the argument that asked for the ``new`` tokens.

  Raises:
    ValueError: when ``length + new > cfg.max_positions``, naming the prompt when it alone is
      too long, else ``new_name`` with the most it may be.
  """
  limit = cfg.max_positions
  if limit is None or length + new <= limit:
    return
  if not new:
    raise ValueError(
      f"{name}: a prompt of {length} tokens is longer than the model's context of {limit} "
      f"positions (max_positions); expected at most {limit} tokens"
    )
  if length >= limit:
    raise ValueError(
      f"{name}: a prompt of {length} tokens leaves no room in the model's context of {limit} "
      f"positions (max_positions) for the {new} tokens of {new_name}; expected a prompt of at "
      f"most {limit - 1} tokens"
    )
  raise ValueError(
    f"{new_name}: {new} tokens after a prompt of {length} tokens make {length + new}, past the "
    f"model's context of {limit} positions (max_positions); expected {new_name} <= "
    f"{limit - length} for this prompt"
  )
