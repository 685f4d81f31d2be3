"""Declared table columns: a Column (name and kind), a Table (its columns in file order and its schema version),
and the Row of a table, which takes only the table's columns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

KINDS = ("int", "float", "bool", "text")


@dataclass(frozen=True)
class Column:
    """One column of a table: its name (units in the name: `_bytes`, `_ms_`) and the kind of its values."""

    name: str
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"column {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


def columns(kind: str, names: str) -> list[Column]:
    """Columns of one kind from a space-separated list of names, in that order."""
    return [Column(name, kind) for name in names.split()]


class UndeclaredColumn(KeyError):
    """A value for a column its table does not declare: a row has no ad-hoc keys."""


class Table:
    """A file membench writes: its name, schema version and columns, in the order they are written."""

    def __init__(self, name: str, version: int, declared: Iterable[Column]):
        self.name, self.version = name, version
        self.columns = tuple(declared)
        self.names = [column.name for column in self.columns]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"table {name!r} declares a column twice")
        self.kinds = {column.name: column.kind for column in self.columns}

    def check(self, keys: Iterable[str]) -> None:
        """Raises UndeclaredColumn naming the first of `keys` this table does not declare."""
        for key in keys:
            if key not in self.kinds:
                raise UndeclaredColumn(f"{key!r} is not a column of the {self.name} table; declare it first")

    def names_of(self, kind: str) -> list[str]:
        return [column.name for column in self.columns if column.kind == kind]

    def row(self, values: Mapping[str, Any] | None = None, **more: Any) -> "Row":
        """A row of this table with `schema_version` set (where the table has one) and the given values."""
        row = Row(self)
        if "schema_version" in self.kinds:
            row["schema_version"] = self.version
        row.update(values or {}, **more)
        return row

    def __reduce__(self):
        return Table, (self.name, self.version, self.columns)


class Row(dict):
    """The values of one row of `table`, by column: a dict that refuses a key the table does not declare.

    Crosses processes as JSON of its columns (`dict(row)`), and is made back with `table.row(values)`."""

    __slots__ = ("table",)

    def __init__(self, table: Table, values: Mapping[str, Any] | None = None):
        super().__init__()
        self.table = table
        if values:
            self.update(values)

    def __setitem__(self, key: str, value: Any) -> None:
        self.table.check([key])
        super().__setitem__(key, value)

    def update(self, values: Mapping[str, Any] | Iterable = (), **more: Any) -> None:
        values = dict(values, **more)
        self.table.check(values)
        super().update(values)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.table.check([key])
        return super().setdefault(key, default)

    def __ior__(self, values):
        self.update(values)
        return self

    def copy(self) -> "Row":
        return Row(self.table, self)

    def __reduce__(self):
        return Row, (self.table, dict(self))
