"""Golden and property tests of CapKV and KVCompose.

The fixture ``tests/fixtures/kvpress_0_5_5_capkv.npz`` comes from
``tests/make_kvpress_fixtures_capkv.py`` (kvpress 0.5.5 on the tiny random Llama
``tests/fixtures/kvpress_tiny_llama``): ``CapPress``'s inputs, query anchor, scores and kept
positions at compression_ratio 0.5; ``KVComposePress``'s per-query-head evidence, its enhanced
scores, its per-layer and per-head counts and its kept positions.
"""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.model as km
from kvjax import policies, select
from kvjax.model import calibrate
from kvjax.policies.capkv import CapKV
from kvjax.policies.kvcompose import (
  Composite,
  KVCompose,
  composite_head_counts,
  composite_layer_counts,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "kvpress_0_5_5_capkv.npz"

CAP_CASES = {
  "capkv": CapKV(),
  "capkv_t2_s2_f64": CapKV(tau=2.0, sinks=2, n_future=64),
  "capkv_eps": CapKV(epsilon=1e-2),
}

COMPOSE_CASES = {  # fixture name -> kvjax policy (compression_ratio 0.5: budget T // 2)
  "kvcompose": KVCompose(),
  "kvcompose_unstructured": KVCompose(allocator=Composite(structured=False)),
  "kvcompose_max_max": KVCompose(agg_group="max", allocator=Composite(agg_head="max")),
  "kvcompose_nomean": KVCompose(add_mean_across_heads=False),
  "kvcompose_lb8": KVCompose(allocator=Composite(keep_token_lower_bound=8)),
  "kvcompose_unstructured_lb8": KVCompose(
    allocator=Composite(structured=False, keep_token_lower_bound=8)
  ),
}

# fixture name -> (compression_ratio, structured, keep_token_lower_bound): totals that are not
# a multiple of L (of L * G), checked through the count functions with kvpress's total
RATIO_CASES = {
  "kvcompose_r08": (0.8, True, 0),
  "kvcompose_unstructured_r08": (0.8, False, 0),
  "kvcompose_r08_lb8": (0.8, True, 8),
  "kvcompose_unstructured_r08_lb8": (0.8, False, 8),
  "kvcompose_r095": (0.95, True, 0),
}


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


def cap_evidence(fx, name) -> policies.Evidence:
  return policies.Evidence(
    query_mean_LHD=jnp.asarray(fx[f"{name}_anchor_LHD"]),
    keys_LGTD=jnp.asarray(fx["keys_LGTD"]),
    values_LGTD=jnp.asarray(fx["values_LGTD"]),
  )


def compose_evidence(fx) -> policies.Evidence:
  return policies.Evidence(
    reconstruction_attn_LHT=jnp.asarray(fx["reconstruction_attn_LHT"]),
    values_LGTD=jnp.asarray(fx["values_LGTD"]),
  )


def test_fixture_records_every_case(fx):
  assert set(fx["meta"]["presses"]) == set(CAP_CASES) | set(COMPOSE_CASES) | set(RATIO_CASES)
  assert fx["meta"]["n_kept"] == fx["keys_LGTD"].shape[2] // 2


# --------------------------------------------------------------------------- CapKV golden


@pytest.mark.parametrize("name", sorted(CAP_CASES))
def test_capkv_scores_and_kept_set_match_kvpress(fx, name):
  policy = CAP_CASES[name]
  ev = cap_evidence(fx, name)
  ours = np.asarray(policy.scores(ev))
  ref = fx[f"{name}_scores_LGT"]
  k = policy.sinks
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  np.testing.assert_allclose(ours[..., k:], ref[..., k:], rtol=1e-5, atol=1e-6)
  assert np.isposinf(ours[..., :k]).all()
  keep = np.asarray(policy.keep_mask(ev, fx["meta"]["n_kept"]))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


@pytest.mark.parametrize("name", ["capkv", "capkv_t2_s2_f64"])
def test_prefill_computes_the_capkv_anchor(fx, name):
  """kvjax's own prefill, asked by the policy, gives kvpress's ``CapPress._query_anchor``."""
  policy = CAP_CASES[name]
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  T = fx["keys_LGTD"].shape[2]
  request = policy.evidence_request(T)
  assert request.query_stats
  assert (request.n_sink, request.n_future) == (policy.sinks, policy.n_future)
  ids = jnp.asarray(fx["input_ids_T"][None].astype(np.int32))
  pre = km.prefill(cfg, model.params(), ids, request=request)
  np.testing.assert_allclose(np.asarray(pre.query_mean[:, 0]), fx[f"{name}_anchor_LHD"], atol=2e-6)
  np.testing.assert_allclose(np.asarray(pre.keys[:, 0]), fx["keys_LGTD"], atol=1e-5)
  np.testing.assert_allclose(np.asarray(pre.values[:, 0]), fx["values_LGTD"], atol=1e-5)
  ev = policies.Evidence(
    query_mean_LHD=pre.query_mean[:, 0], keys_LGTD=pre.keys[:, 0], values_LGTD=pre.values[:, 0]
  )
  keep = np.asarray(policy.keep_mask(ev, fx["meta"]["n_kept"]))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


# --------------------------------------------------------------------------- KVCompose golden


def test_kvcompose_evidence_matches_kvpress(fx):
  """The second pass (the context read again after itself): per query head, the max attention
  each context key receives, as ``KVComposePress``'s task aggregators hold it."""
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  ours = calibrate.kvcompose_evidence(model, fx["input_ids_T"])
  assert ours.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(ours), fx["reconstruction_attn_LHT"], atol=1e-5)
  batch = calibrate.kvcompose_evidence(model, np.stack([fx["input_ids_T"]] * 2))
  np.testing.assert_allclose(np.asarray(batch[:, 1]), np.asarray(ours), atol=1e-5)
  again = calibrate.kvcompose_evidence(model, fx["input_ids_T"], prompt_ids=fx["input_ids_T"])
  np.testing.assert_allclose(np.asarray(again), np.asarray(ours), atol=1e-6)
  ev = compose_evidence(fx).replace(reconstruction_attn_LHT=ours)
  keep = np.asarray(KVCompose().keep_mask(ev, fx["meta"]["n_kept"]))
  np.testing.assert_array_equal(keep, fx["kvcompose_keep_LGT"])


