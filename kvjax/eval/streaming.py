"""StreamingLLM's perplexity experiment (Xiao et al. 2023, Fig. 3) on a real model.

One long natural text is read token by token through kvjax's decode-time cache
(:func:`kvjax.model.logprobs.stream_logprobs`) under a sliding window and ``sinks`` attention
sinks + window, at several cache sizes, beside the full cache (one causal forward,
:func:`kvjax.model.logprobs.teacher_forced_logprobs`, which equals reading it token by token).
The paper's finding: once the text outgrows the cache, the window's perplexity explodes (the
first tokens, which soak up attention, are gone), and keeping 4 sink tokens recovers it.

The text ships with Python itself: the "Special method names" section of *The Python Language
Reference*'s "Data model" chapter (about 13k tokens of prose), then "Compound statements" and
"Built-in types", as CPython's ``pydoc_data.topics`` carries them (PSF license); no download. The
tiny model's word vocabulary cannot spell it, so its quick run reads the task haystack's random
sentences instead (``text="filler"``).
"""

from __future__ import annotations

import pathlib
import pydoc_data.topics
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvjax import checks, policies, rundir
from kvjax.eval import tasks
from kvjax.model import llama, logprobs

TEXT_SOURCE = "The Python Language Reference (CPython's pydoc_data.topics, PSF license)"
TOPICS = ("specialnames", "compound", "types")  # the longest stretches of prose in it
TEXTS = ("python_reference", "filler")


def reference_text(min_chars: int) -> str:
  """At least ``min_chars`` characters of continuous English prose from :data:`TOPICS`, joined
  by blank lines."""
  parts, size = [], 0
  for name in TOPICS:
    parts.append(pydoc_data.topics.topics[name].strip())
    size += len(parts[-1])
    if size >= min_chars:
      break
  if size < min_chars:
    raise ValueError(f"min_chars: the reference has {size} characters, fewer than {min_chars}")
  return "\n\n".join(parts)


def text_ids(tokenizer, num_tokens: int, text: str = "python_reference") -> np.ndarray:
  """``[1, num_tokens]`` ids of :func:`reference_text` (``text="filler"``: the task haystack's
  random sentences), ``bos`` first when the tokenizer has one."""
  if text not in TEXTS:
    raise ValueError(f"text: expected one of {TEXTS}, got {text!r}")
  ids = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
  if text == "filler":
    ids += tasks.haystack_ids(tokenizer, num_tokens, seed=0)
  else:
    ids += tokenizer.encode(reference_text(6 * num_tokens))
  if len(ids) < num_tokens:
    raise ValueError(f"num_tokens: the text gives {len(ids)} tokens, fewer than {num_tokens}")
  return np.asarray(ids[:num_tokens], np.int32)[None]


def segment_ppl(logp_S: np.ndarray, segment: int) -> np.ndarray:
  """Perplexity of each consecutive ``segment`` of token log-probabilities."""
  n = len(logp_S) // segment
  return np.exp(-logp_S[: n * segment].reshape(n, segment).mean(-1))


def _streams(config) -> list[tuple[str, tuple[int, ...] | None, dict]]:
  """``(policy, cache sizes read in one scan, options)`` of each stream: the full cache once,
  then the window and sinks + window under every cache size."""
  caches = tuple(int(c) for c in config.caches)
  return [
    ("full", None, {}),
    ("sliding_window", caches, {}),
    ("streaming_llm", caches, {"sinks": int(config.sinks)}),
  ]


