"""XLA's compiled memory plan of ``km.prefill`` for real model shapes, without any weights.

Lowers and compiles ``llama.prefill`` on abstract parameters (``nnx.eval_shape``) of a
Llama-3.2-1B- and a Llama-3.1-8B-shaped model in bf16, batch 1, and prints the plan XLA makes
(``compile().memory_analysis()``: arguments, outputs, temporaries) at 8k, 32k and 128k tokens,
with the evidence the policies read (32 window rows, H2O's column sums). It needs no device
memory, so it answers on this CPU what a Colab chip would need. Targets (issue 14): 1B at 32k
<= 8 GiB, 1B at 128k <= 16 GiB (one v5e chip). The rows with a target are planned three times:
with the window rows in fp32 (``km.prefill``'s default), in bf16 (``PrefillPlan.window_dtype``,
opt-in), and reduced to SnapKV's scores inside the layer scan (the request's ``window_scores``:
what ``km.generate``, ``km.keep_mask`` and ``km.generate_configs`` ask for when a policy of
SnapKV's family or TOVA is alone on its prefill; ``[L, 1, Hq, T]`` scores instead of
``[L, 1, Hq, 32, T]`` rows).

What the plan shows: outputs are K/V (``[L, 1, G, T, D]`` bf16) and the window rows
(``[L, 1, Hq, 32, T]``, 8 GiB in fp32 at 128k for 1B); temporaries stay near the residual
stream (``[1, T, d]``) plus one layer's weights and one chunk's activations, with no
``[Hq, block, T]`` attention block (queries x keys are tiled, the tiles above the causal
diagonal never read) and no ``[T, F]`` MLP intermediates (``chunk`` tokens at a time). On CPU,
XLA computes bf16 matmuls in fp32, so the temporaries hold one layer's fp32 weight copies
(up to 0.23 GiB for 1B, 0.81 GiB for 8B) that a TPU or GPU would not need.

Usage: ``python -m experiments.bench_memory [--quick] [--block 256] [--chunk 2048]
[--attention blocked]``.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import machine
from kvjax import model as km
from kvjax import policies

GiB = 2**30
SHAPES = {
  "llama-3.2-1b": km.ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
  ),
  "llama-3.1-8b": km.ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
  ),
}
TARGETS_GIB = {("llama-3.2-1b", 32768): 8.0, ("llama-3.2-1b", 131072): 16.0}
# the policies' evidence: the window rows of the reference window and H2O's column sums
EVIDENCE = policies.EvidenceRequest(window=policies.DEFAULT_WINDOW, column_sums=True)
# the window evidence, (request, window_dtype): rows in fp32 or bf16, or reduced to SnapKV's
# scores in the layer scan
WINDOW_MODES = {
  "float32": (EVIDENCE, jnp.float32),
  "bfloat16": (EVIDENCE, jnp.bfloat16),
  "scores": (
    dataclasses.replace(EVIDENCE, window_scores=policies.make("snapkv").window_scorer()),
    jnp.float32,
  ),
}


def plan(cfg: km.ModelConfig, T: int, request, prefill_plan: km.llama.PrefillPlan) -> dict:
  """The memory plan (bytes) of one prefill of ``T`` tokens computing ``request`` under
  ``prefill_plan``."""
  model = nnx.eval_shape(lambda: km.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # ShapeDtypeStructs: no weights
  ids = jax.ShapeDtypeStruct((1, T), jnp.int32)

  def prefill(p, i):
    return km.prefill(
      cfg,
      p,
      i,
      request=request,
      plan=prefill_plan,
    )

  stats = jax.jit(prefill).lower(params, ids).compile().memory_analysis()
  return {
    "arguments": stats.argument_size_in_bytes,
    "outputs": stats.output_size_in_bytes,
    "temporaries": stats.temp_size_in_bytes,
    "total": stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="1B at 8k only")
  parser.add_argument("--block", type=int, default=256, help="queries (and keys) per tile")
  parser.add_argument(
    "--chunk", type=int, default=km.llama.CHUNK, help="tokens per chunk (0: the whole prompt)"
  )
  parser.add_argument("--attention", default="blocked", choices=km.llama.ATTENTION)
  args = parser.parse_args()
  print(machine.machine_line())
  chunk = args.chunk or None
  cases = [("llama-3.2-1b", 8192)]
  if not args.quick:
    cases += [(n, t) for n in SHAPES for t in (8192, 32768, 131072)][1:]
  print(
    f"prefill(request=EvidenceRequest(window={EVIDENCE.window}, column_sums=True), "
    f"block={args.block}, chunk={chunk}, "
    f"attention={args.attention!r}), bf16 weights, batch 1"
  )
  print(
    f"{'model':14s} {'tokens':>7s} {'window':>8s} {'args':>8s} {'outputs':>8s} {'temps':>8s} "
    f"{'total':>8s}"
  )
  met = {}
  for name, T in cases:
    target = TARGETS_GIB.get((name, T))
    for dtype_name in WINDOW_MODES if target is not None or args.quick else ("float32", "scores"):
      request, window_dtype = WINDOW_MODES[dtype_name]
      prefill_plan = km.llama.PrefillPlan(args.block, chunk, args.attention, window_dtype)
      p = plan(SHAPES[name], T, request, prefill_plan)
      gib = {k: v / GiB for k, v in p.items()}
      verdict = ""
      if target is not None:
        ok = gib["total"] <= target
        met.setdefault(dtype_name, []).append(ok)
        verdict = f"  target <= {target:.0f} GiB: " + ("met" if ok else "MISSED")
      print(
        f"{name:14s} {T:7d} {dtype_name:>8s} {gib['arguments']:7.2f}G {gib['outputs']:7.2f}G "
        f"{gib['temporaries']:7.2f}G {gib['total']:7.2f}G{verdict}"
      )
  notes = {
    "float32": "window rows in fp32 (km.prefill's default)",
    "bfloat16": "window rows in bf16 (opt-in)",
    "scores": "SnapKV's scores reduced in the layer scan (km.generate's single-policy prefill)",
  }
  for dtype_name, oks in met.items():
    state = "all met" if all(oks) else f"{oks.count(False)} of {len(oks)} MISSED"
    print(f"targets with {notes[dtype_name]}: {state}")


if __name__ == "__main__":
  main()
