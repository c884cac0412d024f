"""kvjax.eval.streaming: StreamingLLM's perplexity experiment, on the tiny model."""

import numpy as np
import pytest

from configs import streaming_ppl
from kvjax import model as km
from kvjax.eval import streaming


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
  assert list(table["policy"]) == ["full"] + ["sliding_window", "streaming_llm"] * 2
  assert (tmp_path / "results.csv").exists() and np.isfinite(table["ppl"]).all()
  full = table.iloc[0]
  assert len(full["segments"].split()) == 127 // 16
  c.num_tokens = 40
  with pytest.raises(ValueError, match="num_tokens"):
    streaming.run(c, tmp_path / "other", model=model, tokenizer=tok)
