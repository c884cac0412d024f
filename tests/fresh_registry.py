"""The registered policy names of a fresh process: what the README, the landing page and the
built site describe, whatever policies the tests in this process registered of their own."""

import subprocess
import sys


def builtin_policy_names() -> tuple[str, ...]:
  """``policies.names()`` as a fresh ``import kvjax`` gives them."""
  out = subprocess.run(
    [sys.executable, "-c", "from kvjax import policies; print(*policies.names())"],
    capture_output=True,
    text=True,
    check=True,
  )
  return tuple(out.stdout.split())
