"""Model configuration read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 text, Phi-3).

transformers 5 keeps RoPE settings in ``rope_parameters`` (Gemma 3: one dict per layer type);
older files use ``rope_theta`` and ``rope_scaling``: both are accepted. RoPE scalings follow
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``: ``default``, ``linear``, ``dynamic``,
``yarn``, ``longrope`` and ``llama3``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

SUPPORTED = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "Gemma2ForCausalLM": "gemma2",
  "Gemma3ForCausalLM": "gemma3",
  "Gemma3ForConditionalGeneration": "gemma3",  # its text decoder (``text_config``)
  "Phi3ForCausalLM": "phi3",
}

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
  rope_type: str = "default"  # one of ROPE_TYPES
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  # llama3, yarn, longrope: the pretraining context; dynamic: ``max_position_embeddings``, the
  # length past which its base grows
  rope_original_max_positions: int = 8192
  # yarn and longrope scale cos and sin by it (transformers' ``attention_factor``, resolved)
  rope_attention_factor: float = 1.0
  rope_beta_fast: float = 32.0  # yarn's ramp
  rope_beta_slow: float = 1.0
  rope_truncate: bool = True  # yarn: floor/ceil the correction range
  rope_short_factor: tuple[float, ...] | None = None  # longrope, per frequency
  rope_long_factor: tuple[float, ...] | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias)
  o_bias: bool = False  # Llama's attention_bias also biases o_proj
  qk_norm: bool = False  # Qwen3
  # Mistral, Phi-3: every layer's window; Gemma 2/3: the window of the sliding layers
  sliding_window: int | None = None
  # per layer, "full_attention" or "sliding_attention" (Gemma 2/3); None: every layer alike
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None  # Gemma 3: the sliding layers' (default) RoPE base
  # Gemma: attention logits are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim's
  query_pre_attn_scalar: float | None = None
  attn_softcap: float | None = None  # Gemma 2: cap * tanh(logits / cap) before the softmax
  final_softcap: float | None = None  # Gemma 2: the same on the output logits
  sandwich_norms: bool = False  # Gemma 2/3: RMSNorms after attention and after the MLP too
  mlp_activation: str = "silu"  # silu (SwiGLU) | gelu_tanh (Gemma's GeGLU)
  embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the weights' dtype
  # Gemma's RMSNorm scales in fp32 before the cast (Llama casts first); the stored weight is
  # the effective scale (``1 + w``), as llama.cpp stores it
  norm_scale_fp32: bool = False
  family: str = "llama"
  # The context the checkpoint was trained for (``max_position_embeddings``, GGUF's
  # ``{arch}.context_length``); None when the checkpoint does not say. Entry points refuse a
  # prompt plus generated tokens longer than it.
  max_positions: int | None = None

  @property
  def num_groups(self) -> int:
    """The number of query heads that share one key/value head (GQA's group size)."""
    return self.num_heads // self.num_kv_heads

  @property
  def per_layer(self) -> bool:
    """Whether layers differ (``layer_types`` set): then a layer's RoPE and window need its index."""
    return self.layer_types is not None


def _rope_params(raw: dict) -> tuple[dict, dict | None]:
  """The global layers' RoPE parameters and, when the file has them per layer type, the sliding
  layers' (transformers 5 nests Gemma 3's by layer type; older files give ``rope_scaling``)."""
  params = dict(raw.get("rope_parameters") or {})
  if set(params) & set(LAYER_TYPES):
    local = params.get("sliding_attention")
    return dict(params.get("full_attention") or {}), dict(local) if local is not None else None
  return {**dict(raw.get("rope_scaling") or {}), **params}, None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(raw: dict, family: str, max_positions: int | None) -> dict:
  """``ModelConfig``'s ``rope_*`` fields, as transformers' ``ROPE_INIT_FUNCTIONS`` read the
  parameters (defaults and the attention factors of yarn and longrope resolved here)."""
  params, _ = _rope_params(raw)
  theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default")) or "default"
  if family == "phi3" and rope_type in ("su", "yarn"):  # transformers' Phi3Config renames both
    rope_type = "longrope"
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_type: unsupported {rope_type!r}; supported: {list(ROPE_TYPES)}")
  partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1.0):
    raise ValueError(f"partial_rotary_factor: {partial!r} is not supported; expected 1.0")
  out = dict(rope_theta=float(theta), rope_type=rope_type)
  # Phi-3 keeps the pretraining context outside the RoPE dict, and it wins (standardize_rope_params)
  original = raw.get("original_max_position_embeddings") or params.get(
    "original_max_position_embeddings", max_positions
  )
  if rope_type in ("linear", "dynamic", "llama3") and "factor" not in params:
    raise ValueError(f"rope_parameters: {rope_type!r} RoPE needs a 'factor', got {params!r}")
  if rope_type in ("yarn", "longrope") and original is None:
    raise ValueError(f"rope_parameters: {rope_type!r} needs original_max_position_embeddings")
  if rope_type == "llama3":
    out.update(
      rope_factor=float(params["factor"]),
      rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      rope_original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
    )
  elif rope_type == "linear":
    out.update(rope_factor=float(params["factor"]))
  elif rope_type == "dynamic":
    if max_positions is None:
      raise ValueError("max_position_embeddings: dynamic RoPE needs it, got None")
    out.update(rope_factor=float(params["factor"]), rope_original_max_positions=max_positions)
  elif rope_type == "yarn":
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
      attention = (
        _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        if mscale and mscale_all
        else _yarn_mscale(factor)
      )
    out.update(
      rope_factor=float(factor),
      rope_original_max_positions=int(original),
      rope_attention_factor=float(attention),
      rope_beta_fast=float(params.get("beta_fast") or 32.0),
      rope_beta_slow=float(params.get("beta_slow") or 1.0),
      rope_truncate=bool(params.get("truncate", True)),
    )
  elif rope_type == "longrope":
    out.update(_longrope(params, int(original), max_positions))
  return out


