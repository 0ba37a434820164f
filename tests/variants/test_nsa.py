"""What is specific to ``nsa`` (the contract suite covers the rest): the kernel against a per-query loop written from
the paper's rule (outputs and gradients of q, k, v, the compression maps, the gates and the hidden states), the first
and local blocks always read, a compressed block visible only once complete, no future token read, padding content
and amount, a GQA group sharing its selection, bf16, no n x n allocation, the refusals, and the decoding cache."""

from __future__ import annotations

import pytest
import torch
import transformers
from zoo.variants.nsa import NSAAttention, NSALayer, NSAWeights

import zoo
from zoo.cache import GrowingLayer, cache_nbytes
from zoo.ops import chosen_blocks, limits, softmax_attention
from zoo.ops import nsa as nsa_ops
from zoo.ops.choose import top_blocks
from zoo.ops.nsa import NSABlocks
from zoo.ops.nsa.kernel import select
from zoo.ops.nsa.naive import nsa_naive
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_memory_below_quadratic, decode_prompts, greedy, make_call, reference
from zoo.variant import VariantParameterError

HEADS, KV_HEADS, DIM, HIDDEN = 4, 2, 16, 24
SMALL = dict(compress_block=8, compress_stride=4, select_block=8, top_n=5, window=6)


def inputs(n: int, batch: int = 2, seed: int = 0, dtype=torch.float32, kv_heads: int = KV_HEADS):
    """q (B, H, n, D), k/v (B, H_kv, n, D), hidden states (B, n, HIDDEN) and the layer's weights."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, n, DIM, generator=gen)
    k, v = (torch.randn(batch, kv_heads, n, DIM, generator=gen) for _ in range(2))
    hidden = torch.randn(batch, n, HIDDEN, generator=gen)
    torch.manual_seed(seed)
    weights = NSAWeights(HIDDEN, HEADS, kv_heads, DIM, 8).to(dtype)
    return *(x.to(dtype) for x in (q, k, v, hidden)), weights


def padding_mask(padding: str | None, n: int, pad: int = 7) -> torch.Tensor | None:
    """None, or (2, n) with the last row's first (``"left"``) or last (``"right"``) ``pad`` tokens padding."""
    if padding is None:
        return None
    positions = torch.arange(n)
    padded = positions < pad if padding == "left" else positions >= n - pad
    return torch.stack([torch.ones(n, dtype=torch.bool), ~padded])


def naive(q, k, v, hidden, mask, weights, l, d, sel, top_n, w):  # noqa: E741  (the paper's names)
    """The rule, one query at a time (:func:`zoo.ops.nsa.naive.nsa_naive`), gated by the layer's own gates."""
    gates = torch.sigmoid(weights.gate(hidden)).view(*hidden.shape[:2], q.shape[1], 3)
    geometry = NSABlocks(l, d, sel, top_n, w)
    return nsa_naive(q, k, v, gates, mask, weights.key_compressor, weights.value_compressor, geometry)


def kernel(variant, q, k, v, hidden, mask, weights):
    weights.hidden_states = hidden
    try:
        return run_variant(variant, q, k, v, make_call(True, mask, head_dim=DIM, weights=weights))
    finally:
        weights.hidden_states = None


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("n", [48, 45], ids=["block-multiple", "not-a-multiple"])
def test_kernel_equals_the_per_query_loop(padding, n):
    q, k, v, hidden, weights = inputs(n)
    mask = padding_mask(padding, n)
    variant = NSAAttention(**SMALL)
    with torch.no_grad():
        out = kernel(variant, q, k, v, hidden, mask, weights)
        want = naive(q, k, v, hidden, mask, weights, 8, 4, 8, 5, 6)
        if mask is not None:
            want = want.masked_fill(~mask[:, None, :, None], 0.0)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        weights.hidden_states = hidden
        call = make_call(True, mask, head_dim=DIM, weights=weights)
        torch.testing.assert_close(
            reference(variant, q, *(x.repeat_interleave(2, 1) for x in (k, v)), call), out, atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("chunks", ["one", "many"])
def test_outputs_and_gradients_match_the_per_query_loop(chunks, monkeypatch):
    """fp32, a left-padded row, GQA: gradients of q, k, v, the hidden states and every learned weight; with the
    query chunks of the selection and the compressed branch and the window's block chunks one call or many."""
    if chunks == "many":
        monkeypatch.setattr(limits, "NSA_COMPRESSED_QUERY_CHUNK", 5)
        monkeypatch.setattr(limits, "SCORE_CHUNK_ELEMENTS", 600)
        monkeypatch.setattr(limits, "RUN_CHUNK_ELEMENTS", 1)
    n = 37
    q, k, v, hidden, weights = inputs(n)
    mask = padding_mask("left", n, 5)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).masked_fill(~mask[:, None, :, None], 0)
    variant = NSAAttention(**SMALL)
    results = []
    for attention in (
        lambda *x: kernel(variant, *x, mask, weights),
        lambda *x: naive(*x, mask, weights, 8, 4, 8, 5, 6),
    ):
        weights.zero_grad()
        leaves = [x.clone().requires_grad_() for x in (q, k, v, hidden)]
        out = attention(*leaves)
        grads = torch.autograd.grad(out, [*leaves, *weights.parameters()], grad_out)
        results.append([out.detach() * mask[:, None, :, None], *grads])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert all(float(g.abs().max()) > 0 for g in results[0][5:]), "every learned weight gets a gradient"


