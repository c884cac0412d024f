"""Lowers every compiled entry point for TPU and CUDA on this host: ``python -m
experiments.export_check [--layers 32] [--tokens 32768] [--batches 1 8] [--platforms tpu cuda]
[--entries NAME ...]``.

Prints a line per (entry point, platform, batch) as it lowers, then the table (entry point x
platform: ok / error) and every failure; exits 1 when one fails (``kvjax.eval.export_check``).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvjax.eval import export_check


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=32, help="the 8B config's layers")
  ap.add_argument("--tokens", type=int, default=export_check.TOKENS)
  ap.add_argument("--batches", type=int, nargs="+", default=list(export_check.BATCHES))
  ap.add_argument("--platforms", nargs="+", default=list(export_check.PLATFORMS))
  ap.add_argument("--entries", nargs="+", default=None, choices=export_check.ENTRY_POINTS)
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  results = export_check.check(
    args.entries,
    platforms=tuple(args.platforms),
    batches=tuple(args.batches),
    num_layers=args.layers,
    tokens=args.tokens,
    log=lambda line: print(line, flush=True),
  )
  print()
  print(export_check.table(results))
  bad = export_check.failures(results)
  for line in bad:
    print("FAILED", line)
  print(
    f"\n{len(results) - len(bad)}/{len(results)} lowered "
    f"(Llama-3.1-8B shapes, {args.layers} layers, {args.tokens} tokens, batches {args.batches}) "
    f"in {time.perf_counter() - t0:.0f} s"
  )
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
