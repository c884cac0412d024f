"""Bad input at the model's entry points: allocations below a policy's protected window, ratios
as jax scalars, and a ratio too small named as the ratio."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(4, cfg.vocab_size, (1, 64)).astype(np.int32)
  return model, cfg, ids


def test_a_per_layer_allocation_below_the_window_is_refused(tiny):
  model, cfg, ids = tiny
  ratios = (0.0,) * (cfg.num_layers - 1) + (0.99,)
  pol = policies.SnapKV(window=8, allocator=policies.PerLayer(compression_ratios=ratios))
  with pytest.raises(ValueError, match="fewer than the protected window of 8"):
    km.generate(model, ids, policy=pol, budget=32, max_new_tokens=2)
  with pytest.raises(ValueError, match="fewer than the protected window of 8"):
    km.keep_mask(model, ids, pol, 32)


def test_ratios_as_jax_scalars_and_too_small_ratios_named(tiny):
  model, _, ids = tiny
  a = km.generate(
    model, ids, policy="snapkv", window=8, budget=km.Ratio(jnp.float32(0.5)), max_new_tokens=2
  )
  b = km.generate(model, ids, policy="snapkv", window=8, budget=km.Ratio(0.5), max_new_tokens=2)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  with pytest.raises(ValueError, match=r"^ratio: 0.95 keeps 3 tokens"):
    km.generate(model, ids, policy="snapkv", budget=km.Ratio(0.95), max_new_tokens=2)
  with pytest.raises(ValueError, match="^ratio: "):
    km.generate(
      model, ids, policy="snapkv", window=8, budget=km.Ratio(jnp.bool_(True)), max_new_tokens=2
    )
