"""Shared kernels in zoo.ops that variants rely on for speed: running heads in groups must change nothing."""

from __future__ import annotations

import pytest
import torch

from zoo.ops import softmax_attention
from zoo.ops.patterned import _distinct_in_range
from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class
from zoo.testing import assert_memory_below_quadratic, largest_allocation, make_call
from zoo.variant import Variant


@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("causal", [False, True])
def test_head_groups_give_the_same_output_and_gradients(name, causal, monkeypatch):
    variant = get_variant_class(name)()
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[0, 70:] = False
    mask[1, :15] = False
    results = []
    for elements in (2**30, 1):  # all heads at once; one head per group
        monkeypatch.setattr("zoo.ops.limits.HEAD_GROUP_ELEMENTS", elements)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 90, 16, generator=gen).requires_grad_() for _ in range(3))
        out = run_variant(variant, q, k, v, make_call(causal, mask))
        out.pow(2).sum().backward()
        results.append([out, q.grad, k.grad, v.grad])
    for whole, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=1e-5)


def test_distinct_key_blocks_by_sorting_equal_the_pairwise_rule():
    """Each block named once per query block (the earliest slot), out-of-range slots dropped (issue 29, item 2)."""
    gen = torch.Generator().manual_seed(0)
    key_blocks = torch.randint(-3, 12, (40, 17), generator=gen)
    inside = (key_blocks >= 0) & (key_blocks < 10)
    earlier = torch.ones(17, 17, dtype=torch.bool).tril(-1)
    clamped = key_blocks.clamp(0, 9)
    repeated = ((clamped[:, :, None] == clamped[:, None, :]) & inside[:, None, :] & earlier).any(-1)
    assert torch.equal(_distinct_in_range(key_blocks, 10), inside & ~repeated)


def test_a_pattern_only_plugin_whose_key_blocks_grow_with_n_stays_below_quadratic_memory():
    """The plugin fixture ``strided_globals`` (band, a global column every 64 tokens from each row's first real token,
    2 sinks; block hints, no kernel): no tensor grows faster than the keys each query reads (issue 29, item 2)."""
    variant = get_variant_class("strided_globals")()
    sizes = [largest_allocation(variant, n) for n in (2048, 4096)]
    assert sizes[1] < 4096 * 4096 // 8
    assert sizes[1] < 1.5 * sizes[0]  # the chunk buffer, not (query blocks x slots x slots)


def test_the_memory_check_names_the_op_and_shape_that_allocated_the_tensor():
    class MaskedDense(Variant):  # declares O(n) memory but masks dense scores
        name, memory_complexity = "masked_dense_o_n", "O(n)"

        def attend(self, q, k, v, call):
            return softmax_attention(q, k, v, None, call.scaling)

    with pytest.raises(AssertionError, match=r"aten\.bmm\S* -> \(1, 1024, 1024\) torch.float32"):
        assert_memory_below_quadratic(MaskedDense(), 1024)


@pytest.mark.parametrize("layout", ["contiguous", "heads_transposed", "cache_buffer_view", "expanded_heads", "odd"])
def test_key_rows_read_every_position_in_place(layout):
    from zoo.ops.gathered import key_rows

    gen = torch.Generator().manual_seed(0)
    x = {
        "contiguous": lambda: torch.randn(2, 3, 7, 4, generator=gen),
        "heads_transposed": lambda: torch.randn(2, 7, 3, 4, generator=gen).transpose(1, 2),
        "cache_buffer_view": lambda: torch.randn(2, 3, 11, 4, generator=gen)[:, :, :7],
        "expanded_heads": lambda: torch.randn(2, 1, 7, 4, generator=gen).expand(2, 3, 7, 4),
        "odd": lambda: torch.randn(2, 3, 7, 8, generator=gen)[..., ::2],  # rows not D-aligned: copied
    }[layout]()
    rows, start, step = key_rows(x)
    positions = torch.arange(7)
    read = rows.index_select(0, (start[:, :, None] + positions * step).flatten()).view(x.shape)
    assert torch.equal(read, x)
    assert (rows.data_ptr() == x.data_ptr()) == (layout != "odd")


