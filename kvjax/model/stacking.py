"""Parameters stacked over layers (``[L, ...]``), split per layer, and sliced inside a loop.

The layers' parameters are stacked so the forward pass is a ``lax.scan`` over layers (one
compiled layer); an unrolled loop reads them split into one array per layer instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# parameters outside the layer stack (everything else is stacked over a leading layer axis)
UNSTACKED = ("embed", "final_norm", "lm_head")


def stacked(params: dict) -> dict:
  """Selects the per-layer parameters, each ``[L, ...]``: what the layer scan iterates over.

  Args:
    params: the parameter pytree.

  Returns:
    The parameters other than :data:`UNSTACKED` (``embed``, ``final_norm``, ``lm_head``).
  """
  return {
    k: jnp.stack(v) if isinstance(v, tuple) else v for k, v in params.items() if k not in UNSTACKED
  }


def unstacked_params(params: dict) -> dict:
  """Splits each per-layer parameter into a tuple of its ``L`` layers' arrays.

  An unrolled layer loop reads layer ``l``'s arrays as they are; slicing the stacked ``[L, ...]``
  arrays copies them on XLA:CPU (``kvjax.model.cache.per_layer`` uses this form for a loop of
  decode steps). :func:`layer_params` and :func:`stacked` read either form.

  Args:
    params: the parameter pytree (stacked, or already split).

  Returns:
    The parameters, each of :func:`stacked`'s a tuple of ``L`` arrays.
  """
  return {
    k: v if k in UNSTACKED or isinstance(v, tuple) else tuple(v[l] for l in range(v.shape[0]))
    for k, v in params.items()
  }


def layer_params(params: dict, layer) -> dict:
  """Slices one layer out of the stacked parameters.

  Args:
    params: the parameter pytree (stacked, or split by :func:`unstacked_params`, then ``layer``
      an int).
    layer: the layer's index (an int or a traced scalar).

  Returns:
    The layer's parameters, each without the leading ``L`` axis.
  """
  return {k: v[layer] for k, v in stacked(params).items()}


def sliced_in_loop(tree, index):
  """Passes ``tree`` and ``index`` through an optimisation barrier on CPU, before a loop body
  slices the tree at the index.

  XLA's CPU backend computes 16-bit math in fp32 and converts a loop-invariant operand *before*
  the loop would slice it (an fp32 copy of every layer's weights at once: 4.6 GiB for a 1B model
  in bf16); behind the barrier the conversion fuses into the slice, one layer (or vocabulary
  chunk) at a time. Elsewhere it is the identity.

  Args:
    tree: the pytree the loop body slices (stacked weights, a cache, a head).
    index: the loop's index (traced).

  Returns:
    ``(tree, index)``, unchanged in value.
  """
  if jax.default_backend() != "cpu":
    return tree, index
  return jax.lax.optimization_barrier((tree, index))
