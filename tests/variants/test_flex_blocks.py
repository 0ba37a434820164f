"""FlexAttention over content-chosen blocks (:mod:`zoo.ops.backends.flex_blocks`): ``moba`` and ``nsa`` on Flex
against their chunked kernels, the block masks' tile lists against the dense masks of the same selections, and the
backend switch that keeps the path opt-in.

torch 2.13 has no Flex backward on CPU: here the forward only, on Flex's eager reference (it applies the mask
function to every pair and ignores the tile lists: the lists are checked against the dense masks instead) and, for
one shape per variant, on the compiled kernel, which reads the lists. The CUDA tests at the end (skipped without a
GPU) compare forward and backward in fp32.
"""

from __future__ import annotations

import pytest
import torch

from zoo.ops import expand_kv
from zoo.ops import moba as moba_ops
from zoo.ops import nsa as nsa_ops
from zoo.ops.backends import choice, flex, flex_blocks
from zoo.ops.chosen_blocks import selected_blocks_mask
from zoo.ops.moba import kernel as moba_kernel
from zoo.plug import backend as backends
from zoo.plug.dispatch import run_variant
from zoo.testing import make_call, make_inputs, make_variant

HEADS, KV_HEADS, N = 4, 2, 150
PADDINGS = [None, "left", "hole"]  # right padding: another row span, as left
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def gqa_inputs(padding: str | None, n: int = N, seed: int = 0):
    """q (2, 4, n, 16), k/v (2, 2, n, 16) and the padding: left or right of the last row, or a hole inside it."""
    q, k, v, mask = make_inputs(seed=seed, n=n, heads=HEADS, padding=None if padding == "hole" else padding)
    if padding == "hole":
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, 40:60] = False
    return q, k[:, :KV_HEADS], v[:, :KV_HEADS], mask


def both(variant, q, k, v, call, compiled=False):
    """(on Flex, on the chunked kernels): the variant's forward under each backend."""
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        with backends.attention_backend("flex", compiled=compiled):
            got = run_variant(variant, q, k, v, call)
        with backends.attention_backend("chunked"):
            want = run_variant(variant, q, k, v, call)
    return got, want


@pytest.mark.parametrize("padding", PADDINGS, ids=str)
@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_flex_forward_equals_the_chunked_kernel(name, padding):
    variant = make_variant(name)
    q, k, v, mask = gqa_inputs(padding)
    got, want = both(variant, q, k, v, make_call(True, mask, heads=HEADS, variant=variant))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_compiled_flex_reads_the_block_lists_and_equals_the_chunked_kernel(name):
    """The compiled kernel skips the tiles the lists leave out and the mask function on full tiles: a wrong list
    changes the output here, where the eager reference would not notice."""
    variant = make_variant(name, **({"block_size": 64, "top_k": 2} if name == "moba" else {}))
    q, k, v, mask = gqa_inputs("hole", n=300)
    got, want = both(variant, q, k, v, make_call(True, mask, heads=HEADS, variant=variant), compiled=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_each_nsa_branch_on_flex_equals_its_chunked_branch():
    variant = make_variant("nsa")
    q, k, v, mask = gqa_inputs("hole")
    call = make_call(True, mask, heads=HEADS, variant=variant)
    args = (call, variant.geometry, call.weights.key_compressor, call.weights.value_compressor, HEADS // KV_HEADS)
    expanded = expand_kv(k, v, HEADS)
    with torch.no_grad():
        on_flex = nsa_ops.nsa_flex(q, *expanded, *args, compiled=False)
        with backends.attention_backend("chunked"):
            chunked = nsa_ops.nsa_branches(q, *expanded, *args)
    for branch, got, want in zip(("compressed", "selected", "window"), on_flex, chunked, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=branch)


def tiles_of(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full) (B, H, nq, nk) bool: the tiles a BlockMask computes, and those it computes without its mask."""
    def dense(counts, indices):
        rows = torch.zeros(*indices.shape[:-1], indices.shape[-1] + 1, dtype=torch.bool)
        slots = torch.arange(indices.shape[-1]) < counts[..., None]
        return rows.scatter_(-1, torch.where(slots, indices.long(), indices.shape[-1]), True)[..., :-1]

    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return dense(block_mask.kv_num_blocks, block_mask.kv_indices) | full, full


def tiled(allowed: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, n, m) bool pairs -> (any allowed, all allowed) per 128 x 128 tile of the inputs padded to length."""
    padded = torch.nn.functional.pad(allowed, (0, length - allowed.shape[-1], 0, length - allowed.shape[-2]))
    per_tile = padded.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)).sum((-3, -1))
    return per_tile > 0, per_tile == 128 * 128


@pytest.mark.parametrize(("block", "selectors", "dense"), [(48, 4, False), (128, 2, False), (16, 1, False),
                                                       (64, 2, True)])
