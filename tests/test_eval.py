"""Answers through the compressed cache, the evaluation loop and the shipped tiny model."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import kvjax.model as km
from configs import eval as eval_config
from kvjax import policies
from kvjax.eval import evaluate, funnel, report, tasks, vocab

TOK = vocab.tiny_tokenizer()


@pytest.fixture(scope="module")
def random_model():
  cfg = km.ModelConfig(
    vocab_size=TOK.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
  )
  return km.Llama(cfg, rngs=nnx.Rngs(0))


def _batch(task="mqar", length=100, n=3, **opts):
  exs = [tasks.generate(task, TOK, length=length, seed=s, **opts) for s in range(n)]
  return exs, *tasks.batch(exs)


def test_teacher_forced_logprobs_match_the_full_forward(random_model):
  exs, P, A, S = _batch(num_pairs=4, num_queries=2)
  Q = exs[0].question_len
  out = km.answer_configs(
    random_model,
    P,
    A,
    np.array([1]),
    policy="full",
    question=km.Question(length=Q, answer_given=~S),
  )
  seq = jnp.asarray(np.concatenate([P, A[:, :-1]], 1))
  logits = km.forward(random_model.cfg, random_model.params(), seq)
  ref = jax.nn.log_softmax(logits[:, P.shape[1] - 1 :], -1)
  np.testing.assert_allclose(out.logprobs[0], np.asarray(ref), atol=2e-5)
  # greedy: each scored position is the argmax after the model's own earlier outputs
  fed = np.where(S, out.predicted[0], A)  # what the greedy pass fed at each answer position
  seq = jnp.asarray(np.concatenate([P, fed[:, :-1]], 1))
  logits = km.forward(random_model.cfg, random_model.params(), seq)
  greedy = np.asarray(logits[:, P.shape[1] - 1 :].argmax(-1))
  np.testing.assert_array_equal(out.predicted[0][S], greedy[S])


# every policy of the evaluation but HeadKV (which needs measured head scores)
POLICIES = [p["policy"] for p in eval_config.POLICIES if p["policy"] != "headkv"]


# CI's quick mode: every policy in_window, and in each other mode one prefill-time and one
# decode-time policy (the two cache paths a question mode changes)
QUICK_CASES = {(p, "in_window") for p in POLICIES} | {
  ("snapkv", "after"),
  ("streaming_llm", "after"),
  ("h2o", "compressed"),
  ("oracle", "compressed"),
}
CASES = [
  pytest.param(p, q, marks=() if (p, q) in QUICK_CASES else pytest.mark.slow)
  for p, q in [(p, "in_window") for p in POLICIES]
  + [(p, q) for q in ("after", "compressed") for p in ("snapkv", "h2o", "streaming_llm", "oracle")]
]


@pytest.mark.parametrize(("policy", "question"), CASES)
def test_budget_covering_the_context_matches_the_full_cache_exactly(random_model, policy, question):
  exs, P, A, S = _batch(num_pairs=4, num_queries=2)
  kw = dict(question=km.Question(exs[0].question_len, question, answer_given=~S))
  full = km.answer_configs(random_model, P, A, np.array([1]), policy="full", **kw)
  cover = P.shape[1] + A.shape[1]  # context, question and answer: nothing is ever evicted
  out = km.answer_configs(random_model, P, A, np.array([cover, 40]), policy=policy, **kw)
  np.testing.assert_array_equal(out.predicted[0], full.predicted[0])
  np.testing.assert_allclose(out.logprobs[0], full.logprobs[0], atol=2e-5)
  assert evaluate.kl_divergence(full.logprobs[0], out.logprobs[0], S) < 1e-5
  assert out.budget_LH[1].mean() <= 40 * 1.05  # layer schedules move budget, keep the total


def test_question_modes_differ_only_in_what_compression_sees(random_model):
  exs, P, A, S = _batch("multi_key", length=160, n=2)

  def answers(policy, question, budget=40, question_len=exs[0].question_len):
    budgets = np.array([budget])
    kw = dict(policy=policy, question=km.Question(question_len, question))
    return km.answer_configs(random_model, P, A, budgets, **kw)

  def assert_same(got, want, err_msg):
    np.testing.assert_array_equal(got.predicted, want.predicted, err_msg=err_msg)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5, err_msg=err_msg)

  # the full cache: every mode feeds the answer through the same keys and values
  full = {q: answers("full", q, budget=1) for q in km.answers.QUESTION_MODES}
  for q in ("after", "compressed"):
    assert_same(full[q], full["in_window"], f"full cache, {q}")
  # "compressed" is "after" with a one-token question: the question is compressed as context
  np.testing.assert_array_equal(
    answers("snapkv", "compressed").logprobs,
    answers("snapkv", "after", question_len=1).logprobs,
  )
  # key norms read the context's keys alone, which causal attention computes alike whether or not
  # the question was prefilled after them
  assert_same(answers("knorm", "in_window"), answers("knorm", "after"), "knorm")
  # SnapKV's observation window holds the question in_window only: another kept set, answers
  # that differ far beyond the tolerance above
  snapkv = {q: answers("snapkv", q).logprobs for q in ("in_window", "after")}
  assert np.abs(snapkv["in_window"] - snapkv["after"]).max() > 100 * 2e-5


def test_answer_inputs_are_validated(random_model):
  exs, P, A, S = _batch(num_pairs=4, num_queries=2)
  with pytest.raises(ValueError, match="answer_ids"):
    km.answer_configs(random_model, P, A[:1], np.array([50]), policy="snapkv")
  with pytest.raises(ValueError, match="answer_given"):
    km.answer_configs(
      random_model,
      P,
      A,
      np.array([50]),
      policy="snapkv",
      question=km.Question(answer_given=S[:, :1]),
    )
  with pytest.raises(ValueError, match="budget"):
    km.answer_configs(random_model, P, A, np.array([20]), policy="snapkv")
  with pytest.raises(ValueError, match="budgets"):
    km.answer_configs(random_model, P, A, np.array(50), policy="snapkv")
  with pytest.raises(ValueError, match="budgets"):
    km.answer_configs(random_model, P, A, np.zeros(0, np.int32), policy="snapkv")
  with pytest.raises(ValueError, match="layout"):
    km.answer_configs(random_model, P, A, np.array([50]), policy="snapkv", layout="heads")
  with pytest.raises(ValueError, match="question"):
    km.answer_configs(
      random_model, P, A, np.array([50]), policy="snapkv", question=km.Question(mode="before")
    )
  # all-zero importances: no silent window-only
  with pytest.raises(ValueError, match="head_scores: expected finite non-negative"):
    km.answer_configs(
      random_model,
      P,
      A,
      np.array([50]),
      policy="headkv",
      evidence={"head_scores_LH": np.zeros((2, 2))},
    )
  with pytest.raises(ValueError, match="question.length"):
    km.answer_configs(
      random_model, P, A, np.array([50]), policy="snapkv", question=km.Question(length=100)
    )


def test_funnel_statistics_by_hand():
  p = np.zeros((1, 2, 4))
  p[0, 0] = [1.0, 0, 0, 0]
  p[0, 1] = [0.25, 0.25, 0.25, 0.25]
  doc = np.array([-1, 0, 0, 1])
  s = funnel.row_statistics(p, doc, q_index=np.array([1, 3]))
  assert s["first_token_mass"] == pytest.approx((1.0 + 0.25) / 2)
  assert s["entropy"] == pytest.approx(np.log(4) / 2)
  assert s["keys_for_90"] == pytest.approx((1 + 4) / 2)
  assert s["own_document_mass"] == pytest.approx((0.0 + 0.25) / 2)
  ids, doc = funnel.multi_document_prompt(TOK, num_docs=3, doc_len=20)
  assert ids.size == 61 and doc.tolist().count(1) == 20 and doc[0] == -1


# --------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def tiny():
  return km.load_tiny()


def test_load_tiny_returns_model_config_and_tokenizer(tiny):
  model, cfg, tok = tiny
  assert cfg.num_layers >= 4 and cfg.num_kv_heads < cfg.num_heads
  assert tok.vocab == TOK.vocab and cfg.vocab_size == TOK.vocab_size
  card = json.loads((km.assets.tiny_path() / "card.json").read_text())
  assert "full_cache_accuracy" in card


# the tasks the shipped model holds to the 95 % target (card.json has every task)
MASTERED = ("passkey", "single_needle", "multi_key", "variable_tracking", "mqar")


@pytest.mark.parametrize("task", tasks.TASKS)
def test_tiny_model_reaches_its_stated_accuracy_on_held_out_examples(tiny, task):
  model, cfg, tok = tiny
  card = json.loads((km.assets.tiny_path() / "card.json").read_text())
  stated = card["full_cache_accuracy"]["1024"][task]
  stated_recall = card["full_cache_ruler_recall"]["1024"][task]
  if task in MASTERED:
    assert stated >= 0.95
  exs = evaluate.examples(task, tok, 1024, 8, tasks.EVAL_OPTIONS[task], seed=99)
  # every task's answers padded to one length (fed after the answer, never scored: causal
  # attention leaves the scored positions unchanged), so all tasks share one compiled program
  P, A, S = tasks.batch(exs, answer_len=32)
  out = km.answer_configs(
    model, P, A, np.array([1]), policy="full", question=km.Question(answer_given=~S)
  )
  acc = evaluate.accuracy(exs, out.predicted[0]).mean()
  recall = evaluate.recall(exs, out.predicted[0]).mean()
  # 8 fresh held-out examples: 2.5 binomial standard deviations below the stated rate, and at
  # least one miss
  for got, rate in ((acc, stated), (recall, stated_recall)):
    margin = max(1 / 8, 2.5 * np.sqrt(rate * (1 - rate) / 8))
    assert got >= rate - margin - 1e-9, (task, got, rate)


def test_on_the_tiny_model_the_oracle_beats_random_and_keeps_the_answer(tiny):
  model, cfg, tok = tiny
  exs = evaluate.examples("multi_key", tok, 512, 8, {"num_distractors": 3}, seed=3)
  P, A, S = tasks.batch(exs)
  kw = dict(question=km.Question(max(e.question_len for e in exs)))
  full = km.answer_configs(model, P, A, np.array([1]), policy="full", **kw)
  out = {
    p: km.answer_configs(model, P, A, np.array([16]), policy=p, **kw) for p in ("oracle", "random")
  }
  kl = {p: evaluate.kl_divergence(full.logprobs[0], o.logprobs[0], S) for p, o in out.items()}
  acc = {p: evaluate.accuracy(exs, o.predicted[0]).mean() for p, o in out.items()}
  assert kl["oracle"] < kl["random"] and acc["oracle"] >= acc["random"]
  assert acc["oracle"] >= evaluate.accuracy(exs, full.predicted[0]).mean() - 1 / 8
  # HeadKV's importance (retrieval mass near the needle) is positive and differs across heads
  scores = evaluate.head_retrieval_scores(model, tok, count=4)
  assert scores.shape == (cfg.num_layers, cfg.num_kv_heads)
  assert scores.min() > 0 and scores.max() > 2 * scores.min()


def test_eval_quick_writes_results_resumes_and_plots(tmp_path):
  c = eval_config.get_config("quick")
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  assert list(table.columns) == evaluate.COLUMNS
  assert ((table["recall"] >= table["accuracy"]) & (table["recall"] <= 1)).all()
  budget_rows = table[table["kind"] == "budget"]
  full = budget_rows[budget_rows["policy"] == "full"]
  assert len(full) == 2 and (full["kl"] == 0).all()
  assert (tmp_path / "accuracy_vs_budget.png").exists()
  assert (tmp_path / "needle_heatmap_snapkv.png").exists()
  md = (tmp_path / "tables.md").read_text()
  assert "**Full-cache accuracy**" in md and "| snapkv |" in md and "Needle heatmap, snapkv" in md
  n = len(table)
  # nothing left to run: no duplicates; where compiled programs go is not the run's configuration
  c.compilation_cache = ""
  again = evaluate.run(c, tmp_path, log=lambda *_: None)
  assert len(again) == n
  c.budgets = (64,)
  with pytest.raises(ValueError, match="different configuration"):
    evaluate.run(c, tmp_path, log=lambda *_: None)
  # rows carry what each cache held, intervals around their accuracy and every example's outcome
  assert (full["kv_fraction"] == 1).all() and (budget_rows["kv_fraction"] <= 1).all()
  assert (table["accuracy_lo"] <= table["accuracy"]).all()
  assert (table["accuracy"] <= table["accuracy_hi"]).all()
  outcomes = table["example_correct"].map(report.per_example)
  assert [o.mean() for o in outcomes] == pytest.approx(table["accuracy"].tolist())
  assert (tmp_path / "accuracy_vs_memory.png").exists()
  assert "K/V held as a fraction of the full cache" in md and "exact McNemar" in md
  # a results file of another layout (an older one without the memory and outcome columns) is
  # refused before the claim is touched, never appended to
  c = eval_config.get_config("quick")
  claim = (tmp_path / "eval.json").read_bytes()
  old = table.drop(columns=[*evaluate.MEMORY_COLUMNS, *evaluate.INTERVAL_COLUMNS])
  old.drop(columns=evaluate.EXAMPLE_COLUMNS).to_csv(tmp_path / "results.csv", index=False)
  written = (tmp_path / "results.csv").read_bytes()
  with pytest.raises(ValueError, match=r"workdir: .* lacks the columns \['kv_bytes_held'"):
    evaluate.run(c, tmp_path, log=lambda *_: None)
  assert (tmp_path / "results.csv").read_bytes() == written
  assert (tmp_path / "eval.json").read_bytes() == claim
  table.drop(columns=["recall"]).to_csv(tmp_path / "results.csv", index=False)
  with pytest.raises(ValueError, match="columns"):
    evaluate.run(c, tmp_path, log=lambda *_: None)


def test_rows_count_what_each_cache_really_held(random_model):
  exs, *_ = _batch("single_needle", length=128, n=2)
  cfg = random_model.cfg
  Tc = 128 - max(e.question_len for e in exs)
  duo = policies.make("duo_attention", sinks=4)
  pre = evaluate.prefill_examples(
    random_model, exs, oracle=False, needs=evaluate.policy_needs([("duo", duo)])
  )
  per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 4  # K and V, float32

  def row(budget, policy, **kw):
    shared = evaluate.Shared(pre)
    (r,) = evaluate.evaluate_group(random_model, exs, [budget], policy, shared, **kw)["rows"]
    return r

  full = row(Tc, evaluate.FULL)
  assert full["kv_bytes_held"] == Tc * per_token and full["kv_fraction"] == 1.0
  assert row(40, policies.make("snapkv"))["kv_fraction"] == pytest.approx(40 / Tc)
  # DuoAttention's two retrieval heads (the highest gates) keep the whole context, its two
  # streaming heads the budget: it holds far more than the nominal 32 tokens per head
  gates = np.asarray([[0.9, 0.1], [0.2, 0.8]], np.float32)
  held = row(32, duo, evidence={"retrieval_heads_LG": gates})
  assert held["kv_fraction"] == pytest.approx((2 * 32 + 2 * Tc) / (4 * Tc))
  assert held["kv_bytes_held"] == (2 * 32 + 2 * Tc) * per_token // 4


def test_example_batches_merge_to_the_rows_of_one_batch(random_model):
  exs, *_ = _batch(num_pairs=4, num_queries=2, n=4)
  shape = evaluate.shared_shape([exs])

  def group(part):
    pre = evaluate.prefill_examples(random_model, part, oracle=False, shape=shape)
    full = evaluate.evaluate_group(random_model, part, [200], evaluate.FULL, evaluate.Shared(pre))
    snapkv = policies.make("snapkv")
    shared = evaluate.Shared(pre, full["answers"])
    return evaluate.evaluate_group(random_model, part, [40, 64], snapkv, shared)

  whole = group(exs)["rows"]
  parts = [group(b) for b in evaluate.example_batches(exs, 2)]
  assert [len(b) for b in evaluate.example_batches(exs, 3)] == [3, 1]
  merged = evaluate.merge_batches(parts)
  for a, b in zip(merged, whole, strict=True):
    assert a["n"] == b["n"] == 4 and a["budget"] == b["budget"]
    for key in ("accuracy", "recall", "token_accuracy", "kl", "kv_bytes_held", "kv_fraction"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
    for key in ("example_correct", "example_recall"):  # concatenated in example order
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_group_cut_mid_write_is_dropped_and_rerun(tmp_path):
  import pandas as pd

  base = dict(task="t", length=64, kind="budget", question="after", accuracy=1.0)
  rows = [dict(base, policy="snapkv", budget=b) for b in (8, 16, 32)]
  rows += [dict(base, policy="h2o", budget=8)]
  path = tmp_path / "results.csv"
  pd.DataFrame(rows).to_csv(path, index=False)
  expected = {("t", 64, "snapkv", "budget", "after"): 3, ("t", 64, "h2o", "budget", "after"): 3}
  done = evaluate.complete_groups(pd.read_csv(path), path, expected)
  assert done == {("t", 64, "snapkv", "budget", "after")}
  assert len(pd.read_csv(path)) == 3  # the partial h2o group is gone and will rerun


@pytest.mark.parametrize(
  ("field", "value", "match"),
  [
    ("heatmap.policies", ("snapkv", "snapkvv"), "heatmap.policies"),
    ("policies", (dict(label="x", policy="snapkvv"),), "unknown policy 'snapkvv'"),
    ("policies", (dict(label="x", policy="snapkv", windw=8),), "windw"),
    ("question", "in_window,before", "question"),
    ("budgets", (0, 64), "budgets"),
    ("examples", 0, "examples"),
    ("batch", 3, "divisor of examples=4"),
    ("tasks", {"needle": {}}, "tasks"),
    ("policies", (), r"policies: expected at least one policy entry"),
    ("lengths", (256, 256), r"lengths: 256 appear more than once"),
    ("budgets", (48, 48), r"budgets: 48 appear more than once"),
    ("heatmap.depths", (0.0, 0.0), r"heatmap.depths: 0.0 appear more than once"),
    ("reference", "snapkvv", r"reference: 'snapkvv' is not a policy label"),
  ],
)
def test_a_bad_eval_config_fails_before_any_work(tmp_path, field, value, match):
  c = eval_config.get_config("quick")
  if field.startswith("heatmap."):
    c.heatmap[field.split(".")[1]] = value
  elif field == "tasks":
    c.tasks = ml_collections.ConfigDict(value)
  else:
    c[field] = value
  with pytest.raises(ValueError, match=match):
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()  # nothing claimed: the corrected config may use it


def test_new_methods_run_through_the_evaluation(tmp_path):
  c = eval_config.get_config("methods_quick")
  keep = ("expected_attention", "critical_snapkv", "think_snapkv", "kvzip")
  c.policies = tuple(p for p in c.policies if p["label"] in keep)
  c.question, c.budgets = "after", (64,)
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  rows = table[table["policy"].isin(keep)]
  assert sorted(rows["policy"]) == sorted(keep) and rows["accuracy"].between(0, 1).all()
  assert (rows["kl"] >= 0).all()


def test_kvpress_presses_run_through_the_evaluation(tmp_path):
  """configs/eval.py's PRESSES (issue 31) answer through the compressed cache, both question
  modes (one budget, two examples: a smoke run of every preset entry)."""
  c = eval_config.get_config("presses_quick")
  c.budgets, c.examples = (64,), 1
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  labels = {p["label"] for p in c.policies}
  assert labels <= set(table["policy"])
  rows = table[table["policy"].isin(labels)]
  assert rows["accuracy"].between(0, 1).all() and (rows["kl"] >= 0).all()
  assert set(rows["question"]) == {"in_window", "after"}


def test_calibrated_methods_need_a_calibration_file(tmp_path):
  c = eval_config.get_config("methods_quick")
  c.policies = (dict(label="qfilter", policy="qfilter"),)
  with pytest.raises(ValueError, match="experiments.calibrate"):
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()
  path = tmp_path / "calibration.npz"
  np.savez(path, qfilters_LGD=np.ones((2, 2, 4), np.float32))
  c.calibration = str(path)
  got = evaluate.load_calibration(c, {"qfilters_LGD", "keys_LGTD"})
  assert list(got) == ["qfilters_LGD"] and got["qfilters_LGD"].shape == (2, 2, 4)
  c.policies = (dict(label="duo", policy="duo_attention"),)
  with pytest.raises(ValueError, match="retrieval_heads_LG_official"):
    evaluate.validate_config(c)


def test_report_tables_by_hand():
  import pandas as pd

  base = dict(kind="budget", depth=np.nan, recall=1.0, token_accuracy=1.0, n=2, seconds=0.0)
  rows = [dict(base, task="a", length=64, policy="full", question="after", budget=64)]
  rows += [dict(base, task="b", length=64, policy="full", question="after", budget=64)]
  rows += [dict(base, task=t, length=64, policy="snapkv", question="after", budget=8) for t in "ab"]
  acc = [1.0, 0.5, 0.5, 0.0]
  table = pd.DataFrame(
    [r | {"accuracy": a, "kl": 0.1 * i} for i, (r, a) in enumerate(zip(rows, acc, strict=True))]
  )
  assert report.full_cache(table).to_dict() == {64: {"a": 1.0, "b": 0.5}}
  frame = report.by_budget(table, "after")
  assert frame.loc["snapkv"].tolist() == [0.75, 0.25]  # full's mean, then budget 8's
  md = report.markdown(table)
  assert "| snapkv | 0.75 | 0.25 |" in md and "| snapkv | 0.050 | 0.250 |" in md


def test_report_intervals_and_paired_marks_by_hand():
  import pandas as pd

  base = dict(task="a", length=64, kind="budget", question="after", depth=np.nan, kl=0.0)
  outcomes = {"full": [1] * 8, "snapkv": [1] * 8, "h2o": [0] * 8, "tova": [1] * 7 + [0]}
  rows = []
  for policy, correct in outcomes.items():
    text = " ".join(map(str, correct))
    rows.append(
      dict(
        base,
        policy=policy,
        budget=64 if policy == "full" else 8,
        accuracy=np.mean(correct),
        recall=np.mean(correct),
        n=8,
        kv_fraction=1.0 if policy == "full" else 0.125,
        example_correct=text,
        example_recall=text,
      )
    )
  table = pd.DataFrame(rows)
  frame, note = report.interval_table(table, "after", "accuracy")
  # Wilson at 0 of 8: [0, z^2 / (8 + z^2)]; h2o against snapkv: 8 discordant pairs one way,
  # exact McNemar p = 2 / 2^8 (significant after Holm too); tova: one pair, p = 1
  assert frame.loc["h2o", 8] == "0.00 [0.00, 0.32]**"
  assert frame.loc["tova", 8] == "0.88 [0.53, 0.98]"
  assert frame.loc["snapkv", 8] == "1.00 [0.68, 1.00]"  # the reference is not tested
  assert "n = 8 examples per cell" in note and "`snapkv`" in note and "2 comparisons" in note
  assert (
    report.paired_pvalue(table[table["policy"] == "h2o"], table[table["policy"] == "snapkv"])
    == 2 / 2**8
  )
  # against the full cache instead (its rows at the context length pair with every budget)
  frame, note = report.interval_table(table, "after", "accuracy", reference="full")
  assert frame.loc["snapkv", 8] == "1.00 [0.68, 1.00]" and frame.loc["h2o", 8].endswith("**")
  md = report.markdown(table)
  assert "paired bootstrap" in md and "| h2o | 0.125 | 0.125 |" not in md
  assert "| tova | 1.000 | 0.125 |" in md  # the fraction of the full cache held


def test_question_modes_parse():
  c = eval_config.get_config("quick")
  c.question = "in_window, after"
  assert evaluate.question_modes(c) == ("in_window", "after")


def tiny_eval(**fields) -> ml_collections.ConfigDict:
  """One task, one length, two examples, one policy and no heatmap: a run of seconds."""
  c = eval_config.get_config("quick")
  c.tasks = ml_collections.ConfigDict({"single_needle": {}})
  c.lengths, c.examples, c.budgets = (128,), 2, (48,)
  c.policies = tuple(p for p in eval_config.POLICIES if p["label"] == "streaming_llm")
  c.heatmap.policies = ()
  for k, v in fields.items():
    c[k] = v
  return c


def test_results_without_eval_json_are_refused_and_batch_may_change(tmp_path):
  quiet = dict(log=lambda *_: None)
  table = evaluate.run(tiny_eval(batch=2), tmp_path, **quiet)
  results = (tmp_path / "results.csv").read_bytes()
  # the batch size and the compilation cache change no result: the run resumes, nothing to do
  logs = []
  again = evaluate.run(tiny_eval(batch=1, compilation_cache=""), tmp_path, log=logs.append)
  assert logs == [] and len(again) == len(table)
  assert (tmp_path / "results.csv").read_bytes() == results
  assert json.loads((tmp_path / "eval.json").read_text())["batch"] == 1  # the last settings
  # another seed into a directory whose claim is gone: refused, the old rows never adopted
  (tmp_path / "eval.json").unlink()
  with pytest.raises(ValueError, match=r"holds results but no eval.json"):
    evaluate.run(tiny_eval(seed=1), tmp_path, **quiet)
  assert (tmp_path / "results.csv").read_bytes() == results
  assert not (tmp_path / "eval.json").exists()


def _clean(workdir) -> bool:
  return not workdir.exists() or not any(workdir.iterdir())


def test_model_calibration_and_lengths_are_checked_before_the_workdir(tmp_path):
  w = tmp_path / "w"
  quiet = dict(log=lambda *_: None)
  with pytest.raises(ValueError, match=r"model: '/no/such/model' does not exist"):
    evaluate.run(tiny_eval(model="/no/such/model"), w, **quiet)
  with pytest.raises(ValueError, match=r"model: 'tinyy' does not exist; expected 'tiny'"):
    evaluate.run(tiny_eval(model="tinyy"), w, **quiet)
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.gguf"):
    evaluate.run(tiny_eval(model=str(empty)), w, **quiet)
  with pytest.raises(ValueError, match=r"length: 20 tokens cannot hold"):
    evaluate.run(tiny_eval(lengths=(20,), budgets=(8,)), w, **quiet)
  other = tmp_path / "calibration.npz"  # measured on a model of 2 layers and head_dim 4
  np.savez(other, qfilters_LGD=np.ones((2, 2, 4), np.float32))
  c = tiny_eval(policies=(dict(label="qfilter", policy="qfilter"),), calibration=str(other))
  with pytest.raises(ValueError, match=r"calibration: .* shape \(2, 2, 4\), expected \(4, 2, 32\)"):
    evaluate.run(c, w, **quiet)
  assert _clean(w)  # no eval.json, lock file or results: the corrected config starts afresh


def test_empty_workdirs_and_missing_fields_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"workdir: got the empty path ''"):
    evaluate.run(tiny_eval(), "", log=lambda *_: None)
  c = tiny_eval()
  del c["heatmap"]
  with pytest.raises(ValueError, match=r"config.heatmap.task: missing"):
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert _clean(tmp_path / "w")


def test_the_entry_point_refuses_an_empty_workdir_and_writes_nothing(tmp_path):
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.eval",
      f"--config={root}/configs/eval.py:quick",
      "--config.workdir=",
      "--config.model=/no/such/model",  # were the workdir accepted, the run would stop here
    ],
    cwd=tmp_path,  # "" is this directory: it must stay empty
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root)),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode != 0 and "workdir: got the empty path ''" in out.stderr, out.stderr[-2000:]
  assert not any(tmp_path.iterdir())


def test_rulers_tasks_are_evaluation_tasks(tmp_path):
  """RULER's synthetic tasks are accepted as evaluation tasks, their examples come from
  ``kvjax.eval.ruler``, and a heatmap refuses the tasks that have no needle to place."""
  from kvjax.eval import ruler

  c = tiny_eval(tasks=ml_collections.ConfigDict({"niah_single_1": {}, "cwe": {}}))
  evaluate.validate_config(c)
  c = tiny_eval()
  c.heatmap.update(task="cwe", policies=("streaming_llm",))
  with pytest.raises(ValueError, match="heatmap.task: 'cwe' has no needle"):
    evaluate.validate_config(c)
  with pytest.raises(ValueError, match="tasks: 'niah_single_9'"):
    evaluate.validate_config(tiny_eval(tasks=ml_collections.ConfigDict({"niah_single_9": {}})))
  tok = _trained_bpe(tmp_path)
  exs = evaluate.examples("niah_multikey_2", tok, 300, 2, {}, depth=0.5)
  want = [ruler.generate("niah_multikey_2", tok, length=300, seed=s, depth=0.5) for s in (0, 1)]
  assert [len(e.prompt) for e in exs] == [300, 300]
  assert all(e.task == "niah_multikey_2" for e in exs)
  # held-out seeds: other examples than the generator's first seeds
  assert [e.prompt.tolist() for e in exs] != [w.prompt.tolist() for w in want]


def _trained_bpe(tmp_path):
  """A byte-level BPE tokenizer trained offline on RULER's prose (the tiny model's word
  vocabulary cannot spell RULER's words)."""
  tk = pytest.importorskip("tokenizers")
  from kvjax.eval import ruler
  from kvjax.model import tokenizer as tok_lib

  bpe = tk.Tokenizer(tk.models.BPE(unk_token=None))
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
    vocab_size=1000, special_tokens=["<s>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()
  )
  bpe.train_from_iterator([ruler.NOISE, *ruler.essay_sentences()[:200]], trainer)
  path = tmp_path / "tokenizer.json"
  bpe.save(str(path))
  return tok_lib.HFTokenizer(path, bos_token="<s>")


