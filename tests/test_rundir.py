"""Run directories under faults: concurrent runs, a kill mid-append, rows cut or repeated."""

import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest

from kvjax import rundir

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = "config_id,budget,value,note"

# A sweep in miniature: lock the workdir, drop invalid rows, append the missing configurations one
# by one; with "hold", keep the lock until a line arrives on stdin (so that runs overlap for sure).
RUN = textwrap.dedent(
  """
  import sys, time
  from kvjax import rundir

  workdir, timeout, count, hold = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  print("waiting", flush=True)
  with rundir.lock(workdir, timeout=timeout) as out:
    print("locked", flush=True)
    path = out / "results.csv"
    table, _ = rundir.repair_rows(
      path, required=("config_id",), numeric=("value",), key="config_id"
    )
    done = set(table.get("config_id", []))
    for i in range(count):
      if f"c{i}" not in done:
        time.sleep(0.002)
        rundir.append_rows(path, [{"config_id": f"c{i}", "budget": i, "value": i / 7}])
    if hold == "hold":
      print("holding", flush=True)
      sys.stdin.readline()
  print("finished", flush=True)
  """
)

# Appends batches of wide rows forever, until killed.
APPEND_FOREVER = textwrap.dedent(
  """
  import sys
  from kvjax import rundir

  path, i = sys.argv[1], 0
  while True:
    rows = [
      {"config_id": f"c{i}_{j}", "budget": i, "value": i * 1000 + j, "note": "x" * 3000}
      for j in range(64)
    ]
    rundir.append_rows(path, rows)
    i += 1
  """
)


def python(script: str, *args, wait=True):
  cmd = [sys.executable, "-c", script, *map(str, args)]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  if not wait:
    pipe = subprocess.PIPE
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def wait_for_line(proc, text: str, timeout: float = 120) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    line = proc.stdout.readline()
    if text in line:
      return
    if not line and proc.poll() is not None:
      raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
  raise AssertionError(f"no {text!r} within {timeout} s")


def release(proc) -> None:
  proc.stdin.write("\n")
  proc.stdin.flush()
  assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]


def assert_clean(path: pathlib.Path, count: int) -> None:
  lines = path.read_text().splitlines()
  assert lines.count(lines[0]) == 1 and lines[0] == "config_id,budget,value"
  table = pd.read_csv(path)
  assert len(table) == count and table["config_id"].is_unique
  np.testing.assert_allclose(table["value"], table["budget"] / 7)


# --------------------------------------------------------------------------- concurrent runs


def test_second_concurrent_run_refuses_naming_the_holder(tmp_path):
  first = python(RUN, tmp_path, 0, 60, "hold", wait=False)
  wait_for_line(first, "locked")
  second = python(RUN, tmp_path, 0, 60, "")
  assert second.returncode != 0 and "finished" not in second.stdout
  assert "WorkdirLockedError" in second.stderr
  assert f"workdir: {tmp_path} is in use by another run (pid {first.pid}" in second.stderr
  release(first)
  assert_clean(tmp_path / "results.csv", 60)


def test_second_concurrent_run_waits_then_resumes_without_duplicates(tmp_path):
  first = python(RUN, tmp_path, 0, 60, "hold", wait=False)
  wait_for_line(first, "holding")
  second = python(RUN, tmp_path, 120, 80, "", wait=False)  # waits, then adds only c60..c79
  wait_for_line(second, "waiting")
  time.sleep(1.0)
  assert second.poll() is None, "the second run must wait for the lock"
  release(first)
  assert second.wait(timeout=120) == 0, second.stderr.read()[-2000:]
  assert_clean(tmp_path / "results.csv", 80)


def test_lock_is_reentrant_and_released_by_a_kill(tmp_path):
  with rundir.lock(tmp_path) as out, rundir.lock(tmp_path):
    assert out == tmp_path
    assert (tmp_path / rundir.LOCK_NAME).read_text().split()[0] == str(os.getpid())
  holder = python(RUN, tmp_path, 0, 5, "hold", wait=False)
  wait_for_line(holder, "holding")
  with (
    pytest.raises(rundir.WorkdirLockedError, match=f"pid {holder.pid}"),
    rundir.lock(tmp_path, timeout=0.2),
  ):
    pass
  holder.send_signal(signal.SIGKILL)
  holder.wait(timeout=60)
  with rundir.lock(tmp_path, timeout=10):  # the kernel released the killed holder's lock
    pass
  with (
    pytest.raises(ValueError, match="timeout: expected a number of seconds >= 0"),
    rundir.lock(tmp_path, timeout=-1),
  ):
    pass


# --------------------------------------------------------------------------- a kill mid-append


