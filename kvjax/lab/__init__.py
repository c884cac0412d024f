"""The synthetic attention lab: a seeded attention world, every policy replayed online on it,
metrics, the policy x scenario suite and budget sweeps.

``synthetic`` (the world), ``online`` (decode-time replay in a ``lax.scan``), ``metrics``,
``suite`` (what ``python -m experiments.lab`` runs), budget sweeps in three rooms: ``grid``
(fields, axis vocabularies, expansion, validation), ``groups`` (a group's evidence, allocation
and compiled evaluation) and ``sweep`` (the engine and run directory), and ``keys`` (modelled
keys for the attention-free scorers).
``run`` and ``pivot`` are the suite's; ``run_keys``, ``key_pivot`` and ``versus`` its
attention-free comparison (``configs/lab_keys.py``).
"""

from kvjax.lab.suite import key_pivot, pivot, run, run_keys, versus

__all__ = ["key_pivot", "pivot", "run", "run_keys", "versus"]
