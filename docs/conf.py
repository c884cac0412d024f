"""Sphinx configuration of kvjax's documentation (myst-nb and sphinx-book-theme, as optax,
flax and penzai build theirs).

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``. The build generates the
methods catalogue from the policy registry, the API pages and the lab's interactive page
(``_static/lab.html``, from stored data), and renders the notebooks' stored runs
(``docs/notebooks/``); it executes nothing (``docs/pages.py`` refreshes what is stored).
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # configs/ and experiments/ live at the repository root
sys.path.insert(0, str(ROOT / "docs"))

import pages  # noqa: E402  (docs/pages.py, after the path above)

from kvjax import policies  # noqa: E402

project = "kvjax"
author = "the kvjax authors"
copyright = "2026, the kvjax authors"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

# methods_catalogue.md is included by methods.md, not a page of its own
exclude_patterns = ["_build", "**.ipynb_checkpoints", "methods_catalogue.md"]
html_theme = "sphinx_book_theme"
html_title = "kvjax"
html_static_path = ["_static"]
html_css_files = ["kvjax.css"]  # nothing cut off at a 1280 px window
html_theme_options = {
  "repository_url": "https://github.com/kvjax/kvjax",
  "use_repository_button": True,
  "show_toc_level": 2,
  # The sidebar expands the current page's branch only: the API reference's hundred module
  # pages stay out of every other page's navigation (rendering the whole tree on each of ~300
  # pages was most of the build's time).
  "collapse_navbar": True,
}
# A first visit (no mode stored in the browser yet) starts in the reader's system mode, without
# the theme's console error about an empty mode.
html_context = {"default_mode": "auto"}
# The highlighted source pages need no navigation tree of their own.
html_sidebars = {"_modules/**": []}

myst_enable_extensions = ["colon_fence", "dollarmath", "substitution"]
myst_heading_anchors = 3
# Counts the pages state, read from the registry so that they cannot go stale.
myst_substitutions = {"num_policies": len(policies.names())}

# The notebooks' pages are stored runs (docs/pages.py runs them under papermill from notebooks/,
# as a user would), never executed by the build.
nb_execution_mode = "off"

autosummary_generate = False  # docs/pages.py writes the pages: each object documented once
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # dataclass fields are members already: no second attribute entry
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]


# A field naming several things ("keys, values: the outputs", Google style) would reach Sphinx as
# ":ivar keys, values:", which it reads as the type "keys," of "values" and links.
_SHARED_FIELD = re.compile(r"^(\s*:(?:ivar|param|var|cvar) )([\w*]+(?:, [\w*]+)+):")


def _join_shared_fields(app, what, name, obj, options, lines):
  """Writes such a field's names without spaces, so that none of them reads as a type."""
  del app, what, name, obj, options
  lines[:] = [_SHARED_FIELD.sub(lambda m: m[1] + m[2].replace(", ", ",") + ":", x) for x in lines]


# viewcode links each source module back to one name it was documented under (a package that
# re-exports its objects, say), so a link from a module's source to an object documented on the
# module's own page would name an anchor that page does not have.
_SOURCE_LINK = re.compile(r'href="([^"#]*_autosummary/([\w.]+)\.html)#([\w.]+)"')


def _anchor_on_page(page: str, anchor: str, modules: frozenset[str]) -> str:
  """``anchor`` (a module name, then an object's qualified name) as ``page`` names it."""
  parts = anchor.split(".")
  for k in range(len(parts) - 1, 0, -1):
    if ".".join(parts[:k]) in modules:
      return f"{page}.{'.'.join(parts[k:])}"
  return anchor


@functools.cache
def _api_modules() -> frozenset[str]:
  return frozenset(pages.api_members())


def _link_source_to_pages(app, pagename, templatename, context, doctree):
  """Points each source page's links at the anchors of the pages that document the objects."""
  del app, templatename, doctree
  if not pagename.startswith("_modules/") or "body" not in context:
    return
  modules = _api_modules()
  context["body"] = _SOURCE_LINK.sub(
    lambda m: f'href="{m[1]}#{_anchor_on_page(m[2], m[3], modules)}"', context["body"]
  )


def setup(app):
  """Writes the generated pages before Sphinx reads the sources."""
  pages.prepare()
  app.connect("autodoc-process-docstring", _join_shared_fields, priority=600)  # after napoleon
  app.connect("html-page-context", _link_source_to_pages)
