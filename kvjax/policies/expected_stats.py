"""ExpectedAttention with query statistics measured on a corpus (kvpress
``ExpectedAttentionStatsPress``).

Reference: kvpress 0.5.5 ``kvpress/presses/expected_attention_with_stats.py``
(``ExpectedAttentionStatsPress``, and ``collect_queries`` for the statistics). kvpress downloads
the statistics from the Hugging Face hub; kvjax measures them with
:func:`kvjax.model.calibrate.query_stats` on text it ships (``python -m experiments.calibrate``
writes them into ``calibration.npz``) and passes them as caller-given evidence.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.policies.core import Policy
from kvjax.policies.evidence import EvidenceRequest
from kvjax.policies.methods import ExpectedAttention

STATS_FIELDS = frozenset({"stats_query_mean_LHD", "stats_query_cov_LHDD"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttentionStats(ExpectedAttention):
  """kvpress ``ExpectedAttentionStatsPress``: ExpectedAttention whose query mean and covariance
  are measured once on a corpus instead of on the prompt.

  The statistics (``stats_query_mean_LHD``, ``stats_query_cov_LHDD``: pre-RoPE queries after
  the first ``n_sink`` tokens of each calibration row, covariance divided by ``N - 1``, as
  kvpress's ``collect_queries``) are caller-given evidence; the model's cache rotates them for
  each row by the average RoPE over the row's next 512 positions
  (:func:`kvjax.model.cache.rotated_query_stats`, kvpress ``apply_avg_rope`` with the prompt's
  length) into ``query_mean_LHD`` / ``query_cov_LHDD``, which :meth:`score` reads as
  ExpectedAttention does. The prefill then computes no query statistics of its own.

  Differences from kvpress: the statistics come from kvjax's calibration text (Python's pydoc
  topics, shipped with Python) rather than ``kmfoda/booksum``; rows are cut to equal token
  lengths (kvpress cuts each book chapter to 1,000 characters). It does not re-compress while
  decoding (``decode_every``): a re-compression has no prompt length to rotate by.
  """

  needs: ClassVar[frozenset[str]] = STATS_FIELDS | {"keys_LGTD", "values_LGTD"}

  def __post_init__(self):
    super().__post_init__()
    if self.decode_every is not None:
      raise ValueError(
        f"decode_every: ExpectedAttentionStats scores the prompt only; expected None, got "
        f"{self.decode_every!r}"
      )

  def evidence_request(self, T: int, *, reduce_rows: bool = False) -> EvidenceRequest:
    """The keys and values only: the prefill measures no query statistics of its own.

    Args:
      T: the prompt's length.
      reduce_rows: unused (no window rows).

    Returns:
      The :class:`EvidenceRequest`.
    """
    return Policy.evidence_request(self, T, reduce_rows=reduce_rows)

  def score(self, evidence):
    """Expected attention times ``||v||`` under the corpus's rotated statistics.

    Args:
      evidence: the row's evidence, with ``query_mean_LHD`` / ``query_cov_LHDD`` rotated from
        the statistics by the model's cache.

    Returns:
      fp32 scores ``[L, Hq, T]``.

    Raises:
      ValueError: when the rotated statistics are absent (the statistics were not given, or the
        policy runs outside the model's cache).
    """
    if evidence.query_mean_LHD is None:
      raise ValueError(
        f"evidence: policy {self.label!r} needs the corpus's query statistics rotated by the "
        "model's cache; pass evidence={'stats_query_mean_LHD': ..., 'stats_query_cov_LHDD': ...}"
        " (kvjax.model.calibrate.query_stats) to a kvjax.model entry point"
      )
    return super().score(evidence)
