"""Strategy specs (`checkpoint:segments=4+amp`): parsed once into a `StrategySpec`, which builds fresh instances, and
the functions that bind one to a case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.core.errors import UsageError, choices_error
from bench.core.options import parse_option_parts
from strategies.framework.base import STRATEGIES, StepContext, Strategy
from strategies.framework.composite import Composite


def _parse_member(text: str) -> tuple[type[Strategy], tuple[tuple[str, Any], ...]]:
    """`name` or `name:opt=value:opt=value` -> the strategy's class and its options."""
    name, *parts = text.strip().split(":")
    cls = STRATEGIES.get(name)
    return cls, tuple(parse_option_parts("strategy", name, parts, cls.options, text).items())


@dataclass(frozen=True)
class _ParsedSpec:
    members: tuple[tuple[type[Strategy], tuple[tuple[str, Any], ...]], ...]
    canonical: str
    role: str
    recompute_plan_kind: str | None


class StrategySpec(str):
    """A strategy spec (`a`, `a:opt=v`, `a+b+c`) parsed once: it is the text as given, and holds each member's
    class and options once parsed, so that `build()` makes fresh instances without parsing the text again.

    A `str`, so that a case holding one (`bench.run.case.Case.strategy`) still prints, compares, hashes and
    serialises as its text; `spec()` is the canonical spelling rows use (members in composition order, options
    at their default left out). It is parsed on first use, not when made: a strategy that a plugin registers in
    worker processes only ($MEMBENCH_PLUGINS) is unknown to the process that starts them, which only passes the
    text on. There `build()` raises UsageError, `spec()` is the text and `role`/`recompute_plan_kind` are None
    (the worker's row has them)."""

    _parsed: _ParsedSpec | None

    def __new__(cls, text: str) -> "StrategySpec":
        if isinstance(text, StrategySpec):
            return text
        self = super().__new__(cls, text)
        self._parsed = None
        return self

    def parsed(self) -> _ParsedSpec:
        """The members' classes and options, the canonical spelling and what the strategy declares; UsageError for
        an unknown name or a bad option."""
        if self._parsed is None:
            parts = [p for p in self.split("+") if p.strip()]
            if not parts:
                raise choices_error("strategy", str(self), STRATEGIES.names())
            members = tuple(_parse_member(part) for part in parts)
            built = _build(members)  # also checks the composition (conflicts, a strategy named twice)
            self._parsed = _ParsedSpec(members, built.spec(), built.role(), built.recompute_plan_kind)
        return self._parsed

    def build(self) -> Strategy:
        """A fresh, unbound instance (a Composite for several members)."""
        return _build(self.parsed().members)

    def _known(self) -> _ParsedSpec | None:
        try:
            return self.parsed()
        except UsageError:
            return None

    def spec(self) -> str:
        known = self._known()
        return str(self) if known is None else known.canonical

    @property
    def role(self) -> str | None:
        """The strategy's `role()` (`bench.core.results.Role`), None where it is unknown to this process."""
        known = self._known()
        return None if known is None else known.role

    @property
    def recompute_plan_kind(self) -> str | None:
        known = self._known()
        return None if known is None else known.recompute_plan_kind

    def __reduce__(self):
        return StrategySpec, (str(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _build(members: tuple[tuple[type[Strategy], tuple[tuple[str, Any], ...]], ...]) -> Strategy:
    strategies = [cls(**dict(options)) for cls, options in members]
    return strategies[0] if len(strategies) == 1 else Composite(strategies)


def bind_strategy(spec: str, phase: str, device: str, workload: Any = None,
                  batch_size: int | None = None, ranks: int = 1) -> tuple[Strategy, StepContext]:
    """A fresh instance of `spec` (a StrategySpec, or text parsed here) bound to the case's phase, device, workload,
    batch size and the run's ranks (not yet checked)."""
    strategy = StrategySpec(spec).build()
    context = StepContext(phase, device, workload, batch_size, ranks)
    strategy.bind(context)
    return strategy, context


def parse_strategy(spec: str) -> Strategy:
    """`a`, `a:opt=v` or `a+b+c` -> a Strategy (a Composite for several); unknown names raise UsageError."""
    return StrategySpec(spec).build()
