"""Golden and property tests of KVgrad (kvjax.model.kvgrad's evidence, kvjax.policies.kvgrad).

The fixture ``tests/fixtures/kvpress_0_5_5_kvgrad.npz`` comes from
``tests/make_kvpress_fixtures_kvgrad.py`` (kvpress 0.5.5 ``KVgradPress`` on the tiny random
Llama ``tests/fixtures/kvpress_tiny_llama`` with the prompt of ``kvpress_0_5_5.npz``): per run,
``score_val`` before ``compress_post`` (the evidence ``kvgrad_LGT``), the kept pairs at
compression_ratio 0.5 and the reconstruction template the fake tokenizer gave.
"""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.model as km
from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import calibrate, kvgrad
from kvjax.policies.kvgrad import KVgrad, kvgrad_scores

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "kvpress_0_5_5_kvgrad.npz"
RUNS = (
  "kvgrad",
  "kvgrad_chunk16",
  "kvgrad_template_chunk12",
  "kvgrad_sink2_template_chunk16",
  "kvgrad_layerwise",
)
# the evidence through the model: a chunked run with a template (as a batch of two rows) and the
# n_sink=2 run; the others (one chunk, no template; layerwise has kvgrad's evidence) are slow
EVIDENCE_RUNS = (
  "kvgrad_template_chunk12",
  "kvgrad_sink2_template_chunk16",
  pytest.param("kvgrad", marks=pytest.mark.slow),
  pytest.param("kvgrad_chunk16", marks=pytest.mark.slow),
)


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


@pytest.fixture(scope="module")
def tiny():
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return model, cfg, model.params()


def template(fx, run) -> calibrate.KVzipTemplate:
  return calibrate.KVzipTemplate(
    tuple(int(i) for i in fx[f"{run}_first_ids"]),
    tuple(int(i) for i in fx[f"{run}_later_ids"]),
    tuple(int(i) for i in fx[f"{run}_suffix_ids"]),
    int(fx[f"{run}_prefix_len"]),
  )


def policy_of(fx, run) -> KVgrad:
  m = fx["meta"]["runs"][run]
  return KVgrad(sinks=m["n_sink"], allocator=policies.Pooled(layerwise=m["layerwise"]))


def test_fixture_records_every_run(fx):
  assert set(fx["meta"]["runs"]) == set(RUNS)
  T = fx["input_ids_T"].size
  for run in RUNS:
    assert fx[f"{run}_keep_LGT"].sum(-1).sum() == fx[f"{run}_keep_LGT"].size - int(
      fx[f"{run}_keep_LGT"].size * 0.5
    )
    assert fx[f"{run}_kvgrad_LGT"].shape[-1] == T


# --------------------------------------------------------------------------- golden


