"""kvjax's own policy names: each built-in preset and each wrapper prefix, written once with
where it comes from (:class:`Provenance`: its paper, the reference code kvjax follows and the
differences from that code that kvjax names).

:mod:`~kvjax.policies.registry` registers these; :func:`kvjax.policies.provenance` reads them,
and the documentation's methods catalogue is generated from both, so a built-in name whose
provenance is empty is visible there. Adding a built-in method is one entry of :data:`PRESETS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.policies import allocators as alloc_lib
from kvjax.policies import combinators as comb
from kvjax.policies import methods as m
from kvjax.policies import wrappers as w
from kvjax.policies.cam import CaM
from kvjax.policies.capkv import CapKV
from kvjax.policies.compactor import Compactor
from kvjax.policies.core import Policy
from kvjax.policies.curkv import CurDKV
from kvjax.policies.dms import DMS
from kvjax.policies.entropy_chunkkv import EntropyGatedChunkKV
from kvjax.policies.expected_stats import ExpectedAttentionStats
from kvjax.policies.fastkvzip import FastKVzip
from kvjax.policies.finch import Finch
from kvjax.policies.kvcompose import Composite, KVCompose
from kvjax.policies.kvgrad import KVgrad
from kvjax.policies.kvzap import KVzap
from kvjax.policies.leverage import LeverageScore
from kvjax.policies.lukv import LUKV
from kvjax.policies.merging import Merging
from kvjax.policies.noncausal import NonCausalAttention
from kvjax.policies.restorekv import RestoreKV
from kvjax.policies.simlayerkv import SimLayerKV


@dataclasses.dataclass(frozen=True)
class Provenance:
  """Where a method comes from (empty strings where there is none, as for a baseline).

  Attributes:
    paper: the paper (authors, title, arXiv id or other reference).
    code: the reference code kvjax follows (repository and file, or the kvpress press).
    differs: the differences from that code that kvjax names.
  """

  paper: str = ""
  code: str = ""
  differs: str = ""

  def as_dict(self) -> dict[str, str]:
    """The provenance as a dict.

    Returns:
      ``{"paper": ..., "code": ..., "differs": ...}``.
    """
    return dataclasses.asdict(self)


_KVPRESS = "kvpress 0.5.5 `{}`"
_SAME = "none: kept sets equal the reference's in the golden tests"
_COMPACTOR = (
  "Chari & Van Durme, Compactor: Calibrated Query-Agnostic KV Cache Compression with "
  "Approximate Leverage Scores (arXiv 2507.08143)"
)
# ThinK's, shared by the ``think`` preset and the ``think_<base>`` wrapper
_THINK = Provenance(
  paper="Xu et al., ThinK: Thinner Key Cache by Query-Driven Pruning (arXiv 2407.21018)",
  code=_KVPRESS.format("ThinKPress"),
  differs="a real memory saving: pruned key channels are not stored (kvpress zeroes them)",
)


def _preset(
  cls: type[Policy],
  doc: str,
  provenance: Provenance,
  allocator: alloc_lib.Allocator | None = None,
  **defaults,
) -> dict[str, Any]:
  return dict(cls=cls, defaults=defaults, allocator=allocator, doc=doc, provenance=provenance)


_SNAP_MEAN = dict(reduce="mean")

# name -> the keyword arguments of its :class:`~kvjax.policies.registry.Preset` (the policy class,
# its one line, its provenance (a baseline's is empty), its allocator and the reference's
# defaults), in registration order
PRESETS: dict[str, dict[str, Any]] = {
  "full": _preset(
    m.Full,
    "the full cache: every token kept",
    Provenance(),
  ),
  "sliding_window": _preset(
    m.SlidingWindow,
    "the last B tokens",
    Provenance(),
  ),
  "streaming_llm": _preset(
    m.StreamingLLM,
    "4 sinks + recent",
    Provenance(
      paper="Xiao et al., Efficient Streaming Language Models with Attention Sinks (arXiv "
      "2309.17453)",
      code="mit-han-lab/streaming-llm `streaming_llm/kv_cache.py::StartRecentKVCache`; "
      + _KVPRESS.format("StreamingLLMPress"),
      differs="positions are not re-rotated after eviction (keys keep their original RoPE "
      "positions)",
    ),
  ),
  "h2o": _preset(
    m.H2O,
    "causal heavy hitters + recent 8",
    Provenance(
      paper="Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large "
      "Language Models (arXiv 2306.14048)",
      code="FMInference/H2O `h2o_hf/utils_real_drop/modify_llama.py` (causal column sums, evicting "
      "while decoding)",
      differs="`recent=8` by default, as KVCache-Factory's H2O; the official code keeps half the "
      "budget recent (`recent=None`)",
    ),
  ),
  "h2o_kvfactory_legacy": _preset(
    m.HeavyHitters,
    "KVCache-Factory's published H2O (non-causal prefill column sums) + window 8",
    Provenance(
      paper="Zhang et al., H2O (arXiv 2306.14048), as KVCache-Factory publishes it",
      code="Zefan-Cai/KVCache-Factory `pyramidkv/pyramidkv_utils.py::H2OKVCluster`",
      differs="none: the non-causal prefill column sums of that code, kept as published",
    ),
    form="kvfactory_legacy",
  ),
  "h2o_kvpress": _preset(
    m.ObservedAttention,
    "kvpress ObservedAttentionPress",
    Provenance(
      paper="Zhang et al., H2O (arXiv 2306.14048), as kvpress runs it",
      code=_KVPRESS.format("ObservedAttentionPress"),
      differs=_SAME,
    ),
  ),
  "tova": _preset(
    m.TOVA,
    "last query's row averaged over heads",
    Provenance(
      paper="Oren et al., Transformers are Multi-State RNNs (arXiv 2401.06104)",
      code="schwartz-lab-NLP/TOVA `src/tova_cache.py::TOVACache.reduce`; "
      + _KVPRESS.format("TOVAPress"),
      differs=_SAME,
    ),
  ),
  "snapkv": _preset(
    m.SnapKV,
    "window votes, maxpool k=7",
    Provenance(
      paper="Li et al., SnapKV: LLM Knows What You are Looking for Before Generation (arXiv "
      "2404.14469)",
      code="FasterDecoding/SnapKV `snapkv/monkeypatch/snapkv_utils.py::SnapKVCluster.update_kv`",
      differs="kept positions in ascending order (upstream keeps top-k order; attention is "
      "unaffected); scores stay float32 (upstream casts the softmax to fp16/bf16 before summing)",
    ),
  ),
  "snapkv_kvpress": _preset(
    m.SnapKV,
    "kvpress SnapKVPress (mean votes, avgpool k=5; add num_kv_heads for its GQA mean)",
    Provenance(
      paper="Li et al., SnapKV (arXiv 2404.14469), as kvpress runs it",
      code=_KVPRESS.format("SnapKVPress"),
      differs=_SAME,
    ),
    kernel=5,
    pool="avg",
    reduce="mean",
  ),
  "pyramidkv": _preset(
    m.SnapKV,
    "SnapKV scores under PyramidKV's layer schedule",
    Provenance(
      paper="Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information "
      "Funneling (arXiv 2406.02069)",
      code="Zefan-Cai/KVCache-Factory `pyramidkv/pyramidkv_utils.py::PyramidKVCluster.update_kv`",
      differs="as SnapKV's; layer budgets equal the reference's arithmetic on a 648-row grid",
    ),
    allocator=alloc_lib.Pyramid(),
  ),
  "adakv_snapkv": _preset(
    m.SnapKV,
    "Ada-KV head-adaptive budgets over SnapKV scores",
    Provenance(
      paper="Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation "
      "(arXiv 2407.11550)",
      code="FFY0/AdaKV `adaptive_snapkv/monkeypatch/snapkv_utils.py::AdaptiveSnapKVCluster`",
      differs="as SnapKV's",
    ),
    allocator=alloc_lib.AdaKV(),
    **_SNAP_MEAN,
  ),
  "adakv_pyramidkv": _preset(
    m.SnapKV,
    "Ada-KV within PyramidKV's layer schedule (Ada-KV pyram_mode)",
    Provenance(
      paper="Feng et al., Ada-KV (arXiv 2407.11550), within PyramidKV's schedule",
      code="FFY0/AdaKV `adaptive_snapkv` with `pyram_mode=True`",
      differs="as SnapKV's",
    ),
    allocator=alloc_lib.AdaKV(pyramid_mode="legacy_floor"),
    **_SNAP_MEAN,
  ),
  "headkv": _preset(
    m.SnapKV,
    "HeadKV static head budgets over SnapKV mean votes",
    Provenance(
      paper="Fu et al., Not All Heads Matter: A Head-Level KV Cache Compression Method with "
      "Integrated Retrieval and Reasoning (arXiv 2410.19258)",
      code="FYYFU/HeadKV `headkv/snapkv_utils.py::ReasonSnapKVCluster`",
      differs="head scores are data (`evidence['head_scores_LH']`); kvjax ships none for a given "
      "model",
    ),
    allocator=alloc_lib.HeadKV(),
    **_SNAP_MEAN,
  ),
  "cake": _preset(
    m.CAKE,
    "CAKE layer preference budgets, mean + gamma var eviction score",
    Provenance(
      paper="Qin et al., CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences "
      "(arXiv 2503.12491)",
      code="antgroup/cakekv `cake/cake_cache.py::CakeprefillKVCache`, `adjust_budgets`",
      differs="budgets are allocated once after the prompt from every layer's preference (the "
      "reference cascades them layer by layer during the prefill; the final budgets are the same)",
    ),
  ),
  "knorm": _preset(
    m.KNorm,
    "lowest key norm",
    Provenance(
      paper="Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression "
      "(arXiv 2406.11430)",
      code=_KVPRESS.format("KnormPress"),
      differs=_SAME,
    ),
  ),
  "random": _preset(
    m.Random,
    "uniform random scores",
    Provenance(
      code=_KVPRESS.format("RandomPress"),
      differs="its own random generator (jax.random)",
    ),
  ),
  "oracle": _preset(
    m.Oracle,
    "future attention (upper bound)",
    Provenance(
      differs="an upper bound, not a method: it reads the future attention that no realisable "
      "policy has",
    ),
  ),
  "keydiff": _preset(
    m.KeyDiff,
    "kvpress KeyDiffPress: keys least like the mean normalised key",
    Provenance(
      paper="Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM "
      "Inference (arXiv 2504.15364)",
      code=_KVPRESS.format("KeyDiffPress"),
      differs=_SAME,
    ),
  ),
  "lagkv": _preset(
    m.LagKV,
    "kvpress LagKVPress: K/V spread against the next lag chunk, ranked inside each chunk; "
    "4 sinks and the tail chunk kept",
    Provenance(
      paper="Liang et al., LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are "
      "Important (arXiv 2504.04704)",
      code=_KVPRESS.format("LagKVPress"),
      differs="a channel constant over its reference chunk scores 0 (kvpress: NaN)",
    ),
  ),
  "expected_attention": _preset(
    m.ExpectedAttention,
    "kvpress ExpectedAttentionPress: softmax of the expected logits of future queries "
    "(mean + covariance of the pre-RoPE prompt queries, averaged RoPE over the next 512 "
    "positions, computed by the model), times ||v||; 4 sinks kept",
    Provenance(
      paper="Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from "
      "Future Queries Distribution (arXiv 2510.00636)",
      code=_KVPRESS.format("ExpectedAttentionPress"),
      differs="the averaged RoPE matrix is computed in float32",
    ),
  ),
  "kvzap": _preset(
    KVzap,
    "kvpress KVzapPress: a trained per-layer surrogate (ridge or 2-layer MLP) of KVzip+'s log "
    "scores from each position's attention input (evidence kvzap_LGT, "
    "kvjax.model.kvzap.kvzap_evidence); top-k per KV head; dms_kvzap: the threshold",
    Provenance(
      paper="KVzap (arXiv 2601.07891)",
      code=_KVPRESS.format("KVzapPress")
      + " and its training code `kvzap/train.py`, `kvzap/data.py`",
      differs="the surrogate is trained on shipped prose (kvpress downloads nvidia/KVzap-* trained "
      "on Nemotron samples) and loaded by path; fp32; the repeat prompt is tokenised in pieces; "
      "prefill only (kvpress's DMSPress(decoding=True) also scores generated tokens)",
    ),
  ),
  "fastkvzip": _preset(
    FastKVzip,
    "kvpress FastKVzipPress: per-layer gates trained on KVzip's scores (a low-rank sink "
    "attention over each position's attention input; evidence fastkvzip_LGT, "
    "kvjax.model.fastkvzip.fastkvzip_evidence), 4 sinks and a 2 % local window kept, one pooled "
    "selection of L*H*budget across layers and heads (layerwise=True: per layer)",
    Provenance(
      paper="Kim, Han and Yun, Fast KVzip: Efficient and Accurate LLM Inference with Gated KV "
      "Eviction (arXiv 2601.17668)",
      code=_KVPRESS.format("FastKVzipPress")
      + " and the official training code Janghyun1230/FastKVzip `optim.py`",
      differs="the gates are trained on shipped prose (kvpress downloads Jang-Hyun/Fast-KVzip) and "
      "loaded by path; training adds the gate bias once, as every inference path (optim.py adds it "
      "twice); KVzip targets are kvpress's (2048-token chunks, 4 sinks); fp32; the budget is per "
      "head (pooled as L x G x min(b, T)); prefill only, one dense forward (no chunked prefill)",
    ),
  ),
  "restorekv": _preset(
    RestoreKV,
    "kvpress RestoreKVPress: KVzip with 8 learned restore tokens appended after the prompt "
    "(their keys and values from one LoRA-adapted pass over the full cache, "
    "kvjax.model.restorekv.restorekv_evidence), kept inside the same budget "
    "(L*H*(budget - 8) context pairs pooled)",
    Provenance(
      paper="RestoreKV: learned restoration on top of KVzip (arXiv 2608.01247)",
      code=_KVPRESS.format("RestoreKVPress") + " on `KVzipPress`",
      differs="the adapter (restore embeddings and LoRA on q/k/v/o) is trained here by "
      "self-distillation on shipped prose and loaded by path (kvpress downloads "
      "higokri/RestoreKV-*, whose training recipe it does not include); the budget counts the "
      "restore slots (int(T(1-r)) - N context pairs per head on average; kvpress prunes int(L H T "
      "(r + N/T)), equal up to rounding); restore tokens outrank the sinks; fp32",
    ),
  ),
  "expected_attention_stats": _preset(
    ExpectedAttentionStats,
    "kvpress ExpectedAttentionStatsPress: ExpectedAttention with the query mean and covariance "
    "measured once on a corpus (evidence stats_query_mean_LHD / stats_query_cov_LHDD from "
    "kvjax.model.calibrate.query_stats), rotated for each prompt by the model's cache",
    Provenance(
      paper="Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from "
      "Future Queries Distribution (arXiv 2510.00636)",
      code=_KVPRESS.format("ExpectedAttentionStatsPress"),
      differs="statistics measured on Python's pydoc topics in equal-length rows (kvpress: "
      "kmfoda/booksum chapters cut to 1,000 characters, from the hub); no re-compression while "
      "decoding",
    ),
  ),
  "qfilter": _preset(
    m.QFilter,
    "kvpress QFilterPress: -<k, f> with the calibrated Q-Filter direction f per KV head",
    Provenance(
      paper="Godey et al., Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression "
      "(arXiv 2503.02812)",
      code=_KVPRESS.format("QFilterPress")
      + "; the filters as the official `make_filters.py` makes them",
      differs="float32 and numpy's generator for the calibration samples",
    ),
  ),
  "duo_attention": _preset(
    m.DuoAttention,
    "kvpress DuoAttentionPress: the lowest round(L*G*head_compression_ratio) gates are streaming "
    "heads keeping `sinks` sinks + (budget - sinks) recent tokens (kvpress sink_size + "
    "recent_size = the budget: 128 + 256 = 384 in the official patterns); retrieval heads keep "
    "everything; head_compression_ratio 0.5 (kvpress's default 0.0 streams no head)",
    Provenance(
      paper="Xiao et al., DuoAttention: Efficient Long-Context LLM Inference with Retrieval and "
      "Streaming Heads (arXiv 2410.10819)",
      code=_KVPRESS.format("DuoAttentionPress")
      + "; the gates by mit-han-lab/duo-attention's distillation (`duo_attn/train.py`)",
      differs="`head_compression_ratio=0.5` by default (kvpress's 0.0 streams no head); short "
      "prompts shrink sink 128 + recent 256",
    ),
  ),
  "kvzip": _preset(
    m.KVzip,
    "kvpress KVzipPress: max attention of the context-reconstruction queries, 4 sinks kept, one "
    "pooled selection of L*H*budget across all layers and heads (layerwise=True: per layer)",
    Provenance(
      paper="Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
      "(arXiv 2505.23416)",
      code=_KVPRESS.format("KVzipPress"),
      differs="the reconstruction attention is computed in batches of rows; contexts over 4k "
      "tokens through the chunked prefill",
    ),
  ),
  "think": _preset(
    m.ThinK,
    "kvpress ThinKPress alone: every token kept, the int(D*channel_ratio) least important key "
    "channels pruned (give any policy channel_ratio to compose it with a token policy)",
    _THINK,
  ),
  "rkv": _preset(
    m.RKV,
    "R-KV (official code): 0.07 * pooled window attention - 0.93 * key-cosine redundancy, "
    "window 8 kept; re-compresses every 128 generated tokens",
    Provenance(
      paper="Cai et al., R-KV: Redundancy-aware KV Cache Compression for Reasoning Models (arXiv "
      "2505.24133)",
      code="Zefan-Cai/R-KV (the official code; kvpress has no press)",
      differs="none known: checked against a transcription of the official code",
    ),
  ),
  "leverage": _preset(
    LeverageScore,
    "kvpress LeverageScorePress: approximate leverage of the pre-RoPE keys (Gaussian right "
    "sketch of 48, Cholesky solve), z-scored per layer",
    Provenance(
      paper=_COMPACTOR,
      code=_KVPRESS.format("LeverageScorePress"),
      differs="the Gaussian sketch comes from `evidence.sketch_LGDK` or `seed` (kvpress draws a "
      "fresh `torch.randn` per call); when every Cholesky jitter fails the layer's scores may be "
      "NaN where kvpress raises; z-scores per prompt (kvpress: over the batch)",
    ),
    sketch_dimension=48,
  ),
  "noncausal_attn": _preset(
    NonCausalAttention,
    "kvpress NonCausalAttnPress: non-causal chunked attention each key receives times ||v||, "
    "avg-pooled over 3, z-scored per layer",
    Provenance(
      paper=_COMPACTOR,
      code=_KVPRESS.format("NonCausalAttnPress"),
      differs="z-scores per prompt (kvpress: over the batch); a left-padded row is scored as its "
      "unpadded prompt",
    ),
    chunk_size=256,
  ),
  "compactor": _preset(
    Compactor,
    "Compactor (kvpress CompactorPress): blending x leverage + non-causal attention, 8 sinks "
    "and 4 recent tokens kept",
    Provenance(
      paper=_COMPACTOR,
      code=_KVPRESS.format("CompactorPress"),
      differs="`blending` is a number (default 0.5) since kvjax scores do not depend on the budget "
      "(kvpress's `None` means the compression ratio); protected positions score +inf (kvpress: "
      "the layer's maximum); `sinks`/`recent` are kvpress's `sink_size_start`/`sink_size_end`",
    ),
    sinks=8,
    recent=4,
    chunk_size=256,
    sketch_dimension=48,
    blending=0.5,
  ),
  "curkv": _preset(
    CurDKV,
    "CurDKV (kvpress CURPress): locally normalised ||k||^2 x ||v||^2 leverage, 4 sinks kept",
    Provenance(
      paper="CurDKV: Value-Guided KV Compression for LLMs via Approximated CUR Decomposition "
      "(arXiv 2509.15038)",
      code=_KVPRESS.format("CURPress"),
      differs="the random projection (off by default) reads `sketch_LGDK` or draws from `seed`; "
      "sinks score +inf (kvpress: 1.0); options `sinks`, `random_projection`, `local_window` are "
      "kvpress's `num_sinks`, `use_random_leverage`, `local_window_size`",
    ),
    sinks=4,
    leverage_type="kv_product",
    local_window=16,
  ),
  "simlayerkv": _preset(
    SimLayerKV,
    "kvpress SimLayerKVPress: a layer whose last queries put more than lazy_threshold of their "
    "attention on 4 initial + recent keys keeps only those (the budget), the others keep all",
    Provenance(
      paper="Zhang et al., SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction "
      "(arXiv 2410.13846)",
      code=_KVPRESS.format("SimLayerKVPress"),
      differs="the budget stands for kvpress's `n_recent` (a lazy layer keeps `budget` tokens); "
      "`lazy_threshold` also takes a family name (the preset: Llama 3's 0.9; kvpress's default 1.0 "
      "never compresses); laziness reads the prefill's window rows",
    ),
    lazy_threshold="llama3",
  ),
  "finch": _preset(
    Finch,
    "kvpress FinchPress: the question's queries vote for the context keys (question_len tokens "
    "after the context, given per call); the question kept",
    Provenance(
      paper="Corallo & Papotti, FINCH: Prompt-guided Key-Value Cache Compression (TACL 2024, doi "
      "10.1162/tacl_a_00716)",
      code=_KVPRESS.format("FinchPress"),
      differs="the question's length is given per call (`question_len`, traced data), not found "
      "from a delimiter token; kvpress's `chunk_length` mode is not offered; key re-rotation "
      "belongs to the cache layout (`Layout(reindex=True)`)",
    ),
  ),
  "capkv": _preset(
    CapKV,
    "CAPKV (kvpress CapPress): w_i v_i^T A^-1 v_i with A = I + sum (w + eps) v v^T and "
    "w = exp(tau cos(k, the mean future query)); 4 sinks kept",
    Provenance(
      paper="CAPKV (arXiv 2604.25975)",
      code=_KVPRESS.format("CapPress"),
      differs="sinks score +inf (kvpress: the maximum + 1, the same selection); one prompt is "
      "scored (kvpress shifts by the batch's maximum); padding is left out of the capacity matrix",
    ),
    sinks=4,
    tau=5.0,
    epsilon=1e-6,
  ),
  "kvcompose": _preset(
    KVCompose,
    "KVCompose (kvpress KVComposePress): max attention of a second pass over the context, "
    "group mean + mean across heads; structured composite counts per layer",
    Provenance(
      paper="KVCompose: Efficient Structured KV Cache Compression with Composite Tokens (arXiv "
      "2509.05165)",
      code=_KVPRESS.format("KVComposePress"),
      differs="the budget is per head (pooled as L x min(b, T) composite tokens; kvpress: "
      "int(L*T*(1-r))); `agg_task` is always max; the second pass takes one prompt "
      "(`calibrate.kvcompose_evidence`)",
    ),
    allocator=Composite(),
  ),
  "kvcompose_unstructured": _preset(
    KVCompose,
    "KVCompose unstructured: per-head counts pooled over all layers and heads",
    Provenance(
      paper="KVCompose (arXiv 2509.05165), unstructured",
      code=_KVPRESS.format("KVComposePress") + " with `structured=False`",
      differs="the budget is per head (pooled as L x G x min(b, T)); `agg_task` is always max",
    ),
    allocator=Composite(structured=False),
  ),
  "kvgrad": _preset(
    KVgrad,
    "kvpress KVgradPress: input x gradient attribution over KVzip's context reconstruction "
    "(reconstruction attention x ||W_O v|| x ||dPhi/da||, Phi = sum ||h^L||^2), 4 sinks kept, "
    "one pooled selection of L*H*budget across layers and heads (layerwise=True: per layer)",
    Provenance(
      paper="KVgrad (OpenReview cg1wTCJjjk)",
      code=_KVPRESS.format("KVgradPress"),
      differs="the budget is per head (pooled as L x G x min(b, T); kvpress prunes "
      "int(L*G*T*ratio)); sinks score +inf; the gradient is taken through a zero offset on each "
      "layer's attention output (kvpress: retain_grad); the template is given tokenised "
      "(`kvjax.model.kvgrad.kvgrad_evidence`)",
    ),
  ),
  "lukv": _preset(
    LUKV,
    "LU-KV (kvpress LUKVPress): ExpectedAttention under a precomputed per-layer, per-KV-head "
    "budget curve (curve=, [99, L, G]); 4 sinks and the last token kept",
    Provenance(
      paper="Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV "
      "Cache Eviction (LU-KV, arXiv 2602.08585)",
      code=_KVPRESS.format("LUKVPress"),
      differs="the budget curve is given as data (`curve=`), not downloaded, and not computed by "
      "the paper's offline optimisation; kvpress's `sink`/`window` are `sinks`/`recent`",
    ),
  ),
}

# prefix -> (the wrapper class, or ``None`` for ``think_``: the base with key channels pruned;
# its provenance): ``<prefix><base>`` wraps any registered ``<base>``, whose provenance adds its
# own differences. A name matching two prefixes takes the first (``critical_adakv_`` before
# ``critical_``).
WRAPPERS: dict[str, tuple[type[Policy] | None, Provenance]] = {
  "critical_adakv_": (
    w.CriticalAdaKV,
    Provenance(
      paper="Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
      "Perspective (arXiv 2502.03805)",
      code=_KVPRESS.format("CriticalAdaKVPress"),
      differs="the first stage counts from the budget; the window is never dropped",
    ),
  ),
  "critical_": (
    w.Critical,
    Provenance(
      paper="Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
      "Perspective (arXiv 2502.03805)",
      code=_KVPRESS.format("CriticalKVPress"),
      differs="the first stage counts from the budget; the window is never dropped",
    ),
  ),
  "entropy_chunkkv_": (
    EntropyGatedChunkKV,
    Provenance(
      paper="Liu et al., ChunkKV (arXiv 2502.00299), with kvpress's entropy gate",
      code=_KVPRESS.format("EntropyGatedChunkKVPress"),
      differs="the budget is the kept count; ties go to the lower position; a left-padded row's "
      "chunks start at its first real token",
    ),
  ),
  "chunkkv_": (
    w.ChunkKV,
    Provenance(
      paper="Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient "
      "Long-Context LLM Inference (arXiv 2502.00299)",
      code=_KVPRESS.format("ChunkKVPress"),
      differs="exactly the budget (the best whole chunks, then the best tokens of the next); "
      "kvpress rounds to whole chunks",
    ),
  ),
  "chunk_": (
    comb.Chunked,
    Provenance(
      paper="Corallo & Papotti, FINCH (TACL 2024): the context compressed chunk by chunk",
      code=_KVPRESS.format("ChunkPress"),
      differs="exactly the budget in total, spread over chunks by their length (kvpress sums a "
      "rounded-down count per chunk); a base that reads window attention is refused",
    ),
  ),
  "block_": (
    comb.Blockwise,
    Provenance(
      paper="Park et al., KeyDiff (arXiv 2504.15364): block-wise iterative compression",
      code=_KVPRESS.format("BlockPress"),
      differs="the base sees the candidates as a set (kvpress passes them in top-k order); a base "
      "that reads window attention is refused",
    ),
  ),
  "dms_": (
    DMS,
    Provenance(
      paper="Łańcucki et al., Inference-Time Hyper-Scaling with KV Cache Compression (DMS, "
      "arXiv 2506.05345), the dense-prefill version over a given scorer",
      code=_KVPRESS.format("DMSPress"),
      differs="prefill only; positions the base protects are always kept; the kept count is capped "
      "by the budget",
    ),
  ),
  "merging_": (
    Merging,
    Provenance(
      paper="Bolya et al., Token Merging (arXiv 2210.09461); Wan et al., D2O (arXiv 2406.13035)",
      code=_KVPRESS.format("MergingPress"),
      differs="merged in the model's cache at compression (keep_mask and the lab see the kept set "
      "only); padding is neither evicted nor kept; similarity ties go to the lower position",
    ),
  ),
  "cam_": (
    CaM,
    Provenance(
      paper="Zhang et al., CaM: Cache Merging for Memory-efficient LLMs Inference (ICML 2024, "
      "OpenReview LCTmppB165)",
      code=_KVPRESS.format("CAMPress"),
      differs="the Bernoulli draws are jax's, keyed by seed, row and tokens seen; the merge "
      "candidates are the decode_every best evicted slots; score ties go to the lower slot",
    ),
  ),
  "think_": (None, _THINK),
}

# wrapper names :func:`~kvjax.policies.registry.names` lists (and the catalogue describes)
LISTED_WRAPPERS = (
  "critical_snapkv",
  "critical_adakv_snapkv",
  "chunkkv_snapkv",
  "entropy_chunkkv_snapkv_kvpress",
  "chunk_keydiff",
  "block_keydiff",
  "merging_knorm",
  "cam_knorm",
)
