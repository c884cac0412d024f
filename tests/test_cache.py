"""kvjax.model.cache: per-head and per-layer budgets that really shrink the cache, bookkeeping,
kvpress positions, StreamingLLM re-indexing, flagged overflow and sinks on padded rows."""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quick_families_only
from hf_models import (
  make_checkpoint,
  make_checkpoint_cached,
  prompt,
)

from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib


def test_per_head_and_per_layer_budgets_really_shrink_the_cache(family):
  name, _, model, cfg = family
  quick_families_only(name)
  ids = prompt(T=64)
  for policy in ("pyramidkv", "adakv_snapkv"):
    out = km.generate(model, ids, policy=policy, budget=24, window=8, max_new_tokens=8)
    budget = out.budget_LH[0]
    assert (
      out.memory["kv_bytes_held"]
      < out.memory["kv_bytes_allocated"]
      < out.memory["full_cache_bytes"]
    )
    held_tokens = np.minimum(budget, 64).sum() + 7 * budget.size  # the last token is never fed back
    assert out.memory["kv_bytes_held"] == held_tokens * 2 * cfg.head_dim * 4
    if policy == "pyramidkv":
      assert budget[0, 0] > budget[-1, 0]
  out = km.generate(model, ids, policy="streaming_llm", budget=16, max_new_tokens=8)
  assert (
    out.memory["kv_bytes_held"] == 16 * cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * 4
  )


def test_memory_bookkeeping_is_small():
  hf, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  out = km.generate(model, prompt(T=64), policy="snapkv", budget=32, window=8, max_new_tokens=8)
  assert out.memory["bookkeeping_bytes"] <= 0.05 * out.memory["kv_bytes_allocated"] * 2


