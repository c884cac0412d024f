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
  # bf16 weights halve the bytes each decoded token reads (the step is memory-bound on a CPU);
  # softmax and scores stay fp32. "float32" for parity runs.
  c.dtype = "bfloat16"
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
