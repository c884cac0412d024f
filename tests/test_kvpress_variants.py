"""Golden and property tests of the kvpress variants: EntropyGatedChunkKV, SimLayerKV, FINCH,
DMS and LU-KV.

The fixture ``tests/fixtures/kvpress_0_5_5_variants.npz`` comes from
``tests/make_kvpress_fixtures_variants.py`` (kvpress 0.5.5 on the tiny Llama of
``tests/fixtures/kvpress_tiny_llama``); kvjax reruns each press on the inputs it saw and its
kept set must equal kvpress's exactly.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import policies
from kvjax.policies.dms import DMS
from kvjax.policies.entropy_chunkkv import EntropyGatedChunkKV
from kvjax.policies.finch import Finch
from kvjax.policies.lukv import LUKV, BudgetCurve, curve_counts
from kvjax.policies.simlayerkv import LAZY_THRESHOLDS, SimLayerKV

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "kvpress_0_5_5_variants.npz"
T, G, N_KEPT = 48, 2, 24


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


def evidence(fx, name="", window=8):
  prefix = f"{name}_" if name and f"{name}_queries_LHTD" in fx else ""
  q, k, v = (jnp.asarray(fx[f"{prefix}{n}"]) for n in ("queries_LHTD", "keys_LGTD", "values_LGTD"))
  return policies.evidence_from_qk(q, k, window=window, column_sums=False).replace(values_LGTD=v)


def kept(policy, ev, budget):
  return np.asarray(policy.keep_mask(ev, budget))


# --------------------------------------------------------------------------- EntropyGatedChunkKV


def entropy_policy(chunk=10, low=4):
  return EntropyGatedChunkKV(
    base=policies.make("snapkv_kvpress"), num_kv_heads=G, chunk=chunk, low_entropy_chunk=low
  )


@pytest.mark.parametrize("chunk, low", [(10, 4), (8, 3)])
def test_entropy_chunkkv_kept_set(fx, chunk, low):
  name = f"entropy_chunkkv{chunk}"
  ev = evidence(fx, name)
  ours = kept(entropy_policy(chunk, low), ev, N_KEPT)
  np.testing.assert_array_equal(ours, fx[f"{name}_keep_LGT"])
  plain = kept(policies.make("chunkkv_snapkv_kvpress", num_kv_heads=G, chunk=chunk), ev, N_KEPT)
  assert (plain != ours).any()  # the gate changes the choice


def test_entropy_chunkkv_counts_per_head_and_jit(fx):
  ev = evidence(fx, "entropy_chunkkv10")
  policy = entropy_policy()
  for b in (1, 5, 13, 47, 48, 60):
    keep = kept(policy, ev, b)
    assert (keep.sum(-1) == min(b, T)).all()
    assert (keep == keep[:, :1]).all()  # one set per layer
  budget_LH = np.array([[5, 30], [17, 48]], np.int32)
  np.testing.assert_array_equal(kept(policy, ev, budget_LH).sum(-1), budget_LH)
  traces = []

  @jax.jit
  def run(b):
    traces.append(1)
    return policy.keep_mask(ev, b)

  for b in (24, 11):
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(b))), kept(policy, ev, b))
  assert len(traces) == 1


def test_entropy_chunkkv_padded_row_matches_unpadded(fx):
  ev = evidence(fx, "entropy_chunkkv10")
  policy = entropy_policy()
  s = policy.scores(ev)
  pad = 5
  padded = jnp.concatenate([jnp.zeros(s.shape[:2] + (pad,)), s], -1)
  valid = jnp.arange(T + pad) >= pad
  ev_pad = policies.Evidence(valid_T=valid)
  b = jnp.full(s.shape[:2], N_KEPT, jnp.int32)
  ours = np.asarray(policy.rescore(ev_pad, padded, b, None))[..., pad:]
  np.testing.assert_array_equal(ours > 0, fx["entropy_chunkkv10_keep_LGT"])


@pytest.mark.parametrize(
  "options, key",
  [
    ({"low_entropy_chunk": 10}, "low_entropy_chunk"),
    ({"chunk": 1}, "chunk"),
    ({"low_entropy_chunk": 0}, "low_entropy_chunk"),
  ],
)
def test_entropy_chunkkv_bad_options(options, key):
  with pytest.raises(ValueError, match=key):
    EntropyGatedChunkKV(base=policies.make("snapkv_kvpress"), **options)


def test_entropy_chunkkv_refuses_a_rescoring_base():
  with pytest.raises(ValueError, match="base"):
    EntropyGatedChunkKV(base=policies.make("critical_snapkv"))


# --------------------------------------------------------------------------- SimLayerKV

SIM_BUDGET = 4 + 8 - 1  # n_initial + n_recent - n_last of the fixture


@pytest.mark.parametrize("label", ["between", "none_lazy", "all_lazy"])
def test_simlayerkv_kept_set(fx, label):
  meta = fx["meta"][f"simlayerkv_{label}"]
  policy = SimLayerKV(lazy_threshold=meta["args"]["lazy_threshold"], num_kv_heads=G)
  ev = evidence(fx, window=1)
  np.testing.assert_array_equal(np.asarray(policy.lazy_layers(ev, SIM_BUDGET)), meta["lazy_L"])
  keep = kept(policy, ev, SIM_BUDGET)
  np.testing.assert_array_equal(keep, fx[f"simlayerkv_{label}_keep_LGT"])
  expected = np.where(meta["lazy_L"], SIM_BUDGET, T)
  np.testing.assert_array_equal(keep.sum(-1), np.broadcast_to(expected[:, None], (2, G)))


def test_simlayerkv_jit_family_and_short_prompts(fx):
  ev = evidence(fx, window=1)
  between = fx["meta"]["simlayerkv_between"]["args"]["lazy_threshold"]
  policy = SimLayerKV(lazy_threshold=between)
  out = jax.jit(lambda b: policy.budgets(ev, policy.scores(ev), b))(jnp.int32(SIM_BUDGET))
  np.testing.assert_array_equal(np.asarray(out)[:, 0], [SIM_BUDGET, T])
  assert SimLayerKV(lazy_threshold="qwen").threshold == LAZY_THRESHOLDS["qwen"] == 0.85
  assert not np.asarray(SimLayerKV(lazy_threshold=1.0).lazy_layers(ev, SIM_BUDGET)).any()
  assert not np.asarray(policy.lazy_layers(ev, T - 2)).any()  # T <= budget + 2 n_last: kept
  assert policy.allocates  # a layer may keep all T: a real cache sizes its rows for T


@pytest.mark.parametrize(
  "options, key",
  [
    ({"lazy_threshold": 1.5}, "lazy_threshold"),
    ({"lazy_threshold": "gpt"}, "lazy_threshold"),
    ({"n_last": 0}, "n_last"),
    ({"sinks": -1}, "sinks"),
    ({"allocator": policies.Pyramid()}, "allocator"),
  ],
)
def test_simlayerkv_bad_options(options, key):
  with pytest.raises(ValueError, match=key):
    SimLayerKV(**options)


def test_simlayerkv_bad_budgets(fx):
  ev = evidence(fx, window=1)
  policy = SimLayerKV(lazy_threshold=0.5)
  with pytest.raises(ValueError, match="budget"):
    policy.keep_mask(ev, np.array([11, 11]))
  with pytest.raises(ValueError, match="budget"):
    policy.keep_mask(ev, 4)


# --------------------------------------------------------------------------- FINCH


@pytest.mark.parametrize("name, normalize", [("finch", True), ("finch_raw", False)])
def test_finch_scores_and_kept_set(fx, name, normalize):
  q = fx["meta"][name]["window_size"]
  policy = Finch(question_len=q, window=16, normalize_scores=normalize, num_kv_heads=G)
  ev = evidence(fx, window=16)
  ours = np.asarray(policy.scores(ev))
  ref = fx[f"{name}_scores_LGT"]
  np.testing.assert_allclose(ours[..., :-q], ref[..., :-q], rtol=1e-5)
  assert np.isinf(ours[..., -q:]).all()
  np.testing.assert_array_equal(kept(policy, ev, N_KEPT), fx[f"{name}_keep_LGT"])


def test_finch_question_len_is_traced_data(fx):
  ev = evidence(fx, window=16)
  traces = []

  @jax.jit
  def run(policy):
    traces.append(1)
    return policy.keep_mask(ev, N_KEPT)

  for q in (10, 6):
    policy = Finch(question_len=q, window=16, num_kv_heads=G)
    ours = np.asarray(run(policy))
    np.testing.assert_array_equal(ours, kept(policy, ev, N_KEPT))
    assert ours[..., -q:].all()  # the question is kept
  assert len(traces) == 1
  np.testing.assert_array_equal(
    kept(Finch(question_len=10, num_kv_heads=G), evidence(fx, window=10), N_KEPT),
    fx["finch_keep_LGT"],
  )
  assert Finch(question_len=10).observation_window == 10


@pytest.mark.parametrize(
  "options, key",
  [
    ({"question_len": 0}, "question_len"),
    ({"question_len": 20, "window": 16}, "question_len"),
    ({"window": 0}, "window"),
    ({"normalize_scores": 1}, "normalize_scores"),
  ],
)
def test_finch_bad_options(options, key):
  with pytest.raises(ValueError, match=key):
    Finch(**options)


def test_finch_question_len(fx):
  """Without ``question_len`` the whole observation window is the question."""
  ev = evidence(fx, window=16)
  np.testing.assert_array_equal(
    np.asarray(Finch().scores(ev)), np.asarray(Finch(question_len=16).scores(ev))
  )
  with pytest.raises(ValueError, match="question_len"):
    Finch(question_len=12).scores(evidence(fx, window=8))  # more than the window rows


# --------------------------------------------------------------------------- DMS


@pytest.mark.parametrize("name, base", [("dms_knorm", "knorm"), ("dms_snapkv", "snapkv_kvpress")])
def test_dms_kept_set_and_counts(fx, name, base):
  meta = fx["meta"][name]
  ev = evidence(fx, name)
  policy = DMS(
    base=policies.make(base), threshold=meta["args"]["threshold"], sliding_window=8, num_kv_heads=G
  )
  ours = kept(policy, ev, T)
  np.testing.assert_array_equal(ours, fx[f"{name}_keep_LGT"])
  scores = np.asarray(policy.scores(ev))
  count = (scores >= meta["args"]["threshold"]).sum(-1)  # the documented kept count
  np.testing.assert_array_equal(ours.sum(-1), count)
  np.testing.assert_array_equal(count, meta["kept_per_head_LG"])
  capped = kept(policy, ev, 20)
  np.testing.assert_array_equal(capped.sum(-1), np.minimum(count, 20))
  assert capped[..., -8:].all()


def test_dms_threshold_is_traced_data(fx):
  ev = evidence(fx, "dms_knorm")
  traces = []

  @jax.jit
  def run(policy, b):
    traces.append(1)
    return policy.keep_mask(ev, b)

  for thr, b in ((-6.5, 48), (-6.0, 30)):
    policy = DMS(base=policies.make("knorm"), threshold=thr, sliding_window=8, num_kv_heads=G)
    np.testing.assert_array_equal(np.asarray(run(policy, jnp.int32(b))), kept(policy, ev, b))
  assert len(traces) == 1


def test_dms_bad_options(fx):
  with pytest.raises(ValueError, match="sliding_window"):
    DMS(base=policies.make("knorm"), sliding_window=-1)
  with pytest.raises(ValueError, match="threshold"):
    DMS(base=policies.make("knorm"), threshold=float("nan"))
  with pytest.raises(ValueError, match="threshold"):
    DMS(base=policies.make("knorm"), sliding_window=8).keep_mask(evidence(fx), T)
  with pytest.raises(ValueError, match="budget"):
    DMS(base=policies.make("knorm"), threshold=0.0, sliding_window=8).keep_mask(evidence(fx), 8)


# --------------------------------------------------------------------------- LU-KV


def lukv_evidence(fx, name):
  ev = evidence(fx, name)
  if name == "lukv_ea":
    ev = ev.replace(
      query_mean_LHD=jnp.asarray(fx["lukv_ea_query_mean_LHD"]),
      query_cov_LHDD=jnp.asarray(fx["lukv_ea_query_cov_LHDD"]),
    )
  return ev


@pytest.mark.parametrize("name", ["lukv_knorm", "lukv_ea"])
def test_lukv_kept_set(fx, name):
  curve = BudgetCurve(curve=fx["lukv_curve_RLG"])
  base = {"base": policies.make("knorm")} if name == "lukv_knorm" else {}
  policy = LUKV(allocator=curve, num_kv_heads=G, **base)
  ev = lukv_evidence(fx, name)
  ours = kept(policy, ev, N_KEPT)
  np.testing.assert_array_equal(ours.sum(-1), fx["meta"][name]["kept_per_head_LG"])
  np.testing.assert_array_equal(ours, fx[f"{name}_keep_LGT"])
  assert ours[..., :4].all() and ours[..., -1].all()


def test_lukv_curve_rows_counts_and_jit(fx):
  table = fx["lukv_curve_RLG"]
  curve = BudgetCurve(curve=table)
  assert (
    int(curve.row(24, 48)) == 49 and int(curve.row(48, 48)) == 0 and int(curve.row(1, 48)) == 97
  )
  counts = np.asarray(curve_counts(jnp.asarray(table[49]), T))
  ideal = np.clip(1 - table[49], 0, 1) * T
  np.testing.assert_array_equal(counts.sum(-1), np.round(ideal.sum(-1)))
  policy = LUKV(base=policies.make("knorm"), allocator=curve, num_kv_heads=G)
  ev = lukv_evidence(fx, "lukv_knorm")
  run = jax.jit(lambda b: policy.keep_mask(ev, b))
  for b in (24, 12):
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(b))), kept(policy, ev, b))
  assert kept(policy, ev, T).all()
  query_heads = LUKV(base=policies.make("knorm"), allocator=curve)
  assert query_heads.budgets(ev, query_heads.scores(ev), 24).shape == (2, G)


def test_lukv_bad_options(fx):
  with pytest.raises(ValueError, match="curve"):
    BudgetCurve(curve=np.zeros((10, 2, 2)))
  with pytest.raises(ValueError, match="curve"):
    LUKV(base=policies.make("knorm")).keep_mask(evidence(fx), N_KEPT)
  with pytest.raises(ValueError, match="sinks"):
    LUKV(sinks=-1)
  with pytest.raises(ValueError, match="budget"):
    LUKV(base=policies.make("knorm"), allocator=BudgetCurve(curve=fx["lukv_curve_RLG"])).keep_mask(
      evidence(fx), np.array([24, 24])
    )
