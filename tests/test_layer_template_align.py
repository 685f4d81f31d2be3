"""The alignment of a decoder step's logs at k and k+1 layers (bench.measure.layer_template.align), on token lists."""

import pytest

from bench.measure.layer_template import NoReplay, align


def test_blocks_inserted_a_few_events_apart_are_both_found():
    # a sharded step's shape: each layer adds a period to the optimizer's frees, then, 2 events later, one free of
    # its reduce-scattered gradient; 8 events never match between the two sites
    smaller = ["s", "a", "b", "a", "b", "e", "x", "f", "g", "h", "i", "j", "k", "l", "m"]
    larger = ["s", "a", "b", "a", "b", "a", "b", "e", "x", "x", "f", "g", "h", "i", "j", "k", "l", "m"]
    assert align(smaller, larger) == [(5, 2), (9, 1)]


def test_an_inserted_block_that_repeats_nothing_is_refused():
    with pytest.raises(NoReplay, match="repeats no period"):
        align(["a", "b", "c"], ["a", "b", "q", "c"])
    with pytest.raises(NoReplay):
        align(["a", "b"], ["a", "b", "c", "d"])  # the larger log's tail repeats nothing
