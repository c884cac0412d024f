"""KVzap: a trained surrogate of KVzip+'s scores from each position's attention input (kvpress
``KVzapPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies.core import Policy

Array = jax.Array

FIELD = "kvzap_LGT"


def kvzap_scores(kvzap_LGT: Array) -> Array:
  """kvpress ``KVzapPress``'s scores: the surrogate's output as given.

  Args:
    kvzap_LGT: ``evidence.kvzap_LGT``, ``[L, G, T]`` (:func:`kvjax.model.kvzap.kvzap_evidence`).

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: evidence that is not a floating rank-3 array.
  """
  if getattr(kvzap_LGT, "ndim", None) != 3 or not jnp.issubdtype(kvzap_LGT.dtype, jnp.floating):
    shape = getattr(kvzap_LGT, "shape", type(kvzap_LGT).__name__)
    raise ValueError(f"{FIELD}: expected a floating array [L, G, T], got {shape}")
  return kvzap_LGT.astype(jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzap(Policy):
  """KVzap: the predicted log KVzip+ score of every KV pair, from a small trained model.

  Paper: KVzap (arXiv 2601.07891). Reference: kvpress 0.5.5 ``presses/kvzap_press.py::KVzapPress`` (a
  ``ScorerPress``) and its training code ``kvzap/train.py``. The evidence
  ``evidence.kvzap_LGT`` (:func:`kvjax.model.kvzap.kvzap_evidence`) is a per-layer surrogate (a
  ridge regression or a two-layer MLP, :class:`kvjax.model.kvzap.Surrogate`) applied to each
  position's attention input; it was trained to predict
  ``log max_{q, r} attn^r[q, k] / ||h_q|| * ||W_O^r v_k||`` from KVzip's "repeat the previous
  context" pass (:func:`kvjax.model.kvzap.kvzap_targets`). The scores are used as given, no
  sinks or window (kvpress: none either). kvpress recommends the press inside ``DMSPress``
  (a threshold): the registry's ``dms_kvzap`` (:class:`~kvjax.policies.dms.DMS`); with a budget
  the default allocator :class:`~kvjax.policies.Uniform` keeps the top ``budget`` pairs of each
  KV head, as ``ScorerPress.compress``.

  Differences from kvpress:

  * the surrogate is trained here (:mod:`kvjax.model.kvzap`, on shipped text) and loaded from a
    file by path; kvpress downloads ``nvidia/KVzap-<kind>-<model>`` from the Hugging Face hub,
    trained on Nemotron pretraining samples.
  * the surrogate runs in fp32 (kvpress: the model's dtype).
  * prefill only: kvpress's ``DMSPress(decoding=True)`` also scores generated tokens.
  * the budget: kvpress's ``compression_ratio`` keeps ``max(1, int(T * (1 - ratio)))`` per
    head; kvjax takes the per-head budget itself.
  * ties go to the lower position; ``torch.topk`` leaves them unspecified.
  """

  needs: ClassVar[frozenset[str]] = frozenset({FIELD})

  def score(self, evidence):
    """The surrogate's scores (kvpress ``KVzapPress.score``)."""
    return kvzap_scores(evidence.need(FIELD, self.label))
