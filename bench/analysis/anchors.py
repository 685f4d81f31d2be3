"""The anchors: published GPU memory measurements (bench/anchors/*.yaml, one file per source) predicted by membench on
fake CUDA with each anchor's GPU, and the error of each prediction (`python -m bench anchors`).

An anchor file has a `source` (repository, path and commit, or the page's address), `defaults` shared by its rows
and `rows`, each a published figure with its unit and kind (`KINDS`), the configuration as the source states it,
the assumptions made where it does not, and the membench strategy spec it maps to (`strategy`). A spec that does
not parse (a technique membench lacks) falls back to `fallback` when the row gives one, predicted and marked
`partial`, or leaves the row without a prediction (`not_modelled`), saying why, so that merging the technique
lights the row up. What a spec cannot model by construction (torch.compile, another library's optimizer state) is
listed in the row's `not_modelled`; a row is `fully_modelled` only when nothing is.
"""

from __future__ import annotations

import contextlib
import json
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from bench.analysis import nvidia_smi
from bench.core.errors import UsageError
from bench.core.gpus import GPU, find_gpu
from bench.core.job_environment import ANCHOR_WORKER_BYTES_VARIABLE, PROOF_BESIDE_VARIABLE, size_variable
from bench.core import processes
from bench.core.anchors_table import ANCHORS
from bench.core.schema import Row
from bench.core.units import MiB
from bench.measure import fake_cuda

ANCHOR_DIR = Path(__file__).resolve().parent.parent / "anchors"
MODEL_DIR = ANCHOR_DIR / "models"
# the published kind -> the predict table's column that predicts it (nvidia_smi: reserved plus the context)
KINDS = {"max_memory_allocated": "predicted_bytes", "peak_active": "predicted_bytes",
         "max_memory_reserved": "predicted_reserved_bytes", "nvidia_smi": "predicted_reserved_bytes"}
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
REQUIRED = ("name", "label", "figure", "strategy")
# the fake-CUDA worker's address space: a full-size model on fake tensors stays near 500 MB resident
WORKER_MEMORY_BYTES = 12 * 2**30


def worker_memory_bytes() -> int:
    """The fake-CUDA worker's address space: $MEMBENCH_ANCHOR_WORKER_BYTES (a size, checked when a command starts:
    bench.core.job_environment), else WORKER_MEMORY_BYTES. Read when a worker starts, not on import: a bad value is
    then the command's one line, not a traceback of the import."""
    return size_variable(ANCHOR_WORKER_BYTES_VARIABLE, WORKER_MEMORY_BYTES)
STATUSES = ("ok", "partial", "not_modelled", "error")
# the files' order in a run (the issue's order; the sharded, slowest predictions last), any other file after these
SOURCE_ORDER = ("torchtune", "torchao", "transformers", "fsdp_qlora", "torchtitan")


@dataclass
class Anchor:
    """One published figure and the case that predicts it (a row of an anchor file, its file's defaults applied)."""

    name: str
    source: str
    source_ref: str
    label: str
    figure: float
    unit: str
    kind: str
    gpu: str
    model: str
    strategy: str
    fallback: str | None = None
    task: str = "causal_lm"
    attn: str = "sdpa"
    seq_len: int = 128
    packed: int = 0  # documents packed into each row (the hf workload's `packed`); 0: rows not packed
    loss: str = "logits"  # the hf workload's `loss`: `model` where the source takes the model's own loss (labels=)
    batch_size: int = 1
    ranks: int = 1
    batch_per_rank: bool = False  # the source's batch is each GPU's (membench's is the global batch, split by rank)
    configuration: dict = field(default_factory=dict)
    not_modelled: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)
    process_baseline_bytes: int | None = None  # nvidia_smi: the source's own figure of the process before the step

    @property
    def global_batch(self) -> int:
        """membench's batch for the case: the source's, times the ranks where the source's is per GPU."""
        return self.batch_size * (self.ranks if self.batch_per_rank else 1)

    @property
    def published_bytes(self) -> int:
        return int(round(self.figure * UNITS[self.unit]))

    def workload(self, model_dir: Path = MODEL_DIR) -> str:
        """The `hf:` workload spec of the anchor's model: its config.json under bench/anchors/models/ (`model` is a
        name there), the file `model` names (a path ending in .json), or else membench's preset of that name (the
        published configuration numbers of workloads.framework.hf_presets: `llama-3.1-8b`)."""
        config = Path(self.model) if self.model.endswith(".json") else model_dir / (self.model + ".json")
        if not self.model.endswith(".json") and not (MODEL_DIR / (self.model + ".json")).is_file():
            config = self.model
        packed = f":packed={self.packed}" if self.packed else ""
        loss = f":loss={self.loss}" if self.loss != "logits" else ""
        return f"hf:{config}:seq_len={self.seq_len}:attn={self.attn}:task={self.task}{packed}{loss}"


