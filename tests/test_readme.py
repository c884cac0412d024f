"""The README and the documentation's landing page say the same thing about kvjax's breadth."""

import pathlib
import re

from fresh_registry import builtin_policy_names

from kvjax import policies

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _breadth(text: str) -> str:
  return next(line for line in text.splitlines() if line.startswith("| breadth |"))


def test_readme_and_landing_page_agree_on_breadth():
  readme = _breadth((ROOT / "README.md").read_text())
  index = _breadth((ROOT / "docs" / "index.md").read_text())
  count = len(builtin_policy_names())  # tests here may have registered their own
  assert re.search(rf"\b{count} registered policies", readme), (count, readme[:80])
  assert index.replace("{{ num_policies }}", str(count)) == readme


def test_kvpress_presses_are_counted_as_kvpress_0_5_5_has_them():
  # kvpress 0.5.5 exports 46 *Press classes; BasePress and ScorerPress are bases, not methods
  # (RestoreKVPress is one of the 44: docs/restorekv.md)
  assert "all 44 of kvpress's presses" in _breadth((ROOT / "README.md").read_text())
  assert "restorekv" in policies.names()
