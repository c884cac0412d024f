"""Golden and property tests of Fast KVzip (kvjax.model.fastkvzip's gates, training, files and
evidence; kvjax.policies.fastkvzip).

The fixture ``tests/fixtures/kvpress_0_5_5_fastkvzip.npz`` comes from
``tests/make_kvpress_fixtures_fastkvzip.py``: kvjax's gates (``fastkvzip_tiny_gates.npz``)
converted into kvpress 0.5.5's ``FastKVzipGate`` modules and given to ``FastKVzipPress`` on the
tiny random Llama ``tests/fixtures/kvpress_tiny_llama``, recording each gate's output, the
scores ``compress_post`` receives and the kept pairs.
"""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.model as km
from kvjax import policies
from kvjax.model import calibrate, fastkvzip
from kvjax.policies.fastkvzip import FastKVzip, fastkvzip_scores, window_lengths

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "kvpress_0_5_5_fastkvzip.npz"
WEIGHTS = FIXTURES / "fastkvzip_tiny_gates.npz"
RUNS = (
  "fastkvzip",
  "fastkvzip_layerwise",
  "fastkvzip_sink2_window",
  "fastkvzip_ratio625",
  "fastkvzip_ratio75_layerwise",
)
TEMPLATE = calibrate.KVzipTemplate((5, 6, 7, 8, 9, 10), (11, 12, 13), (25, 26, 27))
KVZIP = calibrate.KVzipOptions(chunk_size=16)


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


@pytest.fixture(scope="module")
def tiny():
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  gates, _ = fastkvzip.load(WEIGHTS, model, unverified=True)
  return model, cfg, model.params(), gates


@pytest.fixture(scope="module")
def data(tiny):
  """Fast KVzip's training pairs on random contexts of the tiny checkpoint."""
  model, cfg, params, _ = tiny
  ctx = np.random.default_rng(1).integers(30, cfg.vocab_size, (8, 40))
  return fastkvzip.gate_targets(model, ctx, TEMPLATE, kvzip=KVZIP)


def policy_of(fx, run) -> FastKVzip:
  m = fx["meta"]["runs"][run]
  return FastKVzip(
    sinks=m["n_sink"],
    window_ratio=m["window_ratio"],
    window_size=m["window_size"],
    allocator=policies.Pooled(layerwise=m["layerwise"]),
  )


def budget_of(fx, run) -> int:
  T = fx["input_ids_T"].size
  return T - int(T * fx["meta"]["runs"][run]["args"]["compression_ratio"])


def test_fixture_records_every_run(fx):
  assert set(fx["meta"]["runs"]) == set(RUNS)
  T = fx["input_ids_T"].size
  for run in RUNS:
    keep = fx[f"{run}_keep_LGT"]
    assert keep.shape[-1] == T and fx[f"{run}_scores_LGT"].shape == keep.shape
    assert keep.sum() == keep.size - int(
      keep.size * fx["meta"]["runs"][run]["args"]["compression_ratio"]
    )
    assert fx["meta"]["runs"][run]["min_margin"] > 0  # no tie at the boundary


# --------------------------------------------------------------------------- golden


@pytest.fixture(scope="module")
def evidence(tiny, fx):
  model, cfg, params, gates = tiny
  return fastkvzip.fastkvzip_evidence(model, gates, fx["input_ids_T"][None])


@pytest.mark.parametrize("run", RUNS)
def test_evidence_and_kept_set_match_kvpress(fx, tiny, evidence, run):
  """The gates file through ``fastkvzip_evidence`` gives ``FastKVzipGate``'s outputs; the policy
  gives ``score_val`` (sinks and window at 1.0) and keeps kvpress's pairs exactly."""
  _, cfg, _, _ = tiny
  T = fx["input_ids_T"].size
  assert evidence.shape == (cfg.num_layers, 1, cfg.num_kv_heads, T)
  assert evidence.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(evidence[:, 0]), fx[f"{run}_gates_LGT"], atol=1e-5)
  policy = policy_of(fx, run)
  ev = policies.Evidence(fastkvzip_LGT=evidence[:, 0])
  np.testing.assert_allclose(np.asarray(policy.scores(ev)), fx[f"{run}_scores_LGT"], atol=1e-5)
  for e in (ev, policies.Evidence(fastkvzip_LGT=jnp.asarray(fx[f"{run}_gates_LGT"]))):
    keep = np.asarray(policy.keep_mask(e, budget_of(fx, run)))
    np.testing.assert_array_equal(keep, fx[f"{run}_keep_LGT"])


