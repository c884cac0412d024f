"""Memory plans per chip: the longest prompt a policy family fits, from XLA's compiled plans.

:func:`plan` compiles the three programs one generation runs, at abstract shapes
(``jax.ShapeDtypeStruct``: no weights, nothing allocated), and reads XLA's memory plan of each
(``compile().memory_analysis()``): the prefill with the evidence the policy asks for
(:func:`kvjax.model.decoding.jit_prefill`), the compression of its outputs into the cache
(the weights held alongside), and one decode step over the cache sized for every generated
token (the cache donated, as the decode loop updates it in place; every step holds the same
buffers). A program's bytes are its arguments, outputs and temporaries, less what an output
aliases; the run's peak is the largest program's. :func:`longest_prompt` searches prompt
lengths on a grid (doubling, then bisection) for the longest whose peak fits a chip of
:data:`CHIPS` with :data:`HEADROOM` of its memory left free.

What the plan is and is not:

* It is XLA's **CPU** compile of the program, not a TPU's or a GPU's: their compilers may lay
  buffers out differently (fusion, rematerialisation, their own scratch, and the CPU's
  workarounds that kvjax takes on CPU only: 16-bit K/V carried as bits, the LM head by
  vocabulary chunks, the packed sort). The headroom is there for that, the runtime's own
  allocations and fragmentation. XLA:CPU computes bf16 matmuls in fp32, so the temporaries hold
  one layer's fp32 weight copies (0.8 GiB at 8B) that a TPU or GPU never allocates: the plan
  errs short on that side. The decode step is the device's form (the stacked cache; on CPU
  kvjax splits the cache per layer for speed).
* Compile with ``XLA_FLAGS=--xla_disable_hlo_passes=while-loop-invariant-code-motion``
  (``experiments/memory_plan.py`` sets it): otherwise XLA:CPU converts every layer's bf16
  weights to fp32 once, before the decode step's layer loop (twice the weights' bytes of
  temporaries), which is an artefact of the CPU's fp32 matmuls.
* **Sharded weights** (``shards=N``) are planned by compiling the per-device program of
  kvjax's tensor-parallel layout (:mod:`kvjax.model.sharding`): each device holds ``Hq / N``
  query and ``G / N`` KV heads of every layer and ``F / N`` of the MLP's features, with the
  embeddings, norms and LM head whole. That program is the model's own at a config with those
  head counts and MLP width (:func:`shard_config`); its plan is one device's, without the
  all-reduce buffers (a ``[B, chunk, d]`` activation per layer) and with each head group's
  allocation made within the device's own heads. ``N`` must divide ``G``, ``Hq`` and ``F``
  (kvjax replicates K/V heads that do not divide, saving less).
* Policies whose allocator adapts to the prompt (Ada-KV) are planned at the library's own bound
  (:func:`kvjax.model.decoding.slots_bound`): any head may hold the whole prompt, and the
  stacked cache pads every head to its layer's largest, so their cache is the full one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax import policies
from kvjax.eval import export_check
from kvjax.model import cache as cache_lib
from kvjax.model import decoding
from kvjax.model.config import ModelConfig

GiB = 2**30
HEADROOM = 0.10  # the fraction of a chip's memory left free: compiler, runtime, fragmentation
NEW_TOKENS = 128  # tokens generated after the prompt (the cache's room and the decode loop)
STEP = 1024  # the grid of prompt lengths searched
FRACTIONS = (1.0, 0.25, 0.1)


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator.

  Attributes:
    name: its short name.
    hbm_gib: its memory in GiB, as the runtime reports it usable.
    platform: ``"tpu"`` or ``"gpu"``.
    device_kind: a regular expression that ``jax.Device.device_kind`` (lower-cased) matches.
  """

  name: str
  hbm_gib: float
  platform: str
  device_kind: str


