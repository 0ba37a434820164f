"""What is specific to ``moba`` (the contract suite covers the rest): the selection against a per-query loop written
from the paper's rule, ties, the own-block rule, ``top_k`` >= blocks equals causal dense attention, gradients against
the loop's reference, the refusal of bidirectional calls, and the decoding cache (block means kept, each block
summarized once, every byte counted)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import outputs_and_gradients
from zoo.variants.moba import MoBAAttention, MoBALayer

import zoo
from zoo.cache import GrowingLayer, cache_nbytes
from zoo.ops import chosen_blocks, limits, softmax_attention
from zoo.ops import moba as moba_ops
from zoo.ops.choose import top_blocks
from zoo.ops.moba.naive import moba_naive, moba_naive_mask
from zoo.plug.dispatch import run_variant
from zoo.testing import make_call, reference

HEADS, DIM = 3, 16


def qkv(n: int, batch: int = 2, heads: int = HEADS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, DIM, generator=gen) for _ in range(3)]


def left_padded(batch: int, n: int, pad: int) -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, :pad] = False
    return mask


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize(("block", "top_k"), [(8, 2), (5, 3), (16, 1)])
def test_kernel_reads_the_keys_the_per_query_loop_selects(padding, block, top_k):
    n = 61
    q, k, v = qkv(n)
    mask = None
    if padding == "left":
        mask = left_padded(2, n, 9)
    elif padding == "right":
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[-1, n - 9 :] = False
    variant = MoBAAttention(block_size=block, top_k=top_k)
    call = make_call(True, mask, head_dim=DIM)
    out = run_variant(variant, q, k, v, call)
    torch.testing.assert_close(out, moba_naive(q, k, v, mask, block, top_k, DIM**-0.5), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(reference(variant, q, k, v, call), out, atol=1e-5, rtol=1e-4)
    # the selection is sparse here: fewer keys than causal attention for the late queries
    allowed = moba_naive_mask(q, k, mask, block, top_k)
    assert int(allowed[..., -1, :].sum(-1).max()) <= (top_k + 1) * block < n


def test_padding_inside_a_row_is_left_out_of_the_block_means():
    """A hole of padding in a row (the per-query kernel): a block's gate reads the mean of its real keys only."""
    n, block, top_k = 40, 8, 1
    q, k, v = qkv(n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 3:7] = False
    k[1, :, 3:7] = 100.0  # would dominate block 0's mean if it counted
    out = run_variant(MoBAAttention(block_size=block, top_k=top_k), q, k, v, make_call(True, mask, DIM))
    torch.testing.assert_close(out, moba_naive(q, k, v, mask, block, top_k, DIM**-0.5), atol=1e-5, rtol=1e-4)


def test_selection_is_per_query_head():
    q, k, _ = qkv(64, batch=1, heads=4)
    k[:, 1] = k[:, 0]  # two heads of one KV group: the same keys, their own queries
    allowed = moba_naive_mask(q, k, None, 8, 2)
    assert not torch.equal(allowed[:, 0], allowed[:, 1])
    torch.testing.assert_close(run_variant(MoBAAttention(block_size=8, top_k=2), q, k, _, make_call(True, None, DIM)),
                               moba_naive(q, k, _, None, 8, 2, DIM**-0.5), atol=1e-5, rtol=1e-4)


def test_ties_go_to_the_earlier_blocks():
    """Zero queries score every block 0: each query reads the first top_k blocks before its own and its own block,
    uniformly (the output is the mean of those values)."""
    n, block, top_k = 48, 6, 2
    _, k, v = qkv(n, batch=1, heads=1)
    q = torch.zeros_like(k)
    out = run_variant(MoBAAttention(block_size=block, top_k=top_k), q, k, v, make_call(True, None, DIM))
    for t in range(n):
        own = t // block
        keys = list(range(min(top_k, own) * block)) + list(range(own * block, t + 1))
        torch.testing.assert_close(out[0, 0, t], v[0, 0, keys].mean(0), atol=1e-5, rtol=1e-4)
    blocks, chosen = top_blocks(torch.zeros(1, 5), torch.tensor([[True, False, True, True, True]]), 3)
    assert blocks.tolist() == [[0, 2, 3]] and chosen.all()


