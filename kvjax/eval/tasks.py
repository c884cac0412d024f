"""Seeded RULER-style long-context tasks: text templates, two tokenisations, exact scoring.

Each generator writes a haystack of random sentences, hides needles at chosen depths and asks a
question; it returns an :class:`Example` of token ids. Following RULER (Hsieh et al., 2024,
``scripts/data/synthetic``) the tasks are:

* ``passkey``: one pass key in the haystack (RULER's ``niah_single_1`` passkey template).
* ``single_needle``: one "special magic number for KEY" needle (``niah_single_2``).
* ``multi_key``: the needle among ``num_distractors`` needles with other keys (``niah_multikey``).
* ``multi_value``: ``num_values`` needles for the same key; all values asked for (``niah_multivalue``).
* ``multi_query``: ``num_queries`` of ``num_pairs`` keys asked for at once (``niah_multiquery``).
* ``variable_tracking``: a chain of ``num_hops`` assignments ``var X = Y``; the variables holding
  the value are asked for (``vt``).
* ``mqar``: multi-query associative recall (Arora et al., 2023, Zoology): ``num_pairs`` needles,
  then ``num_queries`` queries ``KEY is VALUE .`` whose keys are given and whose values are scored
  (dense teacher-forced supervision; the prompt ends at the first query).

Named deviations from RULER: values are two-digit numbers and keys one of 64 made-up names (one
token each in the tiny model's word vocabulary, small enough for a model trained in minutes on a
CPU; RULER uses seven-digit numbers and UUIDs or words); the haystack is random sentences over a small word list
(RULER's "noise" haystack repeats one paragraph, its "essay" haystack is Paul Graham essays, which
we may not download); ``multi_value`` and ``multi_query`` are scored as sets (every value present,
in any order: ``scoring="set"``) as in RULER, the others in order (``scoring="exact"``), which for
``variable_tracking`` is stricter than RULER's set of variable names (the chain order is the
natural order to list them and what the tiny model learns).

Two tokenisations: :class:`WordTokenizer` (the tiny model's whitespace word vocabulary, stored as a
Hugging Face ``WordLevel`` ``tokenizer.json``) and :class:`HFTokenizer` (any ``tokenizer.json``
through the ``tokenizers`` package, for real models). Text pieces are tokenised one at a time, so
lengths are exact in tokens whichever tokenizer is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.eval.vocab import FILLER, KEYS, VALUES

TASKS = (
  "passkey",
  "single_needle",
  "multi_key",
  "multi_value",
  "multi_query",
  "variable_tracking",
  "mqar",
)

# the sizes the tiny model is evaluated (and its card measured) at
EVAL_OPTIONS = {
  "passkey": {},
  "single_needle": {},
  "multi_key": {"num_distractors": 3},
  "multi_value": {"num_values": 4},
  "multi_query": {"num_pairs": 8, "num_queries": 4},
  "variable_tracking": {"num_hops": 4},
  "mqar": {"num_pairs": 16, "num_queries": 8},
}
# every option of :func:`generate` with its default; each task reads its own (the module's
# docstring names which) and leaves the others unread
OPTIONS = {"num_distractors": 3, "num_values": 4, "num_queries": 4, "num_pairs": 8, "num_hops": 4}

# --------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Example:
  """A prompt and its answer, as token ids.

  ``answer_given[i]`` marks answer tokens that are part of the question (mqar's query keys): they
  are fed, never scored. ``scoring`` is ``"exact"`` (every scored token, in order) or ``"set"``
  (the scored tokens as a multiset, any order). ``needle_at`` are the prompt indices of each
  needle's answer token(s) (for analysis), ``depth`` the requested depth, ``question_len`` the
  number of trailing prompt tokens that form the question.
  """

  task: str
  prompt: np.ndarray  # [T] int32
  answer: np.ndarray  # [N] int32
  answer_given: np.ndarray  # [N] bool
  answer_piece: np.ndarray  # [N] int: which answer value each token belongs to
  scoring: str
  depth: float
  needle_at: tuple[int, ...]
  question_len: int = 1  # the prompt's last ``question_len`` tokens are the question


def answer_fields(enc, parts) -> dict[str, np.ndarray]:
  """An :class:`Example`'s answer arrays from its texts, each text encoded on its own.

  Args:
    enc: a text's token ids (a tokenizer's ``encode``).
    parts: ``(piece, text, given)`` triples in answer order: the answer item the text belongs
      to and whether its tokens are given (fed, never scored).

  Returns:
    ``answer`` (int32), ``answer_given`` (bool) and ``answer_piece`` (int32), ``[N]`` each: the
    keyword arguments of :class:`Example`.
  """
  answer, given, piece = [], [], []
  for i, text, is_given in parts:
    ids = enc(text)
    answer += ids
    given += [is_given] * len(ids)
    piece += [i] * len(ids)
  return {
    "answer": np.asarray(answer, np.int32),
    "answer_given": np.asarray(given, bool),
    "answer_piece": np.asarray(piece, np.int32),
  }


def _scored(example: Example, predicted) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The reference and predicted tokens at the scored answer positions, and the answer item
  (value) each position belongs to."""
  predicted = np.asarray(predicted)
  if predicted.shape != example.answer.shape:
    raise ValueError(
      f"predicted: shape {predicted.shape}, expected the answer's {example.answer.shape}"
    )
  scored = ~example.answer_given
  return example.answer[scored], predicted[scored], example.answer_piece[scored]


