"""The console text of explain, predict and fit: their tables and lines, made from the data analysis returns
(`bench.analysis.explain`, `bench.analysis.predict`, `bench.analysis.fit`)."""

from __future__ import annotations

import math

from bench.analysis.explain import ModuleRow, UnitRow
from bench.analysis.fit import FitResult
from bench.cli.arguments import batch_option_of
from bench.core.results import Status
from bench.core.units import MiB, format_mib, format_size
from bench.measure.breakdown import BREAKDOWN_COLUMNS
from bench.run.rule_of_thumb import RULE_OF_THUMB_CAVEATS


# --- explain ----------------------------------------------------------------------------------------------------

def format_explain(case, memory: dict, modules: list[ModuleRow], rule: dict) -> str:
    """One case's peak broken down by category, the rule of thumb beside it, and what each module's forward adds
    (`bench.analysis.explain.explain`)."""
    peak = memory["peak_mem_bytes"]
    lines = [f"{case.label()}  workload={case.workload} data={case.data}",
             f"peak (exact live tensor bytes): {peak:,} B = {format_mib(peak)} MiB, "
             f"in stage {memory['peak_stage']}", "",
             "breakdown of the peak:"]
    for column in BREAKDOWN_COLUMNS:
        value = memory[column]
        label = column.removeprefix("peak_").removesuffix("_bytes")
        label = "batch+buffers" if label == "batch" else label
        lines.append(f"  {label:<14} {format_mib(value):>10} MiB  {100 * value / peak:5.1f}%")
    lines.append(f"  {'total':<14} {format_mib(sum(memory[c] for c in BREAKDOWN_COLUMNS)):>10} MiB")
    lines += ["", "rule of thumb (the article: params + sum of module outputs"
              + (" x2 + optimizer state):" if case.phase == "train" else "):"),
              f"  params {format_mib(rule['params_bytes'])} MiB + outputs of {rule['modules_counted']} modules "
              f"{format_mib(rule['outputs_bytes'])} MiB x{rule['outputs_factor']} "
              f"+ optimizer {format_mib(rule['optimizer_bytes'])} MiB"
              f" = {format_mib(rule['total_bytes'])} MiB",
              f"  measured peak {format_mib(peak)} MiB; rule / measured = {rule['total_bytes'] / peak:.2f}",
              "  why it is off:"]
    lines += [f"  - {c}" for c in RULE_OF_THUMB_CAVEATS]
    lines += ["", "per module (forward of the measured step; added = live bytes after - before its forward,",
              "peak within = highest live bytes during it - before; MiB):",
              f"  {'module':<34} {'type':<18} {'output':>9} {'added':>9} {'peak within':>11}"]
    for row in modules:
        name = "  " * row.depth + row.name
        lines.append(f"  {name:<34} {row.kind:<18} {format_mib(row.output_bytes):>9} "
                     f"{format_mib(row.after - row.before):>9} {format_mib(row.peak_within):>11}")
    return "\n".join(lines)


def format_plan_units(label: str, kind: str, units: list[UnitRow], peak: int, baseline_peak: int) -> str:
    """The plan unit by unit (`units` with the checkpoint each belongs to, `bench.analysis.explain.plan_units`):
    which units are recomputed in backward and what each one's forward keeps in the baseline, which is what
    recomputing it can save."""
    selective = kind == "operators"  # recomputed within every unit, not whole units
    total_flops = sum(u.forward_flops for u in units) or 1
    recomputed = [u for u in units if u.checkpoint or selective]
    lines = ["", f"checkpointing plan ({label}): peak {format_mib(peak)} MiB "
                 f"against the baseline's {format_mib(baseline_peak)} MiB",
             ("  every unit is its own checkpoint; in backward only its cheap ops are recomputed (the policy keeps the "
              "outputs of its expensive ones)") if selective else
             (f"  {len(recomputed)} of {len(units)} units recomputed in backward, "
              f"{sum(u.forward_flops for u in recomputed) / 1e9:,.3f} of {total_flops / 1e9:,.3f} forward GFLOP; a "
              "checkpoint keeps only its first unit's input, so it saves what its units keep, less that input"),
             f"  {'unit':<4} {'module':<26} {'checkpoint':>10} {'fwd GFLOP':>10} {'kept':>11} {'saves':>11}"]
    for u in units:
        saves = format_size(u.kept_bytes) if u.checkpoint else ("part" if selective else "-")
        lines.append(f"  {u.index:<4} {u.name[:26]:<26} {u.checkpoint or ('each' if selective else '-'):>10} "
                     f"{u.forward_flops / 1e9:>10,.3f} {format_size(u.kept_bytes):>11} {saves:>11}")
    lines.append("  (kept: live bytes the unit's forward adds in the baseline's measured step, its output included)")
    return "\n".join(lines)


