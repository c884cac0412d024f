"""Where the evaluation's evidence beyond the prompt comes from: the further fields the prefill
computes on request, the calibration file measured once per model (``python -m
experiments.calibrate``), the trained surrogates' files (KVzap, Fast KVzip, RestoreKV) and what
is computed from each batch's context (KVzip's second pass, every kind declaring a ``compute``).
:mod:`kvjax.eval.evaluate` reads them through :func:`policy_needs`, :func:`load_calibration`,
:func:`load_learned` and :func:`context_evidence`.
"""

from __future__ import annotations

import pathlib
import zipfile
import zlib

import numpy as np

from kvjax.eval import tasks
from kvjax.model import calibrate, restorekv
from kvjax.policies import evidence as evidence_lib

# evidence beyond the prompt's attention and keys: computed by the prefill on request, measured
# once per run from the model (kvjax.model.calibrate, saved by experiments.calibrate), or per
# example by KVzip's second pass over the context
PREFILL_EVIDENCE = (
  "value_out_norms_LHT",
  "query_mean_LHD",
  "query_cov_LHDD",
  "window_queries_LHWD",
  "prerope_keys_LGTD",
  "queries_LHTD",
)
# the kinds a calibration file holds (declared with source="calibration")
CALIBRATION_EVIDENCE = evidence_lib.KindIndex(lambda k: k.source == "calibration", lambda k: k.doc)
CONTEXT_EVIDENCE = ("reconstruction_attn_LGT",)
# learned evidence: a trained model's file (the config field its kind names) applied to each
# batch's context; RestoreKV's adapter gives restore tokens rather than a kind of evidence
LEARNED_EVIDENCE = evidence_lib.KindIndex(lambda k: k.resource is not None, lambda k: k.resource)
RESTORE_RESOURCE = {restorekv.KEYS: "restorekv"}  # and restorekv.VALUES, from the same adapter


def _learned_fields() -> dict:
  """``{field: config field}`` of every learned kind and RestoreKV's restore tokens."""
  return {**LEARNED_EVIDENCE, **RESTORE_RESOURCE}


def load_learned(config, needs, model) -> dict:
  """The trained surrogates the policies read, loaded from the config's files: ``kvzap`` (a
  KVzap surrogate, ``python -m experiments.kvzap``), ``fastkvzip`` (Fast KVzip's gates,
  ``python -m experiments.fastkvzip``) and ``restorekv`` (RestoreKV's adapter,
  ``python -m experiments.restorekv``), checked against the model; ``{}`` when none is read.

  Args:
    config: the evaluation config.
    needs: the evidence fields the policies read.
    model: the model (:class:`kvjax.model.llama.Llama`): each file must fit its shapes and
      record its identity (a file trained on another model of the same shapes is refused).

  Returns:
    ``{"kvzap": surrogate, "fastkvzip": gates, "restorekv": adapter}`` for the ones needed.

  Raises:
    ValueError: naming the field, for a missing or unreadable file, or one trained for
      another model.
  """
  loaders = {k.resource: k.load for k in evidence_lib.evidence_kinds().values() if k.resource}
  loaders["restorekv"] = restorekv.load
  paths = learned_paths(config, needs)
  return {name: loaders[name](path, model)[0] for name, path in paths.items()}


def learned_paths(config, needs) -> dict:
  """The trained files the policies read (:data:`LEARNED_EVIDENCE`), checked to exist.

  Args:
    config: the evaluation config.
    needs: the evidence fields the policies read.

  Returns:
    ``{name: path}`` for the ones needed.

  Raises:
    ValueError: naming the config field, for a missing file.
  """
  return {
    name: _config_file(config, name, f"{field}, from a trained file", name, "<file>.npz")
    for field, name in _learned_fields().items()
    if field in needs
  }


def _config_file(config, name: str, read: str, experiment: str, file: str) -> str:
  """The file ``config[name]`` names, checked to exist; ``ValueError`` naming ``name`` (what the
  policies ``read`` from it, and the ``python -m experiments.<experiment>`` that writes ``file``)
  when it is unset or missing."""
  path = config.get(name)
  if not path or not pathlib.Path(path).is_file():
    raise ValueError(
      f"{name}: policies read {read}; run `python -m experiments.{experiment}` and pass "
      f"--config.{name}=DIR/{file} (got {path!r})"
    )
  return path


def policy_needs(entries) -> set[str]:
  """The :class:`kvjax.policies.Evidence` fields the ``(label, policy)`` entries read, and
  RestoreKV's restore tokens (:func:`kvjax.model.restorekv.fields_read`)."""
  return set().union(
    *(policy.evidence_fields | restorekv.fields_read(policy) for _, policy in entries)
  )


