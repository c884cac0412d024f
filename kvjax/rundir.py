"""Run directories: one configuration per directory, one run at a time, rows that survive a kill.

Sweeps, evaluations and training runs all write into a run directory and resume from it. This
module is the one place that knows how:

* :func:`lock` holds an exclusive ``fcntl.flock`` on ``workdir/.rundir.lock`` for a whole run,
  so that a second run into the same directory refuses (or waits) instead of duplicating rows;
* :func:`check_workdir` refuses an empty workdir and one that is a file, before anything;
* :func:`claim` records what a directory holds (its configuration, as JSON) and refuses a
  different configuration, and results that no claim records;
* :func:`append_rows` adds CSV rows durably: one ``write`` per call, ``fsync``'d, the header
  written once, into a file whose first line must be that header;
* :func:`read_rows` reads the valid rows back: a line cut by a kill, a line with the wrong number
  of fields, a repeated header, a row whose required values are missing or not finite numbers,
  and (given a ``key``) a repeated row are all dropped; :func:`repair_rows` also rewrites the
  file without them, so that their configurations run again. Only a file that starts with the
  header (or, cut by a kill, with a prefix of it) is ever repaired: anything else is refused;
* :func:`read_jsonl` does the same for JSON-lines logs;
* :func:`restore_checkpoint` restores a saved step of a run's checkpoints, and names the step and
  its directory when its files are damaged (not the checkpoint library's traceback);
* :func:`enable_compilation_cache` keeps a run's compiled programs across processes (JAX's
  persistent compilation cache), for sweeps and evaluations alike.

A run holds the lock while it writes; readers (notebooks, plots) need no lock: :func:`read_rows`
never modifies the file. Fields must not contain line breaks (one row is one line). It imports
nothing else from kvjax.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import math
import os
import pathlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import jax
import ml_collections
import pandas as pd

LOCK_NAME = ".rundir.lock"
T = TypeVar("T")


def plain(value):
  """A JSON-able copy of a config value (ConfigDicts, and lists of them, become dicts)."""
  if isinstance(value, ml_collections.ConfigDict):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, dict):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [plain(v) for v in value]
  return value


def signature(value) -> str:
  """The canonical text of a configuration (sorted keys; sequences as lists)."""
  return json.dumps(plain(value), sort_keys=True, indent=1, default=str)


# --------------------------------------------------------------------------- the directory


def check_workdir(workdir, name: str = "workdir") -> pathlib.Path:
  """``workdir`` as a ``pathlib.Path``, after refusing what cannot be a run directory.

  ``ValueError`` naming ``name`` for a value that is not a path, an empty (or blank) path and a
  path that exists but is not a directory. An empty workdir is refused, the same way by every
  entry point (evaluation, sweep, lab, training, calibration): ``pathlib.Path("")`` is the
  current directory, while an empty field could as well mean "the default"; neither reading is
  what every user means, so none is guessed. Leave the field unset for an entry point's
  default, or pass ``"."`` for the current directory.
  """
  if isinstance(workdir, bool) or not isinstance(workdir, str | os.PathLike):
    raise ValueError(f"{name}: expected a directory path, got {workdir!r}")
  text = os.fspath(workdir)
  if not isinstance(text, str) or not text.strip():
    raise ValueError(
      f"{name}: got the empty path {text!r}; expected a directory (unset for the default, "
      "'.' for the current directory)"
    )
  out = pathlib.Path(text)
  if out.exists() and not out.is_dir():
    raise ValueError(f"{name}: {out} is a file; expected a directory (or a path to create)")
  return out


def _make_workdir(workdir) -> pathlib.Path:
  """:func:`check_workdir`, then creates it (``ValueError`` naming it when that fails, say under
  a parent that is a file)."""
  out = check_workdir(workdir)
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"workdir: cannot create the directory {out} ({e}); expected one") from None
  return out


def _not_a_directory(path: pathlib.Path, what: str) -> None:
  if path.is_dir():
    raise ValueError(
      f"path: {path} is a directory; expected {what} there (move the directory away)"
    )


def holds_data(path: str | pathlib.Path) -> bool:
  """Whether ``path`` holds anything: a non-empty file, or a directory with an entry. What a run
  directory's results count as for :func:`claim` (a torn or invalid line is data too: only the
  run that wrote it may drop it)."""
  path = pathlib.Path(path)
  if path.is_dir():
    return any(path.iterdir())
  return path.is_file() and path.stat().st_size > 0


# --------------------------------------------------------------------------- one run at a time


class WorkdirLockedError(RuntimeError):
  """Another run holds the run directory's lock."""


