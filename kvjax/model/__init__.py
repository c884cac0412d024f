"""Real models: a flax nnx Llama-family decoder, checkpoint loading, tokenizers and a compressed
KV cache.

Modules: ``config`` (``ModelConfig`` from a checkpoint's config), ``llama`` (the decoder and its
prefill), ``assets`` (the offline models), ``gguf`` (llama.cpp checkpoints), ``tokenizer``,
``loading`` (Hugging Face safetensors and GGUF), ``cache`` (the compressed
per-layer, per-head slot table, with ThinK's pruned key channels and ``decode_every``
re-compression), ``decoding`` (generation through the cache; caller-given evidence as
``evidence={...}``; a padded batch as ``Padded``, kvpress's compression ratio as a ``Ratio``
budget, sampling as ``Sampling``), ``answers`` (answers decoded through the compressed cache from one shared
prefill) ``logprobs`` (a text's log-probabilities read token by token through the cache) and
``stored`` (a compressed context saved and loaded, answered later by ``answer_context``) and
``learned`` (how a model computes the learned kinds of evidence; ``attention_inputs``).
This package re-exports the calls a user needs.
"""

from kvjax.model import (
  answers,
  assets,
  cache,
  config,
  decoding,
  gguf,
  learned,
  llama,
  loading,
  logprobs,
  stored,
  tokenizer,
)
from kvjax.model.answers import Question, answer_configs
from kvjax.model.assets import smollm2_path
from kvjax.model.config import ModelConfig, from_hf_dict
from kvjax.model.decoding import (
  GREEDY,
  Padded,
  Ratio,
  Sampling,
  answer_context,
  compress_context,
  generate,
  generate_configs,
  keep_mask,
)
from kvjax.model.learned import attention_inputs
from kvjax.model.llama import Llama, Prefill, forward, prefill
from kvjax.model.loading import load, load_tiny, save
from kvjax.model.tokenizer import load_tokenizer

__all__ = [
  "GREEDY",
  "Llama",
  "ModelConfig",
  "Padded",
  "Prefill",
  "Question",
  "Ratio",
  "Sampling",
  "answer_configs",
  "answer_context",
  "answers",
  "assets",
  "attention_inputs",
  "cache",
  "compress_context",
  "config",
  "decoding",
  "forward",
  "from_hf_dict",
  "generate",
  "generate_configs",
  "gguf",
  "keep_mask",
  "learned",
  "llama",
  "load",
  "load_tiny",
  "load_tokenizer",
  "loading",
  "logprobs",
  "prefill",
  "save",
  "smollm2_path",
  "stored",
  "tokenizer",
]
