"""A policy whose scores hold NaN is an error wherever a model entry point sees it: NaN cannot be
ranked, so what such a policy kept would be arbitrary."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies


@dataclasses.dataclass(frozen=True, kw_only=True)
class NanNorm(policies.Policy):
  """Key norms, with NaN at one position of layer 1."""

  needs = frozenset({"keys_LGTD"})

  def score(self, evidence):
    s = jnp.linalg.norm(evidence.keys_LGTD.astype(jnp.float32), axis=-1)
    return s.at[1, :, 5].set(jnp.nan)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NanEvictor(policies.DecodePolicy):
  """Recency at the prompt; NaN keep scores while decoding."""

  needs = frozenset({"keys_LGTD"})

  def score(self, evidence):
    L, G, T, _ = evidence.keys_LGTD.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (L, G, T))

  def init_state(self, evidence, scores_LHT, idx_LHC, kept_LHC):
    return None

  def observe(self, state_HC, attn_HC):
    return state_HC

  def keep_scores(self, state_HC, positions_HC, t, budget_H):
    return jnp.full(positions_HC.shape, jnp.nan)


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(4, cfg.vocab_size, (2, 24)).astype(np.int32)
  return model, ids


def test_nan_prompt_scores_are_refused_in_generate_and_keep_mask(tiny):
  model, ids = tiny
  with pytest.raises(ValueError, match=r"scores held NaN at \(batch row, layer, head\) \(0, 1, "):
    km.generate(model, ids, policy=NanNorm(), budget=8, max_new_tokens=2)
  with pytest.raises(ValueError, match="scores held NaN"):
    km.keep_mask(model, ids, NanNorm(), 8)
  with pytest.raises(ValueError, match="scores held NaN"):
    km.answer_configs(model, ids[:, :-2], ids[:, -2:], np.array([8, 12]), policy=NanNorm())


def test_nan_keep_scores_while_decoding_are_refused(tiny):
  model, ids = tiny
  with pytest.raises(RuntimeError, match="keep_scores held NaN"):
    km.generate(model, ids, policy=NanEvictor(), budget=8, max_new_tokens=3)
