"""StreamingLLM's experiment reproduced: ``python -m experiments.streaming_ppl
--config=configs/streaming_ppl.py [--config.workdir=DIR]`` prints the perplexity of one long
text under the full cache, a sliding window and sinks + window, and writes ``results.csv`` and
``streaming_ppl.png`` into the workdir."""

import os
import pathlib

import jax.numpy as jnp
import matplotlib
from absl import app

from configs import common
from kvjax import plotting, rundir
from kvjax.eval import evaluate, streaming

_CONFIG = common.config_flag(
  str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "streaming_ppl.py"),
  "Streaming perplexity configuration.",
  lock_config=True,
)


def main(argv):
  del argv
  matplotlib.use("Agg")  # figures go to files
  config = _CONFIG.value
  rundir.check_workdir(config.workdir)  # "" would be the current directory: refused
  dtypes = ("auto", "float32", "bfloat16", "float16")
  if config.dtype not in dtypes:
    raise ValueError(f"dtype: expected one of {dtypes}, got {config.dtype!r}")
  dtype = None if config.dtype == "auto" else jnp.dtype(config.dtype)
  model, _, tokenizer = evaluate.load_model(config.model, dtype=dtype)
  table = streaming.run(config, config.workdir, model=model, tokenizer=tokenizer)
  fig = plotting.streaming_ppl(
    table, config.segment, title=f"{config.model}: {streaming.TEXT_SOURCE}"
  )
  fig.savefig(os.path.join(config.workdir, "streaming_ppl.png"), dpi=110)
  print(table.drop(columns="segments").to_string(index=False))
  print(f"run directory: {os.path.abspath(config.workdir)}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