def test_snapkv_on_the_model_keeps_kvpress_positions():
  """kvpress 0.5.5 SnapKVPress (window 8, avgpool k=5, mean votes, GQA mean) on the committed
  tiny checkpoint (tests/make_kvpress_fixtures.py) vs kvjax's own prefill + compressed cache."""
  fixtures = pathlib.Path(__file__).parent / "fixtures"
  data = np.load(fixtures / "kvpress_0_5_5.npz")
  model, cfg = km.load(fixtures / "kvpress_tiny_llama")
  ids = data["input_ids_T"][None].astype(np.int32)
  T = ids.shape[1]
  pre = km.prefill(
    cfg, model.params(), jnp.asarray(ids), request=policies.EvidenceRequest(window=8)
  )
  np.testing.assert_allclose(np.asarray(pre.keys[:, 0]), data["keys_LGTD"], atol=1e-5)
  spec = cache_lib.CacheSpec(policies.make("snapkv_kvpress", num_kv_heads=cfg.num_kv_heads), T // 2)
  cache = cache_lib.compress(cfg, pre, spec, T // 2)
  kept = np.zeros((cfg.num_layers, cfg.num_kv_heads, T), bool)
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  for l, h in np.ndindex(cfg.num_layers, cfg.num_kv_heads):
    kept[l, h, pos[l, h][valid[l, h]]] = True
  np.testing.assert_array_equal(kept, data["snapkv_keep_LGT"])


def test_streaming_llm_position_reindexing(tmp_path_factory):
  _, path = make_checkpoint(tmp_path_factory, "llama_mha_tied")  # theta 1e4: positions matter
  model, cfg = km.load(path)
  ids = prompt(T=40)
  full = km.generate(model, ids, max_new_tokens=16).tokens
  # nothing evicted: ranks inside the cache are the original positions
  same = km.generate(
    model,
    ids,
    policy="streaming_llm",
    budget=60,
    max_new_tokens=16,
    layout=cache_lib.Layout(reindex=True),
  )
  np.testing.assert_array_equal(same.tokens, full)
  # with eviction, keys are renumbered by rank: the sinks sit next to the recent window
  pre = km.prefill(cfg, model.params(), jnp.asarray(ids))
  logits = {}
  for reindex in (False, True):
    spec = cache_lib.CacheSpec(policies.make("streaming_llm"), 12, reindex=reindex)
    cache = cache_lib.compress(cfg, pre, spec, 12)
    if reindex:  # stored pre-RoPE: rotating back by the original positions restores the keys
      restored = km.llama.rope_at(cache.keys, cache.positions, cfg)
      plain = cache_lib.compress(cfg, pre, dataclasses.replace(spec, reindex=False), 12)
      np.testing.assert_allclose(np.asarray(restored), np.asarray(plain.keys), atol=1e-5)
    tok, pos = jnp.asarray([5]), jnp.asarray([40])
    logits[reindex] = np.asarray(
      cache_lib.decode_step(cfg, model.params(), spec, cache, tok, pos, pos)[0]
    )
  assert np.abs(logits[True] - logits[False]).max() > 1e-3


def test_capacity_overflow_is_flagged_and_sinks_are_the_first_real_tokens():
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  ids = prompt(T=40)
  # a capacity below the budget is flagged, never silently clamped
  pre = km.prefill(
    cfg, model.params(), jnp.asarray(ids), request=policies.EvidenceRequest(window=8)
  )
  small = cache_lib.compress(
    cfg, pre, cache_lib.CacheSpec(policies.make("snapkv", window=8), 4), 33
  )
  assert bool(np.asarray(small.overflow).all())
  # StreamingLLM keeps the first *real* tokens of a left-padded row
  padded = np.zeros((1, 52), np.int32)
  padded[0, 12:] = ids[0]
  mask = (np.arange(52) >= 12).astype(np.int32)[None]
  pre = km.prefill(cfg, model.params(), jnp.asarray(padded), jnp.asarray(mask))
  cache = cache_lib.compress(cfg, pre, cache_lib.CacheSpec(policies.make("streaming_llm"), 16), 16)
  kept = np.asarray(cache.positions)[np.asarray(cache.valid)].reshape(-1, 16)
  assert (kept[:, :4] == [0, 1, 2, 3]).all() and (kept[:, 4:] == np.arange(28, 40)).all()


def test_query_layout_gathers_each_query_heads_kv_head():
  """Per query head (the query layout), query head ``h`` stores the keys and values of KV head
  ``h // group`` at the positions it kept, gathered without repeating K/V across the group."""
  model, cfg = km.load(make_checkpoint_cached()[1])
  assert cfg.num_heads > cfg.num_kv_heads  # GQA: a group of query heads per KV head
  pre = km.prefill(
    cfg, model.params(), jnp.asarray(prompt(T=48)), request=policies.EvidenceRequest(window=8)
  )
  spec = cache_lib.CacheSpec(policies.make("snapkv", window=8), 24, "query")
  cache = cache_lib.compress(cfg, pre, spec, 20)
  keys, values = np.asarray(pre.keys), np.asarray(pre.values)
  group = cfg.num_heads // cfg.num_kv_heads
  pos, valid = np.asarray(cache.positions), np.asarray(cache.valid)
  assert cache.keys.shape[2] == cfg.num_heads and valid.sum(-1).min() == 20
  for l, b, h in np.ndindex(*valid.shape[:3]):
    p = pos[l, b, h][valid[l, b, h]]
    kept = np.asarray(cache.keys[l, b, h])[valid[l, b, h]]
    np.testing.assert_array_equal(kept, keys[l, b, h // group, p])
    kept_v = np.asarray(cache.values[l, b, h])[valid[l, b, h]]
    np.testing.assert_array_equal(kept_v, values[l, b, h // group, p])
  per_head = {tuple(pos[0, 0, h][valid[0, 0, h]]) for h in range(cfg.num_heads)}
  assert len(per_head) > 1  # query heads of a group keep different positions


def test_fold_configs_makes_one_batch_of_configuration_major_rows():
  """cache.fold_configs: K stacked caches become K * B rows, row k * B + b holding cache k's
  row b in every field, whatever axis the field keeps its batch on."""
  rng = np.random.default_rng(0)
  K, L, B, H, C, D = 3, 2, 4, 2, 5, 3
  caches = cache_lib.KVCache(
    keys=jnp.asarray(rng.standard_normal((K, L, B, H, C, D)), jnp.float32),
    values=jnp.asarray(rng.standard_normal((K, L, B, H, C, D)), jnp.float32),
    positions=jnp.asarray(rng.integers(0, 99, (K, L, B, H, C)), jnp.int32),
    valid=jnp.asarray(rng.random((K, L, B, H, C)) < 0.5),
    budget=jnp.asarray(rng.integers(0, 9, (K, B, L, H)), jnp.int32),
    overflow=jnp.asarray(rng.random((K, B)) < 0.5),
  )
  folded = cache_lib.fold_configs(caches)
  assert folded.keys.shape == (L, K * B, H, C, D) and folded.budget.shape == (K * B, L, H)
  for k in range(K):
    for b in range(B):
      row = k * B + b
      for name in ("keys", "values", "positions", "valid"):
        np.testing.assert_array_equal(getattr(folded, name)[:, row], getattr(caches, name)[k, :, b])
      np.testing.assert_array_equal(folded.budget[row], caches.budget[k, b])
      assert folded.overflow[row] == caches.overflow[k, b]
  assert folded.scores is None


def _blocked_cache(cfg, capacity, seed=0):
  """A cache of ``capacity`` slots, each (row, layer, head) holding its own number of them."""
  rng = np.random.default_rng(seed)
  L, B, H, D = cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim
  shape = (L, B, H, capacity)
  held = rng.integers(capacity // 2, capacity - 8, size=(L, B, H))
  return cache_lib.KVCache(
    keys=jnp.asarray(rng.standard_normal(shape + (D,), np.float32)),
    values=jnp.asarray(rng.standard_normal(shape + (D,), np.float32)),
    positions=jnp.asarray(np.broadcast_to(np.arange(capacity, dtype=np.int32), shape)),
    valid=jnp.asarray(np.arange(capacity) < held[..., None]),
    budget=jnp.full((B, L, H), capacity, jnp.int32),
  )


def test_decode_attention_in_blocks_matches_one_block(monkeypatch):
  """The decode step reads each layer's slots in blocks (the last overlapping the one before);
  the logits, the cache it writes and the per-slot attention a decode-time policy observes
  match one block over all slots."""
  from flax import nnx

  cfg = km.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    attn_softcap=30.0,
    sliding_window=4000,
  )
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  capacity = 2 * cache_lib.DECODE_BLOCK + 501  # 3 blocks: the last overlaps the one before
  token, pos = jnp.asarray([3, 5], jnp.int32), jnp.asarray([4700, 4800], jnp.int32)

  def run(spec, cache):
    return cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos)

  for policy, extra in (("snapkv", {}), ("h2o", {"scores": True})):
    spec = cache_lib.CacheSpec(policies.make(policy), capacity)
    cache = _blocked_cache(cfg, capacity)
    if extra:
      cache = cache.replace(scores=jnp.zeros(cache.valid.shape, jnp.float32))
      cache = cache.replace(budget=jnp.full(cache.budget.shape, capacity - 4, jnp.int32))
    logits, out = run(spec, cache)
    monkeypatch.setattr(cache_lib, "DECODE_BLOCK", 1 << 30)
    ref_logits, ref = run(spec, cache)
    monkeypatch.undo()
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name in ("positions", "valid"):
      np.testing.assert_array_equal(getattr(out, name), getattr(ref, name))
    for name in ("keys", "values"):  # a later layer's token comes from the earlier's output
      np.testing.assert_allclose(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    if extra:
      np.testing.assert_allclose(out.scores, ref.scores, rtol=1e-6, atol=1e-7)


def test_decode_step_carries_a_16_bit_cache_as_its_bits_unchanged(monkeypatch):
  """On CPU the step carries a bf16 or fp16 cache as its bits (XLA:CPU would convert the whole
  cache to fp32 around every scatter); logits and cache match the step over the 16-bit arrays
  bit for bit, blocked (several blocks) and whole (one block), appending and evicting (H2O)."""
  from flax import nnx

  cfg = km.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
  )
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  token, pos = jnp.asarray([3, 5], jnp.int32), jnp.asarray([4700, 4800], jnp.int32)
  runs = [(2 * cache_lib.DECODE_BLOCK + 501, "snapkv", jnp.bfloat16)]
  runs += [(2 * cache_lib.DECODE_BLOCK + 501, "h2o", jnp.float16), (300, "snapkv", jnp.bfloat16)]
  for capacity, policy, dtype in runs:
    spec = cache_lib.CacheSpec(policies.make(policy), capacity)
    cache = _blocked_cache(cfg, capacity)
    cache = cache.replace(keys=cache.keys.astype(dtype), values=cache.values.astype(dtype))
    if policy == "h2o":
      cache = cache.replace(scores=jnp.zeros(cache.valid.shape, jnp.float32))
      cache = cache.replace(budget=jnp.full(cache.budget.shape, capacity - 4, jnp.int32))
    logits, out = cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos)
    assert cache_lib._carried_as_bits(dtype)  # the tests run on CPU
    monkeypatch.setattr(cache_lib, "_carried_as_bits", lambda dtype: False)
    ref_logits, ref = cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos)
    monkeypatch.undo()
    np.testing.assert_array_equal(logits, ref_logits)
    assert out.keys.dtype == dtype and out.values.dtype == dtype
    for name in ("keys", "values", "positions", "valid", "scores"):
      if getattr(ref, name) is not None:
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)


def _three_layer_cfg(**kw):
  """A tiny three-layer model's config (``kw``: its other fields)."""
  return km.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    **kw,
  )


def test_decode_attention_skips_blocks_without_a_visible_slot(monkeypatch):
  """Blocks of slots that no row and head of a layer can see are not read: a layer holding less
  than one block, another whose sliding window hides its first block, and a last layer holding
  nothing but the new token; the step matches one block over all slots."""
  from flax import nnx

  cfg = _three_layer_cfg(sliding_window=4000)
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  capacity = 2 * cache_lib.DECODE_BLOCK + 501  # 3 blocks
  cache = _blocked_cache(cfg, capacity, seed=1)
  rng = np.random.default_rng(2)
  held = np.stack(
    [
      rng.integers(capacity // 2, capacity - 8, size=(2, 2)),  # the window hides block 0
      rng.integers(1, capacity // 4, size=(2, 2)),  # the first block only
      np.zeros((2, 2), int),  # nothing before the new token
    ]
  )
  cache = cache.replace(valid=jnp.asarray(np.arange(capacity) < held[..., None]))
  # the window keeps positions above pos - 4000, past the first block of ~1.5k slots
  token, pos = jnp.asarray([3, 5], jnp.int32), jnp.asarray([5700, 5800], jnp.int32)
  spec = cache_lib.CacheSpec(policies.make("snapkv"), capacity)
  logits, out = cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos)
  monkeypatch.setattr(cache_lib, "DECODE_BLOCK", 1 << 30)
  ref_logits, ref = cache_lib.decode_step(cfg, params, spec, cache, token, pos, pos)
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  for name in ("positions", "valid"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name))
  for name in ("keys", "values"):
    np.testing.assert_allclose(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-6)


def test_decode_steps_per_layer_match_the_stacked_step():
  """A loop of decode steps over the parameters and cache held one buffer per layer
  (``cache.per_layer``, jitted as ``generate`` runs it) gives the stacked step's logits and
  cache to float rounding (its logits are a product over slots-last keys, summed in another
  order; a 16-bit cache to its own rounding of the K/V computed from them), the slots and
  their bookkeeping exactly: appending (SnapKV) and evicting (H2O), a sliding window and a
  soft-cap, the query layout, CaM's attention sums, a 16-bit cache, a cache of several
  blocks."""
  from flax import nnx

  token, pos = jnp.asarray([3, 5], jnp.int32), jnp.asarray([470, 480], jnp.int32)
  runs = [
    ("snapkv", {}, jnp.float32, "kv", 300),
    ("h2o", {}, jnp.float32, "kv", 300),
    ("snapkv", {"sliding_window": 200, "attn_softcap": 30.0}, jnp.float32, "kv", 300),
    ("snapkv", {}, jnp.float32, "query", 300),
    ("snapkv", {}, jnp.bfloat16, "kv", 300),
    ("h2o", {}, jnp.float16, "kv", 300),
    ("snapkv+sums", {}, jnp.float32, "kv", 300),
    ("snapkv", {}, jnp.float32, "kv", 2 * cache_lib.DECODE_BLOCK + 501),
  ]
  for policy, extra, dtype, layout, capacity in runs:
    cfg = _three_layer_cfg(**extra)
    params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
    spec = cache_lib.CacheSpec(policies.make(policy.split("+")[0]), capacity, layout=layout)
    cache = _blocked_cache(cfg, capacity)
    if layout == "query":  # one slot table per query head
      cache = jax.tree.map(functools.partial(jnp.repeat, repeats=cfg.num_groups, axis=2), cache)
      cache = cache.replace(budget=jnp.full((2, 3, cfg.num_heads), capacity, jnp.int32))
    cache = cache.replace(keys=cache.keys.astype(dtype), values=cache.values.astype(dtype))
    if policy == "h2o":
      cache = cache.replace(scores=jnp.zeros(cache.valid.shape, jnp.float32))
      cache = cache.replace(budget=jnp.full(cache.budget.shape, capacity - 4, jnp.int32))
    if policy == "snapkv+sums":  # the attention sums CaM carries
      cache = cache.replace(attn_sums=jnp.zeros(cache.valid.shape, jnp.float32))
    assert cache_lib.decodes_per_layer(spec, cache)  # the tests run on CPU
    split_params, split = cache_lib.per_layer(spec, params, cache)
    assert isinstance(split.keys, tuple) and len(split.keys) == cfg.num_layers
    assert isinstance(split_params["wq"], tuple)
    step = jax.jit(functools.partial(cache_lib.decode_step, cfg, spec=spec))
    ref = cache
    for i in range(3):
      ref_logits, ref = cache_lib.decode_step(cfg, params, spec, ref, token, pos + i, pos + i)
      logits, split = step(split_params, cache=split, token_B=token, pos_B=pos + i, t_B=pos + i)
    out = cache_lib.restacked(split)
    label = f"{policy} {extra} {jnp.dtype(dtype).name} {layout} {capacity}"
    # the per-layer step's logits are a product over slots-last keys, and the stacked step
    # reads a long cache in blocks: each sums in its own order
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5, err_msg=label)
    assert out.keys.dtype == dtype
    for name in ("positions", "valid", "overflow"):
      np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=label)
    for name in ("keys", "values", "scores", "attn_sums"):
      if getattr(ref, name) is not None:
        np.testing.assert_allclose(
          np.asarray(getattr(out, name), np.float32),
          np.asarray(getattr(ref, name), np.float32),
          rtol=1e-5 if jnp.dtype(dtype).itemsize == 4 else 1e-2,
          atol=1e-6 if jnp.dtype(dtype).itemsize == 4 else 1e-3,
          err_msg=f"{label} {name}",
        )


