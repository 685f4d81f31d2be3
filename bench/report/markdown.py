"""The report: REPORT.md plus PNG charts, built from results CSV files alone.

This module reads nothing but CSV files: it must not import torch, the runner, strategies or workloads, so a
report can be built on any machine from a copied `results/` folder.

    build_report([Path("results/<run_id>.csv")], Path("report"), budget_bytes=parse_size("4GiB"))
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench.core.units import format_mib
from bench.core.atomic import write_text_atomic
from bench.core.results import Status
from bench.report import charts
from bench.report.data import (  # noqa: F401 - newest_csv and parse_size are part of this module's API
    Group, MAX_GROUPS, MAX_STRATEGIES, MISMATCH_LABEL, STATUS_LABEL, find_timeline, format_size, load_results,
    make_groups, newest_csv, report_name,
    parse_size, row_flag, strategy_order, is_checkpoint_plan, pitfall_strategies, plan_label, plan_rows, settings_of, state_floor_bytes,
)
from bench.report.pareto_charts import pareto_front

# --- markdown --------------------------------------------------------------------------------------------


def _pct(ratio) -> str:
    if ratio is None or pd.isna(ratio):
        return "—"
    change = (ratio - 1) * 100
    if abs(change) < 0.05:
        return "±0%"
    return f"{change:+.1f}%".replace("-", "−")


def _mib(n_bytes) -> str:
    return "—" if pd.isna(n_bytes) else format_mib(n_bytes)


def _ms(row) -> str:
    median = row["step_time_ms_median"]
    if pd.isna(median):
        return "—"
    low, high = row.get("step_time_ms_ci95_low"), row.get("step_time_ms_ci95_high")
    if low is not None and high is not None and not pd.isna(low) and not pd.isna(high):
        text = f"{median:,.1f} [{low:,.1f}–{high:,.1f}]"
    elif not pd.isna(row["step_time_ms_iqr"]):
        text = f"{median:,.1f} ± {row['step_time_ms_iqr']:,.1f}"
    else:
        text = f"{median:,.1f}"
    if row.get("noisy") is True:
        text += " (noisy)"
    return text


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _note(row) -> str:
    if row["status"] != Status.OK:
        return row["message"] or "(no message)"
    if row["matches_baseline"] is False:
        parts = [f"{name} {row[col]:.2g}" for name, col in (("loss rel diff", "loss_rel_diff"),
                                                           ("max grad rel diff", "max_grad_rel_diff"))
                 if not pd.isna(row[col])]
        return "result differs from baseline" + (f": {', '.join(parts)}" if parts else "") + \
            (f"; {row['message']}" if row["message"] else "")
    return row["message"]


def phase_table(rows: pd.DataFrame, order: list[str]) -> list[str]:
    has_ci = {"step_time_ms_ci95_low", "step_time_ms_ci95_high"} <= set(rows.columns) and \
        rows["step_time_ms_ci95_low"].notna().any()
    spread = "median [95% CI]" if has_ci else "median ± IQR"
    lines = [f"| strategy | status | peak MiB | mem vs baseline | step ms ({spread}) | time vs baseline "
             "| matches baseline | note |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for strategy in order:
        for _, row in rows[rows["strategy"] == strategy].iterrows():
            status = row["status"]
            status_cell = "ok" if status == Status.OK else f"**{STATUS_LABEL.get(status, status)}**"
            matches = row["matches_baseline"]
            matches_cell = {True: "yes", False: f"**no ({MISMATCH_LABEL})**", None: "—"}[matches]
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{strategy}`", status_cell, _mib(row["peak_mem_bytes"]), _pct(row["mem_vs_baseline"]),
                _ms(row), _pct(row["time_vs_baseline"]), matches_cell, _note(row))) + " |")
    return lines


# The baseline's eval is the article's validation with autograd left on (the training-pitfalls article): a pitfall too.
EVAL_BASELINE_PITFALL = "autograd left on during validation (the training-pitfalls article); the fix is `no_grad_eval`"


def _growth(n_bytes) -> str:
    return "—" if n_bytes is None or pd.isna(n_bytes) else f"{n_bytes:,.0f}"


def pitfall_table(rows: pd.DataFrame, order: list[str]) -> list[str]:
    """The pitfalls of one phase (and the baseline's eval): what each costs in peak, per step, and in time."""
    lines = ["| pitfall | status | peak MiB | mem vs baseline | growth B/step | time vs baseline | matches baseline "
             "| note |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    picked = [(s, None) for s in order if s in pitfall_strategies(rows)]
    if (rows["phase"] == "eval").all():
        picked.insert(0, ("baseline", EVAL_BASELINE_PITFALL))
    for strategy, note in picked:
        for _, row in rows[rows["strategy"] == strategy].iterrows():
            status = row["status"]
            matches = {True: "yes", False: f"**no ({MISMATCH_LABEL})**", None: "—"}[row["matches_baseline"]]
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{strategy}`", "ok" if status == Status.OK else f"**{STATUS_LABEL.get(status, status)}**",
                _mib(row["peak_mem_bytes"]), _pct(row["mem_vs_baseline"]),
                _growth(row.get("mem_growth_bytes_per_step")), _pct(row["time_vs_baseline"]), matches,
                note or _note(row))) + " |")
    return lines if len(lines) > 2 else []


def batch_table(group: Group, phase: str, order: list[str], budget_bytes: int | None) -> list[str]:
    """Peak MiB by strategy and batch size for one phase (all rows, non-ok ones by their status)."""
    rows = group.frame[group.frame["phase"] == phase]
    sizes = group.shown_batch_sizes
    rows = rows[rows["batch_size"].isin(sizes)]
    lines = ["| strategy | " + " | ".join(f"batch {b}" for b in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    # each (strategy, batch size)'s last row, found once: a lookup per cell was a scan of every row (a 100,000-row
    # file's table took minutes)
    last = dict(zip(zip(rows["strategy"], rows["batch_size"]), rows.index))  # a later row replaces an earlier one
    present = set(rows["strategy"])
    for strategy in order:
        if strategy not in present:
            continue
        cells = []
        for b in sizes:
            if (strategy, b) not in last:
                cells.append("—")
                continue
            row = rows.loc[last[(strategy, b)]]
            flag = row_flag(row)
            if row["status"] != Status.OK:
                cells.append(f"**{flag}**")
                continue
            text = _mib(row["peak_mem_bytes"])
            if budget_bytes is not None and row["peak_mem_bytes"] > budget_bytes:
                text += " (over budget)"
            if flag:
                text += f" **{flag}**"
            cells.append(text)
        lines.append(f"| `{strategy}` | " + " | ".join(cells) + " |")
    return lines


PITFALLS_INTRO = ("Habits the articles warn about, measured: what each adds to the peak, and the live bytes it "
                  "adds per step (growth that no step gives back runs out of memory in a long enough loop).")


def plan_table(group: Group) -> list[str]:
    """The checkpointing plans in training: what each recomputes, its peak (and predicted peak), its time, and
    whether it is on the Pareto front; the floor of weights + gradients + optimizer state below."""
    rows = plan_rows(group.at_batch())
    if len(rows[rows["strategy"] != "baseline"]) < 2:
        return []
    front = {name for _, _, name in pareto_front(
        [(r["step_time_ms_median"], r["peak_mem_bytes"], r["strategy"]) for _, r in rows.iterrows()])}
    lines = [f"### Checkpointing plans (train, batch {group.chosen_batch})", "",
             "| strategy | units recomputed | peak MiB | predicted MiB | mem vs baseline | step ms | time vs baseline "
             "| Pareto front |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for _, row in rows.sort_values("peak_mem_bytes").iterrows():
        predicted = row.get("predicted_peak_bytes")
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{row['strategy']}`", plan_label(row), _mib(row["peak_mem_bytes"]),
            _mib(predicted) if predicted is not None and not pd.isna(predicted) else "—",
            _pct(row["mem_vs_baseline"]), _ms(row), _pct(row["time_vs_baseline"]),
            "yes" if row["strategy"] in front else "")) + " |")
    floor = state_floor_bytes(group.at_batch())
    if floor is not None:
        lines += ["", f"Floor that no activation technique can go below (weights + gradients + optimizer state): "
                      f"{_mib(floor)} MiB."]
    if any(settings_of(r).get("checkpoint.planning_s", "None") != "None" for _, r in rows.iterrows()):
        lines += ["Budget plans were searched on the meta device and confirmed by a measured step "
                  "(`checkpoint.planning_s` in the CSV's `strategy_settings`)."]
    at_batch = group.at_batch()
    refused = at_batch[is_checkpoint_plan(at_batch) & (at_batch["phase"] == "train")
                       & (at_batch["status"] == Status.UNSUPPORTED)]
    lines += [f"`{row['strategy']}`: unsupported, {row['message']}" for _, row in refused.iterrows()]
    return lines + [""]


