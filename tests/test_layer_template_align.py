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


@pytest.mark.parametrize("module, pattern, numbers", [
    ("model.layers.12.mlp.down_proj", "model.layers.#.mlp.down_proj", ("12",)),
    ("model.layers.3.block_sparse_moe.experts.7.w1", "model.layers.#.block_sparse_moe.experts.#.w1", ("3", "7")),
    ("lm_head", "lm_head", ()),
    ("", "", ()),
    ("h.0 (backward)", "h.# (backward)", ("0",)),
])
def test_a_module_name_is_read_as_the_pattern_and_numbers_of_its_layer_indices(module, pattern, numbers):
    from bench.measure.layer_identity import MODULE_INDEX, module_numbers, module_pattern

    assert (module_pattern(module), module_numbers(module)) == (pattern, numbers)
    assert (MODULE_INDEX.sub("#", module), tuple(MODULE_INDEX.findall(module))) == (pattern, numbers)
