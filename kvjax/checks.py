"""Argument checks shared by the core: each raises ``ValueError`` naming the argument, the value
and what was expected, and returns the value in the form the caller computes with.

Static values (shapes, kernels, windows, modes) are checked in Python; so are concrete data
(counts, reals, arrays). Traced data (under ``jit`` or ``vmap``) cannot be checked in Python:
the dtype of a traced count is still checked (dtypes are static); its values are checked by
``jax.experimental.checkify`` when the caller asks for it. :func:`counts`, :func:`real` and
:func:`finite` (and :func:`float_array`, which calls :func:`finite`) add a
``checkify.debug_check`` for traced values, with the message their concrete check raises:
under ``checkify.checkify(jax.jit(fn))`` the returned error reports it (``error.throw()`` raises
it), and under a plain ``jax.jit`` the check is dropped (no cost, no change to any result).
Every other value check of kvjax runs on concrete values only.
Where an int is expected, a numpy integer (``np.int64(7)``) is one too, and a bool is not.

:func:`model_identity` and :func:`same_model` identify the model a trained file was made for
(a learned scorer or adapter), so that it is refused for another model of the same shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

Array = jax.Array

INT32_LIMIT = 2**31  # counts must satisfy 0 <= x < INT32_LIMIT before they are cast to int32


def is_concrete(*xs) -> bool:
  """Tells whether every value is known in Python (not traced).

  A concrete value can be validated in Python; a traced one (under ``jit`` or ``vmap``) cannot.

  Args:
    *xs: the values to test (arrays, Python numbers or tracers).

  Returns:
    True when none of ``xs`` is a ``jax.core.Tracer``.
  """
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def is_int(value) -> bool:
  """Tells whether ``value`` is a static integer: a Python or numpy integer, not a bool.

  Args:
    value: any value.

  Returns:
    True for ``int`` and ``np.integer`` values other than bools.
  """
  return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def is_real_dtype(dtype) -> bool:
  """Tells whether a numpy dtype holds real numbers: a floating or integer one.

  Args:
    dtype: a numpy dtype.

  Returns:
    True for floating and integer dtypes (not ``object``, bool or complex).
  """
  return bool(np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer))


def choice(name: str, value, choices: Sequence[str]) -> None:
  """Checks that a mode is one of ``choices``.

  Args:
    name: the argument's name, quoted in the error message.
    value: the given mode.
    choices: the known modes.

  Raises:
    ValueError: for a value that is not among ``choices``.
  """
  if value not in choices:
    raise ValueError(f"{name}: unknown value {value!r}; expected one of {tuple(choices)}")


def static_int(name: str, value, minimum: int = 1) -> int:
  """Checks a static integer (a shape, a length, a count of layers) in ``[minimum, 2**31)``.

  Args:
    name: the argument's name, quoted in error messages.
    value: a Python or numpy integer (not a bool, not traced).
    minimum: the smallest allowed value.

  Returns:
    ``value`` as a Python ``int``.

  Raises:
    ValueError: for a bool, a value that is not an integer, one below ``minimum``, and one that
      does not fit int32.
  """
  if not is_int(value) or value < minimum:
    raise ValueError(f"{name}: expected a static int >= {minimum}, got {value!r}")
  if value >= INT32_LIMIT:
    raise ValueError(f"{name}: {value} does not fit int32; expected {minimum} <= {name} < 2**31")
  return int(value)


def _object_ints(name: str, arr: np.ndarray) -> None:
  """Python ints beyond int64 (numpy's ``object`` arrays) are out of range; anything else is not
  an integer at all."""
  values = list(arr.flat)
  if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    worst = max(values, key=abs)
    raise ValueError(f"{name}: {worst} does not fit int32; expected 0 <= {name} < 2**31")
  raise ValueError(f"{name}: expected integer counts, got {arr.tolist()!r}")


def counts(name: str, value, *, minimum: int = 0):
  """Checks integer counts (budgets, lengths, positions) before any cast to int32.

  The dtype must be an integer one (also for traced values: dtypes are static). Concrete values
  must lie in ``[minimum, 2**31)``, so that ``np.int64(2**32 + 12)`` never wraps to 12 and
  ``2**40`` never reaches JAX's converters.

  Args:
    name: the argument's name, quoted in error messages.
    value: the counts: a Python int, a numpy or JAX integer array, or a tracer.
    minimum: the smallest allowed count.

  Returns:
    A numpy array (concrete ``value``) or the tracer unchanged.

  Raises:
    ValueError: naming ``name``, for a non-integer dtype (traced or concrete), and for concrete
      counts below ``minimum`` or not below ``2**31``.
  """
  if not is_concrete(value):
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{name}: expected an integer array, got dtype {value.dtype}")
    _traced_counts(name, value, minimum)
    return value
  arr = np.asarray(value)
  if arr.dtype == object:
    _object_ints(name, arr)
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name}: expected an integer array, got dtype {arr.dtype}")
  if arr.size:
    low, high = int(arr.min()), int(arr.max())
    if low < minimum:
      expected = "non-negative counts" if minimum == 0 else f"counts >= {minimum}"
      raise ValueError(f"{name}: expected {expected}, got minimum {low}")
    if high >= INT32_LIMIT:
      raise ValueError(f"{name}: {high} does not fit int32; expected 0 <= {name} < 2**31")
  return arr


def _traced_counts(name: str, value, minimum: int) -> None:
  """:func:`counts`' value checks on traced counts, reported under ``checkify`` only."""
  expected = "non-negative counts" if minimum == 0 else f"counts >= {minimum}"
  checkify.debug_check(
    jnp.all(value >= minimum),
    f"{name}: expected {expected}, got minimum {{low}}",
    low=jnp.min(value, initial=minimum),
  )
  if jnp.iinfo(value.dtype).max >= INT32_LIMIT:  # int32 counts always fit
    checkify.debug_check(
      jnp.all(value < INT32_LIMIT),
      f"{name}: {{high}} does not fit int32; expected 0 <= {name} < 2**31",
      high=jnp.max(value, initial=0),
    )


def real(name: str, value, low: float, *, strict: bool = False, high: float | None = None) -> None:
  """Checks a real-valued option: a concrete value at once, a traced one under ``checkify``.

  A concrete value must be finite and ``>= low`` (``> low`` when ``strict``), and ``<= high``
  when given.

  Args:
    name: the option's name, quoted in error messages.
    value: a real number or array, concrete or traced.
    low: the lower bound.
    strict: excludes ``low`` itself.
    high: an optional upper bound (inclusive).

  Raises:
    ValueError: for a concrete value that is not a real number, not finite, or out of bounds.
  """
  bound = f"{name} > {low}" if strict else f"{name} >= {low}"
  if high is not None:
    bound = f"{low} <= {name} <= {high}"
  if not is_concrete(value):
    if is_real_dtype(value.dtype):
      x = value.astype(jnp.float32)
      ok = jnp.isfinite(x) & ((x > low) if strict else (x >= low))
      ok = ok if high is None else ok & (x <= high)
      checkify.debug_check(
        jnp.all(ok), f"{name}: expected a finite value with {bound}, got {{value}}", value=value
      )
    return
  arr = np.asarray(value)
  if not is_real_dtype(arr.dtype):
    raise ValueError(f"{name}: expected a real number, got {value!r}")
  arr = arr.astype(np.float64)
  ok = np.isfinite(arr) & ((arr > low) if strict else (arr >= low))
  if high is not None:
    ok &= arr <= high
  if not np.all(ok):
    raise ValueError(f"{name}: expected a finite value with {bound}, got {value!r}")


def ratio(name: str, value, *, high_open: bool = True) -> float:
  """Checks a static share in ``[0, 1)`` (or ``[0, 1]``).

  Args:
    name: the argument's name, quoted in the error message.
    value: a Python or numpy real number (not a bool, not traced).
    high_open: excludes 1 itself.

  Returns:
    ``value`` as a Python ``float``.

  Raises:
    ValueError: for a value that is not a static real number, not finite, or out of bounds.
  """
  ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or not (0.0 <= value < 1.0 if high_open else value <= 1):
    bound = "[0, 1)" if high_open else "[0, 1]"
    raise ValueError(f"{name}: expected a static float in {bound}, got {value!r}")
  return float(value)


def finite(name: str, x) -> None:
  """Checks that values are finite: concrete ones at once, traced ones under ``checkify``.

  Args:
    name: the argument's name, quoted in the error message.
    x: a real number or array, concrete or traced.

  Raises:
    ValueError: for concrete values with NaN or inf.
  """
  message = f"{name}: contains NaN or inf; expected finite values"
  if not is_concrete(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):  # an integer array is always finite
      checkify.debug_check(jnp.all(jnp.isfinite(x)), message)
    return
  if not np.isfinite(np.asarray(x, np.float64)).all():
    raise ValueError(message)


def float_array(name: str, x, ndim: int, letters: str) -> None:
  """Checks an evidence array: floating, of rank ``ndim``, and finite when concrete.

  Args:
    name: the argument's name, quoted in error messages.
    x: the array.
    ndim: the expected rank.
    letters: the names of its axes (``"LGTD"``), quoted in the error message.

  Raises:
    ValueError: for a value of another rank, a non-floating dtype, and (when concrete) NaN or
      inf.
  """
  if not hasattr(x, "ndim") or x.ndim != ndim:
    shape = getattr(x, "shape", type(x).__name__)
    raise ValueError(f"{name}: expected a rank-{ndim} array [{', '.join(letters)}], got {shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
  if is_concrete(x) and not np.isfinite(np.asarray(x, np.float32)).all():
    raise ValueError(f"{name}: contains NaN or inf; expected finite values")


def rank(name: str, x, letters: str) -> None:
  """Checks that ``x`` is an array of rank ``len(letters)``, whatever its dtype.

  Args:
    name: the argument's name, quoted in the error message.
    x: the array.
    letters: the names of its axes (``"LHT"``), quoted in the error message.

  Raises:
    ValueError: for a value that is not an array of that rank.
  """
  if not hasattr(x, "ndim") or x.ndim != len(letters):
    raise ValueError(f"{name}: expected [{', '.join(letters)}], got {getattr(x, 'shape', x)}")


def same_dims(name: str, x, ref_name: str, ref, axes: Sequence[int]) -> None:
  """Checks that two arrays agree along ``axes``.

  Args:
    name: the checked argument's name, quoted in the error message.
    x: the checked array.
    ref_name: the reference argument's name.
    ref: the reference array.
    axes: the axes that must agree.

  Raises:
    ValueError: for arrays whose sizes differ along one of ``axes``.
  """
  if tuple(x.shape[a] for a in axes) != tuple(ref.shape[a] for a in axes):
    raise ValueError(f"{name}: shape {x.shape} does not match {ref_name} {ref.shape}")


def gqa(num_query_heads: int, num_kv_heads: int) -> int:
  """Checks a grouped-query layout: ``Hq`` query heads over ``G`` KV heads.

  Args:
    num_query_heads: the number of query heads ``Hq``.
    num_kv_heads: the number of KV heads ``G``.

  Returns:
    The group size ``Hq // G``.

  Raises:
    ValueError: for ``G < 1`` and ``Hq`` not a multiple of ``G``.
  """
  if num_kv_heads < 1 or num_query_heads % num_kv_heads:
    raise ValueError(
      f"num_kv_heads: Hq={num_query_heads} query heads is not a multiple of "
      f"G={num_kv_heads} KV heads"
    )
  return num_query_heads // num_kv_heads


def queries_keys(queries, keys, q_name: str = "queries", k_name: str = "keys") -> None:
  """Checks queries ``[L, Hq, W, D]`` against keys ``[L, G, T, D]``.

  Args:
    queries: the queries, a floating rank-4 array.
    keys: the keys, a floating rank-4 array.
    q_name: the queries' argument name, quoted in error messages.
    k_name: the keys' argument name, quoted in error messages.

  Raises:
    ValueError: for arrays that :func:`float_array` refuses, shapes that disagree in ``L`` or
      ``D``, and ``Hq`` not a multiple of ``G``.
  """
  float_array(q_name, queries, 4, "LHWD")
  float_array(k_name, keys, 4, "LGTD")
  if queries.shape[0] != keys.shape[0] or queries.shape[-1] != keys.shape[-1]:
    raise ValueError(
      f"{k_name}: shape {keys.shape} does not match {q_name} {queries.shape} "
      "in layers L or head dim D"
    )
  gqa(queries.shape[1], keys.shape[1])


def window(value, num_positions: int) -> int:
  """Checks a window of last positions: a static int in ``[0, T]``.

  Args:
    value: the window, a Python or numpy integer.
    num_positions: the number of positions ``T``.

  Returns:
    ``value`` as a Python ``int``.

  Raises:
    ValueError: for a value that is not a non-negative int, and one above ``T``.
  """
  if not is_int(value) or value < 0:
    raise ValueError(f"window: expected a non-negative int, got {value!r}")
  if value > num_positions:
    raise ValueError(f"window: W={value} exceeds the number of positions T={num_positions}")
  return int(value)


def valid_positions(valid_T, num_positions: int) -> Array:
  """Checks a row's real positions, bool ``[T]`` (``None``: all of them).

  Args:
    valid_T: bool ``[T]`` or ``None``.
    num_positions: the number of positions ``T``.

  Returns:
    bool ``[T]``.

  Raises:
    ValueError: for a value that is not ``[T]``.
  """
  if valid_T is None:
    return jnp.ones((num_positions,), bool)
  if getattr(valid_T, "shape", None) != (num_positions,):
    shape = getattr(valid_T, "shape", valid_T)
    raise ValueError(
      f"valid_T: expected bool [T={num_positions}] (the row's real positions), got {shape}"
    )
  return jnp.asarray(valid_T, bool)


# --------------------------------------------------------------------------- model identity

IDENTITY_SAMPLE = 4096  # elements read at each end of every weight array for its digest


def model_identity(cfg, params) -> dict:
  """What identifies a model for a file trained on it: its config and a digest of its weights.

  The digest reads the first and last :data:`IDENTITY_SAMPLE` elements of every weight array
  (with its name and shape), rounded to bfloat16, so it costs little for any size of model,
  tells two checkpoints of one architecture apart (training changes every array), and is the same
  for a checkpoint loaded in float32 or in bfloat16.

  Args:
    cfg: the model's config (a dataclass, :class:`kvjax.model.ModelConfig`).
    params: the parameter pytree.

  Returns:
    A JSON-able dict: ``config`` (the config's fields) and ``weights_sha256``.
  """
  digest = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(params)
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    flat = jnp.ravel(jnp.asarray(leaf))
    if flat.size > 2 * IDENTITY_SAMPLE:
      flat = jnp.concatenate([flat[:IDENTITY_SAMPLE], flat[-IDENTITY_SAMPLE:]])
    digest.update(json.dumps([jax.tree_util.keystr(path), list(jnp.shape(leaf))]).encode())
    digest.update(np.asarray(flat.astype(jnp.bfloat16)).tobytes())
  config = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as a file's JSON header holds it
  return {"config": config, "weights_sha256": digest.hexdigest()}


def same_model(where: str, saved, want: dict, *, unverified: bool = False) -> None:
  """Checks that a file was made for the model it is loaded for, by :func:`model_identity`.

  Args:
    where: how the error names the file (``"path: <file>"``).
    saved: the identity the file records (``None``: it records none).
    want: :func:`model_identity` of the model it is loaded for.
    unverified: skip the check (the caller's explicit choice, e.g. for a file saved without an
      identity, or one deliberately reused on a fine-tune of its model).

  Raises:
    ValueError: naming ``where``, unless ``unverified``: for a file that records no identity,
      one whose identity is not a JSON object of ``config`` and ``weights_sha256``, and one made
      for another model: the config fields that differ, or else that the weights differ.
  """
  if unverified:
    return
  if saved is None:
    raise ValueError(
      f"{where}: records no model identity, so the model it was trained on is unknown; "
      "expected a file saved with the identity of its model (save it again with identity=), "
      "or pass unverified=True to load it for this model without the check"
    )
  if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
    raise ValueError(
      f"{where}: holds a model identity {saved!r} that is not a JSON object with config and "
      "weights_sha256; expected the one its save recorded"
    )
  old, new = saved["config"], want["config"]
  differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  if differ:
    said = ", ".join(f"{k} ({old.get(k)!r}, {new.get(k)!r})" for k in differ)
    raise ValueError(
      f"{where}: was trained on another model; its config differs (file, this model): {said}"
    )
  if saved.get("weights_sha256") != want["weights_sha256"]:
    raise ValueError(
      f"{where}: was trained on another model of the same config: its weights differ (digest "
      f"{str(saved.get('weights_sha256'))[:12]} in the file, {want['weights_sha256'][:12]} "
      "here); expected the model it was trained on, or unverified=True to use it anyway"
    )
