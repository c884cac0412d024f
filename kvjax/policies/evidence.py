"""What a policy may observe: the declared kinds of evidence (:class:`EvidenceKind`), the
:class:`Evidence` a policy reads, and what a policy asks a prefill to compute
(:class:`EvidenceRequest`).

Every kind of evidence is declared once, as an :class:`EvidenceKind`: its name (shape-suffixed,
``kvzap_LGT``), whether each batch row has its own or one array serves every row, where it comes
from (a model's prefill, the caller, a calibration file, arrays only) and, for the kinds a model
can compute from a prompt (a learned probe on the hidden states, a surrogate model), how. The
model's prefill, the cache, decoding, the answers and the evaluation iterate over the kinds a
policy asks for instead of naming them, so a method that needs new evidence declares it with
:func:`declare_evidence` from outside kvjax (``docs/write_your_own.md``).

A policy reads an :class:`Evidence`; build one from a prompt's queries and keys with
:func:`evidence_from_qk`, fill the kinds you have (the synthetic lab provides attention rows
directly), or let a model's prefill compute what :meth:`kvjax.policies.Policy.evidence_request`
asks for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import scores as scores_lib
from kvjax import select

Array = jax.Array

DEFAULT_WINDOW = 32  # observation queries when a policy sets none (SnapKV's window_size)
N_SINK, N_FUTURE = 4, 512  # kvpress ExpectedAttentionPress's n_sink and n_future_positions

# where a kind comes from: a model's prefill computes it on request; the caller gives it (or a
# declared ``compute`` does, from the model and the prompt); a calibration file holds it (the
# evaluation reads it); only arrays carry it (no model entry point can); kvjax sets it itself
SOURCES = ("prefill", "caller", "calibration", "arrays", "internal")
# the axes a caller-given kind may have, sized by the model (H: the policy's heads)
DATA_AXES = frozenset("LGHTD")
_NAME = re.compile(r"^[a-z][a-z0-9_]*_([A-Z]+)$")


@dataclasses.dataclass(frozen=True)
class EvidenceKind:
  """One kind of evidence a policy may read, declared once (:func:`declare_evidence`).

  Attributes:
    name: the field's name, ending in its axes from the shape key (``probe_LGT``: layers, KV
      heads, positions); ``Evidence.<name>`` reads it.
    doc: what it is, one sentence (the catalogue and error messages quote it).
    source: one of :data:`SOURCES`.
    per_row: whether each batch row has its own array (a model's entry points take it with the
      batch at axis 1, ``[L, B, ...]``, or ``[L, ...]`` for every row) or one array serves
      every row.
    decode: whether a re-compression while decoding can rebuild it over the cache's own slots.
    prefill: for ``source="prefill"``, the :class:`kvjax.model.llama.Prefill` attribute
      holding it.
    request: for ``source="prefill"``, the :class:`EvidenceRequest` settings that compute it,
      given the observation window (``lambda window: {"column_sums": True}``).
    also: other accepted axes (HeadKV's importances may be per KV head: ``("LG",)``).
    compute: for ``source="caller"``, how a model computes it from a prompt when the caller
      gives none: ``compute(model, input_ids_BT, attention_mask_BT)`` (with ``resource``:
      ``compute(model, input_ids_BT, attention_mask_BT, loaded)``) returning ``[L, B, ...]``
      over the caller's columns.
    resource: the evaluation config field naming a trained file that ``compute`` needs
      (``"kvzap"``), loaded once with ``load``.
    load: ``load(path, model) -> (resource, meta)``, checking the file fits the model (its
      shapes, and the identity of the model it was trained on).
    check: an extra check of a caller's concrete value (a NumPy array): returns what is wrong,
      or ``None``.
  """

  name: str
  doc: str
  source: str = "caller"
  per_row: bool = True
  decode: bool = False
  prefill: str | None = None
  request: Callable[[int], dict] | None = None
  also: tuple[str, ...] = ()
  compute: Callable[..., Any] | None = None
  resource: str | None = None
  load: Callable[..., Any] | None = None
  check: Callable[[Any], str | None] | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not (_NAME.match(self.name) or self.name in _UNSUFFIXED):
      raise ValueError(
        f"name: expected a lower-case name ending in its axes from the shape key "
        f"('probe_LGT'), got {self.name!r}"
      )
    if self.source not in SOURCES:
      raise ValueError(f"source: expected one of {SOURCES}, got {self.source!r}")
    if not isinstance(self.doc, str) or not self.doc.strip():
      raise ValueError(f"doc: expected a sentence saying what {self.name} is, got {self.doc!r}")
    if self.source == "caller":
      bad = sorted(set(self.axes) - DATA_AXES) or (self.axes[:1] != "L")
      if bad:
        raise ValueError(
          f"name: a caller-given kind's axes start with L and use {sorted(DATA_AXES)} (sized by "
          f"the model), got {self.name!r}"
        )
    if self.source == "prefill" and (self.prefill is None or self.request is None):
      raise ValueError(f"prefill: kind {self.name!r} from the prefill needs prefill= and request=")
    if (self.resource is None) != (self.load is None):
      raise ValueError(f"resource: kind {self.name!r} needs both resource= and load=, or neither")
    for name in ("compute", "load", "check", "request"):
      value = getattr(self, name)
      if value is not None and not callable(value):
        raise ValueError(f"{name}: expected a callable or None, got {value!r}")

  @property
  def axes(self) -> str:
    """The axes' letters (``"LGT"``; ``""`` for ``rng``)."""
    m = _NAME.match(self.name)
    return m.group(1) if m else ""

  @property
  def key_axis(self) -> int | None:
    """The key-position axis (``T``) counted from the end, or ``None``."""
    axes = self.axes
    return axes.rindex("T") - len(axes) if "T" in axes else None


_UNSUFFIXED = frozenset({"rng"})
_KINDS: dict[str, EvidenceKind] = {}


def declare_evidence(kind: EvidenceKind, *, overwrite: bool = False) -> EvidenceKind:
  """Declares a kind of evidence, so policies may read it and models compute or take it.

  Args:
    kind: the declaration.
    overwrite: replace a kind of the same name declared outside kvjax (a built-in kind is
      never replaced; :func:`provide` attaches a model's computation to one).

  Returns:
    ``kind``.

  Raises:
    ValueError: ``kind`` is not an :class:`EvidenceKind`, or its name is taken.
  """
  if not isinstance(kind, EvidenceKind):
    raise ValueError(f"kind: expected an EvidenceKind, got {type(kind).__name__}")
  old = _KINDS.get(kind.name)
  if old is not None and old != kind and (not overwrite or kind.name in BUILTIN):
    raise ValueError(
      f"kind: {kind.name!r} is already declared ({old.doc}); choose another name"
      + ("" if kind.name in BUILTIN else " or pass overwrite=True")
    )
  _KINDS[kind.name] = kind
  return kind


def provide(name: str, compute: Callable, *, resource=None, load=None) -> EvidenceKind:
  """Attaches how a model computes a declared caller-given kind (a trained surrogate's scores).

  Declared beside the code that computes it (``kvjax.model.kvzap`` for ``kvzap_LGT``), while
  the kind itself is declared beside the policy that reads it.

  Args:
    name: the kind's name.
    compute: as :attr:`EvidenceKind.compute`.
    resource: as :attr:`EvidenceKind.resource`.
    load: as :attr:`EvidenceKind.load`.

  Returns:
    The kind with its computation.

  Raises:
    ValueError: an undeclared name, or a kind that is not caller-given.
  """
  kind = evidence_kind(name)
  if kind.source != "caller":
    raise ValueError(f"name: {name!r} comes from {kind.source!r}; only caller-given kinds compute")
  kind = dataclasses.replace(kind, compute=compute, resource=resource, load=load)
  _KINDS[name] = kind
  return kind


def evidence_kind(name: str) -> EvidenceKind:
  """The declared kind ``name``.

  Args:
    name: the kind's name.

  Returns:
    Its :class:`EvidenceKind`.

  Raises:
    ValueError: no kind of that name is declared.
  """
  kind = _KINDS.get(name) if isinstance(name, str) else None
  if kind is None:
    raise ValueError(
      f"evidence: {name!r} is not a declared kind of evidence; expected one of {sorted(_KINDS)} "
      "or a kind declared with kvjax.policies.declare_evidence"
    )
  return kind


def evidence_kinds(*, source: str | None = None, per_row: bool | None = None) -> dict:
  """The declared kinds, by name, optionally only those of one ``source`` or scope.

  Args:
    source: one of :data:`SOURCES`, or ``None`` for all.
    per_row: ``True`` (per batch row), ``False`` (shared by every row) or ``None`` (both).

  Returns:
    ``{name: EvidenceKind}``, sorted by name.
  """
  return {
    k: v
    for k, v in sorted(_KINDS.items())
    if (source is None or v.source == source) and (per_row is None or v.per_row == per_row)
  }


class KindIndex(Mapping):
  """A live, read-only view of the declared kinds that pass a filter, as ``{name: value}``
  (so a kind declared later is seen by the code holding the view)."""

  def __init__(self, keep: Callable[[EvidenceKind], bool], value: Callable[[EvidenceKind], Any]):
    self._keep, self._value = keep, value

  def _items(self) -> dict:
    return {k: self._value(v) for k, v in sorted(_KINDS.items()) if self._keep(v)}

  def __getitem__(self, name):
    return self._items()[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._items())

  def __len__(self) -> int:
    return len(self._items())

  def __repr__(self) -> str:
    return f"KindIndex({sorted(self._items())})"


# the key axis of each per-position kind
KEY_AXIS = KindIndex(lambda k: k.key_axis is not None, lambda k: k.key_axis)


@jax.tree_util.register_pytree_node_class
class Evidence:
  """What a policy may observe at compression time: any declared kind, by name.

  ``Evidence(attn_window_LHWT=rows, probe_LGT=scores)`` holds the kinds given; reading a
  declared kind that is absent (``evidence.column_sums_LHT``) gives ``None``, and
  :meth:`need` names the policy and the kind when a policy needs one that is absent. A pytree:
  ``jit`` and ``vmap`` see its arrays; ``observation_window`` is static.

  The built-in kinds (:func:`evidence_kinds` lists each with its ``doc``) include the window
  rows ``attn_window_LHWT``, H2O's ``column_sums_LHT``, the keys and values as cached
  ``keys_LGTD`` / ``values_LGTD``, the oracle's ``future_attn_LHST``, the learned scores
  (``kvzap_LGT``, ``fastkvzip_LGT``, ``kvgrad_LGT``), calibration data (``qfilters_LGD``,
  ``retrieval_heads_LG``), HeadKV's ``head_scores_LH``, ``rng`` and a padded row's real
  positions ``valid_T``.

  Args:
    observation_window: ``W``, the observation queries behind ``attn_window_LHWT`` or
      ``window_scores_LHT`` (static; ``None``: the rows' own ``W``).
    **fields: declared kinds and their arrays (``None`` values are left out).

  Raises:
    ValueError: a field that is not a declared kind.
  """

  __slots__ = ("_fields", "observation_window")

  def __init__(self, observation_window: int | None = None, **fields):
    for name in fields:
      evidence_kind(name)
    object.__setattr__(self, "_fields", {k: v for k, v in fields.items() if v is not None})
    object.__setattr__(self, "observation_window", observation_window)

  def __getattr__(self, name: str):
    if name.startswith("__") or name not in _KINDS:
      raise AttributeError(
        f"Evidence has no attribute {name!r} (not a declared kind of evidence; "
        "kvjax.policies.evidence_kinds() lists them)"
      )
    return self._fields.get(name)

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"Evidence is immutable; use replace({name}=...)")

  def __repr__(self) -> str:
    shapes = {k: getattr(v, "shape", type(v).__name__) for k, v in sorted(self._fields.items())}
    return f"Evidence({shapes}, observation_window={self.observation_window})"

  def tree_flatten(self):
    names = tuple(sorted(self._fields))
    return [self._fields[k] for k in names], (names, self.observation_window)

  @classmethod
  def tree_unflatten(cls, aux, children):
    names, window = aux
    out = object.__new__(cls)
    object.__setattr__(out, "_fields", dict(zip(names, children, strict=True)))
    object.__setattr__(out, "observation_window", window)
    return out

  @property
  def fields(self) -> dict:
    """The kinds present, ``{name: array}``."""
    return dict(self._fields)

  def replace(self, **fields) -> Evidence:
    """A copy with ``fields`` set (``None`` removes one; ``observation_window`` too).

    Args:
      **fields: declared kinds and their values.

    Returns:
      The new :class:`Evidence`.
    """
    window = fields.pop("observation_window", self.observation_window)
    return Evidence(observation_window=window, **{**self._fields, **fields})

  def need(self, field: str, policy: str) -> Array:
    """Reads a kind that the policy needs.

    Args:
      field: the kind's name.
      policy: the policy's label, named in the error.

    Returns:
      The kind's value.

    Raises:
      ValueError: the kind is absent (or not declared).
    """
    value = self._fields.get(field)
    if value is None:
      kind = evidence_kind(field)
      raise ValueError(
        f"evidence: policy {policy!r} needs evidence.{field} ({kind.doc}), which is None"
      )
    return value

  def positions_shape(self, policy: str) -> tuple[int, int, int]:
    """``(L, H, T)`` from whichever evidence is present.

    Keys are ``[L, G, T, D]``, so from keys alone ``H`` is ``G``.

    Args:
      policy: the policy's label, named in the error.

    Returns:
      ``(L, H, T)``.

    Raises:
      ValueError: no field sizes ``[L, H, T]``.
    """
    for field in ("attn_window_LHWT", "window_scores_LHT", "column_sums_LHT", "future_attn_LHST"):
      value = self._fields.get(field)
      if value is not None:
        return value.shape[0], value.shape[1], value.shape[-1]
    if self._fields.get("keys_LGTD") is not None:
      return self._fields["keys_LGTD"].shape[:3]
    raise ValueError(
      f"evidence: policy {policy!r} needs at least one evidence field to size [L, H, T]"
    )

  def rolled(self, shift) -> Evidence:
    """Every per-position kind rolled by ``shift`` (traced) along its key axis.

    A left-padded row with its padding moved to the end, for scorers that count from the first
    real token.

    Args:
      shift: the roll, an int or traced int (negative: towards the front).

    Returns:
      The rolled :class:`Evidence` (the other kinds unchanged).
    """
    fields = {
      k: jnp.roll(v, shift, axis=_KINDS[k].key_axis)
      for k, v in self._fields.items()
      if _KINDS[k].key_axis is not None
    }
    return self.replace(**fields)


