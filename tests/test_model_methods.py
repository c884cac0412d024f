"""kvjax.model on issue 15's methods: the new prefill evidence against dense references (and
kvpress's own statistics through the core's pure helpers), left padding, ThinK's pruned key
channels against kvpress's zeroed keys, decode-time re-compression (``decode_every``, R-KV),
caller-given evidence, budgets as traced data."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint_cached, prompt

from kvjax import model as km
from kvjax import policies
from kvjax import scores as scores_lib
from kvjax.model import answers, decoding, llama
from kvjax.model import cache as cache_lib

EXTRA = policies.EvidenceRequest(query_stats=True, value_out_norms=True, window_queries=6)


@pytest.fixture(scope="module")
def tiny():
  _, path = make_checkpoint_cached()  # Llama 3 RoPE scaling, 4 query heads on 2 KV heads
  model, cfg = km.load(path)
  return model, cfg, model.params()


def _dense_reference(cfg, params, ids, W):
  """Layer by layer over an unpadded prompt, every query at once: CriticalKV's norms as one
  einsum, ExpectedAttention's statistics from the core's dense ``scores.expected_query_stats``
  and ``scores.average_rope`` (kvpress's recipe), the last ``W`` post-RoPE queries."""
  B, T = ids.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  allowed = llama.causal_allowed(pos, pos, jnp.ones((B, T), bool), pos, pos, cfg.sliding_window)
  rope = scores_lib.average_rope(llama.inv_frequencies(cfg), T, 512)
  x = params["embed"][jnp.asarray(ids)]
  out = {"value_out_norms": [], "query_mean": [], "query_cov": [], "window_queries": []}
  for layer in range(cfg.num_layers):
    p = llama.layer_params(params, layer)
    q_pre, _, v = llama.project_heads(cfg, p, x)
    wo = np.asarray(p["wo"], np.float64).reshape(cfg.num_heads, cfg.head_dim, -1)
    v_rep = np.repeat(np.asarray(v, np.float64), cfg.num_groups, axis=1)
    out["value_out_norms"].append(np.abs(np.einsum("bhtd,hde->bhte", v_rep, wo)).sum(-1))
    mean, cov = scores_lib.expected_query_stats(q_pre, rope, n_sink=4)  # B plays the L axis
    out["query_mean"].append(mean)
    out["query_cov"].append(cov)
    out["window_queries"].append(llama.rope(q_pre, pos, cfg)[:, :, T - W :])
    x = llama.dense_layer(cfg, p, x, pos, allowed)[0]
  return {k: np.stack([np.asarray(a) for a in v]) for k, v in out.items()}


def test_project_heads_no_longer_rotates():
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  p = llama.layer_params(model.params(), 0)
  x = jax.random.normal(jax.random.key(0), (1, 5, cfg.hidden_size))
  pos = jnp.arange(5)[None]
  q_pre, k_pre, _ = llama.project_heads(cfg, p, x)
  q, k, _ = llama.project_qkv(cfg, p, x, pos)
  np.testing.assert_allclose(np.asarray(llama.rope(q_pre, pos, cfg)), np.asarray(q), atol=1e-6)
  np.testing.assert_allclose(np.asarray(llama.rope(k_pre, pos, cfg)), np.asarray(k), atol=1e-6)


def test_new_prefill_evidence_equals_the_dense_reference(tiny):
  """Chunked (16 tokens, three chunks for T=40) and tiled: nothing dense is formed, yet every
  field matches the all-at-once reference; nothing extra unless asked for."""
  model, cfg, params = tiny
  ids = prompt(T=40)
  pre = llama.prefill(
    cfg, params, jnp.asarray(ids), request=EXTRA, plan=llama.PrefillPlan(block=8, chunk=16)
  )
  ref = _dense_reference(cfg, params, ids, 6)
  for name, tol in (
    ("value_out_norms", 1e-4),
    ("query_mean", 1e-5),
    ("query_cov", 1e-5),
    ("window_queries", 1e-5),
  ):
    got = np.asarray(getattr(pre, name))
    assert got.shape == ref[name].shape, name
    np.testing.assert_allclose(got, ref[name], atol=tol * max(1.0, np.abs(ref[name]).max()))
  plain = llama.prefill(cfg, params, jnp.asarray(ids))
  for name in ("value_out_norms", "query_mean", "query_cov", "window_queries"):
    assert getattr(plain, name) is None


# prefill policies whose kept set a model prompt alone decides (no calibration, no oracle, no rng)
PADDED_POLICIES = [
  n
  for n in policies.names()
  if n
  not in (
    "full",
    "random",  # one key per batch row: another row draws other positions
    "oracle",
    "h2o_kvfactory_legacy",
    "headkv",
    "qfilter",
    "duo_attention",
    "kvzip",
    "think",
    "lukv",  # its budget curve is data for a given model
  )
]
# CI's quick mode: the scorers that aggregate over a row's keys, and one windowed and one sink
# policy (the rolled rows)
QUICK_PADDED = ("keydiff", "rkv", "expected_attention", "chunkkv_snapkv", "snapkv", "lagkv")


@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=() if n in QUICK_PADDED else pytest.mark.slow) for n in PADDED_POLICIES],
)
def test_a_padded_batch_row_keeps_what_the_prompt_alone_keeps(name):
  """Right padding (moved to the left inside) must not change a row's kept set: KeyDiff's
  anchor, R-KV's redundancy, ExpectedAttention's softmax and ChunkKV's chunks skip padding."""
  model, _, _ = km.load_tiny()
  rng = np.random.default_rng(0)
  T, pad = 150, 37
  ids = rng.integers(4, 200, (1, T)).astype(np.int32)
  both = np.concatenate([np.concatenate([ids, np.zeros((1, pad), np.int32)], 1)] * 2, 0)
  mask = np.ones_like(both)
  mask[0, T:] = 0
  alone = km.keep_mask(model, ids, name, 60)
  padded = km.keep_mask(model, km.Padded(both, mask), name, 60)
  np.testing.assert_array_equal(padded[:, 0, :, :T], alone[:, 0], err_msg=name)
  assert not padded[:, 0, :, T:].any()


