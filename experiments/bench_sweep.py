"""Benchmark of the budget-sweep engine against a Python loop, measured in one process.

1,000 budget configurations of SnapKV (a prefill-time policy) mixing layer schedules (uniform,
PyramidKV legacy and exact-total, CAKE) and head allocations (uniform, Ada-KV, HeadKV) on a
synthetic world with ``L=32, H=32, P=8192``. Prints:

* compile time (first pass over every group) apart from the compiled throughput;
* configurations per second of the compiled, vmapped sweep (the median of 5 sweeps), end to end
  (each score set's scores, sort and Ada-KV table + every configuration; the world's evidence,
  CAKE statistics and the oracle's order are per world, computed once by the evidence stage, and
  a second rate recomputes the last two in every sweep) and in the per-configuration stage alone
  (target >= 1,000/s);
* the speed-up over a Python loop calling the same jitted single-configuration function
  (timed on a sample of configurations per group; target >= 50x);
* peak resident memory of a fresh process sweeping 1,000 and 10,000 configurations (bounded:
  shared work is per group, configurations stream through fixed-size chunks).

JAX's persistent compilation cache is on (``--compilation-cache``, default the user cache
directory; ``--compilation-cache=`` turns it off): the fresh processes then load the executables
this process compiled (a first run ever compiles them all, later runs load them).

Usage: ``python -m experiments.bench_sweep [--quick] [--compilation-cache=DIR]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import jax
import ml_collections
import numpy as np

from configs import sweep_lab
from experiments import machine
from kvjax import policies
from kvjax.lab import sweep

REPEATS = 5  # timed sweeps of the compiled engine


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


class PeakRSS:
  """Samples the resident set size in a thread; ``peak`` in MiB."""

  def __enter__(self):
    self.peak, self._stop = rss_mb(), threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.wait(0.01):
      self.peak = max(self.peak, rss_mb())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def make_configs(count: int, P: int, seed: int = 0) -> list[dict]:
  """``count`` SnapKV configurations spread over six static structures."""
  base = sweep_lab.base()
  base.update(window=8, scenario="needle_qa", policy="snapkv")
  rng = np.random.default_rng(seed)
  kinds = [
    dict(schedule="uniform", head_alloc="uniform"),
    dict(schedule="uniform", head_alloc="adakv"),
    dict(schedule="pyramid", head_alloc="uniform", pyramid_mode="legacy_floor"),
    dict(schedule="pyramid", head_alloc="adakv", pyramid_mode="exact_total"),
    dict(schedule="cake", head_alloc="uniform"),
    dict(schedule="uniform", head_alloc="headkv"),
  ]
  configs = []
  for i in range(count):
    cfg = base.to_dict() | kinds[i % len(kinds)]
    cfg.update(
      budget=int(rng.integers(16, 513)),
      beta=float(rng.choice([4.0, 10.0, 20.0])),
      alpha=float(rng.choice([0.1, 0.2, 0.5])),
      head_beta=float(rng.choice([1.01, 1.5, 2.0])),
      tau1=float(rng.choice([1.0, 1.6])),
      tau2=float(rng.choice([0.4, 1.0])),
    )
    configs.append(cfg)
  return configs


def by_group(configs):
  groups: dict = {}
  for cfg in configs:
    groups.setdefault(sweep.group_key(cfg), []).append(cfg)
  return groups


def world_state(engine, key) -> tuple:
  """What the engine keeps per world (computed on first use): the evidence a group reads, CAKE's
  statistics and the oracle's order."""
  layers, _ = sweep.allocators(key)
  cake = engine.cake_statistics(key) if isinstance(layers, policies.CakeLayers) else None
  return engine.evidence(key), cake, engine.descending_mass(key)


