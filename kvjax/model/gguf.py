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

The file is read by :mod:`~kvjax.model.gguf_reader` (the header parsed with bounds checks before
``gguf`` sees the file, typed metadata, dequantisation) and its configuration built by
:mod:`~kvjax.model.gguf_config`; their names are re-exported here (``gguf.read_header``,
``gguf.config_from_header``). A wrong magic number, a truncated file, a corrupt header, an
unsupported architecture or quantisation type, a metadata value of the wrong type or a tensor
shaped otherwise than the configuration says raises ``ValueError`` naming the file (and the
tensor or key), so a file never loads as wrong weights.
"""

from __future__ import annotations

import pathlib

import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.gguf_config import (
  ARCHITECTURES,
  GEMMA,
  LARGE_LAYERS,
  LOCAL_ROPE_BASE,
  ROPE_FACTORS,
  ROPE_FREQS,
  SUPPORTED_ARCHITECTURES,
  SWA_PATTERN,
  architecture,
  check_tensors,
  config_from_header,
  expected_shapes,
  llama3_rope,
  phi3_longrope,
)
from kvjax.model.gguf_reader import (
  DEFAULT_ALIGNMENT,
  INT32_MAX,
  MAGIC,
  MAX_DIMS,
  SUPPORTED_TYPES,
  TYPES,
  VERSIONS,
  Header,
  TensorInfo,
  check_layout,
  dequantize_tensor,
  describe,
  metadata_bool,
  metadata_float,
  metadata_int,
  metadata_numbers,
  metadata_str,
  metadata_strings,
  nbytes,
  read_header,
  tensor_reader,
  type_name,
)

__all__ = [
  "ARCHITECTURES",
  "ARCH_LAYER_NAMES",
  "DEFAULT_ALIGNMENT",
  "GEMMA",
  "GLOBAL_NAMES",
  "INT32_MAX",
  "LARGE_LAYERS",
  "LAYER_NAMES",
  "LOCAL_ROPE_BASE",
  "MAGIC",
  "MAX_DIMS",
  "ROPE_FACTORS",
  "ROPE_FREQS",
  "SUPPORTED_ARCHITECTURES",
  "SUPPORTED_TYPES",
  "SWA_PATTERN",
  "TYPES",
  "VERSIONS",
  "Header",
  "TensorInfo",
  "architecture",
  "check_layout",
  "check_tensors",
  "config_from_header",
  "dequantize_tensor",
  "describe",
  "expected_shapes",
  "hf_name",
  "llama3_rope",
  "metadata_bool",
  "metadata_float",
  "metadata_int",
  "metadata_numbers",
  "metadata_str",
  "metadata_strings",
  "nbytes",
  "permute",
  "phi3_longrope",
  "read",
  "read_header",
  "tensor_reader",
  "type_name",
  "unpermute",
]

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
  reader = tensor_reader(header.path)
  found = {t.name: t for t in reader.tensors}
  if ROPE_FREQS in found:
    freqs = dequantize_tensor(found[ROPE_FREQS], (cfg.head_dim // 2,), header.path)
    cfg = llama3_rope(cfg, freqs, header.path)
  if cfg.family == "phi3":
    cfg = phi3_longrope(header, cfg, found)
  tensors: dict[str, np.ndarray] = {}
  for name, shape in expected.items():
    w = dequantize_tensor(found[name], shape, header.path)
    if cfg.family in ("llama", "mistral"):
      if name.endswith(("attn_q.weight", "attn_q.bias")):
        w = unpermute(w, cfg.num_heads)
      elif name.endswith(("attn_k.weight", "attn_k.bias")):
        w = unpermute(w, cfg.num_kv_heads)
    if cfg.family in GEMMA and name.endswith("norm.weight"):
      w = w - np.float32(1.0)  # llama.cpp stores Gemma2RMSNorm's 1 + w
    tensors[hf_name(name, architecture(header))] = w
  return cfg, tensors
