"""Bad input in saved files: a damaged checkpoint step is named with its directory, and a learned
file (KVzap surrogate, Fast KVzip gates, RestoreKV adapter) is refused for a model other than the
one it was trained on, even one of the same shapes."""

import dataclasses
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import checks, rundir
from kvjax import model as km
from kvjax.eval.search import optimise
from kvjax.eval.search.space import Space
from kvjax.model import fastkvzip_gates, kvzap, restorekv_adapter

# --------------------------------------------------------------------------- checkpoints


def _search(checkpoint_dir, **kw):
  space = Space((2,), total=8, window=0, prompt_len=8)

  def evaluate(params_KN):
    return -np.sum(np.asarray(params_KN) ** 2, -1), None

  return optimise.run(
    evaluate,
    space,
    optimise.SearchOptions("random", population=4, generations=4),
    checkpoint_dir=checkpoint_dir,
    log=lambda *_: None,
    **kw,
  )


@pytest.mark.parametrize(
  ("damage", "said"),
  [
    ("truncate", "JSONDecodeError"),
    ("garbage", "UnicodeDecodeError"),
  ],
)
def test_a_damaged_search_checkpoint_names_the_step_and_its_directory(tmp_path, damage, said):
  """A resume from a step whose metadata was cut or overwritten: the error names the step, its
  directory and what the checkpoint library said, never a silent restart."""
  ckpt = tmp_path / "ckpt"
  assert _search(ckpt, stop_after=2) is None
  meta = ckpt / "2" / "default" / "_METADATA"
  assert meta.is_file()
  meta.write_bytes(meta.read_bytes()[:10] if damage == "truncate" else b"\xff\xfe not json")
  step_dir = (ckpt / "2").absolute()
  with pytest.raises(ValueError, match=r"^checkpoint_dir: step 2 of the checkpoints") as e:
    _search(ckpt)
  assert said in str(e.value) and f"remove {step_dir}" in str(e.value)


def test_a_search_checkpoint_with_a_cut_array_file_names_the_step(tmp_path):
  ckpt = tmp_path / "ckpt"
  _search(ckpt, stop_after=2)
  manifest = ckpt / "2" / "default" / "manifest.ocdbt"
  manifest.write_bytes(manifest.read_bytes()[:10])
  with pytest.raises(ValueError, match=r"^checkpoint_dir: step 2 .* damaged or incomplete"):
    _search(ckpt)


def test_an_intact_search_checkpoint_resumes_as_before(tmp_path):
  """The checked restore changes nothing for an intact step: a resume equals one run."""
  _search(tmp_path / "a", stop_after=2)
  resumed, whole = _search(tmp_path / "a"), _search(tmp_path / "b")
  np.testing.assert_array_equal(resumed.params, whole.params)


def test_restore_checkpoint_passes_a_result_and_names_a_failure(tmp_path):
  assert rundir.restore_checkpoint(tmp_path, 3, lambda: "tree") == "tree"

  def broken():
    raise OSError("DATA_LOSS: a/.zarray\nmore lines")

  with pytest.raises(
    ValueError, match=r"step 3 .*\(OSError: DATA_LOSS: a/.zarray\); its files in"
  ) as e:
    rundir.restore_checkpoint(tmp_path, 3, broken)
  assert isinstance(e.value.__cause__, OSError)
  assert str(pathlib.Path(tmp_path).absolute() / "3") in str(e.value)


# --------------------------------------------------------------------------- learned files


@pytest.fixture(scope="module")
def two_models():
  """The tiny model and another of the very same config and shapes, with other weights."""
  model, cfg, _ = km.load_tiny()
  params = model.params()
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  other = jax.tree.map(lambda w: w + 0.01 * jax.random.normal(next(keys), w.shape, w.dtype), params)
  return cfg, params, other


def _model(cfg, params):
  """A model of ``cfg`` and ``params`` as the file loaders read one (its ``cfg`` and
  ``params()``), so the same weights can be paired with another config."""
  return types.SimpleNamespace(cfg=cfg, params=lambda: params)


def _learned(kind, cfg, params):
  """``(module, an untrained instance)`` of each kind of learned file."""
  if kind == "kvzap":
    return kvzap, kvzap.init_mlp(jax.random.key(0), cfg.num_layers, cfg.hidden_size, 2, 8)
  if kind == "fastkvzip":
    return fastkvzip_gates, fastkvzip_gates.init_gates(0, *fastkvzip_gates.model_dims(cfg))
  return restorekv_adapter, restorekv_adapter.init_adapter(cfg, params, tokens=2, rank=2)


KINDS = ("kvzap", "fastkvzip", "restorekv")


@pytest.mark.parametrize("kind", KINDS)
def test_a_learned_file_is_refused_for_another_model_of_the_same_shapes(two_models, tmp_path, kind):
  cfg, params, other = two_models
  lib, thing = _learned(kind, cfg, params)
  path = lib.save(
    tmp_path / "f.npz", thing, {"model": "tiny"}, identity=checks.model_identity(cfg, params)
  )
  _, meta = lib.load(path, _model(cfg, params))  # its own model
  assert meta["model_identity"] == checks.model_identity(cfg, params)
  with pytest.raises(
    ValueError, match=r"f\.npz.*trained on another model of the same config: its weights differ"
  ):
    lib.load(path, _model(cfg, other))
  lib.load(path, _model(cfg, other), unverified=True)  # the caller's explicit choice
  other_config = dataclasses.replace(
    cfg, rope_theta=cfg.rope_theta * 2
  )  # same shapes, other config
  with pytest.raises(
    ValueError, match=r"config differs \(file, this model\): rope_theta \(10000\.0, 20000\.0\)"
  ):
    lib.load(path, _model(other_config, params))


@pytest.mark.parametrize("kind", KINDS)
def test_a_learned_file_without_an_identity_needs_the_explicit_opt_out(two_models, tmp_path, kind):
  cfg, params, _ = two_models
  lib, thing = _learned(kind, cfg, params)
  path = lib.save(tmp_path / "old.npz", thing, {"model": "tiny"})  # as files saved before
  _, meta = lib.load(path, _model(cfg, params), unverified=True)
  assert "model_identity" not in meta
  with pytest.raises(ValueError, match=r"old\.npz.*records no model identity.*unverified=True"):
    lib.load(path, _model(cfg, params))
  lib.load(path, _model(cfg, params), unverified=True)


def test_the_model_identity_is_the_same_in_float32_and_bfloat16(two_models):
  cfg, params, other = two_models
  half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
  assert checks.model_identity(cfg, half) == checks.model_identity(cfg, params)
  assert checks.model_identity(cfg, other) != checks.model_identity(cfg, params)
  with pytest.raises(ValueError, match="not a JSON object with config"):
    checks.same_model("path: f", "abc", checks.model_identity(cfg, params))
