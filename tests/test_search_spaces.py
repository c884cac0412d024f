"""The named allocators' search spaces (kvjax.eval.search.allocator_spaces): at known parameters a
space gives the allocator's own budgets (the allocator called directly), every vector maps to a
feasible allocation, and bad bounds raise ValueError naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import search as search_config
from kvjax import budgets, policies
from kvjax.eval.search import allocator_spaces, fitness, runner
from kvjax.policies import allocators

L, G, P, W = 6, 2, 64, 4
RNG = np.random.default_rng(0)
SCORES_LGP = RNG.random((L, G, P)).astype(np.float32)
ATTN_LHWT = jax.nn.softmax(jnp.asarray(RNG.normal(size=(L, 3, 8, P)) * 2, jnp.float32), -1)


def _feasible(space, a):
  a = np.asarray(a)
  assert a.shape == space.shape and a.dtype == np.int32
  assert a.sum() == space.total
  assert a.min() >= space.low and a.max() <= space.prompt_len


def _direct(name, space, values, scores_LHT):
  """The allocator itself (kvjax.policies.allocators) at the decoded values, [L, H]."""
  v = {k: float(x) for k, x in values.items()}
  if name == "pyramid_beta":
    alloc = allocators.Pyramid(beta=v["beta"], pyramid_mode="exact_total")
    return alloc(policies.Evidence(), scores_LHT, space.budget, W)
  if name == "adakv":
    alloc = allocators.AdaKV(floor_alpha=v["floor_alpha"], adakv_mode=space.adakv_mode)
    return alloc(policies.Evidence(), scores_LHT, space.budget, W)
  alloc = allocators.CakeLayers(tau1=v["tau1"], tau2=v["tau2"])
  return alloc(policies.Evidence(attn_window_LHWT=ATTN_LHWT), scores_LHT, space.budget, W)


def _space(name, shape, budget=16, **fields):
  if name == "adakv":
    fields.setdefault("scores_LGP", SCORES_LGP)
  if name == "cake":
    fields.setdefault("statistics", budgets.cake_statistics(ATTN_LHWT, W))
  return allocator_spaces.SPACES[name].from_budget(shape, budget, W, P, **fields)


KNOWN = [
  ("pyramid_beta", (L,), {"beta": 20.0}),
  ("pyramid_beta", (L,), {"beta": 1.0}),
  ("pyramid_beta", (L, G), {"beta": 5.0}),
  ("cake", (L,), {"tau1": 1.0, "tau2": 1.0}),
  ("cake", (L, G), {"tau1": 1.6, "tau2": 0.4}),
]


@pytest.mark.parametrize("name, shape, values", KNOWN)
def test_a_space_gives_the_allocators_own_budgets(name, shape, values):
  space = _space(name, shape)
  x = space.encode(**values)
  decoded = space.decode(x)
  for k, v in values.items():
    np.testing.assert_allclose(float(decoded[k]), v, rtol=1e-5)
  direct_LH = np.asarray(_direct(name, space, decoded, jnp.asarray(SCORES_LGP)))
  got = np.asarray(space.allocate(x))
  want = direct_LH[:, 0] if len(shape) == 1 else direct_LH
  np.testing.assert_array_equal(got, want)
  _feasible(space, got)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_space_gives_adakvs_budgets(alpha):
  # kvpress's Ada-KV sums exactly to each layer's total: the space gives its budgets as they are
  scores = SCORES_LGP.copy()
  scores[..., -W:] = np.inf  # kvpress protects the window through the scores
  space = _space("adakv", (L, G), scores_LGP=scores, adakv_mode="kvpress")
  x = space.encode(floor_alpha=alpha)
  decoded = space.decode(x)
  direct = np.asarray(_direct("adakv", space, decoded, jnp.asarray(scores)))
  np.testing.assert_array_equal(np.asarray(space.allocate(x)), direct)
  # the official caps need not sum to the layer's total (as upstream): the space adds (or
  # takes) only the missing slots, one per entry at most here
  space = _space("adakv", (L, G))
  x = space.encode(floor_alpha=alpha)
  direct = np.asarray(_direct("adakv", space, space.decode(x), jnp.asarray(SCORES_LGP)))
  got = np.asarray(space.allocate(x))
  _feasible(space, got)
  gap = space.total - direct.sum()
  assert np.abs(got - direct).sum() == abs(gap) and np.abs(got - direct).max() <= 1
  if gap == 0:
    np.testing.assert_array_equal(got, direct)


@pytest.mark.parametrize(
  "name, shape", [("pyramid_beta", (L,)), ("adakv", (L, G)), ("cake", (L, G))]
)
def test_any_vector_is_feasible_and_the_population_vmaps(name, shape):
  space = _space(name, shape, budget=8)  # tight: steep pyramids and CAKE hit the window floor
  params = RNG.normal(size=(24, space.num_params)) * 8
  params[0] = np.nan
  params[1] = np.inf
  pop = np.asarray(space.allocate_population(params))
  for a in pop:
    _feasible(space, a)
  np.testing.assert_array_equal(pop[2], np.asarray(space.allocate(jnp.asarray(params[2]))))


@pytest.mark.parametrize(
  "build, match",
  [
    (lambda: _space("pyramid_beta", (L,), beta_range=(0.5, 10.0)), r"beta_range: \(0.5, 10.0\)"),
    (lambda: _space("pyramid_beta", (L,), beta_range=(5.0, 5.0)), "low < high"),
    (lambda: _space("pyramid_beta", (L,), pyramid_mode="steep"), "pyramid_mode: unknown"),
    (lambda: _space("adakv", (L, G), alpha_range=(0.0, 1.5)), r"alpha_range: \(0.0, 1.5\)"),
    (lambda: _space("adakv", (L,)), r"shape: \(6,\); Ada-KV"),
    (lambda: _space("adakv", (L, G), scores_LGP=SCORES_LGP[:, :, :10]), "scores_LGP: shape"),
    (lambda: _space("adakv", (L, G), adakv_mode="x"), "adakv_mode: unknown"),
    (lambda: _space("cake", (L,), tau_range=(0.0, 2.0)), r"tau_range: \(0.0, 2.0\)"),
    (lambda: _space("cake", (L,), tau_range=(1.0, float("inf"))), "tau_range"),
    (lambda: _space("cake", (L,), statistics=None), "statistics: NoneType"),
    (
      lambda: _space("cake", (L,), statistics=(np.zeros(L), np.ones(L))),
      "preferences are all 0",
    ),
    (
      lambda: allocator_spaces.CakeSpace((L,), 16 * L + 1, W, P, statistics=(np.ones(L),) * 2),
      "multiple",
    ),
    (lambda: _space("pyramid_beta", (L,)).encode(beta=200.0), r"beta: 200.0 outside"),
    (lambda: _space("pyramid_beta", (L,)).encode(slope=2.0), "values: got"),
    (lambda: allocator_spaces.PyramidSpace((L,), 16 * L, W, P, rule="free"), "rule: unknown"),
  ],
)
def test_bad_bounds_raise(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_encode_decode_round_trip_and_middle():
  space = _space("cake", (L,))
  mid = space.decode(jnp.zeros(2))
  np.testing.assert_allclose([float(mid["tau1"]), float(mid["tau2"])], [1.0, 1.0], rtol=1e-6)
  x = space.encode(tau1=0.3, tau2=3.0)
  d = space.decode(x)
  np.testing.assert_allclose([float(d["tau1"]), float(d["tau2"])], [0.3, 3.0], rtol=1e-5)
  assert space.num_params == 2 and _space("adakv", (L, G)).num_params == 1


# --------------------------------------------------------------------------- the runner


@pytest.mark.parametrize(
  "arg, rule",
  [("quick", "pyramid_beta"), ("quick,lg", "adakv"), ("quick", "cake"), ("quick,tiny,lg", "cake")],
)
def test_a_named_allocators_search_from_a_config(tmp_path, arg, rule):
  c = search_config.get_config(f"{arg},rule={rule}")
  c.lab.world.update(num_layers=4, num_heads=2, prompt_len=64, gen_steps=16, head_dim=8, window=8)
  c.budget = 12
  c.population, c.generations = 4, 2
  summary = runner.run(c, tmp_path, log=lambda *_: None)
  head = summary["header"]
  assert head["rule"] == rule
  names = list(allocator_spaces.SPACES[rule].defaults)
  assert sorted(head["parameters"]) == sorted(names)
  # the file's allocation is the space's at the file's parameters, rebuilt from the evidence
  data = runner.evidence(c)
  space = runner.space_of(c, data.cal, data.model["num_kv_heads"], data.rules)
  with np.load(tmp_path / "allocation.npz") as f:
    allocation, params = f["allocation"], f["params"]
  np.testing.assert_array_equal(allocation, np.asarray(space.allocate(jnp.asarray(params))))
  assert space.values(params) == pytest.approx(head["parameters"])
  _feasible(space, allocation)
  judged = summary["judged"]
  if rule != "pyramid_beta":  # PyramidKV's default (20) is the pyramid_beta20 baseline already
    assert f"{rule}_default" in judged


def test_a_named_allocators_config_errors():
  c = search_config.get_config("quick,rule=adakv")  # shape L
  with pytest.raises(ValueError, match=r"shape: \(6,\); Ada-KV"):
    data = runner.evidence(c)
    runner.space_of(c, data.cal, data.model["num_kv_heads"], data.rules)
  c = search_config.get_config("quick,rule=steep")
  with pytest.raises(ValueError, match="rule: unknown value 'steep'"):
    runner.check_config(c)
  c = search_config.get_config("quick,rule=cake")
  c.window = 1
  with pytest.raises(ValueError, match="window: 1; rule 'cake' reads the window's queries"):
    runner.space_of(c, fitness.MassTable(jnp.zeros((6, 4, 193)), jnp.zeros((6, 4))), 4, None)
