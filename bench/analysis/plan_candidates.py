"""The planner's candidates: every registered strategy's declared option settings (`Strategy.plan_settings`) that
apply to the case, and the combinations of them that compose (what `strategies.Composite` accepts).

The planner names no strategy: a strategy is tried with the settings it declares, never when it declares
`plan_excluded` or is a pitfall (a setting that cannot train alone, with the companions it declares:
`Strategy.plan_companions`), and two settings combine when the Composite of them can be built (no declared
conflict, no hook replaced by both) and is not two settings of one strategy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bench.core.errors import Unsupported, UsageError
from strategies import STRATEGIES, Composite, PlanSpace, StepContext, Strategy, StrategySpec


@dataclass(frozen=True)
class Setting:
    """One strategy with one option setting: its spec (`checkpoint:segments=sqrt`) and the strategy's name."""

    spec: str
    strategy: str


@dataclass(frozen=True)
class Refused:
    """A declared setting that cannot run in the case (its check() said why): a row of the plan table."""

    spec: str
    reason: str


def excluded_strategies() -> dict[str, str]:
    """Registered strategies the planner never tries, with why (pitfalls, and those declaring `plan_excluded`)."""
    reasons = {}
    for name in STRATEGIES.names():
        cls = STRATEGIES.get(name)
        if cls.pitfall:
            reasons[name] = "a pitfall: measured to show its cost, never a technique to choose"
        elif cls.plan_excluded:
            reasons[name] = cls.plan_excluded
    return reasons


def settings(space: PlanSpace) -> tuple[list[Setting], list[Refused]]:
    """Every declared setting of every strategy the planner tries, split into those `check()` accepts in the
    space's case and those it refuses."""
    excluded = excluded_strategies()
    accepted, refused = [], []
    for name in STRATEGIES.names():
        if name in excluded:
            continue
        cls = STRATEGIES.get(name)
        for options in cls.plan_settings(space):
            try:
                strategy = cls(**options)
            except UsageError as error:  # a declared setting this version does not take
                refused.append(Refused(f"{name}:{options}", str(error)))
                continue
            try:
                _bound(strategy, space.context).check(space.context)
            except (Unsupported, UsageError) as error:  # refused under the strategy's own spec (its row's name)
                refused.append(Refused(strategy.spec(), str(error)))
                continue
            for companions in cls.plan_companions(options, space):
                # one candidate of the setting and each set of its companions (tp's mesh: fsdp+tp:degree=T)
                try:
                    candidate = _bound(StrategySpec("+".join([*companions, strategy.spec()])).build(), space.context)
                    candidate.check(space.context)
                except (Unsupported, UsageError) as error:
                    refused.append(Refused(cls(**options).spec() if not companions
                                           else "+".join([*companions, cls(**options).spec()]), str(error)))
                    continue
                accepted.append(Setting(candidate.spec(), name))
    return list({s.spec: s for s in accepted}.values()), refused


def _bound(strategy: Strategy, context: StepContext) -> Strategy:
    strategy.bind(context)
    return strategy


def compose(members: tuple[Setting, ...], context: StepContext) -> str | None:
    """The canonical spec of `members` applied together, or None when they do not compose (two settings of one
    strategy, a declared conflict, a hook replaced by two, or a check() that refuses the combination)."""
    if len({m.strategy for m in members}) != len(members):
        return None

    try:
        built = StrategySpec("+".join(m.spec for m in members)).build()
        if isinstance(built, Composite):
            built.bind(context)
            built.check(context)
        return built.spec()
    except (UsageError, Unsupported):
        return None


def combinations(pool: list[Setting], size: int, context: StepContext) -> list[tuple[tuple[Setting, ...], str]]:
    """Every composable combination of `size` settings of `pool`, with its canonical spec."""
    found = []
    for members in itertools.combinations(pool, size):
        spec = compose(members, context)
        if spec is not None:
            found.append((members, spec))
    return found