def _items(tokens: np.ndarray, pieces: np.ndarray) -> list[tuple[int, ...]]:
  """Each answer item as the tuple of its tokens (multi-token values under BPE tokenizers)."""
  return [tuple(tokens[pieces == p].tolist()) for p in np.unique(pieces)]


def score(example: Example, predicted: np.ndarray) -> bool:
  """The task's exact rule over the predicted tokens at the answer's positions (``[N]``)."""
  want, got, pieces = _scored(example, predicted)
  if example.scoring == "exact":
    return bool(np.array_equal(want, got))
  # a set of values, compared value by value so that multi-token values cannot mix
  return sorted(_items(want, pieces)) == sorted(_items(got, pieces))


def recall(example: Example, predicted: np.ndarray) -> float:
  """RULER's ``string_match_all`` for one example: the fraction of the answer's items found in
  the prediction, in any order and whatever else it holds (partial credit, where :func:`score`
  is all or nothing). An item is one value (its tokens, contiguous) and the prediction is the
  scored tokens at the answer's positions; RULER matches substrings of up to 128 generated
  tokens, this looks only at the answer's own length."""
  want, got, pieces = _scored(example, predicted)
  got = tuple(got.tolist())
  found = [
    any(got[i : i + len(t)] == t for i in range(len(got) - len(t) + 1))
    for t in _items(want, pieces)
  ]
  return float(np.mean(found))


# --------------------------------------------------------------------------- text pieces


def _sentence(rng: np.random.Generator) -> str:
  n = int(rng.integers(4, 9))
  return " ".join(rng.choice(FILLER, n).tolist()) + " ."


def haystack_ids(tokenizer, num_tokens: int, *, seed: int = 0) -> list[int]:
  """``num_tokens`` ids of the tasks' haystack alone (random filler sentences, no needle)."""
  rng = np.random.default_rng(seed)
  ids: list[int] = []
  while len(ids) < num_tokens:
    ids += tokenizer.encode(_sentence(rng))
  return ids[:num_tokens]


def _needle(key: str, value: str) -> str:
  return f"the special magic number for {key} is {value} ."


def _draw(rng, pool, n, name: str = "count") -> list[str]:
  if n > len(pool):
    raise ValueError(f"{name}: {n} distinct items asked from a pool of {len(pool)}")
  return rng.choice(pool, n, replace=False).tolist()


@dataclasses.dataclass
class _Spec:
  needles: list[str]  # inserted in order at ``depths``
  depths: list[float]
  question: str
  answer: list[str]  # answer pieces (words for the tiny vocabulary)
  given: list[bool]
  scoring: str
  answer_words: list[str]  # the word of each needle whose position is recorded


