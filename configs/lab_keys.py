"""Attention-free scorers in the lab: ``--config=configs/lab_keys.py[:scenario|:quick]``.

Issue 15's question: where do KeyDiff and LagKV (and key norm), which read only keys and
values, win or lose against attention-based policies? The world has no keys, so the lab models
them (:mod:`kvjax.lab.keys`: sinks and heavy hitters distinctive, facts distinctive or disguised
by ``fact_distinctness``); each scenario runs at every ``fact_distinctness`` value and budget.

LagKV runs with ``lag=16`` instead of its reference 128: with 128 on a 512-token prompt it
protects the 4 sinks plus a 252-token tail, more than every budget here, so it would reduce to
keeping the lowest tail positions. ``lag=16`` protects 4 + 28 tokens and ranks the other 30
chunks. Run with ``python -m experiments.lab --config=configs/lab_keys.py``.
"""

import ml_collections

from configs import common

SCENARIOS = ("streaming_chat", "needle_qa", "diffuse", "topic_drift")
POLICIES = ("keydiff", "lagkv", "knorm", "snapkv", "h2o", "streaming_llm", "oracle")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.scenarios = SCENARIOS
  c.policies = POLICIES
  c.versus = "snapkv"  # the attention-based policy the attention-free scorers are measured against
  c.budgets = (48, 64, 128)  # per (layer, head); SnapKV needs > its 32-token window
  c.fact_distinctness = (0.0, 1.0)  # facts disguised as ordinary keys / as distinctive as sinks
  c.key_model = ml_collections.ConfigDict(  # kvjax.lab.keys.KeyGeometry but fact_distinctness
    dict(
      sink_distinctness=1.0, heavy_log_ratio=2.0, key_noise=0.3, norm_contrast=0.5, norm_noise=0.1
    )
  )
  # H2O as in configs/lab.py: half of each head's budget recent (the official 1:1 split)
  c.policy_options = ml_collections.ConfigDict(
    dict(lagkv=dict(lag=16), h2o=dict(recent=ml_collections.config_dict.placeholder(int)))
  )
  c.world = ml_collections.ConfigDict(
    dict(num_layers=8, num_heads=8, prompt_len=512, gen_steps=128, head_dim=16, window=32, seed=0)
  )
  c.workdir = ml_collections.config_dict.placeholder(str)  # default: runs/lab-<timestamp>
  a = common.parse_arg(arg, presets=SCENARIOS, quick=False)
  if a.quick:
    # lag 16 still applies: 4 + 2 * 16 <= 192
    c.world.update(num_layers=2, num_heads=4, prompt_len=192, gen_steps=48, window=16)
    c.budgets = (24, 48)
  if a.preset:
    c.scenarios = (a.preset,)
  return c
