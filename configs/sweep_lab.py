"""Budget sweep on the lab world: ``--config=configs/sweep_lab.py[:quick][,ratios]``.

The grid crosses total budgets, layer schedules, head allocations and scorers; ``zip`` axes move
together (here each schedule with its own hyper-parameter label is crossed by product).
``ratios`` sweeps kvpress compression ratios (the fraction of the prompt removed; a ``ratio``
axis instead of ``budget``): each configuration keeps ``int(prompt_len * (1 - ratio))`` slots
per (layer, head), and its row holds the ratio beside that budget.

A user's own pieces are named after registering them before the sweep runs (in a config file
that imports this one, say, since ``experiments.sweep`` executes the config file):
``kvjax.policies.register`` for a scorer on the ``policy`` axis, and
``kvjax.lab.sweep.register_schedule`` / ``register_head_alloc`` for an allocator on the
``schedule`` / ``head_alloc`` axes, its swept fields mapped to the data axes below (``axes=``).
"""

import ml_collections

from configs import common


def base() -> ml_collections.ConfigDict:
  """Every sweepable field with its default (the type of each default is enforced on the grid)."""
  return ml_collections.ConfigDict(
    dict(
      scenario="needle_qa",
      policy="snapkv",  # any sweepable registered policy (kvjax.lab.sweep.sweepable())
      # uniform | pyramid | cake (policies.Uniform, Pyramid, CakeLayers) | a registered schedule
      schedule="uniform",
      # uniform | adakv | headkv (policies.Uniform, AdaKV, HeadKV) | a registered head allocation
      head_alloc="uniform",
      pyramid_mode="legacy_floor",  # legacy_floor | kvpress | exact_total
      window=8,  # observation window (<= world.window)
      kernel=7,
      pool="max",
      budget=64,  # per (layer, head), window included
      beta=20.0,  # PyramidKV beta
      alpha=0.2,  # Ada-KV floor_alpha
      head_beta=1.5,  # HeadKV beta
      sinks=4,  # StreamingLLM sinks
      tau1=1.0,  # CAKE temperatures
      tau2=1.0,
    )
  )


def world() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(num_layers=8, num_heads=8, prompt_len=512, gen_steps=128, head_dim=16, window=32, seed=0)
  )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.base = base()
  c.world = world()
  c.grid = ml_collections.ConfigDict()
  c.grid.product = ml_collections.ConfigDict(
    dict(
      scenario=("needle_qa", "streaming_chat"),
      policy=("snapkv", "h2o", "streaming_llm", "tova", "oracle"),
      schedule=("uniform", "pyramid", "cake"),
      head_alloc=("uniform", "adakv"),
      budget=(16, 32, 64, 128, 256),
    )
  )
  c.grid.zip = ml_collections.ConfigDict()
  c.chunk_size = 256  # configurations per compiled call (bounds memory)
  c.bytes_per_value = 2  # bf16 cache
  # persistent compilation cache: "" (off), "default" (~/.cache/kvjax/jax) or a directory; None
  # reads $KVJAX_COMPILATION_CACHE
  c.compilation_cache = ml_collections.config_dict.placeholder(str)
  c.workdir = ml_collections.config_dict.placeholder(str)
  arg = common.parse_arg(arg, quick=False, ratios=False)
  if arg.quick:
    c.world.update(num_layers=2, num_heads=4, prompt_len=192, gen_steps=48, window=16)
    c.grid.product = ml_collections.ConfigDict(
      dict(policy=("snapkv", "h2o"), schedule=("uniform", "pyramid"), budget=(16, 32, 64))
    )
    c.chunk_size = 4
  if arg.ratios:  # kvpress's leaderboard ratios, and two tighter ones, instead of budgets
    del c.grid.product["budget"]
    c.grid.product.ratio = RATIOS
  return c


# the fraction of the prompt removed: 0.25 / 0.5 / 0.75 / 0.875 are kvpress's leaderboard's
RATIOS = (0.25, 0.5, 0.75, 0.875, 0.9, 0.95)
