"""The policy registry: every policy runs, keeps its budget, and validates its options."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import policies, scores, select

L, HQ, G, T, D, W = 3, 4, 2, 64, 8, 8


@pytest.fixture(scope="module")
def evidence():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(L, HQ, T, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(L, G, T, D)), jnp.float32)
  ev = policies.evidence_from_qk(q, k, window=W, rng=jax.random.key(1))
  future = jax.nn.softmax(jnp.asarray(rng.normal(size=(L, HQ, 5, T)), jnp.float32), -1)
  head_scores = jnp.asarray(rng.random((L, HQ)) + 0.1, jnp.float32)
  return ev.replace(
    future_attn_LHST=future, head_scores_LH=head_scores, **new_method_evidence(rng, q, k)
  )


def new_method_evidence(rng, q, k) -> dict:
  """Issue 15's evidence fields for queries ``q [L, Hq, T, D]`` and keys ``k [L, G, T, D]``."""
  L, G, T, D = k.shape
  mean, cov = scores.expected_query_stats(
    q, scores.average_rope(1e4 ** -(np.arange(D // 2) / (D // 2)), T)
  )
  return dict(
    values_LGTD=jnp.asarray(rng.normal(size=k.shape), jnp.float32),
    value_out_norms_LHT=jnp.asarray(rng.random((L, q.shape[1], T)) + 0.5, jnp.float32),
    query_mean_LHD=mean,
    query_cov_LHDD=cov,
    window_queries_LHWD=q[:, :, -W:],
    queries_LHTD=q,
    prerope_keys_LGTD=jnp.asarray(rng.normal(size=k.shape), jnp.float32),
    qfilters_LGD=jnp.asarray(rng.normal(size=(L, G, D)), jnp.float32),
    retrieval_heads_LG=jnp.asarray(rng.random((L, G)), jnp.float32),
    reconstruction_attn_LGT=jnp.asarray(rng.random((L, G, T)), jnp.float32),
    reconstruction_attn_LHT=jnp.asarray(rng.random((L, q.shape[1], T)), jnp.float32),
    kvgrad_LGT=jnp.asarray(rng.random((L, G, T)), jnp.float32),
    kvzap_LGT=jnp.asarray(rng.normal(size=(L, G, T)), jnp.float32),
    fastkvzip_LGT=jnp.asarray(rng.random((L, G, T)), jnp.float32),
  )


def required_options(name: str, L: int, G: int) -> dict:
  """The options a registered policy cannot run without: LU-KV's budget curve (here each head
  prunes the curve row's ratio)."""
  if name == "lukv":
    return {"curve": np.broadcast_to(np.arange(1, 100)[:, None, None] / 100, (99, L, G))}
  return {}


@pytest.mark.parametrize("name", policies.names())
@pytest.mark.parametrize("budget", [W + 4, 24, T, T + 10])
def test_every_policy_keeps_its_allocation(evidence, name, budget):
  policy = policies.make(name, **required_options(name, L, G))
  if policy.allocator.keeps_all and budget < T:  # ThinK and the full cache keep every token
    with pytest.raises(ValueError, match="keeps every token"):
      policy.keep_mask(evidence, budget)
    return
  scores_LHT = policy.scores(evidence)
  budget_LH = np.asarray(policy.budgets(evidence, scores_LHT, budget))
  keep = np.asarray(policy.keep_mask(evidence, budget))
  assert keep.shape == scores_LHT.shape
  np.testing.assert_array_equal(keep.sum(-1), np.minimum(budget_LH, scores_LHT.shape[-1]))
  # The reference "no compression when the prompt fits" guard, for every policy. HeadKV's guard
  # is strict (``base_capacity > q_len - w``): at budget == T it still moves budget across heads.
  if budget > T or (budget == T and name != "headkv"):
    assert keep.all(), name


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "adakv_snapkv", "cake", "h2o", "tova"])
def test_window_is_protected(evidence, name):
  keep = np.asarray(policies.make(name).keep_mask(evidence, 20))
  if name == "tova":  # TOVA protects nothing; it must still keep exactly 20
    assert (keep.sum(-1) == 20).all()
  else:
    assert keep[..., T - W :].all()


def test_group_to_kv_heads(evidence):
  policy = policies.make("snapkv_kvpress", num_kv_heads=G)
  keep = policy.keep_mask(evidence, 16)
  assert keep.shape == (L, G, T) and (np.asarray(keep).sum(-1) == 16).all()


def test_pyramid_budgets_vary_by_layer(evidence):
  policy = policies.make("pyramidkv", pyramid_mode="exact_total")
  scores_LHT = policy.scores(evidence)
  budget_LH = np.asarray(policy.budgets(evidence, scores_LHT, 24))
  assert budget_LH[0, 0] > budget_LH[-1, 0] and budget_LH.sum() == 24 * L * HQ


def test_compact_matches_keep_mask(evidence):
  policy = policies.make("adakv_snapkv")
  keep = np.asarray(policy.keep_mask(evidence, 20))
  idx, valid = policy.compact(evidence, 20, capacity=T)
  rebuilt = np.zeros_like(keep)
  for l, h in np.ndindex(L, HQ):
    rebuilt[l, h, np.asarray(idx[l, h])[np.asarray(valid[l, h])]] = True
  np.testing.assert_array_equal(rebuilt, keep)


@pytest.mark.parametrize("name", ["pyramidkv", "adakv_snapkv", "headkv", "cake", "snapkv"])
def test_vmap_over_budgets_single_trace(evidence, name):
  policy = policies.make(name)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def sweep(budgets_C):
    return jax.vmap(lambda b: policy.keep_mask(evidence, b, capacity=T))(budgets_C)

  budgets_C = jnp.asarray([12, 20, 33, 48], jnp.int32)
  masks = np.asarray(sweep(budgets_C))
  sweep(budgets_C + 1)
  for c, b in enumerate(np.asarray(budgets_C)):
    np.testing.assert_array_equal(masks[c], np.asarray(policy.keep_mask(evidence, int(b))))
  chex.clear_trace_counter()


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("snapkvv", {}, "name: unknown policy 'snapkvv'"),
    ("snapkv", dict(kernel=4), "kernel: expected a positive odd"),
    ("snapkv", dict(pool="median"), "pool: unknown value 'median'"),
    ("snapkv", dict(sinks=4), r"options: \['sinks'\] are not options"),
    ("h2o", dict(form="x"), "form: unknown value"),
    ("pyramidkv", dict(pyramid_mode="floor"), "pyramid_mode: unknown value"),
    ("adakv_snapkv", dict(adakv_mode="x"), "adakv_mode: unknown value"),
    ("snapkv", dict(num_kv_heads=0), "num_kv_heads: expected a positive int"),
    ("snapkv", dict(gqa="median"), "gqa: unknown value"),
  ],
)
def test_bad_policy_options(name, options, match):
  with pytest.raises(ValueError, match=match):
    policies.make(name, **options)


