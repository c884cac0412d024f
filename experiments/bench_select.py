"""Benchmark of kvjax.select against baselines measured in the same process.

1. One configuration: ``keep_mask`` and ``compact`` on ``[32, 32, 8192]`` float32 scores with
   per-row budgets up to 512, against a numpy ``argpartition`` reference that produces the same
   exact, tie-consistent mask / index set, the two timed in alternation (medians of 7). Prints
   the ratio kvjax / numpy (issue 16: <= 1.0).
2. Deep selection: ``keep_mask`` with a capacity of ``T / 2`` (the integer-sort path: a packed
   int64 sort on CPU) against the same numpy reference. Prints the ratio kvjax / numpy.
3. 64 budget configurations: one ``jit(vmap(keep_mask))`` call against a Python loop of 64 calls
   of the same jitted single-configuration function. Prints the speed-up (issue 16: >= 50x).

Shape letters follow ``kvjax``'s key: ``C`` capacity, ``K`` configurations.

Usage: ``python -m experiments.bench_select [--quick]`` (``--quick`` shrinks T for a smoke run).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import machine
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


def paired(ours, theirs, repeats: int = 7) -> tuple[float, float]:
  """Median wall times in seconds of ``ours()`` and ``theirs()``, timed in alternation after one
  warm-up call each, so that a machine whose speed drifts (a shared 2-core VM) slows both alike."""
  jax.block_until_ready(ours())
  theirs()
  times = ([], [])
  for _ in range(repeats):
    for fn, out in zip((ours, theirs), times, strict=True):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      out.append(time.perf_counter() - start)
  return float(np.median(times[0])), float(np.median(times[1]))


def numpy_top(scores: np.ndarray, capacity: int) -> np.ndarray:
  """Positions of the top ``capacity`` per row, best first, ties to the lower position.

  numpy compares ``-0.0 == +0.0``, so the two zeros tie here as they do in kvjax."""
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
  print(machine.machine_line())
  L, H, T, C, K = (4, 4, 1024, 64, 8) if args.quick else (32, 32, 8192, 512, 64)

  rng = np.random.default_rng(0)
  scores_np = rng.standard_normal((L, H, T), dtype=np.float32)
  budget_np = rng.integers(1, C + 1, size=(L, H)).astype(np.int32)
  scores, budget = jnp.asarray(scores_np), jnp.asarray(budget_np)
  print(f"jax {jax.__version__} on {jax.default_backend()}; scores [{L}, {H}, {T}], budgets <= {C}")

  keep = jax.jit(lambda s, b: select.top_mask(s, b, capacity=C))
  compact = jax.jit(lambda s, b: select.compact(s, b, C))
  assert np.array_equal(np.asarray(keep(scores, budget)), numpy_keep_mask(scores_np, budget_np, C))
  ours_idx, ours_valid = compact(scores, budget)
  ref_idx, ref_valid = numpy_compact(scores_np, budget_np, C)
  assert np.array_equal(np.asarray(ours_idx), ref_idx)
  assert np.array_equal(np.asarray(ours_valid), ref_valid)

  t_mask, t_np_mask = paired(
    lambda: keep(scores, budget), lambda: numpy_keep_mask(scores_np, budget_np, C)
  )
  t_compact, t_np_compact = paired(
    lambda: compact(scores, budget), lambda: numpy_compact(scores_np, budget_np, C)
  )
  print(
    f"keep_mask: kvjax {t_mask * 1e3:8.1f} ms   numpy {t_np_mask * 1e3:8.1f} ms   "
    f"ratio kvjax/numpy {t_mask / t_np_mask:5.2f}  (issue 16: <= 1.0)"
  )
  print(
    f"compact:   kvjax {t_compact * 1e3:8.1f} ms   numpy {t_np_compact * 1e3:8.1f} ms   "
    f"ratio kvjax/numpy {t_compact / t_np_compact:5.2f}  (issue 16: <= 1.0)"
  )

  deep_C = T // 2
  deep_budget_np = rng.integers(1, deep_C + 1, size=(L, H)).astype(np.int32)
  deep_budget = jnp.asarray(deep_budget_np)
  deep = jax.jit(lambda s, b: select.top_mask(s, b, capacity=deep_C))
  assert np.array_equal(
    np.asarray(deep(scores, deep_budget)), numpy_keep_mask(scores_np, deep_budget_np, deep_C)
  )
  t_deep, t_np_deep = paired(
    lambda: deep(scores, deep_budget),
    lambda: numpy_keep_mask(scores_np, deep_budget_np, deep_C),
    repeats=3,
  )
  print(
    f"deep (C = {deep_C}): kvjax {t_deep * 1e3:8.1f} ms   numpy {t_np_deep * 1e3:8.1f} ms   "
    f"ratio kvjax/numpy {t_deep / t_np_deep:5.2f}"
  )

  budgets_KLH = jnp.asarray(rng.integers(1, C + 1, size=(K, L, H)).astype(np.int32))
  # the scores are an argument (shared by every configuration: in_axes None), not a closed-over
  # constant, which XLA would try to constant-fold (its sort included) at compile time
  sweep = jax.jit(jax.vmap(lambda s, b: select.top_mask(s, b, capacity=C), in_axes=(None, 0)))

  def loop(s, budgets):
    return [keep(s, budgets[k]) for k in range(K)]

  keep_KLHT = np.asarray(sweep(scores, budgets_KLH))
  for k in (0, K - 1):
    assert np.array_equal(keep_KLHT[k], np.asarray(keep(scores, budgets_KLH[k])))
  del keep_KLHT
  t_sweep = timeit(sweep, scores, budgets_KLH, repeats=3)
  t_loop = timeit(loop, scores, budgets_KLH, repeats=3)
  print(
    f"{K} configs: vmap {t_sweep * 1e3:8.1f} ms   python loop {t_loop * 1e3:8.1f} ms   "
    f"speed-up {t_loop / t_sweep:5.1f}x  (issue 16: >= 50x)"
  )


if __name__ == "__main__":
  main()
