"""The lab's modelled keys (kvjax.lab.keys) and the attention-free scorers replayed on them."""

import functools

import jax
import numpy as np
import pytest

from kvjax import scores
from kvjax.lab import keys, metrics, online, suite, synthetic

SIZES = dict(num_layers=2, num_heads=2, prompt_len=160, gen_steps=32, head_dim=8, window=16)
LAG = dict(lag=16)  # the reference 128 needs a prompt of >= 260 tokens


@functools.cache
def world(name: str = "needle_qa", seed: int = 0) -> synthetic.World:
  return synthetic.make_world(synthetic.world_config(name, dict(SIZES, seed=seed)))


def test_keys_are_shaped_finite_and_deterministic():
  w = world()
  a = keys.world_keys(w, seed=0)
  L, H, T, D = SIZES["num_layers"], SIZES["num_heads"], w.dims.total_len, SIZES["head_dim"]
  assert a.shape == (L, H, T, D) and a.dtype == np.float32
  assert np.isfinite(np.asarray(a)).all()
  np.testing.assert_array_equal(np.asarray(a), np.asarray(keys.world_keys(world(), seed=0)))
  assert not np.array_equal(np.asarray(a), np.asarray(keys.world_keys(w, seed=1)))
  disguised = keys.world_keys(w, keys.KeyGeometry(fact_distinctness=0.0), seed=0)
  assert not np.array_equal(np.asarray(a), np.asarray(disguised))


def test_hypothesis_sinks_and_facts_are_unlike_the_background_and_short():
  w = world()
  P = w.dims.prompt_len
  fact_T = np.asarray(w.fact_mask_FT).any(0)[:P]
  k = keys.world_keys(w, keys.KeyGeometry(fact_distinctness=1.0))[:, :, :P]
  diff, norm = np.asarray(scores.keydiff(k)), np.asarray(scores.knorm(k))
  ordinary = ~fact_T & (np.arange(P) >= 4)
  for s in (diff, norm):  # KeyDiff's and key norm's hypotheses both hold by construction
    assert s[..., fact_T].min() > np.median(s[..., ordinary])
    assert s[..., :4].min() > np.median(s[..., ordinary])
  d = np.asarray(keys.distinctiveness(w, keys.KeyGeometry(fact_distinctness=0.25)))
  assert ((d >= 0) & (d <= 1)).all() and np.allclose(d[..., :P][..., fact_T], 0.25)


def recall(policy: str, fd: float, budget: int = 32, **options) -> float:
  geometry = keys.KeyGeometry(fact_distinctness=fd)
  trace = online.simulate(world(), policy, budget, geometry=geometry, **options)
  return metrics.summarize(trace.metrics)["fact_recall"]


def test_distinctive_facts_are_kept_by_keydiff_disguised_ones_are_not():
  high, low = recall("keydiff", 1.0), recall("keydiff", 0.0)
  assert high == 1.0 and low < 0.5 and high > low


@pytest.mark.parametrize("policy,options", [("keydiff", {}), ("lagkv", LAG), ("knorm", {})])
def test_replay_keeps_exactly_the_budget(policy, options):
  assert policy in online.LAB_POLICIES and online.needs_keys(policy)
  w, budget = world(), 24
  trace = online.simulate(w, policy, budget, record_map=True, **options)
  valid, pos = np.asarray(trace.valid_SLHC), np.asarray(trace.positions_SLHC)
  t = w.dims.prompt_len + np.arange(w.dims.gen_steps)
  expected = np.broadcast_to(np.minimum(budget, t + 1)[:, None, None], valid.shape[:-1])
  np.testing.assert_array_equal(valid.sum(-1), expected)
  assert ((pos == t[:, None, None, None]) & valid).any(-1).all(), "current token not cached"
  r = np.asarray(trace.metrics.retained)
  assert (r <= np.asarray(trace.metrics.oracle) + 1e-5).all()


def test_evidence_carries_the_prompt_keys_and_values():
  w = world()
  ev = online.key_evidence(w, online.prompt_evidence(w, jax.random.key(0)), seed=0)
  P = w.dims.prompt_len
  np.testing.assert_array_equal(
    np.asarray(ev.keys_LGTD), np.asarray(keys.world_keys(w, seed=0))[:, :, :P]
  )
  np.testing.assert_array_equal(np.asarray(ev.values_LGTD), np.asarray(w.values_LHTD)[:, :, :P])


@pytest.mark.parametrize(
  "field,value",
  [
    ("fact_distinctness", 1.5),
    ("fact_distinctness", -0.1),
    ("fact_distinctness", float("nan")),
    ("sink_distinctness", 2.0),
    ("norm_contrast", 1.0),
    ("heavy_log_ratio", 0.0),
    ("key_noise", -1.0),
    ("norm_noise", "0.1"),
  ],
)
def test_bad_knobs_raise_naming_the_argument(field, value):
  with pytest.raises(ValueError, match=field):
    keys.KeyGeometry(**{field: value})


def test_bad_world_keys_arguments_raise():
  with pytest.raises(ValueError, match="geometry"):
    keys.world_keys(world(), dict(fact_distinctness=0.5))
  with pytest.raises(ValueError, match="seed"):
    keys.world_keys(world(), seed="0")


def tiny_config(**overrides):
  from configs import lab_keys

  c = lab_keys.get_config("quick")
  c.world.update(SIZES)
  c.scenarios, c.policies, c.budgets = ("needle_qa",), ("keydiff", "snapkv"), (24,)
  c.policy_options = {}
  c.update(overrides)
  return c


def test_run_keys_table_and_versus():
  table = suite.run_keys(tiny_config(), None, log=lambda *_: None)
  assert list(table.columns) == list(suite.KEY_COLUMNS)
  assert len(table) == 4  # keydiff at fd 0 and 1; snapkv (keys unread) repeated for both
  snap = table[table.policy == "snapkv"]
  assert snap.retained_mass.nunique() == 1 and not snap.reads_keys.any()
  delta = suite.versus(table)
  assert set(delta.policy) == {"keydiff"} and len(delta) == 2


@pytest.mark.parametrize(
  "overrides,field",
  [
    (dict(budgets=(0,)), "budgets"),
    (dict(fact_distinctness=(2.0,)), "fact_distinctness"),
    (dict(policies=("keydiff", "nope")), "policies"),
  ],
)
def test_bad_keys_config_raises(overrides, field):
  with pytest.raises(ValueError, match=field):
    suite.validate_keys_config(tiny_config(**overrides))