@pytest.mark.parametrize("run", EVIDENCE_RUNS)
def test_evidence_matches_kvpress(fx, tiny, run):
  """The replay, its backward pass and the attribution, as ``KVgradPress.score_val``; then the
  policy on kvjax's evidence keeps kvpress's pairs."""
  model, cfg, params = tiny
  m = fx["meta"]["runs"][run]
  ctx = fx["input_ids_T"]
  T = ctx.size
  kw = {"options": calibrate.KVzipOptions(chunk_size=m["chunk_size"], n_sink=m["n_sink"])}
  if run == "kvgrad_template_chunk12":  # a batch of two rows: row 0 is kvpress's
    both = kvgrad.kvgrad_evidence(model, np.stack([ctx, ctx[::-1]]), template(fx, run), **kw)
    assert both.shape == (cfg.num_layers, 2, cfg.num_kv_heads, T)
    assert not np.allclose(np.asarray(both[:, 1]), np.asarray(both[:, 0]))
    ours = both[:, 0]
  else:
    ours = kvgrad.kvgrad_evidence(model, ctx, template(fx, run), **kw)
  assert ours.shape == (cfg.num_layers, cfg.num_kv_heads, T) and ours.dtype == jnp.float32
  ours, ref = np.asarray(ours), fx[f"{run}_kvgrad_LGT"]
  np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  prefix = int(fx[f"{run}_prefix_len"])
  assert (ours[..., :prefix] == 0).all() and (ours[..., prefix:] > 0).all()
  ev = policies.Evidence(kvgrad_LGT=jnp.asarray(ours))
  keep = np.asarray(policy_of(fx, run).keep_mask(ev, T // 2))
  np.testing.assert_array_equal(keep, fx[f"{run}_keep_LGT"])


@pytest.mark.parametrize("run", RUNS)
def test_kept_set_matches_kvpress(fx, run):
  """kvpress's evidence through the policy: the pooled (or per-layer) selection at
  compression_ratio 0.5 is the per-head budget ``T // 2``."""
  policy = policy_of(fx, run)
  ev = policies.Evidence(kvgrad_LGT=jnp.asarray(fx[f"{run}_kvgrad_LGT"]))
  T = fx["input_ids_T"].size
  scores = np.asarray(policy.scores(ev))
  assert scores.dtype == np.float32 and np.isposinf(scores[..., : policy.sinks]).all()
  keep = np.asarray(policy.keep_mask(ev, T // 2))
  np.testing.assert_array_equal(keep, fx[f"{run}_keep_LGT"])


def test_layerwise_run_shares_the_evidence(fx):
  np.testing.assert_array_equal(fx["kvgrad_layerwise_kvgrad_LGT"], fx["kvgrad_kvgrad_LGT"])
  assert not np.array_equal(fx["kvgrad_layerwise_keep_LGT"], fx["kvgrad_keep_LGT"])


# --------------------------------------------------------------------------- the gradient


def test_gradient_is_the_attention_output_derivative(tiny):
  """``replay``'s offsets shift each layer's attention output: a finite difference of ``Phi``
  along one offset matches ``jax.grad``'s directional derivative."""
  model, cfg, params = tiny
  L, d = cfg.num_layers, params["embed"].shape[-1]
  rng = np.random.default_rng(0)
  ctx = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 12)), jnp.int32)
  pre = km.prefill(cfg, params, ctx)
  repeat = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 5)), jnp.int32)
  zero = jnp.zeros((L, 1, 5, d), jnp.float32)
  direction = jnp.asarray(rng.standard_normal((L, 1, 5, d)), jnp.float32)

  def phi(offsets):
    return kvgrad.replay(cfg, params, pre.keys, pre.values, repeat, offsets)[0]

  grad = jax.grad(phi)(zero)
  eps = 1e-3
  fd = (phi(eps * direction) - phi(-eps * direction)) / (2 * eps)
  np.testing.assert_allclose(float(fd), float((grad * direction).sum()), rtol=2e-3)
  # zero offsets: the model's own forward over the repeat tokens after the cached context
  _, xs = kvgrad.replay(cfg, params, pre.keys, pre.values, repeat, zero)
  np.testing.assert_array_equal(np.asarray(xs[0]), np.asarray(params["embed"][repeat]))


# --------------------------------------------------------------------------- properties


def random_evidence(seed=0, L=2, G=2, T=40) -> policies.Evidence:
  rng = np.random.default_rng(seed)
  return policies.Evidence(kvgrad_LGT=jnp.asarray(rng.gamma(2.0, 50.0, (L, G, T)), jnp.float32))


@pytest.mark.parametrize("budget", [1, 7, 20, 40, 100])
def test_exactly_min_budget_kept(budget):
  ev = random_evidence()
  per_head = np.asarray(KVgrad(allocator=policies.Uniform()).keep_mask(ev, budget))
  assert per_head.shape == (2, 2, 40)
  assert (per_head.sum(-1) == min(budget, 40)).all()
  pooled = np.asarray(KVgrad().keep_mask(ev, budget))
  assert pooled.sum() == 2 * 2 * min(budget, 40)
  layerwise = np.asarray(KVgrad(allocator=policies.Pooled(layerwise=True)).keep_mask(ev, budget))
  assert (layerwise.sum((1, 2)) == 2 * min(budget, 40)).all()


def test_pooled_keeps_the_best_scores():
  ev = random_evidence(1)
  policy = KVgrad()
  keep = np.asarray(policy.keep_mask(ev, 13))
  s = np.asarray(policy.scores(ev))
  assert s[keep].min() >= s[~keep].max()
  assert keep[..., :4].all()  # the sinks first


def test_per_head_budgets():
  ev = random_evidence(2)
  policy = KVgrad(allocator=policies.Uniform())
  budget_LH = np.array([[4, 17], [40, 9]], np.int32)
  keep = np.asarray(policy.keep_mask(ev, budget_LH))
  np.testing.assert_array_equal(keep.sum(-1), budget_LH)
  s = np.asarray(policy.scores(ev))
  for l, h in np.ndindex(2, 2):
    assert s[l, h][keep[l, h]].min() >= s[l, h][~keep[l, h]].max(initial=-np.inf)


