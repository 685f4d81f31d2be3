"""The blocks tools/docs/figures.py writes from the reference runs (models, captcha, llm, fit, peers): each a function
(results file or folder, page) -> markdown registered under its block's name; the anchors' are in accuracy_table.py."""

from __future__ import annotations

import csv
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
GiB = 2**30
GENERATORS: dict[str, Callable[[Path, Path], str]] = {}


def generator(name: str):
    """Register `function(csv_path, page_path) -> markdown` as the generator of blocks named `name`."""
    def register(function):
        GENERATORS[name] = function
        return function
    return register


def link(path: Path, page: Path) -> str:
    """`path` as a markdown link target from `page` (docs/ pages link with ../)."""
    relative = path.relative_to(ROOT).as_posix()
    return relative if page.parent == ROOT else "../" + relative


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _ratio_cell(row: dict, baseline: dict) -> str:
    if row["status"] != "ok":
        message = row["message"]
        why = ("no ReLU" if "has no ReLU" in message else "in place already" if "in place already" in message
               else "CUDA only" if "needs device cuda" in message else "")
        return f"unsupported ({why})" if why else "unsupported"
    mem = float(row["mem_vs_baseline"])
    cell = f"**{mem:.2f}×**" if mem < 0.4 else f"{mem:.2f}×"
    cell += f", {float(row['time_vs_baseline']):.2f}×"
    if row["noisy"] == "True" or baseline["noisy"] == "True":
        cell += " ~"
    if row["matches_baseline"] != "True":
        cell += ", **does not match**"
    return cell


def ratio_table(rows: list[dict], phase: str) -> str:
    """Strategies down, workloads across: each cell peak memory × and step time × against the workload's baseline.
    A strategy unsupported on every workload in this phase is left out."""
    rows = [r for r in rows if r["phase"] == phase]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    batch = {r["workload"]: r["batch_size"] for r in rows}
    cell = {(r["workload"], r["strategy"]): r for r in rows}
    strategies = [s for s in dict.fromkeys(r["strategy"] for r in rows)
                  if s != "baseline" and any(r["status"] == "ok" for r in rows if r["strategy"] == s)]
    heads = [f"{w} (batch {batch[w]})" if i == 0 else f"{w} ({batch[w]})" for i, w in enumerate(workloads)]
    lines = ["| strategy | " + " | ".join(heads) + " |", "|---" * (len(workloads) + 1) + "|",
             "| baseline peak | " + " | ".join(f"{float(cell[w, 'baseline']['peak_mem_bytes']) / MiB:,.1f} MiB"
                                               for w in workloads) + " |"]
    for s in strategies:
        lines.append(f"| `{s}` | " + " | ".join(_ratio_cell(cell[w, s], cell[w, "baseline"]) for w in workloads)
                     + " |")
    return "\n".join(lines)


@generator("models-train")
def models_train(source: Path, page: Path) -> str:
    return ratio_table(read_rows(source), "train")


@generator("models-eval")
def models_eval(source: Path, page: Path) -> str:
    return ratio_table(read_rows(source), "eval")