CHIPS = {
  c.name: c
  for c in (
    Chip("v5e-1", 16.0, "tpu", r"v5 ?lite|v5e"),
    Chip("v6e-1", 32.0, "tpu", r"v6 ?lite|v6e"),
    Chip("t4", 15.0, "gpu", r"\bt4\b"),
    Chip("l4", 24.0, "gpu", r"\bl4\b"),
    Chip("a100-40", 40.0, "gpu", r"a100.*40gb"),
    Chip("a100-80", 80.0, "gpu", r"a100.*80gb"),
    Chip("h100-80", 80.0, "gpu", r"h100"),
  )
}

# a family's representative policy: what its prefill computes and what its cache holds
FAMILIES = {
  "snapkv": "snapkv",  # window scores reduced in the layer scan; a uniform budget (PyramidKV too)
  "adakv": "adakv_snapkv",  # the same evidence, budgets allocated per head from it
  "h2o": "h2o",  # column sums over the whole prompt; accumulated scores evicted while decoding
  "knorm": "knorm",  # no attention evidence: key norms alone
  "expected_attention": "expected_attention",  # query statistics of the prompt
}


def qwen3_8b(num_layers: int = 36) -> ModelConfig:
  """A Qwen3-8B-shaped config (32 query / 8 KV heads of 128 with QK-norm, d 4096, F 12288).

  Args:
    num_layers: the layers (36 in the model).

  Returns:
    The config.
  """
  return ModelConfig(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=num_layers,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
    family="qwen3",
    max_positions=40960,
  )


MODELS = {"llama-3.1-8b": export_check.llama31_8b, "qwen3-8b": qwen3_8b}


def _entry(table: dict, name: str, arg: str, what: str):
  """``table[name]``; a ``ValueError`` naming ``arg`` and the known names when there is none."""
  if name not in table:
    raise ValueError(f"{arg}: unknown {what} {name!r}; expected one of {tuple(table)}")
  return table[name]


def check_chip(chip: str) -> Chip:
  """The :class:`Chip` named ``chip``.

  Raises:
    ValueError: for a name not in :data:`CHIPS`.
  """
  return _entry(CHIPS, chip, "chip", "chip")


def check_family(family: str) -> str:
  """The registered policy name of ``family``.

  Raises:
    ValueError: for a family not in :data:`FAMILIES`.
  """
  return _entry(FAMILIES, family, "family", "policy family")


def check_fraction(fraction) -> float:
  """``fraction`` as a float in ``(0, 1]``.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(fraction, bool) or not isinstance(fraction, int | float):
    raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
  if not (0 < fraction <= 1) or math.isnan(fraction):
    raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
  return float(fraction)


def _check_count(name: str, value, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
  return value


def check_headroom(headroom) -> float:
  """``headroom`` as a float in ``[0, 1)``.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 <= headroom < 1:
    raise ValueError(f"headroom: expected a fraction in [0, 1), got {headroom!r}")
  return float(headroom)


def shard_config(cfg: ModelConfig, shards: int) -> ModelConfig:
  """The config whose program is one device's of ``cfg``'s weights split over ``shards``.

  kvjax's tensor-parallel layout (:mod:`kvjax.model.sharding`) gives each device whole query
  and KV heads and a slice of the MLP's features; the embeddings, norms and LM head stay
  whole. A device then runs the model at ``Hq / N`` and ``G / N`` heads and ``F / N``
  features (plus the all-reduces, whose buffers this leaves out).

  Args:
    cfg: the model's config.
    shards: the devices the weights are split over.

  Returns:
    ``cfg`` with its heads and MLP width divided by ``shards``.

  Raises:
    ValueError: for ``shards`` not an int >= 1, or one that does not divide the KV heads, the
      query heads and the MLP width.
  """
  n = _check_count("shards", shards)
  counts = {
    "num_kv_heads": cfg.num_kv_heads,
    "num_heads": cfg.num_heads,
    "intermediate_size": cfg.intermediate_size,
  }
  wrong = {k: v for k, v in counts.items() if v % n}
  if wrong:
    raise ValueError(f"shards: {n} does not divide the model's {wrong}; expected a divisor of all")
  return dataclasses.replace(cfg, **{k: v // n for k, v in counts.items()})


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one generation runs besides the model and the prompt.

  Attributes:
    batch: rows per call.
    new_tokens: tokens generated after the prompt (the cache's room and the decode loop).
    shards: the devices the weights are split over (:func:`shard_config`); a plan is one
      device's.

  Raises:
    ValueError: for counts that are not ints >= 1, when built.
  """

  batch: int = 1
  new_tokens: int = NEW_TOKENS
  shards: int = 1

  def __post_init__(self):
    for arg in ("batch", "new_tokens", "shards"):
      _check_count(arg, getattr(self, arg))


@dataclasses.dataclass(frozen=True)
class Plan:
  """XLA's memory plan of one generation, in bytes.

  Attributes:
    prefill: the prefill program's arguments + outputs + temporaries.
    compress: the compression's (the weights and the prefill's outputs in, the cache out).
    decode: one decode step's (the weights and the cache, updated in place).
    weights: the weights' bytes (one device's).
    cache: the compressed cache's bytes (the decode loop's cache output).
  """

  prefill: int
  compress: int
  decode: int
  weights: int
  cache: int

  @property
  def peak(self) -> int:
    """The larger program's bytes: what the device must hold at once."""
    return max(self.prefill, self.compress, self.decode)


