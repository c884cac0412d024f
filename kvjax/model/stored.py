"""A compressed context kept for later questions: compress a context once, save it, load it in
another process and answer several questions from it without reading the context again.

:func:`kvjax.model.decoding.compress_context` makes a :class:`CompressedContext` and
:func:`kvjax.model.decoding.answer_context` answers from one. This module holds the object and
its file: one safetensors file with every array of the cache and a JSON header naming the model
(its shapes and a digest of its embedding), the policy, the budget and each row's next position,
so that a cache saved for another model or policy is refused when loaded.

A loaded file is checked whole before anything answers from it: the header's fields (types and
ranges), a SHA-256 of every array and of the header (written at save: any byte changed after
saving is refused), and each array's shape, dtype and values against the model and the header
(finite keys and values, positions of each row's own tokens, at least one valid slot per row and
layer, integer budgets within the capacity, no overflow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model.config import ModelConfig

FORMAT = "kvjax.compressed_context/1"
# the cache fields saved as arrays (evidence is a dict saved as evidence/<field>)
_ARRAYS = tuple(f.name for f in dataclasses.fields(cache_lib.KVCache) if f.name != "evidence")
# the header's fields every saved context holds; "checksum" covers the arrays and the others
HEADER_FIELDS = (
  "format",
  "model",
  "policy",
  "policy_identity",
  "policy_label",
  "capacity",
  "layout",
  "reindex",
  "compress_sliding",
  "next_pos",
  "checksum",
)
_INT32_MAX = 2**31 - 1


def policy_identity(policy: policies.Policy) -> str:
  """What identifies a policy for a saved cache: its ``repr`` with the fields that take no part
  in its equality (a registered policy's ``name``) at their defaults, in nested policies too, so
  that ``policies.make("snapkv")`` and ``policies.SnapKV()`` are the same policy.

  Args:
    policy: a policy object.

  Returns:
    The canonical text.
  """
  return repr(_canonical(policy))


def _canonical(value):
  if isinstance(value, tuple | list):
    return type(value)(_canonical(v) for v in value)
  if not dataclasses.is_dataclass(value) or isinstance(value, type):
    return value
  changes = {}
  for f in dataclasses.fields(value):
    if not f.init:
      continue
    current = getattr(value, f.name)
    if not f.compare and f.default is not dataclasses.MISSING:
      if current != f.default:
        changes[f.name] = f.default
      continue
    canonical = _canonical(current)
    if canonical is not current:
      changes[f.name] = canonical
  return dataclasses.replace(value, **changes) if changes else value


def checksum(arrays: dict, header: dict) -> str:
  """The SHA-256 a saved context's header holds: of every array (name, dtype, shape and bytes,
  in name order) and of the header's other fields (canonical JSON).

  Args:
    arrays: ``{name: numpy array}`` as saved.
    header: the header, without its ``checksum`` (ignored when present).

  Returns:
    The hex digest.
  """
  digest = hashlib.sha256()
  fields = {k: v for k, v in header.items() if k != "checksum"}
  digest.update(json.dumps(fields, sort_keys=True).encode())
  for name in sorted(arrays):
    a = np.ascontiguousarray(arrays[name])
    digest.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
    digest.update(a.tobytes())
  return digest.hexdigest()


def model_fingerprint(cfg: ModelConfig, params: dict) -> dict:
  """What identifies a model for a saved cache: its shapes and a digest of its embedding.

  The digest reads the embedding matrix only (one array of a checkpoint, so a check costs
  little even for large models); two checkpoints of one architecture differ there.

  Args:
    cfg: the model's config.
    params: the parameter pytree.

  Returns:
    A JSON-able dict: layers, query and KV heads, head dim, vocabulary and the embedding's
    SHA-256.
  """
  embed = np.ascontiguousarray(np.asarray(params["embed"], np.float32))
  return dict(
    num_layers=cfg.num_layers,
    num_heads=cfg.num_heads,
    num_kv_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    vocab_size=cfg.vocab_size,
    embed_sha256=hashlib.sha256(embed.tobytes()).hexdigest(),
  )


@dataclasses.dataclass(frozen=True)
class CompressedContext:
  """A context compressed once under a policy, ready for questions.

  Attributes:
    cache: the compressed cache (:class:`kvjax.model.cache.KVCache`), one row per context.
    spec: its static choices (policy, capacity, layout).
    next_pos_B: each row's next RoPE position (its context's real tokens), int32 ``[B]``.
    model: :func:`model_fingerprint` of the model that made it.
  """

  cache: cache_lib.KVCache
  spec: cache_lib.CacheSpec
  next_pos_B: np.ndarray
  model: dict

  def header(self) -> dict:
    """The JSON header of the file: format, model, policy, layout and positions (the file's
    checksum is added by :meth:`save`)."""
    return dict(
      format=FORMAT,
      model=self.model,
      policy=repr(self.spec.policy),
      policy_identity=policy_identity(self.spec.policy),
      policy_label=self.spec.policy.label,
      capacity=self.spec.capacity,
      layout=self.spec.layout,
      reindex=self.spec.reindex,
      compress_sliding=self.spec.compress_sliding,
      next_pos=[int(p) for p in np.asarray(self.next_pos_B)],
    )

  def save(self, path) -> pathlib.Path:
    """Writes the context to one safetensors file.

    Args:
      path: the file (``.safetensors`` is appended when absent).

    Returns:
      The path written.
    """
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    if path.suffix != ".safetensors":
      path = path.with_name(path.name + ".safetensors")
    arrays = {}
    for name in _ARRAYS:
      value = getattr(self.cache, name)
      if value is not None:
        arrays[name] = np.ascontiguousarray(np.asarray(value))
    for name, value in (self.cache.evidence or {}).items():
      arrays[f"evidence/{name}"] = np.ascontiguousarray(np.asarray(value))
    header = self.header()
    header["checksum"] = checksum(arrays, header)
    save_file(arrays, str(path), metadata={"kvjax": json.dumps(header)})
    return path


def _read(path: pathlib.Path) -> tuple[dict, dict]:
  """``(header, arrays)`` of a safetensors file holding a compressed context (its format and
  the header's fields checked)."""
  from safetensors import SafetensorError, safe_open
  from safetensors.numpy import load_file

  if not path.is_file():
    raise ValueError(f"path: {str(path)!r} is not a file; expected a saved compressed context")
  try:
    with safe_open(str(path), "np") as f:
      meta = f.metadata() or {}
    arrays = load_file(str(path))
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"path: {path} is not a safetensors file ({e})") from None
  try:
    header = json.loads(meta["kvjax"])
    ok = isinstance(header, dict) and header.get("format") == FORMAT
  except (KeyError, TypeError, json.JSONDecodeError):
    ok = False
  if not ok:
    raise ValueError(f"path: {path} holds no compressed context (expected format {FORMAT})")
  missing = [k for k in HEADER_FIELDS if k not in header]
  if missing:
    raise ValueError(
      f"path: {path} is a compressed context whose header lacks {missing}; expected the header "
      "CompressedContext.save writes (compress the context again)"
    )
  if header["checksum"] != checksum(arrays, header):
    raise ValueError(
      f"path: {path} does not match its checksum: its arrays or header changed after it was "
      "saved; expected the file as CompressedContext.save wrote it"
    )
  return header, arrays


