"""What is specific to ``bigbird`` (the contract suite covers the rest): the random layout (deterministic per
seed/layer/length/head, the same in training and eval, across processes and after a reload, no block counted
twice), the ITC semantics block by block, any length, short inputs = full attention, causal prefix
consistency, no n x n intermediate, and equality with transformers' BigBirdBlockSparseAttention when both use
the same random blocks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from zoo.variants.bigbird import BigBirdAttention, fixed_blocks, make_layout

import zoo
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_memory_below_quadratic, assert_reloads_identically, make_call, reference
from zoo.variant import AttentionCall, VariantParameterError

HEADS, DIM = 3, 16


def qkv(n: int, batch: int = 2, heads: int = HEADS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, DIM, generator=gen) for _ in range(3)]


def call(causal: bool = False, mask=None, **kwargs) -> AttentionCall:
    return make_call(causal, mask, head_dim=DIM, **kwargs)


def fingerprint(variant: BigBirdAttention, layer: int, num_blocks: int, causal: bool = False) -> list:
    layout = variant.layout(layer, num_blocks, 4, causal, "cpu")
    return (layout.key_blocks * layout.valid).tolist()


# -- the layout ---------------------------------------------------------------------------------------------


def test_layout_is_deterministic_and_differs_per_layer_seed_and_head():
    first, again = BigBirdAttention(), BigBirdAttention()
    assert fingerprint(first, 0, 40) == fingerprint(again, 0, 40)
    assert fingerprint(first, 0, 40) != fingerprint(first, 1, 40)
    assert fingerprint(first, 0, 40) != fingerprint(BigBirdAttention(seed=1), 0, 40)
    heads = first.layout(0, 40, 4, False, "cpu").key_blocks
    assert not torch.equal(heads[0], heads[1])
    assert first.layout(0, 40, 4, False, "cpu") is first.layout(0, 40, 4, False, "cpu"), "layout is cached"
    # A head's layout does not depend on how many heads there are (the pattern predicate relies on it).
    assert torch.equal(first.layout(0, 40, 2, False, "cpu").key_blocks, heads[:2])


def test_layout_is_the_same_in_another_process():
    script = (
        "from zoo.variants.bigbird import BigBirdAttention; "
        "l = BigBirdAttention(seed=5).layout(2, 40, 4, False, 'cpu'); print((l.key_blocks * l.valid).tolist())"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(fingerprint(BigBirdAttention(seed=5), 2, 40))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_blocks,window,num_global,num_random", [(12, 3, 1, 3), (16, 5, 2, 4), (6, 3, 1, 3)])
def test_each_query_block_sees_window_globals_and_distinct_random_blocks(causal, num_blocks, window, num_global,
                                                                         num_random):
    variant = BigBirdAttention(window_blocks=window, num_global_blocks=num_global, num_random_blocks=num_random)
    layout = variant.layout(0, num_blocks, 4, causal, "cpu")
    assert layout.block_counts.max() <= 1, "a key block counted twice in one softmax"
    half, all_blocks = window // 2, set(range(num_blocks))
    for head in range(4):
        for i in range(num_blocks):
            seen = set(torch.nonzero(layout.adjacency[head, i]).flatten().tolist())
            if causal:
                window_set = set(range(max(i - half, 0), i + 1))
                globals_ = set(range(min(num_global, i + 1)))
                candidates = set(range(i)) - window_set - globals_
            else:
                if i < num_global or i >= num_blocks - num_global:
                    assert seen == all_blocks, "global query blocks attend to everything"
                    continue
                window_set = set(range(i - half, i + half + 1))
                globals_ = set(range(num_global)) | set(range(num_blocks - num_global, num_blocks))
                candidates = all_blocks - window_set - globals_
            assert window_set | globals_ <= seen
            random = seen - window_set - globals_
            assert random <= candidates and len(random) == min(num_random, len(candidates))


def test_causal_layout_of_a_block_does_not_depend_on_the_length():
    variant = BigBirdAttention(block_size=8)
    short, long = (variant.layout(0, nb, 4, True, "cpu") for nb in (10, 30))
    assert torch.equal(long.key_blocks[:, :10], short.key_blocks)
    assert torch.equal(long.valid[:, :10], short.valid)


def test_window_blocks_must_be_odd():
    with pytest.raises(VariantParameterError, match="'window_blocks'"):
        BigBirdAttention(window_blocks=4)


# -- the kernel ---------------------------------------------------------------------------------------------


def test_training_and_eval_give_the_same_output():
    variant = BigBirdAttention(block_size=16)
    q, k, v = qkv(200)
    train = run_variant(variant, q, k, v, call(training=True))
    assert torch.equal(train, run_variant(variant, q, k, v, call(training=False)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 150, 192])
def test_up_to_three_blocks_is_exactly_full_attention(n, causal):
    variant = BigBirdAttention()  # block 64: n <= 192 is at most 3 blocks
    q, k, v = qkv(n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 2 + 1 :] = False
    got = run_variant(variant, q, k, v, call(causal, mask))
    positions = torch.arange(n)
    allowed = mask[:, None, None, :] & ((positions[None, :] <= positions[:, None]) if causal else True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).masked_fill(~mask[:, None, :, None], 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_longer_inputs_not_a_block_multiple_match_the_pattern_and_are_sparse(causal):
    variant = BigBirdAttention(block_size=16, num_random_blocks=2)
    n = 16 * 13 + 5
    q, k, v = qkv(n, seed=1)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :20] = False  # left padding in one row, right padding in the other
    mask[1, 150:] = False
    c = call(causal, mask)
    got = run_variant(variant, q, k, v, c).transpose(1, 2)[mask]
    torch.testing.assert_close(got, reference(variant, q, k, v, c).transpose(1, 2)[mask], atol=1e-5, rtol=1e-4)
    full = reference(BigBirdAttention(block_size=16, window_blocks=63), q, k, v, c).transpose(1, 2)[mask]
    assert not torch.allclose(got, full, atol=1e-3), "the pattern must actually be sparse here"


@pytest.mark.parametrize("causal", [False, True])
def test_chunks_give_the_same_output_and_gradients(causal, monkeypatch):
    variant = BigBirdAttention(block_size=16, num_random_blocks=2)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 200:] = False
    results = []
    for chunk in (2**25, 1):  # everything in one chunk; one query block per chunk
        monkeypatch.setattr("zoo.ops.limits.GATHER_CHUNK_ELEMENTS", chunk)
        q, k, v = (x.requires_grad_() for x in qkv(300, seed=2))
        out = run_variant(variant, q, k, v, call(causal, mask))
        out.pow(2).sum().backward()
        results.append([out, q.grad, k.grad, v.grad])
    for single, chunked in zip(*results, strict=True):
        torch.testing.assert_close(chunked, single, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_flash_path_equals_the_single_gather_path(causal):
    """fp32 on CPU runs the chunked flash kernel with recompute in the backward; fp64 the one-gather SDPA path."""
    variant = BigBirdAttention(block_size=16, num_random_blocks=2)
    mask = torch.ones(2, 250, dtype=torch.bool)
    mask[0, :40] = False  # whole padded blocks: their queries may see no real key at all
    mask[1, 230:] = False
    results = []
    for dtype in (torch.float32, torch.float64):
        q, k, v = (x.to(dtype).requires_grad_() for x in qkv(250, seed=3))
        out = run_variant(variant, q, k, v, call(causal, mask))
        out.pow(2).sum().backward()
        results.append([x.double() for x in (out, q.grad, k.grad, v.grad)])
    for flash, gathered in zip(*results, strict=True):
        assert torch.isfinite(flash).all()
        torch.testing.assert_close(flash, gathered, atol=2e-5, rtol=1e-4)


def test_causal_decoding_with_a_kv_cache_gives_the_full_forward_rows():
    variant = BigBirdAttention(block_size=8, num_random_blocks=2)
    q, k, v = qkv(150, batch=1)
    full = run_variant(variant, q, k, v, call(True))
    for t in (0, 7, 8, 77, 149):
        step = run_variant(variant, q[..., t : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], call(True))
        torch.testing.assert_close(step[..., 0, :], full[..., t, :], atol=1e-5, rtol=1e-4)
    prefix = run_variant(variant, q[..., :90, :], k[..., :90, :], v[..., :90, :], call(True))
    torch.testing.assert_close(prefix, full[..., :90, :], atol=1e-5, rtol=1e-4)


def test_no_n_by_n_intermediate_at_4096():
    """A smaller block than the contract suite's default one (more blocks, a larger layout)."""
    assert_memory_below_quadratic(BigBirdAttention(block_size=32), heads=2)


