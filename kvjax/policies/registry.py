"""Names at the boundary: configs, sweeps and notebooks name policies; :func:`make` builds the
object once, :func:`register` adds a user's own.

A registered name is a factory of flat options (``make("pyramidkv", beta=5, window=16)``): a
:class:`Preset` routes each option to the policy's field or to its allocator's.
``critical_<base>``, ``critical_adakv_<base>``, ``chunkkv_<base>`` and ``think_<base>`` wrap any
registered prefill scorer ``<base>`` on demand. kvjax's own presets and wrapper prefixes, each
with its provenance, are written in :mod:`~kvjax.policies.builtins`.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

from kvjax.policies import allocators as alloc_lib
from kvjax.policies import builtins
from kvjax.policies.builtins import Provenance
from kvjax.policies.core import Policy

_NOT_OPTIONS = ("allocator", "name", "base")


def _field_names(cls) -> set[str]:
  return {f.name for f in dataclasses.fields(cls) if f.name not in _NOT_OPTIONS}


def _default_allocator(cls) -> alloc_lib.Allocator:
  field = next(f for f in dataclasses.fields(cls) if f.name == "allocator")
  return field.default


@dataclasses.dataclass(frozen=True)
class Preset:
  """A policy class with reference defaults (and allocator) under a name.

  Called with flat options, it routes each one to the policy's field or its allocator's.

  Attributes:
    cls: the :class:`Policy` subclass it builds.
    defaults: the reference's options, which a call's options override.
    allocator: the allocator (``None``: the class's default one).
    doc: one line on the policy (:func:`doc`).
    provenance: its paper, reference code and named differences
      (:func:`kvjax.policies.provenance`; ``None``: not stated, the class's own ``paper``,
      ``code`` and ``differs`` attributes are read).
  """

  cls: type
  defaults: dict = dataclasses.field(default_factory=dict)
  allocator: alloc_lib.Allocator | None = None
  doc: str = ""
  provenance: Provenance | None = None

  @property
  def _allocator(self) -> alloc_lib.Allocator:
    return self.allocator if self.allocator is not None else _default_allocator(self.cls)

  def accepted(self) -> set[str]:
    """The options a call takes: the policy's fields and its allocator's.

    Returns:
      The option names.
    """
    return _field_names(self.cls) | _field_names(type(self._allocator))

  def __call__(self, name: str | None = None, **options) -> Policy:
    """Builds the policy, each option routed to the policy's field or its allocator's.

    Args:
      name: the policy's registered name (its ``name`` field; ``None``: unnamed).
      **options: the options, overriding :attr:`defaults`; an option the allocator has goes to
        the allocator.

    Returns:
      The frozen :class:`Policy`.

    Raises:
      ValueError: an option's value the policy or the allocator refuses.
      TypeError: an option neither has.
    """
    allocator = self._allocator
    alloc_fields = _field_names(type(allocator))
    own = {k: v for k, v in options.items() if k not in alloc_fields}
    routed = {k: v for k, v in options.items() if k in alloc_fields}
    if routed:
      allocator = dataclasses.replace(allocator, **routed)
    return self.cls(allocator=allocator, name=name, **{**self.defaults, **own})


def _check_options(name: str, accepted: set[str], options: dict) -> None:
  unknown = sorted(set(options) - accepted)
  if unknown:
    raise ValueError(
      f"options: {unknown} are not options of policy {name!r}; expected some of {sorted(accepted)}"
    )


def accepted(factory) -> set[str] | None:
  """The options a factory takes.

  Args:
    factory: a :class:`Preset`, a callable with an ``accepted`` set (the wrappers'), a
      :class:`Policy` subclass, or any callable (its parameters).

  Returns:
    The option names, or ``None`` for a ``**kwargs`` callable, which takes any.
  """
  if isinstance(factory, Preset):
    return factory.accepted()
  if isinstance(getattr(factory, "accepted", None), set):
    return factory.accepted
  if isinstance(factory, type) and issubclass(factory, Policy):
    return _field_names(factory) | _field_names(type(_default_allocator(factory)))
  params = inspect.signature(factory).parameters.values()
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return None
  return {p.name for p in params}


REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory, *, overwrite: bool = False) -> None:
  """Names a policy for configs, sweeps and evaluations.

  Args:
    name: the name configs use (an identifier, not yet registered unless ``overwrite``).
    factory: a :class:`Policy` subclass (its fields are the options) or a callable taking
      options and returning a :class:`Policy`.
    overwrite: replace an existing registration.

  Raises:
    ValueError: ``name`` is not an identifier or is registered already (without
      ``overwrite``), or ``factory`` is neither a :class:`Policy` subclass nor callable.
  """
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"name: expected an identifier such as 'my_policy', got {name!r}")
  if name in REGISTRY and not overwrite:
    raise ValueError(f"name: {name!r} is registered already; pass overwrite=True to replace it")
  if isinstance(factory, type) and issubclass(factory, Policy):
    factory = Preset(factory, doc=(factory.__doc__ or "").strip().split("\n")[0])
  elif not callable(factory):
    raise ValueError(f"factory: expected a Policy subclass or a callable, got {factory!r}")
  REGISTRY[name] = factory


def unregister(name: str) -> None:
  """Removes a user's registration.

  A built-in name stays: a user's registration over it (``overwrite=True``) is undone, the
  built-in factory restored; the built-in itself cannot be removed.

  Args:
    name: the registered name.

  Raises:
    ValueError: ``name`` is not registered, or is a built-in name holding its built-in factory.
  """
  if name not in REGISTRY:
    raise ValueError(f"name: {name!r} is not registered")
  builtin = _BUILTIN_NAMES.get(name)
  if builtin is not None:
    if REGISTRY[name] is builtin:
      raise ValueError(f"name: {name!r} is a built-in policy; it cannot be removed")
    REGISTRY[name] = builtin
    return
  del REGISTRY[name]


def is_registered(name) -> bool:
  """Whether ``name`` names a policy (registered, or a wrapper of a registered base).

  Args:
    name: the candidate name (any value; a non-string is not a name).

  Returns:
    ``True`` when :func:`factory` resolves it.
  """
  try:
    factory(name)
  except ValueError:
    return False
  return True


def names_where(predicate: Callable[[Policy], bool]) -> tuple[str, ...]:
  """The registered names whose policy, built with its defaults, satisfies ``predicate``.

  A factory that cannot build without options is left out.

  Args:
    predicate: a test on a :class:`Policy`.

  Returns:
    The names, in registration order.
  """
  out = []
  for name in REGISTRY:
    try:
      policy = make(name)
    except (TypeError, ValueError):
      continue
    if predicate(policy):
      out.append(name)
  return tuple(out)


def names() -> tuple[str, ...]:
  """All registered policy names.

  Wrappers of other bases, such as ``critical_knorm``, resolve on demand and are not listed.

  Returns:
    The names, in registration order.
  """
  return tuple(REGISTRY)


def _wrapped(name: str):
  """A factory for ``<prefix><base>`` names, or ``None``."""
  for prefix, (wrapper, _) in builtins.WRAPPERS.items():
    base_name = name[len(prefix) :]
    if name.startswith(prefix) and base_name:
      if base_name not in REGISTRY:
        raise ValueError(
          f"name: {name!r} wraps an unknown policy {base_name!r}; expected "
          f"{prefix}<one of {names()}>"
        )
      return _wrapper_factory(wrapper, base_name)
  return None


def _wrapper_factory(wrapper, base_name: str):
  base_factory = REGISTRY[base_name]
  base_accepted = accepted(base_factory) or set()
  if wrapper is None:  # think_<base>: the base with ThinK's key channels on by default

    def think(name=None, **options):
      return _call(base_factory, name, {"channel_ratio": 0.5, **options})

    think.accepted = base_accepted  # type: ignore[attr-defined]
    think.takes_name = True  # type: ignore[attr-defined]
    return think

  own = _field_names(wrapper)

  def wrap(name=None, **options):
    base = _call(base_factory, base_name, {k: v for k, v in options.items() if k not in own})
    mine = {k: v for k, v in options.items() if k in own}
    return wrapper(base=base, allocator=base.allocator, name=name, **mine)

  wrap.accepted = own | base_accepted  # type: ignore[attr-defined]
  wrap.takes_name = True  # type: ignore[attr-defined]
  return wrap


def _call(f, name: str, options: dict) -> Policy:
  """``f(**options)``, naming the policy ``name`` (before its options are validated, so errors
  name it)."""
  if isinstance(f, Preset) or getattr(f, "takes_name", False):
    return f(name=name, **options)
  return f(**options)


def factory(name: str):
  """The factory registered (or resolved) for ``name``.

  Args:
    name: a registered name, or a wrapper prefix (``critical_``, ``critical_adakv_``,
      ``chunkkv_``, ``think_``) over a registered one.

  Returns:
    The factory: called with options, it returns a :class:`Policy`.

  Raises:
    ValueError: ``name`` is not a string, is unknown, or wraps an unknown policy.
  """
  if not isinstance(name, str):
    raise ValueError(f"name: expected a policy name (str), got {name!r}")
  if name in REGISTRY:
    return REGISTRY[name]
  wrapped = _wrapped(name)
  if wrapped is None:
    raise ValueError(f"name: unknown policy {name!r}; expected one of {names()}")
  return wrapped


def accepted_options(name: str, *, window=None, **candidates) -> dict:
  """The options that policy ``name`` takes, of ``candidates`` and the protected ``window``.

  What a sweep's static axes become for that policy.

  Args:
    name: a policy name (:func:`factory`).
    window: the protected window; it goes to the policy's ``window_field`` when it has one
      (``None``: none given).
    **candidates: options to filter.

  Returns:
    The candidates the policy takes (all of them for a ``**kwargs`` factory), plus its
    ``window_field`` set to ``window``.

  Raises:
    ValueError: ``name`` is unknown.
  """
  known = accepted(factory(name))
  out = {k: v for k, v in candidates.items() if known is None or k in known}
  field = make(name).window_field
  if window is not None and field is not None:
    out[field] = window
  return out


def make(name: str, **options) -> Policy:
  """The policy ``name`` with ``options`` overriding its reference defaults.

  Args:
    name: a registered name (:func:`names`), or ``critical_<base>``, ``critical_adakv_<base>``,
      ``chunkkv_<base>``, ``think_<base>`` over a registered prefill scorer.
    **options: the policy's options, validated when it is built. Every policy also accepts
      ``num_kv_heads``, ``gqa``, ``channel_ratio``, and every prefill scorer ``decode_every``
      (:class:`Policy`).

  Returns:
    A frozen :class:`Policy` named ``name``.

  Raises:
    ValueError: an unknown name, an option the policy does not take, a value it refuses, or a
      factory that returns something other than a :class:`Policy`.
  """
  f = factory(name)
  known = accepted(f)
  if known is not None:
    _check_options(name, known, options)
  policy = _call(f, name, options)
  if not isinstance(policy, Policy):
    raise ValueError(f"factory: {name!r} returned {type(policy).__name__}, expected a Policy")
  return dataclasses.replace(policy, name=name) if policy.name != name else policy


def build(policy: Policy | str, **options) -> Policy:
  """A policy object from a policy or a name (what every entry point calls once).

  Args:
    policy: a :class:`Policy`, or a name for :func:`make`.
    **options: options for :func:`make` (only with a name: an object carries its own).

  Returns:
    The policy.

  Raises:
    ValueError: options given with a policy object, or what :func:`make` refuses.
  """
  if isinstance(policy, Policy):
    if options:
      raise ValueError(
        f"options: {sorted(options)} given with a policy object {policy.label!r}; set them on "
        "the object (dataclasses.replace) or pass the policy by name"
      )
    return policy
  return make(policy, **options)


_BUILTIN = {name: Preset(**preset) for name, preset in builtins.PRESETS.items()}
REGISTRY.update(_BUILTIN)
# The built-in factories, read-only (a user may re-register a name with overwrite=True; this
# still tells the built-in apart).
BUILTIN: Mapping[str, Callable[..., Policy]] = types.MappingProxyType(dict(_BUILTIN))
for _name in builtins.LISTED_WRAPPERS:
  REGISTRY[_name] = _wrapped(_name)
# every name registered by kvjax itself, with its factory (unregister refuses to remove them)
_BUILTIN_NAMES: dict[str, Callable[..., Policy]] = dict(REGISTRY)


def doc(name: str) -> str:
  """One line on policy ``name`` (its preset's, or its class's docstring).

  Args:
    name: a policy name (:func:`factory`).

  Returns:
    The line (empty for a factory without a docstring).

  Raises:
    ValueError: ``name`` is unknown.
  """
  f = factory(name)
  if isinstance(f, Preset):
    return f.doc or (f.cls.__doc__ or "").strip().split("\n")[0]
  return (getattr(f, "__doc__", None) or "").strip().split("\n")[0]


def describe(name: str) -> dict[str, Any]:
  """Policy ``name``'s defaults as flat options.

  Args:
    name: a policy name (:func:`make`).

  Returns:
    The options :func:`make` takes to rebuild it (:attr:`Policy.options`).

  Raises:
    ValueError: ``name`` is unknown.
  """
  return make(name).options
