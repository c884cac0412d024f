"""Bad input, round three: stored contexts that were edited, model configs out of range, the
leaderboard's lists, RULER's absurd options, file readers that name the file, and the run
identity every process of one run must share (``docs/bad_input.md``)."""

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.model import npzfile, stored

ROOT = pathlib.Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- stored contexts


@pytest.fixture(scope="module")
def context():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(5, cfg.vocab_size, (2, 24)).astype(np.int32)
  pol = policies.make("snapkv", window=4)
  ctx = km.compress_context(model, ids, policy=pol, budget=12)
  return model, cfg, pol, ctx


def _load(context, path, policy=None):
  model, _, pol, _ = context
  return stored.load(path, model, pol if policy is None else policy)


def _edited(ctx, **cache_fields):
  return dataclasses.replace(ctx, cache=dataclasses.replace(ctx.cache, **cache_fields))


def test_an_equal_policy_built_by_class_loads_a_context_saved_by_name(context, tmp_path):
  path = context[3].save(tmp_path / "c")
  loaded = _load(context, path, policies.SnapKV(window=4))
  assert jnp.array_equal(loaded.cache.keys, context[3].cache.keys)
  with pytest.raises(ValueError, match="policy: .* was compressed with"):
    _load(context, path, policies.SnapKV(window=6))


def _set(a, index, value):
  out = np.array(a)
  out[index] = value
  return jnp.asarray(out)


@pytest.mark.parametrize(
  "edit, match",
  [
    (lambda c: dict(keys=_set(c.keys, (0, 0, 0, 0, 0), np.nan)), "NaN or inf keys"),
    (lambda c: dict(values=_set(c.values, (1, 1, 0, 2, 3), np.inf)), "NaN or inf values"),
    (lambda c: dict(valid=_set(c.valid, (2, 1), False)), "no valid slot in row 1 of layer 2"),
    (lambda c: dict(budget=jnp.asarray(c.budget, jnp.float32)), "budget of dtype float32"),
    (lambda c: dict(budget=_set(c.budget, (0, 0, 0), 99)), r"outside \[0, capacity=12\]"),
    (lambda c: dict(positions=_set(c.positions, (0, 0, 0, 0), 24)), "outside the row's tokens"),
    (lambda c: dict(positions=_set(c.positions, (0, 0, 0, 0), -1)), "position -1"),
    (lambda c: dict(valid=jnp.asarray(c.valid, jnp.int32)), "valid of dtype int32"),
    (lambda c: dict(positions=c.positions[:, :, :, :5]), "positions of shape"),
    (lambda c: dict(keys=c.keys[:3]), "keys of shape"),
    (lambda c: dict(overflow=jnp.asarray([False, True])), r"rows \[1\] that overflowed"),
  ],
)
def test_a_saved_context_with_impossible_arrays_is_refused(context, tmp_path, edit, match):
  """Saved as edited (the checksum then matches): the arrays' own checks refuse them."""
  ctx = context[3]
  path = _edited(ctx, **edit(ctx.cache)).save(tmp_path / "c")
  with pytest.raises(ValueError, match=match) as e:
    _load(context, path)
  assert str(path) in str(e.value)


@pytest.mark.parametrize(
  "header, match",
  [
    (dict(next_pos=[20, 24]), "outside the row's tokens"),
    (dict(next_pos=[24]), "keys of shape"),
    (dict(next_pos=[24, 0]), "next_pos="),
    (dict(capacity=13), "keys of shape"),
    (dict(capacity=0), "capacity=0"),
    (dict(capacity=12.0), "capacity=12.0"),
    (dict(layout="query"), "keys of shape"),
    (dict(layout="rows"), "layout='rows'"),
    (dict(reindex="yes"), "reindex='yes'"),
    (dict(model=[1]), "not a JSON object"),
  ],
)
def test_a_saved_context_with_an_impossible_header_is_refused(context, tmp_path, header, match):
  """A header edited consistently with its checksum: the fields' own checks refuse it."""
  ctx = context[3]
  fields = ctx.header() | header
  path = ctx.save(tmp_path / "c")
  _rewrite(path, fields)
  with pytest.raises(ValueError, match=match) as e:
    _load(context, path)
  assert str(path) in str(e.value)


