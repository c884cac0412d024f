"""The ragged per-head decode kernel (kvjax.model.ragged) in the Pallas interpreter on CPU: equal
to its XLA reference and to the cache's own decode attention (``cache.layer_attention``) over
random ragged lengths (0, 1 and full among them), GQA groups, soft-caps and sliding windows, in
fp32 and bf16; its page layout reads only each head's own pages; bad input is a ValueError."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.model import cache as cache_lib
from kvjax.model import ragged
from kvjax.model.config import ModelConfig

# both sides compute in fp32 from the same (bf16 or fp32) inputs: they differ by summation order
ATOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-6}
RTOL = 1e-5
B, G, GROUP, C, D, PAGE = 2, 3, 4, 80, 64, 16


def _case(seed, dtype, *, capacity=None):
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.standard_normal((B, G, C, D)), dtype)
  v = jnp.asarray(rng.standard_normal((B, G, C, D)), dtype)
  q = jnp.asarray(rng.standard_normal((B, G * GROUP, 1, D)), dtype)
  length = np.array([[0, 1, C], [rng.integers(2, C), PAGE, PAGE + 1]])
  positions = np.stack([rng.permutation(C) for _ in range(B * G)]).reshape(B, G, C)
  return q, k, v, length, positions.astype(np.int32)


def _cfg(softcap):
  return ModelConfig(
    vocab_size=8,
    hidden_size=G * GROUP * D,
    intermediate_size=8,
    num_layers=1,
    num_heads=G * GROUP,
    num_kv_heads=G,
    head_dim=D,
    attn_softcap=softcap,
  )


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("softcap,window", [(None, None), (20.0, 30)])
def test_kernel_equals_reference_and_layer_attention(backend, dtype, softcap, window):
  q, k, v, length, positions = _case(0, dtype)
  capacity = np.array([[16, 16, C], [C, 32, 48]])
  rows = ragged.pack_rows(k, v, length, capacity_BG=capacity, page=PAGE, positions_BGC=positions)
  q_RGD = q[:, :, 0].reshape(B * G, GROUP, D)
  query_pos = jnp.full((B * G,), C, jnp.int32)
  kw = dict(softcap=softcap)
  if window is not None:
    kw.update(query_pos_R=query_pos, window=window)
  out = ragged.ragged_decode_attention(q_RGD, rows, backend=backend, interpret=True, **kw)
  ref = ragged.reference(q_RGD, rows, **kw)
  np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL[dtype])
  # the cache's own decode attention over the stacked slot tables (held slots first)
  visible = jnp.arange(C)[None, None, :] < jnp.asarray(length)[:, :, None]
  if window is not None:
    visible = visible & (C - jnp.asarray(positions) < window)
  _, attn = cache_lib.layer_attention(_cfg(softcap), q, k, v, visible)
  np.testing.assert_allclose(
    out.reshape(B, G * GROUP, D), attn[:, :, 0], rtol=RTOL, atol=ATOL[dtype]
  )
  assert np.all(np.asarray(out[0]) == 0)  # a head holding nothing attends to nothing


def test_auto_is_the_reference_on_cpu():
  q, k, v, length, _ = _case(1, jnp.float32)
  rows = ragged.pack_rows(k, v, length, page=PAGE)
  q_RGD = q[:, :, 0].reshape(B * G, GROUP, D)
  out = jax.jit(ragged.ragged_decode_attention)(q_RGD, rows)
  np.testing.assert_array_equal(out, ragged.reference(q_RGD, rows))


def test_pages_are_each_heads_own():
  """A head's pages end at its own capacity: the layout holds (and a step reads) the counted
  bytes, not every head up to the layer's largest budget."""
  _, k, v, length, _ = _case(2, jnp.bfloat16)
  packed = ragged.pack_rows(k, v, length, page=PAGE)
  pages_per_row = -(-np.maximum(length.reshape(-1), 1) // PAGE)
  assert packed.keys.shape[0] == pages_per_row.sum() + 1  # one spare page
  rows = [set(np.asarray(packed.table)[r, :n].tolist()) for r, n in enumerate(pages_per_row)]
  assert sum(len(r) for r in rows) == len(set().union(*rows))  # no page shared
  counted = 2 * (-(-length.reshape(-1) // PAGE)).sum() * PAGE * D * 2
  assert ragged.bytes_read(packed.length, PAGE, D, 2) == counted
  padded = 2 * B * G * (-(-length.max() // PAGE)) * PAGE * D * 2
  assert ragged.bytes_read(packed.length, PAGE, D, 2) < padded


def test_bad_input():
  q, k, v, length, _ = _case(3, jnp.float32)
  rows = ragged.pack_rows(k, v, length, page=PAGE)
  q_RGD = q[:, :, 0].reshape(B * G, GROUP, D)
  with pytest.raises(ValueError, match="backend"):
    ragged.ragged_decode_attention(q_RGD, rows, backend="metal")
  with pytest.raises(ValueError, match=r"pages.length: row 0 holds \d+ slots; expected 0..\d+"):
    too_long = rows.length.at[0].set(rows.table.shape[1] * PAGE + 1)
    ragged.ragged_decode_attention(q_RGD, dataclasses.replace(rows, length=too_long))
  with pytest.raises(ValueError, match="page"):
    ragged.pack_rows(k, v, length, page=24)
  with pytest.raises(ValueError, match="pages.keys: a page of 12 slots"):
    cut = dataclasses.replace(rows, keys=rows.keys[:, :12], values=rows.values[:, :12])
    ragged.ragged_decode_attention(q_RGD, cut)
  with pytest.raises(ValueError, match="capacity_BG"):
    ragged.pack_rows(k, v, length, capacity_BG=np.zeros_like(length), page=PAGE)
  with pytest.raises(ValueError, match="window: needs pages.positions"):
    ragged.ragged_decode_attention(q_RGD, rows, window=8)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernel_lowers(platform):
  from kvjax.eval import export_check

  assert export_check.check(["ragged_decode"], platforms=(platform,))[0].ok


def test_the_device_check_runs_the_kernel_against_its_reference():
  """``experiments.device_check``'s ragged row, as it runs on a CPU (the Pallas interpreter)."""
  from experiments import device_check

  (row,) = device_check.ragged_rows(quick=True)
  assert "interpreter" in row and "FAILED" not in row, row
  assert float(row.rsplit(" ", 1)[1]) < 1e-5, row
