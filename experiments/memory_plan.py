"""The longest prompt each policy family fits per chip, from XLA's compiled memory plans.

For each model shape, weight sharding, policy family and cache fraction, searches the prompt
lengths (doubling, then bisection on a grid of ``--step`` tokens) for the longest whose
compiled plan (:func:`kvjax.eval.memory_plan.plan`: prefill, compression, one decode step; bf16,
batch 1) fits each chip of :data:`kvjax.eval.memory_plan.CHIPS` with
:data:`~kvjax.eval.memory_plan.HEADROOM` free, and prints one markdown table per (model,
shards): a row per (family, fraction), a column per chip. Compiles are cached by shape, so the
chips share them. ``--json`` also writes the results (what ``memory_plan.TABLE`` holds).

XLA's flags are set here before jax starts: ``while-loop-invariant-code-motion`` is disabled,
so XLA:CPU does not hoist the fp32 conversion of every layer's bf16 weights out of the decode
step's layer loop (twice the weights of temporaries that a TPU or GPU never allocates), and
LLVM's optimisation is off (code generation runs after the buffers are planned; it only speeds
the compiles up).

Usage: ``python -m experiments.memory_plan [--quick] [--models llama-3.1-8b qwen3-8b]
[--families snapkv adakv h2o] [--shards 1 2] [--step 4096] [--json out.json]``.
"""

from __future__ import annotations

import os

PLAN_FLAGS = (
  "--xla_disable_hlo_passes=while-loop-invariant-code-motion "
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {PLAN_FLAGS}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

from kvjax.eval import memory_plan as mp  # noqa: E402
from kvjax.model.config import ModelConfig  # noqa: E402

QUICK = ModelConfig(
  vocab_size=512,
  hidden_size=64,
  intermediate_size=128,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  max_positions=4096,
)


def tokens_label(tokens: int) -> str:
  """``"32k"`` for 32768 tokens, ``"-"`` for none."""
  if not tokens:
    return "-"
  return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def search(cfg, families, fractions, chips, shards, step, headroom, log):
  """``{(family, fraction): {chip: tokens}}`` for one model and sharding."""
  out = {}
  for family in families:
    for fraction in fractions:
      t0 = time.perf_counter()
      row = {
        chip: mp.longest_prompt(
          cfg,
          family,
          fraction,
          chip,
          workload=mp.Workload(shards=shards),
          headroom=headroom,
          step=step,
        )
        for chip in chips
      }
      out[(family, fraction)] = row
      said = " ".join(f"{c}={tokens_label(t)}" for c, t in row.items())
      log(f"  {family} {fraction:.0%} shards={shards}: {said} ({time.perf_counter() - t0:.0f} s)")
  return out


def table(results: dict, chips) -> str:
  """A markdown table: a row per (family, fraction), a column per chip."""
  lines = ["| family | cache | " + " | ".join(chips) + " |", "|---" * (len(chips) + 2) + "|"]
  for (family, fraction), row in results.items():
    cells = " | ".join(tokens_label(row[c]) for c in chips)
    lines.append(f"| {family} | {fraction:.0%} | {cells} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="a tiny shape against tiny chips")
  parser.add_argument("--models", nargs="+", default=list(mp.MODELS), choices=list(mp.MODELS))
  parser.add_argument("--families", nargs="+", default=list(mp.FAMILIES))
  parser.add_argument("--fractions", nargs="+", type=float, default=list(mp.FRACTIONS))
  parser.add_argument("--shards", nargs="+", type=int, default=[1, 2])
  parser.add_argument("--chips", nargs="+", default=list(mp.CHIPS))
  parser.add_argument("--step", type=int, default=4096, help="the grid of prompt lengths")
  parser.add_argument("--headroom", type=float, default=mp.HEADROOM)
  parser.add_argument("--json", default="", help="write the results here")
  args = parser.parse_args()
  for chip in args.chips:
    mp.check_chip(chip)
  t_start = time.perf_counter()
  print(
    f"memory plans: batch 1, bf16, {mp.NEW_TOKENS} new tokens, {args.headroom:.0%} headroom, "
    f"grid {args.step} tokens; XLA:CPU compile on {platform.node()} ({os.cpu_count()} cores), "
    f"{time.strftime('%Y-%m-%d')}",
    flush=True,
  )
  saved = []
  if args.quick:
    # the tiny shape's plans are kilobytes: chips of a few MiB stand in for the real ones
    mp.CHIPS.update(
      {f"tiny-{n}": mp.Chip(f"tiny-{n}", n / 1024, "cpu", f"tiny-{n}") for n in (2, 4)}
    )
    models = {"tiny": QUICK}
    chips, step = ["tiny-2", "tiny-4"], 256
  else:
    models = {m: mp.MODELS[m]() for m in args.models}
    chips, step = args.chips, args.step
  for name, cfg in models.items():
    for shards in args.shards:
      print(f"{name}, weights over {shards} chip(s):", flush=True)
      results = search(
        cfg,
        args.families,
        args.fractions,
        chips,
        shards,
        step,
        args.headroom,
        lambda line: print(line, flush=True),
      )
      print(table(results, chips), flush=True)
      saved += [
        {"model": name, "shards": shards, "family": f, "fraction": x, "tokens": row}
        for (f, x), row in results.items()
      ]
      if args.json:  # after each table: a run cut short keeps what it found
        with open(args.json, "w") as f:
          json.dump(saved, f, indent=1)
  print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
  main()
