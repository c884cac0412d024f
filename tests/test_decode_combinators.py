"""PrefillDecoding and RatioDecoding (kvpress ``PrefillDecodingPress`` + ``DecodingPress``,
``CompressionRatioDecodingPress``) through the model's real compressed cache: the held counts
after each re-compression, the kept set against a direct computation on the cache's own slots,
the capacity, budget-free RatioDecoding, and budgets as traced data."""

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies, select
from kvjax.model import cache as cache_lib
from kvjax.model import decoding, llama, logprobs
from kvjax.policies import combinators as comb

T, N = 30, 5


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(5, cfg.vocab_size, (2, T)).astype(np.int32)
  return model, cfg, model.params(), ids


def _pd(decode_budget=8, every=N):
  return comb.PrefillDecoding(
    prefill=policies.SnapKV(window=4),
    decoding=policies.KNorm(),
    decode_every=every,
    decode_budget=decode_budget,
  )


def _ratio(every=N, ratio=0.5):
  return comb.RatioDecoding(decoding=policies.KNorm(), compression_ratio=ratio, decode_every=every)


def _per_slot(cfg, params):
  """K/V bytes of one slot."""
  return 2 * cfg.head_dim * llama.kv_itemsize(cfg, params)


def _run(cfg, params, spec, cache, tokens_SB, start):
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  held = []
  for i, tok in enumerate(tokens_SB):
    _, cache = step(cfg, params, spec, cache, jnp.asarray(tok), start + i, start + i, i)
    held.append(np.asarray(cache.valid.sum(-1)))
  return cache, np.stack(held)


def _setup(cfg, params, ids, pol, budget, cap):
  pre = decoding.jit_prefill(
    cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(T)
  )
  spec = cache_lib.CacheSpec(pol, cap)
  return spec, cache_lib.compress(cfg, pre, spec, budget)


def _tokens(cfg, S, B, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (S, B)).astype(np.int32)


def test_prefill_decoding_holds_decode_budget_after_each_recompression(tiny):
  model, cfg, params, ids = tiny
  budget, db = 12, 8
  pol = _pd(db)
  spec, cache = _setup(cfg, params, ids, pol, budget, pol.decode_capacity(budget, T, 12))
  assert (np.asarray(cache.valid.sum(-1)) == budget).all()
  start = jnp.full((2,), T, jnp.int32)
  cache, held = _run(cfg, params, spec, cache, _tokens(cfg, 12, 2), start)
  steps = np.arange(1, 13)
  # budget + s until the first re-compression, then decode_budget + (s mod N)
  expected = np.where(steps < N, budget + steps, db + steps % N)
  np.testing.assert_array_equal(held, np.broadcast_to(expected[:, None, None, None], held.shape))
  assert not bool(np.asarray(cache.overflow).any())
  # through generate: 11 tokens fed (re-compressions after 5 and 10), db + 1 slots per head
  out = km.generate(model, ids, policy=pol, budget=budget, max_new_tokens=12)
  per_slot = _per_slot(cfg, params)
  rows = cfg.num_layers * 2 * cfg.num_kv_heads
  assert out.memory["kv_bytes_held"] == rows * (db + 1) * per_slot
  # capacity max(budget, decode_budget) + decode_every, bucketed
  assert out.memory["kv_bytes_allocated"] == rows * (12 + N) * per_slot
  big = _pd(20)
  out = km.generate(model, ids, policy=big, budget=budget, max_new_tokens=12)
  assert out.memory["kv_bytes_held"] == rows * (20 + 1) * per_slot
  assert out.memory["kv_bytes_allocated"] == rows * (20 + N) * per_slot


