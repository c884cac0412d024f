"""Real models: parity with transformers, the compressed cache, generation, loading errors."""

import dataclasses
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvjax import model as km  # noqa: E402
from kvjax import policies  # noqa: E402
from kvjax.model import cache as cache_lib  # noqa: E402
from kvjax.model import config as config_lib  # noqa: E402

NEW = 32
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
}
FAMILIES = {
  "llama3_gqa_untied": ("Llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), 2),
  "llama_mha_tied": ("Llama", dict(tie_word_embeddings=True), 4),
  "mistral_gqa": ("Mistral", dict(sliding_window=4096), 2),
  "qwen2_bias_tied": ("Qwen2", dict(tie_word_embeddings=True), 2),
  "qwen3_qknorm": ("Qwen3", dict(head_dim=16), 2),
}


def tiny_hf(family: str, kv_heads: int = 2, **extra):
  """A seeded tiny transformers model of ``family`` (weights ~ N(0, 0.2^2): far from uniform
  attention, so positions and policies matter)."""
  torch.manual_seed(0)
  cfg = getattr(transformers, f"{family}Config")(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=kv_heads,
    max_position_embeddings=512,
    **extra,
  )
  hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.2)
  return hf


def make_checkpoint(tmp_path_factory, name):
  family, extra, kv_heads = FAMILIES[name]
  hf = tiny_hf(family, kv_heads, **extra)
  path = tmp_path_factory.mktemp(name)
  hf.save_pretrained(path)
  return hf, path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  hf, path = make_checkpoint(tmp_path_factory, request.param)
  model, cfg = km.load(path)
  return request.param, hf, model, cfg


def prompt(T=40, B=1, seed=0):
  return np.random.default_rng(seed).integers(0, 128, size=(B, T)).astype(np.int32)


def hf_generate(hf, ids, new=NEW, mask=None):
  mask = np.ones_like(ids) if mask is None else mask  # else HF infers padding from pad_token_id
  kwargs = {"attention_mask": torch.tensor(mask)}
  with torch.no_grad():
    hf.generation_config.eos_token_id = None  # kvjax generates a fixed number of tokens
    out = hf.generate(
      torch.tensor(ids), max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs
    )
  return out.numpy()[:, ids.shape[1] :]


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


@pytest.mark.parametrize(
  "policy",
  [
    "snapkv",
    "pyramidkv",
    "adakv_snapkv",
    "knorm",
    "h2o",
    "streaming_llm",
    "tova",
    "sliding_window",
  ],
)
def test_budget_covering_the_prompt_reproduces_full_cache(family, policy):
  _, _, model, _ = family
  ids = prompt(T=40)
  full = km.generate(model, ids, max_new_tokens=NEW).tokens
  # prefill-time policies append without eviction: budget >= prompt suffices; decode-time
  # policies evict once prompt + generated exceeds the budget, so they need T + NEW.
  budget = 40 + NEW if policy in cache_lib.DECODE_POLICIES else 40
  options = {"window": 8} if policy in ("snapkv", "pyramidkv", "adakv_snapkv") else {}
  out = km.generate(model, ids, policy=policy, budget=budget, max_new_tokens=NEW, **options)
  np.testing.assert_array_equal(out.tokens, full)


def test_left_and_right_padding_match_unpadded_rows(family):
  _, hf, model, _ = family
  a, b = prompt(T=40, seed=1)[0], prompt(T=31, seed=2)[0]
  solo = [km.generate(model, r[None], max_new_tokens=12).tokens[0] for r in (a, b)]
  left = np.zeros((2, 40), np.int32)
  left[0], left[1, 9:] = a, b
  left_mask = (np.arange(40) >= np.array([[0], [9]])).astype(np.int32)
  right = np.zeros((2, 40), np.int32)
  right[0], right[1, :31] = a, b
  right_mask = (np.arange(40) < np.array([[40], [31]])).astype(np.int32)
  for ids, mask, side in ((left, left_mask, "left"), (right, right_mask, "right")):
    out = km.generate(model, ids, attention_mask=mask, padding_side=side, max_new_tokens=12).tokens
    np.testing.assert_array_equal(out, np.stack(solo), err_msg=side)
    comp = km.generate(
      model,
      ids,
      attention_mask=mask,
      padding_side=side,
      policy="snapkv",
      budget=24,
      window=8,
      max_new_tokens=12,
    )
    solo_comp = [
      km.generate(model, r[None], policy="snapkv", budget=24, window=8, max_new_tokens=12).tokens[0]
      for r in (a, b)
    ]
    np.testing.assert_array_equal(comp.tokens, np.stack(solo_comp), err_msg=side)
  np.testing.assert_array_equal(solo[0], hf_generate(hf, a[None], 12)[0])


