"""Several JAX processes, one sweep: local CPU processes joined by ``jax.distributed`` (gloo).

The quick form (CI) launches two processes of two CPU devices each on a one-group sweep, compares
its ``results.csv`` with a one-process run on four devices (byte for byte), kills one process
mid-sweep (``KVJAX_FAULT_EXIT``, the test-only fault injection of ``kvjax.distributed``), times
the survivor's exit and resumes. ``KVJAX_FULL=1`` adds the quick config's whole grid (several
groups) and the process-0 death.
"""

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pandas as pd
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import distributed, rundir  # noqa: E402

# one group (one compile), three chunks of four on four devices
SMALL = (
  "--config.grid.product.policy=('snapkv',)",
  "--config.grid.product.schedule=('uniform',)",
  "--config.grid.product.budget=(12,16,20,24,28,32,36,40,44,48,56,64)",
)


def _free_port() -> int:
  with contextlib.closing(socket.socket()) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_FAULT")}
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), **extra)
  return env


def _command(workdir, grid) -> list[str]:
  return [
    sys.executable,
    "-m",
    "experiments.sweep",
    "--config=configs/sweep_lab.py:quick",
    f"--config.workdir={workdir}",
    "--noplots",
    *grid,
  ]


def one_process(workdir, grid=SMALL, devices=4):
  out = subprocess.run(
    _command(workdir, grid), cwd=ROOT, env=_env(devices), capture_output=True, text=True
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def start(workdir, grid=SMALL, count=2, devices=2, **env) -> list[subprocess.Popen]:
  """Starts ``count`` processes of one sweep (a free port for their coordinator)."""
  port = _free_port()
  procs = []
  for i in range(count):
    flags = [f"--coordinator=localhost:{port}", f"--num_processes={count}", f"--process_id={i}"]
    procs.append(
      subprocess.Popen(
        _command(workdir, grid) + flags,
        cwd=ROOT,
        env=_env(devices, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
  return procs


def finish(procs, timeout=300, until=None) -> list[tuple]:
  """Waits for ``procs`` (all of them, or the one at index ``until``; the others are killed
  then): ``[(returncode, stdout, stderr, end time)]`` in process order."""
  ends = [None] * len(procs)
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for i, p in enumerate(procs):
      if ends[i] is None and p.poll() is not None:
        ends[i] = time.monotonic()
    if (None not in ends) if until is None else ends[until] is not None:
      break
    time.sleep(0.05)
  for p in procs:
    if p.poll() is None:
      p.kill()
  return [(p.returncode, *p.communicate(), end) for p, end in zip(procs, ends, strict=True)]


def processes(workdir, grid=SMALL, count=2, devices=2, timeout=300, **env) -> list[tuple]:
  """Runs ``count`` processes of one sweep to the end (:func:`finish`)."""
  return finish(start(workdir, grid, count, devices, **env), timeout)


def _rows(workdir) -> pd.DataFrame:
  table = pd.read_csv(pathlib.Path(workdir) / "results.csv", dtype={"config_id": str})
  return table.set_index("config_id").sort_index()


def _check_death_and_resume(tmp_path, grid, reference, dead: int):
  workdir = tmp_path / f"killed_{dead}"
  runs = processes(workdir, grid, KVJAX_FAULT_EXIT=f"{dead}:1")
  (rc_dead, _, err_dead, end_dead) = runs[dead]
  (rc_alive, _, err_alive, end_alive) = runs[1 - dead]
  assert rc_dead == distributed.FAULT_EXIT_CODE, err_dead[-3000:]
  assert rc_alive != 0 and end_alive is not None, err_alive[-3000:]
  if dead == 1:  # the survivor owns the directory: it names the failure itself
    assert rc_alive == distributed.PEER_FAILED_EXIT_CODE, err_alive[-3000:]
    assert "PeerFailedError" in err_alive and "rerun the same command" in err_alive
  else:  # the coordinator died: JAX's runtime stops the survivor, naming the dead task
    assert "another task died" in err_alive, err_alive[-3000:]
  survived = end_alive - end_dead
  print(f"process {1 - dead} exited {survived:.1f} s after process {dead} died")
  assert survived < 120
  partial = _rows(workdir)
  assert 0 < len(partial) < len(reference) and partial.index.is_unique
  pd.testing.assert_frame_equal(partial, reference.loc[partial.index])
  again = processes(workdir, grid)
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  assert f"{len(partial)} already in" in again[0][1]
  resumed = _rows(workdir)
  assert resumed.index.is_unique
  pd.testing.assert_frame_equal(resumed, reference)


CLUSTER_ENV = (
  *distributed.ENV.values(),
  "SLURM_JOB_ID",
  "SLURM_STEP_NODELIST",
  "SLURM_PROCID",
  "SLURM_LOCALID",
  "SLURM_NTASKS",
  "TPU_WORKER_HOSTNAMES",
  "TPU_PROCESS_ADDRESSES",
  "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture
def no_cluster(monkeypatch):
  for name in CLUSTER_ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_settings_come_from_flags_then_the_environment_then_defaults(no_cluster):
  assert distributed.settings() == {
    "distributed": "auto",
    "coordinator": None,
    "num_processes": None,
    "process_id": None,
    "heartbeat_timeout": 60,
    "initialization_timeout": 120,
  }
  no_cluster.setenv("KVJAX_COORDINATOR", "host:1234")
  no_cluster.setenv("KVJAX_NUM_PROCESSES", "4")
  no_cluster.setenv("KVJAX_PROCESS_ID", "3")
  no_cluster.setenv("KVJAX_HEARTBEAT_TIMEOUT", "30")
  s = distributed.settings({"process_id": 2, "coordinator": None})
  assert (s["coordinator"], s["num_processes"], s["process_id"]) == ("host:1234", 4, 2)
  assert s["heartbeat_timeout"] == 30
  assert distributed.cluster() == "explicit"
  assert distributed.cluster({"distributed": "off"}) is None


@pytest.mark.parametrize(
  "given, match",
  [
    ({"distributed": "maybe"}, "distributed: expected one of"),
    ({"coordinator": "nohost"}, "coordinator: expected host:port"),
    ({"coordinator": "h:1", "num_processes": 2}, "expected all three"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "process_id: 2 is not below"),
    ({"num_processes": 0}, "num_processes: expected an int >= 1"),
    ({"heartbeat_timeout": "soon"}, "heartbeat_timeout: expected an int >= 1"),
    ({"process_id": True}, "process_id: expected an int >= 0"),
  ],
)
def test_bad_settings_are_named(no_cluster, given, match):
  with pytest.raises(ValueError, match=match):
    distributed.settings(given)


def test_clusters_are_detected_from_their_environment(no_cluster):
  assert distributed.cluster() is None and distributed.cluster({"distributed": "on"}) == "on"
  slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_PROCID="0", SLURM_LOCALID="0")
  for k, v in slurm.items():
    no_cluster.setenv(k, v)
  no_cluster.setenv("SLURM_NTASKS", "1")  # one task: a one-process run
  assert distributed.cluster() is None
  no_cluster.setenv("SLURM_NTASKS", "2")
  assert distributed.cluster() == "slurm"
  for k in (*slurm, "SLURM_NTASKS"):
    no_cluster.delenv(k)
  no_cluster.setenv("TPU_WORKER_HOSTNAMES", "w0")
  assert distributed.cluster() is None  # one worker
  no_cluster.setenv("TPU_WORKER_HOSTNAMES", "w0,w1,w2,w3")
  assert distributed.cluster() == "tpu"
  no_cluster.delenv("TPU_WORKER_HOSTNAMES")
  no_cluster.setenv("OMPI_COMM_WORLD_SIZE", "2")
  assert distributed.cluster() == "mpi"


def test_in_one_process_every_helper_is_the_plain_operation(no_cluster, monkeypatch):
  assert not distributed.maybe_initialize()  # no cluster: nothing to initialise
  assert distributed.is_primary() and distributed.process_count() == 1
  assert distributed.on_primary(lambda: [1, 2], "listing") == [1, 2]
  assert distributed.broadcast_json({"a": 1}) == {"a": 1}
  x = jax.numpy.arange(4.0)
  np.testing.assert_array_equal(distributed.to_host({"x": x})["x"], np.arange(4.0))
  assert distributed.put({"x": np.ones(2)}, None)["x"].shape == (2,)
  assert [a.tolist() for a in distributed.gather_arrays(np.ones(2))] == [[1.0, 1.0]]
  assert [a.tolist() for a in distributed.gather_shares([[1], [2]], 2)] == [[1], [2]]
  with pytest.raises(ValueError, match="values: got 1 arrays; expected 2"):
    distributed.gather_shares([[1]], 2)
  assert distributed.process_mesh().devices.size == 1
  with pytest.raises(KeyError), distributed.fail_fast():  # one process: errors propagate
    raise KeyError("k")
  distributed.fault_point()  # unset: nothing
  monkeypatch.setenv(distributed.FAULT_ENV, "one:2")
  with pytest.raises(ValueError, match="KVJAX_FAULT_EXIT: expected PROCESS:CALLS"):
    distributed.fault_point()
  monkeypatch.setenv(distributed.FAULT_ENV, "1:1")  # another process's fault: nothing here
  distributed.fault_point()


HELPERS_PROBE = """
import json, sys
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from kvjax import distributed
assert distributed.maybe_initialize()  # from KVJAX_COORDINATOR, KVJAX_NUM_PROCESSES, ...
import jax
me = distributed.process_index()
out = dict(primary=distributed.is_primary(), count=distributed.process_count())
out["broadcast"] = distributed.broadcast_json({"from": me})
out["gathered"] = distributed.gather_json({"rows": list(range(me + 1))})
out["share"] = distributed.share(list("abcde"))
out["on_primary"] = distributed.on_primary(lambda: [me, "done"], "a step")
try:
  distributed.on_primary(lambda: 1 / 0, "dividing")
except Exception as e:
  out["error"] = f"{type(e).__name__}: {e}"
mesh = Mesh(np.asarray(jax.devices()), ("c",))
x = distributed.put(np.arange(8.0), NamedSharding(mesh, PartitionSpec("c")))
y = jax.jit(lambda v: 2 * v)(x)
out["addressable"] = y.is_fully_addressable
out["to_host"] = distributed.to_host(y).tolist()
arrays = distributed.gather_arrays(np.full((me + 1, 2), 0.1 + me, np.float64))
out["arrays"] = [[a.dtype.str, a.tolist()] for a in arrays]
shares = [np.arange(i + 1, dtype=np.int64) for i in distributed.share(range(3))]
out["shares"] = [a.tolist() for a in distributed.gather_shares(shares, 3)]
out["mesh"] = [d.process_index for d in distributed.process_mesh().devices.flat]
print("PROBE " + json.dumps(out))
"""


def test_the_helpers_across_two_processes():
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", HELPERS_PROBE],
      cwd=ROOT,
      env=_env(
        1,
        KVJAX_COORDINATOR=f"localhost:{port}",
        KVJAX_NUM_PROCESSES="2",
        KVJAX_PROCESS_ID=str(i),
      ),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=180) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
  got = [json.loads(o.split("PROBE ", 1)[1]) for o, _ in outs]
  assert [g["primary"] for g in got] == [True, False] and {g["count"] for g in got} == {2}
  assert all(g["broadcast"] == {"from": 0} for g in got)
  assert all(g["gathered"] == [{"rows": [0]}, {"rows": [0, 1]}] for g in got)
  assert [g["share"] for g in got] == [[0, 2, 4], [1, 3]]
  assert all(g["on_primary"] == [0, "done"] for g in got)
  assert got[0]["error"] == "ZeroDivisionError: division by zero"
  assert got[1]["error"].startswith("RuntimeError: process 1: process 0 failed dividing")
  assert all(not g["addressable"] and g["to_host"] == [2.0 * i for i in range(8)] for g in got)
  arrays = [["<f8", [[0.1, 0.1]]], ["<f8", [[1.1, 1.1], [1.1, 1.1]]]]  # float64 kept
  assert all(g["arrays"] == arrays for g in got)
  assert all(g["shares"] == [[0], [0, 1], [0, 1, 2]] and g["mesh"] == [0, 1] for g in got)


def test_two_processes_match_one_and_a_death_is_bounded_and_resumed(tmp_path):
  start = time.monotonic()
  one_process(tmp_path / "one")
  one_s = time.monotonic() - start
  start = time.monotonic()
  runs = processes(tmp_path / "two")
  two_s = time.monotonic() - start
  print(f"one process of 4 devices: {one_s:.1f} s; two processes of 2 devices: {two_s:.1f} s")
  assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:] + runs[1][2][-3000:]
  one_csv = (tmp_path / "one" / "results.csv").read_bytes()
  assert (tmp_path / "two" / "results.csv").read_bytes() == one_csv  # same rows, same order
  assert "run directory:" in runs[0][1] and "run directory:" not in runs[1][1]
  _check_death_and_resume(tmp_path, SMALL, _rows(tmp_path / "one"), dead=1)


@pytest.mark.slow
def test_a_directory_a_live_run_holds_is_refused_by_every_process(tmp_path):
  workdir = tmp_path / "held"
  with rundir.lock(workdir):
    runs = processes(workdir, timeout=120)
  assert all(r[0] not in (0, None) for r in runs), [r[2][-2000:] for r in runs]
  assert "is in use by another run" in runs[0][2]
  assert "process 0 failed claiming the run directory" in runs[1][2]
  assert not (workdir / "results.csv").exists()


@pytest.mark.slow
def test_the_quick_grid_over_two_processes_and_the_coordinators_death(tmp_path):
  one_process(tmp_path / "one", grid=())
  runs = processes(tmp_path / "two", grid=())
  assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:] + runs[1][2][-3000:]
  assert (tmp_path / "two" / "results.csv").read_bytes() == (
    tmp_path / "one" / "results.csv"
  ).read_bytes()
  reference = _rows(tmp_path / "one")
  _check_death_and_resume(tmp_path, (), reference, dead=0)
  _check_death_and_resume(tmp_path, (), reference, dead=1)


@pytest.mark.slow
def test_a_hung_peer_stops_the_survivor_within_two_minutes(tmp_path):
  """A peer that stops answering without dying (SIGSTOP) is caught by JAX's heartbeats
  (``--heartbeat_timeout``, 60 s by default) or by gloo's connection timeout."""
  workdir = tmp_path / "hung"
  procs = start(workdir)
  results = workdir / "results.csv"
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and procs[1].poll() is None:
    if results.exists() and results.read_text().count("\n") >= 5:
      break
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGSTOP)
  stopped = time.monotonic()
  runs = finish(procs, timeout=180, until=0)
  rc, _, err, end = runs[0]
  assert rc not in (0, None) and end is not None, err[-3000:]
  print(f"process 0 exited {end - stopped:.1f} s after process 1 stopped")
  assert end - stopped < 120
  assert "another task died" in err or "PeerFailedError" in err, err[-3000:]
  partial = _rows(workdir)
  assert len(partial) >= 4 and partial.index.is_unique
  again = processes(workdir)
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  assert len(_rows(workdir)) == 12 and _rows(workdir).index.is_unique


