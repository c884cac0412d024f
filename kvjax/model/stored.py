"""A compressed context kept for later questions: compress a context once, save it, load it in
another process and answer several questions from it without reading the context again.

:func:`kvjax.model.decoding.compress_context` makes a :class:`CompressedContext` and
:func:`kvjax.model.decoding.answer_context` answers from one. This module holds the object and
its file: one safetensors file with every array of the cache and a JSON header naming the model
(its shapes and a digest of its embedding), the policy, the budget and each row's next position,
so that a cache saved for another model or policy is refused when loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model.config import ModelConfig

FORMAT = "kvjax.compressed_context/1"
# the cache fields saved as arrays (evidence is a dict saved as evidence/<field>)
_ARRAYS = tuple(f.name for f in dataclasses.fields(cache_lib.KVCache) if f.name != "evidence")


def model_fingerprint(cfg: ModelConfig, params: dict) -> dict:
  """What identifies a model for a saved cache: its shapes and a digest of its embedding.

  The digest reads the embedding matrix only (one array of a checkpoint, so a check costs
  little even for large models); two checkpoints of one architecture differ there.

  Args:
    cfg: the model's config.
    params: the parameter pytree.

  Returns:
    A JSON-able dict: layers, query and KV heads, head dim, vocabulary and the embedding's
    SHA-256.
  """
  embed = np.ascontiguousarray(np.asarray(params["embed"], np.float32))
  return dict(
    num_layers=cfg.num_layers,
    num_heads=cfg.num_heads,
    num_kv_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    vocab_size=cfg.vocab_size,
    embed_sha256=hashlib.sha256(embed.tobytes()).hexdigest(),
  )


@dataclasses.dataclass(frozen=True)
class CompressedContext:
  """A context compressed once under a policy, ready for questions.

  Attributes:
    cache: the compressed cache (:class:`kvjax.model.cache.KVCache`), one row per context.
    spec: its static choices (policy, capacity, layout).
    next_pos_B: each row's next RoPE position (its context's real tokens), int32 ``[B]``.
    model: :func:`model_fingerprint` of the model that made it.
  """

  cache: cache_lib.KVCache
  spec: cache_lib.CacheSpec
  next_pos_B: np.ndarray
  model: dict

  def header(self) -> dict:
    """The JSON header of the file: format, model, policy, layout and positions."""
    return dict(
      format=FORMAT,
      model=self.model,
      policy=repr(self.spec.policy),
      policy_label=self.spec.policy.label,
      capacity=self.spec.capacity,
      layout=self.spec.layout,
      reindex=self.spec.reindex,
      compress_sliding=self.spec.compress_sliding,
      next_pos=[int(p) for p in np.asarray(self.next_pos_B)],
    )

  def save(self, path) -> pathlib.Path:
    """Writes the context to one safetensors file.

    Args:
      path: the file (``.safetensors`` is appended when absent).

    Returns:
      The path written.
    """
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    if path.suffix != ".safetensors":
      path = path.with_name(path.name + ".safetensors")
    arrays = {}
    for name in _ARRAYS:
      value = getattr(self.cache, name)
      if value is not None:
        arrays[name] = np.ascontiguousarray(np.asarray(value))
    for name, value in (self.cache.evidence or {}).items():
      arrays[f"evidence/{name}"] = np.ascontiguousarray(np.asarray(value))
    save_file(arrays, str(path), metadata={"kvjax": json.dumps(self.header())})
    return path


def load(path, cfg: ModelConfig, params: dict, policy: policies.Policy) -> CompressedContext:
  """Reads a :class:`CompressedContext` saved by :meth:`CompressedContext.save`.

  Args:
    path: the file.
    cfg: the model's config.
    params: the model's parameters (the fingerprint is checked against them).
    policy: the policy the context was compressed with (an object).

  Returns:
    The context, on the default device.

  Raises:
    ValueError: naming the file, for a file that is not a saved context, or one saved for
      another model (what differs) or another policy.
  """
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"path: {str(path)!r} is not a file; expected a saved compressed context")
  try:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
      meta = f.metadata() or {}
    arrays = load_file(str(path))
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"path: {path} is not a safetensors file ({e})") from None
  try:
    header = json.loads(meta["kvjax"])
    ok = header.get("format") == FORMAT
  except (KeyError, json.JSONDecodeError, AttributeError):
    ok = False
  if not ok:
    raise ValueError(f"path: {path} holds no compressed context (expected format {FORMAT})")
  want = model_fingerprint(cfg, params)
  differs = {k: (header["model"].get(k), v) for k, v in want.items() if header["model"].get(k) != v}
  if differs:
    raise ValueError(
      f"path: {path} was saved for another model; differs (saved, this model): {differs}"
    )
  if header["policy"] != repr(policy):
    raise ValueError(
      f"policy: {path} was compressed with {header['policy']}, not with {policy!r}; pass the "
      "policy it was saved with"
    )
  fields = {k: jnp.asarray(v) for k, v in arrays.items() if not k.startswith("evidence/")}
  evidence = {k.split("/", 1)[1]: jnp.asarray(v) for k, v in arrays.items() if "/" in k}
  cache = cache_lib.KVCache(**fields, evidence=evidence or None)
  spec = cache_lib.CacheSpec(
    policy,
    int(header["capacity"]),
    header["layout"],
    reindex=bool(header["reindex"]),
    compress_sliding=bool(header.get("compress_sliding", False)),
  )
  return CompressedContext(
    jax.device_put(cache), spec, np.asarray(header["next_pos"], np.int32), header["model"]
  )
