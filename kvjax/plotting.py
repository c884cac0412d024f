"""Figures (matplotlib; the backend is the entry point's choice): the lab's four-panel figure, sweeps, accuracy."""

from __future__ import annotations

import json
import pathlib

import matplotlib.pyplot as plt
import numpy as np


def close(fig) -> None:
  plt.close(fig)


def cache_fraction(trace, step: int, total_len: int) -> np.ndarray:
  """Fraction of (layer, head) rows caching each position at ``step``: ``[T]``."""
  pos = np.asarray(trace.positions_SLHC[step])
  valid = np.asarray(trace.valid_SLHC[step])
  counts = np.bincount(pos[valid].ravel(), minlength=total_len)
  return counts / (pos.shape[0] * pos.shape[1])


def lab_figure(
  traces: dict,
  step: int,
  focus: str,
  *,
  prompt_len: int,
  facts_T: np.ndarray,
  active_T: np.ndarray,
  row_LHT: np.ndarray,
  title: str = "",
):
  """Four panels: retained mass over steps per policy; each policy's cache map at ``step`` with
  the old facts ``facts_T`` marked (the ones queried at ``step``, ``active_T``, stronger); the
  full attention row ``row_LHT`` of that step in gray with the part ``focus`` retains over it;
  retained mass per layer (the funnel)."""
  T, P = row_LHT.shape[-1], prompt_len
  fig, axes = plt.subplots(2, 2, figsize=(14, 9))
  ax_mass, ax_map, ax_row, ax_layer = axes.ravel()
  for name, (trace, summary) in traces.items():
    mass = np.asarray(trace.metrics.retained).mean((1, 2))
    ax_mass.plot(mass, label=f"{name} ({summary['retained_mass']:.2f})", lw=1.4)
    ax_layer.plot(summary["retained_mass_L"], marker="o", label=name)
  ax_mass.axvline(step, color="k", ls=":", lw=1)
  ax_mass.set(xlabel="generated token", ylabel="retained mass R_t", title="Retained attention mass")
  ax_mass.legend(fontsize=7, ncol=2)
  ax_layer.set(xlabel="layer", ylabel="mean retained mass", title="Retained mass by layer")
  ax_layer.legend(fontsize=7, ncol=2)

  names = list(traces)
  grid = np.stack([cache_fraction(traces[n][0], step, T) for n in names])
  ax_map.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
  ax_map.set_yticks(range(len(names)), names, fontsize=8)
  active = np.asarray(active_T)
  for p in np.flatnonzero(np.asarray(facts_T)):
    ax_map.axvline(p, color="red", lw=2.0 if active[p] else 0.8, alpha=0.9 if active[p] else 0.35)
  ax_map.axvline(P + step, color="tab:blue", lw=1)
  ax_map.set(xlabel="position", title=f"Cache map at step {step} (share of layer-heads holding it)")

  row = np.asarray(row_LHT)
  mean_row = row.mean((0, 1))
  trace = traces[focus][0]
  kept = np.zeros(row.shape, bool)
  pos, valid = np.asarray(trace.positions_SLHC[step]), np.asarray(trace.valid_SLHC[step])
  np.put_along_axis(kept, pos, valid, axis=-1)
  ax_row.bar(np.arange(T), mean_row, width=1.0, color="0.7", label="full attention")
  ax_row.bar(
    np.arange(T), (row * kept).mean((0, 1)), width=1.0, color="tab:purple", label=f"kept by {focus}"
  )
  ax_row.set_yscale("log")
  ax_row.set_ylim(max(mean_row[mean_row > 0].min(), 1e-6), None)
  ax_row.set(
    xlabel="position", ylabel="attention (mean over layers, heads)", title=f"Row at step {step}"
  )
  ax_row.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  return fig


# --------------------------------------------------------------------------- sweeps


def _label(frame, keys) -> str:
  return "/".join(str(frame[k]) for k in keys)