# --------------------------------------------------------------------------- calibration

# bit for bit: each row, batch or context computed whole by one process and gathered
CALIBRATION_EXACT = (
  "stats_query_mean_LHD",
  "stats_query_cov_LHDD",
  "duo_loss",
  "duo_sink_recent",
  "retrieval_heads_LG_kvpress_on_the_fly",
  "retrieval_heads_LG_distant_mass",
  "kvzip_context_T",
  "reconstruction_attn_LGT",
)
# measured differences on the quick config: Q-Filters 2e-7 (a one-row forward rounds its matmuls
# unlike the two-row one), the DuoAttention gates 6e-8 and distillation 6e-10 (the gradients
# summed across processes in another order)
CALIBRATION_CLOSE = ("qfilters_LGD", "retrieval_heads_LG_official", "duo_distill")


def _calibrate(workdir, flags=(), devices=2, **env):
  return [
    sys.executable,
    "-m",
    "experiments.calibrate",
    "--config=configs/calibrate.py:quick",
    f"--config.workdir={workdir}",
    *flags,
  ], _env(devices, **env)


@pytest.mark.slow
def test_calibration_over_two_processes_matches_one(tmp_path):
  start = time.monotonic()
  cmd, env = _calibrate(tmp_path / "one")
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  one_s = time.monotonic() - start
  port = _free_port()
  start = time.monotonic()
  procs = []
  for i in range(2):
    flags = [f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
    cmd, env = _calibrate(tmp_path / "two", flags)
    procs.append(
      subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
      )
    )
  runs = finish(procs, timeout=300)
  two_s = time.monotonic() - start
  print(f"calibration: one process {one_s:.1f} s, two processes {two_s:.1f} s")
  assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:] + runs[1][2][-3000:]
  assert "run directory:" in runs[0][1] and "run directory:" not in runs[1][1]
  one, two = (np.load(tmp_path / d / "calibration.npz") for d in ("one", "two"))
  assert sorted(one) == sorted(two) == sorted(CALIBRATION_EXACT + CALIBRATION_CLOSE)
  for key in CALIBRATION_EXACT:
    np.testing.assert_array_equal(two[key], one[key], err_msg=key)
  for key in CALIBRATION_CLOSE:
    np.testing.assert_allclose(two[key], one[key], rtol=0, atol=2e-6, err_msg=key)
  timings = json.loads((tmp_path / "two" / "timings.json").read_text())
  assert timings["processes"] == 2


