"""What a sweep is: its axes, their vocabularies, the grid's expansion and the validation of one
configuration.

A sweep is a base configuration plus a grid (``product`` axes crossed with ``zip`` axes, the
``get_hyper`` idea of big_vision without its internal module); each configuration is a dict of
:data:`FIELDS`. The static axes (:data:`STATIC_FIELDS`) choose what compiles: a configuration's
:class:`GroupKey`. The data axes (:data:`DATA_FIELDS`) are numbers, swept under ``vmap``.

Names live here, at the boundary, and nowhere else in the sweep:

* the ``policy`` axis names any registered policy the sweep can score (:func:`sweepable`: it
  reads no evidence beyond :data:`SWEEP_EVIDENCE` and takes its budget as given), a user's after
  :func:`kvjax.policies.register` included; :func:`sweep_policy` builds a group's;
* the ``schedule`` and ``head_alloc`` axes name :mod:`kvjax.policies` allocators
  (:data:`SCHEDULES`, :data:`HEAD_ALLOCS`): a layer schedule, then a head allocation of each
  layer's budget (:class:`kvjax.policies.Layered`'s composition), their swept numbers set from
  data axes (:data:`ALLOCATOR_AXES`); a user's own after :func:`register_schedule` or
  :func:`register_head_alloc`. :func:`allocators` builds a configuration's.

The engine that evaluates the groups is :mod:`kvjax.lab.sweep`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Mapping

from kvjax import budgets as budgets_lib
from kvjax import policies
from kvjax import scores as scores_lib
from kvjax.lab import synthetic

STATIC_FIELDS = (
  "scenario",
  "policy",
  "schedule",
  "head_alloc",
  "pyramid_mode",
  "window",
  "kernel",
  "pool",
)
DATA_FIELDS = ("budget", "beta", "alpha", "head_beta", "sinks", "tau1", "tau2")
FIELDS = STATIC_FIELDS + DATA_FIELDS
FLOAT_FIELDS = ("beta", "alpha", "head_beta", "tau1", "tau2")
# What the sweep's world gives a scorer or an allocator: the prompt's window rows, H2O's column
# sums, the future attention (the oracle's), a PRNG key, the lab's modelled keys and the world's
# values (kvjax.lab.online.key_evidence, built per world only for the groups that read them) and
# HeadKV's head scores (measured on a calibration world). Any policy that reads no more, takes
# its budget as given (the schedule and head_alloc axes allocate) and scores without it can be
# swept by name, a user's registered one included (sweepable).
SWEEP_EVIDENCE = frozenset(
  {
    "attn_window_LHWT",
    "column_sums_LHT",
    "future_attn_LHST",
    "rng",
    "keys_LGTD",
    "values_LGTD",
    "head_scores_LH",
  }
)
# The config's schedule and head_alloc axes name kvjax.policies allocators: a layer schedule,
# then a head allocation of each layer's budget. register_schedule / register_head_alloc add a
# user's.
SCHEDULES: dict[str, type] = {
  "uniform": policies.Uniform,
  "pyramid": policies.Pyramid,
  "cake": policies.CakeLayers,
}
HEAD_ALLOCS: dict[str, type] = {
  "uniform": policies.Uniform,
  "adakv": policies.AdaKV,
  "headkv": policies.HeadKV,
}
# the data axes that set each allocator's swept numbers, {allocator field: axis}
ALLOCATOR_AXES: dict[type, dict[str, str]] = {
  policies.Pyramid: {"beta": "beta"},
  policies.CakeLayers: {"tau1": "tau1", "tau2": "tau2"},
  policies.AdaKV: {"floor_alpha": "alpha"},
  policies.HeadKV: {"beta": "head_beta"},
}
_BUILTIN = {"schedule": frozenset(SCHEDULES), "head_alloc": frozenset(HEAD_ALLOCS)}
_VOCABULARY = {"schedule": SCHEDULES, "head_alloc": HEAD_ALLOCS}
ALLOCATOR_DATA_AXES = tuple(f for f in DATA_FIELDS if f != "budget")  # what axes= may name
# The axis that sweeps kvpress compression ratios instead of budgets: each configuration keeps
# int(prompt_len * (1 - ratio)) slots per (layer, head) of its scenario's prompt (resolve_ratios)
# and its row carries the ratio. Not a field of base: a grid has a budget axis or a ratio axis.
RATIO = "ratio"


# --------------------------------------------------------------------------- the grid


def _axis_values(name: str, values, base) -> tuple:
  if name not in FIELDS and name != RATIO:
    raise ValueError(f"grid: unknown axis {name!r}; expected one of {(*FIELDS, RATIO)}")
  if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)):
    values = (values,)
  if not values:
    raise ValueError(f"grid: axis {name!r} has no values")
  if name == RATIO:
    for v in values:
      real = isinstance(v, int | float) and not isinstance(v, bool)
      if not real or not 0.0 <= v < 1.0:
        raise ValueError(
          f"grid: axis 'ratio' value {v!r} is not a compression ratio; expected a float in "
          "[0, 1) (kvpress compression_ratio, the fraction of the prompt removed)"
        )
    return tuple(float(v) for v in values)
  expected = type(base[name])
  for v in values:
    ok = isinstance(v, expected) or (expected is float and isinstance(v, int))
    if not ok or isinstance(v, bool):
      raise ValueError(
        f"grid: axis {name!r} value {v!r} is a {type(v).__name__}, expected {expected.__name__}"
      )
  return tuple(values)


def _distinct(name: str, values: tuple) -> tuple:
  """A product axis's values, each once: a repeat would only run its configurations twice."""
  repeated = sorted({repr(v) for v in values if values.count(v) > 1})
  if repeated:
    raise ValueError(
      f"grid.product.{name}: {', '.join(repeated)} appear more than once; expected distinct values"
    )
  return values