# --- predict ----------------------------------------------------------------------------------------------------

def format_predictions(rows: list[dict]) -> str:
    """The console table: allocated (and on CUDA reserved) per case, what the peak is made of (MiB), the engine,
    and any note (the attention kernel of scaled_dot_product_attention among them)."""
    cuda = any(r["device"] == "cuda" for r in rows)
    parts = [("weights", "predicted_weights_bytes"), ("grads", "predicted_grads_bytes"),
             ("optim", "predicted_optimizer_state_bytes"), ("activ", "predicted_activations_bytes"),
             ("logits", "predicted_logits_bytes"), ("comm", "predicted_communication_bytes"),
             ("other", "predicted_other_bytes")]
    header = (f"{'strategy':<28} {'phase':<5} {'batch':>5} {'allocated bytes':>16} {'MiB':>9} "
              + (f"{'reserved MiB':>12} {'cuBLAS MiB':>10} " if cuda else "")
              + "".join(f"{name:>8} " for name, _ in parts) + f"{'engine':<6}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        b = f"{r['predicted_bytes']:,}" if r["predicted_bytes"] is not None else "-"
        m = f"{r['predicted_mib']:.1f}" if r["predicted_mib"] is not None else "-"
        extra = ""
        if cuda:
            reserved = r.get("predicted_reserved_mib")
            workspace = r.get("cublas_workspace_bytes")
            extra = (f"{reserved:>12.1f} " if reserved is not None else f"{'-':>12} ") + \
                    (f"{workspace / MiB:>10.1f} " if workspace is not None else f"{'-':>10} ")
        extra += "".join(f"{r[column] / MiB:>8.0f} " if r.get(column) is not None else f"{'-':>8} "
                         for _, column in parts)
        note = r["status"] if r["status"] != Status.OK else ""
        kernel = f"sdpa: {r['sdpa_kernel']}" if r.get("sdpa_kernel") else ""
        note = "; ".join(x for x in (note, kernel, r["message"]) if x)
        lines.append(f"{r['strategy']:<28} {r['phase']:<5} {r['batch_size']:>5} {b:>16} {m:>9} {extra}"
                     f"{r['engine'] or '-':<6}  {note}")
    return "\n".join(lines)


# --- fit --------------------------------------------------------------------------------------------------------

def nothing_fits(results: list[FitResult]) -> str | None:
    """None when some strategy fits a batch; else one line naming the smallest peak any of them reaches (batch 1's)
    and the strategy that reaches it."""
    if any(r.batch_size >= 1 for r in results):
        return None
    budget = results[0].budget_bytes
    reached = [r for r in results if r.next_batch_peak_bytes is not None]
    if not reached:
        return f"nothing fits in {format_size(budget)}: no strategy ran at batch 1 (out of memory or unsupported)"
    smallest = min(reached, key=lambda r: r.next_batch_peak_bytes)
    peak = smallest.next_batch_peak_bytes
    return (f"nothing fits in {format_size(budget)} ({budget:,} B): the smallest peak is {format_size(peak)} "
            f"({peak:,} B), {smallest.strategy} at batch 1")


def mib_beside_budget(n_bytes: int, budget_bytes: int) -> str:
    """MiB to one decimal, rounded away from the budget: a peak over the budget never prints as equal to it or
    below it, and a peak under it never prints above it."""
    tenths = n_bytes / MiB * 10
    tenths = math.ceil(tenths) if n_bytes > budget_bytes else math.floor(tenths)
    return f"{tenths / 10:,.1f}"


def format_fit(results: list[FitResult], time_steps: int) -> str:
    """The table of fit's answers, one line per strategy, and how its time was measured."""
    header = (f"{'strategy':<28} {'phase':<5} {'largest batch':>13} {'peak MiB':>9} {'budget MiB':>10} "
              f"{'next MiB':>9} {'ms/sample':>9} {'runs':>4}  note")
    lines = [header, "-" * len(header)]
    for r in results:
        peak = mib_beside_budget(r.peak_bytes, r.budget_bytes) if r.peak_bytes is not None else "-"
        nxt = (mib_beside_budget(r.next_batch_peak_bytes, r.budget_bytes) if r.next_batch_peak_bytes is not None
               else "-")
        t = f"{r.time_per_sample_ms:.2f}" if r.time_per_sample_ms is not None else "-"
        verified = "verified by a tracked run" if r.verified and r.device == "cpu" else \
            ("verified by a run" if r.verified else "")
        note = "; ".join(x for x in (verified, f"next batch by {r.next_batch_method}" if r.next_batch_method else "",
                                       r.note) if x)
        budget = mib_beside_budget(r.budget_bytes, r.budget_bytes)
        lines.append(f"{r.strategy:<28} {r.phase:<5} {r.batch_size:>13} {peak:>9} {budget:>10} "
                     f"{nxt:>9} {t:>9} {r.runs:>4}  {note}")
    lines.append(f"(ms/sample from {time_steps} timed step(s) at the largest batch; on the CPU the steps after its "
                 "tracked first step)"
                 if time_steps else "(time not measured)")
    return "\n".join(lines)


def format_fit_seq_len(results: list[FitResult]) -> str:
    """The table of `fit --over seq_len`: the longest sequence per strategy, what was judged, and what made up the
    peak; every figure a prediction."""
    header = (f"{'strategy':<34} {'longest seq_len':>15} {'judged MiB':>10} {'next MiB':>9} {'budget MiB':>10}  "
              "peak made of; monotonic check; note")
    lines = [header, "-" * len(header)]
    for r in results:
        judged = mib_beside_budget(r.judged_bytes, r.budget_bytes) if r.judged_bytes is not None else "-"
        nxt = mib_beside_budget(r.next_judged_bytes, r.budget_bytes) if r.next_judged_bytes is not None else "-"
        budget = mib_beside_budget(r.budget_bytes, r.budget_bytes)
        note = "; ".join(x for x in (r.peak_by, r.monotonic_check, r.note) if x)
        longest = "-" if r.seq_len is None else r.seq_len  # None: not searched (plan --over seq_len)
        lines.append(f"{r.strategy:<34} {longest:>15} {judged:>10} {nxt:>9} {budget:>10}  {note}")
    return "\n".join(lines)


def mib_or_dash(value) -> str:
    """Bytes as MiB with one decimal, or "-" for none."""
    return "-" if value is None else f"{value / MiB:,.1f}"


def ms_or_dash(value) -> str:
    """Milliseconds as a whole number, or "-" for none."""
    return "-" if value is None else f"{value:,.0f}"


def compare_command(request, spec: str) -> str:
    """The `compare` command that measures `spec` against the baseline."""
    ranks = f" --ranks {request.ranks}" if request.ranks > 1 else ""
    batch = batch_option_of(request.batch_size, request.ranks)
    return (f"python -m bench compare --workload {request.workload} {batch} --device {request.device} --phases train "
            f"--strategies {spec}{ranks}")


def rank_share(batch_size: int, ranks: int) -> str:
    """Each rank's share of the step's batch: `2 a rank`, or `2 or 1 a rank` where the ranks do not divide it."""
    low, extra = divmod(batch_size, ranks)
    return f"{low} a rank" if not extra else f"{low + 1} or {low} a rank"


def batch_words(batch_size: int, ranks: int) -> str:
    """`batch 8`, or on several ranks the step's batch and each rank's share: `batch 8 (1 a rank on 8 ranks)`."""
    if ranks <= 1:
        return f"batch {batch_size}"
    return f"batch {batch_size} ({rank_share(batch_size, ranks)} on {ranks} ranks)"
