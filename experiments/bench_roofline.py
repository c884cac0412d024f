"""The decode step against its memory-bandwidth bound: the bytes it must read over its time.

A decode step reads the weights and the cache's held K/V once; its best time is those bytes over
the memory bandwidth. On ``bench_decode``'s random model (8 layers, d=512, 8 query heads, 4 KV
heads of 64, batch 4, fp32) at 4k and 16k prompt tokens, for the full cache and three 10 %
caches (``uniform10``: one budget for every head; ``adakv10``: Ada-KV's ragged per-head budgets;
``pyramid10``: PyramidKV's per-layer budgets), this prints the bytes a step must read (weights,
the valid K/V slots, and the bookkeeping the step touches: every slot's position and validity,
the budgets), the step's median time (jitted, after warm-up, the cache donated and threaded
through the steps as inside ``generate``'s scan) and the bandwidth achieved, as a fraction of
the bandwidth a large array reduction reaches in the same run: XLA's ``sum`` over 1 GiB, timed
once after each step, so that the load of a shared machine weighs on both alike (the run's
first lines give it, and numpy's, measured alone before the cases). One line per case, in the
form tooling reads::

  roofline <case> T=<tokens>: <percent>% of measured bandwidth (<GB/s> of <GB/s>)

Padding slots of a ragged cache are not counted as bytes the step must read: a step that reads
them pays for them in its fraction. Each case's line also gives the fraction over the bytes of
every slot of the capacity, which a step reading each layer's slots whole reads.

On CPU the step runs over the parameters and cache held one buffer per layer, as ``generate``
holds them (``kvjax.model.cache.per_layer``, split once before the timed steps).

Usage: ``python -m experiments.bench_roofline [--quick] [--repeats N] [--kv-dtype bfloat16]
[--decode-block N] [--against REV] [--breakdown] [--cases full,...] [--lengths 4096,...]``
(``--decode-block 1000000``: each layer's slots read whole; ``--against REV``: the decode step
of ``kvjax/model/cache.py`` at git revision ``REV`` timed beside this one, the steps
alternated in one process, with the ratio of their times; ``--breakdown``: the step's
attention alone per case, and the step over an empty cache, which is the weights alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import machine
from experiments.bench_decode import model_config
from kvjax import budgets as budgets_lib
from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib

CASES = ("full", "uniform10", "adakv10", "pyramid10")
# the cases whose allocation follows from the budget alone (PyramidKV's schedule): generate
# gives their layers capacities of their own (Allocator.from_budget_alone); Ada-KV's depends on
# the input, so its layers share one
LAYER_CAPACITY_CASES = ("pyramid10",)
BATCH = 4
WINDOW = 32  # SnapKV's observation window, counted inside every budget
ROOM = 32  # empty slots past the held tokens: the timed steps append into them


def case_budgets(case: str, cfg, T: int, rng: np.random.Generator) -> np.ndarray:
  """The slots each (row, layer, head) holds for ``case`` at ``T`` prompt tokens.

  Args:
    case: one of :data:`CASES`.
    cfg: the model's config.
    T: prompt tokens.
    rng: draws the synthetic head scores Ada-KV allocates by.

  Returns:
    int32 budgets ``[B, L, H]``.

  Raises:
    ValueError: for an unknown case.
  """
  if case not in CASES:
    raise ValueError(f"case: expected one of {CASES}, got {case!r}")
  L, H = cfg.num_layers, cfg.num_kv_heads
  b = T // 10

  def adakv():
    # heads that concentrate their attention differently: log-normal scores whose spread
    # differs by head, so the pooled top-k gives each head its own share
    rows = []
    for _ in range(BATCH):
      sigma = rng.uniform(0.5, 2.5, size=(L, H, 1))
      scores = np.exp(sigma * rng.standard_normal((L, H, T))).astype(np.float32)
      rows.append(np.asarray(budgets_lib.adakv(jnp.asarray(scores), b, WINDOW)))
    return np.stack(rows)

  per_case = {
    "full": lambda: np.full((L, H), T),
    "uniform10": lambda: np.full((L, H), b),
    "adakv10": adakv,
    "pyramid10": lambda: np.asarray(budgets_lib.pyramid(L, b, WINDOW, T))[:, None],
  }
  out = per_case[case]()
  return np.broadcast_to(out, (BATCH, L, H)).astype(np.int32)


def filled_cache(cfg, budget_BLH: np.ndarray, kv_dtype, seed: int) -> cache_lib.KVCache:
  """A cache whose row ``b``, layer ``l``, head ``h`` holds its first ``budget`` slots.

  The step's cost does not depend on what the slots hold, so they are filled directly (on the
  host: nothing here compiles).

  Args:
    cfg: the model's config.
    budget_BLH: int budgets ``[B, L, H]``.
    kv_dtype: the K/V storage dtype.
    seed: seeds the K/V contents.

  Returns:
    The cache, ``ROOM`` empty slots past its largest budget.
  """
  L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  C = int(budget_BLH.max()) + ROOM
  held_LBH = np.moveaxis(budget_BLH, 0, 1)
  shape = (L, BATCH, H, C)
  rng = np.random.default_rng(seed)
  kv = [jnp.asarray(rng.standard_normal(shape + (D,), np.float32), kv_dtype) for _ in range(2)]
  return cache_lib.KVCache(
    keys=kv[0],
    values=kv[1],
    positions=jnp.asarray(np.broadcast_to(np.arange(C, dtype=np.int32), shape)),
    valid=jnp.asarray(np.arange(C) < held_LBH[..., None]),
    budget=jnp.asarray(np.full((BATCH, L, H), C, np.int32)),
  )


def step_bytes(params: dict, cache: cache_lib.KVCache, layered: bool = False) -> dict:
  """The bytes one decode step must read.

  Args:
    params: the model's parameters.
    cache: the cache before the step.
    layered: each layer holds its own capacity (:func:`spec_of`).

  Returns:
    ``{"weights", "kv", "bookkeeping", "total", "read"}``: every weight but the embedding table
    (one row per token of it is read); the valid slots' K and V; each slot's position and
    validity and the budgets (read for every slot, held or not); their total; and the total
    with the K and V of every slot of each layer's capacity (:func:`spec_of`), held or not,
    which a step over each layer's slots whole reads (a ragged cache's padding, and the room
    for the tokens to come).
  """
  weights = sum(v.nbytes for k, v in params.items() if k != "embed")
  weights += BATCH * params["embed"].shape[-1] * params["embed"].dtype.itemsize
  if "lm_head" not in params:  # tied: the head reads the whole table
    weights += params["embed"].nbytes
  itemsize = cache.keys.dtype.itemsize
  kv = int(np.asarray(cache.valid).sum()) * (cache.keys.shape[-1] + cache.values.shape[-1])
  kv *= itemsize
  book = cache.positions.nbytes + cache.valid.nbytes + cache.budget.nbytes
  caps = spec_of(cache_lib, cache, layered).layer_capacity
  caps = caps or (cache.keys.shape[3],) * cache.keys.shape[0]
  slots = sum(caps) * cache.keys.shape[1] * cache.keys.shape[2]  # each layer's own capacity
  read = weights + slots * (cache.keys.shape[-1] + cache.values.shape[-1]) * itemsize + book
  return dict(weights=weights, kv=kv, bookkeeping=book, total=weights + kv + book, read=read)


def reference_bandwidth(nbytes: int, repeats: int) -> tuple[float, float]:
  """Bandwidths (GB/s) of a large fp32 array reduction: XLA's ``sum`` and numpy's.

  Args:
    nbytes: the array's size in bytes.
    repeats: timed runs (median) after a warm-up.

  Returns:
    ``(xla_gbs, numpy_gbs)``.
  """
  n = nbytes // 4
  host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
  device = jax.device_put(host)
  total = jax.jit(jnp.sum)

  def median(fn) -> float:
    fn()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  xla = median(lambda: jax.block_until_ready(total(device)))
  numpy = median(lambda: host.sum())
  return n * 4 / xla / 1e9, n * 4 / numpy / 1e9


def spec_of(cache_module, cache, layered: bool = False):
  """The SnapKV cache spec of ``cache_module`` for ``cache``'s capacity; with ``layered``, each
  layer's own capacity (its largest held count and the ``ROOM``, as ``generate`` sizes each
  layer of an allocation that follows from the budget alone) where the module's spec has
  ``layer_capacity``."""
  spec = cache_module.CacheSpec(policies.make("snapkv"), cache.keys.shape[3])
  if not layered or not hasattr(spec, "layer_capacity"):
    return spec
  held = np.asarray(cache.valid).sum(-1).max((1, 2))
  caps = tuple(min(int(h) + ROOM, cache.keys.shape[3]) for h in held)
  return dataclasses.replace(spec, layer_capacity=caps)


def compiled_step(cfg, cache_module, capacity: int):
  """The jitted decode step of ``cache_module`` (``kvjax.model.cache`` or an earlier revision's,
  :func:`cache_module_at`) for a SnapKV cache of ``capacity`` slots, the cache donated."""
  spec = cache_module.CacheSpec(policies.make("snapkv"), capacity)
  return jax.jit(
    lambda p, c, tok, pos: cache_module.decode_step(cfg, p, spec, c, tok, pos, pos),
    donate_argnums=1,
  )


def time_steps(
  cfg, params, caches: list, T: int, repeats: int, modules=None, reference=None, layered=False
) -> list:
  """Times decode steps at position ``T`` after a warm-up, the steps of each cache alternated
  (each round starting with the next).

  Args:
    cfg: the model's config.
    params: the model's parameters.
    caches: caches (donated: each is threaded through its own steps).
    T: the token's position.
    repeats: timed steps per cache (fewer than ``ROOM``: every step appends).
    modules: the cache module stepping each cache (default ``kvjax.model.cache`` for all).
    reference: a function timed once per round after the steps (the bandwidth reference, so
      that the load of a shared machine weighs on both alike), or ``None``.
    layered: each layer held with its own capacity (:func:`spec_of`).

  Returns:
    Per cache, the seconds of each timed step (a numpy array); then, with ``reference``, the
    seconds of each of its runs.
  """
  modules = modules or [cache_lib] * len(caches)
  steps = [compiled_step(cfg, m, c.keys.shape[3]) for m, c in zip(modules, caches, strict=True)]
  tok = jnp.zeros((BATCH,), jnp.int32)
  pos = jnp.full((BATCH,), T, jnp.int32)
  # each module's step runs over the cache as its generate loop holds it (one buffer per layer
  # on CPU, each with its own capacity: cache.per_layer; a revision without it holds it stacked)
  forms = [
    m.per_layer(spec_of(m, c, layered), params, c) if hasattr(m, "per_layer") else (params, c)
    for m, c in zip(modules, caches, strict=True)
  ]
  step_params = [p for p, _ in forms]
  caches = [c for _, c in forms]
  for j, step in enumerate(steps):  # compile
    _, caches[j] = jax.block_until_ready(step(step_params[j], caches[j], tok, pos))
  times = [[] for _ in range(len(steps) + (reference is not None))]
  for i in range(repeats):
    # each round starts with another step: the one right after the reference finds no cache warm
    for j in np.roll(np.arange(len(steps)), -i):
      step = steps[j]
      start = time.perf_counter()
      _, caches[j] = jax.block_until_ready(step(step_params[j], caches[j], tok, pos + 1 + i))
      times[j].append(time.perf_counter() - start)
    if reference is not None:
      start = time.perf_counter()
      reference()
      times[-1].append(time.perf_counter() - start)
  return [np.asarray(t) for t in times]


def xla_reduction(nbytes: int):
  """A function that runs a jitted ``sum`` over an fp32 array of ``nbytes`` on the device (after
  a warm-up): the bandwidth reference timed beside the steps."""
  x = jax.device_put(np.random.default_rng(1).standard_normal(nbytes // 4, dtype=np.float32))
  total = jax.jit(jnp.sum)
  jax.block_until_ready(total(x))
  return lambda: jax.block_until_ready(total(x))


def time_step(cfg, params, cache, T: int, repeats: int) -> float:
  """The median time (s) of a decode step at position ``T``, after a warm-up.

  Args:
    cfg: the model's config.
    params: the model's parameters.
    cache: the cache (donated: it is threaded through the steps).
    T: the token's position.
    repeats: timed steps (fewer than ``ROOM``: every step appends).

  Returns:
    Seconds per step.
  """
  return float(np.median(time_steps(cfg, params, [cache], T, repeats)[0]))


def cache_module_at(rev: str):
  """``kvjax/model/cache.py`` as committed at git revision ``rev``, loaded as its own module (it
  imports the rest of kvjax as it stands), to time its decode step beside this one.

  Args:
    rev: a git revision of this repository.

  Returns:
    The module.

  Raises:
    ValueError: when git cannot show the file at ``rev``.
  """
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
    ["git", "show", f"{rev}:kvjax/model/cache.py"], cwd=root, capture_output=True, text=True
  )
  if out.returncode != 0:
    raise ValueError(f"against: git cannot show kvjax/model/cache.py at {rev!r}: {out.stderr}")
  module = types.ModuleType(f"kvjax_cache_at_{rev}")
  sys.modules[module.__name__] = module  # dataclasses look their module up while it runs
  exec(compile(out.stdout, f"{rev}:kvjax/model/cache.py", "exec"), module.__dict__)
  return module


def time_attention(cfg, cache, repeats: int, layered: bool = False) -> float:
  """The median time (s) of the step's attention alone: every layer's query against its slots
  (the cache's visible slots), chained through the layers as the step chains them, over the
  cache in the form the step reads it (:func:`kvjax.model.cache.per_layer`).

  Args:
    cfg: the model's config.
    cache: the stacked cache.
    repeats: timed runs after a warm-up.
    layered: each layer held with its own capacity (:func:`spec_of`).

  Returns:
    Seconds per run.
  """
  L, B = cache.keys.shape[:2]
  q = jax.random.normal(jax.random.key(0), (B, cfg.num_heads, 1, cfg.head_dim))
  _, held = cache_lib.per_layer(spec_of(cache_lib, cache, layered), {}, cache)

  @jax.jit
  def attention(q, keys, values, valid):
    if isinstance(keys, tuple):  # one buffer per layer: the layers unrolled
      for l in range(L):
        q = q + cache_lib.held_layer_attention(cfg, q, keys[l], values[l], valid[l])[1]
      return q

    def layer(q, l):
      _, out = cache_lib.slot_attention_of_layer(cfg, q, keys, values, l, valid[l])
      return q + out, None

    return jax.lax.scan(layer, q, jnp.arange(L))[0]

  args = (q, held.keys, held.values, held.valid)
  jax.block_until_ready(attention(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(attention(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run(
  quick: bool = False,
  repeats: int = 7,
  kv_dtype=jnp.float32,
  lengths=None,
  cases=CASES,
  emit=print,
  against: str | None = None,
  breakdown: bool = False,
) -> list[str]:
  """Measures every case and returns the printed lines.

  Args:
    quick: the 2-layer model at 1,024 tokens (a smoke run).
    repeats: timed steps per case and timed reductions (median), below ``ROOM``.
    kv_dtype: the K/V storage dtype.
    lengths: prompt lengths (default 4,096 and 16,384; quick 1,024).
    cases: the cases to run, from :data:`CASES`.
    emit: called with each line as it is measured (``print``; ``None``: silent).
    against: a git revision whose decode step is timed beside this one on the same caches,
      the steps alternated (:func:`cache_module_at`); ``None``: none.
    breakdown: also time the step's attention alone per case (:func:`time_attention`) and the
      step on a cache of ``ROOM`` empty slots (the weights and the per-token work alone).

  Returns:
    The lines: the machine, the two reference bandwidths, then per case its bytes and time and
    its ``roofline`` line (with ``against``, the other revision's time and the ratio; with
    ``breakdown``, the attention's time).

  Raises:
    ValueError: for ``repeats`` outside ``[1, ROOM)``.
  """
  if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats < ROOM:
    raise ValueError(f"repeats: expected an int in [1, {ROOM}), got {repeats!r}")
  cfg = model_config(quick)
  params = km.Llama(cfg, rngs=nnx.Rngs(0)).params()
  if lengths is None:
    lengths = (1024,) if quick else (4096, 16384)
  device = jax.devices()[0]
  lines = []

  def say(line: str) -> None:
    lines.append(line)
    if emit is not None:
      emit(line)

  say(machine.machine_line())
  say(
    f"jax {jax.__version__} on {device.device_kind} ({jax.default_backend()}); model "
    f"{cfg.num_layers}L d={cfg.hidden_size} Hq={cfg.num_heads} G={cfg.num_kv_heads} "
    f"D={cfg.head_dim}, batch {BATCH}, K/V {jnp.dtype(kv_dtype).name}"
  )
  ref_bytes = (2**26 if quick else 2**30) if jax.default_backend() == "cpu" else 2**32
  xla_gbs, numpy_gbs = reference_bandwidth(ref_bytes, repeats)
  say(f"reference: sum over {ref_bytes / 2**20:.0f} MiB fp32: XLA {xla_gbs:.1f} GB/s")
  say(f"reference: sum over {ref_bytes / 2**20:.0f} MiB fp32: numpy {numpy_gbs:.1f} GB/s")
  other = None if against is None else cache_module_at(against)
  reference = xla_reduction(ref_bytes)
  if breakdown:
    empty = filled_cache(cfg, np.zeros((BATCH, cfg.num_layers, cfg.num_kv_heads), int), kv_dtype, 0)
    seconds = time_step(cfg, params, empty, 0, repeats)
    say(f"  breakdown: the step on {ROOM} empty slots (weights alone) {seconds * 1e3:.2f} ms")
  rng = np.random.default_rng(0)
  for T in lengths:
    for case in cases:
      budget = case_budgets(case, cfg, T, rng)
      cache = filled_cache(cfg, budget, kv_dtype, T)
      layered = case in LAYER_CAPACITY_CASES
      nbytes = step_bytes(params, cache, layered)
      if breakdown:
        attention = time_attention(cfg, cache, repeats, layered)
        kv_gbs = nbytes["kv"] / attention / 1e9
        say(
          f"  breakdown {case} T={T}: attention alone {attention * 1e3:.2f} ms ({kv_gbs:.1f} GB/s)"
        )
      caches = [cache] if other is None else [cache, filled_cache(cfg, budget, kv_dtype, T)]
      modules = [cache_lib] if other is None else [cache_lib, other]
      *steps, ref = time_steps(cfg, params, caches, T, repeats, modules, reference, layered)
      seconds = float(np.median(steps[0]))
      beside = ref_bytes / float(np.median(ref)) / 1e9
      if other is not None:
        ratio = steps[1] / steps[0]
        say(
          f"  against {against} {case} T={T}: {np.median(steps[1]) * 1e3:.2f} ms, this "
          f"{seconds * 1e3:.2f} ms: {np.median(ratio):.2f}x (per step {ratio.min():.2f}-"
          f"{ratio.max():.2f}x)"
        )
      gbs = nbytes["total"] / seconds / 1e9
      # the fastest of each: a shared machine's load only adds time
      best = nbytes["total"] / float(steps[0].min()) / (ref_bytes / float(ref.min()))
      say(
        f"  {case} T={T}: {nbytes['total'] / 1e6:.1f} MB (weights {nbytes['weights'] / 1e6:.1f}, "
        f"K/V {nbytes['kv'] / 1e6:.1f}, bookkeeping {nbytes['bookkeeping'] / 1e6:.1f}) in "
        f"{seconds * 1e3:.2f} ms; XLA's sum beside the steps {beside:.1f} GB/s; "
        f"{100 * gbs / numpy_gbs:.1f}% of numpy's {numpy_gbs:.1f} GB/s; fastest step against "
        f"fastest sum {100 * best:.1f}%; over the {nbytes['read'] / 1e6:.1f} MB it reads with "
        f"every slot of the capacity {100 * nbytes['read'] / seconds / 1e9 / beside:.1f}%"
      )
      say(
        f"roofline {case} T={T}: {100 * gbs / beside:.1f}% of measured bandwidth "
        f"({gbs:.2f} GB/s of {beside:.2f} GB/s)"
      )
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a 2-layer model at 1,024 tokens")
  parser.add_argument("--repeats", type=int, default=7, help="timed steps per case (median)")
  parser.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument(
    "--decode-block",
    type=int,
    default=cache_lib.DECODE_BLOCK,
    help="slots per block of the step's attention (above the capacity: each layer read whole)",
  )
  parser.add_argument(
    "--against", help="a git revision whose decode step is timed beside this one (same process)"
  )
  parser.add_argument(
    "--breakdown", action="store_true", help="also time the attention and the weights alone"
  )
  parser.add_argument(
    "--cases", default=",".join(CASES), help="comma-separated, from " + str(CASES)
  )
  parser.add_argument("--lengths", help="comma-separated prompt lengths (default 4096,16384)")
  args = parser.parse_args()
  if args.decode_block < 1:
    raise ValueError(f"decode_block: expected an int >= 1, got {args.decode_block}")
  cases = tuple(args.cases.split(","))
  if not set(cases) <= set(CASES):
    raise ValueError(f"cases: expected names from {CASES}, got {args.cases!r}")
  lengths = None if args.lengths is None else tuple(int(t) for t in args.lengths.split(","))
  cache_lib.DECODE_BLOCK = args.decode_block
  run(
    args.quick,
    args.repeats,
    jnp.dtype(args.kv_dtype),
    lengths=lengths,
    cases=cases,
    emit=lambda s: print(s, flush=True),
    against=args.against,
    breakdown=args.breakdown,
  )


if __name__ == "__main__":
  main()