# -- against transformers' BigBird ----------------------------------------------------------------------------


def test_equals_transformers_block_sparse_attention_given_its_random_blocks():
    """transformers draws random blocks with NumPy (training only); give our kernel the same ones. Unpadded rows:
    transformers lays a padded row out over the padded length, the zoo over the row's own length (issue 29; padding
    is held to the padding-amount contract instead)."""
    block, num_blocks, heads, hidden, num_random, seed = 16, 12, 4, 64, 2, 3
    n = block * num_blocks
    config = transformers.BigBirdConfig(hidden_size=hidden, num_attention_heads=heads, block_size=block,
                                        num_random_blocks=num_random, max_position_embeddings=1024)
    module = transformers.models.big_bird.modeling_big_bird.BigBirdBlockSparseAttention(config, seed=seed).train()
    torch.manual_seed(0)
    x = torch.randn(2, n, hidden)
    mask = torch.ones(2, n)
    blocked, band, from_mask, to_mask = transformers.BigBirdModel.create_masks_for_block_sparse_attn(mask, block)
    np.random.seed(seed)  # what the module does before drawing
    plan = module._get_rand_attn_plan(n, block, num_random)
    theirs = np.stack(module._bigbird_block_rand_mask_with_head(n, n, block, block, heads, *plan))
    random = torch.zeros(heads, num_blocks, num_random, dtype=torch.long)
    random[:, 1:-1] = torch.from_numpy(theirs).long()
    valid = torch.zeros_like(random, dtype=torch.bool)
    valid[:, 1:-1] = True
    layout = make_layout(fixed_blocks(num_blocks, 1, 1, causal=False), random, valid)
    assert layout.block_counts.max() == 1
    variant = BigBirdAttention(block_size=block, num_random_blocks=num_random)
    variant.layout = lambda *args: layout
    with torch.no_grad():
        want, _ = module(x, band, from_mask, to_mask, blocked, blocked)
        q, k, v = (p(x).view(2, n, heads, -1).transpose(1, 2) for p in (module.query, module.key, module.value))
        c = AttentionCall(causal=False, scaling=(hidden // heads) ** -0.5, padding_mask=mask.bool())
        got = run_variant(variant, q, k, v, c)
    real = mask.bool()
    torch.testing.assert_close(got.transpose(1, 2).reshape(2, n, hidden)[real], want[real], atol=1e-5, rtol=1e-4)


# -- inside models --------------------------------------------------------------------------------------------


def test_modernbert_forward_backward_and_reload():
    config = transformers.ModernBertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, attention_dropout=0.0, pad_token_id=0)
    zoo.configure(config, "bigbird", block_size=8, num_random_blocks=2)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config)
    ids = torch.randint(3, 64, (2, 100))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, 70:] = 0
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    reloaded = assert_reloads_identically(model, {"input_ids": ids, "attention_mask": mask})
    assert reloaded.config.attention_zoo["params"]["num_random_blocks"] == 2
