"""Report charts 4 and 5: peak memory against batch size (a line per strategy, a budget line), and live memory
over one training step (a panel per strategy, stages shaded)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Transform, blended_transform_factory

from bench.core.units import MiB
from bench.core.results import Status
from bench.report.data import MISMATCH_LABEL, STATUS_LABEL, Group, format_size, pitfall_strategies, strategy_order
from bench.report.figures import new_figure, note_below, phases_in, save_figure, set_titles, strategy_colors

STAGE_COLOR = {"setup": "#d9d9d9", "forward": "#c6dbef", "backward": "#fdd0a2", "optimizer": "#c7e9c0"}
BATCH_MARKERS = "osD^v<>ph*"

# --- chart 4: memory against batch size ---------------------------------------------------------------------


# A budget line is drawn only while it leaves the data most of the plot's height: above this multiple of the
# highest peak it would squash every line into the bottom of the panel, so it is named in a note instead.
BUDGET_IN_VIEW_FACTOR = 1.5


def budget_in_view(data_top: float, budget: float) -> bool:
    """Whether a budget line at `budget` is drawn on a panel whose data reaches `data_top` (same units)."""
    return budget <= data_top * BUDGET_IN_VIEW_FACTOR


def chart_batch(group: Group, path: Path, budget_bytes: int | None) -> Path:
    frame = group.frame[group.frame["batch_size"].isin(group.shown_batch_sizes)]  # at most MAX_BATCH_SIZES
    order = strategy_order(frame)
    colors = strategy_colors(order)
    phases = phases_in(frame)
    fig = new_figure(max(14.0, 6.2 * len(phases) + 3), 7.5)
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=False)[0]
    for ax, phase in zip(axes, phases):
        notes = _batch_lines(ax, frame[frame["phase"] == phase], order, colors)
        _budget_line(ax, budget_bytes)
        ax.set_xticks(group.shown_batch_sizes)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak memory (MiB)")
        ax.set_title(phase, fontsize=12)
        ax.grid(alpha=0.3)
        if notes:
            note_below(fig, ax, "not measured: " + "; ".join(notes), len(phases) + 0.6)
    _batch_legend(fig, axes)
    sizes = group.batch_sizes_text()
    set_titles(fig, "Peak memory against batch size" + (" (dash-dot: memory budget)" if budget_bytes else ""),
               group.subtitle(batch=f"batch sizes {sizes}"))
    return save_figure(fig, path)


def _batch_lines(ax, mine: pd.DataFrame, order: list[str], colors: dict[str, tuple]) -> list[str]:
    """One phase's panel: each strategy's peak against the batch size, mismatches circled, and where a line stops
    because a batch was not measured, an X at the top; returns a note per strategy naming what was not measured."""
    notes = []
    top_slots: dict[int, int] = {}
    marker_transform = blended_transform_factory(ax.transData, ax.transAxes)
    for i, strategy in enumerate(order):
        rows = mine[mine["strategy"] == strategy].sort_values("batch_size")
        if rows.empty:
            continue
        ok = rows[(rows["status"] == Status.OK) & rows["peak_mem_bytes"].notna()]
        bad = rows[rows["status"] != Status.OK]
        if not ok.empty:
            ax.plot(ok["batch_size"], ok["peak_mem_bytes"] / MiB, color=colors[strategy],
                    marker=BATCH_MARKERS[i % len(BATCH_MARKERS)], linewidth=2.2 if strategy == "baseline" else 1.4,
                    linestyle="-" if strategy == "baseline" else (":" if "+" in strategy else "-"),
                    label=strategy)
            mism = ok[ok["matches_baseline"] == False]  # noqa: E712
            if not mism.empty:
                ax.scatter(mism["batch_size"], mism["peak_mem_bytes"] / MiB, s=130, facecolors="none",
                           edgecolors="#b00000", linewidths=1.5, zorder=4)
        if not bad.empty:
            where = ", ".join(f"{int(b)}" for b in bad["batch_size"])
            kinds = "/".join(dict.fromkeys(STATUS_LABEL.get(s, s) for s in bad["status"]))
            notes.append(f"{strategy}: {kinds} at batch {where}")
            if not ok.empty:  # a line that stops: mark where it failed, at the top of the panel
                _mark_failures(ax, bad, strategy, colors[strategy], marker_transform, top_slots)
    return notes


def _mark_failures(ax, bad: pd.DataFrame, strategy: str, color: tuple, marker_transform: Transform,
                   top_slots: dict[int, int]) -> None:
    """An X and the status at the top of the panel for each batch of `strategy` that was not measured; strategies
    failing at the same batch stack downwards (`top_slots`: markers already at each batch)."""
    for b, status in zip(bad["batch_size"], bad["status"]):
        slot = top_slots.get(int(b), 0)
        top_slots[int(b)] = slot + 1
        y = 0.95 - 0.06 * slot
        ax.scatter([b], [y], transform=marker_transform, marker="X", s=80, color=color, edgecolors="black",
                   zorder=5, clip_on=False)
        ax.text(b, y, f" {strategy}: {STATUS_LABEL.get(status, status)}  ", transform=marker_transform,
                ha="right", va="center", fontsize=8, color="#b00000")


def _budget_line(ax, budget_bytes: int | None) -> None:
    """The budget as a dash-dot line where it leaves the data the plot (`budget_in_view`), else a note naming it;
    the y limit leaves room above the data either way."""
    data_top = ax.get_ylim()[1]
    if budget_bytes is not None and budget_in_view(data_top, budget_bytes / MiB):
        budget = budget_bytes / MiB
        ax.axhline(budget, color="#d62728", linestyle="-.", linewidth=1.6, zorder=1)
        ax.text(0.01, budget, f"budget {format_size(budget_bytes)}", transform=blended_transform_factory(
            ax.transAxes, ax.transData), ha="left", va="bottom", fontsize=9, color="#d62728",
            fontweight="bold")
        ax.set_ylim(0, max(data_top, budget * 1.08))
    else:
        ax.set_ylim(0, data_top * 1.1)
        if budget_bytes is not None:  # far above the data: named, not drawn, so the data keeps the plot
            ax.text(0.01, 0.99, f"↑ budget {format_size(budget_bytes)}: far above every peak here",
                    transform=ax.transAxes, ha="left", va="top", fontsize=9, color="#d62728",
                    fontweight="bold")


def _batch_legend(fig: Figure, axes) -> None:
    """One legend for all panels: each strategy once, then the mismatch circle and the not-measured X."""
    handles, labels = [], []
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    handles.append(Line2D([], [], marker="o", markersize=11, markerfacecolor="none",
                          markeredgecolor="#b00000", linestyle="none"))
    labels.append(MISMATCH_LABEL)
    handles.append(Line2D([], [], marker="X", color="#777777", linestyle="none"))
    labels.append("not measured (OOM / error)")
    fig.legend(handles, labels, loc="outside right upper", fontsize=9, frameon=False)


# --- chart 5: memory over one training step ---------------------------------------------------------------


def load_timeline(group: Group) -> tuple[pd.DataFrame, int | None]:
    """The timeline rows for this group's device and workload at one batch size (the charted one if present,
    else the largest), training phase preferred."""
    tl = pd.read_csv(group.timeline)
    for column, value in (("device", group.device), ("workload", group.workload)):
        if column in tl and value:
            tl = tl[tl[column].astype(str) == value]
    if "phase" in tl and (tl["phase"] == "train").any():
        tl = tl[tl["phase"] == "train"]
    batch = None
    if "batch_size" in tl and tl["batch_size"].notna().any():
        sizes = set(int(b) for b in tl["batch_size"].dropna())
        batch = group.chosen_batch if group.chosen_batch in sizes else max(sizes)
        tl = tl[tl["batch_size"] == batch]
    tl = tl.assign(live_bytes=pd.to_numeric(tl["live_bytes"], errors="coerce"),
                   index=pd.to_numeric(tl["index"], errors="coerce"))
    return tl.dropna(subset=["live_bytes", "index"]), batch


def _stage_spans(rows: pd.DataFrame) -> list[tuple[str, float, float]]:
    runs = (rows["stage"] != rows["stage"].shift()).cumsum()
    spans = []
    for _, run in rows.groupby(runs, sort=False):
        spans.append((str(run["stage"].iloc[0]), run["index"].min() - 0.5, run["index"].max() + 0.5))
    return spans


def chart_timeline(group: Group, path: Path, tl: pd.DataFrame, batch: int | None) -> Path:
    order = [s for s in strategy_order(tl, pitfall_strategies(group.frame)) if s in set(tl["strategy"])]
    colors = strategy_colors(strategy_order(group.frame) + [s for s in order if s not in set(group.frame["strategy"])])
    ncols = 1 if len(order) <= 3 else 2
    nrows = -(-len(order) // ncols)
    fig = new_figure(14.0 if ncols == 2 else 12.0, 2.9 * nrows + 1.6)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
    base = tl[tl["strategy"] == "baseline"].sort_values("index")
    stages_seen = []
    for ax, strategy in zip(axes, order):
        rows = tl[tl["strategy"] == strategy].sort_values("index")
        for stage, x0, x1 in _stage_spans(rows):
            ax.axvspan(x0, x1, color=STAGE_COLOR.get(stage, "#eeeeee"), alpha=0.7, zorder=0, linewidth=0)
            if stage not in stages_seen:
                stages_seen.append(stage)
        if strategy != "baseline" and not base.empty:
            ax.plot(base["index"], base["live_bytes"] / MiB, color="#555555", linewidth=1.0, linestyle="--",
                    zorder=1, label="baseline")
        ax.plot(rows["index"], rows["live_bytes"] / MiB, color=colors.get(strategy, "black"), linewidth=1.8,
                zorder=2, label=strategy)
        peak = rows.loc[rows["live_bytes"].idxmax()]
        ax.scatter([peak["index"]], [peak["live_bytes"] / MiB], color="#b00000", zorder=3, s=30)
        ax.annotate(f"peak {peak['live_bytes'] / MiB:,.0f} MiB ({peak['stage']})",
                    (peak["index"], peak["live_bytes"] / MiB), xytext=(6, 4), textcoords="offset points",
                    fontsize=8.5, color="#b00000", ha="left", va="bottom")
        ax.set_title(strategy, fontsize=11)
        ax.set_xlabel("operator index within the step")
        ax.set_ylabel("live memory (MiB)")
        ax.grid(alpha=0.25)
        ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
        ax.set_ylim(0, None)
    for ax in axes[len(order):]:
        ax.set_visible(False)
    top = tl["live_bytes"].max() / MiB
    axes[0].set_ylim(0, top * 1.2)
    fig.legend(handles=[Patch(facecolor=STAGE_COLOR.get(s, "#eeeeee"), label=s) for s in stages_seen],
               loc="outside lower center", ncols=max(1, len(stages_seen)), fontsize=9, frameon=False,
               title="stage (shaded)")
    set_titles(fig, "Memory over one training step (live bytes after each operator; dashed: baseline)",
            group.subtitle(batch=f"batch {batch}" if batch is not None else None))
    return save_figure(fig, path)