def test_learned_evidence_comes_from_the_configs_trained_file(tmp_path):
  """A KVzap policy reads its surrogate's evidence on each batch's context: the run needs the
  file (refused before the workdir otherwise) and writes its rows."""
  from kvjax import checks
  from kvjax.model import kvzap

  model, cfg, _ = km.load_tiny()
  rng = np.random.default_rng(0)
  X = rng.normal(size=(64, cfg.num_layers, cfg.hidden_size)).astype(np.float32)
  y = rng.normal(size=(64, cfg.num_layers, cfg.num_kv_heads)).astype(np.float32)
  identity = checks.model_identity(cfg, model.params())
  path = kvzap.save(
    tmp_path / "kvzap.npz", kvzap.fit_linear(X, y), {"model": "tiny"}, identity=identity
  )
  pols = (dict(label="kvzap", policy="kvzap"),)
  with pytest.raises(ValueError, match="kvzap: policies read kvzap_LGT"):
    evaluate.validate_config(tiny_eval(policies=pols))
  assert not (tmp_path / "run").exists()
  table = evaluate.run(
    tiny_eval(policies=pols, kvzap=str(path)), tmp_path / "run", log=lambda *_: None
  )
  assert set(table["policy"]) == {"full", "kvzap"}


def test_an_evaluation_at_ratios_writes_each_rows_ratio(tmp_path):
  """``ratios`` instead of ``budgets``: each row holds its ratio and the token budget it kept,
  equal to the run at those budgets; the tables have one column per ratio."""
  c = tiny_eval(budgets=(), ratios=(0.5, 0.75), question="after")
  table = evaluate.run(c, tmp_path / "r", log=lambda *_: None)
  mine = table[table["policy"] == "streaming_llm"].sort_values("ratio")
  Tc = 128 - tasks.generate("single_needle", TOK, length=128, seed=0).question_len
  assert list(mine["ratio"]) == [0.5, 0.75]
  assert list(mine["budget"]) == [int(Tc * 0.5), int(Tc * 0.25)]
  assert list(table.loc[table["policy"] == "full", "ratio"]) == [0.0]
  by_budget = evaluate.run(
    tiny_eval(budgets=tuple(int(b) for b in mine["budget"]), question="after"),
    tmp_path / "b",
    log=lambda *_: None,
  )
  theirs = by_budget[by_budget["policy"] == "streaming_llm"].sort_values("budget", ascending=False)
  for col in ("accuracy", "kl", "kv_bytes_held", "example_correct"):
    assert list(mine[col]) == list(theirs[col]), col
  assert by_budget["ratio"].isna().all() or (by_budget["policy"] == "full").all()
  md = (tmp_path / "r" / "tables.md").read_text()
  assert "accuracy vs compression ratio, question `after`" in md and "| 0.5 | 0.75 |" in md


