"""Training the tiny retrieval model: optax AdamW (warmup + cosine, clipping) on the task mixture,
with an orbax ``CheckpointManager`` that resumes exactly.

The loss is next-token cross-entropy on the scored answer tokens only (the haystack is random words:
nothing to learn there). With ``set_targets`` the set-scored tasks (RULER's multi-value and
multi-query, scored as sets) are taught as sets: the answer items are teacher-forced in a random
order and every item not yet given is an accepted next token (``-log`` of their summed
probability), so the model learns to give each matching value once rather than a reference order.

Batches are a pure function of ``(seed, step)``: a resumed run sees the same batches as an
uninterrupted one, so its loss curve continues unchanged. Context lengths follow a curriculum of
fixed shapes (one compile each): short contexts first, where retrieval is learned cheaply, then a
mixture up to ``max_length`` so that the model keeps working at 2k tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import queue
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from kvjax import rundir
from kvjax.eval import tasks, vocab
from kvjax.model import llama
from kvjax.model.config import ModelConfig


def answer_room(T: int) -> int:
  """Tokens reserved after the prompt for the longest answer (mqar's queries fill it)."""
  return 24 if T <= 256 else 48


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  return ModelConfig(
    vocab_size=vocab_size,
    hidden_size=c.hidden_size,
    intermediate_size=c.intermediate_size,
    num_layers=c.num_layers,
    num_heads=c.num_heads,
    num_kv_heads=c.num_kv_heads,
    head_dim=c.hidden_size // c.num_heads,
    rope_theta=c.rope_theta,
    tie_word_embeddings=True,
  )


# --------------------------------------------------------------------------- data


def _task_options(
  task: str, rng: np.random.Generator, c: ml_collections.ConfigDict, T: int
) -> dict:
  """Random task sizes so that the model sees every count it is evaluated on and more (needles
  take at most about half of a short context)."""
  most = max((T - answer_room(T) - 40) // 10, 4)  # a needle is ~9 tokens, a question < 40
  queries = (answer_room(T) + 3) // 4  # an mqar answer of q queries takes 4 q - 3 tokens
  r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
  if task == "multi_key":
    return dict(num_distractors=r(1, min(c.max_distractors, most - 1)))
  if task == "multi_value":
    return dict(num_values=r(2, 4))
  if task == "multi_query":
    pairs = r(4, min(12, most))
    return dict(num_pairs=pairs, num_queries=r(2, min(4, pairs)))
  if task == "variable_tracking":
    return dict(num_hops=r(2, 5))
  if task == "mqar":
    pairs = r(4, min(c.max_pairs, most))
    return dict(num_pairs=pairs, num_queries=r(min(4, pairs), min(queries, pairs)))
  return {}


def stage_at(step: int, c: ml_collections.ConfigDict):
  """The curriculum stage of ``step`` (the last one runs to the end)."""
  return next((s for s in c.curriculum if step < s.until), c.curriculum[-1])


def shape_at(step: int, c: ml_collections.ConfigDict) -> tuple[int, int]:
  """``(length, batch)`` of ``step``: drawn from its stage's shapes (a pure function of the
  step)."""
  rng = np.random.default_rng([c.seed, step, 1])
  shapes = stage_at(step, c).shapes
  return tuple(shapes[int(rng.integers(len(shapes)))])


MAX_SET = 8  # the most answer items a set target lists (training draws at most 4 values or queries)


def make_batch(step: int, c: ml_collections.ConfigDict, tokenizer) -> dict:
  """The batch of ``step``: ``tokens [B, T]``, ``weights [B, T]`` (1 where the next token is a
  scored answer token) and ``targets [B, T, MAX_SET]``: the tokens accepted as the next one
  (-1 pads). That is the next token alone, except with ``c.set_targets`` on a set-scored task
  (``multi_value``, ``multi_query``), where every answer item not yet given is accepted: the task
  is scored as a set, so the order of the reference answer is not something to learn."""
  T, B = shape_at(step, c)
  rng = np.random.default_rng([c.seed, step, 2])
  mixture = stage_at(step, c).get("mixture") or c.mixture
  names = list(mixture.keys())
  probs = np.asarray([mixture[n] for n in names], np.float64)
  tokens = np.full((B, T), tokenizer.pad_id, np.int32)
  weights = np.zeros((B, T), np.float32)
  targets = np.full((B, T, MAX_SET), -1, np.int32)
  for b in range(B):
    task = names[int(rng.choice(len(names), p=probs / probs.sum()))]
    if task == "copy":
      tokens[b], weights[b] = _copy_sequence(rng, T, tokenizer)
      continue
    ex = tasks.generate(
      task,
      tokenizer,
      length=T - answer_room(T),
      seed=int(rng.integers(2**31)),
      **_task_options(task, rng, c, T),
    )
    answer = ex.answer
    as_set = bool(c.get("set_targets")) and _single_token_set(ex)
    if as_set:
      # the teacher-forced items in a random order: in the reference order the last item is never
      # given before the end, so "repeat the last match" would always be accepted
      answer = rng.permutation(answer)
    seq = np.concatenate([ex.prompt, answer])
    tokens[b, : seq.size] = seq
    # the logit at position i predicts token i + 1
    weights[b, ex.prompt.size - 1 : seq.size - 1] = ~ex.answer_given
    if as_set:
      for i in range(answer.size):
        targets[b, ex.prompt.size - 1 + i, 1 : answer.size - i] = answer[i + 1 :]
  targets[:, :-1, 0] = tokens[:, 1:]
  return {"tokens": tokens, "weights": weights, "targets": targets}


def _single_token_set(ex: tasks.Example) -> bool:
  """A set-scored answer whose items are one token each (the tiny vocabulary's values): then any
  remaining item is a correct next token. Multi-token items keep the reference order."""
  n = ex.answer.size
  if ex.scoring != "set" or n > MAX_SET:
    return False
  return bool(np.array_equal(ex.answer_piece, np.arange(n)) and not ex.answer_given.any())


def _copy_sequence(rng: np.random.Generator, T: int, tokenizer):
  """An auxiliary training sequence: random words, then the same words again, the repeat
  supervised. Copying is what every retrieval task needs; this dense signal (half the tokens)
  grows the previous-token and induction heads long before the sparse answers alone would."""
  half = int(rng.integers(8, (T - 1) // 2 + 1))
  words = rng.choice(vocab.FILLER + vocab.KEYS + vocab.VALUES, half).tolist()
  ids = [tokenizer.bos_id] + tokenizer.encode(" ".join(words)) * 2
  seq = np.full(T, tokenizer.pad_id, np.int32)
  seq[: len(ids)] = ids
  w = np.zeros(T, np.float32)
  w[half + 1 : 2 * half] = (
    1.0  # predicts the repeat from its second word on (the first is unknowable)
  )
  return seq, w


class Prefetch:
  """Builds the next batches on a thread while the accelerator trains (numpy releases the GIL
  rarely, but jitted steps do)."""

  def __init__(self, start: int, stop: int, c, tokenizer, depth: int = 4):
    self.q: queue.Queue = queue.Queue(depth)
    self.thread = threading.Thread(target=self._fill, args=(start, stop, c, tokenizer), daemon=True)
    self.thread.start()

  def _fill(self, start, stop, c, tokenizer):
    try:
      for step in range(start, stop):
        self.q.put((step, make_batch(step, c, tokenizer)))
    except Exception as e:  # surfaced in the training loop, never a silent hang
      self.q.put((None, e))

  def __iter__(self):
    while True:
      step, item = self.q.get()
      if step is None:
        raise item
      yield step, item


# --------------------------------------------------------------------------- model and loss


def logits_fn(cfg: ModelConfig, params: dict, tokens_BT: jax.Array) -> jax.Array:
  """Causal forward for training: the model's own layer functions, one ``[T, T]`` mask."""
  B, T = tokens_BT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  allowed = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

  def layer(x, p):
    return llama.dense_layer(cfg, p, x, positions, allowed)[0], None

  x, _ = jax.lax.scan(layer, params["embed"][tokens_BT], llama.stacked(params))
  return llama.logits_of(cfg, params, x)


def loss_fn(cfg, params, batch) -> tuple[jax.Array, dict]:
  """Cross-entropy of the accepted next tokens: ``-log sum_{t in targets} p(t)`` (the plain
  next-token loss where one token is accepted), averaged over the weighted positions."""
  logp = jax.nn.log_softmax(logits_fn(cfg, params, batch["tokens"])[:, :-1])
  targets = batch["targets"][:, :-1]
  ok = targets >= 0
  picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0), axis=-1)
  nll = -jax.nn.logsumexp(jnp.where(ok, picked, -jnp.inf), axis=-1)
  w = batch["weights"][:, :-1]
  n = jnp.maximum(w.sum(), 1.0)
  best = jnp.argmax(logp, -1)[..., None]
  correct = ((best == targets) & ok).any(-1).astype(jnp.float32)
  return (nll * w).sum() / n, {"token_accuracy": (correct * w).sum() / n}


def optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, c.learning_rate, c.warmup_steps, c.steps, end_value=c.learning_rate * c.final_lr_fraction
  )
  # every matrix-shaped leaf decays; with parameters stacked over layers this includes the norm
  # scales [L, d] (the shipped model was trained so; the final norm [d] does not decay)
  decay_mask = lambda params: {k: v.ndim >= 2 for k, v in params.items()}  # noqa: E731
  return optax.chain(
    optax.clip_by_global_norm(c.clip_norm),
    optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=c.weight_decay, mask=decay_mask),
  )


