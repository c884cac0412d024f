"""Properties of kvjax.select against a numpy stable-argsort reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import select


def reference_order(scores):
  """Numpy reference order: stable argsort of the negated scores, -0.0 normalised to +0.0."""
  scores = np.asarray(scores, np.float64)
  return np.argsort(-np.where(scores == 0, 0.0, scores), axis=-1, kind="stable")


def reference_mask(scores, budget, length=None):
  """Numpy reference: stable descending order (ties to the lower position), first min(b, len)."""
  scores = np.asarray(scores, np.float64)
  T = scores.shape[-1]
  flat = scores.reshape(-1, T)
  budget = np.broadcast_to(np.asarray(budget), scores.shape[:-1]).reshape(-1)
  length = (
    np.full(flat.shape[0], T)
    if length is None
    else np.broadcast_to(length, scores.shape[:-1]).reshape(-1)
  )
  out = np.zeros(flat.shape, bool)
  for r in range(flat.shape[0]):
    n = int(length[r])
    order = reference_order(flat[r, :n])
    out[r, order[: min(int(budget[r]), n)]] = True
  return out.reshape(scores.shape)


def random_case(rng, with_ties=False):
  shape = tuple(rng.integers(1, 5, size=rng.integers(1, 3))) + (int(rng.integers(1, 40)),)
  if with_ties:
    scores = rng.integers(0, 4, size=shape).astype(np.float32)
  else:
    scores = rng.normal(size=shape).astype(np.float32)
  budget = rng.integers(0, shape[-1] + 3, size=shape[:-1]).astype(np.int32)
  return scores, budget


@pytest.mark.parametrize("seed", range(30))
def test_keep_mask_matches_reference_count_and_ties(seed):
  rng = np.random.default_rng(seed)
  scores, budget = random_case(rng, with_ties=seed % 2 == 0)
  keep = np.asarray(select.top_mask(jnp.asarray(scores), jnp.asarray(budget)))
  np.testing.assert_array_equal(keep, reference_mask(scores, budget))
  np.testing.assert_array_equal(keep.sum(-1), np.minimum(budget, scores.shape[-1]))


@pytest.mark.parametrize("seed", range(20))
def test_length_prefix_and_capacity(seed):
  rng = np.random.default_rng(100 + seed)
  scores, _ = random_case(rng, with_ties=seed % 3 == 0)
  T = scores.shape[-1]
  length = rng.integers(0, T + 1, size=scores.shape[:-1]).astype(np.int32)
  capacity = int(rng.integers(1, T + 1))
  # budgets either within capacity or covering the row (the only combinations a capacity allows)
  small = rng.integers(0, capacity + 1, size=scores.shape[:-1])
  budget = np.where(rng.random(scores.shape[:-1]) < 0.2, T + 1, small).astype(np.int32)
  keep = np.asarray(select.top_mask(jnp.asarray(scores), budget, length=length, capacity=capacity))
  np.testing.assert_array_equal(keep, reference_mask(scores, budget, length))
  assert not keep[np.arange(T) >= length[..., None]].any()


@pytest.mark.parametrize("seed", range(20))
def test_compact_equals_keep_mask(seed):
  rng = np.random.default_rng(200 + seed)
  scores, budget = random_case(rng, with_ties=seed % 2 == 1)
  T = scores.shape[-1]
  capacity = int(rng.integers(1, T + 4))
  budget = np.minimum(budget, capacity).astype(np.int32)
  idx, valid = select.compact(jnp.asarray(scores), budget, capacity)
  idx, valid = np.asarray(idx), np.asarray(valid)
  assert idx.shape == scores.shape[:-1] + (capacity,) and idx.dtype == np.int32
  expected = reference_mask(scores, budget)
  rebuilt = np.zeros_like(expected)
  for r in np.ndindex(scores.shape[:-1]):
    kept = idx[r][valid[r]]
    assert np.all(np.diff(kept) > 0), "valid slots must be strictly ascending"
    assert valid[r].tolist() == sorted(valid[r].tolist(), reverse=True), "valid slots first"
    rebuilt[r][kept] = True
  np.testing.assert_array_equal(rebuilt, expected)
  assert (idx[~valid] == 0).all()


def test_budget_above_T_keeps_everything_even_beyond_capacity():
  scores = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 50)), jnp.float32)
  keep = select.top_mask(scores, jnp.full((2, 3), 50), capacity=8)
  assert bool(keep.all())
  keep = select.top_mask(scores, jnp.full((2, 3), 10**6), capacity=8)
  assert bool(keep.all())


@pytest.mark.parametrize("seed", range(10))
def test_monotone_in_budget(seed):
  rng = np.random.default_rng(300 + seed)
  scores, _ = random_case(rng, with_ties=True)
  T = scores.shape[-1]
  prev = np.zeros(scores.shape, bool)
  for b in range(T + 2):
    keep = np.asarray(select.top_mask(jnp.asarray(scores), np.int32(b)))
    assert (keep >= prev).all(), "a larger budget must keep a superset"
    prev = keep


def test_head_permutation_equivariance():
  rng = np.random.default_rng(7)
  scores = rng.normal(size=(3, 6, 33)).astype(np.float32)
  budget = rng.integers(0, 33, size=(3, 6)).astype(np.int32)
  perm = rng.permutation(6)
  keep = np.asarray(select.top_mask(jnp.asarray(scores), budget))
  keep_p = np.asarray(select.top_mask(jnp.asarray(scores[:, perm]), budget[:, perm]))
  np.testing.assert_array_equal(keep[:, perm], keep_p)


def test_protected_positions_win_and_count_inside_budget():
  from kvjax import scores as sc

  rng = np.random.default_rng(3)
  raw = jnp.asarray(rng.normal(size=(2, 4, 40)), jnp.float32) * 100
  protected = sc.protect(raw, sinks=3, recent=5)
  keep = np.asarray(select.top_mask(protected, jnp.int32(12)))
  assert keep[..., :3].all() and keep[..., -5:].all()
  assert (keep.sum(-1) == 12).all()
  # a budget below the protected count keeps the lower protected positions first
  keep = np.asarray(select.top_mask(protected, jnp.int32(5)))
  assert keep[..., :3].all() and keep[..., 35:37].all() and keep.sum() == 2 * 4 * 5


def test_no_retrace_on_new_budget_values():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(scores, budget):
    keep = select.top_mask(scores, budget, capacity=16)
    idx, valid = select.compact(scores, budget, 16)
    return keep, idx, valid

  scores = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4, 64)), jnp.float32)
  for b in range(0, 17, 3):
    keep, _, valid = run(scores, jnp.full((4, 4), b, jnp.int32))
    assert int(keep.sum()) == 16 * b and int(valid.sum()) == 16 * b
  for seed in range(3):
    budget = jnp.asarray(np.random.default_rng(seed).integers(0, 17, (4, 4)), jnp.int32)
    run(scores, budget)
  chex.clear_trace_counter()


def test_vmap_over_budget_configurations():
  rng = np.random.default_rng(11)
  scores = jnp.asarray(rng.normal(size=(2, 3, 30)), jnp.float32)
  budgets_KLH = jnp.asarray(rng.integers(0, 12, size=(5, 2, 3)), jnp.int32)
  sweep = jax.jit(jax.vmap(lambda b: select.top_mask(scores, b, capacity=12)))
  keep_KLHT = np.asarray(sweep(budgets_KLH))
  for k in range(5):
    np.testing.assert_array_equal(
      keep_KLHT[k], reference_mask(np.asarray(scores), np.asarray(budgets_KLH[k]))
    )


@pytest.mark.parametrize("seed", range(10))
def test_pooled_selection(seed):
  rng = np.random.default_rng(400 + seed)
  L, H, T = 3, int(rng.integers(1, 6)), int(rng.integers(2, 30))
  scores = rng.normal(size=(L, H, T)).astype(np.float32)
  budget = rng.integers(0, H * T + 3, size=(L,)).astype(np.int32)
  keep = np.asarray(select.top_mask_pooled(jnp.asarray(scores), budget))
  expected = reference_mask(scores.reshape(L, H * T), budget).reshape(L, H, T)
  np.testing.assert_array_equal(keep, expected)
  counts = np.asarray(select.pooled_budgets(jnp.asarray(scores), budget))
  np.testing.assert_array_equal(counts.sum(-1), np.minimum(budget, H * T))
  # each head's own top count_h is the pooled set (no exact ties in normal scores)
  per_head = np.asarray(select.top_mask(jnp.asarray(scores), counts))
  np.testing.assert_array_equal(per_head, keep)


def test_pooled_with_length():
  scores = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 10)), jnp.float32)
  length = jnp.asarray([[10, 4, 0], [2, 2, 2]], jnp.int32)
  keep = np.asarray(select.top_mask_pooled(scores, jnp.asarray([100, 5]), length=length))
  assert keep[0].sum() == 14 and keep[1].sum() == 5
  assert not keep[0, 1, 4:].any() and not keep[0, 2].any() and not keep[1, :, 2:].any()


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(budget=-1), "budget: expected non-negative"),
    (dict(budget=np.ones((3, 3), np.int32)), "budget: shape"),
    (dict(budget=np.float32(2.0)), "budget: expected an integer"),
    (dict(budget=np.int32(2), capacity=0), "capacity"),
    (dict(budget=np.int32(9), capacity=4), "budget: 9 exceeds capacity=4"),
    (dict(budget=np.int32(2), length=np.int32(99)), "length: 99 exceeds"),
    (dict(budget=np.int32(2), length=np.int32(-1)), "length: expected non-negative"),
  ],
)
def test_bad_input_raises(kwargs, match):
  scores = jnp.zeros((2, 16), jnp.float32)
  with pytest.raises(ValueError, match=match):
    select.top_mask(scores, **kwargs)


def test_nan_scores_raise():
  with pytest.raises(ValueError, match="scores: contains NaN"):
    select.top_mask(jnp.asarray([[0.0, jnp.nan]]), jnp.int32(1))
  with pytest.raises(ValueError, match="scores: expected a floating"):
    select.compact(jnp.asarray([[1, 2]]), jnp.int32(1), 2)


@pytest.mark.parametrize("seed", range(4))
def test_pooled_count_table_answers_every_pooled_budget(seed):
  rng = np.random.default_rng(500 + seed)
  L, H, T = 2, 3, 11
  scores = jnp.asarray(rng.integers(0, 5, size=(L, H, T)).astype(np.float32))  # with ties
  table = select.pooled_count_table(scores, 20)
  assert table.shape == (L, 21, H)
  for n in range(0, 25):
    counts = select.pooled_counts_from_table(table, jnp.full((L,), n))
    expected = select.pooled_budgets(scores, jnp.full((L,), min(n, 20)))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(expected))


@pytest.mark.parametrize("seed", range(4))
def test_pooled_rank_table_answers_every_pooled_budget(seed):
  rng = np.random.default_rng(520 + seed)
  L, H, T = 2, 3, 11
  scores = jnp.asarray(rng.integers(0, 5, size=(L, H, T)).astype(np.float32))  # with ties
  scores = scores.at[0, 1, :3].set(jnp.inf)
  table = select.pooled_rank_table(scores, 20)
  assert table.shape == (L, 20) and table.dtype == jnp.int32
  dense = select.pooled_count_table(scores, 20)
  for n in range(0, 25):
    counts = select.pooled_counts_from_ranks(table, jnp.full((L,), n), H)
    np.testing.assert_array_equal(
      np.asarray(counts), np.asarray(select.pooled_counts_from_table(dense, jnp.full((L,), n)))
    )
    expected = select.pooled_budgets(scores, jnp.full((L,), min(n, 20)))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(expected))
  many = jax.jit(jax.vmap(lambda n: select.pooled_counts_from_ranks(table, n, H)))
  ns = jnp.asarray(rng.integers(0, 21, size=(5, L)).astype(np.int32))
  np.testing.assert_array_equal(
    np.asarray(many(ns)), np.stack([np.asarray(select.pooled_budgets(scores, n)) for n in ns])
  )
  with pytest.raises(ValueError, match="max_total"):
    big = jax.ShapeDtypeStruct((1, 2**16, 2**15), jnp.float32)
    jax.eval_shape(lambda x: select.pooled_rank_table(x, 2**31 - 1), big)


def signed_zero_scores(rng, shape):
  """Scores with many exact ties, -0.0 and +0.0 mixed among them, and the +/-inf sentinels.

  About 10% are positive, so a top list longer than T / 10 reaches into the zeros.
  """
  values = np.array([-0.0, 0.0, 1.0, np.inf, -1.0, -2.5, -np.inf], np.float32)
  return rng.choice(values, size=shape, p=[0.3, 0.3, 0.05, 0.05, 0.1, 0.1, 0.1])


@pytest.fixture(params=["packed", "portable"])
def sort_path(request, monkeypatch):
  """Runs a test on the CPU packed int64 sort or on the portable two-key sort of other backends.

  The path is chosen in Python at trace time, so callers must trace afresh (eager calls or a new
  ``jax.jit`` of a lambda), never reuse the module's cached jitted functions under the patch.
  """
  if request.param == "portable":
    jax.clear_caches()  # traces of the packed path must not serve the patched one
    monkeypatch.setattr(select, "uses_packed_sort", lambda: False)
    jaxpr = str(jax.make_jaxpr(lambda s: select.descending_order(s, 300))(jnp.zeros((1, 512))))
    assert "num_keys=2" in jaxpr, "the portable sort path was not taken"
  yield request.param
  if request.param == "portable":
    jax.clear_caches()


@pytest.mark.parametrize("T, k", [(300, 300), (1000, 200), (2048, 2048), (513, 100)])
def test_descending_order_sort_matches_stable_argsort(T, k, sort_path):
  rng = np.random.default_rng(T)
  scores = rng.integers(-3, 3, size=(3, T)).astype(np.float32)  # many ties
  scores[0, :5] = [np.inf, -np.inf, -0.0, 0.0, np.inf]
  scores[1] = signed_zero_scores(rng, T)
  expected = reference_order(scores)[:, :k]
  order = np.asarray(select.descending_order(jnp.asarray(scores), k))
  np.testing.assert_array_equal(order, expected)
  order = np.asarray(jax.jit(lambda s: select.descending_order(s, k))(jnp.asarray(scores)))
  np.testing.assert_array_equal(order, expected)


@pytest.mark.parametrize("seed", range(3))
def test_signed_zeros_tie_on_the_sort_path_under_jit(seed, sort_path):
  # T = 512 and budget 300 take the deep sort path; x + 0.0 used to be folded away under jit, so
  # -0.0 ranked below +0.0 instead of tying with it.
  rng = np.random.default_rng(600 + seed)
  scores = signed_zero_scores(rng, (2, 3, 512))
  scores[..., :100] = np.where(rng.random((2, 3, 100)) < 0.5, -0.0, 0.0)  # zeros win the budget
  budget = np.full((2, 3), 300, np.int32)
  budget[1, 2] = 17
  expected = reference_mask(scores, budget)
  keep = jax.jit(
    lambda s, b: select.top_mask(s, b, length=jnp.full(b.shape, 512, jnp.int32), capacity=512)
  )
  np.testing.assert_array_equal(np.asarray(keep(jnp.asarray(scores), budget)), expected)
  if sort_path == "packed":
    np.testing.assert_array_equal(np.asarray(select.top_mask(scores, budget)), expected)
    np.testing.assert_array_equal(
      np.asarray(jax.jit(select.top_mask)(jnp.asarray(scores), budget)), expected
    )
  idx, valid = jax.jit(lambda s, b: select.compact(s, b, 300, length=jnp.full(b.shape, 512)))(
    jnp.asarray(scores), budget
  )
  rebuilt = np.zeros_like(expected)
  for r in np.ndindex(budget.shape):
    rebuilt[r][np.asarray(idx)[r][np.asarray(valid)[r]]] = True
  np.testing.assert_array_equal(rebuilt, expected)


@pytest.mark.parametrize("T, capacity", [(512, 64), (200, 150), (40, 40)])
def test_signed_zeros_tie_on_the_top_k_path_under_jit(T, capacity):
  # lax.top_k orders +0.0 above -0.0 (a total order on the bits): the zeros are normalised first.
  rng = np.random.default_rng(T)
  scores = signed_zero_scores(rng, (3, 4, T))
  budget = rng.integers(0, capacity + 1, size=(3, 4)).astype(np.int32)
  keep = jax.jit(lambda s, b: select.top_mask(s, b, capacity=capacity))
  np.testing.assert_array_equal(
    np.asarray(keep(jnp.asarray(scores), budget)), reference_mask(scores, budget)
  )
  order = jax.jit(lambda s: select.descending_order(s, capacity))(jnp.asarray(scores))
  np.testing.assert_array_equal(np.asarray(order), reference_order(scores)[..., :capacity])


def test_subnormal_scores_order_the_same_on_every_path():
  # XLA:CPU flushes subnormals in float comparisons; the zero normalisation must not.
  tiny = np.float32(1e-45)
  row = np.array([0.0, tiny, -0.0, -tiny, 0.0, 3 * tiny, -0.0, -tiny, 1.0, -1.0], np.float32)
  scores = np.tile(row, (2, 52))[:, :512]
  expected = reference_order(scores)
  for k in (64, 300):  # the top_k path, then the sort path
    order = jax.jit(lambda s, k=k: select.descending_order(s, k))(jnp.asarray(scores))
    np.testing.assert_array_equal(np.asarray(order), expected[:, :k])


@pytest.mark.parametrize("seed", range(4))
def test_portable_sort_path_equals_the_cpu_path(seed, monkeypatch):
  """The non-CPU path (two-key lax.sort) gives exactly the CPU path's order, ranks and masks."""
  rng = np.random.default_rng(700 + seed)
  T = int(rng.integers(257, 1200))
  shape = (2, int(rng.integers(1, 4)), T)
  if seed % 2:
    scores = signed_zero_scores(rng, shape)
  else:
    scores = rng.integers(-2, 3, size=shape).astype(np.float32) * np.float32(-1.0)  # -0.0 too
  scores = jnp.asarray(scores)
  capacity = int(rng.integers(T // 8 + 1, T))
  budget = jnp.asarray(rng.integers(0, capacity + 1, size=shape[:-1]), jnp.int32)
  length = jnp.asarray(rng.integers(0, T + 1, size=shape[:-1]), jnp.int32)

  def run():
    return (
      select.descending_order(scores, capacity),
      jax.jit(lambda s: select.ranks(s, length=length, capacity=capacity))(scores),
      jax.jit(lambda s, b: select.top_mask(s, b, length=length, capacity=capacity))(scores, budget),
      jax.jit(lambda s, b: select.compact(s, b, capacity, length=length))(scores, budget),
    )

  cpu = run()
  np.testing.assert_array_equal(np.asarray(cpu[0]), reference_order(scores)[..., :capacity])
  np.testing.assert_array_equal(np.asarray(cpu[2]), reference_mask(scores, budget, length))
  jax.clear_caches()  # the module's jitted functions must trace the patched path afresh
  monkeypatch.setattr(select, "uses_packed_sort", lambda: False)
  portable = run()
  jax.clear_caches()
  for a, b in zip(jax.tree.leaves(cpu), jax.tree.leaves(portable), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compact_refuses_a_capacity_below_the_kept_count():
  scores = jnp.zeros((2, 50), jnp.float32)
  with pytest.raises(ValueError, match="capacity: 8 slots cannot hold 50"):
    select.compact(scores, jnp.int32(100), 8)
  idx, valid = select.compact(scores, jnp.int32(100), 8, length=jnp.asarray([8, 3]))
  assert np.asarray(valid).sum(-1).tolist() == [8, 3]


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(budget=np.int64(2**32 + 12)), "budget: 4294967308 does not fit int32"),
    (dict(budget=2**40), "budget: 1099511627776 does not fit int32"),
    (dict(budget=2**70), "budget: .* does not fit int32"),
    (dict(budget=np.uint64(2**63)), "budget: .* does not fit int32"),
    (dict(budget=np.asarray([3, 2**31])), "budget: 2147483648 does not fit int32"),
    (dict(budget=2, length=np.int64(2**32 + 3)), "length: .* does not fit int32"),
    (dict(budget=2, capacity=2**31), "capacity: 2147483648 does not fit int32"),
    (dict(budget=2, capacity=True), "capacity: expected a positive static int"),
    (dict(budget=True), "budget: expected an integer"),
  ],
)
def test_counts_outside_int32_raise_before_any_cast(kwargs, match):
  scores = jnp.zeros((2, 16), jnp.float32)
  with pytest.raises(ValueError, match=match):
    select.top_mask(scores, **kwargs)
  # the largest int32 budget is the no-compression guard, not an error
  assert np.asarray(select.top_mask(scores, np.int64(2**31 - 1))).all()


