"""Figures (matplotlib, headless): the lab's four-panel figure of the essay, made multi-layer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import synthetic  # noqa: E402


def close(fig) -> None:
  plt.close(fig)


def cache_fraction(trace, step: int, total_len: int) -> np.ndarray:
  """Fraction of (layer, head) rows caching each position at ``step``: ``[T]``."""
  pos = np.asarray(trace.positions_SLHB[step])
  valid = np.asarray(trace.valid_SLHB[step])
  counts = np.bincount(pos[valid].ravel(), minlength=total_len)
  return counts / (pos.shape[0] * pos.shape[1])


def lab_figure(world: synthetic.World, traces: dict, step: int, focus: str, title: str = ""):
  """Four panels: retained mass over steps per policy; each policy's cache map at ``step`` with
  the old facts marked (the active one stronger); the full attention row in gray with the part
  ``focus`` retains over it; retained mass per layer (the funnel)."""
  dims = world.dims
  T, P = dims.total_len, dims.prompt_len
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
  active = np.asarray(synthetic.active_fact_positions(world, step))
  facts = np.asarray(world.fact_mask_FT).any(0)
  for p in np.flatnonzero(facts):
    ax_map.axvline(p, color="red", lw=2.0 if active[p] else 0.8, alpha=0.9 if active[p] else 0.35)
  ax_map.axvline(P + step, color="tab:blue", lw=1)
  ax_map.set(xlabel="position", title=f"Cache map at step {step} (share of layer-heads holding it)")

  row = np.asarray(synthetic.attention_row(world, P + step))
  mean_row = row.mean((0, 1))
  trace = traces[focus][0]
  kept = np.zeros(row.shape, bool)
  pos, valid = np.asarray(trace.positions_SLHB[step]), np.asarray(trace.valid_SLHB[step])
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
  import json  # noqa: PLC0415

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
