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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/04_accuracy_under_compression.ipynb)
#
# # Accuracy under compression
#
# Retained attention mass is a first instrument; what users care about is whether the model
# still answers. Here a real model with a real compressed cache runs the RULER-style task suite
# (`kvjax.eval.tasks`): every answer token is predicted from the compressed cache, one prefill per
# example is shared by all budgets (compress and decode `vmap`ped over budgets), and besides
# accuracy the teacher-forced KL divergence to the full cache is reported. Last, the needle
# heatmap (depth x context length) of the PyramidKV and SnapKV papers.
#
# `MODEL = "tiny"` is the shipped model (trained by kvjax on these tasks, runs anywhere). On
# Colab, a Hugging Face id (e.g. `"Qwen/Qwen2.5-0.5B-Instruct"`) runs the same tasks through its
# own tokenizer.

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
QUICK = False  # CI injects QUICK = True: the eval config's quick preset
MODEL = "tiny"
PRESET = ""  # "" (a few minutes on CPU) or "full" (GPU / TPU)
WORKDIR = "runs/notebook_eval"

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from kvjax import plotting, rundir
from kvjax.eval import evaluate

config = rundir.load_config("configs/eval.py", "quick" if QUICK else PRESET)
config.model = MODEL
workdir = WORKDIR + ("_quick" if QUICK else "") + ("" if MODEL == "tiny" else "_hf")
print(config.tasks, config.lengths, config.budgets)

# %% [markdown]
# ## Run (or resume) the evaluation

# %%
table = evaluate.run(config, workdir)
budget_rows = table[table["kind"] == "budget"]
display(
  budget_rows.pivot_table(index=["task", "policy"], columns="budget", values="accuracy").round(2)
)

# %% [markdown]
# ## Accuracy and KL divergence against budget

# %%
plotting.accuracy_vs_budget(table, "accuracy")
plt.show()
plotting.accuracy_vs_budget(table, "kl")
plt.show()

# %% [markdown]
# ## The needle heatmap
# Single-needle accuracy over needle depth x context length at a fixed budget, per policy.

# %%
for policy in config.heatmap.policies:
  plotting.needle_heatmap(table, policy)
  plt.show()