def expand(grid, base) -> list[dict]:
  """``product`` axes crossed with the ``zip`` axes (zipped together) over ``base``.

  ``grid.product`` and ``grid.zip`` map field names to tuples of values. Returns one resolved
  dict per configuration, in a deterministic order. A ``ratio`` axis (:data:`RATIO`) instead of
  ``budget`` gives each configuration a ``ratio``, whose budget :func:`resolve_ratios` sets.
  """
  product = {
    k: _distinct(k, _axis_values(k, v, base)) for k, v in dict(grid.get("product", {})).items()
  }
  zipped = {k: _axis_values(k, v, base) for k, v in dict(grid.get("zip", {})).items()}
  both = set(product) & set(zipped)
  if both:
    raise ValueError(f"grid: axes {sorted(both)} appear in both product and zip")
  axes = set(product) | set(zipped)
  if {"budget", RATIO} <= axes:
    raise ValueError(
      "grid: axes 'budget' and 'ratio' both given; expected a budget axis or a ratio axis, "
      "not both (a ratio sets each configuration's budget)"
    )
  lengths = {len(v) for v in zipped.values()}
  if len(lengths) > 1:
    raise ValueError(f"grid: zip axes have different lengths {sorted(lengths)}")
  zip_rows = list(zip(*zipped.values(), strict=True)) if zipped else [()]
  configs = []
  for prod in itertools.product(*product.values()):
    for zrow in zip_rows:
      cfg = {k: base[k] for k in FIELDS}
      cfg.update(zip(product, prod, strict=True))
      cfg.update(zip(zipped, zrow, strict=True))
      configs.append(cfg)
  if not configs or (not product and not zipped):
    raise ValueError("grid: empty grid; declare at least one product or zip axis")
  return configs


def config_id(cfg: dict) -> str:
  """Stable hash of a configuration's swept fields (independent of dict order); a ratio
  configuration's ``ratio`` is one of them (a budget configuration's hash has no ratio)."""
  # float fields hash as floats, so 20 and 20.0 are one configuration
  typed = {k: float(cfg[k]) if k in FLOAT_FIELDS else cfg[k] for k in FIELDS}
  if cfg.get(RATIO) is not None:
    typed[RATIO] = float(cfg[RATIO])
  canonical = json.dumps(typed, sort_keys=True)
  return hashlib.sha1(canonical.encode()).hexdigest()[:12]


def ratio_budget(ratio: float, prompt_len: int) -> int:
  """The budget per (layer, head) that kvpress's ``compression_ratio`` keeps of a prompt:
  kvpress 0.5.5 ``compute_n_kept``, ``int(prompt_len * (1 - ratio))`` in Python floats.

  Args:
    ratio: the fraction of the prompt removed, in ``[0, 1)``.
    prompt_len: the prompt's tokens.

  Returns:
    The kept tokens.
  """
  return int(int(prompt_len) * (1 - float(ratio)))


