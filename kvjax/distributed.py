"""Several processes, one run: start-up, the primary process, gathers, broadcasts and failures.

On a TPU pod slice or a GPU cluster JAX runs one process per host (multi-controller): every
process runs the same program, sees every device of every process (``jax.devices()``) and holds
only its own shards. kvjax's entry points call :func:`maybe_initialize` first; it calls
``jax.distributed.initialize`` when the process runs under a cluster and does nothing otherwise,
so a one-process run is as before. Then:

* :func:`is_primary`: process 0 owns the run directory (its lock, claim, rows and checkpoints);
  the others compute and write nothing;
* :func:`put` places host data on a sharding that spans every process (each process fills its
  own shards), :func:`to_host` brings a result back whole to every process (gathering the
  shards of the others);
* :func:`on_primary` runs a step on process 0 alone (taking the lock, reading what is done) and
  hands its JSON-able result, or its error, to every process; :func:`broadcast_json` is the
  plain broadcast under it;
* :func:`share` splits a list of work (examples, batches) among the processes and
  :func:`gather_json` brings each process's JSON-able results (rows) to every process;
  :func:`gather_arrays` and :func:`gather_shares` do the same for numpy arrays, byte for byte;
* :func:`process_mesh` is a mesh of one device per process, for data parallelism over the
  processes (a global batch placed with :func:`put`, sharded over its axis);
* :func:`peers` turns a collective that failed because a peer died into
  :class:`PeerFailedError`, and :func:`fail_fast` makes an entry point exit at once on any error
  in a multi-process run instead of waiting on its peers;
* :func:`run_identity` and :func:`check_same`: before any work, every process checks that it
  holds the run identity of process 0 (the config, the code, the device count), and every
  process stops with a ``ValueError`` naming the fields that differ;
* :func:`fault_point` is the test-only fault injection (``KVJAX_FAULT_EXIT``).

JAX's heartbeats bound how long a dead or hung peer goes unnoticed: :data:`DEFAULTS` sets them so
that the survivors fail within a minute (JAX's own defaults allow several minutes). On CPU the
collectives between processes go through gloo, JAX's default. This module is a leaf: it imports
nothing else from kvjax.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = [
  "DEFAULTS",
  "ENV",
  "FAULT_ENV",
  "FAULT_EXIT_CODE",
  "MODES",
  "PEER_FAILED_EXIT_CODE",
  "PeerFailedError",
  "broadcast_json",
  "check_same",
  "cluster",
  "code_version",
  "fail_fast",
  "fault_point",
  "gather_arrays",
  "gather_json",
  "gather_shares",
  "is_primary",
  "maybe_initialize",
  "on_primary",
  "peers",
  "process_count",
  "process_mesh",
  "process_index",
  "put",
  "run_identity",
  "settings",
  "share",
  "start_diagnosis",
  "to_host",
]

MODES = ("auto", "on", "off")
# the settings and the environment variables read when a setting is not given
ENV = {
  "distributed": "KVJAX_DISTRIBUTED",
  "coordinator": "KVJAX_COORDINATOR",
  "num_processes": "KVJAX_NUM_PROCESSES",
  "process_id": "KVJAX_PROCESS_ID",
  "heartbeat_timeout": "KVJAX_HEARTBEAT_TIMEOUT",
  "initialization_timeout": "KVJAX_INITIALIZATION_TIMEOUT",
}
# JAX's defaults (100 s heartbeats, 300 s to connect) leave a survivor waiting for minutes on a
# peer that hangs without dying; a crashed peer is noticed at once by the collectives anyway.
# 60 s of missed heartbeats is long enough for a busy host (heartbeats come from a thread of
# their own, not blocked by compiles) and keeps every failure under two minutes.
DEFAULTS = {"distributed": "auto", "heartbeat_timeout": 60, "initialization_timeout": 120}
# an entry point that exits because a peer failed (fail_fast), and one killed by fault_point
PEER_FAILED_EXIT_CODE = 75
FAULT_EXIT_CODE = 17
FAULT_ENV = "KVJAX_FAULT_EXIT"


class PeerFailedError(RuntimeError):
  """A collective with the other processes failed: one of them died or lost its connection."""


# --------------------------------------------------------------------------- start-up


def _given(source, name: str):
  """The setting ``name`` of ``source`` (a mapping, a ConfigDict, absl's ``FLAGS`` or any object
  with attributes), or ``None`` when it has none."""
  if source is None:
    return None
  if isinstance(source, Mapping):
    return source.get(name)
  try:
    return getattr(source, name, None)
  except (AttributeError, KeyError):  # ConfigDicts raise either for a missing field
    return None


def _int_setting(name: str, value, low: int) -> int | None:
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  try:
    number = int(value)
    ok = not isinstance(value, bool) and number == float(value) and number >= low
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
  return number


def settings(config_or_flags=None) -> dict:
  """The distributed settings: each from ``config_or_flags`` when it sets it, else from its
  environment variable (:data:`ENV`), else its default (:data:`DEFAULTS`, or ``None``).

  Args:
    config_or_flags: ``None``, a mapping, a ConfigDict or absl's ``flags.FLAGS`` (after
      ``configs.common.define_distributed_flags()``), read for ``distributed`` (one of
      :data:`MODES`), ``coordinator`` (``host:port`` of process 0), ``num_processes``,
      ``process_id``, ``heartbeat_timeout`` and ``initialization_timeout`` (seconds).

  Returns:
    A dict of those six settings, validated (``ValueError`` naming the setting otherwise).
  """
  out = {}
  for name, env in ENV.items():
    value = _given(config_or_flags, name)
    if value is None or value == "":
      value = os.environ.get(env) or DEFAULTS.get(name)
    out[name] = value
  if out["distributed"] not in MODES:
    raise ValueError(f"distributed: expected one of {MODES}, got {out['distributed']!r}")
  if out["coordinator"] is not None:
    host, colon, port = str(out["coordinator"]).rpartition(":")
    if not colon or not host or not port.isdigit():
      raise ValueError(
        f"coordinator: expected host:port of process 0 (say localhost:12355), got "
        f"{out['coordinator']!r}"
      )
    out["coordinator"] = str(out["coordinator"])
  out["num_processes"] = _int_setting("num_processes", out["num_processes"], 1)
  out["process_id"] = _int_setting("process_id", out["process_id"], 0)
  out["heartbeat_timeout"] = _int_setting("heartbeat_timeout", out["heartbeat_timeout"], 1)
  out["initialization_timeout"] = _int_setting(
    "initialization_timeout", out["initialization_timeout"], 1
  )
  explicit = [out[k] is not None for k in ("coordinator", "num_processes", "process_id")]
  if any(explicit) and not all(explicit):
    given = {k: out[k] for k in ("coordinator", "num_processes", "process_id")}
    raise ValueError(
      f"coordinator, num_processes, process_id: got {given}; expected all three (an explicit "
      "cluster) or none (a detected one)"
    )
  if all(explicit) and not out["process_id"] < out["num_processes"]:
    raise ValueError(
      f"process_id: {out['process_id']} is not below num_processes={out['num_processes']}; "
      "expected 0 <= process_id < num_processes"
    )
  return out


def _count(text: str | None) -> int:
  try:
    return int(text or 0)
  except ValueError:
    return 0


def cluster(config_or_flags=None) -> str | None:
  """The cluster this process runs under, as :func:`maybe_initialize` sees it.

  Args:
    config_or_flags: as for :func:`settings`.

  Returns:
    ``"explicit"`` (coordinator, num_processes and process_id given), ``"slurm"`` (launched by
    ``srun`` with several tasks), ``"tpu"`` (a TPU slice of several workers naming its hosts:
    ``TPU_WORKER_HOSTNAMES`` or ``TPU_PROCESS_ADDRESSES``), ``"mpi"`` (``mpirun`` of Open MPI
    with several ranks), ``"on"`` (``distributed="on"``: JAX detects the rest, a Cloud TPU VM's
    metadata included), or ``None`` (one process; also for ``distributed="off"``).
  """
  s = settings(config_or_flags)
  if s["distributed"] == "off":
    return None
  if s["coordinator"] is not None:
    return "explicit"
  env = os.environ
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
  if all(k in env for k in slurm) and _count(env.get("SLURM_NTASKS")) > 1:
    return "slurm"
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  if len([h for h in hosts.split(",") if h.strip()]) > 1:
    return "tpu"
  if _count(env.get("OMPI_COMM_WORLD_SIZE")) > 1:
    return "mpi"
  return "on" if s["distributed"] == "on" else None


def maybe_initialize(config_or_flags=None) -> bool:
  """Calls ``jax.distributed.initialize`` when this process runs under a cluster (:func:`cluster`);
  does nothing in a one-process run. Call it first, before anything runs on a device.

  A process that does not see every peer within ``initialization_timeout`` is stopped by JAX's
  runtime (an abort, not an exception, saying "another task died"); just before, this prints
  :func:`start_diagnosis`: the settings it was started with and that a peer never registered.

  Args:
    config_or_flags: as for :func:`settings`; the heartbeat and connection timeouts apply to
      every cluster.

  Returns:
    Whether JAX's distributed runtime is initialised (by this call or an earlier one).

  Raises:
    ValueError: for settings :func:`settings` refuses (a ``process_id`` outside
      ``[0, num_processes)`` among them), before anything connects.
  """
  if jax.distributed.is_initialized():
    return True
  s = settings(config_or_flags)
  found = cluster(config_or_flags)
  if found is None:
    return False
  kwargs = dict(
    heartbeat_timeout_seconds=s["heartbeat_timeout"],
    initialization_timeout=s["initialization_timeout"],
  )
  if found == "explicit":
    kwargs |= dict(
      coordinator_address=s["coordinator"],
      num_processes=s["num_processes"],
      process_id=s["process_id"],
    )
  # said first: a peer that never joins makes JAX's runtime abort this process after the
  # timeout with only "Deadline Exceeded"
  where = f" at {s['coordinator']}" if found == "explicit" else ""
  who = f"process {s['process_id']} of {s['num_processes']}" if found == "explicit" else "a process"
  print(
    f"kvjax.distributed: {who} joining the {found} cluster{where}; waiting up to "
    f"{s['initialization_timeout']} s for every process",
    file=sys.stderr,
    flush=True,
  )
  # JAX aborts the process at the deadline (no exception to catch), saying "another task died":
  # just before it, say what kvjax knows (JAX's call releases the GIL, so the timer runs)
  timeout = s["initialization_timeout"]
  watchdog = threading.Timer(
    max(timeout - min(5.0, timeout / 10), 0.0),
    lambda: print(start_diagnosis(found, s, config_or_flags), file=sys.stderr, flush=True),
  )
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    watchdog.cancel()
  return True


def _origin(config_or_flags, name: str) -> str:
  """Where a setting came from: the flags or config, the environment, or the default."""
  if _given(config_or_flags, name) not in (None, ""):
    return "flag"
  return f"${ENV[name]}" if os.environ.get(ENV[name]) else "default"


def start_diagnosis(found: str, s: dict, config_or_flags=None) -> str:
  """What kvjax knows when the processes of a cluster have not all joined by the deadline: the
  settings this process was started with (and where each came from), and that a peer never
  registered with the coordinator.

  Args:
    found: the cluster (:func:`cluster`).
    s: the settings (:func:`settings`).
    config_or_flags: as for :func:`settings`, to say where each setting came from.

  Returns:
    The message :func:`maybe_initialize` prints just before JAX's runtime stops the process.
  """
  timeout = s["initialization_timeout"]
  if found != "explicit":
    return (
      f"kvjax.distributed: not every process of the {found} cluster joined within {timeout} s: "
      "some process never registered with the coordinator (not started, started with other "
      "settings, or unable to reach process 0); JAX's runtime stops this process now ('another "
      "task died', 'Deadline Exceeded')"
    )
  started = ", ".join(
    f"{k}={s[k]} ({_origin(config_or_flags, k)})"
    for k in ("coordinator", "num_processes", "process_id")
  )
  return (
    f"kvjax.distributed: process {s['process_id']} of {s['num_processes']} has not seen every "
    f"process at {s['coordinator']} within {timeout} s: some process_id in "
    f"[0, {s['num_processes']}) never registered (a process not started, two started with the "
    f"same process_id, one given another num_processes or coordinator, or process 0 "
    f"unreachable). This process was started with {started}; expected one process per "
    f"process_id. JAX's runtime stops this process now ('another task died', "
    "'Deadline Exceeded')"
  )


# --------------------------------------------------------------------------- who is who


def process_count() -> int:
  """The number of JAX processes of this run (1 without a cluster).

  Returns:
    ``jax.process_count()``.
  """
  return jax.process_count()


def process_index() -> int:
  """This process's index (0 without a cluster).

  Returns:
    ``jax.process_index()``.
  """
  return jax.process_index()


def is_primary() -> bool:
  """Whether this is process 0, the one that owns the run directory.

  Returns:
    ``True`` in a one-process run.
  """
  return jax.process_index() == 0


# --------------------------------------------------------------------------- data across processes


@contextlib.contextmanager
def peers(what: str) -> Iterator[None]:
  """Turns a runtime error of the block, in a run of several processes, into
  :class:`PeerFailedError` naming ``what`` was under way (a collective whose peer died fails
  with a transport error such as gloo's "Connection reset by peer").

  Args:
    what: what the block does, for the message ("gathering a sweep chunk").

  Yields:
    Nothing.
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if process_count() == 1:
      raise
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise PeerFailedError(
      f"process {process_index()} of {process_count()}: {what} failed ({first}); another "
      "process most likely died (see its log). What was written so far is kept: rerun the same "
      "command on every process to resume"
    ) from e


def _host_value(x) -> np.ndarray:
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  if x.is_fully_replicated:  # every process holds a whole copy: no collective needed
    return np.asarray(x.addressable_data(0))
  return multihost_utils.process_allgather(x, tiled=True)


def to_host(tree, what: str = "gathering results"):
  """``tree``'s arrays as whole numpy arrays on every process: shards held by other processes
  are gathered (a collective: every process must call it, in the same order).

  Args:
    tree: a pytree of ``jax.Array``\\ s (any sharding) or numpy values.
    what: what is gathered, for :class:`PeerFailedError`'s message.

  Returns:
    The same pytree of numpy arrays (``jax.device_get`` in a one-process run).
  """
  with peers(what):
    return jax.tree.map(_host_value, tree)


def put(tree, sharding):
  """Places ``tree``'s host values (the same on every process) on ``sharding``; each process
  fills the shards it holds, so a sharding over every process's devices works too.

  Args:
    tree: a pytree of numpy arrays (or arrays ``np.asarray`` reads).
    sharding: a ``jax.sharding.Sharding``, or ``None`` to leave ``tree`` as it is.

  Returns:
    The pytree of ``jax.Array``\\ s.
  """
  if sharding is None:
    return tree
  if sharding.is_fully_addressable:
    return jax.device_put(tree, sharding)

  def place(x):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(place, tree)


def broadcast_json(value, what: str = "broadcasting from process 0"):
  """Process 0's ``value`` on every process (a collective: every process calls it).

  Args:
    value: a JSON-able value on process 0 (ignored on the others).
    what: what is broadcast, for :class:`PeerFailedError`'s message.

  Returns:
    Process 0's ``value`` (``value`` itself in a one-process run).
  """
  if process_count() == 1:
    return value
  data = json.dumps(value).encode() if is_primary() else b""
  with peers(what):
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buffer = np.zeros(size, np.uint8)
    if is_primary():
      buffer[:] = np.frombuffer(data, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer)
  return json.loads(np.asarray(buffer, np.uint8).tobytes().decode())


def gather_json(value, what: str = "gathering from every process") -> list:
  """Every process's ``value``, on every process (a collective: every process calls it).

  Args:
    value: a JSON-able value (rows as dicts, say), different on each process.
    what: what is gathered, for :class:`PeerFailedError`'s message.

  Returns:
    The list of the values in process order (``[value]`` in a one-process run).
  """
  if process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  with peers(what):
    sizes = multihost_utils.process_allgather(np.int32(len(data)))
    buffer = np.zeros(int(np.max(sizes)), np.uint8)
    buffer[: len(data)] = data
    everyone = multihost_utils.process_allgather(buffer)
  return [
    json.loads(np.asarray(row[: int(size)], np.uint8).tobytes().decode())
    for row, size in zip(everyone, np.ravel(sizes), strict=True)
  ]


def share(items) -> list[int]:
  """The indices of ``items`` this process takes when the processes split them (round robin:
  process ``i`` of ``n`` takes ``i, i + n, ...``); :func:`gather_json` then brings the results
  back in process order, and sorting them by index restores the one-process order.

  Args:
    items: a sequence (examples, batches, configurations), the same on every process.

  Returns:
    This process's indices (every index in a one-process run).
  """
  return list(range(process_index(), len(items), process_count()))


def gather_arrays(value, what: str = "gathering arrays") -> list[np.ndarray]:
  """Every process's numpy array, on every process, bit for bit (a collective: every process
  calls it). The arrays travel as bytes, so float64 stays float64 (JAX's own gathers would
  cast it to float32 without ``jax_enable_x64``).

  Args:
    value: an array (``np.asarray`` reads it); shapes and dtypes may differ between processes.
    what: what is gathered, for :class:`PeerFailedError`'s message.

  Returns:
    The list of the arrays in process order (``[value]`` in a one-process run).
  """
  value = np.ascontiguousarray(np.asarray(value))
  if process_count() == 1:
    return [value]
  specs = gather_json([list(value.shape), value.dtype.str], what)
  data = value.reshape(-1).view(np.uint8)
  sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in specs]
  buffer = np.zeros(max(max(sizes), 1), np.uint8)
  buffer[: data.size] = data
  with peers(what):
    everyone = np.asarray(multihost_utils.process_allgather(buffer))
  return [
    row[:size].view(np.dtype(dt)).reshape(shape)
    for row, size, (shape, dt) in zip(everyone, sizes, specs, strict=True)
  ]