def test_a_validity_mask_of_the_wrong_length_is_refused():
  keys = jnp.ones((1, 2, 10, 4))
  for call in (
    lambda v: scores_lib.keydiff(keys, v),
    lambda v: scores_lib.key_similarity_redundancy(keys, valid_T=v),
    lambda v: scores_lib.chunkkv(jnp.ones((1, 2, 10)), chunk=3, valid_T=v),
  ):
    with pytest.raises(ValueError, match=r"valid_T: expected bool \[T=10\]"):
      call(np.ones(11, bool))


def test_left_padding_gives_the_same_evidence_as_no_padding(tiny):
  """Row 1 is left-padded by 7: its statistics skip its first 4 *real* tokens and average the
  RoPE over its own length; its norms and window queries match the unpadded row's."""
  model, cfg, params = tiny
  ids = prompt(T=40, B=2)
  mask = np.ones_like(ids)
  mask[1, :7] = 0
  pre = llama.prefill(
    cfg,
    params,
    jnp.asarray(ids),
    jnp.asarray(mask),
    request=EXTRA,
    plan=llama.PrefillPlan(chunk=16),
  )
  alone = llama.prefill(cfg, params, jnp.asarray(ids[1:, 7:]), request=EXTRA)
  np.testing.assert_allclose(
    np.asarray(pre.value_out_norms[:, 1, :, 7:]), np.asarray(alone.value_out_norms[:, 0]), atol=1e-4
  )
  assert not np.asarray(pre.value_out_norms[:, 1, :, :7]).any()
  for name in ("query_mean", "query_cov", "window_queries"):
    np.testing.assert_allclose(
      np.asarray(getattr(pre, name))[:, 1], np.asarray(getattr(alone, name))[:, 0], atol=1e-5
    )


def test_decoding_asks_the_prefill_for_exactly_what_the_policy_needs():
  # beyond the observation window's rows (the policy's window, or 32), each policy asks for its
  # own evidence only (H2O's column sums, issue 15's fields)
  req = lambda name, **o: policies.make(name, **o).evidence_request(64)  # noqa: E731
  R = policies.EvidenceRequest
  assert req("snapkv") == R(window=32) and req("knorm") == R(window=32)
  assert req("full") == R()
  assert req("h2o") == R(window=32, column_sums=True)
  assert req("critical_snapkv") == R(window=32, value_out_norms=True)
  assert req("expected_attention") == R(window=32, query_stats=True, n_sink=4, n_future=512)
  assert req("expected_attention", sinks=2) == R(window=32, query_stats=True, n_sink=2)
  assert req("think_snapkv") == R(window=32, window_queries=32)
  assert req("snapkv", window=8, channel_ratio=0.25) == R(window=8, window_queries=8)
  assert req("rkv") == R(window=8, window_queries=8)
  assert policies.make("snapkv").evidence_request(20) == R(window=20)  # cut to the prompt


