"""Tokenizers: the tiny model's word vocabulary and any Hugging Face ``tokenizer.json``.

Both encode text pieces without special tokens, so that task prompts are exact in tokens
whichever tokenizer is used (:mod:`kvjax.eval.tasks`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from tokenizers import Tokenizer

# the word tokenizer's special words (their ids are the first four of the tiny vocabulary)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class WordTokenizer:
  """Whitespace word-level tokenizer over a fixed vocabulary (unknown words raise)."""

  def __init__(self, vocab: Sequence[str]):
    self.vocab = list(vocab)
    self.ids = {w: i for i, w in enumerate(self.vocab)}
    if len(self.ids) != len(self.vocab):
      raise ValueError("vocab: duplicate words")
    self.pad_id, self.bos_id, self.eos_id = self.ids["<pad>"], self.ids["<bos>"], self.ids["<eos>"]

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, text: str) -> list[int]:
    try:
      return [self.ids[w] for w in text.split()]
    except KeyError as e:
      raise ValueError(f"text: word {e.args[0]!r} is not in the vocabulary") from None

  def decode(self, ids) -> str:
    return " ".join(self.vocab[int(i)] for i in ids)

  def to_json(self) -> dict:
    """A Hugging Face ``tokenizers`` WordLevel file (loadable by ``HFTokenizer`` as well)."""
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
    pathlib.Path(path).write_text(json.dumps(self.to_json()))

  @classmethod
  def load(cls, path: str | pathlib.Path) -> WordTokenizer:
    vocab = json.loads(pathlib.Path(path).read_text())["model"]["vocab"]
    return cls(sorted(vocab, key=vocab.get))


class HFTokenizer:
  """Any Hugging Face ``tokenizer.json`` (``tokenizers`` package), e.g. Llama 3 or Qwen 2.5.

  Pieces are encoded with a leading space and without special tokens, so that concatenated pieces
  read like the joined text; ``bos_id`` is the tokenizer's ``bos_token`` when it has one.
  """

  def __init__(self, path: str | pathlib.Path, bos_token: str | None = None):
    self.tok = Tokenizer.from_file(str(path))
    self.vocab_size = self.tok.get_vocab_size()
    self.bos_id = self.tok.token_to_id(bos_token) if bos_token else None
    if bos_token and self.bos_id is None:
      raise ValueError(f"bos_token: {bos_token!r} is not in the vocabulary of {path}")
    # padding only fills unscored answer slots (never attended: prompts are unpadded)
    self.pad_id = self.bos_id if self.bos_id is not None else 0

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(" " + text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.tok.decode([int(i) for i in ids])