def _bad(path, what: str) -> ValueError:
  return ValueError(
    f"path: {path} holds {what}; expected a context as CompressedContext.save writes"
  )


def _is_int(value, low: int, high: int = _INT32_MAX) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_header(path, header: dict) -> None:
  if not isinstance(header["model"], dict):
    raise _bad(path, f"a model fingerprint {header['model']!r} that is not a JSON object")
  for name in ("policy", "policy_identity", "policy_label"):
    if not isinstance(header[name], str):
      raise _bad(path, f"{name}={header[name]!r}, not a str")
  if not _is_int(header["capacity"], 1):
    raise _bad(path, f"capacity={header['capacity']!r}, not an int in [1, 2**31)")
  if header["layout"] not in cache_lib.LAYOUTS:
    raise _bad(path, f"layout={header['layout']!r}, not one of {cache_lib.LAYOUTS}")
  for name in ("reindex", "compress_sliding"):
    if not isinstance(header[name], bool):
      raise _bad(path, f"{name}={header[name]!r}, not a bool")
  next_pos = header["next_pos"]
  if not isinstance(next_pos, list) or not next_pos or not all(_is_int(p, 1) for p in next_pos):
    raise _bad(path, f"next_pos={next_pos!r}, not a list of positions >= 1, one per row")


