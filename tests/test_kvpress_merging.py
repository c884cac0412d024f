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
from kvjax.policies.cam import CaM, cam_compress, cam_merge
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


def _cam_draws(z, T):
  """kvpress's recorded uniforms as CaM's ``draws``: compression ``c`` (after
  ``(c + 1) N`` fed tokens) of layer ``l`` reads ``cam_{c L + l}_uniform_Gk``."""
  N = int(z["cam_constants"][0])
  calls = int(z["cam_calls"])
  L = int(max(z[f"cam_{c}_layer"] for c in range(calls))) + 1
  table = np.stack(
    [np.stack([z[f"cam_{c * L + l}_uniform_Gk"] for l in range(L)]) for c in range(calls // L)]
  )  # [compressions, L, G, N]
  for c in range(calls):
    assert int(z[f"cam_{c}_layer"]) == c % L

  def draws(seed, row, seen, shape):
    assert tuple(shape) == table.shape[1:]
    return jnp.asarray(table, jnp.float32)[(seen - T) // N - 1]

  return draws


def test_cam_in_the_models_cache_matches_kvpress(golden):
  """``CAMPress(KnormPress(), compression_interval=4, target_size=14, merge_budget=3)`` while
  decoding 12 tokens is ``CaM(base=KNorm(), decode_every=4, decode_budget=14,
  merge_budget=3)`` in the model's cache: with kvpress's recorded Bernoulli uniforms as its
  ``draws`` (both sides' randomness fixed), the final cache holds the same positions per
  layer and KV head, with the merged values within 1e-5."""
  z, cfg, params = golden
  ids = z["input_ids_T"][None]
  T = ids.shape[1]
  N, target, mb = (int(x) for x in z["cam_constants"])
  fed = z["cam_fed_S"]
  draws = _cam_draws(z, T)
  pol = CaM(
    base=policies.KNorm(), decode_every=N, decode_budget=target, merge_budget=mb, draws=draws
  )
  assert pol.merges_while_decoding and not pol.requires_budget
  spec, cache = _compress(cfg, params, ids, pol, None, pol.decode_capacity(T, T, len(fed)))
  _, cache = _feed(cfg, params, spec, cache, fed, T)
  values, pos = _by_position(cache, "values")
  np.testing.assert_array_equal(pos, np.sort(z["cam_final_positions_LGn"], -1))
  order = np.argsort(z["cam_final_positions_LGn"], -1)
  want = np.take_along_axis(z["cam_final_values_LGnD"], order[..., None], 2)
  np.testing.assert_allclose(values, want, atol=1e-5, rtol=0)
  # the merges changed values: the fed run's own values differ at some kept slots
  _, full = _compress(cfg, params, ids, policies.Full(), None, T + len(fed))
  _, full = _feed(cfg, params, cache_lib.CacheSpec(policies.Full(), T + len(fed)), full, fed, T)
  plain = np.asarray(full.values[:, 0])
  own = np.take_along_axis(plain, pos[..., None], 2)
  assert np.abs(own - want).max() > 1e-3


def test_cam_merge_is_cam_compress_on_a_slot_table():
  """:func:`cam_merge` over a padded slot table (empty slots first, a dynamic count) keeps what
  :func:`cam_compress` keeps on the filled slots and gives the same values."""
  rng = np.random.default_rng(0)
  G, n, D, pad, k, target, mb = 2, 19, 4, 5, 4, 9, 3
  values = rng.normal(size=(G, n, D)).astype(np.float32)
  attn = rng.uniform(0, 2, size=(G, n)).astype(np.float32)
  attn[:, 3] = 0.0  # a zero sum: probability 0 or nan -> 0
  scores = rng.normal(size=(G, n)).astype(np.float32)
  uniform = rng.uniform(size=(G, k)).astype(np.float32)
  kept, want = cam_compress(
    jnp.asarray(values),
    jnp.asarray(attn),
    jnp.asarray(scores),
    jnp.asarray(uniform),
    target_size=target,
    merge_budget=mb,
  )

  def padded(x, fill=0):
    return np.concatenate([np.full((G, pad) + x.shape[2:], fill, x.dtype), x], 1)

  valid = padded(np.ones((G, n), bool), False)
  got_kept, got = jax.jit(lambda *a: cam_merge(*a, merge_budget=mb))(
    jnp.asarray(padded(values)),
    jnp.asarray(padded(attn)),
    jnp.asarray(padded(scores, -np.inf)),
    jnp.asarray(valid),
    jnp.int32(target),
    jnp.asarray(uniform),
  )
  np.testing.assert_array_equal(np.nonzero(np.asarray(got_kept))[0] - pad, np.asarray(kept))
  np.testing.assert_allclose(np.asarray(got)[:, np.asarray(got_kept)], want, atol=1e-6)
  # uniforms at 0: every candidate with p > 0 merges, so values change
  _, merged = cam_merge(
    jnp.asarray(values),
    jnp.asarray(attn),
    jnp.asarray(scores),
    jnp.ones((n,), bool)[None].repeat(G, 0),
    target,
    jnp.full((G, k), 0.0),
    merge_budget=mb,
  )
  assert np.abs(np.asarray(merged) - values).max() > 0


def test_cam_options_are_checked():
  with pytest.raises(ValueError, match="merge_budget"):
    CaM(base=policies.KNorm(), merge_budget=0)
  with pytest.raises(ValueError, match="decode_budget"):
    CaM(base=policies.KNorm(), decode_budget=None)
  with pytest.raises(ValueError, match="decoding"):
    CaM(base=policies.KNorm(), decoding=policies.SnapKV())
