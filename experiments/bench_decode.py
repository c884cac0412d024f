"""Decode with a compressed cache vs the full cache, and one prefill shared by many budgets.

On a small random Llama-family model (8 layers, d=512, 8 query heads, 4 KV heads, head dim 64):

1. decode-step time with a 10 % budget vs the full cache at 4k and 16k prompt tokens (batch 4;
   the step's cost does not depend on the cache's content, so caches are filled directly);
   target at least 6x faster at 16k (ideal 10x: weights are read either way);
2. one prefill + 16 vmapped budget configurations vs 16 separate prefill + decode runs (4k
   prompt, 16 new tokens); target at least 5x faster;
3. cache bytes vs sum(budgets) x 2 x D x dtype size (bookkeeping share).

Usage: ``python -m experiments.bench_decode [--quick]``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import machine
from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib


def random_cache(cfg, batch, capacity, fill, rng):
  L, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  k1, k2 = jax.random.split(rng)
  shape = (L, batch, G, capacity, D)
  valid = jnp.broadcast_to(jnp.arange(capacity) < fill, (L, batch, G, capacity))
  return cache_lib.KVCache(
    keys=jax.random.normal(k1, shape),
    values=jax.random.normal(k2, shape),
    positions=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (L, batch, G, capacity)),
    valid=valid,
    budget=jnp.full((batch, L, G), capacity, jnp.int32),
  )


def model_config(quick: bool = False) -> km.ModelConfig:
  """The benchmark's random Llama-family model: 8 layers, d=512, 8 query heads, 4 KV heads of 64.

  Args:
    quick: a 2-layer model of width 128 for smoke runs instead.

  Returns:
    The model's config.
  """
  if quick:
    return km.ModelConfig(
      vocab_size=256,
      hidden_size=128,
      intermediate_size=256,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,
    )
  return km.ModelConfig(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  cfg = model_config(args.quick)
  model = km.Llama(cfg, rngs=nnx.Rngs(0))
  params = model.params()
  print(machine.machine_line())
  print(
    f"jax {jax.__version__} on {jax.default_backend()}; model {cfg.num_layers}L d={cfg.hidden_size} "
    f"Hq={cfg.num_heads} G={cfg.num_kv_heads} D={cfg.head_dim}"
  )
  batch = 4
  spec = cache_lib.CacheSpec(policies.make("snapkv"), 1)
  # the cache is donated and threaded through the steps, as inside generate's scan
  step = jax.jit(
    lambda p, c, tok, pos: cache_lib.decode_step(cfg, p, spec, c, tok, pos, pos)[1],
    donate_argnums=1,
  )

  def time_steps(cache, tok, pos, steps=5):
    cache = jax.block_until_ready(step(params, cache, tok, pos))  # compile
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      cache = jax.block_until_ready(step(params, cache, tok, pos))
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  for T in (512, 2048) if args.quick else (4096, 16384):
    times = {}
    for label, cap in (("full", T + 16), ("10%", T // 10 + 16)):
      cache = random_cache(cfg, batch, cap, cap - 16, jax.random.key(0))
      tok = jnp.zeros((batch,), jnp.int32)
      pos = jnp.full((batch,), T, jnp.int32)
      mem = cache_lib.memory(cache)
      times[label] = time_steps(cache, tok, pos)
      print(
        f"  T={T:>5} {label:>4} cache: decode step {times[label] * 1e3:7.2f} ms; "
        f"K/V {mem['kv_bytes_allocated'] / 2**20:7.1f} MiB, bookkeeping {mem['bookkeeping_bytes'] / mem['kv_bytes_allocated']:.1%}"
      )
    print(
      f"  T={T:>5}: 10% budget decode step is {times['full'] / times['10%']:.1f}x faster than the full cache"
    )

  T = 512 if args.quick else 4096
  new, configs = 16, 16
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, T)).astype(np.int32)
  # SnapKV's budgets count its window of 32 and need a selected token beyond it
  budgets = np.linspace(max(T // 20, 64), T // 4, configs).astype(np.int32)
  km.generate_configs(model, ids, budgets, policy="snapkv", max_new_tokens=new)  # compile
  start = time.perf_counter()
  many = km.generate_configs(model, ids, budgets, policy="snapkv", max_new_tokens=new)
  t_many = time.perf_counter() - start
  for b in budgets:  # each budget has its own static capacity: compile them all first
    km.generate(model, ids, policy="snapkv", budget=int(b), max_new_tokens=new)
  start = time.perf_counter()
  for b in budgets:
    km.generate(model, ids, policy="snapkv", budget=int(b), max_new_tokens=new)
  t_sep = time.perf_counter() - start
  print(
    f"one prefill + {configs} vmapped configs: {t_many:.2f} s; {configs} separate runs: {t_sep:.2f} s; "
    f"{t_sep / t_many:.1f}x faster (target >= 5x)"
  )
  # held K/V = (sum over rows and heads of min(budget, T) + the new-1 appended tokens) x 2 x D x 4
  expected = (
    np.minimum(many.budget_LH, T).sum((1, 2, 3)) + (new - 1) * cfg.num_layers * cfg.num_kv_heads
  )
  expected = expected * 2 * cfg.head_dim * 4
  held = np.asarray(many.memory["kv_bytes_held_per_config"])
  print(
    f"cache bytes per config: {held.min():,} .. {held.max():,}; equal to sum(budgets) x 2 x D x 4: "
    f"{bool((held == expected).all())}; full cache per config {cache_lib.full_cache_bytes(cfg, 1, T + new, 4):,}"
  )


if __name__ == "__main__":
  main()
