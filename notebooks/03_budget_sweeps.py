# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     gpuType: V5E1
#     provenance: []
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/03_budget_sweeps.ipynb)
#
# # Budget sweeps
#
# A sweep crosses total budgets, layer schedules (uniform, PyramidKV, CAKE), head allocations
# (uniform, Ada-KV) and policies over the lab's synthetic worlds. Budgets are data: every
# configuration of a compiled group runs in one `vmap`ped call, sharded over the devices when
# there are several. Results land in `results.csv` as they finish, so an interrupted sweep
# (a Colab runtime that disconnects) resumes where it stopped when the cell is run again.

# %% tags=["skip-execution"]
# Colab: install kvjax with its configs (CI skips this cell).
# !git clone -q https://github.com/kvjax/kvjax && pip install -q -e kvjax
# %cd kvjax

# %%
import os
import pathlib

if pathlib.Path.cwd().name == "notebooks":  # run from the repository root (configs/ lives there)
  os.chdir("..")
import jax

print("jax", jax.__version__, "| backend:", jax.default_backend(), "|", jax.devices())

# %% tags=["parameters"]
QUICK = False  # CI injects QUICK = True: the sweep's quick preset
CONFIG = "configs/sweep_lab.py"  # or configs/sweep_funnel.py
WORKDIR = "runs/notebook_sweep"

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from kvjax import plotting, rundir
from kvjax.lab import sweep

config = rundir.load_config(CONFIG, "quick" if QUICK else None)
workdir = WORKDIR + ("_quick" if QUICK else "")
print(config.grid)

# %% [markdown]
# ## Run (or resume) the sweep

# %%
table = sweep.run(config, workdir, progress=not QUICK)
print(len(table), "configurations in", pathlib.Path(workdir, "results.csv"))
display(table.head())

# %% [markdown]
# ## Metric against budget, per policy

# %%
plotting.sweep_metric_vs_budget(table)
plt.show()

# %% [markdown]
# ## Per-layer budget profiles
# The same total, spent differently over layers: uniform, PyramidKV's linear schedule in its
# three rounding modes, CAKE's preference-driven split.

# %%
plotting.budget_profiles(table)
plt.show()

# %% [markdown]
# ## The Pareto view and the best configuration per budget
# Retained attention mass against cache bytes; the oracle is the reference, not a candidate.

# %%
plotting.pareto(table)
plt.show()
display(sweep.best_per_budget(table).round(4))
