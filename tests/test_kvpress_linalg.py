"""Golden and property tests of LeverageScore, NonCausalAttention, Compactor and CurDKV.

The fixture ``tests/fixtures/kvpress_0_5_5_linalg.npz`` comes from
``tests/make_kvpress_fixtures_linalg.py`` (kvpress 0.5.5 on the tiny random Llama
``tests/fixtures/kvpress_tiny_llama``): the inputs each press saw, its scores, the positions it
kept at compression_ratio 0.5, and its ``torch.randn`` draws, which kvjax reads as
``evidence.sketch_LGDK``.
"""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.model as km
from kvjax import policies
from kvjax.policies.compactor import Compactor
from kvjax.policies.curkv import CurDKV
from kvjax.policies.leverage import LeverageScore, cholesky_with_jitter
from kvjax.policies.noncausal import NonCausalAttention

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "kvpress_0_5_5_linalg.npz"

# fixture name -> (kvjax policy, protected first and last positions kvpress marks by value)
CASES = {
  "leverage": (LeverageScore(), 0, 0),
  "leverage_k8": (LeverageScore(sketch_dimension=8), 0, 0),
  "noncausal": (NonCausalAttention(), 0, 0),
  "noncausal_c16": (NonCausalAttention(chunk_size=16), 0, 0),
  "noncausal_c20": (NonCausalAttention(chunk_size=20), 0, 0),
  "compactor": (Compactor(), 8, 4),
  "compactor_c16_b03": (Compactor(chunk_size=16, blending=0.3), 8, 4),
  "cur": (CurDKV(), 4, 0),
  "cur_key": (CurDKV(leverage_type="key"), 4, 0),
  "cur_value": (CurDKV(leverage_type="value"), 4, 0),
  "cur_kv_avg": (CurDKV(leverage_type="kv_avg"), 4, 0),
  "cur_global": (CurDKV(use_local_approximation=False), 4, 0),
  "cur_w10": (CurDKV(local_window=10, sinks=2), 2, 0),
  "cur_random": (CurDKV(random_projection=True), 4, 0),
}


@pytest.fixture(scope="module")
def fx():
  data = np.load(FIXTURE)
  out = {k: data[k] for k in data.files}
  out["meta"] = json.loads(str(out.pop("meta_json")))
  return out


def evidence_of(fx, name=None) -> policies.Evidence:
  sketch = fx.get(f"{name}_sketch_LGDK")
  return policies.Evidence(
    prerope_keys_LGTD=jnp.asarray(fx["prerope_keys_LGTD"]),
    queries_LHTD=jnp.asarray(fx["queries_LHTD"]),
    keys_LGTD=jnp.asarray(fx["keys_LGTD"]),
    values_LGTD=jnp.asarray(fx["values_LGTD"]),
    sketch_LGDK=None if sketch is None else jnp.asarray(sketch),
  )


def test_fixture_records_every_case(fx):
  assert set(fx["meta"]["presses"]) == set(CASES)
  assert fx["meta"]["n_kept"] == fx["keys_LGTD"].shape[2] // 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_scores_and_kept_set_match_kvpress(fx, name):
  policy, first, last = CASES[name]
  ev = evidence_of(fx, name)
  ours = np.asarray(policy.scores(ev))
  ref = fx[f"{name}_scores_LGT"]
  T = ref.shape[-1]
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  middle = slice(first, T - last)
  np.testing.assert_allclose(ours[..., middle], ref[..., middle], rtol=1e-5, atol=1e-5)
  assert np.isinf(ours[..., :first]).all() and np.isinf(ours[..., T - last :]).all()
  keep = np.asarray(policy.keep_mask(ev, fx["meta"]["n_kept"]))
  np.testing.assert_array_equal(keep, fx[f"{name}_keep_LGT"])


