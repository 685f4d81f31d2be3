"""Exact affine functions of a period and a layer count over the rationals: fitted to observed whole numbers
(`solve`) and evaluated where they must again give whole numbers (`evaluate`); bench.measure.layer_template models
the numbers of a step's event log that change with the layers by them."""

from __future__ import annotations

from fractions import Fraction


class NotWhole(ValueError):
    """An affine function fitted on whole numbers gives a fraction at the period and layer count asked."""


def solve(observations: list[tuple[int, int, int]]) -> tuple[Fraction, Fraction, Fraction] | None:
    """(c, p, n) with value == c + p * period + n * layers for every (period, layers, value) observed, exactly; None
    when no such affine function fits. Coefficients that the observations cannot tell apart are 0."""
    distinct = list(dict.fromkeys(observations))
    # the same answer in integers where it is unique (most of a layer template's fits; Fractions cost ten times more)
    values = {value for _, _, value in distinct}
    if len(values) == 1:  # a constant: the column of ones is always a pivot, the others free, hence 0
        return values.pop(), 0, 0
    unique = _unique_whole_solution(distinct)
    return unique if unique is not None else eliminate(distinct)


def eliminate(distinct: list[tuple[int, int, int]]) -> tuple | None:
    """`solve` by Gaussian elimination over the rationals, on distinct observations."""
    columns = [lambda period, layers: 1, lambda period, layers: period, lambda period, layers: layers]
    # Gaussian elimination over the rationals on the observations, keeping only independent columns
    rows = [[Fraction(f(period, layers)) for f in columns] + [Fraction(value)] for period, layers, value in distinct]
    pivots: list[int] = []
    rank = 0
    for col in range(3):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][col] != 0), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        lead = rows[rank][col]
        rows[rank] = [x / lead for x in rows[rank]]
        for r in range(len(rows)):
            if r != rank and rows[r][col] != 0:
                factor = rows[r][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[rank])]
        pivots.append(col)
        rank += 1
    if any(row[3] != 0 for row in rows[rank:]):
        return None  # inconsistent: no affine function fits
    solution = [Fraction(0)] * 3
    for r, col in enumerate(pivots):
        solution[col] = rows[r][3]
    # whole coefficients as ints: evaluating them is most of making a log
    return tuple(int(x) if x.denominator == 1 else x for x in solution)


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


def evaluate(coefficients, period: int, layers: int) -> int:
    value = coefficients[0] + coefficients[1] * period + coefficients[2] * layers
    if type(value) is not int:
        if value.denominator != 1:
            raise NotWhole("a fitted number is not whole at this layer count")
        value = int(value)
    return value
