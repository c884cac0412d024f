"""Sweeps: grid expansion, vmapped == looped, one compile per group, sharding, resume, bad input."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pandas as pd
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import forced_devices_env  # noqa: E402

from configs import sweep_lab  # noqa: E402
from kvjax import budgets, policies, rundir, select  # noqa: E402
from kvjax.lab import grid, online, sweep, synthetic  # noqa: E402
from kvjax.lab import keys as keys_lib  # noqa: E402


def quick(**product):
  c = sweep_lab.get_config("quick")
  if product:
    c.grid.product = ml_collections.ConfigDict(product)
  return c


def test_expand_product_and_zip():
  c = quick()
  c.grid.product = ml_collections.ConfigDict(dict(budget=(16, 32), policy=("snapkv", "h2o")))
  c.grid.zip = ml_collections.ConfigDict(
    dict(schedule=("uniform", "pyramid", "cake"), beta=(20.0, 4.0, 20.0))
  )
  configs = sweep.expand(c.grid, c.base)
  assert len(configs) == 2 * 2 * 3
  assert {(x["schedule"], x["beta"]) for x in configs} == {
    ("uniform", 20.0),
    ("pyramid", 4.0),
    ("cake", 20.0),
  }
  ids = [sweep.config_id(x) for x in configs]
  assert len(set(ids)) == len(ids)
  shuffled = dict(reversed(list(configs[0].items())))
  assert sweep.config_id(shuffled) == ids[0]


@pytest.mark.parametrize(
  "product, zipped, match",
  [
    ({}, {}, "grid: empty grid"),
    (dict(budgte=(1,)), {}, "grid: unknown axis 'budgte'"),
    (dict(budget=("64",)), {}, "grid: axis 'budget' value '64' is a str, expected int"),
    (dict(budget=()), {}, "grid: axis 'budget' has no values"),
    ({}, dict(schedule=("uniform", "pyramid"), beta=(1.0,)), "zip axes have different lengths"),
  ],
)
def test_bad_grids(product, zipped, match):
  c = quick()
  c.grid.product = ml_collections.ConfigDict(product)
  c.grid.zip = ml_collections.ConfigDict(zipped)
  with pytest.raises(ValueError, match=match):
    sweep.expand(c.grid, c.base)


def test_bad_configurations(tmp_path):
  with pytest.raises(ValueError, match="budget: 100000 does not fit the world"):
    sweep.run(quick(budget=(100000,)), tmp_path / "a", progress=False)
  with pytest.raises(ValueError, match="schedule: unknown value 'pyramidal'"):
    sweep.run(quick(schedule=("pyramidal",)), tmp_path / "b", progress=False)
  with pytest.raises(ValueError, match="policy: unknown value 'snap'"):
    sweep.run(quick(policy=("snap",)), tmp_path / "c", progress=False)
  with pytest.raises(ValueError, match="kernel: expected a positive odd"):
    sweep.run(quick(kernel=(4,)), tmp_path / "d", progress=False)
  with pytest.raises(ValueError, match=r"policy: 'qfilter' cannot be swept: it reads evidence\.qf"):
    sweep.run(quick(policy=("qfilter",)), tmp_path / "f", progress=False)
  with pytest.raises(ValueError, match="policy: 'pyramidkv' cannot be swept: it allocates"):
    sweep.run(quick(policy=("pyramidkv",)), tmp_path / "g", progress=False)
  with pytest.raises(ValueError, match="schedule: HeadKV allocates across layers itself"):
    sweep.run(quick(schedule=("pyramid",), head_alloc=("headkv",)), tmp_path / "h", progress=False)
  sweep.run(quick(budget=(16,)), tmp_path / "e", progress=False, log=lambda *_: None)
  with pytest.raises(ValueError, match="workdir: .* holds a run of a different configuration"):
    sweep.run(quick(budget=(32,)), tmp_path / "e", progress=False)


def _covering(keys: list) -> list:
  """A few group keys in which every value of policy, schedule and head allocation appears."""
  fields = ("policy", "schedule", "head_alloc")
  chosen, seen = [], {f: set() for f in fields}
  for key in sorted(keys, key=str):
    if any(getattr(key, f) not in seen[f] for f in fields):
      chosen.append(key)
      for f in fields:
        seen[f].add(getattr(key, f))
  return chosen


# quick mode: the groups in which every policy, schedule and head allocation appears; the others
# (every triple) are slow
@pytest.mark.parametrize(
  "groups_of", ["covering", pytest.param("the_rest", marks=pytest.mark.slow)]
)
def test_vmapped_equals_loop_of_single_config_function(groups_of):
  c = quick(
    policy=("snapkv", "streaming_llm", "h2o"),
    schedule=("uniform", "pyramid", "cake"),
    head_alloc=("uniform", "adakv"),
    budget=(20, 40),
    sinks=(2, 4),
  )
  configs = sweep.expand(c.grid, c.base)
  engine = sweep.Engine(c.world, capacity=40, chunk_size=8)
  groups = {}
  for cfg in configs:
    groups.setdefault(sweep.group_key(cfg), []).append(cfg)
  covering = _covering(list(groups))
  groups = {k: v for k, v in groups.items() if (k in covering) == (groups_of == "covering")}
  for key, members in groups.items():
    rows = [r for chunk in engine.evaluate(members) for r in chunk]
    single = jax.jit(
      sweep.single_config_fn(key, engine.world_evidence(key.scenario).world.dims, 40)
    )
    ev = engine.evidence(key)
    for cfg, row in zip(members, rows, strict=True):
      data = {k: v[0] for k, v in sweep.stack_data([cfg], 1).items()}
      out = single(ev, data)
      for m in ("retained_mass", "oracle_gap", "fact_recall", "cache_tokens"):
        np.testing.assert_allclose(row[m], float(out[m]), rtol=1e-5, atol=1e-6)
  # one compile per static structure, however many chunks (prepare only assembles, unjitted)
  for fns in engine.compiled.values():
    for name in ("max_budget", "metrics"):
      assert fns[name]._cache_size() == 1, name
  # one CAKE statistics per scenario and rows measured: the window's (snapkv) and every
  # observation row (a policy that protects no window, as policy.budgets measures it)
  assert engine._cake_statistics._cache_size() == 2


def test_prefix_sum_metric_equals_the_mask_route():
  c = quick(policy=("snapkv",), head_alloc=("adakv",), schedule=("pyramid",), budget=(24,))
  cfg = sweep.expand(c.grid, c.base)[0]
  engine = sweep.Engine(c.world, capacity=24)
  row = next(engine.evaluate([cfg]))[0]
  key = sweep.group_key(cfg)
  ev = engine.evidence(key)
  dims = engine.world_evidence(key.scenario).world.dims
  d = {k: jnp.asarray(v[0]) for k, v in sweep.stack_data([cfg], 1).items()}
  fns = sweep.make_group(key, dims, 24, 2)
  state = fns.prepare(ev)
  scores, budget_LH = state["scores"], fns.allocate(state, d)
  keep = select.top_mask(scores, budget_LH)
  expected = float((np.asarray(ev["mass"]) * np.asarray(keep)).sum(-1).mean())
  np.testing.assert_allclose(row["retained_mass"], expected, rtol=1e-5)
  assert row["cache_tokens"] == int(np.asarray(budget_LH).sum())


def _table_scores(kind: str, shape=(3, 6, 64)) -> jax.Array:
  """Scores that stress Ada-KV's pooled table: one head far ahead of the others (it wins more
  than its share), heavy ties, both zeros, and ``-inf`` entries that tie with the left-out
  window."""
  key = jax.random.key({"skewed": 0, "ties": 1, "inf": 2}[kind])
  x = jax.random.uniform(key, shape)
  if kind == "skewed":
    x = x.at[:, 0].add(1.0)
  elif kind == "ties":
    x = jnp.round(x * 3) / 3
    x = jnp.where(x == 0, -0.0, x)
  else:
    x = jnp.where(x < 0.4, -jnp.inf, x)
  return x.at[..., -4:].set(jnp.inf)  # the protected window, as the scorers give it


@pytest.mark.parametrize("kind", ["skewed", "ties", "inf"])
@pytest.mark.parametrize("capacity", [3, 10, 36])
def test_adakv_table_from_each_heads_order_equals_the_pooled_table(kind, capacity):
  scores, window = _table_scores(kind), 4
  L, H, P = scores.shape
  expected = np.asarray(budgets.adakv_table(scores, window, capacity))
  order = select.descending_order(scores, P)
  cap = min(capacity, P - window)
  shallow_exact = False
  for depth in sorted({min(P, cap + window + extra) for extra in (0, cap, 3 * cap)} | {P}):
    table, exact = budgets.adakv_table_from_order(scores, order, window, capacity, depth)
    if bool(exact):  # exact, or it says it is not
      np.testing.assert_array_equal(np.asarray(table), expected)
      shallow_exact |= depth < P
    assert bool(exact) or depth < P or kind == "inf"  # all of it: -inf ties the window only
  assert shallow_exact or kind == "skewed" or capacity != 10  # the pooled union was shallower
  # the engine deepens until exact, then falls back to the full pooled sort
  engine = sweep.Engine(quick().world, capacity=capacity)
  for start in (None, cap + window):  # the first try (P at this size), or a shallow one
    table = engine.pooled_table(sweep.ScoreSet(scores), window, capacity, start)
    np.testing.assert_array_equal(np.asarray(table), expected)


def test_adakv_from_a_shallow_head_order_equals_the_loop():
  c = quick(policy=("snapkv",), schedule=("uniform", "pyramid"), head_alloc=("adakv",))
  c.grid.product.budget = (20, 40)
  c.world.update(num_heads=8, prompt_len=1024, gen_steps=8)
  configs = sweep.expand(c.grid, c.base)
  engine = sweep.Engine(c.world, capacity=40, chunk_size=8)
  assert sweep.table_depth(81, 8, 1024) < 1024  # the pooled table's first try is shallower
  for key in dict.fromkeys(sweep.group_key(cfg) for cfg in configs):
    members = [cfg for cfg in configs if sweep.group_key(cfg) == key]
    rows = [r for chunk in engine.evaluate(members) for r in chunk]
    single = jax.jit(
      sweep.single_config_fn(key, engine.world_evidence(key.scenario).world.dims, 40)
    )
    for cfg, row in zip(members, rows, strict=True):
      out = single(engine.evidence(key), {k: v[0] for k, v in sweep.stack_data([cfg], 1).items()})
      for m in ("retained_mass", "oracle_gap", "fact_recall", "cache_tokens"):
        np.testing.assert_allclose(row[m], float(out[m]), rtol=1e-5, atol=1e-6)


def test_one_sort_per_layer_is_the_same_order():
  x = jnp.round(jax.random.uniform(jax.random.key(4), (3, 5, 64)) * 8)  # heavy ties
  for k in (4, 64):  # top_k, then the full sort
    np.testing.assert_array_equal(
      np.asarray(select.descending_order_by_layer(x, k)), np.asarray(select.descending_order(x, k))
    )


def test_small_groups_pad_to_a_power_of_two():
  engine = sweep.Engine(quick().world, capacity=32, chunk_size=1000)
  assert [engine.chunk_shape(n) for n in (1, 3, 167, 256, 999, 5000)] == [
    1,
    4,
    256,
    256,
    1000,
    1000,
  ]


def test_oracle_prefix_from_the_worlds_order_equals_the_sorted_one():
  mass = jax.random.uniform(jax.random.key(3), (2, 3, 64)) ** 4
  mass = mass.at[0, 0, :10].set(0.0)
  descending = sweep.descending_mass(mass)
  for cap in (4, 8, 9, 40, 64):  # top_k below P / 8, the sort past it
    np.testing.assert_array_equal(
      np.asarray(sweep.oracle_prefix_from(descending, cap)),
      np.asarray(sweep.oracle_prefix(mass, cap)),
    )


def test_the_sweeps_world_without_values_has_the_same_tables():
  cfg = synthetic.world_config("needle_qa", quick().world)
  full, bare = synthetic.make_world(cfg), synthetic.make_world(cfg, values=False)
  assert bare.values_LHTD.shape == full.values_LHTD.shape[:-1] + (0,)
  for name, a in vars(full).items():
    if name not in ("values_LHTD", "dims"):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(getattr(bare, name)), err_msg=name)


def run_cli(workdir, *extra, env=None, wait=True):
  cmd = [
    sys.executable,
    "-m",
    "experiments.sweep",
    "--config=configs/sweep_lab.py:quick",
    f"--config.workdir={workdir}",
    *extra,
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
  if not wait:
    return subprocess.Popen(
      cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_compilation_cache_setting(monkeypatch, tmp_path):
  monkeypatch.delenv(sweep.COMPILATION_CACHE_ENV, raising=False)
  assert sweep.compilation_cache_dir(None) is None  # off by default
  assert sweep.compilation_cache_dir("") is None and sweep.compilation_cache_dir("off") is None
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert sweep.compilation_cache_dir("default") == tmp_path / "kvjax" / "jax"
  monkeypatch.setenv(sweep.COMPILATION_CACHE_ENV, "1")
  assert sweep.compilation_cache_dir(None) == tmp_path / "kvjax" / "jax"
  assert sweep.compilation_cache_dir("") is None  # the config field wins over the environment
  assert sweep.compilation_cache_dir(str(tmp_path / "cc")) == tmp_path / "cc"
  with pytest.raises(ValueError, match="compilation_cache: expected a str"):
    sweep.compilation_cache_dir(3)


@pytest.fixture(scope="module")
def quick_cli_run(tmp_path_factory):
  """``(workdir, completed process)`` of one run of the quick sweep's entry point on one device
  (with plots and its own persistent compilation cache), read by the tests below."""
  workdir = tmp_path_factory.mktemp("quick_cli")
  return workdir, run_cli(workdir, f"--config.compilation_cache={workdir / 'compiled'}")


def test_entry_point_writes_results_and_plots(quick_cli_run):
  tmp_path, out = quick_cli_run
  cache = tmp_path / "compiled"
  assert out.returncode == 0, out.stderr[-3000:]
  assert any(cache.iterdir()), "the persistent compilation cache stayed empty"
  assert f"run directory: {tmp_path}" in out.stdout
  table = pd.read_csv(tmp_path / "results.csv")
  assert len(table) == 12 and table["config_id"].is_unique
  for col in (
    "config_id",
    "policy",
    "schedule",
    "budget",
    "retained_mass",
    "oracle_gap",
    "cache_bytes",
  ):
    assert col in table.columns
  for png in ("metric_vs_budget.png", "budget_profiles.png", "pareto.png"):
    assert (tmp_path / png).stat().st_size > 5000
  assert json.loads((tmp_path / "sweep.json").read_text())["grid"]["product"]["budget"] == [
    16,
    32,
    64,
  ]


def test_interrupted_run_resumes_without_loss_or_duplicates(tmp_path):
  budgets = "--config.grid.product.budget=(12,16,20,24,28,32,40,48,56,64)"
  proc = run_cli(tmp_path / "run", budgets, "--config.chunk_size=2", "--noplots", wait=False)
  results = tmp_path / "run" / "results.csv"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if results.exists() and results.read_text().count("\n") >= 4:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
  partial = pd.read_csv(results)
  assert 0 < len(partial) < 40
  out = run_cli(tmp_path / "run", budgets, "--config.chunk_size=2", "--noplots")
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"{len(partial)} already in" in out.stdout + out.stderr
  resumed = pd.read_csv(results)
  assert len(resumed) == 40 and resumed["config_id"].is_unique
  clean = run_cli(tmp_path / "clean", budgets, "--noplots")
  assert clean.returncode == 0
  fresh = pd.read_csv(tmp_path / "clean" / "results.csv").set_index("config_id").sort_index()
  resumed = resumed.set_index("config_id").sort_index()
  pd.testing.assert_series_equal(resumed["retained_mass"], fresh["retained_mass"], rtol=1e-6)


def test_sharded_over_8_host_devices_matches_one_device(tmp_path, quick_cli_run):
  one_dir, one = quick_cli_run  # the same quick sweep on one device
  eight = run_cli(tmp_path / "eight", "--noplots", env=forced_devices_env(8))
  assert one.returncode == 0 and eight.returncode == 0, eight.stderr[-3000:]
  a = pd.read_csv(one_dir / "results.csv").set_index("config_id").sort_index()
  b = pd.read_csv(tmp_path / "eight" / "results.csv").set_index("config_id").sort_index()
  for m in ("retained_mass", "oracle_gap", "fact_recall", "cache_tokens"):
    np.testing.assert_allclose(a[m], b[m], rtol=1e-5, atol=1e-7)


REPLICATED_PROBE = """
import sys
sys.path.insert(0, {root!r})
import jax
from configs import sweep_lab
from kvjax.lab import sweep
c = sweep_lab.get_config("quick")
engine = sweep.Engine(c.world, capacity=32)
key = sweep.group_key(sweep.expand(c.grid, c.base)[0])
a, b = engine.evidence(key), engine.evidence(key)
assert len(jax.devices()) == 8
assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in a.values())
assert all(a[k] is b[k] for k in a)  # placed once, reused
print("ok")
"""


def test_shared_state_is_placed_once_replicated_over_8_devices():
  out = subprocess.run(
    [sys.executable, "-c", REPLICATED_PROBE.format(root=str(ROOT))],
    capture_output=True,
    text=True,
    env=forced_devices_env(8),
    timeout=300,
  )
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("beta", 0.5, "beta: 0.5 is invalid"),
    ("alpha", 1.5, "alpha"),
    ("head_beta", 1.0, "head_beta"),
    ("tau1", 0.0, "tau1"),
    ("sinks", -3, "sinks"),
  ],
)
def test_data_fields_are_validated(tmp_path, field, value, match):
  c = quick()
  c.grid.product = ml_collections.ConfigDict({field: (value,), "budget": (32,)})
  with pytest.raises(ValueError, match=match):
    sweep.run(c, tmp_path, progress=False)


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("chunk_size", 0, "chunk_size: expected an int in"),
    ("chunk_size", -4, "chunk_size: expected an int in"),
    ("bytes_per_value", 3, r"bytes_per_value: expected an int in \(1, 2, 4\)"),
  ],
)
def test_sweep_options_are_validated_before_anything_is_written(tmp_path, field, value, match):
  c = quick()
  c[field] = value
  with pytest.raises(ValueError, match=match):
    sweep.run(c, tmp_path / "run", progress=False)
  assert not (tmp_path / "run").exists()


def test_a_second_run_into_a_locked_workdir_refuses_and_writes_nothing(tmp_path):
  with rundir.lock(tmp_path):
    out = run_cli(tmp_path, "--noplots")
  assert out.returncode != 0
  assert f"workdir: {tmp_path} is in use by another run (pid {os.getpid()}" in out.stderr
  assert not (tmp_path / "results.csv").exists() and not (tmp_path / "sweep.json").exists()


def test_resume_reruns_cut_and_invalid_rows_and_drops_repeats(tmp_path):
  c = quick()
  quiet = dict(progress=False, log=lambda *_: None)
  fresh = sweep.run(c, tmp_path, **quiet).set_index("config_id").sort_index()
  path = tmp_path / "results.csv"
  lines = path.read_text().splitlines()
  header = lines[0]
  cut = lines[3][: len(lines[3]) * 2 // 3]  # a row cut in the middle of the file (kept there)
  nan = lines[5].split(",")
  nan[header.split(",").index("retained_mass")] = "nan"
  damaged = [header, lines[1], lines[2], cut, lines[4], ",".join(nan), header, lines[6]]
  damaged += [lines[2], *lines[7:]]  # lines[2] twice
  path.write_text("\n".join(damaged) + "\n")
  logs = []
  resumed = sweep.run(c, tmp_path, progress=False, log=logs.append)
  assert any("dropped 4 invalid or repeated lines" in line for line in logs), logs
  assert any("10 already in" in line for line in logs), logs
  text = path.read_text().splitlines()
  assert text.count(header) == 1 and len(text) == 13
  assert resumed["config_id"].is_unique and len(resumed) == 12
  resumed = resumed.set_index("config_id").sort_index()
  for m in sweep.METRICS:
    np.testing.assert_allclose(resumed[m], fresh[m], rtol=1e-6, err_msg=m)


def test_the_builtin_sweepable_policies():
  assert set(sweep.sweepable()) == {
    *("snapkv", "snapkv_kvpress", "h2o", "h2o_kvpress", "tova", "streaming_llm"),
    *("sliding_window", "random", "oracle", "chunkkv_snapkv", "knorm", "keydiff", "lagkv"),
    *("curkv", "chunk_keydiff"),
  }

  # every policy the lab replays, that takes its budget as given (the axes allocate), scores
  # independently of the budget and has no data option beyond the sweep's axes
  def fits(name):
    policy = policies.make(name)
    extra = set(policy.data_options) - set(grid.DATA_FIELDS)
    return not (policy.allocates or policy.rescores or extra)

  assert {n for n in online.replayable() if fits(n)} == set(sweep.sweepable())
  assert online.LAB_EVIDENCE <= sweep.SWEEP_EVIDENCE


@pytest.mark.parametrize(
  "schedule, head_alloc",
  [
    *(("uniform", h) for h in ("uniform", "adakv", "headkv")),
    *(("pyramid", h) for h in ("uniform", "adakv")),
    *(("cake", h) for h in ("uniform", "adakv")),
  ],
)
def test_the_axes_allocate_as_the_registrys_allocators(schedule, head_alloc):
  c = quick()
  cfg = dict(sweep.expand(c.grid, c.base)[0], schedule=schedule, head_alloc=head_alloc)
  cfg.update(budget=40, beta=4.0, alpha=0.3, head_beta=1.2, tau1=1.6, tau2=0.4)
  key = sweep.group_key(cfg)
  engine = sweep.Engine(c.world, capacity=40)
  ev = engine.evidence(key)
  fns = sweep.make_group(key, engine.world_evidence(key.scenario).world.dims, 40, 2)
  state = fns.prepare(ev)
  d = {k: jnp.asarray(v[0]) for k, v in sweep.stack_data([cfg], 1).items()}
  layers, heads = sweep.allocators(key, d)
  assert type(layers) is sweep.SCHEDULES[schedule] and type(heads) is sweep.HEAD_ALLOCS[head_alloc]
  if schedule == "pyramid":
    assert layers.pyramid_mode == cfg["pyramid_mode"] and float(layers.beta) == 4.0
  evidence = policies.Evidence(attn_window_LHWT=ev["attn"], head_scores_LH=ev.get("head_scores"))
  scores, w = state["scores"], key.window
  if isinstance(heads, policies.HeadKV):
    expected = heads(evidence, scores, d["budget"], w)
  else:
    expected = heads(evidence, scores, layers(evidence, scores, d["budget"], w)[:, 0], w)
  np.testing.assert_array_equal(np.asarray(fns.allocate(state, d)), np.asarray(expected))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LastRow(policies.Policy):
  """The last prompt query's attention (a prefill scorer written outside kvjax)."""

  needs = frozenset({"attn_window_LHWT"})

  def score(self, evidence):
    return evidence.attn_window_LHWT[:, :, -1, :]


