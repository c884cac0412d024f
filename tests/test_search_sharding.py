"""The allocation search's population over a one-axis device mesh (2 forced host devices, in a
subprocess): the sharded population call gives what one device gives."""

import json
import subprocess
import sys

from conftest import forced_devices_env

# a lab table and a population of 5 (odd: padded to 6 over 2 devices), evaluated over both
# devices and over the first alone, under the free space and a named allocator's space
_RUN = """
import json
import jax, numpy as np
from kvjax.eval.search import allocator_spaces, fitness, optimise
from kvjax.eval.search.space import Space
world = dict(num_layers=4, num_heads=2, prompt_len=64, gen_steps=16, head_dim=8, window=8, seed=0)
table = fitness.lab_table("needle_qa", world, fitness.lab_policy("snapkv", 4))
rng = np.random.default_rng(0)
out = dict(devices=len(jax.devices()))
spaces = dict(free=Space.from_budget((4, 2), 12, 4, 64),
  pyramid=allocator_spaces.PyramidSpace.from_budget((4,), 12, 4, 64))
for name, space in spaces.items():
  params = rng.normal(size=(5, space.num_params)) * 2
  both = optimise.population_call(space, fitness.retained_mass, table)
  one = optimise.population_call(space, fitness.retained_mass, table, devices=jax.devices()[:1])
  fit, alloc = both(params)
  fit1, alloc1 = one(params)
  out[name] = dict(spans=len(both.devices), shape=list(alloc.shape),
    fit=np.asarray(fit, np.float64).tolist(), alloc=np.asarray(alloc).tolist(),
    fit1=np.asarray(fit1, np.float64).tolist(), alloc1=np.asarray(alloc1).tolist())
print(json.dumps(out))
"""


def test_the_population_sharded_over_two_devices_equals_one_device():
  run = subprocess.run(
    [sys.executable, "-c", _RUN],
    env=forced_devices_env(2),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  two = json.loads(run.stdout.strip().splitlines()[-1])
  assert two["devices"] == 2
  for name in ("free", "pyramid"):
    r = two[name]
    assert r["spans"] == 2 and r["shape"][0] == 5, name
    assert r["alloc"] == r["alloc1"], name
    assert r["fit"] == r["fit1"], name
