"""A row's outputs at its real tokens do not depend on how much padding its batch adds (issue 29, item 1): the
issue's setup, one 500-token row alone and padded by 37 tokens (left when causal, right when bidirectional)."""

from __future__ import annotations

import pytest

from zoo.registry import get_variant_class
from zoo.testing import assert_invariant_to_padding_amount, padding_amount_difference

CASES = [
    ("bigbird", {"block_size": 32, "num_random_blocks": 2}),
    ("bigbird", {}),
    ("sparse_transformer", {"layout": "fixed", "stride": 32, "num_summary": 4}),
    ("sparse_transformer", {"layout": "fixed"}),
    ("sparse_transformer", {"layout": "strided", "stride": 32}),
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES])
def test_a_row_keeps_its_outputs_in_a_longer_padded_batch(name, params):
    assert_invariant_to_padding_amount(get_variant_class(name)(**params), n=500, pad=37)


def test_the_check_names_a_variant_whose_pattern_follows_the_padded_length():
    variant = get_variant_class("reformer")()
    assert not variant.padding_amount_invariant and variant.padding_amount_reason
    assert padding_amount_difference(variant, causal=True) > 1e-3  # what the declaration says
