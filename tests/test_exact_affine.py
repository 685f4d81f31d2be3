"""bench/measure/exact_affine.py's `solve` gives what Gaussian elimination over the rationals gives (`eliminate`), on
observations like a layer template's: constants, whole and fractional slopes, points that fix only some coefficients
(one period, one layer count, collinear), and observations no affine function fits."""

from __future__ import annotations

import random
from fractions import Fraction

from bench.measure.exact_affine import eliminate, solve


def _observations(rng: random.Random) -> list[tuple[int, int, int]]:
    constant, per_period, per_layer = (rng.choice([0, 1, -1, 3, Fraction(1, 2), 7, -24]) for _ in range(3))
    shape = rng.choice(["any", "one period", "one layer count", "collinear", "one point"])
    points = []
    for _ in range(rng.randint(1, 8)):
        period, layers = rng.randint(0, 6), rng.randint(3, 5)
        if shape == "one period":
            period = 2
        elif shape == "one layer count":
            layers = 4
        elif shape == "collinear":
            layers = period + 3
        elif shape == "one point":
            period, layers = 1, 3
        points.append((period, layers))
    observed = [(p, n, int(constant + per_period * p + per_layer * n)) for p, n in points]  # int(): some miss
    if rng.random() < 0.2:
        observed.append((observed[0][0], observed[0][1], observed[0][2] + 1))  # the same point, another value
    return observed


def test_solve_is_the_elimination_over_the_rationals():
    rng = random.Random(45)
    for _ in range(3000):
        observed = _observations(rng)
        assert solve(observed) == eliminate(list(dict.fromkeys(observed))), observed


def test_solve_finds_whole_and_fractional_functions_and_refuses_the_rest():
    assert solve([(0, 3, 5), (1, 3, 7), (0, 4, 6)]) == (2, 2, 1)
    assert solve([(0, 3, 1), (1, 3, 2), (2, 3, 3)]) == (1, 1, 0)  # one layer count: the layers' coefficient is 0
    assert solve([(0, 3, 0), (1, 3, 1), (0, 5, 1)]) == (Fraction(-3, 2), 1, Fraction(1, 2))
    assert solve([(0, 3, 0), (1, 3, 1), (2, 3, 3)]) is None
