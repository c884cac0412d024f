"""The compressed cache's types and static choices: its slot tables (:class:`KVCache`), what it
holds them for (:class:`CacheSpec`, :class:`Layout`), the evidence kinds it takes and keeps, its
memory, and the reshapes of a whole cache (room for fed tokens, configurations folded into rows).

Re-exported by :mod:`kvjax.model.cache`, whose names these are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies, select
from kvjax.model.config import ModelConfig
from kvjax.policies import evidence as evidence_lib

Array = jax.Array


LAYOUTS = ("kv", "query")
# the budget a compression records for a (layer, head) whose policy scores held NaN: the row is
# flagged in `overflow` and check_overflow names the scores (a NaN cannot be ranked)
NAN_SCORES = -2


def check_layout(layout: str) -> None:
  """Checks that ``layout`` names a cache layout (one of :data:`LAYOUTS`).

  Args:
    layout: ``"kv"`` or ``"query"``.

  Raises:
    ValueError: for any other value, naming the expected ones.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a cache holds its slots (what the entry points take as ``layout``; a string there is
  ``Layout(heads=...)``).

  Attributes:
    heads: ``"kv"`` (a slot table per KV head) or ``"query"`` (per query head, the published
      tables' granularity: K/V repeated over each group, 4x the memory for Llama 3).
    reindex: StreamingLLM's pos-shift: keys stored pre-RoPE and rotated by their rank inside
      the cache, so positions never exceed its size (default: original positions).
    compress_sliding: on a model whose layers differ (Gemma 2/3), compress the sliding layers
      too (default: each keeps its window's most recent tokens, as kvpress leaves them;
      :func:`~kvjax.model.cache.sliding_layers`).
    paged: decode over each head's own pages (:mod:`kvjax.model.paged`): ``None`` (default)
      on TPU and GPU when the budgets differ across heads or layers, ``True`` on any platform,
      ``False`` never.
  """

  heads: str = "kv"
  reindex: bool = False
  compress_sliding: bool = False
  paged: bool | None = None

  def __post_init__(self):
    check_layout(self.heads)
    for name in ("reindex", "compress_sliding"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
    if self.paged is not None and not isinstance(self.paged, bool):
      raise ValueError(f"paged: expected None or a bool, got {self.paged!r}")


def as_layout(layout: Layout | str) -> Layout:
  """Converts ``layout`` to a :class:`Layout` (a string names its ``heads``).

  Args:
    layout: a :class:`Layout`, or ``"kv"`` or ``"query"``.

  Returns:
    The :class:`Layout`.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(layout, Layout):
    return layout
  if isinstance(layout, str):
    return Layout(layout)
  raise ValueError(f"layout: expected one of {LAYOUTS} or a cache.Layout, got {layout!r}")


@struct.dataclass
class KVCache:
  """A compressed KV cache: a fixed-capacity slot table per (layer, batch row, head).

  Attributes:
    keys: ``[L, B, H, C, D]`` post-RoPE, at original positions (``D_keep`` channels with ThinK).
    values: ``[L, B, H, C, D]``.
    positions: ``[L, B, H, C]`` int32 original positions of the slots.
    valid: ``[L, B, H, C]`` bool, the slots that hold a token.
    budget: ``[B, L, H]`` int32, the slots each row may hold.
    scores: ``[L, B, H, C]`` decode-time evidence (H2O's sums, TOVA's last row), or None.
    overflow: ``[B]`` bool, set when a row needed more slots than the capacity (a budget above
      it, or appends past it): callers raise on it instead of silently dropping tokens.
    channels: ``[L, B, H, D_keep]`` int32, ThinK's kept key channels, or None.
    new_keys: ``[L, B, H, N, D]`` ThinK's full keys of the generated tokens (generated token
      ``i`` sits in slot ``C_prompt + i``), or None.
    queries: ``[L, B, Hq, W, D]`` the last ``W`` generated queries (``decode_every``), or None.
    query_pos: ``[B, W]`` int32 their RoPE positions (-1: none yet), or None.
    evidence: caller-given model-level evidence a re-compression reuses, or None.
    attn_sums: ``[L, B, H, C]`` fp32 each slot's attention summed over the generated queries,
      for a policy that merges while decoding (CaM), or None.
  """

  keys: Array  # [L, B, H, C, D] post-RoPE, original positions
  values: Array  # [L, B, H, C, D]
  positions: Array  # [L, B, H, C] int32
  valid: Array  # [L, B, H, C] bool
  budget: Array  # [B, L, H] int32: slots each row may hold
  scores: Array | None = None  # [L, B, H, C] decode-time evidence (H2O sums, TOVA's last row)
  # set when a row needed more slots than the capacity (a budget above it, or appends past it):
  # callers raise on it instead of silently dropping tokens
  overflow: Array | None = None  # [B] bool
  channels: Array | None = None  # [L, B, H, D_keep] int32: ThinK's kept key channels
  # ThinK: the generated tokens' full keys; generated token i sits in slot C_prompt + i
  new_keys: Array | None = None  # [L, B, H, N, D]
  queries: Array | None = None  # [L, B, Hq, W, D] the last W generated queries (decode_every)
  query_pos: Array | None = None  # [B, W] int32 their RoPE positions (-1: none yet)
  evidence: dict | None = None  # caller-given model-level evidence a re-compression reuses
  attn_sums: Array | None = None  # [L, B, H, C] fp32 attention summed over generated queries


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Static choices of a compressed cache; what it does while decoding follows from its policy
  object (:class:`kvjax.policies.Policy`)."""

  policy: policies.Policy
  capacity: int
  layout: str = "kv"  # "kv": per KV head; "query": per query head (K/V repeated, 4x for Llama 3)
  reindex: bool = False  # StreamingLLM's positions: keys stored pre-RoPE, rotated by cache rank
  # ThinK: the slots (of the capacity) for generated tokens, whose keys keep every channel
  new_tokens: int = 0
  # the budget has a leading batch axis (one per row: a compression ratio of each row's length)
  row_budgets: bool = False
  # models whose layers differ (Gemma 2/3): compress the sliding layers too (True), or keep each
  # its window's most recent tokens, as kvpress skips them, with budgets counting the global
  # layers only (False)
  compress_sliding: bool = False
  # the slots each layer's buffer keeps in a loop of decode steps over the cache held one buffer
  # per layer (per_layer), each at most `capacity`: a layer whose largest budget is below the
  # others' (PyramidKV's upper layers) reads no empty slots (None: every layer `capacity`)
  layer_capacity: tuple[int, ...] | None = None

  @property
  def decode_every(self) -> int | None:
    """Re-compress to the budget every this many generated tokens (``None``: never)."""
    return self.policy.decode_every

  @property
  def decode_window(self) -> int:
    """Generated queries kept for re-compression: the policy's observation window, at most
    ``decode_every`` (kvpress clears its buffer of hidden states at every compression)."""
    if not self.decode_every:
      return 0
    return min(self.policy.decode_policy.observation_window, self.decode_every)

  @property
  def channel_ratio(self) -> float | None:
    """ThinK's pruned fraction of key channels (``None``: every channel kept)."""
    return self.policy.channel_ratio or None

  @property
  def decode_time(self) -> bool:
    """Whether the policy evicts at every generated token (its decode-time state machine)."""
    return self.policy.evicts_each_step and not self.decode_every


# the data kinds of evidence (declared in kvjax.policies.evidence: caller-given, computed from
# the model by a kind's own compute, or read from a calibration file), live views of the
# declarations: {name: rank}; per model (SHARED) or per batch row (ROW, B at axis 1)
def _data(kind) -> bool:
  return kind.source in ("caller", "calibration")


SHARED_EVIDENCE = evidence_lib.KindIndex(
  lambda k: _data(k) and not k.per_row, lambda k: len(k.axes)
)
ROW_EVIDENCE = evidence_lib.KindIndex(lambda k: _data(k) and k.per_row, lambda k: len(k.axes) + 1)
# what a re-compression during decoding can provide (over the cache's own slots)
# (every shared data kind: the cache keeps them)
DECODE_EVIDENCE = evidence_lib.KindIndex(
  lambda k: k.decode or (_data(k) and not k.per_row), lambda k: k.source
)


def memory(cache: KVCache, sliding: np.ndarray | None = None) -> dict:
  """Counts the bytes of a cache: allocated buffers, K/V actually held and bookkeeping.

  K/V held counts ThinK's pruned keys at their ``D_keep`` channels; bookkeeping counts positions,
  validity, decode-time scores, channel indices, the re-compression's query window and CaM's
  attention sums.

  Args:
    cache: the cache.
    sliding: bool ``[L]``, a model's sliding layers (:func:`~kvjax.model.cache.sliding_layers`);
      when given, the K/V held is also split into ``kv_bytes_held_sliding`` and
      ``kv_bytes_held_global``.

  Returns:
    ``{"kv_bytes_held": ..., "kv_bytes_allocated": ..., "bookkeeping_bytes": ...}`` (ints).
  """
  kv_itemsize = cache.keys.dtype.itemsize
  Dk, Dv = cache.keys.shape[-1], cache.values.shape[-1]
  Cp = cache.keys.shape[3]  # the prompt's slots (all of them unless ThinK)
  held = int(cache.valid[..., :Cp].sum()) * (Dk + Dv) * kv_itemsize
  held += int(cache.valid[..., Cp:].sum()) * (cache.values.shape[-1] * 2) * kv_itemsize
  allocated = (cache.keys.size + cache.values.size) * kv_itemsize
  if cache.new_keys is not None:
    allocated += cache.new_keys.size * kv_itemsize
  book = cache.positions.size * 4 + cache.valid.size
  for extra in (cache.scores, cache.channels, cache.queries, cache.query_pos, cache.attn_sums):
    book += 0 if extra is None else extra.size * extra.dtype.itemsize
  out = {"kv_bytes_held": held, "kv_bytes_allocated": allocated, "bookkeeping_bytes": book}
  if sliding is not None:
    per_layer = np.asarray(cache.valid).reshape(cache.valid.shape[0], -1).sum(-1)
    slot = (Dk + Dv) * kv_itemsize  # ThinK's caches are not split (its layers are alike)
    out["kv_bytes_held_sliding"] = int(per_layer[np.asarray(sliding)].sum()) * slot
    out["kv_bytes_held_global"] = int(per_layer[~np.asarray(sliding)].sum()) * slot
  return out


def full_cache_bytes(cfg: ModelConfig, batch: int, length: int, itemsize: int) -> int:
  """Counts the bytes of an uncompressed cache of ``length`` tokens (K and V, every KV head).

  Args:
    cfg: the model's config.
    batch: rows.
    length: tokens per row.
    itemsize: bytes per element.

  Returns:
    The bytes of the keys and values.
  """
  return cfg.num_layers * batch * cfg.num_kv_heads * length * cfg.head_dim * 2 * itemsize


def check_spec(spec: CacheSpec) -> None:
  """Refuses static cache choices that cannot work together.

  Args:
    spec: the cache's static choices.

  Raises:
    ValueError: for an unknown layout, a ``layer_capacity`` that is not a tuple of ints in
      ``[1, capacity]``, ThinK's ``channel_ratio`` with re-indexed positions or with a policy
      that evicts or re-compresses while decoding, or a ``decode_every`` that cannot run
      (:func:`check_decode_every`).
  """
  check_layout(spec.layout)
  caps = spec.layer_capacity
  if caps is not None and (
    not isinstance(caps, tuple)
    or not caps
    or any(
      isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= spec.capacity for c in caps
    )
  ):
    raise ValueError(
      f"layer_capacity: expected a non-empty tuple of ints in [1, capacity={spec.capacity}] or "
      f"None, got {caps!r}"
    )
  if spec.channel_ratio and spec.reindex:
    raise ValueError(
      "channel_ratio: pruned key channels cannot be re-rotated (RoPE mixes channel i with "
      "i + D/2); expected Layout(reindex=False)"
    )
  if spec.channel_ratio and (spec.decode_time or spec.decode_every):
    raise ValueError(
      f"channel_ratio: ThinK prunes the prompt's keys once; policy {spec.policy.label!r} evicts "
      "or re-compresses while decoding, expected a prefill policy without decode_every"
    )
  check_decode_every(spec)


def check_decode_every(spec: CacheSpec) -> None:
  """Refuses a ``decode_every`` that cannot run with ``spec``.

  It runs with a prefill scorer whose evidence a re-compression can rebuild over the cache's own
  slots, at original positions: the policy's :attr:`~kvjax.policies.Policy.decode_policy` (the
  decoding scorer of :class:`~kvjax.policies.PrefillDecoding`; the prompt's policy may read
  anything a prefill provides). Nothing is checked without ``decode_every``.

  Args:
    spec: the cache's static choices.

  Raises:
    ValueError: for a policy reading evidence a re-compression cannot rebuild, re-indexed
      positions, or a ``decode_every`` shorter than the policy's observation window.
  """
  if not spec.decode_every:
    return
  policy = spec.policy.decode_policy
  needs = set(policy.evidence_fields) - set(DECODE_EVIDENCE)
  if needs:
    raise ValueError(
      f"decode_every: policy {policy.label!r} needs {sorted(needs)}, which a re-compression "
      f"during decoding cannot rebuild; expected a scorer reading only {sorted(DECODE_EVIDENCE)}"
    )
  if spec.reindex:
    raise ValueError("decode_every: re-compression keeps original positions; expected reindex off")
  window = policy.observation_window
  if policy.windowed and spec.decode_every < window:
    raise ValueError(
      f"decode_every: {spec.decode_every} generated tokens cannot fill the observation window "
      f"of {window} of policy {policy.label!r}; expected decode_every >= {window}"
    )


def evidence_shapes(kind, *, L: int, B: int, G: int, T: int, D: int, Hq: int | None = None):
  """The shapes a model's entry points accept for a data kind of evidence, from its axes.

  ``H`` is the query heads ``Hq`` (``G`` when ``Hq`` is ``None``); a per-row kind has the batch
  at axis 1 (``kvzap_LGT``: ``[L, B, G, T]``); a kind's ``also`` axes are accepted too.

  Args:
    kind: the :class:`kvjax.policies.EvidenceKind`.
    L: layers.
    B: batch rows.
    G: KV heads.
    T: prompt tokens.
    D: the head dimension.
    Hq: query heads.

  Returns:
    The accepted shapes, a list of tuples.
  """
  size = {"L": L, "G": G, "H": G if Hq is None else Hq, "T": T, "D": D}
  out = []
  for axes in (kind.axes, *kind.also):
    shape = tuple(size[a] for a in axes)
    out.append(shape[:1] + (B,) + shape[1:] if kind.per_row else shape)
  return list(dict.fromkeys(out))


def check_evidence(
  evidence, *, L: int, B: int, G: int, T: int, D: int, Hq: int | None = None
) -> dict:
  """Checks the caller's evidence mapping (``{kind: array}``) against the model's shapes.

  Only the data kinds are taken (:data:`SHARED_EVIDENCE`, :data:`ROW_EVIDENCE`: caller-given or
  calibration kinds, :func:`kvjax.policies.evidence_kinds`), each of the shape its axes give
  (:func:`evidence_shapes`: ``kvzap_LGT`` ``[L, B, G, T]``, ``qfilters_LGD`` ``[L, G, D]``,
  HeadKV's ``head_scores_LH`` ``[L, Hq]`` or ``[L, G]``); they must be finite and pass their
  kind's own ``check`` (DuoAttention's gates in ``[0, 1]``).

  Args:
    evidence: the caller's mapping, or ``None``.
    L: layers.
    B: batch rows.
    G: KV heads.
    T: prompt tokens.
    D: the head dimension.
    Hq: query heads (``None``: only ``[L, G]`` head scores are accepted).

  Returns:
    The fields that are not ``None``, as fp32 arrays (``{}`` for ``None``).

  Raises:
    ValueError: naming the field, its shape and the expected one, for a field that is not
      caller-given evidence, a wrong shape, non-finite values or values its kind refuses.
  """
  if evidence is None:
    return {}
  if not isinstance(evidence, dict):
    raise ValueError(f"evidence: expected a dict of evidence fields, got {type(evidence).__name__}")
  data = {**SHARED_EVIDENCE, **ROW_EVIDENCE}
  out = {}
  for name, value in evidence.items():
    if name not in data:
      raise ValueError(
        f"evidence: {name!r} is not caller-given evidence; expected some of {sorted(data)} "
        "(the prefill computes the other fields a policy reads, but not all: "
        "kvjax.model.decoding.check_model_evidence names those no model entry point provides)"
      )
    if value is None:
      continue
    kind = evidence_lib.evidence_kind(name)
    expected = evidence_shapes(kind, L=L, B=B, G=G, T=T, D=D, Hq=Hq)
    shape = tuple(np.shape(value))
    if shape not in expected:
      want = " or ".join(str(s) for s in expected)
      raise ValueError(f"evidence: {name} has shape {shape}, expected {want}")
    if select.is_concrete(value):
      arr = np.asarray(value, np.float64)
      if not np.isfinite(arr).all():
        raise ValueError(f"evidence: {name} has non-finite values")
      wrong = kind.check(arr) if kind.check is not None else None
      if wrong:
        raise ValueError(f"evidence: {name} {wrong}")
    out[name] = jnp.asarray(value, jnp.float32)
  return out


def with_room(cache: KVCache, n: int) -> KVCache:
  """The cache with ``n`` more empty slots per (layer, row, head), for tokens fed after it.

  Args:
    cache: the cache (not ThinK's: its generated tokens have slots of their own).
    n: the slots to add, an int ``>= 0``.

  Returns:
    The cache, its slot axis ``C + n`` long (the new slots empty, after the old ones).

  Raises:
    ValueError: for a negative or non-int ``n``, or a ThinK cache.
  """
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"n: expected an int >= 0 of slots to add, got {n!r}")
  if cache.new_keys is not None:
    raise ValueError("cache: ThinK's cache sizes its generated slots at compression; no room added")

  def pad(t, value=0):
    if t is None:
      return None
    widths = [(0, 0)] * t.ndim
    widths[3] = (0, int(n))
    return jnp.pad(t, widths, constant_values=value)

  return cache.replace(
    keys=pad(cache.keys),
    values=pad(cache.values),
    positions=pad(cache.positions),
    valid=pad(cache.valid, False),
    scores=pad(cache.scores),
    attn_sums=pad(cache.attn_sums),
  )


