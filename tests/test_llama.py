"""kvjax.model.llama: logits and greedy tokens against transformers, the prefill's evidence,
bf16, Mistral's sliding window."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import (
  NEW,
  hf_generate,
  make_checkpoint_cached,
  prompt,
  tiny_hf,
  torch,
)

from kvjax import model as km
from kvjax import policies

Request = policies.EvidenceRequest
Plan = km.llama.PrefillPlan


def test_logits_and_greedy_tokens_match_transformers(family):
  name, hf, model, cfg = family
  ids = prompt(T=40, B=2)
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(ids)))
  assert np.abs(ours - ref).max() <= 1e-4, name
  np.testing.assert_array_equal(
    km.generate(model, ids[:1], max_new_tokens=NEW).tokens, hf_generate(hf, ids[:1])
  )


def test_prefill_evidence_is_consistent_with_full_attention_maps():
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  ids = prompt(T=37, B=2)
  mask = np.ones_like(ids)
  mask[1, :5] = 0  # a left-padded row
  pre = km.prefill(
    cfg,
    model.params(),
    jnp.asarray(ids),
    jnp.asarray(mask),
    request=Request(window=6, column_sums=True),
    full_attention_layers=(0, 1),
    plan=km.llama.PrefillPlan(block=8),
  )
  for layer in (0, 1):
    maps = np.asarray(pre.full_attention[layer])  # [B, Hq, T, T]
    real = mask.astype(bool)
    np.testing.assert_allclose(
      maps.sum(-1)[real[:, None, :].repeat(cfg.num_heads, 1)], 1.0, atol=1e-5
    )
    assert (maps[1][..., :5] == 0).all(), "padding receives no attention"
    np.testing.assert_allclose(np.asarray(pre.attn_window[layer]), maps[:, :, -6:], atol=1e-6)
    sums = (maps * real[:, None, :, None]).sum(-2)
    np.testing.assert_allclose(np.asarray(pre.column_sums[layer]), sums, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(pre.key_norms), np.linalg.norm(np.asarray(pre.keys), axis=-1), rtol=1e-6
  )


def test_bfloat16_model_tracks_float32():
  _, path = make_checkpoint_cached()
  m32, _ = km.load(path)
  m16, _ = km.load(path, dtype=jnp.bfloat16)
  ids = jnp.asarray(prompt(T=24))
  l32, l16 = np.asarray(m32(ids)), np.asarray(m16(ids))
  assert l16.dtype == np.float32 and np.abs(l32 - l16).max() < 0.1 * np.abs(l32).max()


def test_mixed_precision_runs_the_matmuls_on_bf16_and_keeps_the_rest_fp32():
  _, path = make_checkpoint_cached()
  m32, cfg = km.load(path)
  mixed, _ = km.load(path, matmul_dtype=jnp.bfloat16)
  params = mixed.params()
  for name, value in params.items():
    expected = jnp.bfloat16 if name in km.llama.MATMUL_WEIGHTS else jnp.float32
    assert value.dtype == expected, name
  ids = jnp.asarray(prompt(T=24))
  text = str(jax.make_jaxpr(lambda ids: km.prefill(cfg, params, ids).logits)(ids))
  # every projection and MLP matmul: bf16 operands, fp32 accumulation (AVX-512 BF16 / AMX)
  assert text.count("preferred_element_type=float32") >= 7  # the layer scan: q k v o gate up down
  pre = km.prefill(cfg, params, ids)
  assert pre.keys.dtype == jnp.float32 and km.llama.kv_itemsize(cfg, params) == 4
  l32, lmx = np.asarray(m32(ids)), np.asarray(mixed(ids))
  assert lmx.dtype == np.float32 and np.abs(l32 - lmx).max() < 0.02 * np.abs(l32).max()
  np.testing.assert_array_equal(l32.argmax(-1), lmx.argmax(-1))


def test_mixed_precision_decodes_and_keeps_what_fp32_does_on_the_tiny_model():
  m32, _, _ = km.load_tiny()
  mixed, _, _ = km.load_tiny(matmul_dtype=jnp.bfloat16)
  ids = np.random.default_rng(0).integers(4, 200, (2, 120)).astype(np.int32)
  out32, outmx = (
    km.generate(m, ids, policy="snapkv", budget=40, max_new_tokens=8) for m in (m32, mixed)
  )
  assert outmx.memory == out32.memory  # the cache stays fp32
  assert (np.asarray(outmx.tokens) == np.asarray(out32.tokens)).mean() >= 0.9
  kept32, keptmx = (km.keep_mask(m, ids, "snapkv", 40) for m in (m32, mixed))
  assert (np.asarray(kept32) == np.asarray(keptmx)).mean() >= 0.95


def test_bf16_attention_rounds_the_output_only_and_keeps_the_evidence_exact():
  model, cfg, _ = km.load_tiny()
  ids = jnp.asarray(np.random.default_rng(1).integers(4, 200, (2, 70)))
  request = Request(window=6, column_sums=False)
  exact = km.prefill(cfg, model.params(), ids, request=request, plan=Plan(block=16), logits="all")
  fast = km.prefill(
    cfg,
    model.params(),
    ids,
    request=request,
    plan=Plan(block=16, attention_dtype=jnp.bfloat16),
    logits="all",
  )
  text = str(
    jax.make_jaxpr(
      lambda ids: (
        km.prefill(
          cfg, model.params(), ids, plan=Plan(block=16, attention_dtype=jnp.bfloat16)
        ).logits
      )
    )(ids)
  )
  assert "bf16[" in text and "preferred_element_type=float32" in text
  gap = np.abs(np.asarray(exact.logits) - np.asarray(fast.logits)).max()
  assert 0 < gap < 0.02 * np.abs(np.asarray(exact.logits)).max()
  assert (exact.logits.argmax(-1) == fast.logits.argmax(-1)).mean() >= 0.95
  # layer 0's keys and window rows come before any rounded output reaches the stream
  np.testing.assert_array_equal(np.asarray(exact.keys[0]), np.asarray(fast.keys[0]))
  np.testing.assert_allclose(
    np.asarray(exact.attn_window[0]), np.asarray(fast.attn_window[0]), atol=1e-6
  )
  with pytest.raises(ValueError, match="attention_dtype: expected float32, bfloat16 or float16"):
    km.prefill(cfg, model.params(), ids, plan=Plan(attention_dtype=jnp.int8))
  with pytest.raises(ValueError, match="attention_dtype=bfloat16 needs attention='blocked'"):
    km.prefill(cfg, model.params(), ids, plan=Plan(attention="xla", attention_dtype=jnp.bfloat16))


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf16", object()])
def test_weight_dtypes_are_checked(dtype):
  with pytest.raises(ValueError, match="matmul_dtype: expected float32, bfloat16 or float16"):
    km.load_tiny(matmul_dtype=dtype)
  with pytest.raises(ValueError, match="dtype: expected float32, bfloat16 or float16"):
    km.llama.with_matmul_dtype({}, dtype)


def test_mistral_sliding_window_applies_during_decoding(tmp_path):
  hf = tiny_hf("Mistral", sliding_window=8)
  hf.save_pretrained(tmp_path)
  model, _ = km.load(tmp_path)
  ids = prompt(T=24)
  out = km.generate(model, ids, max_new_tokens=8).tokens
  seq = np.concatenate([ids, out], 1)
  teacher = np.asarray(model(jnp.asarray(seq))).argmax(-1)[0, 23:31]
  np.testing.assert_array_equal(out[0], teacher)


def test_every_matmul_asks_for_full_fp32_precision():
  # TPUs and TF32 GPUs would otherwise compute fp32 matmuls at reduced precision
  model, cfg, _ = km.load_tiny()
  prefill = jax.make_jaxpr(
    lambda ids: km.prefill(cfg, model.params(), ids, request=Request(window=4, column_sums=True))
  )(jnp.zeros((1, 8), jnp.int32))
  text = str(prefill)
  assert text.count("dot_general") > 5
  assert text.count("dot_general") == text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)")


def test_prefill_computes_the_last_logits_only_unless_asked():
  model, cfg, _ = km.load_tiny()
  ids = jnp.asarray(np.random.default_rng(0).integers(4, 100, (2, 20)), jnp.int32)
  last = km.prefill(cfg, model.params(), ids).logits
  every = km.prefill(cfg, model.params(), ids, logits="all").logits
  assert last.shape == (2, 1, cfg.vocab_size) and every.shape == (2, 20, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(every[:, -1]), atol=1e-5)
  with pytest.raises(ValueError, match="logits"):
    km.prefill(cfg, model.params(), ids, logits="first")


# --------------------------------------------------------------------------- blocked prefill


def _dense_prefill(cfg, params, ids, mask, window):
  """The unblocked reference: every layer's full ``[B, Hq, T, T]`` softmax at once."""
  from kvjax.model import llama

  B, T = ids.shape
  valid = mask.astype(bool)
  positions = llama.positions_from_mask(mask)
  index = jnp.broadcast_to(jnp.arange(T), (B, T))
  allowed = llama.causal_allowed(positions, positions, valid, index, index, cfg.sliding_window)
  x = params["embed"][ids]
  out = {"keys": [], "values": [], "attn_window": [], "column_sums": []}
  for layer in range(cfg.num_layers):
    p = llama.layer_params(params, layer)
    q, k, v = llama.project_qkv(cfg, p, x, positions)
    probs = llama.attention_probs(q, k, allowed) * valid[:, None, :, None]
    x = llama.output_and_mlp(cfg, p, x, llama.attend(probs, v))
    for name, value in (("keys", k), ("values", v), ("attn_window", probs[:, :, -window:])):
      out[name].append(value)
    out["column_sums"].append(probs.sum(-2))
  out = {k: np.stack([np.asarray(a) for a in v]) for k, v in out.items()}
  out["logits"] = np.asarray(llama.logits_of(cfg, params, x))
  return out


