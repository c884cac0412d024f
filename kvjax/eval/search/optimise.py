"""The search loop: evosax evolution strategies over a :class:`~kvjax.eval.search.space.Space`.

A generation asks the strategy for a population of parameter vectors, maps the whole population
to feasible allocations and scores it in ONE compiled call (:func:`population_call`, a
``jit(vmap)``: the population is a configuration axis, budgets being data), and tells the
strategy the fitness. Strategies (:data:`OPTIMISERS`): evosax's CMA-ES (EvolKV's), SNES and
OpenAI-ES, and random search (evosax's, sampling around the uniform allocation) as a baseline.
evosax minimises: it is told the negated fitness.

The loop is resumable: with a ``checkpoint_dir`` the strategy's state and the history are saved
with orbax after every generation, and each generation's random key is derived from the seed and
the generation index, so an interrupted search resumes to the same result as an uninterrupted one.
A candidate whose fitness is NaN (or infinite) is counted, reported, and ranked last; a
generation with no finite fitness raises.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from evosax import algorithms as evo
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from kvjax import rundir
from kvjax.eval.search.space import Space

Array = jax.Array

OPTIMISERS = ("cma_es", "snes", "open_es", "random")
# the negated fitness evosax is told for a candidate that has none (ranked last, still finite)
WORST = 1e30


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """A finished search.

  Attributes:
    params: the best candidate's parameters ``[num_params]``.
    allocation: its feasible allocation (the space's shape, int32).
    fitness: its fitness (on the evidence searched).
    history: per generation ``best`` (best so far), ``mean`` (the generation's mean over finite
      candidates), ``generation_best`` and ``nan`` (candidates without a finite fitness).
    optimiser: the strategy's name.
    seed: the search's seed.
    evaluations: candidates evaluated.
  """

  params: np.ndarray
  allocation: np.ndarray
  fitness: float
  history: dict[str, np.ndarray]
  optimiser: str
  seed: int
  evaluations: int


def check_options(optimiser: str, population: int, generations: int, std_init: float) -> None:
  """Validates a search's options (before anything runs).

  Raises:
    ValueError: an unknown optimiser, a population below 1 (OpenAI-ES: an odd one, its
      sampling is antithetic), generations below 1 or a non-positive ``std_init``.
  """
  if optimiser not in OPTIMISERS:
    raise ValueError(f"optimiser: unknown value {optimiser!r}; expected one of {OPTIMISERS}")
  for name, value in (("population", population), ("generations", generations)):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
      raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
  if optimiser == "open_es" and population % 2:
    raise ValueError(f"population: {population} is odd; open_es samples antithetic pairs")
  if optimiser == "cma_es" and population < 2:
    raise ValueError(f"population: {population}; cma_es needs at least 2 candidates")
  if not isinstance(std_init, float | int) or isinstance(std_init, bool) or not std_init > 0:
    raise ValueError(f"std_init: expected a positive float, got {std_init!r}")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How a search samples: its strategy, population, generations, seed and initial scale.

  Attributes:
    optimiser: one of :data:`OPTIMISERS`.
    population: candidates per generation.
    generations: generations in all.
    seed: the seed of the strategy and of every generation's sampling.
    std_init: the initial search scale (logits around the uniform allocation).

  Raises:
    ValueError: as :func:`check_options`, when built.
  """

  optimiser: str = "cma_es"
  population: int = 16
  generations: int = 20
  seed: int = 0
  std_init: float = 1.0

  def __post_init__(self):
    check_options(self.optimiser, self.population, self.generations, self.std_init)


def strategy(optimiser: str, population: int, num_dims: int, std_init: float = 1.0):
  """An evosax strategy and its parameters: ``(strategy, params)``.

  Raises:
    ValueError: as :func:`check_options`.
  """
  check_options(optimiser, population, 1, std_init)
  solution = jnp.zeros((num_dims,), jnp.float32)
  if optimiser == "cma_es":
    es = evo.CMA_ES(population, solution)
    return es, es.default_params.replace(std_init=jnp.asarray(std_init, jnp.float32))
  if optimiser == "snes":
    es = evo.SNES(population, solution)
    return es, es.default_params.replace(std_init=jnp.asarray(std_init, jnp.float32))
  if optimiser == "open_es":
    es = evo.Open_ES(
      population,
      solution,
      optimizer=optax.adam(0.1 * std_init),
      std_schedule=optax.constant_schedule(float(std_init)),
    )
    return es, es.default_params

  def sample(key):
    return std_init * jax.random.normal(key, (num_dims,))

  es = evo.RandomSearch(population, solution, sampling_fn=sample)
  return es, es.default_params


def population_call(space: Space, fitness_fn: Callable, *args, devices=None) -> Callable:
  """One compiled call over a population: ``params_KN -> (fitness_K, allocations_K...)``.

  The population axis is sharded over a one-axis device mesh (``"population"``): each device
  evaluates its share of the candidates and the evidence is replicated on every device. A
  population that does not divide the device count is padded by repeating its last candidate,
  and the padding is dropped from the results; the results equal one device's.

  Args:
    space: the search space.
    fitness_fn: ``(*args, allocation) -> scalar`` (for example
      :func:`kvjax.eval.search.fitness.retained_mass` with its table as ``args``).
    *args: the evidence ``fitness_fn`` reads (arguments of the call, never constants folded
      into it).
    devices: the devices the population is sharded over (default: this process's,
      ``jax.local_devices()``; one device: no sharding).

  Returns:
    A function of the population, its ``devices`` attribute the devices it spans.

  Raises:
    ValueError: an empty ``devices``.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  if not devices:
    raise ValueError("devices: an empty list; expected at least one device")

  def one(params_N, *evidence):
    budget = space.allocate(params_N)
    return fitness_fn(*evidence, budget), budget

  batched = jax.vmap(one, in_axes=(0,) + (None,) * len(args))
  if len(devices) == 1:
    call = jax.jit(batched)

    def evaluate(params_KN):
      return call(jnp.asarray(params_KN, jnp.float32), *args)

  else:
    mesh = Mesh(np.asarray(devices), ("population",))
    rows, whole = (
      NamedSharding(mesh, PartitionSpec("population")),
      NamedSharding(mesh, PartitionSpec()),
    )
    placed = jax.device_put(args, whole)
    call = jax.jit(batched, in_shardings=(rows,) + (whole,) * len(args), out_shardings=rows)

    def evaluate(params_KN):
      x = jnp.asarray(params_KN, jnp.float32)
      K = x.shape[0]
      padded = -(-K // len(devices)) * len(devices)
      if padded > K:  # a padded candidate repeats the last one: no new work to misread
        x = jnp.concatenate([x, jnp.repeat(x[-1:], padded - K, axis=0)], axis=0)
      fitness_K, budgets_K = call(x, *placed)
      return fitness_K[:K], budgets_K[:K]

  evaluate.devices = tuple(devices)
  return evaluate


def ranked(fitness_K: np.ndarray, generation: int, log: Callable) -> np.ndarray:
  """The fitness to rank by: a non-finite candidate's is ``-inf``, and it is reported.

  Raises:
    ValueError: no candidate of the generation has a finite fitness.
  """
  fitness_K = np.asarray(fitness_K, np.float64)
  bad = ~np.isfinite(fitness_K)
  if bad.all():
    raise ValueError(
      f"fitness: every one of the {bad.size} candidates of generation {generation} has a "
      "non-finite fitness (NaN or inf); expected finite values"
    )
  if bad.any():
    message = (
      f"fitness: {int(bad.sum())} of {bad.size} candidates of generation {generation} have a "
      "non-finite fitness; they are ranked last"
    )
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log(message)
  return np.where(bad, -np.inf, fitness_K)


def _evosax():
  """evosax's strategies broadcast by rank promotion (a ``[N]`` mean against ``[K, N]``): allowed
  inside their calls, whatever the caller's setting."""
  return jax.numpy_rank_promotion("allow")


def _initial(es, params, seed: int, num_dims: int, generations: int) -> dict:
  with _evosax():
    state = es.init(jax.random.key(seed), jnp.zeros((num_dims,), jnp.float32), params)
  return {
    "state": state,
    "generation": jnp.asarray(0, jnp.int32),
    "best_params": jnp.zeros((num_dims,), jnp.float32),
    "best_fitness": jnp.asarray(-jnp.inf, jnp.float32),
    "best": jnp.full((generations,), jnp.nan, jnp.float32),
    "mean": jnp.full((generations,), jnp.nan, jnp.float32),
    "generation_best": jnp.full((generations,), jnp.nan, jnp.float32),
    "nan": jnp.zeros((generations,), jnp.int32),
  }


def _manager(checkpoint_dir) -> ocp.CheckpointManager:
  path = pathlib.Path(checkpoint_dir).absolute()
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))


