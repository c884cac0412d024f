"""A real compressed KV cache: fixed-capacity slot tables per (layer, batch row, head).

``keys``/``values`` are ``[L, B, H, C, D]`` buffers sized by the capacity ``C`` (``H`` = KV heads,
or query heads for the query-head layout of the published tables), with original positions and
a validity mask per slot. Attention masks empty slots, never evicted keys: an evicted key is
gone. Per-layer and per-head budgets decode correctly because every row is its own slot table.

* :func:`compress` turns a prefill (:func:`kvjax.model.llama.prefill`) into a cache with any
  policy object (:class:`kvjax.policies.Policy`) and allocation, through
  :func:`kvjax.select.compact` (the only selection).
* :func:`decode_step` runs one token through the model against the cache (stacked, or held one
  buffer per layer for a loop of steps on CPU: :func:`per_layer`). Prefill-time policies
  (SnapKV, PyramidKV, Ada-KV, HeadKV, CAKE, ...) and the full cache append without eviction, as
  the official code does; decode-time policies (:class:`kvjax.policies.DecodePolicy`: sliding
  window, StreamingLLM, H2O, TOVA, a user's own) admit the new token and evict to stay within
  budget before attending, running the policy's own state machine (``init_state``, ``observe``,
  ``keep_scores``) over the slots.
* ``decode_every=N`` (a policy option) re-compresses a prefill scorer's cache to its budget
  every ``N`` generated tokens (kvpress ``DecodingPress``; R-KV's buffer of 128), inside the
  jitted decode with a fixed capacity ``budget + N``: :func:`recompress`.
  :class:`kvjax.policies.PrefillDecoding` and :class:`kvjax.policies.RatioDecoding` (kvpress
  ``PrefillDecodingPress``, ``CompressionRatioDecodingPress``) re-compress there with their
  decoding scorer to their own decode budgets (``Policy.decode_scores``,
  ``Policy.decode_budgets``, ``Policy.decode_capacity``).
* ``channel_ratio`` (a policy option) prunes key channels as ThinK does, with a real saving:
  the prompt's kept keys are stored ``[L, B, H, C, D_keep]`` with their channel indices
  ``[L, B, H, D_keep]``; generated tokens keep full keys (``new_keys [L, B, H, N, D]``), as
  kvpress (which zeroes channels of the compressed keys only) and the official ThinK do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies, select
from kvjax import scores as scores_lib
from kvjax.model import llama
from kvjax.model.config import ModelConfig
from kvjax.policies import evidence as evidence_lib

Array = jax.Array

LAYOUTS = ("kv", "query")


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
      :func:`sliding_layers`).
  """

  heads: str = "kv"
  reindex: bool = False
  compress_sliding: bool = False

  def __post_init__(self):
    check_layout(self.heads)
    for name in ("reindex", "compress_sliding"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")


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
    sliding: bool ``[L]``, a model's sliding layers (:func:`sliding_layers`); when given, the
      K/V held is also split into ``kv_bytes_held_sliding`` and ``kv_bytes_held_global``.

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


def _batch_first(x):
  return None if x is None else jnp.moveaxis(x, 1, 0)


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


def _evidence_per_row(pre: llama.Prefill, evidence: dict | None = None) -> policies.Evidence:
  """The prefill's evidence (each kind the prefill computes, by its declaration) and the caller's
  per-row ``evidence`` (``B`` at axis 1), with the batch axis first (to ``vmap`` over rows)."""
  rows = {k: _batch_first(v) for k, v in (evidence or {}).items() if k in ROW_EVIDENCE}
  computed = {
    name: _batch_first(getattr(pre, kind.prefill))
    for name, kind in evidence_lib.evidence_kinds(source="prefill").items()
  }
  return policies.Evidence(
    observation_window=pre.window if pre.window_scores is not None else None,
    **computed,
    **rows,
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


def compress(
  cfg: ModelConfig,
  pre: llama.Prefill,
  spec: CacheSpec,
  budget,
  *,
  rng=None,
  evidence: dict | None = None,
) -> KVCache:
  """Compresses prefill outputs into a cache of capacity ``spec.capacity`` under ``budget``.

  The budget is applied per batch row (allocations may differ between rows). With the policy's
  ``channel_ratio`` the keys keep ``D - int(D * ratio)`` channels per (layer, row, KV head)
  (:func:`think_channels`); with ``decode_every`` the cache carries the window of generated
  queries that :func:`recompress` scores with.

  Args:
    cfg: the model's config.
    pre: the prefill's outputs (:func:`kvjax.model.llama.prefill`).
    spec: the cache's static choices.
    budget: slots per head, window included: a scalar, ``[L]`` or ``[L, H]``; with
      ``spec.row_budgets`` a leading ``[B]`` axis, one per row.
    rng: a PRNG key for random policies (``None``: ``jax.random.key(0)``).
    evidence: caller-given data fields (:func:`check_evidence`; HeadKV's importances as
      ``head_scores_LH``).

  Returns:
    The compressed :class:`KVCache`.

  Raises:
    ValueError: for a spec :func:`check_spec` refuses, evidence :func:`check_evidence` refuses,
      or ThinK's ``channel_ratio`` without the prefill's ``window_queries``.
  """
  L, B, G, T, D = pre.keys.shape
  check_spec(spec)
  budget_axis = 0 if spec.row_budgets else None
  rng = jax.random.key(0) if rng is None else rng
  evidence = check_evidence(evidence, L=L, B=B, G=G, T=T, D=D, Hq=cfg.num_heads)
  H = cfg.num_heads if spec.layout == "query" else G
  shared = {k: v for k, v in evidence.items() if k in SHARED_EVIDENCE}
  if "head_scores_LH" in shared:
    shared["head_scores_LH"] = head_scores_to_layout(shared["head_scores_LH"], H, cfg)
  keys, values = pre.keys, pre.values
  new = spec.new_tokens if spec.channel_ratio else 0
  prompt_slots = spec.capacity - new

  sliding = sliding_layers(cfg, spec)

  def policy_selection(ev, valid_T, budget):
    # a left-padded row: sinks count from its first *real* token (Policy.scores_row)
    scores = spec.policy.scores_row(ev)
    if scores.shape[1] != H:
      scores = _to_layout(scores, H, cfg)
    # allocators see padding as zero evidence (Ada-KV's normalisation sums rows); only the
    # selection sees it as never-keep
    budget_LH = spec.policy.budgets(ev, jnp.where(valid_T, scores, 0.0), budget)
    return _selection_scores(spec, ev, scores, valid_T, budget_LH), budget_LH

  def one(ev, valid_T, rng_b, budget):
    ev = ev.replace(rng=rng_b, valid_T=valid_T, **shared)
    if sliding is None:
      scores, budget_LH = policy_selection(ev, valid_T, budget)
    else:  # the policy over the global layers; each sliding layer keeps its window's tokens
      glob, slide = np.flatnonzero(~sliding), np.flatnonzero(sliding)
      per_layer = budget is not None and jnp.ndim(budget) > 0
      budget_g = jnp.asarray(budget)[glob] if per_layer else budget
      scores_g, budget_g = policy_selection(_layer_subset(ev, glob), valid_T, budget_g)
      recency = jnp.where(valid_T, jnp.arange(T, dtype=jnp.float32), -jnp.inf)
      scores = jnp.zeros((L, H, T), jnp.float32).at[glob].set(scores_g)
      scores = scores.at[slide].set(jnp.broadcast_to(recency, (len(slide), H, T)))
      # the next token attends to the window's last sliding_window - 1 tokens and itself: the
      # slots a sliding layer holds, as transformers' sliding-window cache does
      window = jnp.full((len(slide), H), max(cfg.sliding_window - 1, 1), jnp.int32)
      budget_LH = jnp.zeros((L, H), jnp.int32).at[glob].set(budget_g).at[slide].set(window)
    count = jnp.minimum(budget_LH, valid_T.sum())
    idx, kept = select.compact(scores, count, prompt_slots)
    # a decode-time policy's per-slot state (H2O's sums, TOVA's last row) of the kept slots
    state = spec.policy.init_state(ev, scores, idx, kept) if spec.decode_time else None
    overflow = (count > prompt_slots).any() | (budget_LH < 0).any()
    return idx, kept, budget_LH, state, overflow

  rows = _evidence_per_row(pre, evidence)
  if "stats_query_mean_LHD" in shared:  # ExpectedAttentionStats: the corpus's moments, rotated
    mean, cov = rotated_query_stats(
      cfg, shared, pre.valid.sum(-1), spec.policy.evidence_request(T).n_future
    )
    rows = rows.replace(query_mean_LHD=mean, query_cov_LHDD=cov)
  idx, kept, budget_LH, state, overflow = jax.vmap(one, in_axes=(0, 0, 0, budget_axis))(
    rows, pre.valid, jax.random.split(rng, B), budget
  )
  idx_L, kept_L = jnp.moveaxis(idx, 0, 1), jnp.moveaxis(kept, 0, 1)  # [L, B, H, C]
  gather = functools.partial(_gather_slots, idx_L)
  positions = jnp.take_along_axis(
    jnp.broadcast_to(pre.positions[None, :, None, :], (L, B, H, T)), idx_L, axis=3
  )
  kept_keys = gather(keys)
  if spec.policy.merges:  # kvpress MergingPress: evicted values folded into kept ones
    values = _merged_values(spec, pre, idx_L, kept_L)
  if spec.reindex:  # store pre-RoPE keys: undo each key's rotation at its original position
    if cfg.per_layer:
      raise ValueError(
        f"layout: re-indexed positions rotate every layer alike; the {cfg.family} layers differ "
        "in their RoPE (layer_types); expected reindex off"
      )
    kept_keys = llama.rope_at(kept_keys, positions, cfg, inverse=True)
  kept_keys = jnp.where(kept_L[..., None], kept_keys, 0).astype(keys.dtype)
  kept_values = jnp.where(kept_L[..., None], gather(values), 0).astype(values.dtype)
  positions = jnp.where(kept_L, positions, 0)
  channels_L = new_keys = None
  if spec.channel_ratio:  # ThinK on the kept keys (kvpress ComposedPress([press, ThinKPress]))
    if pre.window_queries is None:
      raise ValueError("channel_ratio: ThinK needs the prefill's window_queries (prefill with it)")
    channels_L = think_channels(pre.window_queries, kept_keys, spec.channel_ratio)
    kept_keys = prune_channels(kept_keys, channels_L)
    new_keys = jnp.zeros((L, B, H, new, D), keys.dtype)
    pad = ((0, 0), (0, 0), (0, 0), (0, new))
    kept_L, positions = jnp.pad(kept_L, pad), jnp.pad(positions, pad)
    kept_values = jnp.pad(kept_values, pad + ((0, 0),))
  window = spec.decode_window
  return KVCache(
    keys=kept_keys,
    values=kept_values,
    positions=positions,
    valid=kept_L,
    budget=budget_LH,
    scores=None if state is None else jnp.moveaxis(state, 0, 1),
    overflow=overflow,
    channels=channels_L,
    new_keys=new_keys,
    queries=jnp.zeros((L, B, cfg.num_heads, window, D), keys.dtype) if window else None,
    query_pos=jnp.full((B, window), -1, jnp.int32) if window else None,
    evidence=(shared or None) if window else None,
    attn_sums=jnp.zeros(kept_L.shape, jnp.float32) if spec.policy.merges_while_decoding else None,
  )


def sliding_layers(cfg: ModelConfig, spec: CacheSpec) -> np.ndarray | None:
  """The layers a compression leaves to their sliding window, or ``None`` when it compresses
  every layer alike.

  A model whose layers differ (Gemma 2/3: ``cfg.layer_types``) has sliding layers that attend to
  their window only; kvpress (``presses/base_press.py``) skips them, so by default each keeps
  the most recent ``sliding_window - 1`` tokens of the prompt (what the next token attends to,
  as transformers' sliding-window cache holds them) and the policy (its scores, budgets,
  PyramidKV's schedule, Ada-KV's pooling) runs over the global layers alone.
  ``spec.compress_sliding`` compresses them too. Models whose every layer slides (Mistral,
  Phi-3) compress every layer.

  Args:
    cfg: the model's config.
    spec: the cache's static choices.

  Returns:
    bool ``[L]``, the sliding layers, or ``None``.
  """
  if spec.compress_sliding or not cfg.per_layer or cfg.sliding_window is None:
    return None
  sliding = llama.is_sliding(cfg)
  return sliding if sliding.any() else None


def _layer_subset(ev: policies.Evidence, layers: np.ndarray) -> policies.Evidence:
  """The evidence of some layers: every per-layer field (all but ``valid_T`` and ``rng``) cut
  on its leading layer axis."""
  out = {}
  for f in dataclasses.fields(ev):
    value = getattr(ev, f.name)
    if f.name in ("valid_T", "rng", "observation_window") or value is None:
      continue
    out[f.name] = value[layers]
  return ev.replace(**out)


def rotated_query_stats(cfg: ModelConfig, stats: dict, start_B: Array, n_future: int) -> tuple:
  """Query statistics measured on a corpus, rotated for each row as the prefill rotates a
  prompt's own (kvpress ``ExpectedAttentionStatsPress.get_query_statistics``: ``apply_avg_rope``
  with the row's length).

  Args:
    cfg: the model's config.
    stats: ``stats_query_mean_LHD [L, Hq, D]`` and ``stats_query_cov_LHDD [L, Hq, D, D]``.
    start_B: each row's real tokens, its first future position ``[B]``.
    n_future: the future positions averaged over.

  Returns:
    ``(query_mean [B, L, Hq, D], query_cov [B, L, Hq, D, D])`` fp32.
  """
  mean_LHD, cov_LHDD = stats["stats_query_mean_LHD"], stats["stats_query_cov_LHDD"]
  B = start_B.shape[0]
  means, covs = [], []
  for layer in range(mean_LHD.shape[0]):  # layers may rotate differently (Gemma's local ones)
    R = llama.average_rope(cfg, start_B, n_future, layer=layer)
    m, c = llama.rotate_moments(
      R,
      jnp.broadcast_to(mean_LHD[layer], (B,) + mean_LHD.shape[1:]),
      jnp.broadcast_to(cov_LHDD[layer], (B,) + cov_LHDD.shape[1:]),
    )
    means.append(m)
    covs.append(c)
  return jnp.stack(means, 1), jnp.stack(covs, 1)


def _merged_values(spec: CacheSpec, pre: llama.Prefill, idx_LBHC, kept_LBHC) -> Array:
  """The prompt's values ``[L, B, H, T, D]`` at the cache's heads after the policy's
  :meth:`~kvjax.policies.Policy.merge` of each head's evicted positions into its kept ones
  (one layer at a time: a merge may hold a ``[B, H, T, T]`` similarity)."""
  L, B, H, _ = idx_LBHC.shape
  T = pre.keys.shape[3]
  keys, values = pre.keys, pre.values
  if keys.shape[2] != H:  # the query layout: each query head reads its KV head
    keys, values = (jnp.repeat(t, H // keys.shape[2], axis=2) for t in (keys, values))
  at = lambda n, axis: jnp.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])  # noqa: E731
  keep = jnp.zeros((L, B, H, T + 1), bool)
  keep = keep.at[at(L, 0), at(B, 1), at(H, 2), jnp.where(kept_LBHC, idx_LBHC, T)].set(True)
  valid = pre.valid[:, None, :]  # [B, 1, T]
  return jax.lax.map(
    lambda x: spec.policy.merge(x[0], x[1], x[2], valid), (keys, values, keep[..., :T])
  )


def _gather_slots(idx_LBHC: Array, t_LBGTD: Array) -> Array:
  """``t[l, b, h // (H / G), idx[l, b, h, c]]``: the kept slots of each cache head ``[L, B, H, C,
  D]``, gathered from the KV-head tensor (``H = G``, or the query layout's ``H = Hq``: query head
  ``h`` reads KV head ``h // group``, as ``jnp.repeat`` orders them) without first repeating it
  across each group at full length."""
  L, B, H, C = idx_LBHC.shape
  G, D = t_LBGTD.shape[2], t_LBGTD.shape[-1]
  idx = idx_LBHC.reshape(L, B, G, (H // G) * C)  # each KV head's query heads, slots in a row
  return jnp.take_along_axis(t_LBGTD, idx[..., None], axis=3).reshape(L, B, H, C, D)


# --------------------------------------------------------------------------- ThinK's key channels


def think_channels(window_queries_LBHWD: Array, keys_LBHCD: Array, ratio: float) -> Array:
  """Chooses ThinK's kept key channels per (layer, row, cache head), ascending.

  ``D_keep = D - int(D * ratio)``. :func:`kvjax.scores.think_channel_scores` (kvpress
  ``ThinKPress``: ``mean_w(q^2)`` over the window queries, group-mean, times ``mean_t(k^2)``) over
  the kept keys, as ``ComposedPress([press, ThinKPress])`` scores the keys the sequence press
  kept (empty slots hold zero keys: a per-head constant factor, so the choice is unchanged), and
  :func:`kvjax.scores.think_channel_mask`'s choice.

  Args:
    window_queries_LBHWD: the prefill's last ``W`` post-RoPE queries ``[L, B, Hq, W, D]``.
    keys_LBHCD: the kept keys ``[L, B, H, C, D]``.
    ratio: the pruned fraction of channels.

  Returns:
    int32 channel indices ``[L, B, H, D_keep]``, ascending.
  """
  D = keys_LBHCD.shape[-1]
  keep = D - int(D * ratio)

  def row(q_LHWD, k_LHCD):
    mask = scores_lib.think_channel_mask(scores_lib.think_channel_scores(q_LHWD, k_LHCD), ratio)
    return jnp.argsort(~mask, axis=-1, stable=True)[..., :keep].astype(jnp.int32)

  out = jax.vmap(row, in_axes=(1, 1), out_axes=1)(window_queries_LBHWD, keys_LBHCD)
  return jnp.sort(out, axis=-1)


def _selection_scores(spec: CacheSpec, ev, scores_LHT, valid_T, budget_LH) -> Array:
  """The scores the selection ranks: the policy's budget-dependent last stage (CriticalKV;
  padding enters it as the lowest finite score, so ``(s + eps) * 0`` stays finite), then
  padding never kept."""
  if spec.policy.rescores:
    low = jnp.finfo(jnp.float32).min
    floor = jnp.where(valid_T, scores_LHT, low)
    scores_LHT = spec.policy.selection_scores(ev, floor, budget_LH, capacity=spec.capacity)
  return jnp.where(valid_T, scores_LHT, -jnp.inf)


def prune_channels(keys_LBHCD: Array, channels_LBHK: Array) -> Array:
  """Keeps the keys at their kept channels only, without storing the zeros.

  The result is what kvpress's ``keys.scatter_(-1, pruned, 0)`` leaves non-zero.

  Args:
    keys_LBHCD: keys ``[..., C, D]``.
    channels_LBHK: the kept channels ``[..., D_keep]`` (:func:`think_channels`).

  Returns:
    Keys ``[..., C, D_keep]``.
  """
  return jnp.take_along_axis(keys_LBHCD, channels_LBHK[..., None, :], axis=-1)


def _think_probs(cfg, q_BHq1D, keys_BHCK, new_keys_BHND, channels_BHK, visible_BHC) -> Array:
  """Attention ``[B, Hq, 1, C]`` over ThinK's pruned prompt slots and the generated tokens' full
  keys: the query at its cache head's kept channels against the first (the pruned channels
  would meet kvpress's zeros), the whole query against the second; one fp32 softmax."""
  B, Hq, _, D = q_BHq1D.shape
  H = keys_BHCK.shape[1]
  q = q_BHq1D.reshape(B, H, Hq // H, 1, D)
  q_kept = jnp.take_along_axis(q, channels_BHK[:, :, None, None, :], axis=-1)
  logits = jnp.concatenate(
    [
      llama.attention_logits(
        q_kept.reshape(B, Hq, 1, -1), keys_BHCK, head_dim=D, softcap=cfg.attn_softcap
      ),
      llama.attention_logits(q_BHq1D, new_keys_BHND, softcap=cfg.attn_softcap),
    ],
    axis=-1,
  )
  return llama.masked_softmax(logits, visible_BHC[:, :, None, :])


def head_scores_to_layout(head_scores_LH: Array, H: int, cfg: ModelConfig) -> Array:
  """Maps HeadKV's head importances onto the cache's ``H`` heads, the heads its budgets are for.

  Importances given per query head ``[L, Hq]`` are averaged over each KV head's group for a KV
  cache, as the scores are (a group's share of the total is the sum of its heads' shares:
  HeadKV normalises them); per KV head ``[L, G]`` they are repeated over each group's query
  heads for a query-head cache.

  Args:
    head_scores_LH: ``[L, Hq]`` or ``[L, G]`` importances.
    H: the cache's heads (``cfg.num_heads`` or ``cfg.num_kv_heads``).
    cfg: the model's config.

  Returns:
    ``[L, H]`` importances.

  Raises:
    ValueError: when the heads map to neither.
  """
  if head_scores_LH.shape[1] == H:
    return head_scores_LH
  return _to_layout(head_scores_LH[..., None], H, cfg)[..., 0]


def _to_layout(scores_LHT, H, cfg):
  """Query-head scores to the cache's heads (KV heads: mean over each group, as kvpress)."""
  if scores_LHT.shape[1] == cfg.num_heads and cfg.num_kv_heads == H:
    return scores_lib.group(scores_LHT, H, "mean")
  if scores_LHT.shape[1] == cfg.num_kv_heads and cfg.num_heads == H:
    return jnp.repeat(scores_LHT, cfg.num_groups, axis=1)
  raise ValueError(f"scores: {scores_LHT.shape[1]} heads cannot map to the cache's {H} heads")


def _admit(spec: CacheSpec, slots: dict, budget_BH, pos_B):
  """Where the new token goes in each row: ``(slot [B, H], slots')`` with the bookkeeping
  (positions, validity, decode-time scores) updated; decode-time policies evict to make room."""
  positions, valid = slots["positions"], slots["valid"]
  C = valid.shape[-1]
  fill = valid.sum(-1)
  if spec.decode_time:  # the policy's keep scores before the token at pos_B joins
    keep_old = spec.policy.keep_scores(
      slots.get("scores"), positions, pos_B[:, None, None], budget_BH
    )
    keep_old = jnp.where(valid, keep_old, -jnp.inf)
    # room for the new token: keep the best `budget - 1` current slots (select.keep_mask)
    room = jnp.minimum(jnp.minimum(budget_BH, C) - 1, fill)
    valid = select.keep_mask(keep_old, room) & valid
    slot = jnp.argmin(valid, axis=-1)  # the first slot not kept: evicted, or empty
  else:  # append; past the capacity the row is flagged (the caller sizes C for every token)
    slot = jnp.minimum(fill, C - 1)
    slots = dict(slots, overflow=slots["overflow"] | (fill >= C).any(-1))
  onehot = jax.nn.one_hot(slot, C, dtype=bool)  # [B, H, C]
  out = dict(
    slots, positions=jnp.where(onehot, pos_B[:, None, None], positions), valid=valid | onehot
  )
  if spec.decode_time and slots.get("scores") is not None:
    out["scores"] = jnp.where(onehot | ~out["valid"], 0.0, slots["scores"])
  return slot, out


# slots per block of the decode step's attention: a block of K or V ([B, H, 2048, D], 8 MiB at
# B=4, H=4, D=64 in fp32) stays in the last-level cache between its copy out of the stacked
# [L, ...] buffer and the contraction that reads it (2048 measured faster than 1024 and 4096)
DECODE_BLOCK = 2048


def _held_blocks(visible_BHC: Array, block: int, n: int) -> tuple[Array, Array]:
  """The blocks of :data:`DECODE_BLOCK` slots that hold a visible slot of some row and head:
  ``(first, stop)``, block ``i`` read for ``first <= i < stop``. The blocks before the first
  visible slot and after the last hold nothing the query sees: a sliding window's old slots, a
  layer whose budget is below the capacity (PyramidKV), the room a cache keeps for the tokens
  still to come."""
  C = visible_BHC.shape[-1]
  slot = jnp.arange(C, dtype=jnp.int32)
  first = jnp.min(jnp.where(visible_BHC, slot, C - 1)) // block
  stop = (jnp.max(jnp.where(visible_BHC, slot + 1, 0)) + block - 1) // block
  return jnp.minimum(first, n - 1), jnp.minimum(stop, n)


def _carried_as_bits(dtype) -> bool:
  """Whether the decode step carries K/V of ``dtype`` as their bits (``uint16``): XLA:CPU
  slices and scatters 16-bit floats in fp32, converting the whole stacked ``[L, B, H, C, D]``
  cache to fp32 and back around every layer's scatter (``docs/benchmarks.md`` has the cost)."""
  return jax.default_backend() == "cpu" and jnp.dtype(dtype).itemsize == 2


def _as_bits(x: Array, bits: bool) -> Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x


def _as_float(x: Array, dtype) -> Array:
  """``x`` in ``dtype``, from its bits when it is carried as bits (:func:`_carried_as_bits`)."""
  if x.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
    return jax.lax.bitcast_convert_type(x, dtype)
  return x


def layer_attention(
  cfg: ModelConfig, q_BHq1D: Array, keys_BHCD: Array, values_BHCD: Array, visible_BHC: Array
) -> tuple[Array, Array]:
  """Computes one decode query's attention over one layer's slots, read whole.

  ``llama.attention_probs`` and ``llama.attend`` over the layer's own buffers: what the decode
  step runs over a cache held one buffer per layer (:func:`per_layer`), and over a stacked
  cache of one block (:func:`slot_attention_of_layer`).

  Args:
    cfg: the model's config (its attention soft-cap).
    q_BHq1D: the query ``[B, Hq, 1, D]``, post-RoPE.
    keys_BHCD: the layer's keys ``[B, H, C, D]``.
    values_BHCD: the layer's values ``[B, H, C, D]``.
    visible_BHC: ``[B, H, C]`` bool, the slots the query may see.

  Returns:
    ``(probs [B, Hq, 1, C], out [B, Hq, 1, D])``, fp32; a row with no visible slot gives zeros.
  """
  probs = llama.attention_probs(
    q_BHq1D, keys_BHCD, visible_BHC[:, :, None, :], softcap=cfg.attn_softcap
  )
  return probs, llama.attend(probs, values_BHCD)


def slot_attention_of_layer(
  cfg: ModelConfig,
  q_BHq1D: Array,
  keys_all: Array,
  values_all: Array,
  l,
  visible_BHC: Array,
  kv_dtype=None,
) -> tuple[Array, Array]:
  """Computes one decode query's attention over layer ``l``'s slots of the stacked K/V.

  The same as ``llama.attention_probs`` and ``llama.attend`` over ``keys_all[l]`` and
  ``values_all[l]``, up to float rounding. Slicing layer ``l`` out whole copies ``2 C D`` floats
  per row and head before the contraction reads them again (XLA:CPU's contractions read
  materialised operands), three passes over memory where one is needed; read in blocks of
  :data:`DECODE_BLOCK` slots, each copied block is still in cache when it is contracted, and
  blocks that hold no visible slot are not read (:func:`_held_blocks`). The logits of a block
  are ``k q^T``, the block as the contraction's left operand (XLA:CPU packs a right operand
  before it multiplies: ``q k^T`` copies each block once more); each is a dot product over
  ``D``, as ``attention_logits``'s, summed in another order; the output sums the blocks'
  partial products. A cache of one block attends over the layer's slots whole, through
  ``llama.attention_probs``.

  Args:
    cfg: the model's config (its attention soft-cap).
    q_BHq1D: the query ``[B, Hq, 1, D]``, post-RoPE.
    keys_all: the stacked keys ``[L, B, H, C, D]``.
    values_all: the stacked values ``[L, B, H, C, D]``.
    l: the layer (an int or a traced scalar).
    visible_BHC: ``[B, H, C]`` bool, the slots the query may see.
    kv_dtype: the K/V's dtype when ``keys_all`` and ``values_all`` hold its bits (``uint16``),
      as the decode step carries a 16-bit cache on CPU; ``None``: their own dtype.

  Returns:
    ``(probs [B, Hq, 1, C], out [B, Hq, 1, D])``, fp32; a row with no visible slot gives zeros.
  """
  _, B, H, C, D = keys_all.shape
  Hq = q_BHq1D.shape[1]
  n = -(-C // DECODE_BLOCK)
  kv_dtype = keys_all.dtype if kv_dtype is None else kv_dtype
  if n == 1:  # one block: the layer's slots whole, as the attention over a layer reads them
    keys, values = _as_float(keys_all[l], kv_dtype), _as_float(values_all[l], kv_dtype)
    return layer_attention(cfg, q_BHq1D, keys, values, visible_BHC)
  block = -(-C // n)  # n equal blocks: the last overlaps the one before by fewer than n slots
  q = q_BHq1D.astype(jnp.float32).reshape(B, H, Hq // H, D)
  first, stop = _held_blocks(visible_BHC, block, n)

  def start(i):  # the last block ends at C
    return jnp.minimum(i * block, C - block)

  def logits_block(i, logits):
    k = jax.lax.dynamic_slice(keys_all, (l, 0, 0, start(i), 0), (1, B, H, block, D))[0]
    k = _as_float(k, kv_dtype).astype(jnp.float32)
    x = jnp.einsum("bgkd,bgrd->bgkr", k, q, precision=scores_lib.PRECISION)
    return jax.lax.dynamic_update_slice(logits, x, (0, 0, start(i), 0))

  # slots in blocks not read keep logit 0: none is visible, so the softmax masks them all
  logits = jax.lax.fori_loop(first, stop, logits_block, jnp.zeros((B, H, C, Hq // H), jnp.float32))
  logits = llama.softcap_logits(jnp.swapaxes(logits, 2, 3) / float(np.sqrt(D)), cfg.attn_softcap)
  probs = llama.masked_softmax(logits[:, :, :, None], visible_BHC[:, :, None, :])  # [B,Hq,1,C]
  p = probs.reshape(B, H, Hq // H, C)

  def out_block(i, acc):
    v = jax.lax.dynamic_slice(values_all, (l, 0, 0, start(i), 0), (1, B, H, block, D))[0]
    v = _as_float(v, kv_dtype)
    p_i = jax.lax.dynamic_slice(p, (0, 0, 0, start(i)), (B, H, Hq // H, block))
    # slots the block before already counted (the overlapping last block) count once
    p_i = jnp.where(start(i) + jnp.arange(block) >= i * block, p_i, 0.0)
    return acc + jnp.einsum(
      "bgrk,bgkd->bgrd", p_i, v.astype(jnp.float32), precision=scores_lib.PRECISION
    )

  out = jax.lax.fori_loop(first, stop, out_block, jnp.zeros((B, H, Hq // H, D), jnp.float32))
  return probs, out.reshape(B, Hq, 1, D)


def decode_step(
  cfg: ModelConfig,
  params: dict,
  spec: CacheSpec,
  cache: KVCache,
  token_B,
  pos_B,
  t_B,
  step=None,
):
  """Runs one generated token through every layer against the cache.

  The K/V buffers ride in the layer loop's carry (on CPU a 16-bit cache as its bits,
  :func:`_carried_as_bits`) and only the new token's slot is written (an in-place scatter), so a
  step reads the cache once and writes ``O(B H D)``; each layer's attention reads its slots in
  blocks (:func:`slot_attention_of_layer`). Over parameters and a cache held one buffer per
  layer (:func:`per_layer`) the layers are unrolled, each reading its own weights and slots whole
  (:func:`layer_attention`). Prefill-time policies append; decode-time policies admit the token
  and evict to stay within budget.

  Args:
    cfg: the model's config.
    params: the parameter pytree (stacked, or split by layer with the cache: :func:`per_layer`).
    spec: the cache's static choices.
    cache: the cache (stacked, or held one buffer per layer: :func:`per_layer`).
    token_B: the token per row ``[B]``.
    pos_B: the token's RoPE position per row ``[B]`` (original positions).
    t_B: the token's index in the sequence (not read by the step: slots come from the cache).
    step: a scalar, the generated tokens before this one (the same for every row); it drives
      ``decode_every`` (after the step that makes ``step + 1`` a multiple of ``N`` the cache is
      re-compressed by :func:`recompress`, under a ``lax.cond``, so nothing retraces) and
      ThinK's slots.

  Returns:
    ``(logits [B, V], cache)``: fp32 logits and the updated cache.

  Raises:
    ValueError: when ``decode_every`` or ThinK needs ``step`` and it is ``None``, or for a cache
      held one buffer per layer under a spec that re-compresses or re-indexes.
  """
  if isinstance(cache.keys, tuple):  # one buffer per layer (per_layer)
    if spec.decode_every or spec.reindex:
      raise ValueError(
        f"cache: held one buffer per layer (cache.per_layer), which spec {spec!r} cannot decode "
        "(it re-compresses or re-indexes); expected the stacked cache"
      )
    return _decode_step_per_layer(cfg, params, spec, cache, token_B, pos_B)
  B = token_B.shape[0]
  x = llama.embed_tokens(cfg, params, token_B)[:, None, :]
  stacked = llama.stacked(params)
  slots = {"positions": cache.positions, "valid": cache.valid}
  if cache.scores is not None:
    slots["scores"] = cache.scores
  if cache.attn_sums is not None:
    slots["attn_sums"] = cache.attn_sums
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  budget_LBH = jnp.moveaxis(cache.budget, 0, 1)
  H = cache.keys.shape[2]
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
  h_idx = jnp.broadcast_to(jnp.arange(H)[None, :], (B, H))
  think = cache.new_keys is not None
  if (spec.decode_every or think) and step is None:
    raise ValueError("step: decode_every and ThinK place tokens by step count; pass the step")

  def layer(carry, inputs):
    x, keys_all, values_all, new_all = carry
    p, lslots, budget_BH, l, ch = inputs
    q, k, v = _token_qkv(cfg, spec, p, x, pos_B, l)
    lslots = dict(lslots, overflow=jnp.zeros((B,), bool))
    if think:  # generated token `step` in slot C_prompt + step, its full key in new_keys
      slot, lslots = _admit_generated(cache, lslots, pos_B, step)
      at = jnp.minimum(step, new_all.shape[3] - 1)
      new_all = new_all.at[l, :, :, at].set(k[:, :, 0].astype(new_all.dtype))
    else:
      slot, lslots = _admit(spec, lslots, budget_BH, pos_B)
      keys_all = keys_all.at[l, b_idx, h_idx, slot].set(_as_bits(k[:, :, 0].astype(kv_dtype), bits))
    layer_overflow = lslots.pop("overflow")
    values_all = values_all.at[l, b_idx, h_idx, slot].set(
      _as_bits(v[:, :, 0].astype(cache.values.dtype), bits)
    )
    visible = _visible(cfg, l, lslots, pos_B)
    if think or spec.reindex:  # these read the layer's keys whole (pruned, or rotated)
      keys, values = _as_float(keys_all[l], kv_dtype), _as_float(values_all[l], kv_dtype)
      q_att = q
      if spec.reindex:
        q_att, keys = _reindexed(cfg, q, keys, lslots["positions"], lslots["valid"], pos_B)
      if think:
        probs = _think_probs(cfg, q_att, keys, new_all[l], ch, visible)
      else:
        probs = llama.attention_probs(
          q_att, keys, visible[:, :, None, :], softcap=cfg.attn_softcap
        )  # [B, Hq, 1, C]
      out = llama.attend(probs, values)  # the query layout is the case G = Hq
    else:
      probs, out = slot_attention_of_layer(cfg, q, keys_all, values_all, l, visible, kv_dtype)
    lslots = _observed(spec, lslots, probs, H)
    carry = (llama.output_and_mlp(cfg, p, x, out), keys_all, values_all, new_all)
    return carry, (lslots, layer_overflow, q[:, :, 0] if spec.decode_every else None)

  L = cfg.num_layers
  kv_dtype = cache.keys.dtype
  bits = _carried_as_bits(kv_dtype) and cache.values.dtype == kv_dtype
  carry = (x, _as_bits(cache.keys, bits), _as_bits(cache.values, bits), cache.new_keys)
  xs = (stacked, slots, budget_LBH, jnp.arange(L), cache.channels)
  (x, keys_all, values_all, new_all), (new_slots, layer_overflow, q_LBHD) = jax.lax.scan(
    layer, carry, xs
  )
  logits = llama.logits_of(cfg, params, x)[:, 0]
  overflow = overflow | layer_overflow.any(0)
  cache = cache.replace(
    keys=_as_float(keys_all, kv_dtype),
    values=_as_float(values_all, cache.values.dtype),
    new_keys=new_all,
    overflow=overflow,
    **new_slots,
  )
  if spec.decode_every:
    cache = _remember_query(cache, q_LBHD, pos_B, step)
    cache = jax.lax.cond(
      (step + 1) % spec.decode_every == 0,
      lambda c: recompress(cfg, params, spec, c),
      lambda c: c,
      cache,
    )
  return logits, cache


def _token_qkv(cfg: ModelConfig, spec: CacheSpec, p: dict, x, pos_B, l):
  """The new token's query, key and value at layer ``l``, in the cache's layout (keys before
  RoPE for a re-indexing cache)."""
  q, k, v = llama.project_qkv(cfg, p, x, pos_B[:, None], layer=l)
  if spec.layout == "query":
    k, v = jnp.repeat(k, cfg.num_groups, 1), jnp.repeat(v, cfg.num_groups, 1)
  if spec.reindex:
    k = llama.rope_at(
      k, jnp.broadcast_to(pos_B[:, None, None], k.shape[:-1]), cfg, layer=l, inverse=True
    )
  return q, k, v


def _visible(cfg: ModelConfig, l, lslots: dict, pos_B) -> Array:
  """The slots of layer ``l`` the query at ``pos_B`` sees: the held ones, within the layer's
  window (Mistral's, or a Gemma sliding layer's) when it has one."""
  visible = lslots["valid"]
  window = llama.layer_window(cfg, l)
  if window is not None:  # keys older than the window are not attended
    visible = visible & (pos_B[:, None, None] - lslots["positions"] < window)
  return visible


def _observed(spec: CacheSpec, lslots: dict, probs, H: int) -> dict:
  """The layer's slot state after the token's attention ``probs``: a decode-time policy's scores
  (``observe``), and CaM's attention sums (the new token's own slot included: it was empty)."""
  if spec.decode_time and "scores" in lslots:
    lslots = dict(lslots, scores=spec.policy.observe(lslots["scores"], _per_cache_head(probs, H)))
  if "attn_sums" in lslots:
    lslots = dict(lslots, attn_sums=lslots["attn_sums"] + _per_cache_head(probs, H))
  return lslots


def _written(buf_BHCD: Array, slot_BH: Array, new_BHD: Array) -> Array:
  """``buf`` with each row and head's ``new`` vector in its ``slot`` (in place when ``buf`` is
  donated); a 16-bit buffer is written as its bits on CPU (:func:`_carried_as_bits`)."""
  B, H = slot_BH.shape
  bits = _carried_as_bits(buf_BHCD.dtype)
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
  h_idx = jnp.broadcast_to(jnp.arange(H)[None, :], (B, H))
  new = _as_bits(new_BHD.astype(buf_BHCD.dtype), bits)
  return _as_float(_as_bits(buf_BHCD, bits).at[b_idx, h_idx, slot_BH].set(new), buf_BHCD.dtype)


PER_LAYER_FIELDS = ("keys", "values", "positions", "valid", "scores", "attn_sums")

# the most bytes of per-layer weights and cache that per_layer copies (per configuration under
# vmap): the split holds a second copy of both while the decode loop runs, so above this a loop
# keeps the stacked step
PER_LAYER_MAX_BYTES = 4 << 30


def decodes_per_layer(spec: CacheSpec, cache: KVCache) -> bool:
  """Whether a loop of decode steps runs faster over the cache held one buffer per layer.

  On CPU it does: XLA:CPU's contractions read materialised operands, so the stacked step copies
  every block of K and V it reads, and each layer's weights, out of the ``[L, ...]`` buffers
  (``docs/benchmarks.md`` has the measurements); over one buffer per layer, unrolled, each layer
  reads its own K and V in place. Re-compressing caches (``decode_every``), ThinK's pruned keys
  and re-indexed positions keep the stacked step.

  Args:
    spec: the cache's static choices.
    cache: the stacked cache.

  Returns:
    Whether the backend and the cache allow the split; :func:`per_layer` splits where this
    holds and the copies fit in :data:`PER_LAYER_MAX_BYTES`.
  """
  return (
    jax.default_backend() == "cpu"
    and not spec.decode_every
    and not spec.reindex
    and cache.new_keys is None
    and cache.channels is None
  )


def per_layer(spec: CacheSpec, params: dict, cache: KVCache) -> tuple[dict, KVCache]:
  """The parameters and cache as a loop of decode steps reads them fastest.

  :func:`decode_step` runs over either form, to the same result up to float rounding (the
  stacked step reads a long layer in blocks); :func:`restacked` returns the cache to the
  ``[L, ...]`` form the rest of the library reads. Splitting copies the cache and the
  per-layer weights once, and both copies live while the loop runs, so above
  :data:`PER_LAYER_MAX_BYTES` of them the loop keeps the stacked form. With
  ``spec.layer_capacity``, layer ``l``'s buffers keep their first
  ``layer_capacity[l]`` slots; a row holding a token past them is flagged in ``overflow``
  (callers raise on it), never dropped silently.

  Args:
    spec: the cache's static choices.
    params: the parameter pytree.
    cache: the stacked cache (its held slots first in each row, as :func:`compress` and the
      appends leave them).

  Returns:
    ``(params, cache)``: where :func:`decodes_per_layer` and the copies fit, the parameters
    split by layer (``llama.unstacked_params``) and the cache whose ``keys``, ``values``,
    ``positions``, ``valid`` (and ``scores``, ``attn_sums`` when held) are tuples of ``L``
    per-layer arrays; otherwise both as given.

  Raises:
    ValueError: for a ``spec.layer_capacity`` without one entry in ``[1, C]`` per layer.
  """
  if isinstance(cache.keys, tuple) or not decodes_per_layer(spec, cache):
    return params, cache
  split = [getattr(cache, name) for name in PER_LAYER_FIELDS]
  copied = jax.tree.leaves([llama.stacked(params), split])
  if sum(int(np.prod(t.shape)) * jnp.dtype(t.dtype).itemsize for t in copied) > PER_LAYER_MAX_BYTES:
    return params, cache
  L, B, _, C = cache.valid.shape
  caps = spec.layer_capacity or (C,) * L
  if len(caps) != L or max(caps) > C or min(caps) < 1:
    raise ValueError(
      f"spec.layer_capacity: expected {L} layers' capacities in [1, {C}] slots, got {caps!r}"
    )
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  for l, cap in enumerate(caps):
    if cap < C:  # a held slot past the layer's capacity: flagged, never dropped silently
      overflow = overflow | cache.valid[l, :, :, cap:].any((-2, -1))

  def split(name):
    t = getattr(cache, name)
    if t is None:
      return None
    # each layer's [B, H, C, ...], its slot axis 2
    return tuple(jax.lax.slice_in_dim(t[l], 0, caps[l], axis=2) for l in range(L))

  cache = cache.replace(overflow=overflow, **{name: split(name) for name in PER_LAYER_FIELDS})
  return llama.unstacked_params(params), cache


def restacked(cache: KVCache, capacity: int | None = None) -> KVCache:
  """The cache in its stacked ``[L, ...]`` form (the inverse of :func:`per_layer`).

  Args:
    cache: a cache, stacked or held one buffer per layer.
    capacity: the slots of the stacked cache (the spec's ``capacity``), at least the longest
      layer's; ``None``: the longest layer's.

  Returns:
    The stacked cache (``cache`` itself when it is stacked); layers held with fewer slots
    (``spec.layer_capacity``) are padded with empty ones.

  Raises:
    ValueError: for a ``capacity`` below the longest layer's slots.
  """
  if not isinstance(cache.keys, tuple):
    return cache
  longest = max(t.shape[2] for t in cache.valid)
  if capacity is not None and (
    isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < longest
  ):
    raise ValueError(
      f"capacity: expected an int >= {longest} (the longest layer), got {capacity!r}"
    )
  C = longest if capacity is None else int(capacity)

  def stack(name):
    layers = getattr(cache, name)
    if layers is None:
      return None
    axis = 2  # the slot axis of [B, H, C, ...]
    widths = [[(0, 0)] * t.ndim for t in layers]
    for w, t in zip(widths, layers, strict=True):
      w[axis] = (0, C - t.shape[axis])
    return jnp.stack([jnp.pad(t, w) for t, w in zip(layers, widths, strict=True)])

  return cache.replace(**{name: stack(name) for name in PER_LAYER_FIELDS})


def _decode_step_per_layer(cfg, params, spec: CacheSpec, cache: KVCache, token_B, pos_B):
  """:func:`decode_step` over a cache held one buffer per layer (:func:`per_layer`): the layers
  unrolled, each reading its own parameters, K and V whole (:func:`layer_attention`) and
  writing the new token's K and V into its own buffers."""
  B = token_B.shape[0]
  H = cache.keys[0].shape[1]
  x = llama.embed_tokens(cfg, params, token_B)[:, None, :]
  overflow = jnp.zeros((B,), bool) if cache.overflow is None else cache.overflow
  held = [name for name in PER_LAYER_FIELDS if getattr(cache, name) is not None]
  out = {name: [] for name in held}
  for l in range(cfg.num_layers):
    p = llama.layer_params(params, l)
    q, k, v = _token_qkv(cfg, spec, p, x, pos_B, l)
    lslots = {name: getattr(cache, name)[l] for name in held if name not in ("keys", "values")}
    lslots["overflow"] = overflow
    slot, lslots = _admit(spec, lslots, cache.budget[:, l], pos_B)
    overflow = lslots.pop("overflow")
    keys = _written(cache.keys[l], slot, k[:, :, 0])
    values = _written(cache.values[l], slot, v[:, :, 0])
    probs, attn = layer_attention(cfg, q, keys, values, _visible(cfg, l, lslots, pos_B))
    lslots = _observed(spec, lslots, probs, H)
    x = llama.output_and_mlp(cfg, p, x, attn)
    for name, t in dict(lslots, keys=keys, values=values).items():
      out[name].append(t)
  logits = llama.logits_of(cfg, params, x)[:, 0]
  return logits, cache.replace(overflow=overflow, **{n: tuple(t) for n, t in out.items()})


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


def appends_only(spec: CacheSpec) -> bool:
  """Says whether decoding with ``spec`` only appends to the compressed cache.

  That is a prefill-time policy or the full cache: no decode-time eviction, no re-compression,
  no ThinK, no re-indexing, so that tokens fed one by one see exactly what
  :func:`extend_logits` feeds them at once.

  Args:
    spec: the cache's static choices.

  Returns:
    ``True`` when decoding only appends.
  """
  return not (spec.decode_time or spec.decode_every or spec.channel_ratio or spec.reindex)


# where each KVCache field holds its batch axis B (the fields are [L, B, ...] or [B, ...])
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
  (row ``k * B + b``): what a batch-wide computation such as :func:`extend` then runs over once,
  instead of vmapping over ``K``.

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


def held_kv(spec: CacheSpec, cache: KVCache) -> tuple:
  """Returns the held keys of a cache that decoding only appends to (:func:`appends_only`).

  These are the keys :func:`extend` feeds tokens after.

  Args:
    spec: the cache's static choices.
    cache: the cache.

  Returns:
    ``(keys, values, valid, positions)`` of the cache.

  Raises:
    ValueError: when decoding with ``spec`` does more than append, or the cache holds ThinK's
      generated keys.
  """
  if not appends_only(spec) or cache.new_keys is not None:
    raise ValueError(f"spec: feeding tokens at once needs a cache that only appends, got {spec}")
  return cache.keys, cache.values, cache.valid, cache.positions


def extend_logits(
  cfg: ModelConfig, params: dict, spec: CacheSpec, cache: KVCache, tokens_BM, pos_BM
):
  """Computes the logits of ``M`` tokens fed after the cache at once, without updating it.

  Each token attends to the cache's valid slots and causally to the fed tokens before it, which
  is what feeding them one by one through :func:`decode_step` gives when decoding only appends
  (:func:`appends_only`). One pass over the weights for all ``M`` tokens instead of ``M``
  passes: a decode step reads every weight to produce one row (memory-bound), this reads them
  once for ``B * M`` rows.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    spec: the cache's static choices.
    cache: the cache.
    tokens_BM: the fed tokens ``[B, M]``.
    pos_BM: the tokens' RoPE positions ``[B, M]``.

  Returns:
    fp32 logits ``[B, M, V]``.

  Raises:
    ValueError: as :func:`held_kv`.
  """
  logits, _ = extend(cfg, params, (held_kv(spec, cache),), tokens_BM, pos_BM)
  return logits


def extend(
  cfg: ModelConfig,
  params: dict,
  held: tuple,
  tokens_BM,
  pos_BM,
  *,
  probs=False,
  appended=False,
  logits_from: int = 0,
):
  """Feeds ``M`` tokens at once after keys and values held per layer and head.

  Each fed token attends to the valid held keys and causally to the fed tokens up to itself
  (Mistral's sliding window applies to both). The segments are never concatenated: each one's
  logits are formed against its own keys and its values weighted by its part of the one softmax
  over all of them, so a call reads the held cache once instead of copying it per layer (for an
  evaluation's ``K x B`` caches, gigabytes per call).

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    held: the held segments, attended in order, each ``(keys [L, B, H, C, D], values, valid
      [L, B, H, C], positions [L, B, H, C])`` with keys post-RoPE at their original positions,
      per KV head or (the query layout, ``H = Hq``) per query head.
    tokens_BM: the fed tokens ``[B, M]``, or their input embeddings ``[B, M, d]`` (HF's
      ``inputs_embeds``: RestoreKV's learned restore tokens, which no vocabulary entry holds).
    pos_BM: their RoPE positions ``[B, M]``.
    probs: whether to return the softmax over held and fed keys cut to the first segment (the
      oracle's full-cache attention of future queries).
    appended: whether to also return the fed tokens' own segment, which later tokens are fed
      after by holding it as a second segment.
    logits_from: the logits of the fed tokens from this one on only (the LM head is a fifth of a
      small model's work per token; a prefix fed for its keys needs its last token's logits
      only).

  Returns:
    ``(logits [B, M - logits_from, V], attention [L, B, Hq, M, C] over the first held segment or
    None)``; with ``appended`` a third item, the fed tokens' segment ``(keys [L, B, H, M, D],
    values, valid, positions)``.
  """
  B, M = tokens_BM.shape[:2]
  # embeddings (ndim 3) are the residual stream's input as given
  x = tokens_BM if tokens_BM.ndim == 3 else llama.embed_tokens(cfg, params, tokens_BM)
  held = tuple(held)
  repeat_kv = held[0][0].shape[2] != cfg.num_kv_heads  # the query layout: one slot table per Hq

  def layer(x, inputs):
    p, segments, l = inputs  # per held segment: [B, H, C, D] keys and values, [B, H, C] masks
    q, k, v = llama.project_qkv(cfg, p, x, pos_BM, layer=l)
    if repeat_kv:
      k, v = jnp.repeat(k, cfg.num_groups, 1), jnp.repeat(v, cfg.num_groups, 1)
    H = segments[0][0].shape[1]
    dtype = segments[0][0].dtype
    fed_pos = jnp.broadcast_to(pos_BM[:, None], (B, H, M))
    fed = (k.astype(dtype), v.astype(dtype), jnp.ones((B, H, M), bool), fed_pos)
    parts = (*segments, fed)
    # the model's own causal mask over held then fed keys, per (row, head): held slots all come
    # before the fed tokens (index -1); Mistral's window applies by position to both
    k_pos = jnp.concatenate([s[3].astype(jnp.int32) for s in parts], -1)
    k_valid = jnp.concatenate([s[2] for s in parts], -1)
    held_len = k_pos.shape[-1] - M
    k_index = jnp.concatenate(
      [jnp.full((held_len,), -1, jnp.int32), jnp.arange(M, dtype=jnp.int32)]
    )
    allowed = llama.causal_allowed(
      fed_pos.reshape(B * H, M),
      k_pos.reshape(B * H, -1),
      k_valid.reshape(B * H, -1),
      jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B * H, M)),
      jnp.broadcast_to(k_index, (B * H, held_len + M)),
      llama.layer_window(cfg, l),
    ).reshape(B, H, M, held_len + M)
    bounds = np.cumsum([0] + [s[0].shape[2] for s in parts])
    out, attn = llama.segments_attention(
      q,
      [
        (s[0], s[1], allowed[..., a:b])
        for s, a, b in zip(parts, bounds[:-1], bounds[1:], strict=True)
      ],
      probs_of_first=probs,
      softcap=cfg.attn_softcap,
    )  # attn: [B, Hq, M, C], the first segment's part of the one softmax
    x = llama.output_and_mlp(cfg, p, x, out)
    return x, (attn, fed[:2] if appended else None)

  x, (attn_LBHMC, fed) = jax.lax.scan(
    layer, x, (llama.stacked(params), held, jnp.arange(cfg.num_layers))
  )
  logits = llama.logits_of(cfg, params, x[:, logits_from:])
  if not appended:
    return logits, attn_LBHMC
  positions = held[0][3]
  L, _, H = positions.shape[:3]
  pos_LBHM = jnp.broadcast_to(pos_BM[None, :, None], (L, B, H, M)).astype(positions.dtype)
  return logits, attn_LBHMC, (*fed, jnp.ones((L, B, H, M), bool), pos_LBHM)


def _admit_generated(cache: KVCache, slots: dict, pos_B, step):
  """ThinK's admission: generated token ``step`` takes slot ``C_prompt + step`` in every row
  (flagged as overflow past the reserved slots)."""
  B, H = slots["valid"].shape[:2]
  Cp, N = cache.keys.shape[3], cache.new_keys.shape[3]
  slot = jnp.full((B, H), Cp + jnp.minimum(step, N - 1), jnp.int32)
  onehot = jax.nn.one_hot(slot, slots["valid"].shape[-1], dtype=bool)
  return slot, dict(
    slots,
    positions=jnp.where(onehot, pos_B[:, None, None], slots["positions"]),
    valid=slots["valid"] | onehot,
    overflow=slots["overflow"] | jnp.broadcast_to(step >= N, (B,)),
  )


def _remember_query(cache: KVCache, q_LBHD: Array, pos_B: Array, step) -> KVCache:
  """The step's post-RoPE queries into the ring of the last ``W`` generated ones."""
  W = cache.queries.shape[3]
  at = jnp.asarray(step, jnp.int32) % W
  queries = jax.lax.dynamic_update_index_in_dim(
    cache.queries, q_LBHD[:, :, :, None].astype(cache.queries.dtype), at, 3
  )
  query_pos = jax.lax.dynamic_update_index_in_dim(
    cache.query_pos, pos_B[:, None].astype(jnp.int32), at, 1
  )
  return cache.replace(queries=queries, query_pos=query_pos)


# --------------------------------------------------------------------------- re-compression


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


def _right_aligned(t: Array, order_LBHC: Array) -> Array:
  index = order_LBHC if t.ndim == 4 else order_LBHC[..., None]
  return jnp.take_along_axis(t, index, axis=3)


def _slot_attention(cfg, cache: KVCache, keys_LBHCD, positions_LBHC, valid_LBHC) -> Array:
  """The window of generated queries over the slots: causal by original position, fp32,
  ``[L, B, Hq, W, C]``."""
  L, B, H, C, _ = keys_LBHCD.shape
  q = cache.queries  # [L, B, Hq, W, D]
  q_pos = cache.query_pos  # [B, W]
  allowed = (
    valid_LBHC[:, :, :, None, :]
    & (positions_LBHC[:, :, :, None, :] <= q_pos[None, :, None, :, None])
    & (q_pos >= 0)[None, :, None, :, None]
  )  # [L, B, H, W, C]
  if cfg.sliding_window is not None:  # each layer's window (Mistral's every layer, Gemma's sliding)
    window_L = jnp.asarray(
      np.where(llama.is_sliding(cfg), cfg.sliding_window, llama.FULL_WINDOW), jnp.int32
    )
    behind = q_pos[None, :, None, :, None] - positions_LBHC[:, :, :, None, :]
    allowed = allowed & (behind < window_L[:, None, None, None, None])
  flat = lambda t: t.reshape((L * B,) + t.shape[2:])  # noqa: E731
  probs = llama.attention_probs(flat(q), flat(keys_LBHCD), flat(allowed), softcap=cfg.attn_softcap)
  return probs.reshape((L, B) + probs.shape[1:])


def recompress(cfg: ModelConfig, params: dict, spec: CacheSpec, cache: KVCache) -> KVCache:
  """Re-compresses the cache to its budget, as kvpress ``DecodingPress``'s compression step.

  Every (layer, row, head) keeps its ``min(decode budget, filled)`` best slots under the
  policy's :meth:`~kvjax.policies.Policy.decode_scores`, over everything it holds (prompt and
  generated tokens), as ``DecodingPress.compress`` hands the whole cache to its base press with
  the target size as budget. The decode budget is
  :meth:`~kvjax.policies.Policy.decode_budgets` of the prompt's budgets and the row's tokens
  seen (its last RoPE position + 1): the prompt's budgets for a plain policy, ``decode_budget``
  or a fraction of the tokens seen for :class:`~kvjax.policies.PrefillDecoding` and
  :class:`~kvjax.policies.RatioDecoding` (the caller sizes the capacity for it:
  :meth:`~kvjax.policies.Policy.decode_capacity`; appends past it flag overflow).

  The evidence is rebuilt over the slots in position order (right-aligned per head, so a
  scorer's protected recent window is the most recent tokens and empty slots play the part of
  left padding): keys and values as cached, CriticalKV's value norms from ``W_O``, and the
  attention of the last ``W`` generated queries (``W = min(window, decode_every)``: kvpress's
  buffer of hidden states is cleared at each compression), causal by original position. Unlike
  kvpress (which rotates every buffered query by the current token's position embedding), each
  query keeps its own RoPE position. The evidence fields and window are the
  :attr:`~kvjax.policies.Policy.decode_policy`'s; a budget-dependent last stage (CriticalKV)
  applies when the policy re-compresses with its own scorer.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    spec: the cache's static choices.
    cache: the cache, with its window of generated queries.

  Returns:
    The re-compressed :class:`KVCache`.
  """
  L, B, H, C, _ = cache.keys.shape
  fill = cache.valid.sum(-1)
  # empty slots first, then the valid prefix in position order
  order = (jnp.arange(C)[None, None, None] + fill[..., None]) % C
  keys, values = _right_aligned(cache.keys, order), _right_aligned(cache.values, order)
  positions, valid = _right_aligned(cache.positions, order), _right_aligned(cache.valid, order)
  decoder = spec.policy.decode_policy
  needs = decoder.evidence_fields
  # the window of generated queries oldest first (a ring: slot = step % W)
  chrono = jnp.argsort(cache.query_pos[0])
  win = cache.replace(
    queries=jnp.take(cache.queries, chrono, axis=3), query_pos=jnp.take(cache.query_pos, chrono, 1)
  )
  fields = {"keys_LGTD": keys, "values_LGTD": values}
  if "attn_window_LHWT" in needs:
    fields["attn_window_LHWT"] = _slot_attention(cfg, win, keys, positions, valid)
  if "value_out_norms_LHT" in needs:
    wo = llama.stacked(params)["wo"]
    fields["value_out_norms_LHT"] = jax.vmap(lambda w, v: llama.value_out_norms(cfg, {"wo": w}, v))(
      wo, values
    )
  if "window_queries_LHWD" in needs:
    fields["window_queries_LHWD"] = win.queries
  rows = {k: jnp.moveaxis(v, 1, 0) for k, v in fields.items()}
  shared = {} if cache.evidence is None else cache.evidence
  rngs = jax.random.split(jax.random.fold_in(jax.random.key(1), cache.query_pos.max()), B)

  seen_B = cache.query_pos.max(-1) + 1  # each row's tokens seen: its last RoPE position + 1
  merges = spec.policy.merges_while_decoding
  attn = _right_aligned(cache.attn_sums, order) if merges else jnp.zeros((L, B, H, C))

  def one(row, valid_HC, budget_LH, rng, seen, attn_HC, b):
    # the slots any layer and head holds: exact when every head holds the same count (a uniform prompt
    # budget, CaM), as kvpress's caches always do; empty slots play the part of left padding
    ev = policies.Evidence(rng=rng, valid_T=valid_HC.any((0, 1)), **row, **shared)
    scores = spec.policy.decode_scores(ev)
    if scores.shape[1] != H:
      scores = _to_layout(scores, H, cfg)
    if decoder is spec.policy:  # its own scorer: its budget-dependent last stage (CriticalKV)
      scores = _selection_scores(spec, ev, scores, valid_HC, budget_LH)
    else:
      scores = jnp.where(valid_HC, scores, -jnp.inf)
    count = jnp.minimum(spec.policy.decode_budgets(budget_LH, seen), valid_HC.sum(-1))
    vals = row["values_LGTD"]
    if merges:  # CaM: one kept set (the finite scores), evicted values merged into it
      scores, vals = spec.policy.decode_merge(
        vals, attn_HC, scores, valid_HC, count, row=b, seen=seen
      )
      count = jnp.minimum(count, jnp.isfinite(scores).sum(-1))
    idx, kept = select.compact(scores, count, C)
    return idx, kept, vals

  idx, kept, values = jax.vmap(one)(
    rows,
    jnp.moveaxis(valid, 1, 0),
    cache.budget,
    rngs,
    seen_B,
    jnp.moveaxis(attn, 1, 0),
    jnp.arange(B),
  )
  idx, kept, values = jnp.moveaxis(idx, 0, 1), jnp.moveaxis(kept, 0, 1), jnp.moveaxis(values, 0, 1)
  out = cache.replace(
    keys=jnp.where(kept[..., None], _right_aligned(keys, idx), 0).astype(keys.dtype),
    values=jnp.where(kept[..., None], _right_aligned(values, idx), 0).astype(cache.values.dtype),
    positions=jnp.where(kept, _right_aligned(positions, idx), 0),
    valid=kept,
  )
  if merges:
    out = out.replace(attn_sums=jnp.where(kept, _right_aligned(attn, idx), 0.0))
  return out


def _reindexed(cfg, q_BHq1D, keys_BHCD, positions_BHC, valid_BHC, pos_B):
  """StreamingLLM's pos-shift (``llama_pos_shift_attention_forward``): cached (pre-RoPE) keys are
  rotated by their rank inside the cache (0..n-1 in position order) and the query by its own
  rank ``n - 1``, so positions never exceed the cache size."""
  rank = (
    valid_BHC[:, :, None, :] & (positions_BHC[:, :, None, :] < positions_BHC[:, :, :, None])
  ).sum(-1)
  keys = llama.rope_at(keys_BHCD, rank, cfg)
  n_BH = valid_BHC.sum(-1)  # each head's cache length: the query's own rank is n - 1
  n_BHq = jnp.repeat(n_BH, q_BHq1D.shape[1] // n_BH.shape[1], axis=1)
  q_pos = (n_BHq - 1 - pos_B[:, None])[..., None]  # rotate from the true position to the rank
  return llama.rope_at(q_BHq1D, q_pos, cfg), keys


def _per_cache_head(probs_BHq1C: Array, H: int) -> Array:
  """One step's attention ``[B, Hq, 1, C]`` per cache head ``[B, H, C]``: the mean over the
  query heads reading it (the query layout, ``H = Hq``, is unchanged)."""
  B, Hq, _, C = probs_BHq1C.shape
  return probs_BHq1C[:, :, 0].reshape(B, H, Hq // H, C).mean(2)
