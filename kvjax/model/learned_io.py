"""The files of kvjax's learned components (KVzap's surrogates, Fast KVzip's gates, RestoreKV's
adapters): their fp32 arrays and a json header (:mod:`kvjax.model.npzfile`) that names the
format, the facts the component's reader needs, the arrays' shapes and the identity of the model
the component was trained on.

* :func:`write`: a component's file, with the identity of its model;
* :func:`load`: such a file read back and checked against a model, its arrays' shapes and
  the identity it records; each component's ``load(path, model, *, unverified=False)`` calls
  it with its own format and builder.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np

from kvjax import checks
from kvjax.model import npzfile


def write(
  path: str | pathlib.Path,
  arrays: dict,
  fmt: str,
  meta: dict | None = None,
  *,
  identity: dict | None = None,
  shapes: dict | None = None,
  **facts,
) -> pathlib.Path:
  """Writes a learned component as an ``.npz`` file (:func:`kvjax.model.npzfile.write`): its
  fp32 arrays and a json header of the caller's ``meta`` and ``model_identity``, then
  ``format``, the component's ``facts`` and the arrays' ``shapes``.

  Args:
    path: the file to write.
    arrays: ``{name: array}``.
    fmt: the header's ``format``.
    meta: json-serialisable facts to keep with the arrays, e.g. the model's name and the
      training data.
    identity: :func:`kvjax.checks.model_identity` of the model the component was trained on,
      checked by :func:`load`; ``None`` records none (such a file loads for a model only
      with ``unverified=True``).
    shapes: ``{name: shape}`` for the header (``None``: those of ``arrays``).
    **facts: json-serialisable facts the component's reader needs (e.g. ``kind``).

  Returns:
    The path written.
  """
  meta = (meta or {}) | ({} if identity is None else {"model_identity": identity})
  shapes = {k: np.shape(v) for k, v in arrays.items()} if shapes is None else shapes
  header = {
    **meta,
    "format": fmt,
    **facts,
    "shapes": {k: list(v) for k, v in shapes.items()},
  }
  return npzfile.write(path, arrays, header)


def load(
  path: str | pathlib.Path,
  model,
  *,
  fmt: str,
  what: str,
  build: Callable[[dict, dict, str], object],
  unverified: bool = False,
) -> tuple[object, dict]:
  """Reads a learned component's file (:func:`write`, :func:`kvjax.model.npzfile.read`) and
  checks it against a model: the component's arrays against the model's config (``build``),
  and the identity the file records against the model's config and weights
  (:func:`kvjax.checks.same_model`). Each component's ``load(path, model, *, unverified=False)``
  is this one.

  Args:
    path: the ``.npz`` file.
    model: the model (:class:`kvjax.model.llama.Llama`) the component must fit: the file must
      record the identity of this very model (:func:`kvjax.checks.same_model`), not only fit
      its shapes.
    fmt: the ``format`` its header must name.
    what: what the file holds, for the errors (e.g. ``"Fast KVzip gates"``).
    build: ``(arrays, meta, where) -> component``: the component of the file's numpy arrays
      and header, checked against the model's config (raising ``ValueError`` naming
      ``where``: the path and the model the header names).
    unverified: load a file whose identity is missing or another model's anyway (only the
      shapes are checked): the caller vouches that it suits this model.

  Returns:
    ``(component, meta)``: what ``build`` made, and the header.

  Raises:
    ValueError: naming the file, for one that is missing, unreadable or truncated, lacks the
      header or names another format, what ``build`` refuses (an array missing, or of a shape
      that does not fit the model), and (unless ``unverified``) one that records no model
      identity or another model's.
  """
  files, meta = npzfile.read(path, fmt, what)
  where = f"path: {path} (model {meta.get('model')!r})"
  component = build(files, meta, where)
  if not unverified:  # the identity hashes the weights: only when it is checked
    mine = checks.model_identity(model.cfg, model.params())
    checks.same_model(where, meta.get("model_identity"), mine)
  return component, meta
