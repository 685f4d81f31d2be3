"""A case's result: its row of the results table, and what measuring it gave besides the row's columns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.core.results import Status, new_row
from bench.core.schema import Row


@dataclass
class CaseResult:
    """One case's row (only declared columns) and its side data, which no CSV column holds: each repeat's timed
    steps and peak (to pool repeats run in other processes), the step timeline (`<run>.timeline.csv`), and the
    exit code of a worker process that died. Crosses processes as JSON (`to_json`, `from_json`)."""

    row: Row
    step_times_ms: list[list[float]] = field(default_factory=list)  # per repeat, the timed steps
    peaks: list[int] = field(default_factory=list)  # per repeat, peak_mem_bytes
    timeline: list[dict[str, Any]] = field(default_factory=list)  # live bytes after each operator of one step
    worker_exit_code: int | None = None  # a crashed worker's exit code (negative: the signal that ended it)

    @classmethod
    def failed(cls, message: str, worker_exit_code: int | None = None, **values: Any) -> "CaseResult":
        """An `error` result that says why in `message` (a crashed worker, a failed rank, a failed Ray task)."""
        return cls(new_row(status=Status.ERROR.value, message=message, **values), worker_exit_code=worker_exit_code)

    def to_json(self) -> dict[str, Any]:
        return {"row": dict(self.row), "step_times_ms": self.step_times_ms, "peaks": self.peaks,
                "timeline": self.timeline, "worker_exit_code": self.worker_exit_code}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "CaseResult":
        return cls(new_row(value["row"]), value["step_times_ms"], value["peaks"], value["timeline"],
                   value["worker_exit_code"])
