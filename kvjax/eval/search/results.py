"""The allocation file and the hand-made baselines a search is judged against.

:func:`save_allocation` writes what :class:`kvjax.policies.searched.Searched` reads: one ``.npz``
with the allocation, the search's history and a JSON header (:func:`header`: the model, the
memory budget or ratio, the fitness on calibration and held-out data, the optimiser, the seed,
the calibration data's identity). :func:`baselines` gives the hand-made schedules of the same
memory (uniform, PyramidKV's exact-total pyramid at several slopes), as allocations of the
search's shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax.eval.search.allocator_spaces import AllocatorSpace
from kvjax.eval.search.optimise import SearchResult
from kvjax.eval.search.space import Space
from kvjax.policies.searched import FORMAT, read_allocation

# PyramidKV's beta values tried as baselines (20 is the official default)
PYRAMID_BETAS = (2.0, 5.0, 10.0, 20.0)


def data_identity(*arrays) -> str:
  """A short hash of the calibration data (token ids, a world's arrays)."""
  h = hashlib.sha1()
  for a in arrays:
    a = np.ascontiguousarray(np.asarray(a))
    h.update(str((a.dtype, a.shape)).encode())
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def model_identity(name: str, num_layers: int, num_heads: int, num_kv_heads: int) -> dict:
  """What names the model an allocation was found on (checked when a file is read back)."""
  return {
    "name": name,
    "num_layers": int(num_layers),
    "num_heads": int(num_heads),
    "num_kv_heads": int(num_kv_heads),
  }


def header(
  result: SearchResult,
  space: Space,
  *,
  model: dict,
  calibration: dict,
  held_out: float | None = None,
  ratio: float | None = None,
  policy: str | None = None,
  baselines: dict | None = None,
) -> dict:
  """The allocation file's header (JSON-serialisable)."""
  return {
    "format": FORMAT,
    "model": model,
    "shape": list(space.shape),
    "total": space.total,
    "budget": space.mean_budget,
    "ratio": ratio,
    "window": space.window,
    "prompt_len": space.prompt_len,
    "rule": space.rule,
    # a named allocator's searched arguments (allocator_spaces), else None
    "parameters": space.values(result.params) if isinstance(space, AllocatorSpace) else None,
    "policy": policy,
    "fitness": result.fitness,
    "held_out": held_out,
    "baselines": baselines or {},
    "optimiser": result.optimiser,
    "seed": result.seed,
    "evaluations": result.evaluations,
    "calibration": calibration,
  }


def save_allocation(path, result: SearchResult, head: dict) -> pathlib.Path:
  """Writes the allocation file (atomically: a temporary file, then a rename) and reads it back.

  Args:
    path: the ``.npz`` to write.
    result: the search's result.
    head: its :func:`header`.

  Returns:
    The path written.

  Raises:
    ValueError: an allocation whose shape or total is not the header's.
  """
  allocation = np.asarray(result.allocation, np.int32)
  if list(allocation.shape) != list(head["shape"]) or int(allocation.sum()) != head["total"]:
    raise ValueError(
      f"result: allocation of shape {allocation.shape} and total {int(allocation.sum())}; "
      f"the header says {head['shape']} and {head['total']}"
    )
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp.npz")
  history = {f"history_{k}": np.asarray(v) for k, v in result.history.items()}
  np.savez(
    tmp, allocation=allocation, params=result.params, header=np.asarray(json.dumps(head)), **history
  )
  os.replace(tmp, path)
  read_allocation(path)  # what Searched will read: refused here rather than later
  return path


def baselines(space: Space) -> dict[str, np.ndarray]:
  """The hand-made schedules of the space's memory, as allocations of its shape.

  ``uniform`` (equal budgets, any remainder to the first entries) and ``pyramid_beta{b}``
  (PyramidKV's ``exact_total`` schedule at each of :data:`PYRAMID_BETAS`, kept when its total
  is the space's and every layer is within the space's bounds); under a named allocator's space
  (:class:`~kvjax.eval.search.allocator_spaces.AllocatorSpace`) also ``{rule}_default``, the
  allocator at its own default arguments.

  Args:
    space: the search space.

  Returns:
    ``{name: allocation}``.
  """
  out = {"uniform": np.asarray(space.uniform())}
  L = space.shape[0]
  per_layer = space.total / L / (space.shape[1] if len(space.shape) == 2 else 1)
  if per_layer != int(per_layer):
    return out
  for beta in PYRAMID_BETAS:
    layer_L = np.asarray(
      budgets_lib.pyramid(
        L, int(per_layer), space.window, space.prompt_len, beta=beta, mode="exact_total"
      )
    )
    if len(space.shape) == 2:
      layer_L = np.repeat(layer_L[:, None], space.shape[1], 1)
    ok = layer_L.sum() == space.total and layer_L.min() >= space.low
    if ok and layer_L.max() <= space.prompt_len:
      out[f"pyramid_beta{beta:g}"] = layer_L.astype(np.int32)
  if isinstance(space, AllocatorSpace) and space.default_params() is not None:
    default = np.asarray(space.allocate(jnp.asarray(space.default_params())))
    if not any(np.array_equal(default, a) for a in out.values()):  # PyramidKV's 20 is there
      out[f"{space.rule}_default"] = default
  return out
