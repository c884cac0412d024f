"""kvjax.model.sharding and decoding.shard_configs: the model path with its configurations, batch
and weights over 8 forced host devices gives what one device gives."""

import contextlib
import io
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import forced_devices_env
from flax import nnx

import kvjax.model as km
from kvjax.model import sharding

# a random Llama whose query heads (4), KV heads (2) and MLP features (96) all split over a
# model axis of 2; prompts of a batch of 4 split over a batch axis of 4
_RUN = """
import json
import numpy as np, jax
from flax import nnx
import kvjax.model as km
from kvjax.model import sharding
cfg = km.ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=96, num_layers=2, num_heads=4,
  num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=False)
model = km.Llama(cfg, rngs=nnx.Rngs(0))
ids = np.random.default_rng(0).integers(1, 97, (4, 40)).astype(np.int32)
mask = np.ones_like(ids); mask[1, :5] = 0
budgets = [12, 14, 16, 18, 20]  # 5 configurations, padded to 8 over 8 devices
# the configuration axis alone over every device (weights replicated)
g0 = km.generate_configs(model, ids, budgets, policy="snapkv", window=4, max_new_tokens=4)
# then the weights and the batch too
mesh = sharding.mesh(model_parallel=2 if len(jax.devices()) == 8 else 1)
sharding.shard_model(model, mesh)
wq = model.params()["wq"]
g = km.generate_configs(model, km.Padded(ids, mask), budgets, policy="snapkv", window=4,
  max_new_tokens=4)
a = km.answer_configs(model, ids, ids[:, :3], [12, 20, 24], policy="pyramidkv", window=4,
  question=km.Question(4))
pre = km.prefill(cfg, model.params(), *sharding.place_batch(model.params(), ids, mask))
print(json.dumps(dict(devices=len(jax.devices()), mesh=dict(mesh.shape),
  wq=len(wq.sharding.device_set), wq_shard=list(wq.addressable_shards[0].data.shape),
  keys_shard=list(pre.keys.addressable_shards[0].data.shape),
  tokens0=g0.tokens.tolist(), budget0=g0.budget_LH.tolist(), tokens=g.tokens.tolist(),
  pred=a.predicted.tolist(),
  answer_logp=np.asarray(a.logprobs, np.float64).tolist(),
  logits=np.asarray(pre.logits, np.float64).tolist())))
"""


def test_batch_and_weights_over_eight_devices_equal_one_device():
  out = subprocess.run(
    [sys.executable, "-c", _RUN],
    env=forced_devices_env(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  eight = json.loads(out.stdout.strip().splitlines()[-1])
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):  # the same script on this process's one device
    exec(_RUN, {})
  one = json.loads(printed.getvalue().strip().splitlines()[-1])
  assert (one["devices"], eight["devices"]) == (1, 8)
  assert eight["mesh"] == {"batch": 4, "model": 2} and eight["wq"] == 8
  assert eight["wq_shard"] == [2, 32, 16]  # wq [L, d, Hq * D] split by heads over 2
  assert eight["keys_shard"][1] == 1  # keys [L, B, G, T, D]: one prompt per batch group
  for key in ("tokens0", "budget0", "tokens", "pred"):
    assert eight[key] == one[key], key
  for key in ("answer_logp", "logits"):
    np.testing.assert_allclose(eight[key], one[key], atol=2e-5, err_msg=key)


def _model(**overrides):
  cfg = dict(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
  )
  return km.Llama(km.ModelConfig(**(cfg | overrides)), rngs=nnx.Rngs(0))


def test_param_specs_split_whole_heads_or_replicate():
  model = _model()
  specs = sharding.param_specs(model.cfg, model.params(), _FakeMesh(model=2))
  assert specs["wq"] == jax.sharding.PartitionSpec(None, None, "model")
  assert specs["wk"] == jax.sharding.PartitionSpec(None, None, "model")
  assert specs["wo"] == jax.sharding.PartitionSpec(None, "model", None)
  assert specs["w_down"] == jax.sharding.PartitionSpec(None, "model", None)
  assert specs["embed"] == specs["attn_norm"] == jax.sharding.PartitionSpec()
  # 2 KV heads do not split over 4 devices: replicated, still exact
  specs = sharding.param_specs(model.cfg, model.params(), _FakeMesh(model=4))
  assert specs["wk"] == specs["wv"] == jax.sharding.PartitionSpec()
  assert specs["wq"] == jax.sharding.PartitionSpec(None, None, "model")


class _FakeMesh:
  """Just the axis sizes :func:`sharding.param_specs` reads."""

  def __init__(self, model):
    self.shape = {"batch": 1, "model": model}


def test_bad_mesh_and_batch_shapes_are_refused():
  with pytest.raises(ValueError, match="model_parallel: expected an int >= 1, got 0"):
    sharding.mesh(model_parallel=0)
  with pytest.raises(ValueError, match="model_parallel: 3 does not divide the 2 devices"):
    sharding.mesh(model_parallel=3, devices=jax.devices() * 2)
  with pytest.raises(ValueError, match="does not split over 2 batch devices"):
    sharding.shard_batch(np.zeros((3, 4), np.int32), _FakeBatchMesh())
  model = _model()
  assert sharding.model_mesh(model.params()) is None  # one device: nothing placed
  (ids,) = sharding.place_batch(model.params(), np.zeros((3, 4), np.int32))
  assert isinstance(ids, jax.Array) and ids.shape == (3, 4)


class _FakeBatchMesh:
  shape = {"batch": 2, "model": 1}
