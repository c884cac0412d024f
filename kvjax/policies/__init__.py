"""Policies are objects: a typed, frozen policy scores, allocates and selects.

Build one by name, ``policies.make("pyramidkv", beta=5)``, or as an object,
``policies.SnapKV(allocator=policies.Pyramid(beta=5))``; every entry point of kvjax (the lab,
sweeps, the model's ``generate``/``keep_mask``/``answer_configs``, evaluations) takes either.
A policy's numbers (budgets, data options) stay traced data under ``jit``/``vmap``; the choice
of method is static Python (never ``lax.switch`` over policies under ``vmap``).

* :mod:`~kvjax.policies.evidence`: :class:`Evidence` (what a policy observes),
  :class:`EvidenceRequest` (what it asks a prefill to compute) and the declared evidence kinds
  (:class:`EvidenceKind`, :func:`declare_evidence`, :func:`evidence_kind`, :func:`evidence_kinds`).
* :mod:`~kvjax.policies.base`: the protocol: :class:`Policy` (write ``score``; declare
  ``sinks`` and ``window``), :class:`WindowPolicy` (write ``score_rows``), :class:`DecodePolicy`
  (a decode-time state machine: ``init_state``, ``observe``, ``keep_scores``), and the optional
  protocols a policy opts into: :class:`Rescoring`, :class:`ValueMerging`,
  :class:`DecodeMerging`.
* :mod:`~kvjax.policies.allocators`: total budget -> ``budget_LH``: :class:`Uniform`,
  :class:`Pyramid`, :class:`AdaKV`, :class:`HeadKV`, :class:`CakeLayers`, :class:`DuoSplit`,
  :class:`Pooled`, :class:`KeepAll`.
* :mod:`~kvjax.policies.methods`: one class per method; :mod:`~kvjax.policies.wrappers`:
  :class:`Critical`, :class:`CriticalAdaKV`, :class:`ChunkKV`, :class:`SelectOnce` over any base.
* One module per later method: :mod:`~kvjax.policies.leverage`, ``noncausal``, ``compactor``,
  ``curkv``, ``capkv``, ``kvcompose``, ``kvgrad``, ``merging``, ``cam``, ``simlayerkv``,
  ``finch``, ``dms``, ``entropy_chunkkv``, ``lukv``, ``expected_stats``, ``kvzap``,
  ``fastkvzip``, ``restorekv``;
  :mod:`~kvjax.policies.combinators` (:class:`Composed`, :class:`Chunked`, :class:`Blockwise`,
  :class:`PrefillDecoding`, :class:`RatioDecoding`) and :mod:`~kvjax.policies.per_layer`
  (:class:`PerLayer`).
* :mod:`~kvjax.policies.registry`: names at the boundary: :func:`make`, :func:`register`,
  :func:`build`; :mod:`~kvjax.policies.papers`: each name's paper, reference code and
  named differences (:func:`provenance`).

Budgets passed to a policy are per-(layer, head) ``max_capacity_prompt`` values: a scalar,
``[L]`` or ``[L, H]``, window and sinks included.
"""

