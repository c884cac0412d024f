"""Golden fixtures for kvpress 0.5.5's ``ExpectedAttentionStatsPress`` (kvjax
``ExpectedAttentionStats`` and ``kvjax.model.calibrate.query_stats``).

A standalone script, NOT run by the test suite (kvjax never imports torch), in the kvpress venv
(torch 2.13.0+cpu, kvpress 0.5.5)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_stats.py

On the tiny random Llama ``tests/fixtures/kvpress_tiny_llama`` (eager attention):

* ``rows_BT``: seeded calibration rows; ``query_mean_LHD`` / ``query_cov_LHDD``: kvpress's
  ``collect_queries`` statistics of them (its ``patch_rotary_embedding`` captures the pre-RoPE
  queries of every row, the first ``n_sink`` dropped, pooled, covariance over ``N - 1``), one
  row per forward as kvpress runs them;
* ``input_ids_T``: the prompt of ``tests/fixtures/kvpress_0_5_5.npz``;
  ``<name>_keep_LGT``: the positions ``ExpectedAttentionStatsPress`` kept with those
  statistics set as its ``mu`` / ``cov`` (so it loads nothing from the hub), recovered from the
  compressed cache, for each press in :data:`PRESSES`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from kvpress import ExpectedAttentionStatsPress
from kvpress.presses.expected_attention_with_stats import patch_rotary_embedding
from transformers import AutoModelForCausalLM, DynamicCache

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
PROMPT = HERE / "fixtures" / "kvpress_0_5_5.npz"
OUT = HERE / "fixtures" / "kvpress_0_5_5_stats.npz"
B, T_ROW, N_SINK = 6, 40, 4
PRESSES = {
  "stats": dict(compression_ratio=0.5),
  "stats_nocov": dict(compression_ratio=0.5, use_covariance=False),
  "stats_r075": dict(compression_ratio=0.75, n_sink=2),
}


def collect(model, rows):
  """kvpress ``collect_queries`` on token rows (its dataset and tokenizer steps left out)."""
  collected = []
  for row in rows:
    with torch.no_grad(), patch_rotary_embedding(model) as captured:
      model(input_ids=torch.tensor(row[None]))
    collected.append(torch.cat(captured, dim=0)[:, :, N_SINK:, :])
  q = torch.cat(collected, dim=-2)
  mean = q.mean(dim=-2)
  centered = q - mean.unsqueeze(-2)
  cov = (centered.transpose(-2, -1) @ centered) / (q.shape[-2] - 1)
  return mean, cov


def kept(model, ids, press):
  L, G = model.config.num_hidden_layers, model.config.num_key_value_heads
  full = DynamicCache(config=model.config)
  with torch.no_grad():
    model(ids, past_key_values=full, use_cache=True)
  cache = DynamicCache(config=model.config)
  with torch.no_grad(), press(model):
    model(ids, past_key_values=cache, use_cache=True)
  T = ids.shape[1]
  keep = np.zeros((L, G, T), bool)
  for layer in range(L):
    orig, comp = full.layers[layer].keys[0], cache.layers[layer].keys[0]
    for g in range(G):
      eq = (comp[g][:, None, :] == orig[g][None, :, :]).all(-1)
      assert (eq.sum(-1) == 1).all(), "a compressed key matches no unique original key"
      keep[layer, g, eq.float().argmax(-1).numpy()] = True
  return keep


def main():
  torch.manual_seed(0)
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(
    CKPT, dtype=torch.float32, attn_implementation="eager"
  )
  model.eval()
  rng = np.random.default_rng(3)
  rows = rng.integers(5, model.config.vocab_size, (B, T_ROW)).astype(np.int64)
  mean, cov = collect(model, rows)
  ids = torch.tensor(np.load(PROMPT)["input_ids_T"][None].astype(np.int64))
  out = dict(
    rows_BT=rows.astype(np.int32),
    n_sink=np.int32(N_SINK),
    query_mean_LHD=mean.numpy(),
    query_cov_LHDD=cov.numpy(),
    input_ids_T=ids[0].numpy().astype(np.int32),
  )
  for name, kwargs in PRESSES.items():
    press = ExpectedAttentionStatsPress(**kwargs)
    press.mu, press.cov = mean.clone(), cov.clone()
    out[f"{name}_keep_LGT"] = kept(model, ids, press)
  np.savez_compressed(OUT, **out)
  print("wrote", OUT, {k: v.shape for k, v in out.items()})


if __name__ == "__main__":
  main()
