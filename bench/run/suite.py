"""Suite files: a YAML description of which cases to run, and the command line's values over them, validated before
anything runs."""

from __future__ import annotations

import reprlib
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from bench.core.errors import UsageError
from bench.run.preflight import (DEFAULT_MAX_TIME_PER_CASE_S, DEFAULT_MIN_STEPS, DEFAULT_TARGET_CI,
                                 DEFAULT_WARMUP_STEPS, check_choice, check_steps, parse_batch_sizes)
from bench.run.case import Case
from strategies import PHASES, parse_strategy
from workloads import get_workload

DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "suites" / "default.yaml"

# key -> (type check, description); `devices` holds per-device overrides of the other keys.
_FIELDS: dict[str, tuple[type, str]] = {
    "workload": (str, "a workload spec"),
    "workloads": (list, "a list of workload specs, or of mappings {workload: spec, <key>: override}"),
    "data": (str, "a data source of the workload"),
    "strategies": (list, "a list of strategy names"),
    "phases": (list, "a list of phases"),
    "batch_sizes": (list, "a list of positive integers"),
    "warmup": (int, "a non-negative integer"),
    "steps": (int, "a positive integer"),
    "min_steps": (int, "a positive integer"),
    "max_time_per_case": ((int, float), "a positive number of seconds"),
    "target_ci": ((int, float), "a fraction between 0 and 1 (e.g. 0.05)"),
    "executor": (str, "local or ray"),
    "ray_address": (str, "a Ray cluster address (auto, ray://head:10001)"),
}
_DEVICE_KEYS = ("cpu", "cuda")
# The keys of adaptive timing; `steps` (a fixed count) excludes them in the same mapping.
ADAPTIVE_KEYS = ("min_steps", "max_time_per_case", "target_ci")
_PER_WORKLOAD = ("data", "strategies", "phases", "batch_sizes", "warmup", "steps", *ADAPTIVE_KEYS)


@dataclass
class Suite:
    """What to run: every strategy x phase x batch size of each workload.

    `workloads` holds one entry per workload: its spec and any of `_PER_WORKLOAD` that differ from the suite's
    own values. `batch_sizes` and `data` left at None mean each workload's default batch size and data source.
    """

    workloads: list[dict[str, Any]] = field(default_factory=lambda: [{"workload": "captcha_resnet18"}])
    data: str | None = None
    strategies: list[str] = field(default_factory=lambda: ["baseline"])
    phases: list[str] = field(default_factory=lambda: list(PHASES))
    batch_sizes: list[int] | None = None
    warmup: int = DEFAULT_WARMUP_STEPS
    steps: int | None = None  # a fixed count of timed steps; None: adaptive timing, as the three below say
    min_steps: int = DEFAULT_MIN_STEPS
    max_time_per_case: float = DEFAULT_MAX_TIME_PER_CASE_S
    target_ci: float = DEFAULT_TARGET_CI
    executor: str | None = None  # where the cases run (the command line's --executor wins)
    ray_address: str | None = None

    def set_workloads(self, specs: list[str]) -> None:
        """Replaces the suite's workloads by `specs`, keeping no per-workload override."""
        self.workloads = [{"workload": spec} for spec in specs]

    def cases(self, device: str) -> list[Case]:
        """Cases in run order: per workload, batch size and phase, the baseline first (the others compare to it)."""
        cases = []
        for entry in self.workloads:
            values = {key: entry.get(key, getattr(self, key)) for key in _PER_WORKLOAD}
            if any(key in entry for key in ADAPTIVE_KEYS) and "steps" not in entry:
                values["steps"] = None
            workload = get_workload(entry["workload"])
            if values["data"] is not None:
                workload.check_data(values["data"])
            specs = ["baseline"] + [s for s in values["strategies"] if s != "baseline"]
            sizes = values["batch_sizes"] or [workload.default_batch_size]
            cases += [Case(workload.spec(), spec, phase, bs, device, values["data"], values["warmup"], values["steps"],
                           values["min_steps"], float(values["max_time_per_case"]), float(values["target_ci"]))
                      for bs in sizes for phase in values["phases"] for spec in specs]
        return cases


# What a suite may hold: a file of at most this many bytes whose YAML expands (aliases followed, each time) to at most
# this many values. A suite file lists a few dozen; an alias bomb expands a few hundred bytes to billions.
MAX_SUITE_BYTES = 1 << 20
MAX_SUITE_VALUES = 100_000
_QUOTE = reprlib.Repr()
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxlevel = 80, 80, 8, 8, 3


