"""A method's paper, reference code and named differences are written once, in its registration:
:func:`kvjax.policies.provenance` reads a built-in's preset, a wrapper prefix's entry, or a
user's class attributes."""

import dataclasses

import pytest

from kvjax import policies
from kvjax.policies import builtins, registry


@pytest.mark.parametrize("name", list(builtins.PRESETS))
def test_every_built_in_name_reads_its_provenance_from_its_registration(name):
  preset = registry.factory(name)
  assert isinstance(preset, registry.Preset) and preset is registry.BUILTIN[name]
  assert isinstance(preset.provenance, builtins.Provenance), name
  assert policies.provenance(name) == dataclasses.asdict(preset.provenance)


def test_a_baseline_states_an_empty_provenance():
  assert policies.provenance("full") == dict(paper="", code="", differs="")


def test_snapkv_provenance_is_the_papers_and_the_official_code():
  assert policies.provenance("snapkv") == {
    "paper": "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation "
    "(arXiv 2404.14469)",
    "code": "FasterDecoding/SnapKV `snapkv/monkeypatch/snapkv_utils.py::SnapKVCluster.update_kv`",
    "differs": "kept positions in ascending order (upstream keeps top-k order; attention is "
    "unaffected); scores stay float32 (upstream casts the softmax to fp16/bf16 before summing)",
  }


def test_a_wrapper_reads_its_prefix_and_adds_its_bases_differences():
  source = builtins.WRAPPERS["critical_"][1]
  assert policies.provenance("critical_knorm") == {
    "paper": source.paper,
    "code": "kvpress 0.5.5 `CriticalKVPress`",
    "differs": f"{source.differs}; the base `knorm`: "
    "none: kept sets equal the reference's in the golden tests",
  }
  assert policies.provenance("critical_adakv_snapkv")["code"] == (
    "kvpress 0.5.5 `CriticalAdaKVPress`"
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Mine(policies.KNorm):
  """My key-norm variant."""

  paper = "Me et al., My Method (arXiv 0000.00000)"
  code = "me/my-method `score.py`"
  differs = "mine"


def test_a_users_class_reports_its_own_class_attributes():
  policies.register("mine_for_provenance", _Mine)
  try:
    assert policies.provenance("mine_for_provenance") == dict(
      paper=_Mine.paper, code=_Mine.code, differs="mine"
    )
  finally:
    policies.unregister("mine_for_provenance")


def test_a_user_class_over_a_built_in_name_reports_its_own_until_unregistered():
  before = policies.provenance("knorm")
  policies.register("knorm", _Mine, overwrite=True)
  try:
    assert policies.provenance("knorm")["paper"] == _Mine.paper
  finally:
    policies.unregister("knorm")
  assert policies.provenance("knorm") == before


def test_a_user_preset_without_provenance_reads_its_class():
  policies.register("mine_preset_for_provenance", registry.Preset(_Mine, doc="mine"))
  try:
    assert policies.provenance("mine_preset_for_provenance")["code"] == _Mine.code
  finally:
    policies.unregister("mine_preset_for_provenance")
