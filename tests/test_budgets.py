"""Golden tests of kvjax.budgets against literal transcriptions of the upstream allocators.

Every ``ref_*`` function below is a plain-Python / numpy transcription of the upstream code quoted
in ``notes/refs.md`` (KVCache-Factory ``PyramidKVCluster``, Ada-KV ``AdaptiveSnapKVCluster``,
HeadKV ``ReasonSnapKVCluster`` and KVCache-Factory's ``run_longbench.py`` table, CAKE
``adjust_budgets`` / ``CakeprefillKVCache``). None of them calls kvjax.

Concrete inputs are computed on the host in float64 like upstream, so the tables match exactly.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import budgets

# --------------------------------------------------------------------------- references


def ref_pyramid_legacy(num_hidden_layers, max_capacity_prompt, window_size, q_len, beta=20):
  """KVCache-Factory ``PyramidKVCluster.update_kv``: total kept per layer (window included)."""
  out = []
  for layer_idx in range(num_hidden_layers):
    min_num = (max_capacity_prompt - window_size) // beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
      max_num = q_len - window_size
      min_num = (max_capacity_prompt - window_size) * 2 - max_num
    steps = (max_num - min_num) // (num_hidden_layers - 1)
    layer_capacity = max_num - layer_idx * steps
    if q_len < max_capacity_prompt:
      out.append(q_len)  # "return key_states, value_states": nothing is evicted
    elif q_len < (max_capacity_prompt - window_size) * 2:
      out.append(max_capacity_prompt - window_size + window_size)
    else:
      out.append(layer_capacity + window_size)
  return out


def ref_adakv_official(scores_LHT, budget, window_size, floor_alpha, normalize):
  """Ada-KV ``AdaptiveSnapKVCluster`` allocation (no GQA, skip=0), per layer; window included."""
  L, H, T = scores_LHT.shape
  budget_L = np.broadcast_to(np.asarray(budget), (L,))
  out = np.zeros((L, H), np.int64)
  for layer in range(L):
    base_capacity = int(budget_L[layer]) - window_size
    floor_capacity = int(base_capacity * floor_alpha)
    attn_score = scores_LHT[layer, :, : T - window_size].astype(np.float32)
    if base_capacity > attn_score.shape[-1]:
      out[layer] = T  # uncompressed
      continue
    sorted_attn_score = -np.sort(-attn_score, axis=-1)
    adaptive_attn_score = sorted_attn_score
    length = adaptive_attn_score.shape[-1]
    if normalize:
      ratio_weight = sorted_attn_score[..., :base_capacity].sum(
        axis=-1, keepdims=True
      ) / sorted_attn_score.sum(axis=-1, keepdims=True)
      adaptive_attn_score = adaptive_attn_score * ratio_weight
    adaptive_attn_score = adaptive_attn_score.reshape(length * H)
    sorted_indices = np.argsort(-adaptive_attn_score, kind="stable")[: H * base_capacity]
    sorted_indices = sorted_indices // length
    head_adaptive_capacity = np.zeros(H, np.int64)
    np.add.at(head_adaptive_capacity, sorted_indices, 1)
    assert head_adaptive_capacity.sum() == H * base_capacity
    # torch: int64 tensor * python float -> float32, torch.round is half to even.
    capacity = head_adaptive_capacity.astype(np.float32) * np.float32(1 - floor_alpha)
    capacity = np.round(capacity + np.float32(floor_capacity)).astype(np.int64)
    out[layer] = capacity + window_size
  return out


def ref_headkv_official(head_means, L, H, max_capacity_prompt, window_size, beta, temp):
  """HeadKV ``ReasonSnapKVCluster.__init__`` (float64 throughout, as torch.tensor(numpy)).

  Returns the capacities (window included) and the float64 values before ``torch.round``.
  """
  base_capacity = max_capacity_prompt - window_size
  head_score_list = [np.float64(m) for m in head_means]  # [np.mean(l[1]) for l in ...]
  head_score_list = np.asarray(head_score_list / sum(head_score_list), np.float64)
  head_score_list = np.power(head_score_list, temp)
  head_score_list = head_score_list / np.sum(head_score_list)
  total_attention = head_score_list.reshape(L, H)
  total_pool_capacity = (base_capacity // beta) * L * H
  min_num = base_capacity - base_capacity // beta
  raw = total_attention * total_pool_capacity + min_num
  head_capacity = np.round(raw).astype(np.int64)  # torch.round: half to even
  return head_capacity + window_size, raw


def ref_headkv_kvfactory(head_means, L, H, max_capacity_prompts, window_size, head_beta):
  """KVCache-Factory ``run_longbench.py`` HeadKV table (window included in ``b``, no temp)."""
  head_score_list = [np.float64(m) for m in head_means]
  head_score_list = np.asarray(head_score_list / sum(head_score_list), np.float64)
  total_attention = head_score_list.reshape(L, H)
  total_pool_capacity = (max_capacity_prompts // head_beta) * L * H
  min_num = max_capacity_prompts - max_capacity_prompts // head_beta
  raw = total_attention * total_pool_capacity + min_num
  head_capacity = np.round(raw).astype(np.int64)  # torch.round: half to even
  return head_capacity + window_size, raw


def ref_adjust_budgets(budget_list, total_budget, seq_len, layer_nums):
  """CAKE ``cake/utils.py::adjust_budgets``, verbatim."""
  budget_list = np.array(budget_list, dtype=int)
  # Limit the budget of all layers to not exceed seq_len
  excess = np.maximum(budget_list - seq_len, 0)
  budget_list = np.minimum(budget_list, seq_len)

  # Adjust excess budget
  total_excess = np.sum(excess)

  if total_excess > 0:
    valid_indices = budget_list < seq_len
    num_valid = np.sum(valid_indices)

    if num_valid > 0:
      distribute_per_layer = total_excess // num_valid
      remainder = total_excess % num_valid

      budget_list[valid_indices] += distribute_per_layer
      budget_list[np.where(valid_indices)[0][:remainder]] += 1

  # Ensure total budget equals total_budget
  current_total_budget = np.sum(budget_list)
  budget_diff = total_budget - current_total_budget

  if budget_diff != 0:
    if budget_diff > 0:  # noqa: SIM108 (verbatim upstream)
      valid_indices = budget_list < seq_len
    else:
      valid_indices = budget_list > 1

    num_valid = np.sum(valid_indices)

    if num_valid > 0:
      adjust_per_layer = abs(budget_diff) // num_valid
      remainder = abs(budget_diff) % num_valid

      if budget_diff > 0:
        budget_list[valid_indices] += adjust_per_layer
        budget_list[np.where(valid_indices)[0][:remainder]] += 1
      else:
        budget_list[valid_indices] -= adjust_per_layer
        budget_list[np.where(valid_indices)[0][:remainder]] -= 1

  return budget_list.tolist()


def ref_cake(attn_LHWT, cache_size, window_size, tau1, tau2):
  """CAKE prefill (non-cascading): preference per layer, split, adjust, cap; window included."""
  num_layers = attn_LHWT.shape[0]
  seq_len = attn_LHWT.shape[-1]
  if seq_len <= cache_size + window_size:
    return [seq_len] * num_layers
  pref_scores = []
  for layer in range(num_layers):
    tmp_attn_weights = attn_LHWT[layer][None]  # [bsz=1, H, W, T]
    sliced = tmp_attn_weights[:, :, -window_size:, :-window_size].astype(np.float64)
    disp = -np.sum(sliced * np.log(sliced + 1e-10))  # calculate_entropy
    var = np.var(sliced, axis=-2, ddof=1).sum(0).sum(0).sum(0)  # torch.var is unbiased
    pref_scores.append(disp ** (1 / tau1) * var ** (1 / tau2))
  total_size = (cache_size - window_size) * num_layers
  layer_budgets = [pref_score / sum(pref_scores) * total_size for pref_score in pref_scores]
  layer_budgets = ref_adjust_budgets(layer_budgets, total_size, seq_len - window_size, num_layers)
  out = []
  for budget in layer_budgets:
    if budget >= seq_len - window_size:
      budget = seq_len - window_size
    out.append(budget + window_size)  # top-budget prefix tokens + the last w
  return out


def assert_headkv_golden(got, ref):
  """Exact equality, except where the float64 pre-round value is within float32 noise of .5.

  Traced (jit/vmap) HeadKV tables are float32, so such entries may differ by one there.
  Returns their count.
  """
  want, raw = ref
  got = np.asarray(got)
  ambiguous = np.abs(raw - np.floor(raw) - 0.5) < 1e-6 * np.maximum(np.abs(raw), 1.0)
  np.testing.assert_array_equal(got[~ambiguous], want[~ambiguous])
  assert np.all(np.abs(got - want) <= 1)
  return int(ambiguous.sum())


def distinct_scores(rng, shape):
  """Random float32 scores without ties (a random permutation of well-separated values)."""
  n = int(np.prod(shape))
  values = (rng.permutation(n) + rng.uniform(0.1, 0.9, size=n)) / n
  return values.reshape(shape).astype(np.float32)


def softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def as_list(x):
  return np.asarray(x).tolist()


# --------------------------------------------------------------------------- PyramidKV legacy


def boundary_q_lens(mcp, w):
  return [mcp - 1, mcp, mcp + 1, 2 * (mcp - w) - 1, 2 * (mcp - w), 2 * (mcp - w) + 1]


@pytest.mark.parametrize("budget", [64, 128, 512, 2048])
def test_pyramid_legacy_matches_kvcache_factory(budget):
  L, w = 32, 8
  q_lens = [100, 1000, 3000, 4096, 8192, 31500, *boundary_q_lens(budget, w)]
  for q_len in q_lens:
    got = as_list(budgets.pyramid(L, budget, w, q_len, mode="legacy_floor"))
    assert got == ref_pyramid_legacy(L, budget, w, q_len), (budget, q_len)


def test_pyramid_legacy_branches():
  # q_len < mcp: no compression; mcp <= q_len < 2(mcp - w): uniform; else the pyramid.
  assert as_list(budgets.pyramid(32, 128, 8, 127)) == [127] * 32
  assert as_list(budgets.pyramid(32, 128, 8, 128)) == [128] * 32
  assert as_list(budgets.pyramid(32, 128, 8, 200)) == [128] * 32
  assert as_list(budgets.pyramid(32, 128, 8, 239)) == [128] * 32
  got = as_list(budgets.pyramid(32, 128, 8, 240))
  assert got != [128] * 32 and got == ref_pyramid_legacy(32, 128, 8, 240)
  # refs.md's mcp=2048, q_len=3000 arithmetic (max 2992, steps 61) is never used upstream:
  # 3000 < 2 * (2048 - 8) takes the uniform branch.
  assert as_list(budgets.pyramid(32, 2048, 8, 3000)) == [2048] * 32
  assert ref_pyramid_legacy(32, 2048, 8, 3000) == [2048] * 32


def test_pyramid_legacy_floor_exceeds_uniform_total():
  """Documented upstream fact: at budget 128, q_len 1000, the floors overspend 3840 -> 4016."""
  L, budget, w, q_len = 32, 128, 8, 1000
  selected = np.asarray(budgets.pyramid(L, budget, w, q_len, mode="legacy_floor")) - w
  assert selected[0] == 234 and selected[1] == 227 and selected[-1] == 17
  assert int(selected.sum()) == 4016
  assert int(selected.sum()) > L * (budget - w) == 3840


@pytest.mark.parametrize("num_layers", [2, 4])
@pytest.mark.parametrize("budget", [16, 64, 128])
def test_pyramid_legacy_few_layers(num_layers, budget):
  w = 8
  for q_len in [50, 300, 1000, 4096, *boundary_q_lens(budget, w)]:
    got = as_list(budgets.pyramid(num_layers, budget, w, q_len))
    assert got == ref_pyramid_legacy(num_layers, budget, w, q_len), (budget, q_len)


# --------------------------------------------------------------------------- PyramidKV exact_total


@pytest.mark.parametrize("num_layers", [1, 2, 32])
@pytest.mark.parametrize("budget", [20, 64, 128, 512, 2048])
def test_pyramid_exact_total_properties(num_layers, budget):
  w = 8
  for q_len in sorted({100, 1000, 3000, 4096, 8192, 31500, *boundary_q_lens(budget, w)}):
    got = np.asarray(budgets.pyramid(num_layers, budget, w, q_len, mode="exact_total"))
    assert got.shape == (num_layers,) and got.dtype == np.int32
    if q_len < budget:
      assert got.tolist() == [q_len] * num_layers
      continue
    assert int(got.sum()) == num_layers * budget, (budget, q_len)
    assert np.all(np.diff(got) <= 0), (budget, q_len, got)
    assert np.all(got <= q_len) and np.all(got >= w)
    # Within one token of the real-valued PyramidKV line (beta = 20).
    avg = budget - w
    max_num = min(2 * avg - avg / 20, q_len - w)
    min_num = 2 * avg - max_num
    steps = (max_num - min_num) / max(num_layers - 1, 1)
    line = np.full(1, avg) if num_layers == 1 else max_num - np.arange(num_layers) * steps
    assert np.all(np.abs(got - w - line) < 1), (budget, q_len)


# --------------------------------------------------------------------------- Ada-KV official

ADAKV_CASES = [  # (L, H, T, window, budgets)
  (2, 4, 64, 8, [8, 9, 16, 33, 56, 64, 65]),
  (3, 8, 40, 4, [4, 10, 20, 36, 37]),
  (1, 2, 97, 16, [16, 50, 96]),
]


def _adakv_golden(normalize, alpha):
  rng = np.random.default_rng(int(alpha * 10) + 100 * normalize)
  for L, H, T, w, budget_list in ADAKV_CASES:
    scores = distinct_scores(rng, (L, H, T))
    for budget in budget_list:
      got = np.asarray(
        budgets.adakv(jnp.asarray(scores), budget, w, floor_alpha=alpha, normalize=normalize)
      )
      want = ref_adakv_official(scores, budget, w, alpha, normalize)
      np.testing.assert_array_equal(got, want, err_msg=f"{(L, H, T, w, budget)}")


@pytest.mark.parametrize("alpha", [0.2, 0.5])
@pytest.mark.parametrize(
  "normalize",
  [
    False,
    True,
  ],
)
def test_adakv_official_matches_upstream(normalize, alpha):
  _adakv_golden(normalize, alpha)


@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_adakv_official_normalize_arithmetic(alpha):
  """The normalize=True numbers, also with rank promotion allowed."""
  with jax.numpy_rank_promotion("allow"):
    _adakv_golden(True, alpha)


def test_adakv_official_no_compression_guard():
  rng = np.random.default_rng(1)
  scores = jnp.asarray(distinct_scores(rng, (2, 4, 40)))
  w = 8
  # base = budget - w > T - w = 32 -> the whole prompt
  assert as_list(budgets.adakv(scores, 41, w)) == [[40] * 4] * 2
  assert as_list(budgets.adakv(scores, 1000, w)) == [[40] * 4] * 2
  # base == T - w still goes through the allocation (upstream guard is strict '>')
  np.testing.assert_array_equal(
    np.asarray(budgets.adakv(scores, 40, w)),
    ref_adakv_official(np.asarray(scores), 40, w, 0.2, False),
  )


@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_adakv_official_per_layer_budget(alpha):
  """A budget ``[L]`` (Ada-KV pyram_mode): each layer's base and floor use its own budget."""
  rng = np.random.default_rng(2)
  L, H, T, w = 4, 4, 48, 8
  scores = distinct_scores(rng, (L, H, T))
  budget_L = np.array([40, 24, 12, 60], np.int32)  # the last layer hits the no-compression guard
  got = np.asarray(budgets.adakv(jnp.asarray(scores), jnp.asarray(budget_L), w, floor_alpha=alpha))
  np.testing.assert_array_equal(got, ref_adakv_official(scores, budget_L, w, alpha, False))
  assert got[-1].tolist() == [T] * H