def gather_shares(values, count: int, what: str = "gathering shares") -> list[np.ndarray]:
  """The results of a list of ``count`` items split by :func:`share`, on every process in the
  items' order, bit for bit: what a one-process run computes item by item.

  Args:
    values: this process's result arrays, one per index of ``share(range(count))``, in order.
    count: the number of items.
    what: what is gathered, for :class:`PeerFailedError`'s message.

  Returns:
    The ``count`` arrays in item order (``values`` as arrays in a one-process run).

  Raises:
    ValueError: when ``values`` does not hold one array per index of this process's share.
  """
  values = [np.asarray(v) for v in values]
  mine = share(range(count))
  if len(values) != len(mine):
    raise ValueError(
      f"values: got {len(values)} arrays; expected {len(mine)}, one per item of this "
      f"process's share of {count}"
    )
  if process_count() == 1:
    return values
  parts = gather_json([[list(v.shape), v.dtype.str] for v in values], what)
  flat = np.concatenate(
    [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in values] or [np.zeros(0, np.uint8)]
  )
  everyone = gather_arrays(flat, what)
  out = [None] * count
  for p, (specs, data) in enumerate(zip(parts, everyone, strict=True)):
    offset = 0
    for j, (shape, dt) in enumerate(specs):
      size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
      out[p + j * process_count()] = data[offset : offset + size].view(np.dtype(dt)).reshape(shape)
      offset += size
  return out