@pytest.mark.parametrize(
  "T, block, chunk, pad, sliding_window, attention",
  [
    (37, 8, None, 0, None, "blocked"),  # T not a multiple of the block
    (37, 8, 16, 5, None, "blocked"),  # two chunks and a tail of 5, a left-padded row
    (37, 5, 7, 5, None, "blocked"),  # chunk not a multiple of the block, neither divides T
    (40, 4, 12, 3, 9, "blocked"),  # Mistral's sliding window skips tiles behind it
    (37, 256, 2048, 4, 6, "blocked"),  # the defaults, clamped to the prompt
    (37, 8, 16, 5, 6, "xla"),  # jax.nn.dot_product_attention for the output
  ],
)
def test_blocked_prefill_equals_the_unblocked_reference(
  T, block, chunk, pad, sliding_window, attention
):
  model, cfg, _ = km.load_tiny()
  cfg = dataclasses.replace(cfg, sliding_window=sliding_window)
  params = model.params()
  rng = np.random.default_rng(T + block)
  ids = jnp.asarray(rng.integers(4, cfg.vocab_size, (2, T)), jnp.int32)
  mask = np.ones((2, T), np.int32)
  mask[1, :pad] = 0
  mask = jnp.asarray(mask)
  ref = _dense_prefill(cfg, params, ids, mask, window=6)
  for column_sums in (True, False):
    pre = km.prefill(
      cfg,
      params,
      ids,
      mask,
      request=Request(window=6, column_sums=column_sums),
      logits="all",
      plan=km.llama.PrefillPlan(block=block, chunk=chunk, attention=attention),
    )
    assert pre.attn_window.dtype == jnp.float32 and pre.attn_window.shape == (4, 2, 4, 6, T)
    np.testing.assert_allclose(np.asarray(pre.attn_window), ref["attn_window"], atol=1e-5)
    # logits carry every layer's rounding: 1e-5 of their scale
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(np.asarray(pre.logits), ref["logits"], atol=1e-5 * scale)
    for name in ("keys", "values"):  # deeper layers' keys reach |5|: 1e-5 of their own size too
      np.testing.assert_allclose(np.asarray(getattr(pre, name)), ref[name], rtol=1e-5, atol=1e-5)
    if column_sums:
      np.testing.assert_allclose(np.asarray(pre.column_sums), ref["column_sums"], atol=1e-5)
    else:
      assert pre.column_sums is None