_held: dict[str, int] = {}  # resolved workdir -> nesting depth of this process's lock


def _holder(path: pathlib.Path) -> str:
  try:
    text = path.read_text().split()
  except OSError:
    text = []
  if not text:
    return "pid unknown"
  return f"pid {text[0]}" + (f" on {text[1]}" if len(text) > 1 else "")


@contextlib.contextmanager
def lock(workdir: str | pathlib.Path, *, timeout: float = 0.0) -> Iterator[pathlib.Path]:
  """Holds the exclusive lock of ``workdir`` (created if needed) for the ``with`` block.

  ``with rundir.lock(workdir):`` around a whole run makes it the only writer of that directory:
  a second run refuses with :class:`WorkdirLockedError` (a ``RuntimeError`` naming the directory and
  the holder's pid) after waiting up to ``timeout`` seconds (default: refuse at once). The lock
  is an ``fcntl.flock`` on ``workdir/.rundir.lock``, released by the kernel when its holder
  exits, even by ``SIGKILL``, so a killed run never leaves a stale lock. Nested ``lock`` calls of
  one process on one directory are re-entrant. Yields the directory as a ``pathlib.Path``.
  """
  import fcntl  # POSIX only; imported here so that reading run directories works everywhere

  if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
    raise ValueError(f"timeout: expected a number of seconds >= 0, got {timeout!r}")
  out = _make_workdir(workdir)
  key = str(out.resolve())
  if key in _held:
    _held[key] += 1
    try:
      yield out
    finally:
      _held[key] -= 1
    return
  path = out / LOCK_NAME
  _not_a_directory(path, "the run's lock file")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    deadline = time.monotonic() + timeout
    while True:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        if time.monotonic() >= deadline:
          raise WorkdirLockedError(
            f"workdir: {out} is in use by another run ({_holder(path)}, lock file {path}); "
            "expected one run per workdir: wait for it to finish, or use another workdir"
          ) from None
        time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[key] = 1
    try:
      yield out
    finally:
      del _held[key]
      os.ftruncate(fd, 0)
      fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
  """Writes ``data`` beside ``path``, ``fsync``'s it and renames it over ``path``."""
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(path.parent)


