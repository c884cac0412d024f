"""GGUF files (llama.cpp's format): the header parsed with bounds checks, typed metadata, and
tensors dequantised to float32 through the ``gguf`` package.

The header (metadata and tensor table) is parsed here before ``gguf`` sees the file, so a wrong
magic number, a truncated file or a corrupt header raises ``ValueError`` naming the file (and
the tensor) instead of a numpy or struct error deep inside the reader, and a tokenizer can be
read from the metadata without the ``gguf`` package. Every tensor's data must be aligned to
``general.alignment``, inside the file and apart from every other tensor's
(:func:`check_layout`), and every metadata value must have the type its key needs
(:func:`metadata_int` and its siblings name the key, the value's type and what was expected).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import pathlib
import struct
from typing import Any

import numpy as np

# ggml type id -> (name, elements per block, bytes per block): ggml.h / gguf-py GGML_QUANT_SIZES
TYPES = {
  0: ("F32", 1, 4),
  1: ("F16", 1, 2),
  30: ("BF16", 1, 2),
  8: ("Q8_0", 32, 34),
  2: ("Q4_0", 32, 18),
  3: ("Q4_1", 32, 20),
  6: ("Q5_0", 32, 22),
  7: ("Q5_1", 32, 24),
  10: ("Q2_K", 256, 84),
  11: ("Q3_K", 256, 110),
  12: ("Q4_K", 256, 144),
  13: ("Q5_K", 256, 176),
  14: ("Q6_K", 256, 210),
}
SUPPORTED_TYPES = ", ".join(name for name, _, _ in TYPES.values())
MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT, when general.alignment is absent
INT32_MAX = 2**31 - 1


# GGUF metadata value types (gguf-py GGUFValueType)
_SCALARS = {
  0: "B",
  1: "b",
  2: "H",
  3: "h",
  4: "I",
  5: "i",
  6: "f",
  7: "?",
  10: "Q",
  11: "q",
  12: "d",
}


_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One entry of a GGUF file's tensor table.

  ``dims`` is in GGUF (ggml ``ne``) order, innermost first; ``offset`` is absolute, in bytes from
  the start of the file.
  """

  name: str
  dims: tuple[int, ...]
  type_id: int
  offset: int  # absolute, in bytes from the start of the file

  @property
  def shape(self) -> tuple[int, ...]:
    """The numpy (row-major) shape: ``dims`` reversed, e.g. ``[out, in]`` for a weight."""
    return tuple(reversed(self.dims))

  @property
  def type_name(self) -> str:
    """The name of the tensor's ggml type, e.g. ``Q4_K`` (:func:`type_name`)."""
    return type_name(self.type_id)


@dataclasses.dataclass(frozen=True)
class Header:
  """A GGUF file's metadata and tensor table.

  ``metadata`` maps each key to its value (numeric arrays as numpy); ``tensors`` maps each tensor
  name to its :class:`TensorInfo`.
  """

  path: pathlib.Path
  metadata: dict[str, Any]
  tensors: dict[str, TensorInfo]


def type_name(type_id: int) -> str:
  """Returns the name of a ggml type id.

  Args:
    type_id: the ggml type id, e.g. 12.

  Returns:
    The type's name, e.g. ``"Q4_K"`` for 12; for a type kvjax does not dequantise, ggml's name
    when the ``gguf`` package knows it, else ``"<id> (not a ggml type)"``.
  """
  if type_id in TYPES:
    return TYPES[type_id][0]
  try:
    from gguf import GGMLQuantizationType  # noqa: PLC0415

    return GGMLQuantizationType(type_id).name
  except (ImportError, ValueError):
    return f"{type_id} (not a ggml type)"


