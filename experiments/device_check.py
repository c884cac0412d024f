"""The accelerator check: one script (at most ~5 minutes) to run whenever a GPU or TPU is at hand.

``python -m experiments.device_check [--quick]`` prints one table:

1. the selection golden tests and the kvpress fixtures (``tests/test_select.py``,
   ``tests/test_kvpress_golden.py``; every matmul at ``precision=HIGHEST``), run by pytest;
2. a Llama-3.2-1B-shaped prefill in bf16 (random weights: nothing is downloaded) at 8k, 16k and
   32k tokens with the evidence the policies read, its wall time and the device's peak memory;
3. a decode step at a 10 % budget against the full cache at 16k tokens (time ratio);
4. the decode roofline (``experiments/bench_roofline``): each case's step as a fraction of the
   device's bandwidth measured by a large reduction in the same run (its HBM bandwidth on a GPU
   or TPU); quick sizes;
5. the ragged per-head decode kernel (:mod:`kvjax.model.ragged`) compiled for the device (Mosaic
   on a TPU, Triton on a GPU; the Pallas interpreter on a CPU) against its XLA reference over
   random ragged lengths (0, 1 and full among them) with a soft-cap and a sliding window, its
   largest difference and its time against the reference's; then the roofline with the kernel:
   the decode step over the paged cache (:mod:`kvjax.model.paged`) against the stacked step at
   Ada-KV's 10 % budgets, their outputs' difference, and each step's bytes over its time as a
   fraction of the reduction's bandwidth;
6. one notebook (``01_policy_lab``) in QUICK mode through nbclient.

Each line says what ran where; a failing part is reported, not hidden. Record the table in the
README's benchmark section.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import bench_roofline, machine
from experiments.bench_memory import EVIDENCE, SHAPES
from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import paged, ragged

ROOT = pathlib.Path(__file__).resolve().parents[1]


def peak_gib() -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", 0) / 2**30


def timed(fn, *args, repeats: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def golden_tests() -> str:
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
  cmd += ["tests/test_select.py", "tests/test_kvpress_golden.py"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  last = (out.stdout.strip().splitlines() or ["no output"])[-1]
  return ("ok: " if out.returncode == 0 else "FAILED: ") + last


def prefill_rows(cfg, lengths) -> list[str]:
  model = km.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  params = model.params()
  rows = []
  for T in lengths:
    ids = jnp.asarray(np.random.default_rng(T).integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    fn = jax.jit(lambda p, i: km.prefill(cfg, p, i, request=EVIDENCE))
    try:
      seconds = timed(fn, params, ids, repeats=2)
      rows.append(f"prefill 1B bf16 {T:6d} tokens: {seconds:7.2f} s, peak {peak_gib():6.2f} GiB")
    except Exception as e:  # noqa: BLE001  (an out-of-memory is a result here)
      rows.append(f"prefill 1B bf16 {T:6d} tokens: FAILED {type(e).__name__}: {str(e)[:80]}")
  return rows


def decode_row(cfg, T: int) -> str:
  model = km.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  params = model.params()
  L, G, D, B = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1

  def cache_of(capacity):
    shape = (L, B, G, capacity)
    return cache_lib.KVCache(
      keys=jnp.zeros(shape + (D,), jnp.bfloat16),
      values=jnp.zeros(shape + (D,), jnp.bfloat16),
      positions=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), shape),
      valid=jnp.ones(shape, bool),
      budget=jnp.full((B, L, G), capacity, jnp.int32),
    )

  times = {}
  for name, capacity in (("full", T + 8), ("10 %", T // 10 + 8)):
    spec = cache_lib.CacheSpec(policies.make("snapkv"), capacity)
    step = jax.jit(
      lambda c, spec=spec: cache_lib.decode_step(
        cfg, params, spec, c, jnp.zeros((B,), jnp.int32), jnp.full((B,), T), jnp.full((B,), T)
      )[0]
    )
    times[name] = timed(step, cache_of(capacity))
  return (
    f"decode step at {T} tokens: full {times['full'] * 1e3:.1f} ms, 10 % budget "
    f"{times['10 %'] * 1e3:.1f} ms: {times['full'] / times['10 %']:.1f}x"
  )


def roofline_rows() -> list[str]:
  try:
    lines = bench_roofline.run(quick=True, repeats=5, emit=None)
  except Exception as e:  # noqa: BLE001  (a failure is a result here)
    return [f"roofline: FAILED {type(e).__name__}: {str(e)[:120]}"]
  return [line.strip() for line in lines if line.startswith(("reference", "roofline"))]


def ragged_rows(quick: bool) -> list[str]:
  """The ragged kernel on this device against :func:`kvjax.model.ragged.reference`."""
  B, G, group, D, page = (1, 2, 4, 64, 16) if quick else (4, 8, 4, 128, 64)
  C = 4 * page if quick else 16384
  rng = np.random.default_rng(0)
  k = rng.standard_normal((B, G, C, D)).astype(np.float32)
  v = rng.standard_normal((B, G, C, D)).astype(np.float32)
  length = rng.integers(2, C, (B, G))
  length.flat[:3] = (0, 1, C)[: length.size]
  positions = np.broadcast_to(np.arange(C, dtype=np.int32), (B, G, C))
  held = ragged.pack_rows(k, v, length, page=page, positions_BGC=positions)
  held = dataclasses.replace(
    held, keys=jnp.asarray(held.keys, jnp.bfloat16), values=jnp.asarray(held.values, jnp.bfloat16)
  )
  q = jnp.asarray(rng.standard_normal((B * G, group, D)), jnp.bfloat16)
  qpos = jnp.full((B * G,), C, jnp.int32)
  kw = dict(softcap=30.0, query_pos_R=qpos, window=C // 2)
  interpret = jax.default_backend() == "cpu"
  backend = {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "tpu")
  rows = []
  try:
    kernel = jax.jit(
      lambda *a: ragged.ragged_decode_attention(*a, backend=backend, interpret=interpret, **kw)
    )
    reference = jax.jit(lambda *a: ragged.reference(*a, **kw))
    args = (q, held)
    gap = float(jnp.abs(kernel(*args) - reference(*args)).max())
    where = f"{backend} kernel" + (" (interpreter)" if interpret else "")
    rows.append(f"ragged decode, {where}: max |kernel - reference| {gap:.1e}")
    if not interpret:
      t_kernel, t_ref = timed(kernel, *args), timed(reference, *args)
      read = ragged.bytes_read(held.length, page, D, 2)
      rows.append(
        f"ragged decode at {C} slots: kernel {t_kernel * 1e3:.2f} ms, reference "
        f"{t_ref * 1e3:.2f} ms; {read / t_kernel / 1e9:.0f} GB/s of the kernel's own bytes"
      )
  except Exception as e:  # noqa: BLE001  (a failure is a result here)
    rows.append(f"ragged decode: FAILED {type(e).__name__}: {str(e)[:120]}")
  return rows


def paged_rows(cfg, T: int) -> list[str]:
  """The roofline with the kernel: one decode step over the paged cache at Ada-KV's 10 %
  budgets against the stacked step over the same slots (``bench_roofline``'s cache), their
  largest logit difference, and each step's bytes (weights and the K/V it reads) over its time
  as a fraction of a large reduction's bandwidth in the same run."""
  model = km.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
  params = model.params()
  budget_BLH = bench_roofline.case_budgets("adakv10", cfg, T, np.random.default_rng(0))
  B = budget_BLH.shape[0]
  try:
    stacked = bench_roofline.filled_cache(cfg, budget_BLH, jnp.bfloat16, seed=0)
    spec = cache_lib.CacheSpec(policies.make("snapkv"), stacked.keys.shape[3])
    pool = paged.pool_size(budget_BLH, B, bench_roofline.ROOM, paged.PAGE)
    pcache = paged.from_stacked(stacked, new=bench_roofline.ROOM, pool=pool)
    tok, pos = jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32)
    stacked_step = jax.jit(lambda c: cache_lib.decode_step(cfg, params, spec, c, tok, pos, pos)[0])
    paged_step = jax.jit(lambda c: paged.decode_step(cfg, params, c, tok, pos, backend="auto")[0])
    gap = float(jnp.abs(stacked_step(stacked) - paged_step(pcache)).max())
    ref_bytes = 2**32 if jax.default_backend() != "cpu" else 2**28
    reference = bench_roofline.xla_reduction(ref_bytes)
    t_ref, t_stacked, t_paged = (
      timed(lambda: reference()),
      timed(stacked_step, stacked),
      timed(paged_step, pcache),
    )
    bandwidth = ref_bytes / t_ref
    nbytes = bench_roofline.step_bytes(params, stacked)
    weights = nbytes["weights"]
    paged_bytes = weights + paged.bytes_read(pcache)
    return [
      f"paged decode at {T} tokens, Ada-KV 10 %: max |paged - stacked| logits {gap:.1e}",
      f"paged decode: {t_paged * 1e3:.2f} ms ({paged_bytes / 1e6:.0f} MB read, "
      f"{100 * paged_bytes / t_paged / bandwidth:.0f} % of the reduction's "
      f"{bandwidth / 1e9:.0f} GB/s); stacked {t_stacked * 1e3:.2f} ms ({nbytes['read'] / 1e6:.0f} "
      f"MB read, {100 * nbytes['read'] / t_stacked / bandwidth:.0f} %; "
      f"{100 * nbytes['total'] / t_stacked / bandwidth:.0f} % of the held bytes)",
    ]
  except Exception as e:  # noqa: BLE001  (a failure is a result here)
    return [f"paged decode: FAILED {type(e).__name__}: {str(e)[:120]}"]