def read_claim(path: str | pathlib.Path) -> dict | None:
  """The configuration a claim file records (``None`` when there is none).

  ``ValueError`` naming the path when it is a directory or not a JSON object (a file kvjax did not
  write: claims are written atomically, so a kill never leaves half of one)."""
  path = pathlib.Path(path)
  if not path.exists():
    return None
  _not_a_directory(path, "a claim file (JSON)")
  try:
    record = json.loads(path.read_bytes().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    record = None
  if not isinstance(record, dict):
    raise ValueError(
      f"path: {path} is not a claim file (a JSON object of the run's configuration, as kvjax "
      "writes it); expected one: move it away and use a fresh workdir"
    )
  return record


def _differing(old: dict, new: dict, ignore: Sequence[str]) -> list[str]:
  """The top-level fields, outside ``ignore``, whose values differ (or that only one holds)."""
  keys = (set(old) | set(new)) - set(ignore)
  return sorted(k for k in keys if k not in old or k not in new or old[k] != new[k])


def claim(
  workdir: str | pathlib.Path,
  name: str,
  text: str,
  *,
  has_results: bool,
  not_identity: Sequence[str] = (),
) -> pathlib.Path:
  """Creates ``workdir`` and records ``text`` (a :func:`signature`: a JSON object) in
  ``workdir/name``, the directory's claim.

  A run directory resumes only the run it holds. ``has_results`` says whether the directory
  holds results (:func:`holds_data` of its results); then ``ValueError`` when:

  * the claim is missing: results that no claim describes are never adopted (they may be another
    configuration's, or another seed's);
  * the claim differs from ``text`` in a field outside ``not_identity`` (the fields that change
    no result, such as batch sizes or caches: they may change between a run and its resume).

  Without results a different (corrected) configuration takes the directory over. A claim file
  that is not a JSON object is refused (:func:`read_claim`). The record is rewritten with
  ``text`` when it differs (so it always holds the last run's settings), atomically.
  """
  out = _make_workdir(workdir)
  path = out / name
  old_record = read_claim(path)
  try:
    new_record = json.loads(text)
  except json.JSONDecodeError:
    new_record = None
  if not isinstance(new_record, dict):
    raise ValueError(f"text: expected the signature() of a config (a JSON object), got {text!r}")
  if has_results and old_record is None:
    raise ValueError(
      f"workdir: {out} holds results but no {name} recording their configuration; expected a "
      "run directory claimed by kvjax (results are never adopted without one): use a fresh "
      "workdir, or restore the run's own claim file"
    )
  differ = [] if old_record is None else _differing(old_record, new_record, not_identity)
  if has_results and differ:
    raise ValueError(
      f"workdir: {out} holds a run of a different configuration ({name} differs in {differ}); "
      "expected the same config to resume, or a fresh workdir"
    )
  if old_record is None or path.read_text() != text:
    _write_atomic(path, text.encode())
  return out


# --------------------------------------------------------------------------- CSV rows


def _fields(line: str) -> list[str] | None:
  """The CSV fields of one line, or ``None`` when it is not well-formed CSV (an unterminated
  quote would make pandas swallow the following lines)."""
  try:
    return next(csv.reader([line], strict=True))
  except (csv.Error, StopIteration):
    return None


def _is_number(text: str) -> bool:
  try:
    return math.isfinite(float(text))
  except ValueError:
    return False


def _is_header_prefix(data: bytes, columns: Sequence[str] | None) -> bool:
  """Whether ``data`` (a file without a complete line) can be a header cut by a kill.

  With the expected ``columns``: its fields are distinct columns, the last one possibly cut, in
  any order. Without them (a reader that does not know the whole header), any one line of
  printable UTF-8 text passes; the writer (:func:`append_rows`), which knows the columns, still
  checks before it cuts anything."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    return False
  if not text.isprintable():
    return False
  if columns is None:
    return True
  names = [str(c) for c in columns]
  *whole, last = text.split(",")
  if len(set(whole)) < len(whole) or not set(whole) <= set(names):
    return False
  return any(c.startswith(last) for c in names if c not in whole)


def _complete_lines(path: pathlib.Path) -> tuple[list[str], bool]:
  """The file's complete lines (without their newlines) and whether a torn last line followed."""
  data = path.read_bytes()
  end = data.rfind(b"\n") + 1
  text = data[:end].decode("utf-8", errors="replace")
  return text.split("\n")[:-1], end != len(data)


def _scan(
  path: pathlib.Path,
  dtype,
  *,
  required: Sequence[str] = (),
  numeric: Sequence[str] = (),
  key: str | None = None,
  columns: Sequence[str] | None = None,
) -> tuple[pd.DataFrame, list[str], int]:
  """``(table, kept lines with the header first, number of dropped lines)``."""
  if not path.exists():
    return pd.DataFrame(), [], 0
  _not_a_directory(path, "a CSV results file")
  lines, torn = _complete_lines(path)
  if not lines:
    if torn and not _is_header_prefix(path.read_bytes(), columns):
      raise ValueError(
        f"path: {path} holds no line and does not start like the header of these results "
        f"{list(columns) if columns else ''}; expected a CSV results file (refused, never "
        "rewritten: move it away or use a fresh workdir)"
      )
    return pd.DataFrame(), [], int(torn)
  header, found = lines[0], _fields(lines[0]) or []
  if columns is not None and sorted(found) != sorted(str(c) for c in columns):
    raise ValueError(
      f"path: {path} has the columns {found}, expected {list(columns)} (its first line must be "
      "the header of these results, written by this kvjax version); use a fresh workdir"
    )
  missing = [c for c in (*required, *numeric, *([key] if key else [])) if c not in found]
  if missing or not lines[0].strip():
    raise ValueError(
      f"path: {path} has the columns {found}, expected {missing} too (its first line must be "
      "the header of these results); use a fresh workdir"
    )
  texts = [found.index(c) for c in required]
  numbers = [found.index(c) for c in numeric]
  key_at = found.index(key) if key else None
  kept, seen = [header], set()
  for line in lines[1:]:
    fields = _fields(line)
    if line == header or fields is None or len(fields) != len(found):
      continue
    if any(not fields[i].strip() for i in texts) or not all(_is_number(fields[i]) for i in numbers):
      continue
    if key_at is not None:
      if fields[key_at] in seen:
        continue
      seen.add(fields[key_at])
    kept.append(line)
  dropped = len(lines) - len(kept) + torn
  table = pd.read_csv(io.StringIO("\n".join(kept) + "\n"), dtype=dtype)
  return table, kept, dropped


def read_rows(
  path: str | pathlib.Path,
  dtype: dict | None = None,
  *,
  required: Sequence[str] = (),
  numeric: Sequence[str] = (),
  key: str | None = None,
  columns: Sequence[str] | None = None,
) -> pd.DataFrame:
  """The valid rows of a CSV results file (empty when there is none); never modifies the file.

  Dropped, so that their configurations run again: a last line cut by a kill, a line with the
  wrong number of fields (a row cut in the middle of the file), a repeated header line, a row
  with an empty ``required`` column, or with a ``numeric`` column that is not a finite number
  (missing, unparsable, NaN or inf). With ``key`` (a column), only the first row of each key is
  kept. ``columns``: the whole header expected (in any order). ``ValueError`` when the first
  line is not a header holding those columns, when a file without a complete line is not a
  prefix of a header (binary data, say), and when ``path`` is a directory.
  """
  checks = dict(required=required, numeric=numeric, key=key, columns=columns)
  return _scan(pathlib.Path(path), dtype, **checks)[0]


def repair_rows(
  path: str | pathlib.Path, dtype: dict | None = None, **checks
) -> tuple[pd.DataFrame, int]:
  """:func:`read_rows` (``checks``: its ``required``, ``numeric``, ``key`` and ``columns``),
  then rewrites the file atomically without the dropped lines (when there are any): ``(table,
  number of dropped lines)``. Hold the directory's :func:`lock`. A file without a complete line
  is left to :func:`append_rows`, which cuts it only when it is a prefix of the header it
  writes."""
  path = pathlib.Path(path)
  table, kept, dropped = _scan(path, dtype, **checks)
  if dropped and kept:
    _write_atomic(path, "".join(line + "\n" for line in kept).encode())
  return table, dropped


def _first_line(fd: int) -> bytes | None:
  """The file's first line with its newline, or ``None`` when it has no complete line."""
  chunks, offset = [], 0
  while True:
    chunk = os.pread(fd, 65536, offset)
    if not chunk:
      return None
    cut = chunk.find(b"\n")
    if cut >= 0:
      chunks.append(chunk[: cut + 1])
      return b"".join(chunks)
    chunks.append(chunk)
    offset += len(chunk)


def _cut_torn_tail(fd: int, size: int) -> int:
  """Truncates a last line that lacks its newline (a write cut by a kill); the new size."""
  end = size
  while end > 0:
    start = max(0, end - 65536)
    chunk = os.pread(fd, end - start, start)
    cut = chunk.rfind(b"\n")
    if cut >= 0:
      new_size = start + cut + 1
      break
    end = start
  else:
    new_size = 0
  if new_size != size:
    os.ftruncate(fd, new_size)
  return new_size


def _check_no_line_breaks(table: pd.DataFrame) -> None:
  for column in table.columns:
    for value in table[column]:
      if isinstance(value, str) and ("\n" in value or "\r" in value):
        raise ValueError(
          f"rows: column {column!r} holds a line break in {value!r}; expected one line per row"
        )


def append_rows(path: str | pathlib.Path, rows: list[dict]) -> None:
  """Appends ``rows`` to a CSV file in one ``fsync``'d write (hold the directory's :func:`lock`).

  An empty file (or one holding only a header cut by a kill: a prefix of the header of these
  columns) gets the header first. A non-empty file must start with the header of these columns
  (in any order; the rows follow the file's order): anything else, a file without a newline that
  is not such a prefix included, raises ``ValueError`` rather than writing a second header,
  mixing tables or cutting what is not ours. A torn last line left by a killed writer is cut
  before appending, so it never merges with a row.
  """
  if not rows:
    return
  path = pathlib.Path(path)
  _not_a_directory(path, "a CSV results file")
  table = pd.DataFrame(rows)
  _check_no_line_breaks(table)
  columns = [str(c) for c in table.columns]
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
  try:
    size = os.fstat(fd).st_size
    created = size == 0
    first = _first_line(fd) if size else None
    if first is None:
      if size and not _is_header_prefix(os.pread(fd, size, 0), columns):
        raise ValueError(
          f"path: {path} holds no line and does not start like the header of these rows "
          f"{columns}; expected a CSV results file (refused, never rewritten: move it away or "
          "use a fresh workdir)"
        )
      size = _cut_torn_tail(fd, size) if size else 0
    else:
      existing = _fields(first.decode("utf-8", errors="replace").rstrip("\n")) or []
      if sorted(existing) != sorted(columns):
        raise ValueError(
          f"path: {path} starts with {first.decode(errors='replace').rstrip()!r}, not the "
          f"header of these rows {columns}; expected a results file of the same columns"
        )
      columns = existing
      size = _cut_torn_tail(fd, size)
    data = table.to_csv(index=False, header=size == 0, columns=columns).encode()
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view) :]
    os.fsync(fd)
  finally:
    os.close(fd)
  if created:
    _fsync_dir(path.parent)


