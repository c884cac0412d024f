"""kvpress 0.5.5's combinators as kvjax policies: golden kept sets and properties.

The fixture ``tests/fixtures/kvpress_0_5_5_combinators.npz`` comes from
``tests/make_kvpress_fixtures_combinators.py`` (run in a torch venv).
"""

import json
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import policies, select
from kvjax.policies import combinators as comb
from kvjax.policies.per_layer import PerLayer

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "kvpress_0_5_5_combinators.npz"
T = 48
SNAP = policies.make("snapkv_kvpress", window=8, num_kv_heads=2)


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


def evidence(fx, attn):
  k = jnp.asarray(fx[f"{attn}_keys_LGTD"])
  q = jnp.asarray(fx[f"{attn}_queries_LHTD"])
  return policies.evidence_from_qk(q, k, window=8, column_sums=False)


def kept(policy, ev, budget):
  return np.asarray(policy.keep_mask(ev, budget))


# --------------------------------------------------------------------------- golden


@pytest.mark.parametrize("relative", [True, False])
def test_per_layer_snapkv(fx, relative):
  ev = evidence(fx, "eager")
  policy = policies.SnapKV(
    kernel=5,
    pool="avg",
    reduce="mean",
    window=8,
    num_kv_heads=2,
    allocator=PerLayer(compression_ratios=(0.25, 0.75), relative=relative),
  )
  budget = 24 if relative else T  # relative: the mean budget; absolute: a cap >= T
  ours = kept(policy, ev, budget)
  np.testing.assert_array_equal(ours.sum(-1), [[36, 36], [12, 12]])
  np.testing.assert_array_equal(ours, fx["per_layer_snapkv_keep_LGT"])


def test_per_layer_knorm(fx):
  ev = evidence(fx, "eager")
  policy = policies.KNorm(allocator=PerLayer(compression_ratios=(0.75, 0.5)))
  np.testing.assert_array_equal(kept(policy, ev, 18), fx["per_layer_knorm_keep_LGT"])


@pytest.mark.parametrize(
  "name, second, ratio, budget",
  [
    ("composed_snapkv_knorm", policies.KNorm(), 0.5, 12),
    ("composed_snapkv_keydiff", policies.KeyDiff(), 0.5, 18),
  ],
)
def test_composed_after_snapkv(fx, name, second, ratio, budget):
  ev = evidence(fx, "eager")
  policy = comb.Composed(stages=(SNAP, second), compression_ratios=(ratio,), num_kv_heads=2)
  np.testing.assert_array_equal(kept(policy, ev, budget), fx[f"{name}_keep_LGT"])


def test_composed_knorm_keydiff(fx):
  ev = evidence(fx, "eager")
  policy = comb.Composed(stages=(policies.KNorm(), policies.KeyDiff()), compression_ratios=(0.5,))
  np.testing.assert_array_equal(kept(policy, ev, 12), fx["composed_knorm_keydiff_keep_LGT"])


@pytest.mark.parametrize(
  "name, base, chunk",
  [
    ("chunk10_knorm", policies.KNorm(), 10),
    ("chunk10_keydiff", policies.KeyDiff(), 10),
    ("chunk16_keydiff", policies.KeyDiff(), 16),
  ],
)
def test_chunked(fx, name, base, chunk):
  ev = evidence(fx, "sdpa")
  policy = comb.Chunked(base=base, chunk=chunk)
  np.testing.assert_array_equal(kept(policy, ev, 24), fx[f"{name}_keep_LGT"])


@pytest.mark.parametrize(
  "name, base, block",
  [
    ("block8_keydiff", policies.KeyDiff(), 8),
    ("block5_keydiff", policies.KeyDiff(), 5),
    ("block8_knorm", policies.KNorm(), 8),
  ],
)
def test_blockwise(fx, name, base, block):
  ev = evidence(fx, "sdpa")
  policy = comb.Blockwise(base=base, block=block)
  np.testing.assert_array_equal(kept(policy, ev, 24), fx[f"{name}_keep_LGT"])


def test_blockwise_keydiff_differs_from_global_keydiff(fx):
  ev = evidence(fx, "sdpa")
  ref = fx["block8_keydiff_keep_LGT"]
  assert (kept(policies.KeyDiff(), ev, 24) != ref).any()


def test_composed_with_think_is_channel_ratio(fx):
  policy = comb.Composed(stages=(SNAP, policies.ThinK(channel_ratio=0.5)), num_kv_heads=2)
  assert policy.channel_ratio == 0.5 and policy.token_stages == (SNAP,)
  ev = evidence(fx, "eager")
  np.testing.assert_array_equal(kept(policy, ev, 24), kept(SNAP, ev, 24))


# --------------------------------------------------------------------------- properties