def test_adakv_official_floor_capacity_float64():
  rng = np.random.default_rng(3)
  scores = distinct_scores(rng, (1, 2, 200))
  got = np.asarray(budgets.adakv(jnp.asarray(scores), 98, 8, floor_alpha=0.7))
  np.testing.assert_array_equal(got, ref_adakv_official(scores, 98, 8, 0.7, False))


# --------------------------------------------------------------------------- Ada-KV kvpress


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_adakv_kvpress_counts(alpha):
  rng = np.random.default_rng(4)
  L, H, T = 2, 4, 64
  scores = jnp.asarray(distinct_scores(rng, (L, H, T)))
  for budget in [0, 1, 3, 8, 16, 33, 64]:
    try:
      got = np.asarray(budgets.adakv(scores, budget, 0, floor_alpha=alpha, mode="kvpress"))
    except ValueError as err:  # without the safeguard a head can win nothing: never silently
      assert alpha == 0 and budget > 0 and "leaves a row with no cache" in str(err)
      continue
    assert got.shape == (L, H)
    assert got.sum(-1).tolist() == [H * budget] * L, budget
    floor = max(1, int(budget * alpha)) if (budget > 0 and alpha > 0) else 0
    assert np.all(got >= floor), (budget, got)
    assert np.all(got <= T)


