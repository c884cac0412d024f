"""Confidence intervals and paired tests for the evaluation's accuracies (small pure functions).

Which statistic goes where:

* an accuracy that is a proportion of examples (exact match per example): the Wilson score
  interval (:func:`wilson_interval`); over several cells of equal size (tasks x lengths, each
  weighted equally) it is the Wilson interval of the pooled examples, since the mean of
  equal-sized proportions is the pooled proportion (:func:`proportion_interval`);
* a mean of per-example fractional scores (RULER's ``string_match_all`` recall), or proportions
  over cells of unequal size: a seeded percentile bootstrap over examples, resampled within each
  cell (:func:`bootstrap_interval`);
* a difference between two policies on the same examples: the exact McNemar test on the
  discordant pairs of per-example correct/incorrect (:func:`mcnemar_exact`), or a seeded paired
  bootstrap of the per-example score differences (:func:`paired_bootstrap_pvalue`);
* many comparisons in one table: Holm's step-down adjustment (:func:`holm`).

Everything is exact or seeded, so a table is the same on every rerun; the normal quantile comes
from the standard library (no scipy).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0  # the bootstrap's seed: intervals and p-values are the same on every rerun


def _check_confidence(confidence: float) -> float:
  if isinstance(confidence, bool) or not 0 < float(confidence) < 1:
    raise ValueError(f"confidence: expected a level in (0, 1), got {confidence!r}")
  return float(confidence)


def _z(confidence: float) -> float:
  return statistics.NormalDist().inv_cdf(0.5 + _check_confidence(confidence) / 2)


def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
  """The Wilson score interval of a proportion ``successes / n``.

  Unlike the normal approximation it stays inside ``[0, 1]`` and is not empty at 0 or ``n``
  successes, which matters for cells of a few examples.

  Args:
    successes: the examples answered correctly.
    n: the examples (at least 1).
    confidence: the coverage (0.95: a 95 % interval).

  Returns:
    ``(low, high)``.

  Raises:
    ValueError: for ``n < 1`` or ``successes`` outside ``[0, n]``.
  """
  if isinstance(n, bool) or int(n) != n or n < 1:
    raise ValueError(f"n: expected a positive count of examples, got {n!r}")
  if int(successes) != successes or not 0 <= successes <= n:
    raise ValueError(f"successes: expected an integer in [0, n={n}], got {successes!r}")
  z = _z(confidence)
  p, z2 = successes / n, z * z
  center = (p + z2 / (2 * n)) / (1 + z2 / n)
  half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  # exact ends at 0 and n successes (the formula gives them up to rounding)
  low = 0.0 if successes == 0 else max(0.0, center - half)
  high = 1.0 if successes == n else min(1.0, center + half)
  return low, high


def _groups(name: str, groups) -> list[np.ndarray]:
  arrays = [np.asarray(g, float).ravel() for g in groups]
  if not arrays or any(a.size == 0 for a in arrays):
    raise ValueError(f"{name}: expected one or more non-empty arrays of per-example scores")
  if any(not np.isfinite(a).all() for a in arrays):
    raise ValueError(f"{name}: expected finite per-example scores")
  return arrays


def _bootstrap_means(arrays: list[np.ndarray], resamples: int, seed: int) -> np.ndarray:
  """``[resamples]`` means over the groups (each weighted equally) of each group's mean over
  examples resampled with replacement within it."""
  if isinstance(resamples, bool) or int(resamples) != resamples or resamples < 1:
    raise ValueError(f"resamples: expected a positive int, got {resamples!r}")
  rng = np.random.default_rng(seed)
  total = np.zeros(int(resamples))
  for a in arrays:
    idx = rng.integers(0, a.size, size=(int(resamples), a.size))
    total += a[idx].mean(1)
  return total / len(arrays)


def bootstrap_interval(
  groups: Sequence,
  *,
  confidence: float = CONFIDENCE,
  resamples: int = RESAMPLES,
  seed: int = SEED,
) -> tuple[float, float]:
  """A seeded percentile bootstrap interval of a mean of per-example scores.

  The statistic is the mean over ``groups`` (cells such as tasks x lengths, each weighted
  equally, as the tables average them) of each group's mean; examples are resampled with
  replacement within their group.

  Args:
    groups: one or more 1-D arrays of per-example scores (one array: a plain mean).
    confidence: the coverage.
    resamples: bootstrap resamples.
    seed: the generator's seed (the same interval on every call).

  Returns:
    ``(low, high)``.

  Raises:
    ValueError: for no group, an empty or non-finite one, or a bad ``confidence``/``resamples``.
  """
  arrays = _groups("groups", groups)
  alpha = 1 - _check_confidence(confidence)
  means = _bootstrap_means(arrays, resamples, seed)
  low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
  return float(low), float(high)


def proportion_interval(
  groups: Sequence,
  *,
  confidence: float = CONFIDENCE,
  resamples: int = RESAMPLES,
  seed: int = SEED,
) -> tuple[float, float]:
  """The interval of a mean of per-cell proportions (per-example 0/1 outcomes in each group).

  Groups of one size: the Wilson interval of the pooled examples (their equal-weight mean is the
  pooled proportion); groups of different sizes: :func:`bootstrap_interval`.

  Args:
    groups: one or more 1-D arrays of per-example outcomes, each 0 or 1.
    confidence: the coverage.
    resamples: bootstrap resamples (unequal sizes only).
    seed: the bootstrap's seed (unequal sizes only).

  Returns:
    ``(low, high)``.

  Raises:
    ValueError: for no group, an empty one, or outcomes other than 0 and 1.
  """
  arrays = _groups("groups", groups)
  if any(not np.isin(a, (0.0, 1.0)).all() for a in arrays):
    raise ValueError("groups: expected per-example outcomes of 0 or 1")
  if len({a.size for a in arrays}) == 1:
    total = np.concatenate(arrays)
    return wilson_interval(int(total.sum()), total.size, confidence)
  return bootstrap_interval(arrays, confidence=confidence, resamples=resamples, seed=seed)


def _pairs(a, b) -> tuple[np.ndarray, np.ndarray]:
  a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
  if a.shape != b.shape:
    raise ValueError(f"b: expected the {a.size} examples of a, paired, got {b.size}")
  return a, b


def mcnemar_exact(a, b) -> float:
  """The two-sided exact McNemar test of two policies on the same examples.

  Only the discordant pairs count: ``n01`` examples only ``b`` got right, ``n10`` only ``a``.
  Under the null (no difference) ``n10 ~ Binomial(n01 + n10, 1/2)``; the p-value is twice the
  smaller tail, at most 1 (``math.comb``, exact at any size).

  Args:
    a: per-example correctness (bool or 0/1) of one policy.
    b: the same examples' correctness under the other, in the same order.

  Returns:
    The p-value (1.0 when no pair is discordant).

  Raises:
    ValueError: for arrays of different sizes or values other than 0 and 1.
  """
  a, b = _pairs(a, b)
  for name, x in (("a", a), ("b", b)):
    if not np.isin(x, (0, 1)).all():
      raise ValueError(f"{name}: expected per-example correctness (bool or 0/1)")
  a, b = a.astype(bool), b.astype(bool)
  n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
  n = n10 + n01
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(n10, n01) + 1))
  return min(1.0, 2 * tail / 2**n)


def paired_bootstrap_pvalue(
  groups_a: Sequence, groups_b: Sequence, *, resamples: int = RESAMPLES, seed: int = SEED
) -> float:
  """A seeded paired bootstrap test of a difference in mean per-example scores.

  The per-example differences ``a - b`` are resampled within each group (cell), the statistic
  being the equal-weight mean over groups (as :func:`bootstrap_interval`); the two-sided p-value
  is twice the smaller share of resampled differences on either side of 0 (at most 1), so
  ``p < alpha`` exactly when 0 lies outside the ``1 - alpha`` percentile interval of the
  difference.

  Args:
    groups_a: per-example scores of one policy, one array per cell.
    groups_b: the other policy's on the same examples, in the same order.
    resamples: bootstrap resamples.
    seed: the generator's seed.

  Returns:
    The p-value (1.0 when every difference is 0).

  Raises:
    ValueError: for groups that do not pair up, or empty or non-finite ones.
  """
  a, b = _groups("groups_a", groups_a), _groups("groups_b", groups_b)
  if len(a) != len(b) or any(x.size != y.size for x, y in zip(a, b, strict=False)):
    raise ValueError(
      f"groups_b: expected arrays of sizes {[x.size for x in a]} paired with groups_a, got "
      f"{[y.size for y in b]}"
    )
  diffs = [x - y for x, y in zip(a, b, strict=True)]
  if all((d == 0).all() for d in diffs):
    return 1.0
  means = _bootstrap_means(diffs, resamples, seed)
  return float(min(1.0, 2 * min((means <= 0).mean(), (means >= 0).mean())))


def holm(pvalues: Sequence[float], alpha: float = 1 - CONFIDENCE) -> list[bool]:
  """Holm's step-down rejections of a family of tests at level ``alpha``.

  The ``i``-th smallest p-value (from 0) is rejected when it and every smaller one are below
  ``alpha / (m - i)``; it controls the chance of any false rejection among the ``m``.

  Args:
    pvalues: the family's p-values.
    alpha: the family-wise level.

  Returns:
    Whether each test (in the given order) is rejected.

  Raises:
    ValueError: for p-values outside ``[0, 1]`` or ``alpha`` outside ``(0, 1)``.
  """
  p = np.asarray(pvalues, float).ravel()
  if not ((p >= 0) & (p <= 1)).all():
    raise ValueError(f"pvalues: expected values in [0, 1], got {p.tolist()}")
  if not 0 < alpha < 1:
    raise ValueError(f"alpha: expected a level in (0, 1), got {alpha!r}")
  m, out = p.size, [False] * p.size
  for rank, i in enumerate(np.argsort(p, kind="stable")):
    if p[i] >= alpha / (m - rank):
      break
    out[int(i)] = True
  return out
