"""Task generators: determinism, exact lengths, needles present where the task says, exact scoring."""

import numpy as np
import pytest

from kvjax.eval import tasks, vocab
from kvjax.model import tokenizer

TOK = vocab.tiny_tokenizer()


@pytest.mark.parametrize("task", tasks.TASKS)
def test_deterministic_exact_length_and_in_vocabulary(task):
  a = tasks.generate(task, TOK, length=300, seed=5)
  b = tasks.generate(task, TOK, length=300, seed=5)
  c = tasks.generate(task, TOK, length=300, seed=6)
  assert a.prompt.size == 300 and a.prompt.dtype == np.int32
  np.testing.assert_array_equal(a.prompt, b.prompt)
  np.testing.assert_array_equal(a.answer, b.answer)
  assert not np.array_equal(a.prompt, c.prompt)
  assert a.prompt[0] == TOK.bos_id and (a.prompt < TOK.vocab_size).all()
  assert a.answer.size == a.answer_given.size >= 1


def _count(prompt, token):
  return int((prompt == token).sum())


def test_passkey_and_single_needle_answers_appear_where_the_needle_is():
  for seed in range(20):
    e = tasks.generate("passkey", TOK, length=200, seed=seed)
    (v,) = e.answer
    assert _count(e.prompt, v) == 2  # RULER's passkey says it twice in one needle
    assert e.prompt[e.needle_at[0]] == v
    e = tasks.generate("single_needle", TOK, length=200, seed=seed)
    (v,) = e.answer
    assert _count(e.prompt, v) == 1 and e.prompt[e.needle_at[0]] == v


def test_multi_key_distractors_have_distinct_keys_and_values():
  e = tasks.generate("multi_key", TOK, length=400, seed=1, num_distractors=5)
  vals = e.prompt[list(e.needle_at)]
  assert len(set(vals.tolist())) == 6 and e.answer[0] in vals
  for v in vals:
    assert _count(e.prompt, v) == 1
  key = TOK.decode(e.prompt[-2:-1])  # "... for KEY is"
  assert key in vocab.KEYS and _count(e.prompt, TOK.ids[key]) == 3  # needle + twice in question


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_depth_places_the_needle(depth):
  e = tasks.generate("single_needle", TOK, length=1000, seed=3, depth=depth)
  frac = e.needle_at[0] / 1000
  assert abs(frac - depth) < 0.08


def test_multi_value_and_multi_query_are_scored_as_sets():
  e = tasks.generate("multi_value", TOK, length=300, seed=2, num_values=3)
  assert e.scoring == "set" and e.answer.size == 3
  assert tasks.score(e, e.answer[::-1])
  wrong = e.answer.copy()
  wrong[0] = wrong[1]
  assert not tasks.score(e, wrong)
  q = tasks.generate("multi_query", TOK, length=300, seed=2, num_pairs=6, num_queries=3)
  assert q.scoring == "set" and q.answer.size == 3
  for v in q.answer:
    assert _count(q.prompt, v) == 1


def test_recall_is_ruler_string_match_all():
  e = tasks.generate("multi_value", TOK, length=300, seed=2, num_values=4)
  assert tasks.recall(e, e.answer[::-1]) == 1.0
  repeated = e.answer.copy()
  repeated[3] = repeated[0]  # three of the four values, one of them twice
  assert tasks.recall(e, repeated) == 0.75 and not tasks.score(e, repeated)
  assert tasks.recall(e, np.full(4, TOK.pad_id)) == 0.0
  v = tasks.generate("variable_tracking", TOK, length=300, seed=4, num_hops=3)
  assert tasks.recall(v, v.answer[::-1]) == 1.0 and not tasks.score(v, v.answer[::-1])
  m = tasks.generate("mqar", TOK, length=300, seed=4, num_pairs=8, num_queries=3)
  pred = m.answer.copy()
  pred[m.answer_given] = 0  # given positions are not the model's and never count
  pred[-1] = 0
  np.testing.assert_allclose(tasks.recall(m, pred), 2 / 3)
  with pytest.raises(ValueError, match="predicted"):
    tasks.recall(m, pred[:-1])


