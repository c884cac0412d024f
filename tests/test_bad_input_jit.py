"""Value checks under the caller's own ``jax.jit``: traced counts, reals and finite arrays are
checked by ``checkify`` when the caller asks for it (``checkify.checkify(jax.jit(fn))`` reports
the message the concrete check raises), and dropped under a plain ``jax.jit`` (results
unchanged). See kvjax.checks and docs/bad_input.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from kvjax import budgets, checks

WEIGHTS_L = jnp.asarray([1.5, 2.5, 4.0])


def _concrete_message(fn, *args) -> str:
  with pytest.raises(ValueError) as e:
    fn(*args)
  return str(e.value)


@pytest.mark.parametrize(
  ("fn", "args"),
  [
    (budgets.round_to_total, (WEIGHTS_L, np.int32(-3))),  # a negative count
    (budgets.adjust_budgets, (WEIGHTS_L.at[1].set(jnp.nan), np.int32(8), np.int32(4))),  # NaN
  ],
)
def test_checkify_reports_under_jit_what_the_concrete_check_raises(fn, args):
  said = _concrete_message(fn, *args)
  err, _ = checkify.checkify(jax.jit(fn))(*args)
  assert err.get() is not None and err.get().startswith(said)
  with pytest.raises(checkify.JaxRuntimeError, match=said.split(";")[0]):
    err.throw()


def test_a_plain_jit_drops_the_traced_checks_and_keeps_the_results():
  """No check runs under a plain jit (the values are traced): a good call's result is the
  eager one, and a bad call is not refused (the documented limit, which checkify lifts)."""
  good = (WEIGHTS_L, np.int32(8))
  np.testing.assert_array_equal(
    jax.jit(budgets.round_to_total)(*good), budgets.round_to_total(*good)
  )
  jax.jit(budgets.round_to_total)(WEIGHTS_L, np.int32(-3))  # no error: traced, unchecked
  err, out = checkify.checkify(jax.jit(budgets.round_to_total))(*good)
  assert err.get() is None
  np.testing.assert_array_equal(out, budgets.round_to_total(*good))


@pytest.mark.parametrize(
  ("check", "value", "said"),
  [
    (
      lambda v: checks.counts("budget", v, minimum=1),
      jnp.asarray([3, 0]),
      "budget: expected counts >= 1, got minimum 0",
    ),
    (
      lambda v: checks.real("temp", v, 0.0, strict=True),
      jnp.float32(-1.0),
      "temp: expected a finite value with temp > 0.0, got -1.0",
    ),
    (
      lambda v: checks.real("alpha", v, 0.0, high=1.0),
      jnp.float32(jnp.inf),
      "alpha: expected a finite value with 0.0 <= alpha <= 1.0, got inf",
    ),
    (
      lambda v: checks.finite("attn", v),
      jnp.asarray([0.5, jnp.inf]),
      "attn: contains NaN or inf; expected finite values",
    ),
  ],
)
def test_each_traced_check_under_checkify(check, value, said):
  err, _ = checkify.checkify(jax.jit(check))(value)
  assert err.get().startswith(said)
  err, _ = checkify.checkify(jax.jit(jax.vmap(check)))(value[None])  # batched too
  assert err.get().startswith(said)
