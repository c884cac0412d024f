"""Tokenizers: the tiny model's word vocabulary, any Hugging Face ``tokenizer.json``, and real
models' tokenizers rebuilt from GGUF metadata (:func:`load_tokenizer`, as ``transformers`` does).

All encode text pieces without special tokens, so that task prompts are exact in tokens
whichever tokenizer is used (:mod:`kvjax.eval.tasks`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from tokenizers import Regex, Tokenizer

from kvjax.model import gguf
from kvjax.model.assets import SMOLLM2, smollm2_path

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
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < len(self.vocab)]
    if bad:
      raise ValueError(f"ids: token id {bad[0]} is outside the vocabulary [0, {len(self.vocab)})")
    return " ".join(self.vocab[i] for i in ids)

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


# --------------------------------------------------------------------------- real models' tokenizers


class ModelTokenizer:
  """A real model's tokenizer (a ``tokenizers.Tokenizer``) with its special ids.

  ``encode`` adds no special tokens and no leading space: the ids are those of ``transformers``'
  ``AutoTokenizer`` ``encode(text, add_special_tokens=False)`` for the same file. ``decode``
  keeps special tokens (``transformers``' default). ``pad_id`` is the file's padding token, else
  its ``eos_id``, else 0.
  """

  def __init__(self, tok: Tokenizer, *, bos_id=None, eos_id=None, pad_id=None, source: str = ""):
    self.tok, self.source = tok, source
    self.bos_id, self.eos_id = bos_id, eos_id
    self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def token(self, i: int) -> str:
    return self.tok.id_to_token(int(i))

  def __repr__(self) -> str:
    return f"ModelTokenizer({self.source!r}, vocab_size={self.vocab_size})"


class PieceTokenizer:
  """A real model's tokenizer for text written in pieces (the task generators'): each piece is
  encoded with a leading space and no special tokens, so concatenated pieces read like the
  joined text, as :class:`HFTokenizer` does for a ``tokenizer.json``."""

  def __init__(self, tok: ModelTokenizer):
    self.tok = tok
    self.bos_id, self.eos_id, self.vocab_size = tok.bos_id, tok.eos_id, tok.vocab_size
    # padding only fills unscored answer slots (never attended: prompts are unpadded)
    self.pad_id = tok.bos_id if tok.bos_id is not None else tok.pad_id

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(" " + text)

  def decode(self, ids) -> str:
    return self.tok.decode(ids)


def load_tokenizer(path_or_name: str | pathlib.Path) -> ModelTokenizer:
  """The tokenizer of a ``.gguf`` file (:func:`from_gguf`), of a Hugging Face directory or its
  ``tokenizer.json`` (:func:`from_pretrained_dir`) or of ``"smollm2"`` (the packaged GGUF)."""
  if str(path_or_name) == SMOLLM2:
    path_or_name = smollm2_path()
  path = pathlib.Path(path_or_name)
  if path.suffix == ".gguf":
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
  """A Hugging Face directory's ``tokenizer.json``; special ids from ``tokenizer_config.json``
  (token strings), else from ``config.json`` (``bos_token_id``...)."""
  path = pathlib.Path(path)
  if not (path / "tokenizer.json").is_file():
    raise ValueError(f"path: {path} has no tokenizer.json")
  tok = Tokenizer.from_file(str(path / "tokenizer.json"))
  ids = {}
  for name in ("bos", "eos", "pad"):
    for file in ("tokenizer_config.json", "config.json"):
      raw = json.loads((path / file).read_text()) if (path / file).is_file() else {}
      token = raw.get(f"{name}_token")
      token = token.get("content") if isinstance(token, dict) else token
      found = tok.token_to_id(token) if isinstance(token, str) else raw.get(f"{name}_token_id")
      if isinstance(found, list):  # several eos ids: the first is the canonical one
        found = found[0] if found else None
      if found is not None:
        ids[f"{name}_id"] = int(found)
        break
  return ModelTokenizer(tok, source=str(path), **ids)


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
  """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
  cs, n = list(bs), 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces,
  best score first (transformers' ``generate_merges``, its ties and its stable order)."""
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


def _byte_level(meta: dict, tokens: list[str]):
  from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {
    t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
    for i, t in enumerate(tokens)
  }
  merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
  tok = Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=merges,
      dropout=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
    )
  )
  pre = meta.get("tokenizer.ggml.pre")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in PRE_TOKENIZER_SPLITS:
    byte_level = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  return tok, vocab, ("<|endoftext|>",)


