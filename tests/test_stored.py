"""Compress once, answer many: ``km.compress_context`` / ``km.answer_context``, and a compressed
context saved and loaded in another process (``kvjax.model.stored``)."""

import pathlib
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.model import stored

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
  model, cfg, _ = km.load_tiny()
  rng = np.random.default_rng(0)
  ids = rng.integers(5, cfg.vocab_size, (2, 40)).astype(np.int32)
  questions = [rng.integers(5, cfg.vocab_size, (2, q)).astype(np.int32) for q in (5, 7)]
  return model, cfg, ids, questions


def test_the_full_cache_answers_as_generate_does(tiny):
  model, _, ids, (q, _) = tiny
  ctx = km.compress_context(model, ids)
  got = km.answer_context(model, ctx, q, max_new_tokens=8)
  want = km.generate(model, np.concatenate([ids, q], 1), max_new_tokens=8)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert (got.logprobs <= 0).all() and np.isfinite(got.logprobs).all()


def test_several_questions_from_one_compressed_context(tiny):
  """Each answer equals one from a context compressed afresh: answering changes nothing."""
  model, _, ids, questions = tiny
  ctx = km.compress_context(model, ids, policy="snapkv", budget=16, window=4)
  held = int(np.asarray(ctx.cache.valid).sum())
  for q in questions + questions:
    got = km.answer_context(model, ctx, q, max_new_tokens=6)
    fresh = km.compress_context(model, ids, policy="snapkv", budget=16, window=4)
    want = km.answer_context(model, fresh, q, max_new_tokens=6)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
  assert int(np.asarray(ctx.cache.valid).sum()) == held


def test_a_padded_context_row_answers_as_it_alone(tiny):
  model, _, ids, (q, _) = tiny
  mask = np.ones_like(ids)
  mask[1, :12] = 0
  both = km.compress_context(model, km.Padded(ids, mask), policy="knorm", budget=km.Ratio(0.5))
  alone = km.compress_context(model, ids[1:, 12:], policy="knorm", budget=km.Ratio(0.5))
  a = km.answer_context(model, both, q, max_new_tokens=5)
  b = km.answer_context(model, alone, q[1:], max_new_tokens=5)
  np.testing.assert_array_equal(a.tokens[1:], b.tokens)
  np.testing.assert_allclose(a.logprobs[1:], b.logprobs, atol=1e-5)


_CHILD = """
import sys, numpy as np
from kvjax import model as km, policies
model, _, _ = km.load_tiny()
ctx = km.stored.load(sys.argv[1], model, policies.make("snapkv", window=4))
q = np.load(sys.argv[2])
a = km.answer_context(model, ctx, q, max_new_tokens=6)
np.savez(sys.argv[3], tokens=a.tokens, logprobs=a.logprobs)
"""


def test_a_saved_context_answers_the_same_in_another_process(tiny, tmp_path):
  model, _, ids, (q, _) = tiny
  ctx = km.compress_context(model, ids, policy="snapkv", budget=16, window=4)
  path = ctx.save(tmp_path / "context")
  assert path.name == "context.safetensors"
  want = km.answer_context(model, ctx, q, max_new_tokens=6)
  np.save(tmp_path / "q.npy", q)
  out = tmp_path / "answer.npz"
  run = subprocess.run(
    [sys.executable, "-c", _CHILD, str(path), str(tmp_path / "q.npy"), str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  got = np.load(out)
  np.testing.assert_array_equal(got["tokens"], want.tokens)
  np.testing.assert_allclose(got["logprobs"], want.logprobs, atol=1e-6, rtol=0)


def test_another_model_or_policy_is_refused(tiny, tmp_path):
  model, cfg, ids, (q, _) = tiny
  pol = policies.make("snapkv", window=4)
  ctx = km.compress_context(model, ids, policy=pol, budget=16)
  path = ctx.save(tmp_path / "c.safetensors")
  with pytest.raises(ValueError, match="policy: .* was compressed with"):
    stored.load(path, model, policies.make("snapkv", window=8))
  other = dict(model.params(), embed=model.params()["embed"] + 1.0)
  with pytest.raises(ValueError, match="another model; differs .*embed_sha256"):
    stored.load(path, types.SimpleNamespace(cfg=cfg, params=lambda: other), pol)
  garbage = tmp_path / "g.safetensors"
  garbage.write_bytes(b"not a file of tensors")
  with pytest.raises(ValueError, match="not a safetensors file"):
    stored.load(garbage, model, pol)
  with pytest.raises(ValueError, match="is not a file"):
    stored.load(tmp_path / "absent.safetensors", model, pol)
  with pytest.raises(ValueError, match="question_ids: 1 rows for a context of 2"):
    km.answer_context(model, ctx, q[:1])
  with pytest.raises(ValueError, match="channel_ratio"):
    km.compress_context(model, ids, policy="think_snapkv", budget=16, window=4)
  loaded = stored.load(path, model, pol)
  assert jnp.array_equal(loaded.cache.keys, ctx.cache.keys)