def test_missing_evidence_and_bad_budget_shape(evidence):
  with pytest.raises(ValueError, match="evidence.future_attn_LHST"):
    policies.make("oracle").keep_mask(policies.Evidence(keys_LGTD=evidence.keys_LGTD), 10)
  with pytest.raises(ValueError, match="budget: shape"):
    policies.make("snapkv").keep_mask(evidence, jnp.ones((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="budget: expected non-negative"):
    policies.make("snapkv").keep_mask(evidence, -1)


def test_oracle_beats_every_policy_on_future_mass(evidence):
  fut = np.asarray(evidence.future_attn_LHST).sum(2)
  masses = {}
  for name in ("oracle", "snapkv", "h2o", "sliding_window", "random", "knorm"):
    policy = policies.make(name, num_kv_heads=None)
    keep = np.asarray(policy.keep_mask(evidence, 16))
    if keep.shape[1] != HQ:
      keep = np.repeat(keep, HQ // keep.shape[1], axis=1)
    masses[name] = float((fut * keep).sum())
  assert masses["oracle"] >= max(masses.values()) - 1e-6
  assert select.kept_count(jnp.ones((2, 3), bool)).tolist() == [3, 3]


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("adakv_snapkv", dict(floor_alpha=1.5), "floor_alpha: expected a finite value"),
    ("adakv_snapkv", dict(normalize=1), "normalize: expected a bool"),
    ("snapkv", dict(window=-1), "window: expected None or an int >= 1"),
    ("snapkv", dict(window=0), "window: expected None or an int >= 1"),
    ("snapkv", dict(window=8.0), "window: expected None or an int >= 1"),
    ("streaming_llm", dict(sinks=-2), "sinks: expected a non-negative count"),
    ("streaming_llm", dict(sinks=2.5), "sinks: expected an integer count"),
    ("h2o", dict(recent=-1), "recent: expected a non-negative count"),
    ("pyramidkv", dict(beta=0), "beta: expected a finite value with beta >= 1"),
    ("adakv_pyramidkv", dict(beta=0.5), "beta: expected a finite value with beta >= 1"),
    ("headkv", dict(beta=1.0), "beta: expected a finite value with beta > 1"),
    ("headkv", dict(temp=0.0), "temp: expected a finite value with temp > 0"),
    ("cake", dict(gamma=-1.0), "gamma: expected a finite value with gamma >= 0"),
    ("cake", dict(tau1=0.0), "tau1: expected a finite value with tau1 > 0"),
    ("cake", dict(tau2=float("nan")), "tau2: expected a finite value"),
    ("snapkv", dict(kernel=2**31 + 1), "kernel: expected a positive odd"),
  ],
)
def test_every_option_is_validated_at_make(name, options, match):
  with pytest.raises(ValueError, match=match):
    policies.make(name, **options)


def test_sinks_may_be_traced_data(evidence):
  @jax.jit
  def keep(sinks):
    return policies.make("streaming_llm", sinks=sinks).keep_mask(evidence, 10)

  np.testing.assert_array_equal(
    np.asarray(keep(jnp.int32(3))),
    np.asarray(policies.make("streaming_llm", sinks=3).keep_mask(evidence, 10)),
  )


@pytest.mark.parametrize(
  "name, budget, match",
  [
    ("snapkv", W, f"budget: {W} does not exceed the protected window {W}"),
    ("snapkv", 4, f"budget: 4 does not exceed the protected window {W} .* = {W + 1}"),
    ("pyramidkv", W, "does not exceed the protected window"),
    ("cake", 3, "does not exceed the protected window"),
    ("sliding_window", 0, "budget: 0 keeps nothing"),
    ("h2o", 0, "budget: 0 keeps nothing"),
    ("sliding_window", np.int64(2**32 + 12), "budget: 4294967308 does not fit int32"),
    ("pyramidkv", 2**40, "budget: 1099511627776 does not fit int32"),
    ("pyramidkv", np.asarray([20, 24, 28]), "budget: policy 'pyramidkv' allocates its own"),
    ("cake", np.full((L, HQ), 20), "expected a scalar, got shape"),
  ],
)
def test_policy_budgets_that_cannot_be_honoured_raise(evidence, name, budget, match):
  with pytest.raises(ValueError, match=match):
    policies.make(name).keep_mask(evidence, budget)


def test_policy_keeps_exactly_above_the_window(evidence):
  keep = np.asarray(policies.make("snapkv").keep_mask(evidence, W + 1))
  assert (keep.sum(-1) == W + 1).all() and keep[..., T - W :].all()


def test_evidence_window_is_validated():
  q, k = jnp.zeros((1, 2, 8, 4)), jnp.zeros((1, 1, 8, 4))
  with pytest.raises(ValueError, match="window: expected an int >= 1"):
    policies.evidence_from_qk(q, k, window=0)
  with pytest.raises(ValueError, match="legacy_window: expected an int >= 0"):
    policies.evidence_from_qk(q, k, legacy_window=-1)
  with pytest.raises(ValueError, match="queries: expected a rank-4 array"):
    policies.evidence_from_qk(q[0], k)
