"""Golden KVzip fixtures from NVIDIA kvpress 0.5.5 (PyTorch) for ``tests/test_calibrate.py``.

A standalone script, NOT run by the test suite (kvjax does not depend on torch). It runs
``kvpress.KVzipPress`` on the tiny random Llama checkpoint of ``tests/fixtures/kvpress_tiny_llama``
(made by ``tests/make_kvpress_fixtures.py``) and writes ``tests/fixtures/kvzip_0_5_5.npz``:

* ``context_ids_T``: the context (int32, batch of 1, no BOS).
* per run ``<run>``: ``<run>_scores_LGT`` (kvpress's ``score_val`` [L, 1, G, T] before
  ``compress_post`` overwrites its first ``n_sink`` positions, batch axis dropped) and
  ``<run>_keep_LGT`` (bool: True where ``module.masked_key_indices`` does not mask the pair at
  ``compression_ratio=0.5``), plus the template ids the fake tokenizer gave kvpress
  (``<run>_first_ids``, ``<run>_later_ids``, ``<run>_suffix_ids``, ``<run>_prefix_len``).
* ``meta_json``: versions and each run's arguments.

The tiny checkpoint has no tokenizer, so ``AutoTokenizer.from_pretrained`` is replaced by a fake
one whose ``encode`` maps the exact strings KVzipPress asks for ("\\n\\nRepeat the previous
context exactly.", "\\n\\nRepeat the part of the previous context exactly, starting with", the chat
template's prefix and suffix, or "\\n" without a chat template) to fixed id lists; kvjax's
``kvzip_evidence`` takes the same ids pre-tokenised.

Run from the repository root::

  /tmp/kvp/bin/python tests/make_kvzip_fixtures.py
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
OUT = HERE / "fixtures" / "kvzip_0_5_5.npz"
T = 40
SEED = 7
RATIO = 0.5
QF_ROWS, QF_T, QF_SAMPLES, QF_SEED = 3, 40, 64, 0
OTF_LENGTHS, OTF_Q_LEN = (32, 32, 32), 500  # one length: one compile in the test

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

# (name, chat template?, KVzipPress arguments)
RUNS = (
  ("plain", False, {"chunk_size": 2048}),
  ("chunked", False, {"chunk_size": 16}),
  ("template_chunked", True, {"chunk_size": 12}),
  ("plus_chunked", False, {"chunk_size": 16, "kvzip_plus_normalization": True}),
  ("sink2_template", True, {"chunk_size": 16, "n_sink": 2}),
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


def qfilters_golden(model, arrays, meta) -> None:
  """The official ``make_filters.py`` SVD step in torch on the same model: post-RoPE queries of
  ``QF_ROWS`` rows (captured from each attention module's inputs, as the patched modeling files
  hand them to the cache), kvjax's per-layer sample draw, ``torch.linalg.svd``, the sign rule,
  the group mean."""
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

  rows = np.random.default_rng(SEED + 1).integers(0, model.config.vocab_size, (QF_ROWS, QF_T))
  L, Hq = model.config.num_hidden_layers, model.config.num_attention_heads
  G = model.config.num_key_value_heads
  seen = {i: [] for i in range(L)}

  def hook(module, args, kwargs, output):
    h = kwargs["hidden_states"]
    B, T, _ = h.shape
    q = module.q_proj(h).view(B, T, -1, module.head_dim).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    seen[module.layer_idx].append(q.flatten(0, 1).detach())

  hooks = [
    layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers
  ]
  with torch.no_grad():
    for r in rows:
      model(input_ids=torch.from_numpy(r)[None])
  for h in hooks:
    h.remove()
  rng = np.random.default_rng(QF_SEED)  # kvjax's draw (the official: torch.rand argsort)
  filters, directions = [], []
  for layer in range(L):
    stacked_el = torch.stack(seen[layer], 1).flatten(1, 2)
    total = stacked_el.shape[1]
    idx = torch.from_numpy(np.argsort(rng.random(total))[: min(QF_SAMPLES, total)])
    u, s, vh = torch.linalg.svd(stacked_el[:, idx].float())
    svd_sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1
    svd_filter_q = -svd_sign[:, None] * vh[..., 0, :]
    directions.append(svd_filter_q.numpy())
    filters.append(svd_filter_q.reshape(G, -1, svd_filter_q.shape[-1]).mean(-2).numpy())
  assert len(directions[0]) == Hq
  arrays["qfilters_rows_BT"] = rows.astype(np.int32)
  arrays["qfilters_directions_LHD"] = np.stack(directions).astype(np.float32)
  arrays["qfilters_LGD"] = np.stack(filters).astype(np.float32)
  meta["qfilters"] = {
    "reference": "NathanGodey/qfilters make_filters.py (SVD step verbatim, in torch)",
    "num_svd_samples": QF_SAMPLES,
    "seed": QF_SEED,
    "draw": "numpy default_rng(seed): argsort(rng.random(B*T))[:n] per layer, as kvjax",
  }


def duo_on_the_fly_golden(model, arrays, meta) -> None:
  """kvpress's ``duo_attention_on_the_fly`` on ``OTF_LENGTHS`` random texts: ``load_dataset``
  and the tokenizer are replaced so that its BookSum "chapters" are these id rows."""
  from kvpress.presses import duo_attention_press as duo

  rng = np.random.default_rng(SEED + 2)
  texts = {
    f"text{i}": rng.integers(0, model.config.vocab_size, n) for i, n in enumerate(OTF_LENGTHS)
  }

  class Data:
    def to_pandas(self):
      import pandas as pd

      return pd.DataFrame({"chapter": list(texts)})

  class Encoding(dict):
    def to(self, device):
      return self

  class Tok:
    def __call__(self, text, return_tensors=None):
      ids = torch.from_numpy(texts[text])[None]
      return Encoding(input_ids=ids, attention_mask=torch.ones_like(ids))

  orig = duo.load_dataset, duo.AutoTokenizer
  duo.load_dataset = lambda *a, **k: Data()
  duo.AutoTokenizer = type("Auto", (), {"from_pretrained": staticmethod(lambda _: Tok())})
  try:
    scores = duo.duo_attention_on_the_fly.__wrapped__(model, len(texts), OTF_Q_LEN)
  finally:
    duo.load_dataset, duo.AutoTokenizer = orig
  for i, ids in enumerate(texts.values()):
    arrays[f"duo_otf_text{i}"] = ids.astype(np.int32)
  arrays["duo_otf_scores_LG"] = np.asarray(scores, np.float32)
  meta["duo_on_the_fly"] = {
    "reference": "kvpress 0.5.5 duo_attention_on_the_fly (datasets and tokenizer replaced)",
    "num_samples": len(texts),
    "q_len": OTF_Q_LEN,
    "texts": [f"duo_otf_text{i}" for i in range(len(texts))],
  }


def main() -> int:
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(SEED)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import kvpress
  import transformers
  from kvpress import KVzipPress
  from kvpress.presses import kvzip_press
  from transformers import DynamicCache, LlamaForCausalLM

  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("sdpa")  # compress_post refuses eager
  L = model.config.num_hidden_layers
  G = model.config.num_key_value_heads
  rng = np.random.default_rng(SEED)
  context = rng.integers(30, model.config.vocab_size, T).astype(np.int64)
  input_ids = torch.from_numpy(context)[None]

  arrays: dict[str, np.ndarray] = {"context_ids_T": context.astype(np.int32)}
  meta = {
    "generator": "tests/make_kvzip_fixtures.py",
    "versions": {
      "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama",
    "compression_ratio": RATIO,
    "runs": {},
  }
  original = kvzip_press.AutoTokenizer
  for name, chat, kw in RUNS:
    tok = FakeTokenizer(chat)
    kvzip_press.AutoTokenizer = type(
      "Auto", (), {"from_pretrained": staticmethod(lambda _, t=tok: t)}
    )
    press = KVzipPress(compression_ratio=RATIO, **kw)
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
    arrays[f"{name}_scores_LGT"] = scores.astype(np.float32)
    arrays[f"{name}_keep_LGT"] = keep
    arrays[f"{name}_first_ids"] = np.asarray(IDS[FIRST], np.int32)
    arrays[f"{name}_later_ids"] = np.asarray(IDS[LATER], np.int32)
    arrays[f"{name}_suffix_ids"] = seen["suffix"][0].numpy().astype(np.int32)
    arrays[f"{name}_prefix_len"] = np.asarray(seen["prefix_length"], np.int32)
    meta["runs"][name] = {"chat_template": chat, "args": {"compression_ratio": RATIO, **kw}}
    print(name, "prefix", seen["prefix_length"], "kept", keep.sum(), "of", keep.size)

  qfilters_golden(model, arrays, meta)
  duo_on_the_fly_golden(model, arrays, meta)
  arrays["meta_json"] = np.asarray(json.dumps(meta, indent=1))
  np.savez_compressed(OUT, **arrays)
  print("wrote", OUT, OUT.stat().st_size, "bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
