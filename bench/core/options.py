"""Options of a plug-in (a strategy or a workload): `name:option=value` parsing and validation, shared by both.

A plug-in class declares `options = {name: default}`; the default's type is the option's type. Bad input is a
UsageError that names the option, the bad value and what is valid.
"""

from __future__ import annotations

from typing import Any

from bench.core.errors import UsageError, choices_error


def parse_value(raw: str, default: Any, owner: str, option: str) -> Any:
    """`raw` converted to the type of `default`; a UsageError naming `owner:option` otherwise."""
    kind = type(default)
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        return kind(raw)
    except ValueError:
        raise UsageError(f"bad value {raw!r} for {owner}:{option}; expected {kind.__name__}") from None


def check_option_names(kind: str, owner: str, given, declared: dict[str, Any]) -> None:
    """Raises a UsageError naming the first option of `given` that `declared` does not have."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise choices_error(f"option of {kind} {owner!r}:", unknown[0], list(declared) or ["(none)"])


def parse_option_parts(kind: str, owner: str, parts: list[str], declared: dict[str, Any],
                       text: str) -> dict[str, Any]:
    """`["opt=v", "opt2=w"]` -> typed options; every name checked against `declared`."""
    options = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep:
            raise UsageError(f"bad {kind} option {part!r} in {text!r}; expected {owner}:option=value")
        check_option_names(kind, owner, [key], declared)
        if key in options:  # which one was meant? taking the last silently would measure what nobody asked for
            raise UsageError(f"{kind} option {owner}:{key} is given twice in {text!r}; give it once")
        options[key] = parse_value(raw, declared[key], owner, key)
    return options


def changed_options(settings: dict[str, Any], declared: dict[str, Any]) -> list[str]:
    """`opt=value` for every setting that differs from its default, in declaration order."""
    return [f"{k}={v}" for k, v in settings.items() if k in declared and v != declared[k]]
