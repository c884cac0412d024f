"""kvpress 0.5.5's KeyRerotationPress, MergingPress and CAMPress against kvjax on the tiny fixture
Llama (tests/make_kvpress_fixtures_merging.py records the golden caches and logits)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as km
from kvjax import policies
from kvjax.model import cache as cache_lib
from kvjax.model import decoding, llama
from kvjax.policies.cam import cam_compress
from kvjax.policies.merging import Merging

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def golden():
  z = np.load(FIXTURES / "kvpress_0_5_5_merging.npz")
  model, cfg = km.load(FIXTURES / "kvpress_tiny_llama")
  return z, cfg, model.params()


def _compress(cfg, params, ids, pol, budget, capacity, reindex=False):
  T = ids.shape[1]
  pre = decoding.jit_prefill(
    cfg, params, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), pol.evidence_request(T)
  )
  spec = cache_lib.CacheSpec(pol, capacity, reindex=reindex)
  return spec, cache_lib.compress(cfg, pre, spec, budget)


def _feed(cfg, params, spec, cache, tokens, start):
  step = jax.jit(cache_lib.decode_step, static_argnums=(0, 2))
  logits = []
  for i, tok in enumerate(tokens):
    pos = jnp.full((1,), start + i, jnp.int32)
    out, cache = step(cfg, params, spec, cache, jnp.asarray([tok]), pos, pos, i)
    logits.append(np.asarray(out[0]))
  return np.stack(logits), cache


def _by_position(cache, field):
  """A cache field's valid slots of row 0 in position order, ``[L, G, n, ...]``, and the
  positions ``[L, G, n]``."""
  pos, valid = np.asarray(cache.positions[:, 0]), np.asarray(cache.valid[:, 0])
  x = np.asarray(getattr(cache, field)[:, 0])
  L, G, _ = pos.shape
  n = int(valid[0, 0].sum())
  out_x, out_p = np.zeros((L, G, n) + x.shape[3:], x.dtype), np.zeros((L, G, n), np.int64)
  for l in range(L):
    for g in range(G):
      slots = np.nonzero(valid[l, g])[0]
      slots = slots[np.argsort(pos[l, g, slots])]
      out_x[l, g], out_p[l, g] = x[l, g, slots], pos[l, g, slots]
  return out_x, out_p


def test_key_rerotation_is_the_reindexed_layout(golden):
  """``KeyRerotationPress(KnormPress(0.5))`` is ``Layout(reindex=True)`` with KNorm: the same
  kept positions, the kept (pre-RoPE) keys rotated by their rank equal kvpress's re-rotated
  cached keys, and the fed tokens' logits agree (kvpress feeds them at ``n_kept + i``, the
  pipeline's ``context_length = cache.get_seq_length()``; kvjax rotates each query by its rank
  in the cache, which is the same number)."""
  z, cfg, params = golden
  ids = z["input_ids_T"][None]
  T = ids.shape[1]
  n = int(T * (1 - float(z["ratio"])))
  fed = z["fed_S"]
  spec, cache = _compress(cfg, params, ids, policies.KNorm(), n, n + len(fed), reindex=True)
  keys, pos = _by_position(cache, "keys")
  np.testing.assert_array_equal(pos, np.sort(z["rerotation_kept_LGn"], -1))
  rank = jnp.broadcast_to(jnp.arange(n), keys.shape[:-1])
  rotated = np.asarray(llama.rope_at(jnp.asarray(keys), rank, cfg))
  np.testing.assert_allclose(rotated, z["rerotation_keys_LGnD"], atol=1e-5, rtol=0)
  logits, _ = _feed(cfg, params, spec, cache, fed, T)
  np.testing.assert_allclose(logits, z["rerotation_logits_SV"], atol=1e-5, rtol=0)
  # the comparison tells the layouts apart: original positions give other logits
  spec, cache = _compress(cfg, params, ids, policies.KNorm(), n, n + len(fed))
  plain, _ = _feed(cfg, params, spec, cache, fed, T)
  assert np.abs(plain - z["rerotation_logits_SV"]).max() > 1e-3


@pytest.mark.parametrize(
  ("kind", "options"),
  [("merging", {}), ("merging_gated", dict(similarity_threshold=0.1, merge_fraction=0.75))],
)
def test_merging_matches_kvpress(golden, kind, options):
  """``MergingPress(KnormPress(0.5), ...)`` is ``Merging(base=KNorm(), ...)``: the same kept
  positions per layer and KV head, the merged values within 1e-5, and the fed tokens' logits
  (at original positions) within 1e-5."""
  z, cfg, params = golden
  ids = z["input_ids_T"][None]
  T = ids.shape[1]
  n = int(T * (1 - float(z["ratio"])))
  fed = z["fed_S"]
  pol = Merging(base=policies.KNorm(), **options)
  spec, cache = _compress(cfg, params, ids, pol, n, n + len(fed))
  values, pos = _by_position(cache, "values")
  order = np.argsort(z[f"{kind}_kept_LGn"], -1)
  np.testing.assert_array_equal(pos, np.take_along_axis(z[f"{kind}_kept_LGn"], order, -1))
  want = np.take_along_axis(z[f"{kind}_values_LGnD"], order[..., None], 2)
  np.testing.assert_allclose(values, want, atol=1e-5, rtol=0)
  logits, _ = _feed(cfg, params, spec, cache, fed, T)
  np.testing.assert_allclose(logits, z[f"{kind}_logits_SV"], atol=1e-5, rtol=0)
  # the merge changed values: the base alone keeps the prompt's own
  _, plain = _compress(cfg, params, ids, policies.KNorm(), n, n + len(fed))
  assert np.abs(_by_position(plain, "values")[0] - want).max() > 1e-3


def test_cam_compression_step_matches_kvpress_with_its_draws(golden):
  """Each of kvpress's ``CAMPress(KnormPress(), compression_interval=4, target_size=14,
  merge_budget=3)`` compressions over 12 decoded tokens (2 layers x 3), its
  ``torch.bernoulli`` replaced by ``u < p`` on recorded uniforms: :func:`cam_compress` on the
  same inputs and uniforms keeps the same positions and gives the same values within 1e-5."""
  z = golden[0]
  _, target, mb = (int(x) for x in z["cam_constants"])
  assert int(z["cam_calls"]) == 6
  for c in range(int(z["cam_calls"])):
    f = lambda name, c=c: z[f"cam_{c}_{name}"]  # noqa: E731
    scores = -np.linalg.norm(f("keys_in_GnD").astype(np.float64), axis=-1)  # KnormPress
    kept, values = cam_compress(
      jnp.asarray(f("values_in_GnD")),
      jnp.asarray(f("attn_Gn")),
      jnp.asarray(scores, jnp.float32),
      jnp.asarray(f("uniform_Gk")),
      target_size=target,
      merge_budget=mb,
    )
    assert f("uniform_Gk").shape[-1] == int(f("k"))
    pos_in = f("positions_in_Gn")
    np.testing.assert_array_equal(pos_in[:, np.asarray(kept)], f("positions_out_Gn"))
    np.testing.assert_allclose(np.asarray(values), f("values_out_GnD"), atol=1e-5, rtol=0)
  # the draws mattered: some merges were refused (u >= p), some made
  u = np.concatenate([z[f"cam_{c}_uniform_Gk"].ravel() for c in range(6)])
  p = np.concatenate([z[f"cam_{c}_prob_Gk"].ravel() for c in range(6)])
  assert (u < p).any() and (u >= p).any()
