"""The lab's audit: the essay's checks and qualitative claims, on generated worlds."""

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from kvjax import lab, policies
from kvjax.lab import metrics, online, suite, synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = dict(num_layers=4, num_heads=4)
BUDGET = 64
# the lab's options (configs/lab.py's policy_options): H2O with official H2O's half-budget recent
# window; a bare "h2o" is the registry's (recent 8)
OPTIONS = {"h2o": dict(recent=None)}


@functools.cache
def world(name: str, **kw) -> synthetic.World:
  return synthetic.make_world(synthetic.scenario(name, **SIZES, **kw))


@functools.cache
def trace(name: str, policy: str, budget: int = BUDGET) -> online.Trace:
  options = OPTIONS.get(policy, {})
  return online.simulate(world(name), policy, budget, record_map=True, **options)


def mass(name, policy, budget=BUDGET, steps=slice(None)):
  return float(np.asarray(trace(name, policy, budget).metrics.retained)[steps].mean())


@pytest.mark.parametrize("name", synthetic.SCENARIOS)
def test_rows_are_distributions_over_the_causal_prefix(name):
  w = world(name)
  P, T = w.dims.prompt_len, w.dims.total_len
  for t in (0, 3, P - w.dims.window, P - 1, P, P + 40, T - 1):
    row = np.asarray(synthetic.attention_row(w, t))
    assert (row >= 0).all()
    np.testing.assert_allclose(row[..., : t + 1].sum(-1), 1.0, atol=1e-5)
    assert (row[..., t + 1 :] == 0).all()


def test_determinism():
  a = synthetic.make_world(synthetic.scenario("needle_qa", **SIZES))
  b = synthetic.make_world(synthetic.scenario("needle_qa", **SIZES))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  t1 = online.simulate(a, "h2o", 48)
  t2 = online.simulate(b, "h2o", 48)
  np.testing.assert_array_equal(np.asarray(t1.metrics.retained), np.asarray(t2.metrics.retained))
  c = synthetic.make_world(synthetic.scenario("needle_qa", seed=1, **SIZES))
  assert not np.array_equal(np.asarray(a.salience_LHT), np.asarray(c.salience_LHT))


@pytest.mark.parametrize(
  ("name", "seed"), [("topic_drift", 0), ("funnel", 7), ("needle_qa", 2**40 + 3)]
)
def test_salience_is_the_op_by_op_sum_to_the_bit(name, seed):
  """The world's tables come from one jitted program, but the salience is scaled and summed op
  by op: fused with the draw, XLA:CPU contracts multiplies and additions (1-2 ulp off)."""
  cfg = synthetic.scenario(name, seed=seed, **SIZES)
  w = synthetic.make_world(cfg)
  k_sal = jax.random.split(jax.random.key(seed), 3)[0]
  noise = np.asarray(jax.random.normal(k_sal, (cfg.num_layers, cfg.num_heads, cfg.total_len)))
  fact = np.zeros(cfg.total_len, bool)
  for pos in cfg.fact_positions:
    fact[pos : pos + cfg.fact_span] = True
  expected = np.float32(cfg.salience_scale) * noise
  expected = expected + np.float32(cfg.fact_salience) * fact.astype(np.float32)
  if cfg.drift_step >= 0:
    start = cfg.prompt_len + cfg.drift_step
    drift = np.zeros(cfg.total_len, np.float32)
    drift[start : start + cfg.drift_tokens] = cfg.drift_salience
    expected = expected + drift
  assert expected.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(w.salience_LHT), expected)


@pytest.mark.parametrize("policy", online.LAB_POLICIES)
def test_budget_mass_bounds_and_oracle_at_every_step(policy):
  tr = trace("streaming_chat", policy)
  w = world("streaming_chat")
  valid = np.asarray(tr.valid_SLHC)
  pos = np.asarray(tr.positions_SLHC)
  budget = np.asarray(tr.budget_LH)
  counts = valid.sum(-1)
  assert (counts <= budget).all(), "over budget"
  t = w.dims.prompt_len + np.arange(w.dims.gen_steps)
  np.testing.assert_array_equal(counts, np.minimum(budget, t[:, None, None] + 1))
  assert ((pos == t[:, None, None, None]) & valid).any(-1).all(), "current token not cached"
  assert (pos[valid] <= np.broadcast_to(t[:, None, None, None], pos.shape)[valid]).all()
  r = np.asarray(tr.metrics.retained)
  assert (r >= -1e-6).all() and (r <= 1 + 1e-5).all()
  assert (np.asarray(tr.metrics.oracle) >= r - 1e-5).all(), "oracle must upper-bound every step"