@pytest.mark.parametrize("run", ["fastkvzip", "fastkvzip_ratio75_layerwise"])
def test_through_the_model_keeps_kvpress_set(fx, tiny, evidence, run):
  """``km.keep_mask`` with the evidence given per row: kvpress's kept set (each KV head's set
  repeated over its query heads); ``km.generate`` runs with it within the budget."""
  model, _, _, _ = tiny
  ids = fx["input_ids_T"][None].astype(np.int32)
  ev = {"fastkvzip_LGT": np.asarray(evidence)}
  policy, budget = policy_of(fx, run), budget_of(fx, run)
  keep = np.asarray(km.keep_mask(model, ids, policy, budget, evidence=ev))[:, 0]
  ref = fx[f"{run}_keep_LGT"]
  np.testing.assert_array_equal(keep, np.repeat(ref, keep.shape[1] // ref.shape[1], axis=1))
  out = km.generate(model, ids, policy=policy, budget=budget, evidence=ev, max_new_tokens=3)
  assert out.tokens.shape == (1, 3)
  assert out.budget_LH[0].sum() == budget * out.budget_LH.shape[1] * out.budget_LH.shape[2]


def test_left_padded_row_keeps_what_it_alone_keeps(tiny):
  """Two rows of different lengths: each row's evidence is its own, and the padded row's sinks
  and window count from its first real token, so it keeps what it keeps alone."""
  model, cfg, params, gates = tiny
  rng = np.random.default_rng(3)
  ids = rng.integers(30, cfg.vocab_size, (2, 32)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, :6] = 0
  ev = fastkvzip.fastkvzip_evidence(model, gates, ids, mask)
  alone = fastkvzip.fastkvzip_evidence(model, gates, ids[1:, 6:])
  np.testing.assert_allclose(np.asarray(ev[:, 1, :, 6:]), np.asarray(alone[:, 0]), atol=1e-5)
  policy = FastKVzip(window_ratio=0.1)  # a 2-token window on 26 real tokens
  both = np.asarray(
    km.keep_mask(model, km.Padded(ids, mask), policy, 10, evidence={"fastkvzip_LGT": ev})
  )
  one = np.asarray(km.keep_mask(model, ids[1:, 6:], policy, 10, evidence={"fastkvzip_LGT": alone}))
  np.testing.assert_array_equal(both[:, 1, :, 6:], one[:, 0])
  assert not both[:, 1, :, :6].any()


# --------------------------------------------------------------------------- the gate


def reference_gate(w: dict, layer: int, h_Td: np.ndarray) -> np.ndarray:
  """kvpress ``FastKVzipGate.forward`` transcribed in float64 numpy (``exp`` summed directly)."""
  G, S, D = w["k_base"].shape[1:]
  R = w["b"].shape[-1]

  def norm(x, scale):
    return scale * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)

  q = norm((h_Td @ w["wq"][layer] + w["bq"][layer]).reshape(-1, G, R, D), w["q_norm"][layer])
  k = norm((h_Td @ w["wk"][layer]).reshape(-1, G, D), w["k_norm"][layer])
  logit = np.einsum("tgd,tgrd->gtr", k, q) / math.sqrt(D) + w["b"][layer][:, None]
  base = np.einsum("gsd,tgrd->gtsr", w["k_base"][layer], q) / math.sqrt(D)
  score = 1.0 / (1.0 + np.exp(base - logit[:, :, None]).sum(2))
  return score.mean(-1)  # [G, T]


def test_gate_scores_match_the_reference_formula():
  rng = np.random.default_rng(0)
  L, d, G, R, T = 2, 12, 3, 2, 7
  w = {
    k: rng.standard_normal(v).astype(np.float64)
    for k, v in fastkvzip.expected_shapes(L, d, G, R, dim=4, sink=5).items()
  }
  h = rng.standard_normal((L, T, d))
  ours = np.asarray(
    fastkvzip.gate_scores({k: jnp.asarray(v, jnp.float32) for k, v in w.items()}, h)
  )
  assert ours.shape == (L, G, T)
  for layer in range(L):
    np.testing.assert_allclose(
      ours[layer], reference_gate(w, layer, h[layer]), rtol=1e-4, atol=1e-6
    )
  # extra axes between the layer and the model dim, and untrained gates' sink-16 start
  h2 = rng.standard_normal((L, 2, 5, d))
  ours2 = np.asarray(
    fastkvzip.gate_scores({k: jnp.asarray(v, jnp.float32) for k, v in w.items()}, h2)
  )
  assert ours2.shape == (L, G, 2, 5)
  g0 = fastkvzip.init_gates(0, L, d, G, R)
  s0 = np.asarray(fastkvzip.gate_scores(g0, h))
  assert ((s0 > 0) & (s0 < 1)).all()


# --------------------------------------------------------------------------- training


def test_targets_are_kvzip_scores_and_attention_inputs(tiny, data):
  model, cfg, params, _ = tiny
  X, y = data
  assert X.shape == (8 * 40, cfg.num_layers, cfg.hidden_size) and y.shape == (8 * 40, 2, 2)
  ctx = np.random.default_rng(1).integers(30, cfg.vocab_size, (8, 40))
  ref = np.asarray(calibrate.kvzip_evidence(model, ctx[2], TEMPLATE, options=KVZIP))
  np.testing.assert_allclose(y[80:120].transpose(1, 2, 0), ref, rtol=1e-5, atol=1e-6)
  # a chat-template header is no target
  t = dataclasses.replace(TEMPLATE, prefix_length=3)
  X3, y3 = fastkvzip.gate_targets(model, ctx[:1], t, kvzip=KVZIP)
  assert X3.shape[0] == 37
  np.testing.assert_allclose(X3, X[3:40], rtol=1e-4, atol=1e-5)


def test_few_optax_steps_reduce_the_loss(data):
  X, y = data
  rows = []
  run = fastkvzip.train_gates(
    X, y, 2, max_steps=40, batch_size=32, test_freq=10, test_every=10, on_log=rows.append
  )
  assert [r[0] for r in rows] == [0, 10, 20, 30] and run.history == tuple(rows)
  assert run.history[-1][2] < 0.9 * run.initial_test_loss
  assert run.history[-1][1] < run.history[0][1]
  assert fastkvzip.shapes_of(run.gates) == fastkvzip.expected_shapes(2, 64, 2, 2)


class _KilledError(Exception):
  pass


def test_resume_gives_the_uninterrupted_params(data, tmp_path):
  X, y = data
  kw = dict(max_steps=24, batch_size=32, test_freq=5, test_every=10, checkpoint_every=8)
  whole = fastkvzip.train_gates(X, y, 2, checkpoint_dir=tmp_path / "a", on_log=lambda r: None, **kw)

  def kill(row):
    if row[0] == 10:  # after the checkpoint of step 8, before the one of step 16
      raise _KilledError

  with pytest.raises(_KilledError):
    fastkvzip.train_gates(X, y, 2, checkpoint_dir=tmp_path / "b", on_log=kill, **kw)
  seen = []
  resumed = fastkvzip.train_gates(
    X, y, 2, checkpoint_dir=tmp_path / "b", on_log=lambda r: seen.append(r[0]), **kw
  )
  assert seen == [10, 15, 20]
  for k, v in whole.gates.items():
    np.testing.assert_array_equal(np.asarray(resumed.gates[k]), np.asarray(v))
  assert resumed.history == whole.history


def test_schedule_and_split_are_the_official_ones():
  """``utils.lr_schedule`` (warm-up of 0.01 a step for the first 1 %, then 1, 0.5 from half,
  0.25 from three quarters) and ``load_data.split_fn`` (every 100th example held out)."""

  def official(cur, max_step):
    if cur < 0.01 * max_step:
      return 0.01 * cur
    if 0.5 * max_step <= cur < 0.75 * max_step:
      return 0.5
    if 0.75 * max_step <= cur:
      return 0.25
    return 1.0

  f = fastkvzip.lr_schedule(0.2, 5000)
  for step in (0, 1, 49, 50, 2499, 2500, 3749, 3750, 4999):
    assert float(f(step)) == pytest.approx(0.2 * official(step, 5000), rel=1e-6), step
  train, test = fastkvzip.holdout_split(250)
  np.testing.assert_array_equal(test, [99, 199])
  assert train.size == 248


# --------------------------------------------------------------------------- files and errors


def _with_config(model, cfg):
  """``model``'s weights under another config, as the file loaders read a model (its ``cfg`` and
  ``params()``): a file's shapes are checked against ``cfg``."""
  return types.SimpleNamespace(cfg=cfg, params=model.params)


def test_save_load_round_trip_and_wrong_files(tiny, tmp_path):
  model, cfg, _, gates = tiny
  path = fastkvzip.save(tmp_path / "g.npz", gates, {"model": "tiny"})
  back, meta = fastkvzip.load(path, model, unverified=True)
  assert meta["model"] == "tiny" and meta["format"] == fastkvzip.FORMAT
  for k in fastkvzip.PARAM_KEYS:
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(gates[k]))
  other = _with_config(model, dataclasses.replace(cfg, hidden_size=32))
  with pytest.raises(
    ValueError, match=r"g\.npz.*'tiny'.*wq \(2, 64, 64\) \(expected \(2, 32, 64\)\)"
  ):
    fastkvzip.load(path, other, unverified=True)
  with pytest.raises(ValueError, match=r"fastkvzip_tiny_gates\.npz.*G=4.*b \(2, 2, 2\)"):
    wide = _with_config(model, dataclasses.replace(cfg, num_kv_heads=4, num_heads=8))
    fastkvzip.load(WEIGHTS, wide, unverified=True)
  header = np.asarray(json.dumps({"format": fastkvzip.FORMAT}))
  arrays = {k: np.asarray(v) for k, v in gates.items() if k != "k_base"}
  np.savez(tmp_path / "missing.npz", meta_json=header, **arrays)
  with pytest.raises(ValueError, match=r"missing\.npz.*lacks the gate arrays \['k_base'\]"):
    fastkvzip.load(tmp_path / "missing.npz", model, unverified=True)
  np.savez(tmp_path / "bare.npz", w=np.zeros(3))
  with pytest.raises(ValueError, match=r"bare\.npz has no meta_json"):
    fastkvzip.load(tmp_path / "bare.npz", model, unverified=True)
  np.savez(tmp_path / "kvzap.npz", meta_json=np.asarray(json.dumps({"format": "kvjax.kvzap/1"})))
  with pytest.raises(ValueError, match=r"kvzap\.npz has format 'kvjax.kvzap/1'"):
    fastkvzip.load(tmp_path / "kvzap.npz", model, unverified=True)
  with pytest.raises(ValueError, match=r"nothing\.npz"):
    fastkvzip.load(tmp_path / "nothing.npz", model, unverified=True)