def load_calibration(config, needs) -> dict:
  """``qfilters_LGD`` / ``retrieval_heads_LG`` / ExpectedAttentionStats' query statistics from
  ``config.calibration`` (the ``calibration.npz`` that ``python -m experiments.calibrate``
  writes; DuoAttention's gates of ``config.duo_method``), for the policies that read them; ``{}``
  when none does. A file that is not an npz, lacks an array, or holds NaN, inf or no numbers in
  one is a ``ValueError`` naming ``calibration`` and the file."""
  wanted = sorted(set(needs) & set(CALIBRATION_EVIDENCE))
  if not wanted:
    return {}
  path = _config_file(
    config,
    "calibration",
    f"{wanted}, measured from the model",
    "calibrate --config=configs/calibrate.py",
    "calibration.npz",
  )
  names = {
    "qfilters_LGD": "qfilters_LGD",
    "retrieval_heads_LG": f"retrieval_heads_LG_{config.get('duo_method', 'official')}",
    "stats_query_mean_LHD": "stats_query_mean_LHD",
    "stats_query_cov_LHDD": "stats_query_cov_LHDD",
  }
  try:
    data = np.load(path)
  except (OSError, ValueError, zipfile.BadZipFile) as e:
    raise ValueError(f"calibration: {path} is not a calibration.npz ({e})") from None
  with data:
    absent = [names[w] for w in wanted if names[w] not in data.files]
    if absent:
      raise ValueError(f"calibration: {path} has no {absent}; it has {sorted(data.files)}")
    try:
      out = {w: np.asarray(data[names[w]]) for w in wanted}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
      raise ValueError(f"calibration: {path} is truncated or corrupt ({e})") from None
  for w, value in out.items():
    if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
      bad = "no numbers" if not np.issubdtype(value.dtype, np.number) else "NaN or inf"
      raise ValueError(
        f"calibration: {path} holds {bad} in {names[w]}; expected finite measurements "
        "(recalibrate: python -m experiments.calibrate)"
      )
  return out


def check_calibration(calibration: dict, cfg, path) -> None:
  """``ValueError`` naming ``calibration`` when its arrays (:func:`load_calibration`) were
  measured on another model: ``qfilters_LGD`` must be ``[layers, KV heads, head_dim]``,
  ``retrieval_heads_LG`` ``[layers, KV heads]`` and the query statistics ``[layers, query
  heads, head_dim(, head_dim)]`` of ``cfg``."""
  L, G, D, Hq = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  expected = {  # name: (shape, its axes)
    "qfilters_LGD": ((L, G, D), "layers, KV heads, head_dim"),
    "retrieval_heads_LG": ((L, G), "layers, KV heads"),
    "stats_query_mean_LHD": ((L, Hq, D), "layers, query heads, head_dim"),
    "stats_query_cov_LHDD": ((L, Hq, D, D), "layers, query heads, head_dim, head_dim"),
  }
  for name, value in calibration.items():
    if name in expected and tuple(np.shape(value)) != expected[name][0]:
      shape, axes = expected[name]
      raise ValueError(
        f"calibration: {path} holds {name} of shape {tuple(np.shape(value))}, expected "
        f"{shape} ({axes}) of "
        "the evaluated model; calibrate this model (python -m experiments.calibrate)"
      )


def kvzip_template(tok, model_name: str) -> calibrate.KVzipTemplate:
  """KVzip's "repeat the context" prompt in the model's ids (the tiny model's word vocabulary
  cannot spell it: filler words stand in, as in ``experiments.calibrate``)."""
  raw = getattr(tok, "tok", tok)
  if model_name == "tiny":
    first, later = (tuple(tasks.haystack_ids(raw, n, seed=99 + n)) for n in (6, 10))
    return calibrate.KVzipTemplate(first, later, suffix_ids=())
  return calibrate.kvzip_template(raw)


def context_evidence(model, exs, shape, template, needs, learned=None) -> dict:
  """The evidence computed from each batch's context columns (all but the fed question tail),
  ``[L, B, ...]``, for the policies that read it: KVzip's ``reconstruction_attn_LGT`` (its
  second pass), every kind whose declaration computes it (KVzap's ``kvzap_LGT`` and Fast
  KVzip's ``fastkvzip_LGT`` with the ``learned`` files of :func:`load_learned`, a kind declared
  outside kvjax with its own ``compute``), and RestoreKV's restore tokens after the context
  (``restore_keys_LGND``, ``restore_values_LGND``)."""
  computed = {
    name: kind
    for name, kind in evidence_lib.evidence_kinds().items()
    if name in needs and kind.compute is not None
  }
  wanted = set(needs) & ({"reconstruction_attn_LGT", *RESTORE_RESOURCE} | set(computed))
  if not wanted:
    return {}
  q_len = (shape or (max(e.question_len for e in exs), None))[0]
  prompts, _, _ = tasks.batch(exs)
  context = prompts[:, : prompts.shape[1] - q_len]
  out = {}
  if "reconstruction_attn_LGT" in wanted:
    attn = calibrate.kvzip_evidence(model, context, template)
    out["reconstruction_attn_LGT"] = np.asarray(attn)
  mask = np.ones(context.shape, np.int32)
  for name, kind in computed.items():
    extra = () if kind.resource is None else (learned[kind.resource],)
    out[name] = np.asarray(kind.compute(model, context, mask, *extra), np.float32)
  if restorekv.KEYS in wanted:
    restored = restorekv.restore_evidence(model, learned["restorekv"], context)
    out.update({k: np.asarray(v) for k, v in restored.items()})
  return out