def test_top_k_zero_reads_the_own_block_only():
    n, block = 40, 8
    q, k, v = qkv(n)
    out = run_variant(MoBAAttention(block_size=block, top_k=0), q, k, v, make_call(True, None, DIM))
    positions = torch.arange(n)
    same_block = positions[:, None] // block == positions[None, :] // block
    own_block = same_block & (positions[None, :] <= positions[:, None])
    torch.testing.assert_close(out, softmax_attention(q, k, v, own_block, DIM**-0.5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padding", [None, "left"])
def test_top_k_at_least_the_blocks_is_causal_dense_attention(padding):
    n, block = 50, 8
    q, k, v = qkv(n)
    mask = left_padded(2, n, 7) if padding else None
    out = run_variant(MoBAAttention(block_size=block, top_k=7), q, k, v, make_call(True, mask, DIM))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = causal if mask is None else causal & mask[:, None, None, :]
    want = softmax_attention(q, k, v, allowed, DIM**-0.5)
    if mask is not None:
        want = want.masked_fill(~mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(run_variant(MoBAAttention(block_size=block, top_k=1), q, k, v,
                                          make_call(True, mask, DIM)), want, atol=1e-3)


@pytest.mark.parametrize(("dtype", "padded", "chunks"),
                         [(torch.float32, False, 0), (torch.float64, False, 0), (torch.float32, True, 0),
                          (torch.float64, True, 7)],
                         ids=["block-grouped", "per-query", "left-padded", "per-query-in-chunks"])
def test_outputs_and_gradients_match_the_per_query_loop(monkeypatch, dtype, padded, chunks):
    """fp32 on CPU runs the kernel grouped by key block, fp64 the gathered one per query: both equal the loop."""
    if chunks:  # the off-CPU-flash path in many chunks of at most 7 SDPA entries (CUDA: 2^15)
        monkeypatch.setattr(limits, "DEVICE_CHUNK_ENTRIES", chunks)
    n, block, top_k = 45, 6, 2
    q, k, v = (x.to(dtype) for x in qkv(n))
    mask = left_padded(2, n, 5) if padded else None
    grad_out = torch.randn(2, HEADS, n, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    variant, call = MoBAAttention(block_size=block, top_k=top_k), make_call(True, mask, DIM)
    kernel = outputs_and_gradients(lambda *x: run_variant(variant, *x, call), (q, k, v), grad_out)
    loop = outputs_and_gradients(lambda *x: moba_naive(*x, mask, block, top_k, DIM**-0.5), (q, k, v), grad_out)
    for got, want in zip(kernel, loop, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_bidirectional_calls_are_refused():
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match="causal attention only"):
        run_variant(MoBAAttention(block_size=4, top_k=1), q, k, v, make_call(False, None, DIM))


# -- decoding -------------------------------------------------------------------------------------------------


def tiny_llama(block: int = 4, top_k: int = 1):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    zoo.configure(config, "moba", block_size=block, top_k=top_k)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def prompts(length: int = 30, left_pad: int = 5):
    ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids, mask


def test_decoding_cache_keeps_the_block_means_and_counts_them():
    model = tiny_llama()
    ids, mask = prompts()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    cached = out.sequences
    with torch.no_grad():
        full = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0,
                              use_cache=False)
    assert torch.equal(cached, full)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, MoBALayer)
    # the last generated token was never fed back: the cache holds every token but it
    seen = cached.shape[-1] - 1
    assert layer.seen == seen
    starts = torch.tensor([5, 0])
    assert layer.summarized.tolist() == ((seen - starts) // 4).tolist()
    for row, start in enumerate(starts.tolist()):
        complete = (seen - start) // 4
        keys = layer.keys[row, :, start : start + complete * 4].float().unflatten(-2, (complete, 4))
        torch.testing.assert_close(layer.means[row, :, :complete], keys.mean(-2))
        assert layer.filled[row, :complete].all()
    summaries = sum(x.numel() * x.element_size() for x in (layer.means, layer.filled, layer.summarized,
                                                           layer.row_start))
    assert layer.nbytes() == GrowingLayer.nbytes(layer) + summaries > GrowingLayer.nbytes(layer)
    assert cache_nbytes(out.past_key_values) == sum(x.nbytes() for x in out.past_key_values.layers)


def test_each_block_is_summarized_once_while_decoding(monkeypatch):
    summarized = []
    real_mean = moba_ops.masked_block_mean

    def counting(blocks, real):
        summarized.append(blocks.shape[-3])
        return real_mean(blocks, real)

    monkeypatch.setattr("zoo.variants.moba.masked_block_mean", counting)
    model = tiny_llama()
    ids, mask = prompts(left_pad=0)
    with torch.no_grad():
        out = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12, do_sample=False, pad_token_id=0)
    blocks = (out.shape[-1] - 1) // 4
    assert sum(summarized) == blocks * model.config.num_hidden_layers


def test_decoding_step_reads_its_blocks_only(monkeypatch):
    """A decoding step gathers (top_k + 1) blocks of keys per query, not the context."""
    gathered = []
    real_rows = chosen_blocks.rows_attention

    def recording(q, k, v, allowed, call):
        gathered.append(k.shape[-2])
        return real_rows(q, k, v, allowed, call)

    monkeypatch.setattr(chosen_blocks, "rows_attention", recording)
    model = tiny_llama(block=4, top_k=2)
    ids, mask = prompts(length=40)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gathered and set(gathered) == {3 * 4}


def test_cache_rollback_forgets_the_blocks_it_completed():
    layer = MoBALayer(block_size=4)
    keys = torch.randn(1, 2, 10, DIM)
    layer.update(keys, keys.clone(), kwargs={})
    layer.block_summaries(None, None, 2)
    assert layer.summarized.tolist() == [2]
    layer.crop(-3)
    assert layer.summarized.tolist() == [1] and layer.filled.tolist() == [[True]]
    means, filled = layer.block_summaries(None, None, 4)
    assert means.shape == (1, 4, 1, DIM) and filled.tolist() == [[True]]
    torch.testing.assert_close(means[0, 0, 0], keys[0, 0, :4].mean(0))
    torch.testing.assert_close(means[0, 1, 0], keys[0, 0, :4].mean(0))  # query heads 0 and 1 share KV head 0