def test_per_head_and_per_layer_budgets_really_shrink_the_cache(family):
  _, _, model, cfg = family
  ids = prompt(T=64)
  for policy in ("pyramidkv", "adakv_snapkv"):
    out = km.generate(model, ids, policy=policy, budget=24, window=8, max_new_tokens=8)
    budget = out.budget_LH[0]
    assert (
      out.memory["kv_bytes_held"]
      < out.memory["kv_bytes_allocated"]
      < out.memory["full_cache_bytes"]
    )
    held_tokens = np.minimum(budget, 64).sum() + 7 * budget.size  # the last token is never fed back
    assert out.memory["kv_bytes_held"] == held_tokens * 2 * cfg.head_dim * 4
    if policy == "pyramidkv":
      assert budget[0, 0] > budget[-1, 0]
  out = km.generate(model, ids, policy="streaming_llm", budget=16, max_new_tokens=8)
  assert (
    out.memory["kv_bytes_held"] == 16 * cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * 4
  )


def test_memory_bookkeeping_is_small():
  hf, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  out = km.generate(model, prompt(T=64), policy="snapkv", budget=32, window=8, max_new_tokens=8)
  assert out.memory["bookkeeping_bytes"] <= 0.05 * out.memory["kv_bytes_allocated"] * 2


_CACHE = {}


def make_checkpoint_cached():
  if "ckpt" not in _CACHE:
    import tempfile  # noqa: PLC0415

    _, extra, _ = FAMILIES["llama3_gqa_untied"]
    hf = tiny_hf("Llama", head_dim=32, **extra)
    path = pathlib.Path(tempfile.mkdtemp())
    hf.save_pretrained(path)
    _CACHE["ckpt"] = (hf, path)
  return _CACHE["ckpt"]


def test_vmapped_configurations_equal_separate_runs():
  hf, path = make_checkpoint_cached()
  model, _ = km.load(path)
  ids = prompt(T=48, B=2)
  budgets = np.array([12, 20, 33, 48], np.int32)
  many = km.generate_configs(model, ids, budgets, policy="snapkv", window=8, max_new_tokens=10)
  assert many.tokens.shape == (4, 2, 10)
  for c, b in enumerate(budgets):
    one = km.generate(model, ids, policy="snapkv", budget=int(b), window=8, max_new_tokens=10)
    np.testing.assert_array_equal(many.tokens[c], one.tokens)


def test_config_reads_transformers_5_and_legacy_rope():
  base = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
  )
  new = config_lib.from_hf_dict(
    base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
  )
  old = config_lib.from_hf_dict(
    base | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}}
  )
  assert new == old and new.rope_type == "llama3" and new.rope_theta == 5e5
  with pytest.raises(ValueError, match=r"architectures: \['GPT2LMHeadModel'\] is not supported"):
    config_lib.from_hf_dict(base | {"architectures": ["GPT2LMHeadModel"]})
  with pytest.raises(ValueError, match="rope_type: unsupported 'yarn'"):
    config_lib.from_hf_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_missing_and_misshaped_tensors_are_named(tmp_path):
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415

  _, path = make_checkpoint_cached()
  tensors = load_file(str(path / "model.safetensors"))
  config = (path / "config.json").read_text()
  bad = tmp_path / "missing"
  bad.mkdir()
  (bad / "config.json").write_text(config)
  save_file(
    {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k},
    str(bad / "model.safetensors"),
  )
  with pytest.raises(
    ValueError,
    match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing \(expected shape \(128, 64\)\)",
  ):
    km.load(bad)
  wrong = tmp_path / "wrong"
  wrong.mkdir()
  (wrong / "config.json").write_text(config)
  tensors["model.norm.weight"] = np.ones(3, np.float32)
  save_file(tensors, str(wrong / "model.safetensors"))
  with pytest.raises(
    ValueError, match=r"tensor 'model.norm.weight' has shape \(3,\), expected \(64,\)"
  ):
    km.load(wrong)


