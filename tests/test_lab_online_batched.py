"""The lab's batched replay: every (world, budget) case is the per-case replay, to the bit."""

import jax
import numpy as np
import pytest

from kvjax.lab import online, synthetic

SIZES = dict(num_layers=2, num_heads=2, prompt_len=96, gen_steps=12, window=8, seed=0)
BUDGETS = (18, 24, 36)


def worlds():
  return [synthetic.make_world(synthetic.world_config(n, SIZES)) for n in ("needle_qa", "diffuse")]


@pytest.mark.parametrize(
  "policy, options",
  [
    ("sliding_window", {}),
    ("h2o", dict(recent=None)),
    ("tova", {}),
    ("pyramidkv", {}),  # allocates: each budget's own budget_LH, one shared capacity
    ("random", {}),
    ("oracle", {}),
    ("knorm", {}),  # reads the modelled keys
  ],
)
def test_each_case_is_the_per_case_replay_to_the_bit(policy, options):
  ws = worlds()
  evidence = [online.prompt_evidence(w, jax.random.key(0)) for w in ws]
  batched = online.simulate_batch(
    ws, policy, BUDGETS, record_map=True, evidence=evidence, **options
  )
  capacity = batched[0][0].positions_SLHC.shape[-1]
  assert capacity == max(int(np.asarray(t.budget_LH).max()) for row in batched for t in row)
  for world, ev, row in zip(ws, evidence, batched, strict=True):
    for budget, got in zip(BUDGETS, row, strict=True):
      want = online.simulate(
        world, policy, budget, capacity=capacity, record_map=True, evidence=ev, **options
      )
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_one_program_serves_every_world_and_later_calls():
  ws = worlds()
  online.simulate_batch(ws, "snapkv", BUDGETS, capacity=40)
  size = online._simulate_budgets._cache_size()
  online.simulate_batch(ws[::-1], "snapkv", (20, 30, 40), capacity=40)
  assert online._simulate_budgets._cache_size() == size


def test_every_case_is_checked_before_any_replay():
  ws = worlds()
  with pytest.raises(ValueError, match="budget: 10000 is larger than the world"):
    online.simulate_batch(ws, "sliding_window", (24, 10_000))
  with pytest.raises(ValueError, match="capacity: 20 is smaller than the largest budget 36"):
    online.simulate_batch(ws, "sliding_window", BUDGETS, capacity=20)
  with pytest.raises(ValueError, match="evidence: 1 entries for 2 worlds"):
    online.simulate_batch(ws, "sliding_window", BUDGETS, evidence=ws[:1])
  with pytest.raises(ValueError, match="is not simulated in the lab"):
    online.simulate_batch(ws, "snapkv", BUDGETS, channel_ratio=0.5)
  assert online.simulate_batch(ws, "snapkv", ()) == [[], []]