def quoted(value: Any) -> str:
    """`repr(value)`, shortened: a message quotes at most a line of what a file holds, however large it is."""
    return _QUOTE.repr(value)


def _expanded_values(value: Any, limit: int) -> int:
    """How many values `value` holds with aliases expanded (a shared list counted each time it is reached), counting
    no further than `limit` + 1."""
    count, todo = 0, [value]
    while todo and count <= limit:
        item = todo.pop()
        count += 1
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return count


def _check_list(values: dict[str, Any], key: str, where: str) -> None:
    items = values.get(key)
    if items is None:
        return
    if not items:
        raise UsageError(f"{where}: key {quoted(key)} must not be empty; give {_FIELDS[key][1]}")
    seen = set()
    for item in items:
        if key == "batch_sizes" and (not isinstance(item, int) or isinstance(item, bool) or item <= 0):
            raise UsageError(f"{where}: key 'batch_sizes': batch size {quoted(item)} must be a positive integer")
        if key in ("strategies", "phases") and not isinstance(item, str):
            raise UsageError(f"{where}: key {quoted(key)}: entry {quoted(item)} must be a name (a string)")
        marker = quoted(item) if isinstance(item, dict) else item
        if marker in seen:
            raise UsageError(f"{where}: key {quoted(key)}: duplicate entry {quoted(item)}")
        seen.add(marker)


def _check_workload(spec, data, where: str, key: str):
    """The resolved workload of `spec`, with `data` (if given) checked against its data sources."""
    if not isinstance(spec, str):
        raise UsageError(f"{where}: key {quoted(key)}: entry {quoted(spec)} must be a workload spec (a string)")
    try:
        workload = get_workload(spec)
        if data is not None:
            workload.check_data(data)
    except UsageError as error:
        raise UsageError(f"{where}: key {quoted(key)}: {error}") from None
    return workload


