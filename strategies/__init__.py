"""Memory-saving strategies, registered by name; `parse_strategy("checkpoint+amp")` composes them. This folder holds
the plug-ins, one module per strategy; their framework is in `strategies.framework`, and a plug-in imports the API
below from `strategies` itself."""

from strategies.framework.base import (
    EXACT, MATCHES, PHASES, STRATEGIES, Expected, PlanMeter, PlanSpace, StepContext, Strategy, Tolerance, differs,
    register_strategy, unsupported,
)
from strategies.framework.composite import Composite
from strategies.framework.spec import StrategySpec, bind_strategy, parse_strategy

from bench.core.registry import import_modules_of  # noqa: E402

__all__ = [
    "EXACT", "MATCHES", "PHASES", "STRATEGIES", "Composite", "Expected", "PlanMeter", "PlanSpace", "StepContext",
    "Strategy", "StrategySpec", "Tolerance", "bind_strategy", "differs", "parse_strategy", "register_strategy",
    "unsupported",
]

# Importing a strategy module registers it; one module per strategy, found in this folder (not listed here).
import_modules_of(__name__)
