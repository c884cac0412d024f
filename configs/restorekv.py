"""RestoreKV's adapter: ``python -m experiments.restorekv --config=configs/restorekv.py[:quick]``.

SmolLM2-135M-Instruct reads shipped text (Python's own reference prose, ``pydoc_data.topics``:
:func:`kvjax.eval.streaming.reference_text`, the text Q-Filters' calibration reads) in rows of a
``length``-token context and the ``continuation`` tokens after it. KVzip's kept context pairs
at ``ratio`` are fixed per row; the 8 restore embeddings and a rank-``rank`` LoRA adapter on the
attention projections are trained by self-distillation (the KL divergence of the compressed
cache's next-token distributions over the continuation from the full cache's), written as
``restorekv_adapter.npz`` with the loss curve, the KVzip-alone baseline at the same budget and
the timings in ``results.json``. ``:quick`` is the shipped tiny model at toy sizes (tests and CI).

Sizes are CPU-sized: rank 4 on SmolLM2 trains 0.35 % of its weights (kvpress's adapters: about
0.4 % of Llama-3.1-8B's and Qwen3-8B's), on 48 contexts of 512 tokens for 300 steps; the
published adapters' data, lengths and steps are not part of kvpress.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  c.dtype = "float32"
  c.rows = 48  # training rows cut from the reference prose
  c.eval_rows = 8  # held-out rows after them: the test KL, the baseline, the timings
  c.length = 512  # context tokens per row
  c.continuation = 32  # tokens after the context that both caches predict
  c.batch_rows = 8  # rows per saved part of the training data
  c.ratio = 0.75  # kvpress compression_ratio the adapter is trained for
  c.tokens = 8  # restore tokens (kvpress's adapters: 8)
  c.rank = 4
  c.alpha = 16.0
  c.chunk_size = 2048  # KVzip's reconstruction chunk (kvpress's)
  c.n_sink = 4  # KVzip's sinks (kvpress's)
  c.plus = False  # KVzip+'s normalisation (kvpress's _plus adapters)
  # SmolLM2's chat template around the user turn, as configs/fastkvzip.py
  c.prefix = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n"
  )
  c.suffix = "<|im_end|>\n<|im_start|>assistant\n"
  c.lr = 1e-3
  c.max_steps = 300
  c.batch_size = 4
  c.log_every = 25
  c.checkpoint_every = 50
  c.seed = 0
  c.workdir = "/tmp/kvjax_restorekv"
  if common.parse_arg(arg, quick=False).quick:
    c.model = "tiny"
    c.rows, c.eval_rows, c.length, c.continuation, c.batch_rows = 8, 2, 40, 8, 4
    c.tokens, c.rank, c.chunk_size, c.ratio = 4, 2, 40, 0.5
    c.max_steps, c.batch_size, c.log_every, c.checkpoint_every, c.lr = 12, 4, 4, 4, 1e-2
    c.prefix, c.suffix = "", ""  # the word vocabulary has no chat template
  return c
