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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/02_layer_funneling.ipynb)
#
# # Layer funneling
#
# PyramidKV (Cai et al., 2024) motivates its pyramid of layer budgets with a figure: on a
# multi-document prompt, lower layers attend broadly, middle layers within documents, upper
# layers to a few tokens. This notebook reproduces the recipe (per-layer attention maps, mean over
# heads, colour saturating at 0.01, evenly spaced layers) on a real model, measures the funnel per
# layer (entropy, first-token mass, own-document mass, keys holding 90 % of the mass), does the
# same on the synthetic `funnel` world, and asks what the funnel implies for layer budgets.
#
# `MODEL = "tiny"` is the small model shipped with kvjax (runs anywhere, no download); on Colab
# set it to a Hugging Face id such as `"meta-llama/Llama-3.2-1B"` or `"Qwen/Qwen2.5-0.5B"`.

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
QUICK = False  # CI injects QUICK = True
MODEL = "tiny"  # or a Hugging Face id / local directory
NUM_DOCS = 4
DOC_LEN = 96  # tokens per document
NUM_MAPS = 4  # evenly spaced layers drawn
BUDGET = 64  # mean tokens per (layer, head) for the allocation comparison

# %%
if QUICK:
  NUM_DOCS, DOC_LEN = 3, 40
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

from kvjax import plotting
from kvjax.eval import evaluate, funnel
from kvjax.lab import synthetic

model, cfg, tokenizer = evaluate.load_model(MODEL)
ids, doc = funnel.multi_document_prompt(tokenizer, num_docs=NUM_DOCS, doc_len=DOC_LEN)
print(f"{cfg.num_layers} layers, {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads;")
print(f"prompt of {ids.size} tokens:", tokenizer.decode(ids[:24]), "...")

# %% [markdown]
# ## Attention maps, PyramidKV's recipe

# %%
layers = funnel.evenly_spaced_layers(cfg.num_layers, NUM_MAPS)
maps = funnel.model_attention(model, ids, layers)
plotting.attention_maps(
  maps, funnel.document_edges(doc), vmax=0.01, title=f"{MODEL}: attention (mean over heads)"
)
plt.show()

# %% [markdown]
# ## The funnel, per layer

# %%
model_table = funnel.model_funnel(model, ids, doc).assign(source=MODEL)
display(model_table.round(3))
plotting.funnel_statistics(model_table, title=f"{MODEL} on a {NUM_DOCS}-document prompt")
plt.show()

# %% [markdown]
# ## The same on the synthetic `funnel` world
# The lab's `funnel` scenario builds the funnel in by hand (attention concentration grows with
# depth); its statistics should look like the real model's when the synthetic world is a fair
# stand-in.

# %%
from configs import lab as lab_config

world_cfg = lab_config.get_config("quick" if QUICK else None).world
world = synthetic.make_world(synthetic.world_config("funnel", world_cfg))
syn_maps = funnel.synthetic_attention(world, steps=32 if QUICK else 96)
shown = {layer: syn_maps[layer] for layer in funnel.evenly_spaced_layers(len(syn_maps), NUM_MAPS)}
plotting.attention_maps(shown, vmax=0.01, title="synthetic funnel world (query rows x keys)")
plt.show()
syn_table = funnel.synthetic_funnel(world).assign(source="synthetic funnel")
both = pd.concat([model_table, syn_table], ignore_index=True)
plotting.funnel_statistics(both, title=f"{MODEL} vs the synthetic funnel world")
plt.show()

# %% [markdown]
# ## What the funnel implies for layer budgets
# At the same mean budget per head: uniform (SnapKV), PyramidKV's linear schedule (more at the
# bottom), CAKE's preference from each layer's entropy and variance on *this* prompt, and Ada-KV's
# head-adaptive split (same layer totals as uniform, redistributed over heads).

# %%
profiles = funnel.model_layer_budgets(model, ids, min(BUDGET, ids.size // 2))
plotting.layer_budgets(profiles, title=f"{MODEL}: per-layer budgets at equal total")
plt.show()
display(pd.DataFrame({k: v.mean(-1) for k, v in profiles.items()}).round(1))