def _shape_of(name: str, cfg: ModelConfig, header: dict) -> tuple | None:
  """The shape ``name`` must have (``None``: any shape, checked elsewhere or free)."""
  L, B = cfg.num_layers, len(header["next_pos"])
  H = cfg.num_kv_heads if header["layout"] == "kv" else cfg.num_heads
  C = header["capacity"]
  slots = (L, B, H, C)
  return {
    "values": (*slots, cfg.head_dim),
    "positions": slots,
    "valid": slots,
    "budget": (B, L, H),
    "scores": slots,
    "attn_sums": slots,
    "overflow": (B,),
  }.get(name)


def _kind(a: np.ndarray) -> str:
  if a.dtype == np.bool_:
    return "bool"
  if np.issubdtype(a.dtype, np.integer):
    return "int"
  return "float" if jnp.issubdtype(a.dtype, jnp.floating) else "other"


_KINDS = {
  "keys": "float",
  "values": "float",
  "positions": "int",
  "valid": "bool",
  "budget": "int",
  "scores": "float",
  "overflow": "bool",
  "channels": "int",
  "new_keys": "float",
  "queries": "float",
  "query_pos": "int",
  "attn_sums": "float",
}


def check_arrays(path, cfg: ModelConfig, header: dict, arrays: dict) -> None:
  """Checks a saved context's arrays against the model and the header.

  Args:
    path: the file, for the messages.
    cfg: the model's config.
    header: the file's header (its fields already checked).
    arrays: ``{name: numpy array}`` as saved.

  Raises:
    ValueError: naming the file and the array: an unknown or missing array, a shape other than
      the model's layers, heads, head size, the header's rows and capacity, a dtype of the wrong
      kind, non-finite keys, values or evidence, a valid slot at a position outside its row's
      tokens, a row of a layer without any valid slot, a budget outside ``[0, capacity]``, or
      a row that overflowed.
  """
  unknown = sorted(k for k in arrays if k not in _ARRAYS and not k.startswith("evidence/"))
  missing = [k for k in ("keys", "values", "positions", "valid", "budget") if k not in arrays]
  if unknown or missing:
    raise _bad(path, f"the arrays {sorted(arrays)} (unknown: {unknown}, missing: {missing})")
  for name, a in arrays.items():
    evidence = name.startswith("evidence/")
    if not evidence and _kind(a) != _KINDS[name]:
      raise _bad(path, f"{name} of dtype {a.dtype}, not a {_KINDS[name]} array")
    # keys, values and scores are checked in the valid slots alone (the others are unused)
    whole = _kind(a) == "float" and name not in ("keys", "values", "scores")
    if whole and not np.isfinite(np.asarray(a, np.float32)).all():
      raise _bad(path, f"NaN or inf values in {name}")
  keys = arrays["keys"]
  L, B = cfg.num_layers, len(header["next_pos"])
  H = cfg.num_kv_heads if header["layout"] == "kv" else cfg.num_heads
  C, D = header["capacity"], cfg.head_dim
  channels = arrays.get("channels")
  d_keys = D if channels is None else channels.shape[-1]
  if keys.shape != (L, B, H, C, d_keys):
    raise _bad(
      path,
      f"keys of shape {keys.shape}, not (layers, rows, heads, capacity, head_dim) = "
      f"{(L, B, H, C, d_keys)} for this model, its {len(header['next_pos'])} next_pos and "
      f"capacity {C}",
    )
  if channels is not None and (channels.shape != (L, B, H, d_keys) or not 0 < d_keys <= D):
    raise _bad(path, f"channels of shape {channels.shape}; expected {(L, B, H, '<=' + str(D))}")
  for name, a in arrays.items():
    want = _shape_of(name, cfg, header)
    if want is not None and a.shape != want:
      raise _bad(path, f"{name} of shape {a.shape}, not {want}")
  valid = arrays["valid"]
  for name in ("keys", "values"):
    if not np.isfinite(np.asarray(arrays[name], np.float32)[valid]).all():
      raise _bad(path, f"NaN or inf {name} in valid slots")
  if "scores" in arrays and np.isnan(np.asarray(arrays["scores"], np.float32)[valid]).any():
    raise _bad(path, "NaN scores in valid slots")
  empty = np.argwhere(~valid.any(axis=(2, 3)))
  if empty.size:
    layer, row = empty[0]
    raise _bad(path, f"no valid slot in row {row} of layer {layer} (every slot invalid)")
  next_pos = np.asarray(header["next_pos"], np.int64)
  positions = np.asarray(arrays["positions"], np.int64)
  outside = valid & ((positions < 0) | (positions >= next_pos[None, :, None, None]))
  if outside.any():
    layer, row, head, slot = np.argwhere(outside)[0]
    raise _bad(
      path,
      f"a valid slot at position {positions[layer, row, head, slot]} (layer {layer}, row {row}, "
      f"head {head}, slot {slot}), outside the row's tokens [0, {next_pos[row]}) (next_pos)",
    )
  budget = np.asarray(arrays["budget"], np.int64)
  if budget.min() < 0 or budget.max() > C:
    raise _bad(path, f"budgets in [{budget.min()}, {budget.max()}], outside [0, capacity={C}]")
  if "overflow" in arrays and arrays["overflow"].any():
    raise _bad(path, f"rows {np.flatnonzero(arrays['overflow']).tolist()} that overflowed")
  if channels is not None and (channels.min() < 0 or channels.max() >= D):
    raise _bad(path, f"key channels outside [0, {D})")


