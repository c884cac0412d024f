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
  for field in ("attn_window_LHWT", "column_sums_LHT", "future_attn_LHST"):
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


def _score_snapkv(evidence, opts):
  attn = _need(evidence, "attn_window_LHWT", opts["_name"])
  return scores_lib.snapkv(
    attn, kernel=opts["kernel"], pool=opts["pool"], reduce=opts["reduce"], window=opts["window"]
  )


def _score_h2o(evidence, opts):
  field = "legacy_column_sums_LHT" if opts["form"] == "kvfactory_legacy" else "column_sums_LHT"
  sums = _need(evidence, field, opts["_name"])
  return scores_lib.h2o_from_column_sums(sums, form=opts["form"], recent=opts["recent"])


def _score_tova(evidence, opts):
  attn = _need(evidence, "attn_window_LHWT", opts["_name"])
  return scores_lib.tova(attn[:, :, -1, :])


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


_SNAP = dict(kernel=7, pool="max", reduce="sum", window=None)
_SNAP_MEAN = dict(_SNAP, reduce="mean")
_GROUPING = dict(num_kv_heads=None, gqa="mean")
_NONE: tuple[str, ...] = ()
_WINDOWED = dict(windowed=True, window_option="window")

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
  "tova": Spec(_score_tova, _alloc_given, {}, "last query's row averaged over heads", acts=DECODE),
  "snapkv": Spec(
    _score_snapkv, _alloc_given, dict(_SNAP), "window votes, maxpool k=7", **_WINDOWED
  ),
  "snapkv_kvpress": Spec(
    _score_snapkv,
    _alloc_given,
    dict(kernel=5, pool="avg", reduce="mean", window=None),
    "kvpress SnapKVPress (mean votes, avgpool k=5; add num_kv_heads for its GQA mean)",
    **_WINDOWED,
  ),
  "pyramidkv": Spec(
    _score_snapkv,
    _alloc_pyramid,
    dict(_SNAP, beta=20, pyramid_mode="legacy_floor"),
    "SnapKV scores under PyramidKV's layer schedule",
    **_WINDOWED,
  ),
  "adakv_snapkv": Spec(
    _score_snapkv,
    _alloc_adakv,
    dict(_SNAP_MEAN, floor_alpha=0.2, normalize=False, adakv_mode="official", pyramid_mode=None),
    "Ada-KV head-adaptive budgets over SnapKV scores",
    **_WINDOWED,
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
    **_WINDOWED,
  ),
  "headkv": Spec(
    _score_snapkv,
    _alloc_headkv,
    dict(_SNAP_MEAN, beta=1.5, temp=1.0, headkv_mode="official"),
    "HeadKV static head budgets over SnapKV mean votes",
    replay=False,
    needs=("attn_window_LHWT", "head_scores_LH"),
    **_WINDOWED,
  ),
  "cake": Spec(
    _score_cake,
    _alloc_cake,
    dict(gamma=200.0, kernel=5, window=None, tau1=1.0, tau2=1.0),
    "CAKE layer preference budgets, mean + gamma var eviction score",
    **_WINDOWED,
  ),
  "knorm": Spec(
    _score_knorm, _alloc_given, {}, "lowest key norm", replay=False, needs=("keys_LGTD",)
  ),
  "random": Spec(_score_random, _alloc_given, {}, "uniform random scores", needs=("rng",)),
  "oracle": Spec(
    _score_oracle,
    _alloc_given,
    {},
    "future attention (upper bound)",
    needs=("future_attn_LHST",),
  ),
}


def names() -> tuple[str, ...]:
  """All registered policy names."""
  return tuple(REGISTRY)


def spec(name: str) -> Spec:
  """The registry entry of policy ``name`` (``ValueError`` for an unknown name)."""
  if name not in REGISTRY:
    raise ValueError(f"name: unknown policy {name!r}; expected one of {names()}")
  return REGISTRY[name]


