"""RestoreKV's adapter (RestoreKV, arXiv 2608.01247; kvpress 0.5.5
``presses/restorekv_press.py::RestoreKVPress``): the trained part and its restore pass.

* :class:`Adapter`: ``N`` restore embeddings and a LoRA adapter (rank ``r``) on the attention
  projections, made by :func:`init_adapter`, checked by :func:`check_adapter`;
* :func:`restore_kv`: the one LoRA-adapted pass of the restore embeddings after a prefilled
  prompt (kvpress ``append_restore_tokens``), giving their keys and values per layer;
* :func:`save` / :func:`load`: an ``.npz`` file with a json header, checked against the model.

:mod:`kvjax.model.restorekv` gathers RestoreKV's evidence and re-exports these.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.model import cache as cache_lib
from kvjax.model import learned_io, llama, training
from kvjax.model.config import ModelConfig
from kvjax.policies.restorekv import RESTORE_TOKENS

Array = jax.Array

FORMAT = "kvjax.restorekv/1"
TARGETS = ("wq", "wk", "wv", "wo")  # the attention projections (kvpress: the adapter's choice)
PEFT_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
RANK, ALPHA = 8, 16.0


@struct.dataclass
class Adapter:
  """RestoreKV's trained part for one model.

  Attributes:
    embeddings: the restore tokens' input embeddings ``[N, d]``.
    lora_a: per target projection (:data:`TARGETS`), ``A [L, in, r]``.
    lora_b: per target projection, ``B [L, r, out]``: the projection's weight becomes
      ``W + alpha / r * A @ B`` during the restore pass.
    alpha: LoRA's ``alpha`` (static).
  """

  embeddings: Array
  lora_a: dict
  lora_b: dict
  alpha: float = struct.field(pytree_node=False, default=ALPHA)

  @property
  def tokens(self) -> int:
    """The restore tokens ``N``."""
    return int(self.embeddings.shape[0])

  @property
  def rank(self) -> int:
    """LoRA's rank ``r``."""
    return int(next(iter(self.lora_a.values())).shape[-1])

  @property
  def scaling(self) -> float:
    """``alpha / r``, PEFT's scaling of ``A @ B``."""
    return self.alpha / self.rank


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """Each target projection's ``(in, out)``.

  Args:
    cfg: the model's config.

  Returns:
    ``{target: (in, out)}`` for :data:`TARGETS`.
  """
  d, D = cfg.hidden_size, cfg.head_dim
  q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
  return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}


def expected_shapes(cfg: ModelConfig, tokens: int, rank: int) -> dict[str, tuple[int, ...]]:
  """The arrays an adapter of ``tokens`` restore tokens and LoRA rank ``rank`` holds.

  Args:
    cfg: the model's config.
    tokens: restore tokens ``N``.
    rank: LoRA's rank ``r``.

  Returns:
    ``{"embeddings": (N, d), "a_<target>": (L, in, r), "b_<target>": (L, r, out)}``.
  """
  L = cfg.num_layers
  out = {"embeddings": (tokens, cfg.hidden_size)}
  for t, (i, o) in target_shapes(cfg).items():
    out[f"a_{t}"], out[f"b_{t}"] = (L, i, rank), (L, rank, o)
  return out


def _arrays(adapter: Adapter) -> dict:
  out = {"embeddings": adapter.embeddings}
  for t in TARGETS:
    out[f"a_{t}"], out[f"b_{t}"] = adapter.lora_a[t], adapter.lora_b[t]
  return out