def notebook_row() -> str:
  import nbclient
  import nbformat

  path = ROOT / "notebooks" / "01_policy_lab.ipynb"
  nb = nbformat.read(path, as_version=4)
  cells = [c for c in nb.cells if "skip-execution" not in c.metadata.get("tags", ())]
  for i, cell in enumerate(cells):
    if "parameters" in cell.metadata.get("tags", ()):
      cells.insert(i + 1, nbformat.v4.new_code_cell("QUICK = True"))
      break
  nb.cells = cells
  t0 = time.perf_counter()
  try:
    nbclient.NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(ROOT)}}).execute()
    return f"notebook 01_policy_lab QUICK: ok in {time.perf_counter() - t0:.0f} s"
  except Exception as e:  # noqa: BLE001
    return f"notebook 01_policy_lab QUICK: FAILED {type(e).__name__}: {str(e)[:120]}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="smaller shapes (a CPU smoke run)")
  args = parser.parse_args()
  cfg = dataclasses.replace(SHAPES["llama-3.2-1b"])
  lengths = (1024, 2048) if args.quick else (8192, 16384, 32768)
  if args.quick:
    cfg = dataclasses.replace(cfg, num_layers=2, vocab_size=4096)
  rows = [
    machine.machine_line(),
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}",
  ]
  rows.append(f"golden selection + kvpress fixtures: {golden_tests()}")
  rows += prefill_rows(cfg, lengths)
  rows.append(decode_row(cfg, lengths[-1] // 2 if args.quick else 16384))
  rows += roofline_rows()
  rows += ragged_rows(args.quick)
  rows += paged_rows(cfg, 2048 if args.quick else 16384)
  rows.append(notebook_row())
  print("\n".join(f"| {r} |" for r in rows))


if __name__ == "__main__":
  main()