def _prefill(name, attr, doc, decode=False, **request):
  """A built-in kind a model's prefill computes (``request``'s values: ``"window"`` is the
  observation window)."""

  def make(window: int) -> dict:
    return {k: (window if v == "window" else v) for k, v in request.items()}

  return EvidenceKind(name, doc, "prefill", prefill=attr, request=make, decode=decode)


def _gates(arr) -> str | None:
  if ((arr < 0) | (arr > 1)).any():
    return f"expected gates in [0, 1], got [{arr.min()}, {arr.max()}]"
  return None


_BUILTIN_KINDS = (
  _prefill(
    "attn_window_LHWT",
    "attn_window",
    "causal softmax rows of the last W prompt queries over all T keys",
    decode=True,
  ),
  _prefill(
    "window_scores_LHT",
    "window_scores",
    "the window rows already reduced by the policy's own score_rows inside the prefill",
  ),
  _prefill(
    "column_sums_LHT",
    "column_sums",
    "attention received per key, summed over causal prompt queries (H2O)",
    column_sums=True,
  ),
  _prefill("keys_LGTD", "keys", "keys as cached (post-RoPE)", decode=True),
  _prefill("values_LGTD", "values", "values as cached", decode=True),
  _prefill(
    "value_out_norms_LHT",
    "value_out_norms",
    "CriticalKV's ||W_O^h v_j||_1 per query head",
    decode=True,
    value_out_norms=True,
  ),
  _prefill(
    "query_mean_LHD",
    "query_mean",
    "ExpectedAttention's mean of the pre-RoPE prompt queries after n_sink, rotated by the "
    "average RoPE over the next n_future positions",
    query_stats=True,
  ),
  _prefill(
    "query_cov_LHDD",
    "query_cov",
    "ExpectedAttention's matching query covariance, rotated on both sides",
    query_stats=True,
  ),
  _prefill(
    "window_queries_LHWD",
    "window_queries",
    "the last W post-RoPE prompt queries (ThinK's channels, R-KV)",
    decode=True,
    window_queries="window",
  ),
  _prefill(
    "prerope_keys_LGTD",
    "prerope_keys",
    "keys before RoPE (the leverage scores)",
    prerope_keys=True,
  ),
  _prefill(
    "queries_LHTD",
    "queries",
    "every prompt position's post-RoPE queries (non-causal attention)",
    queries=True,
  ),
  _prefill(
    "future_attn_LHST",
    "future_attn",
    "attention of the tokens after the prompt over its T positions (the oracle only; the "
    "answers compute it from the answer they are given)",
  ),
  EvidenceKind(
    "legacy_column_sums_LHT",
    "H2O's column sums under KVCache-Factory's legacy non-causal prefill mask",
    "arrays",
  ),
  EvidenceKind(
    "sketch_LGDK",
    "standard normal draws for a randomised sketch (G may be 1: one draw per layer)",
    "arrays",
  ),
  EvidenceKind("rng", "a PRNG key (random policies)", "internal", decode=True),
  EvidenceKind("valid_T", "the row's real positions, bool (a padded batch row)", "internal"),
  EvidenceKind(
    "head_scores_LH",
    "HeadKV's static head importance, per query head or per KV head",
    per_row=False,
    decode=True,
    also=("LG",),
  ),
  EvidenceKind(
    "qfilters_LGD",
    "Q-Filters' filter direction per KV head (score -<k, f>)",
    "calibration",
    per_row=False,
    decode=True,
  ),
  EvidenceKind(
    "retrieval_heads_LG",
    "DuoAttention's per-KV-head gate in [0, 1] (1: a retrieval head, keeps everything)",
    "calibration",
    per_row=False,
    decode=True,
    check=_gates,
  ),
  EvidenceKind(
    "stats_query_mean_LHD",
    "pre-RoPE query means measured on a corpus (ExpectedAttentionStats)",
    "calibration",
    per_row=False,
    decode=True,
  ),
  EvidenceKind(
    "stats_query_cov_LHDD",
    "the matching corpus query covariances (divided by N - 1)",
    "calibration",
    per_row=False,
    decode=True,
  ),
  EvidenceKind(
    "reconstruction_attn_LGT",
    "KVzip's importance: the max attention the 'repeat the context' queries pay each key",
  ),
  EvidenceKind(
    "reconstruction_attn_LHT",
    "KVCompose's per-query-head max attention of a second pass over the context",
  ),
  EvidenceKind(
    "kvgrad_LGT",
    "KVgrad's attribution: reconstruction attention x ||W_O v|| x output gradient norm",
  ),
  EvidenceKind(
    "kvzap_LGT",
    "KVzap's surrogate scores: a trained per-layer model on each position's attention input",
  ),
  EvidenceKind(
    "fastkvzip_LGT",
    "Fast KVzip's gate scores: trained per-layer gates on each position's attention input",
  ),
)
for _kind in _BUILTIN_KINDS:
  declare_evidence(_kind)
