"""Model-made evidence for the calibrated methods: ``python -m experiments.calibrate``.

Q-Filters' directions (``qfilters_LGD``), ExpectedAttentionStats' query statistics
(``stats_query_mean_LHD``, ``stats_query_cov_LHDD``), DuoAttention's gates (``retrieval_heads_LG``: the
official distillation and the two proxies) and KVzip's reconstruction attention
(``reconstruction_attn_LGT``) of SmolLM2-135M-Instruct on shipped text, saved as
``calibration.npz`` with their timings in ``timings.json``. ``:quick`` is the shipped tiny model
at toy sizes (tests and CI). Sizes are CPU-sized: the official Q-Filters reads 19 x 2048 tokens,
the official DuoAttention trains 2000 steps on 1k-32k-token prompts.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  c.dtype = "float32"
  # Q-Filters: calibration rows of the Python reference prose
  c.qfilter_rows = 4
  c.qfilter_length = 512
  c.num_svd_samples = 3000
  c.stats_n_sink = 4  # ExpectedAttentionStats: kvpress's n_sink, on the Q-Filters rows
  # DuoAttention: multi-key retrieval prompts (kvjax.eval.tasks), official training + proxies
  c.duo_methods = ("official", "kvpress_on_the_fly", "distant_mass")
  c.duo_task = "multi_query"
  c.duo_num_pairs, c.duo_num_queries = 8, 4  # keys hidden, keys asked (the task's defaults)
  c.duo_examples = 4
  c.duo_length = 384
  # measured on SmolLM2 (CPU): 12 steps rank the heads as 60 do (Spearman 0.92, 33 of the top 35
  # shared); the gates only separate below 0.5 after ~60 (35 of 90 heads above 0.5)
  c.duo_steps = 12
  c.duo_lr = 0.02
  c.duo_reg_weight = 0.05
  # examples per step (the official: 1); over several processes each step's examples are
  # spread among them, so a multiple of the process count keeps every process busy
  c.duo_batch = 1
  c.duo_otf_rows = 4  # kvpress's proxy: texts (kvpress: 50 BookSum chapters), q_len 500
  # KVzip: a context of the reference prose inside SmolLM2's chat template
  c.kvzip_length = 512
  c.kvzip_chunk_size = 2048
  c.kvzip_prefix = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n"
  )
  c.kvzip_suffix = "<|im_end|>\n<|im_start|>assistant\n"
  c.seed = 0
  c.workdir = "/tmp/kvjax_calibrate"
  if common.parse_arg(arg, quick=False).quick:
    c.model = "tiny"
    c.qfilter_rows, c.qfilter_length, c.num_svd_samples = 2, 64, 100
    c.duo_examples, c.duo_length, c.duo_steps, c.duo_otf_rows = 2, 96, 3, 2
    c.duo_batch = 2  # both examples each step: two processes train on one each
    c.duo_num_pairs, c.duo_num_queries = 4, 2
    c.kvzip_length, c.kvzip_chunk_size = 64, 32
    c.kvzip_prefix, c.kvzip_suffix = "", ""  # the word vocabulary has no chat template
  return c
