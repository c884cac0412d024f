"""Memory plans per chip (kvjax.eval.memory_plan): compiled plans of a tiny shape, the search, bad
input."""

import jax
import pytest

from kvjax.eval import memory_plan as mp
from kvjax.model.config import ModelConfig

TINY = ModelConfig(
  vocab_size=256,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_positions=2048,
)


def test_longer_prompts_and_larger_caches_plan_more_bytes():
  """The compiled peak grows with the prompt; a 10 % cache plans no more than the full one;
  half the weights per device plan fewer bytes."""
  short, long = mp.plan(TINY, "snapkv", 1.0, 128), mp.plan(TINY, "snapkv", 1.0, 512)
  assert 0 < short.peak < long.peak and short.weights == long.weights
  assert long.cache > short.cache > 0
  tenth = mp.plan(TINY, "snapkv", 0.1, 512)
  assert tenth.cache < long.cache and tenth.peak <= long.peak
  assert tenth.prefill == long.prefill  # one prefill compile serves every fraction
  halved = mp.plan(TINY, "snapkv", 1.0, 512, workload=mp.Workload(shards=2))
  assert halved.weights < long.weights and halved.peak < long.peak


def test_search_finds_the_last_fitting_grid_point():
  """Doubling then bisection lands on the longest grid point that fits, evaluating few."""
  tokens, tried = mp.longest_fitting(lambda t: 10 * t, 10 * 5000, step=1000, max_tokens=9000)
  assert tokens == 5000 and len(tried) <= 6
  assert mp.longest_fitting(lambda t: t, 10**9, step=1000, max_tokens=9500)[0] == 9000
  assert mp.longest_fitting(lambda t: t, 999, step=1000, max_tokens=9000) == (0, [1000])


def test_a_tenth_of_the_cache_fits_at_least_as_long_a_prompt(monkeypatch):
  """Against a chip of the tiny plans' size, the longest prompt is 0 < T <= the context, and a
  10 % cache fits at least as long a prompt as the full one."""
  peak = mp.plan(TINY, "snapkv", 1.0, 512).peak
  monkeypatch.setitem(mp.CHIPS, "tiny", mp.Chip("tiny", peak / mp.GiB, "cpu", "tiny"))
  full = mp.longest_prompt(TINY, "snapkv", 1.0, "tiny", headroom=0.0, step=256)
  tenth = mp.longest_prompt(TINY, "snapkv", 0.1, "tiny", headroom=0.0, step=256)
  assert 512 <= full <= tenth <= mp.max_prompt(TINY)


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: mp.longest_prompt(TINY, "snapkv", 0.1, "v7x-1"), "chip: unknown chip 'v7x-1'"),
    (lambda: mp.plan(TINY, "snapkv", 0.0, 128), r"fraction: expected a number in \(0, 1\]"),
    (lambda: mp.plan(TINY, "snapkv", 1.5, 128), r"fraction: .* got 1.5"),
    (lambda: mp.plan(TINY, "pyramid", 0.1, 128), "family: unknown policy family 'pyramid'"),
    (lambda: mp.plan(TINY, "snapkv", 0.1, 0), "tokens: expected an int >= 1"),
    (
      lambda: mp.plan(TINY, "snapkv", 0.1, 128, workload=mp.Workload(shards=3)),
      "shards: 3 does not divide",
    ),
    (lambda: mp.longest_prompt(TINY, "snapkv", 0.1, "t4", headroom=1.0), "headroom: expected"),
    (lambda: mp.longest_fitting(len, 1, step=0, max_tokens=8), "step: expected an int >= 1"),
    (lambda: mp.settings_for_device(model="gpt-5"), "model: unknown model 'gpt-5'"),
    (lambda: mp.settings_for_device(fraction=0.5), "fraction: 0.5 has no plan"),
  ],
)
def test_bad_input_names_the_argument(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_settings_for_device_reads_the_table_or_falls_back():
  """A listed chip reads its row of the table (the most shards the devices allow); a CPU, or a
  chip the model does not fit, gets the CPU default."""

  class Device:
    platform, device_kind = "tpu", "TPU v5 lite"

  table = {
    ("llama-3.1-8b", "v5e-1", 1): {("snapkv", 0.1): 0},
    ("llama-3.1-8b", "v5e-1", 2): {("snapkv", 0.1): 65536},
  }
  assert mp.detect_chip([Device()]) == "v5e-1"
  one = mp.settings_for_device(devices=[Device()], table=table)
  assert one == {"chip": "v5e-1", "shards": 1, "tokens": mp.CPU_DEFAULT, "source": "default"}
  two = mp.settings_for_device(devices=[Device(), Device()], table=table)
  assert two == {"chip": "v5e-1", "shards": 2, "tokens": 65536, "source": "plan"}
  here = mp.settings_for_device(devices=jax.devices("cpu"), table=table)
  assert here["chip"] is None and here["tokens"] == mp.CPU_DEFAULT


def test_an_evaluation_keeps_the_lengths_every_family_fits_beside_the_full_cache():
  """The notebooks' lengths: a planned model keeps the lengths below the strictest family's
  plan at 100 % on the chip found (the CPU default on a CPU); a model of no planned shape keeps
  every length."""

  class Device:
    platform, device_kind = "gpu", "NVIDIA L4"

  families = tuple(mp.FAMILIES)
  table = {("qwen3-8b", "l4", 1): {(f, 1.0): 12288 for f in families}}
  table[("qwen3-8b", "l4", 1)][(families[-1], 1.0)] = 6144  # the strictest family
  assert mp.planned_model("Qwen/Qwen3-8B") == "qwen3-8b"
  assert mp.planned_model("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
  assert mp.planned_model("tiny") is None
  fit = mp.fitting_lengths("Qwen/Qwen3-8B", (4096, 8192, 16384), devices=[Device()], table=table)
  assert fit == {
    "lengths": (4096,),
    "dropped": (8192, 16384),
    "limit": 6144,
    "chip": "l4",
    "source": "plan",
  }
  cpu = mp.fitting_lengths("Qwen/Qwen3-8B", (1024, 8192), devices=jax.devices("cpu"))
  assert cpu["lengths"] == (1024,) and cpu["limit"] == mp.CPU_DEFAULT and cpu["source"] == "default"
  tiny = mp.fitting_lengths("tiny", (1024, 65536), devices=[Device()])
  assert tiny["lengths"] == (1024, 65536) and tiny["source"] == "no plan"
  with pytest.raises(ValueError, match="lengths: expected an int >= 1, got 0"):
    mp.fitting_lengths("tiny", (1024, 0))
