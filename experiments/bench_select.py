"""Benchmark of kvjax.select against baselines measured in the same process.

1. One configuration: ``keep_mask`` and ``compact`` on ``[32, 32, 8192]`` float32 scores with
   per-row budgets up to 512, against a numpy ``argpartition`` reference that produces the same
   exact, tie-consistent mask / index set. Prints the ratio kvjax / numpy (target <= 1.5).
2. 64 budget configurations: one ``jit(vmap(keep_mask))`` call against a Python loop of 64 calls
   of the same jitted single-configuration function. Prints the speed-up (target >= 10x).

Usage: ``python -m experiments.bench_select [--quick]`` (``--quick`` shrinks T for a smoke run).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import select


def timeit(fn, *args, repeats: int = 5) -> float:
  """Median wall time in seconds after one warm-up call (compilation excluded)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def numpy_top(scores: np.ndarray, capacity: int) -> np.ndarray:
  """Positions of the top ``capacity`` per row, best first, ties to the lower position."""
  part = np.argpartition(-scores, capacity - 1, axis=-1)[..., :capacity]
  vals = np.take_along_axis(scores, part, -1)
  order = np.lexsort((part, -vals), axis=-1)  # by value desc, then position asc
  return np.take_along_axis(part, order, -1)


def numpy_keep_mask(scores: np.ndarray, budget: np.ndarray, capacity: int) -> np.ndarray:
  top = numpy_top(scores, capacity)
  keep = np.zeros(scores.shape, bool)
  np.put_along_axis(keep, top, np.arange(capacity) < budget[..., None], axis=-1)
  return keep


def numpy_compact(scores: np.ndarray, budget: np.ndarray, capacity: int):
  top = numpy_top(scores, capacity)
  valid = np.arange(capacity) < budget[..., None]
  idx = np.sort(np.where(valid, top, scores.shape[-1]), axis=-1)
  valid = idx < scores.shape[-1]
  return np.where(valid, idx, 0), valid


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
  args = parser.parse_args()
  L, H, T, cap, C = (4, 4, 1024, 64, 8) if args.quick else (32, 32, 8192, 512, 64)

  rng = np.random.default_rng(0)
  scores_np = rng.standard_normal((L, H, T), dtype=np.float32)
  budget_np = rng.integers(1, cap + 1, size=(L, H)).astype(np.int32)
  scores, budget = jnp.asarray(scores_np), jnp.asarray(budget_np)
  print(
    f"jax {jax.__version__} on {jax.default_backend()}; scores [{L}, {H}, {T}], budgets <= {cap}"
  )

  keep = jax.jit(lambda s, b: select.keep_mask(s, b, capacity=cap))
  compact = jax.jit(lambda s, b: select.compact(s, b, cap))
  assert np.array_equal(
    np.asarray(keep(scores, budget)), numpy_keep_mask(scores_np, budget_np, cap)
  )
  ours_idx, ours_valid = compact(scores, budget)
  ref_idx, ref_valid = numpy_compact(scores_np, budget_np, cap)
  assert np.array_equal(np.asarray(ours_idx), ref_idx)
  assert np.array_equal(np.asarray(ours_valid), ref_valid)

  t_np_mask = timeit(numpy_keep_mask, scores_np, budget_np, cap)
  t_mask = timeit(keep, scores, budget)
  t_np_compact = timeit(numpy_compact, scores_np, budget_np, cap)
  t_compact = timeit(compact, scores, budget)
  print(
    f"keep_mask: kvjax {t_mask * 1e3:8.1f} ms   numpy {t_np_mask * 1e3:8.1f} ms   "
    f"ratio kvjax/numpy {t_mask / t_np_mask:5.2f}  (target <= 1.5)"
  )
  print(
    f"compact:   kvjax {t_compact * 1e3:8.1f} ms   numpy {t_np_compact * 1e3:8.1f} ms   "
    f"ratio kvjax/numpy {t_compact / t_np_compact:5.2f}  (target <= 1.5)"
  )

  budgets_np = rng.integers(1, cap + 1, size=(C, L, H)).astype(np.int32)
  budgets = jnp.asarray(budgets_np)
  sweep = jax.jit(jax.vmap(lambda b: select.keep_mask(scores, b, capacity=cap)))

  def loop(bs):
    return [keep(scores, bs[c]) for c in range(C)]

  masks = np.asarray(sweep(budgets))
  for c in (0, C - 1):
    assert np.array_equal(masks[c], np.asarray(keep(scores, budgets[c])))
  t_sweep = timeit(sweep, budgets, repeats=3)
  t_loop = timeit(loop, budgets, repeats=3)
  print(
    f"{C} configs: vmap {t_sweep * 1e3:8.1f} ms   python loop {t_loop * 1e3:8.1f} ms   "
    f"speed-up {t_loop / t_sweep:5.1f}x  (target >= 10x)"
  )


if __name__ == "__main__":
  main()