def test_allocations_run_in_the_lab():
  pyramid = np.asarray(trace("funnel", "pyramidkv").budget_LH)
  assert pyramid[0, 0] > pyramid[-1, 0], "PyramidKV gives lower layers more"
  ada = np.asarray(trace("funnel", "adakv_snapkv").budget_LH)
  assert len(np.unique(ada)) > 1, "Ada-KV gives heads different budgets"


def test_sink_plus_window_beats_sliding_when_sinks_present():
  assert mass("streaming_chat", "streaming_llm") > mass("streaming_chat", "sliding_window") + 0.2


def test_heavy_hitters_beat_sliding_in_fact_heavy_setting():
  assert mass("needle_qa", "h2o") > mass("needle_qa", "sliding_window") + 0.2


def test_observation_voting_retains_old_facts_in_needle():
  s = metrics.summarize(trace("needle_qa", "snapkv").metrics)
  assert s["fact_recall"] >= 0.99
  assert metrics.summarize(trace("needle_qa", "sliding_window").metrics)["fact_recall"] == 0.0


def test_shrinking_the_budget_makes_recency_fail_in_needle_qa():
  w = world("needle_qa")
  big = w.dims.total_len - 30  # covers every fact
  recall = [
    metrics.summarize(trace("needle_qa", "sliding_window", b).metrics)["fact_recall"]
    for b in (big, 256, BUDGET)
  ]
  assert recall[0] == 1.0 and recall[-1] == 0.0 and recall[0] > recall[1] >= recall[2]


def test_diffuse_old_positions_lose_to_sliding_window():
  sliding = mass("diffuse", "sliding_window")
  assert sliding > mass("diffuse", "h2o") and sliding > mass("diffuse", "snapkv")


def test_topic_drift_h2o_adapts_while_prompt_vote_goes_stale():
  w = world("topic_drift")
  cfg = synthetic.scenario("topic_drift")
  late = slice(cfg.drift_step + w.dims.window + 8, None)
  assert mass("topic_drift", "h2o", steps=late) > mass("topic_drift", "snapkv", steps=late) + 0.2
  early = slice(cfg.drift_step + 4, cfg.drift_step + w.dims.window - 4)  # before the window rolls
  assert (
    abs(mass("topic_drift", "h2o", steps=early) - mass("topic_drift", "snapkv", steps=early)) < 0.1
  )


def test_funnel_upper_layers_concentrate():
  w = world("funnel")
  row = np.asarray(synthetic.attention_row(w, w.dims.total_len - 1))
  entropy_L = -(row * np.log(np.where(row > 0, row, 1))).sum(-1).mean(-1)
  assert (np.diff(entropy_L) < 0).all(), entropy_L


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(fact_positions=(600,), fact_steps=((0, 4),)), "fact_positions: 600"),
    (dict(window=600), "window: 600 is longer than the prompt"),
    (dict(num_layers=0), "num_layers: expected a positive int"),
    (dict(fact_steps=((0, 400),), fact_positions=(10,)), r"fact_steps: \(0, 400\)"),
    (dict(recency_tau=0.0), "recency_tau"),
  ],
)
def test_bad_world_config(kw, match):
  with pytest.raises(ValueError, match=match):
    synthetic.scenario("needle_qa", **kw)


def test_bad_lab_inputs():
  with pytest.raises(ValueError, match="scenario: unknown scenario 'needles'"):
    synthetic.scenario("needles")
  with pytest.raises(ValueError, match="overrides: unknown world fields"):
    synthetic.scenario("needle_qa", sinks=3)
  w = world("needle_qa")
  with pytest.raises(ValueError, match="budget: 100000 is larger than the world"):
    online.simulate(w, "snapkv", 100000)
  with pytest.raises(ValueError, match="name: policy 'headkv' is not simulated"):
    online.simulate(w, "headkv", 64)
  with pytest.raises(ValueError, match=r"evidence\.head_scores_LH, which the lab does not"):
    online.simulate(w, policies.make("headkv"), 64)
  with pytest.raises(ValueError, match="channel_ratio"):
    online.simulate(w, "think_snapkv", 64)
  with pytest.raises(ValueError, match="decode_every"):
    online.simulate(w, "snapkv", 64, decode_every=8)
  with pytest.raises(ValueError, match="options: .* given with a policy object"):
    online.simulate(w, policies.make("h2o"), 64, recent=4)
  with pytest.raises(
    ValueError, match=r"budget: 33 is below 41 for .snapkv. \(every budget counts the window of 40"
  ):
    online.simulate(w, "snapkv", 33, window=40)
  with pytest.raises(ValueError, match="TOVA is layer-wise"):
    online.simulate(w, "tova", np.arange(16).reshape(4, 4) + 40)
  with pytest.raises(ValueError, match="budget: 0 < 1"):
    online.simulate(w, "sliding_window", 0)


