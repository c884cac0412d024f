"""Golden kept sets of kvpress 0.5.5's decoding presses on the tiny fixture Llama.

A standalone script (not run by the suite; kvjax does not depend on torch), in the venv of
``tests/make_kvpress_fixtures.py``::

  /work/kvpress-venv/bin/python tests/make_kvpress_fixtures_decoding.py

On ``tests/fixtures/kvpress_tiny_llama`` with a seeded prompt of ``T`` tokens and ``S`` fed
tokens (teacher-forced, one forward each, explicit positions), it runs

* ``PrefillDecodingPress(None, DecodingPress(KnormPress(), compression_interval=N,
  target_size=TARGET))`` and
* ``CompressionRatioDecodingPress(KnormPress(), target_compression_ratio=RATIO,
  compression_interval=N)``

and records, per layer and KV head, which positions the cache holds after the ``S`` fed tokens
(recovered by matching each cached key against the uncompressed run's keys):
``tests/fixtures/kvpress_0_5_5_decoding.npz`` (``input_ids_T``, ``fed_S``, ``<name>_kept_LGP``
over the ``T + S`` positions, and the constants).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from kvpress import CompressionRatioDecodingPress, DecodingPress, KnormPress, PrefillDecodingPress
from transformers import AutoModelForCausalLM, DynamicCache

HERE = Path(__file__).parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
OUT = HERE / "fixtures" / "kvpress_0_5_5_decoding.npz"
T, S, N, TARGET, RATIO = 24, 12, 5, 10, 0.5


def run(model, ids, fed, press):
  """Prompt then fed tokens under ``press``; returns each layer's cached keys ``[G, n, D]`` and
  every key the layer appended in this run ``[G, T + S, D]`` (recorded by a hook that runs before
  the press's, so before any compression)."""
  cache = DynamicCache()
  seen = {}

  def record(module, args, kwargs, output):
    layer = module.layer_idx
    q_len = kwargs["hidden_states"].shape[1]
    new = cache.layers[layer].keys[0, :, -q_len:].clone()
    seen[layer] = new if layer not in seen else torch.cat([seen[layer], new], 1)

  attns = [layer.self_attn for layer in model.model.layers]
  hooks = [m.register_forward_hook(record, with_kwargs=True) for m in attns]
  try:
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
      pos = torch.arange(T)[None]
      model(input_ids=ids, past_key_values=cache, position_ids=pos, cache_position=pos[0])
      for i, tok in enumerate(fed):
        p = torch.tensor([[T + i]])
        model(
          input_ids=torch.tensor([[tok]]),
          past_key_values=cache,
          position_ids=p,
          cache_position=p[0],
        )
  finally:
    for h in hooks:
      h.remove()
  n = len(cache.layers)
  return [cache.layers[layer].keys[0].clone() for layer in range(n)], [seen[i] for i in range(n)]


def kept(run_out):
  keys_press, keys_all = run_out
  L, (G, P, _) = len(keys_all), keys_all[0].shape
  out = np.zeros((L, G, P), bool)
  for layer in range(L):
    for g in range(G):
      d = torch.cdist(keys_press[layer][g].double(), keys_all[layer][g].double())
      idx = d.argmin(-1)
      assert (d.min(-1).values < 1e-6).all() and len(set(idx.tolist())) == len(idx)
      out[layer, g, idx.numpy()] = True
  return out


def main():
  torch.manual_seed(0)
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32)
  model.eval()
  rng = np.random.default_rng(7)
  vocab = model.config.vocab_size
  ids = rng.integers(5, vocab, (1, T))
  fed = rng.integers(5, vocab, S)
  pd = PrefillDecodingPress(
    prefilling_press=None,
    decoding_press=DecodingPress(
      base_press=KnormPress(), compression_interval=N, target_size=TARGET
    ),
  )
  ratio = CompressionRatioDecodingPress(
    base_press=KnormPress(), target_compression_ratio=RATIO, compression_interval=N
  )
  np.savez_compressed(
    OUT,
    input_ids_T=ids[0].astype(np.int32),
    fed_S=fed.astype(np.int32),
    constants=np.asarray([T, S, N, TARGET], np.int32),
    ratio=np.float64(RATIO),
    prefill_decoding_kept_LGP=kept(run(model, torch.tensor(ids), fed, pd)),
    ratio_decoding_kept_LGP=kept(run(model, torch.tensor(ids), fed, ratio)),
  )
  print("wrote", OUT)


if __name__ == "__main__":
  main()
