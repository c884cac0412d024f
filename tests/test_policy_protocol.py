"""The policy protocol: what the pipeline needs of a policy is declared, never probed by name.

A user's policy whose sink option has another name declares ``sinks``, and then protects its
first real token in a left-padded batch; wrappers declare what their base declares and forward
nothing else; the optional protocols (re-scoring, merging) are opted into by subclassing.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies, scores

PAD, T, BUDGET = 5, 24, 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecentWithSinks(policies.Policy):
  """The most recent tokens and the first ``n_sink``: its sink option has another name, and it
  does not declare it."""

  needs = frozenset({"values_LGTD"})
  n_sink: int = 2

  def score(self, evidence):
    L, G, T, _ = evidence.values_LGTD.shape
    recency = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (L, G, T))
    return scores.protect(recency, sinks=self.n_sink)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeclaredSinks(RecentWithSinks):
  """The same policy, its sinks declared."""

  @property
  def sinks(self) -> int:
    return self.n_sink


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(5, cfg.vocab_size, (2, T)).astype(np.int32)
  mask = np.ones((2, T), np.int32)
  mask[1, :PAD] = 0  # row 1 is left-padded: its first real token is at PAD
  return model, ids, mask


def test_declared_sinks_keep_the_first_real_token_of_a_left_padded_row(tiny):
  model, ids, mask = tiny
  keep = km.keep_mask(model, km.Padded(ids, mask), DeclaredSinks(n_sink=2), BUDGET)
  assert keep[:, 0, :, :2].all()  # the unpadded row's sinks
  assert keep[:, 1, :, PAD : PAD + 2].all()  # the padded row's, from its first real token
  assert not keep[:, 1, :, :PAD].any()
  # the padded row keeps what it keeps alone, shifted by its padding
  alone = km.keep_mask(model, ids[1:, PAD:], DeclaredSinks(n_sink=2), BUDGET)
  np.testing.assert_array_equal(keep[:, 1, :, PAD:], alone[:, 0])


def test_undeclared_sinks_are_not_guessed_from_an_option_name(tiny):
  model, ids, mask = tiny
  assert RecentWithSinks().sinks is None
  keep = km.keep_mask(model, km.Padded(ids, mask), RecentWithSinks(n_sink=2), BUDGET)
  assert not keep[:, 1, :, PAD].any()  # it protected two padding positions instead


def test_declared_sinks_on_the_array_path():
  L, G, D = 2, 2, 4
  values = jnp.asarray(np.random.default_rng(1).normal(size=(L, G, T, D)), jnp.float32)
  valid_T = jnp.arange(T) >= PAD
  ev = policies.Evidence(values_LGTD=values, valid_T=valid_T)
  s = np.asarray(DeclaredSinks(n_sink=3).scores_row(ev))
  assert np.isposinf(s[..., PAD : PAD + 3]).all() and not np.isposinf(s[..., PAD + 3 :]).any()
  undeclared = np.asarray(RecentWithSinks(n_sink=3).scores_row(ev))
  assert np.isposinf(undeclared[..., :3]).all() and not np.isposinf(undeclared[..., PAD]).any()


def test_every_policy_declares_sinks_and_window():
  assert policies.Policy.sinks is None and policies.Policy.window is None
  assert policies.SnapKV().sinks is None and policies.KNorm().window is None
  assert policies.KVzip(sinks=2).sinks == 2 and policies.SnapKV(window=16).window == 16
  assert policies.make("streaming_llm", sinks=0).sinks == 0  # 0 sinks: still counted per row


def test_a_wrapper_declares_what_its_base_declares_and_forwards_nothing_else():
  critical = policies.Critical(base=policies.KVzip(sinks=3))
  assert critical.sinks == 3 and critical.window is None
  assert policies.Critical(base=policies.SnapKV(window=16)).window == 16
  assert policies.ChunkKV(base=DeclaredSinks(n_sink=4)).sinks == 4
  wrapped = policies.Critical(base=policies.SnapKV(kernel=5))
  assert wrapped.base.kernel == 5
  assert not hasattr(wrapped, "kernel")  # the base's own options are read on the base
  assert not hasattr(policies.Wrapper, "__getattr__")


def test_optional_protocols_are_opted_into():
  assert policies.make("critical_snapkv").rescores and not policies.make("snapkv").rescores
  assert policies.make("merging_knorm").merges and not policies.make("knorm").merges
  assert policies.make("cam_knorm").merges_while_decoding

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Halved(policies.Rescoring, RecentWithSinks):
    def rescore(self, evidence, scores_LHT, budget_LH, capacity):
      return -scores_LHT  # the oldest tokens instead

  ev = policies.Evidence(values_LGTD=jnp.zeros((1, 1, 6, 2), jnp.float32))
  assert Halved().rescores
  np.testing.assert_array_equal(Halved(n_sink=0).keep_mask(ev, 2)[0, 0], [1, 1, 0, 0, 0, 0])

  with pytest.raises(TypeError, match="Rescoring"):

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Silent(policies.Policy):  # a hook outside its protocol would never be called
      def rescore(self, evidence, scores_LHT, budget_LH, capacity):
        return scores_LHT
