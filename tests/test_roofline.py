"""experiments/bench_roofline: its quick mode runs and prints the four lines tooling reads."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINE = re.compile(
  r"^roofline (full|uniform10|adakv10|pyramid10) T=(\d+): ([0-9.]+)% of measured bandwidth "
  r"\(([0-9.]+) GB/s of ([0-9.]+) GB/s\)$"
)


def test_quick_mode_prints_a_roofline_line_per_case():
  cmd = [sys.executable, "-m", "experiments.bench_roofline", "--quick", "--repeats", "3"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [LINE.match(s) for s in out.stdout.splitlines() if s.startswith("roofline ")]
  assert all(lines), out.stdout
  assert sorted(m.group(1) for m in lines) == sorted(["full", "uniform10", "adakv10", "pyramid10"])
  for m in lines:
    percent, achieved, reference = (float(m.group(i)) for i in (3, 4, 5))
    assert 0 < percent <= 150, m.group(0)
    assert abs(100 * achieved / reference - percent) < 0.2 + 0.01 * percent, m.group(0)
  assert "numpy" in out.stdout