def load(path, model, policy: policies.Policy) -> CompressedContext:
  """Reads a :class:`CompressedContext` saved by :meth:`CompressedContext.save`.

  The file is checked whole first: its header, its checksum and every array
  (:func:`check_arrays`), then the model (:func:`model_fingerprint`) and the policy (by
  :func:`policy_identity`: an equal policy built by class or by name is the same).

  Args:
    path: the file.
    model: the model (:class:`kvjax.model.llama.Llama`) the context was saved for (the
      fingerprint is checked against its config and parameters).
    policy: the policy the context was compressed with (an object).

  Returns:
    The context, on the default device.

  Raises:
    ValueError: naming the file, for a file that is not a saved context, a header that lacks
      a field or holds a wrong one, a file changed after it was saved (its checksum), arrays
      :func:`check_arrays` refuses, one saved for another model (what differs) or another
      policy.
  """
  cfg = model.cfg
  path = pathlib.Path(path)
  header, arrays = _read(path)
  _check_header(path, header)
  want = model_fingerprint(cfg, model.params())
  differs = {k: (header["model"].get(k), v) for k, v in want.items() if header["model"].get(k) != v}
  if differs:
    raise ValueError(
      f"path: {path} was saved for another model; differs (saved, this model): {differs}"
    )
  if header["policy_identity"] != policy_identity(policy):
    raise ValueError(
      f"policy: {path} was compressed with {header['policy']}, not with {policy!r}; pass the "
      "policy it was saved with"
    )
  check_arrays(path, cfg, header, arrays)
  fields = {k: jnp.asarray(v) for k, v in arrays.items() if not k.startswith("evidence/")}
  evidence = {k.split("/", 1)[1]: jnp.asarray(v) for k, v in arrays.items() if "/" in k}
  cache = cache_lib.KVCache(**fields, evidence=evidence or None)
  spec = cache_lib.CacheSpec(
    policy,
    header["capacity"],
    header["layout"],
    reindex=header["reindex"],
    compress_sliding=header["compress_sliding"],
  )
  return CompressedContext(
    jax.device_put(cache), spec, np.asarray(header["next_pos"], np.int32), header["model"]
  )
