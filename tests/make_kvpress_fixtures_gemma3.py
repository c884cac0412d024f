"""Golden kept sets of kvpress 0.5.5 on a tiny random Gemma 3 (its global layers compressed, its
sliding layers left alone).

A standalone script (not run by the suite; kvjax does not depend on torch), in the kvpress venv::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_gemma3.py

It writes a seeded tiny ``Gemma3ForCausalLM`` (5 layers, sliding, global, sliding, global,
sliding; window 8; ``query_pre_attn_scalar`` equal to the head dim, as the released Gemma 3
checkpoints up to 12B have it, since kvpress's window attention scales by ``sqrt(head_dim)``)
to ``tests/fixtures/kvpress_tiny_gemma3`` and records ``tests/fixtures/kvpress_0_5_5_gemma3.npz``:
the prompt ``input_ids_T`` and, for ``SnapKVPress(0.5, window_size=4)`` and ``KnormPress(0.5)``,
``<name>_keep_LGT`` on the global layers (recovered from the compressed cache against a plain
prefill's keys) and ``<name>_sliding_len_L``, each sliding layer's cached length, which equals the
plain prefill's (nothing compressed there).

kvpress skips sliding layers for ``Gemma3ForConditionalGeneration`` only
(``presses/base_press.py``); this script applies that rule to the text model by pointing the
check at ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from kvpress import KnormPress, SnapKVPress
from kvpress.presses import base_press
from transformers import DynamicCache

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_gemma3"
OUT = HERE / "fixtures" / "kvpress_0_5_5_gemma3.npz"
TYPES = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
T = 48


def tiny_gemma3():
  torch.manual_seed(0)
  cfg = transformers.Gemma3TextConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=len(TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    layer_types=TYPES,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
  )
  hf = transformers.Gemma3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.2)
  return hf


def keys_of(hf, ids, press=None):
  cache = DynamicCache(config=hf.config)
  with torch.no_grad():
    if press is None:
      hf(ids, past_key_values=cache, use_cache=True)
    else:
      with press(hf):
        hf(ids, past_key_values=cache, use_cache=True)
  return [layer.keys[0].clone() for layer in cache.layers]


def main():
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  hf = tiny_gemma3()
  hf.save_pretrained(CKPT)
  hf = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  hf.set_attn_implementation("eager")
  ids_np = np.random.default_rng(2).integers(3, 128, (1, T))
  ids = torch.tensor(ids_np)
  plain = keys_of(hf, ids)
  base_press.Gemma3ForConditionalGeneration = transformers.Gemma3ForCausalLM  # skip sliding
  out = dict(input_ids_T=ids_np[0].astype(np.int32))
  glob = [i for i, t in enumerate(TYPES) if t == "full_attention"]
  for name, press in [("snapkv", SnapKVPress(0.5, window_size=4)), ("knorm", KnormPress(0.5))]:
    comp = keys_of(hf, ids, press)
    G = plain[0].shape[0]
    keep = np.zeros((len(TYPES), G, T), bool)
    for layer in glob:
      for g in range(G):
        d = torch.cdist(comp[layer][g].double(), plain[layer][g].double())
        best = d.min(-1)
        assert float(best.values.max()) < 1e-6
        keep[layer, g, best.indices.numpy()] = True
    out[f"{name}_keep_LGT"] = keep
    out[f"{name}_sliding_len_L"] = np.array(
      [comp[i].shape[1] if i not in glob else -1 for i in range(len(TYPES))], np.int32
    )
    out["plain_len_L"] = np.array([k.shape[1] for k in plain], np.int32)
  np.savez_compressed(OUT, **out)
  print("wrote", OUT, {k: v.shape for k, v in out.items()}, out["plain_len_L"])


if __name__ == "__main__":
  main()
