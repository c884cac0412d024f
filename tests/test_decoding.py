"""kvjax.model.decoding (with answers and logprobs): generation, answers and streamed
log-probabilities through the compressed cache (full-cache equivalence, padding, vmapped
configurations, budget validation)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUICK_FAMILIES, family_params, family_rows
from hf_models import (
  NEW,
  hf_generate,
  make_checkpoint_cached,
  prompt,
  tiny_hf,
)

from kvjax import budgets as budgets_lib
from kvjax import model as km
from kvjax import policies

COVERING_POLICIES = [
  "snapkv",
  "pyramidkv",
  "adakv_snapkv",
  "knorm",
  "h2o",
  "streaming_llm",
  "tova",
  "sliding_window",
]


@pytest.mark.parametrize(("family", "policy"), family_rows(COVERING_POLICIES), indirect=["family"])
def test_budget_covering_the_prompt_reproduces_full_cache(family, policy):
  _, _, model, _ = family
  ids = prompt(T=40)
  full = km.generate(model, ids, max_new_tokens=NEW).tokens
  # prefill-time policies append without eviction: budget >= prompt suffices; decode-time
  # policies evict once prompt + generated exceeds the budget, so they need T + NEW.
  budget = 40 + NEW if policies.make(policy).acts_at_decode else 40
  options = {"window": 8} if policy in ("snapkv", "pyramidkv", "adakv_snapkv") else {}
  out = km.generate(model, ids, policy=policy, budget=budget, max_new_tokens=NEW, **options)
  np.testing.assert_array_equal(out.tokens, full)


@pytest.mark.parametrize("family", family_params(QUICK_FAMILIES[:1]), indirect=True)
def test_left_and_right_padding_match_unpadded_rows(family):
  _, hf, model, _ = family
  a, b = prompt(T=40, seed=1)[0], prompt(T=31, seed=2)[0]
  solo = [km.generate(model, r[None], max_new_tokens=12).tokens[0] for r in (a, b)]
  left = np.zeros((2, 40), np.int32)
  left[0], left[1, 9:] = a, b
  left_mask = (np.arange(40) >= np.array([[0], [9]])).astype(np.int32)
  right = np.zeros((2, 40), np.int32)
  right[0], right[1, :31] = a, b
  right_mask = (np.arange(40) < np.array([[40], [31]])).astype(np.int32)
  for ids, mask, side in ((left, left_mask, "left"), (right, right_mask, "right")):
    out = km.generate(model, km.Padded(ids, mask), max_new_tokens=12).tokens
    np.testing.assert_array_equal(out, np.stack(solo), err_msg=side)
    comp = km.generate(
      model, km.Padded(ids, mask), policy="snapkv", budget=24, window=8, max_new_tokens=12
    )
    solo_comp = [
      km.generate(model, r[None], policy="snapkv", budget=24, window=8, max_new_tokens=12).tokens[0]
      for r in (a, b)
    ]
    np.testing.assert_array_equal(comp.tokens, np.stack(solo_comp), err_msg=side)
  np.testing.assert_array_equal(solo[0], hf_generate(hf, a[None], 12)[0])


def test_vmapped_configurations_equal_separate_runs():
  hf, path = make_checkpoint_cached()
  model, _ = km.load(path)
  ids = prompt(T=48, B=2)
  budgets = np.array([12, 20, 33, 48], np.int32)
  many = km.generate_configs(model, ids, budgets, policy="snapkv", window=8, max_new_tokens=10)
  assert many.tokens.shape == (4, 2, 10)
  for c, b in enumerate(budgets):
    one = km.generate(model, ids, policy="snapkv", budget=int(b), window=8, max_new_tokens=10)
    np.testing.assert_array_equal(many.tokens[c], one.tokens)


def test_bad_generation_inputs():
  _, path = make_checkpoint_cached()
  model, _ = km.load(path)
  with pytest.raises(ValueError, match="budget: required"):
    km.generate(model, prompt(), policy="snapkv")
  with pytest.raises(ValueError, match="prompt_ids: expected"):
    km.generate(model, np.zeros(5, np.int32))
  with pytest.raises(ValueError, match="layout: expected one of"):
    km.generate(model, prompt(), layout="heads")
  with pytest.raises(ValueError, match="name: unknown policy"):
    km.generate(model, prompt(), policy="snapkvv", budget=8)


def test_budgets_below_the_window_or_recent_are_refused():
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  ids = prompt(T=40)
  for bad, match in (
    (0, "budget: 0 is below 9"),
    (-3, "budget: -3"),
    (20.5, "integer token counts"),
  ):
    with pytest.raises(ValueError, match=match):
      km.generate(model, ids, policy="snapkv", budget=bad, window=8)
  with pytest.raises(ValueError, match="budget: 10 is below 33"):
    km.generate_configs(model, ids, [10, 36], policy="pyramidkv")
  with pytest.raises(ValueError, match="must exceed H2O's recent window"):
    km.generate(model, ids, policy="h2o", budget=6)


def test_keep_mask_on_a_real_prompt_matches_the_policy_and_survives_padding():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(4, 200, (1, 120)).astype(np.int32)
  kept = km.keep_mask(model, ids, "snapkv", 40, window=8)
  assert kept.shape == (cfg.num_layers, 1, cfg.num_heads, 120)
  assert (kept.sum(-1) == 40).all() and kept[..., -8:].all()  # the window is protected
  pre = km.prefill(cfg, model.params(), ids, request=policies.EvidenceRequest(window=8))
  ev = policies.Evidence(attn_window_LHWT=pre.attn_window[:, 0], keys_LGTD=pre.keys[:, 0])
  expected = np.asarray(policies.make("snapkv", window=8).keep_mask(ev, 40))
  np.testing.assert_array_equal(kept[:, 0], expected)
  grouped = km.keep_mask(model, ids, "snapkv", 40, window=8, num_kv_heads=cfg.num_kv_heads)
  assert grouped.shape[2] == cfg.num_kv_heads and (grouped.sum(-1) == 40).all()
  # the same prompt right-padded in a batch keeps the same columns
  padded = np.concatenate([ids, np.zeros((1, 30), np.int32)], 1)
  both = np.concatenate([padded, padded], 0)
  mask = np.ones_like(both)
  mask[0, 120:] = 0
  kept2 = km.keep_mask(model, km.Padded(both, mask), "snapkv", 40, window=8)
  np.testing.assert_array_equal(kept2[:, 0, :, :120], kept[:, 0])
  assert not kept2[:, 0, :, 120:].any()
  with pytest.raises(ValueError, match="num_kv_heads"):
    km.keep_mask(model, ids, "snapkv", 40, num_kv_heads=cfg.num_kv_heads + 1)


# every policy that reads its window rows only through its window scorer; quick mode runs one
# per way the scores are read (as given, by an allocator, by a budget-dependent stage, chunked,
# by a decode-time policy), the others are slow
WINDOW_SCORED = [
  "snapkv",
  "adakv_snapkv",
  "critical_snapkv",
  "chunkkv_snapkv",
  "tova",
  *(
    pytest.param(name, marks=pytest.mark.slow)
    for name in (
      "snapkv_kvpress",
      "pyramidkv",
      "adakv_pyramidkv",
      "critical_adakv_snapkv",
      "think_snapkv",
    )
  ),
]


@pytest.mark.parametrize("policy", WINDOW_SCORED)
def test_window_rows_reduced_in_the_layer_scan_keep_what_the_rows_keep(policy):
  model, cfg, _ = km.load_tiny()
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(4, 200, (2, 90)), jnp.int32)
  mask = np.ones((2, 90), np.int32)
  mask[1, :17] = 0  # a left-padded row
  mask = jnp.asarray(mask)
  pol = policies.make(policy) if policy == "tova" else policies.make(policy, window=8)
  scorer = pol.window_scorer()
  assert scorer == policies.make(pol.name, **dict(pol.options)).window_scorer()  # one compile
  # the entry points' observation window: the policy's, or 32 rows
  request = pol.evidence_request(90)
  assert request.window == (32 if policy == "tova" else 8) and request.window_scores is None
  assert pol.evidence_request(90, reduce_rows=True) == dataclasses.replace(
    request, window_scores=scorer
  )
  rows = km.prefill(cfg, model.params(), ids, mask, request=request)
  reduced = km.prefill(
    cfg, model.params(), ids, mask, request=dataclasses.replace(request, window_scores=scorer)
  )
  assert reduced.attn_window is None and reduced.window == rows.window == request.window
  assert reduced.window_scores.shape == (cfg.num_layers, 2, cfg.num_heads, 90)
  expected = np.stack([np.asarray(scorer(rows.attn_window[l])) for l in range(cfg.num_layers)])
  np.testing.assert_allclose(np.asarray(reduced.window_scores), expected, rtol=1e-6, atol=1e-7)
  for layout in ("query", "kv"):
    spec = km.cache.CacheSpec(pol, 40, layout)
    want, got = (km.cache.compress(cfg, pre, spec, 32) for pre in (rows, reduced))
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
    np.testing.assert_array_equal(np.asarray(got.positions), np.asarray(want.positions))
    np.testing.assert_array_equal(np.asarray(got.budget), np.asarray(want.budget))
  # the entry points ask for the reduction themselves, and keep the same positions
  options = {} if policy == "tova" else {"window": 8}
  kept = km.keep_mask(model, km.Padded(ids, mask), policy, 32, **options)
  want = km.cache.compress(cfg, rows, km.cache.CacheSpec(pol, 90, "query"), 32)
  valid = np.asarray(want.valid)
  columns = np.asarray(want.positions) + np.array([0, 17])[None, :, None, None]  # + padding
  expected = np.zeros(kept.shape, bool)
  l, b, h, c = np.nonzero(valid)
  expected[l, b, h, columns[l, b, h, c]] = True
  np.testing.assert_array_equal(kept, expected)


def test_policies_that_read_rows_otherwise_keep_them():
  for name in ("cake", "h2o", "knorm", "rkv", "expected_attention"):
    assert policies.make(name).window_scorer() is None, name


# CI's quick mode checks the shared prefill in one question mode
@pytest.mark.parametrize("question", [pytest.param("in_window", marks=pytest.mark.slow), "after"])
def test_one_prefill_serves_every_policy(question):
  model, _, _ = km.load_tiny()
  rng = np.random.default_rng(1)
  prompt = rng.integers(4, 200, (2, 96)).astype(np.int32)
  answer = rng.integers(4, 200, (2, 3)).astype(np.int32)
  shared = km.answers.prefill_answers(
    model, prompt, answer, question=km.Question(length=5, mode=question)
  )
  for policy, options in [("snapkv", {"window": 8}), ("h2o", {}), ("oracle", {}), ("tova", {})]:
    alone = km.answer_configs(
      model,
      prompt,
      answer,
      [24, 40],
      policy=policy,
      **options,
      question=km.Question(length=5, mode=question),
    )
    both = km.answers.answer_prefilled(model, shared, [24, 40], policy=policy, **options)
    np.testing.assert_array_equal(both.predicted, alone.predicted)
    np.testing.assert_allclose(both.logprobs, alone.logprobs, atol=1e-5)
  with pytest.raises(ValueError, match="window rows"):
    km.answers.answer_prefilled(model, shared, [60], policy="snapkv", window=40)


# (model, question mode, policies): on the tiny model CI's quick mode checks one mode and no
# per-head allocation, the rest is slow; the Mistral window's own masks: one mode, two policies
TOKEN_LOOP_RUNS = [
  pytest.param("tiny", "after", ("full", "snapkv", "oracle"), id="tiny-after"),
  pytest.param("tiny", "after", ("adakv_snapkv",), id="tiny-after-adakv", marks=pytest.mark.slow),
  pytest.param(
    "tiny",
    "in_window",
    ("full", "snapkv", "adakv_snapkv", "oracle"),
    id="tiny-in_window",
    marks=pytest.mark.slow,
  ),
  pytest.param("mistral_window_8", "after", ("full", "snapkv"), id="mistral_window_8-after"),
]


@pytest.mark.parametrize(("model_name", "question", "names"), TOKEN_LOOP_RUNS)
def test_answers_without_a_token_loop_equal_the_token_loop(model_name, question, names, tmp_path):
  # prefill-time policies answer in one pass (teacher-forced) and greedy rounds to a fixed point;
  # random answers are wrong, so the greedy pass needs rounds; some positions are given (mqar's
  # keys); a Mistral sliding window of 8 tokens also cuts the fed tokens' own attention
  if model_name == "tiny":
    model, _, _ = km.load_tiny()
    vocab, T = 200, 96
  else:
    tiny_hf("Mistral", sliding_window=8).save_pretrained(tmp_path)
    model, _ = km.load(tmp_path)
    vocab, T = 128, 40
  rng = np.random.default_rng(3)
  prompt_ids = rng.integers(4, vocab, (2, T)).astype(np.int32)
  answer = rng.integers(4, vocab, (2, 6)).astype(np.int32)
  given = np.zeros(answer.shape, bool)
  given[:, 2] = True
  cases = {
    "full": ([T], {}),
    "snapkv": ([6, 24], {"window": 4}),
    "adakv_snapkv": ([24], {"window": 4}),
    "oracle": ([8], {}),
  }
  shared = km.answers.prefill_answers(
    model, prompt_ids, answer, question=km.Question(length=5, mode=question, answer_given=given)
  )
  for policy in names:
    budgets, options = cases[policy]
    at_once = km.answers.answer_prefilled(model, shared, budgets, policy=policy, **options)
    loop = km.answers.answer_prefilled(
      model, shared, budgets, policy=policy, token_loop=True, **options
    )
    np.testing.assert_array_equal(at_once.predicted, loop.predicted, err_msg=policy)
    np.testing.assert_allclose(at_once.logprobs, loop.logprobs, atol=2e-5, err_msg=policy)
    teacher = at_once.logprobs.argmax(-1)
    assert (teacher != at_once.predicted).any(), policy  # the greedy pass needed rounds


@pytest.mark.parametrize(
  ("call", "match"),
  [
    (dict(prompt=[[1, 2, 10**6]]), "token id 1000000 is outside the vocabulary"),
    (dict(prompt=[[1, -1, 3]]), "token id -1 is outside"),
    (dict(prompt=[[1.0, 2.5]]), "integer token ids"),
    (dict(prompt=np.zeros((1, 0), np.int32)), r"T >= 1"),
    (dict(prompt=np.zeros((0, 4), np.int32)), r"batch >= 1"),
    (dict(mask=[[0, 0, 0, 0]]), "row 0 has no real token"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(policy="full", budget=16), "full cache keeps everything"),
    (dict(budget=np.int64(2**32 + 12)), "does not fit int32"),
    (dict(budget=2**40), "does not fit int32"),
  ],
)
def test_bad_generation_calls_are_named(call, match):
  model, _, _ = km.load_tiny()
  prompt = np.asarray(call.get("prompt", [[5, 6, 7, 8]]))
  kw = dict(policy=call.get("policy", "streaming_llm"), max_new_tokens=2)
  if "budget" in call or kw["policy"] != "full":
    kw["budget"] = call.get("budget", 16)
  with pytest.raises(ValueError, match=match):
    if "mask" in call:
      prompt = km.Padded(prompt, np.asarray(call["mask"]))
    if "temperature" in call:
      kw["sampling"] = km.Sampling(temperature=call["temperature"])
    km.generate(model, prompt, **kw)


def test_bad_config_budgets_and_answer_ids_are_named():
  model, cfg, _ = km.load_tiny()
  prompt = np.full((1, 40), 5, np.int32)
  with pytest.raises(ValueError, match="outside"):
    km.generate_configs(model, prompt, np.asarray([16, 2**32 + 12]), policy="streaming_llm")
  with pytest.raises(ValueError, match="answer_ids: token id"):
    km.answer_configs(model, prompt, [[cfg.vocab_size]], [16], policy="streaming_llm")


def test_stream_logprobs_through_the_cache_equal_the_full_forward():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(0).integers(4, 200, (2, 60)).astype(np.int32)
  logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids)), -1))[:, :-1]
  ref = np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(km.logprobs.stream_logprobs(model, ids), ref, atol=1e-4)
  np.testing.assert_allclose(km.logprobs.teacher_forced_logprobs(model, ids), ref, atol=1e-5)
  # a window as long as the text evicts nothing; the prefix is compressed under the budget too
  wide = km.logprobs.stream_logprobs(model, ids, policy="sliding_window", budget=60, prefix=10)
  np.testing.assert_allclose(wide, ref[:, 9:], atol=1e-4)
  small = km.logprobs.stream_logprobs(model, ids, policy="streaming_llm", budget=12)
  assert small.shape == (2, 59) and np.isfinite(small).all()
  assert np.abs(small[:, :10] - ref[:, :10]).max() < 1e-4  # nothing evicted yet
  with pytest.raises(ValueError, match="decode-time policy"):
    km.logprobs.stream_logprobs(model, ids, policy="snapkv", budget=40)
  with pytest.raises(ValueError, match="prefix"):
    km.logprobs.stream_logprobs(model, ids, prefix=60)


def test_new_budget_maxima_rarely_recompile_the_decoder():
  model, _, _ = km.load_tiny()
  ids = np.random.default_rng(3).integers(4, 200, (1, 200)).astype(np.int32)
  jax.clear_caches()
  for budget in range(80, 96, 2):  # eight different largest budgets, two capacity buckets
    km.generate(model, ids, policy="snapkv", budget=budget, max_new_tokens=2, window=8)
  assert km.decoding._compress_and_decode._cache_size() <= 2
  assert [km.decoding.capacity_bucket(n) for n in (5, 40, 41, 64, 65, 100)] == [
    8,
    40,
    48,
    64,
    80,
    112,
  ]


@pytest.mark.parametrize("n", [9, 17, 33, 100, 1000, 4097, 100_003])
def test_capacity_buckets_waste_at_most_a_quarter(n):
  b = km.decoding.capacity_bucket(n)
  assert n <= b <= 1.25 * n


def test_a_warm_generate_builds_its_policy_once(monkeypatch):
  model, _, _ = km.load_tiny()
  ids = np.random.default_rng(5).integers(4, 200, (1, 40)).astype(np.int32)
  calls = []
  real = policies.registry.make

  def counting(name, **options):
    calls.append(name)
    return real(name, **options)

  for name, options in (("snapkv", {"window": 8}), ("h2o", {})):
    kw = dict(policy=name, budget=24, max_new_tokens=4, **options)
    km.generate(model, ids, **kw)  # warm: compiled
    with monkeypatch.context() as m:
      m.setattr(policies.registry, "make", counting)
      m.setattr(policies, "make", counting)
      calls.clear()
      out = km.generate(model, ids, **kw)
      assert calls == [name]
      # an object is never rebuilt, and generates the same tokens
      calls.clear()
      obj = policies.H2O() if name == "h2o" else policies.SnapKV(window=8)
      same = km.generate(model, ids, policy=obj, budget=24, max_new_tokens=4)
      assert calls == []
    np.testing.assert_array_equal(same.tokens, out.tokens)
  with pytest.raises(ValueError, match="policy object"):
    km.generate(model, ids, policy=policies.SnapKV(), budget=40, window=8)


def test_one_layout_object_and_evidence_dict_reach_every_entry_point():
  # the cache layout (heads, StreamingLLM's re-indexing) is one argument, and HeadKV's head
  # importances are caller-given evidence like the calibrated fields
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(2).integers(4, 200, (2, 40)).astype(np.int32)
  layout = km.cache.Layout(reindex=True)
  many = km.generate_configs(
    model, ids, [16, 24], policy="streaming_llm", max_new_tokens=8, layout=layout
  )
  for k, b in enumerate((16, 24)):
    one = km.generate(model, ids, policy="streaming_llm", budget=b, max_new_tokens=8, layout=layout)
    np.testing.assert_array_equal(many.tokens[k], one.tokens)
  with pytest.raises(ValueError, match="layout"):
    km.cache.Layout(heads="heads")
  head_LG = np.random.default_rng(0).random((cfg.num_layers, cfg.num_kv_heads), np.float32) + 0.1
  ev = {"head_scores_LH": head_LG}
  out = km.generate(model, ids, policy="headkv", budget=24, window=4, evidence=ev)
  expected = budgets_lib.headkv(jnp.asarray(head_LG), 24, 4, beta=1.5, temp=1.0, q_len=40)
  np.testing.assert_array_equal(out.budget_LH[0], np.asarray(expected))
  # a re-compression reuses them (decode_every)
  again = km.generate(model, ids, policy="headkv", budget=24, window=4, decode_every=4, evidence=ev)
  assert again.tokens.shape == (2, 32)
  with pytest.raises(ValueError, match="head_scores_LH"):
    km.generate(model, ids, policy="headkv", budget=24, window=4)
  bad = {"head_scores_LH": head_LG[:1]}
  with pytest.raises(ValueError, match="head_scores_LH has shape"):
    km.generate(model, ids, policy="headkv", budget=24, window=4, evidence=bad)


def _no_prefill(monkeypatch):
  """Makes any prefill fail the test: the refusals below come before any work."""

  def fail(*args, **kwargs):
    raise AssertionError("a prefill ran before the refusal")

  monkeypatch.setattr(km.decoding, "jit_prefill", fail)


def test_lengths_past_the_context_are_refused_before_any_work(monkeypatch):
  model, cfg, _ = km.load_tiny()  # max_position_embeddings 4096
  assert cfg.max_positions == 4096
  ids = np.full((1, 40), 5, np.int32)
  long = np.full((1, 4097), 5, np.int32)
  _no_prefill(monkeypatch)
  new = r"max_new_tokens: 1000000000 tokens after a prompt of 40 tokens .* context of 4096"
  calls = [
    (lambda: km.generate(model, ids, max_new_tokens=10**9), new),
    (
      lambda: km.generate_configs(model, ids, [16], policy="streaming_llm", max_new_tokens=10**9),
      new,
    ),
    (
      lambda: km.generate(model, ids, max_new_tokens=4057),
      r"max_new_tokens: 4057 .* expected max_new_tokens <= 4056",
    ),
    (lambda: km.keep_mask(model, long, "snapkv", 64), "input_ids: a prompt of 4097 tokens"),
    (
      lambda: km.answer_configs(model, ids, np.full((1, 4057), 5), [16], policy="streaming_llm"),
      "answer_ids: 4057 tokens after a prompt of 40 tokens",
    ),
    (lambda: km.logprobs.stream_logprobs(model, long), "input_ids: a prompt of 4097 tokens"),
    (lambda: km.logprobs.teacher_forced_logprobs(model, long), "input_ids: a prompt of 4097"),
  ]
  for call, match in calls:
    with pytest.raises(ValueError, match=match):
      call()
  # a padded row counts its real tokens: 4000 columns, 40 of them real, leave room for 4056
  wide = np.zeros((1, 4000), np.int32)
  mask = np.zeros((1, 4000), np.int32)
  mask[0, -40:] = 1
  with pytest.raises(ValueError, match="max_new_tokens: 4057 tokens after a prompt of 40"):
    km.generate(model, km.Padded(wide, mask), max_new_tokens=4057)


def test_caches_above_the_memory_limit_are_refused_before_any_work(monkeypatch):
  model, cfg, _ = km.load_tiny()
  model.cfg = dataclasses.replace(cfg, max_positions=None)  # a context nobody knows
  ids = np.full((2, 40), 5, np.int32)
  prefill = km.decoding.jit_prefill
  _no_prefill(monkeypatch)
  monkeypatch.setattr(km.decoding, "MAX_CACHE_BYTES", 2**20)
  # 4 layers x 2 x 2 KV heads x (40 + 10**6) slots x 32 x 4 bytes x 2 rows: 15.3 GiB
  limit = r"kvjax.model.decoding.MAX_CACHE_BYTES = 0.0 GiB; .* raise the limit"
  with pytest.raises(ValueError, match=r"max_new_tokens: 1000000 with a prompt of 40 .*" + limit):
    km.generate(model, ids, max_new_tokens=10**6)
  with pytest.raises(
    ValueError, match=r"\(model context: unknown\) .* 4 configuration\(s\) x batch 2"
  ):
    km.generate_configs(model, ids, [8, 16, 24, 32], policy="snapkv", window=4, max_new_tokens=4000)
  with pytest.raises(ValueError, match="answer_ids: 4000 with a prompt of 39"):
    km.answer_configs(model, ids, np.full((2, 4000), 5), [16], policy="snapkv", window=4)
  with pytest.raises(ValueError, match="input_ids: 4000 with a prompt of 4000"):
    km.logprobs.stream_logprobs(model, np.full((2, 4000), 5, np.int32))
  # the estimate is the cache the policy builds: an evicting policy's stays at its budget, a
  # prefill policy's is its budget's capacity bucket plus the new tokens, and a run at exactly
  # the limit goes through
  assert km.decoding.slots_bound(policies.make("streaming_llm"), 8, 40, 10**6) == 8
  assert km.decoding.slots_bound(policies.make("snapkv", window=4), 8, 40, 3) == 8 + 3
  monkeypatch.setattr(km.decoding, "jit_prefill", prefill)
  monkeypatch.setattr(km.decoding, "MAX_CACHE_BYTES", 4 * 2 * 2 * (8 + 3) * 32 * 4 * 2)
  out = km.generate(model, ids, policy="snapkv", budget=8, window=4, max_new_tokens=3)
  assert out.tokens.shape == (2, 3)
  assert out.memory["kv_bytes_allocated"] == km.decoding.MAX_CACHE_BYTES


@pytest.mark.parametrize(
  "ids",
  [np.ones((1, 8), bool), np.zeros(8, np.int32), np.zeros((1, 2, 4), np.int32)],
  ids=["bool", "1-D", "3-D"],
)
def test_every_entry_point_refuses_ids_outside_the_one_rule(ids):
  model, cfg, _ = km.load_tiny()
  calls = {
    "generate": lambda: km.generate(model, ids, max_new_tokens=2),
    "generate_configs": lambda: km.generate_configs(model, ids, [4], policy="streaming_llm"),
    "keep_mask": lambda: km.keep_mask(model, ids, "streaming_llm", 4),
    "answer_configs": lambda: km.answer_configs(
      model, ids, np.ones((1, 2), np.int32), [4], policy="streaming_llm"
    ),
    "stream_logprobs": lambda: km.logprobs.stream_logprobs(model, ids),
    "teacher_forced_logprobs": lambda: km.logprobs.teacher_forced_logprobs(model, ids),
  }
  expected = "expected integer token ids, got dtype bool" if ids.dtype == bool else "got shape"
  for name, call in calls.items():
    with pytest.raises(ValueError, match=r"(prompt|input)_ids: .*" + expected):
      call()
      pytest.fail(f"{name} accepted ids {ids.dtype}{ids.shape}")


def test_headkv_takes_query_head_or_kv_head_importances_under_either_layout():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(2).integers(4, 200, (1, 40)).astype(np.int32)
  L, Hq, G = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
  head_LH = np.random.default_rng(0).random((L, Hq)) + 0.1
  group_LG = head_LH.reshape(L, G, Hq // G).mean(-1)
  kw = dict(policy="headkv", budget=24, window=4, max_new_tokens=2)
  ref = dict(beta=1.5, temp=1.0, q_len=40)
  # the documented [L, Hq] under the default KV-head cache: each group's mean importance
  out = km.generate(model, ids, evidence={"head_scores_LH": head_LH}, **kw)
  want = budgets_lib.headkv(jnp.asarray(group_LG, jnp.float32), 24, 4, **ref)
  np.testing.assert_array_equal(out.budget_LH[0], np.asarray(want))
  # [L, G] under a query-head cache: each query head takes its group's importance
  out = km.generate(model, ids, evidence={"head_scores_LH": group_LG}, layout="query", **kw)
  want = budgets_lib.headkv(jnp.asarray(np.repeat(group_LG, Hq // G, 1), jnp.float32), 24, 4, **ref)
  np.testing.assert_array_equal(out.budget_LH[0], np.asarray(want))


def test_evidence_no_model_can_provide_is_named_with_what_to_use_instead(monkeypatch):
  model, cfg, _ = km.load_tiny()
  ids = np.full((1, 40), 5, np.int32)
  _no_prefill(monkeypatch)
  legacy = (
    r"policy: 'h2o_kvfactory_legacy' reads legacy_column_sums_LHT, KVCache-Factory's legacy "
    r"non-causal prefill column sums .* use 'h2o'"
  )
  with pytest.raises(ValueError, match=legacy):
    km.generate(model, ids, policy="h2o_kvfactory_legacy", budget=24)
  with pytest.raises(ValueError, match=legacy):
    km.generate_configs(model, ids, [24], policy="h2o_kvfactory_legacy")
  with pytest.raises(ValueError, match=legacy):
    km.keep_mask(model, ids, "h2o_kvfactory_legacy", 24)
  with pytest.raises(ValueError, match=legacy):
    km.answer_configs(model, ids, ids[:, :2], [24], policy="h2o_kvfactory_legacy")
  with pytest.raises(ValueError, match="not caller-given evidence.*legacy_column_sums_LHT"):
    km.generate(model, ids, policy="h2o", budget=24, evidence={"legacy_column_sums_LHT": 0})
  oracle = "policy: 'oracle' reads future_attn_LHST, .* use kvjax.model.answer_configs"
  with pytest.raises(ValueError, match=oracle):
    km.generate(model, ids, policy="oracle", budget=24)
  with pytest.raises(ValueError, match=oracle):
    km.keep_mask(model, ids, "oracle", 24)


def test_generate_decodes_per_layer_as_the_stacked_step(monkeypatch):
  """On CPU ``generate`` decodes over the cache split by layer, each layer with its own
  capacity where the allocation follows from the budget alone (PyramidKV), one capacity where
  it depends on the input (Ada-KV: no compile per prompt); the tokens and the cache it returns
  are those of the stacked step."""
  from flax import nnx

  from kvjax.model import cache as cache_lib
  from kvjax.model import decoding

  cfg = km.ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
  )
  model = km.Llama(cfg, rngs=nnx.Rngs(0))
  ids = np.random.default_rng(0).integers(0, 97, (2, 160)).astype(np.int32)
  budget = np.zeros((2, 4, 2), np.int32)
  pyramid = policies.build("pyramidkv")
  budget[:] = np.asarray(budgets_lib.pyramid(4, 48, pyramid.observation_window, 160))[:, None]
  caps = decoding._layer_capacity(cfg, pyramid, budget, 160, 10)
  assert caps is not None and caps[0] > caps[-1]  # lower layers hold more
  assert decoding._layer_capacity(cfg, policies.build("adakv_snapkv"), budget, 160, 10) is None
  same = np.full_like(budget, 48)  # one budget for every layer: one capacity
  assert decoding._layer_capacity(cfg, policies.build("snapkv"), same, 160, 10) is None
  for policy in ("pyramidkv", "adakv_snapkv", "h2o"):
    out = km.generate(model, ids, policy=policy, budget=48, max_new_tokens=10)
    monkeypatch.setattr(cache_lib, "decodes_per_layer", lambda spec, cache: False)
    ref = km.generate(model, ids, policy=policy, budget=48, max_new_tokens=10)
    monkeypatch.undo()
    np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=policy)
    assert out.memory == ref.memory, policy


def test_sampling_draws_from_its_key_and_greedy_is_its_zero_temperature():
  model, cfg, _ = km.load_tiny()
  ids = np.random.default_rng(5).integers(4, cfg.vocab_size, (2, 24)).astype(np.int32)
  kw = dict(policy="snapkv", budget=12, window=4, max_new_tokens=8)
  greedy = km.generate(model, ids, **kw).tokens
  np.testing.assert_array_equal(km.generate(model, ids, sampling=km.GREEDY, **kw).tokens, greedy)
  hot = [km.Sampling(temperature=5.0, rng=jax.random.key(s)) for s in (0, 0, 1)]
  a, b, c = (km.generate(model, ids, sampling=s, **kw).tokens for s in hot)
  np.testing.assert_array_equal(a, b)  # one key, one draw
  assert not np.array_equal(a, c)  # another key draws other tokens at a high temperature
  assert not np.array_equal(a, greedy)
  with pytest.raises(ValueError, match="^sampling: expected a kvjax.model.decoding.Sampling"):
    km.generate(model, ids, sampling=0.5, **kw)