def sweep_all(engine, groups) -> int:
  return sum(len(rows) for rows in engine.evaluate_groups(groups))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a small world for a smoke run")
  parser.add_argument("--loop-sample", type=int, default=3, help="loop calls timed per group")
  parser.add_argument("--memory", type=int, default=0, help="internal: one sweep of N configs")
  parser.add_argument(
    "--compilation-cache",
    default="default",
    help="persistent compilation cache: a directory, 'default' (the user cache dir) or '' (off)",
  )
  args = parser.parse_args()
  print(machine.machine_line())
  os.environ[sweep.COMPILATION_CACHE_ENV] = args.compilation_cache  # fresh processes too
  sizes = (4, 4, 1024, 8) if args.quick else (32, 32, 8192, 16)
  L, H, P, S = sizes
  world = ml_collections.ConfigDict(
    dict(num_layers=L, num_heads=H, prompt_len=P, gen_steps=S, head_dim=4, window=16, seed=0)
  )
  if args.memory:
    memory_run(args.memory, world, P)
    return
  print(
    f"jax {jax.__version__} on {jax.default_backend()} x{jax.device_count()}; world L={L} H={H} P={P}"
  )
  configs = make_configs(1000, P)
  groups = by_group(configs)
  engine = sweep.Engine(world, capacity=max(c["budget"] for c in configs), chunk_size=1000)
  print(f"persistent compilation cache: {engine.compilation_cache or 'off'}")

  start = time.perf_counter()
  engine.world_evidence("needle_qa")
  for key in groups:
    jax.block_until_ready(world_state(engine, key))
  print(
    "evidence (world rows, column sums, head scores, CAKE statistics, the oracle's order): "
    f"{time.perf_counter() - start:.1f} s"
  )

  start = time.perf_counter()
  sweep_all(engine, groups)
  first = time.perf_counter() - start
  sweeps = []
  for _ in range(REPEATS):  # the median of several sweeps: one sample moves by 10 % here
    start = time.perf_counter()
    n = sweep_all(engine, groups)
    sweeps.append(time.perf_counter() - start)
  compiled = float(np.median(sweeps))
  print(f"first pass (compile + run): {first:.2f} s; compile ~ {first - compiled:.2f} s")

  # the same with the per-world state (CAKE's statistics, the oracle's order) recomputed
  per_world = []
  for _ in range(REPEATS):
    engine.forget_world_state()
    start = time.perf_counter()
    sweep_all(engine, groups)
    per_world.append(time.perf_counter() - start)

  # the per-configuration stage alone (shared per-group work excluded)
  staged = []
  cap = sweep.round_capacity(512 * 3, P)
  for key, members in groups.items():
    fns = engine.group_fns(key)
    ev = engine.evidence(key)
    shared = sweep.ScoreSet(engine.scores(key))
    table = stats = ordered = None
    layers, heads = sweep.allocators(key)
    if isinstance(heads, policies.AdaKV):
      table = engine.pooled_table(shared, key.window, sweep.layer_capacity(key, engine.capacity, P))
    if isinstance(layers, policies.CakeLayers):
      stats = engine.cake_statistics(key)
    state = fns["prepare"](ev, shared.scores, table, stats)
    if state["scores"] is not None:
      ordered = jax.block_until_ready(engine.prefix_sums(key, shared, cap, {}))
    data = sweep.stack_data(members, engine.chunk_shape(len(members)))
    jax.block_until_ready(fns["metrics"](state, ordered, data, cap))  # compile for this cap
    staged.append((fns["metrics"], state, ordered, data, cap))
  start = time.perf_counter()
  for fn, state, ordered, data, cap in staged:
    jax.block_until_ready(fn(state, ordered, data, cap))
  stage = time.perf_counter() - start
  print(
    f"compiled sweep (median of {REPEATS}): {n} configs in {compiled:.2f} s = "
    f"{n / compiled:,.0f} configs/s end to end (fastest {n / min(sweeps):,.0f}); "
    f"per-configuration stage {n / stage:,.0f} configs/s (target >= 1,000/s)"
  )
  print(
    f"  with the per-world state (CAKE statistics, the oracle's order) recomputed in every sweep: "
    f"{n / np.median(per_world):,.0f} configs/s ({np.median(per_world):.2f} s, median of {REPEATS})"
  )

  loop_times = []
  for key, members in groups.items():
    dims = engine.world_evidence(key.scenario).world.dims
    single = jax.jit(sweep.single_config_fn(key, dims, engine.capacity))
    ev = engine.evidence(key)
    one = {k: v[0] for k, v in sweep.stack_data(members[:1], 1).items()}
    jax.block_until_ready(single(ev, one))  # compile outside the timing
    for cfg in members[: args.loop_sample]:
      data = {k: v[0] for k, v in sweep.stack_data([cfg], 1).items()}
      t0 = time.perf_counter()
      jax.block_until_ready(single(ev, data))
      loop_times.append(time.perf_counter() - t0)
  per_config_loop = float(np.mean(loop_times))
  loop_total = per_config_loop * n
  print(
    f"python loop of the jitted single-configuration function: {per_config_loop * 1e3:.0f} ms/config "
    f"(mean of {len(loop_times)} timed calls) -> {loop_total:.0f} s for {n}; "
    f"speed-up {loop_total / compiled:,.0f}x (target >= 50x)"
  )

  for count in (1000, 10000):  # fresh processes, so each peak is that sweep's own
    cmd = [sys.executable, "-m", "experiments.bench_sweep", "--memory", str(count)]
    cmd += ["--quick"] if args.quick else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    print(out.stdout.strip().splitlines()[-1])


def memory_run(count: int, world, P: int) -> None:
  """Sweeps ``count`` configurations in this process; prints time, rate and peak RSS."""
  groups = by_group(make_configs(count, P, seed=count))
  engine = sweep.Engine(world, capacity=512, chunk_size=1000)
  before = rss_mb()
  with PeakRSS() as mem:
    start = time.perf_counter()
    done = sweep_all(engine, groups)
    took = time.perf_counter() - start
  print(
    f"{done:>6} configs (incl. evidence and compile): {took:.1f} s, {done / took:,.0f} configs/s, "
    f"peak RSS {mem.peak:,.0f} MiB (process start {before:,.0f} MiB)"
  )


if __name__ == "__main__":
  main()
