"""Allocations per second: the compiled population call against a loop of single evaluations.

  python -m experiments.bench_search [--population=256] [--source=lab|tiny]

Both evaluate the same allocations on the same evidence in this process: the population call is
one ``jit(vmap)`` over ``population`` parameter vectors (feasible map + retained mass), the loop
calls a jitted single evaluation once per candidate (one evaluation per candidate, EvolKV's
way). The ratio is printed with the machine's numbers (``docs/allocation_search.md``).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import machine
from kvjax import model as km
from kvjax.eval.search import fitness, optimise, runner
from kvjax.eval.search.space import Space

_POP = flags.DEFINE_integer("population", 256, "Candidates per population call.")
_SOURCE = flags.DEFINE_enum("source", "lab", ["lab", "tiny"], "Evidence: lab world or tiny model.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed population calls.")


def _table():
  if _SOURCE.value == "lab":
    world = dict(num_layers=8, num_heads=8, prompt_len=512, gen_steps=128, head_dim=16, window=32)
    return fitness.lab_table("needle_qa", world, fitness.lab_policy("snapkv", 8)), (8, 8), 8
  model, cfg, tok = km.load_tiny()
  ids = runner.model_rows(tok, "single_needle", 96, range(4))
  table = fitness.model_table(model, ids, 96, fitness.lab_policy("snapkv", 4))
  return table, (cfg.num_layers, cfg.num_kv_heads), 4


def main(argv):
  del argv
  print(machine.machine_line())
  table, shape, window = _table()
  space = Space.from_budget(shape, 32, window, table.prompt_len)
  pop = np.random.default_rng(0).normal(size=(_POP.value, space.num_params)).astype(np.float32)
  call = optimise.population_call(space, fitness.retained_mass, table)
  jax.block_until_ready(call(pop))  # compile
  t = time.perf_counter()
  for _ in range(_REPEATS.value):
    batched, _ = jax.block_until_ready(call(pop))
  vmapped = _POP.value * _REPEATS.value / (time.perf_counter() - t)

  single = jax.jit(lambda x, tab: fitness.retained_mass(tab, space.allocate(x)))
  jax.block_until_ready(single(jnp.asarray(pop[0]), table))  # compile
  t = time.perf_counter()
  looped = [float(single(jnp.asarray(x), table)) for x in pop]
  loop = _POP.value / (time.perf_counter() - t)
  np.testing.assert_allclose(np.asarray(batched), looped, rtol=1e-5)
  print(
    f"source {_SOURCE.value}, shape {list(shape)}, population {_POP.value}, jax {jax.__version__}"
  )
  print(f"population call: {vmapped:,.0f} allocations/s")
  print(f"loop of single evaluations: {loop:,.0f} allocations/s")
  print(f"ratio: {vmapped / loop:.1f}x")


if __name__ == "__main__":
  app.run(main)