def _sentencepiece(meta: dict, tokens: list[str]):
  from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

  vocab = {t: i for i, t in enumerate(tokens)}
  if "tokenizer.ggml.merges" in meta:
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
  else:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
      raise ValueError("the SentencePiece vocabulary has neither merges nor scores")
    merges = merges_from_scores(tokens, [float(s) for s in scores])
  tok = Tokenizer(
    models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
  )
  # llama.cpp honours add_space_prefix; transformers always prepends (the flag's default)
  prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
    replacement="▁", prepend_scheme="first" if prefix else "never", split=False
  )
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
  return tok, vocab, ("<unk>", "<s>", "</s>")


def from_gguf_metadata(meta: dict, source: str = "GGUF metadata") -> ModelTokenizer:
  """The tokenizer described by GGUF metadata (``tokenizer.ggml.*``), built as ``transformers``
  builds it (``GGUFGPTConverter``/``GGUFLlamaConverter``, now ``gguf_tokenizer_mapping``).

  ``tokenizer.ggml.model`` ``"gpt2"`` is byte-level BPE with the file's merges and the split of
  ``tokenizer.ggml.pre``; ``"llama"`` is SentencePiece BPE with byte fallback, merges from the
  scores and ``▁`` for spaces (prepended to the text unless ``add_space_prefix`` is false).
  Control tokens (and bos/eos/unk/pad) are special added tokens, user-defined ones plain added
  tokens, so both are matched whole in the text.
  """
  from tokenizers import AddedToken  # noqa: PLC0415

  kind = meta.get("tokenizer.ggml.model")
  tokens = meta.get("tokenizer.ggml.tokens")
  if kind not in ("gpt2", "llama") or tokens is None:
    raise ValueError(
      f"path: {source} has tokenizer.ggml.model {kind!r}"
      f"{'' if tokens is not None else ' and no tokenizer.ggml.tokens'}; supported: "
      "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
    )
  try:
    tok, vocab, defaults = (_byte_level if kind == "gpt2" else _sentencepiece)(meta, list(tokens))
  except ValueError as e:
    raise ValueError(f"path: {source}: {e}") from None
  types = list(meta.get("tokenizer.ggml.token_type", ()))
  alphabet = set(bytes_to_unicode().values())
  ids = {
    name: int(meta[f"tokenizer.ggml.{key}"])
    for name, key in (
      ("bos_id", "bos_token_id"),
      ("eos_id", "eos_token_id"),
      ("unk_id", "unknown_token_id"),
      ("pad_id", "padding_token_id"),
    )
    if f"tokenizer.ggml.{key}" in meta and 0 <= int(meta[f"tokenizer.ggml.{key}"]) < len(tokens)
  }
  special = [
    t
    for t, kind_id in zip(tokens, types, strict=False)
    if kind_id == CONTROL and (kind != "gpt2" or set(t) <= alphabet)
  ]
  # transformers' tokenizer classes add their default specials and the file's bos/eos/unk/pad
  special += [t for t in defaults if t in vocab] + [tokens[i] for i in ids.values()]
  tok.add_special_tokens(
    [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)]
  )
  user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  ids.pop("unk_id", None)
  return ModelTokenizer(tok, source=source, **ids)


def from_gguf(path: str | pathlib.Path) -> ModelTokenizer:
  """The tokenizer of a GGUF file (its metadata only: no tensor is read)."""
  header = gguf.read_header(path)
  return from_gguf_metadata(header.metadata, source=str(header.path))
