"""The documentation site, built once for this module (``sphinx-build -W``: warnings are errors)
and read as a newcomer would: every internal link and anchor resolves, and in headless Chromium
at a 1280 px window no page is wider than the window, no code block is cut off, every image
loads and nothing logs an error (external resources, which an offline machine cannot reach,
aside)."""

import html
import os
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import pytest
from fresh_registry import builtin_policy_names

pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WINDOW = {"width": 1280, "height": 900}
EXTERNAL = ("http:", "https:", "mailto:", "javascript:", "data:")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  """The built site's folder."""
  pytest.importorskip("sphinx", reason="needs the docs packages: pip install -e '.[docs]'")
  out = tmp_path_factory.mktemp("site") / "html"
  build = subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    env={**os.environ, "MPLBACKEND": "Agg"},
  )
  assert build.returncode == 0, build.stderr[-4000:]
  return out


def _pages(site: pathlib.Path) -> list[pathlib.Path]:
  """The site's HTML pages (the lab page in ``_static`` is tested in tests/test_explorer.py)."""
  return sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts)


def test_the_build_renders_the_stored_runs_the_lab_and_the_catalogue(site):
  for path in NOTEBOOKS:
    page = (site / "notebooks" / f"{path.stem}.html").read_text()
    assert "<img" in page and "_images/" in page, f"{path.name}: no figure on its page"
  assert (site / "_static" / "lab.html").stat().st_size > 1_000_000  # plotly.js and the data
  methods = (site / "methods.html").read_text()
  for name in builtin_policy_names():  # tests here may have registered their own
    assert f"policy-{name.replace('_', '-')}" in methods, name


# Sphinx writes every attribute in double quotes: a regular expression reads a page's anchors
# and links many times faster than an HTML parser.
_ATTRIBUTE = re.compile(r'\s(id|name|href|src)="([^"]*)"')


class _Page:
  """A page's anchors (``id`` and ``name`` attributes) and the links and sources it holds."""

  def __init__(self, path: pathlib.Path):
    self.anchors, self.links = set(), []
    for key, value in _ATTRIBUTE.findall(path.read_text(errors="replace")):
      if value:
        (self.anchors.add if key in ("id", "name") else self.links.append)(html.unescape(value))


def test_no_internal_link_or_anchor_is_broken(site):
  parsed = {p: _Page(p) for p in _pages(site)}
  broken = []
  for path, page in parsed.items():
    for link in page.links:
      if link.startswith(EXTERNAL) or link.startswith("//"):
        continue
      parts = urllib.parse.urlsplit(link)
      target = (path.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else path
      if target.is_dir():
        target = target / "index.html"
      where = f"{path.relative_to(site)}: {link}"
      if not target.exists():
        broken.append(f"{where} (no file)")
      elif parts.fragment and target.suffix == ".html":
        anchors = (parsed.get(target) or _Page(target)).anchors
        if urllib.parse.unquote(parts.fragment) not in anchors:
          broken.append(f"{where} (no anchor)")
  assert not broken, f"{len(broken)} broken links, the first: " + "\n".join(broken[:30])


# What each page reports: how wide it is against the window, the code blocks and printed text
# wider than their box (values shown as text, a data frame's, scroll in theirs by design) and
# the local images that did not load.
_MEASURE = """async () => {
  const local = (img) => !/^(https?:)?\\/\\//.test(img.getAttribute("src") || "");
  const images = [...document.images].filter(local);
  await Promise.all(images.map((img) => { img.loading = "eager"; return img.decode().catch(() => {}); }));
  return {
    width: document.documentElement.scrollWidth,
    window: document.documentElement.clientWidth,
    clipped: [...document.querySelectorAll(".bd-article div.highlight pre")]
      .filter((pre) => !pre.closest(".text_plain") && pre.scrollWidth > pre.clientWidth + 1)
      .map((pre) => pre.textContent.slice(0, 60)),
    unloaded: images.filter((img) => !(img.complete && img.naturalWidth > 0))
      .map((img) => img.getAttribute("src")),
  };
}"""


def _local_error(message) -> bool:
  """A console error that is the site's own: not an external resource the machine may not
  reach (a badge, a font)."""
  url = (message.location or {}).get("url", "")
  return message.type == "error" and not url.startswith(("http:", "https:"))


@pytest.mark.skipif(
  CHROMIUM is None, reason="needs a browser: apt-get install chromium (Debian's package)"
)
def test_every_page_fits_the_window_and_loads_cleanly(site):
  """One Chromium, every page at a 1280 px window."""
  sync_api = pytest.importorskip("playwright.sync_api", reason="needs pip install playwright")
  problems = []
  with sync_api.sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_page(viewport=WINDOW)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if _local_error(m) else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    for path in _pages(site):
      errors.clear()
      page.goto(path.as_uri(), wait_until="load")
      seen = page.evaluate(_MEASURE)
      name = path.relative_to(site)
      if seen["width"] > seen["window"]:
        problems.append(f"{name}: {seen['width']} px wide at a {seen['window']} px window")
      problems += [f"{name}: code cut off: {c!r}" for c in seen["clipped"]]
      problems += [f"{name}: image not loaded: {src}" for src in seen["unloaded"]]
      problems += [f"{name}: console: {e}" for e in errors]
    browser.close()
  assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
