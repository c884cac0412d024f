"""Fast KVzip's evidence: small per-layer gates, trained on KVzip's scores, that score every KV
pair from its attention input (Fast KVzip, Kim, Han and Yun, NAVER AI Lab, arXiv 2601.17668;
kvpress 0.5.5 ``presses/fastkvzip_press.py::FastKVzipPress`` and the official training code of
``Janghyun1230/FastKVzip``: ``optim.py``, ``utils.py``, ``load_data.py``, ``prefill/feature.py``).

* :func:`gate_scores`: the gates (kvpress ``FastKVzipGate``, a "low-rank sink attention") applied
  to attention inputs;
* :func:`gate_targets` -> ``(X_NLd, y_NLG)``: the training pairs, each context position's
  attention input at every layer and its KVzip score per KV head
  (:func:`kvjax.model.reconstruction.kvzip_evidence`), as ``prefill/feature.py`` collects them;
* :func:`train_gates`: the official ``optim.py`` with optax (binary cross-entropy, SGD with
  momentum 0.9 at 0.2, its step schedule, batches of 1000 positions), checkpointed with orbax;
* :func:`save` / :func:`load`: an ``.npz`` file with a json header, checked against the model;
* :func:`fastkvzip_evidence` -> ``fastkvzip_LGT``, the evidence
  :class:`kvjax.policies.fastkvzip.FastKVzip` reads.

The gates of one model are a dict of arrays stacked over layers (``L`` layers, model dim ``d``,
``G`` KV heads, ``R`` query heads per KV head, gate dim ``D`` 16, ``S`` 16 sink keys):

* ``wq [L, d, G*R*D]``, ``bq [L, G*R*D]``: ``q_proj`` (torch's ``weight`` transposed, its bias);
* ``wk [L, d, G*D]``: ``k_proj`` (no bias);
* ``q_norm [L, D]``, ``k_norm [L, D]``: the scales of ``Qwen3RMSNorm`` (eps 1e-6);
* ``k_base [L, G, S, D]``: the learned sink keys (kvpress ``[G, 1, S, D]`` per layer);
* ``b [L, G, R]``: the logit bias (kvpress ``[G, 1, R]`` per layer).

The gates, their files and the evidence live in :mod:`kvjax.model.fastkvzip_gates`, the
training and the experiment in :mod:`kvjax.model.fastkvzip_training`; this module re-exports
both.

The model passes are plain layer loops (``lax.scan`` over the stacked layers) built on the public
functions of :mod:`kvjax.model.llama`, with dense attention; gates and scores are fp32.
"""

from __future__ import annotations

# The gates and their training live beside this module; fastkvzip.X reaches every part.
from kvjax.model.fastkvzip_gates import (  # noqa: F401
  DIM,
  EPS,
  FORMAT,
  PARAM_KEYS,
  SINK,
  check_gates,
  dims_of,
  expected_shapes,
  fastkvzip_evidence,
  gate_scores,
  init_gates,
  load,
  model_dims,
  save,
  shapes_of,
)
from kvjax.model.fastkvzip_training import (  # noqa: F401
  ACC_THRESHOLD,
  BATCH_SIZE,
  COLUMNS,
  LR,
  MAX_STEPS,
  MOMENTUM,
  TEST_EVERY,
  TEST_FREQ,
  GateConfig,
  GateTraining,
  accuracy,
  bce,
  compare_with_kvzip,
  experiment,
  gate_targets,
  holdout_split,
  layer_losses,
  loss,
  lr_schedule,
  optimizer,
  train_gates,
)
