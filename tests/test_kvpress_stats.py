"""kvpress 0.5.5's ExpectedAttentionStatsPress against kvjax on the tiny fixture Llama
(tests/make_kvpress_fixtures_stats.py records the statistics and kept sets): the statistics
measured by :func:`kvjax.model.calibrate.query_stats`, and the kept sets under them."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import calibrate, decoding

FIXTURES = Path(__file__).parent / "fixtures"
OPTIONS = {
  "stats": (0.5, {}),
  "stats_nocov": (0.5, dict(use_covariance=False)),
  "stats_r075": (0.75, dict(sinks=2)),
}


@pytest.fixture(scope="module")
def golden():
  z = np.load(FIXTURES / "kvpress_0_5_5_stats.npz")
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return z, model, cfg


def test_query_stats_are_kvpress_collect_queries(golden):
  z, model, cfg = golden
  mean, cov = calibrate.query_stats(model, z["rows_BT"], n_sink=int(z["n_sink"]))
  np.testing.assert_allclose(mean, z["query_mean_LHD"], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(cov, z["query_cov_LHDD"], atol=1e-5, rtol=1e-4)
  # the batch size of the passes changes nothing
  again, _ = calibrate.query_stats(model, z["rows_BT"], n_sink=4, batch=1)
  np.testing.assert_allclose(again, mean, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_kept_sets_equal_kvpress(golden, name):
  """``ExpectedAttentionStatsPress`` with the recorded statistics as its ``mu`` / ``cov`` keeps
  what ``ExpectedAttentionStats`` keeps with them as evidence, per layer and KV head."""
  z, model, cfg = golden
  ratio, options = OPTIONS[name]
  ids = z["input_ids_T"][None]
  T = ids.shape[1]
  n = int(T * (1 - ratio))
  pol = policies.ExpectedAttentionStats(**options)
  stats = {"stats_query_mean_LHD": z["query_mean_LHD"], "stats_query_cov_LHDD": z["query_cov_LHDD"]}
  evidence = decoding.check_evidence(pol, stats, cfg, ids, None)
  pre = decoding.jit_prefill(
    cfg, model.params(), jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(T)
  )
  assert pre.query_mean is None  # the prefill measures nothing of its own
  spec = cache_lib.CacheSpec(pol, n)
  cache = cache_lib.compress(cfg, pre, spec, n, evidence=evidence)
  kept = np.zeros((cfg.num_layers, cfg.num_kv_heads, T), bool)
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  for layer in range(cfg.num_layers):
    for g in range(cfg.num_kv_heads):
      kept[layer, g, pos[layer, g][valid[layer, g]]] = True
  np.testing.assert_array_equal(kept, z[f"{name}_keep_LGT"])


def test_the_statistics_matter(golden):
  """The corpus's statistics and the prompt's own (ExpectedAttention) keep different sets, and
  a generation runs through ``km.generate`` with the statistics as evidence."""
  z, model, cfg = golden
  ids = z["input_ids_T"][None]
  stats = {"stats_query_mean_LHD": z["query_mean_LHD"], "stats_query_cov_LHDD": z["query_cov_LHDD"]}
  mask = decoding.keep_mask(
    model, ids, policy="expected_attention_stats", budget=16, evidence=stats
  )
  own = decoding.keep_mask(model, ids, policy="expected_attention", budget=16)
  assert (np.asarray(mask) != np.asarray(own)).any()
  out = km.generate(
    model, ids, policy="expected_attention_stats", budget=16, max_new_tokens=3, evidence=stats
  )
  assert out.tokens.shape == (1, 3)


def test_bad_statistics_are_refused(golden):
  z, model, cfg = golden
  ids = z["input_ids_T"][None]
  with pytest.raises(ValueError, match="stats_query_cov_LHDD"):
    km.generate(
      model,
      ids,
      policy="expected_attention_stats",
      budget=16,
      max_new_tokens=1,
      evidence={"stats_query_mean_LHD": z["query_mean_LHD"]},
    )
  with pytest.raises(ValueError, match="stats_query_mean_LHD"):
    km.generate(
      model,
      ids,
      policy="expected_attention_stats",
      budget=16,
      max_new_tokens=1,
      evidence={
        "stats_query_mean_LHD": z["query_mean_LHD"][:, :2],
        "stats_query_cov_LHDD": z["query_cov_LHDD"],
      },
    )
  with pytest.raises(ValueError, match="decode_every"):
    policies.ExpectedAttentionStats(decode_every=8)
  with pytest.raises(ValueError, match="n_sink"):
    calibrate.query_stats(model, z["rows_BT"][:1, :5], n_sink=4)
