"""The report's charts: which ones a group of results rows allows, drawn into PNGs beside REPORT.md.

Each chart lives with its kind: bars per strategy (`bar_charts`), memory against time (`pareto_charts`), lines
against batch size and over one step (`line_charts`), on the figure helpers they share (`figures`). Like
`bench.report.markdown`, they read only the CSV-derived frames of `bench.report.data` and never import torch.
"""

from __future__ import annotations

from pathlib import Path

from bench.core.filenames import bounded_name
from bench.core.results import Status
from bench.report.bar_charts import chart_memory, chart_time
from bench.report.data import Group, plan_rows
from bench.report.line_charts import chart_batch, chart_timeline, load_timeline
from bench.report.pareto_charts import chart_pareto, chart_tradeoff

# chart name -> caption, in the order REPORT.md shows them; the file is <run_id>.<name>.png
CAPTIONS = {
    "memory": "1. Peak memory per strategy",
    "time": "2. Step time per strategy",
    "pareto": "3. Memory against time",
    "batch": "4. Peak memory against batch size",
    "timeline": "5. Memory over one training step",
    "tradeoff": "6. Checkpointing plans: peak memory against step time",
}


def chart_path(group: Group, out_dir: Path, name: str) -> Path:
    """`<run_id><suffix>.<name>.png` in `out_dir`, shortened with a hash where a long workload spec in the suffix
    would pass the file system's limit on a name."""
    return Path(out_dir) / bounded_name(group.stem, f".{name}.png")


def draw_all(group: Group, out_dir: Path, budget_bytes: int | None) -> None:
    """Draws the charts the group's rows allow into `out_dir`, filling `group.charts` (name -> path) and
    `group.skipped` (name -> why)."""
    out_dir = Path(out_dir)

    def target(name: str) -> Path:
        return chart_path(group, out_dir, name)

    rows = group.at_batch()
    measured = rows[rows["status"] == Status.OK]
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
