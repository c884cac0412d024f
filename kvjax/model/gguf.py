"""GGUF checkpoints (llama.cpp's format) -> ``(ModelConfig, Hugging Face-named float32 tensors)``.

:func:`read` maps a GGUF file onto exactly what :func:`kvjax.model.loading.params_from_tensors`
takes from a safetensors checkpoint, so both paths build the model identically. It follows the
references that write and read these files:

* llama.cpp's ``gguf-py``: ``GGUFReader`` maps the tensors, ``gguf.quants.dequantize`` unpacks
  them (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K);
* llama.cpp's ``convert_hf_to_gguf.py``: the tensor names, the metadata keys, and
  ``LlamaModel.permute``, which reorders the rows of every ``llama``-architecture query and key
  projection (weights and biases) for ggml's interleaved RoPE; :func:`unpermute` is its exact
  inverse. ``qwen2`` and ``qwen3`` files are written unpermuted. A Llama 3 ``rope_freqs`` tensor
  is matched back to the ``llama3`` RoPE scaling parameters that produced it;
* ``transformers``' GGUF loader (``modeling_gguf_pytorch_utils.py``), against which the tests
  check the logits: tied embeddings when ``output.weight`` is absent, Mistral as a ``llama`` file
  whose ``general.name`` says so;
* llama.cpp's ``Gemma2Model``, ``Gemma3Model`` and ``Phi3MiniModel`` converters and its
  ``llama-model.cpp`` hyperparameters: Gemma's norm weights are stored with the ``+ 1`` of
  ``Gemma2RMSNorm`` added (subtracted here, so the tensors are Hugging Face's), its sliding
  layers follow llama.cpp's fixed pattern (every 2nd layer global in ``gemma2``, every 6th in
  ``gemma3``, unless ``attention.sliding_window_pattern`` says otherwise), Gemma 3's sliding
  layers rotate at base 10000 (``rope.freq_base_swa`` when present), its global layers take
  ``rope.scaling`` (linear), the attention scale is ``head_dim ** -0.5`` except for the 27B
  models (46 layers in ``gemma2``, 62 in ``gemma3``: ``(hidden / heads) ** -0.5``); Phi-3's
  ``attn_qkv`` and ``ffn_up`` (gate and up) stay fused, as its Hugging Face checkpoints, and
  its LongRoPE factors are the tensors ``rope_factors_long`` and ``rope_factors_short``.

The header (metadata and tensor table) is parsed here with bounds checks before ``gguf`` sees the
file, so a wrong magic number, a truncated file, a corrupt header, an unsupported architecture or
an unsupported quantisation type raises ``ValueError`` naming the file (and the tensor) instead of
a numpy or struct error deep inside the reader, and :mod:`kvjax.model.tokenizer` reads a
tokenizer from the metadata without the ``gguf`` package. Every tensor's data must be aligned to
``general.alignment``, inside the file and apart from every other tensor's (:func:`check_layout`),
every metadata value must have the type its key needs (``metadata_int`` and its siblings name the
key, the value's type and what was expected), and every tensor's shape is checked against the
configuration, so a file never loads as wrong weights.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import pathlib
import struct
from typing import Any

import numpy as np

from kvjax.model import llama
from kvjax.model.config import ModelConfig

ARCHITECTURES = {
  "llama": "llama",
  "qwen2": "qwen2",
  "qwen3": "qwen3",
  "gemma2": "gemma2",
  "gemma3": "gemma3",
  "phi3": "phi3",
}
SUPPORTED_ARCHITECTURES = "llama (Llama, Mistral), qwen2, qwen3, gemma2, gemma3, phi3"
GEMMA = ("gemma2", "gemma3")
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's hparams.set_swa_pattern per architecture
LARGE_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B by block count
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3

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

# GGUF tensor name -> Hugging Face name ("{i}" is the layer)
GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_output.bias": "self_attn.o_proj.bias",
  "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
# the same GGUF names that mean other Hugging Face tensors in some architectures
ARCH_LAYER_NAMES = {
  "gemma2": {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
  },
  "phi3": {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
  },
}
ARCH_LAYER_NAMES["gemma3"] = ARCH_LAYER_NAMES["gemma2"]
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
  """Maps a GGUF tensor name to its Hugging Face tensor name.

  Args:
    gguf_name: the GGUF name, e.g. ``"blk.3.attn_q.weight"``.
    arch: the file's architecture (Gemma's and Phi-3's layers name some tensors otherwise).

  Returns:
    The Hugging Face name, e.g. ``"model.layers.3.self_attn.q_proj.weight"``, or ``None`` for a
    GGUF name that has none (``rope_freqs.weight``, a tensor kvjax does not use).
  """
  if gguf_name in GLOBAL_NAMES:
    return GLOBAL_NAMES[gguf_name]
  names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
    return f"model.layers.{int(parts[1])}.{names[parts[2]]}"
  return None


# --------------------------------------------------------------------------- the header


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


# --------------------------------------------------------------------------- the configuration


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
  value = _lookup(meta, key, default, where)
  if key not in meta:
    return value
  if not _is_int(value) or not minimum <= value <= INT32_MAX:
    raise ValueError(
      f"{where}: metadata {key!r} is {describe(value)}, expected an integer in "
      f"[{minimum}, {INT32_MAX}]"
    )
  return int(value)


def metadata_float(meta: dict, key: str, where: str, default: Any = ..., *, positive=False):
  """Reads a finite float metadata value, ``> 0`` when ``positive`` and ``>= 0`` otherwise.

  Integers are accepted, bools and strings are not.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"llama.rope.freq_base"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.
    positive: whether zero is refused as well.

  Returns:
    ``meta[key]`` as a ``float``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key, a value that is not a finite
      number (a string, a bool, an array, NaN, inf) or one below the bound.
  """
  value = _lookup(meta, key, default, where)
  if key not in meta:
    return value
  number = (_is_int(value) or isinstance(value, float | np.floating)) and math.isfinite(value)
  if not number or value < 0 or (positive and value == 0):
    raise ValueError(
      f"{where}: metadata {key!r} is {describe(value)}, expected a finite number "
      f"{'> 0' if positive else '>= 0'}"
    )
  return float(value)


def metadata_str(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a string metadata value.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"general.architecture"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.

  Returns:
    ``meta[key]``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not a string.
  """
  value = _lookup(meta, key, default, where)
  if key in meta and not isinstance(value, str):
    raise ValueError(f"{where}: metadata {key!r} is {describe(value)}, expected a string")
  return value


