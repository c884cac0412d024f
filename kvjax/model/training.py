"""One training loop for kvjax's learned components: KVzap's MLP surrogate
(:func:`kvjax.model.kvzap.train_mlp`), Fast KVzip's gates
(:func:`kvjax.model.fastkvzip.train_gates`), RestoreKV's adapter
(:func:`kvjax.model.restorekv.train_adapter`) and DuoAttention's gates
(:func:`kvjax.model.duo.train_duo_attention`).

* :class:`TrainConfig`: the hyperparameters every component has (``lr``, ``batch_size``,
  ``seed``), each checked when the config is made; a component's config adds its own fields,
  checked the same way (:func:`int_field`, :func:`float_field`, :func:`config_field`);
* :class:`Loop`: what a component supplies: its optimiser step, its batches and its log rows;
* :func:`run`: the loop, with orbax checkpoints that resume exactly, a record of the run's
  arguments that refuses a resume with others, log rows and a progress bar;
* :class:`DataParallel`: each step's batch spread over the processes of a run
  (``kvjax.distributed``), padded with rows of weight 0 to a multiple of their count;
* :func:`epochs`, :func:`passes`, :func:`cycled`: the orders in which the examples are drawn,
  each a pure function of the seed and the unit, so that a resumed run draws what an
  uninterrupted one would;
* :func:`optax_step`: the usual step (the loss's value and gradient, one optax update);
* :func:`cached_parts`: training data computed part by part, each part saved, so that a killed
  run computes only the missing ones (shared among the processes of a run); :func:`saved_targets`,
  an experiment's targets saved that way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from kvjax import distributed, rundir

Array = jax.Array

# --------------------------------------------------------------------------- checks


def check_int(name: str, value, minimum: int = 1) -> int:
  """``value`` as an int, checked.

  Args:
    name: what to name in the error.
    value: the value.
    minimum: the smallest value allowed.

  Returns:
    ``int(value)``.

  Raises:
    ValueError: for a value that is not an int (``bool`` included) or is below ``minimum``.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
  return int(value)


def check_float(name: str, value, *, zero: bool = False) -> float:
  """``value`` as a finite positive float (or ``>= 0`` with ``zero``), checked.

  Args:
    name: what to name in the error.
    value: the value.
    zero: whether 0 is allowed.

  Returns:
    ``float(value)``.

  Raises:
    ValueError: for a value that is not a finite number above 0 (at least 0 with ``zero``).
  """
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
    expected = "a finite float >= 0" if zero else "a finite float > 0"
    raise ValueError(f"{name}: expected {expected}, got {value!r}")
  return float(value)


def check_finite(name: str, value) -> float:
  """``value`` as a finite float of any sign, checked.

  Args:
    name: what to name in the error.
    value: the value.

  Returns:
    ``float(value)``.

  Raises:
    ValueError: for a value that is not a finite number.
  """
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  if not ok or not math.isfinite(value):
    raise ValueError(f"{name}: expected a finite float, got {value!r}")
  return float(value)


def config_field(default, check: Callable[[str, object], object]):
  """A config field whose value ``check(name, value)`` validates (and converts) when a config
  is made.

  Args:
    default: the field's default.
    check: ``(name, value) -> value``, raising ``ValueError`` naming the field.

  Returns:
    A ``dataclasses.field``.
  """
  return dataclasses.field(default=default, metadata={"check": check})


def int_field(default: int, minimum: int = 1):
  """A config field holding an int ``>= minimum`` (:func:`check_int`).

  Args:
    default: the field's default.
    minimum: the smallest value allowed.

  Returns:
    A ``dataclasses.field``.
  """
  return config_field(default, lambda name, value: check_int(name, value, minimum))


def float_field(default: float, *, zero: bool = False):
  """A config field holding a finite float ``> 0`` (``>= 0`` with ``zero``, :func:`check_float`).

  Args:
    default: the field's default.
    zero: whether 0 is allowed.

  Returns:
    A ``dataclasses.field``.
  """
  return config_field(default, lambda name, value: check_float(name, value, zero=zero))


