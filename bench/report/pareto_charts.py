"""Report charts 3 and 6: memory against time, one point per strategy (3) or checkpointing plan (6), the Pareto
front joined; `plan`'s chart of its candidates with the memory limit; and the label placement they need."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import Bbox

from bench.core.units import MiB
from bench.core.results import Status
from bench.report.data import MISMATCH_LABEL, STATUS_LABEL, Group, plan_label, plan_rows, state_floor_bytes
from bench.report.figures import PHASE_COLOR, new_figure, note_below, phases_in, save_figure, set_titles


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
    phases = phases_in(rows)
    fig = new_figure(max(13.0, 6.5 * len(phases)), 7.5)
    axes = fig.subplots(1, len(phases), squeeze=False)[0]
    for ax, phase in zip(axes, phases):
        mine = rows[rows["phase"] == phase]
        ok = mine[(mine["status"] == Status.OK) & mine["peak_mem_bytes"].notna() & mine["step_time_ms_median"].notna()]
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
        not_measured = mine[mine["status"] != Status.OK]
        if len(not_measured):
            listing = "; ".join(f"{r['strategy']} ({STATUS_LABEL.get(r['status'], r['status'])})"
                                for _, r in not_measured.sort_values("strategy").iterrows())
            note_below(fig, ax, "not measured: " + listing, len(phases))
        ax._membench_labels = labels  # placed after layout, below
    grey = "#555555"
    handles = [
        Line2D([], [], color=grey, linestyle="--", label="Pareto front (no other strategy is both "
               "faster and smaller)"),
        Line2D([], [], color=grey, marker="*", linestyle="none", markersize=12, label="baseline"),
        Line2D([], [], color=grey, marker="o", linestyle="none", markeredgecolor="black",
               markeredgewidth=1.3, label="on the front"),
        Line2D([], [], color=grey, marker="o", linestyle="none", label="dominated"),
        Line2D([], [], color="#b00000", marker="X", linestyle="none",
               label=f"{MISMATCH_LABEL}: results differ, left off the front"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    fig.canvas.draw()
    for ax in axes:
        place_labels(fig, ax, ax._membench_labels)
    set_titles(fig, "Memory against time (lower-left is better; dashed line: Pareto front)", group.subtitle())
    return save_figure(fig, path)


# --- chart 6: the checkpointing trade-off curve -------------------------------------------------------------


def chart_tradeoff(group: Group, path: Path) -> Path:
    """One point per checkpointing plan (baseline, segment counts, sqrt, budget plans, selective policies) in
    training: peak memory against step time, the Pareto front joined, and the floor of weights + gradients +
    optimizer state that no activation technique can go below."""
    rows = plan_rows(group.at_batch())
    fig = new_figure(12.0, 7.5)
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
    set_titles(fig, "Checkpointing plans (labels: the units recomputed; filled, outlined: on the Pareto front)",
            group.subtitle())
    return save_figure(fig, path)


# --- the plan chart: every candidate of `python -m bench plan`, the front and the budget line --------------------


def chart_plan(frame, limit_bytes: int, path: Path, title: str, subtitle: str) -> Path:
    """`plan`'s candidates (a frame of the plan table): judged memory against estimated step time; the Pareto front
    of the eligible ones joined, the answer starred, candidates that change what is trained in grey, and the
    memory limit as a horizontal line. Only the front and the answer are labelled (the CSV names every point)."""
    ok = frame[(frame["status"] == Status.OK) & frame["judged_bytes"].notna() & frame["est_step_time_ms"].notna()]
    fig = new_figure(12.0, 7.5)
    ax = fig.add_subplot()
    color = PHASE_COLOR["train"]
    eligible = ok[ok["eligible"] == True]  # noqa: E712
    other = ok[ok["eligible"] != True]  # noqa: E712
    ax.scatter(other["est_step_time_ms"], other["judged_bytes"] / MiB, s=35, color="#bbbbbb", zorder=2,
               label="changes what is trained (differs_by_design)")
    ax.scatter(eligible["est_step_time_ms"], eligible["judged_bytes"] / MiB, s=45, color="#9ecae1", zorder=2,
               label="candidate")
    front = eligible[eligible["on_front"] == True].sort_values("est_step_time_ms")  # noqa: E712
    ax.plot(front["est_step_time_ms"], front["judged_bytes"] / MiB, color=color, linestyle="--", marker="o",
            markeredgecolor="black", linewidth=1.5, zorder=3, label="Pareto front")
    answer = ok[ok["answer"] == True]  # noqa: E712
    ax.scatter(answer["est_step_time_ms"], answer["judged_bytes"] / MiB, s=260, marker="*", color="#f0a000",
               edgecolors="black", zorder=4, label="answer: the fastest that fits")
    ax.axhline(limit_bytes / MiB, color="#b00000", linestyle=":", linewidth=1.5,
               label=f"limit {limit_bytes / MiB:,.0f} MiB")
    labels = [(r["est_step_time_ms"], r["judged_bytes"] / MiB, r["strategy"])
              for _, r in pd_concat_unique(front, answer).iterrows()]
    ax.set_xlabel("estimated step time (ms)")
    ax.set_ylabel("predicted memory judged against the limit (MiB)")
    ax.grid(alpha=0.3)
    ax.margins(0.2, 0.15)
    ax.legend(loc="upper right", fontsize=9, framealpha=0.9)
    fig.canvas.draw()
    place_labels(fig, ax, labels, fontsize=7.5)
    set_titles(fig, title, subtitle)
    return save_figure(fig, path)


def pd_concat_unique(first: pd.DataFrame, second: pd.DataFrame) -> pd.DataFrame:
    """The rows of two frames of one table, each strategy once."""
    return pd.concat([first, second]).drop_duplicates("strategy")