def test_the_first_and_local_blocks_are_always_read():
    """Compressed keys that make the latest blocks score highest: the first and the two local blocks are read
    anyway, with top_n - 3 of the best others, never a block after the query's."""
    geometry = NSABlocks(compress=4, stride=4, select=4, top_n=5, window=4)
    n = 40
    q = torch.ones(1, 2, n, DIM)
    keys = torch.arange(10.0)[None, None, :, None].expand(1, 1, 10, DIM) * 0.1  # later blocks score higher
    ends = torch.arange(10) * 4 + 3
    positions = torch.arange(n)

    def visible(rows):
        return (ends[None, None, :] <= positions[rows, None])[:, None]

    blocks, chosen = select(q, keys, visible, (positions // 4)[None], geometry, 10, 1.0)
    assert blocks.shape == (1, 1, n, 5)
    for t in range(n):
        read = set(blocks[0, 0, t][chosen[0, 0, t]].tolist())
        own = t // 4
        assert {0, own, max(own - 1, 0)} <= read and max(read) == own, (t, read)
        assert len(read) == min(5, own + 1)
        if own >= 6:  # the best others: the blocks just before the local ones
            assert read == {0, own, own - 1, own - 2, own - 3}


def test_a_compressed_block_is_visible_only_once_complete():
    n = 30
    q, k, v, _, weights = inputs(n, batch=1, kv_heads=HEADS)
    geometry = NSAAttention(**SMALL).geometry
    call = make_call(True, None, head_dim=DIM)
    o_cmp, _, _ = nsa_ops.nsa_branches(q, k, v, call, geometry, weights.key_compressor, weights.value_compressor, 1)
    assert (o_cmp[..., : 8 - 1, :] == 0).all() and (o_cmp[..., 8 - 1, :] != 0).all()
    changed = k.clone()
    changed[..., 12:, :] += 5.0  # the second block (4 .. 11) ends before 12: no output before 12 may change
    o_changed, _, _ = nsa_ops.nsa_branches(
        q, changed, v, call, geometry, weights.key_compressor, weights.value_compressor, 1
    )
    torch.testing.assert_close(o_changed[..., :12, :], o_cmp[..., :12, :])
    assert not torch.allclose(o_changed[..., 15, :], o_cmp[..., 15, :])  # block 2 (8 .. 15) is seen at 15


def test_no_query_reads_a_future_token():
    n = 64
    q, k, v, hidden, weights = inputs(n)
    variant = NSAAttention(**SMALL)
    with torch.no_grad():
        out = kernel(variant, q, k, v, hidden, None, weights)
        for t in (1, 17, 40, 63):
            changed = [x.clone() for x in (q, k, v)]
            for x in changed:
                x[:, :, t:] = torch.randn_like(x[:, :, t:]) * 10
            noisy_hidden = hidden.clone()
            noisy_hidden[:, t:] = 7.0
            out_changed = kernel(variant, *changed, noisy_hidden, None, weights)
            torch.testing.assert_close(out_changed[:, :, :t], out[:, :, :t], atol=1e-5, rtol=1e-4)


def test_left_padding_content_and_amount_leave_real_rows_unchanged():
    n = 50
    q, k, v, hidden, weights = inputs(n, batch=1)
    variant = NSAAttention(**SMALL)
    with torch.no_grad():
        alone = kernel(variant, q, k, v, hidden, None, weights)
        for pad, seed in ((11, 1), (23, 2)):
            gen = torch.Generator().manual_seed(seed)
            garbage = [torch.randn(*x.shape[:-2], pad, x.shape[-1], generator=gen) * 50 for x in (q, k, v)]
            padded = [torch.cat([g, x], -2) for g, x in zip(garbage, (q, k, v), strict=True)]
            padded_hidden = torch.cat([torch.randn(1, pad, HIDDEN, generator=gen) * 50, hidden], 1)
            mask = padding_mask("left", n + pad, pad)[-1:]
            out = kernel(variant, *padded, padded_hidden, mask, weights)
            torch.testing.assert_close(out[:, :, pad:], alone, atol=1e-5, rtol=1e-4)
            assert (out[:, :, :pad] == 0).all()


def test_a_kv_group_shares_its_selection_and_sums_its_heads():
    n = 64
    q, k, v, hidden, weights = inputs(n, batch=1)
    geometry = NSABlocks(compress=8, stride=4, select=8, top_n=5, window=4)
    call = make_call(True, None, head_dim=DIM)
    expanded = [x.repeat_interleave(2, 1) for x in (k, v)]
    parts = nsa_ops.span_parts(q, *expanded, call, geometry, weights.key_compressor, weights.value_compressor, 2)
    blocks, chosen = parts[3], parts[4]
    read = chosen_blocks.selected_blocks_mask(blocks, chosen, 8, n, parts[5], None)
    assert torch.equal(read[:, 0], read[:, 1]) and torch.equal(read[:, 2], read[:, 3])
    assert not torch.equal(read[:, 1], read[:, 2])
    alone = nsa_ops.span_parts(
        q[:, :1], *(x[:, :1] for x in expanded), call, geometry, weights.key_compressor, weights.value_compressor, 1
    )
    mine = chosen_blocks.selected_blocks_mask(alone[3], alone[4], 8, n, alone[5], None)
    assert not torch.equal(mine[:, 0], read[:, 0]), "the group's choice is not head 0's own"


def test_bf16_runs_without_nan_and_stays_close_to_fp32():
    n = 70
    q, k, v, hidden, weights = inputs(n, dtype=torch.bfloat16)
    variant = NSAAttention(**SMALL)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, hidden)]
    out = kernel(variant, *leaves, padding_mask("left", n, 9), weights)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    assert all(torch.isfinite(p.grad).all() for p in weights.parameters())
    with torch.no_grad():
        full = kernel(variant, *(x.float() for x in (q, k, v, hidden)), padding_mask("left", n, 9), weights.float())
    assert float((out.detach().float() - full).norm() / full.norm()) < 0.05