def _spec(task, rng, depth, num_distractors, num_values, num_queries, num_pairs, num_hops):
  spread = lambda n: sorted(rng.uniform(0.0, 1.0, n).tolist())  # noqa: E731
  if task == "passkey":
    (v,) = _draw(rng, VALUES, 1)
    return _Spec(
      [f"the pass key is {v} . remember it . {v} is the pass key ."],
      [depth],
      "what is the pass key ? the pass key is",
      [v],
      [False],
      "exact",
      [v],
    )
  if task in ("single_needle", "multi_key"):
    n = 1 + (num_distractors if task == "multi_key" else 0)
    keys, vals = _draw(rng, KEYS, n, "num_distractors"), _draw(rng, VALUES, n, "num_distractors")
    others = spread(n - 1)
    depths = sorted([depth, *others])
    order = [0] + list(range(1, n))  # the asked needle sits at ``depth``; distractors anywhere
    at = depths.index(depth)
    order = order[1 : at + 1] + [0] + order[at + 1 :]
    needles = [_needle(keys[i], vals[i]) for i in order]
    q = (
      f"what is the special magic number for {keys[0]} ? the special magic number for {keys[0]} is"
    )
    return _Spec(needles, depths, q, [vals[0]], [False], "exact", [vals[i] for i in order])
  if task == "multi_value":
    (key,) = _draw(rng, KEYS, 1)
    vals = _draw(rng, VALUES, num_values, "num_values")
    depths = sorted([depth, *spread(num_values - 1)])
    q = (
      f"what are all the special magic numbers for {key} ? the special magic numbers for {key} are"
    )
    return _Spec(
      [_needle(key, v) for v in vals], depths, q, vals, [False] * num_values, "set", vals
    )
  if task in ("multi_query", "mqar"):
    if num_queries > num_pairs:
      raise ValueError(f"num_queries: {num_queries} > num_pairs {num_pairs}")
    keys, vals = (
      _draw(rng, KEYS, num_pairs, "num_pairs"),
      _draw(rng, VALUES, num_pairs, "num_pairs"),
    )
    depths = sorted([depth, *spread(num_pairs - 1)])
    asked = rng.permutation(num_pairs)[:num_queries].tolist()
    needles = [_needle(k, v) for k, v in zip(keys, vals, strict=False)]
    if task == "multi_query":
      listed = " , ".join(keys[i] for i in asked)
      q = (
        f"what are the special magic numbers for {listed} ? "
        f"the special magic numbers for {listed} are"
      )
      ans = [vals[i] for i in asked]
      return _Spec(needles, depths, q, ans, [False] * len(ans), "set", vals)
    ans, given = [], []
    for j, i in enumerate(asked):
      if j:
        ans += [".", keys[i], "is"]
        given += [True, True, True]
      ans.append(vals[i])
      given.append(False)
    q = f"answer the questions . {keys[asked[0]]} is"
    return _Spec(needles, depths, q, ans, given, "exact", vals)
  if task == "variable_tracking":
    names = _draw(rng, KEYS, num_hops, "num_hops")
    (v,) = _draw(rng, VALUES, 1)
    chain = [f"var {names[0]} = {v} ."] + [
      f"var {names[i]} = {names[i - 1]} ." for i in range(1, num_hops)
    ]
    depths = sorted([depth, *spread(num_hops - 1)])
    q = f"find all variables that are assigned the value {v} in the text above . they are :"
    return _Spec(chain, depths, q, names, [False] * num_hops, "exact", names)
  raise ValueError(f"task: {task!r} is not one of {TASKS}")