def test_exact_scoring_is_exact_and_mqar_ignores_given_tokens():
  e = tasks.generate("variable_tracking", TOK, length=300, seed=4, num_hops=3)
  assert e.scoring == "exact" and tasks.score(e, e.answer)
  assert not tasks.score(e, e.answer[::-1])
  m = tasks.generate("mqar", TOK, length=300, seed=4, num_pairs=8, num_queries=3)
  assert m.answer_given.tolist() == [False, True, True, True, False, True, True, True, False]
  pred = m.answer.copy()
  pred[m.answer_given] = 0  # given positions are never scored
  assert tasks.score(m, pred)
  pred[-1] = pred[0]
  assert not tasks.score(m, pred)
  with pytest.raises(ValueError, match="predicted"):
    tasks.score(m, pred[:-1])


def test_variable_tracking_chain_reads_back_to_the_value():
  e = tasks.generate("variable_tracking", TOK, length=400, seed=9, num_hops=4)
  text = TOK.decode(e.prompt)
  names = TOK.decode(e.answer).split()
  value = text.split("assigned the value ")[1].split()[0]
  assert f"var {names[0]} = {value} ." in text
  for prev, name in zip(names, names[1:], strict=False):
    assert f"var {name} = {prev} ." in text


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="task"):
    tasks.generate("nope", TOK, length=100, seed=0)
  with pytest.raises(ValueError, match="length"):
    tasks.generate("multi_key", TOK, length=30, seed=0)
  with pytest.raises(ValueError, match="depth"):
    tasks.generate("passkey", TOK, length=100, seed=0, depth=1.5)
  with pytest.raises(ValueError, match="num_hops"):
    tasks.generate("variable_tracking", TOK, length=100, seed=0, num_hops=0)
  with pytest.raises(ValueError, match="num_queries"):
    tasks.generate("mqar", TOK, length=300, seed=0, num_pairs=2, num_queries=3)
  with pytest.raises(ValueError, match="vocabulary"):
    TOK.encode("zzzz")


def test_tokenizer_json_round_trips_through_hugging_face_tokenizers(tmp_path):
  pytest.importorskip("tokenizers")
  TOK.save(tmp_path / "tokenizer.json")
  again = tokenizer.WordTokenizer.load(tmp_path / "tokenizer.json")
  assert again.vocab == TOK.vocab
  hf = tokenizer.HFTokenizer(tmp_path / "tokenizer.json", bos_token="<bos>")
  e = tasks.generate("multi_key", TOK, length=200, seed=0)
  f = tasks.generate("multi_key", hf, length=200, seed=0)
  np.testing.assert_array_equal(e.prompt, f.prompt)
  np.testing.assert_array_equal(e.answer, f.answer)


def test_a_subword_tokenizer_gets_exact_lengths(tmp_path):
  """The same tasks on a byte-level BPE tokenizer (trained here, offline): exact prompt lengths,
  answers that decode to the needle's value."""
  tk = pytest.importorskip("tokenizers")
  bpe = tk.Tokenizer(tk.models.BPE(unk_token=None))
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=["<s>"],
    initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing is dropped
  )
  corpus = [" ".join(vocab.FILLER + vocab.TEMPLATE_WORDS + vocab.KEYS[:50] + vocab.PUNCT)]
  bpe.train_from_iterator(corpus * 3, trainer)
  bpe.save(str(tmp_path / "tokenizer.json"))
  hf = tokenizer.HFTokenizer(tmp_path / "tokenizer.json", bos_token="<s>")
  for task in tasks.TASKS:
    e = tasks.generate(task, hf, length=400, seed=1)
    assert e.prompt.size == 400
  e = tasks.generate("single_needle", hf, length=400, seed=1)
  value = hf.decode(e.answer).strip()
  assert value in vocab.VALUES and f"is {value} ." in hf.decode(e.prompt)


def test_set_scoring_compares_whole_values_not_tokens():
  e = tasks.generate("multi_value", TOK, length=300, seed=2, num_values=2)
  # as if each value were two tokens (a BPE tokenizer): "42 24" must not match "44 22"
  two = tasks.Example(
    task="multi_value",
    prompt=e.prompt,
    answer=np.array([4, 2, 2, 4], np.int32),
    answer_given=np.zeros(4, bool),
    answer_piece=np.array([0, 0, 1, 1], np.int32),
    scoring="set",
    depth=0.0,
    needle_at=(),
  )
  assert tasks.score(two, np.array([2, 4, 4, 2]))  # the values swapped: fine
  assert not tasks.score(two, np.array([4, 4, 2, 2]))  # digits swapped across values: wrong
  assert tasks.recall(two, np.array([2, 4, 4, 2])) == 1.0
  assert tasks.recall(two, np.array([2, 2, 4, 4])) == 0.5  # "2 4" is in it, contiguous; "4 2" not
