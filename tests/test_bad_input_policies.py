"""Issue 44's policy-side cases: allocations below the protected window, one allocation window
everywhere (the sweep's too), kvpress's integer counts, a policy's outputs checked against the
shapes it promises, messages that name the argument given, valid numpy/jax values accepted and
built-in names kept."""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import sweep_lab  # noqa: E402
from kvjax import policies  # noqa: E402
from kvjax.lab import sweep  # noqa: E402
from kvjax.policies import registry  # noqa: E402
from kvjax.policies.per_layer import n_kept  # noqa: E402

L, HQ, G, T, D, W = 2, 4, 2, 64, 8, 8


@pytest.fixture(scope="module")
def evidence():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(L, HQ, T, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(L, G, T, D)), jnp.float32)
  return policies.evidence_from_qk(q, k, window=W, rng=jax.random.key(1))


# --------------------------------------------------------------------------- item 2


def test_a_per_layer_allocation_below_the_protected_window_is_refused(evidence):
  # layer 1 keeps 10 % of the budget: 2 slots of SnapKV's window of 8 (it kept 2 of 8 silently)
  policy = policies.SnapKV(allocator=policies.PerLayer(compression_ratios=(0.0, 0.9)))
  with pytest.raises(ValueError, match=r"PerLayer gives L=1.*fewer than the protected window of 8"):
    policy.keep_mask(evidence, 16)
  with pytest.raises(ValueError, match="protected window of 8"):
    policy.check_allocation(np.array([[29, 29], [2, 2]]), 8)
  ok = policies.SnapKV(allocator=policies.PerLayer(compression_ratios=(0.0, 0.5)))
  assert np.asarray(ok.keep_mask(evidence, 16).sum(-1)).min() >= W


@dataclasses.dataclass(frozen=True)
class WrongShape(policies.Allocator):
  def __call__(self, evidence, scores_LHT, budget, window):
    return jnp.full((scores_LHT.shape[0],), 16, jnp.int32)


def test_an_allocator_output_of_another_shape_is_named(evidence):
  policy = policies.KNorm(allocator=WrongShape())
  with pytest.raises(ValueError, match=r"allocator: WrongShape of policy 'KNorm' returned"):
    policy.keep_mask(evidence, 16)


# --------------------------------------------------------------------------- item 7


def test_the_sweep_allocates_with_the_policys_own_window():
  c = sweep_lab_quick()
  base = sweep.expand(c.grid, c.base)[0]
  for name, expected in (("snapkv", base["window"]), ("knorm", 0), ("streaming_llm", 0)):
    key = sweep.group_key(dict(base, policy=name, schedule="pyramid"))
    assert sweep.allocation_window(key) == expected, name


def test_pyramid_under_knorm_is_the_same_in_a_sweep_and_in_policy_budgets():
  c = sweep_lab_quick()
  cfg = dict(sweep.expand(c.grid, c.base)[0], policy="knorm", schedule="pyramid", budget=40)
  key = sweep.group_key(cfg)
  engine = sweep.Engine(c.world, capacity=40)
  ev = engine.evidence(key)
  dims = engine.world_evidence(key.scenario).world.dims
  fns = sweep.make_group(key, dims, 40, 2)
  state = fns.prepare(ev)
  d = {k: jnp.asarray(v[0]) for k, v in sweep.stack_data([cfg], 1).items()}
  policy = policies.KNorm(allocator=policies.Pyramid(pyramid_mode=cfg["pyramid_mode"]))
  expected = policy.budgets(sweep.sweep_evidence(ev), state["scores"], 40)
  np.testing.assert_array_equal(np.asarray(fns.allocate(state, d)), np.asarray(expected))


def sweep_lab_quick():
  c = sweep_lab.get_config("quick")
  c.grid.product = ml_collections.ConfigDict(dict(policy=("snapkv",), budget=(40,)))
  return c


# --------------------------------------------------------------------------- "also" items


def test_per_layer_absolute_counts_are_kvpress_integer_arithmetic():
  assert int(640 * (1 - 0.9)) == 63
  assert n_kept(640, 0.9) == 63
  assert int(n_kept(jnp.int32(640), 0.9)) == 63
  assert int(jax.jit(lambda n: n_kept(n, 0.9, max_n=640))(jnp.int32(640))) == 63
  alloc = policies.PerLayer(compression_ratios=(0.9, 0.5), relative=False)
  scores = jnp.zeros((2, 1, 640))
  ev = policies.Evidence(valid_T=jnp.ones((640,), bool))
  out = jax.jit(lambda b: alloc(ev, scores, b, 0))(jnp.int32(640))
  np.testing.assert_array_equal(np.asarray(out)[:, 0], [63, 320])


# --------------------------------------------------------------------------- poor errors


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneTooMany(policies.Policy):
  def score(self, evidence):
    a = evidence.attn_window_LHWT[:, :, -1, :]
    return jnp.concatenate([a, a[..., :1]], -1)


def test_a_policy_score_of_the_wrong_shape_is_named(evidence):
  with pytest.raises(ValueError, match=r"score: policy 'OneTooMany' returned scores of shape"):
    OneTooMany().keep_mask(evidence, 16)


def test_a_ratio_below_the_window_names_the_ratio():
  policy = policies.make("snapkv", window=8)
  with pytest.raises(ValueError, match=r"ratio: 0.95 keeps 3 tokens"):
    policy.check_budget(np.asarray([3]), 8, 64, ratio=0.95)


def test_numpy_and_jax_scalars_are_accepted():
  p = policies.make("snapkv", kernel=np.int64(7), window=np.int64(8), num_kv_heads=np.int64(2))
  assert p.window == 8 and p.num_kv_heads == 2
  p = policies.make("snapkv", channel_ratio=jnp.float32(0.5))
  assert p.channel_ratio == 0.5 and hash(p)
  alloc = policies.PerLayer(compression_ratios=(jnp.float32(0.5), np.float64(0.25)))
  assert alloc.compression_ratios == (0.5, 0.25) and hash(alloc)


def test_unregister_keeps_the_built_in_names():
  with pytest.raises(ValueError, match="'snapkv' is a built-in policy"):
    policies.unregister("snapkv")
  assert policies.is_registered("snapkv")
  original = registry.factory("knorm")
  policies.register("knorm", policies.KeyDiff, overwrite=True)
  policies.unregister("knorm")  # the user's registration undone, the built-in restored
  assert registry.factory("knorm") is original