def test_checked_selection_reports_nan_negative_and_over_capacity_under_jit():
  mask = jax.jit(lambda s, b, n: select.checked_top_mask(s, b, length=n, capacity=4))
  slots = jax.jit(lambda s, b: select.checked_compact(s, b, 4))
  scores = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16)), jnp.float32)
  full = jnp.asarray([16, 16])
  cases = [
    (scores.at[1, 3].set(jnp.nan), [2, 2], full, "scores: contains 1 NaN"),
    (scores, [2, -1], full, "budget: expected non-negative counts, got minimum -1"),
    (scores, [2, 9], full, "budget: 9 exceeds capacity=4 for a row of length 16"),
    (scores, [2, 2], jnp.asarray([16, 17]), r"length: expected counts in \[0, T=16\]"),
  ]
  for s, b, n, match in cases:
    err, keep = mask(s, jnp.asarray(b, jnp.int32), n)
    with pytest.raises(ValueError, match=match):  # checkify's error is a ValueError
      err.throw()
  err, keep = mask(scores, jnp.asarray([3, 16], jnp.int32), full)  # 16 = the whole row
  assert err.get() is None
  np.testing.assert_array_equal(np.asarray(keep).sum(-1), [3, 16])
  err, (idx, valid) = slots(scores, jnp.asarray([4, 6], jnp.int32))
  with pytest.raises(ValueError, match="capacity: 4 slots cannot hold 6 kept positions"):
    err.throw()
  err, (idx, valid) = slots(scores, jnp.asarray([4, 1], jnp.int32))
  assert err.get() is None and np.asarray(valid).sum(-1).tolist() == [4, 1]
  # concrete bad input still raises at the boundary, before any jit
  with pytest.raises(ValueError, match="scores: contains NaN"):
    select.checked_top_mask(scores.at[0, 0].set(jnp.nan), 2)