class _Cursor:
  """Bounds-checked little/big-endian reads from the mapped file."""

  def __init__(self, buf, path: pathlib.Path, order: str):
    self.buf, self.path, self.order, self.pos = buf, path, order, 0

  def corrupt(self, what: str) -> ValueError:
    return ValueError(
      f"path: GGUF file {self.path} is truncated or has a corrupt header ({what} at byte "
      f"{self.pos}, file size {len(self.buf)} bytes)"
    )

  def take(self, n: int, what: str) -> bytes:
    if n < 0 or self.pos + n > len(self.buf):
      raise self.corrupt(f"{what}: {n} bytes past the end of the file")
    out = self.buf[self.pos : self.pos + n]
    self.pos += n
    return out

  def unpack(self, fmt: str, what: str):
    return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

  def string(self, what: str) -> str:
    n = self.unpack("Q", what)
    raw = self.take(n, what)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      raise self.corrupt(f"{what}: not UTF-8") from None

  def value(self, vtype: int, what: str, depth: int = 0):
    if vtype in _SCALARS:
      return self.unpack(_SCALARS[vtype], what)
    if vtype == _STRING:
      return self.string(what)
    if vtype != _ARRAY or depth > 1:
      raise self.corrupt(f"{what}: unknown value type {vtype}")
    itype, count = self.unpack("I", what), self.unpack("Q", what)
    if itype in _SCALARS:
      size = struct.calcsize(_SCALARS[itype])
      raw = self.take(count * size, what)
      dtype = np.dtype(_SCALARS[itype] if itype != 7 else "u1").newbyteorder(self.order)
      arr = np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="))
      return arr.astype(bool) if itype == 7 else arr
    if count * 8 > len(self.buf) - self.pos:  # every element needs at least a length or a type
      raise self.corrupt(f"{what}: an array of {count} elements cannot fit in the file")
    return [self.value(itype, what, depth + 1) for _ in range(count)]


