"""Exceptions that the CLI turns into one-line messages, and that the runner turns into row statuses."""


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits 2."""


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