def test_eval_ratios_are_checked_before_any_work(tmp_path):
  for fields, match in [
    (dict(ratios=(0.5,)), r"ratios: \(0.5,\) given with budgets \(48,\); expected budgets or"),
    (dict(budgets=(), ratios=(1.0,)), r"ratios: 1.0 is not a compression ratio"),
    (dict(budgets=(), ratios=(0.5, 0.5)), r"ratios: 0.5 appear more than once"),
    (dict(budgets=()), r"budgets: expected a non-empty tuple of positive ints, got \(\)"),
  ]:
    with pytest.raises(ValueError, match=match):
      evaluate.run(tiny_eval(**fields), tmp_path / "w", log=lambda *_: None)
    assert _clean(tmp_path / "w")
  with pytest.raises(ValueError, match=r"ratios: 0.9 keeps 11 of the 112 .* 'snapkv'.* at 128 tok"):
    c = tiny_eval(budgets=(), ratios=(0.5, 0.9))
    c.policies = tuple(p for p in eval_config.POLICIES if p["label"] == "snapkv")
    evaluate.run(c, tmp_path / "w", log=lambda *_: None)
  assert _clean(tmp_path / "w")
  evaluate.validate_config(eval_config.get_config("ratios_quick"))
  evaluate.validate_config(eval_config.get_config("smollm2_ratios"))
