"""The tiny model's word vocabulary: specials, punctuation, template and filler words, keys, values.

The task texts of :mod:`kvjax.eval.tasks` are written over these words, so that every word is one
token of :class:`kvjax.model.tokenizer.WordTokenizer` (and several of a real model's tokenizer).
"""

from __future__ import annotations

import numpy as np

from kvjax.model.tokenizer import SPECIALS, WordTokenizer

PUNCT = (".", ",", "?", ":", "=")


def _words(text: str) -> tuple[str, ...]:
  """The whitespace-separated words of ``text``, in order (a word list written as prose)."""
  return tuple(text.split())


# the task templates' words (kvjax.eval.tasks), in vocabulary order
TEMPLATE_WORDS = _words(
  """
  the special magic number numbers for is are what all and pass key remember it answer var
  find variables that assigned value in text above they questions document grass sky sun
  here we go there back again
  """
)
# the haystack sentences' words, in vocabulary order: determiners, adjectives, nouns, verbs,
# prepositions and conjunctions, adverbs, then more nouns
FILLER = _words(
  """
  a an this every some many few old new small large quiet loud bright dark warm cold early late
  red blue green yellow happy tired busy calm swift slow
  cat dog bird horse river mountain city village garden forest ocean window door table chair
  book letter song story road bridge tower farmer teacher doctor sailor baker painter child
  friend king queen soldier merchant
  walks runs sees finds builds paints reads writes sings carries follows watches visits opens
  closes keeps holds brings sends meets helps
  near under over beside behind through across with without from into after before during
  while because but or so then
  often never always sometimes today yesterday tomorrow morning evening night winter summer
  spring autumn rain snow wind stone wood gold silver bread milk apple water fire light shadow
  """
)
_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u"]


def _key_words() -> tuple[str, ...]:
  """64 made-up two-syllable names (``bako``, ``dimu``...), disjoint from every other word."""
  taken = set(TEMPLATE_WORDS) | set(FILLER)
  words = []
  for i in range(len(_ONSETS) ** 2 * len(_VOWELS) ** 2):
    a, rest = divmod(i, len(_VOWELS) * len(_ONSETS) * len(_VOWELS))
    b, rest = divmod(rest, len(_ONSETS) * len(_VOWELS))
    c, d = divmod(rest, len(_VOWELS))
    w = _ONSETS[a] + _VOWELS[b] + _ONSETS[c] + _VOWELS[d]
    if w not in taken:
      words.append(w)
  rng = np.random.default_rng(1234)  # a fixed spread over onsets, not alphabetical runs
  return tuple(sorted(rng.choice(words, 64, replace=False).tolist()))


KEYS = _key_words()
VALUES = tuple(str(v) for v in range(10, 100))


def tiny_vocabulary() -> list[str]:
  """The tiny model's vocabulary: specials, punctuation, template and filler words, keys, values."""
  return [*SPECIALS, *PUNCT, *TEMPLATE_WORDS, *FILLER, *KEYS, *VALUES]


def tiny_tokenizer() -> WordTokenizer:
  return WordTokenizer(tiny_vocabulary())
