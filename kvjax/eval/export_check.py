"""Every compiled entry point of kvjax, lowered for TPU and CUDA on any host (abstract shapes).

``jax.export.export(jax.jit(f), platforms=(platform,))`` lowers a function for a platform that
the host lacks. :func:`check` does that for each entry point of :data:`ENTRY_POINTS` at a
Llama-3.1-8B shape in bf16 (:func:`llama31_8b`) with 32k-token prompts: the prefill with each
kind of evidence, the compression under six policies, the decode step (stacked and held one
buffer per layer), the generate loop, the answers' step, ``select.top_mask`` /
``select.compact``, the ragged decode kernel (:mod:`kvjax.model.ragged`) and, on the lab's
synthetic world, a sweep's compiled group and the online replay. Arguments are
``jax.ShapeDtypeStruct`` (``jax.eval_shape`` of the parameters, prefill and cache): nothing of
the model's size is allocated. A host callback, a float64, a custom call that only the CPU has
or a Pallas block the TPU refuses fails there, naming the entry point and the platform.

While an entry point is traced for a platform, ``jax.default_backend()`` answers that platform
(``"tpu"`` or ``"gpu"``), so the code that picks its path by backend (``cache.decode_step``'s
16-bit carry, ``select``'s sort, the ragged kernel) lowers what that device would run; trace
caches are cleared around it, so no trace made for another platform is reused or leaks out.
Each platform is exported on its own: the ragged kernel's Mosaic and Triton variants carry
compiler parameters of their own platform and cannot share one multi-platform module.

The generate loop and the answers' step are lowered as their public pieces compose them
(``cache.compress``, ``cache.per_layer``, ``cache.decode_step``, ``cache.extend``); the lab's
replay through ``online.simulate`` inside one jit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from kvjax import policies, select
from kvjax.lab import online, synthetic
from kvjax.lab import sweep as sweep_lib
from kvjax.model import answers, decoding, llama, paged, ragged
from kvjax.model import cache as cache_lib
from kvjax.model.config import ModelConfig

PLATFORMS = ("tpu", "cuda")
# the backend jax.default_backend() names for each platform jax.export lowers for
BACKEND_OF = {"tpu": "tpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}
TOKENS = 32768
BATCHES = (1, 8)
BUDGET_FRACTION = 0.1
NEW_TOKENS = 16  # generated tokens: the decode capacity's room and the generate loop's length
# the custom calls of Pallas's GPU kernels, which jax.export does not guarantee across versions
# (every other custom call stays checked): lowering them is what this check asks
UNSTABLE_KERNELS = ("__gpu$xla.gpu.triton",)
COMPRESSION_POLICIES = {
  "snapkv": {},
  "pyramidkv": {},
  "adakv_snapkv": {},
  "h2o": {},
  "knorm": {},
  "think": {},
}
EVIDENCE_KINDS = {
  "window_rows": policies.EvidenceRequest(window=64),
  "window_scores": "snapkv",  # the window rows reduced inside the layer scan
  "column_sums": policies.EvidenceRequest(column_sums=True),
  "query_stats": policies.EvidenceRequest(query_stats=True),
  "window_queries": policies.EvidenceRequest(window_queries=64),
  "prerope_keys": policies.EvidenceRequest(prerope_keys=True),
}


def llama31_8b(num_layers: int = 32) -> ModelConfig:
  """A Llama-3.1-8B-shaped config (32 query / 8 KV heads of 128, d 4096, llama3 RoPE).

  Args:
    num_layers: the layers (32 in the model; fewer lower faster at the same layer shape).

  Returns:
    The config.
  """
  return ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=num_layers,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_factor=8.0,
    rope_original_max_positions=8192,
    family="llama",
    max_positions=131072,
  )


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The shapes an entry point is lowered at.

  Attributes:
    cfg: the model's config.
    batch: rows per call.
    tokens: prompt tokens per row.
    dtype: the weights' (and cache's) dtype.
  """

  cfg: ModelConfig
  batch: int
  tokens: int = TOKENS
  dtype: object = jnp.bfloat16

  def __post_init__(self):
    for name in ("batch", "tokens"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")

  @property
  def budget(self) -> int:
    return max(1, int(self.tokens * BUDGET_FRACTION))


@dataclasses.dataclass
class Result:
  """One entry point lowered for one platform.

  Attributes:
    entry: the entry point's name.
    platform: ``"tpu"`` or ``"cuda"``.
    batch: the rows it was lowered at.
    ok: whether it lowered.
    error: the error's first line when it did not.
    seconds: the time tracing and lowering took.
  """

  entry: str
  platform: str
  batch: int
  ok: bool
  error: str = ""
  seconds: float = 0.0


@contextlib.contextmanager
def traced_for(platform: str):
  """Makes ``jax.default_backend()`` answer ``platform``'s backend while entry points trace.

  Trace caches are cleared on entry and exit: a trace made for another backend is not reused,
  and none made here is used afterwards.

  Args:
    platform: a platform ``jax.export`` lowers for (``"tpu"``, ``"cuda"``, ``"rocm"``, ``"cpu"``).

  Raises:
    ValueError: for another platform name.
  """
  if platform not in BACKEND_OF:
    raise ValueError(f"platform: expected one of {tuple(BACKEND_OF)}, got {platform!r}")
  original = jax.default_backend
  jax.clear_caches()
  jax.default_backend = lambda: BACKEND_OF[platform]
  try:
    yield
  finally:
    jax.default_backend = original
    jax.clear_caches()


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@functools.cache
def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
  """The parameter pytree of ``cfg`` as ``ShapeDtypeStruct`` (nothing allocated)."""
  model = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  return _abstract(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _ids(s: Shapes):
  return (
    jax.ShapeDtypeStruct((s.batch, s.tokens), jnp.int32),
    jax.ShapeDtypeStruct((s.batch, s.tokens), jnp.int32),
  )


def _policy(name: str) -> policies.Policy:
  return policies.build(name, **COMPRESSION_POLICIES.get(name, {}))


def _request(pol: policies.Policy, s: Shapes):
  return pol.evidence_request(s.tokens, reduce_rows=True)


def _prefill_of(s: Shapes, request) -> llama.Prefill:
  params = abstract_params(s.cfg, s.dtype)
  return jax.eval_shape(functools.partial(llama.prefill, s.cfg, request=request), params, *_ids(s))


def _spec(pol: policies.Policy, s: Shapes) -> cache_lib.CacheSpec:
  cap = s.budget + NEW_TOKENS
  return cache_lib.CacheSpec(pol, cap, new_tokens=NEW_TOKENS)


def _budget():
  return jax.ShapeDtypeStruct((), jnp.int32)


def _cache_of(s: Shapes, name: str = "snapkv"):
  pol = _policy(name)
  spec = _spec(pol, s)
  pre = _prefill_of(s, _request(pol, s))
  cache = jax.eval_shape(lambda p, b: cache_lib.compress(s.cfg, p, spec, b), pre, _budget())
  return spec, cache


def _rows(s: Shapes, dtype=jnp.int32):
  return jax.ShapeDtypeStruct((s.batch,), dtype)


# -- the entry points: each returns (a jitted function, its arguments) at shapes `s`


def prefill_entry(kind: str, s: Shapes):
  """``decoding.jit_prefill`` with one kind of evidence (:data:`EVIDENCE_KINDS`)."""
  request = EVIDENCE_KINDS[kind]
  if isinstance(request, str):
    request = _request(_policy(request), s)
  params = abstract_params(s.cfg, s.dtype)
  return decoding.jit_prefill, (s.cfg, params, *_ids(s), request)


def compress_entry(name: str, s: Shapes):
  """``cache.compress`` of the policy's prefill into a cache of its budget."""
  pol = _policy(name)
  spec = _spec(pol, s)
  if pol.channel_ratio:  # ThinK keeps full keys of the generated tokens apart
    spec = dataclasses.replace(spec, capacity=s.budget)
  pre = _prefill_of(s, _request(pol, s))
  fn = jax.jit(cache_lib.compress, static_argnames=("cfg", "spec"))
  return fn, (s.cfg, pre, spec, _budget())


def decode_entry(form: str, s: Shapes):
  """``cache.decode_step`` over the stacked cache, or over the parameters and cache held one
  buffer per layer (``cache.per_layer``, the CPU's form, split here whatever the backend)."""
  spec, cache = _cache_of(s)
  params = abstract_params(s.cfg, s.dtype)
  if form == "per_layer":
    params = jax.eval_shape(llama.unstacked_params, params)
    L, C = s.cfg.num_layers, spec.capacity

    def layer_shape(name, shape):  # per_layer holds the keys slots-last
      return shape[:2] + (shape[3], shape[2]) if name == "keys" else shape

    split = {
      name: tuple(jax.ShapeDtypeStruct(layer_shape(name, t.shape[1:]), t.dtype) for _ in range(L))
      for name in cache_lib.PER_LAYER_FIELDS
      if (t := getattr(cache, name)) is not None
    }
    cache = cache.replace(**split)
    assert all(t.shape[2] == C for t in cache.valid)

  def step(cfg, spec, params, cache, token, pos, t, i):
    return cache_lib.decode_step(cfg, params, spec, cache, token, pos, t, step=i)

  fn = jax.jit(step, static_argnames=("cfg", "spec"))
  i = jax.ShapeDtypeStruct((), jnp.int32)
  return fn, (s.cfg, spec, params, cache, _rows(s), _rows(s), _rows(s), i)


def generate_entry(name: str, s: Shapes):
  """The generate loop: compress the prefill, then :data:`NEW_TOKENS` decode steps in a scan
  (as ``generate``'s compiled function does, from the same public pieces)."""
  pol = _policy(name)
  spec = _spec(pol, s)
  pre = _prefill_of(s, _request(pol, s))
  params = abstract_params(s.cfg, s.dtype)

  def loop(cfg, spec, params, pre, budget, first):
    cache = cache_lib.compress(cfg, pre, spec, budget)
    start = pre.valid.sum(-1).astype(jnp.int32)
    T = pre.valid.shape[1]
    params, cache = cache_lib.per_layer(spec, params, cache)

    def step(carry, i):
      cache, token = carry
      logits, cache = cache_lib.decode_step(
        cfg, params, spec, cache, token, start + i, T + i, step=i
      )
      return (cache, jnp.argmax(logits, -1).astype(jnp.int32)), token

    (cache, _), tokens = jax.lax.scan(step, (cache, first), jnp.arange(NEW_TOKENS))
    return tokens.T, cache_lib.restacked(cache, spec.capacity)

  fn = jax.jit(loop, static_argnames=("cfg", "spec"))
  return fn, (s.cfg, spec, params, pre, _budget(), _rows(s))


def answers_entry(name: str, s: Shapes, configs: int = 2, answer: int = 8):
  """The answers' step over ``configs`` compressed caches (vmapped): an appending cache's
  answer fed at once after its held keys (``cache.extend``, what answers decode through), a
  decode-time policy's token by token (``cache.decode_step`` in a scan)."""
  pol = _policy(name)
  spec = answers.decoding_spec(dataclasses.replace(_spec(pol, s), new_tokens=0))
  pre = _prefill_of(s, _request(pol, s))
  budgets = jax.ShapeDtypeStruct((configs,), jnp.int32)
  caches = jax.eval_shape(
    lambda p, b: jax.vmap(lambda x: cache_lib.compress(s.cfg, p, spec, x))(b), pre, budgets
  )
  params = abstract_params(s.cfg, s.dtype)
  fed = jax.ShapeDtypeStruct((s.batch, answer), jnp.int32)

  def step(cfg, spec, params, caches, fed_BN, start_B):
    pos_BN = start_B[:, None] + jnp.arange(fed_BN.shape[1], dtype=jnp.int32)[None, :]

    def one(cache):
      if cache_lib.appends_only(spec):
        held = (cache_lib.held_kv(spec, cache),)
        return cache_lib.extend(cfg, params, held, fed_BN, pos_BN)[0]

      def token(cache, i):
        logits, cache = cache_lib.decode_step(
          cfg, params, spec, cache, fed_BN[:, i], pos_BN[:, i], pos_BN[:, i], step=i
        )
        return cache, logits

      return jax.lax.scan(token, cache, jnp.arange(fed_BN.shape[1]))[1]

    return jax.vmap(one)(caches)

  fn = jax.jit(step, static_argnames=("cfg", "spec"))
  return fn, (s.cfg, spec, params, caches, fed, _rows(s))


def select_entry(name: str, s: Shapes):
  """``select.top_mask`` / ``select.compact`` over ``[B, L, G, T]`` scores."""
  L, G = s.cfg.num_layers, s.cfg.num_kv_heads
  scores = jax.ShapeDtypeStruct((s.batch, L, G, s.tokens), jnp.float32)
  budget = jax.ShapeDtypeStruct((s.batch, L, G), jnp.int32)
  if name == "top_mask":
    return jax.jit(select.top_mask), (scores, budget)
  fn = jax.jit(select.compact, static_argnames="capacity")
  return fn, (scores, budget, s.budget)


def ragged_entry(s: Shapes, page: int = ragged.PAGE):
  """The ragged decode kernel over one layer: every (row, KV head) up to the budget's pages."""
  R, Gq, D = s.batch * s.cfg.num_kv_heads, s.cfg.num_groups, s.cfg.head_dim
  M = -(-s.budget // page)
  pool = jax.ShapeDtypeStruct((R * M + 1, page, D), s.dtype)
  table, length = jax.ShapeDtypeStruct((R, M), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32)
  args = (jax.ShapeDtypeStruct((R, Gq, D), s.dtype), ragged.Pages(pool, pool, table, length))
  return jax.jit(ragged.ragged_decode_attention), args


def paged_entry(s: Shapes):
  """``paged.decode_step`` over Ada-KV's cache in pages (the ragged kernel of the platform)."""
  _, cache = _cache_of(s, "adakv_snapkv")
  budget_BLH = np.full((s.batch, s.cfg.num_layers, s.cfg.num_kv_heads), s.budget)
  pool = paged.pool_size(budget_BLH, s.batch, NEW_TOKENS, paged.PAGE)
  pages = jax.eval_shape(lambda c: paged.from_stacked(c, new=NEW_TOKENS, pool=pool), cache)

  def step(cfg, params, cache, token, pos):
    return paged.decode_step(cfg, params, cache, token, pos, backend="auto")

  fn = jax.jit(step, static_argnames="cfg")
  return fn, (s.cfg, abstract_params(s.cfg, s.dtype), pages, _rows(s), _rows(s))


def _lab_world():
  return synthetic.make_world(synthetic.world_config("needle_qa", _sweep_config().world))


def replay_entry(name: str, s: Shapes | None = None):
  """The lab's online replay (``online.simulate``) of a policy on a small synthetic world,
  inside one jit over the world: the allocation from the (concrete) prompt evidence is computed
  while tracing, the replay's jitted scan over the world is lowered."""
  world = _lab_world()
  pol = policies.build(name)
  evidence = online.prompt_evidence(world, jax.random.key(0))

  def replay(world):
    with jax.ensure_compile_time_eval():
      return online.simulate(world, pol, 32, evidence=evidence)

  return jax.jit(replay), (world,)


def _sweep_config():
  c = ml_collections.ConfigDict()
  c.base = ml_collections.ConfigDict(
    dict(
      scenario="needle_qa",
      policy="snapkv",
      schedule="uniform",
      head_alloc="uniform",
      pyramid_mode="legacy_floor",
      window=8,
      kernel=7,
      pool="max",
      budget=32,
      beta=20.0,
      alpha=0.2,
      head_beta=1.5,
      sinks=4,
      tau1=1.0,
      tau2=1.0,
    )
  )
  c.world = ml_collections.ConfigDict(
    dict(num_layers=2, num_heads=4, prompt_len=192, gen_steps=16, head_dim=16, window=16, seed=0)
  )
  c.grid = ml_collections.ConfigDict()
  c.grid.product = ml_collections.ConfigDict(
    dict(schedule=("pyramid",), head_alloc=("adakv",), budget=(16, 32))
  )
  c.grid.zip = ml_collections.ConfigDict()
  c.chunk_size = 2
  c.bytes_per_value = 2
  c.compilation_cache = ""
  return c


@functools.cache
def _sweep_calls() -> tuple:
  """A small sweep's compiled group calls (``max_budget`` and ``metrics``), recorded with their
  arguments while the sweep runs on the host."""
  configs, engine = sweep_lib.prepare(_sweep_config())
  calls = []
  group_fns = engine.group_fns

  def recorded(key):
    fns = group_fns(key)

    def wrap(name):
      def call(*args):
        calls.append((name, fns[name], args))
        return fns[name](*args)

      return call

    return {**fns, "max_budget": wrap("max_budget"), "metrics": wrap("metrics")}

  engine.group_fns = recorded
  for _ in engine.evaluate(configs):
    pass
  seen = {}
  for name, fn, args in calls:
    seen.setdefault(name, (fn, args))
  return tuple(seen.items())


def sweep_entry(part: str, s: Shapes | None = None):
  """A sweep's compiled group (Ada-KV heads under PyramidKV layers on the lab world)."""
  fn, args = dict(_sweep_calls())[part]
  return fn, args


def _entries() -> dict[str, tuple[Callable, bool]]:
  """``{name: (build(shapes), per_batch)}``; the lab's entries run on its world (one batch)."""
  out = {}
  for kind in EVIDENCE_KINDS:
    out[f"prefill:{kind}"] = (functools.partial(prefill_entry, kind), True)
  for name in COMPRESSION_POLICIES:
    out[f"compress:{name}"] = (functools.partial(compress_entry, name), True)
  for form in ("stacked", "per_layer"):
    out[f"decode_step:{form}"] = (functools.partial(decode_entry, form), True)
  out["generate:snapkv"] = (functools.partial(generate_entry, "snapkv"), True)
  out["generate:h2o"] = (functools.partial(generate_entry, "h2o"), True)
  out["answers:snapkv"] = (functools.partial(answers_entry, "snapkv"), True)
  out["answers:h2o"] = (functools.partial(answers_entry, "h2o"), True)
  out["select:top_mask"] = (functools.partial(select_entry, "top_mask"), True)
  out["select:compact"] = (functools.partial(select_entry, "compact"), True)
  out["ragged_decode"] = (ragged_entry, True)
  out["decode_step:paged"] = (paged_entry, True)
  out["lab:sweep_max_budget"] = (functools.partial(sweep_entry, "max_budget"), False)
  out["lab:sweep_metrics"] = (functools.partial(sweep_entry, "metrics"), False)
  out["lab:replay_snapkv"] = (functools.partial(replay_entry, "snapkv"), False)
  out["lab:replay_h2o"] = (functools.partial(replay_entry, "h2o"), False)
  return out


ENTRY_POINTS = tuple(_entries())


def _first_line(e: Exception) -> str:
  text = f"{type(e).__name__}: {e}"
  return text.strip().splitlines()[0][:300]


def lower(fn, args, platform: str) -> jax.export.Exported:
  """Exports ``fn(*args)`` for ``platform`` alone, traced as that platform's backend.

  Args:
    fn: a jitted function (static arguments among ``args`` as its ``static_argnames`` say).
    args: its arguments (``ShapeDtypeStruct`` or arrays; static ones as values).
    platform: ``"tpu"``, ``"cuda"``, ``"rocm"`` or ``"cpu"``.

  Returns:
    The ``jax.export.Exported``.

  Raises:
    ValueError: for an unknown platform; whatever tracing or lowering raises.
  """
  disabled = [jax.export.DisabledSafetyCheck.custom_call(t) for t in UNSTABLE_KERNELS]
  with traced_for(platform):
    return jax.export.export(fn, platforms=(platform,), disabled_checks=disabled)(*args)


def check(
  entries=None,
  *,
  platforms=PLATFORMS,
  batches=BATCHES,
  num_layers: int = 32,
  tokens: int = TOKENS,
  log: Callable[[str], None] | None = None,
) -> list[Result]:
  """Lowers each entry point for each platform and batch, recording what fails.

  Args:
    entries: names from :data:`ENTRY_POINTS` (``None``: all).
    platforms: platforms to lower for (:data:`PLATFORMS`).
    batches: the batch sizes of the model's entry points (the lab's run once on its world).
    num_layers: the 8B config's layers (:func:`llama31_8b`).
    tokens: prompt tokens per row.
    log: called with one line per result, as it comes.

  Returns:
    One :class:`Result` per (entry, platform, batch).

  Raises:
    ValueError: for an unknown entry point or platform, or batches that are not ints >= 1.
  """
  table = _entries()
  entries = list(ENTRY_POINTS if entries is None else entries)
  unknown = [e for e in entries if e not in table]
  if unknown:
    raise ValueError(f"entries: unknown {unknown}; expected names from {ENTRY_POINTS}")
  for p in platforms:
    if p not in BACKEND_OF:
      raise ValueError(f"platforms: {p!r} is not a platform; expected one of {tuple(BACKEND_OF)}")
  cfg = llama31_8b(num_layers)
  shapes = [Shapes(cfg, b, tokens) for b in batches]
  results = []
  for name in entries:
    build, per_batch = table[name]
    for s in shapes if per_batch else shapes[:1]:
      for platform in platforms:
        t0 = time.perf_counter()
        try:
          with traced_for(platform):
            fn, args = build(s)
          lower(fn, args, platform)
          r = Result(name, platform, s.batch if per_batch else 0, True)
        except Exception as e:  # noqa: BLE001 - the failure is the result, reported by name
          r = Result(name, platform, s.batch if per_batch else 0, False, _first_line(e))
        r.seconds = time.perf_counter() - t0
        results.append(r)
        if log is not None:
          log(format_result(r))
  return results


def format_result(r: Result) -> str:
  """One line: entry, platform, batch, ok / error and the seconds."""
  status = "ok" if r.ok else f"error: {r.error}"
  batch = f"B={r.batch}" if r.batch else "lab"
  return f"{r.entry:<24} {r.platform:<5} {batch:<5} {status} ({r.seconds:.1f} s)"


def failures(results: list[Result]) -> list[str]:
  """The failed results as lines naming the entry point and platform."""
  return [f"{r.entry} on {r.platform} (batch {r.batch}): {r.error}" for r in results if not r.ok]


def table(results: list[Result]) -> str:
  """A markdown table: entry point x platform, ``ok`` or ``error`` (over every batch).

  Args:
    results: :func:`check`'s results.

  Returns:
    The table's text.
  """
  platforms = list(dict.fromkeys(r.platform for r in results))
  names = list(dict.fromkeys(r.entry for r in results))
  cell = {}
  for r in results:
    key = (r.entry, r.platform)
    cell[key] = cell.get(key, True) and r.ok
  lines = ["| entry point | " + " | ".join(platforms) + " |"]
  lines.append("|---" * (len(platforms) + 1) + "|")
  for n in names:
    marks = ["ok" if cell[(n, p)] else "error" for p in platforms]
    lines.append(f"| {n} | " + " | ".join(marks) + " |")
  return "\n".join(lines)