def _source_ref(source: dict) -> str:
    where = f"{source['repository']}/{source['path']}@{source['commit']}" if "repository" in source else ""
    return where or source["url"]


def _bytes_of(figure: dict, where: str) -> int:
    if figure.get("unit") not in UNITS:
        raise UsageError(f"{where}: unit {figure.get('unit')!r}; valid choices: {', '.join(UNITS)}")
    return int(round(float(figure["figure"]) * UNITS[figure["unit"]]))


def load_file(path: Path) -> list[Anchor]:
    """The anchors of one file; a UsageError naming the file and the first thing missing or invalid."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f"anchor file {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict) or "source" not in data or not data.get("rows"):
        raise UsageError(f"anchor file {path}: needs `source` and `rows`")
    source, defaults = data["source"], dict(data.get("defaults") or {})
    if "name" not in source or not ({"repository", "path", "commit"} <= set(source) or "url" in source):
        raise UsageError(f"anchor file {path}: the source needs a name and repository, path and commit (or url)")
    baseline = (defaults.pop("nvidia_smi", None) or {}).get("process_baseline")
    anchors = []
    for row in data["rows"]:
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise UsageError(f"anchor file {path}: row {row.get('name', '?')!r} has no {missing[0]!r}")
        values = {**defaults, **row}
        where = f"anchor {row['name']} ({path.name})"
        if values.get("kind") not in KINDS:
            raise UsageError(f"{where}: kind {values.get('kind')!r}; valid choices: {', '.join(KINDS)}")
        _bytes_of(values, where)
        configuration = {**(defaults.get("configuration") or {}), **(row.get("configuration") or {})}
        anchors.append(Anchor(
            name=row["name"], source=source["name"], source_ref=_source_ref(source), label=row["label"],
            figure=float(row["figure"]), unit=values["unit"], kind=values["kind"], gpu=find_gpu(values["gpu"]).name,
            model=values["model"], strategy=row["strategy"], fallback=row.get("fallback"),
            task=values.get("task", "causal_lm"), attn=values.get("attn", "sdpa"),
            seq_len=int(values.get("seq_len", 128)), packed=int(values.get("packed", 0)),
            loss=str(values.get("loss", "logits")), batch_size=int(values.get("batch_size", 1)),
            ranks=int(values.get("ranks", 1)), batch_per_rank=bool(values.get("batch_per_rank", False)),
            configuration=configuration,
            not_modelled=list(row.get("not_modelled") or []),
            assumptions=list(defaults.get("assumptions") or []) + list(row.get("assumptions") or []),
            process_baseline_bytes=_bytes_of(baseline, where) if baseline and values["kind"] == "nvidia_smi" else None))
    return anchors


def load_anchors(folder: Path = ANCHOR_DIR, only: list[str] | None = None) -> list[Anchor]:
    """Every anchor of every `*.yaml` in `folder`, files in SOURCE_ORDER; `only`: the anchors with these names, or every anchor
    of a source with that name (a UsageError naming the valid choices for any other)."""
    paths = sorted(Path(folder).glob("*.yaml"),
                   key=lambda p: (SOURCE_ORDER.index(p.stem) if p.stem in SOURCE_ORDER else len(SOURCE_ORDER), p.stem))
    anchors = [anchor for path in paths for anchor in load_file(path)]
    if not only:
        return anchors
    known = {a.name for a in anchors} | {a.source for a in anchors}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r}: no such anchor or source; valid choices: "
                         f"{', '.join(sorted({a.source for a in anchors}))}, {', '.join(a.name for a in anchors)}")
    return [a for a in anchors if a.name in only or a.source in only]


def spec_problem(spec: str) -> str | None:
    """Why membench cannot build strategy `spec` (an unknown strategy or option), or None when it can."""
    from strategies import parse_strategy

    try:
        parse_strategy(spec)
    except UsageError as error:
        return str(error).split("; valid choices")[0]
    return None


def plan_row(anchor: Anchor) -> tuple[str | None, list[str]]:
    """(the spec to predict, or None; what is not modelled): the anchor's spec where it parses, else its fallback
    with the missing technique named, else nothing."""
    missing = list(anchor.not_modelled)
    problem = spec_problem(anchor.strategy)
    if problem is None:
        return anchor.strategy, missing
    missing.insert(0, f"{anchor.strategy}: {problem}")
    if anchor.fallback and spec_problem(anchor.fallback) is None:
        return anchor.fallback, missing
    return None, missing


def error_of(predicted: int | None, published: int) -> tuple[int | None, float | None]:
    """(predicted - published in bytes, that as a percentage of the published figure); None without a prediction."""
    if predicted is None:
        return None, None
    return predicted - published, 100.0 * (predicted - published) / published


def predicted_figure(anchor: Anchor, predict_row: dict) -> tuple[int | None, str]:
    """The prediction of the anchor's kind of figure from a predict row, and the terms it is made of."""
    value = predict_row.get(KINDS[anchor.kind])
    if value is None:
        return None, ""
    if anchor.kind != "nvidia_smi":
        return int(value), f"{KINDS[anchor.kind]}={int(value) / MiB:,.0f} MiB"
    terms = nvidia_smi.nvidia_smi_terms(int(value), anchor.process_baseline_bytes)
    return sum(term.bytes for term in terms), nvidia_smi.describe(terms)