_BATCH_AXIS = dict(
  keys=1,
  values=1,
  positions=1,
  valid=1,
  budget=0,
  scores=1,
  overflow=0,
  channels=1,
  new_keys=1,
  queries=1,
  query_pos=0,
  attn_sums=1,
)


def fold_configs(caches_K: KVCache) -> KVCache:
  """Folds ``K`` caches stacked on a leading axis into one cache of ``K * B`` rows.

  The caches are stacked as a vmapped compression returns them; rows are configuration-major
  (row ``k * B + b``): what a batch-wide computation such as :func:`~kvjax.model.cache.extend`
  then runs over once, instead of vmapping over ``K``.

  Args:
    caches_K: the stacked caches (every field with a leading ``K`` axis).

  Returns:
    One :class:`KVCache` of ``K * B`` rows.

  Raises:
    ValueError: for caches holding model-level evidence.
  """
  if caches_K.evidence is not None:
    raise ValueError("caches: caches holding model-level evidence cannot be folded")
  K, _, B = caches_K.keys.shape[:3]

  def rows(name):
    x = getattr(caches_K, name)
    if x is None:
      return None
    axis = _BATCH_AXIS[name]
    x = jnp.moveaxis(x, 0, axis)  # the configurations next to the batch
    return x.reshape(x.shape[:axis] + (K * B,) + x.shape[axis + 2 :])

  # every field but the evidence (a new field without a _BATCH_AXIS entry fails here, loudly)
  names = [f.name for f in dataclasses.fields(caches_K) if f.name != "evidence"]
  return dataclasses.replace(caches_K, **{name: rows(name) for name in names})
