"""Golden tests against NVIDIA kvpress 0.5.5 on a tiny random Llama.

The fixture ``tests/fixtures/kvpress_0_5_5.npz`` is produced by ``tests/make_kvpress_fixtures.py``
(run it in a separate torch venv; kvjax itself never imports torch). It holds the post-RoPE
queries/keys each press saw, kvpress's raw scores and the positions kvpress kept at ratio 0.5.
"""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import budgets, policies, scores, select

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "kvpress_0_5_5.npz"
RATIO = 0.5


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


def n_kept(T):
  return max(1, int(T * (1 - RATIO)))


def test_fixture_attention_is_reproduced_by_window_attention(fx):
  q, k, attn = fx["queries_LHTD"], fx["keys_LGTD"], fx["attn_LHTT"]
  W = 8
  ours = scores.window_attention(jnp.asarray(q[:, :, -W:]), jnp.asarray(k))
  np.testing.assert_allclose(np.asarray(ours), attn[:, :, -W:], atol=2e-6)


def snapkv_kvpress(fx, window=8):
  q, k = fx["queries_LHTD"], fx["keys_LGTD"]
  attn = scores.window_attention(jnp.asarray(q[:, :, -window:]), jnp.asarray(k))
  s = scores.snapkv(attn, kernel=5, pool="avg", reduce="mean")
  return scores.group(s, k.shape[1], "mean")


def test_snapkv_scores_and_kept_set(fx):
  ours = np.asarray(snapkv_kvpress(fx))
  T = ours.shape[-1]
  np.testing.assert_allclose(ours[..., : T - 8], fx["snapkv_scores_LGT"][..., : T - 8], atol=1e-6)
  assert np.isinf(ours[..., T - 8 :]).all()
  keep = np.asarray(select.top_mask(jnp.asarray(ours), jnp.int32(n_kept(T))))
  np.testing.assert_array_equal(keep, fx["snapkv_keep_LGT"])


def test_streaming_llm_kept_set(fx):
  L, G, T = fx["streaming_llm_keep_LGT"].shape
  keep = np.asarray(select.top_mask(scores.streaming(T, (L, G), sinks=4), jnp.int32(n_kept(T))))
  np.testing.assert_array_equal(keep, fx["streaming_llm_keep_LGT"])


def test_tova_scores_and_kept_set(fx):
  attn = fx["attn_LHTT"]
  L, G, T = fx["tova_keep_LGT"].shape
  ours = np.asarray(scores.tova(jnp.asarray(attn[:, :, -1, :])))
  ours = scores.group(jnp.asarray(ours), G, "mean")  # identical rows: grouping is a no-op
  np.testing.assert_allclose(np.asarray(ours)[..., :-1], fx["tova_scores_LGT"][..., :-1], atol=1e-6)
  # kvpress's TOVAPress additionally forces the last token (official TOVA does not).
  forced = scores.protect(ours, recent=1)
  keep = np.asarray(select.top_mask(forced, jnp.int32(n_kept(T))))
  np.testing.assert_array_equal(keep, fx["tova_keep_LGT"])


def test_observed_attention_is_h2o_kvpress_form(fx):
  q, k = jnp.asarray(fx["queries_LHTD"]), jnp.asarray(fx["keys_LGTD"])
  G = k.shape[1]
  ours = scores.group(scores.h2o(q, k, form="kvpress", block=7), G, "mean")
  np.testing.assert_allclose(np.asarray(ours), fx["observed_attention_scores_LGT"], rtol=2e-5)
  keep = np.asarray(select.top_mask(ours, jnp.int32(n_kept(ours.shape[-1]))))
  np.testing.assert_array_equal(keep, fx["observed_attention_keep_LGT"])


def test_knorm(fx):
  ours = np.asarray(scores.knorm(jnp.asarray(fx["keys_LGTD"])))
  np.testing.assert_allclose(ours, fx["knorm_scores_LGT"], rtol=1e-6)
  keep = np.asarray(select.top_mask(jnp.asarray(ours), jnp.int32(n_kept(ours.shape[-1]))))
  np.testing.assert_array_equal(keep, fx["knorm_keep_LGT"])