def validate(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Checks keys, types and names; raises UsageError naming the place, the key and the reason.

    `workload` (one spec) is turned into `workloads` (a list of entries); every workload is resolved (a missing
    file or unknown name fails here, before anything runs) and its data source checked."""
    _check_types(values, where)
    _check_names(values, where)
    _check_ranges(values, where)
    if "workload" in values:
        values["workloads"] = [{"workload": values.pop("workload")}]
    if "workloads" in values:
        values["workloads"] = _workload_entries(values, where)
    return values


def _check_types(values: dict[str, Any], where: str) -> None:
    """Every key known, every value of its type; the lists non-empty and without duplicates."""
    for key, value in values.items():
        if key not in _FIELDS:
            raise UsageError(f"{where}: unknown key {quoted(key)}; valid keys: {', '.join([*_FIELDS, 'devices'])}")
        kind, what = _FIELDS[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UsageError(f"{where}: key {quoted(key)} must be {what}, got {quoted(value)}")
    if "workload" in values and "workloads" in values:
        raise UsageError(f"{where}: give either key 'workload' or key 'workloads', not both")
    for key in ("strategies", "phases", "batch_sizes", "workloads"):
        _check_list(values, key, where)


def _check_names(values: dict[str, Any], where: str) -> None:
    """Strategies, phases and the executor are ones membench knows."""
    for spec in values.get("strategies", []):
        try:
            parse_strategy(str(spec))
        except UsageError as error:
            raise UsageError(f"{where}: key 'strategies': {error}") from None
    for phase in values.get("phases", []):
        if phase not in PHASES:
            raise UsageError(f"{where}: key 'phases': unknown phase {quoted(phase)}; valid choices: "
                             f"{', '.join(PHASES)}")
    if values.get("executor", "local") not in ("local", "ray"):
        raise UsageError(f"{where}: key 'executor': unknown executor {quoted(values['executor'])}; valid choices: "
                         "local, ray")


def _check_ranges(values: dict[str, Any], where: str) -> None:
    """Step counts, times and the interval target in range, and fixed or adaptive timing, not both."""
    if values.get("warmup", 0) < 0:
        raise UsageError(f"{where}: key 'warmup' must be a non-negative integer, got {quoted(values['warmup'])}")
    if "steps" in values and values["steps"] <= 0:
        raise UsageError(f"{where}: key 'steps' must be a positive integer, got {quoted(values['steps'])}")
    for key in ("min_steps", "max_time_per_case"):
        if key in values and values[key] <= 0:
            raise UsageError(f"{where}: key {quoted(key)} must be {_FIELDS[key][1]}, got {quoted(values[key])}")
    if "target_ci" in values and not 0 < values["target_ci"] < 1:
        raise UsageError(f"{where}: key 'target_ci' must be {_FIELDS['target_ci'][1]}, "
                         f"got {quoted(values['target_ci'])}")
    adaptive = [key for key in ADAPTIVE_KEYS if key in values]
    if "steps" in values and values["steps"] is not None and adaptive:
        raise UsageError(f"{where}: key 'steps' fixes the number of timed steps; key {quoted(adaptive[0])} is for "
                         "adaptive timing: give one or the other")


def _workload_entries(values: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The `workloads` entries, each resolved to its canonical spec with its own keys validated; an optional one
    that cannot be resolved is skipped with a warning."""
    entries = []
    for raw in values["workloads"]:
        entry = {"workload": raw} if not isinstance(raw, dict) else dict(raw)
        if "workload" not in entry:
            raise UsageError(f"{where}: key 'workloads': entry {quoted(raw)} has no 'workload' key")
        optional = entry.pop("optional", False)
        if not isinstance(optional, bool):
            raise UsageError(f"{where}: key 'workloads': 'optional' must be true or false in entry {quoted(raw)}")
        extra = {k: v for k, v in entry.items() if k != "workload"}
        bad = [k for k in extra if k not in _PER_WORKLOAD]
        if bad:
            raise UsageError(f"{where}: key 'workloads': unknown key {quoted(bad[0])} in entry {quoted(raw)}; "
                             f"valid keys: workload, optional, {', '.join(_PER_WORKLOAD)}")
        validate(extra, f"{where} (workload {entry['workload']})")
        try:
            workload = _check_workload(entry["workload"], extra.get("data", values.get("data")), where, "workloads")
        except UsageError as error:
            if not optional:
                raise
            print(f"warning: skipping optional workload {quoted(entry['workload'])}: {error}", file=sys.stderr)
            continue
        entries.append({**extra, "workload": workload.spec()})
    return entries


def load_suite(path: Path | str, device: str) -> Suite:
    """Reads and validates a suite file, applying the overrides under `devices: {<device>: ...}`."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_SUITE_BYTES:
            raise UsageError(f"{path}: a suite file of {path.stat().st_size:,} bytes; suites are at most "
                             f"{MAX_SUITE_BYTES:,} bytes")
        raw = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise UsageError(f"cannot read suite {quoted(str(path))}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: malformed suite: not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                         f"offset {error.start}); a suite is a UTF-8 YAML file") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        problem = str(getattr(error, "problem", None) or error).splitlines()[0]  # a ReaderError spans lines
        raise UsageError(f"{path}: malformed YAML{at}: {problem}") from None
    if _expanded_values(raw, MAX_SUITE_VALUES) > MAX_SUITE_VALUES:
        raise UsageError(f"{path}: the suite expands to more than {MAX_SUITE_VALUES:,} values (YAML aliases "
                         "repeated inside each other?); a suite lists a few dozen")
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: a suite must be a mapping of keys ({', '.join(_FIELDS)}), got {type(raw).__name__}")
    overrides = raw.pop("devices", None) or {}
    if not isinstance(overrides, dict):
        raise UsageError(f"{path}: key 'devices' must map {' / '.join(_DEVICE_KEYS)} to overrides, "
                         f"got {quoted(overrides)}")
    for dev in overrides:
        if dev not in _DEVICE_KEYS:
            raise UsageError(f"{path}: key 'devices.{dev}': unknown device {quoted(dev)}; valid choices: "
                             f"{', '.join(_DEVICE_KEYS)}")
    values = validate(raw, str(path))
    for dev, extra in overrides.items():
        if not isinstance(extra, dict):
            raise UsageError(f"{path}: key 'devices.{dev}' must be a mapping, got {quoted(extra)}")
        validate(extra, f"{path} (devices.{dev})")
    override = overrides.get(device, {})
    if any(key in override for key in ADAPTIVE_KEYS) and "steps" not in override:
        values["steps"] = None  # the device's adaptive keys replace a fixed count given for every device
    values.update(override)
    return check_data(replace(Suite(), **values), str(path))


def check_data(suite: Suite, where: str) -> Suite:
    """Checks each workload's data source (the suite's `data` or its entry's) against what the workload makes."""
    for entry in suite.workloads:
        _check_workload(entry["workload"], entry.get("data", suite.data), where, "data")
    return suite


@dataclass
class SuiteOverrides:
    """The command line's values over a suite file's (`python -m bench run|compare`); None leaves the suite's value.

    Every value is checked by `apply`, before anything runs; a bad one is a UsageError that names the command-line
    option that gave it (`--workload`, `--steps`, ...).

    Example:
        suite = SuiteOverrides(strategies=["checkpoint"], batch_sizes="25,50", quick=True).apply(Suite())
    """

    strategies: list[str] | None = None
    workloads: list[str] | None = None
    data: str | None = None
    phases: list[str] | None = None
    batch_sizes: str | None = None  # as typed: one size or a comma list
    steps: int | None = None
    warmup: int | None = None
    min_steps: int | None = None
    max_time_per_case: float | None = None
    target_ci: float | None = None
    quick: bool = False  # 1 warm-up step and, unless adaptive timing is asked for, 3 measured steps

    def _adaptive(self) -> dict[str, Any]:
        """The adaptive-timing values given, in ADAPTIVE_KEYS' order."""
        return {key: getattr(self, key) for key in ADAPTIVE_KEYS if getattr(self, key) is not None}

    def _names(self) -> dict[str, Any]:
        """The strategies, workloads, data source, phases and batch sizes given, each checked."""
        values: dict[str, Any] = {}
        if self.strategies is not None:
            values["strategies"] = self.strategies
            try:
                validate({"strategies": self.strategies}, "--strategies")
            except UsageError as error:
                raise UsageError(str(error).replace("--strategies: key 'strategies':", "--strategies:")) from None
        if self.workloads is not None:
            values["workloads"] = self.workloads
            for spec in self.workloads:
                try:
                    get_workload(spec)
                except UsageError as error:
                    raise UsageError(f"--workload: {error}") from None
        if self.data:
            values["data"] = self.data
        if self.phases is not None:
            values["phases"] = [check_choice("phase", phase, PHASES, "--phases") for phase in self.phases]
        if self.batch_sizes:
            values["batch_sizes"] = parse_batch_sizes(self.batch_sizes)
        return values

    def _timing(self) -> dict[str, Any]:
        """The step counts and adaptive-timing values given; a fixed count and adaptive timing exclude each other."""
        adaptive = self._adaptive()
        if self.steps is not None and adaptive:
            option = "--" + next(iter(adaptive)).replace("_", "-")
            raise UsageError(f"--steps {self.steps} fixes the number of timed steps; {option} is for adaptive timing: "
                             "give one or the other")
        values: dict[str, Any] = {}
        if self.quick:
            values.update(warmup=1, **({} if adaptive else {"steps": 3}))
        if self.steps is not None:
            values["steps"] = self.steps
        if self.warmup is not None:
            values["warmup"] = self.warmup
        return {**values, **adaptive}

    def apply(self, suite: Suite) -> Suite:
        """`suite` with these values in place of its own (adaptive timing drops every fixed step count)."""
        values = {**self._names(), **self._timing()}
        validate(values, "command line")
        for key, value in values.items():
            setattr(suite, key, value)
        if self._adaptive():
            suite.steps = None
            for entry in suite.workloads:
                entry.pop("steps", None)
        if self.data:
            for entry in suite.workloads:
                try:
                    get_workload(entry["workload"]).check_data(self.data)
                except UsageError as error:
                    raise UsageError(f"--data: {error}") from None
        return check_data(suite, "command line")

    def check_steps(self, cases: list[Case]) -> None:
        """The cases' step counts within bench.run.preflight's limits, named by the option (or suite key) that set
        them."""
        for case in {(c.warmup, c.steps, c.min_steps): c for c in cases}.values():
            check_steps(case.steps, "--steps" if self.steps is not None else "the suite's steps", 1)
            check_steps(case.warmup, "--warmup" if self.warmup is not None else "the suite's warmup", 0)
            check_steps(case.min_steps, "--min-steps" if self.min_steps is not None else "the suite's min_steps", 1)


def suite_for_command_line(path: Path | str | None, device: str, overrides: SuiteOverrides) -> Suite:
    """The suite to run: the suite file at `path` if given (else the default Suite()), with `overrides` over it."""
    suite = load_suite(path, device) if path else Suite()
    return overrides.apply(suite)
