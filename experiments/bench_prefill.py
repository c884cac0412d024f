"""SmolLM2's prefill on this machine: kvjax against torch's SDPA, measured in one process.

The model body only (embedding, 30 decoder layers, final norm and the last position's logits),
fp32 on both sides, batch 1, a prompt of natural text (:func:`kvjax.eval.streaming.text_ids`) at
1k and 2k tokens. kvjax runs ``km.llama.prefill`` jitted with no evidence asked for, in each
attention kernel it offers; torch runs transformers' ``LlamaForCausalLM`` with
``attn_implementation="sdpa"`` on the same GGUF file under ``torch.inference_mode()`` with
``logits_to_keep=1``. Each timing is the median of ``--repeats`` warm calls, taken in
interleaved rounds (each kernel, then torch) so that both sides see the same machine; compile is
reported apart. Prints, last, kvjax's time as a multiple of torch's, with the range of the
rounds' own ratios (issue 16's target: at most 1.0x).

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


def seconds(fn, arg) -> float:
  """Wall time of one call of ``fn(arg)`` (its result ready: blocked on)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(arg))
  return time.perf_counter() - t0


def kvjax_prefill(model, attention: str, block: int):
  """``ids -> last logits``: the jitted prefill with no evidence (what generation runs). The
  weights are an argument, not a closure, so XLA does not fold 0.5 GB of constants."""
  cfg, params = model.cfg, model.params()
  run = jax.jit(
    lambda p, ids: (
      km.llama.prefill(cfg, p, ids, plan=km.llama.PrefillPlan(block, attention=attention)).logits
    )
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
    x = jnp.asarray(ids)
    runs = {}
    for attention, block in [(a, b) for a in args.attention for b in args.blocks]:
      run = kvjax_prefill(model, attention, block)
      t0 = time.perf_counter()
      ours = np.asarray(jax.block_until_ready(run(x)))
      runs[(attention, block)] = (run, time.perf_counter() - t0)
    if reference is not None:
      theirs = reference(ids)  # warm-up, and the logits compared
      gap = float(np.abs(theirs.float().numpy()[:, -1] - ours[:, -1]).max())
    # interleaved rounds: every kernel and torch once per round, so that a machine whose speed
    # drifts (a shared 2-core VM moves by 10-20 % between minutes) slows both sides alike
    times = {key: [] for key in runs}
    times["torch"] = []
    for _ in range(args.repeats):
      for key, (run, _) in runs.items():
        times[key].append(seconds(run, x))
      if reference is not None:
        times["torch"].append(seconds(reference, ids))
    for (attention, block), (_, compile_s) in runs.items():
      warm = statistics.median(times[(attention, block)])
      print(
        f"T={T:5d} kvjax attention={attention:8s} block={block:5d} {warm * 1e3:8.0f} ms "
        f"({T / warm:,.0f} tok/s; first call incl. compile {compile_s:.1f} s)"
      )
    if reference is not None:
      warm_t = statistics.median(times["torch"])
      print(
        f"T={T:5d} torch SDPA ({threads} threads)   {warm_t * 1e3:8.0f} ms (last logits within {gap:.1e})"
      )
      best = min(runs, key=lambda key: statistics.median(times[key]))
      per_round = [a / b for a, b in zip(times[best], times["torch"], strict=True)]
      ratios.append((T, statistics.median(times[best]) / warm_t, min(per_round), max(per_round)))
  for T, ratio, low, high in ratios:
    print(
      f"T={T}: kvjax {ratio:.2f}x torch SDPA's time (rounds {low:.2f}-{high:.2f}x; target <= 1.0x)"
    )


if __name__ == "__main__":
  main()