@dataclasses.dataclass
class TrainState:
  step: int
  params: dict
  opt_state: optax.OptState


def init_state(c: ml_collections.ConfigDict, cfg: ModelConfig) -> TrainState:
  """Step 0: random parameters, or those of the latest checkpoint in ``c.init_from`` (a second
  training phase; the optimizer starts afresh)."""
  params = llama.Llama(cfg, rngs=nnx.Rngs(c.seed)).params()
  params = {k: jnp.asarray(v) for k, v in params.items()}
  if c.get("init_from"):
    source = checkpoint_manager(c.init_from)
    like = TrainState(0, params, optimizer(c).init(params))
    restored = restore(source, like)
    source.close()
    if restored is None:
      raise ValueError(f"init_from: no checkpoint in {c.init_from}")
    params = restored.params
  return TrainState(0, params, optimizer(c).init(params))


def make_step(cfg: ModelConfig, c: ml_collections.ConfigDict):
  opt = optimizer(c)

  @jax.jit
  def step(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch), has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(aux, loss=loss)

  return step


# --------------------------------------------------------------------------- checkpoints


def checkpoint_manager(workdir: str | pathlib.Path, keep: int = 2) -> ocp.CheckpointManager:
  path = pathlib.Path(workdir).absolute() / "checkpoints"
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def save(mngr: ocp.CheckpointManager, state: TrainState) -> None:
  item = {"params": state.params, "opt_state": state.opt_state}
  mngr.save(state.step, args=ocp.args.StandardSave(item))
  mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, like: TrainState) -> TrainState | None:
  step = mngr.latest_step()
  if step is None:
    return None
  target = {"params": like.params, "opt_state": like.opt_state}
  restore = functools.partial(mngr.restore, step, args=ocp.args.StandardRestore(target))
  item = rundir.restore_checkpoint(mngr.directory, step, restore)
  return TrainState(step, item["params"], item["opt_state"])


