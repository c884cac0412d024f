"""Run directories: one configuration per directory, rows appended so that nothing is lost.

Sweeps, evaluations and training runs all write into a run directory and resume from it. This
module is the one place that knows how: :func:`claim` records what a directory holds and refuses
a different configuration, :func:`append_rows` adds CSV rows durably (one ``fsync``'d write per
call, the header once), :func:`read_rows` reads them back dropping a line cut by an interruption,
and :func:`read_jsonl` does the same for JSON-lines logs. It imports nothing else from kvjax.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import ml_collections
import pandas as pd


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


def claim(
  workdir: str | pathlib.Path, name: str, text: str, *, has_results: bool = True
) -> pathlib.Path:
  """Creates ``workdir`` and records ``text`` (a :func:`signature`) in ``workdir/name``.

  Raises ``ValueError`` when the directory already holds a run of a different configuration:
  a run directory resumes only the run it holds. Pass ``has_results=False`` when the directory
  holds no results yet, so that a corrected configuration may take it over.
  """
  out = pathlib.Path(workdir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / name
  if has_results and path.exists() and path.read_text() != text:
    raise ValueError(
      f"workdir: {out} holds a run of a different configuration ({name} differs); "
      "expected the same config to resume, or a fresh workdir"
    )
  path.write_text(text)
  return out


def _complete_text(path: pathlib.Path) -> str:
  """The file's text up to its last newline; a torn last line is cut from the file too."""
  text = path.read_text()
  if text and not text.endswith("\n"):
    text = text[: text.rfind("\n") + 1]
    path.write_text(text)
  return text


def read_rows(path: str | pathlib.Path, dtype: dict | None = None) -> pd.DataFrame:
  """The complete rows of a CSV results file (empty when there is none); a line cut by an
  interruption is dropped, so that its configuration runs again."""
  path = pathlib.Path(path)
  if not path.exists() or not _complete_text(path).strip():
    return pd.DataFrame()
  return pd.read_csv(path, dtype=dtype)


def append_rows(path: str | pathlib.Path, rows: list[dict]) -> None:
  """Appends ``rows`` to a CSV file in one write, flushed to disk before returning; the header
  is written only into an empty file."""
  path = pathlib.Path(path)
  header = not path.exists() or path.stat().st_size == 0
  data = pd.DataFrame(rows).to_csv(index=False, header=header)
  with open(path, "a") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def write_rows(path: str | pathlib.Path, table: pd.DataFrame) -> None:
  """Replaces a results file with ``table`` (written beside it, then renamed over it)."""
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + ".tmp")
  table.to_csv(tmp, index=False)
  os.replace(tmp, path)


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  """The parsable lines of a JSON-lines log (a line cut by a kill is skipped)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def load_config(path: str | pathlib.Path, arg: str | None = None):
  """``get_config(arg)`` of an ml-collections config file (what ``--config=path:arg`` loads), for
  notebooks and scripts that do not parse flags."""
  path = pathlib.Path(path)
  if not path.exists():
    raise ValueError(f"path: config file {path} does not exist")
  spec = importlib.util.spec_from_file_location(f"kvjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
