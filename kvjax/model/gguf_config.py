"""A GGUF file's :class:`~kvjax.model.config.ModelConfig`: llama.cpp's metadata keys and
hyperparameters per architecture, the tensor table checked against the configuration, and the
RoPE scalings that llama.cpp writes as tensors (Llama 3's ``rope_freqs``, Phi-3's LongRoPE
factors)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kvjax.model.config import ModelConfig, check_ranges
from kvjax.model.gguf_reader import (
  SUPPORTED_TYPES,
  TYPES,
  Header,
  dequantize_tensor,
  describe,
  metadata_float,
  metadata_int,
  metadata_numbers,
  metadata_str,
)
from kvjax.model.rope import inv_frequencies

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
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE


def _uniform(header: Header, key: str, default: Any = ...) -> int:
  """A positive integer, or a per-layer integer array (some converters write one head count per
  layer), which must be uniform here."""
  where = f"path: GGUF file {header.path}"
  value = header.metadata.get(key)
  if not isinstance(value, np.ndarray):  # absent (the default, or an error) or a scalar
    return metadata_int(header.metadata, key, where, default)
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
  cfg = ModelConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=_uniform(header, f"{arch}.feed_forward_length"),
    num_layers=num_layers,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    rms_norm_eps=metadata_float(
      meta, f"{arch}.attention.layer_norm_rms_epsilon", where, positive=True
    ),
    rope_theta=metadata_float(meta, f"{arch}.rope.freq_base", where, 10000.0, positive=True),
    tie_word_embeddings="output.weight" not in names,
    qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
    o_bias=arch != "qwen2" and "blk.0.attn_output.bias" in names,
    qk_norm=arch in ("qwen3", "gemma3"),
    family=family,
    max_positions=integer("context_length", None),
    **fields,
  )
  # every field in range, named as the file names it (GGUF's window of 0 is None above)
  check_ranges(
    cfg, {f: f"path: GGUF file {header.path}: {arch}.{k}" for f, k in _GGUF_NAMES.items()}
  )
  return cfg


# the GGUF metadata key of each ModelConfig field that check_ranges reads
_GGUF_NAMES = {
  "hidden_size": "embedding_length",
  "intermediate_size": "feed_forward_length",
  "num_layers": "block_count",
  "num_heads": "attention.head_count",
  "num_kv_heads": "attention.head_count_kv",
  "head_dim": "attention.key_length",
  "rms_norm_eps": "attention.layer_norm_rms_epsilon",
  "rope_theta": "rope.freq_base",
  "sliding_window": "attention.sliding_window",
  "rope_local_theta": "rope.local.freq_base",
}


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
  default = inv_frequencies(cfg)
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
    if np.allclose(default / inv_frequencies(trial), freq_factors, rtol=1e-4, atol=0):
      return trial
  raise ValueError(
    f"path: GGUF file {path}: tensor {ROPE_FREQS!r} is not Llama 3 RoPE scaling (the only "
    "frequency scaling kvjax supports)"
  )


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
  long, short = (
    dequantize_tensor(found[n], (cfg.head_dim // 2,), header.path) for n in ROPE_FACTORS
  )
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
