"""Run from the folder above a clone named ``kvjax``, Python imports the clone itself as a
namespace package; kvjax says so and how to run instead of failing later on a missing file."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_clone_imported_as_a_namespace_package_is_named(tmp_path):
  (tmp_path / "kvjax").symlink_to(ROOT, target_is_directory=True)  # the clone, named kvjax
  script = tmp_path / "script.py"
  script.write_text("import kvjax.model\n")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  run = subprocess.run(
    [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env
  )
  if "No module named 'kvjax.model'" in run.stderr:  # kvjax is not installed (editable)
    return
  assert run.returncode != 0
  assert "kvjax was imported as a namespace package" in run.stderr, run.stderr[-2000:]
  assert "run from inside the clone" in run.stderr


def test_the_installed_package_finds_its_tiny_model():
  from kvjax.model import assets

  assert assets.namespace_problem() is None
  assert (assets.tiny_path() / "config.json").is_file()