def write_rows(path: str | pathlib.Path, table: pd.DataFrame) -> None:
  """Replaces a results file with ``table`` (written beside it, ``fsync``'d, renamed over it)."""
  _not_a_directory(pathlib.Path(path), "a CSV results file")
  _check_no_line_breaks(table)
  _write_atomic(pathlib.Path(path), table.to_csv(index=False).encode())


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  """The parsable lines of a JSON-lines log (a line cut by a kill is skipped)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  rows = []
  for line in path.read_text(errors="replace").splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def load_config(path: str | pathlib.Path, arg: str | None = None):
  """``get_config(arg)`` of an ml-collections config file (what ``--config=path:arg`` loads), for
  notebooks and scripts that do not parse flags."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"path: config file {path} does not exist (or is not a file)")
  spec = importlib.util.spec_from_file_location(f"kvjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"path: config file {path} defines no get_config(arg); expected one")
  return module.get_config(arg)


def require_fields(config, fields: Sequence[str], what: str) -> None:
  """``ValueError`` naming the first of ``fields`` (dotted paths) that ``config`` lacks, instead
  of ml_collections' bare ``AttributeError: "'name'"`` deep inside a run. ``what`` names the
  config file whose fields are expected."""
  for dotted in fields:
    node = config
    for part in dotted.split("."):
      if not hasattr(node, "keys") or part not in node:
        raise ValueError(
          f"config.{dotted}: missing; expected the fields of {what} (a config file must set it)"
        )
      node = node[part]


# --------------------------------------------------------------------------- checkpoints


def restore_checkpoint(path: str | pathlib.Path, step: int, restore: Callable[[], T]) -> T:
  """Restores one saved step of a run's checkpoints, naming the step and its files when it cannot.

  A step directory that a kill, a full disk or an edit left damaged (a truncated or rewritten
  metadata file, a missing or cut array file) makes the checkpoint library fail with its own
  error (a ``JSONDecodeError``, a ``UnicodeDecodeError``, a storage driver's ``DATA_LOSS``);
  this says which step of which directory it was and what to do, instead of that traceback.

  Args:
    path: the checkpoint directory (the one the checkpoint manager was given).
    step: the step being restored (its directory is ``path/step``).
    restore: restores the step and returns it (e.g. ``lambda: mngr.restore(step, args=...)``).

  Returns:
    What ``restore`` returned.

  Raises:
    ValueError: naming ``checkpoint_dir``, the step, its directory and the library's error, when
      ``restore`` raises.
  """
  try:
    return restore()
  except Exception as e:  # the checkpoint library's errors have no common base class
    where = pathlib.Path(path).absolute() / str(step)
    said = (str(e).strip().splitlines() or [""])[0][:300]
    raise ValueError(
      f"checkpoint_dir: step {step} of the checkpoints in {pathlib.Path(path).absolute()} "
      f"cannot be restored ({type(e).__name__}: {said}); its files in {where} are damaged or "
      f"incomplete. Expected an intact step: remove {where} to resume from the step before it, "
      "or start in a fresh directory"
    ) from e


# --------------------------------------------------------------------------- compiled programs

COMPILATION_CACHE_ENV = "KVJAX_COMPILATION_CACHE"
_CACHE_OFF = ("", "0", "off", "false", "no", "none")
_CACHE_DEFAULT = ("1", "on", "true", "yes", "default")


def default_compilation_cache_dir() -> pathlib.Path:
  """The user cache directory for compiled programs: ``$XDG_CACHE_HOME/kvjax/jax`` (or
  ``~/.cache/kvjax/jax``)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "kvjax" / "jax"


def compilation_cache_dir(setting: str | None = None) -> pathlib.Path | None:
  """Where to keep compiled executables across processes, or ``None`` (off, the default).

  ``setting`` (a sweep or evaluation config's ``compilation_cache``; when ``None``, the
  environment variable ``KVJAX_COMPILATION_CACHE``) is off when empty or
  ``0``/``off``/``false``/``no``/``none``,
  the user cache directory (:func:`default_compilation_cache_dir`) when ``1``/``on``/``true``/
  ``yes``/``default``, and otherwise a directory path.
  """
  value = os.environ.get(COMPILATION_CACHE_ENV, "") if setting is None else setting
  if not isinstance(value, str):
    raise ValueError(f"compilation_cache: expected a str (a path, 'default' or ''), got {value!r}")
  if value.strip().lower() in _CACHE_OFF:
    return None
  if value.strip().lower() in _CACHE_DEFAULT:
    return default_compilation_cache_dir()
  return pathlib.Path(value).expanduser()


def enable_compilation_cache(setting: str | None = None) -> pathlib.Path | None:
  """Turns on JAX's persistent compilation cache at :func:`compilation_cache_dir` (``setting``),
  caching every compile however short: a cold process then loads a run's executables
  instead of compiling them (seconds on CPU). Process-wide; returns the directory or ``None``.
  The cache is trusted code: keep it in a directory only you can write.
  """
  path = compilation_cache_dir(setting)
  if path is None:
    return None
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
