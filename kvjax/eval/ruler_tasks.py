"""RULER's task generators (:mod:`kvjax.eval.ruler`): each task's definition (:data:`TASKS`,
:data:`TEMPLATES`, :data:`DEFAULTS`) and its text before the haystack is sized (:class:`Task`,
one builder per kind in :data:`BUILD`), following ``scripts/data/synthetic``'s ``niah.py``,
``variable_tracking.py``, ``common_words_extraction.py`` and ``freq_words_extraction.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import random
import string
from collections.abc import Iterator, Sequence

import numpy as np
from scipy.special import zeta

from kvjax.eval.ruler_haystacks import (
  DEPTHS,
  NEEDLE,
  NOISE,
  Needle,
  Place,
  distinct,
  essay_units,
  fill,
  nearest,
  random_value,
  repeat,
  uniform_slots,
  word_lists,
)

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


@functools.cache
def _cwe_words() -> tuple[str, ...]:
  # common_words_extraction.py: the three lists, deduplicated, sorted, shuffled with its seed 42
  lists = word_lists()
  words = sorted(set(lists["nouns"] + lists["adjectives"] + lists["verbs"]))
  random.Random(42).shuffle(words)
  return tuple(words)


def _split(full: str, kind: str, **fields) -> tuple[str, str, str]:
  """``(header, question, answer prefix)`` of a template (with its answer prefix) formatted
  around its context; the newline between the context and the question is a piece boundary."""
  text = full.format(context="\x00", **fields)
  header, rest = text.split("\x00")
  cut = rest.rfind(TEMPLATES[kind][1][:10])  # as RULER finds its answer prefix
  return header, rest[:cut].lstrip("\n"), rest[cut:]


@dataclasses.dataclass
class Task:
  """A task's text before the haystack is sized.

  Attributes:
    before: pieces before the context: worked examples, the header.
    units: the haystack's units.
    needles: the needles, the asked one first.
    place: where the needles go (:func:`kvjax.eval.ruler_haystacks.fill`).
    header: the template's part before the context.
    question: its part after the context.
    answer_prefix: RULER's answer prefix.
    items: the answer's scored items.
    given: a given piece before each item (``""`` for none).
    scoring: the answer's scoring (:class:`kvjax.eval.tasks.Example`).
    queries: several asked keys, each as its own ``(question, answer prefix, outputs)``.
  """

  before: list[str]  # pieces before the context: worked examples, the header
  units: Iterator[str]
  needles: list[Needle]
  place: Place
  header: str
  question: str
  answer_prefix: str
  items: list[str]  # the answer's scored items
  given: list[str]  # a given piece before each item ("" for none)
  scoring: str
  # several asked keys, each as its own (question, answer prefix, outputs)
  queries: list[tuple[str, str, list[str]]] = dataclasses.field(default_factory=list)


def _niah(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> Task:
  """niah.py's generate_input_output."""
  del enc, length
  k_type, v_type, haystack = opts["type_needle_k"], opts["type_needle_v"], opts["type_haystack"]
  num_v, num_q = opts["num_needle_v"], opts["num_needle_q"]
  num_k = max(opts["num_needle_k"], num_q)
  taken: set[str] = set()
  keys = distinct(rng, k_type, num_k, taken)
  values = [distinct(rng, v_type, num_v, set()) for _ in keys]
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
    Needle(NEEDLE.format(type_needle_v=v_type, key=k, value=v) + end, v)
    for k, v in [first, *others]
  ]
  if haystack == "noise":
    units = repeat(NOISE + "\n")
  elif haystack == "essay":
    units = essay_units()
  else:

    def distractors():
      while True:
        (k,) = distinct(rng, k_type, 1, taken)
        value = random_value(rng, v_type)
        yield NEEDLE.format(type_needle_v=v_type, key=k, value=value) + "\n"

    units = distractors()
  grid = [d / 100 for d in rng.sample(DEPTHS, len(needles))] if haystack == "essay" else None

  def place(num_units: int, bounds: np.ndarray) -> list[int]:
    if grid is not None:  # essays: depths from RULER's 40-point grid, at sentence boundaries
      slots = [nearest(bounds, f) for f in grid]
    else:
      slots = uniform_slots(rng, num_units, len(needles))
    if depth is not None:
      slots[0] = nearest(bounds, depth)
    return slots

  header, question, answer_prefix = _niah_text(v_type, num_q * num_v, query)
  # each asked key alone, after the same header and context: only the question's wording
  # (niah.py's for num_q = 1) differs
  queries = [_niah_text(v_type, num_v, keys[i])[1:] + (values[i],) for i in asked]
  return Task(
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
    needles = [Needle(line + "\n", line.split()[1]) for line in lines]
    units = repeat(NOISE + "\n")

    def place(num_units: int, bounds: np.ndarray) -> list[int]:
      slots = []
      for c, (_, chain) in enumerate(chains):
        these = sorted(uniform_slots(rng, num_units, len(chain)))
        if c == 0 and depth is not None:  # the chain keeps its order: depth takes one line
          these = sorted(these[1:] + [nearest(bounds, depth)])
        slots += these
      return slots

  else:
    lines = _interleave(rng, [chain for _, chain in chains])
    needles = [Needle(line.strip() + ".", line.split()[1]) for line in lines]
    units = essay_units()
    grid = sorted(d / 100 for d in rng.sample(DEPTHS, len(needles)))
    if depth is not None:
      grid = sorted(grid[1:] + [depth])

    def place(num_units: int, bounds: np.ndarray) -> list[int]:
      del num_units
      return [nearest(bounds, f) for f in grid]

  template, prefix = TEMPLATES["variable_tracking"]
  header, question, answer_prefix = _split(
    template + prefix, "variable_tracking", query=value, num_v=num_hops + 1
  )
  return names, needles, units, place, header, question, answer_prefix


def _vt(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> Task:
  """variable_tracking.py: one worked example of at most 500 tokens (3-letter names, its answer
  given), a newline, then the task."""
  del length
  shown = _vt_text(rng, opts, None, icl=True)
  # the task's chains are drawn before the worked example is sized (which depends on the
  # tokenizer), so that its answer is the same through every tokenizer
  names, needles, units, place, header, question, prefix = _vt_text(rng, opts, depth, icl=False)
  after = [shown[5], shown[6].strip()]
  room = ICL_LENGTH - enc.total([shown[4], *after])
  ids, _, _ = fill(enc, room, shown[2], shown[1], shown[3], whole=True)
  worked = [shown[4], tuple(ids), *after, " ".join(shown[0]) + "\n\n"]
  return Task(
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


def _cwe(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> Task:
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
  return Task(
    before, iter(_numbered(word_list)), [], lambda n, b: [], header, question, answer_prefix,
    common, [f"{i + 1}." for i in range(len(common))], "set",
  )  # fmt: skip


def _fwe(opts: dict, rng: random.Random, depth: float | None, enc, length: int) -> Task:
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
  return Task(
    [header.rstrip(" ")], iter(text), [], lambda n, b: [], header, question, answer_prefix,
    words[1:4], [""] * 3, "set",
  )  # fmt: skip


# each kind's builder: (options, generator, depth, piece tokenizer, length) -> Task
BUILD = {
  "niah": _niah,
  "variable_tracking": _vt,
  "common_words_extraction": _cwe,
  "freq_words_extraction": _fwe,
}
