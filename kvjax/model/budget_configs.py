"""``K`` budget configurations over one shared prefill: the cache's spec sized for all of them
and their allocations (:func:`configs_spec`), the configuration axis spread over this process's
devices (:func:`shard_configs`).

Re-exported by :mod:`kvjax.model.decoding`, whose names these are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.model import cache as cache_lib
from kvjax.model import sharding
from kvjax.model.budget_checks import allocation, cache_capacity

Array = jax.Array


def shard_configs(budgets_K: Array, params: dict | None = None) -> tuple[Array, int]:
  """Spreads the configuration axis over every device of this process.

  The devices are a TPU host's chips, several GPUs, or forced host devices: this process's own
  (``jax.local_devices()``), so that in a run of several processes each evaluates its own share
  without the others (an evaluation splits its policies across processes). ``budgets_K`` is
  padded to a multiple of the device count by repeating its last row and placed with a
  ``NamedSharding`` over a one-axis ``Mesh``; the vmapped compress-and-decode then runs each
  device's share (GSPMD partitions it). A model placed by
  :func:`kvjax.model.sharding.shard_model` already spreads its batch and weights over the
  devices: its configurations are replicated on that mesh (one mesh per program; GSPMD cannot
  mix two layouts of the same devices).

  Args:
    budgets_K: the budgets ``[K, ...]``.
    params: the model's parameters, to find its mesh (``None``: no model mesh).

  Returns:
    ``(budgets, K)``: the placed (possibly padded) budgets and the real ``K``.
  """
  devices = jax.local_devices()
  K = budgets_K.shape[0]
  model_mesh = sharding.model_mesh(params) if params is not None else None
  if model_mesh is not None:
    return jax.device_put(budgets_K, NamedSharding(model_mesh, PartitionSpec())), K
  if len(devices) == 1:
    return budgets_K, K
  padded = -(-K // len(devices)) * len(devices)
  if padded > K:
    extra = jnp.repeat(budgets_K[-1:], padded - K, axis=0)
    budgets_K = jnp.concatenate([budgets_K, extra], axis=0)
  mesh = Mesh(np.asarray(devices), ("k",))
  return jax.device_put(budgets_K, NamedSharding(mesh, PartitionSpec("k"))), K


def configs_spec(cfg, pol, pre, budgets, window, layout, new, evidence):
  """Sizes the cache spec for every configuration and computes their allocations.

  The budgets are checked first. Shared by :func:`~kvjax.model.decoding.generate_configs` and
  :func:`kvjax.model.answers.answer_configs`.

  Args:
    cfg: the model's config.
    pol: the policy (an object).
    pre: the shared prefill's outputs.
    budgets: the checked budgets ``[K, ...]``.
    window: the observation window the budgets must hold.
    layout: a :class:`kvjax.model.cache.Layout`.
    new: tokens decoded or fed after it.
    evidence: the checked caller-given evidence, or ``None``.

  Returns:
    ``(spec, alloc)``: the :class:`kvjax.model.cache.CacheSpec` sized for every configuration
    and the allocations ``[K, B, L, H]``.

  Raises:
    ValueError: for budgets the policy refuses, or a spec
      :func:`kvjax.model.cache.check_spec` refuses.
  """
  T = pre.valid.shape[1]  # the prompt's (context's) tokens, restore tokens included
  if pol.requires_budget:
    pol.check_budget(budgets, window, T)
  spec = cache_lib.CacheSpec(
    pol, 1, layout.heads, reindex=layout.reindex, compress_sliding=layout.compress_sliding
  )
  cache_lib.check_spec(spec)
  alloc = jax.vmap(lambda b: allocation(cfg, pre, spec, b, evidence))(budgets)
  cap = cache_capacity(pol, int(np.asarray(alloc).max()), T, new)
  return dataclasses.replace(spec, capacity=cap, new_tokens=new), alloc
