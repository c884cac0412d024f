"""The task-accuracy fitness (kvjax.eval.search.fitness.population_accuracy): a population's
scores equal the evaluation's own path (answer_configs over the examples, each configuration
scored by grouping.accuracy), and a search on it from a config."""

import numpy as np
import pytest

from configs import search as search_config
from kvjax import model as km
from kvjax import policies
from kvjax.eval import grouping, tasks
from kvjax.eval.search import fitness, runner
from kvjax.eval.search.space import Space


@pytest.fixture(scope="module")
def tiny():
  return km.load_tiny()


@pytest.mark.parametrize("shape, metric", [("L", "accuracy"), ("LG", "recall")])
def test_accuracy_fitness_equals_the_evaluations_path(tiny, shape, metric):
  model, cfg, tok = tiny
  exs = [tasks.generate("single_needle", tok, length=48, seed=s) for s in range(4)]
  G = cfg.num_kv_heads
  kv = {"num_kv_heads": G} if shape == "LG" else {}
  policy = policies.SnapKV(window=4, **kv)
  data = fitness.accuracy_data(model, exs, policy, metric=metric)
  space = Space.from_budget((cfg.num_layers,) if shape == "L" else (cfg.num_layers, G), 6, 4, 48)
  pop = np.random.default_rng(0).normal(size=(4, space.num_params)) * 2
  allocations = np.asarray(space.allocate_population(pop))
  got = fitness.population_accuracy(model, data, policy, allocations)
  # directly: the evaluation's answer_configs, one configuration per allocation
  P, A, S = tasks.batch(exs)
  context = P.shape[1] - max(e.question_len for e in exs)
  score = grouping.accuracy if metric == "accuracy" else grouping.recall
  want = []
  for a in allocations:
    b = np.minimum(np.asarray(fitness.budget_heads(a, data.heads)), context)
    out = km.answer_configs(
      model,
      P,
      A,
      b[None],
      policy=policy,
      question=km.Question(length=exs[0].question_len, answer_given=~S),
    )
    want.append(score(exs, np.asarray(out.predicted[0])).mean())
  np.testing.assert_allclose(got, want)
  full = km.answer_configs(
    model,
    P,
    A,
    [context],
    policy=policy,
    question=km.Question(length=exs[0].question_len, answer_given=~S),
  )
  np.testing.assert_allclose(data.full, score(exs, np.asarray(full.predicted[0])))
  with pytest.raises(ValueError, match="metric: unknown value 'f1'"):
    fitness.accuracy_data(model, exs, policy, metric="f1")
  with pytest.raises(ValueError, match="examples: none"):
    fitness.accuracy_data(model, [], policy)


def test_accuracy_search_on_the_tiny_model(tmp_path):
  c = search_config.get_config("quick,tiny,acc")
  c.model.update(prompt_len=48, rows=4)
  c.budget = 6
  c.population, c.generations = 4, 2
  summary = runner.run(c, tmp_path, log=len)
  judged = summary["judged"]
  assert summary["header"]["calibration"]["fitness"] == "accuracy"
  assert judged["searched"]["calibration_accuracy"] == pytest.approx(summary["header"]["fitness"])
  hand = {k: v for k, v in judged.items() if k not in ("searched", "best_hand_made")}
  best = max(v["calibration_accuracy"] for v in hand.values())
  assert judged["best_hand_made"]["calibration_accuracy"] == best
  assert 0.0 <= judged["searched"]["held_out_accuracy"] <= 1.0
  assert set(summary["full_cache"]) == {"calibration_accuracy", "held_out_accuracy"}
  with pytest.raises(ValueError, match="fitness: 'accuracy' needs"):
    runner.check_config(search_config.get_config("quick,acc"))
