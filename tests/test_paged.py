"""kvjax.model.paged: the per-head paged cache. Its decode equals the stacked cache's, its step
reads each head's own slots (the roofline's count), and ``generate`` picks it on TPU and GPU
(the platform forced here) for per-head and per-layer budgets, the stacked step on CPU."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import decoding, paged

CFG = km.ModelConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
)


@pytest.fixture(scope="module")
def model():
  return km.Llama(CFG, rngs=nnx.Rngs(0))


def _ids(B=2, T=150, seed=0):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T)).astype(np.int32)


def _compressed(model, policy: str, T: int, budget: int):
  """A one-row prompt of ``T`` tokens compressed under ``policy`` to ``budget`` (stacked)."""
  ids = _ids(B=1, T=T)
  pol = policies.build(policy)
  request = pol.evidence_request(T)
  pre = decoding.jit_prefill(CFG, model.params(), ids, np.ones_like(ids), request)
  return cache_lib.compress(CFG, pre, cache_lib.CacheSpec(pol, T), np.int32(budget))


@pytest.mark.parametrize(
  "policy, options",
  [("adakv_snapkv", {}), ("pyramidkv", {}), ("full", {})],
)
def test_paged_generation_equals_the_stacked_cache(model, policy, options):
  """Greedy tokens through the paged cache (the XLA path on CPU) equal the stacked cache's,
  padded rows included; the allocation it reports is the same."""
  ids = _ids()
  mask = np.ones_like(ids)
  mask[1, :17] = 0  # a left-padded row
  budget = None if policy == "full" else 40
  kw = dict(policy=policy, budget=budget, max_new_tokens=12, **options)
  stacked = km.generate(model, km.Padded(ids, mask), layout=cache_lib.Layout(paged=False), **kw)
  out = km.generate(model, km.Padded(ids, mask), layout=cache_lib.Layout(paged=True), **kw)
  np.testing.assert_array_equal(out.tokens, stacked.tokens)
  np.testing.assert_array_equal(out.budget_LH, stacked.budget_LH)
  assert out.memory["kv_bytes_held"] == stacked.memory["kv_bytes_held"]


def test_new_budgets_rarely_change_the_pool_and_so_the_compiled_decoder():
  """The pool's pages are bucketed as a capacity is: at a Llama-3.1-8B shape (32 layers, 8 KV
  heads), the budgets 1,000-2,000 give a few pool sizes, each spanning many budgets."""
  pools = {paged.pool_size(np.full((32, 8), b), 1, 32, 128) for b in range(1000, 2001)}
  exact = {int(((b + 32) * 8 // 128) * 32 + 32 * 8 + 1) for b in range(1000, 2001)}
  assert len(exact) == 64 and len(pools) == 5, (len(exact), sorted(pools))
  per_head = np.random.default_rng(0).integers(0, 3000, (32, 8))
  assert paged.pool_size(per_head, 1, 32, 128) >= int(((per_head + 32).sum(1) // 128).sum()) + 257


def test_paged_generation_keeps_a_sliding_window_and_a_soft_cap():
  """A model whose every layer attends within a window (Mistral's) with Gemma 2's soft-cap: the
  paged step masks by the slots' positions, as the stacked step does."""
  cfg = dataclasses.replace(CFG, sliding_window=40, attn_softcap=20.0)
  windowed = km.Llama(cfg, rngs=nnx.Rngs(0))
  kw = dict(policy="adakv_snapkv", budget=40, max_new_tokens=12)
  stacked = km.generate(windowed, _ids(), layout=cache_lib.Layout(paged=False), **kw)
  out = km.generate(windowed, _ids(), layout=cache_lib.Layout(paged=True), **kw)
  np.testing.assert_array_equal(out.tokens, stacked.tokens)


def test_paged_cache_holds_each_head_its_own_slots_and_a_step_reads_those_bytes(model):
  """After compression under Ada-KV the pool holds each row's held slots in its own pages; the
  bytes a step reads are those slots rounded to pages (equal to the roofline's count of held
  slots where each length fills its pages), below the stacked cache's padded read."""
  stacked = _compressed(model, "adakv_snapkv", 300, 64)
  pool = paged.pool_size(np.asarray(stacked.budget), 1, 0, 16)
  cache = paged.from_stacked(stacked, new=0, pool=pool, page=16)
  length = np.asarray(cache.length)
  np.testing.assert_array_equal(length, np.asarray(stacked.valid).sum(-1).reshape(3, 2))
  assert len(set(length.reshape(-1).tolist())) > 1  # Ada-KV's heads hold different counts
  D = CFG.head_dim
  item = stacked.keys.dtype.itemsize
  counted = int(np.asarray(stacked.valid).sum()) * 2 * D * item  # the roofline's count
  pages = -(-length // 16)
  assert paged.bytes_read(cache) == 2 * int(pages.sum()) * 16 * D * item
  assert counted <= paged.bytes_read(cache) < counted + 2 * length.size * 16 * D * item
  padded = length.size * int(length.max()) * 2 * D * item  # every head to its layer's largest
  assert paged.bytes_read(cache) < padded
  # where every length fills its pages the read is exactly the held slots
  full = dataclasses.replace(cache, length=np.full_like(length, 32))
  assert paged.bytes_read(full) == length.size * 32 * 2 * D * item
  # each row's slots sit in its own pages, in slot order
  keys = np.asarray(stacked.keys).reshape(3, 2, -1, D)
  valid = np.asarray(stacked.valid).reshape(3, 2, -1)
  for l in range(3):
    for r in range(2):
      got = np.asarray(cache.keys)[np.asarray(cache.pages)[l, r]].reshape(-1, D)
      np.testing.assert_array_equal(got[: length[l, r]], keys[l, r][valid[l, r]])


def test_the_paged_step_through_the_interpreted_kernels_equals_the_xla_step(model):
  """One decode step over the paged cache through the TPU and GPU kernels (Pallas
  interpreter) equals the XLA step to rounding."""
  stacked = _compressed(model, "adakv_snapkv", 120, 48)
  cache = paged.from_stacked(stacked, new=2, pool=40, page=16)
  token, pos = np.array([5], np.int32), np.array([120], np.int32)
  params = model.params()
  want, _ = paged.decode_step(CFG, params, cache, token, pos, backend="xla")
  for backend in ("tpu", "gpu"):
    got, _ = paged.decode_step(CFG, params, cache, token, pos, backend=backend, interpret=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=backend)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_generate_selects_the_paged_cache_on_tpu_and_gpu(model, monkeypatch, platform):
  """With the platform forced, ``generate`` decodes Ada-KV and PyramidKV over the paged cache
  and a uniform budget over the stacked one; on CPU the stacked step stays the default."""
  calls = []
  real = decoding._compress_and_decode_paged

  def spy(*a, **k):
    calls.append(a[3].policy.name)
    return real(*a, **k)

  monkeypatch.setattr(decoding, "_compress_and_decode_paged", spy)
  ids = _ids(B=1)
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  for name in ("adakv_snapkv", "pyramidkv", "snapkv"):
    km.generate(model, ids, policy=name, budget=40, max_new_tokens=3)
  km.generate(model, ids, policy="h2o", budget=40, max_new_tokens=3)  # decode-time: stacked
  assert calls == ["adakv_snapkv", "pyramidkv"]
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  km.generate(model, ids, policy="adakv_snapkv", budget=40, max_new_tokens=3)
  assert calls == ["adakv_snapkv", "pyramidkv"]


def test_paged_selection_and_bad_choices_are_named():
  spec = cache_lib.CacheSpec(policies.build("adakv_snapkv"), 64)
  per_head = np.array([[10, 30], [20, 20]])
  assert paged.uses_paged(CFG, spec, per_head, None, "tpu")
  assert paged.uses_paged(CFG, spec, per_head, None, "gpu")
  assert not paged.uses_paged(CFG, spec, per_head, None, "cpu")
  assert not paged.uses_paged(CFG, spec, np.full((2, 2), 20), None, "tpu")
  assert not paged.uses_paged(CFG, spec, per_head, False, "tpu")
  assert paged.uses_paged(CFG, spec, per_head, True, "cpu")
  with pytest.raises(ValueError, match="platform: expected one of .* got 'metal'"):
    paged.uses_paged(CFG, spec, per_head, None, "metal")
  h2o = cache_lib.CacheSpec(policies.build("h2o"), 64)
  assert not paged.uses_paged(CFG, h2o, per_head, None, "tpu")
  with pytest.raises(ValueError, match="paged=True cannot hold this cache: .*evicts"):
    paged.uses_paged(CFG, h2o, per_head, True, "cpu")
  query = cache_lib.CacheSpec(policies.build("snapkv"), 64, "query")
  with pytest.raises(ValueError, match="heads are 'query'"):
    paged.uses_paged(CFG, query, per_head, True, "cpu")
  with pytest.raises(ValueError, match="paged: expected None or a bool, got 'yes'"):
    cache_lib.Layout(paged="yes")
  with pytest.raises(ValueError, match="page: expected a power of two >= 16, got 24"):
    paged.pool_size(per_head, 1, 0, 24)
  with pytest.raises(ValueError, match="new: expected a static int >= 0, got -1"):
    paged.pool_size(per_head, 1, -1, 16)
  with pytest.raises(ValueError, match="budget_LH: expected"):
    paged.pool_size(-per_head, 1, 0, 16)


def test_a_pool_too_small_flags_overflow_instead_of_losing_tokens(model):
  stacked = _compressed(model, "snapkv", 90, 48)
  small = paged.from_stacked(stacked, new=0, pool=4, page=16)
  assert bool(np.asarray(small.overflow).all())
  with pytest.raises(RuntimeError, match="more slots than"):
    decoding.check_overflow(small)
  pool = paged.pool_size(np.full((3, 2), 48), 1, 0, 16)
  exact = paged.from_stacked(stacked, new=0, pool=pool, page=16)
  assert not bool(np.asarray(exact.overflow).any())
  # a row that fills its pages while decoding is flagged too
  params = model.params()
  _, after = paged.decode_step(
    CFG, params, exact, np.array([3], np.int32), np.array([90], np.int32), backend="xla"
  )
  assert bool(np.asarray(after.overflow).all())