# --------------------------------------------------------------------------- training: KVzap


def _launch(module, config, workdir, count=2, devices=2, **env) -> list[subprocess.Popen]:
  """Starts ``count`` processes of the entry point ``module`` (a free port for their
  coordinator); ``count=1`` starts a plain one-process run."""
  port = _free_port()
  procs = []
  for i in range(count):
    cmd = [sys.executable, "-m", module, f"--config={config}", f"--config.workdir={workdir}"]
    if count > 1:
      cmd += [f"--coordinator=localhost:{port}", f"--num_processes={count}", f"--process_id={i}"]
    procs.append(
      subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(devices, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
  return procs


def _surrogate(path) -> dict:
  with np.load(path) as f:
    return {k: f[k] for k in f.files if k != "meta_json"}


def _kvzap_reference(workdir) -> dict:
  """The one-process MLP on the targets a run saved (each part is computed whole by one process,
  so they are a one-process run's bit for bit)."""
  from configs import kvzap as kvzap_config
  from kvjax.model import kvzap

  c = kvzap_config.get_config("quick")
  parts = sorted((pathlib.Path(workdir) / "targets").glob("part_*.npz"))
  X = np.concatenate([np.load(p)["X"] for p in parts])
  y = np.concatenate([np.load(p)["y"] for p in parts])
  n_test = c.test_rows * c.n_tokens
  run = kvzap.train_mlp(
    X[n_test:],
    y[n_test:],
    hidden_dim=c.hidden_dim,
    max_epochs=c.max_epochs,
    lr=c.lr,
    batch_size=c.batch_size,
    weight_decay=c.weight_decay,
    valid_fraction=c.valid_fraction,
    seed=c.seed,
    on_epoch=lambda *a: None,
  )
  return {k: np.asarray(v) for k, v in run.surrogate.params.items()}


# measured on the quick config: the MLP's weights differ from a one-process run's by up to 2e-7
# (the gradients summed across processes in another order); the targets and the ridge are equal
MLP_ATOL = 2e-6


@pytest.mark.slow
def test_kvzap_killed_mid_training_resumes_to_the_one_process_result(tmp_path):
  workdir = tmp_path / "killed"
  start = time.monotonic()
  runs = finish(
    _launch("experiments.kvzap", "configs/kvzap.py:quick", workdir, KVJAX_FAULT_EXIT="1:1")
  )
  (rc0, _, err0, end0), (rc1, _, err1, end1) = runs
  assert rc1 == distributed.FAULT_EXIT_CODE, err1[-3000:]
  assert rc0 == distributed.PEER_FAILED_EXIT_CODE and "PeerFailedError" in err0, err0[-3000:]
  assert end0 - end1 < 120
  checkpoints = sorted(p.name for p in (workdir / "mlp_checkpoints").iterdir() if p.name.isdigit())
  assert checkpoints == ["1"] and not (workdir / "kvzap_mlp.npz").exists()
  again = finish(_launch("experiments.kvzap", "configs/kvzap.py:quick", workdir))
  print(f"kvzap: killed and resumed over two processes in {time.monotonic() - start:.1f} s")
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  assert "targets: contexts" not in again[0][1] + again[1][1]  # the saved parts are read
  assert "epoch 1/3" not in again[0][1] and "epoch 3/3" in again[0][1]  # from the checkpoint
  assert "run directory:" in again[0][1] and "run directory:" not in again[1][1]
  got = _surrogate(workdir / "kvzap_mlp.npz")
  reference = _kvzap_reference(workdir)
  assert sorted(got) == sorted(reference)
  for key, value in reference.items():
    np.testing.assert_allclose(got[key], value, rtol=0, atol=MLP_ATOL, err_msg=key)


@pytest.mark.slow
def test_kvzap_over_two_processes_matches_one_and_the_resumed_run(tmp_path):
  one = finish(_launch("experiments.kvzap", "configs/kvzap.py:quick", tmp_path / "one", count=1))
  two = finish(_launch("experiments.kvzap", "configs/kvzap.py:quick", tmp_path / "two"))
  assert [r[0] for r in one + two] == [0, 0, 0], [r[2][-2000:] for r in one + two]
  for name in ("part_00000.npz", "part_00006.npz"):
    a, b = (np.load(tmp_path / d / "targets" / name) for d in ("one", "two"))
    np.testing.assert_array_equal(a["X"], b["X"])
    np.testing.assert_array_equal(a["y"], b["y"])
  linear = [_surrogate(tmp_path / d / "kvzap_linear.npz") for d in ("one", "two")]
  for key in linear[0]:
    np.testing.assert_array_equal(linear[1][key], linear[0][key])
  mlp = [_surrogate(tmp_path / d / "kvzap_mlp.npz") for d in ("one", "two")]
  for key in mlp[0]:
    np.testing.assert_allclose(mlp[1][key], mlp[0][key], rtol=0, atol=MLP_ATOL, err_msg=key)
  workdir = tmp_path / "killed"
  finish(_launch("experiments.kvzap", "configs/kvzap.py:quick", workdir, KVJAX_FAULT_EXIT="0:2"))
  again = finish(_launch("experiments.kvzap", "configs/kvzap.py:quick", workdir))
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  resumed = _surrogate(workdir / "kvzap_mlp.npz")
  for key in mlp[1]:  # the same steps from the same checkpoint: bit for bit
    np.testing.assert_array_equal(resumed[key], mlp[1][key])


# --------------------------------------------------------------------------- training: Fast KVzip


@pytest.mark.slow
def test_fastkvzip_over_two_processes_matches_one_and_the_resumed_run(tmp_path):
  config = "configs/fastkvzip.py:quick"
  one = finish(_launch("experiments.fastkvzip", config, tmp_path / "one", count=1))
  two = finish(_launch("experiments.fastkvzip", config, tmp_path / "two"))
  assert [r[0] for r in one + two] == [0, 0, 0], [r[2][-2000:] for r in one + two]
  a, b = (np.load(tmp_path / d / "targets" / "part_00000.npz") for d in ("one", "two"))
  np.testing.assert_array_equal(a["X"], b["X"])
  np.testing.assert_array_equal(a["y"], b["y"])
  gates = [_surrogate(tmp_path / d / "fastkvzip_gates.npz") for d in ("one", "two")]
  for key in gates[0]:  # measured: up to 6e-7 (the gradients summed in another order)
    np.testing.assert_allclose(gates[1][key], gates[0][key], rtol=0, atol=MLP_ATOL, err_msg=key)
  workdir = tmp_path / "killed"
  killed = finish(_launch("experiments.fastkvzip", config, workdir, KVJAX_FAULT_EXIT="1:2"))
  assert [r[0] for r in killed] == [distributed.PEER_FAILED_EXIT_CODE, distributed.FAULT_EXIT_CODE]
  again = finish(_launch("experiments.fastkvzip", config, workdir))
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  resumed = _surrogate(workdir / "fastkvzip_gates.npz")
  for key in gates[1]:  # the same steps from the same checkpoint: bit for bit
    np.testing.assert_array_equal(resumed[key], gates[1][key])


# --------------------------------------------------------------------------- evaluation

EVAL = (
  "--config.lengths=(128,)",
  "--config.examples=2",
  "--config.budgets=(48,)",
  "--config.heatmap.policies=()",
)


def _eval(workdir, count=2, **env) -> list[subprocess.Popen]:
  """Starts ``count`` processes of a small evaluation (``:quick`` at 128 tokens: two tasks, the
  full cache and three policies), or one plain process."""
  port = _free_port()
  procs = []
  for i in range(count):
    cmd = [
      sys.executable,
      "-m",
      "experiments.eval",
      "--config=configs/eval.py:quick",
      f"--config.workdir={workdir}",
      *EVAL,
    ]
    if count > 1:
      cmd += [f"--coordinator=localhost:{port}", f"--num_processes={count}", f"--process_id={i}"]
    procs.append(
      subprocess.Popen(
        cmd, cwd=ROOT, env=_env(2, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
      )
    )
  return procs


def _eval_rows(workdir) -> pd.DataFrame:
  """``results.csv`` as written, without the timings (the one column that differs by run)."""
  table = pd.read_csv(pathlib.Path(workdir) / "results.csv", dtype=str)
  return table.drop(columns=["seconds"])


def _eval_reference(tmp_path) -> pd.DataFrame:
  (one,) = finish(_eval(tmp_path / "one", count=1), timeout=600)
  assert one[0] == 0, one[2][-3000:]
  return _eval_rows(tmp_path / "one")


@pytest.mark.slow  # CI: the sweep's two-process run and the evaluation's run-identity check
def test_evaluation_over_two_processes_matches_one(tmp_path):
  """The policies of each group split over two processes: ``results.csv`` equals a one-process
  run's (in order, but for ``seconds``) and ``tables.md`` too."""
  reference = _eval_reference(tmp_path)
  runs = finish(_eval(tmp_path / "two"), timeout=600)
  assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:] + runs[1][2][-3000:]
  assert "results:" in runs[0][1] and "results:" not in runs[1][1]
  pd.testing.assert_frame_equal(_eval_rows(tmp_path / "two"), reference)
  tables = (tmp_path / "one" / "tables.md").read_text()
  assert (tmp_path / "two" / "tables.md").read_text() == tables


@pytest.mark.slow
def test_an_evaluation_process_killed_stops_the_other_and_the_rerun_resumes(tmp_path):
  """A process killed after its first group stops the other within two minutes, and the rerun
  completes the rows, none repeated, equal to a one-process run's."""
  reference = _eval_reference(tmp_path)
  killed = tmp_path / "killed"
  runs = finish(_eval(killed, KVJAX_FAULT_EXIT="1:1"), timeout=600)
  (rc0, _, err0, end0), (rc1, _, err1, end1) = runs
  assert rc1 == distributed.FAULT_EXIT_CODE, err1[-3000:]
  assert rc0 == distributed.PEER_FAILED_EXIT_CODE, err0[-3000:]
  assert "PeerFailedError" in err0 and end0 - end1 < 120
  partial = _eval_rows(killed)
  assert 0 < len(partial) < len(reference)
  pd.testing.assert_frame_equal(partial, reference.iloc[: len(partial)])
  again = finish(_eval(killed), timeout=600)
  assert [r[0] for r in again] == [0, 0], again[0][2][-3000:] + again[1][2][-3000:]
  pd.testing.assert_frame_equal(_eval_rows(killed), reference)