# --------------------------------------------------------------------------- ThinK


def _think_reference_channels(pre, cache, ratio):
  """kvpress ThinKPress's rule in numpy on the kept keys: prune the int(D * ratio) lowest of
  mean_w(q^2) (group mean) * mean_t(k^2)."""
  q = np.asarray(pre.window_queries, np.float64)  # [L, B, Hq, W, D]
  k = np.asarray(cache.keys, np.float64)  # [L, B, G, C, D], zeros in empty slots
  valid = np.asarray(cache.valid)
  L, B, G, C, D = k.shape
  q2 = (q**2).mean(3).reshape(L, B, G, -1, D).mean(3)
  k2 = (k**2).sum(3) / valid.sum(-1, keepdims=True)
  pruned = np.argsort(q2 * k2, axis=-1, kind="stable")[..., : int(D * ratio)]
  keep = np.ones((L, B, G, D), bool)
  np.put_along_axis(keep, pruned, False, axis=-1)
  return keep


def test_think_logits_equal_kvpress_zeroed_keys_and_the_cache_is_smaller(tiny):
  model, cfg, params = tiny
  ids = prompt(T=40, B=2, seed=3)
  N, budget, ratio = 6, 16, 0.5
  request = policies.EvidenceRequest(window=8, window_queries=8)
  pre = decoding.jit_prefill(cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), request)
  think = cache_lib.CacheSpec(
    policies.make("snapkv", window=8, channel_ratio=ratio), budget + N, new_tokens=N
  )
  plain = cache_lib.CacheSpec(policies.make("snapkv", window=8), budget + N)
  c_think = cache_lib.compress(cfg, pre, think, budget)
  c_plain = cache_lib.compress(cfg, pre, plain, budget)
  D = cfg.head_dim
  assert c_think.keys.shape[-1] == D - int(D * ratio) and c_think.new_keys.shape[3] == N
  keep = _think_reference_channels(pre, c_plain, ratio)
  got = np.zeros_like(keep)
  np.put_along_axis(got, np.asarray(c_think.channels), True, axis=-1)
  np.testing.assert_array_equal(got, keep)
  # kvpress: the same tokens, their pruned channels zeroed (keys decoded later stay whole)
  zeroed = c_plain.replace(keys=c_plain.keys * jnp.asarray(keep)[:, :, :, None, :])
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(N, 2)).astype(np.int32)
  start = jnp.full((2,), 40, jnp.int32)
  for i in range(N):
    tok = jnp.asarray(tokens[i])
    lt, c_think = step(cfg, params, think, c_think, tok, start + i, start + i, jnp.int32(i))
    lz, zeroed = step(cfg, params, plain, zeroed, tok, start + i, start + i, jnp.int32(i))
    np.testing.assert_allclose(np.asarray(lt), np.asarray(lz), atol=2e-5)
  assert not bool(np.asarray(c_think.overflow).any())
  m_think, m_plain = cache_lib.memory(c_think), cache_lib.memory(c_plain)
  held = 2 * cfg.num_layers * cfg.num_kv_heads  # rows x layers x heads
  item = c_think.keys.dtype.itemsize
  assert m_think["kv_bytes_held"] == held * (budget * (D // 2 + D) + N * 2 * D) * item
  assert m_think["kv_bytes_allocated"] < m_plain["kv_bytes_allocated"]


def test_think_through_generate_and_its_refusals(tiny):
  model, cfg, _ = tiny
  ids = prompt(T=40)
  out = km.generate(model, ids, policy="think_snapkv", budget=20, window=8, max_new_tokens=5)
  ref = km.generate(model, ids, policy="snapkv", budget=20, window=8, max_new_tokens=5)
  assert out.memory["kv_bytes_held"] < ref.memory["kv_bytes_held"]
  whole = km.generate(model, ids, policy="think", budget=40, max_new_tokens=5, channel_ratio=0.0)
  full = km.generate(model, ids, max_new_tokens=5)
  np.testing.assert_array_equal(whole.tokens, full.tokens)  # nothing pruned: the full cache
  with pytest.raises(ValueError, match="reindex"):
    km.generate(
      model,
      ids,
      policy="snapkv",
      budget=20,
      window=8,
      channel_ratio=0.5,
      layout=cache_lib.Layout(reindex=True),
    )
  with pytest.raises(ValueError, match="channel_ratio"):
    km.generate(model, ids, policy="snapkv", budget=40, channel_ratio=0.5, decode_every=32)


# --------------------------------------------------------------------------- decode_every


def _run_steps(cfg, params, spec, cache, n, seed=0):
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  B = cache.valid.shape[1]
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(n, B)).astype(np.int32)
  start = jnp.full((B,), 40, jnp.int32)
  held, logits = [], []
  for i in range(n):
    lg, cache = step(cfg, params, spec, cache, jnp.asarray(tokens[i]), start + i, start + i, i)
    held.append(np.asarray(cache.valid.sum(-1)))
    logits.append(np.asarray(lg))
  return cache, np.stack(held), np.stack(logits)


def test_decode_every_keeps_at_most_budget_plus_n_and_compresses_on_time(tiny):
  model, cfg, params = tiny
  ids = prompt(T=40, B=2, seed=1)
  budget, N = 12, 5
  pre = decoding.jit_prefill(
    cfg,
    params,
    jnp.asarray(ids),
    jnp.ones(ids.shape, jnp.int32),
    policies.EvidenceRequest(window=4),
  )
  spec = cache_lib.CacheSpec(policies.make("snapkv", window=4, decode_every=N), budget + N)
  assert spec.decode_window == 4 and not spec.decode_time
  cache = cache_lib.compress(cfg, pre, spec, budget)
  cache, held, _ = _run_steps(cfg, params, spec, cache, 12)
  expected = budget + (np.arange(1, 13) % N)  # back to the budget after steps 5 and 10
  np.testing.assert_array_equal(held, np.broadcast_to(expected[:, None, None, None], held.shape))
  assert not bool(np.asarray(cache.overflow).any())
  # the last 4 generated tokens (the window) always survive; the valid slots stay a prefix in
  # position order
  pos, valid = np.asarray(cache.positions), np.asarray(cache.valid)
  assert (pos[..., budget - 2 : budget] >= 40 + 8).all()
  first = pos[..., :-1][valid[..., 1:]]
  assert (np.diff(pos, axis=-1)[valid[..., 1:]] > 0).all() and first.size


def test_a_recompression_keeps_what_the_policy_selects_on_the_slots(tiny):
  """Decode N steps without compressing, then one re-compression: the kept positions are
  SnapKV's choice from the window of generated queries (numpy, causal by position) over the
  slots, and equal the decode_every=N run's after its N-th step."""
  model, cfg, params = tiny
  ids = prompt(T=40, B=2, seed=2)
  budget, N = 10, 6
  pre = decoding.jit_prefill(
    cfg,
    params,
    jnp.asarray(ids),
    jnp.ones(ids.shape, jnp.int32),
    policies.EvidenceRequest(window=4),
  )
  pol = policies.make("snapkv", window=4, decode_every=N)
  spec = cache_lib.CacheSpec(pol, budget + N)
  late = cache_lib.CacheSpec(policies.make("snapkv", window=4, decode_every=1000), budget + N)
  c0 = cache_lib.compress(cfg, pre, spec, budget)
  uncompressed, _, _ = _run_steps(cfg, params, late, c0, N)
  compressed, _, _ = _run_steps(cfg, params, spec, c0, N)
  # every head holds budget + N slots in position order, so slots need no alignment
  q = np.asarray(uncompressed.queries, np.float64)  # [L, B, Hq, W, D], written in order
  k = np.asarray(uncompressed.keys, np.float64)
  pos = np.asarray(uncompressed.positions)
  q_pos = np.asarray(uncompressed.query_pos)
  L, B, G, C, D = k.shape
  R = cfg.num_groups
  logits = np.einsum("lbgrwd,lbgcd->lbgrwc", q.reshape(L, B, G, R, -1, D), k) / np.sqrt(D)
  causal = pos[:, :, :, None, None, :] <= q_pos[None, :, None, None, :, None]
  logits = np.where(causal, logits, -np.inf)
  attn = np.exp(logits - logits.max(-1, keepdims=True))
  attn = (attn / attn.sum(-1, keepdims=True)).reshape(L, B, G * R, -1, C)
  for b in range(B):
    ev = policies.Evidence(attn_window_LHWT=jnp.asarray(attn[:, b], jnp.float32))
    keep = np.asarray(pol.keep_mask(ev, budget))  # [L, Hq, C] -> KV heads by group mean
    scores = np.asarray(pol.scores(ev)).reshape(L, G, R, C).mean(2)
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :budget]
    want = np.sort(np.take_along_axis(pos[:, b], order, -1), -1)
    got = np.asarray(compressed.positions[:, b, :, :budget])
    np.testing.assert_array_equal(got, want)
    assert keep.shape == (L, G * R, C)
  again = cache_lib.recompress(cfg, params, spec, uncompressed)
  np.testing.assert_array_equal(np.asarray(again.positions), np.asarray(compressed.positions))
  np.testing.assert_array_equal(np.asarray(again.valid), np.asarray(compressed.valid))


