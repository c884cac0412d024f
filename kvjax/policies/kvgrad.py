"""KVgrad: input x gradient attribution of each KV pair to the final hidden states over KVzip's
context reconstruction (kvpress ``KVgradPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import scores as scores_lib
from kvjax.policies.methods import KVzip

Array = jax.Array

FIELD = "kvgrad_LGT"


def kvgrad_scores(kvgrad_LGT: Array, *, sinks: int = 4) -> Array:
  """kvpress ``KVgradPress``'s scores (``KVzipPress.compress_post``) from the attribution.

  The attribution (:func:`kvjax.model.kvgrad.kvgrad_evidence`) with the first ``sinks``
  positions protected (``+inf``; kvpress writes the global max + 1, which ranks the same).

  Args:
    kvgrad_LGT: ``evidence.kvgrad_LGT``, ``[L, G, T]``.
    sinks: the protected first positions.

  Returns:
    fp32 scores ``[L, G, T]``.

  Raises:
    ValueError: an attribution that is not a floating rank-3 array, or a ``sinks`` that is
      negative, not an integer or beyond int32.
  """
  if getattr(kvgrad_LGT, "ndim", None) != 3 or not jnp.issubdtype(kvgrad_LGT.dtype, jnp.floating):
    shape = getattr(kvgrad_LGT, "shape", type(kvgrad_LGT).__name__)
    raise ValueError(f"{FIELD}: expected a floating array [L, G, T], got {shape}")
  return scores_lib.protect(kvgrad_LGT.astype(jnp.float32), sinks=sinks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVgrad(KVzip):
  """KVgrad: each KV pair's effect on the final hidden states, by input x gradient attribution.

  Paper: KVgrad (https://openreview.net/forum?id=cg1wTCJjjk), as kvpress cites it. Reference:
  kvpress 0.5.5 ``presses/kvgrad_press.py::KVgradPress`` (a ``KVzipPress``). The evidence
  ``evidence.kvgrad_LGT`` (:func:`kvjax.model.kvgrad.kvgrad_evidence`) is, for each context KV
  pair ``c`` of layer ``l`` and KV head ``g``,
  ``max_{p, r} A_{r,p,c} * ||W_O^r v_c||_2 * ||d Phi / d a_p||_2``: KVzip's reconstruction
  attention of probe token ``p`` and query head ``r`` of the group, the norm of what the pair
  writes into the residual stream, and the sensitivity of ``Phi = sum_p ||h^L_p||^2`` (the last
  hidden states of the "repeat the context" pass) to the attention output ``a_p`` of that layer.
  It is a :class:`~kvjax.policies.KVzip` with this evidence in place of the reconstruction
  attention: the first ``sinks`` (4) positions are protected; the default allocator
  :class:`~kvjax.policies.Pooled` selects once over every layer and head, as kvpress
  (``Pooled(layerwise=True)``: per layer).

  Differences from kvpress:

  * the budget: kvpress takes ``compression_ratio`` and prunes
    ``int(L * G * T * ratio)`` pairs (``int(G * T * ratio)`` per layer with ``layerwise``);
    kvjax takes a per-head budget ``b`` and keeps ``L * G * min(b, T)`` (``G * min(b, T)``
    per layer): the same when ``T * ratio`` is an integer.
  * the sinks score ``+inf`` (kvpress: the global maximum + 1), the same ranking; ``sinks``
    should equal the evidence's ``n_sink``, as in kvpress where one ``n_sink`` sets both.
  * kvjax evicts the pruned pairs from a real cache; kvpress masks them in attention
    (``masked_key_indices``).
  * ties go to the lower layer, head and position; kvpress's ``torch.topk`` leaves them
    unspecified.
  * the evidence's own differences are in :func:`kvjax.model.kvgrad.kvgrad_evidence`
    (batches of rows, the gradient through a zero offset on the attention output).

  Attributes:
    sinks: the protected first positions (kvpress ``n_sink``, 4).
  """

  needs: ClassVar[frozenset[str]] = frozenset({FIELD})

  def score(self, evidence):
    """The attribution, ``sinks`` protected (kvpress ``KVgradPress``)."""
    return kvgrad_scores(evidence.need(FIELD, self.label), sinks=self.sinks)