def acts_at_decode(name: str) -> bool:
  """Whether policy ``name`` evicts as it decodes (else it selects once after the prompt)."""
  return spec(name).acts == DECODE


def allocates(name: str) -> bool:
  """Whether policy ``name`` turns a total budget into its own ``budget_LH`` (PyramidKV, Ada-KV,
  HeadKV, CAKE), rather than taking the budget as given."""
  return spec(name).allocator is not _alloc_given


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
    scores_LHT = REGISTRY[self.name].scorer(evidence, opts)
    if opts["num_kv_heads"] is not None and scores_LHT.shape[1] != opts["num_kv_heads"]:
      scores_LHT = scores_lib.group(scores_LHT, opts["num_kv_heads"], opts["gqa"])
    return scores_LHT

  def budgets(self, evidence: Evidence, scores_LHT: Array, budget) -> Array:
    """Total budget (scalar, ``[L]`` or ``[L, H]``) -> ``budget_LH`` int32 under this allocator.

    A concrete budget must keep something: ``>= 1``, and for a windowed policy
    (:attr:`Spec.windowed`) ``>= window + 1``, since the protected window counts inside the budget
    (``ValueError`` otherwise, instead of keeping fewer than the protected tokens or nothing).
    """
    self._check_budget(evidence, scores_LHT, budget)
    return REGISTRY[self.name].allocator(evidence, scores_LHT, budget, self.opts)

  def _check_budget(self, evidence: Evidence, scores_LHT: Array, budget) -> None:
    as_budget_LH(budget, *scores_LHT.shape[:2])  # dtype, int32 range and shape
    allocator = REGISTRY[self.name].allocator
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
    if REGISTRY[self.name].windowed:
      window = _window_of(evidence, self.opts)
      if low < window + 1:
        raise ValueError(
          f"budget: {low} does not exceed the protected window {window} of policy "
          f"{self.name!r}; expected budget >= window + 1 = {window + 1}"
        )

  def keep_mask(self, evidence: Evidence, budget, *, capacity: int | None = None) -> Array:
    """Kept positions ``[L, H, T]`` bool."""
    scores_LHT = self.scores(evidence)
    return select.keep_mask(
      scores_LHT, self.budgets(evidence, scores_LHT, budget), capacity=capacity
    )

  def compact(self, evidence: Evidence, budget, capacity: int) -> tuple[Array, Array]:
    """Kept positions as ``(idx_LHC, valid_LHC)`` for a real cache of capacity ``C``."""
    scores_LHT = self.scores(evidence)
    return select.compact(scores_LHT, self.budgets(evidence, scores_LHT, budget), capacity)


def make(name: str, **options) -> Policy:
  """The policy ``name`` with ``options`` overriding its reference defaults.

  Every policy also accepts ``num_kv_heads`` (group query-head scores to KV heads; default
  ``None`` keeps the query-head granularity of the published tables) and ``gqa``
  (``"mean"``/``"max"``/``"sum"``).
  """
  allowed = dict(spec(name).defaults, **_GROUPING)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(
      f"options: {unknown} are not options of policy {name!r}; expected some of {sorted(allowed)}"
    )
  merged = dict(allowed, **options)
  _validate(name, merged)
  return Policy(name, tuple(sorted(merged.items())))


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
  reals = {
    "floor_alpha": dict(low=0.0, high=1.0),
    "temp": dict(low=0.0, strict=True),
    "gamma": dict(low=0.0),
    "tau1": dict(low=0.0, strict=True),
    "tau2": dict(low=0.0, strict=True),
    # PyramidKV's schedule needs beta >= 1; HeadKV's pool (b // beta) needs beta > 1
    "beta": dict(low=1.0, strict=spec(name).allocator is _alloc_headkv),
  }
  for key, bounds in reals.items():
    if key in opts:
      budgets_lib.check_real(key, opts[key], **bounds)