def test_pyramidkv_layer_budgets_and_kept_set(fx):
  L, G, T = fx["pyramidkv_keep_LGT"].shape
  layer = budgets.pyramid(L, 8 + T * (1 - RATIO), 8, T, beta=20, mode="kvpress")
  np.testing.assert_array_equal(np.asarray(layer), fx["pyramidkv_budgets_L"])
  ours = snapkv_kvpress(fx)
  keep = np.asarray(select.top_mask(ours, budgets.per_head(layer, G)))
  np.testing.assert_array_equal(keep, fx["pyramidkv_keep_LGT"])


def test_pyramid_kvpress_budget_grid(fx):
  grid = fx["pyramid_budgets_grid"]
  for num_layers, q_len, ratio100, window, layer, expected in grid:
    ratio = ratio100 / 100
    ours = budgets.pyramid(
      int(num_layers), window + q_len * (1 - ratio), int(window), int(q_len), mode="kvpress"
    )
    assert int(ours[layer]) == expected, (num_layers, q_len, ratio, window, layer)


@pytest.mark.parametrize("name, alpha", [("adakv_snapkv", 0.2), ("adakv_knorm_a08", 0.8)])
def test_adakv_kvpress_allocation(fx, name, alpha):
  raw = jnp.asarray(fx[f"{name}_scores_LGT"])
  T = raw.shape[-1]
  counts = budgets.adakv(raw, n_kept(T), 0, floor_alpha=alpha, mode="kvpress")
  expected = fx["meta"]["presses"][name]["kept_per_head_LG"]
  np.testing.assert_array_equal(np.asarray(counts), expected)
  np.testing.assert_array_equal(np.asarray(counts).sum(-1), raw.shape[1] * n_kept(T))
  keep = np.asarray(select.top_mask(raw, counts))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


# --------------------------------------------------------------------------- issue 15's presses
# Recorded in a later run whose CPU rounds 1e-6 differently: those presses saw the
# ``issue15_*`` inputs (``meta["issue15_inputs"]``), and kvjax reruns on exactly those.


def issue15_evidence(fx) -> policies.Evidence:
  q, k, v = (jnp.asarray(fx[f"issue15_{n}"]) for n in ("queries_LHTD", "keys_LGTD", "values_LGTD"))
  ev = policies.evidence_from_qk(q, k, window=8, column_sums=False)
  return ev.replace(
    values_LGTD=v,
    value_out_norms_LHT=jnp.asarray(fx["value_out_norms_LHT"]),
    query_mean_LHD=jnp.asarray(fx["query_mean_LHD"]),
    query_cov_LHDD=jnp.asarray(fx["query_cov_LHDD"]),
    window_queries_LHWD=q[:, :, -32:],
    qfilters_LGD=jnp.asarray(fx["qfilters_LGD"]),
    retrieval_heads_LG=jnp.asarray(fx["retrieval_heads_LG"]),
  )


def kept(policy, ev, budget):
  return np.asarray(policy.keep_mask(ev, budget))


