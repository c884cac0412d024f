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
  one, two = rundir.signature({"seed": 1}), rundir.signature({"seed": 2})
  rundir.claim(tmp_path, "run.json", one, has_results=False)
  rundir.claim(tmp_path, "run.json", one, has_results=True)
  with pytest.raises(ValueError, match=r"holds a run of a different configuration .*\['seed'\]"):
    rundir.claim(tmp_path, "run.json", two, has_results=True)
  rundir.claim(tmp_path, "run.json", two, has_results=False)
  assert (tmp_path / "run.json").read_text() == two
  assert not list(tmp_path.glob("*.tmp"))


def test_results_without_a_claim_are_refused_never_adopted(tmp_path):
  (tmp_path / "results.csv").write_text("config_id,value\na,1.0\n")
  assert rundir.holds_data(tmp_path / "results.csv") and not rundir.holds_data(tmp_path / "x")
  sig = rundir.signature({"seed": 1})
  with pytest.raises(ValueError, match=r"holds results but no run.json .* fresh workdir"):
    rundir.claim(tmp_path, "run.json", sig, has_results=True)
  assert not (tmp_path / "run.json").exists()


def test_fields_outside_the_identity_may_change_on_resume(tmp_path):
  old = rundir.signature({"seed": 1, "batch": 2})  # a record that holds a non-identity field
  rundir.claim(tmp_path, "run.json", old, has_results=False)
  new = rundir.signature({"seed": 1, "batch": 4, "compilation_cache": ""})
  rundir.claim(
    tmp_path, "run.json", new, has_results=True, not_identity=("batch", "compilation_cache")
  )
  assert (tmp_path / "run.json").read_text() == new  # the record holds the last run's settings
  with pytest.raises(ValueError, match=r"differs in \['seed'\]"):
    rundir.claim(
      tmp_path,
      "run.json",
      rundir.signature({"seed": 2, "batch": 4}),
      has_results=True,
      not_identity=("batch", "compilation_cache"),
    )


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"not json", b"[1, 2]"])
def test_a_foreign_claim_file_is_named(tmp_path, content):
  (tmp_path / "sweep.json").write_bytes(content)
  with pytest.raises(ValueError, match=r"sweep.json is not a claim file"):
    rundir.claim(tmp_path, "sweep.json", rundir.signature({}), has_results=False)
  assert (tmp_path / "sweep.json").read_bytes() == content  # nothing overwritten


def test_a_binary_results_file_without_a_newline_is_refused_not_truncated(tmp_path):
  path = tmp_path / "results.csv"
  data = bytes(range(256)).replace(b"\n", b"") * 4  # a small binary file, no newline byte
  path.write_bytes(data)
  with pytest.raises(ValueError, match=r"does not start like the header"):
    rundir.append_rows(path, [{"config_id": "a", "value": 1.0}])
  with pytest.raises(ValueError, match=r"does not start like the header"):
    rundir.repair_rows(path, required=("config_id",), numeric=("value",))
  text = tmp_path / "text.csv"  # text, but not a prefix of this header
  text.write_text("budget,val")
  with pytest.raises(ValueError, match=r"does not start like the header"):
    rundir.append_rows(text, [{"config_id": "a", "value": 1.0}])
  with pytest.raises(ValueError, match=r"does not start like the header"):
    rundir.read_rows(text, columns=("config_id", "value"))
  assert path.read_bytes() == data and text.read_text() == "budget,val"
  torn = tmp_path / "torn.csv"  # a header cut by a kill, in the file's order: repaired
  torn.write_text("value,conf")
  rundir.append_rows(torn, [{"config_id": "a", "value": 1.0}])
  assert torn.read_text() == "config_id,value\na,1.0\n"


def test_a_blank_first_line_is_refused_not_emptied(tmp_path):
  path = tmp_path / "results.csv"
  path.write_text("\nconfig_id,value\na,1.0\n")
  with pytest.raises(ValueError, match="its first line must be the header"):
    rundir.repair_rows(path, required=("config_id",))
  assert path.read_text() == "\nconfig_id,value\na,1.0\n"


def test_directories_where_files_belong_and_empty_workdirs_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"workdir: got the empty path ''"):
    rundir.check_workdir("")
  with pytest.raises(ValueError, match=r"workdir: got the empty path"):
    rundir.lock("  ").__enter__()
  afile = tmp_path / "afile"
  afile.write_text("x")
  with pytest.raises(ValueError, match=r"workdir: .*afile is a file; expected a directory"):
    rundir.lock(afile).__enter__()
  with pytest.raises(ValueError, match=r"workdir: cannot create the directory"):
    rundir.claim(afile / "sub", "run.json", "{}", has_results=False)
  (tmp_path / "w" / rundir.LOCK_NAME).mkdir(parents=True)
  with pytest.raises(ValueError, match=r"\.rundir\.lock is a directory; expected the run's lock"):
    rundir.lock(tmp_path / "w").__enter__()
  (tmp_path / "results.csv").mkdir()
  for call in (
    lambda: rundir.read_rows(tmp_path / "results.csv"),
    lambda: rundir.append_rows(tmp_path / "results.csv", [{"a": 1}]),
  ):
    with pytest.raises(ValueError, match=r"results.csv is a directory; expected a CSV results"):
      call()
  (tmp_path / "run.json").mkdir()
  with pytest.raises(ValueError, match=r"run.json is a directory; expected a claim file"):
    rundir.claim(tmp_path, "run.json", "{}", has_results=False)


def test_config_files_and_missing_fields_are_named(tmp_path):
  nofn = tmp_path / "c.py"
  nofn.write_text("x = 1\n")
  with pytest.raises(ValueError, match=r"defines no get_config"):
    rundir.load_config(nofn)
  import ml_collections  # noqa: PLC0415

  c = ml_collections.ConfigDict(dict(a=1, heatmap=dict(task="x")))
  rundir.require_fields(c, ("a", "heatmap.task"), "configs/x.py")
  with pytest.raises(ValueError, match=r"config.heatmap.depths: missing; expected the fields"):
    rundir.require_fields(c, ("heatmap.depths",), "configs/x.py")