def resolve_ratios(configs: list[dict], world_cfg) -> list[dict]:
  """Sets each ratio configuration's ``budget`` from its ratio and its scenario's prompt
  (:func:`ratio_budget`); budget configurations are returned as they are.

  Args:
    configs: expanded configurations (:func:`expand`).
    world_cfg: the sweep's world sizes (``config.world``).

  Returns:
    New configuration dicts, each ratio one with its budget.

  Raises:
    ValueError: naming ``ratio``, for a ratio that keeps no more than the configuration's
      protected window (its budget must exceed ``window``).
  """
  out = []
  for cfg in configs:
    if cfg.get(RATIO) is None:
      out.append(cfg)
      continue
    P = synthetic.world_config(cfg["scenario"], world_cfg).prompt_len
    budget = ratio_budget(cfg[RATIO], P)
    if budget <= cfg["window"]:
      raise ValueError(
        f"ratio: {cfg[RATIO]!r} keeps {budget} of the {P} prompt tokens per head; expected a "
        f"smaller ratio, keeping more than window={cfg['window']}"
      )
    out.append(cfg | {"budget": budget})
  return out


# --------------------------------------------------------------------------- a group's policy


@dataclasses.dataclass(frozen=True)
class GroupKey:
  """A configuration's static structure (:data:`STATIC_FIELDS`): one compiled program."""

  scenario: str
  policy: str
  schedule: str
  head_alloc: str
  pyramid_mode: str
  window: int
  kernel: int
  pool: str


def group_key(cfg: dict) -> GroupKey:
  return GroupKey(*(cfg[f] for f in STATIC_FIELDS))


def sweep_policy(key: GroupKey, data: dict | None = None) -> policies.Policy:
  """The group's policy: its name built with the static axes it takes (``window`` as its
  protected window, ``kernel``, ``pool``: :func:`kvjax.policies.accepted_options`) and, given a
  configuration's ``data``, its data options from it (StreamingLLM's sink count, traced)."""
  options = policies.accepted_options(
    key.policy, window=key.window, kernel=key.kernel, pool=key.pool
  )
  policy = policies.make(key.policy, **options)
  if data is None or not policy.data_options:
    return policy
  return policies.make(key.policy, **options, **{k: data[k] for k in policy.data_options})


def allocation_window(key: GroupKey) -> int:
  """The window a group's allocators reserve in every budget: its policy's own protected window
  (the ``window`` axis for a policy that protects its window, 0 for one that protects none), the
  window :meth:`kvjax.policies.Policy.budgets` gives the allocator in the lab and the model."""
  evidence = policies.Evidence(observation_window=key.window)
  return sweep_policy(key).protected_window(evidence)


def sweep_problem(policy: policies.Policy) -> str | None:
  """Why the sweep cannot score ``policy``, or ``None`` when it can (:func:`sweepable`)."""
  refusals = (
    (lambda p: p.merges, "it merges evicted values into kept ones"),
    (lambda p: p.merges_while_decoding, "it merges evicted values while decoding"),
  )
  refusals = [(test, f"{why}, which the sweep's cache does not model") for test, why in refusals]
  problem = synthetic.policy_problem(policy, refusals, SWEEP_EVIDENCE, "the sweep's world")
  if problem:
    return problem
  if policy.allocates:
    return "it allocates its own budgets; sweep its scorer under the schedule and head_alloc axes"
  if policy.rescores:
    return "its selection scores depend on the budget"
  axes = [k for k in policy.data_options if k not in DATA_FIELDS]
  if axes:
    return f"its data options {axes} are not sweep axes (expected some of {DATA_FIELDS})"
  return None


def sweepable() -> tuple[str, ...]:
  """The registered names the sweep scores (with their defaults), a user's included."""
  return policies.names_where(lambda policy: sweep_problem(policy) is None)


# --------------------------------------------------------------------------- allocators


def _allocator(cls: type, key: GroupKey, data: dict | None) -> policies.Allocator:
  fields = {}
  if data is not None:
    fields = {f: data[axis] for f, axis in ALLOCATOR_AXES.get(cls, {}).items()}
  if issubclass(cls, policies.Pyramid):
    fields["pyramid_mode"] = key.pyramid_mode
  return cls(**fields)


def allocators(
  key: GroupKey, data: dict | None = None
) -> tuple[policies.Allocator, policies.Allocator]:
  """A configuration's ``(layer schedule, head allocation)`` as :mod:`kvjax.policies`
  allocators: ``Uniform``, ``Pyramid(beta, pyramid_mode)``, ``CakeLayers(tau1, tau2)`` or a
  registered schedule, then ``Uniform``, ``AdaKV(floor_alpha)``, ``HeadKV(beta)`` or a
  registered head allocation. Their numbers come from the configuration's ``data`` (traced
  under ``vmap``; :data:`ALLOCATOR_AXES`); without it, their defaults (the group's static
  structure, what the engine dispatches on)."""
  return (
    _allocator(SCHEDULES[key.schedule], key, data),
    _allocator(HEAD_ALLOCS[key.head_alloc], key, data),
  )