BUILTIN = frozenset(k.name for k in _BUILTIN_KINDS)
# every declared kind's name (a live view)
FIELDS = KindIndex(lambda k: True, lambda k: k.source)


@dataclasses.dataclass(frozen=True)
class EvidenceRequest:
  """What a prefill computes besides logits, keys and values.

  One hashable object, static under ``jit`` (:func:`kvjax.model.llama.prefill` takes it), built
  from a policy's needs by :meth:`kvjax.policies.Policy.evidence_request` and merged with ``|``
  for a prefill that several policies share.

  Attributes:
    window: window rows of the last ``window`` queries over every key (0: none).
    column_sums: H2O's causal attention column sums.
    value_out_norms: CriticalKV's ``||W_O^h v_j||_1``.
    query_stats: ExpectedAttention's query mean and covariance, with kvpress's ``n_sink`` and
      ``n_future`` (``n_future_positions``).
    window_queries: the last ``window_queries`` post-RoPE queries (ThinK, R-KV; 0: none).
    prerope_keys: the keys before RoPE (leverage scores).
    queries: every prompt position's post-RoPE queries (non-causal attention).
    window_scores: a hashable callable reducing one layer's window rows ``[B, H, W, T]`` to
      scores ``[B, H, T]`` inside the layer scan, so the prefill keeps the scores instead of the
      rows (:meth:`kvjax.policies.WindowPolicy.window_scorer`); ``None`` keeps the rows.
  """

  window: int = 0
  column_sums: bool = False
  value_out_norms: bool = False
  query_stats: bool = False
  n_sink: int = N_SINK
  n_future: int = N_FUTURE
  window_queries: int = 0
  prerope_keys: bool = False
  queries: bool = False
  window_scores: Callable[[Array], Array] | None = None

  def __or__(self, other: EvidenceRequest) -> EvidenceRequest:
    """Both requests at once, for a prefill shared by several policies.

    The shared prefill keeps the rows: the result has no ``window_scores``.

    Args:
      other: the other request.

    Returns:
      The request computing what either asks for.

    Raises:
      ValueError: both ask for query statistics with different ``n_sink`` or ``n_future``.
    """
    if (self.query_stats and other.query_stats) and (
      (self.n_sink, self.n_future) != (other.n_sink, other.n_future)
    ):
      raise ValueError(
        f"request: query statistics with n_sink={self.n_sink}, n_future={self.n_future} and "
        f"n_sink={other.n_sink}, n_future={other.n_future} cannot share one prefill"
      )
    stats = self if self.query_stats else other
    return EvidenceRequest(
      window=max(self.window, other.window),
      column_sums=self.column_sums or other.column_sums,
      value_out_norms=self.value_out_norms or other.value_out_norms,
      query_stats=self.query_stats or other.query_stats,
      n_sink=stats.n_sink,
      n_future=stats.n_future,
      window_queries=max(self.window_queries, other.window_queries),
      prerope_keys=self.prerope_keys or other.prerope_keys,
      queries=self.queries or other.queries,
    )

  @classmethod
  def for_fields(cls, needs, window: int, **settings) -> EvidenceRequest:
    """The request that computes the :class:`Evidence` fields ``needs``.

    Each kind's declaration says what the prefill computes for it
    (:attr:`EvidenceKind.request`); a model gives keys and values always, and the other kinds
    come from the caller, a calibration file or a kind's own ``compute``.

    Args:
      needs: declared kinds' names.
      window: the window rows' and window queries' count.
      **settings: other :class:`EvidenceRequest` fields (``n_sink``, ``n_future``,
        ``window_scores``).

    Returns:
      The :class:`EvidenceRequest`.

    Raises:
      ValueError: ``needs`` names a kind that is not declared.
    """
    settings_from_kinds: dict = {}
    for name in sorted(frozenset(needs)):
      kind = _KINDS.get(name) if isinstance(name, str) else None
      if kind is None:
        raise ValueError(
          f"needs: {name!r} is not a declared kind of evidence; expected some of "
          f"{sorted(_KINDS)} or a kind declared with kvjax.policies.declare_evidence"
        )
      if kind.request is not None:
        settings_from_kinds.update(kind.request(window))
    return cls(window=window, **settings_from_kinds, **settings)


