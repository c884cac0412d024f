"""Policies are objects: a typed, frozen policy scores, allocates and selects.

Build one by name, ``policies.make("pyramidkv", beta=5)``, or as an object,
``policies.SnapKV(allocator=policies.Pyramid(beta=5))``; every entry point of kvjax (the lab,
sweeps, the model's ``generate``/``keep_mask``/``answer_configs``, evaluations) takes either.
A policy's numbers (budgets, data options) stay traced data under ``jit``/``vmap``; the choice
of method is static Python (never ``lax.switch`` over policies under ``vmap``). Budgets passed
to a policy are per-(layer, head) ``max_capacity_prompt`` values: a scalar, ``[L]`` or
``[L, H]``, window and sinks included.

This package exports what a user of policies needs; the helpers each method is built from stay
in the module that defines them (``kvjax.policies.cam.cam_merge``,
``kvjax.policies.searched.read_allocation``, ``kvjax.policies.registry.Preset``).

Names (:mod:`~kvjax.policies.registry`, :mod:`~kvjax.policies.papers`):
  :func:`make` builds a registered name once, :func:`build` takes a name or an object;
  :func:`names`, :func:`names_where`, :func:`is_registered`; :func:`register` and
  :func:`unregister` a user's own; :func:`accepted_options`, :func:`doc`, :func:`describe`
  and :func:`provenance` (each name's paper, reference code and named differences).

Writing a policy (:mod:`~kvjax.policies.core` and the protocols):
  :class:`Policy` (write ``score``; declare ``sinks`` and ``window``), :class:`WindowPolicy`
  (write ``score_rows``), :class:`DecodePolicy` (a decode-time state machine: ``init_state``,
  ``observe``, ``keep_scores``; :func:`gather_slots` reads evidence at the kept slots),
  :class:`Wrapper` (a policy over a base policy); the optional protocols a policy opts into:
  :class:`Rescoring`, :class:`ValueMerging`, :class:`DecodeMerging`.

Checked hooks (what the model's cache and the lab's replay call on a decode-time policy):
  :func:`checked_init_state`, :func:`checked_observe`, :func:`checked_keep_scores` and the
  check they share, :func:`check_decode_output`.

Evidence (:mod:`~kvjax.policies.evidence`):
  :class:`Evidence` (what a policy observes), :class:`EvidenceRequest` (what it asks a prefill
  to compute), :func:`evidence_from_qk`, :data:`DEFAULT_WINDOW`; the declared kinds:
  :class:`EvidenceKind`, :func:`declare_evidence`, :func:`evidence_kind`, :func:`evidence_kinds`.

Allocators (:mod:`~kvjax.policies.allocators`: a total budget -> ``budget_LH``):
  :class:`Allocator`, :class:`Layered`, :class:`Uniform`, :class:`Pyramid`, :class:`AdaKV`,
  :class:`HeadKV`, :class:`CakeLayers`, :class:`DuoSplit`, :class:`Pooled`, :class:`KeepAll`,
  :class:`PerLayer`, :class:`BudgetCurve`, :class:`Composite`, :class:`Searched`;
  :func:`as_budget_LH` broadcasts a budget to ``[L, H]``.

Methods (:mod:`~kvjax.policies.methods` and one module per later method):
  :class:`Full`, :class:`SlidingWindow`, :class:`StreamingLLM`, :class:`HeavyHitters`,
  :class:`ObservedAttention`, :class:`H2O`, :class:`TOVA`, :class:`SnapKV`, :class:`CAKE`,
  :class:`KNorm`, :class:`Random`, :class:`Oracle`, :class:`KeyDiff`, :class:`LagKV`,
  :class:`ExpectedAttention`, :class:`ExpectedAttentionStats`, :class:`QFilter`,
  :class:`DuoAttention`, :class:`KVzip`, :class:`ThinK`, :class:`RKV`, :class:`LeverageScore`,
  :class:`NonCausalAttention`, :class:`Compactor`, :class:`CurDKV`, :class:`CapKV`,
  :class:`KVCompose`, :class:`KVgrad`, :class:`SimLayerKV`, :class:`Finch`, :class:`KVzap`,
  :class:`FastKVzip`, :class:`RestoreKV`.

Wrappers and combinators (:mod:`~kvjax.policies.wrappers`, :mod:`~kvjax.policies.combinators`):
  :class:`Critical`, :class:`CriticalAdaKV`, :class:`ChunkKV`, :class:`SelectOnce`,
  :class:`EntropyGatedChunkKV`, :class:`LUKV`, :class:`DMS`, :class:`Merging`, :class:`CaM`
  over a base; :class:`Composed`, :class:`Chunked`, :class:`Blockwise`,
  :class:`PrefillDecoding`, :class:`RatioDecoding`.
"""

from .allocators import (
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
)
from .cam import CaM
from .capkv import CapKV
from .combinators import Blockwise, Chunked, Composed, PrefillDecoding, RatioDecoding
from .compactor import Compactor
from .core import Policy
from .curkv import CurDKV
from .decode_policy import (
  DecodePolicy,
  check_decode_output,
  checked_init_state,
  checked_keep_scores,
  checked_observe,
  gather_slots,
)
from .dms import DMS
from .entropy_chunkkv import EntropyGatedChunkKV
from .evidence import (
  DEFAULT_WINDOW,
  Evidence,
  EvidenceKind,
  EvidenceRequest,
  declare_evidence,
  evidence_from_qk,
  evidence_kind,
  evidence_kinds,
)
from .expected_stats import ExpectedAttentionStats
from .fastkvzip import FastKVzip
from .finch import Finch
from .kvcompose import Composite, KVCompose
from .kvgrad import KVgrad
from .kvzap import KVzap
from .leverage import LeverageScore
from .lukv import LUKV, BudgetCurve
from .merging import Merging
from .methods import (
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
from .noncausal import NonCausalAttention
from .papers import provenance
from .per_layer import PerLayer
from .protocols import DecodeMerging, Rescoring, ValueMerging
from .registry import (
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
from .restorekv import RestoreKV
from .searched import Searched
from .simlayerkv import SimLayerKV
from .window import WindowPolicy
from .wrappers import ChunkKV, Critical, CriticalAdaKV, SelectOnce, Wrapper

__all__ = [
  "accepted_options",
  "AdaKV",
  "Allocator",
  "as_budget_LH",
  "Blockwise",
  "BudgetCurve",
  "build",
  "CAKE",
  "CakeLayers",
  "CaM",
  "CapKV",
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
  "KeyDiff",
  "KNorm",
  "KVCompose",
  "KVgrad",
  "KVzap",
  "KVzip",
  "LagKV",
  "Layered",
  "LeverageScore",
  "LUKV",
  "make",
  "Merging",
  "names",
  "names_where",
  "NonCausalAttention",
  "ObservedAttention",
  "Oracle",
  "PerLayer",
  "Policy",
  "Pooled",
  "PrefillDecoding",
  "provenance",
  "Pyramid",
  "QFilter",
  "Random",
  "RatioDecoding",
  "register",
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
  "Wrapper",
]
