"""Budgets as kvpress compression ratios (``ratio=``): the same kept sets as the equivalent token
budgets, each row's own length for padded rows, no retrace across ratios, and clear errors."""

import numpy as np
import pytest

from kvjax import model as km
from kvjax.model import answers, decoding


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(5, cfg.vocab_size, (2, 40)).astype(np.int32)
  return model, cfg, ids


def test_ratio_budgets_are_kvpress_compute_n_kept():
  # kvpress: int(T * (1 - ratio)) in Python floats
  for T in (1, 7, 40, 1000, 4096):
    for r in (0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.875, 0.9, 0.99):
      assert decoding.ratio_budgets(r, [T])[0] == int(T * (1 - r))
  np.testing.assert_array_equal(decoding.ratio_budgets(0.5, [40, 31]), [20, 15])


@pytest.mark.parametrize(
  ("policy", "options"), [("snapkv", dict(window=4)), ("knorm", {}), ("pyramidkv", dict(window=4))]
)
def test_a_ratio_keeps_what_its_budget_keeps(tiny, policy, options):
  model, _, ids = tiny
  for r in (0.25, 0.5, 0.8):
    got = km.keep_mask(model, ids, policy, km.Ratio(r), **options)
    want = km.keep_mask(model, ids, policy, int(40 * (1 - r)), **options)
    np.testing.assert_array_equal(got, want)


def test_padded_rows_take_their_own_length(tiny):
  model, _, ids = tiny
  mask = np.ones_like(ids)
  mask[1, :10] = 0  # row 1: 30 real tokens
  got = km.keep_mask(model, km.Padded(ids, mask), "knorm", km.Ratio(0.5))
  per_row = got.sum(-1)  # [L, B, H]
  assert (per_row[:, 0] == 20).all() and (per_row[:, 1] == 15).all()
  alone = km.keep_mask(model, ids[1:, 10:], "knorm", 15)
  np.testing.assert_array_equal(got[:, 1:, :, 10:], alone)


def test_generate_with_a_ratio_matches_the_budget_and_does_not_retrace(tiny):
  model, _, ids = tiny
  a = km.generate(model, ids, policy="snapkv", budget=km.Ratio(0.5), max_new_tokens=4, window=4)
  b = km.generate(model, ids, policy="snapkv", budget=20, max_new_tokens=4, window=4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.memory == b.memory
  before = decoding._compress_and_decode._cache_size()
  km.generate(model, ids, policy="snapkv", budget=km.Ratio(0.52), max_new_tokens=4, window=4)
  km.generate(model, ids, policy="snapkv", budget=km.Ratio(0.55), max_new_tokens=4, window=4)
  assert decoding._compress_and_decode._cache_size() == before  # ratios are data


def test_bad_ratios_are_refused(tiny):
  model, _, ids = tiny
  for bad in (1.0, -0.1, "0.5", True, float("nan")):
    with pytest.raises(ValueError, match="ratio: expected a float in \\[0, 1\\)"):
      km.generate(model, ids, policy="knorm", budget=km.Ratio(bad), max_new_tokens=1)
  with pytest.raises(ValueError, match="takes no budget"):
    km.generate(model, ids, policy="full", budget=km.Ratio(0.5), max_new_tokens=1)
  # a ratio that leaves less than the window is named as the ratio the caller gave
  with pytest.raises(ValueError, match=r"^ratio: 0\.99 keeps \d+ tokens"):
    km.keep_mask(model, ids, "snapkv", km.Ratio(0.99), window=4)


@pytest.fixture(scope="module")
def answer_inputs(tiny):
  model, cfg, _ = tiny
  rng = np.random.default_rng(1)
  prompt = rng.integers(5, cfg.vocab_size, (2, 52)).astype(np.int32)  # 48 context + 4 question
  answer = rng.integers(5, cfg.vocab_size, (2, 3)).astype(np.int32)
  return model, prompt, answer


def test_answer_configs_ratios_match_their_budgets(answer_inputs):
  model, prompt, answer = answer_inputs
  kw = dict(policy="snapkv", question=km.Question(4), window=4)
  got = km.answer_configs(model, prompt, answer, budgets=km.Ratio((0.25, 0.5, 0.75)), **kw)
  want = km.answer_configs(model, prompt, answer, [36, 24, 12], **kw)  # int(48 * (1 - r))
  np.testing.assert_array_equal(got.predicted, want.predicted)
  np.testing.assert_array_equal(got.logprobs, want.logprobs)
  np.testing.assert_array_equal(got.budget_LH, want.budget_LH)
  np.testing.assert_array_equal(got.kv_bytes_held, want.kv_bytes_held)
  np.testing.assert_array_equal(got.ratios, [0.25, 0.5, 0.75])
  assert want.ratios is None


def test_answer_configs_compiles_once_for_every_ratio(answer_inputs):
  model, prompt, answer = answer_inputs
  prompt = prompt[:, 2:]  # a shape no other test compiled: 46 context tokens
  kw = dict(policy="knorm", question=km.Question(4))
  fns = (answers._compress_configs, answers._answer_configs)
  before = [f._cache_size() for f in fns]
  km.answer_configs(model, prompt, answer, budgets=km.Ratio((0.2, 0.5, 0.8)), **kw)
  once = [f._cache_size() for f in fns]
  assert [b - a for a, b in zip(before, once, strict=True)] == [1, 1]  # three ratios, one compile
  # other ratios whose largest budget fills the same capacity bucket: nothing compiles again
  km.answer_configs(model, prompt, answer, budgets=km.Ratio((0.25, 0.4, 0.875)), **kw)
  assert [f._cache_size() for f in fns] == once


def test_answer_configs_bad_ratios_are_refused(answer_inputs):
  model, prompt, answer = answer_inputs
  kw = dict(question=km.Question(4))
  for bad in ((1.0,), (-0.1,), ("0.5",), (True,), (float("nan"),), (), 0.5, [[0.5]]):
    with pytest.raises(ValueError, match="ratios: .*expected a non-empty \\[K\\] sequence"):
      km.answer_configs(model, prompt, answer, policy="knorm", budgets=km.Ratio(bad), **kw)
  with pytest.raises(ValueError, match="budgets: .* got neither"):
    km.answer_configs(model, prompt, answer, policy="knorm", **kw)
  with pytest.raises(ValueError, match="budgets: policy 'full' takes no budget"):
    km.answer_configs(model, prompt, answer, policy="full", budgets=km.Ratio((0.5,)), **kw)
  with pytest.raises(ValueError, match="ratios: 0.95 keeps 2 of the 48 context tokens"):
    km.answer_configs(
      model, prompt, answer, policy="snapkv", budgets=km.Ratio((0.5, 0.95)), window=4, **kw
    )