def test_prefill_computes_prerope_keys_and_queries(fx):
  """kvjax's own prefill of the fixture's checkpoint gives the inputs kvpress's presses saw."""
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  request = Compactor().evidence_request(fx["keys_LGTD"].shape[2])
  assert request.prerope_keys and request.queries
  ids = jnp.asarray(fx["input_ids_T"][None].astype(np.int32))
  pre = km.prefill(cfg, model.params(), ids, request=request)
  np.testing.assert_allclose(np.asarray(pre.prerope_keys[:, 0]), fx["prerope_keys_LGTD"], atol=1e-5)
  np.testing.assert_allclose(np.asarray(pre.queries[:, 0]), fx["queries_LHTD"], atol=1e-5)
  np.testing.assert_allclose(np.asarray(pre.keys[:, 0]), fx["keys_LGTD"], atol=1e-5)
  chunked = km.prefill(
    cfg, model.params(), ids, request=request, plan=km.llama.PrefillPlan(chunk=20, block=16)
  )
  for got, want in ((chunked.prerope_keys, pre.prerope_keys), (chunked.queries, pre.queries)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  none = km.prefill(cfg, model.params(), ids)
  assert none.prerope_keys is None and none.queries is None


def test_requests():
  assert LeverageScore().evidence_request(48).prerope_keys
  assert not LeverageScore().evidence_request(48).queries
  assert NonCausalAttention().evidence_request(48).queries
  assert not CurDKV().evidence_request(48).prerope_keys
  merged = LeverageScore().evidence_request(48) | NonCausalAttention().evidence_request(48)
  assert merged.prerope_keys and merged.queries


# --------------------------------------------------------------------------- properties

ALL = [
  LeverageScore(),
  NonCausalAttention(chunk_size=16),
  Compactor(chunk_size=16),
  CurDKV(),
  CurDKV(random_projection=True),
]


def random_evidence(seed=0, L=2, Hq=4, G=2, T=40, D=8, K=None) -> policies.Evidence:
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return policies.Evidence(
    prerope_keys_LGTD=f(L, G, T, D),
    queries_LHTD=f(L, Hq, T, D),
    keys_LGTD=f(L, G, T, D),
    values_LGTD=f(L, G, T, D),
    sketch_LGDK=None if K is None else f(L, G, D, K),
  )


@pytest.mark.parametrize("policy", ALL, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("budget", [1, 7, 20, 40, 100])
def test_exactly_min_budget_kept(policy, budget):
  ev = random_evidence()
  keep = np.asarray(policy.keep_mask(ev, budget))
  assert keep.shape == (2, 2, 40)
  assert (keep.sum(-1) == min(budget, 40)).all()


@pytest.mark.parametrize("policy", ALL, ids=lambda p: type(p).__name__)
def test_per_head_budgets(policy):
  ev = random_evidence(1)
  budget_LH = np.array([[3, 17], [40, 9]], np.int32)
  keep = np.asarray(policy.keep_mask(ev, budget_LH))
  np.testing.assert_array_equal(keep.sum(-1), budget_LH)
  s = np.asarray(policy.scores(ev))
  for l, h in np.ndindex(2, 2):  # the kept positions are the best-scored ones
    assert s[l, h][keep[l, h]].min() >= s[l, h][~keep[l, h]].max(initial=-np.inf)


@pytest.mark.parametrize("policy", ALL, ids=lambda p: type(p).__name__)
def test_budgets_traced_without_retrace(policy):
  ev = random_evidence(2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def kept(budget_LH):
    return policy.keep_mask(ev, budget_LH)

  for b in ([[5, 6], [7, 8]], [[30, 2], [1, 40]]):
    budget_LH = jnp.asarray(b, jnp.int32)
    np.testing.assert_array_equal(np.asarray(kept(budget_LH)).sum(-1), b)
  chex.clear_trace_counter()


@pytest.mark.parametrize("policy", ALL, ids=lambda p: type(p).__name__)
def test_padded_row_scores_as_its_prompt(policy):
  """A left-padded row scores its real positions as the unpadded prompt (chunks, windows and
  sinks count from the first real token; padding enters no statistic)."""
  pad, T = 5, 35
  K = policy.sketch_dimension if hasattr(policy, "sketch_dimension") else 20
  full = random_evidence(3, T=pad + T, K=K if not isinstance(policy, CurDKV) else None)
  if isinstance(policy, CurDKV):
    full = full.replace(sketch_LGDK=random_evidence(4, G=1, D=20, K=8).keys_LGTD[:, :, :8, :20])
  unpadded = full.replace(
    **{k: getattr(full, k)[..., pad:, :] for k in ("prerope_keys_LGTD", "queries_LHTD")},
    keys_LGTD=full.keys_LGTD[..., pad:, :],
    values_LGTD=full.values_LGTD[..., pad:, :],
  )
  valid_T = jnp.arange(pad + T) >= pad
  ours = np.asarray(policy.scores(full.replace(valid_T=valid_T)))[..., pad:]
  ref = np.asarray(policy.scores(unpadded))
  np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
  "cls", [LeverageScore, Compactor, lambda **o: CurDKV(random_projection=True, **o)]
)
def test_drawn_sketch_is_seeded(cls):
  ev = random_evidence(5)
  a, b = cls(seed=1).scores(ev), cls(seed=1).scores(ev)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(cls(seed=2).scores(ev)))


def test_sketch_of_the_wrong_shape_is_refused():
  ev = random_evidence(6, K=8)
  with pytest.raises(ValueError, match="sketch_LGDK"):
    LeverageScore(sketch_dimension=48).scores(ev)
  with pytest.raises(ValueError, match="sketch_LGDK"):
    CurDKV(random_projection=True).scores(ev)


def test_missing_evidence_is_named():
  ev = random_evidence().replace(queries_LHTD=None, prerope_keys_LGTD=None)
  with pytest.raises(ValueError, match="queries_LHTD"):
    NonCausalAttention().scores(ev)
  with pytest.raises(ValueError, match="prerope_keys_LGTD"):
    LeverageScore().scores(ev)


@pytest.mark.parametrize(
  "cls, options, match",
  [
    (LeverageScore, {"sketch_dimension": 0}, "sketch_dimension"),
    (LeverageScore, {"sketch_dimension": 4.0}, "sketch_dimension"),
    (LeverageScore, {"seed": -1}, "seed"),
    (NonCausalAttention, {"chunk_size": 0}, "chunk_size"),
    (NonCausalAttention, {"chunk_size": True}, "chunk_size"),
    (Compactor, {"sinks": -1}, "sinks"),
    (Compactor, {"recent": 1.5}, "recent"),
    (Compactor, {"blending": -0.1}, "blending"),
    (Compactor, {"blending": float("nan")}, "blending"),
    (Compactor, {"chunk_size": 0}, "chunk_size"),
    (Compactor, {"sketch_dimension": 0}, "sketch_dimension"),
    (CurDKV, {"leverage_type": "kv_sum"}, "leverage_type"),
    (CurDKV, {"sinks": -2}, "sinks"),
    (CurDKV, {"local_window": 0}, "local_window"),
    (CurDKV, {"random_projection": 1}, "random_projection"),
    (CurDKV, {"use_local_approximation": "yes"}, "use_local_approximation"),
  ],
)
def test_bad_options_refused(cls, options, match):
  with pytest.raises(ValueError, match=match):
    cls(**options)


def test_short_prompts_keep_their_protected_positions():
  ev = random_evidence(7, T=10)
  s = np.asarray(Compactor().scores(ev))  # 8 sinks + 2 recent: no middle left
  assert np.isinf(s).all()
  keep = np.asarray(Compactor().keep_mask(ev, 4))
  assert (keep.sum(-1) == 4).all()


def test_cholesky_jitter_escalates_per_layer():
  """kvpress ``chol_with_jitter``: 1e-2, then x10, until every head of the layer factors."""
  gram = np.zeros((2, 2, 2, 2), np.float32)
  gram[:] = np.eye(2, dtype=np.float32)
  gram[0, 1, 0, 0] = -0.5  # layer 0 needs jitter 1.0 for all its heads; layer 1 takes 1e-2
  chol = np.asarray(cholesky_with_jitter(jnp.asarray(gram)))
  np.testing.assert_allclose(chol[0, 0], np.sqrt(2.0) * np.eye(2), rtol=1e-6)
  np.testing.assert_allclose(chol[0, 1], np.diag([np.sqrt(0.5), np.sqrt(2.0)]), rtol=1e-6)
  np.testing.assert_allclose(chol[1, 0], np.sqrt(1.01) * np.eye(2), rtol=1e-6)


def test_many_layers_factor_in_one_call_without_hanging():
  """Separate Cholesky calls of SmolLM2's 30 x 3 Gram matrices, one per jitter, run side by side
  on XLA:CPU and could hang in LAPACK; the jitters are one batched call (checked in a subprocess
  with a timeout, so a hang fails instead of stalling the suite)."""
  import subprocess
  import sys

  code = (
    "import numpy as np, jax.numpy as jnp, jax\n"
    "from kvjax.policies import leverage\n"
    "x = np.random.default_rng(0).normal(size=(30, 3, 48, 64)).astype(np.float32)\n"
    "g = jnp.asarray(x @ np.swapaxes(x, -1, -2))\n"
    "print(np.asarray(jax.jit(leverage.cholesky_with_jitter)(g)).shape)\n"
  )
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "(30, 3, 48, 48)" in run.stdout