def process_mesh(axis: str = "processes"):
  """A one-axis mesh of the first device of every process, in process order: a global batch
  sharded over it (:func:`put`) gives each process one slice, and a jitted step over it reduces
  across the processes (its gradients averaged by the collective XLA inserts).

  Args:
    axis: the mesh axis's name.

  Returns:
    A ``jax.sharding.Mesh`` of ``process_count()`` devices (one device in a one-process run).
  """
  first = {}
  for d in jax.devices():
    first.setdefault(d.process_index, d)
  return jax.sharding.Mesh(np.asarray([first[p] for p in sorted(first)]), (axis,))


def on_primary(fn: Callable[[], object], what: str):
  """Runs ``fn`` on process 0 alone and hands its result, or its error, to every process.

  Args:
    fn: a function of no arguments returning a JSON-able value (it may hold a lock or write
      files: only process 0 runs it).
    what: what ``fn`` does, for the other processes' error message.

  Returns:
    ``fn()``'s value, on every process. When ``fn`` raises, process 0 raises that error and the
    others a ``RuntimeError`` quoting it, so that every process stops instead of waiting for the
    next collective.
  """
  if process_count() == 1:
    return fn()
  result, error = None, None
  if is_primary():
    try:
      result = fn()
    except Exception as e:
      error = e
  payload = {
    "result": result,
    "error": None if error is None else f"{type(error).__name__}: {error}",
  }
  shared = broadcast_json(payload if is_primary() else None, what)
  if error is not None:
    raise error
  if shared["error"] is not None:
    raise RuntimeError(f"process {process_index()}: process 0 failed {what}: {shared['error']}")
  return shared["result"]


