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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/01_policy_lab.ipynb)
#
# # The policy lab
#
# Which tokens keep existing when the KV cache is too small? The lab builds a synthetic attention
# world (sinks, recency decay, old facts needed later, an observation window, per-layer funnels)
# and replays every eviction policy over it with a fixed per-head budget. This notebook draws the
# essay's figure for every scenario, with the generation step and the budget as parameters, then
# breaks retained attention mass down per layer and per head.

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
QUICK = False  # True in CI: a small world, two scenarios, four policies
PRESET = "auto"  # "auto": "full" on a GPU / TPU, "" on a CPU; QUICK mode runs "quick"
BUDGET = None  # tokens per (layer, head), sinks and window included; None: the preset's
STEP = -1  # generation step of the figure; -1: the middle of the last fact's query window
SCENARIOS = ("streaming_chat", "needle_qa", "diffuse", "topic_drift", "funnel")
POLICIES = None  # None: every policy of configs/lab.py

# %% [markdown]
# **The GPU / TPU preset.** With `PRESET = "auto"` a GPU or TPU runs the `"full"` sizes and a
# CPU the default ones; QUICK mode (CI) always runs the smallest (`"quick"`). Here `"full"`
# quadruples the world's prompt (2048 tokens), doubles its generation (256 steps) and its layers
# (16) and quadruples the budget (256 tokens per head), which stays an eighth of the prompt.

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

from configs import lab as lab_config
from kvjax import plotting
from kvjax.lab import suite

config = lab_config.get_config("quick" if PRESET == "quick" else None)
if PRESET == "full":
  config.world.update(num_layers=16, prompt_len=2048, gen_steps=256, window=64)
  config.budget = 256
if BUDGET is not None:
  config.budget = BUDGET
config.scenarios = SCENARIOS[:2] if QUICK else SCENARIOS
if POLICIES:
  config.policies = tuple(POLICIES)
elif QUICK:  # each policy compiles once: the smoke run keeps four
  config.policies = ("streaming_llm", "h2o", "snapkv", "oracle")
config.figure_step = STEP
print(config.world, "budget:", config.budget)

# %% [markdown]
# ## Every scenario, every policy
# Each scenario is simulated once for all policies (`kvjax.lab.suite.simulate_scenario`); the figure
# shows the essay's four panels: what the focus policy keeps over time, the attention row at the
# chosen step with the kept part, the retained mass per policy and per layer.

# %%
runs = {s: suite.simulate_scenario(s, config, log=lambda *_: None) for s in config.scenarios}
for sim in runs.values():
  fig = suite.figure(sim, config)
  plt.show()

# %%
summary, _ = suite.summary_tables([row for sim in runs.values() for row in sim.rows])
display(suite.pivot(summary))

# %% [markdown]
# ## The step as a parameter
# With `ipywidgets` (Colab has it) a slider redraws the figure at any generation step; without
# it, the figure is drawn at `STEP`.

# %%
sim = runs[config.scenarios[-1]]
try:
  import ipywidgets as widgets

  widgets.interact(
    lambda step: (suite.figure(sim, config, step), plt.show()),
    step=widgets.IntSlider(sim.step, 0, sim.world.dims.gen_steps - 1),
  )
except ImportError:
  suite.figure(sim, config, sim.step)
  plt.show()

# %% [markdown]
# ## Per layer and per head
# Retained attention mass (mean over generation steps) of each (layer, head) row: uniform
# budgets starve the heads whose attention is spread, which is what head-adaptive allocations
# (Ada-KV, HeadKV) and layer schedules (PyramidKV, CAKE) try to fix.

# %%
by_head = suite.retained_by_head(sim)
plotting.retained_by_head_figure(
  by_head, f"{sim.scenario}: retained mass per (layer, head) at budget {config.budget}"
)
plt.show()
display(by_head.groupby(["policy", "layer"])["retained_mass"].mean().unstack().round(3))