def test_adakv_kvpress_window_protected_by_inf_scores():
  rng = np.random.default_rng(5)
  L, H, T, w = 2, 4, 48, 6
  scores = distinct_scores(rng, (L, H, T))
  scores[..., -w:] = np.inf
  for budget in [6, 10, 30]:
    got = np.asarray(budgets.adakv(jnp.asarray(scores), budget, w, mode="kvpress"))
    assert got.sum(-1).tolist() == [H * budget] * L
    assert np.all(got >= max(w, 1, int(budget * 0.2)))


# --------------------------------------------------------------------------- HeadKV


def _head_means(seed, L, H):
  rng = np.random.default_rng(seed)
  return rng.uniform(0.05, 1.0, size=L * H)


@pytest.mark.parametrize("beta", [1.005, 1.01, 1.5, 2, 5])
@pytest.mark.parametrize("temp", [1, 2])
def test_headkv_official_matches_upstream(beta, temp):
  L, H, w = 4, 8, 8
  ambiguous = 0
  for seed, budget in enumerate([16, 64, 128, 256, 512, 2048]):
    means = _head_means(seed, L, H)
    got = np.asarray(
      budgets.headkv(means.reshape(L, H), budget, w, beta=beta, temp=temp, mode="official")
    )
    ambiguous += assert_headkv_golden(got, ref_headkv_official(means, L, H, budget, w, beta, temp))
  assert ambiguous <= 0.02 * 6 * L * H


