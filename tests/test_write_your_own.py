"""A researcher's own policies (``examples/my_policies.py``, the README's "Write your own") run
through every entry point of kvjax with no edit to kvjax, and keep what numpy says they should.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import my_policies as mine
from kvjax import policies

ROOT = pathlib.Path(__file__).resolve().parents[1]
L, G, T, D = 3, 2, 48, 8


@pytest.fixture(autouse=True, scope="module")
def registered():
  mine.register()
  yield
  for name in ("value_norm", "decayed_h2o", "value_norm_ramp"):
    policies.unregister(name)


def top_b(scores_RT: np.ndarray, budget_R: np.ndarray) -> np.ndarray:
  """numpy's kept mask: each row's ``budget`` best scores, ties to the lower position."""
  keep = np.zeros(scores_RT.shape, bool)
  T = scores_RT.shape[-1]
  for r, (s, b) in enumerate(zip(scores_RT, budget_R, strict=True)):
    order = np.lexsort((np.arange(T), -s))  # descending score, then ascending position
    keep[r, order[: min(int(b), T)]] = True
  return keep


def value_norm_np(values_LGTD: np.ndarray, sinks: int) -> np.ndarray:
  s = np.linalg.norm(values_LGTD.astype(np.float64), axis=-1)
  s[..., :sinks] = np.inf
  return s


def ramp_np(budget: int, window: int, L: int, low: float = 0.5) -> np.ndarray:
  scale = np.linspace(low, 2 - low, L, dtype=np.float32)
  return np.maximum(np.floor(budget * scale), window + 1).astype(int)


@pytest.fixture(scope="module")
def values():
  return np.random.default_rng(0).normal(size=(L, G, T, D)).astype(np.float32)


def test_each_example_is_at_most_30_lines_and_the_readme_shows_it():
  source = (ROOT / "examples" / "my_policies.py").read_text()
  readme = (ROOT / "README.md").read_text()
  for node in ast.parse(source).body:
    if isinstance(node, ast.ClassDef):
      lines = ast.get_source_segment(source, node).splitlines()
      assert len(lines) + len(node.decorator_list) <= 30, node.name
      assert "\n".join(lines) in readme, f"README's write-your-own lacks {node.name} as written"


@pytest.mark.parametrize("budget", [10, 20, T + 3])
def test_value_norm_on_arrays(values, budget):
  policy = policies.make("value_norm", sinks=3)
  keep = np.asarray(policy.keep_mask(policies.Evidence(values_LGTD=jnp.asarray(values)), budget))
  expected = top_b(value_norm_np(values, 3).reshape(L * G, T), np.full(L * G, budget))
  np.testing.assert_array_equal(keep, expected.reshape(L, G, T))


def test_value_norm_per_head_budgets_and_options(values):
  budget_LH = np.array([[5, 9], [12, 7], [30, 4]], np.int32)
  ev = policies.Evidence(values_LGTD=jnp.asarray(values))
  keep = np.asarray(mine.ValueNorm().keep_mask(ev, budget_LH))
  expected = top_b(value_norm_np(values, 4).reshape(L * G, T), budget_LH.reshape(-1))
  np.testing.assert_array_equal(keep, expected.reshape(L, G, T))
  with pytest.raises(ValueError, match="sinks: expected an int >= 0"):
    policies.make("value_norm", sinks=-1)
  with pytest.raises(ValueError, match=r"options: \['window'\] are not options of policy"):
    policies.make("value_norm", window=4)


def test_allocator_on_arrays(values):
  policy = policies.make("value_norm_ramp", sinks=2)
  ev = policies.Evidence(values_LGTD=jnp.asarray(values))
  keep = np.asarray(policy.keep_mask(ev, 16))
  budget_L = ramp_np(16, 0, L)
  assert budget_L.tolist() == [8, 16, 24]
  np.testing.assert_array_equal(
    np.asarray(policy.budgets(ev, policy.scores(ev), 16)), np.repeat(budget_L[:, None], G, 1)
  )
  expected = top_b(value_norm_np(values, 2).reshape(L * G, T), np.repeat(budget_L, G))
  np.testing.assert_array_equal(keep, expected.reshape(L, G, T))
  # budgets stay data: one trace for every budget
  traced = jax.jit(lambda b: policy.keep_mask(ev, b))
  np.testing.assert_array_equal(np.asarray(traced(jnp.int32(16))), keep)


def test_decode_policy_state_machine_on_arrays():
  rng = np.random.default_rng(1)
  policy = policies.make("decayed_h2o", decay=0.5, recent=2)
  sums = rng.random((L, G, T)).astype(np.float32)
  ev = policies.Evidence(column_sums_LHT=jnp.asarray(sums))
  idx, kept = policy.compact(ev, 10, 12)
  expected = top_b(np.where(np.arange(T) >= T - 2, np.inf, sums).reshape(-1, T), [10] * (L * G))
  got = np.zeros((L * G, T), bool)
  for r, (i, k) in enumerate(
    zip(np.asarray(idx).reshape(-1, 12), np.asarray(kept).reshape(-1, 12), strict=True)
  ):
    got[r, i[k]] = True
  np.testing.assert_array_equal(got, expected)
  state = policy.init_state(ev, policy.scores(ev), idx, kept)
  np.testing.assert_allclose(
    np.where(kept, np.take_along_axis(sums, np.asarray(idx), -1), 0), state
  )
  attn = rng.random(state.shape).astype(np.float32)
  np.testing.assert_allclose(policy.observe(state, attn), 0.5 * np.asarray(state) + attn, rtol=1e-6)
  keep = np.asarray(policy.keep_scores(state, idx, T, jnp.full((L, G), 10)))
  assert np.isinf(keep[np.asarray(idx) > T - 2]).all()
