"""The machine line every benchmark prints first: CPU model, cores, the flags that decide speed.

A ratio measured on one CPU need not hold on another (AVX-512, bf16 units and AMX change which
kernels XLA and oneDNN pick), so ``docs/benchmarks.md`` records each row's machine as this line
gives it::

  machine: Intel(R) Xeon(R) Processor, 2 cores (avx2 fma avx512f avx512bw avx512_vnni
  avx512_bf16 amx_bf16 amx_int8 amx_tile); jax 0.10.2 (cpu); load average 1.2 0.9 0.8

``python -m experiments.machine`` prints it alone.
"""

from __future__ import annotations

import os
import pathlib
import platform

# the /proc/cpuinfo flags that decide which kernels run: vector width, fused multiply-add, the
# bf16 and int8 dot-product units, AMX tiles
SPEED_FLAGS = (
  "avx2",
  "fma",
  "avx512f",
  "avx512bw",
  "avx512_vnni",
  "avx512_bf16",
  "avx512_fp16",
  "amx_bf16",
  "amx_int8",
  "amx_tile",
)
CPUINFO = pathlib.Path("/proc/cpuinfo")


def cpu_fields(cpuinfo: str) -> tuple[str, frozenset[str]]:
  """The first processor's model name and flags in a ``/proc/cpuinfo`` text.

  Args:
    cpuinfo: the text of ``/proc/cpuinfo`` (x86: ``model name`` and ``flags`` lines).

  Returns:
    ``(model, flags)``; ``("", frozenset())`` for what the text does not hold.
  """
  model, flags = "", frozenset()
  for line in cpuinfo.splitlines():
    key, _, value = line.partition(":")
    key = key.strip()
    if key == "model name" and not model:
      model = " ".join(value.split())
    elif key == "flags" and not flags:
      flags = frozenset(value.split())
  return model, flags


def speed_flags(flags) -> tuple[str, ...]:
  """The :data:`SPEED_FLAGS` among ``flags``, in :data:`SPEED_FLAGS`' order."""
  return tuple(f for f in SPEED_FLAGS if f in flags)


def machine_line() -> str:
  """This machine as one line: CPU model, cores, speed flags, jax and its backend, load average.

  Returns:
    The line (``machine: ...``); fields this platform cannot tell are left out or named
    ``unknown``.
  """
  text = CPUINFO.read_text() if CPUINFO.exists() else ""
  model, flags = cpu_fields(text)
  model = model or platform.processor() or platform.machine() or "unknown CPU"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  line = f"machine: {model}, {cores} cores ({' '.join(speed_flags(flags)) or 'no listed flags'})"
  try:
    import jax

    line += f"; jax {jax.__version__} ({jax.default_backend()})"
  except ImportError:
    pass
  if hasattr(os, "getloadavg"):
    line += "; load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
  return line


if __name__ == "__main__":
  print(machine_line())