def test_bad_arguments_are_named(tiny):
  model, cfg, params, gates = tiny
  ids = np.arange(30, 50)
  X, y = np.zeros((300, 2, 4), np.float32), np.full((300, 2, 2), 0.5, np.float32)
  cases = [
    ("template", lambda: fastkvzip.gate_targets(model, ids, (5, 6))),
    ("context_ids", lambda: fastkvzip.gate_targets(model, [cfg.vocab_size], TEMPLATE)),
    ("X_NLd", lambda: fastkvzip.train_gates(X, y[:4], 2)),
    ("y_NLG", lambda: fastkvzip.train_gates(X, y + 1.0, 2)),
    ("max_steps", lambda: fastkvzip.train_gates(X, y, 2, max_steps=0)),
    ("lr", lambda: fastkvzip.train_gates(X, y, 2, lr=-0.1)),
    ("num_query_groups", lambda: fastkvzip.train_gates(X, y, 0)),
    ("batch_size", lambda: fastkvzip.train_gates(X, y, 2, batch_size=1000)),
    ("gates", lambda: fastkvzip.fastkvzip_evidence(model, "g.npz", ids[None])),
    (
      "attention_mask",
      lambda: fastkvzip.fastkvzip_evidence(model, gates, ids[None], np.ones(3)),
    ),
    ("input_ids", lambda: fastkvzip.fastkvzip_evidence(model, gates, ids)),
  ]
  for match, call in cases:
    with pytest.raises(ValueError, match=match):
      call()


