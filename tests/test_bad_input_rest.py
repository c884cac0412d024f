"""Bad input, the rest of round three: ThinK's own query window, CaM's draws given by the caller,
decode-time policies' outputs checked with the policy named, validation before a run directory
is claimed, and the process flags named when a multi-host start cannot complete."""

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.lab import online, synthetic
from kvjax.model import cache as cache_lib
from kvjax.model import compression, decoding
from kvjax.policies.cam import CaM

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  return model, cfg, model.params()


# --------------------------------------------------------------------------- ThinK's window


def _kvpress_think_channels(queries_LBHWD, keys_LBGCD, valid_LBGC, ratio):
  """kvpress ThinKPress's rule in numpy: prune the int(D * ratio) lowest of mean_w(q^2) (group
  mean) * mean_t(k^2) over the kept keys."""
  q = np.asarray(queries_LBHWD, np.float64)
  k = np.asarray(keys_LBGCD, np.float64)
  L, B, G, _, D = k.shape
  q2 = (q**2).mean(3).reshape(L, B, G, -1, D).mean(3)
  k2 = (k**2).sum(3) / np.asarray(valid_LBGC).sum(-1, keepdims=True)
  pruned = np.argsort(q2 * k2, axis=-1, kind="stable")[..., : int(D * ratio)]
  keep = np.ones((L, B, G, D), bool)
  np.put_along_axis(keep, pruned, False, axis=-1)
  return keep


def test_composed_think_scores_channels_with_its_own_32_queries(tiny):
  # kvpress ComposedPress([SnapKVPress(window_size=64), ThinKPress(0.5)]): ThinK recomputes its
  # own last 32 queries whatever the sequence press observed
  _, cfg, params = tiny
  T, N, budget, ratio = 160, 2, 80, 0.5
  snap = policies.SnapKV(window=64, num_kv_heads=cfg.num_kv_heads)
  think = policies.ThinK(channel_ratio=ratio)
  assert think.channel_window == 32
  composed = policies.Composed(stages=(snap, think), num_kv_heads=cfg.num_kv_heads)
  assert composed.channel_window == 32
  request = composed.evidence_request(T)
  assert request.window == 64 and request.window_queries == 64
  ids = np.random.default_rng(1).integers(4, cfg.vocab_size, (1, T)).astype(np.int32)
  pre = decoding.jit_prefill(cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), request)
  spec = cache_lib.CacheSpec(composed, budget + N, new_tokens=N, layout="kv")
  plain = cache_lib.CacheSpec(snap, budget + N, layout="kv")
  c = cache_lib.compress(cfg, pre, spec, budget)
  kept = cache_lib.compress(cfg, pre, plain, budget)
  got = np.zeros((*np.asarray(c.channels).shape[:3], cfg.head_dim), bool)
  np.put_along_axis(got, np.asarray(c.channels), True, axis=-1)
  last32 = _kvpress_think_channels(pre.window_queries[:, :, :, -32:], kept.keys, kept.valid, ratio)
  all64 = _kvpress_think_channels(pre.window_queries, kept.keys, kept.valid, ratio)
  np.testing.assert_array_equal(got, last32)
  assert (last32 != all64).any()  # the window matters on this prompt


def test_think_window_asked_of_the_prefill_and_checked():
  snap8 = policies.SnapKV(window=8)
  composed = policies.Composed(stages=(snap8, policies.ThinK(channel_window=16)))
  assert composed.evidence_request(100).window_queries == 32  # the observation window's 32 rows
  assert policies.ThinK(channel_window=64).evidence_request(100).window_queries == 64
  assert policies.ThinK(channel_window=64).evidence_request(20).window_queries == 20
  # channel_ratio on a token policy: ThinK reads that policy's own observation window
  assert policies.SnapKV(window=8, channel_ratio=0.25).evidence_request(100).window_queries == 8
  assert policies.ThinK(channel_window=np.int64(8)).channel_window == 8
  for bad in (0, -1, 2.5, True, None):
    with pytest.raises(ValueError, match="^channel_window: expected an int >= 1"):
      policies.ThinK(channel_window=bad)
  queries = jnp.zeros((1, 1, 2, 8, 4))
  assert compression.think_queries(queries, None, 100).shape[3] == 8
  assert compression.think_queries(queries, 4, 100).shape[3] == 4
  assert compression.think_queries(queries, 32, 8).shape[3] == 8
  with pytest.raises(
    ValueError, match="^channel_window: ThinK scores its channels with the last 16"
  ):
    compression.think_queries(queries, 16, 100)


