"""Training: the loss falls, checkpoints restore exactly, a killed run resumes on the same curve."""

import json

import jax
import numpy as np
import pytest

from configs import train_tiny
from kvjax import model as km
from kvjax import rundir
from kvjax.eval import card, train, vocab
from kvjax.model import tokenizer


def quick_config(steps=8):
  c = train_tiny.get_config("quick")
  c.steps = steps
  return c


def test_batches_are_a_pure_function_of_the_step():
  c, tok = quick_config(), vocab.tiny_tokenizer()
  a, b = train.make_batch(3, c, tok), train.make_batch(3, c, tok)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  assert not np.array_equal(a["tokens"], train.make_batch(4, c, tok)["tokens"])
  assert a["tokens"].shape == (4, 128) and a["weights"].sum() > 0
  # every weighted position predicts an answer (or repeated) token, never padding
  nxt = a["tokens"][:, 1:][a["weights"][:, :-1] > 0]
  assert (nxt != tok.pad_id).all()


def test_set_targets_accept_every_item_not_yet_given():
  c, tok = quick_config(), vocab.tiny_tokenizer()
  c.curriculum[0].mixture = {"multi_value": 1.0}
  plain = train.make_batch(0, c, tok)
  # off: the next token alone is accepted
  np.testing.assert_array_equal(plain["targets"][:, :-1, 0], plain["tokens"][:, 1:])
  assert (plain["targets"][:, :, 1:] == -1).all()
  c.set_targets = True
  in_prompt_order = []
  for step in range(3):
    batch = train.make_batch(step, c, tok)
    for b in range(batch["tokens"].shape[0]):
      at = np.flatnonzero(batch["weights"][b])
      given = batch["tokens"][b, at + 1].tolist()
      # the values of the key's needles, each once, in some order
      prompt = batch["tokens"][b, : at[0] + 1].tolist()
      assert len(set(given)) == len(given) >= 2 and all(v in prompt for v in given)
      in_prompt_order.append(given == sorted(given, key=prompt.index))
      for i, pos in enumerate(at):
        accepted = batch["targets"][b, pos]
        assert accepted[0] == given[i]
        assert set(accepted[accepted >= 0].tolist()) == set(given[i:])
  # the teacher-forced order is drawn, not the reference (prompt) order
  assert not all(in_prompt_order)


def test_loss_is_minus_log_of_the_accepted_mass():
  c, tok = quick_config(), vocab.tiny_tokenizer()
  cfg = train.model_config(c.model, tok.vocab_size)
  params = train.init_state(c, cfg).params
  tokens = np.asarray([[tok.bos_id, 5, 6, 7, 8, 9]], np.int32)
  weights = np.asarray([[0, 0, 1, 1, 0, 0]], np.float32)
  targets = np.full((1, 6, train.MAX_SET), -1, np.int32)
  targets[0, :-1, 0] = tokens[0, 1:]
  targets[0, 2, 1] = 11  # position 2 accepts 7 or 11
  batch = {"tokens": tokens, "weights": weights, "targets": targets}
  loss, _ = train.loss_fn(cfg, params, batch)
  logp = np.asarray(jax.nn.log_softmax(train.logits_fn(cfg, params, tokens)[0]), np.float64)
  want = -(np.log(np.exp(logp[2, 7]) + np.exp(logp[2, 11])) + logp[3, 8]) / 2
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  targets[0, 2, 1] = -1  # one accepted token: the plain next-token cross-entropy
  loss, _ = train.loss_fn(cfg, params, batch | {"targets": targets})
  np.testing.assert_allclose(float(loss), -(logp[2, 7] + logp[3, 8]) / 2, rtol=1e-5)


def test_a_few_steps_reduce_the_loss():
  c, tok = quick_config(), vocab.tiny_tokenizer()
  c.learning_rate = 1e-2
  cfg = train.model_config(c.model, tok.vocab_size)
  state = train.init_state(c, cfg)
  step = train.make_step(cfg, c)
  batch = train.make_batch(0, c, tok)
  first = None
  params, opt = state.params, state.opt_state
  for _ in range(6):  # the same batch: the loss must fall
    params, opt, m = step(params, opt, batch)
    first = float(m["loss"]) if first is None else first
  assert float(m["loss"]) < first - 0.5