def register_schedule(
  name: str,
  allocator_cls: type,
  *,
  axes: Mapping[str, str] | None = None,
  overwrite: bool = False,
) -> None:
  """Names a user's layer schedule for the ``schedule`` axis.

  A schedule turns a configuration's total budget into per-layer budgets: the first column of
  the ``budget_LH`` it returns (:class:`kvjax.policies.Layered`'s rule); the ``head_alloc``
  axis then splits each layer's budget among its heads. The engine calls it through the
  :class:`kvjax.policies.Allocator` protocol, ``allocator(evidence, scores_LHT, budget,
  window)``, under ``vmap``: the budget and the swept fields are traced scalars.

  Args:
    name: the name configs use (an identifier; the built-in names stay).
    allocator_cls: a :class:`kvjax.policies.Allocator` subclass, buildable with its defaults
      (what a group's static structure holds); it may read the evidence of
      :data:`SWEEP_EVIDENCE`.
    axes: ``{allocator field: data axis}``, the fields swept as data, e.g. ``{"low": "alpha"}``
      sets the field ``low`` from each configuration's ``alpha`` (one of
      :data:`ALLOCATOR_DATA_AXES`); the other fields keep their defaults. One set of axes per
      class.
    overwrite: replace an earlier registration of ``name``.
  """
  _register("schedule", name, allocator_cls, axes, overwrite)


def register_head_alloc(
  name: str,
  allocator_cls: type,
  *,
  axes: Mapping[str, str] | None = None,
  overwrite: bool = False,
) -> None:
  """Names a user's head allocation for the ``head_alloc`` axis: as :func:`register_schedule`,
  but it is called with each layer's budget (``budget_L`` ``[L]`` int32) and returns the
  ``budget_LH`` of the configuration. An allocator that only takes a scalar budget
  (``max_budget_ndim == 0``, as HeadKV) allocates across layers itself and runs after the
  uniform schedule alone."""
  _register("head_alloc", name, allocator_cls, axes, overwrite)


def unregister_schedule(name: str) -> None:
  """Removes a user's schedule ``name`` (``ValueError`` for a built-in or unknown one)."""
  _unregister("schedule", name)


def unregister_head_alloc(name: str) -> None:
  """Removes a user's head allocation ``name`` (``ValueError`` for a built-in or unknown one)."""
  _unregister("head_alloc", name)


def _users(cls: type, but: tuple[str, str] | None = None) -> list[tuple[str, str]]:
  """The ``(axis, name)`` registrations of ``cls``, leaving out ``but``."""
  return [
    (axis, name)
    for axis, vocabulary in _VOCABULARY.items()
    for name, c in vocabulary.items()
    if c is cls and (axis, name) != but
  ]


def _register(axis: str, name, cls, axes, overwrite: bool) -> None:
  vocabulary = _VOCABULARY[axis]
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"name: expected an identifier such as 'my_{axis}', got {name!r}")
  if name in _BUILTIN[axis]:
    raise ValueError(f"name: {name!r} is a built-in {axis}; expected another name")
  if name in vocabulary and not overwrite:
    raise ValueError(
      f"name: {axis} {name!r} is registered already; pass overwrite=True to replace it"
    )
  if not (isinstance(cls, type) and issubclass(cls, policies.Allocator)):
    raise ValueError(f"allocator_cls: expected a kvjax.policies.Allocator subclass, got {cls!r}")
  try:
    default = cls()
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"allocator_cls: {cls.__name__}() fails ({e}); expected an allocator buildable with its "
      "defaults (a group's static structure)"
    ) from e
  missing = sorted(default.needs - SWEEP_EVIDENCE)
  if missing:
    fields = ", ".join(f"evidence.{f}" for f in missing)
    raise ValueError(
      f"allocator_cls: {cls.__name__} reads {fields}, which the sweep's world does not provide; "
      f"expected some of {sorted(SWEEP_EVIDENCE)}"
    )
  if isinstance(axes, str) or not isinstance(axes, Mapping | None):
    raise ValueError(f"axes: expected a mapping {{allocator field: data axis}}, got {axes!r}")
  axes = dict(axes or {})
  own = sorted(f.name for f in dataclasses.fields(cls) if f.init)
  for field, data_axis in axes.items():
    if field not in own:
      raise ValueError(f"axes: {field!r} is not a field of {cls.__name__}; expected one of {own}")
    if data_axis not in ALLOCATOR_DATA_AXES:
      raise ValueError(
        f"axes: {field!r} -> {data_axis!r} is not a data axis; expected one of "
        f"{ALLOCATOR_DATA_AXES}"
      )
  if ALLOCATOR_AXES.get(cls, {}) != axes and _users(cls, but=(axis, name)):
    raise ValueError(
      f"axes: {cls.__name__} is swept by the axes {ALLOCATOR_AXES.get(cls, {})} already; "
      "expected the same axes (or a subclass for others)"
    )
  replaced = vocabulary.get(name)
  vocabulary[name] = cls
  if replaced is not None and replaced is not cls and not _users(replaced):
    ALLOCATOR_AXES.pop(replaced, None)
  if axes:
    ALLOCATOR_AXES[cls] = axes
  else:
    ALLOCATOR_AXES.pop(cls, None)


