"""What a strategy's class declares, in words: where it runs, its result against the baseline, what `plan` tries of
it. `python -m bench list` and the strategy table of docs/strategies.md (tools/docs/strategy_table.py) print these."""

from __future__ import annotations

from strategies.framework.base import STRATEGIES, Expected, Strategy


def runs_in(cls: type[Strategy]) -> str:
    """Its phases, and the device or the ranks it needs (`train, eval`, `train; CUDA only`)."""
    words = [", ".join(cls.phases)]
    if "cpu" not in cls.devices:
        words.append("CUDA only")
    if cls.distributed:
        words.append("--ranks 2 or more")
    return "; ".join(words)


def outcome(expected: Expected) -> str:
    """`matches the baseline`, `differs by design (why)` or `unsupported (why)`."""
    if expected.outcome == "matches":
        return "matches the baseline"
    return f"{'differs by design' if expected.outcome == 'differs' else 'unsupported'} ({expected.why})"


def result(cls: type[Strategy]) -> str:
    """Its declared result on any workload, then on a workload with a trait where it is another one."""
    by_outcome: dict[Expected, list[str]] = {}
    for trait, expected in cls.expected_with.items():
        by_outcome.setdefault(expected, []).append(trait)
    others = [f"with {' or '.join(traits)}: {outcome(expected)}" for expected, traits in by_outcome.items()]
    return "; ".join([outcome(cls.expected), *others])


def planner(cls: type[Strategy]) -> str:
    """The settings `python -m bench plan` tries of it, or why it tries none."""
    if cls.pitfall:
        return "never: a pitfall"
    if cls.plan_excluded:
        return f"never: {cls.plan_excluded}"
    if "plan_settings" in {name for klass in cls.__mro__ if klass is not Strategy for name in vars(klass)}:
        return " ".join((cls.plan_settings.__doc__ or "settings that depend on the case").split()).rstrip(".")
    return ", ".join(":".join(f"{k}={v}" for k, v in options.items()) or "its defaults" for options in cls.plan_options)


def ordered_names() -> list[str]:
    """The baseline, the techniques, then the pitfalls, each by name."""
    return sorted(STRATEGIES.names(), key=lambda name: (name != "baseline", STRATEGIES.get(name).pitfall, name))