# --------------------------------------------------------------------------- the loop


# config fields that change no trained weight: they may differ between a run and its resume
NOT_IDENTITY = ("log_every", "checkpoint_every")


def train(c: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, log=print) -> TrainState:
  """Trains (or resumes) to ``c.steps``; writes ``metrics.jsonl`` (one line per logged step,
  never duplicated on resume) and checkpoints every ``c.checkpoint_every`` steps. The run holds
  the workdir's lock (:func:`kvjax.rundir.lock`): a second run into it refuses. The workdir's
  ``train_config.json`` records the config (:func:`kvjax.rundir.claim`): a resume must agree
  with it outside :data:`NOT_IDENTITY`, and checkpoints or metrics without it are refused."""
  rundir.check_workdir(workdir)
  with rundir.lock(workdir):
    return _train(c, pathlib.Path(workdir), log)


def _train(c: ml_collections.ConfigDict, workdir: pathlib.Path, log) -> TrainState:
  tok = vocab.tiny_tokenizer()
  cfg = model_config(c.model, tok.vocab_size)
  done = rundir.holds_data(workdir / "checkpoints") or rundir.holds_data(workdir / "metrics.jsonl")
  rundir.claim(
    workdir,
    "train_config.json",
    rundir.signature(c),
    has_results=done,
    not_identity=NOT_IDENTITY,
  )
  state = init_state(c, cfg)
  mngr = checkpoint_manager(workdir)
  restored = restore(mngr, state)
  if restored is not None:
    state = restored
    log(f"resumed at step {state.step}")
  metrics_path = workdir / "metrics.jsonl"
  _truncate_metrics(metrics_path, state.step)
  step_fn = make_step(cfg, c)
  t0 = time.time()
  window: list[dict] = []
  batches = Prefetch(state.step, c.steps, c, tok) if state.step < c.steps else []
  for step, batch in batches:
    params, opt_state, m = step_fn(state.params, state.opt_state, batch)
    state = TrainState(step + 1, params, opt_state)
    window.append({k: float(v) for k, v in m.items()} | {"length": batch["tokens"].shape[1]})
    if state.step % c.log_every == 0 or state.step == c.steps:
      row = {
        "step": state.step,
        "loss": float(np.mean([w["loss"] for w in window])),
        "token_accuracy": float(np.mean([w["token_accuracy"] for w in window])),
        "seconds": round(time.time() - t0, 1),
      }
      window = []
      with metrics_path.open("a") as f:
        f.write(json.dumps(row) + "\n")
      log(json.dumps(row))
    if state.step % c.checkpoint_every == 0 or state.step == c.steps:
      save(mngr, state)
    if state.step >= c.steps:
      break
  mngr.close()
  return state


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
  """Drops metric lines past the restored step (written after the last checkpoint)."""
  if not path.exists():
    return
  rows = rundir.read_jsonl(path)  # a line cut by a kill is skipped
  path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
