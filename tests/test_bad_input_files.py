"""Bad input in saved files: a damaged checkpoint step is named with its directory, and a learned
file (KVzap surrogate, Fast KVzip gates, RestoreKV adapter) is refused for a model other than the
one it was trained on, even one of the same shapes."""

import pathlib

import numpy as np
import pytest

from kvjax import rundir
from kvjax.eval.search import optimise
from kvjax.eval.search.space import Space

# --------------------------------------------------------------------------- checkpoints


def _search(checkpoint_dir, **kw):
  space = Space((2,), total=8, window=0, prompt_len=8)

  def evaluate(params_KN):
    return -np.sum(np.asarray(params_KN) ** 2, -1), None

  return optimise.run(
    evaluate,
    space,
    optimiser="random",
    population=4,
    generations=4,
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