def test_a_registered_scorer_is_swept_by_name(tmp_path):
  c = quick(policy=("last_row_sweep_test",), budget=(16, 32))
  policies.register("last_row_sweep_test", LastRow)
  try:
    assert "last_row_sweep_test" in sweep.sweepable()
    table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
  finally:
    policies.unregister("last_row_sweep_test")
  engine = sweep.Engine(c.world, capacity=32)
  ev = engine.world_evidence(c.base.scenario)
  last, mass = np.asarray(ev.attn_window_LHWP)[:, :, -1], np.asarray(ev.future_mass_LHP)
  for b in (16, 32):  # each head's top b of the last row, judged by the future mass
    kept = np.argsort(-last, -1, kind="stable")[..., :b]
    expected = np.take_along_axis(mass, kept, -1).sum(-1).mean()
    row = table[table.budget == b]
    np.testing.assert_allclose(row.retained_mass.item(), expected, rtol=1e-5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstRow(policies.Policy):
  """The first window query's attention (another scorer for the name of :class:`LastRow`)."""

  needs = frozenset({"attn_window_LHWT"})

  def score(self, evidence):
    return evidence.attn_window_LHWT[:, :, 0, :]


def test_a_name_registered_again_scores_with_its_new_policy():
  c = quick()
  cfg = dict(sweep.expand(c.grid, c.base)[0], policy="reregistered_sweep_test")
  scores = []
  try:
    for cls in (LastRow, FirstRow):
      policies.register("reregistered_sweep_test", cls, overwrite=True)
      scores.append(np.asarray(sweep.Engine(c.world, capacity=32).scores(sweep.group_key(cfg))))
  finally:
    policies.unregister("reregistered_sweep_test")
  attn = np.asarray(
    sweep.Engine(c.world, capacity=32).world_evidence(cfg["scenario"]).attn_window_LHWP
  )
  np.testing.assert_array_equal(scores[0], attn[:, :, -1])
  np.testing.assert_array_equal(scores[1], attn[:, :, 0])


def test_best_per_budget_leaves_out_what_reads_the_future():
  rows = [
    dict(budget=b, policy=p, schedule="uniform", head_alloc="uniform", retained_mass=m)
    | dict(oracle_gap=0.0, fact_recall=1.0, cache_bytes=1.0)
    for b in (16, 32)
    for p, m in (("oracle", 0.9), ("snapkv", 0.5), ("h2o", 0.6))
  ]
  best = sweep.best_per_budget(pd.DataFrame(rows))
  assert list(best.policy) == ["h2o", "h2o"]


# --------------------------------------------------------------------------- keys and values


@dataclasses.dataclass(frozen=True, kw_only=True)
class LargestValues(policies.Policy):
  """Keep the positions whose values have the largest L2 norm (a scorer written outside kvjax)."""

  needs = frozenset({"values_LGTD"})

  def score(self, evidence):
    return jnp.linalg.norm(evidence.values_LGTD, axis=-1)


def _kept_by_numpy(rank_LHP: np.ndarray, budget_LH: np.ndarray) -> np.ndarray:
  """``[L, H, P]`` bool: each head's first ``budget`` positions of ``rank`` (a stable sort: ties
  to the lower position, the selection's rule)."""
  order = np.argsort(rank_LHP, -1, kind="stable")
  keep = np.zeros(rank_LHP.shape, bool)
  for idx in np.ndindex(budget_LH.shape):
    keep[idx][order[idx][: budget_LH[idx]]] = True
  return keep


def _metrics_by_numpy(keep_LHP: np.ndarray, mass_LHP: np.ndarray, fact_P: np.ndarray) -> dict:
  L, H, _ = keep_LHP.shape
  return {
    "retained_mass": (mass_LHP * keep_LHP).sum(-1).mean(),
    "fact_recall": (keep_LHP & fact_P).sum() / max(fact_P.sum() * L * H, 1),
    "cache_tokens": keep_LHP.sum(),
  }


def test_key_and_value_scorers_are_swept_by_name(tmp_path):
  """Key norm (the lab's modelled keys) and a user's value-norm scorer (the world's values),
  both by name: what they keep and retain checked against numpy on the lab's keys and values."""
  name = "largest_values_sweep_test"
  c = quick(policy=("knorm", name), budget=(16, 48))
  policies.register(name, LargestValues)
  try:
    assert name in sweep.sweepable()
    table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
    engine = sweep.Engine(c.world, capacity=48)
    configs = sweep.expand(c.grid, c.base)
    engine_scores = {cfg["policy"]: engine.scores(sweep.group_key(cfg)) for cfg in configs}
  finally:
    policies.unregister(name)
  cfg = synthetic.world_config(c.base.scenario, c.world)
  world, P = synthetic.make_world(cfg), cfg.prompt_len  # the lab's world, with its values
  keys = np.asarray(keys_lib.world_keys(world, seed=cfg.seed), np.float64)[..., :P, :]
  values = np.asarray(world.values_LHTD, np.float64)[..., :P, :]
  ranks = {  # ascending: the first kept
    "knorm": np.linalg.norm(keys, axis=-1),  # the lowest key norms
    name: -np.linalg.norm(values, axis=-1),  # the largest value norms
  }
  ev = engine.world_evidence(c.base.scenario)
  mass, fact = np.asarray(ev.future_mass_LHP), np.asarray(ev.fact_P)
  L, H = mass.shape[:2]
  for policy, rank in ranks.items():
    for b in (16, 48):
      keep = _kept_by_numpy(rank, np.full((L, H), b))
      np.testing.assert_array_equal(
        np.asarray(select.top_mask(engine_scores[policy], b)), keep, err_msg=policy
      )
      row = table[(table.policy == policy) & (table.budget == b)]
      for m, expected in _metrics_by_numpy(keep, mass, fact).items():
        np.testing.assert_allclose(row[m].item(), expected, rtol=1e-5, err_msg=f"{policy} {m}")


def test_keys_and_values_are_the_labs_and_built_only_when_read():
  c = quick()
  c.world.update(prompt_len=384)  # past LagKV's sinks + 2 * lag: its chunked scores
  engine = sweep.Engine(c.world, capacity=64)
  base = sweep.expand(c.grid, c.base)[0]
  ev = engine.world_evidence(base["scenario"])
  engine.scores(sweep.group_key(base))  # SnapKV reads neither
  assert ev._keys is None and ev._values is None
  cfg = synthetic.world_config(base["scenario"], c.world)
  world = synthetic.make_world(cfg)
  lab = online.key_evidence(
    world, online.prompt_evidence(world, jax.random.key(cfg.seed)), seed=cfg.seed
  )
  for policy in ("knorm", "keydiff", "lagkv"):
    key = sweep.group_key(dict(base, policy=policy))
    expected = policies.make(policy).scores(lab)  # the lab's replay scores these
    actual = np.asarray(engine.scores(key))  # fused in one program: within float rounding
    np.testing.assert_allclose(actual, np.asarray(expected), rtol=1e-5, atol=1e-6, err_msg=policy)
    if policy == "knorm":
      assert ev._keys is not None and ev._values is None  # keys alone: no world with values
  np.testing.assert_array_equal(np.asarray(ev.keys_LHPD), np.asarray(lab.keys_LGTD))
  np.testing.assert_array_equal(np.asarray(ev.values_LHPD), np.asarray(lab.values_LGTD))


# --------------------------------------------------------------------------- a user's allocators


@dataclasses.dataclass(frozen=True)
class LinearRamp(policies.Allocator):
  """Layer budgets rising linearly from ``low`` x the budget to ``2 - low`` x, never below the
  protected window + 1 (a layer schedule written outside kvjax)."""

  low: float = 0.5

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, _ = scores_LHT.shape
    budget_L = jnp.floor(budget * jnp.linspace(self.low, 2.0 - self.low, L))
    budget_L = jnp.maximum(budget_L, window + 1).astype(jnp.int32)
    return jnp.broadcast_to(budget_L[:, None], (L, H))


@dataclasses.dataclass(frozen=True)
class HeadTilt(policies.Allocator):
  """Each layer's budget tilted across its heads, from ``1 - tilt`` x to ``1 + tilt`` x, never
  below the protected window + 1 (a head allocation written outside kvjax)."""

  budget_ndim = 1  # takes a budget per layer
  tilt: float = 0.5

  def __call__(self, evidence, scores_LHT, budget_L, window):
    L, H, _ = scores_LHT.shape
    budget_L = jnp.broadcast_to(jnp.asarray(budget_L), (L,))
    scale_H = jnp.linspace(1.0 - self.tilt, 1.0 + self.tilt, H)
    tilted = jnp.floor(budget_L[:, None] * scale_H[None])
    return jnp.maximum(tilted, window + 1).astype(jnp.int32)


def test_a_users_allocators_on_the_schedule_and_head_alloc_axes(tmp_path):
  """A registered schedule and head allocation, their numbers swept as data, called through the
  Allocator protocol under vmap: budgets, kept mass and recall checked against numpy."""
  sweep.register_schedule("linear_ramp_test", LinearRamp, axes={"low": "alpha"})
  sweep.register_head_alloc("head_tilt_test", HeadTilt, axes={"tilt": "tau2"})
  c = quick(
    policy=("snapkv", "streaming_llm"),
    schedule=("linear_ramp_test", "uniform"),
    head_alloc=("uniform", "head_tilt_test"),
    budget=(20, 40),
    alpha=(0.25, 0.625),  # multipliers k / 8 at L = H = 4: exact in float32 and float64
  )
  c.base.tau2 = 0.375
  c.world.num_layers = 4
  try:
    table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
  finally:
    sweep.unregister_schedule("linear_ramp_test")
    sweep.unregister_head_alloc("head_tilt_test")
  assert "linear_ramp_test" not in sweep.SCHEDULES and LinearRamp not in sweep.ALLOCATOR_AXES
  assert len(table) == 2 * 2 * 2 * 2 * 2
  engine = sweep.Engine(c.world, capacity=40)
  ev = engine.world_evidence(c.base.scenario)
  attn, mass, fact = (np.asarray(a) for a in (ev.attn_window_LHWP, ev.future_mass_LHP, ev.fact_P))
  L, H, P = mass.shape
  w = c.base.window
  evidence = policies.Evidence(attn_window_LHWT=jnp.asarray(attn))
  ranks = {
    "snapkv": -np.asarray(policies.make("snapkv", window=w).scores(evidence)),
    "streaming_llm": -np.asarray(
      policies.make("streaming_llm", sinks=c.base.sinks).scores(evidence)
    ),
  }
  for row in table.itertuples():
    budget_L = np.full(L, row.budget, np.float64)
    # the allocators' floor is the policy's own protected window + 1 (none for streaming_llm)
    w_row = w if row.policy == "snapkv" else 0
    if row.schedule == "linear_ramp_test":
      budget_L = np.maximum(
        np.floor(row.budget * np.linspace(row.alpha, 2 - row.alpha, L)), w_row + 1
      )
    budget_LH = np.broadcast_to(budget_L[:, None], (L, H))
    if row.head_alloc == "head_tilt_test":
      tilt = np.linspace(1 - row.tau2, 1 + row.tau2, H)
      budget_LH = np.maximum(np.floor(budget_L[:, None] * tilt), w_row + 1)
    budget_LH = budget_LH.astype(int)
    assert json.loads(row.budget_profile) == np.round(budget_LH.mean(-1), 2).tolist(), row
    keep = _kept_by_numpy(ranks[row.policy], budget_LH)
    for m, expected in _metrics_by_numpy(keep, mass, fact).items():
      np.testing.assert_allclose(getattr(row, m), expected, rtol=1e-5, err_msg=f"{row} {m}")


class SlowPyramid(policies.Pyramid):
  """PyramidKV's schedule without the engine's fast path (a subclass: called by the protocol)."""


class SlowCake(policies.CakeLayers):
  pass


class SlowAdaKV(policies.AdaKV):
  pass


class SlowHeadKV(policies.HeadKV):
  pass


def test_the_protocol_path_equals_the_fast_paths(tmp_path):
  """The built-in allocators' subclasses go through the Allocator protocol (the slow path); their
  rows equal the fast paths' (shared CAKE statistics, Ada-KV's pooled table, HeadKV)."""
  slow = {
    "schedule": {
      "slow_pyramid": (SlowPyramid, {"beta": "beta"}),
      "slow_cake": (SlowCake, {"tau1": "tau1", "tau2": "tau2"}),
    },
    "head_alloc": {
      "slow_adakv": (SlowAdaKV, {"floor_alpha": "alpha"}),
      "slow_headkv": (SlowHeadKV, {"beta": "head_beta"}),
    },
  }
  pairs = [  # (fast schedule, head_alloc) -> the same through the protocol
    (("pyramid", "adakv"), ("slow_pyramid", "adakv")),
    (("pyramid", "adakv"), ("pyramid", "slow_adakv")),
    (("cake", "uniform"), ("slow_cake", "uniform")),
    (("uniform", "headkv"), ("uniform", "slow_headkv")),
  ]
  both = list(dict.fromkeys(p for pair in pairs for p in pair))
  c = quick(policy=("snapkv", "streaming_llm"), budget=(20, 40))
  c.grid.zip = ml_collections.ConfigDict(
    dict(schedule=tuple(s for s, _ in both), head_alloc=tuple(h for _, h in both))
  )
  c.base.update(beta=4.0, alpha=0.3, head_beta=1.2, tau1=1.6, tau2=0.4)
  for name, (cls, axes) in slow["schedule"].items():
    sweep.register_schedule(name, cls, axes=axes)
  for name, (cls, axes) in slow["head_alloc"].items():
    sweep.register_head_alloc(name, cls, axes=axes)
  try:
    table = sweep.run(c, tmp_path, progress=False, log=lambda *_: None)
  finally:
    for name in slow["schedule"]:
      sweep.unregister_schedule(name)
    for name in slow["head_alloc"]:
      sweep.unregister_head_alloc(name)
  rows = table.set_index(["policy", "budget", "schedule", "head_alloc"]).sort_index()
  for fast, protocol in pairs:
    for policy in ("snapkv", "streaming_llm"):
      for b in (20, 40):
        a, z = rows.loc[(policy, b, *fast)], rows.loc[(policy, b, *protocol)]
        assert a.budget_profile == z.budget_profile, (fast, protocol, policy, b)
        for m in sweep.METRICS:
          np.testing.assert_allclose(z[m], a[m], rtol=1e-6, err_msg=f"{fast} {protocol} {m}")


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: sweep.register_schedule("pyramid", LinearRamp), "'pyramid' is a built-in schedule"),
    (lambda: sweep.register_schedule("my ramp", LinearRamp), "expected an identifier"),
    (lambda: sweep.register_schedule("ramp_x", object), "expected a kvjax.policies.Allocator"),
    (
      lambda: sweep.register_schedule("ramp_x", LinearRamp, axes={"high": "alpha"}),
      r"'high' is not a field of LinearRamp; expected one of \['low'\]",
    ),
    (
      lambda: sweep.register_schedule("ramp_x", LinearRamp, axes={"low": "budget"}),
      "'low' -> 'budget' is not a data axis",
    ),
    (
      lambda: sweep.register_head_alloc("duo_x", policies.DuoSplit),
      r"reads evidence\.retrieval_heads_LG, which the sweep's world does not provide",
    ),
    (
      lambda: sweep.register_head_alloc("pyramid_x", policies.Pyramid, axes={"beta": "tau1"}),
      r"Pyramid is swept by the axes \{'beta': 'beta'\} already",
    ),
    (lambda: sweep.unregister_schedule("cake"), "'cake' is a built-in schedule"),
    (lambda: sweep.unregister_head_alloc("nope"), "head_alloc 'nope' is not registered"),
  ],
)
def test_allocator_registration_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()
  assert set(sweep.SCHEDULES) == {"uniform", "pyramid", "cake"}
  assert set(sweep.HEAD_ALLOCS) == {"uniform", "adakv", "headkv"}