def _bytes(compiled) -> int:
  """A compiled program's planned bytes: arguments, outputs and temporaries (an output that
  aliases an argument counted once)."""
  m = compiled.memory_analysis()
  return (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )


def _tree_bytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _ids(batch: int, tokens: int):
  return jax.ShapeDtypeStruct((batch, tokens), jnp.int32)


@functools.cache
def _prefill_bytes(cfg: ModelConfig, name: str, tokens: int, batch: int) -> tuple[int, object]:
  """The prefill program's bytes and its abstract output, traced for the device."""
  pol = policies.build(name)
  params = export_check.abstract_params(cfg, jnp.bfloat16)
  ids = _ids(batch, tokens)
  request = pol.evidence_request(tokens, reduce_rows=True)
  lowered = decoding.jit_prefill.lower(cfg, params, ids, ids, request)
  pre = jax.eval_shape(
    functools.partial(decoding.jit_prefill, cfg, request=request), params, ids, ids
  )
  return _bytes(lowered.compile()), pre


def _compress(cfg, spec, params, pre, budget):
  """Compression of the prefill into the cache; the weights stay resident meanwhile (an
  argument kept, unused)."""
  del params
  return cache_lib.compress(cfg, pre, spec, budget)


def _decode_step(cfg, spec, params, cache, token, pos, t):
  """One decode step; the cache is donated, as the decode loop updates its carry in place."""
  return cache_lib.decode_step(cfg, params, spec, cache, token, pos, t, step=0)


@functools.cache
def _plan(cfg: ModelConfig, name: str, fraction: float, tokens: int, batch: int, new: int) -> Plan:
  prefill, pre = _prefill_bytes(cfg, name, tokens, batch)
  pol = policies.build(name)
  budget = max(1, int(tokens * fraction))
  capacity = decoding.slots_bound(pol, budget, tokens, new)
  spec = cache_lib.CacheSpec(pol, capacity, new_tokens=new)
  params = export_check.abstract_params(cfg, jnp.bfloat16)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  compress = jax.jit(_compress, static_argnames=("cfg", "spec"), keep_unused=True)
  lowered = compress.lower(cfg, spec, params, pre, scalar)
  cache = jax.eval_shape(functools.partial(_compress, cfg, spec), params, pre, scalar)
  compressed = _bytes(lowered.compile())
  rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
  step = jax.jit(_decode_step, static_argnames=("cfg", "spec"), donate_argnames=("cache",))
  lowered = step.lower(cfg, spec, params, cache, rows, rows, rows)
  decoded = _bytes(lowered.compile())
  return Plan(prefill, compressed, decoded, _tree_bytes(params), _tree_bytes(cache))


