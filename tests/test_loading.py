"""kvjax.model.config and kvjax.model.loading: configs of every family, named tensor errors,
sharded checkpoints."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import (
  make_checkpoint_cached,
  prompt,
  torch,
)
from safetensors.numpy import load_file, save_file

from kvjax import model as km
from kvjax.model import assets, loading
from kvjax.model import config as config_lib


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
  with pytest.raises(ValueError, match="rope_type: unsupported .mrope."):
    config_lib.from_hf_dict(base | {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}})


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


def test_weights_default_to_fp32_on_cpu_and_bf16_on_accelerators(monkeypatch):
  assert loading.default_dtype() == jnp.float32
  model, _, _ = km.load_tiny()
  assert model.params()["wq"].dtype == jnp.float32
  monkeypatch.setattr(loading.jax, "default_backend", lambda: "tpu")
  assert loading.default_dtype() == jnp.bfloat16
  with pytest.raises(ValueError, match="dtype"):
    km.load_tiny(dtype=jnp.int8)


@pytest.mark.parametrize(
  ("damage", "match"),
  [
    ("truncate", "model.safetensors is not a readable safetensors file"),
    ("garbage", "model.safetensors is not a readable safetensors file"),
    ("nan", "holds NaN or inf"),
    ("fewer_layers", "holds 4 layers, its config says num_hidden_layers=2"),
    ("gelu", "hidden_act: 'gelu' is not supported"),
    ("no_hidden_size", r"\['hidden_size'\] missing"),
    ("bad_json", "config.json is not valid JSON"),
  ],
)
def test_a_damaged_checkpoint_is_named(tmp_path, damage, match):
  path = tmp_path / "ckpt"
  shutil.copytree(assets.tiny_path(), path)
  weights, config = path / "model.safetensors", path / "config.json"
  raw = json.loads(config.read_text())
  if damage == "truncate":
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
  elif damage == "garbage":
    weights.write_bytes(b"\x00garbage" * 100)
  elif damage == "nan":
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][0] = np.nan
    save_file(tensors, str(weights))
  elif damage == "bad_json":
    config.write_text("{not json")
  else:
    if damage == "fewer_layers":
      raw["num_hidden_layers"] = 2
    elif damage == "gelu":
      raw["hidden_act"] = "gelu"
    else:
      del raw["hidden_size"]
    config.write_text(json.dumps(raw))
  with pytest.raises(ValueError, match=match):
    km.load(path)


def test_a_missing_local_path_is_named(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    km.load(tmp_path / "nowhere")


@pytest.mark.parametrize(
  ("index", "match"),
  [
    ('{"weight_map": ', r"model\.safetensors\.index\.json is not valid JSON"),
    ("[1, 2]", r"model\.safetensors\.index\.json holds a JSON list, expected an object"),
    ('{"metadata": {}}', r"model\.safetensors\.index\.json has no weight_map of tensor name"),
    ('{"weight_map": {"a": 3}}', r"model\.safetensors\.index\.json has no weight_map"),
  ],
)
def test_a_damaged_shard_index_is_named(tmp_path, index, match):
  path = tmp_path / "ckpt"
  shutil.copytree(assets.tiny_path(), path)
  (path / "model.safetensors.index.json").write_text(index)
  with pytest.raises(ValueError, match=match):
    km.load(path)


def test_a_file_that_is_neither_gguf_nor_a_checkpoint_is_named(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
  with pytest.raises(ValueError, match=r"model\.safetensors is a file but not a \.gguf file"):
    km.load(tmp_path / "model.safetensors")


def test_gemma_and_phi3_configs_as_the_hub_writes_them():
  base = dict(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=12,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
  )
  # a Gemma 3 file of transformers 4: the local base and the global scaling at the top level
  legacy = config_lib.from_hf_dict(
    base
    | {
      "architectures": ["Gemma3ForCausalLM"],
      "rope_theta": 1e6,
      "rope_local_base_freq": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0},
      "sliding_window_pattern": 6,
      "query_pre_attn_scalar": 4,
    }
  )
  assert legacy.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
  assert (legacy.rope_theta, legacy.rope_local_theta) == (1e6, 1e4)
  assert (legacy.rope_type, legacy.rope_factor, legacy.qk_norm) == ("linear", 8.0, True)
  nested = config_lib.from_hf_dict(
    base
    | {
      "architectures": ["Gemma3ForCausalLM"],
      "layer_types": list(legacy.layer_types),
      "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
      },
      "query_pre_attn_scalar": 4,
    }
  )
  assert nested == legacy
  # Gemma 2's defaults (transformers' Gemma2Config) for the keys a file leaves out
  g2 = config_lib.from_hf_dict(base | {"architectures": ["Gemma2ForCausalLM"]})
  assert (g2.attn_softcap, g2.final_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
  assert g2.layer_types[:2] == ("sliding_attention", "full_attention") and g2.tie_word_embeddings
  assert g2.mlp_activation == "gelu_tanh" and g2.sliding_window == 4096
  # Phi-3 128k: 'su' is LongRoPE, the pretraining context outside the RoPE dict
  phi = config_lib.from_hf_dict(
    base
    | {
      "architectures": ["Phi3ForCausalLM"],
      "max_position_embeddings": 131072,
      "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su", "short_factor": [1.0, 1.0], "long_factor": [2.0, 4.0]},
    }
  )
  assert (phi.rope_type, phi.rope_original_max_positions, phi.rope_factor) == (
    "longrope",
    4096,
    32.0,
  )
  assert phi.rope_attention_factor == pytest.approx(1.1902380714238083)
  for bad, match in (
    ({"layer_types": ["sliding_attention"]}, "layer_types: .*expected 12 entries"),
    ({"hidden_activation": "relu"}, "hidden_act: 'relu' is not supported"),
  ):
    with pytest.raises(ValueError, match=match):
      config_lib.from_hf_dict(base | {"architectures": ["Gemma2ForCausalLM"]} | bad)