def test_sharded_checkpoint_with_index(tmp_path):
  hf, _ = make_checkpoint_cached()
  hf.save_pretrained(tmp_path, max_shard_size="100KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 5
  model, _ = km.load(tmp_path)
  ids = prompt(T=12)
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  assert np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max() <= 1e-4


def test_bad_generation_inputs():
  _, path = make_checkpoint_cached()
  model, _ = km.load(path)
  with pytest.raises(ValueError, match="budget: required"):
    km.generate(model, prompt(), policy="snapkv")
  with pytest.raises(ValueError, match="prompt_ids: expected"):
    km.generate(model, np.zeros(5, np.int32))
  with pytest.raises(ValueError, match="padding_side"):
    km.generate(model, prompt(), padding_side="middle")
  with pytest.raises(ValueError, match="name: unknown policy"):
    km.generate(model, prompt(), policy="snapkvv", budget=8)


def test_snapkv_on_the_model_keeps_kvpress_positions():
  """kvpress 0.5.5 SnapKVPress (window 8, avgpool k=5, mean votes, GQA mean) on the committed
  tiny checkpoint (tests/make_kvpress_fixtures.py) vs kvjax's own prefill + compressed cache."""
  fixtures = pathlib.Path(__file__).parent / "fixtures"
  data = np.load(fixtures / "kvpress_0_5_5.npz")
  model, cfg = km.load(fixtures / "kvpress_tiny_llama")
  ids = data["input_ids_T"][None].astype(np.int32)
  T = ids.shape[1]
  pre = km.prefill(cfg, model.params(), jnp.asarray(ids), window=8)
  np.testing.assert_allclose(np.asarray(pre["keys"][:, 0]), data["keys_LGTD"], atol=1e-5)
  spec = cache_lib.CacheSpec(policies.make("snapkv_kvpress", num_kv_heads=cfg.num_kv_heads), T // 2)
  cache = cache_lib.compress(cfg, pre, spec, T // 2)
  kept = np.zeros((cfg.num_layers, cfg.num_kv_heads, T), bool)
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  for l, h in np.ndindex(cfg.num_layers, cfg.num_kv_heads):
    kept[l, h, pos[l, h][valid[l, h]]] = True
  np.testing.assert_array_equal(kept, data["snapkv_keep_LGT"])


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
    window=6,
    column_sums=True,
    full_attention_layers=(0, 1),
    block=8,
  )
  for layer in (0, 1):
    maps = np.asarray(pre["full_attention"][layer])  # [B, Hq, T, T]
    real = mask.astype(bool)
    np.testing.assert_allclose(
      maps.sum(-1)[real[:, None, :].repeat(cfg.num_heads, 1)], 1.0, atol=1e-5
    )
    assert (maps[1][..., :5] == 0).all(), "padding receives no attention"
    np.testing.assert_allclose(np.asarray(pre["attn_window"][layer]), maps[:, :, -6:], atol=1e-6)
    sums = (maps * real[:, None, :, None]).sum(-2)
    np.testing.assert_allclose(np.asarray(pre["column_sums"][layer]), sums, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(pre["key_norms"]), np.linalg.norm(np.asarray(pre["keys"]), axis=-1), rtol=1e-6
  )


def test_bfloat16_model_tracks_float32():
  _, path = make_checkpoint_cached()
  m32, _ = km.load(path)
  m16, _ = km.load(path, dtype=jnp.bfloat16)
  ids = jnp.asarray(prompt(T=24))
  l32, l16 = np.asarray(m32(ids)), np.asarray(m16(ids))
  assert l16.dtype == np.float32 and np.abs(l32 - l16).max() < 0.1 * np.abs(l32).max()


def test_streaming_llm_position_reindexing(tmp_path_factory):
  _, path = make_checkpoint(tmp_path_factory, "llama_mha_tied")  # theta 1e4: positions matter
  model, cfg = km.load(path)
  ids = prompt(T=40)
  full = km.generate(model, ids, max_new_tokens=16).tokens
  # nothing evicted: ranks inside the cache are the original positions
  same = km.generate(
    model, ids, policy="streaming_llm", budget=60, max_new_tokens=16, reindex_positions=True
  )
  np.testing.assert_array_equal(same.tokens, full)
  # with eviction, keys are renumbered by rank: the sinks sit next to the recent window
  pre = km.prefill(cfg, model.params(), jnp.asarray(ids))
  logits = {}
  for reindex in (False, True):
    spec = cache_lib.CacheSpec(policies.make("streaming_llm"), 12, reindex=reindex)
    cache = cache_lib.compress(cfg, pre, spec, 12)
    if reindex:  # stored pre-RoPE: rotating back by the original positions restores the keys
      restored = km.llama.rope_at(cache.keys, cache.positions, cfg)
      plain = cache_lib.compress(cfg, pre, dataclasses.replace(spec, reindex=False), 12)
      np.testing.assert_allclose(np.asarray(restored), np.asarray(plain.keys), atol=1e-5)
    tok, pos = jnp.asarray([5]), jnp.asarray([40])
    logits[reindex] = np.asarray(
      cache_lib.decode_step(cfg, model.params(), spec, cache, tok, pos, pos)[0]
    )
  assert np.abs(logits[True] - logits[False]).max() > 1e-3


def test_review_regressions_budgets_capacity_sinks_and_windows(tmp_path_factory):
  _, path = make_checkpoint_cached()
  model, cfg = km.load(path)
  ids = prompt(T=40)
  for bad, match in (
    (0, "budget: 0 is below 9"),
    (-3, "budget: -3"),
    (20.5, "integer token counts"),
  ):
    with pytest.raises(ValueError, match=match):
      km.generate(model, ids, policy="snapkv", budget=bad, window=8)
  with pytest.raises(ValueError, match="budget: 10 is below 33"):
    km.generate_configs(model, ids, [10, 36], policy="pyramidkv")
  with pytest.raises(ValueError, match="must exceed H2O's recent window"):
    km.generate(model, ids, policy="h2o", budget=6)
  # a capacity below the budget is flagged, never silently clamped
  pre = km.prefill(cfg, model.params(), jnp.asarray(ids), window=8)
  small = cache_lib.compress(
    cfg, pre, cache_lib.CacheSpec(policies.make("snapkv", window=8), 4), 33
  )
  assert bool(np.asarray(small.overflow).all())
  # StreamingLLM keeps the first *real* tokens of a left-padded row
  padded = np.zeros((1, 52), np.int32)
  padded[0, 12:] = ids[0]
  mask = (np.arange(52) >= 12).astype(np.int32)[None]
  pre = km.prefill(cfg, model.params(), jnp.asarray(padded), jnp.asarray(mask))
  cache = cache_lib.compress(cfg, pre, cache_lib.CacheSpec(policies.make("streaming_llm"), 16), 16)
  kept = np.asarray(cache.positions)[np.asarray(cache.valid)].reshape(-1, 16)
  assert (kept[:, :4] == [0, 1, 2, 3]).all() and (kept[:, 4:] == np.arange(28, 40)).all()


def test_mistral_sliding_window_applies_during_decoding(tmp_path):
  hf = tiny_hf("Mistral", sliding_window=8)
  hf.save_pretrained(tmp_path)
  model, _ = km.load(tmp_path)
  ids = prompt(T=24)
  out = km.generate(model, ids, max_new_tokens=8).tokens
  seq = np.concatenate([ids, out], 1)
  teacher = np.asarray(model(jnp.asarray(seq))).argmax(-1)[0, 23:31]
  np.testing.assert_array_equal(out[0], teacher)