def generate(
  task: str, tokenizer, *, length: int, seed: int, depth: float | None = None, **options
) -> Example:
  """One example of ``task`` whose prompt is exactly ``length`` tokens (``bos`` included).

  ``depth`` in [0, 1] is where one needle sits, as a fraction of the haystack (uniform at random
  when ``None``): the asked one for ``passkey``, ``single_needle`` and ``multi_key``; for the
  tasks with several needles (values, pairs, a chain) the others are drawn uniformly and all are
  placed in sorted order, so ``depth`` places whichever needle sorts there. Deterministic in
  ``seed``.

  Args:
    task: one of :data:`TASKS`.
    tokenizer: the tokenizer the prompt is written in.
    length: the prompt's tokens.
    seed: the example's seed.
    depth: the needle's depth, or ``None``.
    **options: the task's counts (:data:`OPTIONS`, their defaults): ``num_distractors``
      (``multi_key``), ``num_values`` (``multi_value``), ``num_pairs`` and ``num_queries``
      (``multi_query``, ``mqar``), ``num_hops`` (``variable_tracking``).

  Returns:
    The :class:`Example`.

  Raises:
    ValueError: for an unknown task or option, a depth outside [0, 1], a count below its
      minimum (0 distractors, 1 of the others), more of a kind than can be drawn, or a
      ``length`` too short for the needles and the question.
  """
  if task not in TASKS:
    raise ValueError(f"task: {task!r} is not one of {TASKS}")
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
  unknown = sorted(set(options) - set(OPTIONS))
  if unknown:
    raise ValueError(f"options: {unknown} are not task options; expected some of {list(OPTIONS)}")
  opts = OPTIONS | options
  for name, val in opts.items():
    if val < (0 if name == "num_distractors" else 1):
      raise ValueError(f"{name}: expected a count >= {int(name != 'num_distractors')}, got {val}")
  rng = np.random.default_rng([seed, TASKS.index(task)])
  d = float(rng.uniform()) if depth is None else float(depth)
  spec = _spec(task, rng, d, **opts)

  enc = tokenizer.encode
  head = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
  needles = [enc(n) for n in spec.needles]
  question = enc(spec.question)
  fixed = len(head) + sum(map(len, needles)) + len(question)
  room = length - fixed
  if room < 0:
    raise ValueError(
      f"length: {length} tokens cannot hold the needles and question of {task!r} ({fixed} tokens)"
    )
  # haystack sentences up to exactly ``room`` tokens (the last one cut to fit)
  hay: list[list[int]] = []
  total = 0
  while total < room:
    s = enc(_sentence(rng))[: room - total]
    hay.append(s)
    total += len(s)
  # needles go between sentences, at the sentence boundary nearest their depth
  bounds = np.cumsum([0] + [len(s) for s in hay])
  slots = [int(np.argmin(np.abs(bounds - dd * total))) for dd in spec.depths]
  pieces: list[list[int]] = [head]
  needle_at: list[int] = []
  pos = len(head)
  ni = 0
  for si in range(len(hay) + 1):
    while ni < len(needles) and slots[ni] == si:
      word_ids = enc(spec.answer_words[ni])
      offset = _find(needles[ni], word_ids)
      needle_at.append(pos + offset)
      pieces.append(needles[ni])
      pos += len(needles[ni])
      ni += 1
    if si < len(hay):
      pieces.append(hay[si])
      pos += len(hay[si])
  pieces.append(question)
  prompt = np.asarray([t for p in pieces for t in p], np.int32)
  assert prompt.size == length, (prompt.size, length)

  parts = enumerate(zip(spec.answer, spec.given, strict=True))
  return Example(
    task=task,
    prompt=prompt,
    **answer_fields(enc, ((i, w, g) for i, (w, g) in parts)),
    scoring=spec.scoring,
    depth=d,
    needle_at=tuple(needle_at),
    question_len=len(question),
  )


def _find(haystack: list[int], needle: list[int]) -> int:
  for i in range(len(haystack) - len(needle) + 1):
    if haystack[i : i + len(needle)] == needle:
      return i
  raise AssertionError("answer word not found in its needle")


def batch(examples: Sequence[Example], pad_id: int = 0, answer_len: int | None = None):
  """Stacks same-length prompts (``[B, T]``) and right-pads answers (``[B, N]`` plus a mask of
  the scored positions) to the longest answer, or to ``answer_len``."""
  lengths = {e.prompt.size for e in examples}
  if len(lengths) != 1:
    raise ValueError(f"examples: prompts of different lengths {sorted(lengths)}")
  N = max(e.answer.size for e in examples)
  if answer_len is not None:
    if answer_len < N:
      raise ValueError(f"answer_len: {answer_len} is shorter than the longest answer ({N})")
    N = answer_len
  prompts = np.stack([e.prompt for e in examples])
  answers = np.full((len(examples), N), pad_id, np.int32)
  scored = np.zeros((len(examples), N), bool)
  for i, e in enumerate(examples):
    answers[i, : e.answer.size] = e.answer
    scored[i, : e.answer.size] = ~e.answer_given
  return prompts, answers, scored
