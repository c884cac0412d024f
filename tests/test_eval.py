"""Answers through the compressed cache, the evaluation loop and the shipped tiny model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax.model as km
from configs import eval as eval_config
from kvjax import evaluate, funnel, tasks

TOK = tasks.tiny_tokenizer()


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
  out = km.answer_configs(random_model, P, A, np.array([1]), policy="full", answer_given=~S)
  seq = jnp.asarray(np.concatenate([P, A[:, :-1]], 1))
  logits = km.forward(random_model.cfg, random_model.params(), seq)
  ref = jax.nn.log_softmax(logits[:, P.shape[1] - 1 :], -1)
  np.testing.assert_allclose(out.logprobs[0], np.asarray(ref), atol=2e-5)
  # greedy: scored positions are the model's own argmax given what it produced before
  np.testing.assert_array_equal(out.predicted[0][S], np.asarray(ref.argmax(-1))[S])


POLICIES = [
  "sliding_window",
  "streaming_llm",
  "h2o",
  "tova",
  "snapkv",
  "pyramidkv",
  "adakv_snapkv",
  "cake",
  "knorm",
  "random",
  "oracle",
]


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_covering_the_context_matches_the_full_cache_exactly(random_model, policy):
  exs, P, A, S = _batch(num_pairs=4, num_queries=2)
  full = km.answer_configs(random_model, P, A, np.array([1]), policy="full", answer_given=~S)
  out = km.answer_configs(random_model, P, A, np.array([100, 40]), policy=policy, answer_given=~S)
  np.testing.assert_array_equal(out.predicted[0], full.predicted[0])
  np.testing.assert_allclose(out.logprobs[0], full.logprobs[0], atol=2e-5)
  assert evaluate.kl_divergence(full.logprobs[0], out.logprobs[0], S) < 1e-5
  assert (out.budget_LH[1] <= 40).all()


def test_oracle_beats_random_on_kl(random_model):
  exs, P, A, S = _batch("single_needle", length=160, n=4)
  full = km.answer_configs(random_model, P, A, np.array([1]), policy="full")
  kls = {}
  for policy in ("oracle", "random"):
    out = km.answer_configs(random_model, P, A, np.array([12]), policy=policy)
    kls[policy] = evaluate.kl_divergence(full.logprobs[0], out.logprobs[0], S)
  assert kls["oracle"] < kls["random"]


def test_answer_inputs_are_validated(random_model):
  exs, P, A, S = _batch(num_pairs=4, num_queries=2)
  with pytest.raises(ValueError, match="answer_ids"):
    km.answer_configs(random_model, P, A[:1], np.array([50]), policy="snapkv")
  with pytest.raises(ValueError, match="answer_given"):
    km.answer_configs(random_model, P, A, np.array([50]), policy="snapkv", answer_given=S[:, :1])
  with pytest.raises(ValueError, match="budget"):
    km.answer_configs(random_model, P, A, np.array([20]), policy="snapkv")
  with pytest.raises(ValueError, match="budgets"):
    km.answer_configs(random_model, P, A, np.array(50), policy="snapkv")


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
  card = json.loads((km.loading.tiny_path() / "card.json").read_text())
  assert "full_cache_accuracy" in card


@pytest.mark.parametrize("task", ["passkey", "single_needle", "multi_key", "mqar"])
def test_tiny_model_reaches_its_stated_accuracy_on_held_out_examples(tiny, task):
  model, cfg, tok = tiny
  card = json.loads((km.loading.tiny_path() / "card.json").read_text())
  stated = card["full_cache_accuracy"]["1024"][task]
  opts = dict(eval_config.get_config().tasks[task])
  exs = evaluate.examples(task, tok, 1024, 8, opts, seed=99)
  P, A, S = tasks.batch(exs)
  out = km.answer_configs(model, P, A, np.array([1]), policy="full", answer_given=~S)
  acc = evaluate.accuracy(exs, out.predicted[0]).mean()
  # 8 held-out examples: allow one miss beyond the stated rate
  assert acc >= stated - 1 / 8 - 1e-9, (task, acc, stated)


def test_eval_quick_writes_results_resumes_and_plots(tmp_path):
  c = eval_config.get_config("quick")
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  assert {"task", "policy", "budget", "accuracy", "kl"} <= set(table.columns)
  budget_rows = table[table["kind"] == "budget"]
  full = budget_rows[budget_rows["policy"] == "full"]
  assert len(full) == 2 and (full["kl"] == 0).all()
  assert (tmp_path / "accuracy_vs_budget.png").exists()
  assert (tmp_path / "needle_heatmap_snapkv.png").exists()
  n = len(table)
  again = evaluate.run(c, tmp_path, log=lambda *_: None)  # nothing left to run: no duplicates
  assert len(again) == n
  c.budgets = [64]
  with pytest.raises(ValueError, match="different evaluation"):
    evaluate.run(c, tmp_path, log=lambda *_: None)
