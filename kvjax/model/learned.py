"""How a model computes the learned kinds of evidence, and the hidden states a learned scorer
reads.

KVzap's ``kvzap_LGT`` and Fast KVzip's ``fastkvzip_LGT`` are declared beside the policies that
read them (:mod:`kvjax.policies.evidence`); this module attaches their computation
(:func:`kvjax.policies.evidence.provide`): a trained file, named by the evaluation config's
``kvzap`` / ``fastkvzip`` field, applied to each position's attention input. A kind declared
outside kvjax computes the same way, from :func:`attention_inputs` (``examples/probe_policy.py``).

A trained file (a KVzap surrogate, Fast KVzip gates, a RestoreKV adapter) records the identity of
the model it was trained on (``save(..., identity=kvjax.checks.model_identity(cfg, params))``):
its ``load(path, model)`` refuses it for another model, even one of the same shapes, and a file
that records no identity unless the caller passes ``unverified=True``
(:func:`kvjax.checks.same_model`); with ``unverified=True``, ``load`` checks the shapes alone.
"""

from __future__ import annotations

import jax

from kvjax.model import fastkvzip, kvzap
from kvjax.model.passes import attention_inputs  # noqa: F401 (km.attention_inputs)
from kvjax.policies import evidence as evidence_lib

Array = jax.Array


def _kvzap(model, input_ids, attention_mask, surrogate) -> Array:
  return kvzap.kvzap_evidence(model, surrogate, input_ids, attention_mask)


def _fastkvzip(model, input_ids, attention_mask, gates) -> Array:
  return fastkvzip.fastkvzip_evidence(model, gates, input_ids, attention_mask)


evidence_lib.provide("kvzap_LGT", _kvzap, resource="kvzap", load=kvzap.load)
evidence_lib.provide("fastkvzip_LGT", _fastkvzip, resource="fastkvzip", load=fastkvzip.load)