def sweep_metric_vs_budget(table, metric: str = "retained_mass"):
  """One panel per policy: ``metric`` against the total budget, a line per layer schedule and
  head allocation (mean over the other swept fields)."""
  policies = sorted(table["policy"].unique())
  fig, axes = plt.subplots(1, len(policies), figsize=(4.2 * len(policies), 3.6), squeeze=False)
  for ax, policy in zip(axes[0], policies, strict=True):
    sub = table[table["policy"] == policy]
    lines = sub.groupby(["schedule", "head_alloc", "budget"])[metric].mean().reset_index()
    for (schedule, head), line in lines.groupby(["schedule", "head_alloc"]):
      ax.plot(line["budget"], line[metric], marker="o", label=f"{schedule}/{head}")
    ax.set(xscale="log", xlabel="budget per head", ylabel=metric, title=policy)
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def budget_profiles(table):
  """Mean per-layer budget of each layer schedule (and head allocation), one line each."""
  fig, ax = plt.subplots(figsize=(6, 3.8))
  budget = sorted(table["budget"].unique())[len(table["budget"].unique()) // 2]
  sub = table[table["budget"] == budget]
  for (schedule, mode), group in sub.groupby(["schedule", "pyramid_mode"]):
    profile = np.mean([json.loads(p) for p in group["budget_profile"]], axis=0)
    label = schedule if schedule != "pyramid" else f"pyramid ({mode})"
    ax.plot(profile, marker="o", label=label)
  ax.set(
    xlabel="layer",
    ylabel="budget (mean over heads)",
    title=f"Layer budget profiles at budget {budget}",
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def pareto(table, metric: str = "retained_mass"):
  """``metric`` against cache bytes for every configuration, with each policy's frontier."""
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for policy, sub in table.groupby("policy"):
    ax.scatter(sub["cache_bytes"], sub[metric], s=10, alpha=0.5, label=policy)
    ordered = sub.sort_values("cache_bytes")
    front = ordered[ordered[metric] >= ordered[metric].cummax()]
    ax.plot(front["cache_bytes"], front[metric], lw=1)
  ax.set(xscale="log", xlabel="cache bytes (K and V)", ylabel=metric, title="Pareto view")
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


# --------------------------------------------------------------------------- task accuracy


def _interval(frame, metric: str):
  """``(low, high)`` columns of ``metric``'s interval, or ``None`` when ``frame`` has none."""
  lo, hi = f"{metric}_lo", f"{metric}_hi"
  if lo in frame.columns and hi in frame.columns and frame[lo].notna().any():
    return lo, hi
  return None


def accuracy_vs_budget(table, metric: str = "accuracy"):
  """One panel per task: ``metric`` against the per-head budget, a line per policy (mean over
  context lengths); the full cache as a dashed line. A table with ``{metric}_lo`` and
  ``{metric}_hi`` columns also gets each interval drawn, a band around each line and around the
  full cache's, where a point is one row (an evaluation's summary,
  :func:`kvjax.eval.report.plot_summaries`): the interval of a mean over several rows is not
  the mean of theirs, so none is drawn there."""
  if "kind" in table.columns:
    table = table[table["kind"] == "budget"]
  band = _interval(table, metric)
  task_names = list(dict.fromkeys(table["task"]))
  cols = min(len(task_names), 4)
  rows = -(-len(task_names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
  for ax, task in zip(axes.flat, task_names, strict=False):
    sub = table[table["task"] == task]
    full_rows = sub[sub["policy"] == "full"]
    full = full_rows[metric].mean()
    for i, (policy, rows) in enumerate(sub[sub["policy"] != "full"].groupby("policy")):
      line = rows.groupby("budget")[metric].mean()
      # 12+ policies: tab20 colours and alternating markers keep every line distinguishable
      style = dict(color=plt.cm.tab20(i % 20), marker="osD^v<>"[i % 7], ms=3)
      ax.plot(line.index, line.values, label=policy, **style)
      if band and rows.groupby("budget").size().max() == 1:
        ends = rows.groupby("budget")[list(band)].mean()
        ax.fill_between(ends.index, ends[band[0]], ends[band[1]], color=style["color"], alpha=0.12)
    ax.axhline(full, color="k", ls="--", lw=1, label="full")
    if band and len(full_rows) == 1:
      ax.axhspan(full_rows[band[0]].mean(), full_rows[band[1]].mean(), color="k", alpha=0.06)
    ax.set(xscale="log", xlabel="budget per head (tokens)", ylabel=metric, title=task)
  for ax in list(axes.flat)[len(task_names) :]:
    ax.axis("off")
  handles, labels = axes.flat[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  return fig


def accuracy_vs_memory(summary, metric: str = "accuracy"):
  """One panel per context length: ``metric`` against the K/V bytes each policy's compressed
  cache held per example (log scale), a line per policy over its budgets, the full cache as a
  star; the intervals (``{metric}_lo``/``{metric}_hi``) as error bars when given.

  Args:
    summary: one row per (length, policy, budget) with ``kv_bytes_held`` and ``metric`` (the
      full cache's row without a budget): an evaluation's summary.
    metric: the column drawn.

  Returns:
    The figure.
  """
  band = _interval(summary, metric)
  lengths = list(dict.fromkeys(summary["length"]))
  fig, axes = plt.subplots(
    1, len(lengths), figsize=(4.6 * len(lengths), 3.8), squeeze=False, sharey=True
  )
  for ax, length in zip(axes[0], lengths, strict=True):
    sub = summary[summary["length"] == length]
    # the policies in accuracy_vs_budget's order and colours, the full cache last
    lines = [
      *sub[sub["policy"] != "full"].groupby("policy"),
      ("full", sub[sub["policy"] == "full"]),
    ]
    for i, (policy, line) in enumerate(lines):
      if line.empty:
        continue
      line = line.sort_values("kv_bytes_held")
      y = line[metric].to_numpy(float)
      err = None
      if band:  # error bars: distances from the mean to each end
        err = np.clip(
          [y - line[band[0]].to_numpy(float), line[band[1]].to_numpy(float) - y], 0, None
        )
      if policy == "full":
        style = dict(color="k", marker="*", ms=10, ls="none")
      else:
        style = dict(color=plt.cm.tab20(i % 20), marker="osD^v<>"[i % 7], ms=3, capsize=2)
      ax.errorbar(line["kv_bytes_held"], y, yerr=err, label=policy, lw=1, **style)
    ax.set(
      xscale="log",
      xlabel="K/V bytes held per example",
      ylabel=metric if ax is axes[0][0] else None,
      title=f"context {length}",
    )
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  return fig


def needle_heatmap(table, policy: str):
  """Accuracy over needle depth (rows) x context length (columns) for one policy."""
  sub = table[table["kind"].astype(str).str.startswith("heatmap") & (table["policy"] == policy)]
  grid = sub.pivot_table(index="depth", columns="length", values="accuracy", aggfunc="mean")
  fig, ax = plt.subplots(figsize=(1.2 * grid.shape[1] + 2.5, 0.5 * grid.shape[0] + 2))
  im = ax.imshow(grid.values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
  ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
  ax.set_yticks(range(grid.shape[0]), [f"{d:.0%}" for d in grid.index])
  for (i, j), v in np.ndenumerate(grid.values):
    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
  ax.set(xlabel="context length", ylabel="needle depth", title=f"needle retrieval: {policy}")
  fig.colorbar(im, ax=ax, fraction=0.05)
  fig.tight_layout()
  return fig


def accuracy_figures(table, out_dir, suffix: str = "", summaries: dict | None = None) -> list[str]:
  """Writes the figures of one question mode into ``out_dir``, each name ending in ``suffix``.

  ``accuracy_vs_budget.png``, ``recall_vs_budget.png`` (RULER's partial credit, when the table
  has it), ``kl_vs_budget.png``, ``accuracy_vs_memory.png`` (when ``summaries`` has
  ``"memory"``) and one ``needle_heatmap_*.png`` per heatmap policy.

  Args:
    table: the results rows of one question mode.
    out_dir: the directory.
    suffix: the end of every file name (before ``.png``).
    summaries: what the figures with intervals draw instead of ``table``'s plain means:
      ``{"accuracy": ..., "recall": ...}`` (one row per task, policy and budget) and
      ``"memory"`` (one row per length, policy and budget), as
      :func:`kvjax.eval.report.plot_summaries` makes them.

  Returns:
    The file names written.
  """
  out_dir = pathlib.Path(out_dir)
  summaries = summaries or {}
  written = []
  if (table["kind"] == "budget").any():
    for metric in [m for m in ("accuracy", "recall", "kl") if m in table.columns]:
      fig = accuracy_vs_budget(summaries.get(metric, table), metric)
      fig.savefig(out_dir / f"{metric}_vs_budget{suffix}.png", dpi=110)
      close(fig)
      written.append(f"{metric}_vs_budget{suffix}.png")
    memory = summaries.get("memory")
    if memory is not None and "kv_bytes_held" in memory.columns:
      fig = accuracy_vs_memory(memory)
      fig.savefig(out_dir / f"accuracy_vs_memory{suffix}.png", dpi=110)
      close(fig)
      written.append(f"accuracy_vs_memory{suffix}.png")
  heat = table[table["kind"].astype(str).str.startswith("heatmap")]
  for policy in dict.fromkeys(heat["policy"]):
    fig = needle_heatmap(table, policy)
    name = f"needle_heatmap_{policy}{suffix}.png"
    fig.savefig(out_dir / name, dpi=110)
    close(fig)
    written.append(name)
  return written


def retained_by_head_figure(by_head, title: str = ""):
  """One ``[layer, head]`` panel of retained mass per policy (``lab.retained_by_head``)."""
  names = list(dict.fromkeys(by_head["policy"]))
  fig, axes = plt.subplots(
    1, len(names), figsize=(2.2 * len(names), 2.6), sharey=True, squeeze=False
  )
  for ax, name in zip(axes[0], names, strict=False):
    grid = by_head[by_head["policy"] == name].pivot(
      index="layer", columns="head", values="retained_mass"
    )
    ax.imshow(grid.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(title=name, xlabel="head")
  axes[0][0].set_ylabel("layer")
  fig.suptitle(title)
  fig.tight_layout()
  return fig


# --------------------------------------------------------------------------- layer funneling


def attention_maps(maps: dict, boundaries=(), vmax: float = 0.01, title: str = ""):
  """PyramidKV's figure: one ``[T, T]`` map per layer (mean over heads), colour saturating at
  ``vmax`` so that the structure of small weights shows; ``boundaries`` draws document edges."""
  layers = sorted(maps)
  fig, axes = plt.subplots(1, len(layers), figsize=(3.3 * len(layers), 3.3), squeeze=False)
  for ax, layer in zip(axes[0], layers, strict=False):
    m = np.asarray(maps[layer])
    m = m.mean(0) if m.ndim == 3 else m
    ax.imshow(m, cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    for b in boundaries:
      ax.axhline(b - 0.5, color="w", lw=0.5)
      ax.axvline(b - 0.5, color="w", lw=0.5)
    ax.set(title=f"layer {layer}", xlabel="key", ylabel="query" if layer == layers[0] else None)
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def funnel_statistics(table, title: str = ""):
  """The quantitative funnel: one panel per statistic (``kvjax.funnel`` columns) against layer."""
  stats = [
    c
    for c in ("entropy", "first_token_mass", "own_document_mass", "keys_for_90")
    if c in table.columns
  ]
  fig, axes = plt.subplots(1, len(stats), figsize=(3.4 * len(stats), 2.9), squeeze=False)
  label_col = "source" if "source" in table.columns else None
  groups = table.groupby(label_col) if label_col else [("", table)]
  for ax, stat in zip(axes[0], stats, strict=False):
    for label, sub in groups:
      ax.plot(sub["layer"], sub[stat], marker="o", ms=3, label=label or None)
    ax.set(xlabel="layer", title=stat)
  if label_col:
    axes[0][0].legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def layer_budgets(profiles: dict, title: str = ""):
  """Per-layer budgets (mean over heads) of several allocations at equal total."""
  fig, ax = plt.subplots(figsize=(5.5, 3.4))
  for label, b in profiles.items():
    b = np.asarray(b, float)
    ax.plot(b.mean(-1) if b.ndim == 2 else b, marker="o", ms=3, label=label)
  ax.set(xlabel="layer", ylabel="budget per head (tokens)", title=title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def streaming_ppl(table, segment: int, title: str = ""):
  """StreamingLLM's Fig. 3: perplexity per ``segment`` tokens along the text, a line per
  (policy, cache); the cache sizes as dotted verticals."""
  fig, ax = plt.subplots(figsize=(8, 4.2))
  for i, row in enumerate(table.itertuples()):
    seg = np.asarray([float(v) for v in row.segments.split()])
    x = (np.arange(len(seg)) + 1) * segment
    label = "full cache" if row.policy == "full" else f"{row.policy} ({row.cache})"
    ax.plot(x, seg, label=label, color=plt.cm.tab10(i % 10), lw=1.4)
  for cache in sorted(set(table["cache"]) - {int(table["cache"].max())}):
    ax.axvline(cache, color="0.6", ls=":", lw=1)
  ax.set(yscale="log", xlabel="tokens read", ylabel=f"perplexity per {segment} tokens", title=title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig
