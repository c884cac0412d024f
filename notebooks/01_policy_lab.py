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
# Colab: install kvjax (CI skips this cell; locally, `pip install -e .` from the repository).
# !pip install -q "kvjax @ git+https://github.com/kvjax/kvjax"

# %%
import jax

print("jax", jax.__version__, "| backend:", jax.default_backend(), "|", jax.devices())

# %% tags=["parameters"]
QUICK = False  # CI injects QUICK = True: a small world, two scenarios
BUDGET = 64  # tokens per (layer, head), sinks and window included
STEP = -1  # generation step of the figure; -1: the middle of the last fact's query window
SCENARIOS = ("streaming_chat", "needle_qa", "diffuse", "topic_drift", "funnel")

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from configs import lab as lab_config
from kvjax import plotting
from kvjax.lab import suite

config = lab_config.get_config("quick" if QUICK else None)
config.budget = min(BUDGET, 32) if QUICK else BUDGET
config.scenarios = SCENARIOS[:2] if QUICK else SCENARIOS
config.figure_step = STEP
print(config.world)

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
