"""Property and fuzz tests of select, budgets and policies on hostile input.

Random shapes, score dtypes (float16, bfloat16, float32) and budget dtypes (int8 .. uint64,
Python ints, jax arrays); budgets at and around 0, the window, the capacity, ``T`` and ``2**31``;
NaN, inf and signed zeros in the scores. Every outcome is either exact (the kept count is
``min(budget, length)``, ties go to the lower position, ``-0.0 == +0.0``, protection is honoured)
or a ``ValueError`` naming its argument: never another exception, never a wrong count.

Deterministic by default (``derandomize``); ``KVJAX_FUZZ=N`` explores with random seeds and
``N`` times the examples.
"""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import budgets, policies, scores, select

SCALE = int(os.environ.get("KVJAX_FUZZ", "0"))
LIMIT = 2**31


def fuzz(n: int):
  return settings(
    max_examples=n * max(SCALE, 1),
    deadline=None,
    database=None,
    derandomize=SCALE == 0,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  )


SCORE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45, 3e-39, 65504.0, 1e30])


def expect_value_error(call, *names):
  """``call()`` must raise ``ValueError`` whose message starts with one of ``names``."""
  with pytest.raises(ValueError) as info:
    call()
  assert str(info.value).split(":")[0] in names, str(info.value)


# --------------------------------------------------------------------------- strategies


@st.composite
def score_arrays(draw, shape):
  """``(scores in their dtype, the same values as float64)``: normal, tied, special or tiny
  values, with an occasional NaN."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  style = draw(st.sampled_from(["normal", "ties", "specials", "tiny"]))
  if style == "normal":
    x = rng.normal(size=shape)
  elif style == "ties":
    x = rng.integers(-1, 3, size=shape).astype(np.float64)
  elif style == "specials":
    x = rng.choice(SPECIALS, size=shape) * rng.choice([1.0, -1.0], size=shape)
  else:
    x = rng.choice([0.0, -0.0, 1e-45, -1e-45, 1e-40, 5e-8], size=shape)
  if draw(st.integers(0, 7)) == 0 and x.size:
    x.flat[int(rng.integers(x.size))] = np.nan
  dtype = draw(st.sampled_from(SCORE_DTYPES))
  with np.errstate(over="ignore"):  # 1e30 is inf in float16, on purpose
    scores = jnp.asarray(x.astype(np.float32), dtype)
  return scores, np.asarray(scores.astype(jnp.float32), np.float64)


def _counts_arg(values: list[int], shape: tuple[int, ...], kind):
  """``values`` (Python ints) as the argument form ``kind``: a Python int or list, a numpy
  array of an integer dtype (when every value fits it), or an int32 jax array."""
  scalar = len(values) == 1
  if kind == "python":
    return values[0] if scalar else np.asarray(values, dtype=object).reshape(shape).tolist()
  if kind == "jax":
    if all(-LIMIT <= v < LIMIT for v in values):
      arr = jnp.asarray(values, jnp.int32)
      return arr[0] if scalar else arr.reshape(shape)
    return values[0] if scalar else values
  info = np.iinfo(kind)
  if not all(info.min <= v <= info.max for v in values):
    return values[0] if scalar else np.asarray(values, dtype=object).reshape(shape).tolist()
  arr = np.asarray(values, kind)
  return arr[0] if scalar else arr.reshape(shape)


@st.composite
def counts(draw, shape: tuple[int, ...], special: list[int], high: int):
  """``(argument, Python-int array broadcast to shape)``: one count or one per row, at the
  ``special`` values or in ``[0, high]``, in a random integer form."""
  per_row = bool(shape) and draw(st.booleans())
  n = math.prod(shape) if per_row else 1
  value = st.one_of(st.sampled_from(special), st.integers(0, high))
  values = draw(st.lists(value, min_size=n, max_size=n))
  kind = draw(st.sampled_from(("python", "jax", *INT_DTYPES)))
  ints = np.asarray(values, dtype=object).reshape(shape if per_row else ())
  return _counts_arg(values, shape if per_row else (), kind), np.broadcast_to(ints, shape)


def boundary(*points: int) -> list[int]:
  """The points and their neighbours, plus int32's edges and beyond."""
  near = {p + d for p in points for d in (-1, 0, 1)}
  return sorted(near | {0, 1, LIMIT - 1, LIMIT, 2**32 + 12, 2**40, -1, -(2**31), -(2**40)})