def metadata_bool(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a bool metadata value.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"tokenizer.ggml.add_space_prefix"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.

  Returns:
    ``meta[key]`` as a ``bool``, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not a bool.
  """
  value = _lookup(meta, key, default, where)
  if key in meta and not isinstance(value, bool | np.bool_):
    raise ValueError(f"{where}: metadata {key!r} is {describe(value)}, expected a bool")
  return value if key not in meta else bool(value)


def metadata_strings(meta: dict, key: str, where: str, default: Any = ...):
  """Reads a metadata value that is an array of strings.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"tokenizer.ggml.tokens"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.

  Returns:
    ``meta[key]``, a list of strings, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not an array
      of strings.
  """
  value = _lookup(meta, key, default, where)
  if key in meta and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
    raise ValueError(
      f"{where}: metadata {key!r} is {describe(value)}, expected an array of strings"
    )
  return value


def metadata_numbers(meta: dict, key: str, where: str, default: Any = ..., *, integer=False):
  """Reads a metadata value that is a numeric array, as numpy.

  Args:
    meta: a GGUF file's metadata (:attr:`Header.metadata`).
    key: the metadata key, e.g. ``"tokenizer.ggml.scores"``.
    where: how errors name the file, e.g. ``"path: GGUF file m.gguf"``.
    default: returned as is when ``key`` is absent; ``...`` makes the key required.
    integer: whether the array must hold integers.

  Returns:
    ``meta[key]``, a numpy array, or ``default`` when ``key`` is absent.

  Raises:
    ValueError: naming the file and the key, for a missing key or a value that is not an array
      of numbers (of integers when ``integer``).
  """
  value = _lookup(meta, key, default, where)
  if key not in meta:
    return value
  kinds = "iu" if integer else "iuf"
  if not (isinstance(value, np.ndarray) and value.dtype.kind in kinds):
    raise ValueError(
      f"{where}: metadata {key!r} is {describe(value)}, expected an array of "
      f"{'integers' if integer else 'numbers'}"
    )
  return value


def _uniform(header: Header, key: str, default: Any = ...) -> int:
  """A positive integer, or a per-layer integer array (some converters write one head count per
  layer), which must be uniform here."""
  where = f"path: GGUF file {header.path}"
  value = _lookup(header.metadata, key, default, where)
  if not isinstance(value, np.ndarray):
    return metadata_int({key: value}, key, where)
  metadata_numbers({key: value}, key, where, integer=True)
  values = sorted({int(v) for v in value.ravel()})
  if len(values) != 1:
    raise ValueError(
      f"{where} has per-layer {key} {values}; kvjax supports one value for every layer"
    )
  return metadata_int({key: values[0]}, key, where)


def architecture(header: Header) -> str:
  """Returns a GGUF file's ``general.architecture``, checked to be supported.

  Args:
    header: the file's header (:func:`read_header`).

  Returns:
    The architecture, one of :data:`ARCHITECTURES`.

  Raises:
    ValueError: naming the file, when the key is missing, is not a string or names an
      unsupported architecture.
  """
  arch = metadata_str(header.metadata, "general.architecture", f"path: GGUF file {header.path}")
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"path: GGUF file {header.path} has architecture {arch!r}; supported: "
      f"{SUPPORTED_ARCHITECTURES}"
    )
  return arch


def _rope_scaling(header: Header, arch: str) -> dict:
  """The ``rope_*`` fields of the metadata's scaling: none, or (``gemma3``'s global layers)
  linear; Llama 3's comes from a ``rope_freqs`` tensor and Phi-3's from its factor tensors."""
  where = f"path: GGUF file {header.path}"
  kind = metadata_str(header.metadata, f"{arch}.rope.scaling.type", where, "none")
  factor = metadata_float(header.metadata, f"{arch}.rope.scaling.factor", where, 1.0)
  if kind in ("none", "") or (kind == "linear" and factor == 1.0):
    return {}
  if kind == "linear" and arch == "gemma3":
    return dict(rope_type="linear", rope_factor=factor)
  raise ValueError(
    f"path: GGUF file {header.path} has RoPE scaling {kind!r} (factor {factor}); supported: "
    "none, linear (gemma3), Llama 3 scaling given by a rope_freqs tensor, or Phi-3's LongRoPE "
    "given by rope_factors tensors"
  )


def _family_fields(header: Header, arch: str, num_layers: int, hidden: int, heads: int) -> dict:
  """The ``ModelConfig`` fields of Gemma 2/3 and Phi-3 files (llama.cpp's hyperparameters)."""
  where, meta = f"path: GGUF file {header.path}", header.metadata
  window = metadata_int(meta, f"{arch}.attention.sliding_window", where, 0, minimum=0)
  if arch == "phi3":  # llama.cpp's converter writes 0 for no window (Phi-4)
    return dict(sliding_window=window or None)
  if arch not in GEMMA:
    return {}
  head_dim = metadata_int(meta, f"{arch}.attention.key_length", where, hidden // heads)
  large = num_layers == LARGE_LAYERS[arch]
  softcap = lambda key: metadata_float(meta, f"{arch}.{key}", where, None, positive=True)  # noqa: E731
  fields = dict(
    sliding_window=window or None,
    layer_types=_gguf_layer_types(header, arch, num_layers),
    query_pre_attn_scalar=float(hidden // heads if large else head_dim),
    attn_softcap=softcap("attn_logit_softcapping") if arch == "gemma2" else None,
    final_softcap=softcap("final_logit_softcapping") if arch == "gemma2" else None,
    sandwich_norms=True,
    mlp_activation="gelu_tanh",
    embed_scale=True,
    norm_scale_fp32=True,
  )
  if arch == "gemma3":
    fields["rope_local_theta"] = metadata_float(
      meta, f"{arch}.rope.freq_base_swa", where, LOCAL_ROPE_BASE, positive=True
    )
  return fields


def _gguf_layer_types(header: Header, arch: str, num_layers: int) -> tuple[str, ...]:
  """Sliding or global per layer: ``attention.sliding_window_pattern`` (a period, or one bool per
  layer, true for sliding) when present, else llama.cpp's fixed period (a layer is sliding
  unless it ends a period)."""
  key = f"{arch}.attention.sliding_window_pattern"
  value = header.metadata.get(key, SWA_PATTERN[arch])
  if isinstance(value, (list, np.ndarray)):
    if len(value) != num_layers or np.asarray(value).dtype.kind not in "biu":
      raise ValueError(
        f"path: GGUF file {header.path}: {key} is {describe(value)}, expected {num_layers} bools"
      )
    sliding = [bool(v) for v in value]
  else:
    period = metadata_int(header.metadata, key, f"path: GGUF file {header.path}", SWA_PATTERN[arch])
    sliding = [i % period < period - 1 for i in range(num_layers)]
  return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def config_from_header(header: Header) -> ModelConfig:
  """Builds the :class:`ModelConfig` of a ``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``
  or ``phi3`` GGUF file (Gemma's and Phi-3's fields as llama.cpp sets them: the module's notes).

  The configuration is the one before any ``rope_freqs`` tensor (Llama 3 RoPE scaling, see
  :func:`llama3_rope`) is applied. Every metadata value is type-checked;
  ``{arch}.context_length``, when present, is ``max_positions``. A head count or feed-forward
  length given per layer must be the same for every layer. A ``llama`` file whose
  ``general.name`` says Mistral has the family ``"mistral"``.

  Args:
    header: the file's header (:func:`read_header`).

  Returns:
    The model's configuration.

  Raises:
    ValueError: naming the file and the key, for an unsupported architecture, a missing metadata
      key, a value of the wrong type or range (naming the value's type and what was expected),
      per-layer values that differ between layers, key, value and RoPE dimensions that differ,
      RoPE scaling other than Llama 3's, a missing ``token_embd.weight`` or a ``vocab_size`` that
      disagrees with its rows.
  """
  arch = architecture(header)
  where, meta = f"path: GGUF file {header.path}", header.metadata

  def integer(name, default=...):
    return metadata_int(meta, f"{arch}.{name}", where, default)

  hidden = integer("embedding_length")
  heads = _uniform(header, f"{arch}.attention.head_count")
  kv_heads = _uniform(header, f"{arch}.attention.head_count_kv", heads)
  rotary = integer("rope.dimension_count", None)
  head_dim = integer("attention.key_length", rotary if rotary is not None else hidden // heads)
  value_dim = integer("attention.value_length", head_dim)
  rotary = head_dim if rotary is None else rotary
  if value_dim != head_dim or rotary != head_dim:
    raise ValueError(
      f"path: GGUF file {header.path} has key length {head_dim}, value length {value_dim} and "
      f"RoPE dimension {rotary}; kvjax supports equal ones (full rotary heads)"
    )
  scaling = _rope_scaling(header, arch)
  if "token_embd.weight" not in header.tensors:
    raise ValueError(f"path: GGUF file {header.path} lacks the tensor 'token_embd.weight'")
  vocab = header.tensors["token_embd.weight"].shape[0]
  stated = integer("vocab_size", vocab)
  if stated != vocab:
    raise ValueError(
      f"path: GGUF file {header.path} states {arch}.vocab_size {stated} but token_embd.weight "
      f"has {vocab} rows"
    )
  name = metadata_str(meta, "general.name", where, "").lower()
  family = "mistral" if arch == "llama" and "mistral" in name else ARCHITECTURES[arch]
  names = header.tensors
  num_layers = integer("block_count")
  # llama.cpp attends to every key for llama, qwen2 and qwen3
  fields = {
    "sliding_window": None,
    **scaling,
    **_family_fields(header, arch, num_layers, hidden, heads),
  }
  return ModelConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=_uniform(header, f"{arch}.feed_forward_length"),
    num_layers=num_layers,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    rms_norm_eps=metadata_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", where),
    rope_theta=metadata_float(meta, f"{arch}.rope.freq_base", where, 10000.0, positive=True),
    tie_word_embeddings="output.weight" not in names,
    qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
    o_bias=arch != "qwen2" and "blk.0.attn_output.bias" in names,
    qk_norm=arch in ("qwen3", "gemma3"),
    family=family,
    max_positions=integer("context_length", None),
    **fields,
  )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Lists the GGUF tensors a configuration needs, with their shapes.

  Args:
    cfg: the model configuration.

  Returns:
    GGUF tensor name -> numpy shape (``[out, in]`` for a weight), for every layer; ``rope_freqs``
    is not among them.
  """
  d, F, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
  q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
  layer = {
    "attn_norm.weight": (d,),
    "attn_q.weight": (q, d),
    "attn_k.weight": (kv, d),
    "attn_v.weight": (kv, d),
    "attn_output.weight": (d, q),
    "ffn_norm.weight": (d,),
    "ffn_gate.weight": (F, d),
    "ffn_up.weight": (F, d),
    "ffn_down.weight": (d, F),
  }
  if cfg.qkv_bias:
    layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
  if cfg.o_bias:
    layer["attn_output.bias"] = (d,)
  if cfg.qk_norm:
    layer |= {"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)}
  if cfg.sandwich_norms:
    layer |= {"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)}
  if cfg.family == "phi3":  # fused, as llama.cpp's Phi3MiniModel writes them
    for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
      del layer[name]
    layer |= {"attn_qkv.weight": (q + 2 * kv, d), "ffn_up.weight": (2 * F, d)}
  out = {"token_embd.weight": (V, d), "output_norm.weight": (d,)}
  if not cfg.tie_word_embeddings:
    out["output.weight"] = (V, d)
  for i in range(cfg.num_layers):
    out |= {f"blk.{i}.{k}": v for k, v in layer.items()}
  return out


def check_tensors(header: Header, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Checks a GGUF file's tensor table against its configuration.

  Every tensor ``cfg`` needs must be present, shaped as expected and of a supported type; no
  tensor may be left over (a leftover would be silently ignored weights).

  Args:
    header: the file's header (:func:`read_header`).
    cfg: the configuration read from it (:func:`config_from_header`).

  Returns:
    :func:`expected_shapes` of ``cfg``: GGUF tensor name -> numpy shape.

  Raises:
    ValueError: naming the file and the tensor, for a missing tensor, a shape other than the
      metadata's, a quantisation type kvjax does not dequantise, a mis-shaped ``rope_freqs`` or
      tensors the model does not use.
  """
  expected = expected_shapes(cfg)
  path = header.path
  for name, shape in expected.items():
    if name not in header.tensors:
      raise ValueError(f"path: GGUF file {path} lacks the tensor {name!r} (shape {list(shape)})")
    info = header.tensors[name]
    if info.shape != shape:
      raise ValueError(
        f"path: GGUF file {path}: tensor {name!r} has shape {list(info.shape)}, expected "
        f"{list(shape)} from the metadata"
      )
  for info in header.tensors.values():
    if info.type_id not in TYPES:
      raise ValueError(
        f"path: GGUF file {path}: tensor {info.name!r} has quantisation type {info.type_name}; "
        f"supported: {SUPPORTED_TYPES}"
      )
  if ROPE_FREQS in header.tensors and header.tensors[ROPE_FREQS].shape != (cfg.head_dim // 2,):
    raise ValueError(
      f"path: GGUF file {path}: tensor {ROPE_FREQS!r} has shape "
      f"{list(header.tensors[ROPE_FREQS].shape)}, expected {[cfg.head_dim // 2]}"
    )
  for name in ROPE_FACTORS:
    if name in header.tensors and header.tensors[name].shape != (cfg.head_dim // 2,):
      raise ValueError(
        f"path: GGUF file {path}: tensor {name!r} has shape "
        f"{list(header.tensors[name].shape)}, expected {[cfg.head_dim // 2]}"
      )
  allowed = {ROPE_FREQS, *(ROPE_FACTORS if cfg.family == "phi3" else ())}
  extra = sorted(set(header.tensors) - set(expected) - allowed)
  if extra:
    raise ValueError(
      f"path: GGUF file {path} has tensors a {cfg.family} model of this configuration does not "
      f"use: {extra[:8]}{' ...' if len(extra) > 8 else ''}"
    )
  return expected


# candidate Llama 3 RoPE parameters (low_freq_factor, high_freq_factor, original positions)
_LLAMA3_GRID = [
  (low, high, old)
  for low in (1.0, 2.0, 4.0)
  for high in (2.0, 4.0, 8.0, 16.0, 32.0)
  for old in (2048, 4096, 8192, 16384, 32768, 65536, 131072)
  if high > low
]


def llama3_rope(cfg: ModelConfig, freq_factors: np.ndarray, path) -> ModelConfig:
  """Returns ``cfg`` with the ``llama3`` RoPE scaling that ``freq_factors`` encodes.

  llama.cpp's converter (``LlamaModel.generate_extra_tensors``) writes Llama 3 scaling as the
  tensor ``rope_freqs`` = default inverse frequency / scaled one; this finds the
  (factor, low, high, original positions) that reproduce it.

  Args:
    cfg: the configuration read from the metadata (default RoPE).
    freq_factors: the ``rope_freqs`` tensor, the per-frequency divisors, ``[head_dim // 2]``.
    path: the file, named in errors.

  Returns:
    ``cfg`` itself when every factor is 1 (no scaling), else a copy with ``rope_type="llama3"``
    and the parameters found.

  Raises:
    ValueError: naming the file, when no Llama 3 RoPE parameters reproduce ``freq_factors``.
  """
  freq_factors = np.asarray(freq_factors, np.float64)
  if np.allclose(freq_factors, 1.0, rtol=0, atol=1e-6):
    return cfg
  default = llama.inv_frequencies(cfg)
  factor = float(np.round(freq_factors.max(), 4))
  for low, high, old in _LLAMA3_GRID:
    trial = dataclasses.replace(
      cfg,
      rope_type="llama3",
      rope_factor=factor,
      rope_low_freq_factor=low,
      rope_high_freq_factor=high,
      rope_original_max_positions=old,
    )
    if np.allclose(default / llama.inv_frequencies(trial), freq_factors, rtol=1e-4, atol=0):
      return trial
  raise ValueError(
    f"path: GGUF file {path}: tensor {ROPE_FREQS!r} is not Llama 3 RoPE scaling (the only "
    "frequency scaling kvjax supports)"
  )


# --------------------------------------------------------------------------- the tensors


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Applies llama.cpp's ``LlamaModel.permute`` to a query or key projection's rows.

  Within each head, rotate_half's halves ``[x0..x_{D/2-1}, y0..]`` become pairs ``x0 y0 x1 y1``.

  Args:
    w: the projection's weight ``[n_head * D, in]`` or bias ``[n_head * D]``.
    n_head: the number of heads it projects to (query heads, or key/value heads).

  Returns:
    ``w`` with its rows reordered, of the same shape.
  """
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes :func:`permute` exactly.

  ``unpermute(permute(w, n), n) == w``.

  Args:
    w: a permuted weight ``[n_head * D, in]`` or bias ``[n_head * D]``.
    n_head: the number of heads it projects to (query heads, or key/value heads).

  Returns:
    ``w`` with its rows in Hugging Face (rotate_half) order, of the same shape.
  """
  return (
    w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def _reader(path: pathlib.Path):
  try:
    from gguf import GGUFReader  # noqa: PLC0415
  except ImportError:
    raise ImportError("reading GGUF tensors needs the gguf package: pip install gguf") from None
  try:
    return GGUFReader(path)
  except Exception as e:  # noqa: BLE001  (the header was checked: whatever remains is corruption)
    raise ValueError(f"path: GGUF file {path} could not be read: {type(e).__name__}: {e}") from None


def _dequantize(tensor, shape: tuple[int, ...], path: pathlib.Path) -> np.ndarray:
  from gguf.quants import dequantize  # noqa: PLC0415

  try:
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type))
    return np.array(w.reshape(shape), dtype=np.float32)  # a copy: the file may be closed after
  except Exception as e:  # noqa: BLE001
    raise ValueError(
      f"path: GGUF file {path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) could not "
      f"be dequantised to {list(shape)}: {type(e).__name__}: {e}"
    ) from None


def read(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads a GGUF checkpoint as its configuration and Hugging Face-named float32 tensors.

  The tensors are what :func:`kvjax.model.loading.params_from_tensors` takes: Hugging Face
  names, dequantised ``[out, in]`` float32 weights, the query and key projections of ``llama``
  files unpermuted (:func:`unpermute`); a ``rope_freqs`` tensor becomes Llama 3 RoPE scaling in
  the configuration (:func:`llama3_rope`).

  Args:
    path: the ``.gguf`` file.

  Returns:
    ``(config, tensors)``: the :class:`ModelConfig` and Hugging Face tensor name -> float32 numpy
    array.

  Raises:
    FileNotFoundError: when there is no file at ``path``.
    ImportError: when the ``gguf`` package is not installed.
    ValueError: naming the file (and the tensor), for an unsupported architecture or quantisation
      type, a missing or mis-shaped tensor, a truncated file, a wrong magic number or a corrupt
      header.
  """
  header = read_header(path)
  cfg = config_from_header(header)
  expected = check_tensors(header, cfg)
  reader = _reader(header.path)
  found = {t.name: t for t in reader.tensors}
  if ROPE_FREQS in found:
    freqs = _dequantize(found[ROPE_FREQS], (cfg.head_dim // 2,), header.path)
    cfg = llama3_rope(cfg, freqs, header.path)
  if cfg.family == "phi3":
    cfg = phi3_longrope(header, cfg, found)
  tensors: dict[str, np.ndarray] = {}
  for name, shape in expected.items():
    w = _dequantize(found[name], shape, header.path)
    if cfg.family in ("llama", "mistral"):
      if name.endswith(("attn_q.weight", "attn_q.bias")):
        w = unpermute(w, cfg.num_heads)
      elif name.endswith(("attn_k.weight", "attn_k.bias")):
        w = unpermute(w, cfg.num_kv_heads)
    if cfg.family in GEMMA and name.endswith("norm.weight"):
      w = w - np.float32(1.0)  # llama.cpp stores Gemma2RMSNorm's 1 + w
    tensors[hf_name(name, architecture(header))] = w
  return cfg, tensors


def phi3_longrope(header: Header, cfg: ModelConfig, found: dict) -> ModelConfig:
  """Returns ``cfg`` with the LongRoPE scaling a Phi-3 file's factor tensors encode.

  llama.cpp's ``Phi3MiniModel`` writes ``rope_factors_long`` and ``rope_factors_short``, the
  pretraining context as ``rope.scaling.original_context_length`` and the cos/sin scale as
  ``rope.scaling.attn_factor``; the extended context is ``context_length``.

  Args:
    header: the file's header.
    cfg: the configuration read from the metadata.
    found: GGUF tensor name -> the reader's tensor.

  Returns:
    ``cfg`` itself without both factor tensors, else a copy with ``rope_type="longrope"``.

  Raises:
    ValueError: naming the file, for one factor tensor without the other, or a missing
      original context length.
  """
  present = [n in found for n in ROPE_FACTORS]
  if not any(present):
    return cfg
  where = f"path: GGUF file {header.path}"
  if not all(present):
    raise ValueError(f"{where} has only one of the tensors {list(ROPE_FACTORS)}")
  long, short = (_dequantize(found[n], (cfg.head_dim // 2,), header.path) for n in ROPE_FACTORS)
  original = metadata_int(header.metadata, "phi3.rope.scaling.original_context_length", where)
  factor = (cfg.max_positions or original) / original
  default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
  attention = metadata_float(header.metadata, "phi3.rope.scaling.attn_factor", where, default)
  return dataclasses.replace(
    cfg,
    rope_type="longrope",
    rope_factor=factor,
    rope_original_max_positions=original,
    rope_attention_factor=attention,
    rope_long_factor=tuple(float(f) for f in long),
    rope_short_factor=tuple(float(f) for f in short),
  )