from kvjax.policies.allocators import (
  AdaKV,
  Allocator,
  CakeLayers,
  DuoSplit,
  HeadKV,
  KeepAll,
  Layered,
  Pooled,
  Pyramid,
  Uniform,
  as_budget_LH,
  check_budget_counts,
)
from kvjax.policies.base import (
  DecodeMerging,
  DecodePolicy,
  Policy,
  Rescoring,
  ValueMerging,
  WindowPolicy,
  WindowScorer,
  check_decode_output,
  checked_init_state,
  checked_keep_scores,
  checked_observe,
  gather_slots,
)
from kvjax.policies.cam import CaM, cam_compress, cam_merge, merge_uniforms
from kvjax.policies.capkv import CapKV
from kvjax.policies.combinators import Blockwise, Chunked, Composed, PrefillDecoding, RatioDecoding
from kvjax.policies.compactor import Compactor
from kvjax.policies.curkv import CurDKV
from kvjax.policies.dms import DMS
from kvjax.policies.entropy_chunkkv import EntropyGatedChunkKV
from kvjax.policies.evidence import (
  DEFAULT_WINDOW,
  KEY_AXIS,
  N_FUTURE,
  N_SINK,
  Evidence,
  EvidenceKind,
  EvidenceRequest,
  declare_evidence,
  evidence_from_qk,
  evidence_kind,
  evidence_kinds,
)
from kvjax.policies.expected_stats import ExpectedAttentionStats
from kvjax.policies.fastkvzip import FastKVzip
from kvjax.policies.finch import Finch
from kvjax.policies.kvcompose import Composite, KVCompose
from kvjax.policies.kvgrad import KVgrad
from kvjax.policies.kvzap import KVzap
from kvjax.policies.leverage import LeverageScore
from kvjax.policies.lukv import LUKV, BudgetCurve
from kvjax.policies.merging import Merging, merge_values
from kvjax.policies.methods import (
  CAKE,
  H2O,
  RKV,
  TOVA,
  DuoAttention,
  ExpectedAttention,
  Full,
  HeavyHitters,
  KeyDiff,
  KNorm,
  KVzip,
  LagKV,
  ObservedAttention,
  Oracle,
  QFilter,
  Random,
  SlidingWindow,
  SnapKV,
  StreamingLLM,
  ThinK,
)
from kvjax.policies.noncausal import NonCausalAttention
from kvjax.policies.papers import provenance
from kvjax.policies.per_layer import PerLayer
from kvjax.policies.registry import (
  BUILTIN,
  REGISTRY,
  Preset,
  accepted_options,
  build,
  describe,
  doc,
  is_registered,
  make,
  names,
  names_where,
  register,
  unregister,
)
from kvjax.policies.restorekv import RestoreKV
from kvjax.policies.searched import Searched, read_allocation
from kvjax.policies.simlayerkv import LAZY_THRESHOLDS, SimLayerKV
from kvjax.policies.wrappers import ChunkKV, Critical, CriticalAdaKV, SelectOnce, Wrapper

__all__ = [
  "accepted_options",
  "AdaKV",
  "Allocator",
  "as_budget_LH",
  "Blockwise",
  "BudgetCurve",
  "build",
  "BUILTIN",
  "CAKE",
  "CakeLayers",
  "CaM",
  "cam_compress",
  "cam_merge",
  "CapKV",
  "check_budget_counts",
  "check_decode_output",
  "checked_init_state",
  "checked_keep_scores",
  "checked_observe",
  "Chunked",
  "ChunkKV",
  "Compactor",
  "Composed",
  "Composite",
  "Critical",
  "CriticalAdaKV",
  "CurDKV",
  "declare_evidence",
  "DecodeMerging",
  "DecodePolicy",
  "DEFAULT_WINDOW",
  "describe",
  "DMS",
  "doc",
  "DuoAttention",
  "DuoSplit",
  "EntropyGatedChunkKV",
  "Evidence",
  "evidence_from_qk",
  "evidence_kind",
  "evidence_kinds",
  "EvidenceKind",
  "EvidenceRequest",
  "ExpectedAttention",
  "ExpectedAttentionStats",
  "FastKVzip",
  "Finch",
  "Full",
  "gather_slots",
  "H2O",
  "HeadKV",
  "HeavyHitters",
  "is_registered",
  "KeepAll",
  "KEY_AXIS",
  "KeyDiff",
  "KNorm",
  "KVCompose",
  "KVgrad",
  "KVzap",
  "KVzip",
  "LagKV",
  "Layered",
  "LAZY_THRESHOLDS",
  "LeverageScore",
  "LUKV",
  "make",
  "merge_uniforms",
  "merge_values",
  "Merging",
  "N_FUTURE",
  "N_SINK",
  "names",
  "names_where",
  "NonCausalAttention",
  "ObservedAttention",
  "Oracle",
  "PerLayer",
  "Policy",
  "Pooled",
  "PrefillDecoding",
  "Preset",
  "provenance",
  "Pyramid",
  "QFilter",
  "Random",
  "RatioDecoding",
  "read_allocation",
  "register",
  "REGISTRY",
  "Rescoring",
  "RestoreKV",
  "RKV",
  "Searched",
  "SelectOnce",
  "SimLayerKV",
  "SlidingWindow",
  "SnapKV",
  "StreamingLLM",
  "ThinK",
  "TOVA",
  "Uniform",
  "unregister",
  "ValueMerging",
  "WindowPolicy",
  "WindowScorer",
  "Wrapper",
]
