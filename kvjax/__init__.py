"""kvjax: KV-cache eviction policies with per-layer and per-head budgets, in JAX.

The pipeline (``docs/concepts.md``): every method is four pure steps over stacked arrays,

    evidence --score--> scores_LHT --allocate--> budget_LH --select--> keep_LHT / (idx_LHC, valid_LHC)

and the package is laid out in layers whose imports point one way (down this list):

* the core, ``select``, ``scores``, ``budgets`` and ``policies`` (policies as typed, frozen
  objects: the protocol, allocators, one class per method, wrappers, and the registry that names
  them), which import nothing else from kvjax;
* three leaves, ``rundir`` (run directories: one config per directory, rows appended durably),
  ``plotting`` (figures from arrays and tables) and ``distributed`` (several JAX processes:
  start-up, process 0's run directory, gathering and failing fast);
* ``kvjax.lab``: the synthetic attention world, online replay of every policy, metrics, the
  policy x scenario suite and budget sweeps;
* ``kvjax.model``: a flax nnx decoder (Llama, Mistral, Qwen, Gemma 2/3, Phi-3), checkpoint
  loading, tokenizers, the compressed cache and decoding through it;
* ``kvjax.eval``: long-context tasks, accuracy against budget on a real model, attention funnel
  statistics, training of the tiny model and its card (it may use ``lab`` and ``model``).

The shape key (every array name ends in the letters of its axes):

    L layers            H heads (query or KV, per the granularity)    G KV heads
    T key positions     W window queries      Q query positions (a block of them)
    S generation steps  D head dim            B batch
    C cache capacity (slots)                  K configurations
    V vocabulary        N answer tokens       d model width
"""

from kvjax import budgets, policies, scores, select

__all__ = ["budgets", "policies", "scores", "select"]
__version__ = "0.1.0"
