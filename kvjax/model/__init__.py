"""Real models: a flax nnx Llama-family decoder, HF checkpoint loading, a compressed KV cache."""

from kvjax.model import llama
from kvjax.model.config import ModelConfig, from_hf_dict
from kvjax.model.llama import Llama, forward, prefill
from kvjax.model.loading import load, load_tiny, save

__all__ = [
  "Llama",
  "ModelConfig",
  "cache",
  "forward",
  "from_hf_dict",
  "llama",
  "load",
  "load_tiny",
  "prefill",
  "save",
]

from kvjax.model import cache  # noqa: E402
from kvjax.model.generate import answer_configs, generate, generate_configs  # noqa: E402

__all__ += ["answer_configs", "generate", "generate_configs"]
