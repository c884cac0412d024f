"""KVzap's surrogates: ``python -m experiments.kvzap --config=configs/kvzap.py[:quick]``.

KVzip+ targets of SmolLM2-135M-Instruct on shipped text (Python's own reference prose,
``pydoc_data.topics``: :func:`kvjax.eval.streaming.reference_text`, the text Q-Filters'
calibration reads), then a ridge surrogate and a 2-layer MLP surrogate trained as kvpress's
``kvzap/train.py`` does, written as ``kvzap_linear.npz`` and ``kvzap_mlp.npz`` with their test
MSE in ``results.json``. ``:quick`` is the shipped tiny model at toy sizes (tests and CI).

Sizes are CPU-sized: kvpress trains on 4500 Nemotron samples of 750-1250 tokens, 500 sampled
positions each (2.25M examples); here ``rows`` contexts of ``length`` tokens and ``n_tokens``
positions each.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  c.dtype = "float32"
  c.rows = 48  # contexts cut from the reference prose (about 25k of its 35k SmolLM2 tokens)
  c.test_rows = 4  # held out for the test MSE (kvpress: 5 per subset, 45 of 4545 samples)
  c.length = 512  # tokens of prose per context (kvpress: 750-1250)
  c.n_tokens = 128  # positions drawn per context (kvpress: 500)
  c.batch_rows = 4  # contexts per forward pass of the target extraction
  # SmolLM2's chat template around the user turn, as configs/calibrate.py
  c.prefix = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n"
  )
  c.suffix = "<|im_end|>\n<|im_start|>assistant\n"
  # kvzap/train.py's MLP defaults
  c.hidden_dim = 512
  c.max_epochs = 15
  c.lr = 5e-3
  c.batch_size = 512
  c.weight_decay = 0.01
  c.valid_fraction = 0.05
  c.ridge_alpha = 1.0
  c.seed = 42
  c.workdir = "/tmp/kvjax_kvzap"
  if common.parse_arg(arg, quick=False).quick:
    c.model = "tiny"
    c.rows, c.test_rows, c.length, c.n_tokens, c.batch_rows = 12, 2, 48, 24, 6
    c.hidden_dim, c.max_epochs, c.batch_size = 32, 3, 64
    c.prefix, c.suffix = "", ""  # the word vocabulary has no chat template
  return c
