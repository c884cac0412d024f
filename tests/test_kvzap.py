"""Golden and property tests of KVzap (kvjax.model.kvzap's targets, training, files and evidence;
kvjax.policies.kvzap).

The fixture ``tests/fixtures/kvpress_0_5_5_kvzap.npz`` comes from
``tests/make_kvpress_fixtures_kvzap.py``: kvjax's surrogates (``kvzap_tiny_{linear,mlp}.npz``)
given to kvpress 0.5.5's ``KVzapPress`` (alone at compression_ratio 0.5, and inside
``DMSPress``) on the tiny random Llama ``tests/fixtures/kvpress_tiny_llama``, recording its
scores and kept pairs; and the KVzip+ targets by ``kvzap/data.py``'s hook formula.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.model as km
from kvjax import policies
from kvjax.model import calibrate, kvzap
from kvjax.policies.dms import DMS
from kvjax.policies.kvzap import KVzap, kvzap_scores

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "kvpress_0_5_5_kvzap.npz"
WEIGHTS = {kind: FIXTURES / f"kvzap_tiny_{kind}.npz" for kind in kvzap.KINDS}
RUNS = tuple(f"kvzap_{kind}_{mode}" for kind in kvzap.KINDS for mode in ("ratio", "dms"))


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


@pytest.fixture(scope="module")
def tiny():
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return model, cfg, model.params()


@pytest.fixture(scope="module")
def data(tiny):
  """KVzap's training pairs on random contexts of the tiny checkpoint."""
  model, cfg, params = tiny
  ctx = np.random.default_rng(1).integers(30, cfg.vocab_size, (8, 24))
  return kvzap.kvzap_targets(model, ctx, template_of(None), n_tokens=16, seed=0)


def template_of(fx) -> calibrate.KVzipTemplate:
  if fx is None:
    return calibrate.KVzipTemplate((5, 6, 7, 8, 9, 10), (), (25, 26, 27))
  first, suffix = (
    tuple(int(i) for i in fx[k]) for k in ("template_first_ids", "template_suffix_ids")
  )
  return calibrate.KVzipTemplate(first, (), suffix)


def policy_of(fx, run):
  m = fx["meta"]["runs"][run]
  if run.endswith("_dms"):
    return DMS(
      base=KVzap(),
      threshold=m["args"]["threshold"],
      sliding_window=m["args"]["sliding_window_size"],
    )
  return KVzap()


def budget_of(fx, run) -> int:
  T = fx["input_ids_T"].size
  return T if run.endswith("_dms") else T // 2  # DMS: the threshold alone