def plan(
  cfg: ModelConfig,
  family: str,
  fraction: float,
  tokens: int,
  *,
  workload: Workload = Workload(),
) -> Plan:
  """XLA's compiled memory plan of one generation (prefill, compression, decode), in bf16.

  Compiles are cached by their shapes: a prefill is compiled once for every cache fraction.

  Args:
    cfg: the model's config.
    family: a policy family of :data:`FAMILIES`.
    fraction: the cache's budget as a fraction of the prompt, in ``(0, 1]`` (1: every token).
    tokens: the prompt's tokens per row.
    workload: the batch, the tokens generated and the shards (:class:`Workload`).

  Returns:
    The :class:`Plan`.

  Raises:
    ValueError: for an unknown family, a fraction outside ``(0, 1]``, ``tokens`` not an int
      >= 1, or shards that do not divide the model's heads.
  """
  name = check_family(family)
  fraction = check_fraction(fraction)
  _check_count("tokens", tokens)
  cfg = shard_config(cfg, workload.shards)
  return _plan(cfg, name, fraction, tokens, workload.batch, workload.new_tokens)


def longest_fitting(
  bytes_of: Callable[[int], int], limit: int, *, step: int = STEP, max_tokens: int
) -> tuple[int, list[int]]:
  """The longest multiple of ``step`` up to ``max_tokens`` whose ``bytes_of`` is at most ``limit``.

  ``bytes_of`` must not decrease with the length. Doubling from ``step`` brackets the answer,
  bisection on the grid narrows it; the search stops at the first length that does not fit.

  Args:
    bytes_of: a prompt length -> the bytes it needs.
    limit: the bytes available.
    step: the grid's spacing (tokens).
    max_tokens: the longest prompt allowed (the model's context less the generated tokens).

  Returns:
    ``(tokens, tried)``: the longest fitting length (0 when not even ``step`` fits) and the
    lengths evaluated, in order.

  Raises:
    ValueError: for ``step`` or ``max_tokens`` not an int >= 1, or ``limit`` < 0.
  """
  _check_count("step", step)
  _check_count("max_tokens", max_tokens)
  if isinstance(limit, bool) or not isinstance(limit, int | float) or limit < 0:
    raise ValueError(f"limit: expected bytes >= 0, got {limit!r}")
  top = max_tokens // step  # the grid's last point, in steps
  tried = []

  def fits(k: int) -> bool:
    tried.append(k * step)
    return bytes_of(k * step) <= limit

  if top == 0 or not fits(1):
    return 0, tried
  lo, hi = 1, None
  while hi is None:
    k = min(2 * lo, top)
    if k == lo:  # the whole grid fits
      return lo * step, tried
    if fits(k):
      lo = k
    else:
      hi = k
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo * step, tried


def max_prompt(cfg: ModelConfig, new_tokens: int = NEW_TOKENS) -> int:
  """The longest prompt the model's context allows before ``new_tokens`` (its
  ``max_positions``; 128k when it does not say)."""
  context = cfg.max_positions if cfg.max_positions is not None else 131072
  return context - new_tokens


def longest_prompt(
  cfg: ModelConfig,
  family: str,
  fraction: float,
  chip: str,
  *,
  workload: Workload = Workload(),
  headroom: float = HEADROOM,
  step: int = STEP,
) -> int:
  """The longest prompt (a multiple of ``step``) a chip fits under a policy family.

  Args:
    cfg: the model's config.
    family: a policy family of :data:`FAMILIES`.
    fraction: the cache's budget as a fraction of the prompt, in ``(0, 1]``.
    chip: a chip of :data:`CHIPS`.
    workload: the batch, the tokens generated and the chips the weights are split over
      (:class:`Workload`; the plan is one chip's).
    headroom: the fraction of the chip's memory left free.
    step: the grid of prompt lengths.

  Returns:
    The longest fitting prompt, 0 when not even ``step`` tokens fit.

  Raises:
    ValueError: for an unknown chip or family, a fraction outside ``(0, 1]``, a headroom
      outside ``[0, 1)``, or shards that do not divide the model's heads.
  """
  limit = check_chip(chip).hbm_gib * GiB * (1 - check_headroom(headroom))
  check_family(family)
  check_fraction(fraction)
  shard_config(cfg, workload.shards)

  def peak(tokens: int) -> int:
    return plan(cfg, family, fraction, tokens, workload=workload).peak

  max_tokens = max_prompt(cfg, workload.new_tokens)
  return longest_fitting(peak, limit, step=step, max_tokens=max_tokens)[0]