def from_settings(cls: type, settings):
  """An instance of the dataclass ``cls`` of the fields that ``settings`` (an experiment's
  ``ml_collections`` config, or any object) holds as attributes, the others at their defaults.

  Args:
    cls: the dataclass.
    settings: the experiment's settings.

  Returns:
    The instance.
  """
  names = [f.name for f in dataclasses.fields(cls) if hasattr(settings, f.name)]
  return cls(**{n: getattr(settings, n) for n in names})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The hyperparameters every trained component has; each component's config extends it.

  Every field is checked (and converted: numpy ints become ints) when the config is made, so a
  bad value raises a ``ValueError`` naming the field and the value before anything is written.

  Attributes:
    lr: the (peak) learning rate.
    batch_size: examples per optimiser step.
    seed: the seed of the initialisation and the shuffles.
  """

  lr: float = float_field(1e-3)
  batch_size: int = int_field(1)
  seed: int = int_field(0, minimum=0)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      check = f.metadata.get("check")
      if check is not None:
        object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))

  @classmethod
  def make(cls, config: TrainConfig | None = None, **options):
    """A config from an optional base and keyword options (the fields' names).

    Args:
      config: a config of this class (``None``: the defaults).
      **options: fields to set, over ``config``.

    Returns:
      The config.

    Raises:
      ValueError: for a ``config`` of another class, or a field's bad value.
      TypeError: for an option that is not a field.
    """
    if config is None:
      return cls(**options)
    if not isinstance(config, cls):
      raise ValueError(f"config: expected a {cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **options) if options else config

  @classmethod
  def from_settings(cls, settings):
    """A config of the fields ``settings`` holds (:func:`from_settings`).

    Args:
      settings: the experiment's settings.

    Returns:
      The config.

    Raises:
      ValueError: for a field's bad value.
    """
    return from_settings(cls, settings)

  def record(self) -> dict:
    """The fields as json values (tuples become lists), for a run's record."""
    return json.loads(json.dumps(dataclasses.asdict(self)))


# --------------------------------------------------------------------------- batch orders


def epochs(n: int, batch_size: int, seed: int) -> Callable[[int], list[np.ndarray]]:
  """One unit per epoch: a fresh shuffle of the ``n`` examples cut into batches of
  ``batch_size`` (the last one smaller).

  Args:
    n: examples.
    batch_size: examples per step.
    seed: the shuffles' seed (epoch ``e`` shuffles with ``[seed, e]``).

  Returns:
    ``epoch -> [indices of each step]``.
  """

  def batches(epoch: int) -> list[np.ndarray]:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]

  return batches


def passes(n: int, batch_size: int, seed: int, *, sort: bool = False):
  """One unit per step: the examples are reshuffled whenever a pass over them starts (every
  ``n // batch_size`` steps), and the last partial batch of a pass is never drawn.

  Args:
    n: examples (at least ``batch_size``).
    batch_size: examples per step.
    seed: the shuffles' seed (pass ``p`` shuffles with ``[seed, p]``).
    sort: each batch's indices in increasing order.

  Returns:
    ``step -> [indices]``.
  """
  per_pass = n // batch_size
  orders: dict[int, np.ndarray] = {}

  def batches(step: int) -> list[np.ndarray]:
    epoch, split = divmod(step, per_pass)
    if epoch not in orders:  # one pass's order at a time
      orders.clear()
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
    b = orders[epoch][split * batch_size : (split + 1) * batch_size]
    return [np.sort(b) if sort else b]

  return batches


def cycled(n: int, batch_size: int) -> Callable[[int], list[np.ndarray]]:
  """One unit per step: the examples in order, cycled (step ``s`` takes the next
  ``batch_size`` after step ``s - 1``'s).

  Args:
    n: examples.
    batch_size: examples per step.

  Returns:
    ``step -> [indices]``.
  """
  return lambda step: [np.asarray([(step * batch_size + i) % n for i in range(batch_size)])]


# --------------------------------------------------------------------------- steps