def test_policy_scores_window_and_refusals():
  rng = np.random.default_rng(0)
  s = jnp.asarray(rng.uniform(0.01, 0.9, (2, 2, 60)), jnp.float32)
  out = np.asarray(fastkvzip_scores(s, sinks=3, window_ratio=0.1))
  assert (out[..., :3] == 1.0).all() and (out[..., -6:] == 1.0).all()
  np.testing.assert_array_equal(out[..., 3:-6], np.asarray(s)[..., 3:-6])
  # a short context's window is at least 1; from 32000 tokens on it is window_size
  sizes = window_lengths(40000, 0.02, 4096)
  assert sizes[10] == 1 and sizes[50] == 1 and sizes[100] == 2 and sizes[31999] == 639
  assert sizes[32000] == 4096
  # the window ends at the row's real length (padding rolled to the end)
  valid = jnp.arange(60) < 50
  out = np.asarray(fastkvzip_scores(s, sinks=0, window_ratio=0.1, valid_T=valid))
  assert (
    (out[..., 45:50] == 1.0).all() and (out[..., 50:] < 1.0).all() and (out[..., :45] < 1).all()
  )
  ev = policies.Evidence(fastkvzip_LGT=s)
  assert FastKVzip().evidence_fields == {"fastkvzip_LGT"}
  keep = np.asarray(FastKVzip().keep_mask(ev, 7))
  assert keep.sum() == 2 * 2 * 7 and keep[..., :4].all() and keep[..., -1].all()
  layerwise = FastKVzip(allocator=policies.Pooled(layerwise=True))
  assert (np.asarray(layerwise.keep_mask(ev, 7)).sum((1, 2)) == 2 * 7).all()
  with pytest.raises(ValueError, match="fastkvzip_LGT"):
    FastKVzip().scores(policies.Evidence())
  with pytest.raises(ValueError, match="fastkvzip_LGT"):
    fastkvzip_scores(jnp.zeros((2, 30)))
  with pytest.raises(ValueError, match="fastkvzip_LGT"):
    fastkvzip_scores(jnp.zeros((2, 2, 30), jnp.int32))
  for options, match in (
    ({"sinks": -1}, "sinks"),
    ({"window_ratio": 1.5}, "window_ratio"),
    ({"window_size": 0}, "window_size"),
  ):
    with pytest.raises(ValueError, match=match):
      FastKVzip(**options)