# The longest prompts of the tables in docs/accelerators.md (python -m experiments.memory_plan:
# batch 1, bf16, 128 new tokens, 10 % headroom, a 4096-token grid), as
# {(model, chip, shards): {(family, fraction): tokens}}; 0: not even 4096 tokens fit. A device
# without an entry falls back to CPU_DEFAULT.
_ROWS = {  # (model, chip, shards): {family: longest prompts at FRACTIONS (100 %, 25 %, 10 %)}
  ("llama-3.1-8b", "v5e-1", 1): {
    "snapkv": (0, 0, 0),
    "adakv": (0, 0, 0),
    "h2o": (0, 0, 0),
    "knorm": (0, 0, 0),
    "expected_attention": (0, 0, 0),
  },
  ("llama-3.1-8b", "v6e-1", 1): {
    "snapkv": (53248, 81920, 94208),
    "adakv": (53248, 53248, 53248),
    "h2o": (32768, 49152, 49152),
    "knorm": (24576, 32768, 32768),
    "expected_attention": (4096, 4096, 4096),
  },
  ("llama-3.1-8b", "t4", 1): {
    "snapkv": (0, 0, 0),
    "adakv": (0, 0, 0),
    "h2o": (0, 0, 0),
    "knorm": (0, 0, 0),
    "expected_attention": (0, 0, 0),
  },
  ("llama-3.1-8b", "l4", 1): {
    "snapkv": (24576, 40960, 40960),
    "adakv": (24576, 24576, 24576),
    "h2o": (16384, 20480, 20480),
    "knorm": (12288, 16384, 16384),
    "expected_attention": (0, 0, 0),
  },
  ("llama-3.1-8b", "a100-40", 1): {
    "snapkv": (81920, 126976, 126976),
    "adakv": (81920, 81920, 81920),
    "h2o": (53248, 73728, 77824),
    "knorm": (40960, 49152, 53248),
    "expected_attention": (8192, 8192, 8192),
  },
  ("llama-3.1-8b", "a100-80", 1): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (126976, 126976, 126976),
    "knorm": (114688, 126976, 126976),
    "expected_attention": (28672, 28672, 28672),
  },
  ("llama-3.1-8b", "h100-80", 1): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (126976, 126976, 126976),
    "knorm": (114688, 126976, 126976),
    "expected_attention": (28672, 28672, 28672),
  },
  ("llama-3.1-8b", "v5e-1", 2): {
    "snapkv": (45056, 69632, 73728),
    "adakv": (45056, 45056, 45056),
    "h2o": (28672, 40960, 40960),
    "knorm": (20480, 28672, 28672),
    "expected_attention": (4096, 4096, 4096),
  },
  ("llama-3.1-8b", "v6e-1", 2): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (106496, 126976, 126976),
    "knorm": (81920, 98304, 106496),
    "expected_attention": (20480, 20480, 20480),
  },
  ("llama-3.1-8b", "t4", 2): {
    "snapkv": (36864, 61440, 61440),
    "adakv": (36864, 36864, 36864),
    "h2o": (24576, 32768, 32768),
    "knorm": (20480, 24576, 24576),
    "expected_attention": (4096, 4096, 4096),
  },
  ("llama-3.1-8b", "l4", 2): {
    "snapkv": (102400, 126976, 126976),
    "adakv": (102400, 102400, 102400),
    "h2o": (69632, 90112, 94208),
    "knorm": (53248, 65536, 65536),
    "expected_attention": (12288, 12288, 12288),
  },
  ("llama-3.1-8b", "a100-40", 2): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (126976, 126976, 126976),
    "knorm": (110592, 126976, 126976),
    "expected_attention": (24576, 28672, 28672),
  },
  ("llama-3.1-8b", "a100-80", 2): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (126976, 126976, 126976),
    "knorm": (126976, 126976, 126976),
    "expected_attention": (61440, 65536, 65536),
  },
  ("llama-3.1-8b", "h100-80", 2): {
    "snapkv": (126976, 126976, 126976),
    "adakv": (126976, 126976, 126976),
    "h2o": (126976, 126976, 126976),
    "knorm": (126976, 126976, 126976),
    "expected_attention": (61440, 65536, 65536),
  },
  ("qwen3-8b", "v5e-1", 1): {
    "snapkv": (0, 0, 0),
    "adakv": (0, 0, 0),
    "h2o": (0, 0, 0),
    "knorm": (0, 0, 0),
    "expected_attention": (0, 0, 0),
  },
  ("qwen3-8b", "v6e-1", 1): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (28672, 36864, 36864),
    "knorm": (20480, 28672, 28672),
    "expected_attention": (4096, 4096, 4096),
  },
  ("qwen3-8b", "t4", 1): {
    "snapkv": (0, 0, 0),
    "adakv": (0, 0, 0),
    "h2o": (0, 0, 0),
    "knorm": (0, 0, 0),
    "expected_attention": (0, 0, 0),
  },
  ("qwen3-8b", "l4", 1): {
    "snapkv": (20480, 32768, 36864),
    "adakv": (20480, 20480, 20480),
    "h2o": (12288, 16384, 16384),
    "knorm": (8192, 12288, 12288),
    "expected_attention": (0, 0, 0),
  },
  ("qwen3-8b", "a100-40", 1): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (8192, 8192, 8192),
  },
  ("qwen3-8b", "a100-80", 1): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (24576, 24576, 24576),
  },
  ("qwen3-8b", "h100-80", 1): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (24576, 24576, 24576),
  },
  ("qwen3-8b", "v5e-1", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (24576, 32768, 32768),
    "knorm": (16384, 24576, 24576),
    "expected_attention": (4096, 4096, 4096),
  },
  ("qwen3-8b", "v6e-1", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (16384, 16384, 16384),
  },
  ("qwen3-8b", "t4", 2): {
    "snapkv": (32768, 36864, 36864),
    "adakv": (32768, 32768, 32768),
    "h2o": (20480, 28672, 28672),
    "knorm": (16384, 20480, 20480),
    "expected_attention": (4096, 4096, 4096),
  },
  ("qwen3-8b", "l4", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (8192, 8192, 12288),
  },
  ("qwen3-8b", "a100-40", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (24576, 24576, 24576),
  },
  ("qwen3-8b", "a100-80", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (36864, 36864, 36864),
  },
  ("qwen3-8b", "h100-80", 2): {
    "snapkv": (36864, 36864, 36864),
    "adakv": (36864, 36864, 36864),
    "h2o": (36864, 36864, 36864),
    "knorm": (36864, 36864, 36864),
    "expected_attention": (36864, 36864, 36864),
  },
}
TABLE: dict[tuple[str, str, int], dict[tuple[str, float], int]] = {
  key: {(f, x): n for f, ns in row.items() for x, n in zip(FRACTIONS, ns, strict=True)}
  for key, row in _ROWS.items()
}
CPU_DEFAULT = 4096  # a prompt the notebooks run in minutes on a laptop's CPU