HOW_TO_READ = """## How to read this report

- **Peak memory** is the highest memory in use during one step (`memory_method` says how it was measured: on
  CPU, live tensor bytes counted op by op, or for compiled steps the bytes held at PyTorch's CPU allocator; on
  CUDA, `torch.cuda.max_memory_allocated`). Lower is better. The
  percentages compare each strategy with the baseline of the same phase, batch size and device.
- **Step time** is the median over the timed steps; the error bars / `±` show the spread of the timing pass
  (the interquartile range, or the 95% confidence interval when the results hold one). Lower is better.
- **Memory vs time**: the points on the Pareto front (drawn as a line) are the strategies that no other
  strategy beats on both memory and time. Pick the cheapest point on the front that fits your card.
- Rows marked **OOM**, **unsupported** or **error** were not measured (hatched stubs, never drawn as savings);
  rows marked **≠ baseline** ran but their loss or gradients differ from the baseline beyond tolerance, so their
  savings come with a change in results (hatched bars, left off the Pareto front).
- **Memory over one training step** shows live bytes after each operator of one training step; the shaded
  spans are forward, backward and the optimizer. The peak is usually at the end of forward or early in
  backward: a technique that saves activations lowers that hump.
- **Checkpointing plans** (when a run holds several): one point per plan of what to recompute (segment counts,
  `segments=sqrt`, budget plans, selective policies), peak memory against step time in training; the dashed line
  joins the plans no other plan beats on both, the dotted line is the floor of weights + gradients + optimizer
  state that no activation technique can go below.
"""