def test_a_users_allocator_validates_its_numbers_and_names_the_axis(tmp_path):
  @dataclasses.dataclass(frozen=True)
  class CheckedRamp(LinearRamp):
    def __post_init__(self):
      budgets.check_real("low", self.low, low=0.0, high=1.0)  # concrete values only

  sweep.register_schedule("checked_ramp_test", CheckedRamp, axes={"low": "beta"})
  try:
    with pytest.raises(ValueError, match="schedule: 'checked_ramp_test' rejects this config"):
      sweep.run(quick(schedule=("checked_ramp_test",), beta=(4.0,)), tmp_path, progress=False)
    with pytest.raises(ValueError, match="name: schedule 'checked_ramp_test' is registered"):
      sweep.register_schedule("checked_ramp_test", CheckedRamp)
  finally:
    sweep.unregister_schedule("checked_ramp_test")


def test_results_without_sweep_json_are_refused_never_adopted(tmp_path):
  quiet = dict(progress=False, log=lambda *_: None)
  c = quick(policy=("snapkv",), budget=(16, 32))
  sweep.run(c, tmp_path, **quiet)
  results = (tmp_path / "results.csv").read_bytes()
  (tmp_path / "sweep.json").unlink()
  c.world.seed = 1  # another world: the old rows are not its results
  with pytest.raises(ValueError, match=r"holds results but no sweep.json"):
    sweep.run(c, tmp_path, **quiet)
  assert (tmp_path / "results.csv").read_bytes() == results
  assert not (tmp_path / "sweep.json").exists()