@pytest.mark.parametrize("masked", [None, "row", "full"])
def test_flash_backward_of_one_head_split_over_threads_equals_the_kernel_in_one_piece(masked):
    from zoo.ops import flash

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        count = 2 * flash.SPLIT_MIN_QUERIES + 3  # pieces of unequal length: the last one padded
        q, k, v = torch.randn(1, 1, count, 8, generator=gen), *torch.randn(2, 1, 1, 40, 8, generator=gen)
        mask = None
        if masked:
            allowed = torch.rand(1, 1, count if masked == "full" else 1, 40, generator=gen) > 0.3
            mask = flash.additive_mask(allowed | (torch.arange(40) == 0), torch.float32)
        out, lse = flash.flash_forward(q, k, v, mask, 0.3)
        grad = torch.randn(out.shape, generator=gen)
        split = flash.flash_backward(grad, q, k, v, out, lse, mask, 0.3)
        whole = flash._flash_backward(grad, q, k, v, out, lse, mask, 0.3)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(split, whole, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ties_to_later", [True, False])
@pytest.mark.parametrize("scores", ["distinct", "integers", "signed_zeros", "few_eligible", "forced", "mixed"])
def test_top_positions_one_topk_equals_the_rule_of_ranked_keys(scores, ties_to_later):
    """The fast path (one topk, no tie at the k-th score), the 64-bit ranked keys and the two mixed row by row agree
    with the rule written out: the top_k eligible positions, ties to the later (DSA) or the earlier (MoBA, NSA)
    position, -0.0 and 0.0 one score, +inf above every finite score (NSA's forced blocks)."""
    from zoo.ops.choose import _ranked_positions, top_positions

    gen = torch.Generator().manual_seed(0)
    rows, n, top_k = 6, 40, 9
    values = {
        "distinct": lambda: torch.randn(rows, n, generator=gen),
        "integers": lambda: torch.randint(-2, 3, (rows, n), generator=gen).float(),
        "signed_zeros": lambda: torch.where(torch.rand(rows, n, generator=gen) > 0.5, 0.0, -0.0),
        "few_eligible": lambda: torch.randn(rows, n, generator=gen),
        "forced": lambda: torch.randn(rows, n, generator=gen).index_fill_(1, torch.tensor([0, 38, 39]), float("inf")),
        "mixed": lambda: torch.cat([torch.randn(3, n, generator=gen), torch.randint(-1, 2, (3, n), generator=gen)]),
    }[scores]().float()
    eligible = torch.rand(rows, n, generator=gen) > (0.9 if scores == "few_eligible" else 0.2)
    want = torch.zeros(rows, n, dtype=torch.bool)
    for row in range(rows):
        ranked = sorted((-float(values[row, s]), -s if ties_to_later else s) for s in range(n) if eligible[row, s])
        for _, position in ranked[:top_k]:
            want[row, abs(position)] = True
    masked = values.masked_fill(~eligible, float("-inf"))
    for index, chosen in (top_positions(values, eligible, top_k, ties_to_later),
                          _ranked_positions(masked, top_k, ties_to_later)):
        got = torch.zeros(rows, n, dtype=torch.long).scatter_add_(-1, index, chosen.long()) > 0
        assert torch.equal(got, want)
        assert torch.equal(index, index.sort(-1).values)  # ascending, the chosen slots first
        assert torch.equal(chosen, chosen.sort(-1, descending=True).values)
        assert torch.equal(index[~chosen], torch.full_like(index[~chosen], n - 1))


@pytest.mark.parametrize("batch_elements", [None, 64 * 8])
@pytest.mark.parametrize("sharpness", [1.0, 60.0])
def test_chosen_key_blocks_in_padded_batches_equal_dense_softmax(batch_elements, sharpness, monkeypatch):
    """MoBA's and NSA's by-key-block kernel runs the groups of queries that chose a key block in padded batches of
    similar size: outputs and q/k/v gradients equal dense softmax over the own block (causal) and the chosen ones,
    with the default batches and with batches cut small, with plain logits and sharp ones (log-sum-exps of one query
    apart by far more than the merge's headroom, several parts of a query in one batch)."""
    from zoo.ops import limits
    from zoo.ops.block_grouped import block_grouped_attention, by_key_block
    from zoo.ops.choose import top_blocks
    from zoo.ops.chosen_blocks import selected_blocks_mask
    from zoo.ops.dropout import NO_DROPOUT

    if batch_elements is not None:
        monkeypatch.setattr(limits, "KEY_BLOCK_BATCH_ELEMENTS", batch_elements)
    gen = torch.Generator().manual_seed(3)
    n, block, heads, kv_heads, dim = 150, 8, 4, 2, 8
    q = torch.randn(2, heads, n, dim, generator=gen) * sharpness
    k, v = (torch.randn(2, kv_heads, n, dim, generator=gen) for _ in range(2))
    nb = -(-n // block)
    own = torch.arange(n) // block
    eligible = (torch.arange(nb) < own[:, None]) & (torch.rand(2, kv_heads, n, nb, generator=gen) < 0.7)
    blocks, chosen = top_blocks(torch.rand(2, kv_heads, n, nb, generator=gen), eligible, 4)
    batches = list(by_key_block(blocks, chosen, block, heads // kv_heads).batches(dim, one_each=False))
    assert any(not bool(valid.all()) for *_, valid in batches)  # some batch pads its groups
    assert any(len(set(rows[valid].tolist())) < int(valid.sum()) for _, _, rows, valid in batches)  # a query twice
    distance = torch.arange(n)[:, None] - torch.arange(n)
    allowed = selected_blocks_mask(blocks, chosen, block, n, torch.arange(n), None)
    allowed = (allowed | ((distance >= 0) & (own[:, None] == own[None, :]))).repeat_interleave(2, 1)
    grad = torch.randn(q.shape, generator=gen)
    results = []
    for attention in (
        lambda q, k, v: block_grouped_attention(q, k, v, blocks, chosen, block, dim**-0.5, NO_DROPOUT),
        lambda q, k, v: softmax_attention(q, *(x.repeat_interleave(2, 1) for x in (k, v)), allowed, dim**-0.5),
    ):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4 * sharpness, rtol=1e-4)
