"""The evaluation's intervals and paired tests against hand-computed and published values."""

import math

import numpy as np
import pytest

from kvjax.eval import stats


@pytest.mark.parametrize(
  ("successes", "n", "low", "high"),
  [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I,
    # the Wilson score method's 95 % intervals
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
    # by hand: p = 1/2 is the centre; at 0 of n the upper end is z^2 / (n + z^2)
    (2, 4, 0.1500, 0.8500),
    (0, 4, 0.0, 3.8415 / 7.8415),
  ],
)
def test_wilson_matches_published_and_hand_values(successes, n, low, high):
  got = stats.wilson_interval(successes, n)
  np.testing.assert_allclose(got, (low, high), atol=6e-5)


def test_wilson_ends_solve_the_score_equation():
  # each end pi satisfies (p - pi)^2 = z^2 pi (1 - pi) / n
  z2 = 1.959963984540054**2
  for s, n in ((3, 7), (10, 13), (1, 50)):
    for pi in stats.wilson_interval(s, n):
      assert math.isclose((s / n - pi) ** 2, z2 * pi * (1 - pi) / n, rel_tol=1e-9)
  lo90, hi90 = stats.wilson_interval(3, 7, confidence=0.9)
  lo95, hi95 = stats.wilson_interval(3, 7)
  assert lo95 < lo90 < 3 / 7 < hi90 < hi95


@pytest.mark.parametrize(
  ("call", "match"),
  [
    (lambda: stats.wilson_interval(1, 0), r"n: expected a positive count"),
    (lambda: stats.wilson_interval(5, 4), r"successes: expected an integer in \[0, n=4\]"),
    (lambda: stats.wilson_interval(1, 4, confidence=1.0), r"confidence: expected a level"),
    (lambda: stats.bootstrap_interval([]), r"groups: expected one or more non-empty"),
    (lambda: stats.bootstrap_interval([[0.5]], resamples=0), r"resamples: expected a positive"),
    (lambda: stats.proportion_interval([[0.5, 1]]), r"groups: expected per-example outcomes"),
    (lambda: stats.mcnemar_exact([1, 0], [1]), r"b: expected the 2 examples of a"),
    (lambda: stats.mcnemar_exact([2, 0], [1, 0]), r"a: expected per-example correctness"),
    (lambda: stats.paired_bootstrap_pvalue([[1, 0]], [[1]]), r"groups_b: expected arrays"),
    (lambda: stats.holm([0.5, 1.5]), r"pvalues: expected values in \[0, 1\]"),
  ],
)
def test_bad_arguments_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_mcnemar_exact_by_hand():
  def pairs(n10, n01, both=0):
    a = [1] * n10 + [0] * n01 + [1] * both
    b = [0] * n10 + [1] * n01 + [1] * both
    return a, b

  # p = 2 * sum_{i <= min} C(n, i) / 2^n over the n discordant pairs
  assert stats.mcnemar_exact(*pairs(0, 5)) == 2 / 32
  assert stats.mcnemar_exact(*pairs(0, 6, both=9)) == 2 / 64  # concordant pairs do not count
  assert stats.mcnemar_exact(*pairs(1, 9)) == 2 * 11 / 1024
  assert stats.mcnemar_exact(*pairs(3, 12)) == 2 * (1 + 15 + 105 + 455) / 2**15
  assert stats.mcnemar_exact(*pairs(4, 4)) == 1.0  # capped at 1
  assert stats.mcnemar_exact([True, False], [True, False]) == 1.0  # no discordant pair
  # symmetric in the two policies, and exact at sizes where floats of 2^n would overflow
  assert stats.mcnemar_exact(*pairs(9, 1)) == stats.mcnemar_exact(*pairs(1, 9))
  assert 0 < stats.mcnemar_exact(*pairs(500, 600)) < 0.01


def test_bootstrap_by_hand_and_against_wilson():
  # every resample of constant cells has the same equal-weight mean
  assert stats.bootstrap_interval([[1, 1], [0, 0, 0]]) == (0.5, 0.5)
  assert stats.bootstrap_interval([[0.25] * 4]) == (0.25, 0.25)
  # seeded: the same interval on every call, another with another seed
  x = np.linspace(0, 1, 30) ** 2
  assert stats.bootstrap_interval([x]) == stats.bootstrap_interval([x])
  assert stats.bootstrap_interval([x], seed=1) != stats.bootstrap_interval([x])
  # a large sample of 0/1 outcomes: close to Wilson's interval
  outcomes = np.r_[np.ones(40), np.zeros(60)]
  np.testing.assert_allclose(
    stats.bootstrap_interval([outcomes]), stats.wilson_interval(40, 100), atol=0.02
  )


def test_proportion_interval_pools_equal_cells_and_bootstraps_unequal_ones():
  cells = [[1, 0, 1, 1], [0, 0, 1, 0]]
  assert stats.proportion_interval(cells) == stats.wilson_interval(4, 8)
  unequal = [[1, 1], [0, 0, 0, 1]]
  assert stats.proportion_interval(unequal) == stats.bootstrap_interval(unequal)


def test_paired_bootstrap_by_hand():
  # d = [1, 0]: resampled means 1, 1/2, 1/2, 0 (each 1/4), so P(mean <= 0) = 1/4 and p = 1/2
  assert abs(stats.paired_bootstrap_pvalue([[1, 0]], [[0, 0]]) - 0.5) < 0.05
  # d = [1, -1]: P(mean <= 0) = P(mean >= 0) = 3/4, so p = 1
  assert stats.paired_bootstrap_pvalue([[1, 0]], [[0, 1]]) == 1.0
  assert stats.paired_bootstrap_pvalue([[0.5, 1]], [[0.5, 1]]) == 1.0  # no difference
  # a difference on every one of 20 examples: no resample crosses 0
  assert stats.paired_bootstrap_pvalue([np.ones(20)], [np.zeros(20)]) == 0.0


def test_holm_by_hand():
  # 0.01 < 0.05/4; 0.03 >= 0.05/3 stops the step-down
  assert stats.holm([0.01, 0.04, 0.03, 0.2]) == [True, False, False, False]
  assert stats.holm([0.04, 0.001, 0.02]) == [True, True, True]  # 0.001 < .05/3, .02 < .05/2
  assert stats.holm([]) == []
