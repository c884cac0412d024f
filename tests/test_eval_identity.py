"""The processes of one evaluation hold the same run identity before any work: a process given
another ``seed`` would draw other examples, and process 0 would write their rows as its own."""

import contextlib
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _process(workdir, seed, port, index):
  env = {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_FAULT")}
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "experiments.eval",
      "--config=configs/eval.py:quick",
      f"--config.workdir={workdir}",
      f"--config.seed={seed}",
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


def test_evaluation_processes_given_different_seeds_stop_naming_the_field(tmp_path):
  with contextlib.closing(socket.socket()) as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / "run"
  procs = [_process(workdir, seed, port, i) for i, seed in enumerate((0, 1))]
  outs = [p.communicate(timeout=240) for p in procs]
  errors = [err for _, err in outs]
  assert [p.returncode for p in procs] == [1, 1], [e[-2000:] for e in errors]
  for err in errors:
    assert "ValueError: config.seed: process 1 of 2" in err, err[-2000:]
  assert not (workdir / "results.csv").exists()