def optax_step(loss_fn: Callable, opt: optax.GradientTransformation, *, has_aux: bool = False):
  """One optimiser step of ``loss_fn``: its value and gradient, then ``opt``'s update.

  Args:
    loss_fn: ``(params, *batch) -> loss`` (with ``has_aux``: ``-> (objective, loss)``, the
      gradient of ``objective`` and the reported ``loss``).
    opt: the optax transformation.
    has_aux: whether ``loss_fn`` returns ``(objective, loss)``.

  Returns:
    ``(params, opt_state, *batch) -> (params, opt_state, loss)``.
  """

  def step(params, state, *batch):
    if has_aux:
      (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


class DataParallel:
  """A loop's arrays on this process alone, or data-parallel over the processes of a run.

  Data-parallel when asked for in a run of several processes (``kvjax.distributed``): every
  process runs the same loop on the same data; the weights and the optimiser state are
  replicated on :func:`kvjax.distributed.process_mesh`, each step's batch is padded with rows
  of weight 0 to a multiple of the process count and sliced over the processes, and the jitted
  step reduces the loss and the gradients across them. The result equals a one-process run's
  up to the order of the sums.

  Args:
    across_processes: whether to spread the steps over the processes.
    what: the trained weights, for the error of a failed gather (``"the MLP"``).
  """

  def __init__(self, across_processes: bool, what: str):
    self.across = bool(across_processes) and distributed.process_count() > 1
    self.what = what
    self.replicated = self.sliced = None
    if self.across:
      mesh = distributed.process_mesh("batch")
      self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      self.sliced = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))

  @property
  def count(self) -> int:
    """The processes a batch is spread over (1 on this process alone)."""
    return distributed.process_count() if self.across else 1

  def place(self, tree):
    """``tree`` replicated on every process (unchanged on this process alone)."""
    if not self.across:
      return tree
    return distributed.put(jax.tree.map(np.asarray, tree), self.replicated)

  def local(self, tree):
    """``tree``'s replicated arrays read on this process (a collective when data-parallel)."""
    return distributed.to_host(tree, f"gathering {self.what}") if self.across else tree

  def step(self, step: Callable, weighted_step: Callable) -> Callable:
    """The jitted step of host batches.

    Args:
      step: ``(params, opt_state, *batch) -> (params, opt_state, loss)``.
      weighted_step: the same with a last argument ``w`` of each row's weight (0 for the
        padding rows), for the data-parallel batches.

    Returns:
      ``(params, opt_state, *batch) -> (params, opt_state, loss)`` of numpy batches whose
      first axis is the examples; the loss is on the host when data-parallel.
    """
    if not self.across:
      plain = jax.jit(step)
      return lambda p, st, *batch: plain(p, st, *(jnp.asarray(b) for b in batch))
    parallel = jax.jit(weighted_step, out_shardings=(self.replicated,) * 3)
    P = self.count

    def run(p, st, *batch):
      n = batch[0].shape[0]
      rows = -(-n // P) * P  # padded so that every process holds as many rows
      w = (np.arange(rows) < n).astype(np.float32)
      padded = tuple(
        np.pad(np.asarray(b), [(0, rows - n)] + [(0, 0)] * (np.ndim(b) - 1)) for b in batch
      )
      p, st, loss = parallel(p, st, *distributed.put((*padded, w), self.sliced))
      return p, st, distributed.to_host(loss, f"gathering the loss of {self.what}")

    return run


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass(frozen=True)
class Loop:
  """What a component gives :func:`run`.

  A unit is one optimiser step, or an epoch of them (KVzap's MLP): log rows, checkpoints and the
  progress bar count units.

  Attributes:
    name: the component, for the progress bar, the log and the run's record
      (``<name>_run.json`` in the checkpoint directory).
    units: the units to run.
    columns: the names of a log row's values.
    batches: ``unit -> [indices]``, the examples of each of the unit's steps (:func:`epochs`,
      :func:`passes`, :func:`cycled`).
    batch: ``(unit, indices) -> batch``, the arrays of one step.
    step: ``(params, opt_state, *batch) -> (params, opt_state, loss)``.
    row: ``(unit, before, after, losses, batch) -> row``, the log row of a logged unit: the
      weights before and after the unit, its steps' ``(loss, examples)`` pairs and its last
      batch.
    log_every: a unit ``u`` is logged when ``u % log_every == 0``.
    log_last: the last unit is logged too.
    checkpoint_every: units between checkpoints (the last unit is always checkpointed).
  """

  name: str
  units: int
  columns: tuple[str, ...]
  batches: Callable[[int], Sequence[np.ndarray]]
  batch: Callable[[int, np.ndarray], tuple]
  step: Callable
  row: Callable[..., Sequence[float]]
  log_every: int = 1
  log_last: bool = False
  checkpoint_every: int = 1

  def logged(self, unit: int) -> bool:
    """Whether ``unit`` gives a log row."""
    return unit % self.log_every == 0 or (self.log_last and unit + 1 == self.units)


@dataclasses.dataclass(frozen=True)
class Trained:
  """:func:`run`'s result.

  Attributes:
    params: the trained weights.
    opt_state: the optimiser state.
    history: the log rows, in order (resumed runs included).
  """

  params: object
  opt_state: object
  history: tuple[tuple[float, ...], ...]


def check_record(path: pathlib.Path, record: dict) -> None:
  """Records a checkpointed run's arguments in ``path``; a resume with others is refused (the
  checkpoints belong to another run).

  Args:
    path: the record's file (its folder is made).
    record: the json-serialisable arguments.

  Raises:
    ValueError: naming the checkpoint directory and each argument that differs.
  """
  record = json.loads(json.dumps(record, sort_keys=True))
  if path.exists():
    saved = json.loads(path.read_text())
    differ = {k: (saved.get(k), v) for k, v in record.items() if saved.get(k) != v}
    if differ:
      said = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in differ.items())
      raise ValueError(
        f"checkpoint_dir: {path.parent} holds a run with other arguments ({said}); use a fresh "
        "directory"
      )
  else:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, sort_keys=True))


