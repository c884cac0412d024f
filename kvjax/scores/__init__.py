"""Scores: evidence -> ``scores_LHT`` (higher = keep), one pure function per method.

Each scorer follows one official implementation (the methods catalogue, ``docs/methods.md``); its
docstring names the reference and the keyword defaults are the reference defaults. Scores never
depend on budgets (that is :mod:`kvjax.budgets`), and nothing here selects (that is
:mod:`kvjax.select`). Softmax and accumulation run in fp32 whatever the input dtype.

Protection (sinks, the observation/recent window) is the score transform :func:`protect`, which
writes ``+inf``: protected positions are always selected first and count inside the budget, as in
every reference implementation (the window is part of ``max_capacity_prompt``).

The package, one module per concern: :mod:`kvjax.scores.attention` (the window attention, the
attention column sums, reductions over window rows, :data:`PRECISION`),
:mod:`kvjax.scores.transforms` (:func:`protect`, :func:`pool1d`, :func:`group`),
:mod:`kvjax.scores.classic` (recency, StreamingLLM, SnapKV, H2O, TOVA, K-norm, random, oracle,
CAKE), :mod:`kvjax.scores.rope` (ExpectedAttention and its RoPE statistics) and
:mod:`kvjax.scores.modern` (KeyDiff, LagKV, CriticalKV, ChunkKV, Q-Filters, DuoAttention, KVzip,
ThinK, R-KV). Every scorer is reachable here, as ``scores.snapkv``.
"""

from __future__ import annotations

import jax

from .attention import (
  COLUMN_SUM_MASKS,
  PRECISION,
  attention_column_sums,
  mean_rows,
  sum_rows,
  var_rows,
  window_attention,
)
from .classic import (
  H2O_FORMS,
  REDUCES,
  cake,
  h2o,
  h2o_from_column_sums,
  knorm,
  oracle,
  random,
  recency,
  snapkv,
  streaming,
  tova,
)
from .modern import (
  chunkkv,
  critical,
  duo_streaming_heads,
  group_norms,
  key_similarity_redundancy,
  keydiff,
  kvzip,
  lagkv,
  qfilter,
  rkv,
  think_channel_mask,
  think_channel_scores,
)
from .rope import (
  ExpectedAttentionOptions,
  average_rope,
  expected_attention,
  expected_query_stats,
)
from .transforms import (
  GROUPINGS,
  POOLS,
  check_count,
  check_kernel,
  group,
  pool1d,
  protect,
)

Array = jax.Array

__all__ = [
  "COLUMN_SUM_MASKS",
  "ExpectedAttentionOptions",
  "GROUPINGS",
  "H2O_FORMS",
  "POOLS",
  "PRECISION",
  "REDUCES",
  "attention_column_sums",
  "average_rope",
  "cake",
  "check_count",
  "check_kernel",
  "chunkkv",
  "critical",
  "duo_streaming_heads",
  "expected_attention",
  "expected_query_stats",
  "group",
  "group_norms",
  "h2o",
  "h2o_from_column_sums",
  "key_similarity_redundancy",
  "keydiff",
  "knorm",
  "kvzip",
  "lagkv",
  "mean_rows",
  "oracle",
  "pool1d",
  "protect",
  "qfilter",
  "random",
  "recency",
  "rkv",
  "snapkv",
  "streaming",
  "sum_rows",
  "think_channel_mask",
  "think_channel_scores",
  "tova",
  "var_rows",
  "window_attention",
]
