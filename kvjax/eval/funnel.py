"""Layer funneling, measured: how attention narrows with depth (PyramidKV, Cai et al. 2024, Fig. 2).

PyramidKV's figure shows per-layer attention maps on a multi-document prompt: lower layers spread
attention over everything, middle layers attend within documents, upper layers concentrate on a
few tokens (sinks and the relevant facts). Here the funnel is also quantified per layer, from the
post-softmax attention of every query row:

* ``entropy``: mean attention entropy (nats); falls as attention funnels.
* ``first_token_mass``: mean mass on the first token (the attention sink).
* ``own_document_mass``: mean mass inside the query's own document (queries inside documents).
* ``keys_for_90``: mean number of keys holding 90 % of a row's mass.

The same statistics apply to the synthetic ``funnel`` world's attention rows, and to any
Hugging Face model :func:`kvjax.model.load` reads.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pandas as pd

from kvjax import model as km
from kvjax.eval import vocab
from kvjax.lab import synthetic


def multi_document_prompt(tokenizer, *, num_docs: int = 4, doc_len: int = 48, seed: int = 0):
  """``(ids [T], doc_id [T])``: ``document k :`` headers over random sentences; ``doc_id`` is -1 on
  the leading ``bos``. A stand-in for PyramidKV's multi-document QA prompt (no downloads)."""
  if not 1 <= num_docs <= 90 or doc_len < 8:
    raise ValueError(
      f"num_docs, doc_len: expected 1..90 documents of >= 8 tokens, got {num_docs}, {doc_len}"
    )
  rng = np.random.default_rng(seed)
  ids = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
  doc = [-1] * len(ids)
  for k in range(num_docs):
    # header words that exist in the tiny vocabulary: "document" and the number k + 10
    piece = tokenizer.encode(f"document {10 + k} :")
    while len(piece) < doc_len:
      words = rng.choice(vocab.FILLER, int(rng.integers(4, 9))).tolist()
      piece += tokenizer.encode(" ".join(words) + " .")
    piece = piece[:doc_len]
    ids += piece
    doc += [k] * len(piece)
  return np.asarray(ids, np.int32), np.asarray(doc, np.int32)


def document_edges(doc_id_T: np.ndarray) -> list[int]:
  """Positions where a new document starts (for drawing boundaries on attention maps)."""
  doc = np.asarray(doc_id_T)
  return [int(i) for i in np.flatnonzero(doc[1:] != doc[:-1]) + 1]


def row_statistics(probs_HQT: np.ndarray, doc_id_T: np.ndarray | None = None, q_index=None) -> dict:
  """Funnel statistics of one layer's attention rows ``[H, Q, K]`` (rows sum to 1 over the
  visible keys). ``q_index [Q]`` are the rows' positions (default: the last ``Q`` of ``K``)."""
  p = np.asarray(probs_HQT, np.float64)
  H, Q, K = p.shape
  q_index = np.arange(K - Q, K) if q_index is None else np.asarray(q_index)
  ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)).sum(-1)
  sorted_desc = -np.sort(-p, axis=-1)
  keys90 = (np.cumsum(sorted_desc, -1) < 0.9).sum(-1) + 1
  out = {
    "entropy": float(ent.mean()),
    "first_token_mass": float(p[..., 0].mean()),
    "keys_for_90": float(keys90.mean()),
  }
  if doc_id_T is not None:
    doc = np.asarray(doc_id_T)
    own = doc[q_index]
    inside = own >= 0
    same_QT = doc[None, :] == own[:, None]
    mass = (p * same_QT[None]).sum(-1)  # [H, Q]
    out["own_document_mass"] = float(mass[:, inside].mean()) if inside.any() else np.nan
  return out


def model_attention(model, ids_T: np.ndarray, layers=None) -> dict[int, np.ndarray]:
  """``{layer: [Hq, T, T]}`` full-cache attention of one prompt (all layers by default)."""
  cfg = model.cfg
  layers = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
  ids = jnp.asarray(np.asarray(ids_T, np.int32)[None])
  maps = km.llama.full_attention_maps(cfg, model.params(), ids, jnp.ones_like(ids), layers)
  return {layer: np.asarray(m[0]) for layer, m in maps.items()}


def model_funnel(model, ids_T: np.ndarray, doc_id_T: np.ndarray | None = None) -> pd.DataFrame:
  """Per-layer funnel statistics of a real model on one prompt (every query row)."""
  maps = model_attention(model, ids_T)
  T = len(ids_T)
  return pd.DataFrame(
    [
      {"layer": layer, **row_statistics(m, doc_id_T, np.arange(T))}
      for layer, m in sorted(maps.items())
    ]
  )


def synthetic_funnel(world, steps: int = 8) -> pd.DataFrame:
  """Per-layer funnel statistics of a synthetic world's attention rows at ``steps`` evenly spaced
  generation steps (document structure: none; ``own_document_mass`` is omitted)."""
  dims = world.dims
  ts = np.linspace(dims.prompt_len, dims.prompt_len + dims.gen_steps - 1, steps).astype(int)
  rows_SLHT = np.stack([np.asarray(synthetic.attention_row(world, jnp.asarray(t))) for t in ts])
  out = []
  for layer in range(rows_SLHT.shape[1]):
    p = rows_SLHT[:, layer].transpose(1, 0, 2)  # [H, S, T]
    out.append({"layer": layer, **row_statistics(p, None, ts)})
  return pd.DataFrame(out)


def evenly_spaced_layers(num_layers: int, count: int = 4) -> list[int]:
  """``count`` layers from first to last, as PyramidKV's figure picks them."""
  return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, min(count, num_layers))})


def synthetic_attention(world, steps: int = 64) -> dict[int, np.ndarray]:
  """``{layer: [H, S, T]}`` attention rows of a synthetic world at ``steps`` evenly spaced
  positions from the observation window to the end (the world's analogue of an attention map)."""
  d = world.dims
  ts = np.linspace(d.prompt_len - d.window, d.prompt_len + d.gen_steps - 1, steps).astype(int)
  rows = np.stack([np.asarray(synthetic.attention_row(world, jnp.asarray(t))) for t in ts])
  return {layer: rows[:, layer].transpose(1, 0, 2) for layer in range(rows.shape[1])}


def model_layer_budgets(model, ids_T: np.ndarray, budget: int, allocations=None) -> dict:
  """Each allocation's ``budget_LH`` on one prompt at the same mean per-head ``budget``:
  ``uniform`` (SnapKV), ``pyramidkv`` (PyramidKV's schedule), ``cake`` (CAKE's layer
  preferences from this prompt's attention) and ``adakv`` (Ada-KV's head-adaptive split)."""
  allocations = allocations or {
    "uniform": "snapkv",
    "pyramidkv": "pyramidkv",
    "cake": "cake",
    "adakv": "adakv_snapkv",
  }
  ids = np.asarray(ids_T, np.int32)[None]
  out = {}
  for label, name in allocations.items():
    g = km.generate_configs(model, ids, np.array([budget]), policy=name, max_new_tokens=1)
    out[label] = np.asarray(g.budget_LH[0, 0])
  return out
