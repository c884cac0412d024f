"""What a policy may observe (:class:`Evidence`) and what it asks a prefill to compute
(:class:`EvidenceRequest`).

A policy reads an :class:`Evidence` pytree; build one from a prompt's queries and keys with
:func:`evidence_from_qk`, fill the fields you have (the synthetic lab provides attention rows
directly), or let a model's prefill compute what :meth:`kvjax.policies.Policy.evidence_request`
asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import scores as scores_lib
from kvjax import select

Array = jax.Array

DEFAULT_WINDOW = 32  # observation queries when a policy sets none (SnapKV's window_size)
N_SINK, N_FUTURE = 4, 512  # kvpress ExpectedAttentionPress's n_sink and n_future_positions


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
    reconstruction_attn_LHT: KVCompose's evidence ``[L, Hq, T]`` fp32, per query head: max over
      the queries of a second pass that reads the context again after itself (plain causal
      attention) of the attention each context key receives (kvpress ``KVComposePress``;
      :func:`kvjax.model.calibrate.kvcompose_evidence`).
    prerope_keys_LGTD: keys before RoPE ``[L, G, T, D]`` (after Qwen3's k-norm; kvpress
      ``get_prerope_key_states``), for the leverage scores.
    queries_LHTD: the post-RoPE queries of every prompt position ``[L, Hq, T, D]`` (non-causal
      attention).
    sketch_LGDK: standard normal draws for a randomised sketch, ``[L, G, D, K]`` (``G`` may be
      1: one draw per layer shared by its heads); ``None``: the policy draws its own from its
      ``seed`` option.
    valid_T: the row's real positions, bool ``[T]`` (``None``: all of them).
    window_scores_LHT: the window rows already reduced by the policy's own
      :meth:`~kvjax.policies.WindowPolicy.score_rows` (fp32 ``[L, H, T]``, before GQA
      grouping), where a prefill formed them layer by layer and kept only the scores; the
      scorer then reads these instead of the rows.
    observation_window: ``W``, the observation queries behind ``attn_window_LHWT`` or
      ``window_scores_LHT`` (static; ``None``: the rows' own ``W``).
    kvgrad_LGT: KVgrad's attribution ``[L, G, T]`` fp32: max over the reconstruction queries
      ``p`` (and the GQA group) of KVzip's reconstruction attention times ``||W_O v||_2`` times
      ``||d Phi / d a_p||_2`` (``Phi = sum_p ||h^L_p||^2``, ``a_p`` the layer's attention
      output) in the "repeat the context" pass (kvpress ``KVgradPress``;
      :func:`kvjax.model.kvgrad.kvgrad_evidence`).
    kvzap_LGT: KVzap's surrogate scores ``[L, G, T]`` fp32: a trained per-layer model applied to
      each position's attention input (kvpress ``KVzapPress``;
      :func:`kvjax.model.kvzap.kvzap_evidence`).
    fastkvzip_LGT: Fast KVzip's gate scores ``[L, G, T]`` fp32: trained per-layer gates applied
      to each position's attention input (kvpress ``FastKVzipPress``;
      :func:`kvjax.model.fastkvzip.fastkvzip_evidence`).
    stats_query_mean_LHD: pre-RoPE query means measured on a corpus ``[L, Hq, D]`` fp32
      (kvpress ``ExpectedAttentionStatsPress``; :func:`kvjax.model.calibrate.query_stats`); the
      model's cache rotates them into ``query_mean_LHD`` for each row.
    stats_query_cov_LHDD: the matching covariances ``[L, Hq, D, D]`` (divided by ``N - 1``).
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
  prerope_keys_LGTD: Array | None = None
  queries_LHTD: Array | None = None
  sketch_LGDK: Array | None = None
  # the row's real positions, bool [T] (a padded batch row; None: every position): the scorers
  # that aggregate over keys (KeyDiff's anchor, R-KV, ExpectedAttention's softmax, ChunkKV's
  # chunks) skip padding
  valid_T: Array | None = None
  window_scores_LHT: Array | None = None
  observation_window: int | None = struct.field(pytree_node=False, default=None)
  reconstruction_attn_LHT: Array | None = None
  kvgrad_LGT: Array | None = None
  kvzap_LGT: Array | None = None
  fastkvzip_LGT: Array | None = None
  stats_query_mean_LHD: Array | None = None
  stats_query_cov_LHDD: Array | None = None

  def need(self, field: str, policy: str) -> Array:
    """Reads a field that the policy needs.

    Args:
      field: the field's name.
      policy: the policy's label, named in the error.

    Returns:
      The field's value.

    Raises:
      ValueError: the field is ``None``.
    """
    value = getattr(self, field)
    if value is None:
      raise ValueError(f"evidence: policy {policy!r} needs evidence.{field}, which is None")
    return value

  def positions_shape(self, policy: str) -> tuple[int, int, int]:
    """``(L, H, T)`` from whichever evidence is present.

    Keys are ``[L, G, T, D]``, so from keys alone ``H`` is ``G``.

    Args:
      policy: the policy's label, named in the error.

    Returns:
      ``(L, H, T)``.

    Raises:
      ValueError: no field sizes ``[L, H, T]``.
    """
    for field in ("attn_window_LHWT", "window_scores_LHT", "column_sums_LHT", "future_attn_LHST"):
      value = getattr(self, field)
      if value is not None:
        return value.shape[0], value.shape[1], value.shape[-1]
    if self.keys_LGTD is not None:
      return self.keys_LGTD.shape[:3]
    raise ValueError(
      f"evidence: policy {policy!r} needs at least one evidence field to size [L, H, T]"
    )

  def rolled(self, shift) -> Evidence:
    """Every per-position field rolled by ``shift`` (traced) along its key axis.

    A left-padded row with its padding moved to the end, for scorers that count from the first
    real token.

    Args:
      shift: the roll, an int or traced int (negative: towards the front).

    Returns:
      The rolled :class:`Evidence` (the other fields unchanged).
    """
    fields = {
      k: jnp.roll(getattr(self, k), shift, axis=a)
      for k, a in KEY_AXIS.items()
      if getattr(self, k) is not None
    }
    return self.replace(**fields)


# the key axis of each per-position evidence field
KEY_AXIS = {
  "attn_window_LHWT": -1,
  "window_scores_LHT": -1,
  "column_sums_LHT": -1,
  "legacy_column_sums_LHT": -1,
  "keys_LGTD": -2,
  "future_attn_LHST": -1,
  "values_LGTD": -2,
  "value_out_norms_LHT": -1,
  "reconstruction_attn_LGT": -1,
  "reconstruction_attn_LHT": -1,
  "prerope_keys_LGTD": -2,
  "queries_LHTD": -2,
  "valid_T": -1,
  "kvgrad_LGT": -1,
  "kvzap_LGT": -1,
  "fastkvzip_LGT": -1,
}

FIELDS = frozenset(f.name for f in dataclasses.fields(Evidence)) - {"observation_window"}


@dataclasses.dataclass(frozen=True)
class EvidenceRequest:
  """What a prefill computes besides logits, keys and values.

  One hashable object, static under ``jit`` (:func:`kvjax.model.llama.prefill` takes it), built
  from a policy's needs by :meth:`kvjax.policies.Policy.evidence_request` and merged with ``|``
  for a prefill that several policies share.

  Attributes:
    window: window rows of the last ``window`` queries over every key (0: none).
    column_sums: H2O's causal attention column sums.
    value_out_norms: CriticalKV's ``||W_O^h v_j||_1``.
    query_stats: ExpectedAttention's query mean and covariance, with kvpress's ``n_sink`` and
      ``n_future`` (``n_future_positions``).
    window_queries: the last ``window_queries`` post-RoPE queries (ThinK, R-KV; 0: none).
    prerope_keys: the keys before RoPE (leverage scores).
    queries: every prompt position's post-RoPE queries (non-causal attention).
    window_scores: a hashable callable reducing one layer's window rows ``[B, H, W, T]`` to
      scores ``[B, H, T]`` inside the layer scan, so the prefill keeps the scores instead of the
      rows (:meth:`kvjax.policies.WindowPolicy.window_scorer`); ``None`` keeps the rows.
  """

  window: int = 0
  column_sums: bool = False
  value_out_norms: bool = False
  query_stats: bool = False
  n_sink: int = N_SINK
  n_future: int = N_FUTURE
  window_queries: int = 0
  prerope_keys: bool = False
  queries: bool = False
  window_scores: Callable[[Array], Array] | None = None

  def __or__(self, other: EvidenceRequest) -> EvidenceRequest:
    """Both requests at once, for a prefill shared by several policies.

    The shared prefill keeps the rows: the result has no ``window_scores``.

    Args:
      other: the other request.

    Returns:
      The request computing what either asks for.

    Raises:
      ValueError: both ask for query statistics with different ``n_sink`` or ``n_future``.
    """
    if (self.query_stats and other.query_stats) and (
      (self.n_sink, self.n_future) != (other.n_sink, other.n_future)
    ):
      raise ValueError(
        f"request: query statistics with n_sink={self.n_sink}, n_future={self.n_future} and "
        f"n_sink={other.n_sink}, n_future={other.n_future} cannot share one prefill"
      )
    stats = self if self.query_stats else other
    return EvidenceRequest(
      window=max(self.window, other.window),
      column_sums=self.column_sums or other.column_sums,
      value_out_norms=self.value_out_norms or other.value_out_norms,
      query_stats=self.query_stats or other.query_stats,
      n_sink=stats.n_sink,
      n_future=stats.n_future,
      window_queries=max(self.window_queries, other.window_queries),
      prerope_keys=self.prerope_keys or other.prerope_keys,
      queries=self.queries or other.queries,
    )

  @classmethod
  def for_fields(cls, needs, window: int, **settings) -> EvidenceRequest:
    """The request that computes the :class:`Evidence` fields ``needs``.

    A model computes the others: keys and values always; the caller gives Q-Filters,
    DuoAttention's gates, KVzip's and KVCompose's reconstruction attention and KVgrad's
    attribution.

    Args:
      needs: :class:`Evidence` field names.
      window: the window rows' and window queries' count.
      **settings: other :class:`EvidenceRequest` fields (``n_sink``, ``n_future``,
        ``window_scores``).

    Returns:
      The :class:`EvidenceRequest`.

    Raises:
      ValueError: ``needs`` names a field :class:`Evidence` lacks.
    """
    needs = frozenset(needs)
    unknown = sorted(needs - FIELDS)
    if unknown:
      raise ValueError(
        f"needs: {unknown} are not Evidence fields; expected some of {sorted(FIELDS)}"
      )
    return cls(
      window=window,
      column_sums="column_sums_LHT" in needs,
      value_out_norms="value_out_norms_LHT" in needs,
      query_stats=bool({"query_mean_LHD", "query_cov_LHDD"} & needs),
      window_queries=window if "window_queries_LHWD" in needs else 0,
      prerope_keys="prerope_keys_LGTD" in needs,
      queries="queries_LHTD" in needs,
      **settings,
    )


def evidence_from_qk(
  queries_LHTD: Array,
  keys_LGTD: Array,
  *,
  window: int = DEFAULT_WINDOW,
  legacy_window: int = 8,
  column_sums: bool = True,
  rng: Array | None = None,
) -> Evidence:
  """Evidence of one prompt from its post-RoPE queries and keys, without a ``T x T`` matrix.

  Args:
    queries_LHTD: post-RoPE queries ``[L, Hq, T, D]``.
    keys_LGTD: post-RoPE keys ``[L, G, T, D]``.
    window: observation queries (an int ``>= 1``; the whole prompt when it is shorter).
    legacy_window: the window of KVCache-Factory's legacy non-causal mask (an int ``>= 0``).
    column_sums: also compute the causal and legacy H2O column sums, blockwise.
    rng: a PRNG key for the random policy.

  Returns:
    An :class:`Evidence` with the window rows, the column sums, the keys and ``rng``.

  Raises:
    ValueError: queries or keys that are not rank-4 arrays, a ``window`` or ``legacy_window``
      that is not an int in its range, or a ``column_sums`` that is not a bool.
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