@pytest.mark.parametrize(
  "policy", [KVgrad(), KVgrad(allocator=policies.Uniform())], ids=["pooled", "uniform"]
)
def test_budgets_traced_without_retrace(policy):
  ev = random_evidence(3)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def kept(budget):
    return policy.keep_mask(ev, budget)

  for b in (5, 17, 40):
    ours = np.asarray(kept(jnp.asarray(b, jnp.int32)))
    np.testing.assert_array_equal(ours, np.asarray(policy.keep_mask(ev, b)))
  chex.clear_trace_counter()


def test_request_fields_and_roll():
  policy = KVgrad()
  assert policy.evidence_fields == {"kvgrad_LGT"}
  request = policy.evidence_request(48)
  assert request == policies.EvidenceRequest.for_fields({"kvgrad_LGT"}, request.window)
  ev = random_evidence(4)
  np.testing.assert_array_equal(
    np.asarray(ev.rolled(3).kvgrad_LGT), np.roll(np.asarray(ev.kvgrad_LGT), 3, axis=-1)
  )


def test_missing_or_bad_evidence_is_named():
  with pytest.raises(ValueError, match="kvgrad_LGT"):
    KVgrad().scores(policies.Evidence())
  with pytest.raises(ValueError, match="kvgrad_LGT"):
    kvgrad_scores(jnp.zeros((2, 40)))
  with pytest.raises(ValueError, match="kvgrad_LGT"):
    kvgrad_scores(jnp.zeros((2, 2, 40), jnp.int32))


@pytest.mark.parametrize(
  "options, match",
  [
    ({"sinks": -1}, "sinks"),
    ({"sinks": 2.0}, "sinks"),
    ({"allocator": policies.Uniform(), "sinks": 1.5}, "sinks"),
  ],
)
def test_bad_options_refused(options, match):
  with pytest.raises(ValueError, match=match):
    KVgrad(**options)


def test_bad_evidence_arguments_refused(tiny):
  model, cfg, params = tiny
  ids = np.arange(10, 30)
  t = calibrate.KVzipTemplate((5, 6), (7,), (3,))
  cases = [
    ("context_ids", lambda: kvgrad.kvgrad_evidence(model, np.zeros((1, 0), int), t)),
    ("context_ids", lambda: kvgrad.kvgrad_evidence(model, np.zeros((1, 2, 3), int), t)),
    ("context_ids", lambda: kvgrad.kvgrad_evidence(model, [cfg.vocab_size], t)),
    (
      "chunk_size",
      lambda: kvgrad.kvgrad_evidence(model, ids, t, options=calibrate.KVzipOptions(chunk_size=0)),
    ),
    (
      "chunk_size",
      lambda: kvgrad.kvgrad_evidence(model, ids, t, options=calibrate.KVzipOptions(chunk_size=4.0)),
    ),
    (
      "n_sink",
      lambda: kvgrad.kvgrad_evidence(model, ids, t, options=calibrate.KVzipOptions(n_sink=-1)),
    ),
    (
      "options.plus",
      lambda: kvgrad.kvgrad_evidence(model, ids, t, options=calibrate.KVzipOptions(plus=True)),
    ),
    ("template", lambda: kvgrad.kvgrad_evidence(model, ids, (1, 2))),
    (
      "template.first_ids",
      lambda: kvgrad.kvgrad_evidence(
        model, ids, calibrate.KVzipTemplate((cfg.vocab_size,), (7,), (3,))
      ),
    ),
    (
      "prefix_length",
      lambda: kvgrad.kvgrad_evidence(
        model, ids, calibrate.KVzipTemplate((5,), (7,), (3,), prefix_length=20)
      ),
    ),
  ]
  for match, call in cases:
    with pytest.raises(ValueError, match=match):
      call()


@pytest.mark.skipif(
  "kvgrad_LGT" not in cache_lib.ROW_EVIDENCE,
  reason="kvgrad_LGT is not caller-given evidence of the model cache yet",
)
def test_through_the_model_keeps_kvpress_set(fx):
  """``km.keep_mask`` on the checkpoint with kvpress's evidence given per row: kvpress's kept
  set (each KV head's set repeated over its query heads at query-head granularity)."""
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  ids = fx["input_ids_T"][None].astype(np.int32)
  T = ids.shape[1]
  evidence = {"kvgrad_LGT": fx["kvgrad_kvgrad_LGT"][:, None]}
  keep = np.asarray(km.keep_mask(model, ids, KVgrad(), T // 2, evidence=evidence))[:, 0]
  ref = fx["kvgrad_keep_LGT"]
  np.testing.assert_array_equal(keep, np.repeat(ref, keep.shape[1] // ref.shape[1], axis=1))
