"""The front door: the README's size, no page narrating history, a catalogue that lists the
registry, no reference to a document the repository lacks. (The Sphinx build itself runs in
``tests/test_notebooks.py``, after the notebooks it renders.)"""

import importlib
import pathlib
import re
import sys

import pytest

from kvjax import policies

pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import catalogue  # noqa: E402  (docs/catalogue.py)

PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [p for p in PAGES if p.name != "methods_catalogue.md"]

# Phrases that date a number relative to earlier work or an earlier machine.
HISTORY = re.compile(
  r"this session|previous session|next session|earlier machine|later machine|the one after|"
  r"on the latest|the previous model|the previous engine|previous one's|at this session|"
  r"tried and dropped|was \d[\d.,]* ?(?:ms|s|GiB|MiB|×|x)\b|\bbefore: |no longer|used to be",
  re.IGNORECASE,
)


def test_readme_is_short():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 220, f"README.md has {len(lines)} lines; the front door keeps <= 220"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_no_page_narrates_history(path):
  found = [m.group(0) for m in HISTORY.finditer(path.read_text())]
  assert not found, f"{path.name} dates numbers against earlier work: {found}"


def test_catalogue_lists_every_registered_policy():
  text = catalogue.markdown()
  listed = re.findall(r"^## `([a-z0-9_]+)`$", text, re.MULTILINE)
  assert listed == list(policies.names())


def test_catalogue_names_the_paper_and_code_of_every_method():
  baselines = {"full", "sliding_window", "oracle"}
  for name in policies.names():
    entry = catalogue.entry(name)
    if name not in baselines:
      assert entry["code"] != "—", name
      assert entry["paper"] != "—" or name == "random", name


def test_a_users_policy_enters_the_catalogue_with_its_own_provenance():
  import dataclasses

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Mine(policies.KNorm):
    """My key-norm variant."""

    paper = "Me et al., My Method (arXiv 0000.00000)"
    code = "me/my-method `score.py`"

  policies.register("mine_for_the_catalogue", Mine)
  try:
    entry = catalogue.entry("mine_for_the_catalogue")
    assert entry["paper"] == Mine.paper and entry["code"] == Mine.code
    assert entry["summary"] == "My key-norm variant."
    assert "## `mine_for_the_catalogue`" in catalogue.markdown()
  finally:
    policies.unregister("mine_for_the_catalogue")


def test_no_file_cites_a_design_document_the_repository_lacks():
  tracked = [
    p
    for p in ROOT.rglob("*")
    if p.is_file()
    and p.suffix in (".py", ".md", ".toml", ".yaml")
    and not any(part in (".venv", "_build", "_autosummary", "runs") for part in p.parts)
    and p != pathlib.Path(__file__)
  ]
  for path in tracked:
    text = path.read_text(errors="replace")
    assert "DESIGN.md" not in text, f"{path.relative_to(ROOT)} cites DESIGN.md (docs/concepts.md)"
    assert "ALGORITHMS.md" not in text, (
      f"{path.relative_to(ROOT)} cites ALGORITHMS.md (docs/methods.md)"
    )
    assert "../shared/" not in text, f"{path.relative_to(ROOT)} points outside the repository"


def _public_functions(package_names):
  import importlib
  import inspect
  import pkgutil

  modules = []
  for name in package_names:
    module = importlib.import_module(name)
    modules.append(module)
    if hasattr(module, "__path__"):
      modules += [
        importlib.import_module(f"{name}.{m.name}") for m in pkgutil.iter_modules(module.__path__)
      ]
  for module in modules:
    for fname, f in vars(module).items():
      if not fname.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__:
        yield f"{module.__name__}.{fname}", f, inspect.signature(f)


def test_public_functions_of_the_core_and_the_model_have_args_and_returns():
  """Google style, as optax: every public function of ``select``, ``scores``, ``budgets``,
  ``policies`` and ``kvjax.model`` has ``Args:`` (when it takes any) and ``Returns:`` (unless it
  returns ``None``)."""
  packages = ["kvjax.select", "kvjax.scores", "kvjax.budgets", "kvjax.policies", "kvjax.model"]
  missing = []
  for name, f, sig in _public_functions(packages):
    doc = f.__doc__ or ""
    if sig.parameters and "Args:" not in doc:
      missing.append(f"{name} (Args)")
    if sig.return_annotation not in (None, "None") and not ("Returns:" in doc or "Yields:" in doc):
      missing.append(f"{name} (Returns)")
  assert not missing, missing


def test_the_main_jobs_tables_are_narrow_and_define_their_columns(capsys):
  """``python -m experiments.lab`` prints one policy x scenario table per metric, each under its
  definition, no line wider than a terminal of 100 columns."""
  import pandas as pd

  from experiments import lab as main_job
  from kvjax import lab

  rows = [
    dict(scenario=s, policy=p, retained_mass=0.5, oracle_gap=0.1, output_error=0.2, fact_recall=1)
    for s in ("streaming_chat", "needle_qa", "diffuse", "topic_drift", "funnel")
    for p in ("sliding_window", "streaming_llm", "adakv_snapkv", "oracle")
  ]
  main_job.print_tables(lab.pivot(pd.DataFrame(rows)))
  out = capsys.readouterr().out
  assert max(len(line) for line in out.splitlines()) <= 100, out
  for metric in ("retained_mass", "oracle_gap", "output_error", "fact_recall"):
    assert re.search(rf"^{metric}: \w", out, re.MULTILINE), metric
  assert "(R above;" in out  # the progress lines name R


def test_the_api_reference_documents_every_object_once():
  """``docs/pages.py`` writes the API pages: each class and function on one page only (its
  package's when the package exports it), the other modules that offer it linking there."""
  import pages

  members = pages.api_members()
  homes = {}
  for module, (own, _) in members.items():
    for name in own:
      obj = getattr(importlib.import_module(module), name)
      assert id(obj) not in homes, f"{module}.{name} is also documented as {homes[id(obj)]}"
      homes[id(obj)] = f"{module}.{name}"
  assert "SnapKV" in members["kvjax.policies"][0]
  assert "kvjax.policies.SnapKV" in members["kvjax.policies.methods"][1]
  assert not members["kvjax.policies.methods"][0]  # every method class is exported
  for module, (_, elsewhere) in members.items():
    for full in elsewhere:
      assert full in homes.values(), f"{module} links {full}, which no page documents"


def test_the_catalogue_links_arxiv_ids_and_repositories():
  text = catalogue.markdown()
  ids = set(re.findall(r"arXiv (\d{4}\.\d{4,5})", text))
  assert ids and all(f"(https://arxiv.org/abs/{i})" in text for i in ids)
  assert "[FasterDecoding/SnapKV](https://github.com/FasterDecoding/SnapKV)" in text
  assert catalogue.linked("`a/b.py` of me/mine") == "`a/b.py` of me/mine"  # paths stay code