def evidence_from_qk(
  queries_LHTD: Array,
  keys_LGTD: Array,
  *,
  window: int = DEFAULT_WINDOW,
  legacy_window: int = 8,
  column_sums: bool = True,
  rng: Array | None = None,
) -> Evidence:
  """Evidence of one prompt from its post-RoPE queries and keys, without a ``T x T`` matrix.

  Args:
    queries_LHTD: post-RoPE queries ``[L, Hq, T, D]``.
    keys_LGTD: post-RoPE keys ``[L, G, T, D]``.
    window: observation queries (an int ``>= 1``; the whole prompt when it is shorter).
    legacy_window: the window of KVCache-Factory's legacy non-causal mask (an int ``>= 0``).
    column_sums: also compute the causal and legacy H2O column sums, blockwise.
    rng: a PRNG key for the random policy.

  Returns:
    An :class:`Evidence` with the window rows, the column sums, the keys and ``rng``.

  Raises:
    ValueError: queries or keys that are not rank-4 arrays, a ``window`` or ``legacy_window``
      that is not an int in its range, or a ``column_sums`` that is not a bool.
  """
  for name, x, letters in (("queries", queries_LHTD, "LHTD"), ("keys", keys_LGTD, "LGTD")):
    if not hasattr(x, "ndim") or x.ndim != 4:
      shape = getattr(x, "shape", type(x).__name__)
      raise ValueError(f"{name}: expected a rank-4 array [{', '.join(letters)}], got {shape}")
  if (
    isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < select.INT32_LIMIT
  ):
    raise ValueError(f"window: expected an int >= 1 (observation queries), got {window!r}")
  if (
    isinstance(legacy_window, bool)
    or not isinstance(legacy_window, int)
    or not 0 <= legacy_window < select.INT32_LIMIT
  ):
    raise ValueError(f"legacy_window: expected an int >= 0, got {legacy_window!r}")
  if not isinstance(column_sums, bool):
    raise ValueError(f"column_sums: expected a bool, got {column_sums!r}")
  T = queries_LHTD.shape[2]
  attn = scores_lib.window_attention(queries_LHTD[:, :, T - min(window, T) :], keys_LGTD)
  sums = legacy = None
  if column_sums:
    sums = scores_lib.attention_column_sums(queries_LHTD, keys_LGTD, mask="causal")
    legacy = scores_lib.attention_column_sums(
      queries_LHTD, keys_LGTD, mask="kvfactory_legacy", window=legacy_window
    )
  return Evidence(
    attn_window_LHWT=attn,
    column_sums_LHT=sums,
    legacy_column_sums_LHT=legacy,
    keys_LGTD=keys_LGTD,
    rng=rng,
  )
