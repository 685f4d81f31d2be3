"""TextEnum: an enumeration whose members are their text, for values that are written to and read from tables.

A `(str, Enum)` member compares equal to its text in Python, but pandas' string columns compare a scalar by its
`str()`, which for a plain `(str, Enum)` member is "Status.OK", not "ok": a column of "ok" then matched nothing
(`compare` said "no case succeeded" over three `ok` rows in an environment whose pandas keeps strings in Python
objects). A TextEnum member's `str()` and `format()` are its value, so it compares, prints and formats as its text.
"""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A `(str, Enum)` whose members are their value wherever text is made of them (`str`, f-strings, pandas)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