def test_expected_attention_query_statistics(fx):
  meta = fx["meta"]["presses"]["expected_attention"]
  T = fx["prerope_queries_LHTD"].shape[2]
  rope = scores.average_rope(
    fx["rope_inv_freq"],
    T,
    meta["defaults"]["n_future_positions"],
    attention_scaling=meta["attention_scaling"],
  )
  mean, cov = scores.expected_query_stats(jnp.asarray(fx["prerope_queries_LHTD"]), rope, n_sink=4)
  np.testing.assert_allclose(np.asarray(mean), fx["query_mean_LHD"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(cov), fx["query_cov_LHDD"], rtol=1e-4, atol=1e-5)


def test_expected_attention_scores_and_kept_set(fx):
  ev = issue15_evidence(fx)
  policy = policies.make("expected_attention")
  ours = np.asarray(policy.scores(ev))
  ref = fx["expected_attention_scores_LGT"]
  np.testing.assert_allclose(ours[..., 4:], ref[..., 4:], rtol=1e-4, atol=1e-7)
  assert np.isinf(ours[..., :4]).all()
  np.testing.assert_array_equal(
    kept(policy, ev, n_kept(ref.shape[-1])), fx["expected_attention_keep_LGT"]
  )


@pytest.mark.parametrize("name", ["keydiff", "lagkv", "qfilter"])
def test_attention_free_scorers(fx, name):
  ev = issue15_evidence(fx)
  policy = policies.make(name, **({"lag": 8} if name == "lagkv" else {}))
  ours = np.asarray(policy.scores(ev))
  ref = fx[f"{name}_scores_LGT"]
  if name == "lagkv":  # kvpress writes 1 for the sinks and the tail, kvjax +inf
    ref = np.where(ref == 1.0, np.inf, ref)
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(kept(policy, ev, n_kept(ref.shape[-1])), fx[f"{name}_keep_LGT"])


def test_critical_snapkv(fx):
  ev = issue15_evidence(fx)
  policy = policies.make("critical_snapkv_kvpress", num_kv_heads=2)
  T = ev.keys_LGTD.shape[2]
  np.testing.assert_array_equal(kept(policy, ev, n_kept(T)), fx["critical_snapkv_keep_LGT"])


def test_critical_adakv_snapkv(fx):
  ev = issue15_evidence(fx)
  policy = policies.make("critical_adakv_snapkv_kvpress", num_kv_heads=2)
  T = ev.keys_LGTD.shape[2]
  ours = kept(policy, ev, n_kept(T))
  np.testing.assert_array_equal(
    ours.sum(-1), fx["meta"]["presses"]["critical_adakv_snapkv"]["kept_per_head_LG"]
  )
  np.testing.assert_array_equal(ours, fx["critical_adakv_snapkv_keep_LGT"])


@pytest.mark.parametrize("chunk", [8, 10])
def test_chunkkv_snapkv(fx, chunk):
  ev = issue15_evidence(fx)
  ref = fx[f"chunkkv{chunk}_snapkv_keep_LGT"]
  policy = policies.make("chunkkv_snapkv_kvpress", num_kv_heads=2, chunk=chunk)
  budget = int(ref[0, 0].sum())  # kvpress keeps whole chunks: the budget is what it kept
  assert (ref.sum(-1) == budget).all()
  np.testing.assert_array_equal(kept(policy, ev, budget), ref)


def test_duo_attention(fx):
  ev = issue15_evidence(fx)
  meta = fx["meta"]["presses"]["duo_attention"]["injected"]
  streaming = scores.duo_streaming_heads(ev.retrieval_heads_LG, 0.5)
  np.testing.assert_array_equal(np.asarray(streaming), fx["duo_streaming_LG"])
  policy = policies.make("duo_attention", sinks=meta["sink_size"], head_compression_ratio=0.5)
  budget = meta["sink_size"] + meta["recent_size"]
  np.testing.assert_array_equal(kept(policy, ev, budget), fx["duo_attention_keep_LGT"])


def test_think_channels(fx):
  ev = issue15_evidence(fx)
  channel_scores = scores.think_channel_scores(ev.window_queries_LHWD, ev.keys_LGTD)
  keep = np.asarray(scores.think_channel_mask(channel_scores, 0.5))
  np.testing.assert_array_equal(~keep, fx["think_pruned_LGD"])


def test_think_after_snapkv_scores_the_kept_keys(fx):
  ev = issue15_evidence(fx)
  keep = np.asarray(policies.make("snapkv_kvpress", num_kv_heads=2).keep_mask(ev, 24))
  keys = np.asarray(ev.keys_LGTD)
  kept_keys = np.stack(
    [np.stack([keys[i, g][keep[i, g]] for g in range(keys.shape[1])]) for i in range(keys.shape[0])]
  )
  channel_scores = scores.think_channel_scores(ev.window_queries_LHWD, jnp.asarray(kept_keys))
  pruned = ~np.asarray(scores.think_channel_mask(channel_scores, 0.5))
  np.testing.assert_array_equal(pruned, fx["think_snapkv_pruned_LGD"])
  assert (pruned != fx["think_pruned_LGD"]).any()  # the kept keys change the choice
