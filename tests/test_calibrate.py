"""kvjax.model.calibrate: Q-Filters, DuoAttention gates and KVzip evidence on tiny models, against
kvpress 0.5.5 and the official code's math (``tests/fixtures/kvzip_0_5_5.npz``, written by
``tests/make_kvzip_fixtures.py`` on ``tests/fixtures/kvpress_tiny_llama``)."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.eval import tasks
from kvjax.model import assets
from kvjax.model import calibrate as cal
from kvjax.model.tokenizer import WordTokenizer

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def gold():
  return np.load(FIXTURES / "kvzip_0_5_5.npz")


@pytest.fixture(scope="module")
def tiny():
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return model, cfg, model.params()


def _template(gold, run):
  return cal.KVzipTemplate(
    tuple(gold[f"{run}_first_ids"]),
    tuple(gold[f"{run}_later_ids"]),
    tuple(gold[f"{run}_suffix_ids"]),
    int(gold[f"{run}_prefix_len"]),
  )


def _kvzip(gold, tiny, run, context=None):
  model, cfg, params = tiny
  args = json.loads(str(gold["meta_json"]))["runs"][run]["args"]
  return cal.kvzip_evidence(
    model,
    gold["context_ids_T"] if context is None else context,
    _template(gold, run),
    options=cal.KVzipOptions(
      chunk_size=args["chunk_size"],
      n_sink=args.get("n_sink", 4),
      plus=args.get("kvzip_plus_normalization", False),
    ),
  )


# --------------------------------------------------------------------------- KVzip


def _kvpress_keep(scores_LGT, ratio=0.5, n_sink=4):
  """kvpress's ``compress_post`` (layerwise=False): sinks get the max + 1, the lowest
  ``int(numel * ratio)`` scores over all layers and heads are pruned."""
  s = scores_LGT.copy()
  s[..., :n_sink] = s.max() + 1
  n_pruned = int(s.size * ratio)
  keep = np.ones(s.size, bool)
  keep[np.argsort(s.reshape(-1), kind="stable")[:n_pruned]] = False
  return keep.reshape(s.shape)


# the fixture's other runs (one chunk, no template, n_sink=2) are slow
RUNS = ("template_chunked", "plus_chunked") + tuple(
  pytest.param(run, marks=pytest.mark.slow) for run in ("plain", "chunked", "sink2_template")
)


@pytest.mark.parametrize("run", RUNS)
def test_kvzip_matches_kvpress(gold, tiny, run):
  _, cfg, _ = tiny
  ctx = gold["context_ids_T"]
  T = ctx.size
  if run == "template_chunked":  # a batch of two rows: row 0 is kvpress's, rows are independent
    both = np.asarray(_kvzip(gold, tiny, run, np.stack([ctx, ctx[::-1]])))
    assert both.shape == (cfg.num_layers, 2, cfg.num_kv_heads, T)
    assert not np.allclose(both[:, 1], both[:, 0])
    got = both[:, 0]
  else:
    got = _kvzip(gold, tiny, run)
    assert got.shape == (cfg.num_layers, cfg.num_kv_heads, T) and got.dtype == jnp.float32
    got = np.asarray(got)
  np.testing.assert_allclose(got, gold[f"{run}_scores_LGT"], atol=2e-5, rtol=1e-5)
  prefix = int(gold[f"{run}_prefix_len"])
  assert (got[..., :prefix] == 0).all()  # the template's header is never repeated
  # the kept set: kvpress's rule on kvjax's scores, and the kvzip policy's
  keep = gold[f"{run}_keep_LGT"]
  n_sink = json.loads(str(gold["meta_json"]))["runs"][run]["args"].get("n_sink", 4)
  np.testing.assert_array_equal(_kvpress_keep(got, n_sink=n_sink), keep)
  if run == "template_chunked":
    evidence = policies.Evidence(reconstruction_attn_LGT=jnp.asarray(got))
    mask = policies.make("kvzip").keep_mask(evidence, T // 2)
    np.testing.assert_array_equal(np.asarray(mask), keep)


def test_kvzip_chunks_follow_kvpress_prepare():
  t = cal.KVzipTemplate((1, 2), (3,), (4, 5), prefix_length=2)
  ctx = np.arange(10, 30)[None]
  chunks = cal.kvzip_chunks(ctx, t, chunk_size=8, prev_postfix_size=3)
  assert [(s, e) for s, e, _ in chunks] == [(2, 10), (10, 18), (18, 20)]
  np.testing.assert_array_equal(chunks[0][2][0], [1, 2, 4, 5, *range(12, 20)])
  np.testing.assert_array_equal(chunks[1][2][0], [3, 17, 18, 19, 4, 5, *range(20, 28)])


def test_kvzip_template_from_a_tokenizer():
  class Words:  # a tokenizer of word lengths (the tiny word vocabulary cannot spell the prompt)
    def encode(self, text):
      return [len(w) for w in text.split()]

  t = cal.kvzip_template(Words(), prefix_text="a b c")
  assert t.first_ids == (6, 3, 8, 7, 8) and t.prefix_length == 3 and t.suffix_ids == ()
  assert t.later_ids == (6, 3, 4, 2, 3, 8, 7, 8, 8, 4)


# --------------------------------------------------------------------------- Q-Filters


def test_qfilters_match_the_official_svd(gold, tiny):
  model, cfg, params = tiny
  meta = json.loads(str(gold["meta_json"]))["qfilters"]
  kw = dict(num_svd_samples=meta["num_svd_samples"], seed=meta["seed"])
  dirs = cal.qfilter_directions(model, gold["qfilters_rows_BT"], **kw)
  np.testing.assert_allclose(np.asarray(dirs), gold["qfilters_directions_LHD"], atol=2e-5)
  f = cal.qfilters(model, gold["qfilters_rows_BT"], **kw)
  assert f.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) and f.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(f), gold["qfilters_LGD"], atol=2e-5)


def test_qfilters_unit_vectors_and_sign_rule(gold, tiny):
  model, cfg, params = tiny
  ids, n, seed = gold["qfilters_rows_BT"], 64, 5
  dirs = np.asarray(cal.qfilter_directions(model, ids, num_svd_samples=n, seed=seed))
  np.testing.assert_allclose(np.linalg.norm(dirs, axis=-1), 1.0, atol=1e-5)
  rng = np.random.default_rng(seed)  # the same draw: the rule holds over the sampled queries
  idx = np.stack([np.argsort(rng.random(ids.size))[:n] for _ in range(cfg.num_layers)])
  q = np.asarray(cal.sampled_queries_jit(cfg, params, jnp.asarray(ids), jnp.asarray(idx)))
  negative = (np.einsum("lhnd,lhd->lhn", q, dirs) < 0).mean(-1)
  assert (negative >= 0.5).all(), negative  # most queries point against the filter
  f = np.asarray(cal.qfilters(model, ids, num_svd_samples=n, seed=seed))
  np.testing.assert_allclose(f, dirs.reshape(f.shape[0], f.shape[1], -1, f.shape[2]).mean(2))


def test_calibration_rows():
  class Tok:
    bos_id = 1

    def encode(self, text):
      return [len(w) for w in text.split()]

  rows = cal.calibration_rows(Tok(), "a bb ccc dddd " * 10, 3, 5)
  assert rows.shape == (3, 5) and (rows[:, 0] == 1).all()
  np.testing.assert_array_equal(rows[0, 1:], [1, 2, 3, 4])
  with pytest.raises(ValueError, match="text"):
    cal.calibration_rows(Tok(), "a b", 3, 5)


# --------------------------------------------------------------------------- DuoAttention


def test_streaming_mask_is_the_official_one():
  m = cal.streaming_mask(6, 1, 2)
  expected = np.array(
    [
      [1, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 0, 0],
      [1, 1, 1, 0, 0, 0],
      [1, 0, 1, 1, 0, 0],
      [1, 0, 0, 1, 1, 0],
      [1, 0, 0, 0, 1, 1],
    ],
    bool,
  )
  np.testing.assert_array_equal(m, expected)
  assert cal.duo_sizes(100_000) == (128, 256)
  assert cal.duo_sizes(384) == (32, 64)


def test_duo_schedule_is_the_official_lambda():
  N, lr = 20, 0.02
  sched = cal.duo_schedule(lr, N)
  for s in range(N):
    ref = lr * min(1, max((s + 1) / (N // 5), 0.1), max((N - s) / (N // 5), 0.1))
    assert float(sched(s)) == pytest.approx(ref)


def _random_examples(cfg, n, T, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    labels = np.zeros(T, bool)
    labels[-8:] = True
    out.append((rng.integers(0, cfg.vocab_size, T), labels))
  return out


def test_duo_official_training(tiny):
  model, cfg, params = tiny
  examples = _random_examples(cfg, 2, 40)
  run = cal.train_duo_attention(model, examples, num_steps=6, sizes=(2, 4))
  assert run.alpha_LG.shape == (cfg.num_layers, cfg.num_kv_heads)
  assert ((run.alpha_LG >= 0) & (run.alpha_LG <= 1)).all()
  assert run.distill[0] < 1e-8  # every gate at 1: the gated model is the model
  assert run.loss[-1] < run.loss[0]
  assert (run.alpha_LG < 1).any()
  pattern = cal.duo_attention_pattern(model, examples, num_steps=6, sizes=(2, 4))
  np.testing.assert_allclose(pattern, run.alpha_LG)


def test_duo_batches_average_the_examples_and_pad_shorter_ones(tiny):
  model, cfg, params = tiny
  short, long = _random_examples(cfg, 1, 30)[0], _random_examples(cfg, 1, 40)[0]
  kw = dict(num_steps=3, sizes=(2, 4))
  one = cal.train_duo_attention(model, [short], **kw)
  # one process: the data-parallel path at batch size 1 is the plain loop, bit for bit
  same = cal.train_duo_attention(model, [short], across_processes=True, **kw)
  np.testing.assert_array_equal(same.alpha_LG, one.alpha_LG)
  # a batch of the same example twice, padded beside a longer one or not: the same gradient
  twice = cal.train_duo_attention(model, [short, short], batch_size=2, **kw)
  np.testing.assert_allclose(twice.alpha_LG, one.alpha_LG, atol=1e-6)
  np.testing.assert_allclose(twice.loss, one.loss, rtol=1e-5)
  mixed = cal.train_duo_attention(model, [short, long], batch_size=2, **kw)
  alone = [cal.train_duo_attention(model, [e], num_steps=1, sizes=(2, 4)) for e in (short, long)]
  np.testing.assert_allclose(mixed.loss[0], np.mean([r.loss[0] for r in alone]), rtol=1e-5)
  with pytest.raises(ValueError, match="^batch_size"):
    cal.train_duo_attention(model, [short], batch_size=0)


def test_query_stats_and_qfilters_across_one_process_are_the_plain_ones(tiny):
  model, cfg, params = tiny
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (5, 24))
  plain = cal.query_stats(model, ids, batch=2)
  across = cal.query_stats(model, ids, batch=2, across_processes=True)
  for a, b in zip(plain, across, strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
    cal.qfilters(model, ids, num_svd_samples=50),
    cal.qfilters(model, ids, num_svd_samples=50, across_processes=True),
  )


def test_duo_kvpress_on_the_fly_matches_kvpress(gold, tiny):
  model, cfg, params = tiny
  meta = json.loads(str(gold["meta_json"]))["duo_on_the_fly"]
  texts = [gold[name] for name in meta["texts"]]
  got = cal.duo_attention_pattern(
    model, method="kvpress_on_the_fly", calibration_ids=texts, q_len=meta["q_len"]
  )
  assert got.shape == (cfg.num_layers, cfg.num_kv_heads)
  np.testing.assert_allclose(got, gold["duo_otf_scores_LG"], atol=1e-6)


def test_duo_distant_mass_and_task_examples(tiny):
  model, cfg, params = tiny
  tok = WordTokenizer.load(assets.tiny_path() / "tokenizer.json")
  exs = [
    tasks.generate("multi_query", tok, length=64, seed=s, num_pairs=3, num_queries=2)
    for s in range(2)
  ]
  pairs = cal.duo_examples(exs)
  ids, labels = pairs[0]
  assert ids.size == 64 + exs[0].answer.size
  assert labels.sum() == exs[0].question_len + exs[0].answer.size and labels[-1]
  # the tiny fixture's vocabulary is smaller: the proxy runs on random ids of the same layout
  examples = [(np.asarray(i) % cfg.vocab_size, lab) for i, lab in pairs]
  mass = cal.duo_attention_pattern(model, examples, method="distant_mass")
  assert mass.shape == (cfg.num_layers, cfg.num_kv_heads)
  assert ((mass >= 0) & (mass <= 1)).all() and (mass > 0).any()
  everything = cal.duo_attention_pattern(model, examples, method="distant_mass", sizes=(1, 1))
  assert (everything >= mass - 1e-6).all()  # a smaller streaming window leaves more far mass


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument(tiny, gold):
  model, cfg, params = tiny
  ids = np.zeros((1, 8), np.int32)
  t = _template(gold, "chunked")
  cases = [
    ("calibration_ids", lambda: cal.qfilters(model, ids.astype(float))),
    ("calibration_ids", lambda: cal.qfilters(model, ids + cfg.vocab_size)),
    ("num_svd_samples", lambda: cal.qfilters(model, ids, num_svd_samples=0)),
    ("method", lambda: cal.duo_attention_pattern(model, [], method="nope")),
    ("examples", lambda: cal.duo_attention_pattern(model, [])),
    ("examples\\[0\\]", lambda: cal.train_duo_attention(model, [(ids[0], [1, 0])])),
    (
      "num_steps",
      lambda: cal.train_duo_attention(model, [(ids[0], ids[0] == 0)], num_steps=0),
    ),
    (
      "calibration_ids",
      lambda: cal.duo_attention_pattern(model, method="kvpress_on_the_fly"),
    ),
    (
      "sizes",
      lambda: cal.train_duo_attention(model, [(ids[0], ids[0] == 0)], sizes=(2,)),
    ),
    (
      "recent_size",
      lambda: cal.duo_attention_pattern(
        model, [(ids[0], ids[0] == 0)], method="distant_mass", sizes=(2, 0)
      ),
    ),
    (
      "num_steps",
      lambda: cal.duo_attention_pattern(model, method="distant_mass", num_steps=2),
    ),
    ("context_ids", lambda: cal.kvzip_evidence(model, np.zeros((1, 0), int), t)),
    (
      "chunk_size",
      lambda: cal.kvzip_evidence(model, ids, t, options=cal.KVzipOptions(chunk_size=0)),
    ),
    (
      "n_sink",
      lambda: cal.kvzip_evidence(model, ids, t, options=cal.KVzipOptions(n_sink=-1)),
    ),
    ("options", lambda: cal.kvzip_evidence(model, ids, t, options={"n_sink": 4})),
    ("template", lambda: cal.kvzip_evidence(model, ids, (1, 2))),
    (
      "template.prefix_length",
      lambda: cal.kvzip_evidence(model, ids, cal.KVzipTemplate((1,), (2,), (3,), 8)),
    ),
    (
      "template.suffix_ids",
      lambda: cal.kvzip_evidence(model, ids, cal.KVzipTemplate((1,), (2,), (cfg.vocab_size,))),
    ),
  ]
  for name, call in cases:
    with pytest.raises(ValueError, match=f"^{name}"):
      call()


# --------------------------------------------------------------------------- the entry point


def test_experiment_entry_point(tmp_path):
  root = pathlib.Path(__file__).resolve().parents[1]
  cmd = [
    sys.executable,
    "-m",
    "experiments.calibrate",
    "--config=configs/calibrate.py:quick",
    "--config.duo_methods=('distant_mass',)",  # the official training has its own test above
    f"--config.workdir={tmp_path}",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"run directory: {tmp_path}" in out.stdout
  saved = np.load(tmp_path / "calibration.npz")
  cfg = km.load_tiny()[1]
  assert saved["qfilters_LGD"].shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
  assert saved["retrieval_heads_LG_distant_mass"].shape == (cfg.num_layers, cfg.num_kv_heads)
  L, Hq, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
  assert saved["stats_query_mean_LHD"].shape == (L, Hq, D)
  assert saved["stats_query_cov_LHDD"].shape == (L, Hq, D, D)
  assert saved["reconstruction_attn_LGT"].shape[:2] == (cfg.num_layers, cfg.num_kv_heads)
  assert "kvzip" in json.loads((tmp_path / "timings.json").read_text())["timings_s"]
