"""Real models: a flax nnx Llama-family decoder, HF checkpoint loading, a compressed KV cache."""

from kvjax.model import llama
from kvjax.model.config import ModelConfig, from_hf_dict
from kvjax.model.llama import Llama, forward, prefill
from kvjax.model.loading import load

__all__ = ["Llama", "ModelConfig", "cache", "forward", "from_hf_dict", "llama", "load", "prefill"]

from kvjax.model import cache  # noqa: E402
from kvjax.model.generate import generate, generate_configs  # noqa: E402

__all__ += ["generate", "generate_configs"]