def detect_chip(devices=None) -> str | None:
  """The :data:`CHIPS` name of the first device, or ``None`` on a CPU or an unlisted chip.

  Args:
    devices: the devices (``jax.devices()`` when ``None``).

  Returns:
    The chip's name, or ``None``.
  """
  devices = jax.devices() if devices is None else devices
  if not devices or devices[0].platform == "cpu":
    return None
  kind = str(getattr(devices[0], "device_kind", "")).lower()
  found = [c.name for c in CHIPS.values() if re.search(c.device_kind, kind)]
  return found[0] if found else None


def settings_for_device(
  model: str = "llama-3.1-8b",
  family: str = "snapkv",
  fraction: float = 0.1,
  *,
  devices=None,
  table: dict | None = None,
) -> dict:
  """The longest prompt to run on the device found, from the memory plans' table.

  Args:
    model: a model of :data:`MODELS`.
    family: a policy family of :data:`FAMILIES`.
    fraction: one of :data:`FRACTIONS`.
    devices: the devices (``jax.devices()`` when ``None``); several of one chip plan the
      weights sharded over them where the table has that count.
    table: the plans (:data:`TABLE` when ``None``).

  Returns:
    ``{"chip", "shards", "tokens", "source"}``: the chip's name (``None`` on a CPU or an
    unlisted chip), the shards planned, the longest prompt, and ``"plan"`` or ``"default"``
    (:data:`CPU_DEFAULT`, where the table has no entry or the model does not fit).

  Raises:
    ValueError: for an unknown model or family, or a fraction not in :data:`FRACTIONS`.
  """
  _entry(MODELS, model, "model", "model")
  check_family(family)
  if check_fraction(fraction) not in FRACTIONS:
    raise ValueError(f"fraction: {fraction!r} has no plan; expected one of {FRACTIONS}")
  devices = jax.devices() if devices is None else devices
  table = TABLE if table is None else table
  chip = detect_chip(devices)
  if chip is not None:
    counts = sorted({s for (m, c, s) in table if (m, c) == (model, chip) and s <= len(devices)})
    for shards in reversed(counts):
      tokens = table[(model, chip, shards)].get((family, float(fraction)), 0)
      if tokens:
        return {"chip": chip, "shards": shards, "tokens": tokens, "source": "plan"}
  return {"chip": chip, "shards": 1, "tokens": CPU_DEFAULT, "source": "default"}