def init_adapter(
  cfg: ModelConfig,
  params: dict,
  *,
  tokens: int = RESTORE_TOKENS,
  rank: int = RANK,
  alpha: float = ALPHA,
  seed: int = 0,
) -> Adapter:
  """An untrained adapter: the restore pass equals the base model's.

  PEFT's LoRA initialisation (``A`` Kaiming-uniform with ``a = sqrt(5)``, so bounded by
  ``1 / sqrt(in)``; ``B`` zero); the restore embeddings are copies of the embeddings of
  ``tokens`` vocabulary entries drawn with ``seed`` (as prompt tuning starts).

  Args:
    cfg: the model's config.
    params: the parameter pytree (its ``embed`` table is read).
    tokens: restore tokens ``N`` (kvpress's adapters: 8).
    rank: LoRA's rank ``r``.
    alpha: LoRA's ``alpha``.
    seed: the draw's seed.

  Returns:
    The fp32 :class:`Adapter`.

  Raises:
    ValueError: for ``tokens`` or ``rank`` that is not a positive int, or ``alpha`` that is not
      positive.
  """
  tokens, rank = training.check_int("tokens", tokens), training.check_int("rank", rank)
  alpha = training.check_float("alpha", alpha)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, tokens)
  embeddings = jnp.asarray(np.asarray(params["embed"], np.float32)[ids])
  lora_a, lora_b = {}, {}
  for t, (i, o) in target_shapes(cfg).items():
    bound = 1.0 / math.sqrt(i)
    a = rng.uniform(-bound, bound, (cfg.num_layers, i, rank))
    lora_a[t] = jnp.asarray(a, jnp.float32)
    lora_b[t] = jnp.zeros((cfg.num_layers, rank, o), jnp.float32)
  return Adapter(embeddings, lora_a, lora_b, alpha)


def check_adapter(adapter, cfg: ModelConfig, where: str = "adapter") -> None:
  """Checks that an adapter fits a model.

  Args:
    adapter: the :class:`Adapter`.
    cfg: the model.
    where: what to name in the error (an argument, or a file).

  Raises:
    ValueError: naming ``where``: not an :class:`Adapter`, a missing target, or shapes that do
      not fit the model.
  """
  if not isinstance(adapter, Adapter):
    raise ValueError(f"{where}: expected a kvjax.model.restorekv.Adapter, got {adapter!r:.80}")
  for part in ("lora_a", "lora_b"):
    missing = [t for t in TARGETS if t not in getattr(adapter, part)]
    if missing:
      raise ValueError(f"{where}: {part} lacks the targets {missing}")
  emb = np.shape(adapter.embeddings)
  if len(emb) != 2:
    raise ValueError(f"{where}: embeddings have shape {emb}, expected [N, d]")
  rank = np.shape(adapter.lora_a["wq"])[-1]
  want = expected_shapes(cfg, emb[0], rank)
  got = {k: tuple(np.shape(v)) for k, v in _arrays(adapter).items()}
  wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
  if wrong:
    said = ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in wrong.items())
    raise ValueError(
      f"{where}: does not fit this model (L={cfg.num_layers}, d={cfg.hidden_size}, "
      f"Hq={cfg.num_heads}, G={cfg.num_kv_heads}, D={cfg.head_dim}): {said}"
    )


def adapted_params(params: dict, adapter: Adapter) -> dict:
  """The model's parameters with the adapter merged: ``W + alpha / r * A @ B`` per target.

  Args:
    params: the parameter pytree.
    adapter: the :class:`Adapter`.

  Returns:
    The parameter pytree of the restore pass (the targets in their own dtype).
  """
  out = dict(params)
  for t in TARGETS:
    delta = jnp.einsum("lir,lro->lio", adapter.lora_a[t], adapter.lora_b[t])
    w = params[t]
    out[t] = (w.astype(jnp.float32) + adapter.scaling * delta).astype(w.dtype)
  return out


def held_segment(pre: llama.Prefill, valid_LBGT: Array | None = None) -> tuple:
  """A prefill's keys and values as one held segment of :func:`kvjax.model.cache.extend`.

  Args:
    pre: a prefill's outputs.
    valid_LBGT: the pairs held (``None``: every real token's).

  Returns:
    ``(keys, values, valid_LBGT, positions_LBGT)``.
  """
  L, B, G, T = pre.keys.shape[:4]
  valid = jnp.broadcast_to(pre.valid[None, :, None, :], (L, B, G, T))
  if valid_LBGT is not None:
    valid = valid & valid_LBGT
  positions = jnp.broadcast_to(pre.positions[None, :, None, :], (L, B, G, T))
  return (pre.keys, pre.values, valid, positions)


def next_positions(pre: llama.Prefill) -> Array:
  """Each row's next RoPE position: its real tokens' count (rows are left-padded).

  Args:
    pre: a prefill's outputs.

  Returns:
    int32 positions ``[B]``.
  """
  return pre.valid.sum(-1).astype(jnp.int32)


