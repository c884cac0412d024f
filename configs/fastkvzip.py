"""Fast KVzip's gates: ``python -m experiments.fastkvzip --config=configs/fastkvzip.py[:quick]``.

KVzip scores of SmolLM2-135M-Instruct on shipped text (Python's own reference prose,
``pydoc_data.topics``: :func:`kvjax.eval.streaming.reference_text`, the text Q-Filters'
calibration reads), then the gates trained as the official ``Janghyun1230/FastKVzip``
``optim.py`` does (binary cross-entropy, SGD with momentum 0.9 at lr 0.2 and its step schedule,
batches of 1000 positions, every 100th position held out), written as ``fastkvzip_gates.npz``
with the loss curve in ``results.json``. ``:quick`` is the shipped tiny model at toy sizes
(tests and CI).

Sizes are CPU-sized: the official gates train for 5000 steps on about 0.9M fineweb-edu positions
(29 documents of 10k-30k tokens and 5 concatenations of about 100k, 2000-token KVzip chunks);
here ``rows`` contexts of ``length`` tokens (16k positions) and ``max_steps`` steps.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  c.dtype = "float32"
  c.rows = 32  # contexts cut from the reference prose (about 16k of its 35k SmolLM2 tokens)
  c.eval_rows = 2  # held-out contexts after them: overlap with KVzip's kept pairs, timings
  c.length = 512  # tokens of prose per context (official: 10k-100k-token documents)
  c.batch_rows = 4  # contexts per pass of the target extraction
  c.chunk_size = 2048  # KVzip's reconstruction chunk (kvpress's; the official scoring: 2000)
  c.n_sink = 4  # KVzip's sinks in each reconstruction softmax (kvpress's)
  # SmolLM2's chat template around the user turn, as configs/calibrate.py
  c.prefix = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n"
  )
  c.suffix = "<|im_end|>\n<|im_start|>assistant\n"
  # optim.py's defaults (the gate: --dim 16, --sink 16, --lr 0.2, --loss cnt)
  c.dim = 16
  c.sink = 16
  c.lr = 0.2
  c.max_steps = 600  # official MAX_STEP: 5000
  c.batch_size = 1000
  c.test_freq = 50
  c.test_every = 100
  c.checkpoint_every = 100
  c.seed = 0
  c.workdir = "/tmp/kvjax_fastkvzip"
  if common.parse_arg(arg, quick=False).quick:
    c.model = "tiny"
    c.rows, c.eval_rows, c.length, c.batch_rows, c.chunk_size = 8, 1, 40, 8, 40
    c.max_steps, c.batch_size, c.test_freq, c.test_every, c.checkpoint_every = 30, 64, 10, 10, 10
    c.prefix, c.suffix = "", ""  # the word vocabulary has no chat template
  return c
