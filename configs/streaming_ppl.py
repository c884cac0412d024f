"""StreamingLLM's perplexity experiment on SmolLM2: ``python -m experiments.streaming_ppl``.

One long natural text (The Python Language Reference, shipped with CPython) read through the
decode-time cache: the full cache, a sliding window and ``sinks`` sinks + window at each cache
size. ``:quick`` is the shipped tiny model on a short text (tests and CI).
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  # the weights' dtype; "auto": kvjax.model.load's default, bf16 on an accelerator and fp32 on
  # a CPU, where XLA emulates bf16 dots: a SmolLM2 decode step (two caches) took 187 ms in bf16
  # against 40 ms in fp32 here. Softmax and scores stay fp32 either way.
  c.dtype = "auto"
  c.text = "python_reference"  # kvjax.eval.streaming.TEXTS
  c.num_tokens = 4096
  c.caches = (256, 512)  # slots per head, sinks included
  c.sinks = 4
  c.segment = 128  # tokens per plotted perplexity
  c.workdir = "/tmp/kvjax_streaming"
  if common.parse_arg(arg, quick=False).quick:
    c.model = "tiny"
    c.dtype = "float32"
    c.text = "filler"  # the word vocabulary cannot spell the reference
    c.num_tokens = 256
    c.caches = (32, 64)
    c.segment = 32
  return c