def test_checkpoint_restore_gives_identical_params_and_next_step(tmp_path):
  c, tok = quick_config(), vocab.tiny_tokenizer()
  cfg = train.model_config(c.model, tok.vocab_size)
  step = train.make_step(cfg, c)
  state = train.init_state(c, cfg)
  params, opt, _ = step(state.params, state.opt_state, train.make_batch(0, c, tok))
  state = train.TrainState(1, params, opt)
  mngr = train.checkpoint_manager(tmp_path)
  train.save(mngr, state)
  restored = train.restore(train.checkpoint_manager(tmp_path), train.init_state(c, cfg))
  assert restored.step == 1
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batch = train.make_batch(1, c, tok)
  p1, _, m1 = step(state.params, state.opt_state, batch)
  p2, _, m2 = step(restored.params, restored.opt_state, batch)
  assert float(m1["loss"]) == float(m2["loss"])
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class KilledError(Exception):
  pass


def test_interrupted_run_resumes_on_the_same_loss_curve(tmp_path):
  c = quick_config(steps=8)
  whole = train.train(c, tmp_path / "whole", log=lambda *_: None)

  def kill_at_6(line):  # dies right after logging step 6; the last checkpoint is step 4
    if '"step": 6' in line:
      raise KilledError

  with pytest.raises(KilledError):
    train.train(c, tmp_path / "cut", log=kill_at_6)
  lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
  assert json.loads(lines[-1])["step"] == 6
  resumed = train.train(c, tmp_path / "cut", log=lambda *_: None)
  assert resumed.step == whole.step == 8
  a = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
  b = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6, 8]  # none lost or doubled
  np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
  for x, y in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  record = card.phase_record(tmp_path / "cut")  # what a model card says of the run
  assert record["steps"] == 8 and record["config"]["steps"] == 8
  assert record["final_loss"] == b[-1]["loss"]
  with pytest.raises(ValueError, match="workdir"):
    card.phase_record(tmp_path / "nothing")


def test_export_loads_back_as_a_hugging_face_checkpoint(tmp_path):
  c, tok = quick_config(), vocab.tiny_tokenizer()
  cfg = train.model_config(c.model, tok.vocab_size)
  state = train.init_state(c, cfg)
  card.export(c, state.params, tmp_path, note="test")
  model, cfg2 = km.load(tmp_path)
  assert cfg2 == cfg
  for k, v in state.params.items():
    np.testing.assert_array_equal(np.asarray(model.params()[k]), np.asarray(v))
  assert tokenizer.WordTokenizer.load(tmp_path / "tokenizer.json").vocab == tok.vocab
  written = json.loads((tmp_path / "card.json").read_text())
  assert written["note"] == "test" and written["phases"] == [{"config": rundir.plain(c)}]
  assert written["model"].startswith(f"Llama config, {cfg.num_layers} layers")


def test_unknown_preset_is_named():
  with pytest.raises(ValueError, match="preset"):
    train_tiny.get_config("huge")


def test_a_torn_metrics_line_and_a_changed_config(tmp_path):
  c = quick_config(steps=4)
  train.train(c, tmp_path, log=lambda *_: None)
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 6, "lo')  # cut by a kill
  c6 = quick_config(steps=6)
  with pytest.raises(ValueError, match="different config"):
    train.train(c6, tmp_path, log=lambda *_: None)
  state = train.train(c, tmp_path, log=lambda *_: None)  # same config: resumes (nothing to do)
  assert state.step == 4
  steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == [2, 4]


def test_a_run_without_its_claim_or_with_a_changed_logging_plan(tmp_path):
  c = quick_config(steps=4)
  train.train(c, tmp_path, log=lambda *_: None)
  # logging and checkpoint intervals change no weight: the run resumes (nothing left to do)
  c.log_every, c.checkpoint_every = 1, 1
  assert train.train(c, tmp_path, log=lambda *_: None).step == 4
  # checkpoints and metrics whose claim is gone are never adopted, whatever the config
  (tmp_path / "train_config.json").unlink()
  c.seed = 1
  with pytest.raises(ValueError, match=r"holds results but no train_config.json"):
    train.train(c, tmp_path, log=lambda *_: None)
  assert not (tmp_path / "train_config.json").exists()
  with pytest.raises(ValueError, match=r"workdir: got the empty path"):
    train.train(c, "", log=lambda *_: None)