def log_line(loop: Loop, row: Sequence[float]) -> str:
  """A log row as one line: ``"<name>: [unit/units] column value ..."``.

  Args:
    loop: the loop.
    row: a log row whose first value is its unit.

  Returns:
    The line.
  """
  values = " ".join(f"{c} {v:.4f}" for c, v in zip(loop.columns[1:], row[1:], strict=True))
  return f"{loop.name}: [{int(row[0]) + 1}/{loop.units}] {values}"


def run(
  loop: Loop,
  params,
  opt_state,
  *,
  checkpoint_dir: str | pathlib.Path | None = None,
  record: dict | None = None,
  on_log: Callable[[tuple], None] | None = None,
) -> Trained:
  """Runs a training loop: ``loop.units`` units of ``loop.step`` over ``loop.batches``.

  After each logged unit (:meth:`Loop.logged`) its row joins the history and goes to
  ``on_log``, after the unit's checkpoint if it has one. With a ``checkpoint_dir`` the weights,
  the optimiser state and the history are saved with orbax every ``loop.checkpoint_every``
  units and after the last, and a later call with the same arguments resumes from the last
  checkpoint: the result equals an uninterrupted run's (the batch orders depend only on the
  seed and the unit). Data-parallel runs (:class:`DataParallel`) save orbax's multi-host
  checkpoints: every process saves and restores, process 0 writes the replicated arrays and
  the record, so ``checkpoint_dir`` must be the same directory for every process.

  Args:
    loop: the component's loop.
    params: the initial weights (placed where the steps run).
    opt_state: the initial optimiser state (placed likewise).
    checkpoint_dir: where to checkpoint and resume (``None``: no checkpoints).
    record: the run's arguments (json values): a resume with others is refused
      (:func:`check_record`).
    on_log: called with each log row (``None``: process 0 prints :func:`log_line`).

  Returns:
    The :class:`Trained` weights, optimiser state and history.

  Raises:
    ValueError: for a ``checkpoint_dir`` holding a run with another ``record``, and a saved
      step that cannot be restored (:func:`kvjax.rundir.restore_checkpoint`).
  """
  history: list[tuple[float, ...]] = []
  start, mngr = 0, None
  if checkpoint_dir is not None:
    import orbax.checkpoint as ocp  # only checkpointed runs pay for orbax's import

    path = pathlib.Path(checkpoint_dir).absolute()
    if record is not None:  # process 0 checks; its refusal reaches every process
      where = path / f"{loop.name}_run.json"
      distributed.on_primary(lambda: check_record(where, record), "checking the checkpoints")
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    last = mngr.latest_step()
    if last is not None:
      rows = sum(loop.logged(u) for u in range(last))
      like = {
        "params": params,
        "opt_state": opt_state,
        "history": np.zeros((rows, len(loop.columns)), np.float64),
      }
      restore = functools.partial(mngr.restore, last, args=ocp.args.StandardRestore(like))
      item = rundir.restore_checkpoint(path, last, restore)
      params, opt_state = item["params"], item["opt_state"]
      history = [tuple(float(v) for v in row) for row in np.asarray(item["history"])]
      start = last
  if on_log is None:

    def on_log(row):
      if distributed.is_primary():
        print(log_line(loop, row), flush=True)

  bar = tqdm(
    total=loop.units,
    initial=start,
    desc=loop.name,
    disable=None if distributed.is_primary() else True,  # None: shown on a terminal alone
    leave=False,
  )
  for unit in range(start, loop.units):
    before, losses, batch = params, [], ()
    for indices in loop.batches(unit):
      batch = loop.batch(unit, indices)
      params, opt_state, loss = loop.step(params, opt_state, *batch)
      losses.append((loss, len(indices)))
    row = None
    if loop.logged(unit):
      row = tuple(float(v) for v in loop.row(unit, before, params, losses, batch))
      history.append(row)
    if mngr is not None and ((unit + 1) % loop.checkpoint_every == 0 or unit + 1 == loop.units):
      item = {
        "params": params,
        "opt_state": opt_state,
        "history": np.asarray(history, np.float64),
      }
      mngr.save(unit + 1, args=ocp.args.StandardSave(item))
      mngr.wait_until_finished()
    bar.update()
    if row is not None:
      on_log(row)
      distributed.fault_point()  # after a row and its checkpoint: the tests kill a process here
  bar.close()
  if mngr is not None:
    mngr.close()
  return Trained(params, opt_state, tuple(history))