def _longrope(params: dict, original: int, max_positions: int | None) -> dict:
  """LongRoPE's fields (transformers ``_compute_longrope_parameters``)."""
  short, long = params.get("short_factor"), params.get("long_factor")
  if short is None or long is None or len(short) != len(long):
    raise ValueError(
      "rope_parameters: longrope needs short_factor and long_factor of equal lengths, got "
      f"{short!r} and {long!r}"
    )
  factor = params.get("factor")
  if factor is None:  # Phi-3: the ratio of the extended to the pretraining context
    factor = (max_positions or original) / original
  attention = params.get("attention_factor")
  if attention is None:
    attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
  return dict(
    rope_factor=float(factor),
    rope_original_max_positions=original,
    rope_attention_factor=float(attention),
    rope_short_factor=tuple(float(f) for f in short),
    rope_long_factor=tuple(float(f) for f in long),
  )


def _layer_types(raw: dict, family: str, num_layers: int) -> tuple[str, ...] | None:
  """Gemma's per-layer attention: ``layer_types`` when given, else the family's pattern (Gemma 2
  alternates from a sliding layer, Gemma 3 puts a global layer after every
  ``sliding_window_pattern - 1`` sliding ones), as transformers' configs build them."""
  if family not in ("gemma2", "gemma3"):
    return None
  types = raw.get("layer_types")
  if types is None:
    every = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern", 6))
    types = [
      "sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)
    ]
  types = tuple(types)
  if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
    raise ValueError(
      f"layer_types: {list(types)!r}, expected {num_layers} entries from {list(LAYER_TYPES)}"
    )
  return types


def _local_theta(raw: dict) -> float:
  """Gemma 3's sliding-layer RoPE base (default RoPE only, as every Gemma 3 checkpoint has)."""
  _, local = _rope_params(raw)
  if local is None:
    return float(raw.get("rope_local_base_freq", 10000.0))
  kind = local.get("rope_type", local.get("type", "default"))
  if kind != "default":
    raise ValueError(
      f"rope_parameters: sliding_attention rope_type {kind!r} is not supported; expected 'default'"
    )
  return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))


def _max_positions(value) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"max_position_embeddings: {value!r}, expected a positive integer")
  return int(value)