def test_decode_every_with_a_budget_covering_everything_changes_nothing(tiny):
  model, cfg, _ = tiny
  ids = prompt(T=40)
  out = km.generate(
    model, ids, policy="snapkv", budget=64, window=4, max_new_tokens=10, decode_every=4
  )
  full = km.generate(model, ids, max_new_tokens=10)
  np.testing.assert_array_equal(out.tokens, full.tokens)


def test_rkv_recompresses_through_the_same_mechanism(tiny):
  model, cfg, params = tiny
  spec = cache_lib.CacheSpec(policies.make("rkv"), 1)
  assert spec.decode_every == 128 and spec.decode_window == 8 and not spec.decode_time
  ids = prompt(T=40, B=2, seed=4)
  request = policies.make("rkv").evidence_request(40)
  assert request == policies.EvidenceRequest(window=8, window_queries=8)
  pre = llama.prefill(cfg, params, jnp.asarray(ids), request=request)
  spec = cache_lib.CacheSpec(policies.make("rkv", decode_every=8), 16 + 8)
  cache = cache_lib.compress(cfg, pre, spec, 16)
  cache, held, _ = _run_steps(cfg, params, spec, cache, 10)
  assert held.max() <= 16 + 8 and (held[7] == 16).all() and (held[9] == 18).all()
  out = km.generate(model, ids, policy="rkv", budget=16, max_new_tokens=12, decode_every=8)
  assert out.tokens.shape == (2, 12)