def _span(values: list[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}–{high}"


def _convolutional(workload: str) -> bool:
    """Whether the model of `workload` (a row's spec) has convolution layers: its trait, read from its modules on a
    model that holds no memory (`workloads.Workload.traits`)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from workloads import get_workload  # torch and the workloads: only for the blocks that need a model's traits
    from workloads import Trait

    return Trait.CONVOLUTIONAL.value in get_workload(workload).traits()


def _claim(holds: bool, claim: str, source: Path) -> None:
    if not holds:
        raise ValueError(f"{source.name} no longer supports the claim {claim!r}: rewrite its words "
                         "in tools/docs/figures.py")


@generator("models-findings")
def models_findings(source: Path, page: Path) -> str:
    """The README's bullets of what the models run says, every figure computed from the run."""
    rows = [r for r in read_rows(source) if r["status"] == "ok"]
    get = {(r["workload"], r["strategy"], r["phase"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    convolutional = [w for w in workloads if _convolutional(w)]
    mem = lambda w, s, p: float(get[w, s, p]["mem_vs_baseline"])  # noqa: E731
    time = lambda w, s, p: float(get[w, s, p]["time_vs_baseline"])  # noqa: E731
    saving = lambda values: _span([(1 - v) * 100 for v in values], "{:.0f}")  # noqa: E731
    amp = [w for w in workloads if w != "deep_mlp"]
    relu = [mem(w, "inplace_relu", "train") for w in workloads if (w, "inplace_relu", "train") in get]
    # the bullets' words are claims about the run: a run that contradicts one fails here rather than print it
    _claim(max(mem(w, "checkpoint", "train") for w in ("gpt_mini", "deep_mlp"))
           < min(mem(w, "checkpoint", "train") for w in convolutional), "checkpointing saves most off the MLP and the "
           "transformer", source)
    _claim(all(round(mem(w, "checkpoint", "eval"), 2) == 1 for w in workloads), "checkpointing: nothing in eval",
           source)
    _claim(all(time(w, "amp", "train") < 1 for w in amp), "amp is faster on every model with real matrices", source)
    _claim(all(round(v, 2) == 1 for v in relu), "in-place ReLU saves nothing in training", source)
    return "\n".join([
        f"- **Checkpointing pays where activations dominate the peak**: −{saving([mem('gpt_mini', 'checkpoint', 'train')])}%"
        f" on the transformer and −{saving([mem('deep_mlp', 'checkpoint', 'train')])}% on the 1000-layer MLP, "
        f"{saving([mem(w, 'checkpoint', 'train') for w in convolutional])}% less on the {len(convolutional)} CNNs for "
        f"{_span([(time(w, 'checkpoint', 'train') - 1) * 100 for w in convolutional], '{:.0f}')}% more time, and "
        f"nothing in evaluation ({_span([mem(w, 'checkpoint', 'eval') for w in workloads], '{:.2f}')}× the eval peak).",
        f"- **Mixed precision pays on a CPU with bfloat16 instructions**: `amp` saves "
        f"{saving([mem(w, 'amp', 'train') for w in amp])}% of the training peak and takes "
        f"{_span([time(w, 'amp', 'train') for w in amp], '{:.2f}')}× the time on every model with real matrices "
        f"(on `deep_mlp`, whose 10×10 layers are all cast overhead, {time('deep_mlp', 'amp', 'train'):.2f}×).",
        "- **The article's validation loop is a memory leak of one graph**: with autograd on, the kept output of the "
        "previous batch holds its whole graph, so `del_intermediates` takes every model's eval peak to "
        f"{_span([mem(w, 'del_intermediates', 'eval') for w in workloads], '{:.2f}')}× and `no_grad_eval` cuts it by "
        f"{saving([mem(w, 'no_grad_eval', 'eval') for w in workloads])}%.",
        "- **In-place ReLU saves nothing in training** where it applies ("
        + _span(relu, "{:.2f}")
        + "× the peak: each ReLU follows a BatchNorm, which does not need its own output)."])


@generator("captcha-table")
def captcha_table(source: Path, page: Path) -> str:
    """The captcha model at its largest batch: peak and step time per strategy in train and eval, with ratios."""
    rows = read_rows(source)
    batch = max(int(r["batch_size"]) for r in rows)
    get = {(r["strategy"], r["phase"]): r for r in rows if int(r["batch_size"]) == batch}
    strategies = list(dict.fromkeys(s for s, _ in get))

    def cells(strategy, phase):
        row = get.get((strategy, phase))
        if row is None or row["status"] != "ok":
            return [row["status"] if row else "", ""]
        return [f"{float(row['peak_mem_bytes']) / MiB:,.1f} ({float(row['mem_vs_baseline']):.2f}×)",
                f"{float(row['step_time_ms_median']) / 1000:.2f} ({float(row['time_vs_baseline']):.2f}×)"]

    def matches(strategy):
        found = [r["matches_baseline"] for p in ("train", "eval") if (r := get.get((strategy, p))) and
                 r["status"] == "ok"]
        return "" if not found else "yes" if all(m == "True" for m in found) else "**no**"

    lines = [f"Batch {batch}:", "",
             "| strategy | train peak MiB | train step s | eval peak MiB | eval step s | matches baseline |",
             "|---|---:|---:|---:|---:|---|"]
    for s in strategies:
        lines.append(f"| `{s}` | " + " | ".join([*cells(s, "train"), *cells(s, "eval"), matches(s)]) + " |")
    return "\n".join(lines)


@generator("amp-slowdown")
def amp_slowdown(source: Path, page: Path) -> str:
    """One sentence: how many times slower `amp` was where the CPU emulated bfloat16 (a captcha `make bench` run)."""
    rows = [r for r in read_rows(source) if r["status"] == "ok" and r["strategy"] == "amp"]
    batch = max(int(r["batch_size"]) for r in rows)
    at = {r["phase"]: float(r["time_vs_baseline"]) for r in rows if int(r["batch_size"]) == batch}
    every = [float(r["time_vs_baseline"]) for r in rows]
    return (f"On an AMD EPYC without bfloat16 instructions the same `amp` took {at['train']:.1f}× the baseline's time "
            f"a training step and {at['eval']:.1f}× an eval step at batch {batch} ({min(every):.1f}× to "
            f"{max(every):.1f}× over the run's {len(every)} `amp` cases: "
            f"[`{source.parent.name}/`]({link(source.parent / 'REPORT.md', page)})).")


@generator("llm-measured")
def llm_measured(source: Path, page: Path) -> str:
    """A language model's training peak per strategy, measured on the CPU, against its baseline."""
    rows = [r for r in read_rows(source) if r["phase"] == "train"]
    workload, batch = rows[0]["workload"], rows[0]["batch_size"]
    lines = [f"| strategy | `{workload}`, batch {batch}: peak | vs baseline | matches the baseline |",
             "|---|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| `{r['strategy']}` | {r['status']} | | |")
            continue
        message = r["message"]
        verdict = ("yes" if r["matches_baseline"] == "True" and "by design" not in message
                   else "first step yes; differs by design" if r["matches_baseline"] == "True"
                   else "differs by design" if "by design" in message else "**no**")
        lines.append(f"| `{r['strategy']}` | {float(r['peak_mem_bytes']) / MiB:,.1f} MiB | "
                     f"{float(r['mem_vs_baseline']):.2f}× | {verdict} |")
    return "\n".join(lines)


def _fit_rows(source: Path) -> list[dict]:
    return read_rows(source)


@generator("fit-table")
def fit_table(source: Path, page: Path) -> str:
    """`fit`'s answer per strategy: the largest batch under the budget, its peak, its time per sample."""
    rows = _fit_rows(source)
    budget = int(rows[0]["budget_bytes"]) / MiB
    lines = [f"| strategy | largest batch under {budget:,.0f} MiB | peak at that batch | confirmed by a real run | "
             "time per sample |", "|---|---:|---:|---|---:|"]
    for r in rows:
        peak = f"{int(r['peak_bytes']) / MiB:,.1f} MiB" if r["peak_bytes"] else ""
        per_sample = f"{float(r['time_per_sample_ms']):,.0f} ms" if r["time_per_sample_ms"] else ""
        lines.append(f"| `{r['strategy']}` | {r['batch_size']} | {peak} | "
                     f"{'yes' if r['verified'] == 'True' else 'no'} | {per_sample} |")
    return "\n".join(lines)


@generator("fit-readme")
def fit_readme(source: Path, page: Path) -> str:
    """One sentence of `fit`'s answers, linking the CSV."""
    rows = _fit_rows(source)
    answers = ", ".join(f"{r['batch_size']} with `{r['strategy']}`" for r in rows)
    return (f"  {answers} ([`{source.relative_to(ROOT).as_posix()}`]({link(source, page)}); "
            f"[docs/prediction.md]({link(ROOT / 'docs' / 'prediction.md', page)}#fit-the-largest-batch-under-a-budget)).")


def gib(value) -> str:
    return f"{int(value) / GiB:,.1f}"


def row_of(rows: list[dict], strategy: str) -> dict | None:
    """The train row of `strategy` in a predict CSV's rows, or None."""
    return next((r for r in rows if r["strategy"] == strategy and r["phase"] == "train"), None)


def cell(row: dict | None) -> str:
    """Allocated / reserved GiB of a predict row, or its status."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    return f"{gib(row['predicted_bytes'])} / {gib(row['predicted_reserved_bytes'])}"


def _peers(folder: Path) -> tuple[list[dict], dict[str, list[dict]]]:
    """The estimators' CSV and, per preset, its newest predict CSV (tools/peers/presets_table.py's layout)."""
    estimators = read_rows(folder / "estimators.csv")
    return estimators, {e["preset"]: read_rows(sorted((folder / e["preset"]).glob("predict-*.csv"))[-1])
                        for e in estimators}


@generator("peers-estimators")
def peers_estimators(source: Path, page: Path) -> str:
    """membench's predicted peak of each preset beside accelerate's and DeepSpeed's estimates ."""
    estimators, predicted = _peers(source)
    lines = ["| model (seq) | parameters | membench: allocated / reserved | of which not model states (activations, "
             "logits, temporaries) | accelerate: fp32 / mixed | DeepSpeed ZeRO-2 / ZeRO-3, 1 GPU |",
             "|---|---:|---:|---:|---:|---:|"]
    for e in estimators:
        base = row_of(predicted[e["preset"]], "baseline")
        rest = sum(int(base[f"predicted_{k}_bytes"]) for k in ("activations", "logits", "other"))
        lines.append(f"| {e['preset']} ({e['seq_len']}) | {int(e['params']) / 1e9:.3f} B | {cell(base)} | "
                     f"{gib(rest)} | {gib(e['accelerate_train_fp32_bytes'])} / "
                     f"{gib(e['accelerate_train_mixed_bytes'])} | "
                     f"{gib(e['deepspeed_zero2_bytes'])} / {gib(e['deepspeed_zero3_bytes'])} |")
    return "\n".join(lines)


PEER_TECHNIQUES = ("baseline", "lora", "lora+checkpoint", "lora+checkpoint+chunked_loss", "amp")


@generator("peers-techniques")
def peers_techniques(source: Path, page: Path) -> str:
    """membench's predicted peak of each preset per technique, and the attention kernel SDPA chose."""
    estimators, predicted = _peers(source)
    lines = ["| model (seq) | baseline (AdamW) | lora | lora+checkpoint | lora+checkpoint+chunked_loss | amp | "
             "SDPA kernel |", "|---|---:|---:|---:|---:|---:|---|"]
    for e in estimators:
        rows = predicted[e["preset"]]
        amp = sorted({r["sdpa_kernel"] for r in rows if r["strategy"] == "amp" and r["sdpa_kernel"]})
        other = sorted({r["sdpa_kernel"] for r in rows if r["strategy"] != "amp" and r["sdpa_kernel"]})
        cells = [cell(row_of(rows, s)) for s in PEER_TECHNIQUES]
        lines.append(f"| {e['preset']} ({e['seq_len']}) | " + " | ".join(cells) + " | "
                     + ", ".join([f"{k} (amp)" for k in amp] + other) + " |")
    return "\n".join(lines)


@generator("peers-readme")
def peers_readme(source: Path, page: Path, preset: str = "llama-3.1-8b") -> str:
    """One preset's predicted peaks per technique, and the peers' figures, in a sentence."""
    estimators, predicted = _peers(source)
    e = next(e for e in estimators if e["preset"] == preset)
    rows = predicted[preset]
    each = "; ".join(f"`{s}` {cell(row_of(rows, s))}" for s in PEER_TECHNIQUES
                     if row_of(rows, s))
    return (f"`predict --device cuda` for `hf:{preset}:seq_len={e['seq_len']}` at batch 1, training, allocated / "
            f"reserved GiB on fake CUDA: {each}. For the same model accelerate's `estimate-memory` says "
            f"{gib(e['accelerate_train_fp32_bytes'])} GiB (float32) or "
            f"{gib(e['accelerate_train_mixed_bytes'])} GiB (mixed), DeepSpeed's ZeRO-2 model states "
            f"{gib(e['deepspeed_zero2_bytes'])} GiB on one GPU: neither counts activations or logits "
            f"([`{source.relative_to(ROOT).as_posix()}/`]({link(source, page)}/README.md), "
            f"[docs/peers.md]({link(ROOT / 'docs' / 'peers.md', page)}), every preset).")


def _harness_rows(folder: Path, threshold: str) -> dict[tuple, dict]:
    """benchmarks/resident_memory.py's rows run with mmap threshold `threshold` (`off`: glibc's dynamic one), from
    every CSV of `folder` that names it, a later file's row replacing an earlier one's of the same case."""
    rows: dict[tuple, dict] = {}
    workloads: list[str] = []  # in the order the runs met them (a workload re-run alone keeps its place)
    for path in sorted(folder.glob(f"harness-memory-*-{threshold}.csv")):
        for r in read_rows(path):
            workloads += [r["workload"]] if r["workload"] not in workloads else []
            if r["strategy"]:  # a compare that failed as a whole has no case: its re-run has
                rows[(r["workload"], r["batch_size"], r["strategy"], r["phase"])] = r
    order = list(rows)
    return dict(sorted(rows.items(), key=lambda item: (workloads.index(item[0][0]), int(item[0][1]),
                                                       order.index(item[0]))))


@generator("harness-memory")
def harness_memory(source: Path, page: Path) -> str:
    """Per case: the counted peak, the resident peak and the process at rest with the harness's mmap threshold
    pinned (the newest run that is not `off`), the ratio (resident - rest) / counted against the goal, and the ratio
    of the run with glibc's own threshold beside it."""
    labels = sorted({p.name.rsplit("-", 1)[1][:-4] for p in source.glob("harness-memory-*.csv")} - {"off"})
    if not labels:
        raise FileNotFoundError(f"no pinned run in {source}")
    pinned, before = _harness_rows(source, labels[-1]), _harness_rows(source, "off")
    lines = [f"| workload | batch | strategy | phase | counted peak | resident peak | at rest | ratio | <= 1.3 | "
             f"ratio, glibc's threshold |", "|---|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for key, r in pinned.items():
        if r["status"] != "ok" or not r["ratio"]:
            continue  # `lora` in eval: unsupported, no figures
        old = before.get(key)
        old_ratio = f"{float(old['ratio']):.2f}" if old and old["ratio"] else ""
        lines.append(f"| `{key[0]}` | {key[1]} | `{key[2]}` | {key[3]} | {float(r['peak_mem_bytes']) / MiB:,.1f} MiB | "
                     f"{float(r['process_peak_rss_bytes']) / MiB:,.1f} MiB | "
                     f"{float(r['process_rest_rss_bytes']) / MiB:,.1f} MiB | {float(r['ratio']):.2f} | "
                     f"{'yes' if r['meets_goal'] == 'True' else '**no**'} | {old_ratio} |")
    return "\n".join(lines)


_CARD = re.compile(r"longest sequence .* on (?P<card>.+) \((?P<gib>[\d.]+) GiB\), phase")
_PROBE = re.compile(r"^fit (?P<strategy>\S+): seq_len (?P<seq_len>\d+): judged (?P<judged>[\d.]+) GiB "
                    r"vs budget (?P<budget>[\d.]+) GiB$", re.M)


def _longest_answers(folder: Path) -> tuple[dict[float, str], dict[tuple[float, str], dict]]:
    """`fit --over seq_len`'s answers in `folder`: the card of each budget (GiB, named in the logs' result lines) and,
    per (budget GiB, strategy), the longest sequence with the judged GiB at it and at the next probe. A fit CSV's row
    (the newest CSV's) is the answer; a strategy no CSV holds for that budget, whose run was stopped before writing
    one, is read from its log's probe lines (the longest probe that fits, and the shortest longer one)."""
    cards: dict[float, str] = {}
    answers: dict[tuple[float, str], dict] = {}
    for log in sorted(folder.glob("*.stdout.txt")):
        text = log.read_text(encoding="utf-8")
        cards.update({float(m["gib"]): m["card"] for m in _CARD.finditer(text)})
        probes: dict[tuple[float, str], list[tuple[int, float]]] = {}
        for m in _PROBE.finditer(text):
            probes.setdefault((float(m["budget"]), m["strategy"]), []).append((int(m["seq_len"]), float(m["judged"])))
        for (budget, strategy), found in probes.items():
            fits = [p for p in found if p[1] <= budget]
            longest = max(fits, default=(0, None))
            over = min((p for p in found if p[0] > longest[0] and p[1] > budget), default=None)
            if over is not None:
                answers.setdefault((budget, strategy), {"seq_len": longest[0], "judged": longest[1],
                                                        "next_seq_len": over[0], "next_judged": over[1]})
    for path in sorted(folder.glob("fit-*.csv")):
        for r in read_rows(path):
            step = int(r["seq_len_step"])
            seq_len = int(r["seq_len"])
            answers[(round(int(r["budget_bytes"]) / GiB, 1), r["strategy"])] = {
                "seq_len": seq_len, "judged": int(r["judged_bytes"]) / GiB if r["judged_bytes"] else None,
                "next_seq_len": seq_len + step if seq_len else step,
                "next_judged": int(r["next_judged_bytes"]) / GiB}
    return cards, answers


@generator("longest-context")
def longest_context(source: Path, page: Path) -> str:
    """The longest sequence per strategy (rows) and card (columns), from `fit --over seq_len`'s CSVs and logs: the
    answer, the judged GiB at it and at the next multiple of 256, or the judged GiB at 256 where nothing fits."""
    cards, answers = _longest_answers(source)
    budgets = sorted({budget for budget, _ in answers})
    strategies = sorted({s for _, s in answers},
                        key=lambda s: [answers.get((b, s), {"seq_len": -1})["seq_len"] for b in reversed(budgets)])

    def head(budget: float) -> str:
        card = cards[budget]
        return card if card.endswith(f"{budget:.0f}GB") else f"{card} ({budget:.0f} GiB)"

    def answer(a: dict | None) -> str:
        if a is None:
            return "-"
        if not a["seq_len"]:
            return f"does not fit ({a['next_judged']:,.1f} GiB at {a['next_seq_len']:,})"
        return f"{a['seq_len']:,} ({a['judged']:,.1f} GiB; {a['next_seq_len']:,}: {a['next_judged']:,.1f})"

    lines = ["| strategy | " + " | ".join(head(b) for b in budgets) + " |",
             "| --- |" + " ---: |" * len(budgets)]
    for s in strategies:
        lines.append(f"| `{s}` | " + " | ".join(answer(answers.get((b, s))) for b in budgets) + " |")
    return "\n".join(lines)


def _gpu_check_rows(folder: Path, layers: str) -> list[dict]:
    """The anchors' rows of tools/gpu/check.py's CSVs under `folder` (`layers`: "layers2" or "layers0"), the newest ok
    row of each anchor (by the CSV's UTC time), without the bitsandbytes emulation's rows, which a real GPU refuses
    now (`optimizer:impl=bitsandbytes`); the `--case` rows (captcha, the cuda tests' cases) are not anchors."""
    newest: dict[str, dict] = {}
    for path in sorted(folder.glob(f"*/gpu-check-*-{layers}.csv"), key=lambda p: p.name):
        for r in read_rows(path):
            if r["status"] == "ok" and r["workload"].startswith("hf:") and r.get("error_pct"):
                newest[r["anchor"]] = r
    return [r for r in newest.values() if "impl=bitsandbytes" not in r["strategy"]]


def _compiled_low_bit(row: dict) -> bool:
    """A torchao low-bit AdamW (8- or 4-bit), whose update torch.compile fuses: predicted on the H200 before
    strategies/framework/compiled_update.py read inductor's buffers."""
    return any(f"optimizer:name=adamw{bits}bit" in row["strategy"] for bits in (8, 4))


def _gpu_check_summary(source: Path) -> dict:
    """What the GPU check found: allocated |error| at 2 decoder layers and at full size over the anchors'
    configurations measured and predicted on that GPU (tools/gpu/check.py's CSVs)."""
    two, full = _gpu_check_rows(source, "layers2"), _gpu_check_rows(source, "layers0")
    before = [r for r in two if _compiled_low_bit(r)]
    two = [r for r in two if not _compiled_low_bit(r)]
    error = lambda rows: sorted(abs(float(r["error_pct"])) for r in rows)  # noqa: E731
    _claim(all(e > 5 for e in error(before)), "the low-bit rows were predicted high before the compiled update",
           source)
    gib = sorted(float(r["measured_bytes"]) / GiB for r in full)
    return {"two": len(two), "median": statistics.median(error(two)), "largest": max(error(two)),
            "before": len(before), "before_low": min(error(before)), "before_high": max(error(before)),
            "full": len(full), "full_largest": max(error(full)), "gib": (gib[0], gib[-1]),
            "exact": sum(r["measured_bytes"] == r["predicted_bytes"] for r in full),
            "models": list(dict.fromkeys(Path(r["workload"].split(":")[1]).stem for r in full)),
            "first": min(two + full, key=lambda r: r["timestamp"])}


@generator("gpu-check")
def gpu_check(source: Path, page: Path) -> str:
    """The first GPU's check of the predictions, in a paragraph."""
    s = _gpu_check_summary(source)
    first = s["first"]
    return (f"The first GPU this project met, an {first['device_name']} ({first['timestamp'][:10]}, torch "
            f"{first['torch_version']}, CUDA {first['cuda_version']}), ran every single-GPU anchor's configuration and "
            f"compared `max_memory_allocated` with `predict` for that GPU: over {s['two']} configurations at 2 decoder "
            f"layers the |error| has median {s['median']:.2f}% and largest {s['largest']:.2f}%; the {s['before']} "
            f"whose low-bit AdamW update `torch.compile` fuses were {s['before_low']:.0f}-{s['before_high']:.0f}% high "
            "there: the mechanism the GPU showed missing, which predict now counts (their figures predicted again "
            f"since, on the CPU, are in the folder's README); {s['full']} at full size ({', '.join(s['models'])}; "
            f"{s['gib'][0]:.0f} to {s['gib'][1]:.0f} GiB) are within {s['full_largest']:.2f}%, {s['exact']} of them "
            f"equal to the byte ([`{source.relative_to(ROOT).as_posix()}/`]({link(source, page)}/README.md)).")


@generator("gpu-check-readme")
def gpu_check_readme(source: Path, page: Path) -> str:
    """The README's clause of the GPU check: the largest allocated |error| at 2 layers and at full size."""
    s = _gpu_check_summary(source)
    return (f"The predictions met a real GPU once (an {s['first']['device_name'].removeprefix('NVIDIA ')}: allocated "
            f"within {s['largest']:.2f}% at 2 layers, {s['full_largest']:.2f}% at full size; "
            f"[`{source.relative_to(ROOT).as_posix()}/`]({link(source, page)}/README.md)), and")


def _small(value: str) -> str:
    """A relative difference as docs/strategies.md writes it: 0, 7.5e-5, 0.60."""
    number = float(value or 0)
    if number == 0:
        return "0"
    return f"{number:.1e}".replace("e-0", "e-") if abs(number) < 0.01 else f"{number:.2f}"


@generator("strategy-verdicts")
def strategy_verdicts(source: Path, page: Path) -> str:
    """A compare run's training rows: peak, against the baseline, whether the step matched it, and by how much the
    loss and the gradients differ."""
    rows = [r for r in read_rows(source) if r["phase"] == "train" and r["status"] == "ok"]
    lines = ["| strategy | peak (MiB) | vs base | matches | loss_rel_diff | max_grad_rel_diff |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = ("yes" if r["matches_baseline"] == "True" else "by design" if "by design" in r["message"]
                   else "**no**")
        lines.append(f"| `{r['strategy']}` | {float(r['peak_mem_bytes']) / MiB:,.1f} | "
                     f"{float(r['mem_vs_baseline']):.2f}× | {verdict} | {_small(r['loss_rel_diff'])} | "
                     f"{_small(r['max_grad_rel_diff'])} |")
    return "\n".join(lines)


BREAKDOWN = (("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer state"),
             ("activations", "activations"), ("temp", "temporaries"), ("batch", "batch"))


@generator("peak-moves")
def peak_moves(source: Path, page: Path) -> str:
    """A compare run's training rows: each peak against the baseline's, and every part of the peak's breakdown that
    moved by 0.1 MiB or more (the parts `peak_*_bytes` of the results table)."""
    rows = [r for r in read_rows(source) if r["phase"] == "train" and r["status"] == "ok"]
    base = next(r for r in rows if r["strategy"] == "baseline")
    lines = ["| strategy | train peak MiB | what moved at the peak | matches baseline |", "|---|---:|---|---|"]
    for r in rows:
        peak, difference = float(r["peak_mem_bytes"]), float(r["peak_mem_bytes"]) - float(base["peak_mem_bytes"])
        shown = (f"{peak / MiB:,.1f} ({difference:+,.0f} bytes)" if 0 < abs(difference) < 0.05 * MiB
                 else f"{peak / MiB:,.1f} ({float(r['mem_vs_baseline']):.2f}×)")
        moved = [f"{name} {float(base[f'peak_{key}_bytes'] or 0) / MiB:,.1f} → "
                 f"{float(r[f'peak_{key}_bytes'] or 0) / MiB:,.1f} MiB" for key, name in BREAKDOWN
                 if abs(float(r[f"peak_{key}_bytes"] or 0) - float(base[f"peak_{key}_bytes"] or 0)) >= 0.1 * MiB]
        if r["peak_stage"] != base["peak_stage"]:
            moved.append(f"peak in the {r['peak_stage']} (the baseline's: {base['peak_stage']})")
        verdict = ("yes" if r["matches_baseline"] == "True" else "**no, by design**" if "by design" in r["message"]
                   else "**no**")
        name = f"pitfall `{r['strategy']}`" if r["strategy_role"] == "pitfall" else f"`{r['strategy']}`"
        lines.append(f"| {name} | {shown} | {'; '.join(moved)} | {verdict} |")
    return "\n".join(lines)