@pytest.mark.parametrize("k", [3, 40])  # lax.top_k's depth, then the int32 sort's (past T / 8)
def test_descending_values_equal_the_values_at_the_descending_order(k):
  rng = np.random.default_rng(k)
  x = rng.standard_normal((3, 4, 300)).astype(np.float32)
  x[0, 0, :50] = 0.5  # ties
  x[1, 1, 7], x[1, 1, 9] = -0.0, 0.0
  x_j = jnp.asarray(x)
  got = np.asarray(select.descending_values(x_j, k))
  want = np.take_along_axis(x, np.asarray(select.descending_order(x_j, k)), -1)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, -np.sort(-x, -1)[..., :k])


# --------------------------------------------------------------------------- the count threshold
# keep_mask on rows of at least COUNT_THRESHOLD_MIN_POSITIONS with a capacity up to T / 8 finds,
# by bisection with counting passes, a key with exactly n entries at or above it; when some row's
# n-th best is tied with the next (or is -inf) the batch takes the ordered path instead.


def threshold_case(rng, kind, shape):
  if kind == "normal":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "heavy_tail":  # attention-like: positive, spanning orders of magnitude
    return np.exp(rng.standard_normal(shape) * 4).astype(np.float32)
  if kind == "ties":  # few distinct values: the n-th best tied with the next
    return rng.integers(0, 5, size=shape).astype(np.float32)
  if kind == "signed_zeros":
    return signed_zero_scores(rng, shape)
  if kind == "subnormal":  # distinct subnormals of both signs, and the zeros
    ints = np.stack(
      [rng.permutation(shape[-1]) - shape[-1] // 2 for _ in range(np.prod(shape[:-1]))]
    )
    return (ints.reshape(shape) * np.float32(1e-45)).astype(np.float32)
  if kind == "inf":  # +inf sentinels (protect) and -inf positions
    s = rng.standard_normal(shape).astype(np.float32)
    s[..., :5] = np.inf
    s[..., 7::97] = -np.inf
    return s
  raise AssertionError(kind)


def settles(masked, n):
  """Whether every row with n >= 1 has its n-th best above -inf and above its (n + 1)-th."""
  desc = -np.sort(-np.where(masked == 0, 0.0, masked.astype(np.float64)), axis=-1)
  for row, count in zip(desc.reshape(-1, desc.shape[-1]), np.ravel(n), strict=True):
    if count >= 1 and (
      row[count - 1] == -np.inf or (count < len(row) and row[count - 1] == row[count])
    ):
      return False
  return True


@pytest.mark.parametrize(
  "kind", ["normal", "heavy_tail", "ties", "signed_zeros", "subnormal", "inf"]
)
def test_count_threshold_path_equals_the_reference(kind):
  rng = np.random.default_rng(len(kind))
  T = select.COUNT_THRESHOLD_MIN_POSITIONS + 77
  scores = threshold_case(rng, kind, (3, 5, T))
  capacity = T // 8
  budget = rng.integers(0, capacity + 1, size=(3, 5)).astype(np.int32)
  budget[0, 0], budget[0, 1], budget[0, 2] = 0, 1, capacity  # edges
  length = rng.integers(capacity, T + 1, size=(3, 5)).astype(np.int32)
  length[1, 0], length[1, 1] = 0, 3  # an empty row; a row shorter than its budget
  keep = jax.jit(lambda s, b, n: select.top_mask(s, b, length=n, capacity=capacity))
  np.testing.assert_array_equal(
    np.asarray(keep(scores, budget, length)), reference_mask(scores, budget, length)
  )
  full = jax.jit(lambda s, b: select.top_mask(s, b, capacity=capacity))
  np.testing.assert_array_equal(np.asarray(full(scores, budget)), reference_mask(scores, budget))
  # which path ran: the count threshold wherever every row settles, as numpy predicts
  masked = np.where(np.arange(T) < length[..., None], scores, -np.inf).astype(np.float32)
  n = np.minimum(budget, length)
  settled = bool(jax.jit(select.count_threshold)(masked, n)[1])
  assert settled == settles(masked, n)
  if kind in ("normal", "heavy_tail", "subnormal"):
    assert settled  # these exercise the count threshold, not the fallback
  if kind in ("ties", "signed_zeros"):
    assert not settled


def test_count_threshold_declines_ties_and_minus_inf_and_settles_empty_rows():
  rng = np.random.default_rng(5)
  T = 8192
  n = rng.integers(1, 513, size=(4, 6)).astype(np.int32)
  search = jax.jit(select.count_threshold)
  scores = rng.standard_normal((4, 6, T)).astype(np.float32)
  assert bool(search(scores, n)[1])
  assert not bool(search(np.zeros_like(scores), n)[1])  # every key tied
  empty = scores.copy()
  empty[0, 0] = -np.inf  # a row of length 0 (n = 0) keeps nothing and settles
  n_empty = n.copy()
  n_empty[0, 0] = 0
  assert bool(search(empty, n_empty)[1])
  masked = scores.copy()
  masked[..., 100:] = -np.inf  # the 200th best is -inf: declined
  assert not bool(search(masked, np.full((4, 6), 200, np.int32))[1])


def test_count_threshold_pads_rows_to_whole_count_blocks():
  # 20000 positions: the last block of 256 is padded with -inf, never counted
  rng = np.random.default_rng(9)
  T = 20000
  scores = rng.standard_normal((2, T)).astype(np.float32)
  budget = np.array([1, 2000], np.int32)
  keep = jax.jit(lambda s, b: select.top_mask(s, b, capacity=2048))
  np.testing.assert_array_equal(np.asarray(keep(scores, budget)), reference_mask(scores, budget))
  assert bool(jax.jit(select.count_threshold)(scores, budget)[1])


@pytest.mark.parametrize("shared", [True, False])
def test_count_threshold_under_vmap(shared):
  """Budgets vmapped over shared scores take one ordered top-k (its batching rule); vmapped
  scores run the count threshold on every row. Both equal the reference."""
  rng = np.random.default_rng(11)
  K, T, C = 3, 4096, 256
  scores = rng.standard_normal((K, 2, 4, T)).astype(np.float32)
  budgets = rng.integers(0, C + 1, size=(K, 2, 4)).astype(np.int32)
  one = lambda s, b: select.top_mask(s, b, capacity=C)  # noqa: E731
  if shared:
    keep = jax.jit(jax.vmap(one, in_axes=(None, 0)))(scores[0], budgets)
    expected = [reference_mask(scores[0], budgets[k]) for k in range(K)]
  else:
    keep = jax.jit(jax.vmap(one))(scores, budgets)
    expected = [reference_mask(scores[k], budgets[k]) for k in range(K)]
  np.testing.assert_array_equal(np.asarray(keep), np.stack(expected))


@pytest.mark.parametrize("kind", ["normal", "heavy_tail", "ties"])
def test_count_threshold_finishes_the_last_rows_alone(kind):
  # more than 2 * TAIL_ROWS rows: the last unsettled rows are gathered and bisected alone
  rng = np.random.default_rng(21)
  T = select.COUNT_THRESHOLD_MIN_POSITIONS + 5
  rows = 3 * select.TAIL_ROWS
  scores = threshold_case(rng, kind, (rows, T))
  budget = rng.integers(0, T // 8 + 1, size=rows).astype(np.int32)
  length = rng.integers(T // 8, T + 1, size=rows).astype(np.int32)
  keep = jax.jit(lambda s, b, n: select.top_mask(s, b, length=n, capacity=T // 8))
  np.testing.assert_array_equal(
    np.asarray(keep(scores, budget, length)), reference_mask(scores, budget, length)
  )
  masked = np.where(np.arange(T) < length[..., None], scores, -np.inf).astype(np.float32)
  n = np.minimum(budget, length)
  assert bool(jax.jit(select.count_threshold)(masked, n)[1]) == settles(masked, n)
  assert settles(masked, n) == (kind != "ties")


def test_order_keys_order_as_sortable_int32():
  rng = np.random.default_rng(3)
  tiny = np.float32(1e-45)
  x = np.concatenate(
    [
      rng.standard_normal(500).astype(np.float32),
      np.array([0.0, -0.0, np.inf, -np.inf, tiny, -tiny, 3 * tiny, -3 * tiny], np.float32),
      np.float32(3.4e38) * np.array([1, -1], np.float32),
    ]
  )
  u = np.asarray(select.order_keys(jnp.asarray(x))).astype(np.int64)
  k = np.asarray(select.sortable_int32(jnp.asarray(x))).astype(np.int64)
  # the same ranks, ties included (the two zeros share one key in both)
  np.testing.assert_array_equal(
    np.unique(u, return_inverse=True)[1], np.unique(k, return_inverse=True)[1]
  )
  assert u[500] == u[501]


def test_count_threshold_rejects_bad_counts_and_scores():
  scores = np.zeros((2, 1100), np.float32)
  with pytest.raises(ValueError, match="n: 1101 exceeds T=1100"):
    select.count_threshold(scores, np.array([1, 1101]))
  with pytest.raises(ValueError, match="n: expected non-negative counts, got minimum -1"):
    select.count_threshold(scores, np.array([1, -1]))
  with pytest.raises(ValueError, match="n: shape"):
    select.count_threshold(scores, np.ones((3,), np.int32))
  with pytest.raises(ValueError, match="NaN"):
    select.count_threshold(np.full((2, 1100), np.nan, np.float32), np.array([1, 1]))


def test_float64_scores_are_selected_in_their_own_order():
  # beyond float32's range: a cast would make all three +inf (the keep-always marker) and keep
  # position 1; closer than float32's precision: a cast would tie them and keep position 0
  huge = np.array([[0.0, 1e39, 3e39, 2e39]])
  close = np.array([[1.0, 1.0 + 1e-12, 1.0 + 2e-12, 0.5]])
  for scores in (huge, close):
    want = reference_mask(scores, [1])
    np.testing.assert_array_equal(select.top_mask(scores, 1), want)
    np.testing.assert_array_equal(select.checked_top_mask(scores, 1)[1], want)
    idx, valid = select.compact(scores, 1, 2)
    assert np.asarray(idx)[0, 0] == 2 and np.asarray(valid).tolist() == [[True, False]]
    np.testing.assert_array_equal(select.ranks(scores), reference_order(scores).argsort(-1))
    # a pooled layer ranks its heads together
    pooled = select.top_mask_pooled(scores.reshape(1, 2, 2), 1)
    np.testing.assert_array_equal(np.asarray(pooled).reshape(1, 4), want)
  # the sentinels, ties and signed zeros of float64 scores survive
  mixed = np.array([[-np.inf, 1e39, np.inf, -0.0, 0.0, 1e39, -1e-300]])
  for b in range(8):
    np.testing.assert_array_equal(select.top_mask(mixed, b), reference_mask(mixed, [b]))
  # under x64, traced float64 scores keep their order too
  with jax.enable_x64(True):
    keep = jax.jit(lambda s, b: select.top_mask(s, b))(jnp.asarray(close), jnp.int32(2))
    np.testing.assert_array_equal(keep, reference_mask(close, [2]))


def test_keep_mask_under_jit_keeps_capacity_for_a_traced_budget_above_it_as_documented():
  # concrete budgets are checked; traced ones cannot be, and the docstring says what the
  # unchecked path does and which variant reports it
  scores = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16)), jnp.float32)
  with pytest.raises(ValueError, match="budget: 9 exceeds capacity=4"):
    select.top_mask(scores, 9, capacity=4)
  keep = jax.jit(lambda s, b: select.top_mask(s, b, capacity=4))(scores, jnp.int32(9))
  assert np.asarray(keep).sum(-1).tolist() == [4, 4]
  doc = " ".join(select.top_mask.__doc__.split())
  assert "a budget in ``(capacity, length)`` keeps ``capacity`` entries" in doc
  assert ":func:`checked_top_mask`" in doc
  err, _ = jax.jit(lambda s, b: select.checked_top_mask(s, b, capacity=4))(scores, jnp.int32(9))
  with pytest.raises(ValueError, match="budget: 9 exceeds capacity=4"):
    err.throw()
