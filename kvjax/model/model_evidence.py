"""The caller's evidence checked before any work: the data kinds a policy reads, computed from
the model where a kind declares how (:func:`computed_evidence`), checked against the model's
shapes and moved to the left padding the model runs with (:func:`check_evidence`); the kinds no
model entry point provides refused (:func:`check_model_evidence`).

Re-exported by :mod:`kvjax.model.decoding`, whose names these are.
"""

from __future__ import annotations

import numpy as np

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import restorekv
from kvjax.model.config import ModelConfig
from kvjax.policies import evidence as evidence_lib


def computed_evidence(model, policy: policies.Policy, evidence, input_ids, attention_mask=None):
  """The caller's evidence and every kind ``policy`` reads that the caller did not give but
  whose declaration computes it from the model (:attr:`kvjax.policies.EvidenceKind.compute`).

  Args:
    model: the model.
    policy: the policy (an object).
    evidence: the caller's ``{kind: array}`` mapping, or ``None``.
    input_ids: the prompt's token ids ``[B, T]``, as the caller gave them.
    attention_mask: the caller's 0/1 mask ``[B, T]`` (``None``: every token is real).

  Returns:
    The mapping with the computed kinds added over the caller's columns (``evidence`` itself
    when nothing is computed).
  """
  if evidence is not None and not isinstance(evidence, dict):
    return evidence  # check_evidence names the type
  given = evidence or {}
  wanted = [
    name
    for name in sorted(policy.evidence_fields)
    if given.get(name) is None and evidence_lib.evidence_kind(name).compute is not None
  ]
  computed = {}
  for name in wanted:
    kind = evidence_lib.evidence_kind(name)
    if kind.resource is not None:  # a trained file the caller loads (the evaluation does)
      continue
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
    computed[name] = np.asarray(kind.compute(model, ids, mask), np.float32)
  return {**given, **computed} if computed else evidence


def check_evidence(
  policy: policies.Policy, evidence, cfg: ModelConfig, input_ids, attention_mask, *, model=None
):
  """Checks the caller's data evidence for ``policy`` on a batch and moves it to left padding.

  The data kinds (:data:`kvjax.model.cache.SHARED_EVIDENCE`, :data:`~kvjax.model.cache.ROW_EVIDENCE`)
  are shared by every row (``qfilters_LGD``, ``retrieval_heads_LG``, HeadKV's ``head_scores_LH``)
  or per row, ``[L, B, ...]`` over the caller's columns or ``[L, ...]`` for every row
  (``reconstruction_attn_LGT``, ``kvzap_LGT``, a kind declared outside kvjax); the per-row
  kinds are moved to the left padding the model runs with. With ``model``, the kinds the policy
  reads that a declaration computes are computed first (:func:`computed_evidence`).

  Args:
    policy: the policy (an object).
    evidence: the caller's ``{field: array}`` mapping, or ``None``.
    cfg: the model's config.
    input_ids: the prompt's token ids ``[B, T]``, as the caller gave them.
    attention_mask: the caller's 0/1 mask ``[B, T]`` (``None``: every token is real).
    model: the model, to compute the kinds that declare a computation (``None``: none).

  Returns:
    The checked evidence with the per-row fields left-padded, or ``None`` when empty.

  Raises:
    ValueError: when a field is not caller-given evidence, a field the policy needs is missing,
      HeadKV's head scores are not finite, non-negative with a positive sum, or a field has the
      wrong shape (:func:`kvjax.model.cache.check_evidence`).
  """
  if model is not None:
    evidence = computed_evidence(model, policy, evidence, input_ids, attention_mask)
  ids = np.asarray(input_ids)
  B, T = ids.shape
  given = {} if evidence is None else evidence
  if not isinstance(given, dict):
    raise ValueError(f"evidence: expected a dict of evidence fields, got {type(given).__name__}")
  data = {**cache_lib.SHARED_EVIDENCE, **cache_lib.ROW_EVIDENCE}
  unknown = sorted(set(given) - set(data) - set(restorekv.FIELDS))
  if unknown:
    raise ValueError(
      f"evidence: {unknown} are not caller-given evidence; expected some of {sorted(data)} "
      "(the prefill computes the other fields a policy reads, but not "
      f"{sorted(UNAVAILABLE_EVIDENCE)}, which no model entry point provides)"
    )
  _check_head_scores(policy, given.get("head_scores_LH"))
  missing = sorted(
    (policy.evidence_fields & set(data)) - {k for k, v in given.items() if v is not None}
  )
  if missing:
    raise ValueError(
      f"evidence: policy {policy.label!r} needs {missing}; pass evidence={{...}} "
      "(kvjax.model.calibrate computes them from the model)"
    )
  L, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  restore = restorekv.check_restore_evidence(policy, given, L=L, B=B, G=G, D=D)
  out = {k: v for k, v in given.items() if k not in restorekv.FIELDS}
  mask = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask, bool)
  sizes = dict(L=L, B=B, G=G, T=T, D=D, Hq=cfg.num_heads)
  for field in cache_lib.ROW_EVIDENCE:
    if out.get(field) is not None:
      out[field] = _row_evidence_left_padded(
        evidence_lib.evidence_kind(field), out[field], sizes, mask
      )
  cache_lib.check_evidence(out, **sizes)
  return {**out, **restore} or None