def _env_lines(group: Group) -> list[str]:
    f = group
    threads = f.first("cpu_threads")
    cuda = f.first("cuda_version", "")
    lines = [
        f"- **Run id:** `{group.run_id}`",
        f"- **Device:** {f.first('device_name', group.device)} (`{group.device}`)",
        f"- **Workload:** `{group.workload}`, data `{group.data or '?'}`, batch sizes "
        f"{group.batch_sizes_text()}",
        f"- **torch:** {f.first('torch_version')}" + (f", CUDA {cuda}" if cuda and cuda != "nan" else ""),
        f"- **CPU threads:** {threads.removesuffix('.0') if isinstance(threads, str) else threads}",
        f"- **Commit:** `{f.first('git_commit')}`",
        f"- **Source:** `{Path(group.frame['_source'].iloc[0]).name}`",
    ]
    return lines


def _rel(path: Path, out_dir: Path) -> str:
    try:
        return path.relative_to(out_dir).as_posix()
    except ValueError:
        return path.as_posix()


def render_markdown(groups: list[Group], out_dir: Path, budget_bytes: int | None, left_out: list[Group] = ()) -> str:
    """REPORT.md of `groups`; `left_out`: the groups past MAX_GROUPS, named in one line, not drawn."""
    run_ids = list(dict.fromkeys(g.run_id for g in groups))
    lines = [f"# membench report: {', '.join(run_ids)}", ""]
    if left_out:
        lines += [left_out_line(groups, left_out), ""]
    if budget_bytes is not None:
        lines += [f"Memory budget: **{format_size(budget_bytes)}** ({budget_bytes:,} bytes).", ""]
    for group in groups:
        title = f"{group.run_id}" + (f" · {group.device} · {group.workload} · {group.data}" if group.suffix else "")
        lines += [f"## {title}", "", "### Environment", "", *_env_lines(group), ""]
        if group.strategies_left_out:
            lines += [f"**{group.strategies_left_out:,} more strategies are not shown:** a report shows the first "
                      f"{MAX_STRATEGIES} of a run (baseline, techniques, compositions, pitfalls), its time bounded.",
                      ""]
        order = strategy_order(group.frame)
        rows = group.at_batch()
        techniques = [s for s in order if s not in pitfall_strategies(group.frame)]
        for phase in ("train", "eval"):
            phase_rows = rows[rows["phase"] == phase]
            if phase_rows.empty:
                continue
            lines += [f"### {phase} (batch {group.chosen_batch})", "", *phase_table(phase_rows, techniques), ""]
            pitfalls = pitfall_table(phase_rows, order)
            if pitfalls:
                lines += [f"#### pitfalls, {phase} (batch {group.chosen_batch})", "", PITFALLS_INTRO, "",
                          *pitfalls, ""]
        other_phases = sorted(set(rows["phase"]) - {"train", "eval"})
        for phase in other_phases:
            lines += [f"### {phase} (batch {group.chosen_batch})", "",
                      *phase_table(rows[rows["phase"] == phase], order), ""]
        if len(group.batch_sizes) > 1:
            for phase in [p for p in ("train", "eval") if (group.frame["phase"] == p).any()]:
                shown = "" if len(group.shown_batch_sizes) == len(group.batch_sizes) else (
                f"{len(group.shown_batch_sizes)} of the {len(group.batch_sizes):,} batch sizes, spread from the "
                "smallest to the largest; the CSV holds every one.")
            lines += [f"### Peak MiB by batch size ({phase})", "", *([shown, ""] if shown else []),
                      *batch_table(group, phase, order, budget_bytes), ""]
        lines += plan_table(group)
        lines += ["### Charts", ""]
        for name, caption in charts.CAPTIONS.items():
            if name in group.charts:
                lines += [f"**{caption}**", "", f"![{caption}]({_rel(group.charts[name], out_dir)})", ""]
            elif name in group.skipped:
                lines += [f"**{caption}:** skipped: {group.skipped[name]}", ""]
    lines += [HOW_TO_READ]
    return "\n".join(lines)