# --------------------------------------------------------------------------- training data


def check_pairs(X_NLd, y_NLG, why_finite: str = "") -> tuple[np.ndarray, np.ndarray]:
  """Checks per-position training pairs: attention inputs and their per-KV-head targets.

  Args:
    X_NLd: inputs ``[N, L, d]``.
    y_NLG: targets ``[N, L, G]``.
    why_finite: appended to the error for a non-finite value, e.g. what makes one.

  Returns:
    ``(X, y)`` as fp32 numpy arrays.

  Raises:
    ValueError: for arrays that are not 3-D, of different ``N`` or ``L``, empty, or holding a
      non-finite value.
  """
  X, y = np.asarray(X_NLd, np.float32), np.asarray(y_NLG, np.float32)
  if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2] or X.shape[0] == 0:
    raise ValueError(
      f"X_NLd, y_NLG: expected [N, L, d] and [N, L, G] with the same N, L > 0, got {X.shape} "
      f"and {y.shape}"
    )
  if not (np.isfinite(X).all() and np.isfinite(y).all()):
    raise ValueError(f"X_NLd, y_NLG: expected finite values{why_finite}")
  return X, y


def timed(fn: Callable[[], object]) -> tuple[object, float]:
  """``(result, seconds)`` of a second call of ``fn`` (the first one compiles).

  Args:
    fn: a function of no arguments returning arrays.

  Returns:
    The second call's result (ready) and its wall time.
  """
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def _from_primary(value, what: str):
  """Process 0's array on every process (it alone reads the run directory)."""
  if distributed.process_count() == 1:
    return value
  mine = value if distributed.is_primary() else np.zeros(0, np.float32)
  return distributed.gather_arrays(mine, what)[0]


def _claim(folder: pathlib.Path, names: list[str], identity: dict | None) -> list[str]:
  """The saved parts among ``names``; with an ``identity``, checks (or records) the settings
  the saved parts were computed with."""
  folder.mkdir(parents=True, exist_ok=True)
  if identity is not None:
    record = folder / f"{folder.name}.json"
    identity = json.loads(json.dumps(identity, sort_keys=True))
    if record.exists() and json.loads(record.read_text()) != identity:
      raise ValueError(
        f"workdir: {folder} holds parts of other settings ({record.read_text()}); use a fresh "
        "workdir"
      )
    record.write_text(json.dumps(identity, sort_keys=True))
  return [n for n in names if (folder / n).exists()]


