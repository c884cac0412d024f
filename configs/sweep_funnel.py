"""Layer schedules on the funnel world at equal total budget: ``--config=configs/sweep_funnel.py``.

Uniform vs PyramidKV (several beta, both legacy and exact-total arithmetic) vs CAKE (several
temperatures), each with uniform or Ada-KV heads, over total budgets.
"""

import ml_collections

from configs import common, sweep_lab


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = sweep_lab.get_config(arg)
  c.base.scenario = "funnel"
  if common.parse_arg(arg, quick=False).quick:
    return c
  c.grid.product = ml_collections.ConfigDict(
    dict(
      policy=("snapkv", "oracle"),
      head_alloc=("uniform", "adakv"),
      budget=(16, 24, 32, 48, 64, 96, 128),
    )
  )
  # each layer schedule with its own hyper-parameters, zipped so they move together
  c.grid.zip = ml_collections.ConfigDict(
    dict(
      schedule=("uniform", "pyramid", "pyramid", "pyramid", "cake", "cake"),
      pyramid_mode=(
        "exact_total",
        "legacy_floor",
        "exact_total",
        "exact_total",
        "exact_total",
        "exact_total",
      ),
      beta=(20.0, 20.0, 20.0, 4.0, 20.0, 20.0),
      tau1=(1.0, 1.0, 1.0, 1.0, 1.0, 1.6),
      tau2=(1.0, 1.0, 1.0, 1.0, 1.0, 0.4),
    )
  )
  return c
