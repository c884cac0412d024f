"""RULER's 11 synthetic tasks (Hsieh et al., 2024), at any length and depth, through any tokenizer.

The tasks of RULER's ``scripts/synthetic.yaml`` that are generated rather than read from a data
set (its ``qa_1`` and ``qa_2`` read SQuAD and HotpotQA):

* ``niah_single_1``: one number needle in the noise haystack (a repeated paragraph);
* ``niah_single_2`` / ``niah_single_3``: one number / UUID needle in the essay haystack;
* ``niah_multikey_1``: the asked needle among 3 others with other keys, in the essay haystack;
* ``niah_multikey_2`` / ``niah_multikey_3``: a haystack made of needles with other keys (word
  keys and number values / UUID keys and values);
* ``niah_multivalue``: 4 values of one key; ``niah_multiquery``: 4 keys asked at once;
* ``vt``: one chain of 4 hops ``VAR B = VAR A``, after one worked example (RULER's few-shot);
* ``cwe``: the 10 most common words of a numbered list, after one worked example;
* ``fwe``: the three most frequent coded words of a text whose word counts follow a zeta law.

Followed from RULER (github.com/NVIDIA/RULER, Apache-2.0): the templates and answer prefixes of
``scripts/data/synthetic/constants.py`` word for word (:data:`TEMPLATES`), with ``niah.py``'s
singular rewording when one value is asked; the task options of ``scripts/synthetic.yaml`` over
the argparse defaults of ``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``
and ``freq_words_extraction.py`` (:data:`DEFAULTS`); their needles, keys and values (7-digit
numbers, adjective-noun words from ``wonderwords``' lists, UUID4s; 5-letter variable names and
5-digit values; 6-letter coded words), their haystacks and insertion rules; and the metrics of
``scripts/eval/synthetic/constants.py`` (:func:`string_match_all`, :func:`string_match_part`,
every synthetic task scored with ``string_match_all``) after ``scripts/eval/evaluate.py``'s
``postprocess_pred``.

The differences from RULER:

* The essay haystack is not Paul Graham's essays (RULER downloads them; kvjax may not
  redistribute them) but the prose paragraphs of the Python Language Reference (CPython 3.11.7's
  ``pydoc_data.topics``, PSF License), shipped in ``kvjax/assets/ruler/essay.txt`` (``SOURCES.md``
  beside it): about 29k tokens of SmolLM2's, repeated from its start past that (RULER repeats its
  essays too when a length needs more). Its sentences are split by a full stop, question or
  exclamation mark followed by a space and a capital, quote or parenthesis, not by NLTK's punkt.
* Lengths are exact: the prompt is ``length`` tokens (``bos`` included), where RULER fits its
  prompt plus the tokens to generate under ``max_seq_length`` by a search over the haystack's
  size. Text pieces (the template's parts, each haystack unit, each needle) are tokenised one at a
  time, as :mod:`kvjax.eval.tasks` does, and the haystack's last unit is cut to fit. Pieces are
  RULER's text with the separators it joins them by: a newline stays at the end of the piece
  before it; a space, and the newline after an essay or word-list context, is the boundary
  between two pieces (a space for the piece tokenizers). ``length`` plays the part of RULER's
  ``max_seq_length`` minus the task's tokens to generate where RULER reads that (``cwe``'s choice
  of regime below 4096, ``fwe``'s vocabulary of ``max_seq_length // 50`` words).
* ``depth``, when given, places the asked needle (the first answer's) at that fraction of the
  haystack's tokens, at the nearest unit boundary; ``vt``'s chain keeps its order, so there it
  places whichever line sorts there. When ``None``, RULER's own placement: essay needles at
  depths drawn from its 40-point grid, noise and needle-haystack needles before uniformly drawn
  units. ``cwe`` and ``fwe`` have no needle and take no depth.
* ``cwe`` and ``fwe`` lists are drawn until they fill the length, then cut to it, so a few
  entries at the end are missing (RULER shrinks the list by whole words); ``cwe`` draws its words
  from ``wonderwords``' lists only, so a context that needs more words than they hold is refused
  (RULER switches to another list, ``english_words.json``, stored as a Git LFS object).
* The random draws are seeded per example (``seed``); RULER shuffles needles, ``cwe`` lists and
  ``fwe`` texts with its one global seed, the same permutation for every example of a length.
  Keys of one example are distinct, and the needle haystack's distractor keys differ from them
  (RULER draws them independently; a collision is rare). Word keys draw the adjective and the
  noun independently (RULER draws from the list of all pairs, the same law up to the lists'
  repeated entries). ``vt``'s worked example is drawn afresh rather than made once and relabelled.
* No model chat template (RULER's ``base`` template), the same prompt for every model.
* The teacher-forced answer (:class:`kvjax.eval.tasks.Example`) is RULER's outputs as items, each
  tokenised as a piece: ``niah``'s values, ``vt``'s variables and ``fwe``'s words scored as a
  set, ``cwe``'s words after their given ``1.``, ``2.``... The text metrics score generated text
  as RULER does.

Kept as RULER has them: ``cwe``'s question says "10 most common words" whatever ``num_cw`` is,
and below 4096 tokens its counts are the short regime's (6 and 1, after a worked example of 20
words) whatever ``freq_cw`` and ``freq_ucw`` are.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import importlib.resources
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from scipy.special import zeta

from kvjax.eval import tasks

TASKS = (
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

# scripts/data/synthetic/constants.py, word for word: (template, answer prefix)
TEMPLATES = {
  "niah": (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
    "the special magic {type_needle_v} for {query} mentioned in the provided text?",
    " The special magic {type_needle_v} for {query} mentioned in the provided text are",
  ),
  "variable_tracking": (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above.",
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: ",
  ),
  "common_words_extraction": (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
    "words in the above list?",
    " Answer: The top 10 words that appear most often in the list are:",
  ),
  "freq_words_extraction": (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:",
  ),
}
TOKENS_TO_GENERATE = {
  "niah": 128,
  "variable_tracking": 30,
  "common_words_extraction": 120,
  "freq_words_extraction": 50,
}

# niah.py's needle and noise haystack
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))

_NIAH = dict(
  num_needle_k=1,
  num_needle_v=1,
  num_needle_q=1,
  type_haystack="essay",
  type_needle_k="words",
  type_needle_v="numbers",
)
# scripts/synthetic.yaml's options over each script's argparse defaults
DEFAULTS = {
  "niah_single_1": _NIAH | dict(type_haystack="noise"),
  "niah_single_2": dict(_NIAH),
  "niah_single_3": _NIAH | dict(type_needle_v="uuids"),
  "niah_multikey_1": _NIAH | dict(num_needle_k=4),
  "niah_multikey_2": _NIAH | dict(type_haystack="needle"),
  "niah_multikey_3": _NIAH
  | dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
  "niah_multivalue": _NIAH | dict(num_needle_v=4),
  "niah_multiquery": _NIAH | dict(num_needle_q=4),
  "vt": dict(type_haystack="noise", num_chains=1, num_hops=4),
  "cwe": dict(freq_cw=30, freq_ucw=3, num_cw=10, num_fewshot=1),
  "fwe": dict(alpha=2.0, coded_wordlen=6, vocab_size=None),
}
KIND = {t: "niah" for t in TASKS[:8]} | {
  "vt": "variable_tracking",
  "cwe": "common_words_extraction",
  "fwe": "freq_words_extraction",
}
DEPTHLESS = ("cwe", "fwe")  # no needle: they take no depth
HAYSTACKS = {"niah": ("noise", "essay", "needle"), "variable_tracking": ("noise", "essay")}
NEEDLE_TYPES = ("numbers", "words", "uuids")
ICL_LENGTH = 500  # variable_tracking.py: its worked example fits in 500 tokens
SHORT = 4096  # common_words_extraction.py: below this max_seq_length, the short regime

TEXT_SOURCE = (
  "prose of the Python Language Reference (CPython 3.11.7's pydoc_data.topics, PSF License), "
  "kvjax/assets/ruler/essay.txt, in place of RULER's Paul Graham essays"
)


# --------------------------------------------------------------------------- shipped text


def _asset(name: str) -> str:
  return (importlib.resources.files("kvjax") / "assets" / "ruler" / name).read_text("utf-8")


@functools.cache
def essay_sentences() -> tuple[str, ...]:
  """The essay haystack's sentences, in order (see :data:`TEXT_SOURCE`).

  RULER (``niah.py``) joins its essays with runs of whitespace made single spaces and splits the
  text into sentences with NLTK's punkt; this splits after ``.``, ``?`` or ``!`` followed by a
  space and a capital letter, a quote or a parenthesis.

  Returns:
    The sentences.
  """
  text = re.sub(r"\s+", " ", _asset("essay.txt")).strip()
  return tuple(re.split(r"(?<=[.?!])\s(?=[A-Z\"“(])", text))


@functools.cache
def word_lists() -> dict[str, tuple[str, ...]]:
  """``wonderwords``' ``nouns``, ``adjectives`` and ``verbs``, as RULER reads them.

  Returns:
    Each list, in its file's order (``_get_words_from_text_file``: each line right-stripped).
  """
  return {
    name: tuple(w.rstrip() for w in _asset(f"{name}.txt").splitlines())
    for name in ("nouns", "adjectives", "verbs")
  }


@functools.cache
def _cwe_words() -> tuple[str, ...]:
  # common_words_extraction.py: the three lists, deduplicated, sorted, shuffled with its seed 42
  lists = word_lists()
  words = sorted(set(lists["nouns"] + lists["adjectives"] + lists["verbs"]))
  random.Random(42).shuffle(words)
  return tuple(words)


# --------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Question:
  """One question asked of a sample's context apart from the others (:attr:`RulerSample.queries`).

  Attributes:
    question: RULER's question for one asked key, as :attr:`RulerSample.question` is for all.
    answer_prefix: its answer prefix.
    outputs: that key's references.
    ids: the question then the answer prefix as tokens ``[Q]`` (int32), pieces tokenised as the
      sample's own question is: fed after the sample's context.
  """

  question: str
  answer_prefix: str
  outputs: tuple[str, ...]
  ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class RulerSample:
  """One RULER example: its tokens for kvjax's evaluation and RULER's text fields.

  ``header``, ``question`` and ``answer_prefix`` are the formatted template's parts before the
  context, after it (kvpress's ``question``: from ``What`` / ``Question:`` on) and RULER's answer
  prefix, as RULER writes them; ``outputs`` are RULER's references (``outputs`` in its jsonl),
  scored with :func:`string_match_all`; ``needles`` the inserted needle (or chain line) texts, in
  the order they appear in the prompt. ``queries``: for a sample that asks several keys in one
  question (``niah_multiquery``), each key as a question of its own (:class:`Question`, in
  ``niah.py``'s wording for one key), asked of the same context (the prompt but its last
  ``example.question_len`` tokens); empty for a sample that asks one.
  """

  task: str
  example: tasks.Example
  outputs: tuple[str, ...]
  header: str
  question: str
  answer_prefix: str
  needles: tuple[str, ...] = ()
  queries: tuple[Question, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Needle:
  text: str  # RULER's text, ending in the newline RULER joins lines with where it does
  mark: str  # the part of it whose prompt position ``needle_at`` records


# (number of units, their token boundaries [units + 1]) -> one slot (a boundary) per needle
_Place = Callable[[int, np.ndarray], list[int]]


class _Encoder:
  """The tokenizer's ``encode`` of one piece at a time, memoised (haystacks repeat pieces)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.memo = tokenizer, {}

  def __call__(self, text: str | tuple[int, ...]) -> list[int]:
    if isinstance(text, tuple):  # a piece already in ids (a worked example's context)
      return list(text)
    if text not in self.memo:
      try:
        self.memo[text] = list(self.tokenizer.encode(text))
      except ValueError as e:  # a word vocabulary (the tiny model's) cannot spell RULER's text
        raise ValueError(
          f"tokenizer: cannot encode RULER's text {text!r:.50} ({e}); RULER's tasks need a "
          "tokenizer that spells English, such as a real model's"
        ) from None
    return self.memo[text]

  def total(self, pieces: Sequence) -> int:
    return sum(len(self(p)) for p in pieces)


def _nearest(bounds: np.ndarray, fraction: float) -> int:
  return int(np.argmin(np.abs(bounds - fraction * bounds[-1])))


def _fill(
  enc: _Encoder,
  room: int,
  units: Iterator[str],
  needles: Sequence[_Needle],
  place: _Place,
  *,
  whole: bool = False,
) -> tuple[list[int], list[int], float]:
  """``(ids, needle starts, depth of the first needle)`` of a context of ``room`` tokens.

  Units are drawn until they fill ``room`` tokens less the needles', the last one cut to fit
  (``whole``: only whole units, at most ``room``); then each needle goes before the unit of its
  slot, needles of one slot in their order.
  """
  room -= sum(len(enc(n.text)) for n in needles)
  hay: list[list[int]] = []
  total = 0
  while total < room:
    try:
      ids = enc(next(units))
    except StopIteration:
      raise ValueError(f"length: the haystack ran out {room - total} tokens short") from None
    if whole and total + len(ids) > room:
      break
    hay.append(ids[: room - total])
    total += len(hay[-1])
  bounds = np.cumsum([0] + [len(h) for h in hay])
  slots = place(len(hay), bounds)
  order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
  ids: list[int] = []
  starts = [0] * len(needles)
  k = 0
  for u in range(len(hay) + 1):
    while k < len(order) and slots[order[k]] == u:
      i = order[k]
      nid = enc(needles[i].text)
      starts[i] = len(ids) + _find(nid, enc(needles[i].mark))
      ids += nid
      k += 1
    if u < len(hay):
      ids += hay[u]
  first = float(bounds[slots[0]] / max(total, 1)) if needles else math.nan
  return ids, starts, first


def _find(ids: list[int], part: list[int]) -> int:
  # the mark's tokens inside the needle's; a tokenizer that merges it with its neighbours (a word
  # vocabulary's unknown words) records the needle's start
  for i in range(len(ids) - len(part) + 1):
    if ids[i : i + len(part)] == part:
      return i
  return 0


def _split(full: str, kind: str, **fields) -> tuple[str, str, str]:
  """``(header, question, answer prefix)`` of a template (with its answer prefix) formatted
  around its context; the newline between the context and the question is a piece boundary."""
  text = full.format(context="\x00", **fields)
  header, rest = text.split("\x00")
  cut = rest.rfind(TEMPLATES[kind][1][:10])  # as RULER finds its answer prefix
  return header, rest[:cut].lstrip("\n"), rest[cut:]


def _random_value(rng: random.Random, kind: str) -> str:
  # niah.py's generate_random
  if kind == "numbers":
    return str(rng.randint(10**6, 10**7 - 1))
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  lists = word_lists()
  return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"


def _distinct(rng: random.Random, kind: str, n: int, taken: set[str]) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    v = _random_value(rng, kind)
    if v not in taken:
      taken.add(v)
      out.append(v)
  return out


def _essay_units() -> Iterator[str]:
  while True:  # past its end the text repeats from its start, as RULER's essays do
    yield from essay_sentences()


def _repeat(text: str) -> Iterator[str]:
  while True:
    yield text


def _uniform_slots(rng: random.Random, num_units: int, n: int) -> list[int]:
  # niah.py / variable_tracking.py: before distinct, uniformly drawn lines of the haystack
  if num_units >= n:
    return rng.sample(range(num_units), n)
  return sorted(rng.choices(range(num_units + 1), k=n))


@dataclasses.dataclass
class _Task:
  """A task's text before the haystack is sized."""

  before: list[str]  # pieces before the context: worked examples, the header
  units: Iterator[str]
  needles: list[_Needle]
  place: _Place
  header: str
  question: str
  answer_prefix: str
  items: list[str]  # the answer's scored items
  given: list[str]  # a given piece before each item ("" for none)
  scoring: str
  # several asked keys, each as its own (question, answer prefix, outputs)
  queries: list[tuple[str, str, list[str]]] = dataclasses.field(default_factory=list)


def _niah(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> _Task:
  """niah.py's generate_input_output."""
  del enc, length
  k_type, v_type, haystack = opts["type_needle_k"], opts["type_needle_v"], opts["type_haystack"]
  num_v, num_q = opts["num_needle_v"], opts["num_needle_q"]
  num_k = max(opts["num_needle_k"], num_q)
  taken: set[str] = set()
  keys = _distinct(rng, k_type, num_k, taken)
  values = [_distinct(rng, v_type, num_v, set()) for _ in keys]
  asked = rng.sample(range(num_k), num_q)
  queries = [keys[i] for i in asked]
  answers = [v for i in asked for v in values[i]]
  query = ", ".join(queries[:-1]) + ", and " + queries[-1] if num_q > 1 else queries[0]

  end = "" if haystack == "essay" else "\n"  # noise and needle haystacks are lines
  pairs = [(k, v) for k, vals in zip(keys, values, strict=True) for v in vals]
  first = (queries[0], answers[0])
  others = [p for p in pairs if p != first]
  rng.shuffle(others)
  needles = [
    _Needle(NEEDLE.format(type_needle_v=v_type, key=k, value=v) + end, v)
    for k, v in [first, *others]
  ]
  if haystack == "noise":
    units = _repeat(NOISE + "\n")
  elif haystack == "essay":
    units = _essay_units()
  else:

    def distractors():
      while True:
        (k,) = _distinct(rng, k_type, 1, taken)
        value = _random_value(rng, v_type)
        yield NEEDLE.format(type_needle_v=v_type, key=k, value=value) + "\n"

    units = distractors()
  grid = [d / 100 for d in rng.sample(DEPTHS, len(needles))] if haystack == "essay" else None

  def place(num_units: int, bounds: np.ndarray) -> list[int]:
    if grid is not None:  # essays: depths from RULER's 40-point grid, at sentence boundaries
      slots = [_nearest(bounds, f) for f in grid]
    else:
      slots = _uniform_slots(rng, num_units, len(needles))
    if depth is not None:
      slots[0] = _nearest(bounds, depth)
    return slots

  header, question, answer_prefix = _niah_text(v_type, num_q * num_v, query)
  # each asked key alone, after the same header and context: only the question's wording
  # (niah.py's for num_q = 1) differs
  queries = [_niah_text(v_type, num_v, keys[i])[1:] + (values[i],) for i in asked]
  return _Task(
    [header], units, needles, place, header, question, answer_prefix, answers,
    [""] * len(answers), "exact" if len(answers) == 1 else "set",
    queries if num_q > 1 else [],
  )  # fmt: skip


def _niah_text(v_type: str, num_answers: int, query: str) -> tuple[str, str, str]:
  """``(header, question, answer prefix)`` of the niah template asking ``query`` for
  ``num_answers`` values, with niah.py's singular wording when it asks one."""
  template, prefix = TEMPLATES["niah"]
  full, v_word = template + prefix, v_type
  if num_answers == 1:  # niah.py's singular wording, over the template and its answer prefix
    full = full.replace("Some", "A").replace("are all", "is").replace("are", "is")
    full, v_word = full.replace("answers", "answer"), v_type[:-1]
  return _split(full, "niah", type_needle_v=v_word, query=query)


def _chains(rng: random.Random, num_chains: int, num_hops: int, k: int):
  """variable_tracking.py's generate_chains: distinct upper-case names, a 5-digit value each."""
  names: list[str] = []
  seen: set[str] = set()  # the draws of a list, found in constant time
  while len(names) < num_chains * (num_hops + 1):
    name = "".join(rng.choices(string.ascii_uppercase, k=k))
    if name not in seen:
      seen.add(name)
      names.append(name)
  out = []
  for c in range(num_chains):
    these = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
    value = str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): high excluded
    lines = [f"VAR {these[0]} = {value}"]
    lines += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
    out.append((these, lines))
  return out


def _interleave(rng: random.Random, lists: list[list[str]]) -> list[str]:
  """variable_tracking.py's shuffle_sublists_heap: the chains interleaved, each in its order."""
  heap = [(rng.random(), i, 0) for i in range(len(lists))]
  heapq.heapify(heap)
  out = []
  while heap:
    _, i, j = heapq.heappop(heap)
    out.append(lists[i][j])
    if j + 1 < len(lists[i]):
      heapq.heappush(heap, (rng.random(), i, j + 1))
  return out


def _vt_text(rng, opts: dict, depth: float | None, *, icl: bool):
  """One variable-tracking prompt's parts: ``(names, needles, units, place, header, question,
  answer prefix)`` (variable_tracking.py's generate_input_output)."""
  num_hops = min(10, opts["num_hops"]) if icl else opts["num_hops"]
  chains = _chains(rng, opts["num_chains"], num_hops, 3 if icl else 5)
  names, value = chains[0][0], chains[0][1][0].split("=")[-1].strip()
  if opts["type_haystack"] == "noise":
    lines = [line for _, chain in chains for line in chain]
    needles = [_Needle(line + "\n", line.split()[1]) for line in lines]
    units = _repeat(NOISE + "\n")

    def place(num_units: int, bounds: np.ndarray) -> list[int]:
      slots = []
      for c, (_, chain) in enumerate(chains):
        these = sorted(_uniform_slots(rng, num_units, len(chain)))
        if c == 0 and depth is not None:  # the chain keeps its order: depth takes one line
          these = sorted(these[1:] + [_nearest(bounds, depth)])
        slots += these
      return slots

  else:
    lines = _interleave(rng, [chain for _, chain in chains])
    needles = [_Needle(line.strip() + ".", line.split()[1]) for line in lines]
    units = _essay_units()
    grid = sorted(d / 100 for d in rng.sample(DEPTHS, len(needles)))
    if depth is not None:
      grid = sorted(grid[1:] + [depth])

    def place(num_units: int, bounds: np.ndarray) -> list[int]:
      del num_units
      return [_nearest(bounds, f) for f in grid]

  template, prefix = TEMPLATES["variable_tracking"]
  header, question, answer_prefix = _split(
    template + prefix, "variable_tracking", query=value, num_v=num_hops + 1
  )
  return names, needles, units, place, header, question, answer_prefix


def _vt(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> _Task:
  """variable_tracking.py: one worked example of at most 500 tokens (3-letter names, its answer
  given), a newline, then the task."""
  del length
  shown = _vt_text(rng, opts, None, icl=True)
  # the task's chains are drawn before the worked example is sized (which depends on the
  # tokenizer), so that its answer is the same through every tokenizer
  names, needles, units, place, header, question, prefix = _vt_text(rng, opts, depth, icl=False)
  after = [shown[5], shown[6].strip()]
  room = ICL_LENGTH - enc.total([shown[4], *after])
  ids, _, _ = _fill(enc, room, shown[2], shown[1], shown[3], whole=True)
  worked = [shown[4], tuple(ids), *after, " ".join(shown[0]) + "\n\n"]
  return _Task(
    [*worked, header], units, needles, place, header, question, prefix, names,
    [""] * len(names), "set",
  )  # fmt: skip


def _cwe_list(rng: random.Random, words: Sequence[str], cr: int, ucr: int, num_cw: int):
  """common_words_extraction.py's get_example: ``(shuffled list, common words)``."""
  common, uncommon = list(words[:num_cw]), list(words[num_cw:])
  word_list = common * cr + uncommon * ucr
  rng.shuffle(word_list)
  return word_list, common


def _numbered(words: Sequence[str]) -> list[str]:
  # "1. word1 2. word2 ...": the number and the word are two pieces
  return [p for i, w in enumerate(words) for p in (f"{i + 1}.", w)]


def _cwe(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> _Task:
  """common_words_extraction.py's generate_input_output: ``num_fewshot`` worked examples, then
  the list; below 4096 tokens (with the 120 to generate) the short regime's counts."""
  del depth
  num_cw, pool = opts["num_cw"], _cwe_words()
  if num_cw > len(pool):
    raise ValueError(f"num_cw: {num_cw} common words asked from a list of {len(pool)}")
  short = length + TOKENS_TO_GENERATE["common_words_extraction"] < SHORT
  shot = (20, 3, 1) if short else (40, 10, 3)
  cr, ucr = (6, 1) if short else (opts["freq_cw"], opts["freq_ucw"])
  template, prefix = TEMPLATES["common_words_extraction"]
  header, question, answer_prefix = _split(
    template + prefix, "common_words_extraction", num_cw=num_cw, query=""
  )
  before: list = []
  for _ in range(opts["num_fewshot"]):
    word_list, common = _cwe_list(rng, rng.sample(pool, shot[0]), shot[1], shot[2], num_cw)
    answer = _numbered(common)
    answer[-1] += "\n"  # worked examples end with a newline, and one more before the task
    before += [header, *_numbered(word_list), question, answer_prefix.strip(), *answer]
  before.append(header)

  # the fewest words whose list fills the length (RULER: the most that fit)
  room = length - int(getattr(enc.tokenizer, "bos_id", None) is not None)
  room -= enc.total([*before, question, answer_prefix.strip()])
  perm = rng.sample(pool, len(pool))
  n, entries = num_cw, num_cw * cr
  total = cr * enc.total(perm[:num_cw]) + enc.total([f"{i}." for i in range(1, entries + 1)])
  while total < room:
    if n == len(perm):
      raise ValueError(
        f"length: {length} tokens need more words than the {len(pool)} of wonderwords' lists "
        "(RULER then draws from english_words.json)"
      )
    total += ucr * len(enc(perm[n])) + enc.total([f"{entries + j}." for j in range(1, ucr + 1)])
    n, entries = n + 1, entries + ucr
  word_list, common = _cwe_list(rng, perm[:n], cr, ucr, num_cw)
  return _Task(
    before, iter(_numbered(word_list)), [], lambda n, b: [], header, question, answer_prefix,
    common, [f"{i + 1}." for i in range(len(common))], "set",
  )  # fmt: skip


def _fwe(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> _Task:
  """freq_words_extraction.py's generate_input_output: coded words whose counts follow a zeta
  law, the top-ranked one ``...`` (noise); the answer is the next three."""
  del depth
  wordlen, alpha = opts["coded_wordlen"], float(opts["alpha"])
  size = opts["vocab_size"] or length // 50
  if size < 4:
    raise ValueError(
      f"vocab_size: {size} coded words (length // 50 by default), expected at least 4: the noise "
      "word and the three asked"
    )
  if size > 26**wordlen:
    raise ValueError(f"vocab_size: {size} distinct words of {wordlen} letters do not exist")
  vocab: set[str] = set()
  while len(vocab) < size:
    vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
  words = sorted(vocab)
  rng.shuffle(words)
  words[0] = "..."  # treat the top ranked as noise
  rate = np.arange(1, size + 1, dtype=np.float64) ** -alpha / zeta(alpha)
  lens = np.asarray([len(enc(w)) for w in words])
  template, prefix = TEMPLATES["freq_words_extraction"]
  header, question, answer_prefix = _split(template + prefix, "freq_words_extraction", query="")
  room = length - int(getattr(enc.tokenizer, "bos_id", None) is not None)
  room -= enc.total([header.rstrip(" "), question, answer_prefix.strip()])

  def tokens(n: int) -> int:
    return int(((n * rate).astype(np.int64) * lens).sum())

  lo, hi = 0, max(room, 1)
  while tokens(hi) < room:
    hi *= 2
  while lo < hi:  # the fewest words that fill the length (RULER: the most that fit)
    mid = (lo + hi) // 2
    lo, hi = (mid + 1, hi) if tokens(mid) < room else (lo, mid)
  counts = (lo * rate).astype(np.int64)
  text = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
  rng.shuffle(text)
  return _Task(
    [header.rstrip(" ")], iter(text), [], lambda n, b: [], header, question, answer_prefix,
    words[1:4], [""] * 3, "set",
  )  # fmt: skip


_BUILD = {
  "niah": _niah,
  "variable_tracking": _vt,
  "common_words_extraction": _cwe,
  "freq_words_extraction": _fwe,
}


def _check_options(task: str, options: dict) -> dict:
  unknown = sorted(set(options) - set(DEFAULTS[task]))
  if unknown:
    raise ValueError(
      f"options: {unknown} are not options of {task!r}; expected some of {sorted(DEFAULTS[task])}"
    )
  opts = DEFAULTS[task] | options
  for name, value in opts.items():
    if name == "alpha":
      if isinstance(value, bool) or not isinstance(value, int | float) or not value > 1:
        raise ValueError(
          f"alpha: expected a number > 1 (the zeta law diverges at 1), got {value!r}"
        )
    elif name == "type_haystack":
      if value not in HAYSTACKS[KIND[task]]:
        raise ValueError(f"type_haystack: expected one of {HAYSTACKS[KIND[task]]}, got {value!r}")
    elif name.startswith("type_needle"):
      if value not in NEEDLE_TYPES:
        raise ValueError(f"{name}: expected one of {NEEDLE_TYPES}, got {value!r}")
    elif not (name == "vocab_size" and value is None) and not _count(value):
      raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
  return opts


def _value_count(kind: str) -> float:
  """How many distinct values :func:`_random_value` draws of ``kind``."""
  if kind == "numbers":
    return 10**7 - 10**6
  if kind == "uuids":
    return math.inf
  lists = word_lists()
  return len(set(lists["adjectives"])) * len(set(lists["nouns"]))


def _check_counts(task: str, opts: dict, length: int) -> None:
  """Refuses, before anything is drawn, the options no prompt of ``length`` tokens can hold and
  the draws that cannot end: more needles than tokens (each needle takes one at least), than an
  essay haystack's depth grid holds (RULER draws their depths without repeats), or than there
  are distinct keys, values or variable names to draw."""
  kind = KIND[task]
  if kind == "niah":
    num_k = max(opts["num_needle_k"], opts["num_needle_q"])
    needles, what = num_k * opts["num_needle_v"], "num_needle_k x num_needle_v"
    for name, count in (("type_needle_k", num_k), ("type_needle_v", opts["num_needle_v"])):
      if count > _value_count(opts[name]):
        raise ValueError(
          f"{name}: {count} distinct {opts[name]} asked; only {_value_count(opts[name])} exist"
        )
  elif kind == "variable_tracking":
    chains, hops = opts["num_chains"], opts["num_hops"]
    needles, what = chains * (hops + 1), "num_chains x (num_hops + 1)"
    icl = chains * (min(10, hops) + 1)  # the worked example's lines: 3-letter names
    if needles > 26**5 or icl > 26**3:
      raise ValueError(
        f"num_chains: {chains} chains of {hops} hops need {needles} distinct 5-letter names "
        f"(at most {26**5}) and {icl} 3-letter ones for the worked example (at most {26**3})"
      )
    if icl > ICL_LENGTH:
      raise ValueError(
        f"num_chains: {chains} chains of {hops} hops put {icl} lines in the worked example, "
        f"which holds {ICL_LENGTH} tokens; expected fewer chains or hops"
      )
  else:
    return
  if opts["type_haystack"] == "essay" and needles > len(DEPTHS):
    raise ValueError(
      f"{what.split()[0]}: {needles} needles ({what}) in an essay haystack, whose depth grid "
      f"has {len(DEPTHS)} points; expected at most {len(DEPTHS)}"
    )
  if needles > length:
    raise ValueError(
      f"length: {length} tokens cannot hold {needles} needles ({what}) of {task!r}; expected "
      "a longer prompt or fewer needles"
    )


def _count(value) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 1


def sample(
  task: str, tokenizer, *, length: int, seed: int, depth: float | None = None, **options
) -> RulerSample:
  """One example of a RULER task whose prompt is exactly ``length`` tokens (``bos`` included).

  Follows RULER's ``scripts/data/synthetic`` generator of the task's kind (``niah.py``,
  ``variable_tracking.py``, ``common_words_extraction.py``, ``freq_words_extraction.py``) with
  the options of ``scripts/synthetic.yaml`` (:data:`DEFAULTS`), with the differences the module
  names. The prompt is RULER's input followed by its answer prefix, which ends the question.
  Deterministic in ``seed``.

  Args:
    task: one of :data:`TASKS`.
    tokenizer: any tokenizer of :mod:`kvjax.model.tokenizer` whose ``encode`` takes a text piece
      (``HFTokenizer``, ``PieceTokenizer``; a ``WordTokenizer`` only spells its own words), with
      ``bos_id`` (``None`` for none) and ``decode``.
    length: the prompt's length in tokens.
    seed: the example's seed.
    depth: where the asked needle sits, as a fraction in [0, 1] of the haystack's tokens; RULER's
      own random placement when ``None``. ``cwe`` and ``fwe`` take none.
    **options: the task's options, overriding :data:`DEFAULTS` (RULER's names: ``num_needle_k``,
      ``num_needle_v``, ``num_needle_q``, ``type_haystack``, ``type_needle_k``,
      ``type_needle_v``; ``num_chains``, ``num_hops``; ``freq_cw``, ``freq_ucw``, ``num_cw``,
      ``num_fewshot``; ``alpha``, ``coded_wordlen``, ``vocab_size``).

  Returns:
    The example's tokens (:class:`kvjax.eval.tasks.Example`, its answer RULER's outputs) and
    RULER's text fields.

  Raises:
    ValueError: naming the argument, for an unknown task or option, a bad option value, a
      ``length`` that is not an int or cannot hold the task's fixed text and needles (or, for
      ``cwe``, needs more words than the lists hold), a ``seed`` that is not an int, a ``depth``
      outside [0, 1] or given to ``cwe`` or ``fwe``; and, before anything is drawn, more
      needles than ``length`` tokens or an essay's depth grid hold, or more distinct keys,
      values or variable names than exist.
  """
  if task not in TASKS:
    raise ValueError(f"task: {task!r} is not one of {TASKS}")
  if not _count(length):
    raise ValueError(f"length: expected an int >= 1, got {length!r}")
  if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
    raise ValueError(f"seed: expected an int, got {seed!r}")
  if depth is not None:
    if task in DEPTHLESS:
      raise ValueError(f"depth: {task!r} has no needle to place; expected None, got {depth!r}")
    if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0 <= depth <= 1:
      raise ValueError(f"depth: expected a fraction in [0, 1], got {depth!r}")
  opts = _check_options(task, options)
  _check_counts(task, opts, int(length))
  rng = random.Random(f"ruler/{task}/{int(seed)}")
  enc = _Encoder(tokenizer)
  t = _BUILD[KIND[task]](opts, rng, depth, enc, length)

  bos = getattr(tokenizer, "bos_id", None)
  head = [bos] if bos is not None else []
  for piece in t.before:
    head += enc(piece)
  tail = enc(t.question) + enc(t.answer_prefix.strip())
  room = length - len(head) - len(tail)
  needle_tokens = sum(len(enc(n.text)) for n in t.needles)
  if room < needle_tokens:
    raise ValueError(
      f"length: {length} tokens cannot hold the text and needles of {task!r} "
      f"({length - room + needle_tokens} tokens)"
    )
  context, starts, first = _fill(enc, room, t.units, t.needles, t.place)
  prompt = np.asarray(head + context + tail, np.int32)
  assert prompt.size == length, (prompt.size, length)

  answer, given, piece = [], [], []
  for i, (item, before) in enumerate(zip(t.items, t.given, strict=True)):
    for text, is_given in ((before, True), (item, False)):
      ids = enc(text) if text else []
      answer += ids
      given += [is_given] * len(ids)
      piece += [i] * len(ids)
  at = sorted(range(len(starts)), key=starts.__getitem__)
  example = tasks.Example(
    task=task,
    prompt=prompt,
    answer=np.asarray(answer, np.int32),
    answer_given=np.asarray(given, bool),
    answer_piece=np.asarray(piece, np.int32),
    scoring=t.scoring,
    depth=float(depth) if depth is not None else first,
    needle_at=tuple(len(head) + starts[i] for i in at),
    question_len=len(tail),
  )
  return RulerSample(
    task=task,
    example=example,
    outputs=tuple(t.items),
    header=t.header,
    question=t.question,
    answer_prefix=t.answer_prefix,
    needles=tuple(t.needles[i].text for i in at),
    queries=tuple(
      Question(q, p, tuple(outs), np.asarray(enc(q) + enc(p.strip()), np.int32))
      for q, p, outs in t.queries
    ),
  )


def generate(
  task: str, tokenizer, *, length: int, seed: int, depth: float | None = None, **options
) -> tasks.Example:
  """The tokens of :func:`sample`: a drop-in for :func:`kvjax.eval.tasks.generate`.

  Args:
    task: one of :data:`TASKS`.
    tokenizer: as for :func:`sample`.
    length: the prompt's length in tokens.
    seed: the example's seed.
    depth: as for :func:`sample`.
    **options: the task's options (:data:`DEFAULTS`).

  Returns:
    The example, its answer RULER's outputs.

  Raises:
    ValueError: as :func:`sample`.
  """
  return sample(task, tokenizer, length=length, seed=seed, depth=depth, **options).example


# --------------------------------------------------------------------------- scoring


def postprocess_pred(predict_str: str) -> str:
  """RULER's ``postprocess_pred`` (``scripts/eval/evaluate.py``): strips the text and turns
  control characters into newlines.

  Args:
    predict_str: a model's generated text.

  Returns:
    The text as RULER scores it.

  Raises:
    ValueError: when ``predict_str`` is not a ``str``.
  """
  if not isinstance(predict_str, str):
    raise ValueError(f"predict_str: expected a str, got {type(predict_str).__name__}")
  return re.sub(r"[\x00-\x1f]", "\n", predict_str.strip()).strip()


def _check_match(preds, refs) -> None:
  if isinstance(preds, str) or not isinstance(preds, Sequence) or not preds:
    raise ValueError(f"preds: expected a non-empty list of predicted texts, got {preds!r:.60}")
  if not all(isinstance(p, str) for p in preds):
    raise ValueError("preds: expected every prediction to be a str")
  if isinstance(refs, str) or not isinstance(refs, Sequence) or len(refs) != len(preds):
    raise ValueError(f"refs: expected a list of {len(preds)} reference lists, one per prediction")
  for i, ref in enumerate(refs):
    if isinstance(ref, str) or not isinstance(ref, Sequence) or not ref:
      raise ValueError(f"refs: element {i} is {ref!r:.60}, expected a non-empty list of strings")
    if not all(isinstance(r, str) for r in ref):
      raise ValueError(f"refs: element {i} holds a non-string reference")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  """RULER's ``string_match_all`` (``scripts/eval/synthetic/constants.py``): the fraction of each
  example's references found in its prediction (case-insensitive substrings), averaged, in
  percent rounded to 2 decimals.

  Args:
    preds: one predicted text per example.
    refs: each example's references (RULER's ``outputs``).

  Returns:
    The score in [0, 100].

  Raises:
    ValueError: for ``preds`` that are not texts, or ``refs`` that are not one non-empty list of
      strings per prediction.
  """
  _check_match(preds, refs)
  score = (
    sum(
      sum(1.0 if r.lower() in pred.lower() else 0.0 for r in ref) / len(ref)
      for pred, ref in zip(preds, refs, strict=True)
    )
    / len(preds)
    * 100
  )
  return round(score, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  """RULER's ``string_match_part`` (``scripts/eval/synthetic/constants.py``, its QA metric): 1
  for an example when any of its references is in its prediction (case-insensitive), averaged,
  in percent rounded to 2 decimals.

  Args:
    preds: one predicted text per example.
    refs: each example's references.

  Returns:
    The score in [0, 100].

  Raises:
    ValueError: as :func:`string_match_all`.
  """
  _check_match(preds, refs)
  score = (
    sum(
      max(1.0 if r.lower() in pred.lower() else 0.0 for r in ref)
      for pred, ref in zip(preds, refs, strict=True)
    )
    / len(preds)
    * 100
  )
  return round(score, 2)


# scripts/eval/synthetic/constants.py: every synthetic task is scored with string_match_all
METRICS = {task: string_match_all for task in TASKS}


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
  """A task's RULER score of generated texts: :func:`postprocess_pred`, then the task's metric
  (:data:`METRICS`), as RULER's ``scripts/eval/evaluate.py`` does.

  Args:
    task: one of :data:`TASKS`.
    predictions: one generated text per example.
    references: each example's outputs (:attr:`RulerSample.outputs`).

  Returns:
    The score in [0, 100].

  Raises:
    ValueError: for an unknown ``task``, or as :func:`string_match_all`.
  """
  if task not in TASKS:
    raise ValueError(f"task: {task!r} is not one of {TASKS}")
  _check_match(predictions, references)
  return METRICS[task]([postprocess_pred(p) for p in predictions], references)
