"""Accuracy under compression on a real model: RULER-style tasks (``tasks`` over the ``vocab``
words), the evaluation grid (``evaluate``), attention funnel statistics (``funnel``), training of
the tiny model (``train``) and its model card (``card``)."""