def test_sigkill_mid_append_loses_only_the_torn_line(tmp_path):
  path = tmp_path / "results.csv"
  proc = python(APPEND_FOREVER, path, wait=False)
  deadline = time.time() + 120
  while time.time() < deadline and (not path.exists() or path.stat().st_size < 2_000_000):
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  data = path.read_bytes()
  if data.endswith(b"\n"):  # the kill fell between two writes: tear the last row by hand
    last = data[:-1].rsplit(b"\n", 1)[1]
    data = data[: len(data) - 1 - len(last) // 2]
    path.write_bytes(data)
  complete = data[: data.rfind(b"\n") + 1].decode().splitlines()
  table = rundir.read_rows(path, required=("config_id", "note"), numeric=("value",))
  assert path.read_bytes() == data, "read_rows must not modify the file"
  assert len(table) == len(complete) - 1  # every complete row, only the torn one dropped
  ij = table["config_id"].str[1:].str.split("_", expand=True).astype(int)
  np.testing.assert_array_equal(table["value"], ij[0] * 1000 + ij[1])
  assert (table["note"].str.len() == 3000).all()
  # the next append cuts the torn tail instead of merging it with its first row
  rundir.append_rows(path, [{"config_id": "next", "budget": 0, "value": 0, "note": "y"}])
  again = rundir.read_rows(path, required=("config_id",), numeric=("value",))
  assert len(again) == len(table) + 1 and again["config_id"].iloc[-1] == "next"
  assert path.read_text().count("\n") == len(again) + 1


# --------------------------------------------------------------------------- damaged files


def damaged(path: pathlib.Path) -> None:
  path.write_text(
    "\n".join(
      [
        HEADER,
        "a,1,0.5,ok",
        "b,2,0.2",  # cut in the middle of the file: a field short
        "c,3,0.3,ok",
        HEADER,  # a second run's header
        "d,4,nan,ok",  # a metric that is not a number
        "e,5,,ok",  # a missing metric
        "f,6,0.6,",  # an optional column may be empty
        "c,3,0.3,again",  # a repeated configuration
        'g,7,0.7,"x',  # an unterminated quote
        "h,8,0.8,ok,extra",  # a row merged with a torn one
        "i,9,inf,ok",
        "",
        "j,10,1.0,ok",
        "k,11,1.1,o",  # torn last line (no newline)
      ]
    )
  )


def test_read_rows_drops_cut_rows_headers_nan_and_repeats(tmp_path):
  path = tmp_path / "results.csv"
  damaged(path)
  before = path.read_bytes()
  table = rundir.read_rows(
    path, dtype={"config_id": str}, required=("config_id",), numeric=("value",), key="config_id"
  )
  assert path.read_bytes() == before
  assert table["config_id"].tolist() == ["a", "c", "f", "j"]
  assert table["note"].tolist()[:2] == ["ok", "ok"] and math.isnan(table["note"].iloc[2])
  assert table["value"].dtype == np.float64 and table["budget"].dtype == np.int64
  # without requirements only the malformed lines go (wrong field counts, the open quote, the
  # header, the empty line, the torn tail); NaN and repeats stay
  loose = rundir.read_rows(path)
  assert loose["config_id"].tolist() == ["a", "c", "d", "e", "f", "c", "i", "j"]
  table, dropped = rundir.repair_rows(
    path, dtype={"config_id": str}, required=("config_id",), numeric=("value",), key="config_id"
  )
  assert dropped == 10 and table["config_id"].tolist() == ["a", "c", "f", "j"]
  assert path.read_text().splitlines() == [
    HEADER,
    "a,1,0.5,ok",
    "c,3,0.3,ok",
    "f,6,0.6,",
    "j,10,1.0,ok",
  ]
  assert rundir.repair_rows(path, required=("config_id",), numeric=("value",))[1] == 0


def test_resume_after_damage_in_a_subprocess_reruns_exactly_the_bad_rows(tmp_path):
  assert python(RUN, tmp_path, 0, 30, "").returncode == 0
  path = tmp_path / "results.csv"
  lines = path.read_text().splitlines()
  # c4 cut by a kill while another writer went on: the torn row runs into c5's
  lines[5:7] = [lines[5][: len(lines[5]) // 2] + lines[6]]
  lines[6] = lines[6].rsplit(",", 1)[0]  # c6 cut in the middle of the file: its metric is gone
  lines[7] = lines[7].rsplit(",", 1)[0] + ",nan"  # c7's metric is NaN
  lines.insert(12, lines[0])  # a duplicated header
  lines.insert(20, lines[3])  # c2 twice
  path.write_text("\n".join(lines) + "\n")
  out = python(RUN, tmp_path, 0, 30, "")
  assert out.returncode == 0, out.stderr[-2000:]
  assert_clean(path, 30)
  assert pd.read_csv(path)["config_id"].tolist()[-4:] == ["c4", "c5", "c6", "c7"]


def test_append_rows_writes_one_header_and_refuses_a_foreign_file(tmp_path):
  path = tmp_path / "results.csv"
  rundir.append_rows(path, [{"config_id": "a", "value": 1.0}])
  rundir.append_rows(path, [{"value": 2.0, "config_id": "b"}])  # columns in another order
  rundir.append_rows(path, [])
  assert path.read_text() == "config_id,value\na,1.0\nb,2.0\n"
  with pytest.raises(ValueError, match="path: .* not the header of these rows"):
    rundir.append_rows(path, [{"config_id": "c", "other": 1.0}])
  headless = tmp_path / "headless.csv"
  headless.write_text("a,1.0\n")
  with pytest.raises(ValueError, match=r"starts with 'a,1.0', not the header"):
    rundir.append_rows(headless, [{"config_id": "b", "value": 2.0}])
  with pytest.raises(ValueError, match="expected .*'value'.* too"):
    rundir.read_rows(headless, numeric=("value",))
  torn_header = tmp_path / "torn.csv"
  torn_header.write_text("config_i")
  rundir.append_rows(torn_header, [{"config_id": "a", "value": 1.0}])
  assert torn_header.read_text() == "config_id,value\na,1.0\n"
  with pytest.raises(ValueError, match="rows: column 'config_id' holds a line break"):
    rundir.append_rows(path, [{"config_id": "x\ny", "value": 1.0}])
  assert rundir.read_rows(tmp_path / "missing.csv").empty


def test_claim_refuses_another_configuration_and_writes_atomically(tmp_path):
  rundir.claim(tmp_path, "run.json", "one")
  rundir.claim(tmp_path, "run.json", "one")
  with pytest.raises(ValueError, match="holds a run of a different configuration"):
    rundir.claim(tmp_path, "run.json", "two")
  rundir.claim(tmp_path, "run.json", "two", has_results=False)
  assert (tmp_path / "run.json").read_text() == "two"
  assert not list(tmp_path.glob("*.tmp"))