def test_a_garbage_claim_or_binary_results_are_refused_and_kept(tmp_path):
  quiet = dict(progress=False, log=lambda *_: None)
  c = quick(policy=("snapkv",), budget=(16,))
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "sweep.json").write_bytes(b"\xff\xfe\x00\x01")
  with pytest.raises(ValueError, match=r"sweep.json is not a claim file"):
    sweep.run(c, tmp_path / "a", **quiet)
  assert (tmp_path / "a" / "sweep.json").read_bytes() == b"\xff\xfe\x00\x01"
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "sweep.json").write_text(sweep.grid_signature(c))
  binary = bytes(range(10)) + bytes(range(11, 256))  # no newline byte
  (tmp_path / "b" / "results.csv").write_bytes(binary)
  with pytest.raises(ValueError, match=r"results.csv holds no line and does not start like"):
    sweep.run(c, tmp_path / "b", **quiet)
  assert (tmp_path / "b" / "results.csv").read_bytes() == binary


def test_a_repeated_axis_value_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"grid.product.policy: 'snapkv' appear more than once"):
    sweep.run(quick(policy=("snapkv", "h2o", "snapkv")), tmp_path / "w", progress=False)
  c = quick(policy=("snapkv",))
  del c["bytes_per_value"]
  with pytest.raises(ValueError, match=r"config.bytes_per_value: missing"):
    sweep.prepare(c)
  assert not (tmp_path / "w").exists()