def test_fixture_records_every_run(fx):
  assert set(fx["meta"]["runs"]) == set(RUNS)
  T = fx["input_ids_T"].size
  for run in RUNS:
    keep = fx[f"{run}_keep_LGT"]
    assert fx[f"{run}_scores_LGT"].shape == keep.shape and keep.shape[-1] == T
    if run.endswith("_ratio"):
      assert (keep.sum(-1) == T // 2).all()


# --------------------------------------------------------------------------- golden


def test_targets_match_kvpress_formula(fx, tiny):
  """KVzip+'s log scores and the attention inputs, as ``kvzap/data.py``'s hook computes them on
  the same prompt (eager attention)."""
  model, cfg, params = tiny
  X, y = kvzap.kvzap_targets(model, fx["input_ids_T"], template_of(fx))
  T = fx["input_ids_T"].size
  assert X.shape == (T, cfg.num_layers, cfg.hidden_size) and y.shape == (T, cfg.num_layers, 2)
  np.testing.assert_allclose(X.transpose(1, 0, 2), fx["targets_X_LTd"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y.transpose(1, 2, 0), fx["targets_y_LGT"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", RUNS)
def test_evidence_and_kept_set_match_kvpress(fx, tiny, run):
  """The surrogate file through ``kvzap_evidence`` gives ``KVzapPress.score``'s scores, and the
  policy on them keeps kvpress's pairs (alone at ratio 0.5; inside DMS at its threshold)."""
  model, cfg, params = tiny
  kind = fx["meta"]["runs"][run]["kind"]
  surrogate, meta = kvzap.load(WEIGHTS[kind], model, unverified=True)
  assert surrogate.kind == kind and meta["model"] == "tests/fixtures/kvpress_tiny_llama"
  ev_LBGT = kvzap.kvzap_evidence(model, surrogate, fx["input_ids_T"][None])
  assert ev_LBGT.shape == (cfg.num_layers, 1, cfg.num_kv_heads, fx["input_ids_T"].size)
  ref = fx[f"{run}_scores_LGT"]
  np.testing.assert_allclose(np.asarray(ev_LBGT[:, 0]), ref, rtol=1e-5, atol=1e-5)
  policy, budget = policy_of(fx, run), budget_of(fx, run)
  for scores in (ev_LBGT[:, 0], jnp.asarray(ref)):
    keep = np.asarray(policy.keep_mask(policies.Evidence(kvzap_LGT=scores), budget))
    np.testing.assert_array_equal(keep, fx[f"{run}_keep_LGT"])


@pytest.mark.parametrize("run", ["kvzap_mlp_ratio", "kvzap_linear_dms"])
def test_through_the_model_keeps_kvpress_set(fx, tiny, run):
  """``km.keep_mask`` with the evidence given per row: kvpress's kept set (each KV head's set
  repeated over its query heads); ``km.generate`` runs with it within the budget."""
  model, cfg, params = tiny
  kind = fx["meta"]["runs"][run]["kind"]
  surrogate, _ = kvzap.load(WEIGHTS[kind], model, unverified=True)
  ids = fx["input_ids_T"][None].astype(np.int32)
  ev = {"kvzap_LGT": np.asarray(kvzap.kvzap_evidence(model, surrogate, ids))}
  policy, budget = policy_of(fx, run), budget_of(fx, run)
  keep = np.asarray(km.keep_mask(model, ids, policy, budget, evidence=ev))[:, 0]
  ref = fx[f"{run}_keep_LGT"]
  np.testing.assert_array_equal(keep, np.repeat(ref, keep.shape[1] // ref.shape[1], axis=1))
  out = km.generate(model, ids, policy=policy, budget=budget, evidence=ev, max_new_tokens=4)
  assert out.tokens.shape == (1, 4)
  held = out.budget_LH[0]
  assert (held <= budget).all() and (held >= 1).all()


def test_generate_left_padded_rows(tiny):
  """Two rows of different lengths: the evidence of the padded batch, each row within budget."""
  model, cfg, params = tiny
  surrogate, _ = kvzap.load(WEIGHTS["linear"], model, unverified=True)
  rng = np.random.default_rng(3)
  ids = rng.integers(30, cfg.vocab_size, (2, 32)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, :6] = 0
  ev = kvzap.kvzap_evidence(model, surrogate, ids, mask)
  alone = kvzap.kvzap_evidence(model, surrogate, ids[1:, 6:])
  np.testing.assert_allclose(np.asarray(ev[:, 1, :, 6:]), np.asarray(alone[:, 0]), atol=1e-4)
  out = km.generate(
    model,
    km.Padded(ids, mask),
    policy=KVzap(),
    budget=12,
    evidence={"kvzap_LGT": ev},
    max_new_tokens=3,
  )
  assert out.tokens.shape == (2, 3)


# --------------------------------------------------------------------------- training


def test_linear_fit_is_ridge_closed_form():
  """``fit_linear`` against the augmented normal equations with an unpenalised intercept."""
  rng = np.random.default_rng(0)
  N, L, d, G = 40, 2, 5, 3
  X = rng.standard_normal((N, L, d)).astype(np.float32) + 0.5
  y = (X @ rng.standard_normal((d, G)) + 2.0 + 0.1 * rng.standard_normal((N, L, G))).astype(
    np.float32
  )
  s = kvzap.fit_linear(X, y, alpha=1.0)
  for layer in range(L):
    A = np.concatenate([X[:, layer].astype(np.float64), np.ones((N, 1))], 1)
    P = np.eye(d + 1)
    P[d, d] = 0.0  # sklearn's Ridge does not penalise the intercept
    sol = np.linalg.solve(A.T @ A + P, A.T @ y[:, layer])
    np.testing.assert_allclose(np.asarray(s.params["w"][layer]), sol[:d], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s.params["b"][layer]), sol[d], rtol=1e-5, atol=1e-6)
  pred = np.asarray(kvzap.apply(s, X.transpose(1, 0, 2)))  # [L, G, N]
  want = np.einsum("nld,ldg->nlg", X, np.asarray(s.params["w"])) + np.asarray(s.params["b"])
  np.testing.assert_allclose(pred.transpose(2, 0, 1), want, atol=1e-5)


def test_few_optax_steps_reduce_the_loss(data):
  X, y = data
  run = kvzap.train_mlp(X, y, hidden_dim=16, max_epochs=3, batch_size=16, on_epoch=lambda *a: None)
  assert len(run.train_loss) == 3 and run.train_loss[-1] < run.train_loss[0]
  assert run.valid_loss[-1] < run.initial_valid_loss
  assert run.surrogate.shapes == kvzap.expected_shapes("mlp", 2, 64, 2, 16)


class _KilledError(Exception):
  pass


def test_resume_gives_the_uninterrupted_params(data, tmp_path):
  X, y = data
  kw = dict(hidden_dim=8, max_epochs=3, batch_size=32)
  whole = kvzap.train_mlp(X, y, checkpoint_dir=tmp_path / "a", on_epoch=lambda *a: None, **kw)

  def kill(epoch, *_):
    if epoch == 0:
      raise _KilledError

  with pytest.raises(_KilledError):
    kvzap.train_mlp(X, y, checkpoint_dir=tmp_path / "b", on_epoch=kill, **kw)
  seen = []
  resumed = kvzap.train_mlp(
    X, y, checkpoint_dir=tmp_path / "b", on_epoch=lambda e, *_: seen.append(e), **kw
  )
  assert seen == [1, 2]
  for k, v in whole.surrogate.params.items():
    np.testing.assert_array_equal(np.asarray(resumed.surrogate.params[k]), np.asarray(v))
  assert resumed.train_loss == whole.train_loss and resumed.valid_loss == whole.valid_loss
  with pytest.raises(ValueError, match=r"checkpoint_dir: .*hidden_dim 8 -> 4"):
    kvzap.train_mlp(X, y, checkpoint_dir=tmp_path / "b", **{**kw, "hidden_dim": 4})


def test_schedule_is_cosine_per_epoch():
  f = kvzap.epoch_schedule(5e-3, 15, 4)
  assert float(f(0)) == pytest.approx(5e-3) and float(f(3)) == pytest.approx(5e-3)
  assert float(f(4)) == pytest.approx(5e-3 * 0.5 * (1 + np.cos(np.pi / 15)))
  assert kvzap.valid_split(100)[1].size == 5


# --------------------------------------------------------------------------- files and errors


def _with_config(model, cfg):
  """``model``'s weights under another config, as the file loaders read a model (its ``cfg`` and
  ``params()``): a file's shapes are checked against ``cfg``."""
  return types.SimpleNamespace(cfg=cfg, params=model.params)


def test_save_load_round_trip_and_wrong_files(tiny, tmp_path):
  model, cfg, _ = tiny
  s, _ = kvzap.load(WEIGHTS["mlp"], model, unverified=True)
  path = kvzap.save(tmp_path / "s.npz", s, {"model": "tiny"})
  back, meta = kvzap.load(path, model, unverified=True)
  assert meta["kind"] == "mlp" and meta["model"] == "tiny"
  for k in s.params:
    np.testing.assert_array_equal(np.asarray(back.params[k]), np.asarray(s.params[k]))
  other = _with_config(model, dataclasses.replace(cfg, hidden_size=32))
  with pytest.raises(ValueError, match=r"s\.npz.*w1 \(2, 64, 32\) \(expected \(2, 32, 32\)\)"):
    kvzap.load(path, other, unverified=True)
  with pytest.raises(ValueError, match=r"kvzap_tiny_linear\.npz.*G=4"):
    wide = _with_config(model, dataclasses.replace(cfg, num_kv_heads=4, num_heads=8))
    kvzap.load(WEIGHTS["linear"], wide, unverified=True)
  header = np.asarray(json.dumps({"format": kvzap.FORMAT, "kind": "linear"}))
  np.savez(tmp_path / "missing.npz", meta_json=header, w=np.zeros((2, 64, 2), np.float32))
  with pytest.raises(ValueError, match=r"missing\.npz lacks the linear weights \['b'\]"):
    kvzap.load(tmp_path / "missing.npz", model, unverified=True)
  np.savez(tmp_path / "bare.npz", w=np.zeros(3))
  with pytest.raises(ValueError, match=r"bare\.npz has no meta_json"):
    kvzap.load(tmp_path / "bare.npz", model, unverified=True)
  with pytest.raises(ValueError, match=r"nothing\.npz"):
    kvzap.load(tmp_path / "nothing.npz", model, unverified=True)


def test_bad_arguments_are_named(tiny):
  model, cfg, params = tiny
  t = template_of(None)
  ids = np.arange(30, 50)
  cases = [
    ("n_tokens", lambda: kvzap.kvzap_targets(model, ids, t, n_tokens=21)),
    ("n_tokens", lambda: kvzap.kvzap_targets(model, ids, t, n_tokens=0)),
    ("template", lambda: kvzap.kvzap_targets(model, ids, (5, 6))),
    ("context_ids", lambda: kvzap.kvzap_targets(model, [cfg.vocab_size], t)),
    ("alpha", lambda: kvzap.fit_linear(np.zeros((4, 2, 3)), np.zeros((4, 2, 1)), alpha=-1.0)),
    ("X_NLd", lambda: kvzap.fit_linear(np.zeros((4, 2, 3)), np.zeros((5, 2, 1)))),
    ("max_epochs", lambda: kvzap.train_mlp(np.zeros((4, 2, 3)), np.zeros((4, 2, 1)), max_epochs=0)),
    ("kind", lambda: kvzap.Surrogate({}, "cubic")),
    ("surrogate", lambda: kvzap.kvzap_evidence(model, "w.npz", ids[None])),
    ("attention_mask", lambda: kvzap.kvzap_evidence(model, None, ids[None], np.ones(3))),
  ]
  for match, call in cases:
    with pytest.raises(ValueError, match=match):
      call()


def test_policy_scores_and_refusals():
  rng = np.random.default_rng(0)
  ev = policies.Evidence(kvzap_LGT=jnp.asarray(rng.standard_normal((2, 2, 30)), jnp.float32))
  assert KVzap().evidence_fields == {"kvzap_LGT"}
  keep = np.asarray(KVzap().keep_mask(ev, 7))
  assert (keep.sum(-1) == 7).all()
  s = np.asarray(ev.kvzap_LGT)
  for layer, g in np.ndindex(2, 2):
    assert s[layer, g][keep[layer, g]].min() >= s[layer, g][~keep[layer, g]].max()
  dms = DMS(base=KVzap(), threshold=0.0, sliding_window=4)
  keep = np.asarray(dms.keep_mask(ev, 30))
  assert keep[..., -4:].all()
  np.testing.assert_array_equal(keep[..., :-4], s[..., :-4] >= 0.0)
  with pytest.raises(ValueError, match="kvzap_LGT"):
    KVzap().scores(policies.Evidence())
  with pytest.raises(ValueError, match="kvzap_LGT"):
    kvzap_scores(jnp.zeros((2, 30)))
  with pytest.raises(ValueError, match="kvzap_LGT"):
    kvzap_scores(jnp.zeros((2, 2, 30), jnp.int32))
  jax.clear_caches()


# --------------------------------------------------------------------------- the entry point


def test_experiment_entry_point_and_resume(tmp_path):
  """``:quick`` trains both surrogates on the shipped tiny model; a second run reuses the saved
  targets and the last MLP checkpoint, and writes the same files."""
  root = pathlib.Path(__file__).resolve().parents[1]
  cmd = [
    sys.executable,
    "-m",
    "experiments.kvzap",
    "--config=configs/kvzap.py:quick",
    f"--config.workdir={tmp_path}",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  runs = [subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=300)]
  assert runs[0].returncode == 0, runs[0].stderr[-2000:]
  assert f"run directory: {tmp_path}" in runs[0].stdout and "targets: contexts" in runs[0].stdout
  first = json.loads((tmp_path / "results.json").read_text())
  runs.append(subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=300))
  assert runs[1].returncode == 0, runs[1].stderr[-2000:]
  assert "targets: contexts" not in runs[1].stdout and "epoch" not in runs[1].stdout
  assert json.loads((tmp_path / "results.json").read_text())["test_mse"] == first["test_mse"]
  model, cfg, _ = km.load_tiny()
  for kind in kvzap.KINDS:  # the files record the model they were trained on
    s, meta = kvzap.load(tmp_path / f"kvzap_{kind}.npz", model)
    assert s.kind == kind and meta["model"] == "tiny"


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow  # SmolLM2's GGUF takes ~20 s to load
def test_smollm2_kept_set_agrees_with_kvpress(fx):
  """SmolLM2-135M-Instruct with the linear surrogate ``experiments/kvzap.py`` trained on it:
  kvpress's ``KVzapPress`` scores (on the same dequantised weights) and >= 0.99 of its kept
  pairs at compression_ratio 0.5."""
  from kvjax.model import assets

  model, cfg = km.load(assets.SMOLLM2, dtype=np.float32)
  surrogate, meta = kvzap.load(FIXTURES / "kvzap_smollm2_linear.npz", model, unverified=True)
  assert meta["model"] == "smollm2"
  ids = fx["smollm2_input_ids_T"][None]
  ev = kvzap.kvzap_evidence(model, surrogate, ids)[:, 0]
  ref = fx["smollm2_scores_LGT"]
  np.testing.assert_allclose(np.asarray(ev), ref, atol=1e-4)
  keep = np.asarray(KVzap().keep_mask(policies.Evidence(kvzap_LGT=ev), ids.shape[1] // 2))
  agree = (keep == fx["smollm2_keep_LGT"]).mean()
  assert agree >= 0.99, agree