def test_the_chosen_blocks_mask_lists_exactly_the_tiles_the_selection_touches(block, selectors, dense):
    """Listed tiles: those holding a chosen pair; full tiles (computed without the mask function): those whose pairs
    are all chosen, causal and real. ``dense``: every earlier block chosen, so the tiles below the diagonal are full
    (but those of the padded keys)."""
    n, length, batch = 300, 384, 2
    gen = torch.Generator().manual_seed(block)
    nb = -(-n // block)
    own = (torch.arange(n) // block)[None, None, :, None].expand(batch, selectors, n, 1)
    if dense:
        blocks = torch.arange(nb).expand(batch, selectors, n, nb)
        chosen = blocks <= own
    else:
        earlier = (torch.rand(batch, selectors, n, 3, generator=gen) * own).long()  # blocks before the own one
        blocks = torch.cat([earlier, own], -1)
        chosen = torch.rand(blocks.shape, generator=gen) < 0.8
        chosen[..., -1] = True
    padding = torch.ones(batch, n, dtype=torch.bool)
    padding[1, 200:230] = False
    mask = flex_blocks.chosen_blocks_mask(blocks, chosen, block, HEADS, padding, n, length)
    allowed = selected_blocks_mask(blocks, chosen, block, n, torch.arange(n), padding)  # (B, S, n, n)
    touched, whole = tiled(allowed.repeat_interleave(HEADS // selectors, 1), length)
    listed, full = tiles_of(mask)
    assert torch.equal(listed, touched)
    assert torch.equal(full, whole)
    assert bool(full.any()) or not dense


def test_the_visible_keys_mask_lists_each_query_tile_up_to_its_last_visible_key():
    n, count = 600, 140
    ends = torch.arange(count) * 2 + 7  # compressed blocks of 8 tokens every 2
    filled = torch.ones(2, count, dtype=torch.bool)
    filled[0, :10] = False
    mask = flex_blocks.visible_keys_mask(ends, filled, n, 768, 256)
    allowed = (ends[None, :] <= torch.arange(n)[:, None])[None, None] & filled[:, None, None, :]
    touched, whole = (x[..., :2] for x in tiled(allowed, 768))
    listed, full = tiles_of(mask)
    assert torch.equal(listed, touched)
    assert torch.equal(full, whole)
    assert not bool(full[0, :, :, 0].any()) and bool(full[1, 0, 3, 0])  # row 0's unfilled keys: masked tiles


def test_auto_keeps_the_chunked_kernel_until_flex_is_measured(monkeypatch):
    calls = []
    monkeypatch.setattr(moba_kernel, "chosen_blocks_attention", lambda q, *a: calls.append(a) or q.new_zeros(q.shape))
    variant = make_variant("moba")
    q, k, v, _ = gqa_inputs(None)
    call = make_call(True, heads=HEADS)
    with torch.no_grad():
        assert run_variant(variant, q, k, v, call).abs().sum() > 0 and calls == []  # auto: nothing measured
        monkeypatch.setitem(backends.CPU_CROSSOVER, "moba", 64)
        assert run_variant(variant, q, k, v, call).abs().sum() == 0 and len(calls) == 1  # measured: Flex
        with backends.attention_backend("chunked"):
            run_variant(variant, q, k, v, call)
    assert len(calls) == 1


def test_past_the_recompile_limit_auto_takes_the_chunked_kernel_and_flex_raises(monkeypatch):
    def recompiles(*args):
        raise flex.FlexRecompileLimitError("compiled flex_attention reached the recompile limit")

    monkeypatch.setattr(moba_kernel, "chosen_blocks_attention", recompiles)
    monkeypatch.setitem(backends.CPU_CROSSOVER, "moba", 64)
    variant = make_variant("moba")
    q, k, v, _ = gqa_inputs(None)
    call = make_call(True, heads=HEADS)
    with torch.no_grad():
        got = run_variant(variant, q, k, v, call)
        with backends.attention_backend("chunked"):
            torch.testing.assert_close(got, run_variant(variant, q, k, v, call))
        with backends.attention_backend("flex"), pytest.raises(backends.FlexUnavailableError, match="recompile"):
            run_variant(variant, q, k, v, call)


def test_a_forced_flex_call_that_needs_a_cpu_backward_raises():
    variant = make_variant("moba")
    q, k, v, _ = gqa_inputs(None)
    with backends.attention_backend("flex"), pytest.raises(backends.FlexUnavailableError, match="no backward on CPU"):
        run_variant(variant, q.requires_grad_(), k, v, make_call(True, heads=HEADS))
    assert choice.content_flex("moba", q, k, v, make_call(True)) is False  # auto, nothing measured


def test_moba_flex_is_callable_whatever_the_backend():
    q, k, v, _ = gqa_inputs(None)
    k, v = expand_kv(k, v, HEADS)
    call = make_call(True, heads=HEADS)
    with torch.no_grad():
        got = moba_ops.moba_flex(q, k, v, call, 8, 2, compiled=False)
        with backends.attention_backend("chunked"):
            want = moba_ops.moba_attention(q, k, v, call, 8, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): Flex forward and backward against the chunked kernels, fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention's backward runs only there)")
@pytest.mark.parametrize("padding", [None, "hole"], ids=str)
@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_cuda_content_chosen_flex_forward_and_backward_equal_the_chunked_kernel(name, padding):
    variant = make_variant(name, **({"block_size": 64, "top_k": 2} if name == "moba" else {}))
    q, k, v, mask = (None if x is None else x.cuda() for x in gqa_inputs(padding, n=300))
    call = make_call(True, mask, heads=HEADS, variant=variant)
    if call.weights is not None:
        call.weights.cuda()
    results = []
    for backend in ("flex", "chunked"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with backends.attention_backend(backend), torch._dynamo.config.patch(recompile_limit=64):
            out = run_variant(variant, *leaves, call)
        out.square().sum().backward()
        results.append([out] + [x.grad for x in leaves])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
