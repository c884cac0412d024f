# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     gpuType: V5E1
#     provenance: []
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab,kernelspec,language_info
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   language_info:
#     codemirror_mode:
#       name: ipython
#       version: 3
#     file_extension: .py
#     mimetype: text/x-python
#     name: python
#     nbconvert_exporter: python
#     pygments_lexer: ipython3
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
# Colab: clone kvjax (the notebooks read its configs/) and install it; CI skips this cell.
# Locally, run `pip install -e .` in the repository instead.
# !test -d /content/kvjax || git clone -q https://github.com/kvjax/kvjax /content/kvjax
# %cd /content/kvjax
# !pip install -q -e .

# %%
import os
import pathlib
import sys

if pathlib.Path.cwd().name == "notebooks":  # run from the repository root (configs/ lives there)
  os.chdir("..")
import jax

from kvjax import distributed

distributed.maybe_initialize()  # several hosts (a TPU slice, SLURM): joins them; else nothing
print("jax", jax.__version__, "| backend:", jax.default_backend(), "|", jax.devices())
if jax.default_backend() == "cpu" and (
  "google.colab" in sys.modules or any(k.startswith("COLAB_") for k in os.environ)
):
  print(
    "WARNING: JAX is running on the CPU. Pick an accelerator in Colab's menu,\n"
    "  Runtime > Change runtime type > TPU/GPU\n"
    "and run the notebook again. If one is selected already, JAX lacks its plugin:\n"
    '  pip install -U "jax[tpu]" (or "jax[cuda12]"), then restart the session.'
  )

# %% tags=["parameters"]
QUICK = False  # True in CI (injected after this cell): the sweep's quick preset
PRESET = "auto"  # "auto": "full" on a GPU / TPU, "" on a CPU; QUICK mode runs "quick"
CONFIG = "configs/sweep_lab.py"  # or configs/sweep_funnel.py
WORKDIR = "runs/notebook_sweep"  # the preset's name is appended ("_quick", "_full")

# %% [markdown]
# **The GPU / TPU preset.** With `PRESET = "auto"` a GPU or TPU runs the `"full"` sizes and a
# CPU the config's defaults; QUICK mode (CI) always runs the config's `:quick` preset. Here
# `"full"` is the policy lab's full world (a 2048-token prompt, 256 generation steps, 16 layers)
# with every budget of the grid quadrupled, so budgets keep their share of the prompt. Each
# preset has its own run directory, so each resumes only itself.

# %%
if PRESET == "auto":
  PRESET = "full" if jax.default_backend() != "cpu" else ""
if QUICK:
  PRESET = "quick"
if PRESET not in ("", "full", "quick"):
  raise ValueError(f"PRESET: expected 'auto', '', 'full' or 'quick', got {PRESET!r}")
print("preset:", PRESET or "(default)", "| backend:", jax.default_backend())

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from kvjax import plotting, rundir
from kvjax.lab import sweep

config = rundir.load_config(CONFIG, "quick" if PRESET == "quick" else None)
if PRESET == "full":
  config.world.update(num_layers=16, prompt_len=2048, gen_steps=256, window=64)
  config.grid.product.budget = tuple(4 * b for b in config.grid.product.budget)
workdir = WORKDIR + (f"_{PRESET}" if PRESET else "")
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