def test_prefill_window_rows_in_bfloat16_on_request():
  model, cfg, _ = km.load_tiny()
  ids = jnp.asarray(np.random.default_rng(1).integers(4, 100, (1, 30)), jnp.int32)
  request = Request(window=5, column_sums=True)
  plan = km.llama.PrefillPlan(block=8, chunk=16)
  f32 = km.prefill(cfg, model.params(), ids, request=request, plan=plan)
  bf16 = km.prefill(
    cfg,
    model.params(),
    ids,
    request=request,
    plan=dataclasses.replace(plan, window_dtype=jnp.bfloat16),
  )
  assert bf16.attn_window.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(bf16.attn_window, np.float32), np.asarray(f32.attn_window), atol=4e-3
  )
  np.testing.assert_array_equal(np.asarray(bf16.column_sums), np.asarray(f32.column_sums))


def test_prefill_validates_its_blocking_arguments():
  model, cfg, _ = km.load_tiny()
  ids = jnp.zeros((1, 8), jnp.int32)
  for kw, name in [
    (dict(plan=Plan(block=0)), "block"),
    (dict(plan=Plan(block=2.5)), "block"),
    (dict(plan=Plan(chunk=0)), "chunk"),
    (dict(plan=Plan(chunk=True)), "chunk"),
    (dict(request=Request(window=9)), "window"),
    (dict(request=Request(window=-1)), "window"),
    (dict(plan=Plan(window_dtype=jnp.int32)), "window_dtype"),
    (dict(plan=Plan(attention="flash")), "attention"),
    (dict(plan=dict(block=8)), "plan"),
    (dict(attention_mask=Request(window=2)), "request="),
    (dict(request=Request(window_scores=jnp.sum)), "window_scores"),  # no window rows to reduce
    (dict(request=Request(window=2, window_scores="snapkv")), "window_scores"),
    (dict(request=Request(window_queries=9)), "window_queries"),
    (dict(request=Request(value_out_norms=1)), "value_out_norms"),
    (dict(request=Request(query_stats=True, n_sink=-1)), "n_sink"),
    (dict(request=Request(query_stats=True, n_future=0)), "n_future"),
    (dict(request={"window": 2}), "request"),
  ]:
    with pytest.raises(ValueError, match=name):
      km.prefill(cfg, model.params(), ids, **kw)