def _unregister(axis: str, name) -> None:
  vocabulary = _VOCABULARY[axis]
  if name in _BUILTIN[axis]:
    raise ValueError(f"name: {name!r} is a built-in {axis}; it cannot be removed")
  if name not in vocabulary:
    raise ValueError(f"name: {axis} {name!r} is not registered")
  cls = vocabulary.pop(name)
  if not _users(cls):
    ALLOCATOR_AXES.pop(cls, None)


# --------------------------------------------------------------------------- validation


def validate(cfg: dict, dims: synthetic.Dims | None) -> None:
  """Names the offending field of one configuration (sizes are checked when ``dims`` is given)."""
  checks = (
    ("scenario", cfg["scenario"] in synthetic.SCENARIOS, tuple(synthetic.SCENARIOS)),
    ("policy", policies.is_registered(cfg["policy"]), None),
    ("schedule", cfg["schedule"] in SCHEDULES, tuple(SCHEDULES)),
    ("head_alloc", cfg["head_alloc"] in HEAD_ALLOCS, tuple(HEAD_ALLOCS)),
    ("pyramid_mode", cfg["pyramid_mode"] in budgets_lib.PYRAMID_MODES, budgets_lib.PYRAMID_MODES),
    ("pool", cfg["pool"] in scores_lib.POOLS, scores_lib.POOLS),
  )
  for name, ok, choices in checks:
    if not ok:
      choices = sweepable() if choices is None else choices
      raise ValueError(f"{name}: unknown value {cfg[name]!r}; expected one of {choices}")
  scores_lib.check_kernel(cfg["kernel"])
  key = group_key(cfg)
  problem = sweep_problem(sweep_policy(key))
  if problem is not None:
    raise ValueError(
      f"policy: {cfg['policy']!r} cannot be swept: {problem}; expected one of {sweepable()}"
    )
  if dims is None:
    return
  if not 1 <= cfg["window"] <= dims.window:
    raise ValueError(
      f"window: {cfg['window']} outside 1..{dims.window} (the world's observation window)"
    )
  if not cfg["window"] < cfg["budget"] <= dims.prompt_len:
    raise ValueError(
      f"budget: {cfg['budget']} does not fit the world: expected window={cfg['window']} < "
      f"budget <= prompt_len={dims.prompt_len}"
    )
  data_checks = (
    ("beta", cfg["beta"] >= 1, "PyramidKV's beta >= 1"),
    ("alpha", 0 <= cfg["alpha"] <= 1, "Ada-KV's floor_alpha in [0, 1]"),
    ("head_beta", cfg["head_beta"] > 1, "HeadKV's beta > 1"),
    ("tau1", cfg["tau1"] > 0, "a positive CAKE temperature"),
    ("tau2", cfg["tau2"] > 0, "a positive CAKE temperature"),
    ("sinks", 0 <= cfg["sinks"] < cfg["budget"], "0 <= sinks < budget"),
  )
  for name, ok, expected in data_checks:
    if not ok:
      raise ValueError(f"{name}: {cfg[name]!r} is invalid; expected {expected}")
  for axis, vocabulary in _VOCABULARY.items():  # a user allocator's own checks of its numbers
    try:
      _allocator(vocabulary[cfg[axis]], key, cfg)
    except ValueError as e:
      raise ValueError(f"{axis}: {cfg[axis]!r} rejects this configuration: {e}") from e
  layers, heads = allocators(key)
  if isinstance(layers, policies.CakeLayers) and cfg["window"] < 2:
    raise ValueError(
      f"window: CAKE's variance over window queries needs window >= 2, got {cfg['window']}"
    )
  if heads.max_budget_ndim == 0 and not isinstance(layers, policies.Uniform):
    raise ValueError(
      f"schedule: {type(heads).__name__} allocates across layers itself; got {cfg['schedule']!r}"
    )
