"""Allocation search: per-layer ``[L]`` and per-layer-and-KV-head ``[L, G]`` budgets found at a
fixed memory, instead of hand-made schedules (EvolKV, arXiv 2509.08315; BaKlaVa).

* :mod:`~kvjax.eval.search.space`: any real vector -> a feasible integer allocation whose total
  is the memory budget exactly (:class:`Space`), from free logits or a rule's few parameters;
* :mod:`~kvjax.eval.search.allocator_spaces`: a named allocator's few parameters as the space
  (PyramidKV's ``beta``, Ada-KV's ``floor_alpha``, CAKE's temperatures);
* :mod:`~kvjax.eval.search.fitness`: the retained attention mass of an allocation, from the
  lab's world or a real model's calibration prompts, vmapped over a population;
* :mod:`~kvjax.eval.search.optimise`: evosax's CMA-ES, SNES, OpenAI-ES and random search, one
  compiled call per generation, checkpointed with orbax and resumable;
* :mod:`~kvjax.eval.search.results`: the allocation file (read back by
  :class:`kvjax.policies.searched.Searched`) and the hand-made baselines at the same memory;
* :mod:`~kvjax.eval.search.runner`: a search from a config (``experiments/search.py``).
"""

from kvjax.eval.search import allocator_spaces, fitness, optimise, space
from kvjax.eval.search.allocator_spaces import ALLOCATOR_RULES, AdaKVSpace, CakeSpace, PyramidSpace
from kvjax.eval.search.fitness import MassTable, lab_table, model_table, retained_mass
from kvjax.eval.search.optimise import OPTIMISERS, SearchOptions, SearchResult, population_call
from kvjax.eval.search.space import RULES, Space

__all__ = [
  "ALLOCATOR_RULES",
  "OPTIMISERS",
  "RULES",
  "AdaKVSpace",
  "CakeSpace",
  "MassTable",
  "PyramidSpace",
  "SearchOptions",
  "SearchResult",
  "Space",
  "allocator_spaces",
  "fitness",
  "lab_table",
  "model_table",
  "optimise",
  "population_call",
  "retained_mass",
  "space",
]
