"""SmolLM2's prefill: kvjax against torch's SDPA, measured in one process.

The model body only (embedding, 30 decoder layers, final norm and the last position's logits),
batch 1, a prompt of natural text (:func:`kvjax.eval.streaming.text_ids`) at 1k and 2k tokens,
in four precisions on kvjax's side and two on torch's:

* ``fp32``: every weight and activation fp32 (kvjax's matmuls at ``Precision.HIGHEST``; torch's
  default fp32 matmuls);
* ``mixed`` (kvjax, ``km.load(..., matmul_dtype=jnp.bfloat16)``): the projections' and MLP's
  weights in bf16, their matmuls on bf16 operands accumulated in fp32 (the CPU's AVX-512 BF16 and
  AMX units), the residual stream, norms, attention, softmax and cache in fp32;
* ``mixed-bf16att`` (kvjax): ``mixed`` with ``PrefillPlan(attention_dtype=jnp.bfloat16)``: the
  attention output's two matmuls on bf16 operands too (fp32 accumulation and softmax), as flash
  attention runs in bf16;
* ``bf16``: the model loaded in bf16 (kvjax: ``km.load(..., dtype=jnp.bfloat16)``, every
  activation bf16, the matmuls accumulated in fp32, the blocked kernel's attention on bf16
  operands too; torch: oneDNN's bf16 kernels): the like-for-like comparison, and torch's nearest
  to kvjax's mixed precision, less exact.

kvjax runs ``km.llama.prefill`` jitted with no evidence asked for, in each attention kernel it
offers; torch runs transformers' ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` on the
same GGUF file under ``torch.inference_mode()`` with ``logits_to_keep=1``. Each timing is the
median of ``--repeats`` warm calls, taken in interleaved rounds (every kvjax run, then every torch
run) so that both sides see the same machine; compile is reported apart. Each run's last logits
are compared with torch fp32's. Prints, last, kvjax's best time in each precision as a multiple
of torch fp32's and torch bf16's, with the range of the rounds' own ratios (target: at most
0.8x).

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

from experiments import machine
from kvjax import model as km
from kvjax.eval import streaming


def seconds(fn, arg) -> float:
  """Wall time of one call of ``fn(arg)`` (its result ready: blocked on)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(arg))
  return time.perf_counter() - t0


def kvjax_prefill(cfg, params, attention: str, block: int, attention_dtype=jnp.float32):
  """``ids -> last logits``: the jitted prefill with no evidence (what generation runs). The
  weights are an argument, not a closure, so XLA does not fold 0.5 GB of constants."""
  run = jax.jit(
    lambda p, ids: (
      km.llama.prefill(
        cfg,
        p,
        ids,
        plan=km.llama.PrefillPlan(block, attention=attention, attention_dtype=attention_dtype),
      ).logits
    )
  )
  return functools.partial(run, params)


def torch_prefill(threads: int, dtypes: list[str]):
  """``{precision: ids -> last logits}`` through transformers' SDPA model, or ``None`` without
  torch."""
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
  runs = {}
  for name in dtypes:
    hf = AutoModelForCausalLM.from_pretrained(
      str(path.parent),
      gguf_file=path.name,
      dtype=getattr(torch, TORCH_DTYPES[name]),
      attn_implementation="sdpa",
    ).eval()

    def run(ids, hf=hf):
      with torch.inference_mode():
        return hf(torch.as_tensor(np.asarray(ids), dtype=torch.long), logits_to_keep=1).logits

    runs[f"torch {name}"] = run
  return runs


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def last_logits(out) -> np.ndarray:
  """The last position's logits of either side as fp32 numpy ``[B, V]``."""
  if hasattr(out, "float"):  # a torch tensor
    out = out.float().numpy()
  return np.asarray(out, np.float32)[:, -1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--attention", nargs="+", default=["blocked", "xla"])
  parser.add_argument("--blocks", type=int, nargs="+", default=[256], help="attention tile sizes")
  parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
  parser.add_argument(
    "--torch-precisions", nargs="+", default=["fp32", "bf16"], choices=TORCH_DTYPES
  )
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
  args = parser.parse_args()
  threads = args.threads or os.cpu_count()
  print(machine.machine_line())
  model, cfg = km.load("smollm2", dtype="float32")
  params = {"fp32": model.params()}
  params["mixed"] = km.llama.with_matmul_dtype(params["fp32"], jnp.bfloat16)
  params["mixed-bf16att"] = params["mixed"]
  if "bf16" in args.precisions:
    params["bf16"] = km.load("smollm2", dtype="bfloat16")[0].params()
  tokenizer = km.load_tokenizer("smollm2")
  print(f"jax {jax.__version__} on {jax.default_backend()}; SmolLM2-135M, batch 1")
  reference = torch_prefill(threads, args.torch_precisions)
  if reference is None:
    print("torch/transformers not installed: kvjax times only")
  summary = []
  for T in args.lengths:
    ids = streaming.text_ids(tokenizer, T)
    x = jnp.asarray(ids)
    runs, compile_s, outputs = {}, {}, {}
    for precision in args.precisions:
      for attention, block in [(a, b) for a in args.attention for b in args.blocks]:
        bf16_operands = precision.endswith(("bf16att", "bf16"))
        if bf16_operands and attention != "blocked" and precision == "mixed-bf16att":
          continue  # the other kernels take no attention_dtype: the same run as "mixed"
        key = f"kvjax {precision} {attention} {block}"
        operands = jnp.bfloat16 if bf16_operands and attention == "blocked" else jnp.float32
        runs[key] = kvjax_prefill(cfg, params[precision], attention, block, operands)
        t0 = time.perf_counter()
        outputs[key] = last_logits(jax.block_until_ready(runs[key](x)))
        compile_s[key] = time.perf_counter() - t0
    for key, run in (reference or {}).items():
      outputs[key] = last_logits(run(ids))  # warm-up, and the logits compared
      runs[key] = run
    base = outputs.get("torch fp32", outputs[next(iter(outputs))])
    # interleaved rounds: every run once per round, so that a machine whose speed drifts (a
    # shared 2-core VM moves by 10-20 % between minutes) slows both sides alike
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
      for key, run in runs.items():
        times[key].append(seconds(run, x if key.startswith("kvjax") else ids))
    for key in runs:
      warm = statistics.median(times[key])
      gap = float(np.abs(outputs[key] - base).max())
      extra = f"; first call incl. compile {compile_s[key]:.1f} s" if key in compile_s else ""
      print(
        f"T={T:5d} {key:31s} {warm * 1e3:8.0f} ms ({T / warm:,.0f} tok/s; last logits within "
        f"{gap:.1e} of torch fp32{extra})"
      )
    for precision in args.precisions:
      mine = [key for key in runs if key.startswith(f"kvjax {precision} ")]
      if not mine:
        continue
      best = min(mine, key=lambda key: statistics.median(times[key]))
      for theirs in reference or {}:
        per_round = [a / b for a, b in zip(times[best], times[theirs], strict=True)]
        ratio = statistics.median(times[best]) / statistics.median(times[theirs])
        summary.append((T, best, theirs, ratio, min(per_round), max(per_round)))
  for T, best, theirs, ratio, low, high in summary:
    print(
      f"T={T}: {best} {ratio:.2f}x {theirs}'s time (rounds {low:.2f}-{high:.2f}x; target <= 0.8x)"
    )


PRECISIONS = ("fp32", "mixed", "mixed-bf16att", "bf16")


if __name__ == "__main__":
  main()
