"""Issue 15's methods: kept counts, protection, per-layer/per-head and traced budgets, and
hand-computed cases (R-KV has no kvpress press; kvpress goldens are in test_kvpress_golden)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import policies, scores, select

L, HQ, G, T, D, W = 2, 4, 2, 40, 8, 8

NEW = (
  "keydiff",
  "lagkv",
  "expected_attention",
  "qfilter",
  "duo_attention",
  "kvzip",
  "rkv",
  "critical_snapkv",
  "critical_adakv_snapkv",
  "chunkkv_snapkv",
)
# small-T settings that make every method compress (LagKV's lag 128 and Duo's 128 sinks do not)
SMALL = {"lagkv": dict(lag=4), "duo_attention": dict(sinks=2), "chunkkv_snapkv": dict(chunk=6)}
# what each keeps whatever the budget (>= 1): sinks / window positions
PROTECTED = {
  "lagkv": np.r_[0:4],
  "expected_attention": np.r_[0:4],
  "kvzip": np.r_[0:4],
  "rkv": np.r_[T - 8 : T],
  "critical_snapkv": np.r_[T - W : T],
  "critical_adakv_snapkv": np.r_[T - W : T],
}


@pytest.fixture(scope="module")
def evidence():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(L, HQ, T, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(L, G, T, D)), jnp.float32)
  rope = scores.average_rope(1e4 ** -(np.arange(D // 2) / (D // 2)), T)
  mean, cov = scores.expected_query_stats(q, rope)
  return policies.evidence_from_qk(q, k, window=W, column_sums=False).replace(
    values_LGTD=jnp.asarray(rng.normal(size=k.shape), jnp.float32),
    value_out_norms_LHT=jnp.asarray(rng.random((L, HQ, T)) + 0.5, jnp.float32),
    query_mean_LHD=mean,
    query_cov_LHDD=cov,
    window_queries_LHWD=q[:, :, -W:],
    qfilters_LGD=jnp.asarray(rng.normal(size=(L, G, D)), jnp.float32),
    retrieval_heads_LG=jnp.asarray([[0.9, 0.1], [0.3, 0.6]], jnp.float32),
    reconstruction_attn_LGT=jnp.asarray(rng.random((L, G, T)), jnp.float32),
  )


def make(name, **options):
  return policies.make(name, **SMALL.get(name, {}), **options)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("budget", [W + 2, 17, T + 5])
def test_kept_count_and_protection(evidence, name, budget):
  policy = make(name)
  s = policy.scores(evidence)
  budget_LH = np.asarray(policy.budgets(evidence, s, budget))
  keep = np.asarray(policy.keep_mask(evidence, budget))
  np.testing.assert_array_equal(keep.sum(-1), np.minimum(budget_LH, T))
  if name in PROTECTED:
    assert keep[..., PROTECTED[name]].all(), name
  if budget >= T:
    assert keep.all()
  if not policy.allocates:
    assert (budget_LH == budget).all()


@pytest.mark.parametrize("name", [n for n in NEW if not policies.make(n).allocates])
def test_per_layer_and_per_head_budgets(evidence, name):
  policy = make(name)
  H = policy.scores(evidence).shape[1]
  per_layer = np.asarray([12, 20], np.int32)
  per_head = 10 + np.arange(L * H, dtype=np.int32).reshape(L, H)
  for budget in (per_layer, per_head):
    keep = np.asarray(policy.keep_mask(evidence, budget))
    expected = np.broadcast_to(budget if budget.ndim == 2 else budget[:, None], keep.shape[:2])
    if name == "critical_adakv_snapkv":  # Ada-KV moves budget across heads, layer totals hold
      np.testing.assert_array_equal(keep.sum((-1, -2)), expected.sum(-1))
    else:
      np.testing.assert_array_equal(keep.sum(-1), expected)


@pytest.mark.parametrize("name", NEW)
def test_budgets_are_traced_data(evidence, name):
  policy = make(name)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def sweep(budgets_K):
    return jax.vmap(lambda b: policy.keep_mask(evidence, b, capacity=T))(budgets_K)

  budgets_K = jnp.asarray([W + 2, 14, 23, 31], jnp.int32)
  masks = np.asarray(sweep(budgets_K))
  sweep(budgets_K + 3)  # new budget values: no retrace
  for i, b in enumerate(np.asarray(budgets_K)):
    np.testing.assert_array_equal(masks[i], np.asarray(policy.keep_mask(evidence, int(b))))
  chex.clear_trace_counter()


# --------------------------------------------------------------------------- hand-computed cases


def test_rkv_matches_a_direct_numpy_reading_of_the_official_code():
  rng = np.random.default_rng(3)
  q = rng.normal(size=(1, 2, 3, 4)).astype(np.float32)  # 2 query heads, 1 KV head, 3 queries
  k = rng.normal(size=(1, 1, 9, 4)).astype(np.float32)
  k[0, 0, 5] = k[0, 0, 2] * 2.0  # a duplicate direction: one of the pair is exempted
  window, lam = 3, 0.07
  # importance: max over the group of the logits, softmax over the prefix, mean, maxpool 7
  logits = np.einsum("hwd,td->hwt", q[0], k[0, 0, : 9 - window]) / 2.0
  p = np.exp(logits.max(0) - logits.max(0).max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).mean(0)
  pad = np.pad(p, 3, constant_values=-np.inf)
  importance = np.array([pad[i : i + 7].max() for i in range(6)])
  # redundancy: cosine, diagonal 0, last similar neighbour exempted, column mean, softmax
  kn = k[0, 0] / (np.linalg.norm(k[0, 0], axis=-1, keepdims=True) + 1e-8)
  cos = kn @ kn.T
  np.fill_diagonal(cos, 0.0)
  for i in range(9):
    above = np.nonzero(cos[i] > 0.5)[0]
    cos[i, above.max() if above.size else 0] = 0.0
  r = np.exp(cos.mean(0)) / np.exp(cos.mean(0)).sum()
  expected = lam * importance - (1 - lam) * r[:6]
  ours = np.asarray(scores.rkv(jnp.asarray(q), jnp.asarray(k), window=window))
  np.testing.assert_allclose(ours[0, 0, :6], expected, rtol=1e-5, atol=1e-7)
  assert np.isinf(ours[0, 0, 6:]).all()


def test_rkv_registry_entry_is_decode_time_every_128():
  rkv = policies.make("rkv")
  assert rkv.acts_at_decode and not rkv.evicts_each_step and rkv.decode_every == 128


def test_keydiff_by_hand():
  k = np.array([[[[1.0, 0.0], [1.0, 0.1], [0.0, 3.0]]]], np.float32)
  a = (k[0, 0] / np.linalg.norm(k[0, 0], axis=-1, keepdims=True)).mean(0)
  expected = -(k[0, 0] @ a) / (np.linalg.norm(k[0, 0], axis=-1) * np.linalg.norm(a))
  np.testing.assert_allclose(np.asarray(scores.keydiff(jnp.asarray(k)))[0, 0], expected, rtol=1e-6)
  assert int(np.argmax(expected)) == 2  # the odd key out is kept first


def test_lagkv_partition_and_short_prompt():
  rng = np.random.default_rng(1)
  k = jnp.asarray(rng.normal(size=(1, 1, 23, 3)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, 1, 23, 3)), jnp.float32)
  s = np.asarray(scores.lagkv(k, v, lag=4, sinks=2))[0, 0]
  # 21 = 5 chunks of 4 + 1: chunks 0..3 scored (positions 2..17), tail = last chunk + remainder
  assert np.isinf(s[:2]).all() and np.isinf(s[18:]).all() and np.isfinite(s[2:18]).all()
  for c in range(4):
    np.testing.assert_array_equal(np.sort(s[2 + 4 * c : 6 + 4 * c]), [0, 0.25, 0.5, 0.75])
  short = np.asarray(scores.lagkv(k[:, :, :9], v[:, :, :9], lag=4, sinks=2))
  np.testing.assert_array_equal(short, np.asarray(scores.streaming(9, (1, 1), sinks=2)))


def test_chunkkv_keeps_whole_chunks_then_the_next_chunks_best_tokens():
  base = np.zeros((1, 2, 10), np.float32)
  base[0, :, 4:8] = [[1, 5, 2, 3], [1, 5, 2, 3]]  # chunk 1 (of 4) is best; chunk 2 (2 tokens) next
  base[0, :, 8:] = 2.0
  order = scores.chunkkv(jnp.asarray(base), chunk=4)
  keep = np.asarray(select.top_mask(order, jnp.int32(5)))
  np.testing.assert_array_equal(keep[0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(keep[0, 0], keep[0, 1])  # shared across heads
  keep4 = np.asarray(select.top_mask(order, jnp.int32(2)))  # inside a chunk: its best tokens
  np.testing.assert_array_equal(np.nonzero(keep4[0, 0])[0], [5, 7])


def test_duo_attention_heads_and_budget(evidence):
  policy = policies.make("duo_attention", sinks=2, head_compression_ratio=0.5)
  keep = np.asarray(policy.keep_mask(evidence, 7))
  streaming = np.asarray(scores.duo_streaming_heads(evidence.retrieval_heads_LG, 0.5))
  np.testing.assert_array_equal(streaming, [[False, True], [True, False]])  # gates 0.1 and 0.3
  assert keep[~streaming].all()
  for row in keep[streaming]:
    np.testing.assert_array_equal(np.nonzero(row)[0], [0, 1, T - 5, T - 4, T - 3, T - 2, T - 1])
  with pytest.raises(ValueError, match="allocates its own budget_LH"):
    policy.keep_mask(evidence, np.asarray([7, 8]))
  assert round(4 * 0.625) == 2 and scores.duo_streaming_heads(jnp.ones((2, 2)), 0.625).sum() == 2


def test_kvzip_pools_over_every_layer_and_head(evidence):
  for layerwise in (False, True):
    policy = policies.make("kvzip", layerwise=layerwise)
    s = policy.scores(evidence)
    budget_LH = np.asarray(policy.budgets(evidence, s, 12))
    if layerwise:
      assert (budget_LH.sum(-1) == 12 * G).all()
    else:
      assert budget_LH.sum() == 12 * G * L and len(np.unique(budget_LH)) > 1
    keep = np.asarray(policy.keep_mask(evidence, 12))
    assert keep[..., :4].all()
    finite = np.where(np.isinf(np.asarray(s)), np.inf, np.asarray(s))
    low = np.where(keep, finite, np.inf).min(axis=(-1, -2) if layerwise else None)
    high = np.where(keep, -np.inf, finite).max(axis=(-1, -2) if layerwise else None)
    assert np.all(low >= high)  # one pooled top-k


def test_think_channels_and_composition(evidence):
  cs = scores.think_channel_scores(evidence.window_queries_LHWD, evidence.keys_LGTD)
  q2 = np.square(np.asarray(evidence.window_queries_LHWD)).mean(2).reshape(L, G, 2, D).mean(2)
  np.testing.assert_allclose(
    np.asarray(cs), q2 * np.square(np.asarray(evidence.keys_LGTD)).mean(2), rtol=1e-6
  )
  keep = np.asarray(scores.think_channel_mask(cs, 0.3))
  assert (keep.sum(-1) == D - int(D * 0.3)).all()
  kept_scores = np.where(keep, np.asarray(cs), np.inf).min(-1)
  assert np.all(kept_scores >= np.where(keep, -np.inf, np.asarray(cs)).max(-1))
  assert policies.make("snapkv", channel_ratio=0.5).channel_ratio == 0.5
  assert policies.make("think_snapkv").channel_ratio == 0.5
  think = policies.make("think")
  assert np.asarray(think.keep_mask(evidence, T)).all()
  with pytest.raises(ValueError, match="keeps every token"):
    think.keep_mask(evidence, T - 1)


def test_average_rope_is_the_mean_rotation():
  inv = 1e4 ** -(np.arange(2) / 2)
  R = np.asarray(scores.average_rope(inv, 5, 3))
  q = np.array([0.3, -1.0, 2.0, 0.5], np.float32)

  def rope(x, p):
    f = np.concatenate([p * inv, p * inv])
    return x * np.cos(f) + np.concatenate([-x[2:], x[:2]]) * np.sin(f)

  np.testing.assert_allclose(R @ q, np.mean([rope(q, p) for p in (5, 6, 7)], 0), rtol=1e-5)


def test_expected_attention_by_hand_and_without_covariance(evidence):
  mu, cov = evidence.query_mean_LHD, evidence.query_cov_LHDD
  k, v = evidence.keys_LGTD, evidence.values_LGTD
  ours = np.asarray(
    scores.expected_attention(mu, cov, k, v, options=scores.ExpectedAttentionOptions(sinks=4))
  )
  kk = np.repeat(np.asarray(k)[:, :, 4:], 2, axis=1)
  z = np.einsum("lhd,lhtd->lht", np.asarray(mu), kk) / math.sqrt(D)
  z += np.einsum("lhti,lhij,lhtj->lht", kk, np.asarray(cov), kk) / D / 2
  p = np.exp(z - z.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).reshape(L, G, 2, T - 4).mean(2)
  p *= np.linalg.norm(np.asarray(v)[:, :, 4:], axis=-1)
  np.testing.assert_allclose(ours[..., 4:], p, rtol=2e-4, atol=1e-8)
  plain = policies.make("expected_attention", use_covariance=False, use_vnorm=False)
  no_cov = evidence.replace(query_cov_LHDD=None, values_LGTD=None)
  assert np.asarray(plain.keep_mask(no_cov, 10)).sum(-1).tolist() == [[10, 10], [10, 10]]


def test_critical_first_stage_is_the_base_top(evidence):
  policy = policies.make("critical_knorm", first_stage_ratio=0.5)
  base = np.asarray(policies.make("knorm").scores(evidence))
  keep = np.asarray(policy.keep_mask(evidence, 10))
  top5 = np.argsort(-base, axis=-1, kind="stable")[..., :5]
  assert np.take_along_axis(keep, top5, -1).all()
  assert (keep.sum(-1) == 10).all()
  off = policies.make("critical_knorm", first_stage_ratio=0.0)
  norms = scores.group_norms(evidence.value_out_norms_LHT, G)
  plain = select.top_mask((jnp.asarray(base) + 1e-4) * norms, jnp.int32(10))
  np.testing.assert_array_equal(np.asarray(off.keep_mask(evidence, 10)), np.asarray(plain))


def test_critical_keeps_sentinels_whatever_the_norm():
  s = jnp.asarray([[[jnp.inf, -jnp.inf, 0.5, 0.2]]], jnp.float32)
  norms = jnp.asarray([[[0.0, 0.0, 2.0, 0.0]]], jnp.float32)
  out = np.asarray(scores.critical(s, norms, jnp.zeros(s.shape, bool)))
  np.testing.assert_allclose(out, [[[np.inf, -np.inf, (0.5 + 1e-4) * 2.0, 0.0]]])


def test_wrappers_resolve_and_refuse(evidence):
  assert "critical_knorm" not in policies.names()
  assert policies.make("chunkkv_knorm").evidence_fields == {"keys_LGTD"}
  for name, match in (
    ("critical_h2o", "not a budget-free prefill scorer"),
    ("chunkkv_pyramidkv", "takes its budget as given"),
    ("critical_adakv_cake", "takes its budget as given"),
    ("critical_nope", "wraps an unknown policy 'nope'"),
    ("critical_critical_snapkv", "not a budget-free prefill scorer"),
  ):
    with pytest.raises(ValueError, match=match):
      policies.make(name)


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("snapkv", dict(decode_every=0), "decode_every: expected an int >= 1"),
    ("snapkv", dict(decode_every=2.0), "decode_every: expected an int >= 1"),
    ("h2o", dict(decode_every=4), "decode_every: policy 'h2o' evicts at every step already"),
    ("snapkv", dict(channel_ratio=1.0), "channel_ratio: expected a fraction"),
    ("snapkv", dict(channel_ratio=-0.1), "channel_ratio: expected a finite value"),
    ("lagkv", dict(lag=0), "lag: expected an int >= 1"),
    ("chunkkv_snapkv", dict(chunk=True), "chunk: expected an int >= 1"),
    ("expected_attention", dict(use_vnorm=1), "use_vnorm: expected a bool"),
    ("kvzip", dict(layerwise="yes"), "layerwise: expected a bool"),
    ("critical_snapkv", dict(first_stage_ratio=1.5), "first_stage_ratio: expected a finite"),
    ("critical_snapkv", dict(epsilon=-1.0), "epsilon: expected a finite value"),
    ("duo_attention", dict(head_compression_ratio=2.0), "head_compression_ratio: expected"),
    ("rkv", dict(mix_lambda=1.5), "mix_lambda: expected a finite value"),
  ],
)
def test_new_options_are_validated_at_make(name, options, match):
  with pytest.raises(ValueError, match=match):
    policies.make(name, **options)


def test_decode_every_on_prefill_policies():
  for name in ("snapkv", "expected_attention", "critical_snapkv", "kvzip"):
    assert policies.make(name, decode_every=64).decode_every == 64
    assert policies.make(name).decode_every is None


def test_missing_evidence_names_the_field(evidence):
  with pytest.raises(ValueError, match="evidence.value_out_norms_LHT"):
    policies.make("critical_snapkv").keep_mask(evidence.replace(value_out_norms_LHT=None), 12)
  with pytest.raises(ValueError, match="evidence.qfilters_LGD"):
    policies.make("qfilter").keep_mask(evidence.replace(qfilters_LGD=None), 12)