def _limit_memory() -> None:
    """In the worker before it starts: its address space capped at `worker_memory_bytes()` (or a lower hard
    limit)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = worker_memory_bytes()
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# whether the fake-CUDA processes of `predict_on_fake_cuda` run several at once (`cores_shared`)
_CORES_SHARED = [False]


@contextlib.contextmanager
def cores_shared(shared: bool):
    """Inside, with `shared`, `predict_on_fake_cuda`'s processes run several at once (`anchors --jobs N`): they have
    the cores, and none forks a worker for layer replay's traces (bench.analysis.proof_beside)."""
    saved = _CORES_SHARED[0]
    _CORES_SHARED[0] = shared
    try:
        yield
    finally:
        _CORES_SHARED[0] = saved


def predict_on_fake_cuda(case: dict, ranks: int, capability: tuple[int, int]) -> tuple[dict | None, str]:
    """One predict row of `case` from the fake-CUDA environment's Python, on fake CUDA only (never a real step: a
    full-size model would be allocated), its address space capped; or None and why."""
    python = fake_cuda.environment_python()
    if python is None:
        return None, f"no fake-CUDA environment: {fake_cuda.unavailable_reason()}"
    request = {"cases": [case], "engine": "fake-cuda", "ranks": ranks, "capability": list(capability),
               "snapshot_dir": None}
    with tempfile.TemporaryDirectory(prefix="membench-anchor-") as folder:
        request_file, rows_file = Path(folder) / "request.json", Path(folder) / "rows.json"
        request_file.write_text(json.dumps(request))
        environment = {**fake_cuda.python_environment(), **({PROOF_BESIDE_VARIABLE: "0"} if _CORES_SHARED[0] else {})}
        done = processes.run_child([str(python), "-m", "bench.analysis._predict_worker", str(request_file),
                                    str(rows_file)], env=environment, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, preexec_fn=_limit_memory)
        answer = json.loads(rows_file.read_text()) if rows_file.exists() else {}
    if done.returncode == 130:
        raise KeyboardInterrupt
    if done.returncode == 0 and answer.get("rows"):
        return answer["rows"][0], ""
    tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
    return None, answer.get("error") or tail[0]


def _configuration_text(configuration: dict) -> str:
    return "; ".join(f"{key}: {value}" for key, value in configuration.items())


