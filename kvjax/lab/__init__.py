"""The synthetic attention lab: a seeded attention world, every policy replayed online on it,
metrics, the policy x scenario suite and budget sweeps.

``synthetic`` (the world), ``online`` (decode-time replay in a ``lax.scan``), ``metrics``,
``suite`` (what ``python -m experiments.lab`` runs) and ``sweep`` (grids of budget
configurations, vmapped and sharded). ``run`` and ``pivot`` are the suite's.
"""

from kvjax.lab.suite import pivot, run

__all__ = ["pivot", "run"]
