"""Scorers: hand-computed cases and naive numpy references of the reference semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import scores, select


def softmax(x, axis=-1):
  x = x - x.max(axis, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis, keepdims=True)


def naive_attention(q_LHTD, k_LGTD, allowed_TT):
  """Full [L, Hq, T, T] attention with HF repeat_kv, for small references only."""
  rep = q_LHTD.shape[1] // k_LGTD.shape[1]
  k = np.repeat(k_LGTD, rep, axis=1)
  logits = np.einsum("lhqd,lhkd->lhqk", q_LHTD, k) / np.sqrt(q_LHTD.shape[-1])
  logits = np.where(allowed_TT, logits, -np.inf)
  return softmax(logits)


def random_qk(seed=0, L=2, Hq=4, G=2, T=19, D=8):
  rng = np.random.default_rng(seed)
  return (
    rng.normal(size=(L, Hq, T, D)).astype(np.float32),
    rng.normal(size=(L, G, T, D)).astype(np.float32),
  )


def test_window_attention_matches_naive_gqa():
  q, k = random_qk()
  T = q.shape[2]
  causal = np.tril(np.ones((T, T), bool))
  full = naive_attention(q, k, causal)
  for W in (1, 5, T):
    ours = np.asarray(scores.window_attention(jnp.asarray(q[:, :, -W:]), jnp.asarray(k)))
    np.testing.assert_allclose(ours, full[:, :, -W:], atol=1e-6)
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("block", [1, 4, 19, 64])
def test_column_sums_causal_and_legacy(block):
  q, k = random_qk(seed=1)
  T, w = q.shape[2], 5
  causal = np.tril(np.ones((T, T), bool))
  legacy = causal | (np.arange(T)[:, None] < T - w)  # rows before the window see the future
  for mask, allowed in (("causal", causal), ("kvfactory_legacy", legacy)):
    ours = scores.attention_column_sums(
      jnp.asarray(q), jnp.asarray(k), mask=mask, window=w, block=block
    )
    expected = naive_attention(q, k, allowed).sum(-2)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)


def test_h2o_forms():
  q, k = random_qk(seed=2)
  T = q.shape[2]
  sums = naive_attention(q, k, np.tril(np.ones((T, T), bool))).sum(-2)
  causal = np.asarray(scores.h2o(jnp.asarray(q), jnp.asarray(k), form="causal", recent=3))
  np.testing.assert_allclose(causal[..., : T - 3], sums[..., : T - 3], rtol=1e-5)
  assert np.isinf(causal[..., T - 3 :]).all()
  kvpress = np.asarray(scores.h2o(jnp.asarray(q), jnp.asarray(k), form="kvpress"))
  np.testing.assert_allclose(kvpress, sums / np.arange(T, 0, -1), rtol=1e-5)
  legacy = np.asarray(scores.h2o(jnp.asarray(q), jnp.asarray(k), form="kvfactory_legacy"))
  assert np.isinf(legacy[..., T - 8 :]).all() and np.isfinite(legacy[..., : T - 8]).all()


def test_pool1d_hand_computed():
  x = jnp.asarray([[1.0, 3.0, 2.0, 0.0, 5.0]])
  np.testing.assert_allclose(np.asarray(scores.pool1d(x, 3, "max")), [[3, 3, 3, 5, 5]])
  avg = [(0 + 1 + 3) / 3, (1 + 3 + 2) / 3, (3 + 2 + 0) / 3, (2 + 0 + 5) / 3, (0 + 5 + 0) / 3]
  np.testing.assert_allclose(np.asarray(scores.pool1d(x, 3, "avg")), [avg], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(scores.pool1d(x, 1, "avg")), x)


def test_snapkv_hand_computed():
  # one layer, one head, W=2 window rows over T=5 keys; prefix keys 0..2
  attn = np.zeros((1, 1, 2, 5), np.float32)
  attn[0, 0, 0] = [0.1, 0.5, 0.1, 0.3, 0.0]
  attn[0, 0, 1] = [0.2, 0.1, 0.3, 0.2, 0.2]
  votes = np.array([0.3, 0.6, 0.4])
  s = np.asarray(scores.snapkv(jnp.asarray(attn), kernel=1))
  np.testing.assert_allclose(s[0, 0, :3], votes, rtol=1e-6)
  assert np.isinf(s[0, 0, 3:]).all()
  s = np.asarray(scores.snapkv(jnp.asarray(attn), kernel=3, pool="max", reduce="mean"))
  np.testing.assert_allclose(s[0, 0, :3], [0.3, 0.3, 0.3], rtol=1e-6)
  s = np.asarray(scores.snapkv(jnp.asarray(attn), kernel=3, pool="avg"))
  np.testing.assert_allclose(s[0, 0, :3], [0.3, 1.3 / 3, 1.0 / 3], rtol=1e-6)
  # budget 3 = window 2 + the best prefix key (1)
  keep = np.asarray(select.top_mask(jnp.asarray(scores.snapkv(jnp.asarray(attn), kernel=1)), 3))
  assert keep[0, 0].tolist() == [False, True, False, True, True]


def test_streaming_and_recency_kept_sets():
  keep = np.asarray(select.top_mask(scores.streaming(20, (1,), sinks=4), jnp.int32(9)))
  assert np.flatnonzero(keep[0]).tolist() == [0, 1, 2, 3, 15, 16, 17, 18, 19]
  keep = np.asarray(select.top_mask(scores.recency(20, (2, 3)), jnp.int32(5)))
  assert (keep[..., 15:]).all() and keep.sum() == 2 * 3 * 5


def test_tova_knorm_oracle_cake():
  rng = np.random.default_rng(4)
  row = softmax(rng.normal(size=(2, 3, 10)))
  t = np.asarray(scores.tova(jnp.asarray(row, jnp.float32)))
  np.testing.assert_allclose(t, np.broadcast_to(row.mean(1, keepdims=True), row.shape), rtol=1e-6)
  keys = rng.normal(size=(2, 2, 10, 4)).astype(np.float32)
  np.testing.assert_allclose(
    np.asarray(scores.knorm(jnp.asarray(keys))), -np.linalg.norm(keys, axis=-1), rtol=1e-6
  )
  fut = softmax(rng.normal(size=(2, 3, 6, 10))).astype(np.float32)
  np.testing.assert_allclose(np.asarray(scores.oracle(jnp.asarray(fut))), fut.sum(2), rtol=1e-6)
  attn = softmax(rng.normal(size=(2, 3, 4, 10))).astype(np.float32)
  c = np.asarray(scores.cake(jnp.asarray(attn), gamma=200.0, kernel=1))
  prefix = attn[..., :, :6]
  np.testing.assert_allclose(c[..., :6], prefix.mean(2) + 200 * prefix.var(2, ddof=1), rtol=1e-5)
  assert np.isinf(c[..., 6:]).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 33])
def test_window_row_reductions_equal_numpy(rows):
  """sum_rows / mean_rows / var_rows (the tree of adds the window readers use) equal numpy's
  reductions over the row axis, on a sliced input as the scorers feed them, under jit."""
  rng = np.random.default_rng(rows)
  attn = rng.random((2, 3, rows + 2, 11)).astype(np.float32)
  sliced = jax.jit(lambda a: a[..., 2:, :9])
  x = np.asarray(attn[..., 2:, :9], np.float64)
  got = jax.jit(lambda a: scores.sum_rows(sliced(a)))(jnp.asarray(attn))
  np.testing.assert_allclose(np.asarray(got), x.sum(-2), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(scores.mean_rows(sliced(attn))), x.mean(-2), rtol=1e-6)
  if rows > 1:
    var = np.asarray(scores.var_rows(sliced(attn), ddof=1))
    np.testing.assert_allclose(var, x.var(-2, ddof=1), rtol=1e-5, atol=1e-7)
  assert got.shape == (2, 3, 9)


def test_group_mapping():
  s = jnp.asarray(np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3))
  g = np.asarray(scores.group(s, 2, "max"))
  np.testing.assert_array_equal(g, np.asarray(s).reshape(2, 2, 2, 3).max(2))
  np.testing.assert_array_equal(
    np.asarray(scores.group(s, 2, "sum")), np.asarray(s).reshape(2, 2, 2, 3).sum(2)
  )
  np.testing.assert_array_equal(np.asarray(scores.group(s, 4, "mean")), np.asarray(s))


def test_protect_per_row_counts_and_length():
  s = jnp.zeros((2, 10))
  p = np.asarray(
    scores.protect(
      s, sinks=jnp.asarray([1, 2]), recent=jnp.asarray([3, 0]), length=jnp.asarray([8, 10])
    )
  )
  assert np.flatnonzero(np.isinf(p[0])).tolist() == [0, 5, 6, 7]
  assert np.flatnonzero(np.isinf(p[1])).tolist() == [0, 1]


def test_random_scores_are_seeded():
  a = scores.random(jax.random.key(0), (2, 3, 5))
  b = scores.random(jax.random.key(0), (2, 3, 5))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: scores.pool1d(jnp.zeros((3,)), 4), "kernel: expected a positive odd"),
    (lambda: scores.pool1d(jnp.zeros((3,)), 0), "kernel: expected a positive odd"),
    (lambda: scores.pool1d(jnp.zeros((3,)), 3.0), "kernel: expected a positive odd"),
    (lambda: scores.pool1d(jnp.zeros((3,)), 3, "median"), "pool: unknown value 'median'"),
    (lambda: scores.snapkv(jnp.zeros((1, 1, 2, 5)), reduce="prod"), "reduce: unknown"),
    (lambda: scores.snapkv(jnp.zeros((1, 1, 2, 5)), window=3), "window: expected 1 <= window"),
    (lambda: scores.group(jnp.zeros((1, 6, 5)), 4), "Hq=6 query heads is not a multiple of G=4"),
    (lambda: scores.group(jnp.zeros((1, 4, 5)), 2, "median"), "how: unknown value"),
    (
      lambda: scores.window_attention(jnp.zeros((1, 2, 6, 4)), jnp.zeros((1, 1, 5, 4))),
      "window: W=6 exceeds",
    ),
    (
      lambda: scores.window_attention(jnp.zeros((1, 3, 2, 4)), jnp.zeros((1, 2, 5, 4))),
      "not a multiple",
    ),
    (
      lambda: scores.window_attention(jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 1, 5, 3))),
      "keys: shape",
    ),
    (lambda: scores.snapkv(jnp.full((1, 1, 2, 5), jnp.nan)), "attn: contains NaN"),
    (
      lambda: scores.h2o(jnp.zeros((1, 1, 5, 2)), jnp.zeros((1, 1, 5, 2)), form="noncausal"),
      "form: unknown",
    ),
    (lambda: scores.protect(jnp.zeros((2, 4)), sinks=-1), "sinks: expected a non-negative"),
    (lambda: scores.recency(0), "num_positions"),
  ],
)
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_counts_are_integers_in_int32():
  with pytest.raises(ValueError, match="sinks: expected an integer count"):
    scores.streaming(8, sinks=2.5)
  with pytest.raises(ValueError, match="sinks: expected a non-negative count"):
    scores.streaming(8, sinks=-2)
  with pytest.raises(ValueError, match="sinks: .* does not fit int32"):
    scores.streaming(8, sinks=np.int64(2**32 + 2))
  with pytest.raises(ValueError, match="recent: expected an integer count"):
    scores.protect(jnp.zeros((2, 8)), recent=np.float32(1.0))
  with pytest.raises(ValueError, match="length: 1099511627776 does not fit int32"):
    scores.protect(jnp.zeros((2, 8)), sinks=1, length=2**40)
  with pytest.raises(ValueError, match="kernel: expected a positive odd integer"):
    scores.pool1d(jnp.zeros((2, 8)), 2**31 + 1)
  with pytest.raises(ValueError, match="gamma: expected a finite weight"):
    scores.cake(jnp.full((1, 1, 4, 8), 1 / 8), gamma=float("nan"))
  # sinks stay data: traced ints are fine, and give the same scores
  traced = jax.jit(lambda s: scores.streaming(8, (2,), sinks=s))(jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(scores.streaming(8, (2,), sinks=2)))
