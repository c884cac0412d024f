"""Real models: a flax nnx Llama-family decoder, checkpoint loading, tokenizers and a compressed
KV cache.

Modules: ``config`` (``ModelConfig`` from a checkpoint's config), ``llama`` (the decoder and its
prefill), ``tokenizer``, ``loading`` (Hugging Face safetensors), ``cache`` (the compressed
per-layer, per-head slot table) and ``decoding`` (generation and answers through the cache). This
package re-exports the calls a user needs.
"""

from kvjax.model import cache, config, decoding, llama, loading, tokenizer
from kvjax.model.config import ModelConfig, from_hf_dict
from kvjax.model.decoding import answer_configs, generate, generate_configs, keep_mask
from kvjax.model.llama import Llama, Prefill, forward, prefill
from kvjax.model.loading import load, load_tiny, save

__all__ = [
  "Llama",
  "ModelConfig",
  "Prefill",
  "answer_configs",
  "cache",
  "config",
  "decoding",
  "forward",
  "from_hf_dict",
  "generate",
  "generate_configs",
  "keep_mask",
  "llama",
  "load",
  "load_tiny",
  "loading",
  "prefill",
  "save",
  "tokenizer",
]
