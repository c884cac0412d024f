"""The policy protocol: a typed, frozen object that scores, allocates and selects.

A policy is a frozen dataclass (and a pytree: its :attr:`Policy.data_options` are leaves, the
other fields static), the way optax builds transformations. Subclass one of

* :class:`Policy`: a prefill scorer; write :meth:`Policy.score` (``Evidence -> scores_LHT``,
  higher keeps) and list the evidence it reads in ``needs``;
* :class:`WindowPolicy`: a scorer of the observation window's rows; write
  :meth:`WindowPolicy.score_rows` and a prefill may reduce each layer's rows as it forms them;
* :class:`DecodePolicy`: a decode-time evictor, a small state machine over the cache's slots
  (:meth:`DecodePolicy.init_state`, :meth:`DecodePolicy.observe`,
  :meth:`DecodePolicy.keep_scores`) that the model's cache and the lab's replay both run.

Every policy takes an :class:`~kvjax.policies.allocators.Allocator` (``allocator=``) and the
common options below; the pipeline is ``scores`` -> ``budgets`` -> ``selection_scores`` ->
:mod:`kvjax.select`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select
from kvjax.policies import allocators as alloc_lib
from kvjax.policies.evidence import DEFAULT_WINDOW, Evidence, EvidenceRequest

Array = jax.Array


def check_int(key: str, value, low: int) -> None:
  """Checks that an option is an int in ``[low, 2**31)``.

  Args:
    key: the option's name, for the error.
    value: the value given.
    low: the smallest value accepted.

  Raises:
    ValueError: ``value`` is not an int (a bool is not one) or lies outside ``[low, 2**31)``.
  """
  if isinstance(value, bool) or not isinstance(value, int) or not low <= value < select.INT32_LIMIT:
    raise ValueError(f"{key}: expected an int >= {low}, got {value!r}")


def check_bool(key: str, value) -> None:
  """Checks that an option is a bool.

  Args:
    key: the option's name, for the error.
    value: the value given.

  Raises:
    ValueError: ``value`` is not a bool.
  """
  if not isinstance(value, bool):
    raise ValueError(f"{key}: expected a bool, got {value!r}")


def check_choice(key: str, value, choices, policy: str = "") -> None:
  """Checks that an option is one of its choices.

  Args:
    key: the option's name, for the error.
    value: the value given.
    choices: the values accepted.
    policy: the policy's label, named in the error (empty: none named).

  Raises:
    ValueError: ``value`` is not in ``choices``.
  """
  if value not in choices:
    of = f" for {policy!r}" if policy else ""
    raise ValueError(f"{key}: unknown value {value!r}{of}; expected one of {choices}")


def check_window(value, policy: str) -> None:
  """Checks a ``window`` option: ``None`` (the rows' own ``W``) or an int in ``[1, 2**31)``.

  Args:
    value: the value given.
    policy: the policy's label, named in the error.

  Raises:
    ValueError: ``value`` is neither ``None`` nor an int in ``[1, 2**31)``.
  """
  if value is not None and (
    isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < select.INT32_LIMIT
  ):
    raise ValueError(f"window: expected None or an int >= 1 for {policy!r}, got {value!r}")


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
class Policy:
  """A KV-cache policy: evidence -> ``scores_LHT`` -> ``budget_LH`` -> kept positions.

  Subclass it, declare ``needs`` and write :meth:`score`; the rest (allocation, grouping,
  budget checks, selection) is inherited. Options are dataclass fields, validated once in
  ``__post_init__``.

  Attributes:
    allocator: the total budget -> ``budget_LH`` rule (default :class:`Uniform`: as given).
    num_kv_heads: group query-head scores to this many KV heads (``None``: query heads, the
      published tables' granularity).
    gqa: how to group (``"mean"``, ``"max"``, ``"sum"``).
    channel_ratio: ThinK: prune the ``int(D * channel_ratio)`` least important key channels of
      the kept keys, a float in ``[0, 1)`` (``None``: off; applied by the model cache).
    decode_every: kvpress ``DecodingPress``: re-compress the cache to the budget every ``N``
      generated tokens (``None``: select once after the prompt; applied by the model).
    name: the registered name (a label for tables and errors; never dispatched on).

  Class attributes, which a subclass sets:

  * ``needs``: the :class:`Evidence` fields :meth:`score` reads.
  * ``windowed``: it protects its observation window, so a budget must exceed the window.
  * ``window_field``: the option holding its protected recent window (a sweep's ``window``
    axis), or ``None``.
  * ``data_options``: options that stay traced data in a sweep (pytree leaves).
  * ``requires_budget``: ``False`` for the full cache alone.
  """

  needs: ClassVar[frozenset[str]] = frozenset({"attn_window_LHWT"})
  windowed: ClassVar[bool] = False
  window_field: ClassVar[str | None] = None
  data_options: ClassVar[tuple[str, ...]] = ()
  requires_budget: ClassVar[bool] = True

  allocator: alloc_lib.Allocator = alloc_lib.Uniform()
  num_kv_heads: int | None = None
  gqa: str = "mean"
  channel_ratio: float | None = None
  decode_every: int | None = None
  name: str | None = dataclasses.field(default=None, compare=False)

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _pytree(cls)

  def __post_init__(self):
    if not isinstance(self.allocator, alloc_lib.Allocator):
      raise ValueError(f"allocator: expected an Allocator, got {self.allocator!r}")
    kv = self.num_kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
      raise ValueError(f"num_kv_heads: expected a positive int or None, got {kv!r}")
    check_choice("gqa", self.gqa, scores_lib.GROUPINGS, self.label)
    if self.decode_every is not None:
      check_int("decode_every", self.decode_every, 1)
    if self.channel_ratio is not None:
      budgets_lib.check_real("channel_ratio", self.channel_ratio, low=0.0, high=1.0)
      if self.channel_ratio >= 1:
        raise ValueError(
          f"channel_ratio: expected a fraction of key channels in [0, 1), got {self.channel_ratio!r}"
        )

  # ------------------------------------------------------------------ what a subclass writes

  def score(self, evidence: Evidence) -> Array:
    """Scores every prompt position of every head from the evidence, before grouping.

    Higher scores keep; ``+inf`` protects a position. This is the method a subclass writes;
    :meth:`scores` groups its result to KV heads.

    Args:
      evidence: what the policy observes; it reads the fields in ``needs``.

    Returns:
      ``scores_LHT`` fp32 ``[L, H, T]`` (``H``: the evidence's query heads).

    Raises:
      NotImplementedError: here; a subclass implements it.
      ValueError: (in a subclass) a field the policy needs is ``None`` (:meth:`Evidence.need`).
    """
    raise NotImplementedError(f"{type(self).__name__}.score")

  def rescore(self, evidence: Evidence, scores_LHT: Array, budget_LH: Array, capacity) -> Array:
    """Applies a budget-dependent last score stage (CriticalKV's first stage); identity here.

    A subclass that overrides it makes :attr:`rescores` true, and :meth:`selection_scores` then
    ranks its result.

    Args:
      evidence: the evidence the scores came from.
      scores_LHT: the grouped scores ``[L, H, T]`` (:meth:`scores`).
      budget_LH: each head's budget, int32 ``[L, H]`` (:meth:`budgets`).
      capacity: the selection's static capacity (``None``: ``T``).

    Returns:
      The scores the selection ranks, ``[L, H, T]``; here ``scores_LHT`` itself.
    """
    return scores_LHT

  def merge(self, keys_LHTD: Array, values_LHTD: Array, keep_LHT: Array, valid_LHT: Array) -> Array:
    """Folds the evicted positions' values into the kept ones at compression; identity here.

    The model's cache (:func:`kvjax.model.cache.compress`) calls it after the selection, on the
    prompt's keys and values at the cache's heads, before it gathers the kept values; a subclass
    that overrides it makes :attr:`merges` true (:class:`~kvjax.policies.merging.Merging`,
    kvpress ``MergingPress``). Only the kept positions' values are read back.

    Args:
      keys_LHTD: post-RoPE keys ``[..., H, T, D]`` (any leading axes: layers, batch rows).
      values_LHTD: values ``[..., H, T, D]``.
      keep_LHT: bool ``[..., H, T]``, the kept positions.
      valid_LHT: bool, broadcastable to ``keep_LHT``: the real (not padded) positions.

    Returns:
      The values ``[..., H, T, D]``; here ``values_LHTD`` itself.
    """
    return values_LHTD

  def decode_merge(
    self,
    values_LHCD: Array,
    attn_sums_LHC: Array,
    scores_LHC: Array,
    valid_LHC: Array,
    count_LH: Array,
    *,
    row,
    seen,
  ) -> tuple[Array, Array]:
    """Folds a re-compression's evicted values into kept ones while decoding; identity here.

    The model's cache (:func:`kvjax.model.cache.recompress`) calls it on one batch row's slots
    in position order, after :meth:`decode_scores` and before the selection, when
    :attr:`merges_while_decoding` (kvpress ``CAMPress``: :class:`~kvjax.policies.cam.CaM`).
    The cache then keeps the ``count_LH`` best slots under the scores it returns and gathers
    the values it returns.

    Args:
      values_LHCD: the slots' values ``[L, H, C, D]``.
      attn_sums_LHC: fp32 ``[L, H, C]``: each slot's attention summed over the generated
        queries (the mean over the query heads reading the cache head), zero for empty slots.
      scores_LHC: the decoding scorer's scores ``[L, H, C]``, ``-inf`` on empty slots.
      valid_LHC: bool ``[L, H, C]``, the filled slots.
      count_LH: int32 ``[L, H]``, the slots each head keeps.
      row: the batch row (a traced int), for reproducible random draws.
      seen: the row's tokens seen, prompt and generated (a traced int).

    Returns:
      ``(scores_LHC, values_LHCD)``: the scores the selection ranks and the values it gathers;
      here the inputs.
    """
    return scores_LHC, values_LHCD

  # ------------------------------------------------------------------ what it declares

  @property
  def label(self) -> str:
    """The registered name, or the class name."""
    return self.name or type(self).__name__

  @property
  def evidence_fields(self) -> frozenset[str]:
    """Every :class:`Evidence` field the policy reads.

    Its scorer's (``needs``), its allocator's, and ThinK's for ``channel_ratio``.
    """
    out = frozenset(self.needs) | self.allocator.needs
    if self.channel_ratio:
      out |= {"window_queries_LHWD", "keys_LGTD"}
    return out

  @property
  def observation_window(self) -> int:
    """Observation queries the policy's evidence is formed from.

    Its ``window`` option, else :data:`DEFAULT_WINDOW`; 0 when it observes nothing.
    """
    return getattr(self, "window", None) or DEFAULT_WINDOW

  @property
  def allocates(self) -> bool:
    """Whether the allocator turns a total budget into its own ``budget_LH``."""
    return not isinstance(self.allocator, alloc_lib.Uniform)

  @property
  def rescores(self) -> bool:
    """Whether the selection's scores depend on the budget (:meth:`rescore` overridden)."""
    return type(self).rescore is not Policy.rescore

  @property
  def merges(self) -> bool:
    """Whether the cache folds evicted values into kept ones (:meth:`merge` overridden)."""
    return type(self).merge is not Policy.merge

  @property
  def merges_while_decoding(self) -> bool:
    """Whether a re-compression folds evicted values into kept ones (:meth:`decode_merge`
    overridden); the model's cache then carries each slot's attention sums."""
    return type(self).decode_merge is not Policy.decode_merge

  @property
  def evicts_each_step(self) -> bool:
    """Whether it evicts at every generated token (:class:`DecodePolicy`)."""
    return False

  @property
  def acts_at_decode(self) -> bool:
    """Whether it compresses while decoding (every step, or every ``decode_every`` tokens)."""
    return self.evicts_each_step or self.decode_every is not None

  @property
  def reads_future(self) -> bool:
    """Whether it reads future attention (the oracle: an upper bound, not a realisable cache)."""
    return "future_attn_LHST" in self.evidence_fields

  @property
  def options(self) -> dict[str, Any]:
    """The flat options :func:`kvjax.policies.make` takes to rebuild this policy by name."""
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("allocator", "name", "base")
    }
    if not isinstance(self.allocator, alloc_lib.Uniform):
      out |= {f.name: getattr(self.allocator, f.name) for f in dataclasses.fields(self.allocator)}
    return out

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """What a prefill of ``T`` prompt tokens computes for this policy.

    The one mapping from a policy's needs (:attr:`evidence_fields`) to the prefill's work.

    Args:
      T: the prompt's length; the observation window is cut to at most ``T`` queries.
      reduce_rows: a prefill serving this policy alone keeps its
        :meth:`WindowPolicy.window_scorer`'s scores instead of the window rows (a
        :class:`WindowPolicy`'s; this base ignores it).

    Returns:
      The :class:`EvidenceRequest` for :attr:`evidence_fields` with
      ``min(observation_window, T)`` window rows.

    Raises:
      ValueError: :attr:`evidence_fields` names a field :class:`Evidence` lacks.
    """
    return EvidenceRequest.for_fields(self.evidence_fields, min(self.observation_window, T))

  def scores_row(self, evidence: Evidence) -> Array:
    """Scores one left-padded row (``evidence.valid_T`` set) as :meth:`scores` does.

    A policy that keeps sinks counts them from the row's first real token: it scores the row
    with its padding rolled to the end.

    Args:
      evidence: one row's evidence; ``valid_T`` marks its real positions (``None``: all).

    Returns:
      The row's ``scores_LHT``, grouped as :meth:`scores` groups them.
    """
    if getattr(self, "sinks", None) is None or evidence.valid_T is None:
      return self.scores(evidence)
    pad = evidence.valid_T.shape[-1] - evidence.valid_T.sum()
    return jnp.roll(self.scores(evidence.rolled(-pad)), pad, axis=-1)

  # ------------------------------------------------------------------ the pipeline

  def grouped(self, scores_LHT: Array) -> Array:
    """Groups query-head scores to ``num_kv_heads`` (when set).

    Args:
      scores_LHT: scores ``[L, Hq, T]``.

    Returns:
      ``[L, num_kv_heads, T]`` under the ``gqa`` reduction, or ``scores_LHT`` itself when
      ``num_kv_heads`` is ``None`` or already its head count.

    Raises:
      ValueError: ``num_kv_heads`` does not divide the query heads.
    """
    kv = self.num_kv_heads
    if kv is not None and scores_LHT.shape[1] != kv:
      return scores_lib.group(scores_LHT, kv, self.gqa)
    return scores_LHT

  def scores(self, evidence: Evidence) -> Array:
    """Scores the evidence, grouped to KV heads when ``num_kv_heads`` is set.

    :meth:`score`, then :meth:`grouped`.

    Args:
      evidence: what the policy observes.

    Returns:
      ``scores_LHT`` fp32 ``[L, H, T]`` (``H``: ``num_kv_heads`` when set, else the query heads).
    """
    return self.grouped(self.score(evidence))

  def protected_window(self, evidence: Evidence) -> int:
    """The window this policy protects (0 when it protects none).

    Its ``window`` option, else the observation rows' ``W``.

    Args:
      evidence: read for the rows' ``W`` (``observation_window``, else the shape of
        ``attn_window_LHWT``) when the ``window`` option is unset.

    Returns:
      The protected window, an int.

    Raises:
      ValueError: a windowed policy without a ``window`` option meets evidence without window
        rows.
    """
    if not self.windowed:
      return 0
    window = getattr(self, "window", None)
    if window is not None:
      return window
    if evidence.attn_window_LHWT is None and evidence.observation_window is not None:
      return evidence.observation_window
    return evidence.need("attn_window_LHWT", self.label).shape[2]

  def allocation_window(self, evidence: Evidence) -> int:
    """The window the allocator reserves in every budget (the protected one).

    Args:
      evidence: what the policy observes (:meth:`protected_window`).

    Returns:
      The window, an int (0 when the policy protects none).
    """
    return self.protected_window(evidence)

  def budgets(self, evidence: Evidence, scores_LHT: Array, budget) -> Array:
    """Turns a total budget into ``budget_LH`` int32 under the allocator.

    A concrete budget must keep something: ``>= 1``, and for a windowed policy
    ``>= window + 1``, since the protected window counts inside the budget (``ValueError``
    otherwise, instead of keeping fewer than the protected tokens or nothing).

    Args:
      evidence: what the policy observes (an allocator may read it: HeadKV's importances,
        CAKE's rows).
      scores_LHT: the grouped scores ``[L, H, T]`` (:meth:`scores`).
      budget: the total budget, a scalar, ``[L]`` or ``[L, H]`` of token counts (an allocator
        that allocates takes at most its ``max_budget_ndim``).

    Returns:
      ``budget_LH`` int32 ``[L, H]``.

    Raises:
      ValueError: a budget that is not integer, does not fit int32 or has the wrong shape;
        one the allocator cannot take (rank above its ``max_budget_ndim``); a concrete one
        below 1, below ``window + 1`` for a windowed policy, or below ``T`` for an allocator
        that keeps every token.
    """
    self._check_budget(evidence, scores_LHT, budget)
    return self.allocator(evidence, scores_LHT, budget, self.allocation_window(evidence))

  def selection_scores(
    self, evidence: Evidence, scores_LHT: Array, budget_LH: Array, *, capacity: int | None = None
  ) -> Array:
    """The scores the selection ranks under ``budget_LH``.

    :meth:`rescore`'s (CriticalKV), ``scores_LHT`` itself for a budget-free scorer.

    Args:
      evidence: the evidence the scores came from.
      scores_LHT: the grouped scores ``[L, H, T]`` (:meth:`scores`).
      budget_LH: each head's budget, int32 ``[L, H]`` (:meth:`budgets`).
      capacity: the selection's static capacity (default ``T``).

    Returns:
      Scores ``[L, H, T]`` for :mod:`kvjax.select`.
    """
    if not self.rescores:
      return scores_LHT
    return self.rescore(evidence, scores_LHT, budget_LH, capacity)

  def min_budget(self, window: int) -> int:
    """The smallest budget that keeps a selected token.

    Args:
      window: the protected window.

    Returns:
      ``window + 1`` for a windowed policy, else 1.
    """
    return window + 1 if self.windowed else 1

  def check_budget(self, budget, window: int, T: int | None = None) -> None:
    """Checks a concrete budget array that the policy must run with.

    Every entry point calls this one check before any ``jit``.

    Args:
      budget: the budget, a concrete array or number of token counts (any shape).
      window: the protected window (:meth:`min_budget`).
      T: the prompt positions, checked for a policy that keeps every token (``None``: not
        checked).

    Raises:
      ValueError: a budget that is non-integer, beyond int32, below :meth:`min_budget`, or, for
        a policy that keeps every token, below the ``T`` prompt positions.
    """
    arr = np.asarray(budget)
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"budget: expected integer token counts, got {arr.dtype}")
    if arr.size and arr.max() >= 2**31:
      raise ValueError(f"budget: {int(arr.max())} does not fit int32; expected < 2**31 tokens")
    floor = self.min_budget(window)
    if arr.size and arr.min() < floor:
      raise ValueError(
        f"budget: {int(arr.min())} is below {floor} for {self.label!r} "
        f"(every budget counts the window of {window} and needs a selected token)"
        if self.windowed
        else self._low_budget_message(int(arr.min()), floor)
      )
    if T is not None and arr.size and self.allocator.keeps_all and arr.min() < T:
      raise ValueError(self._keeps_all_message(int(arr.min()), T))

  def _keeps_all_message(self, low: int, T: int) -> str:
    return (
      f"budget: {low} < T={T}, but policy {self.label!r} keeps every token (the full cache; "
      "ThinK prunes key channels, not tokens); expected budget >= T, or channel_ratio on a "
      "token policy, e.g. make('snapkv', channel_ratio=0.5)"
    )

  def check_allocation(self, budget_LH) -> None:
    """Checks a concrete allocation the policy can hold; nothing here.

    TOVA overrides it: one index set per layer.

    Args:
      budget_LH: the allocation, ``[L, H]``.

    Raises:
      ValueError: (in an override) an allocation the policy cannot hold.
    """

  def _low_budget_message(self, low: int, floor: int) -> str:
    return f"budget: {low} < {floor}; every row needs at least one slot"

  def _check_budget(self, evidence: Evidence, scores_LHT: Array, budget) -> None:
    alloc_lib.as_budget_LH(budget, *scores_LHT.shape[:2])  # dtype, int32 range and shape
    if self.allocates:
      ndim = self.allocator.max_budget_ndim
      if np.ndim(budget) > ndim:
        expected = "a scalar or [L]" if ndim else "a scalar"
        raise ValueError(
          f"budget: policy {self.label!r} allocates its own budget_LH from one per-head budget; "
          f"expected {expected}, got shape {np.shape(budget)}"
        )
    if not select.is_concrete(budget) or not np.size(budget):
      return
    low = int(np.min(budget))
    if low < 1:
      raise ValueError(
        f"budget: {low} keeps nothing; expected a budget >= 1 for policy {self.label!r}"
      )
    T = scores_LHT.shape[-1]
    if self.allocator.keeps_all and low < T:
      raise ValueError(self._keeps_all_message(low, T))
    if self.windowed:
      window = self.protected_window(evidence)
      if low < window + 1:
        raise ValueError(
          f"budget: {low} does not exceed the protected window {window} of policy "
          f"{self.label!r}; expected budget >= window + 1 = {window + 1}"
        )

  def keep_mask(self, evidence: Evidence, budget, *, capacity: int | None = None) -> Array:
    """Kept positions under ``budget`` as a mask.

    :meth:`scores`, :meth:`budgets`, :meth:`selection_scores`, then
    :func:`kvjax.select.keep_mask`.

    Args:
      evidence: what the policy observes.
      budget: the total budget (scalar, ``[L]`` or ``[L, H]``).
      capacity: the selection's static capacity (``None``: ``T``).

    Returns:
      Kept positions ``[L, H, T]`` bool.

    Raises:
      ValueError: a budget :meth:`budgets` refuses, or evidence the policy needs is missing.
    """
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.keep_mask(scores_LHT, budget_LH, capacity=capacity)

  def compact(self, evidence: Evidence, budget, capacity: int) -> tuple[Array, Array]:
    """Kept positions as ``(idx_LHC, valid_LHC)`` for a real cache of capacity ``C``.

    :meth:`scores`, :meth:`budgets`, :meth:`selection_scores`, then
    :func:`kvjax.select.compact`.

    Args:
      evidence: what the policy observes.
      budget: the total budget (scalar, ``[L]`` or ``[L, H]``).
      capacity: ``C``, the cache's static slots per head.

    Returns:
      ``(idx_LHC, valid_LHC)``: the kept positions, int32 ``[L, H, C]``, ascending in the valid
      slots that come first (0 in the others), and the valid slots, bool ``[L, H, C]``.

    Raises:
      ValueError: a budget :meth:`budgets` refuses, a concrete one that does not fit
        ``capacity``, or evidence the policy needs is missing.
    """
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.compact(scores_LHT, budget_LH, capacity)

  # ------------------------------------------------------------------ while decoding

  @property
  def decode_policy(self) -> Policy:
    """The policy whose scorer re-compresses the cache while decoding (``decode_every``): this
    one. The model's cache rebuilds its evidence fields and observation window over the slots."""
    return self

  def decode_scores(self, evidence: Evidence) -> Array:
    """Scores of the cache's slots at a re-compression (``decode_every``).

    The model's cache (:func:`kvjax.model.cache.recompress`) calls it on the evidence it rebuilds
    over its own slots; here the prompt's scorer on one row, :meth:`scores_row` (the empty slots
    come first and play the part of left padding, ``valid_T`` false: sinks count from the first
    held token). A policy with another scorer for the re-compressions
    (:class:`~kvjax.policies.combinators.PrefillDecoding`) overrides it.

    Args:
      evidence: the cache's evidence, its slots as positions.

    Returns:
      fp32 scores ``[L, H, T]``.
    """
    return self.scores_row(evidence)

  def decode_budgets(self, budget_LH: Array, seen) -> Array:
    """Each head's slots after a re-compression; here the prompt's budgets.

    Args:
      budget_LH: the prompt's budgets, int32 ``[L, H]``.
      seen: the tokens seen so far by the row, prompt and generated (an int or traced int).

    Returns:
      int32 ``[L, H]``: ``budget_LH`` here.
    """
    return budget_LH

  def decode_capacity(self, max_budget: int, T: int, new_tokens: int) -> int:
    """The most slots a row holds while decoding: after a re-compression, plus the tokens
    between two of them.

    Args:
      max_budget: the largest prompt budget of any head.
      T: the prompt's tokens.
      new_tokens: the tokens decoded after it.

    Returns:
      ``max_budget + decode_every`` here (``max_budget`` without ``decode_every``).
    """
    return max_budget + (self.decode_every or 0)

  def window_scorer(self):
    """A hashable callable reducing one layer's window rows to scores, or ``None``.

    For a prefill that keeps the scores instead of the rows; ``None`` unless the policy reads the
    rows only through :meth:`WindowPolicy.score_rows`.

    Returns:
      A :class:`WindowScorer`, or ``None`` here.
    """
    return None


@dataclasses.dataclass(frozen=True)
class WindowScorer:
  """A policy's :meth:`WindowPolicy.score_rows`, bound to the policy.

  Equal (and hashing equal) for equal policies, so a jitted prefill that takes it as a static
  argument compiles once per policy.
  """

  policy: Policy

  def __call__(self, attn_LHWT: Array) -> Array:
    """Reduces window rows to scores with the policy's :meth:`WindowPolicy.score_rows`.

    Args:
      attn_LHWT: window rows ``[., H, W, T]``.

    Returns:
      Scores ``[., H, T]``.
    """
    return self.policy.score_rows(attn_LHWT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowPolicy(Policy):
  """A policy that reads the window rows through :meth:`score_rows` only.

  SnapKV's votes, TOVA's last row: independent per layer, so a prefill may reduce each layer's
  rows to scores as it forms them (``evidence.window_scores_LHT``).
  """

  def score_rows(self, attn_LHWT: Array) -> Array:
    """Reduces window rows to scores, independently per leading index.

    The method a subclass writes; :meth:`score` reads ``evidence.window_scores_LHT`` when a
    prefill formed them already, else applies this to ``evidence.attn_window_LHWT``.

    Args:
      attn_LHWT: window rows ``[., H, W, T]``: causal softmax rows of the last ``W`` queries.

    Returns:
      Scores ``[., H, T]``.

    Raises:
      NotImplementedError: here; a subclass implements it.
    """
    raise NotImplementedError(f"{type(self).__name__}.score_rows")

  def score(self, evidence: Evidence) -> Array:
    """Scores from the prefill's reduced rows if present, else :meth:`score_rows` of the rows."""
    if evidence.window_scores_LHT is not None:
      return evidence.window_scores_LHT
    return self.score_rows(evidence.need("attn_window_LHWT", self.label))

  def window_scorer(self):
    """This policy's :class:`WindowScorer`."""
    return WindowScorer(self)

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The request; with ``reduce_rows``, the scores in place of the window rows.

    The rows stay when the allocator reads them too (CAKE's).
    """
    request = super().evidence_request(T)
    # the rows are read by score_rows alone, unless the allocator reads them too (CAKE's)
    if reduce_rows and "attn_window_LHWT" not in self.allocator.needs:
      request = dataclasses.replace(request, window_scores=self.window_scorer())
    return request


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePolicy(Policy):
  """A decode-time evictor: the cache is cut back to the budget after every generated token.

  After the prompt's selection, every generated token joins the cache and the cache is cut back
  to the budget by :meth:`keep_scores` (the new token always stays).

  A small state machine over the cache's slots, run alike by the model's cache
  (:mod:`kvjax.model.cache`) and the lab's online replay (:mod:`kvjax.lab.online`). Shapes are
  ``[..., H, C]`` (the lab: ``[L, H, C]``; the model, one layer at a time: ``[B, H, C]``).
  """

  def __post_init__(self):
    super().__post_init__()
    if self.decode_every is not None:
      raise ValueError(
        f"decode_every: policy {self.label!r} evicts at every step already; expected None"
      )

  @property
  def evicts_each_step(self) -> bool:
    """True: it evicts at every generated token."""
    return True

  def init_state(
    self, evidence: Evidence, scores_LHT: Array, idx_LHC: Array, kept_LHC: Array
  ) -> Array | None:
    """The per-slot state of the prompt's kept slots, or ``None`` for a policy without state.

    Args:
      evidence: the prompt's evidence.
      scores_LHT: the prompt's grouped scores ``[L, H, T]``.
      idx_LHC: the kept slots' positions, int32 ``[L, H, C]``.
      kept_LHC: which slots hold a kept position, bool ``[L, H, C]``.

    Returns:
      The state ``[L, H, C]`` fp32, or ``None`` (here).
    """
    return None

  def observe(self, state_HC: Array, attn_HC: Array) -> Array:
    """The state after a step whose query paid ``attn_HC`` to each slot.

    A new slot's state starts at 0.

    Args:
      state_HC: the state before the step, ``[..., H, C]``.
      attn_HC: the attention the step's query paid to each slot, per cache head (the mean over
        its query heads), ``[..., H, C]``.

    Returns:
      The state after the step, ``[..., H, C]`` (here ``state_HC`` unchanged).
    """
    return state_HC

  def keep_scores(self, state_HC: Array | None, positions_HC: Array, t, budget_H: Array) -> Array:
    """Keep scores of the current slots before token ``t`` joins.

    Higher keeps, ``+inf`` protects; the cache keeps each head's ``budget_H`` best slots. Here
    the positions themselves (the most recent tokens).

    Args:
      state_HC: the state (:meth:`observe`), or ``None`` for a policy without state.
      positions_HC: the slots' positions, ``[..., H, C]``.
      t: the joining token's position, broadcastable to ``[..., 1, 1]``.
      budget_H: each head's budget, ``[..., H]``.

    Returns:
      Keep scores fp32 ``[..., H, C]``.
    """
    return positions_HC.astype(jnp.float32)


def gather_slots(x_LHT: Array, idx_LHC: Array, kept_LHC: Array, num_heads: int) -> Array:
  """Reads ``x`` at the kept slots' positions (0 elsewhere).

  Its heads are first averaged down to ``num_heads`` (query-head evidence for a KV-head cache).

  Args:
    x_LHT: per-position values ``[L, Hq, T]``.
    idx_LHC: the slots' positions, int32 ``[L, H, C]``.
    kept_LHC: which slots hold a kept position, bool ``[L, H, C]``.
    num_heads: ``H``, the cache's heads (it must divide ``Hq``).

  Returns:
    ``[L, H, C]``: ``x`` at each kept slot's position, 0 in the other slots.
  """
  if x_LHT.shape[1] != num_heads:
    x_LHT = x_LHT.reshape(x_LHT.shape[0], num_heads, -1, x_LHT.shape[-1]).mean(2)
  return jnp.where(kept_LHC, jnp.take_along_axis(x_LHT, idx_LHC, -1), 0.0)