def run(
  evaluate: Callable,
  space: Space,
  options: SearchOptions | None = None,
  *,
  checkpoint_dir: str | pathlib.Path | None = None,
  stop_after: int | None = None,
  log: Callable = print,
  progress: bool = False,
) -> SearchResult | None:
  """Runs (or resumes) a search; the best allocation found.

  Args:
    evaluate: ``params_KN -> (fitness_K, allocations)``, one compiled call per generation
      (:func:`population_call`); higher fitness is better.
    space: the search space (its ``num_params`` is the strategy's dimension).
    options: the strategy, population, generations, seed and initial scale
      (:class:`SearchOptions`; ``None``: its defaults).
    checkpoint_dir: where the state is saved after each generation (orbax); a directory with a
      checkpoint resumes from it. ``None``: no checkpoints.
    stop_after: stop after this generation index (an interruption, for tests); ``None`` runs
      them all.
    log: where the per-generation line goes (best and mean fitness).
    progress: a tqdm bar over generations.

  Returns:
    The :class:`SearchResult`, or ``None`` when stopped by ``stop_after`` before the end.

  Raises:
    ValueError: a generation without a finite fitness, and a saved step that cannot be
      restored (:func:`kvjax.rundir.restore_checkpoint`).
  """
  options = SearchOptions() if options is None else options
  generations = options.generations
  es, params = strategy(
    options.optimiser, options.population, space.num_params, float(options.std_init)
  )
  tree = _initial(es, params, options.seed, space.num_params, generations)
  mngr = _manager(checkpoint_dir) if checkpoint_dir is not None else None
  if mngr is not None and mngr.latest_step() is not None:
    step = mngr.latest_step()
    restore = functools.partial(mngr.restore, step, args=ocp.args.StandardRestore(tree))
    tree = rundir.restore_checkpoint(checkpoint_dir, step, restore)
    log(f"search: resumed after generation {step} of {generations}")
  start = int(tree["generation"])
  base_key = jax.random.key(options.seed)
  bar = tqdm(total=generations, initial=start, unit="gen", disable=not progress)
  for g in range(start, generations):
    ask_key, tell_key = jax.random.split(jax.random.fold_in(base_key, g))
    with _evosax():
      pop, state = es.ask(ask_key, tree["state"], params)
    fitness_K, _ = evaluate(pop)
    fit = ranked(np.asarray(fitness_K), g, log)
    told = jnp.asarray(np.where(np.isfinite(fit), -fit, WORST), jnp.float32)
    with _evosax():
      state, _ = es.tell(tell_key, pop, told, state, params)
    tree = _after(tree, state, np.asarray(pop), fit, g)
    log(
      f"generation {g + 1}/{generations}: best {float(tree['best'][g]):.6f} "
      f"mean {float(tree['mean'][g]):.6f}"
    )
    bar.update(1)
    if mngr is not None:
      mngr.save(g + 1, args=ocp.args.StandardSave(tree))
      mngr.wait_until_finished()
    if stop_after is not None and g + 1 >= stop_after and g + 1 < generations:
      bar.close()
      return None
  bar.close()
  best = np.asarray(tree["best_params"])
  history = {k: np.asarray(tree[k]) for k in ("best", "mean", "generation_best", "nan")}
  return SearchResult(
    params=best,
    allocation=np.asarray(space.allocate(jnp.asarray(best))),
    fitness=float(tree["best_fitness"]),
    history=history,
    optimiser=options.optimiser,
    seed=options.seed,
    evaluations=options.population * generations,
  )


def _after(tree: dict, state, pop_KN: np.ndarray, fit_K: np.ndarray, g: int) -> dict:
  """The loop's state after generation ``g`` (best so far, the history's row ``g``)."""
  i = int(np.argmax(fit_K))  # finite: ranked() refused a generation without one
  improved = fit_K[i] > float(tree["best_fitness"])
  finite = fit_K[np.isfinite(fit_K)]
  best_params = pop_KN[i] if improved else np.asarray(tree["best_params"])
  best_fitness = fit_K[i] if improved else float(tree["best_fitness"])
  return tree | {
    "state": state,
    "generation": jnp.asarray(g + 1, jnp.int32),
    "best_params": jnp.asarray(best_params, jnp.float32),
    "best_fitness": jnp.asarray(best_fitness, jnp.float32),
    "best": tree["best"].at[g].set(best_fitness),
    "mean": tree["mean"].at[g].set(finite.mean()),
    "generation_best": tree["generation_best"].at[g].set(fit_K[i]),
    "nan": tree["nan"].at[g].set(int((~np.isfinite(fit_K)).sum())),
  }
