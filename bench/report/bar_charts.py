"""Report charts 1 and 2: peak memory and step time per strategy, as bars grouped by phase at the charted batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text

from bench.core.units import MiB
from bench.core.results import Status
from bench.report.data import MISMATCH_LABEL, Group, row_flag, strategy_order
from bench.report.figures import PHASE_COLOR, new_figure, phases_in, save_figure, set_titles

NOT_MEASURED_COLOR = "#e0e0e0"


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


@dataclass
class _BarCells:
    """How one bar chart draws a (strategy, phase) cell: `value(row)` is the bar height, `spread(row)` its (low,
    high) error or None, `change_column` the ratio to the baseline that labels it; `top` is the tallest bar, which
    the stubs and labels scale with."""
    value: Callable[[pd.Series], float]
    spread: Callable[[pd.Series], tuple[float, float] | None]
    change_column: str
    width: float
    top: float

    def draw(self, ax, xi: float, hit: pd.DataFrame, strategy: str, color: str) -> Text:
        """The cell's bar (or stub, or 'not run' note); returns its label, which the y limit must leave room for."""
        if hit.empty:
            return ax.text(xi, self.top * 0.01, "not run", rotation=90, ha="center", va="bottom", fontsize=7,
                           color="#888888")
        row = hit.iloc[0]
        flag = row_flag(row)
        if row["status"] != Status.OK or pd.isna(self.value(row)):
            stub = self.top * 0.06
            ax.bar(xi, stub, self.width * 0.92, color=NOT_MEASURED_COLOR, edgecolor=color, hatch="xx", zorder=2)
            return ax.text(xi, stub * 1.15, flag or "no value", rotation=90, ha="center", va="bottom", fontsize=8,
                           color="#b00000", fontweight="bold")
        return self._measured(ax, xi, row, strategy, color, mismatch=flag == MISMATCH_LABEL)

    def _measured(self, ax, xi: float, row: pd.Series, strategy: str, color: str, mismatch: bool) -> Text:
        height = self.value(row)
        ax.bar(xi, height, self.width * 0.92, color=color, alpha=0.55 if mismatch else 0.9,
               edgecolor="#333333" if mismatch else color, hatch="//" if mismatch else None, zorder=2)
        err = self.spread(row)
        label_y = height
        if err is not None:
            low, high = err
            ax.errorbar(xi, height, yerr=[[max(0.0, height - low)], [max(0.0, high - height)]], fmt="none",
                        ecolor="black", elinewidth=1.2, capsize=3, zorder=3)
            label_y = max(height, high)
        label = self._change_label(row, strategy)
        if mismatch:
            label += f"  {MISMATCH_LABEL}"
        return ax.text(xi, label_y + self.top * 0.015, label, rotation=90, ha="center", va="bottom", fontsize=8,
                       color="#b00000" if mismatch else "black")

    def _change_label(self, row: pd.Series, strategy: str) -> str:
        if strategy == "baseline":
            return "baseline"
        change = (row[self.change_column] - 1) * 100 if not pd.isna(row[self.change_column]) else None
        return "n/a" if change is None else ("±0%" if abs(change) < 0.05 else f"{change:+.1f}%".replace("-", "−"))


def _grouped_bars(fig: Figure, ax, rows: pd.DataFrame, order: list[str], value, spread, change_column: str,
                  unit: str) -> None:
    """One bar per (strategy, phase). `value(row)` is the bar height, `spread(row)` its (low, high) error or
    None. Non-ok rows are short hatched stubs labelled with their status, mismatches hatched bars."""
    phases = phases_in(rows)
    n = len(phases)
    width = 0.8 / n
    x = np.arange(len(order))
    ok = rows[rows["status"] == Status.OK]
    values = [value(r) for _, r in ok.iterrows()]
    top = max([v for v in values if not pd.isna(v)] or [1.0])
    cells = _BarCells(value, spread, change_column, width, top)
    texts = []
    for k, phase in enumerate(phases):
        color = PHASE_COLOR.get(phase, "#7f7f7f")
        offset = (k - (n - 1) / 2) * width
        base = rows[(rows["phase"] == phase) & (rows["strategy"] == "baseline") & (rows["status"] == Status.OK)]
        if not base.empty:
            base_value = value(base.iloc[0])
            ax.axhline(base_value, color=color, linestyle="--", linewidth=1.2, zorder=1,
                       label=f"baseline {phase} ({base_value:,.0f} {unit})")
        for i, strategy in enumerate(order):
            hit = rows[(rows["phase"] == phase) & (rows["strategy"] == strategy)]
            texts.append(cells.draw(ax, x[i] + offset, hit, strategy, color))
    _bar_axes(ax, x, order, top, phases)
    _fit_texts_vertically(fig, ax, texts)


def _bar_axes(ax, x: np.ndarray, order: list[str], top: float, phases: list[str]) -> None:
    """Strategy names under the bars, room above the tallest, and the legend: phases, mismatch, not measured."""
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


def chart_memory(group: Group, path: Path) -> Path:
    rows = group.at_batch()
    order = strategy_order(group.frame)
    fig = new_figure(max(11.0, 0.95 * len(order) + 5), 7.0)
    ax = fig.add_subplot()
    _grouped_bars(fig, ax, rows, order, lambda r: r["peak_mem_bytes"] / MiB, lambda r: None, "mem_vs_baseline",
                  "MiB")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_xlabel("strategy")
    method = ", ".join(sorted(set(rows["memory_method"].dropna().astype(str)))) if "memory_method" in rows else ""
    set_titles(fig, "Peak memory per strategy (bar labels: change from baseline)" +
               (f" [{method}]" if method else ""), group.subtitle())
    return save_figure(fig, path)


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
    fig = new_figure(max(11.0, 0.95 * len(order) + 5), 7.0)
    ax = fig.add_subplot()
    _grouped_bars(fig, ax, rows, order, lambda r: r["step_time_ms_median"], _time_spread, "time_vs_baseline", "ms")
    ax.set_ylabel("step time, median (ms)")
    ax.set_xlabel("strategy")
    spread = "95% confidence interval" if has_ci else "interquartile range"
    set_titles(fig, f"Step time per strategy (error bars: {spread}; labels: change from baseline)", group.subtitle())
    return save_figure(fig, path)
