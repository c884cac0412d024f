"""Where each registered method comes from: its paper, the reference code kvjax follows, and the
differences from that code that kvjax names. The documentation's methods catalogue is generated
from this and the registry, so a registered name without an entry is visible there.

A user's policy class states its own with the class attributes ``paper``, ``code`` and
``differs`` (strings); :func:`provenance` reads them.
"""

from __future__ import annotations

from kvjax.policies import registry

_KVPRESS = "kvpress 0.5.5 `{}`"
_SAME = "none: kept sets equal the reference's in the golden tests"
_COMPACTOR = (
  "Chari & Van Durme, Compactor: Calibrated Query-Agnostic KV Cache Compression with "
  "Approximate Leverage Scores (arXiv 2507.08143)"
)

# name -> (paper, reference code followed, named differences)
_BUILTIN: dict[str, tuple[str, str, str]] = {
  "full": ("", "", ""),
  "sliding_window": ("", "", ""),
  "streaming_llm": (
    "Xiao et al., Efficient Streaming Language Models with Attention Sinks (arXiv 2309.17453)",
    "mit-han-lab/streaming-llm `streaming_llm/kv_cache.py::StartRecentKVCache`; "
    + _KVPRESS.format("StreamingLLMPress"),
    "positions are not re-rotated after eviction (keys keep their original RoPE positions)",
  ),
  "h2o": (
    "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large "
    "Language Models (arXiv 2306.14048)",
    "FMInference/H2O `h2o_hf/utils_real_drop/modify_llama.py` (causal column sums, evicting "
    "while decoding)",
    "`recent=8` by default, as KVCache-Factory's H2O; the official code keeps half the budget "
    "recent (`recent=None`)",
  ),
  "h2o_kvfactory_legacy": (
    "Zhang et al., H2O (arXiv 2306.14048), as KVCache-Factory publishes it",
    "Zefan-Cai/KVCache-Factory `pyramidkv/pyramidkv_utils.py::H2OKVCluster`",
    "none: the non-causal prefill column sums of that code, kept as published",
  ),
  "h2o_kvpress": (
    "Zhang et al., H2O (arXiv 2306.14048), as kvpress runs it",
    _KVPRESS.format("ObservedAttentionPress"),
    _SAME,
  ),
  "tova": (
    "Oren et al., Transformers are Multi-State RNNs (arXiv 2401.06104)",
    "schwartz-lab-NLP/TOVA `src/tova_cache.py::TOVACache.reduce`; " + _KVPRESS.format("TOVAPress"),
    _SAME,
  ),
  "snapkv": (
    "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation (arXiv 2404.14469)",
    "FasterDecoding/SnapKV `snapkv/monkeypatch/snapkv_utils.py::SnapKVCluster.update_kv`",
    "kept positions in ascending order (upstream keeps top-k order; attention is unaffected); "
    "scores stay float32 (upstream casts the softmax to fp16/bf16 before summing)",
  ),
  "snapkv_kvpress": (
    "Li et al., SnapKV (arXiv 2404.14469), as kvpress runs it",
    _KVPRESS.format("SnapKVPress"),
    _SAME,
  ),
  "pyramidkv": (
    "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information "
    "Funneling (arXiv 2406.02069)",
    "Zefan-Cai/KVCache-Factory `pyramidkv/pyramidkv_utils.py::PyramidKVCluster.update_kv`",
    "as SnapKV's; layer budgets equal the reference's arithmetic on a 648-row grid",
  ),
  "adakv_snapkv": (
    "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation "
    "(arXiv 2407.11550)",
    "FFY0/AdaKV `adaptive_snapkv/monkeypatch/snapkv_utils.py::AdaptiveSnapKVCluster`",
    "as SnapKV's",
  ),
  "adakv_pyramidkv": (
    "Feng et al., Ada-KV (arXiv 2407.11550), within PyramidKV's schedule",
    "FFY0/AdaKV `adaptive_snapkv` with `pyram_mode=True`",
    "as SnapKV's",
  ),
  "headkv": (
    "Fu et al., Not All Heads Matter: A Head-Level KV Cache Compression Method with Integrated "
    "Retrieval and Reasoning (arXiv 2410.19258)",
    "FYYFU/HeadKV `headkv/snapkv_utils.py::ReasonSnapKVCluster`",
    "head scores are data (`evidence['head_scores_LH']`); kvjax ships none for a given model",
  ),
  "cake": (
    "Qin et al., CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences "
    "(arXiv 2503.12491)",
    "antgroup/cakekv `cake/cake_cache.py::CakeprefillKVCache`, `adjust_budgets`",
    "budgets are allocated once after the prompt from every layer's preference (the reference "
    "cascades them layer by layer during the prefill; the final budgets are the same)",
  ),
  "knorm": (
    "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression "
    "(arXiv 2406.11430)",
    _KVPRESS.format("KnormPress"),
    _SAME,
  ),
  "random": ("", _KVPRESS.format("RandomPress"), "its own random generator (jax.random)"),
  "oracle": (
    "",
    "",
    "an upper bound, not a method: it reads the future attention that no realisable policy has",
  ),
  "keydiff": (
    "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM "
    "Inference (arXiv 2504.15364)",
    _KVPRESS.format("KeyDiffPress"),
    _SAME,
  ),
  "lagkv": (
    "Liang et al., LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are "
    "Important (arXiv 2504.04704)",
    _KVPRESS.format("LagKVPress"),
    "a channel constant over its reference chunk scores 0 (kvpress: NaN)",
  ),
  "expected_attention": (
    "Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from "
    "Future Queries Distribution (arXiv 2510.00636)",
    _KVPRESS.format("ExpectedAttentionPress"),
    "the averaged RoPE matrix is computed in float32",
  ),
  "kvzap": (
    "KVzap (arXiv 2601.07891)",
    _KVPRESS.format("KVzapPress") + " and its training code `kvzap/train.py`, `kvzap/data.py`",
    "the surrogate is trained on shipped prose (kvpress downloads nvidia/KVzap-* trained on "
    "Nemotron samples) and loaded by path; fp32; the repeat prompt is tokenised in pieces; "
    "prefill only (kvpress's DMSPress(decoding=True) also scores generated tokens)",
  ),
  "fastkvzip": (
    "Kim, Han and Yun, Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction "
    "(arXiv 2601.17668)",
    _KVPRESS.format("FastKVzipPress")
    + " and the official training code Janghyun1230/FastKVzip `optim.py`",
    "the gates are trained on shipped prose (kvpress downloads Jang-Hyun/Fast-KVzip) and "
    "loaded by path; training adds the gate bias once, as every inference path (optim.py adds it "
    "twice); KVzip targets are kvpress's (2048-token chunks, 4 sinks); fp32; the budget is per "
    "head (pooled as L x G x min(b, T)); prefill only, one dense forward (no chunked prefill)",
  ),
  "restorekv": (
    "RestoreKV: learned restoration on top of KVzip (arXiv 2608.01247)",
    _KVPRESS.format("RestoreKVPress") + " on `KVzipPress`",
    "the adapter (restore embeddings and LoRA on q/k/v/o) is trained here by self-distillation "
    "on shipped prose and loaded by path (kvpress downloads higokri/RestoreKV-*, whose training "
    "recipe it does not include); the budget counts the restore slots (int(T(1-r)) - N context "
    "pairs per head on average; kvpress prunes int(L H T (r + N/T)), equal up to rounding); "
    "restore tokens outrank the sinks; fp32",
  ),
  "expected_attention_stats": (
    "Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from "
    "Future Queries Distribution (arXiv 2510.00636)",
    _KVPRESS.format("ExpectedAttentionStatsPress"),
    "statistics measured on Python's pydoc topics in equal-length rows (kvpress: kmfoda/booksum "
    "chapters cut to 1,000 characters, from the hub); no re-compression while decoding",
  ),
  "qfilter": (
    "Godey et al., Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression "
    "(arXiv 2503.02812)",
    _KVPRESS.format("QFilterPress") + "; the filters as the official `make_filters.py` makes them",
    "float32 and numpy's generator for the calibration samples",
  ),
  "duo_attention": (
    "Xiao et al., DuoAttention: Efficient Long-Context LLM Inference with Retrieval and "
    "Streaming Heads (arXiv 2410.10819)",
    _KVPRESS.format("DuoAttentionPress") + "; the gates by mit-han-lab/duo-attention's "
    "distillation (`duo_attn/train.py`)",
    "`head_compression_ratio=0.5` by default (kvpress's 0.0 streams no head); short prompts "
    "shrink sink 128 + recent 256",
  ),
  "kvzip": (
    "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
    "(arXiv 2505.23416)",
    _KVPRESS.format("KVzipPress"),
    "the reconstruction attention is computed in batches of rows; contexts over 4k tokens "
    "through the chunked prefill",
  ),
  "think": (
    "Xu et al., ThinK: Thinner Key Cache by Query-Driven Pruning (arXiv 2407.21018)",
    _KVPRESS.format("ThinKPress"),
    "a real memory saving: pruned key channels are not stored (kvpress zeroes them)",
  ),
  "leverage": (
    _COMPACTOR,
    _KVPRESS.format("LeverageScorePress"),
    "the Gaussian sketch comes from `evidence.sketch_LGDK` or `seed` (kvpress draws a fresh "
    "`torch.randn` per call); when every Cholesky jitter fails the layer's scores may be NaN "
    "where kvpress raises; z-scores per prompt (kvpress: over the batch)",
  ),
  "noncausal_attn": (
    _COMPACTOR,
    _KVPRESS.format("NonCausalAttnPress"),
    "z-scores per prompt (kvpress: over the batch); a left-padded row is scored as its unpadded "
    "prompt",
  ),
  "compactor": (
    _COMPACTOR,
    _KVPRESS.format("CompactorPress"),
    "`blending` is a number (default 0.5) since kvjax scores do not depend on the budget "
    "(kvpress's `None` means the compression ratio); protected positions score +inf (kvpress: "
    "the layer's maximum); `sinks`/`recent` are kvpress's `sink_size_start`/`sink_size_end`",
  ),
  "curkv": (
    "CurDKV: Value-Guided KV Compression for LLMs via Approximated CUR "
    "Decomposition (arXiv 2509.15038)",
    _KVPRESS.format("CURPress"),
    "the random projection (off by default) reads `sketch_LGDK` or draws from `seed`; sinks "
    "score +inf (kvpress: 1.0); options `sinks`, `random_projection`, `local_window` are "
    "kvpress's `num_sinks`, `use_random_leverage`, `local_window_size`",
  ),
  "capkv": (
    "CAPKV (arXiv 2604.25975)",
    _KVPRESS.format("CapPress"),
    "sinks score +inf (kvpress: the maximum + 1, the same selection); one prompt is scored "
    "(kvpress shifts by the batch's maximum); padding is left out of the capacity matrix",
  ),
  "kvcompose": (
    "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens (arXiv 2509.05165)",
    _KVPRESS.format("KVComposePress"),
    "the budget is per head (pooled as L x min(b, T) composite tokens; kvpress: int(L*T*(1-r))); "
    "`agg_task` is always max; the second pass takes one prompt "
    "(`calibrate.kvcompose_evidence`)",
  ),
  "kvcompose_unstructured": (
    "KVCompose (arXiv 2509.05165), unstructured",
    _KVPRESS.format("KVComposePress") + " with `structured=False`",
    "the budget is per head (pooled as L x G x min(b, T)); `agg_task` is always max",
  ),
  "simlayerkv": (
    "Zhang et al., SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction "
    "(arXiv 2410.13846)",
    _KVPRESS.format("SimLayerKVPress"),
    "the budget stands for kvpress's `n_recent` (a lazy layer keeps `budget` tokens); "
    "`lazy_threshold` also takes a family name (the preset: Llama 3's 0.9; kvpress's default "
    "1.0 never compresses); laziness reads the prefill's window rows",
  ),
  "finch": (
    "Corallo & Papotti, FINCH: Prompt-guided Key-Value Cache Compression (TACL 2024, "
    "doi 10.1162/tacl_a_00716)",
    _KVPRESS.format("FinchPress"),
    "the question's length is given per call (`question_len`, traced data), not found from a "
    "delimiter token; kvpress's `chunk_length` mode is not offered; key re-rotation belongs to "
    "the cache layout (`Layout(reindex=True)`)",
  ),
  "kvgrad": (
    "KVgrad (OpenReview cg1wTCJjjk)",
    _KVPRESS.format("KVgradPress"),
    "the budget is per head (pooled as L x G x min(b, T); kvpress prunes int(L*G*T*ratio)); "
    "sinks score +inf; the gradient is taken through a zero offset on each layer's attention "
    "output (kvpress: retain_grad); the template is given tokenised "
    "(`kvjax.model.kvgrad.kvgrad_evidence`)",
  ),
  "lukv": (
    "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache "
    "Eviction (LU-KV, arXiv 2602.08585)",
    _KVPRESS.format("LUKVPress"),
    "the budget curve is given as data (`curve=`), not downloaded, and not computed by the "
    "paper's offline optimisation; kvpress's `sink`/`window` are `sinks`/`recent`",
  ),
  "rkv": (
    "Cai et al., R-KV: Redundancy-aware KV Cache Compression for Reasoning Models "
    "(arXiv 2505.24133)",
    "Zefan-Cai/R-KV (the official code; kvpress has no press)",
    "none known: checked against a transcription of the official code",
  ),
}

