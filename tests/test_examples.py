"""The code examples of the README and the documentation run as written: every fenced ```python
block of a page, in order, in one shared namespace (as a reader pastes them one after another
into one session), from the repository root, with matplotlib on the Agg backend. One test per
page with python blocks; ``docs/methods_catalogue.md`` is generated. What cannot run here (a
checkpoint's path, an 8-device mesh) is a comment beside the runnable default, or a ```bash or
plain ``` block.
"""

import os
import pathlib
import re
import sys
import time
import traceback
import types

import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.lab import grid

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
  """The page's ```python blocks as ``(first code line, 1-based; code)``, in page order."""
  text = path.read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


PAGES = [p for p in PAGES if p.name != "methods_catalogue.md" and python_blocks(p)]
_LOADED = {}  # km.load's models, shared by the pages (SmolLM2's GGUF takes ~10 s to read)


def _load_once(path, *args, **kwargs):
  key = (str(path), args, tuple(sorted(kwargs.items())))
  if key not in _LOADED:
    _LOADED[key] = _real_load(path, *args, **kwargs)
  return _LOADED[key]


_real_load = km.load


def test_blocks_are_found():
  assert {p.name for p in PAGES} >= {"README.md", "getting_started.md", "write_your_own.md"}
  readme = python_blocks(ROOT / "README.md")
  line, code = readme[0]
  assert (ROOT / "README.md").read_text().splitlines()[line - 1] == code.splitlines()[0]


@pytest.fixture
def page_session(monkeypatch):
  """The repository root as working directory and import path, matplotlib on Agg, and the
  policies, schedules and head allocations a page registers removed afterwards."""
  monkeypatch.chdir(ROOT)
  monkeypatch.syspath_prepend(str(ROOT))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  if "matplotlib" in sys.modules:
    sys.modules["matplotlib"].use("Agg")
  monkeypatch.setattr(km, "load", _load_once)
  names = set(policies.names())
  allocs = {axis: set(v) for axis, v in grid._VOCABULARY.items()}
  yield
  for name in set(policies.names()) - names:
    policies.unregister(name)
  for name in set(grid._VOCABULARY["schedule"]) - allocs["schedule"]:
    grid.unregister_schedule(name)
  for name in set(grid._VOCABULARY["head_alloc"]) - allocs["head_alloc"]:
    grid.unregister_head_alloc(name)
  try:
    import matplotlib.pyplot as plt

    plt.close("all")
  except ImportError:
    pass


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, page_session):
  blocks = python_blocks(page)
  name = f"_example_{page.stem}"
  module = types.ModuleType(name)  # a module, so dataclasses and pickling find the classes
  module.__file__ = str(page)
  sys.modules[name] = module
  start = time.perf_counter()
  try:
    for k, (line, code) in enumerate(blocks):
      # padded so that a traceback names the page and its own line numbers
      source = compile("\n" * (line - 1) + code, str(page), "exec")
      failure = None
      try:
        exec(source, module.__dict__)
      except Exception as e:  # the page's traceback, from its own frame down
        failure = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
      if failure:
        pytest.fail(f"{page.name}, block {k + 1} (line {line}):\n{failure}", pytrace=False)
  finally:
    del sys.modules[name]
  took = time.perf_counter() - start
  print(f"{page.name}: {len(blocks)} blocks in {took:.1f} s", file=sys.stderr)
  assert os.getcwd() == str(ROOT), f"{page.name}'s examples changed the working directory"
