"""RoPE scalings (kvjax.model.llama.inv_frequencies, rope_tables) against transformers'
ROPE_INIT_FUNCTIONS, each type on its own, and in a tiny model's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import prompt, tiny_hf, torch, transformers

from kvjax import model as km
from kvjax.model import config as config_lib

ROPE_INIT = pytest.importorskip("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS
D = 32
SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 4.0},
  "dynamic": {"rope_type": "dynamic", "factor": 4.0},
  "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
  "yarn_mscale": {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 16,
    "beta_slow": 2,
    "truncate": False,
  },
  "yarn_attention_factor": {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "attention_factor": 1.25,
  },
  "longrope": {
    "rope_type": "longrope",
    "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
    "long_factor": [1.0 + 0.7 * i for i in range(D // 2)],
  },
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
  },
}


def hf_config(scaling: dict, max_positions: int = 256):
  return transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=4 * D,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=D,
    max_position_embeddings=max_positions,
    rope_parameters={"rope_theta": 50000.0, **scaling},
  )


def ours(hf_cfg):
  raw = hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}
  return config_lib.from_hf_dict(raw)


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 100, 1000])
def test_inverse_frequencies_and_attention_factor_match_transformers(name, seq_len):
  hf_cfg = hf_config(SCALINGS[name])
  kind = SCALINGS[name]["rope_type"]
  ref, factor = ROPE_INIT[kind](hf_cfg, None, seq_len=seq_len)
  cfg = ours(hf_cfg)
  assert cfg.rope_type == kind
  np.testing.assert_allclose(km.llama.inv_frequencies(cfg, seq_len), ref.numpy(), rtol=2e-6)
  assert cfg.rope_attention_factor == pytest.approx(factor, rel=1e-12)
  # inside jit, with the length traced (dynamic's base, longrope's short or long set)
  inv, scale = jax.jit(lambda n: km.llama.rope_tables(cfg, seq_len=n))(seq_len or 1)
  np.testing.assert_allclose(np.asarray(inv), ref.numpy(), rtol=2e-6)
  assert float(scale) == pytest.approx(factor, rel=1e-6)


def test_rotation_scales_cos_and_sin_as_the_rotary_embedding_does():
  hf_cfg = hf_config(SCALINGS["yarn_mscale"])
  emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
  positions = np.arange(50)[None]
  x = np.random.default_rng(0).normal(size=(1, 1, 50, D)).astype(np.float32)
  with torch.no_grad():
    cos, sin = emb(torch.tensor(x), torch.tensor(positions))
    ref = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
      torch.tensor(x), torch.tensor(x), cos, sin
    )[0].numpy()
  got = km.llama.rope(jnp.asarray(x), jnp.asarray(positions), ours(hf_cfg))
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn_mscale", "longrope"])
def test_a_tiny_llama_with_each_scaling_matches_transformers(name):
  # a 100-token prompt past a 64-position pretraining context: longrope goes long, and
  # dynamic's base grows (its max_position_embeddings is that context)
  scaling = SCALINGS[name]
  hf = tiny_hf("Llama", head_dim=D, rope_parameters={"rope_theta": 50000.0, **scaling})
  if name == "dynamic":
    hf.config.max_position_embeddings = 64
    hf.model.rotary_emb.__init__(hf.config)
  raw = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
  cfg = config_lib.from_hf_dict(raw)
  tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  params = km.loading.params_from_tensors(cfg, tensors)
  ids = prompt(T=100, B=1)
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  got = np.asarray(km.llama.forward(cfg, params, jnp.asarray(ids)))
  assert np.abs(got - ref).max() <= 1e-4, name


def test_bad_rope_parameters_name_the_argument():
  base = hf_config({}).to_dict() | {"architectures": ["LlamaForCausalLM"]}
  cases = [
    ({"rope_type": "mrope"}, "rope_type: unsupported 'mrope'"),
    ({"rope_type": "linear"}, "rope_parameters: 'linear' RoPE needs a 'factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "longrope needs short_factor and long"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor: 0.5 is not supported"),
  ]
  for params, match in cases:
    with pytest.raises(ValueError, match=match):
      config_lib.from_hf_dict(base | {"rope_parameters": {"rope_theta": 1e4, **params}})


@pytest.mark.parametrize("name", ["yarn_mscale", "longrope", "dynamic"])
def test_inverse_undoes_a_rotation_whatever_the_scaling(name):
  cfg = ours(hf_config(SCALINGS[name], max_positions=64))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 300, D)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(300), (2, 300))
  rotated = km.llama.rope_at(x, positions, cfg)
  assert np.abs(np.asarray(rotated - x)).max() > 0.1
  back = km.llama.rope_at(rotated, positions, cfg, inverse=True)
  np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=2e-4)