def test_per_layer_keeps_the_stacked_form_where_the_step_needs_it(monkeypatch):
  """``per_layer`` splits a cache once (a split cache is returned as it is), ``restacked``
  inverts it exactly, and caches the stacked step alone handles stay stacked: re-compressing
  (``decode_every``), re-indexed positions, ThinK's pruned channels, and weights and K/V whose
  second copy would pass ``PER_LAYER_MAX_BYTES``."""
  from flax import nnx

  cfg = _three_layer_cfg()
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  cache = _blocked_cache(cfg, 40)
  spec = cache_lib.CacheSpec(policies.make("snapkv"), 40)
  p, split = cache_lib.per_layer(spec, params, cache)
  assert cache_lib.per_layer(spec, p, split)[1] is split
  back = cache_lib.restacked(split)
  for name in ("keys", "values", "positions", "valid", "budget"):
    np.testing.assert_array_equal(getattr(back, name), getattr(cache, name))
  assert cache_lib.restacked(cache) is cache
  stacked = [
    (cache_lib.CacheSpec(policies.make("snapkv", decode_every=8), 40), cache),
    (cache_lib.CacheSpec(policies.make("streaming_llm"), 40, reindex=True), cache),
    (spec, cache.replace(channels=jnp.zeros((3, 2, 2, 4), jnp.int32))),
  ]
  for spec, c in stacked:
    assert not cache_lib.decodes_per_layer(spec, c)
    p, same = cache_lib.per_layer(spec, params, c)
    assert p is params and same is c
  spec = cache_lib.CacheSpec(policies.make("snapkv"), 40)
  monkeypatch.setattr(cache_lib, "PER_LAYER_MAX_BYTES", cache.keys.nbytes)  # K and V: twice that
  p, same = cache_lib.per_layer(spec, params, cache)
  assert p is params and same is cache


