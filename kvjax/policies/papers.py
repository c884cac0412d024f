"""Where each registered method comes from: its paper, the reference code kvjax follows, and the
differences from that code that kvjax names. A built-in name states them in its registration
(:data:`kvjax.policies.builtins.PRESETS`, :class:`~kvjax.policies.builtins.Provenance`), a
wrapper prefix beside its wrapper class (:data:`kvjax.policies.builtins.WRAPPERS`). The
documentation's methods catalogue is generated from these and the registry, so a registered name
without a provenance is visible there.

A user's policy class states its own with the class attributes ``paper``, ``code`` and
``differs`` (strings); :func:`provenance` reads them.
"""

from __future__ import annotations

from kvjax.policies import builtins, registry


def provenance(name: str) -> dict[str, str]:
  """The paper, the reference code followed and the named differences of policy ``name``.

  Read from the name's registration (a built-in's preset), else its wrapper prefix (with the
  base's differences), else the class attributes ``paper``, ``code`` and ``differs``.

  Args:
    name: a registered policy name (or a wrapper of one, e.g. ``critical_snapkv``).

  Returns:
    A dict with ``paper``, ``code`` and ``differs`` (empty strings where there is none: a
    baseline, or a user's policy that does not say).

  Raises:
    ValueError: ``name`` is not registered.
  """
  factory = registry.factory(name)  # raises for an unknown name
  if isinstance(factory, registry.Preset) and factory.provenance is not None:
    return factory.provenance.as_dict()
  for prefix, (_, source) in builtins.WRAPPERS.items():
    base = name.removeprefix(prefix)
    if base != name and registry.is_registered(base):
      own = provenance(base)
      return dict(
        paper=source.paper,
        code=source.code,
        differs=f"{source.differs}; the base `{base}`: {own['differs'] or '—'}",
      )
  cls = getattr(factory, "cls", factory)
  return {key: str(getattr(cls, key, "") or "") for key in ("paper", "code", "differs")}
