"""Golden caches of kvpress 0.5.5's KeyRerotationPress, MergingPress and CAMPress on the tiny
fixture Llama.

A standalone script (not run by the suite; kvjax does not depend on torch), in a venv with
kvpress 0.5.5 and torch::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_merging.py

On ``tests/fixtures/kvpress_tiny_llama`` with a seeded prompt of ``T`` tokens and ``S`` fed
tokens (one forward each, explicit positions) it records
``tests/fixtures/kvpress_0_5_5_merging.npz``:

* ``rerotation_*``: ``KeyRerotationPress(KnormPress(RATIO))`` at prefill; the cached keys
  ``[L, G, n, D]`` (re-rotated to positions ``0..n-1``), the kept positions ``[L, G, n]`` (in
  cache order, as ``compress`` hands them to ``rerotate_keys``), and the logits ``[S, V]`` of the fed tokens
  at positions ``n + i``, as ``KVPressTextGenerationPipeline`` gives them (its
  ``context_length = cache.get_seq_length()`` for this press).
* ``merging_*`` and ``merging_gated_*``: ``MergingPress(KnormPress(RATIO))`` (defaults) and
  ``MergingPress(KnormPress(RATIO), similarity_threshold=0.1, merge_fraction=0.75)`` at
  prefill; kept positions ``[L, G, n]`` in cache order (recovered from the untouched keys), the
  cached (merged) values ``[L, G, n, D]``, and the logits of the fed tokens at ``T + i``.
* ``cam_*``: ``CAMPress(KnormPress(), compression_interval=N, target_size=TARGET,
  merge_budget=MB)`` while decoding, with ``torch.bernoulli`` replaced by ``u < p`` on uniforms
  drawn from a seeded generator, recorded per compression (``cam_uniform_{c}_L`` ``[G, k]``) with
  the compression's inputs (keys and values ``[G, n, D]``, running attention ``[G, n]``, positions) and its
  outputs (kept positions, values), and the final cache's positions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from kvpress import CAMPress, KeyRerotationPress, KnormPress, MergingPress
from transformers import AutoModelForCausalLM, DynamicCache

HERE = Path(__file__).parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
OUT = HERE / "fixtures" / "kvpress_0_5_5_merging.npz"
T, S, RATIO = 24, 6, 0.5
CAM_S, N, TARGET, MB = 12, 4, 14, 3


def prefill_then_feed(model, ids, fed, press, start):
  """Prompt under ``press`` (compressed at prefill), then ``fed`` at ``start + i`` without it;
  returns the cache right after the prompt (keys, values per layer) and the fed logits."""
  cache = DynamicCache()
  with torch.no_grad():
    with press(model):
      pos = torch.arange(T)[None]
      model.model(input_ids=ids, past_key_values=cache, position_ids=pos)
    keys = [cache.layers[i].keys[0].clone() for i in range(len(cache.layers))]
    values = [cache.layers[i].values[0].clone() for i in range(len(cache.layers))]
    n = cache.get_seq_length()
    start = n if start is None else start
    logits = []
    for i, tok in enumerate(fed):
      p = torch.tensor([[start + i]])
      out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=p)
      logits.append(out.logits[0, -1])
  return keys, values, torch.stack(logits)


def match(cached, full):
  """Positions of ``cached [G, n, D]`` rows among ``full [G, T, D]`` rows, ``[G, n]``."""
  out = []
  for g in range(cached.shape[0]):
    d = torch.cdist(cached[g].double(), full[g].double())
    assert (d.min(-1).values < 1e-6).all()
    out.append(d.argmin(-1))
  return torch.stack(out).numpy().astype(np.int32)


def full_kv(model, ids):
  cache = DynamicCache()
  with torch.no_grad():
    model.model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(T)[None])
  n = len(cache.layers)
  return [cache.layers[i].keys[0] for i in range(n)], [cache.layers[i].values[0] for i in range(n)]


def cam(model, ids, fed, out):
  """CAMPress while decoding ``fed`` at ``T + i``, Bernoulli draws fixed and recorded."""
  press = CAMPress(
    base_press=KnormPress(), compression_interval=N, target_size=TARGET, merge_budget=MB
  )
  gen = torch.Generator().manual_seed(11)
  calls = []
  orig_compress, orig_bernoulli = CAMPress.compress, torch.bernoulli

  def bernoulli(p):
    u = torch.rand(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
    calls[-1]["uniform"] = u[0].clone()
    calls[-1]["prob"] = p[0].clone()
    return (u < p).to(p.dtype)

  def compress(self, module, hidden_states, keys, values, attentions, kwargs):
    calls.append(
      dict(
        layer=int(module.layer_idx),
        k=int(self.layer_step_counts[int(module.layer_idx)]),
        values_in=values[0].clone(),
        keys_in=keys[0].clone(),
        attn=attentions[0].clone(),
      )
    )
    k, v = orig_compress(self, module, hidden_states, keys, values, attentions, kwargs)
    calls[-1]["keys_out"], calls[-1]["values_out"] = k[0].clone(), v[0].clone()
    return k, v

  cache = DynamicCache()
  # every key the run appends, to recover positions (recorded before the press's hook)
  seen = {}

  def record(module, args, kwargs, output):
    layer = module.layer_idx
    q_len = kwargs["hidden_states"].shape[1]
    new = cache.layers[layer].keys[0, :, -q_len:].clone()
    seen[layer] = new if layer not in seen else torch.cat([seen[layer], new], 1)

  attns = [layer.self_attn for layer in model.model.layers]
  hooks = [m.register_forward_hook(record, with_kwargs=True) for m in attns]
  CAMPress.compress, torch.bernoulli = compress, bernoulli
  try:
    with torch.no_grad(), press(model):
      pos = torch.arange(T)[None]
      model(input_ids=ids, past_key_values=cache, position_ids=pos, cache_position=pos[0])
      for i, tok in enumerate(fed):
        p = torch.tensor([[T + i]])
        model(
          input_ids=torch.tensor([[tok]]),
          past_key_values=cache,
          position_ids=p,
          cache_position=p[0],
        )
  finally:
    CAMPress.compress, torch.bernoulli = orig_compress, orig_bernoulli
    for h in hooks:
      h.remove()
  for c, call in enumerate(calls):
    l = call["layer"]
    pre = f"cam_{c}_"
    out[pre + "layer"] = np.int32(l)
    out[pre + "k"] = np.int32(call["k"])
    out[pre + "positions_in_Gn"] = match(call["keys_in"], seen[l])
    out[pre + "values_in_GnD"] = call["values_in"].numpy()
    out[pre + "keys_in_GnD"] = call["keys_in"].numpy()
    out[pre + "attn_Gn"] = call["attn"].numpy()
    out[pre + "uniform_Gk"] = call["uniform"].numpy()
    out[pre + "prob_Gk"] = call["prob"].numpy()
    out[pre + "positions_out_Gn"] = match(call["keys_out"], seen[l])
    out[pre + "values_out_GnD"] = call["values_out"].numpy()
  out["cam_calls"] = np.int32(len(calls))
  out["cam_final_positions_LGn"] = np.stack(
    [match(cache.layers[l].keys[0], seen[l]) for l in range(len(cache.layers))]
  )
  out["cam_final_values_LGnD"] = np.stack(
    [cache.layers[l].values[0].numpy() for l in range(len(cache.layers))]
  )


def main():
  torch.manual_seed(0)
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32)
  model.eval()
  rng = np.random.default_rng(5)
  vocab = model.config.vocab_size
  # distinct tokens: a repeated token has layer 0's key norm twice, an exact tie that torch's
  # topk breaks its own way (kvjax: to the lower position)
  tokens = rng.choice(np.arange(5, vocab), T + max(S, CAM_S), replace=False)
  ids, fed = tokens[None, :T], tokens[T:]
  tids = torch.tensor(ids)
  full_keys, full_values = full_kv(model, tids)
  out = dict(
    input_ids_T=ids[0].astype(np.int32),
    fed_S=fed[:S].astype(np.int32),
    cam_fed_S=fed[:CAM_S].astype(np.int32),
    ratio=np.float64(RATIO),
    cam_constants=np.asarray([N, TARGET, MB], np.int32),
  )
  # the kept indices, as KeyRerotationPress.compress hands them to rerotate_keys (layer order)
  kept, orig = [], KeyRerotationPress.rerotate_keys

  def rerotate_keys(module, indices, keys):
    kept.append(indices[0].numpy().astype(np.int32))
    return orig(module, indices, keys)

  KeyRerotationPress.rerotate_keys = staticmethod(rerotate_keys)
  try:
    keys, values, logits = prefill_then_feed(
      model, tids, fed[:S], KeyRerotationPress(KnormPress(RATIO)), None
    )
  finally:
    KeyRerotationPress.rerotate_keys = staticmethod(orig)
  out["rerotation_keys_LGnD"] = np.stack([k.numpy() for k in keys])
  out["rerotation_kept_LGn"] = np.stack(kept)
  for v, fv, idx in zip(
    values, full_values, kept, strict=True
  ):  # the values are the kept ones, untouched
    np.testing.assert_array_equal(v.numpy(), np.take_along_axis(fv.numpy(), idx[..., None], 1))
  out["rerotation_logits_SV"] = logits.numpy()
  for name, press in [
    ("merging", MergingPress(KnormPress(RATIO))),
    (
      "merging_gated",
      MergingPress(KnormPress(RATIO), similarity_threshold=0.1, merge_fraction=0.75),
    ),
  ]:
    keys, values, logits = prefill_then_feed(model, tids, fed[:S], press, T)
    out[f"{name}_kept_LGn"] = np.stack(
      [match(k, fk) for k, fk in zip(keys, full_keys, strict=True)]
    )
    out[f"{name}_values_LGnD"] = np.stack([v.numpy() for v in values])
    out[f"{name}_logits_SV"] = logits.numpy()
  cam(model, tids, fed[:CAM_S], out)
  np.savez_compressed(OUT, **out)
  print("wrote", OUT, "cam calls", out["cam_calls"])


if __name__ == "__main__":
  main()