@pytest.mark.parametrize("name", sorted(COMPOSE_CASES))
def test_kvcompose_matches_kvpress(fx, name):
  policy = COMPOSE_CASES[name]
  ev = compose_evidence(fx)
  scores = policy.scores(ev)
  assert scores.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(scores), fx[f"{name}_scores_LGT"], rtol=1e-6, atol=1e-7)
  budget = fx["meta"]["n_kept"]
  budget_LG = np.asarray(policy.budgets(ev, scores, budget))
  if policy.allocator.structured:
    np.testing.assert_array_equal(budget_LG[:, 0], fx[f"{name}_per_layer_L"])
    assert (budget_LG == budget_LG[:, :1]).all()
  else:
    np.testing.assert_array_equal(budget_LG, fx[f"{name}_per_head_LG"])
  keep = np.asarray(policy.keep_mask(ev, budget))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


@pytest.mark.parametrize("name", sorted(RATIO_CASES))
def test_kvcompose_counts_at_kvpress_totals(fx, name):
  ratio, structured, bound = RATIO_CASES[name]
  scores = KVCompose().scores(compose_evidence(fx))
  L, G, T = scores.shape
  if structured:
    counts = composite_layer_counts(scores, int(L * T * (1 - ratio)), keep_token_lower_bound=bound)
    np.testing.assert_array_equal(np.asarray(counts), fx[f"{name}_per_layer_L"])
    budget_LG = jnp.broadcast_to(counts[:, None], (L, G))
  else:
    budget_LG = composite_head_counts(
      scores, int(L * G * T * (1 - ratio)), keep_token_lower_bound=bound
    )
    np.testing.assert_array_equal(np.asarray(budget_LG), fx[f"{name}_per_head_LG"])
  keep = np.asarray(select.top_mask(scores, budget_LG))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


# --------------------------------------------------------------------------- properties


def random_evidence(seed=0, L=2, Hq=4, G=2, T=40, D=8) -> policies.Evidence:
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  attn = jax.nn.softmax(f(L, Hq, T) * 3, axis=-1)
  return policies.Evidence(
    query_mean_LHD=f(L, Hq, D),
    keys_LGTD=f(L, G, T, D),
    values_LGTD=f(L, G, T, D),
    reconstruction_attn_LHT=attn,
  )