def test_ratio_decoding_holds_its_fraction_of_the_tokens_seen(tiny):
  model, cfg, params, ids = tiny
  pol = _ratio()
  assert not pol.requires_budget
  spec, cache = _setup(cfg, params, ids, pol, None, pol.decode_capacity(T, T, 12))
  assert (np.asarray(cache.valid.sum(-1)) == T).all()
  cache, held = _run(cfg, params, spec, cache, _tokens(cfg, 12, 2), jnp.full((2,), T, jnp.int32))
  steps = np.arange(1, 13)
  last = (steps // N) * N  # the generated tokens at the last re-compression
  expected = np.where(steps < N, T + steps, (T + last) // 2 + steps % N)
  np.testing.assert_array_equal(held, np.broadcast_to(expected[:, None, None, None], held.shape))
  per_slot = _per_slot(cfg, params)
  rows = cfg.num_layers * 2 * cfg.num_kv_heads
  out = km.generate(model, ids, policy=pol, max_new_tokens=12)
  assert out.memory["kv_bytes_held"] == rows * ((T + 10) // 2 + 1) * per_slot
  # budget >= T keeps the same prompt; below T is refused (the full prompt policy)
  same = km.generate(model, ids, policy=pol, budget=T, max_new_tokens=12)
  np.testing.assert_array_equal(same.tokens, out.tokens)
  with pytest.raises(ValueError, match="keeps every token"):
    km.generate(model, ids, policy=pol, budget=T - 1, max_new_tokens=12)
  # a long generation: the target passes the prompt, the capacity follows n_kept(T + new)
  long = km.generate(model, ids, policy=_ratio(ratio=0.2), max_new_tokens=40)
  held_long = long.memory["kv_bytes_held"] // (rows * per_slot)
  assert held_long == int((T + 35) * 0.8) + 4  # re-compressed after 35 fed, 4 more fed


def test_left_padded_rows_count_their_own_tokens_seen(tiny):
  model, cfg, params, ids = tiny
  mask = np.ones_like(ids)
  mask[1, :6] = 0  # row 1: 24 real tokens
  pol = _ratio()
  out = km.generate(model, km.Padded(ids, mask), policy=pol, max_new_tokens=6)
  per_slot = _per_slot(cfg, model.params())
  rows = cfg.num_layers * cfg.num_kv_heads
  want = rows * ((T + 5) // 2 + (24 + 5) // 2)  # 5 fed, one re-compression
  assert out.memory["kv_bytes_held"] == want * per_slot


@pytest.mark.parametrize("kind", ["prefill_decoding", "ratio"])
def test_a_recompression_keeps_the_decoding_scorers_choice_on_the_slots(tiny, kind):
  """N steps without re-compressing, then one: the kept slots are KNorm's (the smallest key
  norms, ties to the lower position) over the slots the cache holds, ``decode_budget`` or
  ``int(seen * (1 - ratio))`` of them, and equal the decode_every=N run's after its N-th step."""
  _, cfg, params, ids = tiny
  if kind == "ratio":
    pol, late, budget, keep = _ratio(), _ratio(every=1000), None, (T + N) // 2
  else:
    pol, late, budget, keep = _pd(9), _pd(9, every=1000), 12, 9
  cap = pol.decode_capacity(budget or T, T, N)
  spec, c0 = _setup(cfg, params, ids, pol, budget, cap)
  late_spec = cache_lib.CacheSpec(late, cap)
  toks, start = _tokens(cfg, N, 2, seed=3), jnp.full((2,), T, jnp.int32)
  late_c0 = cache_lib.compress(
    cfg,
    decoding.jit_prefill(
      cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(T)
    ),
    late_spec,
    budget,
  )
  uncompressed, _ = _run(cfg, params, late_spec, late_c0, toks, start)
  compressed, _ = _run(cfg, params, spec, c0, toks, start)
  k = np.asarray(uncompressed.keys, np.float64)
  pos, valid = np.asarray(uncompressed.positions), np.asarray(uncompressed.valid)
  norms = np.where(valid, -np.linalg.norm(k, axis=-1), -np.inf)  # KNorm: higher keeps
  L, B, G, C = valid.shape
  for l in range(L):
    for b in range(B):
      for g in range(G):
        order = sorted(range(C), key=lambda c: (-norms[l, b, g, c], pos[l, b, g, c]))
        want = np.sort(pos[l, b, g, order[:keep]])
        got = np.asarray(compressed.positions[l, b, g])[np.asarray(compressed.valid[l, b, g])]
        np.testing.assert_array_equal(got, want)
  # the policy side's recompress_keep on the same slots agrees
  for b in range(B):
    ev = policies.Evidence(keys_LGTD=jnp.asarray(uncompressed.keys[:, b]))
    # every head holds the same count, in position order: one valid_T per row
    ev = ev.replace(valid_T=jnp.asarray(valid[0, b, 0]))
    kept = np.asarray(pol.recompress_keep(ev, jnp.asarray(c0.budget[b]), T + N))
    for l in range(L):
      for g in range(G):
        np.testing.assert_array_equal(
          np.sort(pos[l, b, g][kept[l, g]]),
          np.asarray(compressed.positions[l, b, g])[np.asarray(compressed.valid[l, b, g])],
        )


def test_budgets_are_traced_data(tiny):
  _, cfg, params, ids = tiny
  pol = _pd(8)
  pre = decoding.jit_prefill(
    cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(T)
  )
  spec = cache_lib.CacheSpec(pol, 16 + N, new_tokens=8)
  first = jnp.zeros((2,), jnp.int32)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(budget):
    return decoding._compress_and_decode(
      cfg, params, pre, spec, budget, first, 8, 0.0, jax.random.key(0), None
    )

  for budget in (10, 12, 16):
    _, cache = run(jnp.int32(budget))
    assert (np.asarray(cache.valid.sum(-1)) == 8 + 2).all()  # 7 fed: re-compressed after 5


def test_generate_configs_and_stream_logprobs(tiny):
  model, cfg, _, ids = tiny
  pol = _pd(8)
  g = km.generate_configs(model, ids, [10, 12, 16], policy=pol, max_new_tokens=12)
  one = km.generate(model, ids, policy=pol, budget=12, max_new_tokens=12)
  np.testing.assert_array_equal(g.tokens[1], one.tokens)
  per_slot = _per_slot(cfg, model.params())
  rows = cfg.num_layers * 2 * cfg.num_kv_heads
  assert g.memory["kv_bytes_held_per_config"] == [rows * 9 * per_slot] * 3
  lp = logprobs.stream_logprobs(model, ids, policy=pol, budget=12, prefix=10)
  assert lp.shape == (2, T - 10) and np.isfinite(lp).all()
  lr = logprobs.stream_logprobs(model, ids, policy=_ratio(), prefix=10)
  assert lr.shape == (2, T - 10) and np.isfinite(lr).all()
  assert np.array_equal(
    lr, logprobs.stream_logprobs(model, ids, policy=_ratio(), budget=10, prefix=10)
  )


def test_checks_read_the_decoding_policy(tiny):
  model, _, _, ids = tiny
  # the prompt's SnapKV window rows are the prefill's: the re-compression reads KNorm's keys
  spec = cache_lib.CacheSpec(_pd(8), 20)
  cache_lib.check_decode_every(spec)
  assert spec.decode_window == N
  bad = comb.PrefillDecoding(
    prefill=policies.KNorm(), decoding=policies.SnapKV(window=8), decode_every=4
  )
  with pytest.raises(ValueError, match="decode_every >= 8"):
    cache_lib.check_decode_every(cache_lib.CacheSpec(bad, 20))


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("kind", ["prefill_decoding", "ratio_decoding"])
def test_kept_sets_match_kvpress_decoding_presses(kind):
  """kvpress 0.5.5 ``PrefillDecodingPress(None, DecodingPress(KnormPress(), 5, 10))`` and
  ``CompressionRatioDecodingPress(KnormPress(), 0.5, 5)`` on the tiny fixture Llama, 12 fed
  tokens (tests/make_kvpress_fixtures_decoding.py): the same positions held per layer and head."""
  z = np.load(FIXTURES / "kvpress_0_5_5_decoding.npz")
  Tp, S, every, target = (int(x) for x in z["constants"])
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  params = model.params()
  if kind == "ratio_decoding":
    pol = comb.RatioDecoding(
      decoding=policies.KNorm(), compression_ratio=float(z["ratio"]), decode_every=every
    )
  else:
    pol = comb.PrefillDecoding(
      prefill=policies.Full(), decoding=policies.KNorm(), decode_every=every, decode_budget=target
    )
  ids = z["input_ids_T"][None]
  pre = decoding.jit_prefill(
    cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(Tp)
  )
  spec = cache_lib.CacheSpec(pol, pol.decode_capacity(Tp, Tp, S))
  cache = cache_lib.compress(cfg, pre, spec, None)
  cache, _ = _run(cfg, params, spec, cache, z["fed_S"][:, None], jnp.full((1,), Tp, jnp.int32))
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  got = np.zeros_like(z[f"{kind}_kept_LGP"])
  for l, g, c in zip(*np.nonzero(valid), strict=True):
    got[l, g, pos[l, g, c]] = True
  np.testing.assert_array_equal(got, z[f"{kind}_kept_LGP"])


@pytest.mark.parametrize("scorer", ["keydiff", "curkv"])
def test_a_recompression_scores_only_the_held_slots(tiny, scorer):
  """In a cache with empty slots (capacity above what it holds) a re-compression keeps what the
  decoding scorer keeps over the held slots alone: KeyDiff's anchor is the held keys' mean, and
  CurDKV's sinks are the first held tokens (not empty slots)."""
  _, cfg, params, ids = tiny
  decoder = policies.KeyDiff() if scorer == "keydiff" else policies.CurDKV(sinks=3)
  pre = policies.SnapKV(window=4)
  pol = comb.PrefillDecoding(prefill=pre, decoding=decoder, decode_every=N, decode_budget=9)
  late = comb.PrefillDecoding(prefill=pre, decoding=decoder, decode_every=1000)
  cap = pol.decode_capacity(12, T, N) + 8  # 8 slots never filled
  spec, c0 = _setup(cfg, params, ids, pol, 12, cap)
  late_spec, late_c0 = _setup(cfg, params, ids, late, 12, cap)
  toks, start = _tokens(cfg, N, 2, seed=4), jnp.full((2,), T, jnp.int32)
  held, _ = _run(cfg, params, late_spec, late_c0, toks, start)
  compressed, _ = _run(cfg, params, spec, c0, toks, start)
  L, B, G, C = held.valid.shape
  for b in range(B):
    pos, valid = np.asarray(held.positions[:, b]), np.asarray(held.valid[:, b])
    order = [[np.nonzero(valid[l, g])[0] for g in range(G)] for l in range(L)]
    order = [[o[np.argsort(pos[l, g, o])] for g, o in enumerate(r)] for l, r in enumerate(order)]

    def in_order(t, b=b, order=order):  # [L, G, n, D]: held slots by position, none empty
      t = np.asarray(t[:, b])
      return np.stack([np.stack([t[l, g][order[l][g]] for g in range(G)]) for l in range(L)])

    ev = policies.Evidence(
      keys_LGTD=jnp.asarray(in_order(held.keys)), values_LGTD=jnp.asarray(in_order(held.values))
    )
    scores = decoder.scores(ev)
    keep = np.asarray(select.top_mask(scores, 9))
    for l in range(L):
      for g in range(G):
        want = np.sort(pos[l, g, order[l][g]][keep[l, g]])
        got = np.asarray(compressed.positions[l, b, g])[np.asarray(compressed.valid[l, b, g])]
        np.testing.assert_array_equal(got, want)