# --------------------------------------------------------------------------- the entry point


@pytest.mark.slow  # CI: KVzap's entry point resumes through the same training loop
def test_experiment_entry_point_and_resume(tmp_path):
  """``:quick`` trains the gates on the shipped tiny model; a second run reuses the saved
  targets and the last checkpoint, and writes the same gates."""
  root = pathlib.Path(__file__).resolve().parents[1]
  cmd = [
    sys.executable,
    "-m",
    "experiments.fastkvzip",
    "--config=configs/fastkvzip.py:quick",
    f"--config.workdir={tmp_path}",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  runs = [subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=300)]
  assert runs[0].returncode == 0, runs[0].stderr[-2000:]
  assert f"run directory: {tmp_path}" in runs[0].stdout and "targets: contexts" in runs[0].stdout
  assert "fastkvzip gates: [" in runs[0].stdout
  first = json.loads((tmp_path / "results.json").read_text())
  assert first["final"]["test_loss"] < first["initial_test_loss"]
  runs.append(subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=300))
  assert runs[1].returncode == 0, runs[1].stderr[-2000:]
  assert "targets: contexts" not in runs[1].stdout and "fastkvzip gates: [" not in runs[1].stdout
  assert json.loads((tmp_path / "results.json").read_text())["history"] == first["history"]
  gates, meta = fastkvzip.load(tmp_path / "fastkvzip_gates.npz", km.load_tiny()[0])
  assert meta["model"] == "tiny" and meta["source"] == "task filler"


# --------------------------------------------------------------------------- SmolLM2


def seeded_gates(L: int, d: int, G: int, R: int, seed: int = 7) -> dict:
  """``tests/make_kvpress_fixtures_fastkvzip.py``'s seeded gates (checked by their sums)."""
  shapes = fastkvzip.expected_shapes(L, d, G, R)
  rng = np.random.default_rng(seed)
  out = {}
  for k in fastkvzip.PARAM_KEYS:
    if k in ("q_norm", "k_norm"):
      out[k] = rng.uniform(0.5, 2.0, shapes[k])
    else:
      out[k] = rng.standard_normal(shapes[k]) / (np.sqrt(d) if k in ("wq", "wk") else 1.0)
  return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.mark.slow  # SmolLM2's GGUF takes ~20 s to load
def test_smollm2_kept_set_agrees_with_kvpress(fx):
  """SmolLM2-135M-Instruct with seeded gates: kvpress's gate outputs (on the same dequantised
  weights) within 1e-4 and >= 0.99 of its kept pairs at compression_ratio 0.5, pooled and
  layerwise."""
  from kvjax.model import assets

  model, cfg = km.load(assets.SMOLLM2, dtype=np.float32)
  gates = seeded_gates(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.num_groups)
  for k, total in fx["meta"]["smollm2"]["gate_sums"].items():
    assert float(gates[k].astype(np.float64).sum()) == pytest.approx(total, rel=1e-9), k
  ids = fx["smollm2_input_ids_T"][None]
  ev = fastkvzip.fastkvzip_evidence(model, gates, ids)[:, 0]
  np.testing.assert_allclose(np.asarray(ev), fx["smollm2_gates_LGT"], atol=1e-4)
  for run, layerwise in (("smollm2", False), ("smollm2_layerwise", True)):
    policy = FastKVzip(allocator=policies.Pooled(layerwise=layerwise))
    keep = np.asarray(policy.keep_mask(policies.Evidence(fastkvzip_LGT=ev), ids.shape[1] // 2))
    agree = (keep == fx[f"{run}_keep_LGT"]).mean()
    assert agree >= 0.99, (run, agree)