def from_hf_dict(raw: dict) -> ModelConfig:
  """Builds a ``ModelConfig`` from a parsed Hugging Face ``config.json``.

  Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (``Gemma3ForCausalLM``, and the text decoder of
  ``Gemma3ForConditionalGeneration`` from its ``text_config``) and Phi-3 are supported, with
  transformers' defaults for the keys a file leaves out (``Gemma2Config``, ``Gemma3TextConfig``,
  ``Phi3Config``). RoPE settings are read from ``rope_parameters`` (transformers 5) or from
  ``rope_theta`` and ``rope_scaling``; Phi-3's ``su`` and ``yarn`` are ``longrope``, as
  ``Phi3Config`` renames them.

  Args:
    raw: the parsed ``config.json``.

  Returns:
    The model configuration.

  Raises:
    ValueError: for an unsupported architecture (naming it), missing required keys, an
      activation other than SiLU or Gemma's tanh GELU, a RoPE type outside :data:`ROPE_TYPES`
      or with missing parameters, a ``partial_rotary_factor`` other than 1, malformed
      ``layer_types``, or a ``max_position_embeddings`` that is not a positive integer.
  """
  archs = raw.get("architectures") or []
  arch = next((a for a in archs if a in SUPPORTED), None)
  if arch is None:
    raise ValueError(
      f"architectures: {archs or raw.get('model_type')!r} is not supported; "
      f"supported: {sorted(SUPPORTED)}"
    )
  family = SUPPORTED[arch]
  if arch == "Gemma3ForConditionalGeneration":
    if not isinstance(raw.get("text_config"), dict):
      raise ValueError(f"text_config: a {arch} config.json needs its text decoder's config")
    raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
  gemma = family in ("gemma2", "gemma3")
  if gemma:  # transformers' Gemma2Config / Gemma3TextConfig defaults
    defaults = dict(
      head_dim=256,
      query_pre_attn_scalar=256,
      sliding_window=4096,
      tie_word_embeddings=True,
      final_logit_softcapping=30.0 if family == "gemma2" else None,
      attn_logit_softcapping=50.0 if family == "gemma2" else None,
      hidden_activation="gelu_pytorch_tanh",
    )
    if family == "gemma3":
      defaults["rope_theta"] = 1_000_000.0
    raw = {**defaults, **raw}
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
  missing = [k for k in (*required, "num_attention_heads") if k not in raw]
  if missing:
    raise ValueError(f"config: {missing} missing; a {arch} config.json needs {list(required)}")
  act = (
    raw.get("hidden_activation") or raw.get("hidden_act")
    if gemma
    else raw.get("hidden_act", raw.get("hidden_activation", "silu"))
  )
  if act not in ACTIVATIONS:
    raise ValueError(
      f"hidden_act: {act!r} is not supported; kvjax's MLP is SwiGLU ('silu') or GeGLU "
      "('gelu_pytorch_tanh')"
    )
  heads = _whole(raw, "num_attention_heads")
  head_dim = _whole(raw, "head_dim") if raw.get("head_dim") else _whole(raw, "hidden_size") // heads
  num_layers = _whole(raw, "num_hidden_layers")
  max_positions = _max_positions(raw.get("max_position_embeddings"))
  rope = _rope(raw, family, max_positions)
  if rope["rope_type"] == "dynamic":  # dynamic NTK stretches the base to reach past the context
    max_positions = int(rope["rope_factor"] * max_positions)
  use_sliding = family in ("mistral", "phi3") or gemma or raw.get("use_sliding_window", False)
  cfg = ModelConfig(
    vocab_size=_whole(raw, "vocab_size"),
    hidden_size=_whole(raw, "hidden_size"),
    intermediate_size=_whole(raw, "intermediate_size"),
    num_layers=num_layers,
    num_heads=heads,
    num_kv_heads=_whole(raw, "num_key_value_heads") if raw.get("num_key_value_heads") else heads,
    head_dim=head_dim,
    rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
    tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
    o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
    qk_norm=family in ("qwen3", "gemma3"),
    sliding_window=_whole(raw, "sliding_window")
    if use_sliding and raw.get("sliding_window") is not None
    else None,
    family=family,
    max_positions=max_positions,
    layer_types=_layer_types(raw, family, num_layers),
    rope_local_theta=_local_theta(raw) if family == "gemma3" else None,
    query_pre_attn_scalar=_number(raw, "query_pre_attn_scalar") if gemma else None,
    attn_softcap=_number(raw, "attn_logit_softcapping", None) if gemma else None,
    final_softcap=_number(raw, "final_logit_softcapping", None) if gemma else None,
    sandwich_norms=gemma,
    mlp_activation=ACTIVATIONS[act],
    embed_scale=gemma,
    norm_scale_fp32=gemma,
    **rope,
  )
  check_ranges(cfg, HF_NAMES)
  return cfg


# ModelConfig's fields by their config.json keys, for check_ranges' messages
HF_NAMES = {
  "num_layers": "num_hidden_layers",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "rope_local_theta": "rope_local_base_freq",
  "attn_softcap": "attn_logit_softcapping",
  "final_softcap": "final_logit_softcapping",
  "rope_factor": "rope_parameters.factor",
  "rope_low_freq_factor": "rope_parameters.low_freq_factor",
  "rope_high_freq_factor": "rope_parameters.high_freq_factor",
  "rope_original_max_positions": "original_max_position_embeddings",
  "rope_attention_factor": "rope_parameters.attention_factor",
  "rope_beta_fast": "rope_parameters.beta_fast",
  "rope_beta_slow": "rope_parameters.beta_slow",
  "rope_short_factor": "rope_parameters.short_factor",
  "rope_long_factor": "rope_parameters.long_factor",
  "max_positions": "max_position_embeddings",
}


def _whole(raw: dict, key: str) -> int:
  """``raw[key]`` as an int: an integer, or a float that is one (``4096.0``); anything else, a
  bool or a fraction (never truncated) included, is refused naming the key."""
  value = raw.get(key)
  ok = isinstance(value, int | float) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or value != int(value):
    raise ValueError(f"{key}: {value!r}, expected an integer")
  return int(value)


