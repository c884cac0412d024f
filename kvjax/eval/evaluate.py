"""Accuracy against budget on the task suite, for every policy, with a real model and cache.

For each (task, context length) a fixed set of held-out examples is prefilled once for every
policy, ``batch`` examples at a time (all at once by default), and answered under every budget of
the grid at once (:func:`kvjax.model.answers.answer_prefilled`: compress and decode vmapped over
budgets), or under every kvpress compression ratio of ``config.ratios`` (each row holds its
ratio and the token budget it kept).
Each (task, length, policy) group appends its rows to ``results.csv`` as soon as its last batch
is done; a rerun skips the groups already there (like sweeps).
Besides accuracy, each row carries the teacher-forced next-token KL divergence between the full and
the compressed cache, ``KL(p_full || p_compressed)`` averaged over the scored answer tokens; the
K/V bytes the compressed context cache really held (counted from the cache, so a policy keeping
whole heads or layers shows what it kept, not its nominal budget) and their fraction of the full
cache's; 95 % intervals of accuracy (Wilson) and recall (seeded bootstrap,
:mod:`kvjax.eval.stats`); and every example's outcome, in order, so that the tables can pair
policies on the same examples.

The needle heatmap (accuracy over depth x context length, the PyramidKV and SnapKV papers'
figure) comes from the same machinery with ``depth`` fixed per cell. ``tables.md`` beside the
results holds their markdown tables (:mod:`kvjax.eval.report`).

The parts, each re-exported here as ``evaluate.X``: :mod:`kvjax.eval.run_setup` (the config's
validation, the model, :func:`prepare`), :mod:`kvjax.eval.grouping` (the examples and one
group's answers, :func:`evaluate_group`), :mod:`kvjax.eval.evidence_sources` (calibration,
trained surrogates, context evidence) and :mod:`kvjax.eval.runner` (:func:`run` and the
results file).
"""

from __future__ import annotations

from kvjax.eval import tasks  # the task suite, reached as evaluate.tasks
from kvjax.eval.evidence_sources import (
  CALIBRATION_EVIDENCE,
  CONTEXT_EVIDENCE,
  LEARNED_EVIDENCE,
  PREFILL_EVIDENCE,
  RESTORE_RESOURCE,
  check_calibration,
  context_evidence,
  kvzip_template,
  learned_paths,
  load_calibration,
  load_learned,
  policy_needs,
)
from kvjax.eval.grouping import (
  ALL_TASKS,
  EVAL_SEED,
  FULL,
  Shared,
  accuracy,
  evaluate_group,
  example_batches,
  examples,
  finish_row,
  full_cache_scores,
  head_retrieval_scores,
  kl_divergence,
  merge_batches,
  policy_entry,
  prefill_examples,
  recall,
  shared_shape,
)
from kvjax.eval.run_setup import (
  CONFIG_FIELDS,
  NOT_IDENTITY,
  Prepared,
  check_ratios_fit,
  config_ratios,
  load_model,
  prepare,
  question_modes,
  validate_config,
)
from kvjax.eval.runner import (
  COLUMNS,
  EXAMPLE_COLUMNS,
  GROUP_COLUMNS,
  INTERVAL_COLUMNS,
  MEMORY_COLUMNS,
  check_results_columns,
  complete_groups,
  gathered_groups,
  ratio_view,
  run,
)

__all__ = [
  "ALL_TASKS",
  "CALIBRATION_EVIDENCE",
  "COLUMNS",
  "CONFIG_FIELDS",
  "CONTEXT_EVIDENCE",
  "EVAL_SEED",
  "EXAMPLE_COLUMNS",
  "FULL",
  "GROUP_COLUMNS",
  "INTERVAL_COLUMNS",
  "LEARNED_EVIDENCE",
  "MEMORY_COLUMNS",
  "NOT_IDENTITY",
  "PREFILL_EVIDENCE",
  "RESTORE_RESOURCE",
  "Prepared",
  "Shared",
  "accuracy",
  "check_calibration",
  "check_ratios_fit",
  "check_results_columns",
  "complete_groups",
  "config_ratios",
  "context_evidence",
  "evaluate_group",
  "example_batches",
  "examples",
  "finish_row",
  "full_cache_scores",
  "gathered_groups",
  "head_retrieval_scores",
  "kl_divergence",
  "kvzip_template",
  "learned_paths",
  "load_calibration",
  "load_learned",
  "load_model",
  "merge_batches",
  "policy_entry",
  "policy_needs",
  "prefill_examples",
  "prepare",
  "question_modes",
  "ratio_view",
  "recall",
  "run",
  "shared_shape",
  "tasks",
  "validate_config",
]