# --------------------------------------------------------------------------- CaM's draws


@pytest.fixture(scope="module")
def cam_golden():
  z = np.load(FIXTURES / "kvpress_0_5_5_merging.npz")
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return z, cfg, model.params()


def _kvpress_cam_draws(z, T):
  """kvpress's recorded uniforms as CaM's ``draws``: compression ``c`` (after ``(c + 1) N`` fed
  tokens) of layer ``l`` reads ``cam_{c L + l}_uniform_Gk``."""
  N, calls = int(z["cam_constants"][0]), int(z["cam_calls"])
  L = int(max(z[f"cam_{c}_layer"] for c in range(calls))) + 1
  table = np.stack(
    [np.stack([z[f"cam_{c * L + l}_uniform_Gk"] for l in range(L)]) for c in range(calls // L)]
  )  # [compressions, L, G, N]

  def draws(seed, row, seen, shape):
    return jnp.asarray(table, jnp.float32)[(seen - T) // N - 1]

  return draws


def _cam_cache(cfg, params, ids, pol, fed):
  T = ids.shape[1]
  request = pol.evidence_request(T)
  pre = decoding.jit_prefill(cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), request)
  spec = cache_lib.CacheSpec(pol, pol.decode_capacity(T, T, len(fed)))
  cache = cache_lib.compress(cfg, pre, spec, None)
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  for i, tok in enumerate(fed):
    pos = jnp.full((1,), T + i, jnp.int32)
    _, cache = step(cfg, params, spec, cache, jnp.asarray([tok]), pos, pos, i)
  return cache


def _row0_by_position(cache):
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  values = np.asarray(cache.values[:, 0])
  order = np.argsort(np.where(valid, pos, np.iinfo(np.int32).max), -1, kind="stable")
  n = int(valid[0, 0].sum())
  order = order[..., :n]
  return np.take_along_axis(values, order[..., None], 2), np.take_along_axis(pos, order, -1)


def test_cam_draws_given_by_the_caller_reproduce_kvpress(cam_golden):
  # kvpress's CAMPress(KnormPress(), compression_interval=4, target_size=14, merge_budget=3)
  # with its recorded Bernoulli uniforms passed as draws, no function patched
  z, cfg, params = cam_golden
  ids = z["input_ids_T"][None]
  N, target, mb = (int(x) for x in z["cam_constants"])
  fed = z["cam_fed_S"]
  opts = dict(base=policies.KNorm(), decode_every=N, decode_budget=target, merge_budget=mb)
  pol = CaM(**opts, draws=_kvpress_cam_draws(z, ids.shape[1]))
  values, pos = _row0_by_position(_cam_cache(cfg, params, ids, pol, fed))
  np.testing.assert_array_equal(pos, np.sort(z["cam_final_positions_LGn"], -1))
  order = np.argsort(z["cam_final_positions_LGn"], -1)
  want = np.take_along_axis(z["cam_final_values_LGnD"], order[..., None], 2)
  np.testing.assert_allclose(values, want, atol=1e-5, rtol=0)
  own, _ = _row0_by_position(_cam_cache(cfg, params, ids, CaM(**opts), fed))
  assert np.abs(own - want).max() > 1e-5  # kvjax's own draws merge otherwise


def test_cam_draws_checked():
  with pytest.raises(ValueError, match="^draws: expected a callable"):
    CaM(base=policies.KNorm(), draws=0.5)
  pol = CaM(
    base=policies.KNorm(), decode_every=4, draws=lambda seed, row, seen, shape: jnp.zeros(3)
  )
  L, H, C, D = 2, 2, 8, 4
  args = (
    jnp.ones((L, H, C, D)),
    jnp.ones((L, H, C)),
    jnp.ones((L, H, C)),
    jnp.ones((L, H, C), bool),
    jnp.full((L, H), 4, jnp.int32),
  )
  with pytest.raises(ValueError, match=r"^draws: policy 'CaM'.*\(3,\); expected .*\(2, 2, 4\)"):
    pol.decode_merge(*args, row=0, seen=12)
  ints = CaM(base=policies.KNorm(), decode_every=4, draws=lambda *a: jnp.zeros(a[-1], jnp.int32))
  with pytest.raises(ValueError, match="^draws: .*expected floating uniforms"):
    ints.decode_merge(*args, row=0, seen=12)


# --------------------------------------------------------------------------- decode-time hooks


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HeadMeanKeep(policies.SlidingWindow):
  """keep_scores one row for every head ([..., 1, C]): it broadcasts silently."""

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return positions_HC.astype(jnp.float32).mean(-2, keepdims=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WideState(policies.H2O):
  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    return super().init_state(evidence, scores_LHT, idx_LHC, kept_LHC)[..., None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _SummedObserve(policies.H2O):
  def observe(self, state_HC, attn_HC):
    return (state_HC + attn_HC).sum(-1)


@pytest.mark.parametrize(
  ("policy", "hook", "got"),
  [
    (_HeadMeanKeep(), "keep_scores", r"shape \(1, 1, 20\); expected shape \(1, 2, 20\)"),
    (_WideState(recent=4), "init_state", r"shape \(4, 2, 1, 1\); expected shape \(4, 2, 1\)"),
    (_SummedObserve(recent=4), "observe", r"shape \(1, 2\); expected shape \(1, 2, 20\)"),
  ],
)
def test_decode_time_hooks_checked_with_the_policy_named(tiny, policy, hook, got):
  model, cfg, _ = tiny
  ids = np.random.default_rng(0).integers(4, cfg.vocab_size, (1, 40)).astype(np.int32)
  with pytest.raises(
    ValueError, match=rf"^{hook}: policy '{type(policy).__name__}' returned {got}"
  ):
    km.generate(model, ids, policy=policy, budget=20, max_new_tokens=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NanKeep(policies.SlidingWindow):
  """Recency, with NaN keep scores from generation step 3 (position P + 3) on."""

  prompt_len: int = 64

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    s = positions_HC.astype(jnp.float32)
    return jnp.where(t >= self.prompt_len + 3, jnp.nan, s)


@pytest.fixture(scope="module")
def lab_world():
  world = synthetic.scenario(
    "streaming_chat",
    num_layers=4,
    num_heads=2,
    prompt_len=64,
    gen_steps=8,
    fact_positions=(20,),
    fact_steps=((1, 4),),
  )
  return synthetic.make_world(world)


@pytest.mark.parametrize(
  ("policy", "hook", "got"),
  [
    (_HeadMeanKeep(), "keep_scores", r"shape \(4, 1, 20\); expected shape \(4, 2, 20\)"),
    (_WideState(recent=4), "init_state", r"shape \(4, 2, 20, 1\); expected shape \(4, 2, 20\)"),
    (_SummedObserve(recent=4), "observe", r"shape \(4, 2\); expected shape \(4, 2, 20\)"),
  ],
)
def test_the_labs_replay_checks_decode_time_hooks_with_the_policy_named(
  lab_world, policy, hook, got
):
  """The lab's online replay runs a decode-time policy's hooks through the same checks as the
  model's cache: a wrong shape is refused with the policy and the hook named."""
  with pytest.raises(
    ValueError, match=rf"^{hook}: policy '{type(policy).__name__}' returned {got}"
  ):
    online.simulate(lab_world, policy, 20)


def test_the_labs_replay_refuses_nan_keep_scores(lab_world):
  with pytest.raises(ValueError, match=r"^keep_scores: policy '_NanKeep' returned NaN .* step 3"):
    online.simulate(lab_world, _NanKeep(), 20)
  good = online.simulate(lab_world, policies.SlidingWindow(), 20)  # the same policy, finite
  assert np.isfinite(np.asarray(good.metrics.retained)).all()


def test_decode_time_hook_checks_pass_good_outputs_unchanged():
  pol = policies.H2O(recent=2)
  state, pos = jnp.ones((1, 2, 5)), jnp.arange(10).reshape(1, 2, 5)
  out = policies.checked_keep_scores(pol, state, pos, 9, jnp.full((1, 2), 4))
  np.testing.assert_array_equal(out, pol.keep_scores(state, pos, 9, jnp.full((1, 2), 4)))
  np.testing.assert_array_equal(policies.checked_observe(pol, state, state), 2 * state)
  with pytest.raises(ValueError, match=r"^observe: policy 'H2O' returned shape \(1, 2\)"):
    policies.check_decode_output(state[..., 0], state.shape, pol, "observe")
  with pytest.raises(ValueError, match="^keep_scores: policy 'H2O' returned None"):
    policies.check_decode_output(None, state.shape, pol, "keep_scores")


# --------------------------------------------------------------------------- before the workdir


def _quick_eval(**fields):
  from configs import eval as eval_config  # noqa: PLC0415

  c = eval_config.get_config("quick")
  c.heatmap.policies = ()
  for k, v in fields.items():
    c[k] = v
  return c


@pytest.mark.parametrize(
  ("fields", "match"),
  [
    (dict(lengths=(256, 4096)), r"^lengths: \[4096\] leave no room .* context of 4096 positions"),
    (dict(lengths=(9000,)), r"^lengths: \[9000\]"),
  ],
)
def test_eval_lengths_the_model_cannot_hold_refused_before_the_workdir(tmp_path, fields, match):
  from kvjax.eval import evaluate  # noqa: PLC0415

  with pytest.raises(ValueError, match=match):
    evaluate.run(_quick_eval(**fields), tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()
  c = _quick_eval()
  c.heatmap.update(policies=("snapkv",), lengths=(256, 5000))
  with pytest.raises(ValueError, match=r"^heatmap.lengths: \[5000\]"):
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()


def test_eval_answers_past_the_context_refused():
  from kvjax.eval import run_setup, tasks  # noqa: PLC0415

  class Cfg:
    max_positions = 100

  def ex(T, N):
    z = np.zeros(N, bool)
    return tasks.Example("t", np.zeros(T, np.int32), np.zeros(N, np.int32), z, z, "exact", 0, ())

  run_setup.check_answers_fit(Cfg, {("t", 96): [ex(96, 4), ex(96, 3)]})
  with pytest.raises(ValueError, match=r"^lengths: 97 tokens of 't' and its answer make 101, .*"):
    run_setup.check_answers_fit(Cfg, {("t", 97): [ex(97, 4)]})
  with pytest.raises(ValueError, match=r"^heatmap.lengths: .*at most 96"):
    run_setup.check_answers_fit(Cfg, {("t", 97): [ex(97, 4)]}, "heatmap.lengths")
  Cfg.max_positions = None
  run_setup.check_answers_fit(Cfg, {("t", 97): [ex(97, 4)]})


@pytest.mark.parametrize("bad", ["nan", "inf", "text", "truncated"])
def test_eval_calibration_with_nan_refused_before_the_workdir(tmp_path, tiny, bad):
  from kvjax.eval import evaluate  # noqa: PLC0415

  _, cfg, _ = tiny
  q = np.ones((cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), np.float32)
  path = tmp_path / "calibration.npz"
  if bad in ("nan", "inf"):
    q[1, 0, 2] = float(bad)
  np.savez(path, qfilters_LGD=q.astype(str) if bad == "text" else q)
  if bad == "truncated":
    path.write_bytes(path.read_bytes()[:-40])
  c = _quick_eval(policies=(dict(label="qfilter", policy="qfilter"),), calibration=str(path))
  what = {"nan": "NaN or inf", "inf": "NaN or inf", "text": "no numbers"}.get(bad, "")
  with pytest.raises(ValueError, match=rf"^calibration: {path} .*{what}"):
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()


def _lab_config(world=None, **fields):
  import configs.lab as lab_config  # noqa: PLC0415

  c = lab_config.get_config("quick")
  c.scenarios = ("needle_qa", "topic_drift")
  c.policies = ("sliding_window", "snapkv")
  c.world.update(world or {})
  for k, v in fields.items():
    c[k] = v
  return c


@pytest.mark.parametrize(
  ("world", "fields", "match"),
  [
    (dict(prompt_len=17), {}, r"^world.prompt_len: 17 leaves no room for the facts"),
    (dict(prompt_len=0), {}, r"^world.prompt_len: expected an int >= 1, got 0"),
    (dict(gen_steps=2), {}, r"^world.gen_steps: 2 steps cannot hold the topic drift"),
    ({}, dict(figure_step=48), r"^figure_step: 48 is outside the 48 generation steps"),
    ({}, dict(budget=0), r"^budget: 0 does not fit the world"),
  ],
)
def test_lab_world_settings_refused_before_anything_is_written(tmp_path, world, fields, match):
  from kvjax import lab  # noqa: PLC0415

  with pytest.raises(ValueError, match=match):
    lab.run(_lab_config(world, **fields), tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()


def test_lab_world_typo_and_short_runs_without_drift():
  from kvjax import lab  # noqa: PLC0415
  from kvjax.lab import synthetic  # noqa: PLC0415

  c = _lab_config()
  c.world.promptlen = 64  # ignored silently before: the run used the default prompt
  with pytest.raises(ValueError, match=r"^world: unknown fields \['promptlen'\]"):
    lab.run(c, None)
  with pytest.raises(ValueError, match=r"^world: unknown fields"):
    lab.run_keys(_keys_config(promptlen=64), None)
  # a world without topic drift needs no room for one (drift_step=-1)
  sizes = dict(num_layers=1, num_heads=2, prompt_len=64, gen_steps=3, window=8)
  assert synthetic.world_config("needle_qa", sizes).gen_steps == 3
  with pytest.raises(ValueError, match=r"^world.gen_steps: expected an int >= 1, got 2.5"):
    synthetic.world_config("needle_qa", dict(sizes, gen_steps=2.5))


def _keys_config(**world):
  import configs.lab_keys as keys_config  # noqa: PLC0415

  k = keys_config.get_config("quick")
  for name, v in world.items():
    k.world[name] = v
  return k


# --------------------------------------------------------------------------- process flags


def test_a_peer_that_never_registers_is_named_with_the_flags(tmp_path):
  # JAX aborts the process at the deadline ("another task died"); kvjax says first what it knows
  import socket  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  code = (
    "from kvjax import distributed; distributed.maybe_initialize(dict(coordinator="
    f"'localhost:{port}', num_processes=2, process_id=0, initialization_timeout=3))"
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_")}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
  )
  assert out.returncode != 0
  err = out.stderr
  assert "kvjax.distributed: process 0 of 2 has not seen every process" in err
  assert "some process_id in [0, 2) never registered" in err
  assert f"coordinator=localhost:{port} (flag), num_processes=2 (flag), process_id=0 (flag)" in err
  assert err.index("never registered") < err.index("another task died")


def test_the_start_watchdog_is_quiet_when_every_process_joins(monkeypatch, capsys):
  import time  # noqa: PLC0415

  from kvjax import distributed  # noqa: PLC0415

  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)
  flags = dict(coordinator="localhost:1", num_processes=2, process_id=1, initialization_timeout=1)
  assert distributed.maybe_initialize(flags)
  time.sleep(1.2)
  assert "never registered" not in capsys.readouterr().err
  with pytest.raises(ValueError, match="^process_id: 2 is not below num_processes=2"):
    distributed.maybe_initialize(dict(flags, process_id=2))
  monkeypatch.setenv("KVJAX_PROCESS_ID", "1")
  s = distributed.settings(dict(coordinator="h:1", num_processes=2))
  message = distributed.start_diagnosis("explicit", s, dict(coordinator="h:1", num_processes=2))
  assert "process_id=1 ($KVJAX_PROCESS_ID)" in message