# --------------------------------------------------------------------------- the reference


def reference_mask(scores64, budget, length):
  """Stable descending order (``-0.0 == +0.0``), first ``min(budget, length)`` of each row."""
  T = scores64.shape[-1]
  flat = np.where(scores64 == 0, 0.0, scores64).reshape(-1, T)
  b = np.asarray(budget, dtype=object).reshape(-1)
  n = np.asarray(length, dtype=object).reshape(-1)
  keep = np.zeros(flat.shape, bool)
  for r in range(flat.shape[0]):
    order = np.argsort(-flat[r, : int(n[r])], kind="stable")
    keep[r, order[: min(int(b[r]), int(n[r]))]] = True
  return keep.reshape(scores64.shape)


def selection_error(scores64, budget, length, capacity, *, slots: bool) -> bool:
  """Whether ``keep_mask`` (or ``compact`` when ``slots``) must refuse this input."""
  T = scores64.shape[-1]
  if np.isnan(scores64).any():
    return True
  if any(not 0 <= int(v) < LIMIT for v in np.ravel(budget)):
    return True
  if any(not 0 <= int(v) <= T for v in np.ravel(length)):
    return True
  if isinstance(capacity, bool) or not 1 <= capacity < LIMIT:
    return True
  b = np.asarray(budget, np.int64)
  n = np.asarray(length, np.int64)
  if slots:
    return bool((np.minimum(b, n) > capacity).any())
  return capacity < T and bool(((b > capacity) & (b < n)).any())


SHAPES = st.tuples(st.sampled_from([(), (3,), (2, 2)]), st.sampled_from([1, 2, 5, 16, 300]))


@st.composite
def selection_case(draw, *, slots: bool):
  batch, T = draw(SHAPES)
  scores, scores64 = draw(score_arrays(batch + (T,)))
  if slots:
    capacity = draw(st.one_of(st.integers(1, T + 3), st.sampled_from([0, -1, True])))
  else:
    capacity = draw(
      st.one_of(st.none(), st.integers(1, T + 3), st.sampled_from([0, True, LIMIT - 1, LIMIT]))
    )
  cap = T if capacity is None else capacity
  budget = draw(counts(batch, boundary(0, T, cap if isinstance(cap, int) else 1), T + 3))
  length = None
  if draw(st.booleans()):
    length = draw(counts(batch, [0, 1, T - 1, T, T + 1, -1, LIMIT], T))
  return scores, scores64, budget, length, capacity


# --------------------------------------------------------------------------- select


@fuzz(150)
@given(selection_case(slots=False))
def test_keep_mask_is_exact_or_a_value_error(case):
  scores, scores64, (budget, budget_ints), length, capacity = case
  T = scores.shape[-1]
  length_arg, length_ints = length or (None, np.full(scores.shape[:-1], T, dtype=object))
  call = functools.partial(select.top_mask, scores, budget, length=length_arg, capacity=capacity)
  cap = T if capacity is None else capacity
  if selection_error(scores64, budget_ints, length_ints, cap, slots=False):
    expect_value_error(call, "scores", "budget", "length", "capacity")
    return
  keep = np.asarray(call())
  np.testing.assert_array_equal(keep, reference_mask(scores64, budget_ints, length_ints))
  want = np.minimum(budget_ints.astype(np.int64), length_ints.astype(np.int64))
  np.testing.assert_array_equal(keep.sum(-1), want)


@fuzz(100)
@given(selection_case(slots=True))
def test_compact_is_exact_or_a_value_error(case):
  scores, scores64, (budget, budget_ints), length, capacity = case
  T = scores.shape[-1]
  length_arg, length_ints = length or (None, np.full(scores.shape[:-1], T, dtype=object))
  call = functools.partial(select.compact, scores, budget, capacity, length=length_arg)
  if selection_error(scores64, budget_ints, length_ints, capacity, slots=True):
    expect_value_error(call, "scores", "budget", "length", "capacity")
    return
  idx, valid = (np.asarray(x) for x in call())
  assert idx.shape == scores.shape[:-1] + (capacity,) and idx.dtype == np.int32
  keep = reference_mask(scores64, budget_ints, length_ints)
  for r in np.ndindex(keep.shape[:-1]):
    kept = np.flatnonzero(keep[r])
    assert valid[r].sum() == len(kept) and valid[r][: len(kept)].all()
    np.testing.assert_array_equal(idx[r][: len(kept)], kept)  # ascending, valid slots first
    assert (idx[r][len(kept) :] == 0).all()