# --------------------------------------------------------------------------- one run identity


@functools.cache
def code_version() -> str:
  """What identifies the code a process runs: kvjax's version and a SHA-256 of its sources
  (every ``.py`` file of the package, by relative path), so that two hosts with different
  checkouts of one version differ too.

  Returns:
    ``"<version>+<first 16 hex digits>"``.
  """
  from importlib import metadata

  try:
    version = metadata.version("kvjax")
  except metadata.PackageNotFoundError:
    version = "unknown"
  root = pathlib.Path(__file__).resolve().parent
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode() + b"\0")
    digest.update(path.read_bytes())
  return f"{version}+{digest.hexdigest()[:16]}"


def run_identity(config, *, devices: int | None = None) -> dict:
  """A run's identity, for :func:`check_same` and for a run directory's claim: the config, the
  code (:func:`code_version`) and, where results depend on it, the device count.

  Args:
    config: the JSON-able part of the config every process must share (a dict; the settings
      a process may hold of its own, such as its workdir or compilation cache, left out).
    devices: the device count the results depend on (``None``: results do not).

  Returns:
    ``{"config": ..., "code": ..., "devices": ...}`` (``devices`` only when given).
  """
  out = {"config": json.loads(json.dumps(config, sort_keys=True, default=str))}
  out["code"] = code_version()
  if devices is not None:
    out["devices"] = int(devices)
  return out