def quick_config(**kw):
  import configs.lab as lab_config  # noqa: PLC0415

  config = lab_config.get_config("quick")
  config.scenarios = ("needle_qa", "topic_drift")
  config.policies = ("sliding_window", "h2o", "snapkv", "oracle")
  for k, v in kw.items():
    setattr(config, k, v)
  return config


def test_lab_run_writes_summary_and_figures(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  table = lab.run(quick_config(), tmp_path, log=lambda *_: None)
  csv = pd.read_csv(tmp_path / "summary.csv")
  for col in ("scenario", "policy", "retained_mass", "oracle_gap", "output_error", "fact_recall"):
    assert col in csv.columns
  assert len(csv) == len(table) == 8
  assert (tmp_path / "needle_qa.png").stat().st_size > 10_000
  assert (tmp_path / "topic_drift.png").exists() and (tmp_path / "layers.csv").exists()
  with pytest.raises(ValueError, match="policies: unknown lab policy 'snap'"):
    lab.run(quick_config(policies=("snap",)), None)
  with pytest.raises(ValueError, match="budget: 100000 does not fit"):
    lab.run(quick_config(budget=100000), None)


def test_main_job_entry_point(tmp_path):
  cmd = [
    sys.executable,
    "-m",
    "experiments.lab",
    "--config=configs/lab.py:quick,needle_qa",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    cmd + ["--config.policies=('sliding_window','oracle')", f"--config.workdir={tmp_path}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"run directory: {tmp_path}" in out.stdout
  assert (tmp_path / "summary.csv").exists() and (tmp_path / "needle_qa.png").exists()
  typo = subprocess.run(
    cmd + ["--config.budgte=3"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
  )
  assert typo.returncode != 0 and "budgte" in typo.stderr


def test_new_token_is_cached_even_when_protected_tokens_fill_the_budget():
  w = world("streaming_chat")
  tr = online.simulate(w, "streaming_llm", 4, sinks=4, record_map=True)
  t = w.dims.prompt_len + np.arange(w.dims.gen_steps)
  pos, valid = np.asarray(tr.positions_SLHC), np.asarray(tr.valid_SLHC)
  assert ((pos == t[:, None, None, None]) & valid).any(-1).all()
  assert (valid.sum(-1) == 4).all()


def retained(tr: online.Trace) -> np.ndarray:
  return np.asarray(tr.metrics.retained)


def test_replay_is_the_evidence_the_lab_provides():
  names = online.replayable()
  assert set(online.LAB_POLICIES) <= set(names)
  for name in (
    *("sliding_window", "streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "adakv_snapkv"),
    *("cake", "random", "oracle", "knorm", "keydiff", "lagkv", "chunkkv_snapkv", "full"),
  ):
    assert name in names and online.can_replay(policies.make(name)), name
  for name in (
    *("headkv", "h2o_kvfactory_legacy", "critical_snapkv", "expected_attention", "qfilter"),
    *("duo_attention", "kvzip", "think", "rkv", "think_snapkv"),
  ):
    assert name not in names and not online.can_replay(name), name
  assert not online.can_replay(policies.make("snapkv", decode_every=16))


def test_the_labs_h2o_is_the_configs_and_a_bare_name_the_registrys(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  assert suite.build_policies(quick_config())["h2o"] == policies.H2O(recent=None)
  w = world("needle_qa")
  bare, eight = online.simulate(w, "h2o", 48), online.simulate(w, policies.H2O(recent=8), 48)
  np.testing.assert_array_equal(retained(bare), retained(eight))
  half = online.simulate(w, "h2o", 48, recent=None)
  np.testing.assert_array_equal(
    retained(half), retained(online.simulate(w, policies.H2O(recent=None), 48))
  )
  assert not np.array_equal(retained(bare), retained(half))


def test_an_object_replays_as_its_name():
  w = world("funnel")
  by_name = online.simulate(w, "pyramidkv", 48, record_map=True)
  obj = online.simulate(w, policies.SnapKV(allocator=policies.Pyramid()), 48, record_map=True)
  for a, b in zip(jax.tree.leaves(by_name), jax.tree.leaves(obj), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Oldest(policies.DecodePolicy):
  """Keeps the oldest tokens (a decode-time evictor written outside kvjax)."""

  needs = frozenset()

  def score(self, evidence):
    L, H, T = evidence.positions_shape(self.label)
    return jnp.broadcast_to(-jnp.arange(T, dtype=jnp.float32), (L, H, T))

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return -positions_HC.astype(jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accumulated(policies.DecodePolicy):
  """Attention accumulated over the compressed cache, no recent window: its own state."""

  needs = frozenset({"column_sums_LHT"})

  def score(self, evidence):
    return evidence.column_sums_LHT

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    return policies.gather_slots(evidence.column_sums_LHT, idx_LHC, kept_LHC, idx_LHC.shape[-2])

  def observe(self, state_HC, attn_HC):
    return state_HC + attn_HC

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return state_HC


def test_a_users_decode_policy_is_replayed_by_its_own_state_machine():
  w, b = world("streaming_chat"), 24
  policies.register("oldest_lab_test", Oldest)
  try:
    assert "oldest_lab_test" in online.replayable()
    tr = online.simulate(w, "oldest_lab_test", b, record_map=True)
  finally:
    policies.unregister("oldest_lab_test")
  pos, valid = np.asarray(tr.positions_SLHC), np.asarray(tr.valid_SLHC)
  for s in range(w.dims.gen_steps):  # the oldest b - 1 prompt tokens, then the current one
    expected = [*range(b - 1), w.dims.prompt_len + s]
    kept = np.sort(np.where(valid[s], pos[s], -1), -1)[..., -b:]
    np.testing.assert_array_equal(kept, np.broadcast_to(expected, kept.shape))
  # its state: the same evictions as H2O with no recent window
  mine = online.simulate(w, Accumulated(), b, record_map=True)
  h2o = online.simulate(w, "h2o", b, record_map=True, recent=0)
  for a, c in zip(jax.tree.leaves(mine), jax.tree.leaves(h2o), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_the_suite_takes_objects_and_checks_options(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  mine = policies.SnapKV(allocator=policies.Pyramid(beta=5), name="mine")
  config = quick_config(policies=(mine, "oracle"), scenarios=("needle_qa",))
  table = lab.run(config, None, log=lambda *_: None)
  assert list(table.policy) == ["mine", "oracle"]
  with pytest.raises(ValueError, match="policy_options: 'h2o': options: .*'recnet'"):
    suite.build_policies(quick_config(policy_options={"h2o": {"recnet": 3}}))
  with pytest.raises(ValueError, match="policies: 'headkv' is not a lab policy"):
    suite.build_policies(quick_config(policies=("headkv",)))
  with pytest.raises(ValueError, match=r"policies: \['oracle'\] appear more than once"):
    suite.build_policies(quick_config(policies=("oracle", "oracle")))


def test_repeats_missing_fields_and_an_empty_workdir_are_refused_up_front(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  import configs.lab_keys as keys_config  # noqa: PLC0415

  with pytest.raises(ValueError, match=r"scenarios: 'needle_qa' appear more than once"):
    lab.run(quick_config(scenarios=("needle_qa", "needle_qa")), None)
  with pytest.raises(ValueError, match=r"workdir: got the empty path ''"):
    lab.run(quick_config(), "")
  c = quick_config()
  del c["figure_step"]
  with pytest.raises(ValueError, match=r"config.figure_step: missing"):
    lab.run(c, None)
  k = keys_config.get_config("quick")
  k.budgets = (24, 24)
  with pytest.raises(ValueError, match=r"budgets: 24 appear more than once"):
    lab.run_keys(k, None)
  k = keys_config.get_config("quick")
  k.fact_distinctness = (0.0, 0.0)
  with pytest.raises(ValueError, match=r"fact_distinctness: 0.0 appear more than once"):
    lab.run_keys(k, None)
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.lab",
      f"--config={ROOT}/configs/lab.py:quick,needle_qa",
      "--config.workdir=",
    ],
    cwd=tmp_path,  # the current directory must stay empty
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode != 0 and "workdir: got the empty path ''" in out.stderr, out.stderr[-2000:]
  assert not any(tmp_path.iterdir())