def _rewrite(path, header, *, checksum=True):
  from safetensors.numpy import load_file, save_file

  arrays = load_file(str(path))
  header = {k: v for k, v in header.items() if k != "checksum"}
  if checksum:
    header["checksum"] = stored.checksum(arrays, header)
  save_file(arrays, str(path), metadata={"kvjax": json.dumps(header)})


def test_a_saved_context_changed_after_saving_is_refused_by_its_checksum(context, tmp_path):
  from safetensors.numpy import load_file, save_file

  ctx = context[3]
  path = ctx.save(tmp_path / "c")
  saved = json.loads(_metadata(path)["kvjax"])
  _rewrite(path, saved | {"next_pos": [23, 24]}, checksum=False)  # a changed next position
  _set_checksum(path, saved["checksum"])
  with pytest.raises(ValueError, match="does not match its checksum"):
    _load(context, path)
  path = ctx.save(tmp_path / "d")
  arrays = load_file(str(path))
  arrays["keys"] = arrays["keys"] * 2  # finite, plausible, but not what was saved
  save_file(arrays, str(path), metadata=_metadata(path))
  with pytest.raises(ValueError, match="does not match its checksum"):
    _load(context, path)


def _metadata(path) -> dict:
  from safetensors import safe_open

  with safe_open(str(path), "np") as f:
    return f.metadata()


def _set_checksum(path, digest):
  from safetensors.numpy import load_file, save_file

  header = json.loads(_metadata(path)["kvjax"]) | {"checksum": digest}
  save_file(load_file(str(path)), str(path), metadata={"kvjax": json.dumps(header)})


def test_a_saved_context_header_without_a_field_names_the_file(context, tmp_path):
  ctx = context[3]
  path = ctx.save(tmp_path / "c")
  header = {k: v for k, v in ctx.header().items() if k != "model"}
  _rewrite(path, header)
  with pytest.raises(ValueError, match=r"header lacks \['model'\]") as e:
    _load(context, path)
  assert str(path) in str(e.value)
  _rewrite(path, ctx.header())
  _set_checksum(path, None)
  with pytest.raises(ValueError, match="does not match its checksum"):
    _load(context, path)


def test_a_truncated_context_file_names_the_file(context, tmp_path):
  path = context[3].save(tmp_path / "c")
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match=f"path: {path} is not a safetensors file"):
    _load(context, path)


# --------------------------------------------------------------------------- npz files


def test_npz_readers_name_the_file(tmp_path):
  path = npzfile.write(tmp_path / "a.npz", {"w": np.ones(3)}, {"format": "f/1"})
  arrays, meta = npzfile.read(path, "f/1", "test")
  assert meta == {"format": "f/1"} and arrays["w"].tolist() == [1, 1, 1]
  data = path.read_bytes()
  cut = tmp_path / "cut.npz"
  cut.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match=f"path: {cut} is not a readable test file"):
    npzfile.read(cut, "f/1", "test")
  for text, match in (("[1, 2]", "not a JSON object"), ("{oops", "not valid JSON")):
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta_json=np.asarray(text), w=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=f"path: {bad} has a meta_json header .*{match}"):
      npzfile.read(bad, "f/1", "test")


# --------------------------------------------------------------------------- model configs

GEMMA2 = dict(
  architectures=["Gemma2ForCausalLM"],
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  query_pre_attn_scalar=8,
  sliding_window=16,
)
PHI3 = dict(
  architectures=["Phi3ForCausalLM"],
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=4,
  max_position_embeddings=128,
  sliding_window=64,
)