def planned_model(name: str) -> str | None:
  """The planned shape (:data:`MODELS`) a model name or Hugging Face id is, or ``None``.

  Args:
    name: a model's name or id (``"meta-llama/Llama-3.1-8B-Instruct"``, ``"Qwen/Qwen3-8B"``).

  Returns:
    The :data:`MODELS` key whose name the id contains (case and ``_`` / ``-`` aside), or
    ``None`` for a model with no plan (the shipped tiny model, SmolLM2, ...).
  """
  key = str(name).lower().replace("_", "-")
  return next((m for m in MODELS if m in key), None)


def fitting_lengths(model: str, lengths, *, devices=None, table: dict | None = None) -> dict:
  """The prompt lengths of an evaluation that fit the device found, from the memory plans.

  An evaluation runs the full cache beside every policy, so a length fits where every family
  fits it at 100 % of the cache (the strictest plan of :func:`settings_for_device`).

  Args:
    model: the model's name or id (:func:`planned_model`).
    lengths: the prompt lengths asked for.
    devices: the devices (``jax.devices()`` when ``None``).
    table: the plans (:data:`TABLE` when ``None``).

  Returns:
    ``{"lengths", "dropped", "limit", "chip", "source"}``: the lengths kept (in order) and
    those above the limit; the limit (``None`` without a plan); the chip found; ``"plan"``,
    ``"default"`` (a CPU or an unlisted chip: :data:`CPU_DEFAULT`) or ``"no plan"`` (a model
    of no planned shape: every length kept).

  Raises:
    ValueError: for a length that is not a positive int.
  """
  lengths = tuple(lengths)
  for t in lengths:
    _check_count("lengths", t)
  planned = planned_model(model)
  if planned is None:
    chip = detect_chip(devices)
    return {"lengths": lengths, "dropped": (), "limit": None, "chip": chip, "source": "no plan"}
  found = [
    settings_for_device(planned, family, 1.0, devices=devices, table=table) for family in FAMILIES
  ]
  limit = min(f["tokens"] for f in found)
  source = "plan" if all(f["source"] == "plan" for f in found) else "default"
  return {
    "lengths": tuple(t for t in lengths if t <= limit),
    "dropped": tuple(t for t in lengths if t > limit),
    "limit": limit,
    "chip": found[0]["chip"],
    "source": source,
  }
