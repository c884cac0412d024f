"""SmolLM2's prefill on this machine: kvjax against torch's SDPA, measured in one process.

The model body only (embedding, 30 decoder layers, final norm and the last position's logits),
fp32 on both sides, batch 1, a prompt of natural text (:func:`kvjax.eval.streaming.text_ids`) at
1k and 2k tokens. kvjax runs ``km.llama.prefill`` jitted with no evidence asked for, in each
attention kernel it offers; torch runs transformers' ``LlamaForCausalLM`` with
``attn_implementation="sdpa"`` on the same GGUF file under ``torch.inference_mode()`` with
``logits_to_keep=1``. Each timing is the median of ``--repeats`` warm calls; compile is reported
apart. Prints, last, kvjax's time as a multiple of torch's (issue 16's target: at most 1.0x).

torch and transformers are test-only dependencies: without them the comparison is skipped and
only kvjax's times are printed.

Usage: ``python -m experiments.bench_prefill [--lengths 1024 2048] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as km
from kvjax.eval import streaming


def median_seconds(fn, arg, repeats: int) -> float:
  """Median wall time of ``fn(arg)`` over ``repeats`` calls (results ready: blocked on)."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def kvjax_prefill(model, attention: str, block: int):
  """``ids -> last logits``: the jitted prefill with no evidence (what generation runs). The
  weights are an argument, not a closure, so XLA does not fold 0.5 GB of constants."""
  cfg, params = model.cfg, model.params()
  run = jax.jit(
    lambda p, ids: km.llama.prefill(cfg, p, ids, attention=attention, block=block).logits
  )
  return functools.partial(run, params)


def torch_prefill(threads: int):
  """``ids -> last logits`` through transformers' SDPA model, or ``None`` without torch."""
  try:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
  except ImportError:
    return None
  logging.set_verbosity_error()
  logging.disable_progress_bar()
  torch.set_num_threads(threads)
  path = km.smollm2_path()
  hf = AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
  ).eval()

  def run(ids):
    with torch.inference_mode():
      return hf(torch.as_tensor(np.asarray(ids), dtype=torch.long), logits_to_keep=1).logits

  return run


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--attention", nargs="+", default=["blocked", "xla"])
  parser.add_argument("--blocks", type=int, nargs="+", default=[256], help="attention tile sizes")
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
  args = parser.parse_args()
  threads = args.threads or os.cpu_count()
  model, _ = km.load("smollm2", dtype="float32")
  tokenizer = km.load_tokenizer("smollm2")
  print(f"jax {jax.__version__} on {jax.default_backend()}; SmolLM2-135M fp32, batch 1")
  reference = torch_prefill(threads)
  if reference is None:
    print("torch/transformers not installed: kvjax times only")
  ratios = []
  for T in args.lengths:
    ids = streaming.text_ids(tokenizer, T)
    best = None
    for attention, block in [(a, b) for a in args.attention for b in args.blocks]:
      run = kvjax_prefill(model, attention, block)
      x = jnp.asarray(ids)
      t0 = time.perf_counter()
      ours = np.asarray(jax.block_until_ready(run(x)))
      compile_s = time.perf_counter() - t0
      warm = median_seconds(run, x, args.repeats)
      print(
        f"T={T:5d} kvjax attention={attention:8s} block={block:5d} {warm * 1e3:8.0f} ms "
        f"({T / warm:,.0f} tok/s; first call incl. compile {compile_s:.1f} s)"
      )
      best = warm if best is None else min(best, warm)
    if reference is not None:
      theirs = reference(ids)
      gap = float(np.abs(theirs.float().numpy()[:, -1] - ours[:, -1]).max())
      warm_t = median_seconds(reference, ids, args.repeats)
      print(
        f"T={T:5d} torch SDPA ({threads} threads)   {warm_t * 1e3:8.0f} ms (last logits within {gap:.1e})"
      )
      ratios.append((T, best / warm_t))
  for T, ratio in ratios:
    print(f"T={T}: kvjax {ratio:.2f}x torch SDPA's time (target <= 1.0x)")


if __name__ == "__main__":
  main()