# Wrapper prefixes (``critical_<base>`` ...): their paper and code; the base adds its own.
_WRAPPERS: dict[str, tuple[str, str, str]] = {
  "critical_adakv_": (
    "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
    "Perspective (arXiv 2502.03805)",
    _KVPRESS.format("CriticalAdaKVPress"),
    "the first stage counts from the budget; the window is never dropped",
  ),
  "critical_": (
    "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
    "Perspective (arXiv 2502.03805)",
    _KVPRESS.format("CriticalKVPress"),
    "the first stage counts from the budget; the window is never dropped",
  ),
  "entropy_chunkkv_": (
    "Liu et al., ChunkKV (arXiv 2502.00299), with kvpress's entropy gate",
    _KVPRESS.format("EntropyGatedChunkKVPress"),
    "the budget is the kept count; ties go to the lower position; a left-padded row's chunks "
    "start at its first real token",
  ),
  "chunk_": (
    "Corallo & Papotti, FINCH (TACL 2024): the context compressed chunk by chunk",
    _KVPRESS.format("ChunkPress"),
    "exactly the budget in total, spread over chunks by their length (kvpress sums a "
    "rounded-down count per chunk); a base that reads window attention is refused",
  ),
  "block_": (
    "Park et al., KeyDiff (arXiv 2504.15364): block-wise iterative compression",
    _KVPRESS.format("BlockPress"),
    "the base sees the candidates as a set (kvpress passes them in top-k order); a base that "
    "reads window attention is refused",
  ),
  "dms_": (
    "Łańcucki et al., Inference-Time Hyper-Scaling with KV Cache Compression (DMS, arXiv "
    "2506.05345), the dense-prefill version over a given scorer",
    _KVPRESS.format("DMSPress"),
    "prefill only; positions the base protects are always kept; the kept count is capped by "
    "the budget",
  ),
  "merging_": (
    "Bolya et al., Token Merging (arXiv 2210.09461); Wan et al., D2O (arXiv 2406.13035)",
    _KVPRESS.format("MergingPress"),
    "merged in the model's cache at compression (keep_mask and the lab see the kept set only); "
    "padding is neither evicted nor kept; similarity ties go to the lower position",
  ),
  "cam_": (
    "Zhang et al., CaM: Cache Merging for Memory-efficient LLMs Inference (ICML 2024, "
    "OpenReview LCTmppB165)",
    _KVPRESS.format("CAMPress"),
    "the Bernoulli draws are jax's, keyed by seed, row and tokens seen; the merge candidates "
    "are the decode_every best evicted slots; score ties go to the lower slot",
  ),
  "chunkkv_": (
    "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context "
    "LLM Inference (arXiv 2502.00299)",
    _KVPRESS.format("ChunkKVPress"),
    "exactly the budget (the best whole chunks, then the best tokens of the next); kvpress "
    "rounds to whole chunks",
  ),
  "think_": _BUILTIN["think"],
}


def provenance(name: str) -> dict[str, str]:
  """The paper, the reference code followed and the named differences of policy ``name``.

  Args:
    name: a registered policy name (or a wrapper of one, e.g. ``critical_snapkv``).

  Returns:
    A dict with ``paper``, ``code`` and ``differs`` (empty strings where there is none: a
    baseline, or a user's policy that does not say).

  Raises:
    ValueError: ``name`` is not registered.
  """
  factory = registry.factory(name)  # raises for an unknown name
  if name in _BUILTIN and factory is registry.BUILTIN.get(name):
    paper, code, differs = _BUILTIN[name]
    return dict(paper=paper, code=code, differs=differs)
  for prefix, (paper, code, differs) in _WRAPPERS.items():
    base = name.removeprefix(prefix)
    if base != name and registry.is_registered(base):
      own = provenance(base)
      return dict(
        paper=paper, code=code, differs=f"{differs}; the base `{base}`: {own['differs'] or '—'}"
      )
  cls = getattr(factory, "cls", factory)
  return {key: str(getattr(cls, key, "") or "") for key in ("paper", "code", "differs")}