def left_out_line(drawn: list[Group], left_out: list[Group]) -> str:
    """What a report past MAX_GROUPS says of the groups it did not draw."""
    runs = len({g.run_id for g in left_out})
    return (f"**{len(left_out):,} more groups (runs, devices, workloads or data sources; {runs:,} run ids) are not "
            f"drawn:** a report draws the first {len(drawn)} (by run id), its time bounded; report the others from "
            "their own CSVs, or name fewer at once.")


# --- entry point -----------------------------------------------------------------------------------------


def build_report(csv_paths: list[Path], out_dir: Path, budget_bytes: int | None = None,
                 name: str | None = None) -> Path:
    """Reads the results CSVs, writes charts (`<run_id>.<chart>.png`) and the report `name` (default
    `<csv stem>.REPORT.md`, `report_name`: one per run) into `out_dir`, returns its path. Charts 1-3 use batch size 100 if present, else the largest; chart 4 needs several
    batch sizes; chart 5 needs `<run_id>.timeline.csv` next to the results file."""
    csv_paths = [Path(p) for p in csv_paths]
    if not csv_paths:
        raise ValueError("no results CSV given")
    missing = [str(p) for p in csv_paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"results CSV not found: {', '.join(missing)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    frames, timelines = [], {}
    for path in csv_paths:
        frame = load_results(path)
        frames.append(frame)
        for run_id in frame["run_id"].unique():
            timeline = find_timeline(path, run_id)
            if timeline is not None:
                timelines.setdefault(run_id, timeline)
    frame = pd.concat(frames, ignore_index=True)
    if frame.empty:
        raise ValueError(f"no rows in {', '.join(str(p) for p in csv_paths)}")

    groups = make_groups(frame)
    groups, left_out = groups[:MAX_GROUPS], groups[MAX_GROUPS:]
    for group in groups:
        group.timeline = timelines.get(group.run_id)
        charts.draw_all(group, out_dir, budget_bytes)

    report = out_dir / (name or report_name(csv_paths, ".md"))
    write_text_atomic(report, render_markdown(groups, out_dir, budget_bytes, left_out))
    return report