def test_no_quadratic_allocation_with_many_compressed_blocks():
    """n = 4096 with a stride of 4 (1,023 compressed blocks per query): still nothing of n²/8 elements."""
    assert_memory_below_quadratic(
        NSAAttention(compress_stride=4, compress_block=8, select_block=32, top_n=8, window=64)
    )


def test_bidirectional_calls_are_refused():
    q, k, v, hidden, weights = inputs(16, kv_heads=HEADS)
    with pytest.raises(ValueError, match="causal attention only"):
        run_variant(NSAAttention(**SMALL), q, k, v, make_call(False, None, head_dim=DIM, weights=weights))


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"compress_block": 12, "compress_stride": 8}, "'compress_block'"),
        ({"select_block": 20, "compress_stride": 8}, "'select_block'"),
        ({"top_n": 2}, "'top_n'"),
        ({"window": 0}, "'window'"),
    ],
)
def test_bad_parameters_are_refused_naming_the_parameter(params, named):
    with pytest.raises(VariantParameterError, match=named):
        NSAAttention(**params)


def test_the_per_query_loop_is_not_causal_dense_attention():
    """The tests have teeth: at these sizes the three branches differ from causal dense attention."""
    n = 48
    q, k, v, hidden, weights = inputs(n, batch=1, kv_heads=HEADS)
    with torch.no_grad():
        out = kernel(NSAAttention(**SMALL), q, k, v, hidden, None, weights)
        dense = softmax_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril(), DIM**-0.5)
    assert not torch.allclose(out, dense, atol=1e-2)


