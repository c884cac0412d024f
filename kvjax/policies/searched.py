"""A searched allocation as an allocator: the budgets an allocation search saved, read back.

An allocation search (:mod:`kvjax.eval.search`) writes one ``.npz`` file: the allocation
(``[L]`` per layer or ``[L, G]`` per layer and KV head, int32, window included) and a JSON header
(the model, the memory budget or ratio, the fitness, the optimiser, the seed, the calibration
data). :class:`Searched` reads it and gives exactly those budgets under any scorer
(``SnapKV(allocator=Searched(path))``), in every entry point that takes a policy. The budget an
entry point passes is not read: the file's allocation is the budget (pass its
:attr:`Searched.budget`, the largest entry, where an entry point asks for one).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.policies.allocators import Allocator, heads_like

FORMAT = "kvjax.searched_allocation/1"
# the header fields every allocation file holds
HEADER_FIELDS = (
  "format",
  "model",
  "shape",
  "total",
  "window",
  "prompt_len",
  "fitness",
  "optimiser",
  "seed",
  "calibration",
)


def read_allocation(path) -> tuple[np.ndarray, dict]:
  """An allocation file's ``(allocation, header)``.

  Args:
    path: the ``.npz`` an allocation search wrote.

  Returns:
    The int32 allocation ``[L]`` or ``[L, G]`` and the header (a dict).

  Raises:
    ValueError: a missing or unreadable file, or one whose header or allocation is not an
      allocation search's (format, fields, shape, integer budgets of at least ``window + 1``).
  """
  p = pathlib.Path(path)
  if not p.is_file():
    raise ValueError(f"path: no allocation file at {str(p)!r}")
  try:
    with np.load(p, allow_pickle=False) as data:
      allocation = np.asarray(data["allocation"])
      header = json.loads(str(data["header"]))
  except (OSError, KeyError, ValueError) as e:
    raise ValueError(f"path: {str(p)!r} is not an allocation file ({e})") from None
  missing = [k for k in HEADER_FIELDS if k not in header]
  if header.get("format") != FORMAT or missing:
    raise ValueError(
      f"path: {str(p)!r} is not an allocation file of format {FORMAT!r} "
      f"(format {header.get('format')!r}, missing fields {missing})"
    )
  if allocation.ndim not in (1, 2) or list(allocation.shape) != list(header["shape"]):
    raise ValueError(
      f"path: {str(p)!r} holds an allocation of shape {allocation.shape}; its header says "
      f"{header['shape']} (expected [L] or [L, G])"
    )
  if not np.issubdtype(allocation.dtype, np.integer) or allocation.min() < header["window"] + 1:
    raise ValueError(
      f"path: {str(p)!r} holds budgets {allocation.tolist()}; expected integers of at least "
      f"window + 1 = {header['window'] + 1}"
    )
  return allocation.astype(np.int32), header


@dataclasses.dataclass(frozen=True)
class Searched(Allocator):
  """The allocation saved by a search: the same ``budget_LH`` whatever the scorer and budget.

  An ``[L]`` allocation gives every head of a layer its budget; an ``[L, G]`` one gives each KV
  head's budget to its query heads (policies at KV-head granularity read it as is).

  Args:
    path: the allocation file (:func:`read_allocation`).
    model: the model the allocation must have been found on (its header's ``model["name"]``);
      ``None`` checks shapes only.

  Raises:
    ValueError: the file :func:`read_allocation` refuses, a ``model`` other than the file's,
      and (when called) scores whose layers or heads the allocation does not fit, or a
      protected window above the one it was searched with.
  """

  budget_ndim: ClassVar[int] = 2
  from_budget_alone: ClassVar[bool] = True
  path: str = ""
  model: str | None = None
  table: tuple = dataclasses.field(default=(), init=False, repr=False)
  header_json: str = dataclasses.field(default="{}", init=False, repr=False, compare=False)

  def __post_init__(self):
    allocation, header = read_allocation(self.path)
    found = header["model"].get("name") if isinstance(header["model"], dict) else None
    if self.model is not None and found != self.model:
      raise ValueError(
        f"model: the allocation file {self.path!r} was searched on model {found!r}; expected "
        f"{self.model!r}"
      )
    object.__setattr__(self, "path", str(self.path))
    rows = np.asarray(allocation).tolist()  # nested tuples: the allocator stays hashable
    table = tuple(tuple(r) if isinstance(r, list) else r for r in rows)
    object.__setattr__(self, "table", table)
    object.__setattr__(self, "header_json", json.dumps(header, sort_keys=True))

  @property
  def header(self) -> dict:
    """The file's header."""
    return json.loads(self.header_json)

  @property
  def allocation(self) -> np.ndarray:
    """The allocation ``[L]`` or ``[L, G]`` int32."""
    return np.asarray(self.table, np.int32)

  @property
  def budget(self) -> int:
    """The largest entry: a budget for entry points that ask for one (it is not read)."""
    return int(self.allocation.max())

  def check_model(self, num_layers: int, num_kv_heads: int) -> None:
    """Checks the allocation against a model's layers and KV heads.

    Raises:
      ValueError: another layer count, or an ``[L, G]`` allocation of another ``G``.
    """
    a = self.allocation
    if a.shape[0] != num_layers or (a.ndim == 2 and a.shape[1] != num_kv_heads):
      raise ValueError(
        f"path: the allocation file {self.path!r} has shape {list(a.shape)} "
        f"(model {self.header['model']}); the model has {num_layers} layers and "
        f"{num_kv_heads} KV heads"
      )

  def __call__(self, evidence, scores_LHT, budget, window):
    L, H, _ = scores_LHT.shape
    a = self.allocation
    if a.shape[0] != L or (a.ndim == 2 and H % a.shape[1]):
      raise ValueError(
        f"path: the allocation file {self.path!r} has shape {list(a.shape)}; the scores have "
        f"{L} layers and {H} heads (expected [L] or [L, G] with G dividing the heads)"
      )
    searched_window = int(self.header["window"])
    if isinstance(window, int) and window > searched_window:
      raise ValueError(
        f"window: {window} exceeds the window {searched_window} the allocation file "
        f"{self.path!r} was searched with"
      )
    if a.ndim == 1:
      return jnp.broadcast_to(jnp.asarray(a)[:, None], (L, H))
    return heads_like(jnp.asarray(a), H)
