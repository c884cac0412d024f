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
#       jupytext_version: 1.19.7
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
#
# **Gated models** (Llama, Gemma, ...) download only once you have accepted their licence on the
# model's Hugging Face page and are logged in: on Colab, add your token as a secret named
# `HF_TOKEN` (the key icon in the left bar, with notebook access on), which `huggingface_hub`
# reads by itself; elsewhere run `from huggingface_hub import login; login()` once, or set the
# `HF_TOKEN` environment variable.

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
QUICK = False  # True in CI: the eval config's quick preset, one task, a one-length heatmap
PRESET = "auto"  # "auto": "full" on a GPU / TPU, "" (a few minutes) on a CPU; QUICK: "quick"
MODEL = "tiny"
WORKDIR = "runs/notebook_eval"  # the preset's name is appended ("_quick", "_full")

# %% [markdown]
# **The GPU / TPU preset.** With `PRESET = "auto"` a GPU or TPU runs `configs/eval.py:full`
# (1k and 2k contexts, 50 examples per cell, seven budgets, a finer and wider needle heatmap)
# and a CPU the config's default (1k contexts, 8 examples, a few minutes on two cores); QUICK
# mode (CI) always runs `:quick`. Each preset (and each model other than `tiny`) has its own
# run directory, so each resumes only itself.

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
import ml_collections
from IPython.display import display

from kvjax import plotting, rundir
from kvjax.eval import evaluate

config = rundir.load_config("configs/eval.py", PRESET)
config.model = MODEL
if QUICK:  # each task and heatmap length compiles anew: the smoke run keeps one of each
  config.tasks = ml_collections.ConfigDict(dict(single_needle=config.tasks.single_needle))
  config.heatmap.lengths = config.heatmap.lengths[:1]
workdir = WORKDIR + (f"_{PRESET}" if PRESET else "") + ("" if MODEL == "tiny" else "_hf")
print(config.tasks, config.lengths, config.budgets)

# %% [markdown]
# **Lengths that fit the chip.** For a model of a planned shape (Llama-3.1-8B, Qwen3-8B), the
# contexts are cut to the longest prompt every policy family fits beside the full cache on the
# chip found, read from the compiled memory plans (`kvjax.eval.memory_plan`, the table in
# `docs/accelerators.md`); other models keep the preset's lengths.

# %%
from kvjax.eval import memory_plan

fit = memory_plan.fitting_lengths(MODEL, config.lengths)
if fit["dropped"]:
  print(f"{fit['chip'] or 'this device'} fits {fit['limit']} tokens: dropped {fit['dropped']}")
  config.lengths = fit["lengths"]
  config.heatmap.lengths = tuple(t for t in config.heatmap.lengths if t <= fit["limit"])
print("lengths:", config.lengths, "| plan:", fit["source"], fit["chip"] or "")

# %% [markdown]
# ## Run (or resume) the evaluation

# %%
table = evaluate.run(config, workdir)
budget_rows = table[table["kind"] == "budget"]
# the full cache runs at no budget (its rows hold the context length): a column of its own
is_full = budget_rows["policy"] == "full"
accuracy = budget_rows[~is_full].pivot_table(
  index=["task", "policy"], columns="budget", values="accuracy"
)
full_accuracy = budget_rows[is_full].groupby("task")["accuracy"].mean()
accuracy["full cache"] = accuracy.index.get_level_values("task").map(full_accuracy)
display(accuracy.round(2))

# %% [markdown]
# ## Accuracy and KL divergence against budget


# %%
def legible(fig):
  """Lines that coincide (several policies at the full cache's accuracy) all show: the first
  drawn widest, each next one narrower on top of it, the full cache's dashed line beneath."""
  for ax in fig.axes:
    lines = [line for line in ax.get_lines() if line.get_label() != "full"]
    for i, line in enumerate(lines):
      line.set(linewidth=1 + 5 * (1 - i / len(lines)), markersize=3 + 6 * (1 - i / len(lines)))
      line.set_zorder(2 + i)
    for line in ax.get_lines():
      if line.get_label() == "full":
        line.set_zorder(1)
  return fig


legible(plotting.accuracy_vs_budget(table, "accuracy"))
plt.show()
legible(plotting.accuracy_vs_budget(table, "kl"))
plt.show()

# %% [markdown]
# ## The needle heatmap
# Single-needle accuracy over needle depth x context length at a fixed budget, per policy.

# %%
for policy in config.heatmap.policies:
  plotting.needle_heatmap(table, policy)
  plt.show()
