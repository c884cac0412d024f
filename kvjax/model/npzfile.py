"""The ``.npz`` files of trained evidence (KVzap's surrogates, Fast KVzip's gates, RestoreKV's
adapters): fp32 arrays and a json header, read back with the file named in every error."""

from __future__ import annotations

import json
import pathlib
import zipfile

import numpy as np

HEADER = "meta_json"


def write(path: str | pathlib.Path, arrays: dict, header: dict) -> pathlib.Path:
  """Writes fp32 ``arrays`` and a json ``header`` (keys sorted) as one ``.npz`` file.

  Args:
    path: the file to write (its directory is made).
    arrays: ``{name: array}``.
    header: json-serialisable facts (the format, the shapes, the caller's meta).

  Returns:
    The path written.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  data = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
  with open(path, "wb") as f:
    np.savez(f, **{HEADER: np.asarray(json.dumps(header, sort_keys=True))}, **data)
  return path


def read(path: str | pathlib.Path, fmt: str, what: str) -> tuple[dict, dict]:
  """Reads a file :func:`write` wrote, checking its header's ``format``.

  Args:
    path: the ``.npz`` file.
    fmt: the ``format`` its header must name.
    what: what the file holds, for the errors (e.g. ``"Fast KVzip gates"``).

  Returns:
    ``(arrays, meta)``: numpy arrays by name and the header.

  Raises:
    ValueError: naming the file, for one that is missing, unreadable or truncated, lacks the
      header, holds a header that is not a JSON object, or names another format.
  """
  path = pathlib.Path(path)
  try:
    with np.load(path, allow_pickle=False) as data:
      files = {k: data[k] for k in data.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated file: BadZipFile
    raise ValueError(f"path: {path} is not a readable {what} file ({e})") from None
  if HEADER not in files:
    raise ValueError(f"path: {path} has no {HEADER} header (not a {what} file)")
  try:
    meta = json.loads(str(files.pop(HEADER)))
  except json.JSONDecodeError as e:
    raise ValueError(f"path: {path} has a {HEADER} header that is not valid JSON ({e})") from None
  if not isinstance(meta, dict):
    raise ValueError(
      f"path: {path} has a {HEADER} header that is not a JSON object ({type(meta).__name__}); "
      f"expected the header of a {what} file"
    )
  if meta.get("format") != fmt:
    raise ValueError(f"path: {path} has format {meta.get('format')!r}, expected {fmt!r}")
  return files, meta
