"""Model configuration read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3).

transformers 5 keeps RoPE settings in ``rope_parameters``; older files use ``rope_theta`` and
``rope_scaling``: both are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

SUPPORTED = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The static description of a Llama-family decoder (hashable: usable as a jit static arg)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_type: str = "default"  # default | llama3
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias)
  o_bias: bool = False  # Llama's attention_bias also biases o_proj
  qk_norm: bool = False  # Qwen3
  sliding_window: int | None = None  # Mistral (when the prompt is longer than it)
  family: str = "llama"
  # The context the checkpoint was trained for (``max_position_embeddings``, GGUF's
  # ``{arch}.context_length``); None when the checkpoint does not say. Entry points refuse a
  # prompt plus generated tokens longer than it.
  max_positions: int | None = None

  @property
  def num_groups(self) -> int:
    """The number of query heads that share one key/value head (GQA's group size)."""
    return self.num_heads // self.num_kv_heads


def _rope(raw: dict) -> dict:
  params = dict(raw.get("rope_parameters") or {})
  scaling = dict(raw.get("rope_scaling") or {})
  params = {**scaling, **params}
  theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default")) or "default"
  if rope_type not in ("default", "llama3"):
    raise ValueError(f"rope_type: unsupported {rope_type!r}; supported: 'default', 'llama3'")
  out = dict(rope_theta=float(theta), rope_type=rope_type)
  if rope_type == "llama3":
    out.update(
      rope_factor=float(params["factor"]),
      rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      rope_original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
    )
  return out


def _max_positions(value) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"max_position_embeddings: {value!r}, expected a positive integer")
  return int(value)


def from_hf_dict(raw: dict) -> ModelConfig:
  """Builds a ``ModelConfig`` from a parsed Hugging Face ``config.json``.

  Llama, Mistral, Qwen2 and Qwen3 are supported. RoPE settings are read from
  ``rope_parameters`` (transformers 5) or from ``rope_theta`` and ``rope_scaling``.

  Args:
    raw: the parsed ``config.json``.

  Returns:
    The model configuration.

  Raises:
    ValueError: for an unsupported architecture (naming it), missing required keys, an
      activation other than SiLU, a RoPE type other than ``default`` or ``llama3``, or a
      ``max_position_embeddings`` that is not a positive integer.
  """
  archs = raw.get("architectures") or []
  arch = next((a for a in archs if a in SUPPORTED), None)
  if arch is None:
    raise ValueError(
      f"architectures: {archs or raw.get('model_type')!r} is not supported; "
      f"supported: {sorted(SUPPORTED)}"
    )
  family = SUPPORTED[arch]
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
  missing = [k for k in (*required, "num_attention_heads") if k not in raw]
  if missing:
    raise ValueError(f"config: {missing} missing; a {arch} config.json needs {list(required)}")
  act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
  if act not in ("silu", "swish"):
    raise ValueError(f"hidden_act: {act!r} is not supported; kvjax's MLP is SwiGLU ('silu')")
  heads = int(raw["num_attention_heads"])
  head_dim = raw.get("head_dim") or int(raw["hidden_size"]) // heads
  use_sliding = family == "mistral" or raw.get("use_sliding_window", False)
  return ModelConfig(
    vocab_size=int(raw["vocab_size"]),
    hidden_size=int(raw["hidden_size"]),
    intermediate_size=int(raw["intermediate_size"]),
    num_layers=int(raw["num_hidden_layers"]),
    num_heads=heads,
    num_kv_heads=int(raw.get("num_key_value_heads") or heads),
    head_dim=int(head_dim),
    rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
    o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
    qk_norm=family == "qwen3",
    sliding_window=raw.get("sliding_window") if use_sliding else None,
    family=family,
    max_positions=_max_positions(raw.get("max_position_embeddings")),
    **_rope(raw),
  )


def to_hf_dict(cfg: ModelConfig) -> dict:
  """Writes a configuration as a Hugging Face ``config.json`` object.

  :func:`from_hf_dict` and ``transformers`` read it back to ``cfg``; ``max_position_embeddings``
  is written only when ``cfg.max_positions`` is set (so an unknown context stays unknown).

  Args:
    cfg: the model configuration.

  Returns:
    The ``config.json`` object, ready for ``json.dumps``.

  Raises:
    ValueError: when ``cfg.rope_type`` is not ``"default"``.
  """
  arch = {v: k for k, v in SUPPORTED.items()}[cfg.family]
  if cfg.rope_type != "default":
    raise ValueError(f"cfg: writing rope_type {cfg.rope_type!r} is not supported")
  out = {
    "architectures": [arch],
    "model_type": cfg.family,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "hidden_act": "silu",
    "torch_dtype": "float32",
  }
  if cfg.max_positions is not None:
    out["max_position_embeddings"] = cfg.max_positions
  if cfg.family == "llama":
    out["attention_bias"] = cfg.qkv_bias
  if cfg.sliding_window is not None:
    out["sliding_window"] = cfg.sliding_window
  return out


def from_pretrained_dir(path: str | pathlib.Path) -> ModelConfig:
  """Reads the configuration of a Hugging Face model directory from its ``config.json``.

  Args:
    path: the directory.

  Returns:
    The model configuration (:func:`from_hf_dict`).

  Raises:
    ValueError: naming the directory or the file, when it has no ``config.json``, the file is not
      valid JSON, or :func:`from_hf_dict` refuses it.
  """
  path = pathlib.Path(path)
  config_path = path / "config.json"
  if not config_path.exists():
    raise ValueError(f"path: {path} has no config.json")
  try:
    raw = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"config: {config_path} is not valid JSON ({e})") from None
  try:
    return from_hf_dict(raw)
  except ValueError as e:
    raise ValueError(f"{config_path}: {e}") from None
