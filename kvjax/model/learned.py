"""How a model computes the learned kinds of evidence, and the hidden states a learned scorer
reads.

KVzap's ``kvzap_LGT`` and Fast KVzip's ``fastkvzip_LGT`` are declared beside the policies that
read them (:mod:`kvjax.policies.evidence`); this module attaches their computation
(:func:`kvjax.policies.evidence.provide`): a trained file, named by the evaluation config's
``kvzap`` / ``fastkvzip`` field, applied to each position's attention input. A kind declared
outside kvjax computes the same way, from :func:`attention_inputs` (``examples/probe_policy.py``).

A trained file (a KVzap surrogate, Fast KVzip gates, a RestoreKV adapter) records the identity of
the model it was trained on (``save(..., identity=kvjax.checks.model_identity(cfg, params))``):
its ``load(path, cfg, params)`` refuses it for another model, even one of the same shapes, and a
file that records no identity unless the caller passes ``unverified=True``
(:func:`kvjax.checks.same_model`). Given only ``cfg``, ``load`` checks the shapes alone.
"""

from __future__ import annotations

import jax

from kvjax.model import fastkvzip, kvzap
from kvjax.policies import evidence as evidence_lib

Array = jax.Array


def attention_inputs(model, input_ids, attention_mask=None) -> Array:
  """Every layer's attention inputs over a prompt: the hidden states after each layer's input
  norm (what kvpress's hooks read as ``hidden_states``), the features of the learned scorers.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    input_ids: token ids ``[B, T]``.
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 ``[L, B, T, d]``.
  """
  return fastkvzip.attention_inputs(model.cfg, model.params(), input_ids, attention_mask)


def _kvzap(model, input_ids, attention_mask, surrogate) -> Array:
  return kvzap.kvzap_evidence(model.cfg, model.params(), surrogate, input_ids, attention_mask)


def _fastkvzip(model, input_ids, attention_mask, gates) -> Array:
  cfg, params = model.cfg, model.params()
  return fastkvzip.fastkvzip_evidence(cfg, params, gates, input_ids, attention_mask)


evidence_lib.provide("kvzap_LGT", _kvzap, resource="kvzap", load=kvzap.load)
evidence_lib.provide("fastkvzip_LGT", _fastkvzip, resource="fastkvzip", load=fastkvzip.load)
