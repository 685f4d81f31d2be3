"""What every report chart shares: a figure on its own Agg canvas, its titles and notes, colours, saving a PNG.

No pyplot: each chart is a `Figure` on its own Agg canvas, so nothing global (backend, open figures) changes.
Like the rest of `bench.report`, the charts read only CSV-derived frames and never import torch.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.core.atomic import atomic_path

DPI = 110
PHASES = ("train", "eval")
PHASE_COLOR = {"train": "#1f77b4", "eval": "#ff7f0e"}


def strategy_colors(order: list[str]) -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab10" if len(order) <= 10 else "tab20"]
    return {s: cmap(i % cmap.N) for i, s in enumerate(order)}


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def set_titles(fig: Figure, title: str, subtitle: str) -> None:
    fig.suptitle(f"{title}\n{subtitle}", fontsize=13)


def save_figure(fig: Figure, path: Path) -> Path:
    """The figure as a PNG at `path`, written atomically (a killed report never leaves a truncated chart)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, facecolor="white", format="png")
    return path


def note_below(fig: Figure, ax, text: str, panels: int, y: float = -0.12) -> None:
    """A red note under a panel, wrapped to the panel's width so the layout never has to widen for it."""
    panel_inches = fig.get_figwidth() / panels - 1.2
    width = max(30, int(panel_inches * 14))
    ax.text(0.0, y, textwrap.fill(text, width), transform=ax.transAxes, ha="left", va="top", fontsize=8.5,
            color="#b00000")


def phases_in(rows: pd.DataFrame) -> list[str]:
    """The phases the rows hold, train and eval first."""
    present = list(dict.fromkeys(rows["phase"]))
    return [p for p in PHASES if p in present] + [p for p in present if p not in PHASES]