def test_an_empty_workdir_or_unknown_field_on_the_command_line_is_refused(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.sweep",
      f"--config={ROOT}/configs/sweep_lab.py:quick",
      "--config.workdir=",
      "--noplots",
    ],
    cwd=tmp_path,  # the current directory must stay empty
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode != 0 and "workdir: got the empty path ''" in out.stderr, out.stderr[-2000:]
  assert not any(tmp_path.iterdir())
  typo = run_cli(tmp_path / "w", "--config.chunk_sise=4")
  assert typo.returncode != 0
  assert "ValueError: --config.chunk_sise: the config has no field 'chunk_sise'" in typo.stderr


def test_a_ratio_axis_sweeps_the_budgets_it_keeps(tmp_path):
  """``ratio`` instead of ``budget``: each configuration keeps kvpress's ``int(P * (1 - r))``,
  its metrics are the equivalent budget's, its row holds the ratio, one compile per group, and
  the run resumes."""
  ratios = (0.25, 0.5, 0.875, 0.95)
  c = sweep_lab.get_config("quick,ratios")
  c.grid.product = ml_collections.ConfigDict(
    dict(policy=("snapkv", "h2o"), schedule=("uniform", "pyramid"), ratio=ratios)
  )
  assert "budget" not in sweep_lab.get_config("quick,ratios").grid.product
  table = sweep.run(c, tmp_path / "r", progress=False, log=lambda *_: None)
  P = c.world.prompt_len
  want = {r: int(P * (1 - r)) for r in ratios}  # 144, 96, 24, 9 of 192
  assert all(want[r] == b for r, b in zip(table["ratio"], table["budget"], strict=True))
  budgets = quick(policy=("snapkv", "h2o"), schedule=("uniform", "pyramid"))
  budgets.grid.product.budget = tuple(want.values())
  theirs = sweep.run(budgets, tmp_path / "b", progress=False, log=lambda *_: None)
  assert "ratio" not in theirs.columns
  key = ["policy", "schedule", "budget"]
  merged = table.merge(theirs, on=key, suffixes=("", "_b"))
  assert len(merged) == len(table) == 16
  for m in sweep.METRICS:
    np.testing.assert_array_equal(merged[m], merged[f"{m}_b"], err_msg=m)
  header = (tmp_path / "r" / "results.csv").read_text().splitlines()[0].split(",")
  assert tuple(header) == sweep.RATIO_RESULT_COLUMNS
  logs = []
  again = sweep.run(c, tmp_path / "r", progress=False, log=logs.append)
  assert len(again) == 16 and "0 to run" in logs[-1]
  engine = sweep.prepare(c)[1]
  configs = sweep.resolve_ratios(sweep.expand(c.grid, c.base), c.world)
  groups = {}
  for cfg in configs:
    groups.setdefault(sweep.group_key(cfg), []).append(cfg)
  for rows in engine.evaluate_groups(groups):
    assert all("ratio" in r for r in rows)
  for fns in engine.compiled.values():  # four ratios, one compile per static structure
    assert fns["metrics"]._cache_size() == 1
  best = sweep.best_per_budget(table)
  assert list(best["ratio"]) == sorted(ratios, reverse=True)  # ascending budgets


@pytest.mark.parametrize(
  "product, match",
  [
    (dict(ratio=(0.5,), budget=(16,)), "grid: axes 'budget' and 'ratio' both given"),
    (dict(ratio=(1.0,)), "grid: axis 'ratio' value 1.0 is not a compression ratio"),
    (dict(ratio=(True,)), "grid: axis 'ratio' value True is not a compression ratio"),
    (dict(ratio=("0.5",)), "grid: axis 'ratio' value '0.5' is not a compression ratio"),
    (dict(ratio=(0.99,)), r"ratio: 0.99 keeps 1 of the 192 prompt tokens per head; expected a"),
  ],
)
def test_bad_ratio_axes(tmp_path, product, match):
  c = quick(**product)
  with pytest.raises(ValueError, match=match):
    sweep.run(c, tmp_path / "w", progress=False)
  assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