def anchor_row(anchor: Anchor,
               predictor: Callable[[dict, int, tuple[int, int]], tuple[dict | None, str]] | None = None) -> Row:
    """The anchors-table row of one anchor: its published figure, membench's prediction of that kind on fake CUDA
    with the anchor's GPU (`predictor(case, ranks, capability)` gives a predict row; default
    `predict_on_fake_cuda`), the error, what is not modelled."""
    predictor = predictor or predict_on_fake_cuda
    gpu: GPU = find_gpu(anchor.gpu)
    spec, missing = plan_row(anchor)
    row = ANCHORS.row({name: None for name in ANCHORS.names if name != "schema_version"})
    row.update(
        anchor=anchor.name, source=anchor.source, source_ref=anchor.source_ref, label=anchor.label,
        configuration=_configuration_text(anchor.configuration), gpu=gpu.name,
        capability=f"{gpu.capability[0]}.{gpu.capability[1]}", published_value=anchor.figure,
        published_unit=anchor.unit, published_kind=anchor.kind, published_bytes=anchor.published_bytes,
        strategy_spec=anchor.strategy, predicted_spec=spec, workload=anchor.workload(MODEL_DIR.relative_to(
            ANCHOR_DIR.parent.parent)), batch_size=anchor.global_batch, ranks=anchor.ranks,
        assumptions=" | ".join(anchor.assumptions), status="not_modelled" if spec is None else "ok",
        fully_modelled=False, message="")
    if anchor.kind == "nvidia_smi":
        missing.append(nvidia_smi.NOT_MODELLED)
    start = time.perf_counter()
    if spec is not None:
        case = {"workload": anchor.workload(), "strategy": spec, "phase": "train", "batch_size": anchor.global_batch,
                "device": "cuda", "data": "synthetic"}
        predicted, why = predictor(case, anchor.ranks, gpu.capability)
        if predicted is None or predicted.get("status") != "ok":
            row.update(status="error", message=why or f"{predicted.get('status')}: {predicted.get('message')}")
        else:
            figure, terms = predicted_figure(anchor, predicted)
            error_bytes, error_pct = error_of(figure, anchor.published_bytes)
            row.update(predicted_bytes=figure, predicted_allocated_bytes=predicted.get("predicted_bytes"),
                       predicted_reserved_bytes=predicted.get("predicted_reserved_bytes"), predicted_terms=terms,
                       error_bytes=error_bytes, error_pct=error_pct, engine=predicted.get("engine"),
                       sdpa_kernel=predicted.get("sdpa_kernel"), message=predicted.get("message") or "",
                       status="partial" if spec != anchor.strategy else "ok",
                       fully_modelled=not missing)
    row.update(not_modelled=" | ".join(missing), duration_s=round(time.perf_counter() - start, 1))
    return row


def summary(rows: list[dict]) -> dict[str, Any]:
    """Median and largest |error %| over the rows with a prediction, and over the fully modelled ones; the row of
    the largest; the counts."""
    def stats(selected):
        errors = [abs(r["error_pct"]) for r in selected]
        worst = max(selected, key=lambda r: abs(r["error_pct"]))["anchor"] if selected else None
        return {"rows": len(selected), "median_abs_error_pct": statistics.median(errors) if errors else None,
                "max_abs_error_pct": max(errors) if errors else None, "worst": worst,
                "within_15_pct": sum(e <= 15 for e in errors)}

    predicted = [r for r in rows if r.get("error_pct") is not None]
    return {"total": len(rows), "predicted": stats(predicted),
            "fully_modelled": stats([r for r in predicted if r.get("fully_modelled")])}


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def format_table(rows: list[dict]) -> str:
    """The console table: anchor, kind, published and predicted GiB, error, status, what is not modelled."""
    header = (f"{'anchor':<36} {'kind':<21} {'published GiB':>13} {'predicted GiB':>13} {'error %':>8} "
              f"{'status':<12} not modelled")
    lines = [header, "-" * len(header)]
    for r in rows:
        error = "-" if r.get("error_pct") is None else f"{r['error_pct']:+.1f}"
        note = r.get("not_modelled") or ""
        if r.get("status") == "error":
            note = f"error: {r.get('message')}"
        lines.append(f"{r['anchor']:<36} {r['published_kind']:<21} {_gib(r['published_bytes']):>13} "
                     f"{_gib(r.get('predicted_bytes')):>13} {error:>8} {r['status']:<12} {note[:160]}")
    return "\n".join(lines)


def format_summary(stats: dict[str, Any]) -> str:
    """Two lines: median and largest |error| over the predicted rows, and over the fully modelled ones."""
    def line(name, s):
        if not s["rows"]:
            return f"{name}: no rows"
        return (f"{name}: {s['rows']} rows, median |error| {s['median_abs_error_pct']:.1f}%, largest "
                f"{s['max_abs_error_pct']:.1f}% ({s['worst']}), {s['within_15_pct']} within 15%")
    return "\n".join([f"{stats['total']} anchors", line("predicted", stats["predicted"]),
                      line("fully modelled", stats["fully_modelled"])])

