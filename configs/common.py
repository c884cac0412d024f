"""What every config file shares: the parser of ``--config=configs/x.py:ARG``.

Modelled on big_vision's ``big_vision/configs/common.py`` (``parse_arg``): ``ARG`` is a
comma-separated list of ``key=value`` pairs and bare words, typed by the defaults given.
"""

import ml_collections


def _typed(key: str, text: str, default):
  if isinstance(default, bool):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"config: {key}={text!r} is not a boolean; expected true or false")
    return text.lower() in ("true", "1")
  try:
    return type(default)(text)
  except ValueError:
    raise ValueError(
      f"config: {key}={text!r} is not a {type(default).__name__} (the type of its default)"
    ) from None


def parse_arg(
  arg: str | None, *, presets: tuple[str, ...] = (), **spec
) -> ml_collections.ConfigDict:
  """``ARG`` of ``--config=file.py:ARG`` as a ConfigDict of ``spec``'s fields (their defaults
  give the types), plus ``preset``.

  * ``key=value`` sets a field of ``spec`` (cast to its default's type);
  * a bare word that names a boolean field of ``spec`` sets it to ``True``;
  * any other bare word must be one of ``presets`` and becomes ``preset`` (one at most).

  So ``:quick``, ``:needle_qa``, ``:quick,needle_qa`` and ``:examples=16`` all parse. Anything
  else raises ``ValueError`` naming the word and what was expected.
  """
  out = ml_collections.ConfigDict(dict(spec, preset=""))
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, eq, text = part.partition("=")
    if eq:
      if key not in spec:
        raise ValueError(f"config: unknown argument {key!r}; expected one of {sorted(spec)}")
      out[key] = _typed(key, text, spec[key])
    elif isinstance(spec.get(part), bool):
      out[part] = True
    elif part in presets and not out.preset:
      out.preset = part
    else:
      flags = sorted(k for k, v in spec.items() if isinstance(v, bool))
      raise ValueError(
        f"config: unknown preset {part!r} (or a second one); expected one of presets "
        f"{tuple(presets)}, flags {flags} or key=value for {sorted(spec)}"
      )
  return out
