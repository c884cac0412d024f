"""The model path over several devices: the batch and the parameters on a ``Mesh``.

Sharding is JAX's job (the design section of ``docs/concepts.md``). :func:`mesh` lays every
device out on two axes, ``"batch"`` (data parallel: each device group holds some of the prompts)
and ``"model"`` (tensor parallel, Megatron's layout, for a model too big for one chip).
:func:`shard_model` places the weights on it and :func:`shard_batch` the prompts; the jitted
prefill, compression and decoding then run unchanged, GSPMD partitioning each program from its
inputs' shardings and inserting the collectives. Nothing here changes a value beyond the order
of floating-point sums (``tests/test_sharding.py`` checks 8 forced host devices against one).

The parameter layout (``P`` = ``PartitionSpec``), all stacked over layers first:

* query, key and value projections ``[L, d, heads * D]`` split by output features, whole heads per
  device (``P(None, None, "model")``), their biases alike; the output projection ``[L, Hq * D,
  d]`` by input features (``P(None, "model", None)``), so attention needs one all-reduce a layer;
* the MLP's gate and up ``[L, d, F]`` by ``F``, its down ``[L, F, d]`` by ``F``: one all-reduce;
* embeddings, norms, QK-norms and the LM head stay replicated (the vocabulary gather and the
  last position's logits are small next to the layers).

A weight whose split does not divide evenly over the ``"model"`` axis (the key/value heads of a
GQA model with fewer KV heads than model devices) stays replicated: still exact, only less memory
saved. The configuration axis of :func:`kvjax.model.decoding.shard_configs` is separate (its own
one-axis mesh of the same devices).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.model.config import ModelConfig

AXES = ("batch", "model")

# parameter name -> (axis split over "model", what it counts: heads of which kind, or "mlp")
_SPLITS = {
  "wq": (2, "q"),
  "bq": (1, "q"),
  "wk": (2, "kv"),
  "bk": (1, "kv"),
  "wv": (2, "kv"),
  "bv": (1, "kv"),
  "wo": (1, "q"),
  "w_gate": (2, "mlp"),
  "w_up": (2, "mlp"),
  "w_down": (1, "mlp"),
}


def _check_axis_size(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
  return int(value)


def mesh(model_parallel: int = 1, devices=None) -> Mesh:
  """Lays devices out on a ``("batch", "model")`` mesh.

  ``model_parallel`` devices split each layer's weights; the rest hold different prompts.

  Args:
    model_parallel: the size of the ``"model"`` axis, a divisor of the number of devices.
    devices: the devices to use; every device (``jax.devices()``) when ``None``.

  Returns:
    A mesh of shape ``(len(devices) // model_parallel, model_parallel)``.

  Raises:
    ValueError: when ``model_parallel`` is not an int >= 1 or does not divide the number of
      devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  m = _check_axis_size("model_parallel", model_parallel)
  if len(devices) % m:
    raise ValueError(
      f"model_parallel: {m} does not divide the {len(devices)} devices; expected a divisor"
    )
  return Mesh(np.asarray(devices).reshape(len(devices) // m, m), AXES)


def _split_count(cfg: ModelConfig, kind: str) -> int:
  return {"q": cfg.num_heads, "kv": cfg.num_kv_heads, "mlp": cfg.intermediate_size}[kind]


def param_specs(cfg: ModelConfig, params: dict, mesh_: Mesh) -> dict[str, PartitionSpec]:
  """Chooses the ``PartitionSpec`` of every parameter (see the module docstring).

  A parameter is split over ``"model"`` where whole heads (or MLP features) divide evenly over
  that axis, and replicated otherwise.

  Args:
    cfg: the model configuration (its head counts and MLP width).
    params: kvjax parameter name -> array, stacked over layers first.
    mesh_: the ``("batch", "model")`` mesh (:func:`mesh`).

  Returns:
    Parameter name -> ``PartitionSpec``.
  """
  size = mesh_.shape["model"]
  specs = {}
  for name, value in params.items():
    axis, kind = _SPLITS.get(name, (None, None))
    if axis is None or size == 1 or _split_count(cfg, kind) % size:
      specs[name] = PartitionSpec()
      continue
    spec = [None] * np.ndim(value)
    spec[axis] = "model"
    specs[name] = PartitionSpec(*spec)
  return specs


def shard_model(model, mesh_: Mesh):
  """Places a model's weights on a mesh, in place.

  Args:
    model: the :class:`kvjax.model.llama.Llama` to shard.
    mesh_: the ``("batch", "model")`` mesh (:func:`mesh`); the layout is :func:`param_specs`'.

  Returns:
    ``model`` itself, its weights sharded.
  """
  params = model.params()
  specs = param_specs(model.cfg, params, mesh_)
  placed = {k: jax.device_put(v, NamedSharding(mesh_, specs[k])) for k, v in params.items()}
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, placed)
  nnx.update(model, state)
  return model


def shard_batch(x, mesh_: Mesh):
  """Splits a batch over the mesh's ``"batch"`` axis, replicated over ``"model"``.

  Args:
    x: a batch ``[B, ...]`` (prompt ids, an attention mask); ``B`` must be a multiple of the
      batch axis's size.
    mesh_: the ``("batch", "model")`` mesh (:func:`mesh`).

  Returns:
    ``x`` as a ``jax.Array`` with that sharding.

  Raises:
    ValueError: when ``x`` has no leading dimension or ``B`` is not a multiple of the batch
      axis's size.
  """
  arr = np.asarray(x) if not isinstance(x, jax.Array) else x
  n = mesh_.shape["batch"]
  if arr.ndim < 1 or arr.shape[0] % n:
    raise ValueError(
      f"x: a batch of shape {tuple(arr.shape)} does not split over {n} batch devices; "
      f"expected a leading dimension that is a multiple of {n}"
    )
  spec = PartitionSpec("batch", *([None] * (arr.ndim - 1)))
  return jax.device_put(arr, NamedSharding(mesh_, spec))


def model_mesh(params: dict) -> Mesh | None:
  """Returns the mesh a model's parameters were placed on by :func:`shard_model`.

  Args:
    params: the model's parameters, kvjax parameter name -> array.

  Returns:
    The ``("batch", "model")`` mesh, or ``None`` on a single device or for weights placed
    otherwise.
  """
  sharding = getattr(params.get("embed"), "sharding", None)
  mesh_ = sharding.mesh if isinstance(sharding, NamedSharding) else None
  return mesh_ if mesh_ is not None and mesh_.axis_names == AXES and mesh_.size > 1 else None


def place_batch(params: dict, *arrays):
  """Places batch arrays on the devices of a model's mesh.

  Each array is split over the ``"batch"`` axis of the model's mesh when the model is sharded and
  ``B`` divides over it, and replicated when it does not (the batch then runs whole on every
  batch group, still exact); for an unsharded model the arrays become plain device arrays.

  Args:
    params: the model's parameters (:func:`model_mesh` finds their mesh).
    *arrays: the arrays, ``[B, ...]`` each.

  Returns:
    The arrays as device arrays, in order.
  """
  mesh_ = model_mesh(params)
  out = []
  for x in arrays:
    if mesh_ is not None and np.shape(x)[0] % mesh_.shape["batch"] == 0:
      out.append(shard_batch(x, mesh_))
    elif mesh_ is not None:
      out.append(jax.device_put(np.asarray(x), NamedSharding(mesh_, PartitionSpec())))
    else:
      out.append(jax.numpy.asarray(x))
  return tuple(out)
