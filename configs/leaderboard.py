"""kvpress's leaderboard protocol on RULER's synthetic tasks: ``python -m experiments.leaderboard
--config=configs/leaderboard.py[:quick|:full]``.

Every method at compression ratios 0.25 / 0.5 / 0.75 / 0.875 in the query-agnostic loop, the
question-window methods also query-aware, scored as RULER scores (``kvjax.eval.leaderboard``).
The default is SmolLM2-135M-Instruct at 1k tokens on a CPU; ``:full`` is the leaderboard's 4k
for a GPU or TPU with a Hugging Face directory of Llama-3.1-8B-Instruct or Qwen3-8B
(``--config.model=DIR``); ``:quick`` is the smoke run the tests use.
"""

import ml_collections

from configs import common
from kvjax.eval import ruler

RATIOS = (0.25, 0.5, 0.75, 0.875)
BOTH = ("agnostic", "aware")
METHODS = (
  dict(label="full", policy="full"),
  dict(label="random", policy="random"),
  dict(label="knorm", policy="knorm"),
  dict(label="streaming_llm", policy="streaming_llm"),
  dict(label="snapkv", policy="snapkv", loops=BOTH),
  dict(label="pyramidkv", policy="pyramidkv", loops=BOTH),
  dict(label="expected_attention", policy="expected_attention"),
  dict(label="keydiff", policy="keydiff"),
  dict(label="critical_snapkv", policy="critical_snapkv", loops=BOTH),
  dict(label="chunkkv", policy="chunkkv_snapkv"),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "smollm2"
  c.tasks = ruler.TASKS
  c.length = 1024
  c.examples = 1
  c.ratios = RATIOS
  c.methods = METHODS
  c.max_new_tokens = ml_collections.FieldReference(None, field_type=int)  # None: RULER's
  # niah_multiquery's keys as separate questions of one context, compressed once per method and
  # ratio in the query-agnostic loop (False: RULER's one question naming every key)
  c.separate_queries = False
  # one fed question length for every task (leaderboard.shared_question_len): each method and
  # ratio compiles once, not once per task; shorter questions feed their context's last tokens
  # uncompressed with them (a named variant; False: the protocol's question alone)
  c.shared_question_len = False
  c.seed = 0
  c.workdir = "/tmp/kvjax_leaderboard"
  preset = common.parse_arg(arg, quick=False, full=False)
  if preset.full:
    c.model = "meta-llama/Llama-3.1-8B-Instruct"  # a local Hugging Face directory in practice
    c.length = 4096
    c.examples = 50
    c.workdir = "/tmp/kvjax_leaderboard_full"
  if preset.quick:
    c.tasks = ("niah_single_1", "niah_multikey_1")
    c.length = 256
    c.examples = 1
    c.ratios = (0.5,)
    c.methods = (
      dict(label="full", policy="full"),
      dict(label="snapkv", policy="snapkv", loops=BOTH),
    )
    c.max_new_tokens = 12
    c.workdir = "/tmp/kvjax_leaderboard_quick"
  return c