def test_decode_every_refuses_what_it_cannot_rebuild(tiny):
  model, cfg, _ = tiny
  ids = prompt(T=40)
  with pytest.raises(ValueError, match="decode_every >= 32"):
    km.generate(model, ids, policy="snapkv", budget=40, decode_every=8)
  with pytest.raises(ValueError, match="query_mean_LHD"):
    km.generate(model, ids, policy="expected_attention", budget=20, decode_every=8)
  with pytest.raises(ValueError, match="step"):
    spec = cache_lib.CacheSpec(policies.make("knorm", decode_every=4), 20)
    pre = llama.prefill(cfg, model.params(), jnp.asarray(ids))
    c = cache_lib.compress(cfg, pre, spec, 16)
    cache_lib.decode_step(cfg, model.params(), spec, c, jnp.zeros(1, jnp.int32), 40, 40)


def test_budgets_are_traced_data_with_decode_every_and_think(tiny):
  model, cfg, params = tiny
  ids = prompt(T=40)
  request = policies.EvidenceRequest(window=8, value_out_norms=True, window_queries=8)
  pre = decoding.jit_prefill(cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), request)
  first = jnp.zeros((1,), jnp.int32)
  for options in (dict(decode_every=8), dict(channel_ratio=0.5)):
    chex.clear_trace_counter()
    spec = cache_lib.CacheSpec(
      policies.make("critical_snapkv", window=8, **options), 32 + 8, new_tokens=8
    )

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(budget, spec=spec):
      return decoding._compress_and_decode(
        cfg, params, pre, spec, budget, first, 8, 0.0, jax.random.key(0), None
      )

    for budget in (12, 20, 32):
      tokens, cache = run(jnp.int32(budget))
      assert int(np.asarray(cache.valid[..., : cache.keys.shape[3]]).sum(-1).max()) <= budget + 8


# --------------------------------------------------------------------------- caller evidence


