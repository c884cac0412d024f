"""The lab's interactive page: its data agree with the lab, and it works in a real browser."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import lab as lab_config
from kvjax.lab import explorer, metrics, online, suite, synthetic

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "docs"))
import pages  # noqa: E402  (docs/pages.py)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def tiny_config():
  c = lab_config.get_config("quick")
  c.world.update(num_layers=2, num_heads=2, prompt_len=96, gen_steps=12, window=8)
  c.scenarios = ("needle_qa", "streaming_chat")
  c.policies = ("sliding_window", "snapkv", "pyramidkv")
  c.budget = 24
  c.explorer_budgets = (18, 24, 36)
  return c


@pytest.fixture(scope="module")
def data():
  c = tiny_config()
  return explorer.explorer_data(c, suite.validate_config(c), focus="snapkv", log=lambda *_: None)


def test_data_match_the_lab(data):
  c = tiny_config()
  assert data["budgets"] == [18, 24, 36]
  assert data["default_budget"] == 24
  world = synthetic.make_world(synthetic.world_config("needle_qa", c.world))
  evidence = online.prompt_evidence(world, jax.random.key(c.world.seed))
  for name, policy in suite.build_policies(c).items():
    trace = online.simulate(world, policy, 36, evidence=evidence)
    summary = metrics.summarize(trace.metrics)
    entry = data["scenarios"]["needle_qa"]["budgets"]["36"]
    assert entry["mean"][name] == pytest.approx(summary["retained_mass"], abs=1e-4)
    np.testing.assert_allclose(
      entry["mass"][name], np.asarray(trace.metrics.retained).mean((1, 2)), atol=6e-4
    )  # the page keeps three significant digits
    np.testing.assert_allclose(entry["layer"][name], summary["retained_mass_L"], atol=6e-4)


def test_maps_and_rows_are_consistent(data):
  levels = data["map_levels"]
  for sc in data["scenarios"].values():
    S = len(sc["steps"])
    assert len(sc["row"]) == len(sc["active"]) == S
    assert all(f in range(sc["prompt_len"]) for f in sc["facts"])
    for b, entry in sc["budgets"].items():
      assert len(entry["kept"]) == S
      kept, row = np.asarray(entry["kept"]), np.asarray(sc["row"])
      assert (kept <= row * 1.06 + 1e-9).all()  # the kept part of a row is part of it (2 digits)
      for maps in entry["map"].values():
        cells = np.array([[ord(ch) - 48 for ch in m] for m in maps])
        assert cells.min() >= 0 and cells.max() <= levels
        # every (layer, head) row holds at most `budget` positions: the map's column sum agrees
        assert (cells.sum(1) / levels * sc["bin"] <= int(b) * 1.5 + sc["bin"]).all()


def test_budget_grid_refuses_budgets_a_policy_cannot_run():
  c = tiny_config()
  built = suite.validate_config(c)
  c.explorer_budgets = ()
  assert explorer.budget_grid(c, built) == (18, 24, 48)  # 3/4, 1 and 2 budgets
  c.explorer_budgets = (8, 24)  # snapkv's window is 8: a budget of 8 keeps nothing selected
  with pytest.raises(ValueError, match="explorer_budgets: 8"):
    explorer.budget_grid(c, built)
  c.explorer_budgets = (24, 10_000)
  with pytest.raises(ValueError, match="explorer_budgets: 10000"):
    explorer.budget_grid(c, built)
  c.explorer_budgets = (32, 24, 32)
  assert explorer.budget_grid(c, built) == (24, 32)


def test_focus_must_be_a_policy_run():
  c = tiny_config()
  with pytest.raises(ValueError, match="focus: 'tova'"):
    explorer.explorer_data(c, suite.validate_config(c), focus="tova")


def test_page_is_self_contained(data, tmp_path):
  from plotly.offline import get_plotlyjs

  page = pathlib.Path(explorer.write_html(data, tmp_path / "lab.html")).read_text()
  assert get_plotlyjs() in page  # plotly.js inlined: the page works offline
  rest = page.replace(get_plotlyjs(), "")
  assert "src=" not in rest and "http" not in rest
  start = page.index("const DATA = ") + len("const DATA = ")
  assert json.loads(page[start : page.index(";\nconst $")]) == data


@pytest.mark.docs
@pytest.mark.skipif(
  CHROMIUM is None, reason="needs a browser: apt-get install chromium (Debian's package)"
)
def test_page_in_a_browser(data, tmp_path):
  sync_api = pytest.importorskip("playwright.sync_api", reason="needs pip install playwright")
  path = explorer.write_html(data, tmp_path / "lab.html")
  errors = []
  with sync_api.sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(pathlib.Path(path).as_uri())
    page.wait_for_selector("#map .main-svg")
    shots = [page.screenshot()]
    page.select_option("#scenario", "streaming_chat")
    page.wait_for_timeout(300)
    shots.append(page.screenshot())
    page.fill("#budget", "2")  # the largest budget of the grid
    page.dispatch_event("#budget", "input")
    page.wait_for_timeout(300)
    shots.append(page.screenshot())
    budget_shown = page.inner_text("#budget-value")
    browser.close()
  assert errors == []
  assert budget_shown == "36"
  assert shots[0] != shots[1] and shots[1] != shots[2]  # each control redraws the picture


def test_the_main_job_writes_the_page(tmp_path):
  """``python -m experiments.lab`` writes ``lab.html`` beside its tables and figures."""
  root = pathlib.Path(__file__).resolve().parents[1]
  workdir = tmp_path / "lab"
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.lab",
      "--config=configs/lab.py:quick",
      "--config.scenarios=('needle_qa',)",
      "--config.policies=('sliding_window','snapkv')",
      "--config.world.num_layers=1",
      "--config.world.prompt_len=96",
      "--config.world.gen_steps=8",
      "--config.world.window=8",
      "--config.budget=24",
      "--config.explorer_budgets=(16,24)",
      f"--config.workdir={workdir}",
    ],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "MPLBACKEND": "Agg"},
  )
  assert run.returncode == 0, run.stderr[-3000:]
  page = (workdir / "lab.html").read_text()
  start = page.index("const DATA = ") + len("const DATA = ")
  data = json.loads(page[start : page.index(";\nconst $")])
  assert data["budgets"] == [16, 24] and list(data["scenarios"]) == ["needle_qa"]
  assert (workdir / "summary.csv").exists()


def test_the_documentation_stores_the_quick_labs_page():
  """The documentation's lab page is written from stored data (``python docs/pages.py lab``):
  those of ``configs/lab.py:quick``, its policies, scenarios and budgets."""
  c = lab_config.get_config(pages.LAB_CONFIG)
  built = suite.validate_config(c)
  stored = pages.read_lab_data()
  assert stored["policies"] == list(built)
  assert list(stored["scenarios"]) == list(c.scenarios)
  assert stored["budgets"] == list(explorer.budget_grid(c, built))
  assert stored["focus"] == explorer.focus_policy(c, built)


@pytest.mark.slow  # a scenario of the quick lab over three budgets: about 25 s on 2 cores
def test_the_stored_lab_data_are_the_labs():
  """The first scenario of the stored data, computed again, agrees with it."""
  c = lab_config.get_config(pages.LAB_CONFIG)
  c.scenarios = c.scenarios[:1]
  data = explorer.explorer_data(c, suite.validate_config(c), log=lambda *_: None)
  stored = pages.read_lab_data()
  (name,) = data["scenarios"]
  for budget, entry in data["scenarios"][name]["budgets"].items():
    got = stored["scenarios"][name]["budgets"][budget]
    for policy, mean in entry["mean"].items():
      assert got["mean"][policy] == pytest.approx(mean, abs=1e-3), (budget, policy)


def test_the_page_takes_the_runs_replays_at_its_budget():
  """Given the main run's replays, the page replays only the other budgets; a position kept in
  a row with empty slots is drawn kept, whatever the slot count."""
  c = tiny_config()
  built = suite.validate_config(c)
  runs = suite.simulate_scenarios(c, lambda *_: None, built, workers=2)
  got = explorer.explorer_data(c, built, focus="snapkv", log=lambda *_: None, replays=runs)
  alone = explorer.explorer_data(c, built, focus="snapkv", log=lambda *_: None, workers=1)
  assert got == alone
