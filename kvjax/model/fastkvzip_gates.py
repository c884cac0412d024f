"""Fast KVzip's gates (kvpress 0.5.5 ``presses/fastkvzip_press.py::FastKVzipGate``), their files
and the evidence they give a prompt; :mod:`kvjax.model.fastkvzip` re-exports these.

* :func:`init_gates`, :func:`gate_scores`: the gates, a "low-rank sink attention" applied to
  attention inputs (:func:`kvjax.model.passes.attention_inputs`);
* :func:`save` / :func:`load` / :func:`check_gates`: an ``.npz`` file with a json header,
  checked against the model;
* :func:`fastkvzip_evidence` -> ``fastkvzip_LGT``, the evidence
  :class:`kvjax.policies.fastkvzip.FastKVzip` reads.

The gates' layout is :mod:`kvjax.model.fastkvzip`'s.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import learned_io, passes
from kvjax.model.config import ModelConfig
from kvjax.scores import PRECISION

Array = jax.Array

DIM, SINK = 16, 16  # optim.py's --dim and --sink (the released gates' "q{R}_dim16_sink16")
EPS = 1e-6  # Qwen3RMSNorm's default eps, which FastKVzipGate's norms keep
FORMAT = "kvjax.fastkvzip/1"
PARAM_KEYS = ("wq", "bq", "wk", "q_norm", "k_norm", "k_base", "b")


# --------------------------------------------------------------------------- the gates


def expected_shapes(L: int, d: int, G: int, R: int, dim: int = DIM, sink: int = SINK) -> dict:
  """The gates' shapes for a model.

  Args:
    L: layers.
    d: the model dim (the attention input's width).
    G: KV heads.
    R: query heads per KV head (kvpress ``ngroup``).
    dim: the gate's head dim (kvpress ``output_dim``, 16).
    sink: the learned sink keys per KV head (16).

  Returns:
    ``{name: shape}`` in the layout of :mod:`kvjax.model.fastkvzip`'s docstring.
  """
  return {
    "wq": (L, d, G * R * dim),
    "bq": (L, G * R * dim),
    "wk": (L, d, G * dim),
    "q_norm": (L, dim),
    "k_norm": (L, dim),
    "k_base": (L, G, sink, dim),
    "b": (L, G, R),
  }


def shapes_of(gates: dict) -> dict[str, tuple[int, ...]]:
  """Each array's shape.

  Args:
    gates: the gates.

  Returns:
    ``{name: shape}``.
  """
  return {k: tuple(np.shape(v)) for k, v in gates.items()}


def dims_of(gates: dict) -> dict[str, int]:
  """The sizes the gates were built for, read from their shapes.

  Args:
    gates: the gates (every key of :data:`PARAM_KEYS`).

  Returns:
    ``{"L", "d", "G", "R", "dim", "sink"}``.
  """
  L, G, sink, dim = np.shape(gates["k_base"])
  return {
    "L": L,
    "d": np.shape(gates["wq"])[1],
    "G": G,
    "R": np.shape(gates["b"])[-1],
    "dim": dim,
    "sink": sink,
  }


def model_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
  """``(L, d, G, R)`` of a model: what its gates must fit.

  Args:
    cfg: the model's config.

  Returns:
    Layers, model dim, KV heads and query heads per KV head.
  """
  return cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.num_groups


def init_gates(seed: int, L: int, d: int, G: int, R: int, *, dim: int = DIM, sink: int = SINK):
  """Untrained gates, as ``optim.py``'s ``Weight`` starts: torch ``nn.Linear``'s default
  initialisation (``U(-1/sqrt(d), 1/sqrt(d))`` for ``q_proj``'s weight and bias and
  ``k_proj``'s weight), norm scales 1, sink keys and bias 0. The draws come from numpy's
  generator (torch's in the official code): the same distribution, other numbers.

  Args:
    seed: the generator's seed.
    L: layers.
    d: the model dim.
    G: KV heads.
    R: query heads per KV head.
    dim: the gate's head dim.
    sink: the sink keys per KV head.

  Returns:
    The gates, a dict of fp32 arrays.
  """
  shapes = expected_shapes(L, d, G, R, dim, sink)
  rng = np.random.default_rng(seed)
  bound = 1.0 / math.sqrt(d)
  out = {k: rng.uniform(-bound, bound, shapes[k]) for k in ("wq", "bq", "wk")}
  out |= {k: np.ones(shapes[k]) for k in ("q_norm", "k_norm")}
  out |= {k: np.zeros(shapes[k]) for k in ("k_base", "b")}
  return {k: jnp.asarray(out[k], jnp.float32) for k in PARAM_KEYS}


def _head_norm(x: Array, scale_LD: Array) -> Array:
  """``Qwen3RMSNorm`` over the last axis, ``scale_LD`` broadcast from the layer axis."""
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
  return scale_LD.reshape(scale_LD.shape[:1] + (1,) * (x.ndim - 2) + scale_LD.shape[1:]) * x


@jax.jit
def gate_scores(gates: dict, h_LTd) -> Array:
  """The gates' scores of attention inputs (kvpress ``FastKVzipGate.forward``).

  Per layer and position, with ``q = q_norm(h W_q + b_q)`` split into ``[G, R, D]`` and
  ``k = k_norm(h W_k)`` into ``[G, D]``:
  ``logit_r = <k, q_r> / sqrt(D) + b_r``, ``base_{s,r} = <k_base_s, q_r> / sqrt(D)`` and
  ``score = mean_r 1 / (1 + sum_s exp(base_{s,r} - logit_r))``, in ``(0, 1)``: a softmax in
  which the position's own key competes with ``S`` learned sink keys for its queries. Computed
  as ``sigmoid(-logsumexp_s(base - logit))``, the same value without overflow.

  Args:
    gates: the gates.
    h_LTd: attention inputs ``[L, ..., d]`` (any axes between the layer and the model dim).

  Returns:
    fp32 scores ``[L, G, ...]``.
  """
  x = jnp.asarray(h_LTd, jnp.float32)
  dims = dims_of(gates)
  G, R, D = dims["G"], dims["R"], dims["dim"]
  L, mid = x.shape[0], x.shape[1:-1]
  x = x.reshape(L, -1, x.shape[-1])
  q = jnp.einsum("lnd,ldk->lnk", x, gates["wq"], precision=PRECISION) + gates["bq"][:, None]
  q = _head_norm(q.reshape(L, -1, G, R, D), gates["q_norm"])
  k = jnp.einsum("lnd,ldk->lnk", x, gates["wk"], precision=PRECISION)
  k = _head_norm(k.reshape(L, -1, G, D), gates["k_norm"])
  scale = 1.0 / math.sqrt(D)
  logit = jnp.einsum("lngd,lngrd->lngr", k, q, precision=PRECISION) * scale + gates["b"][:, None]
  base = jnp.einsum("lgsd,lngrd->lngsr", gates["k_base"], q, precision=PRECISION) * scale
  z = jax.nn.logsumexp(base - logit[:, :, :, None, :], axis=3)  # [L, N, G, R]
  score = jax.nn.sigmoid(-z).mean(-1)  # the group mean: [L, N, G]
  return jnp.moveaxis(score.reshape(L, *mid, G), -1, 1)


# --------------------------------------------------------------------------- files


def save(
  path: str | pathlib.Path, gates: dict, meta: dict | None = None, *, identity: dict | None = None
) -> pathlib.Path:
  """Writes gates as an ``.npz`` file (:func:`kvjax.model.learned_io.write`): the arrays and a
  json header (``format``, ``shapes``, ``model_identity`` and the caller's ``meta``).

  Args:
    path: the file to write.
    gates: the gates.
    meta: as :func:`kvjax.model.learned_io.write`.
    identity: :func:`kvjax.checks.model_identity` of the model they were trained on
      (:func:`kvjax.model.learned_io.write`).

  Returns:
    The path written.
  """
  arrays = {k: gates[k] for k in PARAM_KEYS}
  return learned_io.write(path, arrays, FORMAT, meta, identity=identity, shapes=shapes_of(gates))


def check_gates(gates, cfg: ModelConfig, where: str = "gates") -> None:
  """Checks that gates fit a model.

  Args:
    gates: the gates.
    cfg: the model (``num_layers``, ``hidden_size``, ``num_kv_heads``, ``num_groups``).
    where: what to name in the error (an argument, or a file).

  Raises:
    ValueError: naming ``where``: not a dict, a missing array, or shapes that do not fit.
  """
  if not isinstance(gates, dict):
    raise ValueError(f"{where}: expected a dict of gate arrays, got {type(gates).__name__}")
  missing = [k for k in PARAM_KEYS if k not in gates]
  if missing:
    raise ValueError(f"{where}: lacks the gate arrays {missing}")
  kb = np.shape(gates["k_base"])
  if len(kb) != 4:
    raise ValueError(f"{where}: k_base has shape {kb}, expected [L, G, sink, dim]")
  L, d, G, R = model_dims(cfg)
  want = expected_shapes(L, d, G, R, kb[3], kb[2])
  got = shapes_of({k: gates[k] for k in PARAM_KEYS})
  wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
  if wrong:
    said = ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in wrong.items())
    raise ValueError(f"{where}: does not fit this model (L={L}, d={d}, G={G}, R={R}): {said}")


def load(path: str | pathlib.Path, model, *, unverified=False) -> tuple[dict, dict]:
  """Reads gates written by :func:`save` and checks them against a model
  (:func:`kvjax.model.learned_io.load`; their shapes by :func:`check_gates`).

  Args:
    path, model, unverified: as :func:`kvjax.model.learned_io.load`.

  Returns:
    ``(gates, meta)``: fp32 gates.

  Raises:
    ValueError: as :func:`kvjax.model.learned_io.load`, naming the file.
  """
  cfg = model.cfg

  def gates(files, meta, where):
    check_gates(files, cfg, where)
    return {k: jnp.asarray(files[k], jnp.float32) for k in PARAM_KEYS}

  return learned_io.load(
    path, model, fmt=FORMAT, what="Fast KVzip gates", build=gates, unverified=unverified
  )


# --------------------------------------------------------------------------- evidence


def fastkvzip_evidence(model, gates: dict, input_ids, attention_mask=None):
  """Computes Fast KVzip's ``fastkvzip_LGT`` of a prompt, as kvpress 0.5.5's ``FastKVzipPress``
  scores it during prefill (``_score_fast``: ``gates[layer](hidden_states)``).

  One dense causal forward over the prompt gives every layer's attention inputs (the hidden
  states after the layer's input norm, what kvpress's hook reads as ``hidden_states``); the
  gates map each to ``G`` scores in ``(0, 1)`` (:func:`gate_scores`). The sinks and the local
  window belong to the policy (:class:`kvjax.policies.fastkvzip.FastKVzip`). Padding positions
  get scores too; the policy's ``valid_T`` keeps them out.

  Differs from kvpress: batches of several left-padded rows (kvpress's gate squeezes a batch of
  one); fp32 gates (kvpress: the file's dtype); the forward is dense (``[B, Hq, T, T]`` per
  layer), so this suits prompts of a few thousand tokens.

  Args:
    model: the model (:class:`kvjax.model.llama.Llama`).
    gates: the trained gates (:func:`load`, :func:`train_gates`).
    input_ids: the prompt ``[B, T]`` (left-padded when rows differ).
    attention_mask: ``[B, T]`` 0/1 of the real tokens (``None``: all real).

  Returns:
    fp32 scores ``[L, B, G, T]``: ``evidence={"fastkvzip_LGT": ...}`` for ``km.generate``.

  Raises:
    ValueError: for ids breaking :func:`kvjax.model.llama.check_token_ids`'s rule, a mask of
      another shape, or gates that do not fit the model (:func:`check_gates`).
  """
  ids, mask = passes.padded_prompt(model.cfg, input_ids, attention_mask)
  check_gates(gates, model.cfg)
  gates = {k: jnp.asarray(gates[k], jnp.float32) for k in PARAM_KEYS}
  return passes.learned_scores(model, gate_scores, gates, ids, mask)