def test_per_layer_capacities_read_no_empty_slots_and_flag_what_they_cannot_hold():
  """With ``layer_capacity`` each layer's buffers keep their first slots only (PyramidKV's upper
  layers hold fewer); the steps match the stacked step (to float rounding: the softmax sums
  fewer masked slots) and ``restacked`` pads the layers back. A held slot past its layer's capacity sets ``overflow``; a capacity tuple
  without one entry per layer, or past the capacity, is refused."""
  from flax import nnx

  cfg = _three_layer_cfg()
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  C = 64
  held = np.asarray([40, 20, 9])  # per layer, every row and head
  cache = _blocked_cache(cfg, C).replace(
    valid=jnp.asarray(np.arange(C) < held[:, None, None, None])
  )
  cache = cache.replace(valid=jnp.broadcast_to(cache.valid, cache.keys.shape[:4]))
  caps = (48, 28, 16)  # room for 7 more tokens in every layer
  spec = cache_lib.CacheSpec(policies.make("snapkv"), C, layer_capacity=caps)
  split_params, split = cache_lib.per_layer(spec, params, cache)
  assert [k.shape[3] for k in split.keys] == list(caps)  # the keys held slots-last
  token, pos = jnp.asarray([3, 5], jnp.int32), jnp.asarray([70, 80], jnp.int32)
  ref = cache
  for i in range(7):
    ref_logits, ref = cache_lib.decode_step(cfg, params, spec, ref, token, pos + i, pos + i)
    logits, split = cache_lib.decode_step(cfg, split_params, spec, split, token, pos + i, pos + i)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
  out = cache_lib.restacked(split, C)
  assert not np.asarray(out.overflow).any()
  assert cache_lib.restacked(split).keys.shape[3] == max(caps)
  for capacity in (max(caps) - 1, 64.5, True):
    with pytest.raises(ValueError, match="capacity"):
      cache_lib.restacked(split, capacity)
  for name in ("valid", "overflow"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  held = np.asarray(ref.valid)  # what empty slots hold is nobody's (the padding's is zero)
  np.testing.assert_array_equal(np.where(held, out.positions, 0), np.where(held, ref.positions, 0))
  for name in ("keys", "values"):  # a later layer's token comes from the earlier's output
    np.testing.assert_allclose(
      np.where(held[..., None], getattr(out, name), 0),
      np.where(held[..., None], getattr(ref, name), 0),
      rtol=1e-5,
      atol=1e-6,
    )
  # a row holding a token past its layer's capacity is flagged, not dropped silently
  tight = dataclasses.replace(spec, layer_capacity=(48, 19, 16))
  assert np.asarray(cache_lib.per_layer(tight, params, cache)[1].overflow).all()
  for caps in ((48, 28, 65), (48, 0, 16), [48, 28, 16], ()):
    with pytest.raises(ValueError, match="layer_capacity"):
      cache_lib.check_spec(dataclasses.replace(spec, layer_capacity=caps))
  for caps in ((48, 28), (48, 28, 65), (48, 0, 16)):
    with pytest.raises(ValueError, match="layer_capacity"):
      cache_lib.per_layer(dataclasses.replace(spec, layer_capacity=caps), params, cache)
  # a split cache under a spec that re-compresses or re-indexes is refused, not mis-decoded
  for other in (
    cache_lib.CacheSpec(policies.make("snapkv", decode_every=8), C),
    cache_lib.CacheSpec(policies.make("streaming_llm"), C, reindex=True),
  ):
    with pytest.raises(ValueError, match="one buffer per layer"):
      cache_lib.decode_step(cfg, split_params, other, split, token, pos, pos, step=0)