def check_run(config, *, model, tokenizer) -> np.ndarray:
  """Checks everything :func:`run` needs before it writes anything: the config's values, the
  model's context, each policy's budgets and the text itself.

  Args:
    config: as :func:`run`.
    model: the model (:class:`kvjax.model.llama.Llama`).
    tokenizer: its tokenizer.

  Returns:
    The text's ids ``[1, num_tokens]`` (:func:`text_ids`).

  Raises:
    ValueError: naming the field or argument, for a missing model or tokenizer, an unknown
      ``text``, a ``num_tokens`` below twice the largest cache or beyond the model's context,
      ``caches`` that are not a non-empty list of slot counts a policy can run with, ``sinks``
      that are not a count below the smallest cache, a ``segment`` that is not a count of at
      most the ``num_tokens - 1`` scored tokens, or a text shorter than ``num_tokens``.
  """
  if model is None or tokenizer is None:
    raise ValueError(
      f"model, tokenizer: expected both (kvjax.eval.evaluate.load_model), got model "
      f"{type(model).__name__} and tokenizer {type(tokenizer).__name__}"
    )
  checks.choice("text", config.text, TEXTS)
  num_tokens = checks.static_int("num_tokens", config.num_tokens, minimum=2)
  caches = config.caches
  if isinstance(caches, str) or not isinstance(caches, Sequence) or not caches:
    raise ValueError(f"caches: expected a non-empty list of slots per head, got {caches!r}")
  for cache in caches:
    checks.static_int("caches", cache)
  if num_tokens < 2 * max(caches):
    raise ValueError(
      f"num_tokens: {num_tokens} must be at least twice the largest cache "
      f"{max(caches)} so the text outgrows it"
    )
  sinks = checks.static_int("sinks", config.sinks, minimum=0)
  if sinks >= min(caches):
    raise ValueError(
      f"sinks: {sinks} leaves no window in the smallest cache {min(caches)}; expected fewer "
      "sinks than slots"
    )
  segment = checks.static_int("segment", config.segment)
  if segment > num_tokens - 1:
    raise ValueError(
      f"segment: {segment} is longer than the {num_tokens - 1} tokens scored; expected at most "
      f"num_tokens - 1"
    )
  llama.check_context(model.cfg, num_tokens)
  for policy, sizes, options in _streams(config):
    if sizes is not None:  # the window a stream's policy protects after its one-token prefix
      pol = policies.build(policy, **options)
      pol.check_budget(np.asarray(sizes), pol.evidence_request(1, reduce_rows=True).window)
  return text_ids(tokenizer, num_tokens, config.text)


def run(config, workdir, *, model=None, tokenizer=None, log=print) -> pd.DataFrame:
  """Every ``(policy, cache size)`` of ``config`` on one text; writes ``results.csv`` (overall
  and per-segment perplexity); returns the table.

  ``config``: ``text`` (:data:`TEXTS`), ``num_tokens``, ``caches`` (slots per head), ``sinks``,
  ``segment`` (tokens per plotted point). The run directory is claimed only after
  :func:`check_run` accepted ``config``, ``model`` and ``tokenizer``: a refused run leaves no
  directory and no file behind.

  Raises:
    ValueError: as :func:`check_run`, and for a ``workdir`` holding another configuration's
      results (:func:`kvjax.rundir.claim`).
  """
  ids = check_run(config, model=model, tokenizer=tokenizer)
  fields = {k: config[k] for k in config if k != "workdir"}
  done = (pathlib.Path(workdir) / "results.csv").exists()
  out = rundir.claim(workdir, "streaming.json", rundir.signature(fields), has_results=done)
  rows = []
  for policy, caches, options in _streams(config):
    t0 = time.time()
    if caches is None:  # one causal forward: the full cache read token by token, at once
      logps = {None: logprobs.teacher_forced_logprobs(model, ids)[0]}
    else:
      logp_K = logprobs.stream_logprobs(model, ids, policy=policy, budgets=caches, **options)
      logps = {cache: logp_K[k, 0] for k, cache in enumerate(caches)}
    seconds = (time.time() - t0) / len(logps)
    for cache, logp in logps.items():
      label = "full cache" if cache is None else f"{policy} {cache}"
      rows.append(
        dict(
          policy=policy,
          cache=cache or config.num_tokens,
          sinks=options.get("sinks", 0),
          ppl=float(np.exp(-logp.mean())),
          ppl_after_cache=float(np.exp(-logp[(cache or 0) :].mean())),
          segments=" ".join(f"{v:.3f}" for v in segment_ppl(logp, config.segment)),
          seconds=round(seconds, 1),
        )
      )
      log(f"{label:22s} ppl {rows[-1]['ppl']:8.2f} ({rows[-1]['seconds']:.0f} s)")
  table = pd.DataFrame(rows)
  rundir.write_rows(out / "results.csv", table)
  return table
