"""kvjax.eval.streaming: StreamingLLM's perplexity experiment, on the tiny model."""

import ml_collections
import numpy as np
import pytest

from configs import streaming_ppl
from kvjax import model as km
from kvjax.eval import streaming
from kvjax.model import logprobs


def test_the_text_ships_with_python_and_is_long_enough():
  text = streaming.reference_text(40_000)
  assert len(text) >= 40_000 and text.count(" ") > 6_000  # prose: words, not tables
  with pytest.raises(ValueError, match="min_chars"):
    streaming.reference_text(10**9)


def test_quick_run_writes_every_policy_and_cache(tmp_path):
  c = streaming_ppl.get_config("quick")
  c.num_tokens, c.caches, c.segment = 128, (16, 32), 16
  model, _, tok = km.load_tiny()
  table = streaming.run(c, tmp_path, model=model, tokenizer=tok, log=lambda *_: None)
  assert list(table["policy"]) == ["full"] + ["sliding_window"] * 2 + ["streaming_llm"] * 2
  assert list(table["cache"]) == [128, 16, 32, 16, 32]
  assert (tmp_path / "results.csv").exists() and np.isfinite(table["ppl"]).all()
  full = table.iloc[0]
  assert len(full["segments"].split()) == 127 // 16


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("num_tokens", 40, "num_tokens: 40 must be at least twice"),
    ("num_tokens", 10**6, "context"),
    ("num_tokens", 128.0, "num_tokens: expected a static int"),
    ("caches", (), "caches: expected a non-empty list"),
    ("caches", (0, 32), "caches: expected a static int >= 1"),
    ("caches", (16, 32.5), "caches: expected a static int"),
    ("sinks", -1, "sinks: expected a static int >= 0"),
    ("sinks", 16, "sinks: 16 leaves no window in the smallest cache 16"),
    ("segment", 0, "segment: expected a static int >= 1"),
    ("segment", 128, "segment: 128 is longer than the 127 tokens scored"),
    ("text", "novel", "text: unknown value 'novel'"),
  ],
)
def test_a_refused_run_leaves_no_directory_behind(tmp_path, field, value, match):
  """Every value is checked before the run directory is claimed: nothing is created."""
  c = streaming_ppl.get_config("quick")
  c.num_tokens, c.caches, c.segment = 128, (16, 32), 16
  model, _, tok = km.load_tiny()
  c = ml_collections.ConfigDict({**c.to_dict(), field: value})  # any type, as a user's config
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=match):
    streaming.run(c, workdir, model=model, tokenizer=tok, log=lambda *_: None)
  assert not workdir.exists()


def test_a_run_without_a_model_leaves_no_directory_behind(tmp_path):
  c = streaming_ppl.get_config("quick")
  _, _, tok = km.load_tiny()
  with pytest.raises(ValueError, match="model, tokenizer: expected both"):
    streaming.run(c, tmp_path / "run", tokenizer=tok)
  assert not (tmp_path / "run").exists()


def test_budgets_read_in_one_scan_equal_separate_streams():
  model, _, tok = km.load_tiny()
  ids = streaming.text_ids(tok, 96, "filler")
  together = logprobs.stream_logprobs(model, ids, policy="streaming_llm", budgets=[16, 40], sinks=2)
  for k, b in enumerate([16, 40]):
    alone = logprobs.stream_logprobs(model, ids, policy="streaming_llm", budget=b, sinks=2)
    np.testing.assert_allclose(together[k], alone, atol=1e-5)
  with pytest.raises(ValueError, match="budget or budgets"):
    logprobs.stream_logprobs(model, ids, policy="sliding_window", budget=16, budgets=[16])
  with pytest.raises(ValueError, match="budgets: the full cache"):
    logprobs.stream_logprobs(model, ids, budgets=[16])