def test_caller_evidence_is_validated_and_used(tiny):
  model, cfg, params = tiny
  ids = prompt(T=40)
  L, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  with pytest.raises(ValueError, match="qfilters_LGD"):
    km.generate(model, ids, policy="qfilter", budget=20)
  with pytest.raises(ValueError, match=r"qfilters_LGD has shape \(2, 2\)"):
    km.generate(model, ids, policy="qfilter", budget=20, evidence={"qfilters_LGD": np.ones((2, 2))})
  with pytest.raises(ValueError, match="not caller-given"):
    km.generate(
      model, ids, policy="qfilter", budget=20, evidence={"keys_LGTD": np.ones((L, G, 40, D))}
    )
  with pytest.raises(ValueError, match=r"in \[0, 1\]"):
    km.generate(
      model,
      ids,
      policy="duo_attention",
      budget=20,
      sinks=4,
      evidence={"retrieval_heads_LG": np.full((L, G), 2.0)},
    )
  filters = np.asarray(jax.random.normal(jax.random.key(1), (L, G, D)))
  kept = km.keep_mask(model, ids, "qfilter", 16, num_kv_heads=G, evidence={"qfilters_LGD": filters})
  pre = llama.prefill(cfg, params, jnp.asarray(ids))
  ev = policies.Evidence(keys_LGTD=pre.keys[:, 0], qfilters_LGD=jnp.asarray(filters))
  want = np.asarray(policies.make("qfilter", num_kv_heads=G).keep_mask(ev, 16))
  np.testing.assert_array_equal(kept[:, 0], want)


def test_reconstruction_attention_follows_the_callers_columns(tiny):
  """KVzip's evidence given over right-padded columns keeps what the unpadded row keeps."""
  model, cfg, _ = tiny
  L, G = cfg.num_layers, cfg.num_kv_heads
  ids = prompt(T=30, seed=5)
  attn = np.asarray(jax.random.uniform(jax.random.key(2), (L, 1, G, 30)))
  alone = km.keep_mask(
    model, ids, "kvzip", 12, num_kv_heads=G, evidence={"reconstruction_attn_LGT": attn}
  )
  padded = np.concatenate([ids, np.zeros((1, 6), np.int32)], 1)
  mask = np.concatenate([np.ones((1, 30), np.int32), np.zeros((1, 6), np.int32)], 1)
  attn_p = np.concatenate([attn, np.zeros((L, 1, G, 6), np.float32)], -1)
  got = km.keep_mask(
    model,
    km.Padded(padded, mask),
    "kvzip",
    12,
    num_kv_heads=G,
    evidence={"reconstruction_attn_LGT": attn_p},
  )
  np.testing.assert_array_equal(got[..., :30], alone)
  assert not got[..., 30:].any()


def test_answers_with_the_new_evidence_share_one_prefill(tiny):
  model, cfg, _ = tiny
  ids, answer = prompt(T=40, seed=6), prompt(T=3, seed=7)
  pre = answers.prefill_answers(
    model, ids, answer, window=8, oracle=False, needs=("value_out_norms_LHT", "query_mean_LHD")
  )
  for policy, options in (("critical_snapkv", dict(window=8)), ("expected_attention", {})):
    out = answers.answer_prefilled(model, pre, np.array([16, 24]), policy=policy, **options)
    assert out.predicted.shape == (2, 1, 3)
  with pytest.raises(ValueError, match="n_sink"):
    answers.answer_prefilled(model, pre, np.array([16]), policy="expected_attention", sinks=2)
  bare = answers.prefill_answers(model, ids, answer, window=8, oracle=False)
  with pytest.raises(ValueError, match="needs=\\('value_out_norms_LHT',\\)"):
    answers.answer_prefilled(model, bare, np.array([16]), policy="critical_snapkv", window=8)


def test_every_entry_point_refuses_a_token_budget_for_a_policy_that_keeps_every_token(tiny):
  model, cfg, _ = tiny
  ids = prompt(T=24)
  calls = {
    "generate": lambda: km.generate(model, ids, policy="think", budget=1, max_new_tokens=2),
    "generate_configs": lambda: km.generate_configs(
      model, ids, np.array([1, 30]), policy="think", max_new_tokens=2
    ),
    "keep_mask": lambda: km.keep_mask(model, ids, "think", 1),
    "answer_configs": lambda: km.answer_configs(
      model, ids, ids[:, -2:], np.array([1]), policy="think"
    ),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match="keeps every token"):
      call()
      pytest.fail(f"{name} accepted budget 1 for think")
  assert km.generate(model, ids, policy="think", budget=24, max_new_tokens=2).tokens.shape[1] == 2
