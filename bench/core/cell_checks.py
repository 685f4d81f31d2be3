"""The cells of a results file checked against their declared columns' kinds: the first one that is not (text in a
number column, a fraction where a whole number belongs, an overflow such as `1e400`, a negative size or time), as
the file has it written, for the one line that refuses the file (bench.core.results.read_results_file)."""

from __future__ import annotations

import pandas as pd

from bench.core.schema import Table


_KIND_WORDS = {"int": "a whole number", "float": "a number", "bool": "True or False"}
_BOOL_TEXT = {"true", "false", "1", "0", "1.0", "0.0", "yes", "no"}


def never_negative(column: str, table: Table) -> bool:
    """Whether `column` of `table` holds a figure that is never below 0: a size (`_bytes`), a time (`_ms`,
    `_s`), a rate, a batch, a ratio to the baseline; not the harness's share of resident memory, which the process
    at rest can exceed, nor the memory growth per step, which a step that frees can make negative."""
    if column in SIGNED_COLUMNS or table.kinds.get(column) not in ("int", "float"):
        return False
    return (column.endswith(("_bytes", "_s")) or "_ms" in column
            or column in ("batch_size", "samples_per_s", "mem_vs_baseline", "time_vs_baseline"))


SIGNED_COLUMNS = ("harness_rss_bytes", "mem_growth_bytes_per_step")


def first_bad_cell(raw: pd.DataFrame, table: Table) -> tuple[int, str, str, str] | None:
    """The first cell (by row, then column order) whose value is not of its column's kind in `table` -- text in a
    number column, a fraction in a whole-number one, a word in a True/False one, a number that overflows (`1e400`),
    a negative size or time -- as (row number counted from 1 after the header, column, the cell's text as written,
    what is wrong with it); None when every cell is right. `raw`: the file's cells as text, so that a value is
    quoted as the user wrote it, not as a parser made it (`inf`). Empty cells are allowed (a figure that does not
    apply), and columns the table does not declare (an older file's) are not checked."""
    worst = None
    for column in raw.columns:
        kind = table.kinds.get(column)
        if kind not in _KIND_WORDS:
            continue
        cells = raw[column]
        present = cells.notna()
        if kind == "bool":
            checks = [(present & ~cells.astype(str).str.strip().str.lower().isin(_BOOL_TEXT),
                       f"is not {_KIND_WORDS[kind]}")]
        else:
            numbers = pd.to_numeric(cells, errors="coerce")
            finite = numbers.abs() < float("inf")
            # `inf` as membench writes it (a relative difference to a baseline of 0) is a value; `1e400` is not
            spelled_infinite = cells.astype(str).str.strip().str.lower().str.lstrip("+-").isin(("inf", "infinity"))
            checks = [(present & numbers.isna(), f"is not {_KIND_WORDS[kind]}"),
                      (numbers.notna() & ~finite & ~spelled_infinite, "overflows: it is not a finite number")]
            if kind == "int":
                checks.append((numbers.notna() & ((numbers % 1 != 0) | ~finite), f"is not {_KIND_WORDS[kind]}"))
            if never_negative(column, table):
                checks.append((finite & (numbers < 0), f"is negative, which a figure of {column!r} never is"))
        for bad, why in checks:
            if bad.any():
                index = int(bad.to_numpy().argmax())
                if worst is None or index < worst[0]:
                    worst = (index, column, str(cells.iloc[index]), why)
    return None if worst is None else (worst[0] + 1, *worst[1:])
