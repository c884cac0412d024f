"""Generate golden fixtures for kvpress 0.5.5's ``KVgradPress`` (kvjax ``KVgrad``).

A standalone script, NOT run by the test suite (kvjax never imports torch). It runs
``KVgradPress`` on the tiny random Llama checkpoint ``tests/fixtures/kvpress_tiny_llama`` (sdpa
attention: ``compress_post`` refuses eager) with the prompt ``input_ids_T`` of
``tests/fixtures/kvpress_0_5_5.npz`` and writes ``tests/fixtures/kvpress_0_5_5_kvgrad.npz``.
Run it from the repository root in the kvpress venv (torch 2.13.0+cpu, transformers 5.2.0,
kvpress 0.5.5)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_kvgrad.py

The tiny checkpoint has no tokenizer, so ``AutoTokenizer.from_pretrained`` is replaced by a fake
one (as ``tests/make_kvzip_fixtures.py`` does) whose ``encode`` maps the exact strings
``KVzipPress`` asks for to fixed id lists; kvjax's ``kvgrad_evidence`` takes the same ids
pre-tokenised.

What it records per run ``<run>`` (L layers, G kv heads, T tokens):

* ``<run>_kvgrad_LGT``: ``score_val`` ``[L, 1, G, T]`` (batch axis dropped) as ``compress_post``
  receives it, before it overwrites the first ``n_sink`` positions;
* ``<run>_keep_LGT``: True where ``module.masked_key_indices`` does not mask the pair at
  ``compression_ratio`` 0.5;
* ``<run>_first_ids``, ``<run>_later_ids``, ``<run>_suffix_ids``, ``<run>_prefix_len``: the
  reconstruction template the fake tokenizer gave kvpress;
* ``meta_json``: versions, each run's arguments, and the smallest gap between a kept and a
  pruned score (pooled over every layer and head; per layer with ``layerwise``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
PROMPT = HERE / "fixtures" / "kvpress_0_5_5.npz"
OUT = HERE / "fixtures" / "kvpress_0_5_5_kvgrad.npz"
RATIO = 0.5

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
IDS = {
  FIRST: [5, 6, 7, 8, 9, 10],
  LATER: [11, 12, 13, 14, 15, 16, 17],
  "\n": [3],
  "PREFIX": [20, 21, 22, 23, 24],
  "SUFFIX": [25, 26, 27],
  "": [],
}

# (name, chat template?, KVgradPress arguments besides compression_ratio)
RUNS = (
  ("kvgrad", False, {}),
  ("kvgrad_chunk16", False, {"chunk_size": 16}),
  ("kvgrad_template_chunk12", True, {"chunk_size": 12}),
  ("kvgrad_sink2_template_chunk16", True, {"chunk_size": 16, "n_sink": 2}),
  ("kvgrad_layerwise", False, {"layerwise": True}),
)


class FakeTokenizer:
  """What KVzipPress reads from a tokenizer: ``chat_template``, ``apply_chat_template``,
  ``encode(text, return_tensors="pt", add_special_tokens=False)``."""

  def __init__(self, chat: bool):
    self.chat_template = "fake" if chat else None

  def apply_chat_template(self, messages, **kwargs):
    return "PREFIX" + messages[0]["content"] + "SUFFIX"

  def encode(self, text, return_tensors=None, add_special_tokens=False):
    assert not add_special_tokens and return_tensors == "pt", (text, return_tensors)
    return torch.tensor([IDS[text]], dtype=torch.long).reshape(1, -1)


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(0)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import transformers
  from kvpress.presses import kvzip_press
  from kvpress.presses.kvgrad_press import KVgradPress
  from transformers import DynamicCache, LlamaForCausalLM

  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("sdpa")  # compress_post refuses eager
  ids = np.load(PROMPT)["input_ids_T"]
  input_ids = torch.from_numpy(ids.astype(np.int64))[None]
  cfg = model.config
  L, G, T = cfg.num_hidden_layers, cfg.num_key_value_heads, input_ids.shape[1]
  arrays: dict[str, np.ndarray] = {"input_ids_T": ids.astype(np.int32)}
  meta = {
    "generator": "tests/make_kvpress_fixtures_kvgrad.py",
    "versions": {
      "kvpress": "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (sdpa attention)",
    "prompt": "input_ids_T (from tests/fixtures/kvpress_0_5_5.npz)",
    "compression_ratio": RATIO,
    "runs": {},
  }
  original = kvzip_press.AutoTokenizer
  for name, chat, kw in RUNS:
    tok = FakeTokenizer(chat)
    kvzip_press.AutoTokenizer = type(
      "Auto", (), {"from_pretrained": staticmethod(lambda _, t=tok: t)}
    )
    press = KVgradPress(compression_ratio=RATIO, **kw)
    seen = {}
    compress_post = press.compress_post

    def record(model, _press=press, _seen=seen, _orig=compress_post):
      _seen["scores"] = _press.score_val.detach().clone()
      _seen["prefix_length"] = _press.prefix_length
      _seen["suffix"] = _press._suffix_ids.clone()
      return _orig(model)

    press.compress_post = record
    cache = DynamicCache(config=model.config)
    try:
      with torch.no_grad(), press(model):
        model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    finally:
      kvzip_press.AutoTokenizer = original
    keep = np.ones((L, G, T), dtype=bool)
    for layer in range(L):
      attn = model.model.layers[layer].self_attn
      b, h, s = attn.masked_key_indices
      assert (b == 0).all()
      keep[layer, h.numpy(), s.numpy()] = False
      attn.masked_key_indices = None
      assert cache.layers[layer].keys.shape[2] == T
    scores = seen["scores"][:, 0].float().numpy()
    n_sink = press.n_sink
    protected = scores.copy()
    protected[..., :n_sink] = scores.max() + 1.0
    groups = [(protected[i], keep[i]) for i in range(L)] if press.layerwise else [(protected, keep)]
    margin = min(float(s[k].min() - s[~k].max()) for s, k in groups)
    arrays[f"{name}_kvgrad_LGT"] = scores.astype(np.float32)
    arrays[f"{name}_keep_LGT"] = keep
    arrays[f"{name}_first_ids"] = np.asarray(IDS[FIRST], np.int32)
    arrays[f"{name}_later_ids"] = np.asarray(IDS[LATER], np.int32)
    arrays[f"{name}_suffix_ids"] = seen["suffix"][0].numpy().astype(np.int32)
    arrays[f"{name}_prefix_len"] = np.asarray(seen["prefix_length"], np.int32)
    meta["runs"][name] = {
      "class": "KVgradPress",
      "chat_template": chat,
      "args": {"compression_ratio": RATIO, **kw},
      "chunk_size": press.chunk_size,
      "n_sink": n_sink,
      "layerwise": press.layerwise,
      "min_pooled_margin": margin,
    }
    print(name, "prefix", seen["prefix_length"], "kept", keep.sum(), "of", keep.size, margin)
  arrays["meta_json"] = np.asarray(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print("wrote", OUT, OUT.stat().st_size, "bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
