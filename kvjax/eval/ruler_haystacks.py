"""RULER's haystacks and needles (:mod:`kvjax.eval.ruler`): the shipped text, the random keys
and values, and a context of an exact number of tokens with needles placed in it.

* :func:`essay_sentences`, :func:`word_lists`: the essay haystack and ``wonderwords``' lists,
  shipped in ``kvjax/assets/ruler`` (:data:`TEXT_SOURCE`);
* :func:`random_value`, :func:`distinct`: ``niah.py``'s keys and values;
* :class:`Encoder`, :func:`fill`: pieces tokenised one at a time, and the haystack sized to a
  token count with each :class:`Needle` before the unit of its slot.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import random
import re
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np

# niah.py's needle and noise haystack
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))

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


# --------------------------------------------------------------------------- needles in a haystack


@dataclasses.dataclass(frozen=True)
class Needle:
  """A needle: a line (or sentence) put into the haystack whole.

  Attributes:
    text: RULER's text, ending in the newline RULER joins lines with where it does.
    mark: the part of it whose prompt position ``needle_at`` records.
  """

  text: str  # RULER's text, ending in the newline RULER joins lines with where it does
  mark: str  # the part of it whose prompt position ``needle_at`` records


# (number of units, their token boundaries [units + 1]) -> one slot (a boundary) per needle
Place = Callable[[int, np.ndarray], list[int]]


class Encoder:
  """The tokenizer's ``encode`` of one piece at a time, memoised (haystacks repeat pieces)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.memo = tokenizer, {}

  def __call__(self, text: str | tuple[int, ...]) -> list[int]:
    """The ids of one piece.

    Args:
      text: a text piece, or a piece already in ids (a worked example's context).

    Returns:
      Its token ids.

    Raises:
      ValueError: naming the tokenizer, when it cannot spell the piece.
    """
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
    """The tokens of ``pieces``, each tokenised alone.

    Args:
      pieces: text pieces (or pieces in ids).

    Returns:
      Their tokens' count.
    """
    return sum(len(self(p)) for p in pieces)


def nearest(bounds: np.ndarray, fraction: float) -> int:
  """The unit boundary nearest a fraction of the haystack's tokens.

  Args:
    bounds: the units' token boundaries ``[units + 1]``.
    fraction: a depth in ``[0, 1]``.

  Returns:
    The boundary's index (a slot).
  """
  return int(np.argmin(np.abs(bounds - fraction * bounds[-1])))


def fill(
  enc: Encoder,
  room: int,
  units: Iterator[str],
  needles: Sequence[Needle],
  place: Place,
  *,
  whole: bool = False,
) -> tuple[list[int], list[int], float]:
  """``(ids, needle starts, depth of the first needle)`` of a context of ``room`` tokens.

  Units are drawn until they fill ``room`` tokens less the needles', the last one cut to fit
  (``whole``: only whole units, at most ``room``); then each needle goes before the unit of its
  slot, needles of one slot in their order.

  Args:
    enc: the piece tokenizer.
    room: the context's tokens.
    units: the haystack's units (text pieces).
    needles: the needles.
    place: ``(number of units, their token boundaries) -> one slot per needle``.
    whole: only whole units.

  Returns:
    ``(ids, needle starts, depth of the first needle)`` (nan without needles).

  Raises:
    ValueError: naming ``length``, when the units run out first.
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


def random_value(rng: random.Random, kind: str) -> str:
  """One key or value (``niah.py``'s ``generate_random``).

  Args:
    rng: the example's generator.
    kind: one of ``numbers`` (7 digits), ``uuids``, ``words`` (adjective-noun).

  Returns:
    The value.
  """
  if kind == "numbers":
    return str(rng.randint(10**6, 10**7 - 1))
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  lists = word_lists()
  return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"


def distinct(rng: random.Random, kind: str, n: int, taken: set[str]) -> list[str]:
  """``n`` values of ``kind`` not in ``taken`` (which gains them).

  Args:
    rng: the example's generator.
    kind: as :func:`random_value`.
    n: how many.
    taken: the values already drawn.

  Returns:
    The values, in draw order.
  """
  out: list[str] = []
  while len(out) < n:
    v = random_value(rng, kind)
    if v not in taken:
      taken.add(v)
      out.append(v)
  return out


def essay_units() -> Iterator[str]:
  """The essay haystack's sentences, without end.

  Returns:
    An iterator of sentences.
  """
  while True:  # past its end the text repeats from its start, as RULER's essays do
    yield from essay_sentences()


def repeat(text: str) -> Iterator[str]:
  """A haystack of one repeated unit (the noise haystack).

  Args:
    text: the unit.

  Returns:
    An iterator of ``text``, without end.
  """
  while True:
    yield text


def uniform_slots(rng: random.Random, num_units: int, n: int) -> list[int]:
  """RULER's placement of needles in line haystacks (``niah.py``, ``variable_tracking.py``):
  before distinct, uniformly drawn lines (drawn with repeats when the lines are fewer).

  Args:
    rng: the example's generator.
    num_units: the haystack's lines.
    n: the needles.

  Returns:
    One slot per needle.
  """
  if num_units >= n:
    return rng.sample(range(num_units), n)
  return sorted(rng.choices(range(num_units + 1), k=n))