@pytest.mark.parametrize(
    ("n", "width", "block"), [(45, 40, 16), (100, 16, 16), (10, 30, 16), (70, 7, 16), (300, 40, 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_window_and_selected_kernels_equal_dense_softmax(n, width, block, dtype):
    """The CPU kernels of the window (runs of keys, a group's heads together) and of the selected blocks (by key
    block) against dense softmax over the same keys: outputs and gradients of q, k, v (GQA, n not a block multiple,
    windows shorter and longer than a block)."""
    from zoo.ops.block_grouped import band_attention, block_grouped_attention
    from zoo.ops.dropout import NO_DROPOUT

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, HEADS, n, DIM, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, KV_HEADS, n, DIM, generator=gen, dtype=dtype) for _ in range(2))
    nb = -(-n // block)
    scores = torch.rand(2, KV_HEADS, n, nb, generator=gen)
    own = torch.arange(n) // block
    earlier = torch.arange(nb) < own[:, None]
    blocks, chosen = top_blocks(scores, earlier & (torch.rand(2, KV_HEADS, n, nb, generator=gen) < 0.6), 3)
    distance = torch.arange(n)[:, None] - torch.arange(n)
    picked = chosen_blocks.selected_blocks_mask(blocks, chosen, block, n, torch.arange(n), None)
    picked = (picked | ((distance >= 0) & (own[:, None] == own[None, :]))).repeat_interleave(2, 1)
    cases = [
        (lambda *x: band_attention(*x, width, block, DIM**-0.5, NO_DROPOUT), (distance >= 0) & (distance < width)),
        (lambda *x: block_grouped_attention(*x, blocks, chosen, block, DIM**-0.5, NO_DROPOUT), picked),
    ]
    grad = torch.randn(q.shape, generator=gen, dtype=dtype)
    for fast, allowed in cases:
        results = []
        for attention in (
            fast,
            lambda q, k, v, allowed=allowed: softmax_attention(
                q, *(x.repeat_interleave(2, 1) for x in (k, v)), allowed, DIM**-0.5
            ),
        ):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = attention(*leaves)
            results.append([out, *torch.autograd.grad(out, leaves, grad)])
        for got, want in zip(*results, strict=True):
            tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(got.float(), want.float(), **tolerance)


# -- decoding -------------------------------------------------------------------------------------------------


def tiny_llama(**params):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    zoo.configure(config, "nsa", **{**SMALL, "top_n": 4, **params})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def test_decoding_cache_keeps_the_compressed_blocks_and_counts_them():
    model = tiny_llama()
    ids, mask = decode_prompts(30)  # the first row left-padded by 5
    with torch.no_grad():
        out = greedy(model, ids, mask, 9, return_dict_in_generate=True)
        assert torch.equal(out.sequences, greedy(model, ids, mask, 9, use_cache=False))
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, NSALayer)
    seen = out.sequences.shape[-1] - 1  # the last token was never fed back
    assert layer.seen == seen
    starts = [5, 0]
    assert layer.summarized.tolist() == [(seen - s - 8) // 4 + 1 for s in starts]
    weights = model.model.layers[0].self_attn.attention_zoo
    for row, start in enumerate(starts):
        count = int(layer.summarized[row])
        with torch.no_grad():
            blocks = layer.keys[row, :, start : start + count * 4 + 4].unfold(1, 8, 4).transpose(-1, -2)
            torch.testing.assert_close(
                layer.compressed_keys[row, :, :count], weights.key_compressor(blocks), atol=1e-5, rtol=1e-4
            )
        assert layer.filled[row, :count].all()
    extra = sum(
        x.numel() * x.element_size()
        for x in (layer.compressed_keys, layer.compressed_values, layer.filled, layer.summarized, layer.row_start)
    )
    assert layer.nbytes() == GrowingLayer.nbytes(layer) + extra > GrowingLayer.nbytes(layer)
    assert cache_nbytes(out.past_key_values) == sum(x.nbytes() for x in out.past_key_values.layers)


def test_each_block_is_compressed_once_while_decoding(monkeypatch):
    compressed = []
    real = NSAWeights.compress_rows

    def counting(self, k, v, starts, padding_mask, numbers, geometry):
        compressed.append(len(numbers))
        return real(self, k, v, starts, padding_mask, numbers, geometry)

    monkeypatch.setattr(NSAWeights, "compress_rows", counting)
    model = tiny_llama()
    ids = torch.randint(3, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    blocks = (out.shape[-1] - 1 - 8) // 4 + 1
    assert sum(compressed) == blocks * model.config.num_hidden_layers


def test_cache_rollback_forgets_the_blocks_it_completed():
    layer = NSALayer(NSAAttention(**SMALL).geometry)
    weights = NSAWeights(HIDDEN, HEADS, KV_HEADS, DIM, 8)
    keys = torch.randn(1, KV_HEADS, 20, DIM)
    layer.update(keys, keys.clone(), kwargs={})
    starts = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        before, _, _ = layer.compressed_blocks(None, starts, weights)
        assert layer.summarized.tolist() == [4]
        layer.crop(-5)  # 15 tokens: blocks 0 .. 1 complete
        assert layer.summarized.tolist() == [2] and layer.filled.tolist() == [[True, True]]
        again, _, filled = layer.compressed_blocks(None, starts, weights)
    torch.testing.assert_close(again, before[:, :, :2])
    assert filled.tolist() == [[True, True]]
