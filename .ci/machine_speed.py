"""How fast this machine runs Python against the machine CI's budgets were set on: the factor .ci/steps.sh scales a
step's budget by.

The test suite is Python most of the time (the harness, torch's dispatch of small tensors, pytest), so a fixed
pure-Python workload stands for it: calls, attribute and dict lookups, integer arithmetic, string formatting and a
sort. A machine of this project's kind was seen to change speed in phases of seconds to minutes (the workload took
0.39 s and 0.78 s a minute apart, quiet), so one measurement at the start says little of a 40-minute run: CI samples
the workload through the whole run (`sample`), and a step's factor is the median of the samples taken while it ran
(`factor`). Runs with the machine's python3, before any environment is set up; the standard library only.

    python3 .ci/machine_speed.py sample FILE [EVERY_S]   # one run every EVERY_S seconds, appended to FILE, forever
    python3 .ci/machine_speed.py factor FILE [SINCE]     # the median factor of the samples since SINCE (epoch s)
    python3 .ci/machine_speed.py median FILE             # the median of all the samples, in seconds
"""

from __future__ import annotations

import statistics
import sys
import time

# the workload's median time, sampled through a CI run (the run's own load included: a sample waits for a core as the
# tests do), on the machine the budgets of .ci/run were set on, in seconds (docs/testing.md, "CI's budgets on a
# slower machine", says where it comes from)
REFERENCE_S = 0.24
SAMPLE_EVERY_S = 20.0


class _Point:
    __slots__ = ("x", "y")

    def __init__(self, x: int, y: int):
        self.x, self.y = x, y

    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)


def workload() -> int:
    """A fixed mix of what the suite's Python does; returns a checksum so that nothing is optimised away."""
    total = 0
    table: dict[str, int] = {}
    for i in range(300_000):
        point = _Point(i, -i // 3)
        total += point.norm1()
        key = f"k{i % 997}"
        table[key] = table.get(key, 0) + i
    values = sorted(table.values(), reverse=True)
    return total + values[0] + len(values)


def one_run_s() -> float:
    started = time.perf_counter()
    workload()
    return time.perf_counter() - started


def sample(path: str, every_s: float = SAMPLE_EVERY_S) -> None:
    """Forever: one run of the workload, its end time (epoch s) and duration appended to `path` as a line."""
    while True:
        seconds = one_run_s()
        with open(path, "a") as out:
            out.write(f"{time.time():.1f} {seconds:.4f}\n")
        time.sleep(every_s)


def median_s(path: str, since: float = 0.0) -> float:
    """The median of the samples in `path` ended after `since` (all of them where none did), in seconds; three runs
    now where `path` holds none."""
    with open(path) as lines:
        samples = [tuple(map(float, line.split())) for line in lines if line.strip()]
    if not samples:
        return statistics.median(one_run_s() for _ in range(3))
    recent = [seconds for ended, seconds in samples if ended >= since] or [seconds for _, seconds in samples]
    return statistics.median(recent)


def factor(path: str, since: float = 0.0) -> float:
    """`median_s` over REFERENCE_S."""
    return median_s(path, since) / REFERENCE_S


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "sample":
        sample(argv[1], float(argv[2]) if len(argv) > 2 else SAMPLE_EVERY_S)
        return 0
    if len(argv) >= 2 and argv[0] == "factor":
        print(f"{factor(argv[1], float(argv[2]) if len(argv) > 2 else 0.0):.2f}")
        return 0
    if len(argv) == 2 and argv[0] == "median":
        print(f"{median_s(argv[1]):.3f}")
        return 0
    print("usage:\n" + "\n".join(__doc__.strip().splitlines()[-3:]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
