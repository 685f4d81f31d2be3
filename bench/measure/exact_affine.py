"""Exact affine functions of a period and a layer count over the rationals: fitted to observed whole numbers
(`solve`) and evaluated where they must again give whole numbers (`evaluate`); bench.measure.layer_template models
the numbers of a step's event log that change with the layers by them. The layer count may be a tuple (a count per
kind of layer): then there is one coefficient per kind after the period's."""

from __future__ import annotations

import math
from fractions import Fraction


class NotWhole(ValueError):
    """An affine function fitted on whole numbers gives a fraction at the period and layer count asked."""


def solve(observations: list[tuple[int, int, int]]) -> tuple[Fraction, Fraction, Fraction] | None:
    """(c, p, n) with value == c + p * period + n * layers for every (period, layers, value) observed, exactly; None
    when no such affine function fits. Coefficients that the observations cannot tell apart are 0."""
    distinct = list(dict.fromkeys(observations))
    # the same answer in integers where it is unique (most of a layer template's fits; Fractions cost ten times more)
    values = {value for _, _, value in distinct}
    kinds = distinct[0][1] if distinct else 0
    if len(values) == 1:  # a constant: the column of ones is always a pivot, the others free, hence 0
        return (values.pop(), 0) + ((0,) if type(kinds) is int else (0,) * len(kinds))
    if type(kinds) is not int:
        return _checked_on_all(distinct)
    unique = _unique_whole_solution(distinct)
    return unique if unique is not None else eliminate(distinct)


def eliminate(distinct: list[tuple[int, int, int]]) -> tuple | None:
    """`solve` by Gauss-Jordan elimination on distinct observations, in integers: each row is kept as a whole multiple
    of the row the elimination over the rationals would hold (the same zero entries, so the same pivots and the same
    reduced form), and a coefficient is a Fraction only where its row's value does not divide by its lead; Fractions
    throughout took ten times as long (most of making a template of two kinds of layers)."""
    rows = [[1, period, *((layers,) if type(layers) is int else layers), value] for period, layers, value in distinct]
    width = len(rows[0]) - 1
    pivots: list[int] = []
    rank = 0
    for col in range(width):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][col] != 0), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        lead_row = rows[rank]
        lead = lead_row[col]
        for r in range(len(rows)):
            if r != rank and rows[r][col] != 0:
                factor = rows[r][col]
                rows[r] = _reduced([x * lead - factor * y for x, y in zip(rows[r], lead_row)])
        pivots.append(col)
        rank += 1
    if any(row[width] != 0 for row in rows[rank:]):
        return None  # inconsistent: no affine function fits
    solution: list = [0] * width
    for r, col in enumerate(pivots):
        value, rest = divmod(rows[r][width], rows[r][col])
        # whole coefficients as ints: evaluating them is most of making a log
        solution[col] = value if rest == 0 else Fraction(rows[r][width], rows[r][col])
    return tuple(solution)


def _reduced(row: list[int]) -> list[int]:
    """`row` divided by the greatest common divisor of its entries (the same zeros; its numbers kept small)."""
    divisor = math.gcd(*row)
    return row if divisor in (0, 1) else [x // divisor for x in row]


def _checked_on_all(distinct: list[tuple]) -> tuple | None:
    """`eliminate` on all the observations, found by eliminating on two of each layer count's (the rest checked
    against it): where it fits them all it is what the elimination on all gives (each column free among all the
    observations is free among the few, hence 0), at a few Fractions instead of a row of them per observation."""
    few, seen = [], {}
    for observation in distinct:
        if seen.setdefault(observation[1], 0) < 2:
            few.append(observation)
            seen[observation[1]] += 1
    found = eliminate(few)
    if found is None:
        return None  # the few admit no affine function: neither do all
    if all(found[0] + found[1] * period + layer_terms(found, layers) == value for period, layers, value in distinct):
        return found
    return eliminate(distinct)


def _unique_whole_solution(distinct: list[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """The only affine function through the observations where three of them fix it and its coefficients are whole
    (it is then what the elimination finds); None otherwise (no such three, a fraction, or one that misses some)."""
    if not distinct:
        return None
    period_1, layers_1, value_1 = distinct[0]
    second = next((o for o in distinct if (o[0], o[1]) != (period_1, layers_1)), None)
    if second is None:
        return None
    dp2, dl2, dv2 = second[0] - period_1, second[1] - layers_1, second[2] - value_1
    for period, layers, value in distinct:
        dp3, dl3, dv3 = period - period_1, layers - layers_1, value - value_1
        determinant = dp2 * dl3 - dl2 * dp3
        if determinant:
            per_period, rest_p = divmod(dv2 * dl3 - dl2 * dv3, determinant)
            per_layer, rest_l = divmod(dp2 * dv3 - dv2 * dp3, determinant)
            if rest_p or rest_l:
                return None
            constant = value_1 - per_period * period_1 - per_layer * layers_1
            if all(constant + per_period * p + per_layer * n == v for p, n, v in distinct):
                return constant, per_period, per_layer
            return None
    return None


def layer_terms(coefficients, layers):
    """The layer count's part of an affine function's value (exact)."""
    if type(layers) is int:
        return coefficients[2] * layers
    if len(layers) == 2:  # two kinds of layers (checkpointed, plain): most of building a log's numbers
        return coefficients[2] * layers[0] + coefficients[3] * layers[1]
    return sum(coefficient * count for coefficient, count in zip(coefficients[2:], layers))


def evaluate(coefficients, period: int, layers) -> int:
    if type(layers) is int:
        value = coefficients[0] + coefficients[1] * period + coefficients[2] * layers
    else:
        value = coefficients[0] + coefficients[1] * period + layer_terms(coefficients, layers)
    if type(value) is not int:
        if value.denominator != 1:
            raise NotWhole("a fitted number is not whole at this layer count")
        value = int(value)
    return value