@pytest.fixture(scope="module")
def checked():
  fns = {}

  def get(capacity, slots):
    if (capacity, slots) not in fns:

      def fn(s, b, n):
        if slots:
          return select.checked_compact(s, b, capacity, length=n)
        return select.checked_top_mask(s, b, length=n, capacity=capacity)

      fns[capacity, slots] = jax.jit(fn)
    return fns[capacity, slots]

  return get


@fuzz(80)
@given(
  st.integers(0, 2**32 - 1),
  st.sampled_from([3, 16, 20]),
  st.booleans(),
  st.booleans(),
  st.lists(
    st.sampled_from([-(2**31), -5, -1, 0, 1, 3, 4, 5, 15, 16, 17, 2**31 - 1]),
    min_size=3,
    max_size=3,
  ),
  st.lists(st.sampled_from([-1, 0, 1, 4, 15, 16, 17]), min_size=3, max_size=3),
)
def test_checked_selection_reports_bad_data_under_jit(checked, seed, capacity, slots, nan, b, n):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 4, size=(3, 16)).astype(np.float32) * rng.choice([1.0, -1.0], (3, 16))
  if nan:
    x[rng.integers(3), rng.integers(16)] = np.nan
  err, out = checked(capacity, slots)(jnp.asarray(x), jnp.asarray(b, jnp.int32), jnp.asarray(n))
  b64, n64 = np.asarray(b, np.int64), np.asarray(n, np.int64)
  bad = nan or (b64 < 0).any() or ((n64 < 0) | (n64 > 16)).any()
  if slots:
    bad = bad or (np.minimum(b64, n64) > capacity).any()
  else:
    bad = bad or (capacity < 16 and ((b64 > capacity) & (b64 < n64)).any())
  message = err.get()
  assert (message is not None) == bool(bad), (message, b, n, capacity, nan)
  if message is not None:
    assert message.split(":")[0] in ("scores", "budget", "length", "capacity"), message
    with pytest.raises(ValueError):  # checkify's JaxRuntimeError is a ValueError
      err.throw()
    return
  keep = reference_mask(x.astype(np.float64), b64, n64)
  if slots:
    idx, valid = (np.asarray(v) for v in out)
    np.testing.assert_array_equal(valid.sum(-1), keep.sum(-1))
    for r in range(3):
      np.testing.assert_array_equal(idx[r][valid[r]], np.flatnonzero(keep[r]))
  else:
    np.testing.assert_array_equal(np.asarray(out), keep)


# --------------------------------------------------------------------------- budgets


def ref_pyramid_legacy(num_layers, budget, window, q_len, beta=20):
  """KVCache-Factory ``PyramidKVCluster.update_kv`` in Python ints (per layer, window in)."""
  min_num = (budget - window) // beta
  max_num = (budget - window) * 2 - min_num
  if max_num >= q_len - window:
    max_num = q_len - window
    min_num = (budget - window) * 2 - max_num
  steps = (max_num - min_num) // (num_layers - 1)
  if q_len < budget:
    return [q_len] * num_layers
  if q_len < (budget - window) * 2:
    return [budget] * num_layers
  return [max_num - layer * steps + window for layer in range(num_layers)]


@fuzz(150)
@given(
  st.sampled_from([1, 2, 3, 5]),
  st.sampled_from(budgets.PYRAMID_MODES),
  st.sampled_from([0, 1, 4, 8, -1, LIMIT]),
  st.sampled_from([0, 1, 9, 100, 4096, 2**30, LIMIT - 1, LIMIT]),
  st.sampled_from([20, 1, 1.5, 0.5, float("nan"), float("inf")]),
  st.data(),
)
def test_pyramid_is_exact_or_a_value_error(num_layers, mode, window, q_len, beta, data):
  budget, b = data.draw(counts((), boundary(window, q_len, 2 * window, 2**30), 4096))
  b = int(b)
  call = functools.partial(budgets.pyramid, num_layers, budget, window, q_len, beta=beta, mode=mode)
  must_fail = (
    not 0 <= b < LIMIT
    or not 0 <= window < LIMIT
    or not 0 <= q_len < LIMIT
    or b < window
    or not (math.isfinite(beta) and beta >= 1)
    or (num_layers < 2 and mode != "exact_total")
  )
  names = ("budget", "window", "q_len", "beta", "num_layers")
  if must_fail:
    expect_value_error(call, *names)
    return
  try:
    got = np.asarray(call())
  except ValueError as e:  # refusals beyond the obvious ones: empty rows, int32 arithmetic
    assert str(e).split(":")[0] in names, str(e)
    return
  assert got.shape == (num_layers,) and got.dtype == np.int32
  if q_len > 0:
    assert (got >= 1).all(), got
  if mode == "legacy_floor" and beta == int(beta):
    assert got.tolist() == ref_pyramid_legacy(num_layers, b, window, q_len, int(beta))
  if mode == "exact_total":
    if q_len < b:
      assert (got == q_len).all()
    else:
      assert int(got.astype(np.int64).sum()) == num_layers * b
      assert (got >= window).all() and (got <= q_len).all()


