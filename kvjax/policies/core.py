"""The core of a policy: score, allocate, select.

A policy is a frozen dataclass (and a pytree: its :attr:`Policy.data_options` are leaves, the
other fields static), the way optax builds transformations. The core is :meth:`Policy.score`
(``Evidence -> scores_LHT``, higher keeps), the allocator (``budget -> budget_LH``) and the
selection (:meth:`Policy.keep_mask`, :meth:`Policy.compact`). What else a policy does is a
protocol it inherits (:class:`~kvjax.policies.budget_rules.BudgetRules`,
:class:`~kvjax.policies.recompression.Recompression`) or opts into
(:mod:`~kvjax.policies.protocols`, :class:`~kvjax.policies.DecodePolicy`); what the pipeline
needs to know of a policy (its sinks, its window) it declares, never found by probing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax import budgets as budgets_lib
from kvjax import checks, select
from kvjax import scores as scores_lib
from kvjax.policies import allocators as alloc_lib
from kvjax.policies import protocols
from kvjax.policies.budget_rules import BudgetRules
from kvjax.policies.checks import check_choice, check_int
from kvjax.policies.evidence import Evidence
from kvjax.policies.observation import Observation
from kvjax.policies.recompression import Recompression

Array = jax.Array


def check_scores(policy, scores_LHT, evidence: Evidence):
  """Checks a policy's :meth:`Policy.score` output against the shape it promises.

  The shape is static, so this runs once per trace (under ``jit`` too), not per call.

  Args:
    policy: the policy (named in the error).
    scores_LHT: what its ``score`` returned.
    evidence: the evidence it scored (its ``[L, H, T]``, :meth:`Evidence.positions_shape`).

  Returns:
    ``scores_LHT`` unchanged.

  Raises:
    ValueError: not a float array ``[L, H, T]`` with the evidence's ``L`` and ``T``.
  """
  shape = getattr(scores_LHT, "shape", None)
  dtype = getattr(scores_LHT, "dtype", None)
  if shape is None or len(shape) != 3 or not jnp.issubdtype(dtype, jnp.floating):
    got = f"{type(scores_LHT).__name__} {shape} {dtype}" if shape is not None else repr(scores_LHT)
    raise ValueError(
      f"score: policy {policy.label!r} returned {got}; expected float scores_LHT [L, H, T]"
    )
  try:
    L, _, T = evidence.positions_shape(policy.label)
  except ValueError:  # no field sizes [L, H, T]: nothing to compare with
    return scores_LHT
  if shape[0] != L or shape[-1] != T:
    raise ValueError(
      f"score: policy {policy.label!r} returned scores of shape {tuple(shape)}; expected "
      f"[L={L}, H, T={T}] (one score per layer, head and prompt position of the evidence)"
    )
  return scores_LHT


def _pytree(cls):
  """Registers a policy class as a pytree: :attr:`Policy.data_options` are leaves (a sweep's
  traced sink count), every other field is static."""

  def flatten(p):
    data = tuple(p.data_options)
    static = tuple(
      (f.name, getattr(p, f.name)) for f in dataclasses.fields(p) if f.name not in data
    )
    return tuple(getattr(p, k) for k in data), (data, static)

  def unflatten(aux, leaves):
    data, static = aux
    out = object.__new__(cls)
    for k, v in (*static, *zip(data, leaves, strict=True)):
      object.__setattr__(out, k, v)
    return out

  jax.tree_util.register_pytree_node(cls, flatten, unflatten)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy(BudgetRules, Recompression, Observation, protocols.ProtocolDefaults):
  """A KV-cache policy: evidence -> ``scores_LHT`` -> ``budget_LH`` -> kept positions.

  Subclass it, declare ``needs`` and write :meth:`score`; allocation, grouping, budget checks
  and selection are inherited. Options are dataclass fields, validated in ``__post_init__``.

  Attributes:
    allocator: the total budget -> ``budget_LH`` rule (default :class:`Uniform`: as given).
    num_kv_heads: group query-head scores to this many KV heads (``None``: query heads).
    gqa: how to group (``"mean"``, ``"max"``, ``"sum"``).
    channel_ratio: ThinK: prune the ``int(D * channel_ratio)`` least important key channels of
      the kept keys, a float in ``[0, 1)`` (``None``: off; applied by the model cache).
    decode_every: kvpress ``DecodingPress``: re-compress the cache to the budget every ``N``
      generated tokens (``None``: select once after the prompt; applied by the model).
    name: the registered name (a label for tables and errors; never dispatched on).

  What a subclass declares (class attributes; an option of the same name declares it too):

  * ``needs``: the :class:`Evidence` fields :meth:`score` reads.
  * ``sinks``: the first real tokens of a row it protects, counted from the row's first real
    token (a left-padded row is scored with its padding rolled to the end); ``None``: no
    sinks, a row is scored as it lies. A policy whose option has another name declares it as
    a property (``sinks = property(lambda self: self.n_sink)``).
  * ``window``: its protected (and observed) recent window; ``None``: the observation rows'.
  * ``channel_window``: the last prefill queries that score ThinK's key channels (kvpress
    ``ThinKPress.window_size``); ``None``: every query of its observation window.
  * ``windowed``: it protects its observation window, so a budget must exceed the window.
  * ``window_field``: the option holding its protected recent window (a sweep's ``window``
    axis), or ``None``.
  * ``data_options``: options that stay traced data in a sweep (pytree leaves).
  * ``requires_budget``: ``False`` for the full cache alone.
  * ``restore_tokens``: learned tokens the model appends to its prompt (RestoreKV), or ``None``.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"attn_window_LHWT"})
  sinks: ClassVar[int | None] = None
  window: ClassVar[int | None] = None
  channel_window: ClassVar[int | None] = None
  windowed: ClassVar[bool] = False
  window_field: ClassVar[str | None] = None
  data_options: ClassVar[tuple[str, ...]] = ()
  requires_budget: ClassVar[bool] = True
  restore_tokens: ClassVar[int | None] = None

  allocator: alloc_lib.Allocator = alloc_lib.Uniform()
  num_kv_heads: int | None = None
  gqa: str = "mean"
  channel_ratio: float | None = None
  decode_every: int | None = None
  name: str | None = dataclasses.field(default=None, compare=False)

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    protocols.check_hooks(cls)
    _pytree(cls)

  def __post_init__(self):
    if not isinstance(self.allocator, alloc_lib.Allocator):
      raise ValueError(f"allocator: expected an Allocator, got {self.allocator!r}")
    kv = self.num_kv_heads
    if kv is not None and (not checks.is_int(kv) or kv < 1):
      raise ValueError(f"num_kv_heads: expected a positive int or None, got {kv!r}")
    check_choice("gqa", self.gqa, scores_lib.GROUPINGS, self.label)
    if self.decode_every is not None:
      check_int("decode_every", self.decode_every, 1)
    if self.channel_ratio is not None:
      budgets_lib.check_real("channel_ratio", self.channel_ratio, low=0.0, high=1.0)
      # a numpy or jax scalar is a valid ratio; held as a float, so the policy stays hashable
      object.__setattr__(self, "channel_ratio", float(self.channel_ratio))
      if self.channel_ratio >= 1:
        raise ValueError(
          f"channel_ratio: expected a fraction of key channels in [0, 1), got {self.channel_ratio!r}"
        )

  def score(self, evidence: Evidence) -> Array:
    """Scores every prompt position of every head, before grouping: the method a subclass writes.

    Args:
      evidence: what the policy observes; it reads the fields in ``needs``.

    Returns:
      ``scores_LHT`` fp32 ``[L, H, T]`` (``H``: the evidence's query heads); higher keeps,
      ``+inf`` protects.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.score")

  # ------------------------------------------------------------------ what it declares

  @property
  def label(self) -> str:
    """The registered name, or the class name."""
    return self.name or type(self).__name__

  @property
  def allocates(self) -> bool:
    """Whether the allocator turns a total budget into its own ``budget_LH``."""
    return not isinstance(self.allocator, alloc_lib.Uniform)

  @property
  def options(self) -> dict[str, Any]:
    """The flat options :func:`kvjax.policies.make` takes to rebuild it by name."""
    skip = ("allocator", "name", "base")
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
    if not isinstance(self.allocator, alloc_lib.Uniform):
      out |= {f.name: getattr(self.allocator, f.name) for f in dataclasses.fields(self.allocator)}
    return out

  # ------------------------------------------------------------------ score

  def grouped(self, scores_LHT: Array) -> Array:
    """Groups query-head scores ``[L, Hq, T]`` to ``num_kv_heads`` under ``gqa`` (when set).

    Raises:
      ValueError: ``num_kv_heads`` does not divide the query heads.
    """
    kv = self.num_kv_heads
    if kv is not None and scores_LHT.shape[1] != kv:
      return scores_lib.group(scores_LHT, kv, self.gqa)
    return scores_LHT

  def scores(self, evidence: Evidence) -> Array:
    """:meth:`score`, then :meth:`grouped`: fp32 ``[L, H, T]``.

    Raises:
      ValueError: :meth:`score` returned something other than a float ``[L, H, T]`` of the
        evidence's layers and positions (:func:`check_scores`).
    """
    return self.grouped(check_scores(self, self.score(evidence), evidence))

  def scores_row(self, evidence: Evidence) -> Array:
    """Scores one left-padded row (``evidence.valid_T`` set) as :meth:`scores` does.

    A policy that declares ``sinks`` counts them from the row's first real token: it scores
    the row with its padding rolled to the end.
    """
    if self.sinks is None or evidence.valid_T is None:
      return self.scores(evidence)
    pad = evidence.valid_T.shape[-1] - evidence.valid_T.sum()
    return jnp.roll(self.scores(evidence.rolled(-pad)), pad, axis=-1)

  # ------------------------------------------------------------------ allocate

  def protected_window(self, evidence: Evidence) -> int:
    """The window it protects: 0 unless ``windowed``; ``window``, else the rows' ``W``.

    Raises:
      ValueError: a windowed policy without a ``window`` meets evidence without window rows.
    """
    if not self.windowed:
      return 0
    if self.window is not None:
      return self.window
    if evidence.attn_window_LHWT is None and evidence.observation_window is not None:
      return evidence.observation_window
    return evidence.need("attn_window_LHWT", self.label).shape[2]

  def allocation_window(self, evidence: Evidence) -> int:
    """The window the allocator reserves in every budget: :meth:`protected_window`."""
    return self.protected_window(evidence)

  def budgets(self, evidence: Evidence, scores_LHT: Array, budget) -> Array:
    """Turns a total budget (a scalar, ``[L]`` or ``[L, H]``) into int32 ``budget_LH``.

    The allocator reserves :meth:`allocation_window` in every budget; its output is checked
    (:meth:`~BudgetRules.checked_budget_LH`): an int ``[L, H]`` that, when concrete, gives no
    row of a windowed policy fewer slots than its protected window.

    Raises:
      ValueError: a budget :meth:`~BudgetRules.check_budget`'s rules refuse (non-integer,
        beyond int32, the wrong shape or rank for the allocator; a concrete one below 1, the
        window + 1 of a windowed policy, or ``T`` for an allocator that keeps every token), or
        an allocation :meth:`~BudgetRules.checked_budget_LH` refuses.
    """
    self._check_budget(evidence, scores_LHT, budget)
    window = self.allocation_window(evidence)
    budget_LH = self.allocator(evidence, scores_LHT, budget, window)
    L, H, _ = scores_LHT.shape
    return self.checked_budget_LH(budget_LH, L, H, window)

  # ------------------------------------------------------------------ select

  def selection_scores(
    self, evidence: Evidence, scores_LHT: Array, budget_LH: Array, *, capacity: int | None = None
  ) -> Array:
    """The scores the selection ranks: :meth:`Rescoring.rescore`'s, else ``scores_LHT``."""
    if not self.rescores:
      return scores_LHT
    return self.rescore(evidence, scores_LHT, budget_LH, capacity)

  def keep_mask(self, evidence: Evidence, budget, *, capacity: int | None = None) -> Array:
    """Kept positions ``[L, H, T]`` bool under ``budget`` (:func:`kvjax.select.top_mask`).

    Raises:
      ValueError: a budget :meth:`budgets` refuses, or evidence the policy needs is missing.
    """
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.top_mask(scores_LHT, budget_LH, capacity=capacity)

  def compact(self, evidence: Evidence, budget, capacity: int) -> tuple[Array, Array]:
    """Kept positions as ``(idx_LHC, valid_LHC)`` for a cache of ``capacity`` slots per head
    (:func:`kvjax.select.compact`).

    Raises:
      ValueError: a budget :meth:`budgets` refuses, one that does not fit ``capacity``, or
        evidence the policy needs is missing.
    """
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.compact(scores_LHT, budget_LH, capacity)