def _differences(mine, theirs, path: str = "") -> list[str]:
  """The dotted paths at which two JSON values differ (a list of another length, or a field
  only one holds, is one difference)."""
  if isinstance(mine, dict) and isinstance(theirs, dict):
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
      where = f"{path}.{key}" if path else str(key)
      if key not in mine or key not in theirs:
        out.append(where)
      else:
        out += _differences(mine[key], theirs[key], where)
    return out
  if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
    out = []
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
      out += _differences(a, b, f"{path}[{i}]")
    return out
  return [] if mine == theirs else [path or "(the whole identity)"]


def _at(value, path: str):
  for part in path.replace("[", ".[").split("."):
    if not part:
      continue
    try:
      value = value[int(part[1:-1])] if part.startswith("[") else value[part]
    except (KeyError, IndexError, TypeError, ValueError):
      return "(absent)"
  return value


def check_same(identity: dict, what: str = "run") -> None:
  """Checks, before any work, that every process holds process 0's run identity (one
  collective: every process calls it, with its own ``identity``).

  Processes started with different configs (a grid of another budget, another seed) would
  otherwise compute on different inputs and process 0 would write the others' results under
  its own; a grid of another size would fail later with an unrelated error.

  Args:
    identity: this process's :func:`run_identity` (any JSON-able dict).
    what: what is run, for the message ("sweep", "evaluation").

  Raises:
    ValueError: on every process, when some process's identity differs from process 0's,
      naming the processes and the fields (dotted paths) with both values.
  """
  if process_count() == 1:
    return
  everyone = gather_json(identity, f"comparing the {what}'s identity of every process")
  first = everyone[0]
  for p, other in enumerate(everyone[1:], start=1):
    differ = _differences(first, other)
    if not differ:
      continue
    shown = "; ".join(
      f"{field}: process 0 {_at(first, field)!r:.80}, process {p} {_at(other, field)!r:.80}"
      for field in differ[:5]
    )
    more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
    raise ValueError(
      f"{differ[0]}: process {p} of {len(everyone)} holds another {what} identity than process "
      f"0, differing in {differ}{more} ({shown}); expected every process started with the same "
      "config, code and devices: nothing was computed or written"
    )