def random_evidence(seed=0, L=2, Hq=4, G=2, T=40, D=8):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (L, Hq, T, D))
  k = jax.random.normal(kk, (L, G, T, D))
  ev = policies.evidence_from_qk(q, k, window=8, column_sums=False)
  return ev.replace(values_LGTD=jax.random.normal(kv, (L, G, T, D)))


POLICIES = {
  "composed": lambda: comb.Composed(
    stages=(policies.KNorm(), policies.KeyDiff()), compression_ratios=(0.25,)
  ),
  "chunked": lambda: comb.Chunked(base=policies.KeyDiff(), chunk=7),
  "blockwise": lambda: comb.Blockwise(base=policies.KeyDiff(), block=6),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_kept_counts_per_head_budgets(name):
  ev = random_evidence()
  budget_LH = jnp.asarray([[3, 9], [17, 30]], jnp.int32)
  policy = POLICIES[name]()
  keep = np.asarray(policy.keep_mask(ev, budget_LH))  # the keys' KV heads
  assert keep.shape == (2, 2, 40)
  np.testing.assert_array_equal(keep.sum(-1), np.asarray(budget_LH))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_query_head_granularity(name):
  ev = random_evidence()
  policy = POLICIES[name]()
  ev_q = ev.replace(value_out_norms_LHT=jnp.ones((2, 4, 40)))
  keep = np.asarray(policy.keep_mask(ev_q, 10))
  assert keep.shape == (2, 2, 40)  # keys are per KV head: the scores are too
  assert (keep.sum(-1) == 10).all()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_traced_budgets_do_not_retrace(name):
  ev = random_evidence()
  policy = POLICIES[name]()

  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(ev, budget):
    return policy.keep_mask(ev, budget).sum(-1)

  for b in (5, 11, 20):
    out = np.asarray(f(ev, jnp.int32(b)))
    assert (out == b).all()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_budget_at_least_T_keeps_everything(name):
  ev = random_evidence()
  assert np.asarray(POLICIES[name]().keep_mask(ev, 40)).all() or name == "composed"


def test_composed_caps_at_the_earlier_stage():
  ev = random_evidence()
  policy = POLICIES["composed"]()  # knorm keeps int(40 * 0.75) = 30, then keydiff
  keep = np.asarray(policy.keep_mask(ev, 40))
  assert (keep.sum(-1) == 30).all()
  first = np.asarray(policies.KNorm().keep_mask(ev, 30))
  assert not (keep & ~first).any()


def test_chunked_spreads_the_budget_over_chunks():
  ev = random_evidence()
  keep = np.asarray(comb.Chunked(base=policies.KNorm(), chunk=10).keep_mask(ev, 20))
  per_chunk = keep.reshape(2, 2, 4, 10).sum(-1)
  assert (per_chunk == 5).all()
  # within each chunk, knorm's best 5
  s = np.asarray(policies.KNorm().scores(ev)).reshape(2, 2, 4, 10)
  ref = np.asarray(select.top_mask(jnp.asarray(s), 5)).reshape(2, 2, 40)
  np.testing.assert_array_equal(keep, ref)


def test_chunked_left_padding_counts_from_the_first_real_token():
  ev = random_evidence(T=40)
  policy = comb.Chunked(base=policies.KNorm(), chunk=10)
  pad = 5
  keys = jnp.pad(ev.keys_LGTD[:, :, : 40 - pad], ((0, 0), (0, 0), (pad, 0), (0, 0)))
  valid = jnp.arange(40) >= pad
  padded = policies.Evidence(keys_LGTD=keys, valid_T=valid)
  s = np.asarray(policy.scores_row(padded))
  ref = np.asarray(policy.scores(policies.Evidence(keys_LGTD=ev.keys_LGTD[:, :, :35])))
  np.testing.assert_array_equal(s[..., pad:], ref)
  assert np.isneginf(s[..., :pad]).all()


def test_blockwise_knorm_is_global_knorm():
  ev = random_evidence()
  ours = np.asarray(comb.Blockwise(base=policies.KNorm(), block=4).keep_mask(ev, 13))
  np.testing.assert_array_equal(ours, np.asarray(policies.KNorm().keep_mask(ev, 13)))


def test_per_layer_relative_spreads_a_traced_budget():
  ev = random_evidence()
  policy = policies.KNorm(allocator=PerLayer(compression_ratios=(0.25, 0.75)))

  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(budget):
    return policy.keep_mask(ev, budget).sum(-1)

  np.testing.assert_array_equal(np.asarray(f(jnp.int32(10))), [[15, 15], [5, 5]])
  np.testing.assert_array_equal(np.asarray(f(jnp.int32(16))), [[24, 24], [8, 8]])


def test_per_layer_absolute_counts_real_positions():
  ev = random_evidence()
  alloc = PerLayer(compression_ratios=(0.3, 0.5), relative=False)
  s = jnp.zeros((2, 2, 40))
  np.testing.assert_array_equal(np.asarray(alloc(ev, s, 40, 0))[:, 0], [28, 20])
  np.testing.assert_array_equal(np.asarray(alloc(ev, s, 25, 0))[:, 0], [25, 20])  # capped
  padded = ev.replace(valid_T=jnp.arange(40) >= 30)  # 10 real: int(10 * 0.7) = 7 as Python's
  np.testing.assert_array_equal(np.asarray(alloc(padded, s, 40, 0))[:, 0], [7, 5])


def test_prefill_decoding_phases():
  ev = random_evidence()
  policy = comb.PrefillDecoding(
    prefill=SNAP, decoding=policies.KNorm(), decode_every=16, decode_budget=12
  )
  np.testing.assert_array_equal(kept(policy, ev, 20), kept(SNAP, ev, 20))
  assert policy.acts_at_decode and policy.decode_every == 16
  assert {"attn_window_LHWT", "keys_LGTD"} <= policy.evidence_fields
  budget_LH = jnp.full((2, 2), 20, jnp.int32)
  slots = ev.replace(valid_T=jnp.arange(40) < 30)  # 30 filled slots
  keep = np.asarray(policy.recompress_keep(slots, budget_LH, 60))
  assert (keep.sum(-1) == 12).all() and not keep[..., 30:].any()
  s = np.asarray(policies.KNorm().scores(ev))[..., :30]
  ref = np.asarray(select.top_mask(jnp.asarray(s), 12))
  np.testing.assert_array_equal(keep[..., :30], ref)
  same = comb.PrefillDecoding(prefill=SNAP, decoding=policies.KNorm(), decode_every=16)
  assert (np.asarray(same.recompress_keep(slots, budget_LH, 60)).sum(-1) == 20).all()


def test_ratio_decoding_target_grows_with_tokens_seen():
  ev = random_evidence()
  policy = comb.RatioDecoding(decoding=policies.KeyDiff(), compression_ratio=0.6, decode_every=8)
  assert isinstance(policy.prefill, policies.Full)
  budget_LH = jnp.full((2, 2), 40, jnp.int32)
  for seen, target in ((40, 16), (50, 20), (57, 22)):
    b = np.asarray(policy.decode_budgets(budget_LH, seen))
    assert (b == target).all(), (seen, b)
    b = np.asarray(jax.jit(policy.decode_budgets)(budget_LH, jnp.int32(seen)))
    assert (b == target).all(), (seen, b)
  keep = np.asarray(policy.recompress_keep(ev, budget_LH, 50))
  assert (keep.sum(-1) == 20).all()


# --------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
  "build, option",
  [
    (lambda: PerLayer(compression_ratios=()), "compression_ratios"),
    (lambda: PerLayer(compression_ratios=(0.5, 1.0)), "compression_ratios"),
    (lambda: PerLayer(compression_ratios=(0.5,), relative=1), "relative"),
    (lambda: comb.Composed(stages=()), "stages"),
    (lambda: comb.Composed(stages=(SNAP, policies.KNorm())), "compression_ratios"),
    (lambda: comb.Composed(stages=(SNAP, SNAP), compression_ratios=(0.5,)), "stages[1]"),
    (lambda: comb.Composed(stages=(policies.ThinK(), SNAP)), "stages"),
    (
      lambda: comb.Composed(stages=(SNAP, policies.KNorm()), compression_ratios=(1.5,)),
      "compression_ratios",
    ),
    (lambda: comb.Chunked(base=SNAP, chunk=8), "base"),
    (lambda: comb.Chunked(base=policies.KNorm(), chunk=0), "chunk"),
    (lambda: comb.Blockwise(base=policies.KNorm(), block=True), "block"),
    (lambda: comb.Blockwise(base=policies.make("h2o")), "base"),
    (
      lambda: comb.PrefillDecoding(prefill=SNAP, decoding=policies.make("tova")),
      "decoding",
    ),
    (
      lambda: comb.PrefillDecoding(prefill=SNAP, decoding=policies.KNorm(), decode_every=0),
      "decode_every",
    ),
    (
      lambda: comb.PrefillDecoding(prefill=SNAP, decoding=policies.KNorm(), decode_budget=0),
      "decode_budget",
    ),
    (
      lambda: comb.RatioDecoding(decoding=policies.KNorm(), compression_ratio=1.0),
      "compression_ratio",
    ),
  ],
)
def test_bad_options_are_refused(build, option):
  with pytest.raises(ValueError, match="^" + re.escape(option)):
    build()


def test_per_layer_wrong_layer_count():
  ev = random_evidence()
  policy = policies.KNorm(allocator=PerLayer(compression_ratios=(0.5, 0.5, 0.5)))
  with pytest.raises(ValueError, match="^compression_ratios: 3 ratios for L=2"):
    policy.keep_mask(ev, 10)
