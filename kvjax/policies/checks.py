"""Option checks every policy's ``__post_init__`` uses: each raises a ``ValueError`` naming the
option, the value and what was expected."""

from __future__ import annotations

from kvjax import checks, select


def check_int(key: str, value, low: int) -> None:
  """Checks that an option is an int in ``[low, 2**31)``.

  Args:
    key: the option's name, for the error.
    value: the value given.
    low: the smallest value accepted.

  Raises:
    ValueError: ``value`` is not an int (a numpy integer is one, a bool is not) or lies
      outside ``[low, 2**31)``.
  """
  if not checks.is_int(value) or not low <= value < select.INT32_LIMIT:
    raise ValueError(f"{key}: expected an int >= {low}, got {value!r}")


def check_bool(key: str, value) -> None:
  """Checks that an option is a bool.

  Args:
    key: the option's name, for the error.
    value: the value given.

  Raises:
    ValueError: ``value`` is not a bool.
  """
  if not isinstance(value, bool):
    raise ValueError(f"{key}: expected a bool, got {value!r}")


def check_choice(key: str, value, choices, policy: str = "") -> None:
  """Checks that an option is one of its choices.

  Args:
    key: the option's name, for the error.
    value: the value given.
    choices: the values accepted.
    policy: the policy's label, named in the error (empty: none named).

  Raises:
    ValueError: ``value`` is not in ``choices``.
  """
  if value not in choices:
    of = f" for {policy!r}" if policy else ""
    raise ValueError(f"{key}: unknown value {value!r}{of}; expected one of {choices}")


def check_window(value, policy: str) -> None:
  """Checks a ``window`` option: ``None`` (the rows' own ``W``) or an int in ``[1, 2**31)``.

  Args:
    value: the value given.
    policy: the policy's label, named in the error.

  Raises:
    ValueError: ``value`` is neither ``None`` nor an int in ``[1, 2**31)``.
  """
  if value is not None and (not checks.is_int(value) or not 1 <= value < select.INT32_LIMIT):
    raise ValueError(f"window: expected None or an int >= 1 for {policy!r}, got {value!r}")