@pytest.mark.parametrize(
  "base, field, value, match",
  [
    (GEMMA2, "sliding_window", 0, "sliding_window: 0, expected an int >= 1, or null"),
    (GEMMA2, "sliding_window", -4, "sliding_window: -4"),
    (GEMMA2, "sliding_window", 16.5, "sliding_window: 16.5, expected an integer"),
    (GEMMA2, "rms_norm_eps", -1e-6, "rms_norm_eps: -1e-06, expected a finite number > 0"),
    (GEMMA2, "rms_norm_eps", "1e-6", "rms_norm_eps: '1e-6', expected a number"),
    (GEMMA2, "attn_logit_softcapping", 0.0, "attn_logit_softcapping: 0.0"),
    (GEMMA2, "final_logit_softcapping", -30.0, "final_logit_softcapping: -30.0"),
    (GEMMA2, "rope_theta", -10000.0, "rope_theta: -10000.0, expected a finite number > 0"),
    (GEMMA2, "query_pre_attn_scalar", float("nan"), "query_pre_attn_scalar: nan"),
    (GEMMA2, "num_hidden_layers", 2.5, "num_hidden_layers: 2.5, expected an integer"),
    (GEMMA2, "num_key_value_heads", 3, "num_key_value_heads: 3, expected a divisor"),
    (PHI3, "sliding_window", 0, "sliding_window: 0"),
    (PHI3, "rope_theta", 0, "rope_theta: 0.0"),
    (PHI3, "rms_norm_eps", float("inf"), "rms_norm_eps: inf"),
  ],
)
def test_model_config_values_are_range_checked_naming_the_file(tmp_path, base, field, value, match):
  from kvjax.model import config as config_lib

  raw = dict(base, **{field: value})
  (tmp_path / "config.json").write_text(json.dumps(raw))
  with pytest.raises(ValueError, match=match) as e:
    config_lib.from_pretrained_dir(tmp_path)
  assert str(tmp_path / "config.json") in str(e.value)


def test_model_config_null_means_no_window_or_soft_cap():
  from kvjax.model import config as config_lib

  cfg = config_lib.from_hf_dict(GEMMA2 | dict(attn_logit_softcapping=None))
  assert cfg.attn_softcap is None and cfg.final_softcap == 30.0 and cfg.sliding_window == 16
  assert config_lib.from_hf_dict(PHI3 | dict(sliding_window=None)).sliding_window is None
  assert config_lib.from_hf_dict(GEMMA2 | dict(sliding_window=16.0)).sliding_window == 16


# --------------------------------------------------------------------------- leaderboard, RULER


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("tasks", ("niah_single_1", "vt", "niah_single_1"), "tasks: 'niah_single_1' repeats"),
    ("ratios", (0.5, 0.25, 0.5), "ratios: 0.5 repeats 0.5"),
    ("ratios", (0.5, 0.5000001), "ratios: 0.5000001 repeats 0.5"),
    ("max_new_tokens", 0, "max_new_tokens: expected None .* or an int >= 1, got 0"),
    ("max_new_tokens", -3, "max_new_tokens: .* got -3"),
    ("tasks", (), "tasks: the list is empty"),
    ("ratios", (), "ratios: the list is empty"),
    ("methods", (), "methods: the list is empty"),
  ],
)
def test_leaderboard_lists_and_options_are_refused_before_the_directory(
  tmp_path, field, value, match
):
  from configs import leaderboard as lb_config
  from kvjax.eval import leaderboard

  config = lb_config.get_config("quick")
  config[field] = value
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=match):
    leaderboard.run(config, workdir, model=object(), tokenizer=object())
  assert not workdir.exists()


def test_leaderboard_answer_refuses_no_new_tokens():
  from kvjax.eval import leaderboard

  with pytest.raises(ValueError, match="max_new_tokens: .* got 0"):
    leaderboard.answer(None, None, None, leaderboard.Cell(None, 0.5, "agnostic", max_new_tokens=0))


@pytest.mark.parametrize(
  "options, match",
  [
    (dict(num_chains=10_000), "num_chains: 10000 chains of 4 hops need 50000"),
    (dict(num_chains=200), "num_chains: 200 chains of 4 hops put 1000 lines"),
    (dict(num_chains=9, type_haystack="essay"), "45 needles .* depth grid has 40"),
    (dict(num_hops=400), "length: 300 tokens cannot hold 401 needles"),
  ],
)
def test_ruler_absurd_options_are_refused_at_once(options, match):
  from kvjax.eval import ruler
  from kvjax.model.tokenizer import WordTokenizer

  tokenizer = WordTokenizer(["<pad>", "<bos>", "<eos>"])
  start = time.perf_counter()
  with pytest.raises(ValueError, match=match):
    ruler.sample("vt", tokenizer, length=300, seed=0, **options)
  assert time.perf_counter() - start < 1.0


def test_ruler_niah_needles_beyond_the_prompt_are_refused_at_once():
  from kvjax.eval import ruler
  from kvjax.model.tokenizer import WordTokenizer

  with pytest.raises(ValueError, match="length: 100 tokens cannot hold 400 needles"):
    ruler.sample(
      "niah_single_1",
      WordTokenizer(["<pad>", "<bos>", "<eos>"]),
      length=100,
      seed=0,
      num_needle_k=400,
    )


