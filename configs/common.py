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


def _unknown_field(error: Exception) -> ValueError:
  """The ``ValueError`` naming the ``--config.`` override behind ml_collections' bare
  ``AttributeError: "'foo'"`` (a field the config lacks)."""
  import re  # noqa: PLC0415
  import sys  # noqa: PLC0415

  text = str(error)
  names = re.findall(r"[A-Za-z_]\w*", text)
  name = names[0] if names else text
  hint = re.search(r'Did you mean "([^"]+)"', text)
  given = [a for a in sys.argv[1:] if a.startswith("--config.") and name in a.split("=")[0]]
  flag = given[0].split("=")[0] if given else f"--config.{name}"
  return ValueError(
    f"{flag}: the config has no field {name!r}"
    + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
    + "; expected a field of the config file (check the spelling, and the nesting: "
    "--config.heatmap.budget=...)"
  )


def config_flag(default_file: str, help_text: str = "Configuration.", **kwargs):
  """``config_flags.DEFINE_config_file("config", default_file, ...)`` of the entry points, with a
  mistyped override named: ``--config.foo=1`` for a field the config lacks raises ``ValueError``
  naming ``--config.foo`` (ml_collections raises a bare ``AttributeError: "'foo'"``). The flag
  may read the command line when it is defined; :func:`parse_flags` covers the later parse."""
  from ml_collections import config_flags  # noqa: PLC0415

  try:
    return config_flags.DEFINE_config_file("config", default_file, help_text, **kwargs)
  except (AttributeError, KeyError) as e:
    raise _unknown_field(e) from None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parser (``app.run(main, flags_parser=common.parse_flags)``), naming a
  ``--config.`` override of a field the config lacks (see :func:`config_flag`)."""
  from absl import app  # noqa: PLC0415

  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    raise _unknown_field(e) from None


def define_distributed_flags():
  """Defines the flags of a run of several processes (once per program) and returns absl's
  ``flags.FLAGS``, which ``kvjax.distributed.maybe_initialize`` reads: ``--distributed``
  (auto | on | off), ``--coordinator`` (host:port of process 0), ``--num_processes``,
  ``--process_id``, ``--heartbeat_timeout`` and ``--initialization_timeout`` (seconds). Each
  left unset falls back to its environment variable (``KVJAX_COORDINATOR``, ...), then its
  default (``kvjax.distributed.settings``)."""
  from absl import flags  # noqa: PLC0415

  if "coordinator" not in flags.FLAGS:
    flags.DEFINE_enum(
      "distributed",
      None,
      ["auto", "on", "off"],
      "Several processes: auto (initialise under SLURM, a multi-host TPU slice, mpirun or an "
      "explicit --coordinator), on (always; JAX detects the cluster), off (one process).",
    )
    flags.DEFINE_string("coordinator", None, "host:port of process 0 (with the two below).")
    flags.DEFINE_integer("num_processes", None, "Number of processes of the run.")
    flags.DEFINE_integer("process_id", None, "This process's index, 0 <= id < num_processes.")
    flags.DEFINE_integer(
      "heartbeat_timeout", None, "Seconds of missed heartbeats before a peer counts as dead."
    )
    flags.DEFINE_integer(
      "initialization_timeout", None, "Seconds to wait for every process to connect."
    )
  return flags.FLAGS