def _row_evidence_left_padded(kind, value, sizes: dict, mask: np.ndarray) -> np.ndarray:
  """A per-row kind ``[L, B, ...]`` (or ``[L, ...]`` for every row) with each row's real
  columns moved to the left padding the model runs with."""
  B = mask.shape[0]
  arr = np.asarray(value, np.float32)
  shapes = cache_lib.evidence_shapes(kind, **sizes)
  every_row = [s[:1] + s[2:] for s in shapes]
  if arr.shape in every_row:
    arr = np.broadcast_to(arr[:, None], arr.shape[:1] + (B,) + arr.shape[1:])
  if arr.shape not in shapes:
    want = " or ".join(
      f"{s} ([L, B, ...]) or {r} (every row)" for s, r in zip(shapes, every_row, strict=True)
    )
    raise ValueError(f"evidence: {kind.name} has shape {arr.shape}, expected {want}")
  if kind.key_axis is None:
    return np.array(arr)
  # the key axis last, each row's real columns to its end
  last = np.moveaxis(arr, arr.ndim + kind.key_axis, -1)
  moved = np.zeros_like(last)
  T = last.shape[-1]
  for r in range(B):  # the columns to_left_padding moves
    real = np.flatnonzero(mask[r])
    if real.size:
      moved[:, r, ..., T - real.size :] = last[:, r][..., real]
  return np.moveaxis(moved, -1, arr.ndim + kind.key_axis)


# Evidence that no model entry point can give a policy: the prefill does not compute it and
# ``evidence=`` does not take it. Each: what it is, and what to use instead.
UNAVAILABLE_EVIDENCE = {
  "legacy_column_sums_LHT": (
    "KVCache-Factory's legacy non-causal prefill column sums (queries before the window attend "
    "to later keys), which the model's causal prefill does not compute",
    "use 'h2o' (causal column sums, computed by the prefill), or run this policy on arrays: "
    "kvjax.policies.evidence_from_qk computes the legacy sums",
  ),
  "future_attn_LHST": (
    "the attention that tokens after the prompt pay to it, unknown before they are generated",
    "use kvjax.model.answer_configs, which computes it from the answer it is given",
  ),
}


def check_model_evidence(policy: policies.Policy, *, future: bool = False) -> None:
  """Refuses, before any work, a policy that reads evidence a model entry point cannot provide.

  Args:
    policy: the policy (an object).
    future: whether the entry point computes the future attention (the answers do).

  Raises:
    ValueError: naming the policy, the field, what it is and what to use instead.
  """
  for field, (what, instead) in UNAVAILABLE_EVIDENCE.items():
    if field in policy.evidence_fields and not (future and field == "future_attn_LHST"):
      raise ValueError(
        f"policy: {policy.label!r} reads {field}, {what}; it cannot be passed as evidence "
        f"either; {instead}"
      )


def _check_head_scores(policy: policies.Policy, head_scores) -> None:
  """HeadKV needs positive head importances: all-zero scores would silently leave every head
  with only its window (any policy that reads ``head_scores_LH``)."""
  if "head_scores_LH" not in policy.evidence_fields:
    return
  if head_scores is None:
    raise ValueError(
      f"head_scores: policy {policy.label!r} (HeadKV's allocation) needs per-head importance "
      "scores; pass evidence={'head_scores_LH': [L, H] scores}"
    )
  arr = np.asarray(head_scores, np.float64)
  if arr.ndim != 2 or not np.isfinite(arr).all() or (arr < 0).any() or arr.sum() <= 0:
    raise ValueError(
      f"head_scores: expected finite non-negative [L, H] scores with a positive sum, got "
      f"shape {arr.shape}, sum {arr.sum() if arr.size else 0.0}"
    )