def _parse_header(buf, path: pathlib.Path) -> Header:
  if len(buf) < 8 or buf[:4] != MAGIC:
    raise ValueError(
      f"path: {path} is not a GGUF file (magic number {bytes(buf[:4])!r}, expected {MAGIC!r})"
    )
  order = "<"
  (version,) = struct.unpack("<I", buf[4:8])
  if version & 0xFFFF == 0:  # written on a big-endian host (gguf-py's test)
    order = ">"
    (version,) = struct.unpack(">I", buf[4:8])
  if version not in VERSIONS:
    raise ValueError(f"path: GGUF file {path} has version {version}; supported: {VERSIONS}")
  cur = _Cursor(buf, path, order)
  cur.pos = 8
  n_tensors, n_kv = cur.unpack("Q", "tensor count"), cur.unpack("Q", "metadata count")
  if n_kv * 13 + n_tensors * 24 > len(buf):  # the smallest entry of each kind
    raise cur.corrupt(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the file")
  metadata: dict[str, Any] = {}
  for _ in range(n_kv):
    key = cur.string("a metadata key")
    if key in metadata:
      raise cur.corrupt(f"metadata key {key!r} repeated")
    metadata[key] = cur.value(cur.unpack("I", f"the type of {key!r}"), f"metadata {key!r}")
  infos = []
  for _ in range(n_tensors):
    name = cur.string("a tensor name")
    n_dims = cur.unpack("I", f"the rank of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise cur.corrupt(f"tensor {name!r} has rank {n_dims} (expected 1..{MAX_DIMS})")
    dims = tuple(cur.unpack("Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
    infos.append((name, dims, cur.unpack("I", f"the type of {name!r}"), cur.unpack("Q", name)))
  alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
  if (
    isinstance(alignment, bool)
    or not isinstance(alignment, int)
    or alignment <= 0
    or alignment & (alignment - 1)
  ):
    raise cur.corrupt(f"general.alignment {alignment!r} is not a power of two")
  data_start = -(-cur.pos // alignment) * alignment
  tensors: dict[str, TensorInfo] = {}
  for name, dims, type_id, offset in infos:
    if name in tensors:
      raise cur.corrupt(f"tensor {name!r} repeated")
    info = TensorInfo(name, dims, type_id, data_start + offset)
    if type_id in TYPES and dims[0] % TYPES[type_id][1]:  # others are refused by read()
      raise cur.corrupt(f"tensor {name!r} has rows of {dims[0]}, not whole {info.type_name} blocks")
    tensors[name] = info
  check_layout(list(tensors.values()), data_start, alignment, len(buf), path)
  return Header(path, metadata, tensors)


def nbytes(info: TensorInfo) -> int | None:
  """Returns the number of bytes a tensor's data takes in the file.

  Args:
    info: the tensor's entry of the tensor table.

  Returns:
    The size in bytes, or ``None`` for a type kvjax does not know (one not in :data:`TYPES`).
  """
  if info.type_id not in TYPES:
    return None
  _, block, size = TYPES[info.type_id]
  return math.prod(info.dims) // block * size


def check_layout(
  infos: list[TensorInfo], data_start: int, alignment: int, file_size: int, path
) -> None:
  """Checks that tensor data is aligned, inside the file and never overlapping.

  Offsets are relative to the data section (``data_start``), as llama.cpp's ``gguf.cpp`` reads
  them: a misaligned offset would read every element shifted, an overlapping one another
  tensor's weights, so both are refused rather than loaded as wrong weights. A tensor of a type
  kvjax does not know has no known size: only its start is checked (:func:`check_tensors` refuses
  its type).

  Args:
    infos: the tensor table, with absolute offsets (as in :class:`TensorInfo`).
    data_start: the absolute byte offset of the data section.
    alignment: ``general.alignment``, a power of two.
    file_size: the file's size in bytes.
    path: the file, named in errors.

  Raises:
    ValueError: naming the file, the tensors and their offsets, for a tensor whose data offset is
      not a multiple of ``alignment``, one that ends past the end of the file (a truncated file),
      or two tensors whose bytes overlap.
  """
  spans = []
  for info in infos:
    start = info.offset - data_start
    if start % alignment:
      raise ValueError(
        f"path: GGUF file {path}: tensor {info.name!r} starts at data offset {start}, not a "
        f"multiple of general.alignment {alignment}"
      )
    size = nbytes(info)
    end = info.offset + (size or 0)
    if end > file_size:
      raise ValueError(
        f"path: GGUF file {path} is truncated: tensor {info.name!r} ({info.type_name} "
        f"{list(info.shape)}) ends at byte {end}, the file has {file_size} bytes"
      )
    if size:  # an empty or unknown-size tensor claims no bytes
      spans.append((start, start + size, info.name))
  spans.sort()
  for (a_start, a_end, a_name), (b_start, b_end, b_name) in zip(spans, spans[1:], strict=False):
    if b_start < a_end:
      raise ValueError(
        f"path: GGUF file {path}: tensor {b_name!r} (data bytes {b_start}..{b_end}) overlaps "
        f"tensor {a_name!r} (data bytes {a_start}..{a_end}); each tensor needs its own bytes"
      )


def read_header(path: str | pathlib.Path) -> Header:
  """Reads the metadata and tensor table of a GGUF file, bounds-checked.

  No tensor data is read.

  Args:
    path: the ``.gguf`` file.

  Returns:
    The file's :class:`Header`.

  Raises:
    FileNotFoundError: when there is no file at ``path``.
    ValueError: naming the file, for an empty file, a wrong magic number, an unsupported version,
      a truncated file or a corrupt header (misaligned or overlapping tensor data included, see
      :func:`check_layout`).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"path: no GGUF file at {path}")
  with open(path, "rb") as f:
    if path.stat().st_size == 0:
      raise ValueError(f"path: {path} is empty, not a GGUF file")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
      return _parse_header(buf, path)


def describe(value) -> str:
  """Describes a metadata value for error messages: its type and a short rendering.

  Args:
    value: a metadata value (a scalar, a string, a list or a numpy array).

  Returns:
    A phrase such as ``"an array of 3 int32 values"`` or ``"str 'llama'"``, the rendering cut
    after 60 characters.
  """
  if isinstance(value, np.ndarray):
    return f"an array of {value.size} {value.dtype} values"
  if isinstance(value, list):
    kinds = sorted({type(v).__name__ for v in value})
    return f"an array of {len(value)} {'/'.join(kinds) or 'no'} values"
  text = repr(value)
  return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _lookup(meta: dict, key: str, default, where: str):
  if key in meta:
    return meta[key]
  if default is ...:
    raise ValueError(f"{where} lacks the metadata key {key!r}")
  return default


def _checked(meta: dict, key: str, where: str, default, ok, expected: str):
  """``meta[key]`` when ``ok`` accepts it, ``default`` when the key is absent (``...``: an error),
  else a ``ValueError`` naming the key, the value and ``expected``."""
  value = _lookup(meta, key, default, where)
  if key in meta and not ok(value):
    raise ValueError(f"{where}: metadata {key!r} is {describe(value)}, expected {expected}")
  return value


def _is_int(value) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def metadata_int(meta: dict, key: str, where: str, default: Any = ..., *, minimum: int = 1):
  """Reads an integer metadata value in ``[minimum, 2**31 - 1]``.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"llama.block_count"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.
    minimum: the smallest value accepted.

  Returns:
    ``meta[key]`` as an ``int``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key, a value that is not an integer
      (a string, a float, a bool, an array) or one outside the range.
  """
  ok = lambda v: _is_int(v) and minimum <= v <= INT32_MAX  # noqa: E731
  value = _checked(meta, key, where, default, ok, f"an integer in [{minimum}, {INT32_MAX}]")
  return int(value) if key in meta else value


def metadata_float(meta: dict, key: str, where: str, default: Any = ..., *, positive=False):
  """Reads a finite float metadata value, ``> 0`` when ``positive`` and ``>= 0`` otherwise.

  Integers are accepted, bools and strings are not.

  Args:
    meta, key, where, default: as :func:`metadata_int` (``key``, e.g. ``"llama.rope.freq_base"``).
    positive: whether zero is refused as well.

  Returns:
    ``meta[key]`` as a ``float``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key, a value that is not a finite
      number (a string, a bool, an array, NaN, inf) or one below the bound.
  """

  def ok(v):
    number = (_is_int(v) or isinstance(v, float | np.floating)) and math.isfinite(v)
    return number and v >= 0 and not (positive and v == 0)

  expected = f"a finite number {'> 0' if positive else '>= 0'}"
  value = _checked(meta, key, where, default, ok, expected)
  return float(value) if key in meta else value


def metadata_str(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a string metadata value.

  Args:
    meta, key, where, default: as :func:`metadata_int` (``key``, e.g. ``"general.architecture"``).

  Returns:
    ``meta[key]``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not a string.
  """
  return _checked(meta, key, where, default, lambda v: isinstance(v, str), "a string")


def metadata_bool(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a bool metadata value.

  Args:
    meta, key, where, default: as :func:`metadata_int` (``key``, e.g.
      ``"tokenizer.ggml.add_space_prefix"``).

  Returns:
    ``meta[key]`` as a ``bool``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not a bool.
  """
  value = _checked(meta, key, where, default, lambda v: isinstance(v, bool | np.bool_), "a bool")
  return bool(value) if key in meta else value


def metadata_strings(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a metadata value that is an array of strings.

  Args:
    meta, key, where, default: as :func:`metadata_int` (``key``, e.g. ``"tokenizer.ggml.tokens"``).

  Returns:
    ``meta[key]``, a list of strings, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not an array
      of strings.
  """
  ok = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
  return _checked(meta, key, where, default, ok, "an array of strings")


def metadata_numbers(meta: dict, key: str, where: str, default: Any = ..., *, integer=False):
  """Reads a metadata value that is a numeric array, as numpy.

  Args:
    meta, key, where, default: as :func:`metadata_int` (``key``, e.g. ``"tokenizer.ggml.scores"``).
    integer: whether the array must hold integers.

  Returns:
    ``meta[key]``, a numpy array, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not an array
      of numbers (of integers when ``integer``).
  """
  kinds = "iu" if integer else "iuf"
  ok = lambda v: isinstance(v, np.ndarray) and v.dtype.kind in kinds  # noqa: E731
  return _checked(
    meta, key, where, default, ok, f"an array of {'integers' if integer else 'numbers'}"
  )


def tensor_reader(path: pathlib.Path):
  """Opens a GGUF file's tensors with the ``gguf`` package's ``GGUFReader`` (memory-mapped).

  Args:
    path: the ``.gguf`` file, its header already checked (:func:`read_header`).

  Returns:
    The ``gguf.GGUFReader``; its ``tensors`` list the file's tensors.

  Raises:
    ImportError: when the ``gguf`` package is not installed.
    ValueError: naming the file, when the reader refuses it.
  """
  try:
    from gguf import GGUFReader  # noqa: PLC0415
  except ImportError:
    raise ImportError("reading GGUF tensors needs the gguf package: pip install gguf") from None
  try:
    return GGUFReader(path)
  except Exception as e:  # noqa: BLE001  (the header was checked: whatever remains is corruption)
    raise ValueError(f"path: GGUF file {path} could not be read: {type(e).__name__}: {e}") from None


def dequantize_tensor(tensor, shape: tuple[int, ...], path: pathlib.Path) -> np.ndarray:
  """Dequantises one tensor of a :func:`tensor_reader` to float32 (``gguf.quants.dequantize``).

  Args:
    tensor: the reader's tensor.
    shape: its numpy shape (``[out, in]`` for a weight).
    path: the file, named in errors.

  Returns:
    A float32 copy ``[*shape]``, independent of the file (which may be closed after).

  Raises:
    ValueError: naming the file and the tensor, when its data does not dequantise to ``shape``.
  """
  from gguf.quants import dequantize  # noqa: PLC0415

  try:
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type))
    return np.array(w.reshape(shape), dtype=np.float32)  # a copy: the file may be closed after
  except Exception as e:  # noqa: BLE001
    raise ValueError(
      f"path: GGUF file {path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) could not "
      f"be dequantised to {list(shape)}: {type(e).__name__}: {e}"
    ) from None
