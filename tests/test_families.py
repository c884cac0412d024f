"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers: logits, greedy tokens, sliding and
global layers, the prefill's blocking and evidence on layers that differ."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import NEW, family_checkpoint, hf_generate, prompt, torch
from test_model_methods import PADDED_POLICIES

from kvjax import model as km
from kvjax import policies

FAMILIES = ("gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
  hf, path = family_checkpoint(request.param)
  model, cfg = km.load(path)
  return request.param, hf, model, cfg


def greedy_by_forward(cfg, params, ids, new):
  """Greedy tokens from full forward passes over one fixed-size buffer (one compile): the model
  alone, without the compressed cache."""
  T = ids.shape[1]
  buf = np.zeros((ids.shape[0], T + new), np.int32)
  buf[:, :T] = ids
  step = jax.jit(lambda b: km.llama.forward(cfg, params, b))
  for t in range(new):
    buf[:, T + t] = np.asarray(step(jnp.asarray(buf)))[:, T + t - 1].argmax(-1)
  return buf[:, T:]


def test_logits_match_transformers_with_a_padded_row(loaded):
  name, hf, model, cfg = loaded
  ids = prompt(T=40, B=2)
  mask = np.ones_like(ids)
  mask[1, :6] = 0
  with torch.no_grad():
    ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  ours = np.asarray(km.llama.forward(cfg, model.params(), jnp.asarray(ids), jnp.asarray(mask)))
  real = mask.astype(bool)
  assert np.abs(ours - ref)[real].max() <= 1e-4, name


def test_32_greedy_tokens_match_transformers(loaded):
  name, hf, model, cfg = loaded
  ids = prompt(T=40, B=1, seed=1)
  ref = hf_generate(hf, ids)
  np.testing.assert_array_equal(greedy_by_forward(cfg, model.params(), ids, NEW), ref)


def generation_matches_transformers(loaded, layouts: dict) -> None:
  """The full cache, and each policy of ``layouts`` (its cache layout) with a budget above the
  prompt (nothing evicted), give transformers' greedy tokens."""
  name, hf, model, cfg = loaded
  ids = prompt(T=40, B=1, seed=1)
  ref = hf_generate(hf, ids)
  try:
    got = km.generate(model, ids, max_new_tokens=NEW).tokens
  except ValueError as e:
    if not str(e).startswith("layer:"):
      raise
    pytest.skip(f"{name}: the cache's decode step computes layers without their index ({e})")
  np.testing.assert_array_equal(got, ref)
  for policy, layout in layouts.items():
    try:
      out = km.generate(model, ids, max_new_tokens=8, policy=policy, budget=200, layout=layout)
    except ValueError as e:  # re-indexed positions may be refused where layers rotate differently
      if not (cfg.per_layer and str(e).startswith("layout:")):
        raise
      continue
    np.testing.assert_array_equal(out.tokens, ref[:, :8], err_msg=policy)


def test_generation_through_the_compressed_cache_matches_transformers(loaded):
  """The full cache and StreamingLLM's re-indexed positions give transformers' greedy tokens."""
  generation_matches_transformers(loaded, {"streaming_llm": km.cache.Layout(reindex=True)})


@pytest.mark.slow
def test_generation_through_a_kv_layout_cache_matches_transformers(loaded):
  generation_matches_transformers(loaded, {"snapkv": "kv", "h2o": "kv"})


def test_the_sliding_layers_really_slide():
  for name in ("gemma2", "gemma3"):
    _, path = family_checkpoint(name)
    model, cfg = km.load(path)
    assert cfg.sliding_window < 40 and "full_attention" in cfg.layer_types
    ids = jnp.asarray(prompt(T=40))
    ours = np.asarray(km.llama.forward(cfg, model.params(), ids))
    unwindowed = dataclasses.replace(cfg, sliding_window=10**6)
    other = np.asarray(km.llama.forward(unwindowed, model.params(), ids))
    assert np.abs(ours[:, :8] - other[:, :8]).max() < 1e-5, "inside the window: the same"
    assert np.abs(ours[:, 20:] - other[:, 20:]).max() > 1e-2, "past it: the window binds"


def test_layer_windows_and_rope_follow_the_layer_types():
  _, path = family_checkpoint("gemma3")
  _, cfg = km.load(path)
  np.testing.assert_array_equal(km.llama.is_sliding(cfg), [True, False, True])
  assert km.llama.layer_window(cfg, 0) == 8 and km.llama.layer_window(cfg, 1) is None
  traced = jax.jit(lambda l: km.llama.layer_window(cfg, l))
  assert [int(traced(i)) for i in range(3)] == [8, km.llama.FULL_WINDOW, 8]
  local, _ = km.llama.rope_tables(cfg, layer=0)
  glob, _ = km.llama.rope_tables(cfg, layer=1)
  np.testing.assert_allclose(local, km.llama.inv_frequencies(cfg, local=True), rtol=1e-6)
  np.testing.assert_allclose(glob, 1e6 ** -(np.arange(0, 16, 2) / 16) / 8.0, rtol=1e-6)
  for call in (
    lambda: km.llama.layer_window(cfg),
    lambda: km.llama.rope_tables(cfg),
  ):
    with pytest.raises(ValueError, match="layer: the gemma3 layers differ"):
      call()


# quick mode checks Gemma 3's blocking
@pytest.mark.parametrize("name", [pytest.param("gemma2", marks=pytest.mark.slow), "gemma3"])
def test_blocked_prefill_and_its_evidence_on_sliding_and_global_layers(name):
  _, path = family_checkpoint(name)
  model, cfg = km.load(path)
  params = model.params()
  ids = prompt(T=37, B=2)
  mask = np.ones_like(ids)
  mask[1, :5] = 0
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  whole = km.llama.forward(cfg, params, ids, mask)
  pre = km.prefill(
    cfg,
    params,
    ids,
    mask,
    request=policies.EvidenceRequest(window=6, column_sums=True),
    full_attention_layers=(0, 1, 2),
    logits="all",
    plan=km.llama.PrefillPlan(block=4, chunk=16),
  )
  real = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(np.asarray(pre.logits)[real], np.asarray(whole)[real], atol=1e-5)
  for layer in range(3):
    maps = np.asarray(pre.full_attention[layer])
    np.testing.assert_allclose(np.asarray(pre.attn_window[layer]), maps[:, :, -6:], atol=1e-6)
    sums = (maps * real[:, None, :, None]).sum(-2)
    np.testing.assert_allclose(np.asarray(pre.column_sums[layer]), sums, atol=1e-5)
    behind = maps[0, :, -1, : 37 - 8]  # keys the last query's window leaves out
    assert (behind == 0).all() == bool(km.llama.is_sliding(cfg)[layer]), layer


def test_gemma_norms_are_stored_with_the_one_added_and_written_back_without():
  hf, path = family_checkpoint("gemma2")
  model, cfg = km.load(path)
  params = model.params()
  w = hf.model.layers[1].pre_feedforward_layernorm.weight.detach().numpy()
  np.testing.assert_allclose(np.asarray(params["mlp_norm"][1]), 1.0 + w, rtol=1e-6)
  tensors = km.loading.tensors_from_params(cfg, params)
  np.testing.assert_allclose(
    tensors["model.layers.1.pre_feedforward_layernorm.weight"], w, atol=1e-6
  )
  with pytest.raises(ValueError, match="cfg: writing family 'gemma2' is not supported"):
    km.config.to_hf_dict(cfg)


def test_phi3_fused_projections_are_split_and_checked():
  hf, path = family_checkpoint("phi3")
  model, cfg = km.load(path)
  fused = hf.model.layers[0].self_attn.qkv_proj.weight.detach().numpy()
  np.testing.assert_allclose(np.asarray(model.params()["wk"][0]).T, fused[64:96], rtol=1e-6)
  gate_up = hf.model.layers[0].mlp.gate_up_proj.weight.detach().numpy()
  np.testing.assert_allclose(np.asarray(model.params()["w_up"][0]).T, gate_up[128:], rtol=1e-6)
  bad = {"model.layers.0.self_attn.qkv_proj.weight": np.zeros((100, 64), np.float32)}
  with pytest.raises(ValueError, match=r"qkv_proj.weight' has shape \(100, 64\), expected 128"):
    km.loading.split_fused(cfg, bad)


# quick mode: Gemma 3 (the family kvpress tests) and two policies; the rest of every family by
# every policy the Llama tests pad is slow
QUICK_POLICIES = ("snapkv", "knorm")
POLICY_MATRIX = [
  pytest.param(
    name,
    policy,
    marks=() if name == "gemma3" and policy in QUICK_POLICIES else pytest.mark.slow,
  )
  for name in FAMILIES
  for policy in PADDED_POLICIES
]
# the policies whose evidence a bare prompt does not give (kvjax.model.calibrate computes it)
NEEDS_EVIDENCE = (
  "kvzap",
  "fastkvzip",
  "restorekv",
  "expected_attention_stats",
  "kvcompose",
  "kvcompose_unstructured",
  "kvgrad",
)


def refusal(name: str, policy: str) -> str | None:
  """What ``keep_mask(model, ids, policy, 40)`` on a 48-token prompt of family ``name`` raises
  (a ``ValueError`` message's start), or ``None`` where it selects."""
  if policy in NEEDS_EVIDENCE:
    return f"evidence: policy '{policy}' needs"
  if policy == "cam_knorm":  # CaM merges into a cache that evicts nothing
    return "budget: 40 < T=48, but policy 'Full' keeps every token"
  if policy in ("pyramidkv", "adakv_pyramidkv") and name != "phi3":
    # the policy selects over the global layers alone, and the tiny Gemma checkpoints have one
    return "num_layers: PyramidKV's 'legacy_floor' schedule divides by num_layers - 1"
  return None


@pytest.mark.parametrize(("name", "policy"), POLICY_MATRIX)
def test_policies_select_on_each_family_and_a_padded_row_keeps_what_it_alone_keeps(name, policy):
  """A kept set on every layer, sliding ones included, and a left-padded row keeps what the
  prompt alone keeps; a policy whose evidence needs more than a bare prompt is refused, naming
  what it needs (:func:`refusal`)."""
  _, path = family_checkpoint(name)
  model, _ = km.load(path)
  rng = np.random.default_rng(0)
  ids = (3 + rng.permutation(125)[None, :48]).astype(np.int32)  # distinct: no tied key norms
  expected_error = refusal(name, policy)
  if expected_error is not None:
    with pytest.raises(ValueError, match=re.escape(expected_error)):
      km.keep_mask(model, ids, policy, 40)
    return
  both = np.concatenate([np.concatenate([np.zeros((1, 7), np.int32), ids], 1)] * 2, 0)
  mask = np.ones_like(both)
  mask[0, :7] = 0
  alone = km.keep_mask(model, ids, policy, 40)
  assert alone.any(-1).all(), policy
  padded = km.keep_mask(model, km.Padded(both, mask), policy, 40)
  np.testing.assert_array_equal(padded[:, 0, :, 7:], alone[:, 0], err_msg=policy)


@pytest.mark.slow
def test_prefill_and_decode_time_policies_generate_on_phi3():
  _, path = family_checkpoint("phi3")
  model, _ = km.load(path)
  ids = prompt(T=48, B=1, seed=2)
  full = km.generate(model, ids, max_new_tokens=8).tokens
  for policy in ("snapkv", "pyramidkv", "knorm", "expected_attention", "streaming_llm", "h2o"):
    out = km.generate(model, ids, max_new_tokens=8, policy=policy, budget=64)
    np.testing.assert_array_equal(out.tokens, full, err_msg=f"{policy}: a budget above T")


def test_gemma3_multimodal_checkpoints_load_their_text_decoder(tmp_path):
  import json  # noqa: PLC0415

  from safetensors.numpy import load_file, save_file  # noqa: PLC0415

  _, path = family_checkpoint("gemma3")
  text = json.loads((path / "config.json").read_text())
  tensors = load_file(str(path / "model.safetensors"))
  for prefix in ("model.language_model.", "language_model.model."):  # transformers 5, then 4
    out = tmp_path / prefix.strip(".")
    out.mkdir()
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    (out / "config.json").write_text(json.dumps(config | {"vision_config": {"hidden_size": 8}}))
    renamed = {prefix + k[len("model.") :]: v for k, v in tensors.items()}
    renamed["vision_tower.patch_embedding.weight"] = np.zeros((8, 3), np.float32)
    save_file(renamed, str(out / "model.safetensors"))
    model, cfg = km.load(out)
    ref, ref_cfg = km.load(path)
    assert cfg == ref_cfg
    for k, v in ref.params().items():
      np.testing.assert_array_equal(np.asarray(model.params()[k]), np.asarray(v))
  with pytest.raises(ValueError, match="text_config: a Gemma3ForConditionalGeneration"):
    km.config.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_bfloat16_gemma_tracks_float32():
  """Gemma's norms scale in fp32 before the cast and its embedding scale is the bf16 value."""
  _, path = family_checkpoint("gemma3")
  m32, _ = km.load(path)
  m16, cfg = km.load(path, dtype=jnp.bfloat16)
  ids = jnp.asarray(prompt(T=24))
  l32, l16 = np.asarray(m32(ids)), np.asarray(m16(ids))
  assert l16.dtype == np.float32 and np.abs(l32 - l16).max() < 0.1 * np.abs(l32).max()
  x = km.llama.embed_tokens(cfg, m16.params(), ids)
  assert x.dtype == jnp.bfloat16
  scale = jnp.asarray(8.0, jnp.bfloat16)  # sqrt(64)
  np.testing.assert_array_equal(np.asarray(x), np.asarray(m16.params()["embed"][ids] * scale))