# --------------------------------------------------------------------------- several processes


def test_run_identities_name_the_fields_that_differ(monkeypatch):
  from kvjax import distributed

  a = distributed.run_identity({"grid": {"budget": [8, 16]}, "seed": 0}, devices=4)
  assert a["devices"] == 4 and a["code"] == distributed.code_version()
  b = distributed.run_identity({"grid": {"budget": [8, 24]}, "seed": 0}, devices=4)
  distributed.check_same(a)  # one process: nothing to compare
  monkeypatch.setattr(distributed, "process_count", lambda: 2)
  monkeypatch.setattr(distributed, "gather_json", lambda value, what: [a, b])
  with pytest.raises(ValueError, match=r"config.grid.budget\[1\]: process 1 of 2 .* 16.* 24") as e:
    distributed.check_same(a, "sweep")
  assert "differing in ['config.grid.budget[1]']" in str(e.value)
  monkeypatch.setattr(distributed, "gather_json", lambda value, what: [a, a])
  distributed.check_same(a, "sweep")


def _entry_process(module, args, port, index):
  """One of two local processes running ``python -m module args`` as a cluster."""
  import os
  import subprocess
  import sys

  env = {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_FAULT")}
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      module,
      *args,
      f"--coordinator=localhost:{port}",
      "--num_processes=2",
      f"--process_id={index}",
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _sweep_process(workdir, budgets, port, index):
  args = [
    "--config=configs/sweep_lab.py:quick",
    f"--config.workdir={workdir}",
    "--noplots",
    "--config.grid.product.policy=('snapkv',)",
    "--config.grid.product.schedule=('uniform',)",
    f"--config.grid.product.budget={budgets}",
  ]
  return _entry_process("experiments.sweep", args, port, index)


def _free_port() -> int:
  import contextlib
  import socket

  with contextlib.closing(socket.socket()) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_evaluation_processes_given_different_seeds_stop_naming_the_field(tmp_path):
  """Process 1 holds another ``seed`` (it would draw other examples): both stop before any work,
  naming the field, and nothing is written."""
  port, workdir = _free_port(), tmp_path / "run"
  procs = [
    _entry_process(
      "experiments.eval",
      ["--config=configs/eval.py:quick", f"--config.workdir={workdir}", f"--config.seed={seed}"],
      port,
      i,
    )
    for i, seed in enumerate((0, 1))
  ]
  outs = [p.communicate(timeout=240) for p in procs]
  errors = [err for _, err in outs]
  assert [p.returncode for p in procs] == [1, 1], [e[-2000:] for e in errors]
  for err in errors:
    assert "ValueError: config.seed: process 1 of 2" in err, err[-2000:]
  assert not (workdir / "results.csv").exists()


def test_sweep_processes_given_different_grids_stop_naming_the_field(tmp_path):
  """Process 1's grid differs from process 0's in one budget: both stop before any work, with a
  ValueError naming the field, and nothing is written."""
  port, workdir = _free_port(), tmp_path / "run"
  procs = [
    _sweep_process(workdir, budgets, port, i) for i, budgets in enumerate(("(12,16)", "(12,20)"))
  ]
  outs = [p.communicate(timeout=240) for p in procs]
  errors = [err for _, err in outs]
  assert [p.returncode for p in procs] == [1, 1], [e[-2000:] for e in errors]
  for err in errors:
    assert "ValueError: config.grid.product.budget[1]: process 1 of 2" in err, err[-2000:]
  assert not (workdir / "results.csv").exists()


def test_a_sweep_resumed_on_another_device_count_says_so(tmp_path):
  from configs import sweep_lab
  from kvjax.lab import sweep

  config = sweep_lab.get_config("quick")
  config.grid.product = ml_collections.ConfigDict(
    dict(policy=("snapkv",), schedule=("uniform",), budget=(16,))
  )
  logs = []
  sweep.run(config, tmp_path, log=logs.append, progress=False)
  claim = json.loads((tmp_path / "sweep.json").read_text())
  n = jax.device_count()
  assert claim["devices"] == n and not any("resuming a run" in line for line in logs)
  (tmp_path / "sweep.json").write_text(json.dumps(claim | {"devices": n + 3}))
  table = sweep.run(config, tmp_path, log=logs.append, progress=False)
  assert len(table) == 1 and f"resuming a run of {n + 3} devices on {n}" in "\n".join(logs)