def _number(raw: dict, key: str, default=...):
  """``raw[key]`` as a float (``default`` when absent, or ``null`` for a default of ``None``);
  a value that is not a number (a string, a bool) is refused naming the key."""
  if key not in raw or (raw[key] is None and default is None):
    if default is ...:
      raise ValueError(f"{key}: missing; expected a number")
    return default
  value = raw[key]
  if isinstance(value, bool) or not isinstance(value, int | float):
    raise ValueError(f"{key}: {value!r}, expected a number")
  return float(value)


def _positive(value) -> bool:
  return math.isfinite(value) and value > 0


def check_ranges(cfg: ModelConfig, names: dict | None = None) -> None:
  """Refuses a configuration whose values have no meaning: what would run and produce nonsense
  logits (a window of 0, a negative ``rms_norm_eps``, a soft-cap of 0, a negative RoPE base, a
  NaN ``query_pre_attn_scalar``) instead of an error.

  Sizes and counts are ints >= 1 (the query heads a multiple of the KV heads); ``rms_norm_eps``,
  the RoPE bases, factors and ``query_pre_attn_scalar`` finite and > 0; a window and a soft-cap
  ``None`` (none) or > 0. A format in which a value such as 0 means "none" maps it to ``None``
  before building the configuration (GGUF's ``attention.sliding_window`` of 0).

  Args:
    cfg: the configuration.
    names: the source's name of each field, for the messages (:data:`HF_NAMES` for
      ``config.json``); a field not in it is named as ``ModelConfig`` names it.

  Raises:
    ValueError: naming the field (as the source names it), its value and the range expected.
  """
  names = names or {}

  def refuse(field: str, expected: str):
    raise ValueError(f"{names.get(field, field)}: {getattr(cfg, field)!r}, expected {expected}")

  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
    value = getattr(cfg, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      refuse(field, "an int >= 1")
  for field in ("num_kv_heads", "head_dim"):
    value = getattr(cfg, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      refuse(field, "an int >= 1")
  if cfg.num_heads % cfg.num_kv_heads:
    refuse("num_kv_heads", f"a divisor of num_attention_heads={cfg.num_heads}")
  for field in ("rms_norm_eps", "rope_theta", "rope_factor", "rope_attention_factor"):
    if not _positive(getattr(cfg, field)):
      refuse(field, "a finite number > 0")
  if cfg.rope_type == "llama3" and not (
    _positive(cfg.rope_low_freq_factor) and cfg.rope_high_freq_factor > cfg.rope_low_freq_factor
  ):
    refuse("rope_high_freq_factor", f"above low_freq_factor={cfg.rope_low_freq_factor} > 0")
  if cfg.rope_type == "yarn":
    for field in ("rope_beta_fast", "rope_beta_slow"):
      if not math.isfinite(getattr(cfg, field)):
        refuse(field, "a finite number")
  if cfg.rope_type in ("llama3", "yarn", "longrope") and cfg.rope_original_max_positions < 1:
    refuse("rope_original_max_positions", "an int >= 1")
  for field in ("rope_short_factor", "rope_long_factor"):
    factors = getattr(cfg, field)
    if factors is None:
      continue
    if len(factors) != cfg.head_dim // 2 or not all(_positive(f) for f in factors):
      refuse(field, f"{cfg.head_dim // 2} finite numbers > 0 (one per RoPE frequency)")
  for field in ("rope_local_theta", "query_pre_attn_scalar"):
    if getattr(cfg, field) is not None and not _positive(getattr(cfg, field)):
      refuse(field, "a finite number > 0")
  for field in ("attn_softcap", "final_softcap"):
    if getattr(cfg, field) is not None and not _positive(getattr(cfg, field)):
      refuse(field, "a finite number > 0, or null for no soft-cap")
  window = cfg.sliding_window
  if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
    refuse("sliding_window", "an int >= 1, or null for no window")


def to_hf_dict(cfg: ModelConfig) -> dict:
  """Writes a configuration as a Hugging Face ``config.json`` object.

  :func:`from_hf_dict` and ``transformers`` read it back to ``cfg``; ``max_position_embeddings``
  is written only when ``cfg.max_positions`` is set (so an unknown context stays unknown).

  Args:
    cfg: the model configuration.

  Returns:
    The ``config.json`` object, ready for ``json.dumps``.

  Raises:
    ValueError: when ``cfg.rope_type`` is not ``"default"``, or ``cfg.family`` is not one of
      Llama, Mistral, Qwen2 and Qwen3 (Gemma and Phi-3 checkpoints are read, not written).
  """
  writable = ("llama", "mistral", "qwen2", "qwen3")
  if cfg.family not in writable:
    raise ValueError(f"cfg: writing family {cfg.family!r} is not supported; expected {writable}")
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
