"""Compression of a prefill into a cache (:func:`compress`): each row's policy selection through
:func:`kvjax.select.compact`, the sliding layers a model leaves to their window, evicted values
merged into kept ones, and ThinK's pruned key channels.

Re-exported by :mod:`kvjax.model.cache`, whose names these are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies, select
from kvjax import scores as scores_lib
from kvjax.model import llama
from kvjax.model.cache_layout import (
  NAN_SCORES,
  ROW_EVIDENCE,
  SHARED_EVIDENCE,
  CacheSpec,
  KVCache,
  check_evidence,
  check_spec,
)
from kvjax.model.config import ModelConfig
from kvjax.policies import evidence as evidence_lib

Array = jax.Array


def _batch_first(x):
  return None if x is None else jnp.moveaxis(x, 1, 0)


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
  queries that :func:`~kvjax.model.cache.recompress` scores with.

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
      or ThinK's ``channel_ratio`` without the prefill's ``window_queries`` or with fewer of
      them than its ``channel_window`` (:func:`think_queries`).
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
      scores = to_layout(scores, H, cfg)
    # allocators see padding as zero evidence (Ada-KV's normalisation sums rows); only the
    # selection sees it as never-keep
    budget_LH = spec.policy.budgets(ev, jnp.where(valid_T, scores, 0.0), budget)
    return selection_scores(spec, ev, scores, valid_T, budget_LH), budget_LH

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
    nan_LH = (jnp.isnan(scores) & valid_T[None, None]).any(-1)
    budget_LH = jnp.where(nan_LH, NAN_SCORES, budget_LH)  # flagged: overflow, then an error
    count = jnp.minimum(budget_LH, valid_T.sum())
    idx, kept = select.compact(scores, count, prompt_slots)
    # a decode-time policy's per-slot state (H2O's sums, TOVA's last row) of the kept slots
    state = (
      policies.checked_init_state(spec.policy, ev, scores, idx, kept) if spec.decode_time else None
    )
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
    queries = think_queries(pre.window_queries, spec.policy.channel_window, pre.keys.shape[3])
    channels_L = think_channels(queries, kept_keys, spec.channel_ratio)
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
  """The evidence of some layers: every per-layer kind (all but ``valid_T`` and ``rng``) cut
  on its leading layer axis."""
  out = {name: value[layers] for name, value in ev.fields.items() if name not in ("valid_T", "rng")}
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


def selection_scores(spec: CacheSpec, ev, scores_LHT, valid_T, budget_LH) -> Array:
  """Computes the scores the selection ranks for one row.

  The policy's budget-dependent last stage applies first (CriticalKV; padding enters it as the
  lowest finite score, so ``(s + eps) * 0`` stays finite), then padding is never kept.

  Args:
    spec: the cache's static choices.
    ev: the row's :class:`kvjax.policies.Evidence`.
    scores_LHT: the policy's scores at the cache's heads ``[L, H, T]``.
    valid_T: bool ``[T]`` (or ``[L, H, T]``), the positions that hold a token.
    budget_LH: the row's allocation ``[L, H]``.

  Returns:
    fp32 scores ``[L, H, T]``, ``-inf`` where nothing is held.
  """
  if spec.policy.rescores:
    low = jnp.finfo(jnp.float32).min
    floor = jnp.where(valid_T, scores_LHT, low)
    scores_LHT = spec.policy.selection_scores(ev, floor, budget_LH, capacity=spec.capacity)
  return jnp.where(valid_T, scores_LHT, -jnp.inf)


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
  return to_layout(head_scores_LH[..., None], H, cfg)[..., 0]


def to_layout(scores_LHT: Array, H: int, cfg: ModelConfig) -> Array:
  """Maps scores at the query heads (or the KV heads) onto the cache's ``H`` heads.

  A KV-head cache takes the mean over each group's query heads, as kvpress does; a query-head
  cache repeats each KV head's scores over its group.

  Args:
    scores_LHT: scores ``[L, Hq, T]`` or ``[L, G, T]``.
    H: the cache's heads (``cfg.num_heads`` or ``cfg.num_kv_heads``).
    cfg: the model's config.

  Returns:
    Scores ``[L, H, T]``.

  Raises:
    ValueError: when the heads map to neither.
  """
  if scores_LHT.shape[1] == cfg.num_heads and cfg.num_kv_heads == H:
    return scores_lib.group(scores_LHT, H, "mean")
  if scores_LHT.shape[1] == cfg.num_kv_heads and cfg.num_heads == H:
    return jnp.repeat(scores_LHT, cfg.num_groups, axis=1)
  raise ValueError(f"scores: {scores_LHT.shape[1]} heads cannot map to the cache's {H} heads")


# --------------------------------------------------------------------------- ThinK's key channels


def think_queries(window_queries_LBHWD: Array, channel_window: int | None, T: int) -> Array:
  """The prefill's window queries that score ThinK's channels: the last ``channel_window``.

  kvpress's ``ThinKPress`` recomputes its own last ``window_size`` queries whatever window the
  sequence press before it observed, so a policy's ``channel_window`` (ThinK's, 32) takes the
  last ``min(channel_window, T)`` of the prefill's ``W`` queries; ``None`` takes all ``W``.

  Args:
    window_queries_LBHWD: the prefill's last ``W`` post-RoPE queries ``[L, B, Hq, W, D]``.
    channel_window: the policy's ``channel_window``, or ``None``.
    T: the prompt's length.

  Returns:
    The queries ``[L, B, Hq, min(channel_window, T), D]`` (all ``W`` for ``None``).

  Raises:
    ValueError: the prefill holds fewer than ``min(channel_window, T)`` queries.
  """
  if channel_window is None:
    return window_queries_LBHWD
  W, want = window_queries_LBHWD.shape[3], min(channel_window, T)
  if want > W:
    raise ValueError(
      f"channel_window: ThinK scores its channels with the last {want} queries, the prefill "
      f"holds {W}; expected a prefill with the policy's evidence_request(T)"
    )
  return window_queries_LBHWD[:, :, :, W - want :]


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
