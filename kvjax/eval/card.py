"""The tiny model's card: how it was trained (every phase) and what it measures.

:func:`export` writes the model as a Hugging Face style checkpoint with its tokenizer and a
``card.json``; :func:`phase_record` reads what a training run was; :func:`measure` gives the
card's full-cache accuracy and layer funnel.
"""

from __future__ import annotations

import json
import pathlib

import ml_collections

from kvjax import rundir
from kvjax.eval import evaluate, funnel, stats, tasks, train, vocab
from kvjax.model import loading
from kvjax.model.config import ModelConfig
from kvjax.model.tokenizer import WordTokenizer


def phase_record(workdir: str | pathlib.Path) -> dict:
  """What a training run in ``workdir`` was, for a model card: its config, steps, wall seconds
  and final logged loss."""
  workdir = pathlib.Path(workdir)
  config_path, metrics_path = workdir / "train_config.json", workdir / "metrics.jsonl"
  rows = rundir.read_jsonl(metrics_path)
  if not config_path.exists() or not rows:
    raise ValueError(
      f"workdir: {workdir} holds no training run (train_config.json and logged metrics.jsonl)"
    )
  last = rows[-1]
  return {
    "config": json.loads(config_path.read_text()),
    "steps": last["step"],
    "seconds": last["seconds"],
    "final_loss": last["loss"],
  }


def export(c: ml_collections.ConfigDict, params: dict, path: str | pathlib.Path, **card) -> None:
  """Writes the model as a Hugging Face style checkpoint (``config.json``,
  ``model.safetensors``), its ``tokenizer.json`` and a ``card.json``: the training ``phases``
  (:func:`phase_record` of each run; ``c`` alone when none are given) and any measurements
  passed in ``card``."""
  tok = vocab.tiny_tokenizer()
  cfg = train.model_config(c.model, tok.vocab_size)
  path = pathlib.Path(path)
  loading.save(path, cfg, params)
  tok.save(path / "tokenizer.json")
  phases = card.pop("phases", None) or [{"config": rundir.plain(c)}]
  info = {"model": describe(cfg), "phases": phases, **card}
  (path / "card.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


def describe(cfg: ModelConfig) -> str:
  return (
    f"Llama config, {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / "
    f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, SwiGLU {cfg.intermediate_size}, "
    f"tied embeddings, vocabulary {cfg.vocab_size}"
  )


def measure(path: str | pathlib.Path, *, count: int = 50, lengths=(1024, 2048)) -> dict:
  """The card's measurements of an exported model: full-cache accuracy per task at each length
  (``count`` held-out examples at :data:`kvjax.eval.tasks.EVAL_OPTIONS` sizes) with its 95 %
  Wilson interval, and the layer funnel on a multi-document prompt (attention sinks: first-token
  mass; funneling: entropy per layer)."""
  model, _ = loading.load(path)
  tok = WordTokenizer.load(pathlib.Path(path) / "tokenizer.json")
  scores = evaluate.full_cache_scores(model, tok, lengths, count, tasks.EVAL_OPTIONS)
  ids, doc = funnel.multi_document_prompt(tok, num_docs=4, doc_len=128)
  layers = funnel.model_funnel(model, ids, doc).round(4)
  # accuracy is a proportion of the count examples: Wilson's interval of its successes
  intervals = {
    length: {
      task: list(stats.wilson_interval(round(acc * count), count)) for task, acc in cells.items()
    }
    for length, cells in scores["accuracy"].items()
  }
  return {
    "full_cache_accuracy": scores["accuracy"],
    "full_cache_accuracy_95": intervals,
    "full_cache_ruler_recall": scores["recall"],
    "examples_per_cell": count,
    "funnel": layers.to_dict(orient="list"),
  }