PER_HEAD = [
  CapKV(),
  CapKV(sinks=0, tau=1.0),
  KVCompose(allocator=policies.Uniform()),
  KVCompose(add_v_norm=True, agg_group="max", allocator=policies.Uniform()),
]


@pytest.mark.parametrize("policy", PER_HEAD, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("budget", [1, 7, 20, 40, 100])
def test_exactly_min_budget_kept(policy, budget):
  keep = np.asarray(policy.keep_mask(random_evidence(), budget))
  assert keep.shape == (2, 2, 40)
  assert (keep.sum(-1) == min(budget, 40)).all()


@pytest.mark.parametrize("policy", PER_HEAD, ids=lambda p: type(p).__name__)
def test_per_head_budgets(policy):
  ev = random_evidence(1)
  budget_LH = np.array([[3, 17], [40, 9]], np.int32)
  keep = np.asarray(policy.keep_mask(ev, budget_LH))
  np.testing.assert_array_equal(keep.sum(-1), budget_LH)
  s = np.asarray(policy.scores(ev))
  for l, h in np.ndindex(2, 2):  # the kept positions are the best-scored ones
    assert s[l, h][keep[l, h]].min() >= s[l, h][~keep[l, h]].max(initial=-np.inf)


@pytest.mark.parametrize("policy", PER_HEAD, ids=lambda p: type(p).__name__)
def test_budgets_traced_without_retrace(policy):
  ev = random_evidence(2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def kept(budget_LH):
    return policy.keep_mask(ev, budget_LH)

  for b in ([[5, 6], [7, 8]], [[30, 2], [1, 40]]):
    np.testing.assert_array_equal(np.asarray(kept(jnp.asarray(b, jnp.int32))).sum(-1), b)
  chex.clear_trace_counter()


@pytest.mark.parametrize("bound", [0, 3])
@pytest.mark.parametrize("budget", [1, 5, 20, 40, 64])
def test_composite_kept_counts(budget, bound):
  """Structured: one count per layer, ``L * min(b, T)`` in all unless the floor
  ``max(1, keep_token_lower_bound)`` lifts a layer; unstructured: ``L * H * min(b, T)``."""
  ev = random_evidence(3, L=3, T=40)
  b = min(budget, 40)
  structured = KVCompose(allocator=Composite(keep_token_lower_bound=bound))
  keep = np.asarray(structured.keep_mask(ev, budget)).sum(-1)
  assert (keep == keep[:, :1]).all()
  floor = max(1, bound)
  assert (keep >= min(floor, 40)).all()
  assert keep[:, 0].sum() >= 3 * b
  if (keep[:, 0] > floor).all():
    assert keep[:, 0].sum() == 3 * b
  unstructured = KVCompose(allocator=Composite(structured=False, keep_token_lower_bound=bound))
  keep = np.asarray(unstructured.keep_mask(ev, budget)).sum(-1)
  assert keep.sum() == 3 * 2 * b
  assert (keep >= min(bound, b)).all() if 3 * 2 * b >= 3 * 2 * bound else True


def test_composite_layer_zero_takes_the_largest_curve():
  s = np.zeros((2, 2, 10), np.float32)
  s[1] = np.linspace(1, 2, 10)  # layer 1 dominates; layer 0's curve becomes its copy
  counts = np.asarray(composite_layer_counts(jnp.asarray(s), 10))
  np.testing.assert_array_equal(counts, [5, 5])  # ties: the lower layer first
  np.testing.assert_array_equal(np.asarray(composite_layer_counts(jnp.asarray(s), 0)), [1, 1])


@pytest.mark.parametrize("structured", [True, False])
def test_composite_traced_budget_without_retrace(structured):
  ev = random_evidence(4)
  policy = KVCompose(allocator=Composite(structured=structured))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def kept(budget):
    return policy.keep_mask(ev, budget)

  for b in (5, 17):
    ours = np.asarray(kept(jnp.asarray(b, jnp.int32)))
    np.testing.assert_array_equal(ours, np.asarray(policy.keep_mask(ev, b)))
  chex.clear_trace_counter()


def test_composite_takes_a_scalar_budget():
  ev = random_evidence(5)
  with pytest.raises(ValueError, match="budget"):
    KVCompose().keep_mask(ev, np.array([[3, 4], [5, 6]], np.int32))


def test_requests_and_fields():
  r = CapKV(sinks=2, n_future=64).evidence_request(48)
  assert r.query_stats and (r.n_sink, r.n_future) == (2, 64)
  assert KVCompose().evidence_fields == {"reconstruction_attn_LHT"}
  assert KVCompose(add_v_norm=True).evidence_fields == {"reconstruction_attn_LHT", "values_LGTD"}
  ev = random_evidence(6)
  rolled = ev.rolled(3)
  np.testing.assert_array_equal(
    np.asarray(rolled.reconstruction_attn_LHT),
    np.roll(np.asarray(ev.reconstruction_attn_LHT), 3, axis=-1),
  )


def test_capkv_padded_row_scores_as_its_prompt():
  pad, T = 5, 35
  full = random_evidence(7, T=pad + T)
  unpadded = full.replace(
    keys_LGTD=full.keys_LGTD[..., pad:, :], values_LGTD=full.values_LGTD[..., pad:, :]
  )
  valid_T = jnp.arange(pad + T) >= pad
  ours = np.asarray(CapKV().scores_row(full.replace(valid_T=valid_T)))
  ref = np.asarray(CapKV().scores(unpadded))
  np.testing.assert_allclose(ours[..., pad:], ref, rtol=2e-5, atol=2e-6)
  assert (ours[..., :pad] == 0).all()


def test_missing_evidence_is_named():
  ev = random_evidence().replace(query_mean_LHD=None, reconstruction_attn_LHT=None)
  with pytest.raises(ValueError, match="query_mean_LHD"):
    CapKV().scores(ev)
  with pytest.raises(ValueError, match="reconstruction_attn_LHT"):
    KVCompose().scores(ev)
  with pytest.raises(ValueError, match="values_LGTD"):
    KVCompose(add_v_norm=True).scores(random_evidence().replace(values_LGTD=None))
  with pytest.raises(ValueError, match="sinks"):
    CapKV(sinks=40).scores(random_evidence())


@pytest.mark.parametrize(
  "cls, options, match",
  [
    (CapKV, {"sinks": -1}, "sinks"),
    (CapKV, {"sinks": 2.0}, "sinks"),
    (CapKV, {"tau": float("nan")}, "tau"),
    (CapKV, {"tau": "5"}, "tau"),
    (CapKV, {"tau": True}, "tau"),
    (CapKV, {"n_future": 0}, "n_future"),
    (CapKV, {"epsilon": -1e-6}, "epsilon"),
    (CapKV, {"epsilon": float("inf")}, "epsilon"),
    (KVCompose, {"agg_group": "sum"}, "agg_group"),
    (KVCompose, {"add_v_norm": 1}, "add_v_norm"),
    (KVCompose, {"add_mean_across_heads": "yes"}, "add_mean_across_heads"),
    (Composite, {"structured": 0}, "structured"),
    (Composite, {"agg_head": "median"}, "agg_head"),
    (Composite, {"keep_token_lower_bound": -1}, "keep_token_lower_bound"),
    (Composite, {"keep_token_lower_bound": 1.5}, "keep_token_lower_bound"),
  ],
)
def test_bad_options_refused(cls, options, match):
  with pytest.raises(ValueError, match=match):
    cls(**options)


def test_capkv_through_the_model_keeps_kvpress_set(fx):
  """``km.keep_mask`` on the checkpoint: the prefill's evidence, the policy, kvpress's kept set
  (each KV head's set repeated over its query heads)."""
  model, _ = km.load(FIXTURES / "kvpress_tiny_llama")
  ids = fx["input_ids_T"][None].astype(np.int32)
  keep = np.asarray(km.keep_mask(model, ids, CapKV(), fx["meta"]["n_kept"]))
  np.testing.assert_array_equal(keep[:, 0, ::2], fx["capkv_keep_LGT"])
  np.testing.assert_array_equal(keep[:, 0, 1::2], fx["capkv_keep_LGT"])