def cached_parts(
  folder: str | pathlib.Path,
  total: int,
  size: int,
  compute: Callable[[int], tuple],
  names: dict[str, int],
  *,
  prefix: str = "part",
  identity: dict | None = None,
  label: str = "targets: contexts",
) -> dict[str, np.ndarray]:
  """Training data computed part by part, each part saved (``<folder>/<prefix>_<start>.npz``,
  written whole or not at all), so that a killed run computes only the missing parts.

  Over several processes (``kvjax.distributed``) each round of missing parts is split among them
  (one each) and process 0 saves them; every process returns every part. Each part computed
  prints ``"<label> <done>/<total> (<seconds> s)"``.

  Args:
    folder: the parts' folder.
    total: the items (rows, contexts).
    size: items per part (part ``i`` holds items ``i .. i + size - 1``).
    compute: ``start -> arrays``, one part's arrays in the order of ``names``.
    names: ``{name: axis}``: the arrays' names, each with the axis along which the parts join.
    prefix: the parts' file prefix.
    identity: the settings the parts depend on (json values): saved parts of other settings
      are refused (``<folder>/<folder name>.json`` records them).
    label: the progress line's label.

  Returns:
    ``{name: array}`` of every part, joined in order.

  Raises:
    ValueError: for a folder holding parts of another ``identity``.
  """
  folder = pathlib.Path(folder)
  starts = list(range(0, total, size))
  file = {i: folder / f"{prefix}_{i:05d}.npz" for i in starts}
  claim = lambda: _claim(folder, [file[i].name for i in starts], identity)  # noqa: E731
  done = set(distributed.on_primary(claim, "checking the saved parts"))
  todo = [i for i in starts if file[i].name not in done]
  got: dict[int, dict] = {}
  P = distributed.process_count()
  for r in range(0, len(todo), P):
    round_ = todo[r : r + P]
    mine = []
    for j in distributed.share(round_):
      t0 = time.perf_counter()
      mine.append(compute(round_[j]))
      seconds = time.perf_counter() - t0
      print(f"{label} {min(round_[j] + size, total)}/{total} ({seconds:.1f} s)", flush=True)
    shared = [
      distributed.gather_shares([m[n] for m in mine], len(round_), "gathering the parts")
      for n in range(len(names))
    ]
    for n, i in enumerate(round_):
      got[i] = {k: shared[j][n] for j, k in enumerate(names)}
      if distributed.is_primary():
        tmp = file[i].with_suffix(".tmp.npz")
        np.savez(tmp, **got[i])
        os.replace(tmp, file[i])  # a part is whole or absent
  for i in starts:
    if i not in got:
      arrays = None
      if distributed.is_primary():
        with np.load(file[i]) as f:
          arrays = {k: f[k] for k in names}
      got[i] = {
        k: _from_primary(arrays[k] if arrays else None, "sharing the saved parts") for k in names
      }
  return {k: np.concatenate([got[i][k] for i in starts], axis=axis) for k, axis in names.items()}


def saved_targets(
  c, workdir: pathlib.Path, rows, names: Sequence[str], compute: Callable[[np.ndarray, int], tuple]
) -> tuple[dict[str, np.ndarray], float]:
  """An experiment's training targets ``X`` and ``y`` of ``rows``, computed ``c.batch_rows`` rows
  at a time and saved (``<workdir>/targets/part_*.npz``, :func:`cached_parts`); every process
  calls it with the same arguments.

  Args:
    c: the settings: ``batch_rows`` and the fields ``names``.
    workdir: the run directory, checked (:func:`kvjax.rundir.check_workdir`); process 0 makes it.
    rows: the contexts ``[N, T]``.
    names: the settings the targets depend on: saved parts of other settings (or other rows)
      are refused.
    compute: ``(part_rows, start) -> (X, y)``, the targets of the rows ``start ..``.

  Returns:
    ``({"X": ..., "y": ...}, seconds)``: the targets of every row joined in order and the time
    they took.

  Raises:
    ValueError: for saved targets of other settings.
  """
  if distributed.is_primary():
    workdir.mkdir(parents=True, exist_ok=True)
  identity = {k: getattr(c, k) for k in names} | {"rows_sum": int(np.sum(rows))}

  def part(i):
    return compute(rows[i : i + c.batch_rows], i)

  t0 = time.perf_counter()
  data = cached_parts(
    workdir / "targets", len(rows), c.batch_rows, part, {"X": 0, "y": 0}, identity=identity
  )
  return data, round(time.perf_counter() - t0, 2)
