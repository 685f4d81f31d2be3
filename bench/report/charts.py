"""The report's charts: PNGs drawn with matplotlib's Agg canvas from the frames `bench.report.markdown` loaded.

No pyplot: each chart is a `Figure` on its own Agg canvas, so nothing global (backend, open figures) changes.
Like `bench.report.markdown`, this module reads only CSV-derived frames and never imports torch.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox, blended_transform_factory

from bench.report.data import (
    MISMATCH_LABEL, STATUS_LABEL, Group, format_size, pitfall_strategies, plan_label, plan_rows, row_flag,
    state_floor_bytes, strategy_order,
)

MiB = 2**20
DPI = 110
PHASES = ("train", "eval")
PHASE_COLOR = {"train": "#1f77b4", "eval": "#ff7f0e"}
STAGE_COLOR = {"setup": "#d9d9d9", "forward": "#c6dbef", "backward": "#fdd0a2", "optimizer": "#c7e9c0"}
NOT_MEASURED_COLOR = "#e0e0e0"

# chart name -> caption, in the order REPORT.md shows them; the file is <run_id>.<name>.png
CAPTIONS = {
    "memory": "1. Peak memory per strategy",
    "time": "2. Step time per strategy",
    "pareto": "3. Memory against time",
    "batch": "4. Peak memory against batch size",
    "timeline": "5. Memory over one training step",
    "tradeoff": "6. Checkpointing plans: peak memory against step time",
}


def strategy_colors(order: list[str]) -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab10" if len(order) <= 10 else "tab20"]
    return {s: cmap(i % cmap.N) for i, s in enumerate(order)}


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _titles(fig: Figure, title: str, subtitle: str) -> None:
    fig.suptitle(f"{title}\n{subtitle}", fontsize=13)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def _note_below(fig: Figure, ax, text: str, panels: int, y: float = -0.12) -> None:
    """A red note under a panel, wrapped to the panel's width so the layout never has to widen for it."""
    panel_inches = fig.get_figwidth() / panels - 1.2
    width = max(30, int(panel_inches * 14))
    ax.text(0.0, y, textwrap.fill(text, width), transform=ax.transAxes, ha="left", va="top", fontsize=8.5,
            color="#b00000")


def _phases(rows: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(rows["phase"]))
    return [p for p in PHASES if p in present] + [p for p in present if p not in PHASES]


