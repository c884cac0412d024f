"""The policy protocol: a typed, frozen object that scores, allocates and selects.

Subclass one of

* :class:`Policy` (:mod:`~kvjax.policies.core`): a prefill scorer; write :meth:`Policy.score`
  (``Evidence -> scores_LHT``, higher keeps) and list the evidence it reads in ``needs``;
* :class:`WindowPolicy` (:mod:`~kvjax.policies.window`): a scorer of the observation window's
  rows; write :meth:`WindowPolicy.score_rows` and a prefill may reduce each layer's rows as it
  forms them;
* :class:`DecodePolicy` (:mod:`~kvjax.policies.decode_policy`): a decode-time evictor, a small
  state machine over the cache's slots (:meth:`DecodePolicy.init_state`,
  :meth:`DecodePolicy.observe`, :meth:`DecodePolicy.keep_scores`) that the model's cache and the
  lab's replay both run;

and opt into a protocol by listing its mixin first (:mod:`~kvjax.policies.protocols`):
:class:`Rescoring` (a budget-dependent last score stage), :class:`ValueMerging` (merge-on-evict
at compression), :class:`DecodeMerging` (merging while decoding).

Every policy takes an :class:`~kvjax.policies.allocators.Allocator` (``allocator=``) and the
common options of :class:`Policy`; the pipeline is ``scores`` -> ``budgets`` ->
``selection_scores`` -> :mod:`kvjax.select`. Every policy inherits the budget checks
(:mod:`~kvjax.policies.budget_rules`), the re-compression hooks
(:mod:`~kvjax.policies.recompression`) and its evidence request
(:mod:`~kvjax.policies.observation`); the option checks are :mod:`~kvjax.policies.checks`.
"""

from kvjax.policies.budget_rules import BudgetRules
from kvjax.policies.checks import check_bool, check_choice, check_int, check_window
from kvjax.policies.core import Policy
from kvjax.policies.decode_policy import (
  DecodePolicy,
  check_decode_output,
  checked_init_state,
  checked_keep_scores,
  checked_observe,
  gather_slots,
)
from kvjax.policies.observation import Observation
from kvjax.policies.protocols import DecodeMerging, Rescoring, ValueMerging
from kvjax.policies.recompression import Recompression
from kvjax.policies.window import WindowPolicy, WindowScorer

__all__ = [
  "BudgetRules",
  "DecodeMerging",
  "DecodePolicy",
  "Observation",
  "Policy",
  "Recompression",
  "Rescoring",
  "ValueMerging",
  "WindowPolicy",
  "WindowScorer",
  "check_bool",
  "check_choice",
  "check_decode_output",
  "check_int",
  "check_window",
  "checked_init_state",
  "checked_keep_scores",
  "checked_observe",
  "gather_slots",
]
