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

The tasks' definitions and generators live in :mod:`kvjax.eval.ruler_tasks`, the haystacks and
the needles' placement in :mod:`kvjax.eval.ruler_haystacks`; this module samples and scores, and
re-exports both.

Kept as RULER has them: ``cwe``'s question says "10 most common words" whatever ``num_cw`` is,
and below 4096 tokens its counts are the short regime's (6 and 1, after a worked example of 20
words) whatever ``freq_cw`` and ``freq_ucw`` are.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence

import numpy as np

from kvjax.eval import tasks

# The haystacks and the task generators live beside this module; ruler.X reaches every part.
from kvjax.eval.ruler_haystacks import (  # noqa: F401
  DEPTHS,
  NEEDLE,
  NOISE,
  TEXT_SOURCE,
  Encoder,
  essay_sentences,
  fill,
  word_lists,
)
from kvjax.eval.ruler_tasks import (  # noqa: F401
  BUILD,
  DEFAULTS,
  DEPTHLESS,
  HAYSTACKS,
  ICL_LENGTH,
  KIND,
  NEEDLE_TYPES,
  SHORT,
  TASKS,
  TEMPLATES,
  TOKENS_TO_GENERATE,
)

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
  """How many distinct values :func:`kvjax.eval.ruler_haystacks.random_value` draws of
  ``kind``."""
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
  enc = Encoder(tokenizer)
  t = BUILD[KIND[task]](opts, rng, depth, enc, length)

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
  context, starts, first = fill(enc, room, t.units, t.needles, t.place)
  prompt = np.asarray(head + context + tail, np.int32)
  assert prompt.size == length, (prompt.size, length)

  parts = [  # each item's given text (if any) before the item itself
    (i, text, is_given)
    for i, (item, before) in enumerate(zip(t.items, t.given, strict=True))
    for text, is_given in ((before, True), (item, False))
    if text
  ]
  at = sorted(range(len(starts)), key=starts.__getitem__)
  example = tasks.Example(
    task=task,
    prompt=prompt,
    **tasks.answer_fields(enc, parts),
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
