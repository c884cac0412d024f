"""Allocation search: ``--config=configs/search.py[:quick][,lg][,tiny][,ratio]``.

Searches a per-layer (``shape="L"``) or per-layer-and-KV-head (``"LG"``) allocation at a fixed
memory (``budget`` tokens per entry, or a compression ``ratio``) that maximises the retained
attention mass on calibration evidence, and judges it on held-out evidence
(``docs/search.md``). ``quick`` shrinks the world and the search for a smoke run; ``lg``
searches ``[L, G]``; ``tiny`` searches on the shipped tiny model's task prompts instead of the
lab; ``ratio`` sets the memory as kvpress's compression ratio.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.source = "lab"  # lab | tiny
  c.shape = "L"  # L | LG
  c.policy = "snapkv"  # the scorer the allocation is searched under
  c.window = 8  # the protected window; every entry keeps at least window + 1
  c.budget = ml_collections.config_dict.placeholder(int)  # tokens per entry (memory / entries)
  c.ratio = ml_collections.config_dict.placeholder(float)  # or kvpress's compression ratio
  c.budget = 64
  c.rule = "free"  # free | pyramid | quadratic (kvjax.eval.search.space.RULES)
  c.optimiser = "cma_es"  # cma_es | snes | open_es | random
  c.population = 32
  c.generations = 60
  c.seed = 0
  c.std_init = 1.0
  c.lab = ml_collections.ConfigDict(
    dict(
      scenario="needle_qa",
      world=ml_collections.ConfigDict(
        dict(num_layers=8, num_heads=8, prompt_len=512, gen_steps=128, head_dim=16, window=32)
      ),
      calibration_seed=0,
      held_out_seed=1,
    )
  )
  c.model = ml_collections.ConfigDict(
    dict(task="single_needle", prompt_len=96, rows=4, calibration_seed=0, held_out_seed=1000)
  )
  c.workdir = ml_collections.config_dict.placeholder(str)
  arg = common.parse_arg(arg, quick=False, lg=False, tiny=False, ratio=False)
  if arg.quick:
    c.lab.world.update(num_layers=6, num_heads=4, prompt_len=192, gen_steps=48, window=16)
    c.budget = 32
    c.population = 16
    c.generations = 12
    c.model.update(prompt_len=64, rows=2)
  if arg.lg:
    c.shape = "LG"
  if arg.tiny:
    c.source = "tiny"
    c.window = 4
    c.budget = 16 if arg.quick else 24
  if arg.ratio:
    c.budget = None
    c.ratio = 0.75
  return c