def test_attention_tiles_above_the_diagonal_or_behind_the_window_are_never_read():
  # NaN keys and values poison any output row whose tiles read them (0 * NaN = NaN in p @ v):
  # the rows that must not read a poisoned tile keep their clean values only if it is skipped
  from kvjax.model import blocked

  B, Hq, G, T, D, block = 1, 2, 1, 24, 8, 4
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, Hq, 8, D)), jnp.float32)  # the chunk [8, 16)
  kv = rng.normal(size=(1, B, G, T, D)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  valid = jnp.ones((B, T), bool)

  def outputs(poisoned, sliding_window, sums):
    bad = kv.copy()
    bad[..., poisoned, :] = np.nan
    keys = blocked.Keys(jnp.asarray(bad), jnp.asarray(bad), positions, valid, 0, block)
    sums = jnp.zeros((B, Hq, T), jnp.float32) if sums else None
    return np.asarray(blocked.attend_chunk(q, 8, keys, sums, block, sliding_window)[0])

  for sums in (False, True):
    for poisoned, sliding_window, clean_rows in [
      # keys [12, 16) sit above the diagonal of the query block [8, 12)
      (slice(12, 16), None, np.arange(8, 16) < 12),
      # a window of 4: the query block [12, 16) needs keys from 9 on, [8, 12) from 5 on
      (slice(0, 8), 4, np.arange(8, 16) >= 12),
    ]:
      clean = outputs(slice(0, 0), sliding_window, sums)
      same = (outputs(poisoned, sliding_window, sums) == clean).all(axis=(0, 1, 3))
      np.testing.assert_array_equal(same, clean_rows)


def test_model_call_refuses_ids_outside_the_vocabulary():
  model, cfg, _ = km.load_tiny()
  for bad in ([[1, cfg.vocab_size]], [[-1, 2]], [[1.5, 2.0]]):
    with pytest.raises(ValueError, match="input_ids"):
      model(np.asarray(bad))


def test_segments_attention_equals_one_softmax_over_the_concatenated_keys():
  """llama.segments_attention (keys-major logits, segments never concatenated) against
  attention_logits + masked_softmax + attend over the concatenated segments, with a query that
  may see no key at all (it gives 0) and the first segment's probabilities."""
  from kvjax.model import llama

  rng = np.random.default_rng(0)
  B, Hq, G, Q, D, sizes = 2, 6, 2, 5, 8, (7, 4, 5)
  q = jnp.asarray(rng.standard_normal((B, Hq, Q, D)), jnp.float32)
  keys = [jnp.asarray(rng.standard_normal((B, G, c, D)), jnp.float32) for c in sizes]
  values = [jnp.asarray(rng.standard_normal((B, G, c, D)), jnp.float32) for c in sizes]
  allowed = rng.random((B, G, Q, sum(sizes))) < 0.6
  allowed[0, 1, 2] = False  # a query that sees nothing
  allowed = jnp.asarray(allowed)
  logits = llama.attention_logits(q, jnp.concatenate(keys, 2))
  probs = llama.masked_softmax(logits, allowed)
  want = llama.attend(probs, jnp.concatenate(values, 2))
  bounds = np.cumsum((0,) + sizes)
  segments = [
    (k, v, allowed[..., a:b])
    for k, v, a, b in zip(keys, values, bounds[:-1], bounds[1:], strict=True)
  ]
  out, first = jax.jit(lambda s: llama.segments_attention(q, s, probs_of_first=True))(segments)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  np.testing.assert_allclose(np.asarray(first), np.asarray(probs[..., : sizes[0]]), atol=1e-6)
  assert not np.asarray(out[0, 3:6, 2]).any()  # query heads of group 1, query 2: no key
  assert llama.segments_attention(q, segments)[1] is None


def _tiny_random(max_positions=None):
  """A one-layer random model (nothing trained: the checks run before any of it)."""
  from flax import nnx

  cfg = km.ModelConfig(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_positions=max_positions,
  )
  return km.Llama(cfg, rngs=nnx.Rngs(0)), cfg


@pytest.mark.parametrize(
  ("ids", "match"),
  [
    (
      np.zeros(5, np.int32),
      r"input_ids: expected token ids \[batch >= 1, T >= 1\], got shape \(5,\)",
    ),
    (np.zeros((1, 2, 3), np.int32), r"got shape \(1, 2, 3\)"),
    (np.zeros((1, 0), np.int32), r"got shape \(1, 0\)"),
    (np.zeros((0, 5), np.int32), r"got shape \(0, 5\)"),
    (np.ones((1, 4), bool), "input_ids: expected integer token ids, got dtype bool"),
    (np.array([[1, 16]]), r"token id 16 is outside the vocabulary \[0, 16\)"),
  ],
)
def test_model_call_and_prefill_share_one_rule_for_ids(ids, match):
  model, cfg = _tiny_random()
  calls = {
    "model": lambda x: model(x),
    "prefill": lambda x: km.prefill(cfg, model.params(), x),
    "jit prefill": jax.jit(lambda x: km.prefill(cfg, model.params(), x).logits),
  }
  for name, call in calls.items():
    if name == "jit prefill" and "vocabulary" in match:
      continue  # traced values cannot be checked in Python; shapes and dtypes can
    with pytest.raises(ValueError, match=match):
      call(jnp.asarray(ids) if name == "jit prefill" else ids)
      pytest.fail(f"{name} accepted {ids!r}")


def test_model_call_and_prefill_refuse_prompts_past_the_context():
  model, cfg = _tiny_random(max_positions=8)
  ids = np.ones((1, 9), np.int32)
  for call in (lambda: model(ids), lambda: km.prefill(cfg, model.params(), ids)):
    with pytest.raises(
      ValueError, match="a prompt of 9 tokens is longer than the model's context of 8"
    ):
      call()
  assert model(ids[:, :8]).shape == (1, 8, 16)
  unknown, _ = _tiny_random(max_positions=None)  # no context known: nothing to refuse
  assert unknown(ids).shape == (1, 9, 16)


def test_context_errors_name_the_argument_that_does_not_fit():
  _, cfg = _tiny_random(max_positions=8)
  km.llama.check_context(cfg, 5, 3)  # exactly the context
  with pytest.raises(
    ValueError, match="max_new_tokens: 4 tokens after a prompt of 5 tokens make 9"
  ):
    km.llama.check_context(cfg, 5, 4)
  with pytest.raises(
    ValueError, match="prompt_ids: a prompt of 8 tokens leaves no room .* 2 tokens"
  ):
    km.llama.check_context(cfg, 8, 2, name="prompt_ids")
  with pytest.raises(ValueError, match="answer_ids: 2 tokens after a prompt of 7"):
    km.llama.check_context(cfg, 7, 2, new_name="answer_ids")
