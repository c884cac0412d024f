"""Golden fixtures from NVIDIA kvpress 0.5.5 for kvjax's variant policies.

A standalone script, never run by the test suite (kvjax does not depend on torch). It loads
the tiny Llama of ``tests/fixtures/kvpress_tiny_llama`` and the prompt ``input_ids_T`` of
``tests/fixtures/kvpress_0_5_5.npz``, runs EntropyGatedChunkKVPress, SimLayerKVPress,
FinchPress, DMSPress and LUKVPress on it, and writes ``tests/fixtures/kvpress_0_5_5_variants.npz``:
the inputs every press saw (post-RoPE queries, keys, values; ExpectedAttention's query
statistics), the positions kvpress kept and a ``meta_json`` string.

Run it from the repository root in the kvpress venv (see ``tests/make_kvpress_fixtures.py``)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_variants.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_kvpress_fixtures as base  # noqa: E402

OUT = HERE / "fixtures" / "kvpress_0_5_5_variants.npz"
RATIO = 0.5
SNAP = {"compression_ratio": RATIO, "window_size": 8, "kernel_size": 5}
SIM = {"n_last": 1, "n_recent": 8, "n_initial": 4}
FINCH_QUESTION = 10  # the last 10 prompt tokens follow the delimiter
DMS_WINDOW = 8


def load():
  from transformers import LlamaForCausalLM

  model = LlamaForCausalLM.from_pretrained(base.CKPT_DIR, dtype=torch.float32).eval()
  model.set_attn_implementation("eager")
  ids = np.load(base.OUT)["input_ids_T"]
  return model, torch.from_numpy(ids.astype(np.int64))[None]


def same_inputs(ref, rec, name):
  for layer in range(base.LAYERS):
    for k in ("queries", "keys", "values"):
      assert torch.equal(ref.inputs[layer][k], rec.inputs[layer][k]), (name, layer, k)


def own_inputs(arrays, rec, name):
  """An sdpa run's own inputs (sdpa rounds layer 0's output unlike eager: layer 1 differs)."""
  for k in ("queries", "keys", "values"):
    arrays[f"{name}_{k}_{'LHTD' if k == 'queries' else 'LGTD'}"] = base.stack(rec, k)


def entropy_gated(model, ids, arrays, meta, ref):
  from kvpress import EntropyGatedChunkKVPress, SnapKVPress

  model.set_attn_implementation("sdpa")  # the press refuses eager attentions
  for chunk, low in ((10, 4), (8, 3)):
    press = EntropyGatedChunkKVPress(
      press=SnapKVPress(**SNAP), chunk_length=chunk, low_entropy_chunk_length=low
    )
    rec = base.Recorder(press.press)
    cache = base.run_press(model, ids, press)
    keep = base.kept_from_cache(cache, rec)
    assert (keep == keep[:, :1]).all()
    name = f"entropy_chunkkv{chunk}"
    arrays[f"{name}_keep_LGT"] = keep
    arrays[f"{name}_snapkv_scores_LGT"] = base.scores_arr(rec)
    own_inputs(arrays, rec, name)
    meta[name] = {
      "class": "EntropyGatedChunkKVPress",
      "args": {
        "press": {"class": "SnapKVPress", "args": SNAP},
        "chunk_length": chunk,
        "low_entropy_chunk_length": low,
      },
      "attn_implementation": "sdpa (SnapKV recomputes its window attention)",
      "kept_per_layer": keep[:, 0].sum(-1).tolist(),
      "inputs": f"{name}_queries_LHTD / {name}_keys_LGTD / {name}_values_LGTD",
    }
  model.set_attn_implementation("eager")


def simlayerkv(model, ids, arrays, meta, ref):
  from kvpress import SimLayerKVPress

  # the laziness score of each layer (kvpress SimLayerKVPress.is_lazy), from the recorded rows
  attn = torch.from_numpy(arrays["attn_LHTT"])  # [L, H, T, T]
  T = attn.shape[-1]
  n_last, n_recent, n_initial = SIM["n_last"], SIM["n_recent"], SIM["n_initial"]
  rows = attn[:, :, T - n_last :, : T - n_last].mean((1, 2))
  lazy_scores = (rows[:, :n_initial].sum(-1) + rows[:, -n_recent:].sum(-1)).tolist()
  lo, hi = sorted(lazy_scores)
  thresholds = {"between": (lo + hi) / 2, "none_lazy": min(1.0, hi + 0.01), "all_lazy": lo / 2}
  meta["simlayerkv_lazy_scores_L"] = lazy_scores
  for label, threshold in thresholds.items():
    press = SimLayerKVPress(lazy_threshold=threshold, **SIM)
    cache = base.run_press(model, ids, press)
    keep = base.kept_from_cache(cache, ref)
    arrays[f"simlayerkv_{label}_keep_LGT"] = keep
    meta[f"simlayerkv_{label}"] = {
      "class": "SimLayerKVPress",
      "args": {"lazy_threshold": threshold, **SIM},
      "lazy_L": [bool(s > threshold) for s in lazy_scores],
      "kept_per_layer": keep[:, 0].sum(-1).tolist(),
      "attn_implementation": "eager",
    }


def finch(model, ids, arrays, meta, ref):
  from kvpress import FinchPress

  T = ids.shape[1]
  delimiter = next(i for i in range(base.VOCAB) if i not in ids[0].tolist())
  context = T - FINCH_QUESTION
  with_delim = torch.cat([ids[:, :context], torch.tensor([[delimiter]]), ids[:, context:]], 1)
  for normalize in (True, False):
    press = FinchPress(compression_ratio=RATIO, normalize_scores=normalize, rerotate_keys=False)
    press.delimiter_token_id = delimiter  # set directly: the embedding of the delimiter is dropped
    rec = base.Recorder(press)
    cache = base.run_press(model, with_delim, press)
    assert press.window_size == FINCH_QUESTION
    same_inputs(ref, rec, "finch")
    keep = base.kept_from_cache(cache, rec)
    name = "finch" if normalize else "finch_raw"
    arrays[f"{name}_keep_LGT"] = keep
    arrays[f"{name}_scores_LGT"] = base.scores_arr(rec)
    meta[name] = {
      "class": "FinchPress",
      "args": {"compression_ratio": RATIO, "normalize_scores": normalize, "rerotate_keys": False},
      "delimiter_token_id": delimiter,
      "prompt": f"input_ids_T with the delimiter inserted before position {context}; the model "
      "sees input_ids_T itself (the delimiter's embedding is removed)",
      "window_size": press.window_size,
      "n_kept": int(T * (1 - RATIO)),
      "attn_implementation": "eager",
    }


def dms(model, ids, arrays, meta, ref):
  from kvpress import DMSPress, KnormPress, SnapKVPress

  model.set_attn_implementation("sdpa")
  for name, inner, quantile in (
    ("dms_knorm", KnormPress(), 0.5),
    ("dms_snapkv", SnapKVPress(window_size=8, kernel_size=5), 0.6),
  ):
    rec = base.Recorder(inner)
    probe = DMSPress(press=inner, threshold=-1e30, sliding_window_size=DMS_WINDOW)
    base.run_press(model, ids, probe)  # records the scores, evicts nothing
    base.masked_keep(model)
    s = base.scores_arr(rec)
    T = s.shape[-1]
    threshold = float(np.quantile(s[..., : T - DMS_WINDOW], quantile))
    press = DMSPress(press=inner, threshold=threshold, sliding_window_size=DMS_WINDOW)
    base.run_press(model, ids, press)
    keep = base.masked_keep(model)
    own_inputs(arrays, rec, name)
    arrays[f"{name}_keep_LGT"] = keep
    arrays[f"{name}_scores_LGT"] = s
    meta[name] = {
      "class": "DMSPress",
      "args": {
        "press": type(inner).__name__,
        "threshold": threshold,
        "sliding_window_size": DMS_WINDOW,
      },
      "kept_per_head_LG": keep.sum(-1).tolist(),
      "attn_implementation": "sdpa",
    }
  model.set_attn_implementation("eager")


def lukv(model, ids, arrays, meta, ref):
  from kvpress import ExpectedAttentionPress, KnormPress, LUKVPress

  gen = torch.Generator().manual_seed(base.SEED + 5)
  # a curve shaped as LU-KV's: row i holds prune ratios around (i + 1) / 100 per layer and head
  mid = (torch.arange(1, 100, dtype=torch.float64) / 100)[:, None, None]
  noise = torch.rand((99, base.LAYERS, base.G), generator=gen, dtype=torch.float64) - 0.5
  curve = (mid + 0.4 * noise).clamp(0, 1).numpy()
  arrays["lukv_curve_RLG"] = curve.astype(np.float32)
  model.set_attn_implementation("sdpa")
  for name, inner in (
    ("lukv_knorm", KnormPress()),
    ("lukv_ea", ExpectedAttentionPress(epsilon=2e-2)),
  ):
    stats = {}
    if name == "lukv_ea":
      orig = inner.get_query_statistics

      def get_stats(module, hidden_states, orig=orig, stats=stats):
        mu, cov = orig(module, hidden_states)
        stats[module.layer_idx] = (mu.detach().clone()[0], cov.detach().clone()[0])
        return mu, cov

      inner.get_query_statistics = get_stats
    press = LUKVPress(press=inner, compression_ratio=RATIO, sink=4, window=1)
    press._budget_curves = curve.astype(np.float32)
    rec = base.Recorder(inner)
    base.run_press(model, ids, press)
    keep = base.masked_keep(model)
    own_inputs(arrays, rec, name)
    arrays[f"{name}_keep_LGT"] = keep
    if stats:
      arrays["lukv_ea_query_mean_LHD"] = np.stack([stats[i][0].numpy() for i in range(base.LAYERS)])
      arrays["lukv_ea_query_cov_LHDD"] = np.stack([stats[i][1].numpy() for i in range(base.LAYERS)])
    meta[name] = {
      "class": "LUKVPress",
      "args": {"press": type(inner).__name__, "compression_ratio": RATIO, "sink": 4, "window": 1},
      "curve": "lukv_curve_RLG (injected as _budget_curves)",
      "kept_per_head_LG": keep.sum(-1).tolist(),
      "attn_implementation": "sdpa",
    }
  model.set_attn_implementation("eager")


def main() -> int:
  base._setup_determinism()
  import kvpress
  from kvpress import SnapKVPress

  model, ids = load()
  snap = SnapKVPress(**SNAP)
  ref = base.Recorder(snap)
  base.run_press(model, ids, snap)
  arrays = {
    "queries_LHTD": base.stack(ref, "queries"),
    "keys_LGTD": base.stack(ref, "keys"),
    "values_LGTD": base.stack(ref, "values"),
    "attn_LHTT": base.stack(ref, "attn"),
    "input_ids_T": ids[0].numpy().astype(np.int32),
  }
  meta = {
    "versions": {
      "kvpress": kvpress.__version__
      if hasattr(kvpress, "__version__")
      else base._dist_version("kvpress"),
      "torch": torch.__version__,
    },
    "inputs": "queries_LHTD / keys_LGTD / values_LGTD / attn_LHTT: the eager run's",
  }
  for record in (entropy_gated, simlayerkv, finch, dms, lukv):
    record(model, ids, arrays, meta, ref)
  arrays["meta_json"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
  print(json.dumps(meta, indent=1)[:4000])
  return 0


if __name__ == "__main__":
  sys.exit(main())
