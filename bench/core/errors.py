"""Exceptions that the CLI turns into one-line messages, and that the runner turns into row statuses."""

import re

# A word of a message longer than this (a value the user typed or a file held: 10,000 digits) is shown shortened;
# a path never is (the user copies it), nor anything a message of ours spells out in full below this length.
LONGEST_QUOTED_WORD = 200


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits 2."""


class WorkloadCodeError(UsageError):
    """The user's own workload code (its factory, `__init__`, `configure`) failed: one line before a run, and an
    `error` row (not `unsupported`) where it fails only inside a case."""


class Unsupported(Exception):
    """A case that cannot run (strategy on the wrong device or phase): becomes a row with status `unsupported`."""


class UnsupportedValue(Unsupported):
    """An option value that does not fit this case (more checkpoint segments than the workload has units): a row with
    status `unsupported` where other cases of the run take the value, and a UsageError before the first case where
    none does (a typo, not a finding)."""


def choices_error(kind: str, value, choices) -> UsageError:
    """A UsageError that names the bad value and lists the valid choices."""
    listed = ", ".join(str(c) for c in choices)
    return UsageError(f"unknown {kind} {value!r}; valid choices: {listed}")


def shortened(message: str) -> str:
    """`message` on one line, each word over LONGEST_QUOTED_WORD characters cut to its start and end with its
    length, so that an error about a huge value stays readable."""
    def cut(match: re.Match) -> str:
        word = match.group(0)
        if "/" in word:
            return word
        return f"{word[:40]}...{word[-10:]} ({len(word):,} characters)"

    return re.sub(rf"\S{{{LONGEST_QUOTED_WORD + 1},}}", cut, " ".join(str(message).split()))
