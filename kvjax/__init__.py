"""kvjax: KV-cache eviction policies with per-layer and per-head budgets, in JAX.

The pipeline (DESIGN.md): evidence -> ``scores`` -> ``budgets`` -> ``select``.
"""

from kvjax import budgets, policies, scores, select

__all__ = ["budgets", "policies", "scores", "select"]
__version__ = "0.1.0"