def restore_kv(cfg: ModelConfig, params: dict, adapter: Adapter, pre: llama.Prefill):
  """The restore tokens' keys and values after a prefilled prompt (kvpress
  ``RestoreKVPress.append_restore_tokens``).

  The ``N`` restore embeddings go through the model with the adapter merged
  (:func:`adapted_params`), at positions ``T_row .. T_row + N - 1`` of each row, each attending
  to every real prompt token and causally to the restore tokens before it; each layer's keys
  (post-RoPE) and values of them are what the cache keeps.

  Args:
    cfg: the model's config.
    params: the parameter pytree.
    adapter: the :class:`Adapter`.
    pre: the prompt's prefill (:func:`kvjax.model.llama.prefill`, left-padded rows).

  Returns:
    ``(keys, values)``, each ``[L, B, G, N, D]`` in the cache's dtype.
  """
  B = pre.keys.shape[1]
  N = adapter.tokens
  pos_BN = next_positions(pre)[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
  x_BNd = jnp.broadcast_to(adapter.embeddings[None], (B, N, adapter.embeddings.shape[-1]))
  x_BNd = x_BNd.astype(params["embed"].dtype)
  out = cache_lib.extend(
    cfg,
    adapted_params(params, adapter),
    (held_segment(pre),),
    x_BNd,
    pos_BN,
    appended=True,
    logits_from=N,
  )
  keys, values = out[2][:2]
  return keys, values


# --------------------------------------------------------------------------- files


def save(
  path: str | pathlib.Path,
  adapter: Adapter,
  meta: dict | None = None,
  *,
  identity: dict | None = None,
) -> pathlib.Path:
  """Writes an adapter as an ``.npz`` file: the arrays and a json header (``format``,
  ``alpha``, ``targets``, ``shapes``, ``model_identity`` and the caller's ``meta``, e.g. the
  model and the data).

  Args:
    path: the file to write.
    adapter: the :class:`Adapter`.
    meta: json-serialisable facts to keep with it.
    identity: :func:`kvjax.checks.model_identity` of the model it was trained on
      (:func:`kvjax.model.learned_io.write`).

  Returns:
    The path written.
  """
  return learned_io.write(
    path,
    _arrays(adapter),
    FORMAT,
    meta,
    identity=identity,
    alpha=float(adapter.alpha),
    targets=list(TARGETS),
  )


def load(path: str | pathlib.Path, model, *, unverified=False) -> tuple[Adapter, dict]:
  """Reads an adapter written by :func:`save` and checks it against a model
  (:func:`kvjax.model.learned_io.load`; its shapes by :func:`check_adapter`).

  Args:
    path, model, unverified: as :func:`kvjax.model.learned_io.load`.

  Returns:
    ``(adapter, meta)``.

  Raises:
    ValueError: as :func:`kvjax.model.learned_io.load`, naming the file.
  """
  cfg = model.cfg

  def adapter(files, meta, where):
    need = ["embeddings"] + [f"{p}_{t}" for t in TARGETS for p in ("a", "b")]
    missing = [k for k in need if k not in files]
    if missing:
      raise ValueError(f"{where}: lacks the arrays {missing}")
    built = Adapter(
      jnp.asarray(files["embeddings"]),
      {t: jnp.asarray(files[f"a_{t}"]) for t in TARGETS},
      {t: jnp.asarray(files[f"b_{t}"]) for t in TARGETS},
      float(meta.get("alpha", ALPHA)),
    )
    check_adapter(built, cfg, where)
    return built

  return learned_io.load(
    path, model, fmt=FORMAT, what="RestoreKV adapter", build=adapter, unverified=unverified
  )


def trained_fraction(adapter: Adapter, params: dict) -> float:
  """The adapter's trained values as a fraction of the model's parameters.

  Args:
    adapter: the :class:`Adapter`.
    params: the parameter pytree.

  Returns:
    ``adapter values / model values``.
  """
  trained = sum(int(np.size(v)) for v in _arrays(adapter).values())
  total = sum(int(np.size(v)) for v in jax.tree.leaves(params))
  return trained / total