@pytest.mark.parametrize("beta", [1.005, 1.01, 1.5, 2, 5])
def test_headkv_kvfactory_matches_upstream(beta):
  L, H, w = 4, 8, 8
  ambiguous = 0
  for seed, budget in enumerate([16, 64, 128, 256, 512, 2048]):
    means = _head_means(seed + 50, L, H)
    got = np.asarray(budgets.headkv(means.reshape(L, H), budget, w, beta=beta, mode="kvfactory"))
    ambiguous += assert_headkv_golden(got, ref_headkv_kvfactory(means, L, H, budget, w, beta))
  assert ambiguous <= 0.02 * 6 * L * H


def test_headkv_round_half_to_even_and_float_floor_division():
  # b = 10, beta 2: pool = 5 * 2, min = 5; shares 0.25/0.75 -> 7.5 and 12.5 -> 8 and 12.
  assert as_list(budgets.headkv([[1.0, 3.0]], 10, 0, beta=2.0)) == [[8, 12]]
  assert ref_headkv_official([1.0, 3.0], 1, 2, 10, 0, 2.0, 1)[0].tolist() == [[8, 12]]
  # refs.md: 120 // 1.01 == 118.0, 120 // 1.005 == 119.0, 96 // 1.5 == 64.0
  assert (120 // 1.01, 120 // 1.005, 96 // 1.5) == (118.0, 119.0, 64.0)
  for b, beta in [(120, 1.01), (120, 1.005), (96, 1.5)]:
    # uniform scores: every head gets exactly b (+ w)
    assert as_list(budgets.headkv(np.ones((2, 3)), b + 8, 8, beta=beta)) == [[b + 8] * 3] * 2


def test_headkv_beta_1_2_matches_upstream():
  got = as_list(budgets.headkv([[1.0, 4.0]], 128, 8, beta=1.2))
  assert got == ref_headkv_official([1.0, 4.0], 1, 2, 128, 8, 1.2, 1)[0].tolist()  # [[68, 188]]


def test_headkv_float64_at_llama_size():
  L, H, w, beta = 32, 32, 8, 1.01
  for seed in range(6):
    means = _head_means(seed, L, H)
    for budget in (1024, 2048):
      got = np.asarray(budgets.headkv(means.reshape(L, H), budget, w, beta=beta, temp=2))
      want, _ = ref_headkv_official(means, L, H, budget, w, beta, 2)
      np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- CAKE


@pytest.mark.parametrize("seed", range(12))
def test_adjust_budgets_matches_cake(seed):
  rng = np.random.default_rng(seed)
  L = int(rng.integers(1, 12))
  seq_len = int(rng.integers(2, 200))
  # scale > 1 makes some layers exceed seq_len (excess redistribution)
  scale = [0.5, 1.0, 2.0, 4.0][seed % 4]
  raw = (rng.random(L) * scale * seq_len).astype(np.float32)
  totals = [int(raw.astype(np.float64).sum()), int(rng.integers(L, L * seq_len + 1)), L]
  for total in totals:
    want = ref_adjust_budgets(raw.astype(np.float64).tolist(), total, seq_len, L)
    got = as_list(budgets.adjust_budgets(jnp.asarray(raw), total, seq_len))
    assert got == want, (L, seq_len, total, raw)


def test_adjust_budgets_hand_cases():
  # excess 40 + 0 -> spread over the two uncapped layers; then total forced to 150
  raw = np.array([140.7, 30.2, 20.9], np.float32)
  want = ref_adjust_budgets(raw.astype(np.float64).tolist(), 150, 100, 3)
  assert as_list(budgets.adjust_budgets(jnp.asarray(raw), 150, 100)) == want
  # everything capped: no valid layer to receive the excess
  raw = np.array([300.0, 300.0], np.float32)
  want = ref_adjust_budgets(raw.astype(np.float64).tolist(), 200, 100, 2)
  assert as_list(budgets.adjust_budgets(jnp.asarray(raw), 200, 100)) == want == [100, 100]


CAKE_CASES = [  # (L, H, W, T, window, budget, tau1, tau2)
  (4, 2, 8, 96, 8, 24, 1.0, 1.0),
  (6, 3, 6, 64, 4, 12, 1.6, 0.4),
  (3, 2, 8, 120, 8, 100, 1.6, 0.6),  # large budget: some layers hit the T - w cap
  (5, 1, 4, 40, 4, 6, 1.0, 1.0),
]


@pytest.mark.parametrize("case", CAKE_CASES)
def test_cake_matches_upstream(case):
  L, H, W, T, w, budget, tau1, tau2 = case
  rng = np.random.default_rng(sum(case[:6]))
  logits = rng.normal(size=(L, H, W, T)) * rng.uniform(0.5, 4.0, size=(L, 1, 1, 1))
  attn = softmax(logits).astype(np.float32)
  got = as_list(budgets.cake(jnp.asarray(attn), budget, w, tau1, tau2))
  assert got == ref_cake(attn, budget, w, tau1, tau2)
  assert budget + w < T  # the compressing branch was exercised


def test_cake_no_compression_guard():
  rng = np.random.default_rng(7)
  L, H, W, T, w = 3, 2, 8, 48, 8
  attn = jnp.asarray(softmax(rng.normal(size=(L, H, W, T))).astype(np.float32))
  for budget in (40, 41, 60):  # T <= budget + w
    assert as_list(budgets.cake(attn, budget, w)) == [T] * L
  got = as_list(budgets.cake(attn, 39, w))  # T = budget + w + 1 compresses
  assert got == ref_cake(np.asarray(attn), 39, w, 1.0, 1.0)


def test_cake_preference_matches_numpy():
  rng = np.random.default_rng(8)
  attn = softmax(rng.normal(size=(3, 2, 6, 30))).astype(np.float32)
  w = 6
  a = attn[..., -w:, :-w].astype(np.float64)
  entropy = -(a * np.log(a + 1e-10)).sum((1, 2, 3))
  var = a.var(axis=2, ddof=1).sum((1, 2))
  want = entropy ** (1 / 1.6) * var ** (1 / 0.4)
  got = np.asarray(budgets.cake_preference(jnp.asarray(attn), w, 1.6, 0.4))
  np.testing.assert_allclose(got, want, rtol=1e-4)


# --------------------------------------------------------------------------- simple allocations


def test_uniform_and_per_head():
  u = budgets.uniform(3, 4, 17)
  assert u.shape == (3, 4) and u.dtype == jnp.int32 and np.all(np.asarray(u) == 17)
  p = budgets.per_head([5, 6, 7], 2)
  assert p.dtype == jnp.int32 and as_list(p) == [[5, 5], [6, 6], [7, 7]]


def test_from_table():
  assert as_list(budgets.from_table(9, 2, 3)) == [[9] * 3] * 2
  assert as_list(budgets.from_table([4, 5], 2, 3)) == [[4] * 3, [5] * 3]
  table = [[1, 2, 3], [4, 5, 6]]
  out = budgets.from_table(table, 2, 3)
  assert out.dtype == jnp.int32 and as_list(out) == table
  # integral floats are accepted (JSON configs)
  assert as_list(budgets.from_table([[1.0, 2.0]], 1, 2)) == [[1, 2]]
  assert as_list(budgets.from_table(np.array([[0, 3]], np.int64), 1, 2)) == [[0, 3]]


def test_round_to_total():
  assert as_list(budgets.round_to_total(jnp.array([1.5, 1.5, 1.0]), 4)) == [2, 1, 1]
  assert as_list(budgets.round_to_total(jnp.array([3.0, 2.0, 5.0]), 10)) == [3, 2, 5]
  rng = np.random.default_rng(9)
  for total in (0, 1, 7, 100, 4096):
    weights = rng.dirichlet(np.ones(13)) * total
    got = np.asarray(budgets.round_to_total(jnp.asarray(weights, jnp.float32), total))
    assert got.dtype == np.int32 and int(got.sum()) == total
    assert np.all(np.abs(got - weights) < 1) and np.all(got >= 0)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_error_naming_the_argument():
  with pytest.raises(ValueError, match="budget"):
    budgets.pyramid(32, -8, 0, 100)
  with pytest.raises(ValueError, match="budget"):
    budgets.uniform(2, 2, -1)
  with pytest.raises(ValueError, match="window"):
    budgets.pyramid(32, 128, -1, 1000)
  with pytest.raises(ValueError, match=r"budget.*window"):
    budgets.pyramid(32, 4, 8, 100)
  with pytest.raises(ValueError, match=r"budget.*window"):
    budgets.adakv(jnp.ones((1, 2, 16)), 4, 8)
  with pytest.raises(ValueError, match=r"budget.*window"):
    budgets.headkv(np.ones((2, 2)), 4, 8)
  with pytest.raises(ValueError, match=r"budget.*window"):
    budgets.cake(jnp.full((2, 1, 4, 16), 1 / 16), 2, 4)
  with pytest.raises(ValueError, match="table"):
    budgets.from_table(np.ones((3, 2), np.int32), 2, 2)
  with pytest.raises(ValueError, match="table"):
    budgets.from_table([1, 2, 3], 2, 2)
  with pytest.raises(ValueError, match="table"):
    budgets.from_table([[1.5, 2.0]], 1, 2)
  with pytest.raises(ValueError, match="table"):
    budgets.from_table([[-1, 2]], 1, 2)
  with pytest.raises(ValueError, match="mode"):
    budgets.pyramid(32, 128, 8, 1000, mode="linear")
  with pytest.raises(ValueError, match="mode"):
    budgets.adakv(jnp.ones((1, 2, 16)), 8, 2, mode="linear")
  with pytest.raises(ValueError, match="mode"):
    budgets.headkv(np.ones((2, 2)), 16, 2, mode="linear")
  with pytest.raises(ValueError, match="beta"):
    budgets.pyramid(32, 128, 8, 1000, beta=0.5)
  with pytest.raises(ValueError, match="beta"):
    budgets.pyramid(32, 128, 8, 1000, beta=0.5, mode="exact_total")
  with pytest.raises(ValueError, match="num_layers"):
    budgets.pyramid(0, 128, 8, 1000)
  with pytest.raises(ValueError, match="num_heads"):
    budgets.uniform(2, 0, 8)


def test_allocation_that_empties_a_row_raises():
  # L = 3, budget 10, window 0: min = 10 // 20 = 0, so the top layer keeps nothing: [20, 10, 0].
  assert ref_pyramid_legacy(3, 10, 0, 4096) == [20, 10, 0]
  with pytest.raises(ValueError, match="budget"):
    budgets.pyramid(3, 10, 0, 4096)
  with pytest.raises(ValueError, match="budget"):
    budgets.pyramid(32, 0, 0, 100)
  # the same budgets with a window are fine: the window is always kept
  assert as_list(budgets.pyramid(3, 18, 8, 4096)) == ref_pyramid_legacy(3, 18, 8, 4096)


# --------------------------------------------------------------------------- traced budgets


def test_pyramid_budget_is_traced_data():
  @chex.assert_max_traces(n=1)
  def fn(b):
    return budgets.pyramid(32, b, 8, 4096)

  jitted = jax.jit(fn)
  for b in (64, 128, 512, 2048):
    got = as_list(jitted(jnp.int32(b)))
    assert got == ref_pyramid_legacy(32, b, 8, 4096)


@pytest.mark.parametrize("mode", ["legacy_floor", "exact_total"])
def test_pyramid_vmap_over_budgets_and_q_len(mode):
  bs = [64, 128, 512, 2048, 3000]
  out = jax.vmap(lambda b: budgets.pyramid(32, b, 8, 4096, mode=mode))(jnp.array(bs))
  for i, b in enumerate(bs):
    assert as_list(out[i]) == as_list(budgets.pyramid(32, b, 8, 4096, mode=mode)), b
  q_lens = [100, 600, 1000, 1016, 4096]
  out = jax.vmap(lambda q: budgets.pyramid(32, 512, 8, q, mode=mode))(jnp.array(q_lens))
  for i, q in enumerate(q_lens):
    assert as_list(out[i]) == as_list(budgets.pyramid(32, 512, 8, q, mode=mode)), q
  if mode == "legacy_floor":
    assert as_list(out[3]) == ref_pyramid_legacy(32, 512, 8, 1016)


def test_adakv_official_vmap_and_jit_over_budgets():
  rng = np.random.default_rng(10)
  L, H, T, w = 2, 4, 64, 8
  scores = distinct_scores(rng, (L, H, T))
  s = jnp.asarray(scores)
  bs = [8, 16, 40, 64, 70]
  out = jax.vmap(lambda b: budgets.adakv(s, b, w))(jnp.array(bs))

  @chex.assert_max_traces(n=1)
  def fn(b):
    return budgets.adakv(s, b, w)

  jitted = jax.jit(fn)
  for i, b in enumerate(bs):
    want = ref_adakv_official(scores, b, w, 0.2, False)
    np.testing.assert_array_equal(np.asarray(out[i]), want, err_msg=f"budget={b}")
    np.testing.assert_array_equal(np.asarray(jitted(jnp.int32(b))), want)
  assert math.prod(out.shape) == len(bs) * L * H


def test_adakv_empty_head_raises():
  # head 1 never wins the pooled top-k; with alpha 0 and no window it would keep nothing
  scores = jnp.asarray([[[5.0, 4.0, 3.0, 2.0], [0.1, 0.2, 0.3, 0.4]]])
  with pytest.raises(ValueError, match="budget: the allocation .* leaves a row with no cache"):
    budgets.adakv(scores, 2, 0, floor_alpha=0.0)


def test_counts_outside_int32_raise_instead_of_wrapping():
  for call in (
    lambda: budgets.uniform(2, 2, np.int64(2**32 + 12)),
    lambda: budgets.per_head(np.asarray([4, 2**40]), 2),
    lambda: budgets.pyramid(4, 2**40, 8, 1000),
    lambda: budgets.pyramid(4, np.int64(2**32 + 12), 8, 1000),
    lambda: budgets.adakv(jnp.ones((1, 2, 16)), np.int64(2**32 + 12), 2),
    lambda: budgets.headkv(np.ones((2, 2)), 2**40, 2),
    lambda: budgets.cake(jnp.full((2, 1, 4, 16), 1 / 16), np.int64(2**32 + 12), 4),
    lambda: budgets.from_table([[2**31, 1]], 1, 2),
  ):
    with pytest.raises(ValueError, match=r"(budget|table): \d+ does not fit int32"):
      call()
  with pytest.raises(ValueError, match="q_len: 1099511627776 does not fit int32"):
    budgets.pyramid(4, 64, 8, 2**40)
  with pytest.raises(ValueError, match="window: .* does not fit int32"):
    budgets.pyramid(4, 64, 2**40, 1000)
  with pytest.raises(ValueError, match="num_layers: 2147483648 does not fit int32"):
    budgets.uniform(2**31, 1, 4)
  # an int32-sized budget past the prompt is "no compression", not an overflow
  assert as_list(budgets.pyramid(4, 2**31 - 1, 8, 1000)) == [1000] * 4
  assert as_list(budgets.pyramid(4, 2**31 - 1, 8, 1000, mode="exact_total")) == [1000] * 4
  assert (np.asarray(budgets.adakv(jnp.ones((1, 2, 16)), 2**31 - 1, 2, mode="kvpress")) == 16).all()
  assert (np.asarray(budgets.adakv(jnp.ones((1, 2, 16)), 2**31 - 1, 2, normalize=True)) == 16).all()
  attn = jnp.full((2, 1, 4, 16), 1 / 16)
  assert as_list(budgets.cake(attn, 2**31 - 1, 4)) == [16, 16]
  assert as_list(budgets.headkv(np.ones((2, 2)), 2**31 - 1, 2, q_len=100)) == [[100] * 2] * 2
  with pytest.raises(ValueError, match="budget: .* too large for PyramidKV's int32 arithmetic"):
    budgets.pyramid(4, 2**30 + 8, 0, 2**31 - 1)


@pytest.mark.parametrize("mode", ["legacy_floor", "kvpress"])
def test_pyramid_with_one_layer_is_undefined_upstream(mode):
  # KVCache-Factory divides the layer step by num_layers - 1 (ZeroDivisionError at L = 1); the
  # legacy arithmetic gave 28 here, 1.75x the budget
  with pytest.raises(ValueError, match="num_layers: PyramidKV's .* undefined for num_layers=1"):
    budgets.pyramid(1, 16, 4, 512, mode=mode)
  assert as_list(budgets.pyramid(1, 16, 4, 512, mode="exact_total")) == [16]
  assert as_list(budgets.pyramid(1, 16, 4, 10, mode="exact_total")) == [10]


def test_degenerate_evidence_raises():
  with pytest.raises(ValueError, match="head_scores: all head importances are zero"):
    budgets.headkv(np.zeros((2, 3)), 16, 4)
  with pytest.raises(ValueError, match="head_scores: expected finite"):
    budgets.headkv(np.full((2, 3), np.nan), 16, 4)
  attn = np.full((2, 1, 4, 16), 1 / 16, np.float32)
  attn[1, 0, 2, 5] = np.nan
  with pytest.raises(ValueError, match="attn: contains NaN or inf"):
    budgets.cake(jnp.asarray(attn), 8, 4)
  with pytest.raises(ValueError, match="attn: contains NaN or inf"):
    budgets.cake_statistics(jnp.asarray(attn), 4)
  with pytest.raises(ValueError, match="statistics: CAKE's layer preferences are"):
    budgets.cake(jnp.full((2, 1, 4, 16), 1 / 16), 8, 4)  # no variance: preferences sum to 0
  stats = (jnp.asarray([1.0, jnp.nan]), jnp.asarray([1.0, 2.0]))
  with pytest.raises(ValueError, match="statistics: contains NaN"):
    budgets.cake_from_statistics(stats, 8, 4, 16)
  for name, kwargs in (
    ("beta", dict(beta=float("nan"))),
    ("temp", dict(temp=0.0)),
    ("beta", dict(beta=1.0)),
  ):
    with pytest.raises(ValueError, match=name):
      budgets.headkv(np.ones((2, 3)), 16, 4, **kwargs)
  with pytest.raises(ValueError, match="beta: expected a finite value"):
    budgets.pyramid(4, 64, 8, 1000, beta=float("inf"))
  with pytest.raises(ValueError, match="tau1: expected a finite value"):
    budgets.cake(jnp.full((2, 1, 4, 16), 1 / 16), 8, 4, tau1=float("nan"))
  with pytest.raises(ValueError, match="floor_alpha"):
    budgets.adakv(jnp.ones((1, 2, 16)), 8, 2, floor_alpha=float("nan"))
  with pytest.raises(ValueError, match="budget: expected a scalar"):
    budgets.headkv(np.ones((2, 3)), np.asarray([16, 16]), 4)


def test_adakv_window_covering_the_prompt_keeps_it():
  assert as_list(budgets.adakv(jnp.ones((1, 2, 8)), 8, 8)) == [[8, 8]]
