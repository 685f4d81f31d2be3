"""Suite files: a YAML description of which cases to run, validated before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from bench.errors import UsageError, choices_error
from bench.runner import Case
from strategies import PHASES, STRATEGIES, parse_strategy
from workloads import WORKLOADS

DEFAULT_SUITE = Path(__file__).parent / "suites" / "default.yaml"

# key -> (type check, description); `devices` holds per-device overrides of the other keys.
_FIELDS: dict[str, tuple[type, str]] = {
    "workload": (str, "a workload name"),
    "data": (str, "captcha or synthetic"),
    "strategies": (list, "a list of strategy names"),
    "phases": (list, "a list of phases"),
    "batch_sizes": (list, "a list of positive integers"),
    "warmup": (int, "a non-negative integer"),
    "steps": (int, "a positive integer"),
}
_DEVICE_KEYS = ("cpu", "cuda")


@dataclass
class Suite:
    """What to run: every strategy x phase x batch size of one workload."""

    workload: str = "captcha_resnet18"
    data: str = "captcha"
    strategies: list[str] = field(default_factory=lambda: ["baseline"])
    phases: list[str] = field(default_factory=lambda: list(PHASES))
    batch_sizes: list[int] = field(default_factory=lambda: [100])
    warmup: int = 3
    steps: int = 10

    def cases(self, device: str) -> list[Case]:
        """Cases in run order: per batch size and phase, the baseline first (the others are compared to it)."""
        specs = ["baseline"] + [s for s in self.strategies if s != "baseline"]
        return [Case(self.workload, spec, phase, bs, device, self.data, self.warmup, self.steps)
                for bs in self.batch_sizes for phase in self.phases for spec in specs]


def validate(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Checks keys, types and names; raises UsageError naming the place, the key and the reason."""
    for key, value in values.items():
        if key not in _FIELDS:
            raise UsageError(f"{where}: unknown key {key!r}; valid keys: {', '.join([*_FIELDS, 'devices'])}")
        kind, what = _FIELDS[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UsageError(f"{where}: key {key!r} must be {what}, got {value!r}")
    for key in ("strategies", "phases", "batch_sizes"):
        items = values.get(key)
        if items is None:
            continue
        if not items:
            raise UsageError(f"{where}: key {key!r} must not be empty; give {_FIELDS[key][1]}")
        seen = set()
        for item in items:
            if key == "batch_sizes" and (not isinstance(item, int) or isinstance(item, bool) or item <= 0):
                raise UsageError(f"{where}: key 'batch_sizes': batch size {item!r} must be a positive integer")
            if key != "batch_sizes" and not isinstance(item, str):
                raise UsageError(f"{where}: key {key!r}: entry {item!r} must be a name (a string)")
            if item in seen:
                raise UsageError(f"{where}: key {key!r}: duplicate entry {item!r}")
            seen.add(item)
    if "workload" in values:
        try:
            WORKLOADS.get(values["workload"])
        except UsageError as error:
            raise UsageError(f"{where}: key 'workload': {error}") from None
    if "data" in values and values["data"] not in ("captcha", "synthetic"):
        raise UsageError(f"{where}: key 'data': unknown data source {values['data']!r}; valid choices: captcha, synthetic")
    for spec in values.get("strategies", []):
        try:
            parse_strategy(str(spec))
        except UsageError as error:
            raise UsageError(f"{where}: key 'strategies': {error}") from None
    for phase in values.get("phases", []):
        if phase not in PHASES:
            raise UsageError(f"{where}: key 'phases': unknown phase {phase!r}; valid choices: {', '.join(PHASES)}")
    for bs in values.get("batch_sizes", []):
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            raise UsageError(f"{where}: key 'batch_sizes': batch size {bs!r} must be a positive integer")
    if values.get("warmup", 0) < 0:
        raise UsageError(f"{where}: key 'warmup' must be a non-negative integer, got {values['warmup']!r}")
    if "steps" in values and values["steps"] <= 0:
        raise UsageError(f"{where}: key 'steps' must be a positive integer, got {values['steps']!r}")
    return values


def load_suite(path: Path | str, device: str) -> Suite:
    """Reads and validates a suite file, applying the overrides under `devices: {<device>: ...}`."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise UsageError(f"cannot read suite {str(path)!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}: malformed YAML{at}: {getattr(error, 'problem', error)}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: a suite must be a mapping of keys ({', '.join(_FIELDS)}), got {type(raw).__name__}")
    overrides = raw.pop("devices", None) or {}
    if not isinstance(overrides, dict):
        raise UsageError(f"{path}: key 'devices' must map {' / '.join(_DEVICE_KEYS)} to overrides, got {overrides!r}")
    for dev in overrides:
        if dev not in _DEVICE_KEYS:
            raise UsageError(f"{path}: key 'devices.{dev}': unknown device {dev!r}; valid choices: "
                             f"{', '.join(_DEVICE_KEYS)}")
    values = validate(raw, str(path))
    for dev, extra in overrides.items():
        if not isinstance(extra, dict):
            raise UsageError(f"{path}: key 'devices.{dev}' must be a mapping, got {extra!r}")
        validate(extra, f"{path} (devices.{dev})")
    values.update(overrides.get(device, {}))
    return replace(Suite(), **values)