# --------------------------------------------------------------------------- failures


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
  """For an entry point's ``main``: in a run of several processes, an error escaping the block
  is printed and the process exits at once (``os._exit``), with :data:`PEER_FAILED_EXIT_CODE`
  for :class:`PeerFailedError` and 1 otherwise. A normal exit waits at JAX's shutdown barrier for
  every peer, and a peer blocked in a collective with this process would hold it there for
  minutes; exiting at once breaks that collective, so the peers fail within seconds too. Files
  written with ``fsync`` (rows, claims) are complete; the kernel releases the run directory's
  lock. In a one-process run errors propagate as usual.

  Yields:
    Nothing.
  """
  try:
    yield
  except (Exception, KeyboardInterrupt) as e:
    if not jax.distributed.is_initialized() or process_count() == 1:
      raise
    traceback.print_exc()
    print(f"process {process_index()}: exiting after {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_FAILED_EXIT_CODE if isinstance(e, PeerFailedError) else 1)


_fault_calls = [0]


def fault_point() -> None:
  """Test-only fault injection: with ``KVJAX_FAULT_EXIT=P:N`` in the environment, process ``P``
  exits abruptly (``os._exit(FAULT_EXIT_CODE)``, no clean-up, as a crash) at its ``N``-th call.
  The sweep calls it after each chunk's rows; unset, it does nothing.

  Raises:
    ValueError: ``KVJAX_FAULT_EXIT`` is set but not ``P:N``.
  """
  text = os.environ.get(FAULT_ENV)
  if not text:
    return
  target, colon, count = text.partition(":")
  if not (colon and target.isdigit() and count.isdigit() and int(count) >= 1):
    raise ValueError(f"{FAULT_ENV}: expected PROCESS:CALLS (say 1:2), got {text!r}")
  _fault_calls[0] += 1
  if int(target) == process_index() and _fault_calls[0] >= int(count):
    print(f"process {process_index()}: {FAULT_ENV}={text}: exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(FAULT_EXIT_CODE)