@fuzz(60)
@given(
  st.integers(0, 2**32 - 1),
  st.sampled_from(budgets.ADAKV_MODES),
  st.sampled_from([0, 1, 4, 12, -1, 13, True]),
  st.sampled_from([0.0, 0.2, 1.0, 1.5, -0.1, float("nan")]),
  st.booleans(),
  st.data(),
)
def test_adakv_is_exact_or_a_value_error(seed, mode, window, alpha, normalize, data):
  L, H, T = 2, 3, 12
  scores = jnp.asarray(np.random.default_rng(seed).random((L, H, T)), jnp.float32)
  budget, b = data.draw(counts((), boundary(window, T, H * T, LIMIT // H), 64))
  b = int(b)
  call = functools.partial(
    budgets.adakv, scores, budget, window, floor_alpha=alpha, normalize=normalize, mode=mode
  )
  names = ("budget", "window", "floor_alpha", "capacity")
  if (
    isinstance(window, bool)
    or not 0 <= window <= T
    or not 0 <= b < LIMIT
    or b < window
    or not 0 <= alpha <= 1
  ):
    expect_value_error(call, *names)
    return
  try:
    got = np.asarray(call())
  except ValueError as e:  # an allocation that leaves a head empty
    assert "leaves a row with no cache" in str(e), str(e)
    return
  assert got.shape == (L, H) and got.dtype == np.int32
  if mode == "kvpress":
    assert int(got.sum()) == L * min(H * b, H * T)
    # what the policy then keeps: exactly its counts, per head
    keep = np.asarray(select.top_mask(scores, got))
    np.testing.assert_array_equal(keep.sum(-1), np.minimum(got, T))
  elif b > T:
    assert (got == T).all()  # no compression
  else:
    assert (got >= window).all()


@fuzz(60)
@given(
  st.sampled_from(["random", "zeros", "nan", "negative", "one"]),
  st.sampled_from(budgets.HEADKV_MODES),
  st.sampled_from([0, 2, 8, -1]),
  st.sampled_from([1.5, 1.01, 1.0, 0.5, float("nan")]),
  st.sampled_from([None, 16, 2**31 - 1]),
  st.data(),
)
def test_headkv_is_exact_or_a_value_error(kind, mode, window, beta, q_len, data):
  rng = np.random.default_rng(0)
  head_scores = {
    "random": rng.random((2, 3)) + 0.01,
    "zeros": np.zeros((2, 3)),
    "nan": np.full((2, 3), np.nan),
    "negative": -np.ones((2, 3)),
    "one": np.eye(2, 3),
  }[kind]
  budget, b = data.draw(counts((), boundary(window, 16, LIMIT // 6), 64))
  b = int(b)
  call = functools.partial(
    budgets.headkv, head_scores, budget, window, beta=beta, mode=mode, q_len=q_len
  )
  if (
    kind in ("zeros", "nan", "negative")
    or not beta > 1
    or window < 0
    or not 0 <= b < LIMIT
    or b < window
  ):
    expect_value_error(call, "head_scores", "beta", "budget", "window")
    return
  try:
    got = np.asarray(call())
  except ValueError as e:  # an allocation past int32
    assert str(e).startswith("budget:"), str(e)
    return
  assert got.shape == (2, 3) and got.dtype == np.int32
  if q_len is not None and b > q_len:
    assert (got == q_len).all()
  else:
    assert (got >= window).all()


@fuzz(40)
@given(
  st.integers(0, 2**32 - 1),
  st.sampled_from(["finite", "nan", "inf"]),
  st.sampled_from([2, 4, 1, 5]),
  st.sampled_from([(1.0, 1.0), (1.6, 0.4), (0.0, 1.0), (float("nan"), 1.0)]),
  st.data(),
)
def test_cake_is_exact_or_a_value_error(seed, kind, window, taus, data):
  L, H, W, T = 3, 2, 4, 24
  rng = np.random.default_rng(seed)
  attn = rng.random((L, H, W, T))
  attn /= attn.sum(-1, keepdims=True)
  if kind != "finite":
    attn[rng.integers(L), 0, 0, rng.integers(T)] = np.nan if kind == "nan" else np.inf
  budget, b = data.draw(counts((), boundary(window, T, LIMIT // L), 64))
  b = int(b)
  call = functools.partial(budgets.cake, jnp.asarray(attn, jnp.float32), budget, window, *taus)
  if (
    kind != "finite"
    or not 2 <= window <= W
    or not 0 <= b < LIMIT
    or b < window
    or not all(t > 0 for t in taus)
  ):
    expect_value_error(call, "attn", "window", "budget", "tau1", "tau2")
    return
  try:
    got = np.asarray(call())
  except ValueError as e:
    assert "leaves a row with no cache" in str(e), str(e)
    return
  assert got.shape == (L,) and got.dtype == np.int32
  if b + window >= T:
    assert (got == T).all()
  else:
    assert int(got.sum()) == L * b and (got >= window).all() and (got <= T).all()


# --------------------------------------------------------------------------- policies

PL, PHQ, PG, PT, PD, PW = 2, 2, 1, 24, 4, 4


@pytest.fixture(scope="module")
def evidence():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(PL, PHQ, PT, PD)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(PL, PG, PT, PD)), jnp.float32)
  ev = policies.evidence_from_qk(q, k, window=PW, rng=jax.random.key(1))
  future = jax.nn.softmax(jnp.asarray(rng.normal(size=(PL, PHQ, 3, PT)), jnp.float32), -1)
  mean, cov = scores.expected_query_stats(
    q, scores.average_rope(1e4 ** -(np.arange(PD // 2) / (PD // 2)), PT)
  )
  return ev.replace(
    future_attn_LHST=future,
    head_scores_LH=jnp.asarray(rng.random((PL, PHQ)) + 0.1, jnp.float32),
    values_LGTD=jnp.asarray(rng.normal(size=k.shape), jnp.float32),
    value_out_norms_LHT=jnp.asarray(rng.random((PL, PHQ, PT)) + 0.5, jnp.float32),
    query_mean_LHD=mean,
    query_cov_LHDD=cov,
    window_queries_LHWD=q[:, :, -8:],
    queries_LHTD=q,
    prerope_keys_LGTD=jnp.asarray(rng.normal(size=k.shape), jnp.float32),
    qfilters_LGD=jnp.asarray(rng.normal(size=(PL, PG, PD)), jnp.float32),
    retrieval_heads_LG=jnp.asarray(rng.random((PL, PG)), jnp.float32),
    reconstruction_attn_LGT=jnp.asarray(rng.random((PL, PG, PT)), jnp.float32),
    reconstruction_attn_LHT=jnp.asarray(rng.random((PL, PHQ, PT)), jnp.float32),
    kvgrad_LGT=jnp.asarray(rng.random((PL, PG, PT)), jnp.float32),
    kvzap_LGT=jnp.asarray(rng.normal(size=(PL, PG, PT)), jnp.float32),
    fastkvzip_LGT=jnp.asarray(rng.random((PL, PG, PT)), jnp.float32),
  )


@fuzz(120)
@given(st.sampled_from(policies.names()), st.data())
def test_policy_keeps_its_count_and_protection_or_a_value_error(evidence, name, data):
  # LU-KV cannot run without its budget curve: each head prunes the curve row's ratio
  curve = np.broadcast_to(np.arange(1, 100)[:, None, None] / 100, (99, PL, PG))
  policy = policies.make(name, **({"curve": curve} if name == "lukv" else {}))
  budget, b = data.draw(counts((PL,), boundary(PW, PT, 2**30), PT + 4))
  b = b.astype(np.int64) if all(-(2**63) <= int(v) < 2**63 for v in b) else b
  call = functools.partial(policy.keep_mask, evidence, budget)
  # allocators take one per-head budget (Ada-KV also one per layer); the rest take any table
  per_layer_ok = not policy.allocates or policy.allocator.max_budget_ndim >= 1
  window = policy.protected_window(evidence)  # R-KV protects its own window of 8
  if (
    any(not 1 <= int(v) < LIMIT for v in b)
    or (policy.windowed and min(b) < window + 1)
    or (np.ndim(budget) > 0 and not per_layer_ok)
    # SimLayerKV's one budget is a lazy layer's count: its sinks and at least one recent token
    or (name == "simlayerkv" and (np.ndim(budget) > 0 or min(b) < policy.min_budget(window)))
    or (policy.allocator.keeps_all and min(b) < PT)  # ThinK keeps every token
  ):
    expect_value_error(call, "budget")
    return
  keep = np.asarray(call())
  scores = policy.scores(evidence)
  budget_LH = np.asarray(policy.budgets(evidence, scores, budget))
  np.testing.assert_array_equal(keep.sum(-1), np.minimum(budget_LH, PT))
  b_L1 = np.asarray(b, np.int64)[:, None]
  if not policy.allocates:
    np.testing.assert_array_equal(budget_LH, np.broadcast_to(b_L1, budget_LH.shape))
  if policy.windowed:
    assert keep[..., PT - window :].all()  # the observation window
  if name == "streaming_llm":
    for layer in range(PL):
      assert keep[layer, :, : min(4, int(b[layer]))].all()  # the sinks
  if min(b) >= PT and name != "headkv":  # the no-compression guard
    assert keep.all()


@fuzz(60)
@given(
  st.sampled_from(
    [
      ("streaming_llm", "sinks", [4, 0, -2, 2.5, np.int64(3), np.int64(-1), LIMIT, True]),
      ("snapkv", "window", [None, 1, 4, 0, -1, 2.0, LIMIT, True]),
      ("snapkv", "kernel", [1, 7, 4, 0, -3, 7.0, LIMIT + 1, True]),
      ("h2o", "recent", [8, 0, -1, 1.5, LIMIT]),
      ("adakv_snapkv", "floor_alpha", [0.0, 0.2, 1, 1.5, -0.1, float("nan")]),
      ("pyramidkv", "beta", [20, 1, 0.5, 0, float("inf")]),
      ("headkv", "beta", [1.5, 1.01, 1, 0.5, float("nan")]),
      ("headkv", "temp", [1.0, 0.5, 0, -1, float("inf")]),
      ("cake", "gamma", [200.0, 0.0, -1.0, float("nan")]),
      ("cake", "tau1", [1.0, 0.4, 0.0, -1.0, float("inf")]),
      ("cake", "tau2", [1.0, 0.0]),
      ("adakv_snapkv", "normalize", [True, False, 1, "yes"]),
      ("snapkv", "num_kv_heads", [None, 1, 0, 1.0, True]),
    ]
  ),
  st.data(),
)
def test_policy_options_are_validated_at_make(case, data):
  name, option, values = case
  value = data.draw(st.sampled_from(values))
  ok = {
    "sinks": lambda v: not isinstance(v, bool | float) and 0 <= v < LIMIT,
    "window": lambda v: v is None or (type(v) is int and 1 <= v < LIMIT),
    "kernel": lambda v: type(v) is int and 1 <= v < LIMIT and v % 2 == 1,
    "recent": lambda v: not isinstance(v, bool | float) and 0 <= v < LIMIT,
    "floor_alpha": lambda v: 0 <= v <= 1,
    "beta": lambda v: math.isfinite(v) and (v > 1 if name == "headkv" else v >= 1),
    "temp": lambda v: math.isfinite(v) and v > 0,
    "gamma": lambda v: math.isfinite(v) and v >= 0,
    "tau1": lambda v: math.isfinite(v) and v > 0,
    "tau2": lambda v: math.isfinite(v) and v > 0,
    "normalize": lambda v: isinstance(v, bool),
    "num_kv_heads": lambda v: v is None or (type(v) is int and v >= 1),
  }[option](value)
  call = functools.partial(policies.make, name, **{option: value})
  if ok:
    call()
  else:
    expect_value_error(call, option)


def test_traced_sinks_still_make_a_policy():
  @jax.jit
  def scores(sinks):
    ev = policies.Evidence(keys_LGTD=jnp.zeros((1, 1, 8, 2)))
    return policies.make("streaming_llm", sinks=sinks).scores(ev)

  out = np.asarray(scores(jnp.int32(3)))
  assert np.isinf(out[..., :3]).all() and np.isfinite(out[..., 3:]).all()
