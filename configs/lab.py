"""The attention-policy lab (the main job): ``--config=configs/lab.py[:scenario|:quick]``.

``:needle_qa`` (any scenario name) runs that scenario alone; ``:quick`` shrinks the world for a
smoke run. Every field can be overridden, e.g. ``--config.budget=32``.
"""

import ml_collections

from configs import common

SCENARIOS = ("streaming_chat", "needle_qa", "diffuse", "topic_drift", "funnel")
POLICIES = (
  "sliding_window",
  "streaming_llm",
  "h2o",
  "tova",
  "snapkv",
  "pyramidkv",
  "adakv_snapkv",
  "cake",
  "random",
  "oracle",
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.scenarios = SCENARIOS  # tuples, so they can be overridden on the command line
  c.policies = POLICIES
  c.budget = 64  # per (layer, head), sinks and window included
  # options per policy name (the registry's defaults otherwise); the lab runs H2O as official
  # H2O does, half of each head's budget recent (recent=None), not KVCache-Factory's 8
  h2o_recent = ml_collections.config_dict.placeholder(int)  # None: half of each head's budget
  c.policy_options = ml_collections.ConfigDict(dict(h2o=dict(recent=h2o_recent)))
  c.world = ml_collections.ConfigDict(
    dict(num_layers=8, num_heads=8, prompt_len=512, gen_steps=128, head_dim=16, window=32, seed=0)
  )
  c.figure_step = -1  # -1: the middle of the last fact's query window
  # whose kept part the attention-row panel draws ("": snapkv if run, else the first policy)
  c.figure_policy = ""
  # also write lab.html: the essay's figure, interactive (scenario, budget, generated step),
  # replayed at each of explorer_budgets (empty: 3/4, 1 and 2 times the budget)
  c.explorer = True
  c.explorer_budgets = ()
  c.workdir = ml_collections.config_dict.placeholder(str)  # default: runs/lab-<timestamp>
  a = common.parse_arg(arg, presets=SCENARIOS, quick=False)
  if a.quick:
    c.world.update(num_layers=2, num_heads=4, prompt_len=192, gen_steps=48, window=16)
    c.budget = 32
  if a.preset:
    c.scenarios = (a.preset,)
  return c