def _fit_texts_vertically(fig: Figure, ax, texts: list) -> None:
    """Raises the y limit so that every text (bar labels above tall bars) lies inside the axes.

    One layout pass gives each text's height in pixels; the new top limit then follows from the axes height,
    so no second draw is needed (drawing is the slow part of a report)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    low, high = ax.get_ylim()
    height_px = box.height
    needed = high
    for t in texts:
        extent = t.get_window_extent(renderer)
        anchor_y = t.get_position()[1]
        above = extent.y1 - ax.transData.transform((0, anchor_y))[1] + 6  # pixels the text reaches above its anchor
        if above >= height_px * 0.8:
            continue
        needed = max(needed, low + (anchor_y - low) * height_px / (height_px - above))
    if needed > high:
        ax.set_ylim(low, needed)


# --- charts 1 and 2: grouped bars ------------------------------------------------------------------------


def _grouped_bars(fig: Figure, ax, rows: pd.DataFrame, order: list[str], value, spread, change_column: str,
                  unit: str) -> None:
    """One bar per (strategy, phase). `value(row)` is the bar height, `spread(row)` its (low, high) error or
    None. Non-ok rows are short hatched stubs labelled with their status, mismatches hatched bars."""
    phases = _phases(rows)
    n = len(phases)
    width = 0.8 / n
    x = np.arange(len(order))
    ok = rows[rows["status"] == "ok"]
    values = [value(r) for _, r in ok.iterrows()]
    top = max([v for v in values if not pd.isna(v)] or [1.0])
    stub = top * 0.06
    texts = []
    for k, phase in enumerate(phases):
        color = PHASE_COLOR.get(phase, "#7f7f7f")
        offset = (k - (n - 1) / 2) * width
        base = rows[(rows["phase"] == phase) & (rows["strategy"] == "baseline") & (rows["status"] == "ok")]
        if not base.empty:
            base_value = value(base.iloc[0])
            ax.axhline(base_value, color=color, linestyle="--", linewidth=1.2, zorder=1,
                       label=f"baseline {phase} ({base_value:,.0f} {unit})")
        for i, strategy in enumerate(order):
            hit = rows[(rows["phase"] == phase) & (rows["strategy"] == strategy)]
            xi = x[i] + offset
            if hit.empty:
                texts.append(ax.text(xi, top * 0.01, "not run", rotation=90, ha="center", va="bottom",
                                     fontsize=7, color="#888888"))
                continue
            row = hit.iloc[0]
            flag = row_flag(row)
            if row["status"] != "ok" or pd.isna(value(row)):
                ax.bar(xi, stub, width * 0.92, color=NOT_MEASURED_COLOR, edgecolor=color, hatch="xx", zorder=2)
                label = flag or "no value"
                texts.append(ax.text(xi, stub * 1.15, label, rotation=90, ha="center", va="bottom",
                                     fontsize=8, color="#b00000", fontweight="bold"))
                continue
            height = value(row)
            mismatch = flag == MISMATCH_LABEL
            ax.bar(xi, height, width * 0.92, color=color, alpha=0.55 if mismatch else 0.9,
                   edgecolor="#333333" if mismatch else color, hatch="//" if mismatch else None, zorder=2)
            err = spread(row)
            label_y = height
            if err is not None:
                low, high = err
                ax.errorbar(xi, height, yerr=[[max(0.0, height - low)], [max(0.0, high - height)]], fmt="none",
                            ecolor="black", elinewidth=1.2, capsize=3, zorder=3)
                label_y = max(height, high)
            if strategy == "baseline":
                label = "baseline"
            else:
                change = (row[change_column] - 1) * 100 if not pd.isna(row[change_column]) else None
                label = "n/a" if change is None else ("±0%" if abs(change) < 0.05 else
                                                      f"{change:+.1f}%".replace("-", "−"))
            if mismatch:
                label += f"  {MISMATCH_LABEL}"
            texts.append(ax.text(xi, label_y + top * 0.015, label, rotation=90, ha="center", va="bottom",
                                 fontsize=8, color="#b00000" if mismatch else "black"))
    ax.set_xticks(x)
    ax.set_xticklabels(order, rotation=30, ha="right", rotation_mode="anchor", fontsize=9)
    ax.set_xlim(-0.6, len(order) - 0.4)
    ax.set_ylim(0, top * 1.3)
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(facecolor=PHASE_COLOR.get(p, "#7f7f7f"), label=p) for p in phases]
    handles += [Patch(facecolor="white", edgecolor="#333333", hatch="//", label=f"{MISMATCH_LABEL} (results differ)"),
                Patch(facecolor=NOT_MEASURED_COLOR, edgecolor="#555555", hatch="xx",
                      label="not measured (OOM / unsupported / error)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    _fit_texts_vertically(fig, ax, texts)


def chart_memory(group: Group, path: Path) -> Path:
    rows = group.at_batch()
    order = strategy_order(group.frame)
    fig = _new_figure(max(11.0, 0.95 * len(order) + 5), 7.0)
    ax = fig.add_subplot()
    _grouped_bars(fig, ax, rows, order, lambda r: r["peak_mem_bytes"] / MiB, lambda r: None, "mem_vs_baseline",
                  "MiB")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_xlabel("strategy")
    method = ", ".join(sorted(set(rows["memory_method"].dropna().astype(str)))) if "memory_method" in rows else ""
    _titles(fig, "Peak memory per strategy (bar labels: change from baseline)" +
            (f" [{method}]" if method else ""), group.subtitle())
    return _save(fig, path)


def _time_spread(row):
    low, high = row.get("step_time_ms_ci95_low"), row.get("step_time_ms_ci95_high")
    if low is not None and high is not None and not pd.isna(low) and not pd.isna(high):
        return float(low), float(high)
    iqr = row["step_time_ms_iqr"]
    if pd.isna(iqr):
        return None
    return row["step_time_ms_median"] - iqr / 2, row["step_time_ms_median"] + iqr / 2


def chart_time(group: Group, path: Path) -> Path:
    rows = group.at_batch()
    order = strategy_order(group.frame)
    has_ci = "step_time_ms_ci95_low" in rows and rows["step_time_ms_ci95_low"].notna().any()
    fig = _new_figure(max(11.0, 0.95 * len(order) + 5), 7.0)
    ax = fig.add_subplot()
    _grouped_bars(fig, ax, rows, order, lambda r: r["step_time_ms_median"], _time_spread, "time_vs_baseline", "ms")
    ax.set_ylabel("step time, median (ms)")
    ax.set_xlabel("strategy")
    spread = "95% confidence interval" if has_ci else "interquartile range"
    _titles(fig, f"Step time per strategy (error bars: {spread}; labels: change from baseline)", group.subtitle())
    return _save(fig, path)


# --- chart 3: memory against time, Pareto front ----------------------------------------------------------


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points (time, memory, name) that no other point beats on both, sorted by time."""
    front = []
    best_mem = float("inf")
    for t, m, name in sorted(points, key=lambda p: (p[0], p[1])):
        if m < best_mem:
            front.append((t, m, name))
            best_mem = m
    return front


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(fig: Figure, ax, points: list[tuple[float, float, str]], fontsize: float = 8.5) -> list:
    """Annotates each (x, y, text) near its point, trying offsets in turn until the label overlaps no other
    label, no point and stays inside the axes; far labels get a thin leader line. The figure must have been
    drawn once (so the layout is final) before this is called."""
    renderer = fig.canvas.get_renderer()
    axes_box = ax.get_window_extent(renderer)
    marker_boxes = []
    for x, y, _ in points:
        px, py = ax.transData.transform((x, y))
        marker_boxes.append(Bbox.from_extents(px - 6, py - 6, px + 6, py + 6))
    directions = [(1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1), (1, 0), (-1, 0)]
    placed: list[Bbox] = []
    annotations = []
    for x, y, text in sorted(points, key=lambda p: (p[0], p[1])):
        best = None
        for radius in (9, 18, 30, 45, 62):
            for dx, dy in directions:
                ha = "left" if dx > 0 else ("right" if dx < 0 else "center")
                va = "bottom" if dy > 0 else ("top" if dy < 0 else "center")
                ann = ax.annotate(text, (x, y), xytext=(dx * radius, dy * radius), textcoords="offset points",
                                  ha=ha, va=va, fontsize=fontsize,
                                  bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
                box = ann.get_window_extent(renderer).padded(2)
                cost = sum(_overlap(box, b) for b in placed) + sum(_overlap(box, b) for b in marker_boxes)
                outside = (max(0, axes_box.x0 - box.x0) + max(0, box.x1 - axes_box.x1) +
                           max(0, axes_box.y0 - box.y0) + max(0, box.y1 - axes_box.y1))
                cost += outside * 50 + radius * 0.01
                ann.remove()
                if best is None or cost < best[0]:
                    best = (cost, dx, dy, radius, ha, va, box)
            if best[0] < 1:
                break
        _, dx, dy, radius, ha, va, box = best
        arrow = dict(arrowstyle="-", color="#777777", linewidth=0.7) if radius > 9 else None
        ann = ax.annotate(text, (x, y), xytext=(dx * radius, dy * radius), textcoords="offset points", ha=ha,
                          va=va, fontsize=fontsize, arrowprops=arrow,
                          bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
        placed.append(box)
        annotations.append(ann)
    return annotations


def chart_pareto(group: Group, path: Path) -> Path:
    rows = group.at_batch()
    order = strategy_order(group.frame)
    phases = _phases(rows)
    fig = _new_figure(max(13.0, 6.5 * len(phases)), 7.5)
    axes = fig.subplots(1, len(phases), squeeze=False)[0]
    for ax, phase in zip(axes, phases):
        mine = rows[rows["phase"] == phase]
        ok = mine[(mine["status"] == "ok") & mine["peak_mem_bytes"].notna() & mine["step_time_ms_median"].notna()]
        valid = ok[ok["matches_baseline"] != False]  # noqa: E712  (None: not verified, still a result)
        mismatched = ok[ok["matches_baseline"] == False]  # noqa: E712
        color = PHASE_COLOR.get(phase, "#7f7f7f")
        points = [(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB, r["strategy"]) for _, r in valid.iterrows()]
        front = pareto_front(points)
        front_names = {name for _, _, name in front}
        if len(front) > 1:
            ax.plot([p[0] for p in front], [p[1] for p in front], color=color, linestyle="--", linewidth=1.5,
                    zorder=1, label="Pareto front")
        for t, m, name in points:
            is_base = name == "baseline"
            ax.scatter(t, m, s=120 if is_base else 60, marker="*" if is_base else "o", color=color,
                       edgecolors="black" if name in front_names else "none", linewidths=1.3, zorder=3)
        for _, r in mismatched.iterrows():
            ax.scatter(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB, s=70, marker="X", color="#b00000",
                       zorder=3)
        labels = [(t, m, name + (" (front)" if name in front_names and len(front) > 1 else ""))
                  for t, m, name in points]
        labels += [(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB, f"{r['strategy']} {MISMATCH_LABEL}")
                   for _, r in mismatched.iterrows()]
        ax.set_title(f"{phase}", fontsize=12)
        ax.set_xlabel("step time, median (ms)")
        ax.set_ylabel("peak memory (MiB)")
        ax.grid(alpha=0.3)
        ax.margins(0.22, 0.18)
        not_measured = mine[mine["status"] != "ok"]
        if len(not_measured):
            listing = "; ".join(f"{r['strategy']} ({STATUS_LABEL.get(r['status'], r['status'])})"
                                for _, r in not_measured.sort_values("strategy").iterrows())
            _note_below(fig, ax, "not measured: " + listing, len(phases))
        ax._membench_labels = labels  # placed after layout, below
    grey = "#555555"
    handles = [
        matplotlib.lines.Line2D([], [], color=grey, linestyle="--", label="Pareto front (no other strategy is both "
                                "faster and smaller)"),
        matplotlib.lines.Line2D([], [], color=grey, marker="*", linestyle="none", markersize=12, label="baseline"),
        matplotlib.lines.Line2D([], [], color=grey, marker="o", linestyle="none", markeredgecolor="black",
                                markeredgewidth=1.3, label="on the front"),
        matplotlib.lines.Line2D([], [], color=grey, marker="o", linestyle="none", label="dominated"),
        matplotlib.lines.Line2D([], [], color="#b00000", marker="X", linestyle="none",
                                label=f"{MISMATCH_LABEL}: results differ, left off the front"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    fig.canvas.draw()
    for ax in axes:
        place_labels(fig, ax, ax._membench_labels)
    _titles(fig, "Memory against time (lower-left is better; dashed line: Pareto front)", group.subtitle())
    return _save(fig, path)


# --- chart 6: the checkpointing trade-off curve ------------------------------------------------------------


def chart_tradeoff(group: Group, path: Path) -> Path:
    """One point per checkpointing plan (baseline, segment counts, sqrt, budget plans, selective policies) in
    training: peak memory against step time, the Pareto front joined, and the floor of weights + gradients +
    optimizer state that no activation technique can go below."""
    rows = plan_rows(group.at_batch())
    fig = _new_figure(12.0, 7.5)
    ax = fig.add_subplot()
    points = [(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB, r["strategy"]) for _, r in rows.iterrows()]
    front = pareto_front(points)
    front_names = {name for _, _, name in front}
    ax.plot([p[0] for p in front], [p[1] for p in front], color=PHASE_COLOR["train"], linestyle="--", linewidth=1.5,
            zorder=1, label="Pareto front")
    for _, r in rows.iterrows():
        on_front = r["strategy"] in front_names
        marker = "*" if r["strategy"] == "baseline" else ("s" if r["recompute_plan_kind"] == "operators" else "o")
        ax.scatter(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB, s=120 if marker == "*" else 55,
                   marker=marker, color=PHASE_COLOR["train"] if on_front else "#9ecae1",
                   edgecolors="black" if on_front else "none", linewidths=1.2, zorder=3)
    floor = state_floor_bytes(group.at_batch())
    if floor is not None:
        ax.axhline(floor / MiB, color="#b00000", linestyle=":", linewidth=1.3,
                   label=f"floor: weights + gradients + optimizer state ({floor / MiB:,.0f} MiB)")
    labels = [(r["step_time_ms_median"], r["peak_mem_bytes"] / MiB,
               f"{r['strategy']} [{plan_label(r)}]") for _, r in rows.iterrows()]
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
    ax.margins(0.25, 0.15)
    low = min([p[1] for p in points] + ([floor / MiB] if floor is not None else []))
    ax.set_ylim(bottom=max(0.0, low * 0.9))
    ax.legend(loc="upper right", fontsize=9, framealpha=0.9)
    fig.canvas.draw()
    place_labels(fig, ax, labels, fontsize=7.5)
    _titles(fig, "Checkpointing plans (labels: the units recomputed; filled, outlined: on the Pareto front)",
            group.subtitle())
    return _save(fig, path)


# --- chart 4: memory against batch size ------------------------------------------------------------------


# A budget line is drawn only while it leaves the data most of the plot's height: above this multiple of the
# highest peak it would squash every line into the bottom of the panel, so it is named in a note instead.
BUDGET_IN_VIEW_FACTOR = 1.5


def budget_in_view(data_top: float, budget: float) -> bool:
    """Whether a budget line at `budget` is drawn on a panel whose data reaches `data_top` (same units)."""
    return budget <= data_top * BUDGET_IN_VIEW_FACTOR


def chart_batch(group: Group, path: Path, budget_bytes: int | None) -> Path:
    frame = group.frame
    order = strategy_order(frame)
    colors = strategy_colors(order)
    markers = "osD^v<>ph*"
    phases = _phases(frame)
    fig = _new_figure(max(14.0, 6.2 * len(phases) + 3), 7.5)
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=False)[0]
    for ax, phase in zip(axes, phases):
        mine = frame[frame["phase"] == phase]
        notes = []
        top_slots: dict[int, int] = {}
        marker_transform = blended_transform_factory(ax.transData, ax.transAxes)
        for i, strategy in enumerate(order):
            rows = mine[mine["strategy"] == strategy].sort_values("batch_size")
            if rows.empty:
                continue
            ok = rows[(rows["status"] == "ok") & rows["peak_mem_bytes"].notna()]
            bad = rows[rows["status"] != "ok"]
            if not ok.empty:
                ax.plot(ok["batch_size"], ok["peak_mem_bytes"] / MiB, color=colors[strategy],
                        marker=markers[i % len(markers)], linewidth=2.2 if strategy == "baseline" else 1.4,
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
                    for b, status in zip(bad["batch_size"], bad["status"]):
                        slot = top_slots.get(int(b), 0)
                        top_slots[int(b)] = slot + 1
                        y = 0.95 - 0.06 * slot
                        ax.scatter([b], [y], transform=marker_transform, marker="X", s=80,
                                   color=colors[strategy], edgecolors="black", zorder=5, clip_on=False)
                        ax.text(b, y, f" {strategy}: {STATUS_LABEL.get(status, status)}  ",
                                transform=marker_transform, ha="right", va="center", fontsize=8,
                                color="#b00000")
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
        ax.set_xticks(group.batch_sizes)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak memory (MiB)")
        ax.set_title(phase, fontsize=12)
        ax.grid(alpha=0.3)
        if notes:
            _note_below(fig, ax, "not measured: " + "; ".join(notes), len(phases) + 0.6)
    handles, labels = [], []
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    handles.append(matplotlib.lines.Line2D([], [], marker="o", markersize=11, markerfacecolor="none",
                                           markeredgecolor="#b00000", linestyle="none"))
    labels.append(MISMATCH_LABEL)
    handles.append(matplotlib.lines.Line2D([], [], marker="X", color="#777777", linestyle="none"))
    labels.append("not measured (OOM / error)")
    fig.legend(handles, labels, loc="outside right upper", fontsize=9, frameon=False)
    sizes = ", ".join(str(b) for b in group.batch_sizes)
    _titles(fig, "Peak memory against batch size" + (" (dash-dot: memory budget)" if budget_bytes else ""),
            group.subtitle(batch=f"batch sizes {sizes}"))
    return _save(fig, path)


# --- chart 5: memory over one training step --------------------------------------------------------------


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
    fig = _new_figure(14.0 if ncols == 2 else 12.0, 2.9 * nrows + 1.6)
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
        ax.annotate(f"peak {peak['live_bytes'] / MiB:,.0f} MiB ({peak['stage']})", (peak["index"], peak["live_bytes"] / MiB),
                    xytext=(6, 4), textcoords="offset points", fontsize=8.5, color="#b00000", ha="left", va="bottom")
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
    _titles(fig, "Memory over one training step (live bytes after each operator; dashed: baseline)",
            group.subtitle(batch=f"batch {batch}" if batch is not None else None))
    return _save(fig, path)


# --- all charts for one group ----------------------------------------------------------------------------


def draw_all(group: Group, out_dir: Path, budget_bytes: int | None) -> None:
    """Draws the charts the group's rows allow into `out_dir`, filling `group.charts` (name -> path) and
    `group.skipped` (name -> why)."""
    out_dir = Path(out_dir)

    def target(name: str) -> Path:
        return out_dir / f"{group.stem}.{name}.png"

    rows = group.at_batch()
    measured = rows[rows["status"] == "ok"]
    if rows.empty:
        for name in ("memory", "time", "pareto"):
            group.skipped[name] = "no rows"
    else:
        group.charts["memory"] = chart_memory(group, target("memory"))
        group.charts["time"] = chart_time(group, target("time"))
        if measured.empty:
            group.skipped["pareto"] = f"no strategy was measured at batch {group.chosen_batch}"
        else:
            group.charts["pareto"] = chart_pareto(group, target("pareto"))
    if len(group.batch_sizes) > 1:
        group.charts["batch"] = chart_batch(group, target("batch"), budget_bytes)
    else:
        group.skipped["batch"] = (f"this run holds a single batch size ({group.chosen_batch}); run several "
                                  "batch sizes to see how memory grows")
    plans = plan_rows(rows)
    if len(plans[plans["strategy"] != "baseline"]) >= 2:  # else not a run about checkpointing: no chart, no note
        group.charts["tradeoff"] = chart_tradeoff(group, target("tradeoff"))
    if group.timeline is None:
        group.skipped["timeline"] = (f"no timeline file (`{group.run_id}.timeline.csv`) next to the results; "
                                     "it is written when the run records a step timeline")
    else:
        tl, batch = load_timeline(group)
        if tl.empty:
            group.skipped["timeline"] = f"`{group.timeline.name}` has no rows for {group.device} / {group.workload}"
        else:
            group.charts["timeline"] = chart_timeline(group, target("timeline"), tl, batch)
