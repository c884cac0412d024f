"""Policies by name: scorer + protection + grouping + allocation, composed from a string.

Configs and notebooks name policies as strings (``"snapkv"``, ``"pyramidkv"``,
``"adakv_snapkv"``, ...). :func:`make` returns a frozen, hashable :class:`Policy` whose numbers
(budget, and the data-valued options) stay traced data under ``jit``/``vmap``, while the choice
of scorer is static Python (DESIGN.md: never ``lax.switch`` over policies under ``vmap``).

A policy reads an :class:`Evidence` pytree; build one from a prompt's queries/keys with
:func:`evidence_from_qk`, or fill the fields you have (the synthetic lab provides attention rows
directly). Budgets passed to a policy are per-(layer, head) ``max_capacity_prompt`` values:
a scalar, ``[L]`` or ``[L, H]``, window and sinks included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import budgets as budgets_lib
from kvjax import scores as scores_lib
from kvjax import select

Array = jax.Array


@struct.dataclass
class Evidence:
  """What a policy may observe at compression time (any field may be ``None``).

  Attributes:
    attn_window_LHWT: causal softmax rows of the last ``W`` prompt queries over all ``T`` keys.
    column_sums_LHT: attention received per key, summed over causal prompt queries (H2O).
    legacy_column_sums_LHT: the same under KVCache-Factory's legacy non-causal prefill mask.
    keys_LGTD: keys as cached (post-RoPE), for key norm.
    future_attn_LHST: attention of future queries over the ``T`` positions (oracle only).
    head_scores_LH: static head importance (HeadKV).
    rng: a PRNG key (random policy).
    values_LGTD: values as cached ``[L, G, T, D]`` (LagKV, ExpectedAttention's value norm).
    value_out_norms_LHT: CriticalKV's ``||W_O^h v_j||_1`` per query head ``h`` (``v`` repeated
      over the GQA group), fp32 ``[L, Hq, T]``, before kvpress's group mean.
    query_mean_LHD: ExpectedAttention's mean of the pre-RoPE prompt queries after the first
      ``n_sink`` (4) tokens, rotated by the average RoPE matrix over the next ``n_future`` (512)
      positions ``T .. T + n_future - 1``; fp32 ``[L, Hq, D]`` (kvpress
      ``ExpectedAttentionPress.get_query_statistics``).
    query_cov_LHDD: the matching covariance (divided by the count, not count - 1), rotated on
      both sides; fp32 ``[L, Hq, D, D]``.
    window_queries_LHWD: the last ``W`` post-RoPE prompt queries ``[L, Hq, W, D]`` (ThinK's
      channel evidence).
    qfilters_LGD: Q-Filters' filter direction per KV head ``[L, G, D]`` (score ``-<k, f>``).
    retrieval_heads_LG: DuoAttention's per-KV-head gate ``alpha`` in ``[0, 1]`` ``[L, G]``
      (1 = retrieval head, keeps everything).
    reconstruction_attn_LGT: KVzip's importance ``[L, G, T]`` fp32: max over the reconstruction
      queries (and the GQA group) of the attention they pay to each context key in the "repeat
      the context" pass (kvpress ``KVzipPress``).
    valid_T: the row's real positions, bool ``[T]`` (``None``: all of them).
    window_scores_LHT: the window rows already reduced by the policy's own
      :attr:`Spec.window_scorer` (fp32 ``[L, H, T]``, before GQA grouping), where a prefill
      formed them layer by layer and kept only the scores
      (:meth:`Policy.window_scorer`); the scorer then reads these instead of the rows.
    observation_window: ``W``, the observation queries behind ``attn_window_LHWT`` or
      ``window_scores_LHT`` (static; ``None``: the rows' own ``W``).
  """

  attn_window_LHWT: Array | None = None
  column_sums_LHT: Array | None = None
  legacy_column_sums_LHT: Array | None = None
  keys_LGTD: Array | None = None
  future_attn_LHST: Array | None = None
  head_scores_LH: Array | None = None
  rng: Array | None = None
  values_LGTD: Array | None = None
  value_out_norms_LHT: Array | None = None
  query_mean_LHD: Array | None = None
  query_cov_LHDD: Array | None = None
  window_queries_LHWD: Array | None = None
  qfilters_LGD: Array | None = None
  retrieval_heads_LG: Array | None = None
  reconstruction_attn_LGT: Array | None = None
  # the row's real positions, bool [T] (a padded batch row; None: every position): the scorers
  # that aggregate over keys (KeyDiff's anchor, R-KV, ExpectedAttention's softmax, ChunkKV's
  # chunks) skip padding
  valid_T: Array | None = None
  window_scores_LHT: Array | None = None
  observation_window: int | None = struct.field(pytree_node=False, default=None)


def evidence_from_qk(
  queries_LHTD: Array,
  keys_LGTD: Array,
  *,
  window: int = 32,
  legacy_window: int = 8,
  column_sums: bool = True,
  rng: Array | None = None,
) -> Evidence:
  """Evidence of one prompt from its post-RoPE queries ``[L, Hq, T, D]`` and keys ``[L, G, T, D]``.

  Builds the window rows (no ``T x T`` matrix) and, if ``column_sums``, the causal and legacy
  H2O column sums blockwise. ``window`` (an int ``>= 1``) is the number of observation queries,
  the whole prompt when it is shorter; ``legacy_window`` (an int ``>= 0``) is the window of
  KVCache-Factory's legacy mask.
  """
  for name, x, letters in (("queries", queries_LHTD, "LHTD"), ("keys", keys_LGTD, "LGTD")):
    if not hasattr(x, "ndim") or x.ndim != 4:
      shape = getattr(x, "shape", type(x).__name__)
      raise ValueError(f"{name}: expected a rank-4 array [{', '.join(letters)}], got {shape}")
  if (
    isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < select.INT32_LIMIT
  ):
    raise ValueError(f"window: expected an int >= 1 (observation queries), got {window!r}")
  if (
    isinstance(legacy_window, bool)
    or not isinstance(legacy_window, int)
    or not 0 <= legacy_window < select.INT32_LIMIT
  ):
    raise ValueError(f"legacy_window: expected an int >= 0, got {legacy_window!r}")
  if not isinstance(column_sums, bool):
    raise ValueError(f"column_sums: expected a bool, got {column_sums!r}")
  T = queries_LHTD.shape[2]
  attn = scores_lib.window_attention(queries_LHTD[:, :, T - min(window, T) :], keys_LGTD)
  sums = legacy = None
  if column_sums:
    sums = scores_lib.attention_column_sums(queries_LHTD, keys_LGTD, mask="causal")
    legacy = scores_lib.attention_column_sums(
      queries_LHTD, keys_LGTD, mask="kvfactory_legacy", window=legacy_window
    )
  return Evidence(
    attn_window_LHWT=attn,
    column_sums_LHT=sums,
    legacy_column_sums_LHT=legacy,
    keys_LGTD=keys_LGTD,
    rng=rng,
  )


def _need(evidence: Evidence, field: str, policy: str) -> Array:
  value = getattr(evidence, field)
  if value is None:
    raise ValueError(f"evidence: policy {policy!r} needs evidence.{field}, which is None")
  return value


# --------------------------------------------------------------------------- scorers by family


def _positions_shape(evidence: Evidence, policy: str) -> tuple[int, int, int]:
  """``(L, H, T)`` from whichever evidence is present (keys are ``[L, G, T, D]``)."""
  for field in ("attn_window_LHWT", "window_scores_LHT", "column_sums_LHT", "future_attn_LHST"):
    value = getattr(evidence, field)
    if value is not None:
      return value.shape[0], value.shape[1], value.shape[-1]
  if evidence.keys_LGTD is not None:
    return evidence.keys_LGTD.shape[:3]
  raise ValueError(
    f"evidence: policy {policy!r} needs at least one evidence field to size [L, H, T]"
  )


def _score_recency(evidence, opts):
  L, H, T = _positions_shape(evidence, "sliding_window")
  return scores_lib.recency(T, (L, H))


def _score_streaming(evidence, opts):
  L, H, T = _positions_shape(evidence, "streaming_llm")
  return scores_lib.streaming(T, (L, H), sinks=opts["sinks"])


def _from_window(rows_scorer: Callable[[Array, dict], Array]) -> Callable[[Evidence, dict], Array]:
  """A scorer that reads the window rows through ``rows_scorer`` (rows ``[., H, W, T]`` ->
  scores ``[., H, T]``, independent per leading index), or the scores a prefill already reduced
  them to (``evidence.window_scores_LHT``)."""

  def scorer(evidence, opts):
    if evidence.window_scores_LHT is not None:
      return evidence.window_scores_LHT
    return rows_scorer(_need(evidence, "attn_window_LHWT", opts["_name"]), opts)

  return scorer


def _snapkv_rows(attn_LHWT, opts):
  return scores_lib.snapkv(
    attn_LHWT,
    kernel=opts["kernel"],
    pool=opts["pool"],
    reduce=opts["reduce"],
    window=opts["window"],
  )


def _tova_rows(attn_LHWT, opts):
  return scores_lib.tova(attn_LHWT[:, :, -1, :])


_score_snapkv = _from_window(_snapkv_rows)
_score_tova = _from_window(_tova_rows)


def _score_h2o(evidence, opts):
  field = "legacy_column_sums_LHT" if opts["form"] == "kvfactory_legacy" else "column_sums_LHT"
  sums = _need(evidence, field, opts["_name"])
  return scores_lib.h2o_from_column_sums(sums, form=opts["form"], recent=opts["recent"])


def _score_knorm(evidence, opts):
  return scores_lib.knorm(_need(evidence, "keys_LGTD", opts["_name"]))


def _score_random(evidence, opts):
  L, H, T = _positions_shape(evidence, "random")
  return scores_lib.random(_need(evidence, "rng", opts["_name"]), (L, H, T))


def _score_oracle(evidence, opts):
  return scores_lib.oracle(_need(evidence, "future_attn_LHST", opts["_name"]))


def _score_cake(evidence, opts):
  attn = _need(evidence, "attn_window_LHWT", opts["_name"])
  return scores_lib.cake(attn, gamma=opts["gamma"], kernel=opts["kernel"], window=opts["window"])


def _score_keydiff(evidence, opts):
  return scores_lib.keydiff(_need(evidence, "keys_LGTD", opts["_name"]), evidence.valid_T)


def _score_lagkv(evidence, opts):
  keys = _need(evidence, "keys_LGTD", opts["_name"])
  values = _need(evidence, "values_LGTD", opts["_name"])
  return scores_lib.lagkv(keys, values, lag=opts["lag"], sinks=opts["sinks"])


def _score_expected_attention(evidence, opts):
  name = opts["_name"]
  cov = _need(evidence, "query_cov_LHDD", name) if opts["use_covariance"] else None
  values = _need(evidence, "values_LGTD", name) if opts["use_vnorm"] else None
  return scores_lib.expected_attention(
    _need(evidence, "query_mean_LHD", name),
    cov,
    _need(evidence, "keys_LGTD", name),
    values,
    sinks=opts["sinks"],
    use_covariance=opts["use_covariance"],
    use_vnorm=opts["use_vnorm"],
    epsilon=opts["epsilon"],
    valid_T=evidence.valid_T,
  )


def _score_qfilter(evidence, opts):
  keys = _need(evidence, "keys_LGTD", opts["_name"])
  return scores_lib.qfilter(keys, _need(evidence, "qfilters_LGD", opts["_name"]))


def _score_duo(evidence, opts):
  gates = _need(evidence, "retrieval_heads_LG", opts["_name"])
  T = _positions_shape(evidence, opts["_name"])[2]
  return scores_lib.streaming(T, gates.shape, sinks=opts["sinks"])


def _score_kvzip(evidence, opts):
  attn = _need(evidence, "reconstruction_attn_LGT", opts["_name"])
  return scores_lib.kvzip(attn, sinks=opts["sinks"])


def _score_rkv(evidence, opts):
  queries = _need(evidence, "window_queries_LHWD", opts["_name"])
  return scores_lib.rkv(
    queries,
    _need(evidence, "keys_LGTD", opts["_name"]),
    window=opts["window"],
    kernel=opts["kernel"],
    mix_lambda=opts["mix_lambda"],
    threshold=opts["threshold"],
    valid_T=evidence.valid_T,
  )


def _score_think(evidence, opts):
  L, H, T = _positions_shape(evidence, opts["_name"])
  return scores_lib.recency(T, (L, H))


# --------------------------------------------------------------------------- allocators


def check_budget_counts(budget):
  """A budget's token counts: integer dtype and, when concrete, in ``[0, 2**31)`` (checked before
  any cast, so ``np.int64(2**32 + 12)`` never wraps to 12). Returns numpy (concrete) or the
  tracer."""
  arr = np.asarray(budget) if select.is_concrete(budget) else budget
  if arr.dtype != object and not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"budget: expected integer token counts, got dtype {arr.dtype}")
  if select.is_concrete(arr) and arr.dtype != object and arr.size and int(arr.min()) < 0:
    raise ValueError(f"budget: expected non-negative token counts, got {int(arr.min())}")
  return select.check_counts("budget", budget)


def as_budget_LH(budget, L: int, H: int) -> Array:
  """A scalar, ``[L]`` or ``[L, H]`` budget as ``budget_LH`` int32 (``ValueError`` otherwise)."""
  budget = check_budget_counts(budget)
  if select.is_concrete(budget):
    budget = np.asarray(budget, np.int32)
  budget = jnp.asarray(budget).astype(jnp.int32)
  if budget.ndim == 1:
    budget = budget[:, None]
  try:
    return jnp.broadcast_to(budget, (L, H))
  except ValueError:
    raise ValueError(
      f"budget: shape {budget.shape} is not a scalar, [L={L}] or [L={L}, H={H}]"
    ) from None


def _window_of(evidence: Evidence, opts) -> int:
  if opts.get("window") is not None:
    return opts["window"]
  if evidence.attn_window_LHWT is None and evidence.observation_window is not None:
    return evidence.observation_window
  return _need(evidence, "attn_window_LHWT", opts["_name"]).shape[2]


def _alloc_given(evidence, scores_LHT, budget, opts):
  L, H, _ = scores_LHT.shape
  return as_budget_LH(budget, L, H)


def _alloc_pyramid(evidence, scores_LHT, budget, opts):
  L, H, T = scores_LHT.shape
  layer_L = budgets_lib.pyramid(
    L, budget, _window_of(evidence, opts), T, beta=opts["beta"], mode=opts["pyramid_mode"]
  )
  return budgets_lib.per_head(layer_L, H)


def _alloc_adakv(evidence, scores_LHT, budget, opts):
  L, H, T = scores_LHT.shape
  window = _window_of(evidence, opts)
  if opts.get("pyramid_mode"):
    budget = budgets_lib.pyramid(L, budget, window, T, beta=opts["beta"], mode=opts["pyramid_mode"])
  return budgets_lib.adakv(
    scores_LHT,
    budget,
    window,
    floor_alpha=opts["floor_alpha"],
    normalize=opts["normalize"],
    mode=opts["adakv_mode"],
  )


def _alloc_headkv(evidence, scores_LHT, budget, opts):
  head_scores = _need(evidence, "head_scores_LH", opts["_name"])
  return budgets_lib.headkv(
    head_scores,
    budget,
    _window_of(evidence, opts),
    beta=opts["beta"],
    temp=opts["temp"],
    mode=opts["headkv_mode"],
    q_len=scores_LHT.shape[-1],
  )


def _alloc_cake(evidence, scores_LHT, budget, opts):
  attn = _need(evidence, "attn_window_LHWT", opts["_name"])
  layer_L = budgets_lib.cake(attn, budget, _window_of(evidence, opts), opts["tau1"], opts["tau2"])
  return budgets_lib.per_head(layer_L, scores_LHT.shape[1])


def _heads_like(x_LG: Array, num_heads: int) -> Array:
  """A per-KV-head ``[L, G]`` table at the scores' granularity (repeated over GQA groups)."""
  G = x_LG.shape[1]
  if num_heads == G:
    return x_LG
  if num_heads % G:
    raise ValueError(f"retrieval_heads: G={G} KV heads do not divide the scores' {num_heads} heads")
  return jnp.repeat(x_LG, num_heads // G, axis=1)


def _alloc_duo(evidence, scores_LHT, budget, opts):
  """DuoAttention: retrieval heads keep all ``T``; streaming heads keep ``budget`` (its
  ``sinks`` sinks + ``budget - sinks`` recent tokens, kvpress's ``sink_size + recent_size``)."""
  L, H, T = scores_LHT.shape
  gates = _need(evidence, "retrieval_heads_LG", opts["_name"])
  streaming = scores_lib.duo_streaming_heads(gates, opts["head_compression_ratio"])
  budget_LH = as_budget_LH(budget, L, H)
  return jnp.where(_heads_like(streaming, H), budget_LH, T).astype(jnp.int32)


def _alloc_kvzip(evidence, scores_LHT, budget, opts):
  """KVzip: one pooled selection of ``L * H * budget`` over every layer and head (kvpress's
  default, ``layerwise=False``), or per layer over its heads (``layerwise=True``)."""
  L, H, T = scores_LHT.shape
  b = jnp.minimum(as_budget_LH(budget, L, H)[:, 0], T)  # a scalar budget: every row the same
  if opts["layerwise"]:
    return select.pooled_budgets(scores_LHT, b * H)
  flat = scores_LHT.reshape(1, L * H, T)
  return select.pooled_budgets(flat, b[:1] * (L * H)).reshape(L, H)


def _alloc_all(evidence, scores_LHT, budget, opts):
  """Every position of every head (``think``: ThinK prunes key channels, not tokens)."""
  L, H, T = scores_LHT.shape
  return jnp.full((L, H), T, jnp.int32)


# --------------------------------------------------------------------------- budget-dependent
# scores: CriticalKV's first stage is the top of the base scores under the budget, so the scores
# the selection ranks depend on ``budget_LH`` (traced data: one trace for every budget).


def _first_stage(scores_LHT, count_LH, capacity):
  T = scores_LHT.shape[-1]
  capacity = T if capacity is None else capacity
  count_LH = jnp.minimum(count_LH, capacity)  # a budget >= T keeps everything anyway
  return select.keep_mask(scores_LHT, count_LH, capacity=capacity)


def _stage_one_count(budget_LH, ratio, floor_one):
  count = jnp.floor(budget_LH.astype(jnp.float32) * ratio).astype(jnp.int32)
  if floor_one:  # kvpress: ``max(1, count)`` whenever the first stage is on
    count = jnp.where(jnp.asarray(ratio) > 0, jnp.maximum(count, 1), count)
  return count


def _rescore_critical(evidence, scores_LHT, budget_LH, opts, capacity):
  """CriticalKVPress: stage 1 keeps the base scores' top ``max(1, floor(r * b))`` (kvpress:
  ``max(1, int((1 - ratio) * T * r))``, the same count for ``b = (1 - ratio) T``); stage 2
  ranks the rest by ``(s + epsilon) * ||W_O v||_1``. Protected positions (``+inf``) stay in:
  kvpress pads SnapKV's window with the max + 1, which stage 2 rescales, so with a first stage
  smaller than the window kvpress can drop window tokens; kvjax never does."""
  norms = _need(evidence, "value_out_norms_LHT", opts["_name"])
  count = _stage_one_count(budget_LH, opts["first_stage_ratio"], floor_one=True)
  first = _first_stage(scores_LHT, count, capacity)
  return scores_lib.critical(scores_LHT, norms, first, epsilon=opts["epsilon"])


def _rescore_critical_adakv(evidence, scores_LHT, budget_LH, opts, capacity):
  """CriticalAdaKVPress after kvpress's Ada-KV split (``budget_LH``, which sums to ``H * b``):
  each head's safeguard top ``max(1, int(b * alpha))`` and stage-1 top ``int(r * b_h)`` are
  forced, the rest ranked by ``(s + epsilon) * ||W_O v||_1``; each head keeps its ``b_h``."""
  norms = _need(evidence, "value_out_norms_LHT", opts["_name"])
  L, H, T = scores_LHT.shape
  n_kept_L = budget_LH.sum(-1) // H  # kvpress's counts sum exactly to H * min(b, T)
  alpha = opts["floor_alpha"]
  n_safe_L = jnp.floor(n_kept_L.astype(jnp.float32) * alpha).astype(jnp.int32)
  n_safe_L = jnp.where(
    jnp.asarray(alpha) > 0, jnp.where(n_kept_L > 0, jnp.maximum(n_safe_L, 1), 0), n_safe_L
  )
  safe = _first_stage(scores_LHT, jnp.broadcast_to(n_safe_L[:, None], (L, H)), capacity)
  boosted = jnp.where(safe, jnp.inf, scores_LHT)
  count = _stage_one_count(budget_LH, opts["first_stage_ratio"], floor_one=False)
  first = _first_stage(boosted, count, capacity)
  return scores_lib.critical(boosted, norms, first, epsilon=opts["epsilon"])


# --------------------------------------------------------------------------- the registry


PREFILL, DECODE = "prefill", "decode"


@dataclasses.dataclass(frozen=True)
class Spec:
  """A registered policy: its scorer and allocator, reference defaults, and the properties that
  the lab, the sweeps and the real-model cache read instead of lists of names.

  Attributes:
    acts: ``"prefill"`` (select once after the prompt, then append, as SnapKV's code does) or
      ``"decode"`` (evict at every generated token: window, StreamingLLM, H2O, TOVA).
    windowed: protects the observation window, so a budget must exceed it.
    replay: the synthetic lab can replay it online (:mod:`kvjax.lab.online`).
    needs: the :class:`Evidence` fields the scorer reads.
    window_option: the option that holds the protected recent window (``"window"`` or H2O's
      ``"recent"``), which a sweep's ``window`` axis sets; ``None`` when there is none.
    data_options: options that stay traced data in a sweep (StreamingLLM's sink count).
    rescorer: a budget-dependent last score stage ``(evidence, scores_LHT, budget_LH, opts,
      capacity) -> scores_LHT`` applied by :meth:`Policy.selection_scores` after the
      allocation (CriticalKV's first stage); ``None`` for every budget-free scorer.
    window_scorer: ``(attn_LHWT, opts) -> scores_LHT``, the only part of the policy that reads
      the window rows, independent per layer (SnapKV's votes and pooling, TOVA's last row), so
      a prefill may reduce each layer's rows as it forms them
      (:meth:`Policy.window_scorer`); ``None`` where the rows are read otherwise (CAKE's
      allocator) or not at all.
  """

  scorer: Callable[[Evidence, dict], Array]
  allocator: Callable[[Evidence, Array, Any, dict], Array]
  defaults: dict
  doc: str
  acts: str = PREFILL
  windowed: bool = False
  replay: bool = True
  needs: tuple[str, ...] = ("attn_window_LHWT",)
  window_option: str | None = None
  data_options: tuple[str, ...] = ()
  rescorer: Callable[..., Array] | None = None
  window_scorer: Callable[[Array, dict], Array] | None = None


_SNAP = dict(kernel=7, pool="max", reduce="sum", window=None)
_SNAP_MEAN = dict(_SNAP, reduce="mean")
_GROUPING = dict(num_kv_heads=None, gqa="mean")
_NONE: tuple[str, ...] = ()
_WINDOWED = dict(windowed=True, window_option="window")
_SNAP_ROWS = dict(_WINDOWED, window_scorer=_snapkv_rows)

REGISTRY: dict[str, Spec] = {
  "sliding_window": Spec(
    _score_recency, _alloc_given, {}, "the last B tokens", acts=DECODE, needs=_NONE
  ),
  "streaming_llm": Spec(
    _score_streaming,
    _alloc_given,
    dict(sinks=4),
    "4 sinks + recent",
    acts=DECODE,
    needs=_NONE,
    data_options=("sinks",),
  ),
  "h2o": Spec(
    _score_h2o,
    _alloc_given,
    dict(form="causal", recent=8),
    "causal heavy hitters + recent 8",
    acts=DECODE,
    needs=("column_sums_LHT",),
    window_option="recent",
  ),
  "h2o_kvfactory_legacy": Spec(
    _score_h2o,
    _alloc_given,
    dict(form="kvfactory_legacy", recent=8),
    "KVCache-Factory's published H2O (non-causal prefill column sums) + window 8",
    replay=False,
    needs=("legacy_column_sums_LHT",),
    window_option="recent",
  ),
  "h2o_kvpress": Spec(
    _score_h2o,
    _alloc_given,
    dict(form="kvpress", recent=0),
    "kvpress ObservedAttentionPress",
    replay=False,
    needs=("column_sums_LHT",),
  ),
  "tova": Spec(
    _score_tova,
    _alloc_given,
    {},
    "last query's row averaged over heads",
    acts=DECODE,
    window_scorer=_tova_rows,
  ),
  "snapkv": Spec(
    _score_snapkv, _alloc_given, dict(_SNAP), "window votes, maxpool k=7", **_SNAP_ROWS
  ),
  "snapkv_kvpress": Spec(
    _score_snapkv,
    _alloc_given,
    dict(kernel=5, pool="avg", reduce="mean", window=None),
    "kvpress SnapKVPress (mean votes, avgpool k=5; add num_kv_heads for its GQA mean)",
    **_SNAP_ROWS,
  ),
  "pyramidkv": Spec(
    _score_snapkv,
    _alloc_pyramid,
    dict(_SNAP, beta=20, pyramid_mode="legacy_floor"),
    "SnapKV scores under PyramidKV's layer schedule",
    **_SNAP_ROWS,
  ),
  "adakv_snapkv": Spec(
    _score_snapkv,
    _alloc_adakv,
    dict(_SNAP_MEAN, floor_alpha=0.2, normalize=False, adakv_mode="official", pyramid_mode=None),
    "Ada-KV head-adaptive budgets over SnapKV scores",
    **_SNAP_ROWS,
  ),
  "adakv_pyramidkv": Spec(
    _score_snapkv,
    _alloc_adakv,
    dict(
      _SNAP_MEAN,
      floor_alpha=0.2,
      normalize=False,
      adakv_mode="official",
      beta=20,
      pyramid_mode="legacy_floor",
    ),
    "Ada-KV within PyramidKV's layer schedule (Ada-KV pyram_mode)",
    **_SNAP_ROWS,
  ),
  "headkv": Spec(
    _score_snapkv,
    _alloc_headkv,
    dict(_SNAP_MEAN, beta=1.5, temp=1.0, headkv_mode="official"),
    "HeadKV static head budgets over SnapKV mean votes",
    replay=False,
    needs=("attn_window_LHWT", "head_scores_LH"),
    **_SNAP_ROWS,
  ),
  "cake": Spec(
    _score_cake,
    _alloc_cake,
    dict(gamma=200.0, kernel=5, window=None, tau1=1.0, tau2=1.0),
    "CAKE layer preference budgets, mean + gamma var eviction score",
    **_WINDOWED,
  ),
  "knorm": Spec(
    _score_knorm, _alloc_given, {}, "lowest key norm", replay=True, needs=("keys_LGTD",)
  ),
  "random": Spec(_score_random, _alloc_given, {}, "uniform random scores", needs=("rng",)),
  "oracle": Spec(
    _score_oracle,
    _alloc_given,
    {},
    "future attention (upper bound)",
    needs=("future_attn_LHST",),
  ),
  # ---- issue 15 (kvpress 0.5.5 presses; R-KV from its official code)
  "keydiff": Spec(
    _score_keydiff,
    _alloc_given,
    {},
    "kvpress KeyDiffPress: keys least like the mean normalised key",
    replay=True,
    needs=("keys_LGTD",),
  ),
  "lagkv": Spec(
    _score_lagkv,
    _alloc_given,
    dict(lag=128, sinks=4),
    "kvpress LagKVPress: K/V spread against the next lag chunk, ranked inside each chunk; "
    "4 sinks and the tail chunk kept",
    replay=True,
    needs=("keys_LGTD", "values_LGTD"),
  ),
  "expected_attention": Spec(
    _score_expected_attention,
    _alloc_given,
    dict(sinks=4, use_covariance=True, use_vnorm=True, epsilon=0.0),
    "kvpress ExpectedAttentionPress: softmax of the expected logits of future queries "
    "(mean + covariance of the pre-RoPE prompt queries, averaged RoPE over the next 512 "
    "positions, computed by the model), times ||v||; 4 sinks kept",
    replay=False,
    needs=("query_mean_LHD", "query_cov_LHDD", "keys_LGTD", "values_LGTD"),
  ),
  "qfilter": Spec(
    _score_qfilter,
    _alloc_given,
    {},
    "kvpress QFilterPress: -<k, f> with the calibrated Q-Filter direction f per KV head",
    replay=False,
    needs=("keys_LGTD", "qfilters_LGD"),
  ),
  "duo_attention": Spec(
    _score_duo,
    _alloc_duo,
    dict(sinks=128, head_compression_ratio=0.5),
    "kvpress DuoAttentionPress: the lowest round(L*G*head_compression_ratio) gates are streaming "
    "heads keeping `sinks` sinks + (budget - sinks) recent tokens (kvpress sink_size + "
    "recent_size = the budget: 128 + 256 = 384 in the official patterns); retrieval heads keep "
    "everything; head_compression_ratio 0.5 (kvpress's default 0.0 streams no head)",
    replay=False,
    needs=("retrieval_heads_LG", "keys_LGTD"),
    data_options=("sinks",),
  ),
  "kvzip": Spec(
    _score_kvzip,
    _alloc_kvzip,
    dict(sinks=4, layerwise=False),
    "kvpress KVzipPress: max attention of the context-reconstruction queries, 4 sinks kept, one "
    "pooled selection of L*H*budget across all layers and heads (layerwise=True: per layer)",
    replay=False,
    needs=("reconstruction_attn_LGT",),
  ),
  "think": Spec(
    _score_think,
    _alloc_all,
    dict(channel_ratio=0.5),
    "kvpress ThinKPress alone: every token kept, the int(D*channel_ratio) least important key "
    "channels pruned (give any policy channel_ratio to compose it with a token policy)",
    replay=False,
    needs=("window_queries_LHWD", "keys_LGTD"),
  ),
  "rkv": Spec(
    _score_rkv,
    _alloc_given,
    dict(window=8, kernel=7, mix_lambda=0.07, threshold=0.5, decode_every=128),
    "R-KV (official code): 0.07 * pooled window attention - 0.93 * key-cosine redundancy, "
    "window 8 kept; re-compresses every 128 generated tokens",
    acts=DECODE,
    replay=False,
    needs=("window_queries_LHWD", "keys_LGTD"),
    **_WINDOWED,
  ),
}


# --------------------------------------------------------------------------- wrappers of any base
# ``critical_<base>``, ``critical_adakv_<base>``, ``chunkkv_<base>`` and ``think_<base>`` wrap any
# registered prefill scorer (kvpress's CriticalKVPress / CriticalAdaKVPress / ChunkKVPress take any
# ScorerPress); the named instances are registered below, the rest resolve on demand.

_CRITICAL = dict(epsilon=1e-4, first_stage_ratio=0.5)


def _adakv_kvpress_allocator(windowed: bool):
  """kvpress's Ada-KV split (:func:`kvjax.budgets.adakv`, ``mode="kvpress"``); a windowed base's
  window only bounds the budget from below (its protection is in the scores)."""

  def allocate(evidence, scores_LHT, budget, opts):
    window = _window_of(evidence, opts) if windowed else 0
    return budgets_lib.adakv(
      scores_LHT, budget, window, floor_alpha=opts["floor_alpha"], mode="kvpress"
    )

  return allocate


def _grouped(scores_LHT, opts):
  kv = opts["num_kv_heads"]
  if kv is not None and scores_LHT.shape[1] != kv:
    return scores_lib.group(scores_LHT, kv, opts["gqa"])
  return scores_LHT


def _base_of(name: str, prefix: str) -> Spec:
  base_name = name[len(prefix) :]
  base = REGISTRY.get(base_name) or _WRAPPED.get(base_name)
  if base is None:
    raise ValueError(
      f"name: {name!r} wraps an unknown policy {base_name!r}; expected {prefix}<one of {names()}>"
    )
  if base.acts != PREFILL or base.rescorer is not None:
    raise ValueError(
      f"name: {name!r} wraps {base_name!r}, which is not a budget-free prefill scorer; "
      f"expected {prefix}<a prefill scorer such as snapkv>"
    )
  return base


def _critical_spec(name: str) -> Spec:
  base = _base_of(name, "critical_")
  return dataclasses.replace(
    base,
    defaults=dict(base.defaults, **_CRITICAL),
    doc=f"kvpress CriticalKVPress over {base.doc}",
    replay=False,
    needs=base.needs + ("value_out_norms_LHT",),
    rescorer=_rescore_critical,
  )


def _critical_adakv_spec(name: str) -> Spec:
  base = _base_of(name, "critical_adakv_")
  if base.allocator is not _alloc_given:
    raise ValueError(f"name: {name!r}: Ada-KV's split needs a base that takes its budget as given")
  return dataclasses.replace(
    base,
    allocator=_adakv_kvpress_allocator(base.windowed),
    defaults=dict(base.defaults, floor_alpha=0.2, **_CRITICAL),
    doc=f"kvpress CriticalAdaKVPress (Ada-KV kvpress split, alpha 0.2) over {base.doc}",
    replay=False,
    needs=base.needs + ("value_out_norms_LHT",),
    rescorer=_rescore_critical_adakv,
  )


def _chunkkv_spec(name: str) -> Spec:
  base = _base_of(name, "chunkkv_")
  if base.allocator is not _alloc_given:
    raise ValueError(
      f"name: {name!r}: ChunkKV shares one kept set across heads; expected a base "
      "that takes its budget as given"
    )
  base_scorer = base.scorer

  def scorer(evidence, opts):
    scores = _grouped(base_scorer(evidence, opts), opts)
    return scores_lib.chunkkv(scores, chunk=opts["chunk"], valid_T=evidence.valid_T)

  return dataclasses.replace(
    base,
    scorer=scorer,
    defaults=dict(base.defaults, chunk=20),
    doc=f"kvpress ChunkKVPress (chunks of 20) over {base.doc}",
    windowed=False,  # the window's chunk competes like any other (kvpress pads it max + 1)
  )


def _think_spec(name: str) -> Spec:
  base = _base_of(name, "think_")
  return dataclasses.replace(
    base,
    defaults=dict(base.defaults, channel_ratio=0.5),
    doc=f"{base.doc}, with ThinK key-channel pruning (channel_ratio 0.5)",
    replay=False,
    needs=base.needs + ("window_queries_LHWD",),
  )


_WRAPPERS = (
  ("critical_adakv_", _critical_adakv_spec),
  ("critical_", _critical_spec),
  ("chunkkv_", _chunkkv_spec),
  ("think_", _think_spec),
)
_WRAPPED: dict[str, Spec] = {}


def _resolve(name: str) -> Spec | None:
  for prefix, build in _WRAPPERS:
    if name.startswith(prefix) and len(name) > len(prefix):
      return build(name)
  return None


for _name in ("critical_snapkv", "critical_adakv_snapkv", "chunkkv_snapkv"):
  REGISTRY[_name] = _resolve(_name)


def names() -> tuple[str, ...]:
  """All registered policy names (wrappers of other bases, such as ``critical_knorm``, resolve on
  demand and are not listed)."""
  return tuple(REGISTRY)


def spec(name: str) -> Spec:
  """The registry entry of policy ``name`` (``ValueError`` for an unknown name).

  Besides the registered names, ``critical_<base>``, ``critical_adakv_<base>``,
  ``chunkkv_<base>`` and ``think_<base>`` wrap any registered prefill scorer ``<base>``.
  """
  if name in REGISTRY:
    return REGISTRY[name]
  if name not in _WRAPPED and isinstance(name, str):
    wrapped = _resolve(name)
    if wrapped is not None:
      _WRAPPED[name] = wrapped
  if name not in _WRAPPED:
    raise ValueError(f"name: unknown policy {name!r}; expected one of {names()}")
  return _WRAPPED[name]


def acts_at_decode(name: str) -> bool:
  """Whether policy ``name`` evicts as it decodes (else it selects once after the prompt)."""
  return spec(name).acts == DECODE


def allocates(name: str) -> bool:
  """Whether policy ``name`` turns a total budget into its own ``budget_LH`` (PyramidKV, Ada-KV,
  HeadKV, CAKE, DuoAttention, KVzip), rather than taking the budget as given."""
  return spec(name).allocator is not _alloc_given


def rescores(name: str) -> bool:
  """Whether policy ``name``'s selection scores depend on the budget (CriticalKV): callers that
  select themselves must pass the scores through :meth:`Policy.selection_scores`."""
  return spec(name).rescorer is not None


def replayable() -> tuple[str, ...]:
  """The policies the synthetic lab can replay online."""
  return tuple(n for n, s in REGISTRY.items() if s.replay)


def accepted_options(name: str, *, window=None, **candidates) -> dict:
  """Of ``candidates`` (and the protected ``window``), the options that policy ``name`` takes:
  what a sweep's static axes become for that policy. ``window`` goes to the policy's
  :attr:`Spec.window_option` when it has one."""
  entry = spec(name)
  out = {k: v for k, v in candidates.items() if k in entry.defaults}
  if window is not None and entry.window_option is not None:
    out[entry.window_option] = window
  return out


@dataclasses.dataclass(frozen=True)
class Policy:
  """A named policy with frozen options; pure methods, safe to close over in ``jit``."""

  name: str
  options: tuple[tuple[str, Any], ...]

  @property
  def opts(self) -> dict:
    return dict(self.options, _name=self.name)

  def scores(self, evidence: Evidence) -> Array:
    """Evidence -> ``scores_LHT`` (grouped to KV heads when ``num_kv_heads`` is set)."""
    opts = self.opts
    return _grouped(spec(self.name).scorer(evidence, opts), opts)

  def window_scorer(self) -> WindowScorer | None:
    """This policy's scores from one layer's window rows (``[B, H, W, T]`` -> ``[B, H, T]``), a
    hashable callable to give a prefill (``kvjax.model.llama.prefill(window_scores=...)``) so
    that it keeps the scores instead of the rows; ``None`` when the policy reads the rows
    otherwise (:attr:`Spec.window_scorer`)."""
    return WindowScorer(self) if spec(self.name).window_scorer is not None else None

  def selection_scores(
    self, evidence: Evidence, scores_LHT: Array, budget_LH: Array, *, capacity: int | None = None
  ) -> Array:
    """The scores the selection ranks under ``budget_LH`` (this policy's :meth:`budgets`): the
    budget-dependent last stage of CriticalKV / CriticalAdaKV, ``scores_LHT`` itself for every
    other policy. ``budget_LH`` stays traced data (one trace for every budget); ``capacity`` is
    the selection's static capacity (default ``T``)."""
    rescorer = spec(self.name).rescorer
    if rescorer is None:
      return scores_LHT
    return rescorer(evidence, scores_LHT, budget_LH, self.opts, capacity)

  def budgets(self, evidence: Evidence, scores_LHT: Array, budget) -> Array:
    """Total budget (scalar, ``[L]`` or ``[L, H]``) -> ``budget_LH`` int32 under this allocator.

    A concrete budget must keep something: ``>= 1``, and for a windowed policy
    (:attr:`Spec.windowed`) ``>= window + 1``, since the protected window counts inside the budget
    (``ValueError`` otherwise, instead of keeping fewer than the protected tokens or nothing).
    """
    self._check_budget(evidence, scores_LHT, budget)
    return spec(self.name).allocator(evidence, scores_LHT, budget, self.opts)

  def _check_budget(self, evidence: Evidence, scores_LHT: Array, budget) -> None:
    as_budget_LH(budget, *scores_LHT.shape[:2])  # dtype, int32 range and shape
    allocator = spec(self.name).allocator
    if allocator is not _alloc_given:
      # an allocator turns one per-head budget into its own table; Ada-KV alone also takes a
      # per-layer budget (its pyram_mode input)
      ndim = 1 if allocator is _alloc_adakv and not self.opts.get("pyramid_mode") else 0
      if np.ndim(budget) > ndim:
        expected = "a scalar or [L]" if ndim else "a scalar"
        raise ValueError(
          f"budget: policy {self.name!r} allocates its own budget_LH from one per-head budget; "
          f"expected {expected}, got shape {np.shape(budget)}"
        )
    if not select.is_concrete(budget) or not np.size(budget):
      return
    low = int(np.min(budget))
    if low < 1:
      raise ValueError(
        f"budget: {low} keeps nothing; expected a budget >= 1 for policy {self.name!r}"
      )
    T = scores_LHT.shape[-1]
    if allocator is _alloc_all and low < T:
      raise ValueError(
        f"budget: {low} < T={T}, but policy {self.name!r} keeps every token (ThinK prunes key "
        "channels, not tokens); expected budget >= T, or channel_ratio on a token policy, "
        "e.g. make('snapkv', channel_ratio=0.5)"
      )
    if spec(self.name).windowed:
      window = _window_of(evidence, self.opts)
      if low < window + 1:
        raise ValueError(
          f"budget: {low} does not exceed the protected window {window} of policy "
          f"{self.name!r}; expected budget >= window + 1 = {window + 1}"
        )

  def keep_mask(self, evidence: Evidence, budget, *, capacity: int | None = None) -> Array:
    """Kept positions ``[L, H, T]`` bool."""
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.keep_mask(scores_LHT, budget_LH, capacity=capacity)

  def compact(self, evidence: Evidence, budget, capacity: int) -> tuple[Array, Array]:
    """Kept positions as ``(idx_LHC, valid_LHC)`` for a real cache of capacity ``C``."""
    scores_LHT = self.scores(evidence)
    budget_LH = self.budgets(evidence, scores_LHT, budget)
    scores_LHT = self.selection_scores(evidence, scores_LHT, budget_LH, capacity=capacity)
    return select.compact(scores_LHT, budget_LH, capacity)


@dataclasses.dataclass(frozen=True)
class WindowScorer:
  """:attr:`Spec.window_scorer` bound to a policy's options; equal (and hashing equal) for equal
  policies, so a jitted prefill that takes it as a static argument compiles once per policy."""

  policy: Policy

  def __call__(self, attn_LHWT: Array) -> Array:
    return spec(self.policy.name).window_scorer(attn_LHWT, self.policy.opts)


def make(name: str, **options) -> Policy:
  """The policy ``name`` with ``options`` overriding its reference defaults.

  Every policy also accepts ``num_kv_heads`` (group query-head scores to KV heads; default
  ``None`` keeps the query-head granularity of the published tables), ``gqa``
  (``"mean"``/``"max"``/``"sum"``) and ``channel_ratio`` (ThinK: prune the
  ``int(D * channel_ratio)`` least important key channels of the kept keys, a float in
  ``[0, 1)``; ``None`` = off; applied by the model cache). Every prefill policy also accepts
  ``decode_every`` (kvpress ``DecodingPress``: re-compress the cache to the budget every ``N``
  generated tokens, an int ``>= 1``; ``None`` = select once after the prompt; applied by the
  model's decoding loop).
  """
  allowed = dict(_common_options(spec(name)), **spec(name).defaults)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(
      f"options: {unknown} are not options of policy {name!r}; expected some of {sorted(allowed)}"
    )
  merged = dict(allowed, **options)
  _validate(name, merged)
  return Policy(name, tuple(sorted(merged.items())))


def _common_options(entry: Spec) -> dict:
  out = dict(_GROUPING, channel_ratio=None)
  if entry.acts == PREFILL or "decode_every" in entry.defaults:
    out["decode_every"] = None
  return out


def _check_bool(key: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{key}: expected a bool, got {value!r}")


def _check_int_option(key: str, value, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or not low <= value < select.INT32_LIMIT:
    raise ValueError(f"{key}: expected an int >= {low}, got {value!r}")


def _validate(name: str, opts: dict) -> None:
  """Static options are checked at construction, before any jit."""
  if "kernel" in opts:
    scores_lib.check_kernel(opts["kernel"])
  for key, choices in (
    ("pool", scores_lib.POOLS),
    ("reduce", scores_lib.REDUCES),
    ("gqa", scores_lib.GROUPINGS),
    ("form", scores_lib.H2O_FORMS),
    ("adakv_mode", budgets_lib.ADAKV_MODES),
    ("headkv_mode", budgets_lib.HEADKV_MODES),
  ):
    if key in opts and opts[key] not in choices:
      raise ValueError(
        f"{key}: unknown value {opts[key]!r} for {name!r}; expected one of {choices}"
      )
  if opts.get("pyramid_mode") not in (None, *budgets_lib.PYRAMID_MODES):
    raise ValueError(
      f"pyramid_mode: unknown value {opts['pyramid_mode']!r}; expected one of "
      f"{budgets_lib.PYRAMID_MODES}"
    )
  kv = opts.get("num_kv_heads")
  if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
    raise ValueError(f"num_kv_heads: expected a positive int or None, got {kv!r}")
  window = opts.get("window")
  if window is not None and (
    isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < select.INT32_LIMIT
  ):
    raise ValueError(f"window: expected None or an int >= 1 for {name!r}, got {window!r}")
  for key in ("sinks", "recent"):  # ints, or traced int data (a sweep's sink count)
    if opts.get(key) is not None:
      scores_lib.check_count(key, opts[key])
  if "normalize" in opts and not isinstance(opts["normalize"], bool):
    raise ValueError(f"normalize: expected a bool, got {opts['normalize']!r}")
  for key in ("use_covariance", "use_vnorm", "layerwise"):
    if key in opts:
      _check_bool(key, opts[key])
  for key, low in (("lag", 1), ("chunk", 1)):
    if key in opts:
      _check_int_option(key, opts[key], low)
  if opts.get("decode_every") is not None:
    _check_int_option("decode_every", opts["decode_every"], 1)
  if opts.get("channel_ratio") is not None:
    budgets_lib.check_real("channel_ratio", opts["channel_ratio"], low=0.0, high=1.0)
    if opts["channel_ratio"] >= 1:
      raise ValueError(
        f"channel_ratio: expected a fraction of key channels in [0, 1), got {opts['channel_ratio']!r}"
      )
  reals = {
    "floor_alpha": dict(low=0.0, high=1.0),
    "temp": dict(low=0.0, strict=True),
    "gamma": dict(low=0.0),
    "tau1": dict(low=0.0, strict=True),
    "tau2": dict(low=0.0, strict=True),
    # PyramidKV's schedule needs beta >= 1; HeadKV's pool (b // beta) needs beta > 1
    "beta": dict(low=1.0, strict=spec(name).allocator is _alloc_headkv),
    "epsilon": dict(low=0.0),
    "first_stage_ratio": dict(low=0.0, high=1.0),
    "head_compression_ratio": dict(low=0.0, high=1.0),
    "mix_lambda": dict(low=0.0, high=1.0),
    "threshold": dict(low=-1.0, high=1.0),
  }
  for key, bounds in reals.items():
    if key in opts:
      budgets_lib.check_real(key, opts[key], **bounds)
