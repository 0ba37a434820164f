"""What is specific to ``reformer`` (the contract suite covers the rest): the kernel equals softmax attention
restricted to its own LSH pattern, rebuilt here from its buckets token by token (sort, chunks, self rule, causal
bucket window, log-sum-exp of rounds); the hashing (argmax over [xR, −xR], factorized for many buckets,
deterministic per seed and layer, pinned values); no n x n intermediate; O(n log n)-like scaling of the
largest tensor; errors for a KV cache and an odd bucket count."""

from __future__ import annotations

import pytest
import torch
import transformers
from zoo.variants import reformer
from zoo.variants.reformer import ReformerAttention, shared_keys

import zoo
from zoo.contract import LargestAllocation
from zoo.plug.dispatch import run_variant
from zoo.variant import AttentionCall, VariantParameterError

HEADS, DIM = 2, 16


def qkv(n: int, batch: int = 2, heads: int = HEADS, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, DIM, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


def call(causal: bool = False, mask=None, **kwargs) -> AttentionCall:
    return AttentionCall(causal=causal, scaling=DIM**-0.5, padding_mask=mask, **kwargs)


def padding(n: int, real: int, left: bool = False) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    if left:
        mask[1, : n - real] = False
    else:
        mask[1, real:] = False
    return mask


def lsh_pattern_reference(variant: ReformerAttention, q, v, c: AttentionCall) -> torch.Tensor:
    """The kernel's attention rebuilt densely from its buckets, one round and one (batch, head) at a time.

    Round r: rank every token by (bucket, position) with Python's sort; query i may see key j ≠ i when j is real
    and
    - bidirectional: j's chunk (rank // c) is i's chunk or the one before;
    - causal: j is in i's bucket and rank(i) − c ≤ rank(j) < rank(i).
    Rounds merge as one softmax over their log-sum-exps; a token without any key in every round outputs its value.
    """
    buckets = variant.hash_buckets(q, c)
    batch, heads, n, _ = q.shape
    chunk = variant.bucket_size
    real = c.padding_mask if c.padding_mask is not None else torch.ones(batch, n, dtype=torch.bool)
    scores = torch.matmul(q, shared_keys(q).transpose(-1, -2)) * c.scaling
    out = torch.zeros_like(v)
    for b in range(batch):
        for h in range(heads):
            allowed = torch.zeros(variant.n_hashes, n, n, dtype=torch.bool)
            for r in range(variant.n_hashes):
                bucket = buckets[b, h, r].tolist()
                order = sorted(range(n), key=lambda i, bucket=bucket: (bucket[i], i))
                rank = {token: slot for slot, token in enumerate(order)}
                for i in range(n):
                    for j in range(n):
                        if not real[b, j] or j == i:
                            continue
                        if c.causal:
                            allowed[r, i, j] = bucket[i] == bucket[j] and rank[i] - chunk <= rank[j] < rank[i]
                        else:
                            allowed[r, i, j] = rank[i] // chunk - rank[j] // chunk in (0, 1)
            s = scores[b, h].masked_fill(~allowed, float("-inf"))  # (r, n, n)
            lse = torch.logsumexp(s, -1)  # (r, n)
            rounds = torch.softmax(s.masked_fill(~allowed.any(-1, keepdim=True), 0.0), -1) @ v[b, h]
            weights = torch.softmax(lse.masked_fill(~allowed.any(-1).any(0), 0.0), 0)
            merged = (weights[..., None] * rounds).sum(0)
            out[b, h] = torch.where(allowed.any(-1).any(0)[:, None], merged, v[b, h])
    if c.padding_mask is not None:
        out = out.masked_fill(~c.padding_mask[:, None, :, None], 0.0)
    return out


# -- the kernel is its pattern ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n, params, pad",
    [
        (40, {"bucket_size": 8}, None),  # 5 chunks, 10 buckets
        (45, {"bucket_size": 8, "n_hashes": 3}, "right"),  # length not a multiple of the chunk
        (37, {"bucket_size": 4, "n_buckets": 4}, "left"),  # few buckets: buckets span many chunks
        (50, {"bucket_size": 2, "n_buckets": 200, "n_hashes": 1}, None),  # many buckets: many tokens alone
        (24, {"bucket_size": 32}, "right"),  # one chunk: no previous chunk, nothing twice
    ],
)
def test_kernel_equals_softmax_restricted_to_its_lsh_pattern(n, params, pad, causal):
    variant = ReformerAttention(**params)
    q, k, v = qkv(n, dtype=torch.float64)
    mask = None if pad is None else padding(n, n * 2 // 3, left=pad == "left")
    c = call(causal, mask)
    want = lsh_pattern_reference(variant, q, v, c)
    got = run_variant(variant, q, k, v, c)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got32 = run_variant(variant, *(x.float() for x in (q, k, v)), c)  # fp32: same buckets, same pattern
    torch.testing.assert_close(got32, want.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_those_of_the_pattern_reference(causal):
    """The flash path's backward (merged log-sum-exp, per-round flash backward) is the joint softmax's gradient."""
    variant = ReformerAttention(bucket_size=8, n_hashes=3)
    q, k, v = qkv(45)
    c = call(causal, padding(45, 31))
    grad_out = torch.randn_like(q)
    grads = []
    for fn in (lambda q, v: run_variant(variant, q, k, v, c), lambda q, v: lsh_pattern_reference(variant, q, v, c)):
        leaves = [x.clone().requires_grad_() for x in (q, v)]
        (fn(*leaves) * grad_out).sum().backward()
        grads.append([x.grad for x in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_head_slices_change_nothing(monkeypatch):
    """The flash path runs cache-sized slices of heads: one head per slice gives the same output and gradients."""
    q, k, v = qkv(64, heads=3)
    c = call(True, padding(64, 50))
    results = []
    for elements in (reformer.SLICE_ELEMENTS, 1):
        monkeypatch.setattr(reformer, "SLICE_ELEMENTS", elements)
        leaves = [x.clone().requires_grad_() for x in (q, v)]
        out = run_variant(ReformerAttention(bucket_size=8), leaves[0], k, leaves[1], c)
        out.square().sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for whole, sliced in zip(*results, strict=True):
        torch.testing.assert_close(sliced, whole)


def test_a_token_attends_to_itself_only_when_alone():
    """Causal, every token in its own bucket: each sees only itself, so the output is its own value."""
    variant = ReformerAttention(bucket_size=4, n_buckets=2, n_hashes=1)
    q, k, v = qkv(12)
    q[..., 1:] = 0
    q[..., 0] = torch.arange(12.0) + 1  # all in the same bucket: each sees up to 4 earlier tokens, never itself
    out = run_variant(variant, q, k, v, call(causal=True))
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :])  # the first token has nothing else
    assert not torch.allclose(out[..., 5, :], v[..., 5, :])
    alone = ReformerAttention(bucket_size=4, n_buckets=64, n_hashes=1)
    q = torch.randn(1, 1, 8, DIM)
    buckets = alone.hash_buckets(q, call())[0, 0, 0]
    first_of_bucket = torch.tensor([buckets[i] not in buckets[:i] for i in range(8)])
    out = run_variant(alone, q, q, v[:1, :1, :8], call(causal=True))
    torch.testing.assert_close(out[0, 0, first_of_bucket], v[0, 0, :8][first_of_bucket])


def test_gradients_reach_queries_and_values_only():
    q, k, v = (x.requires_grad_() for x in qkv(40))
    run_variant(ReformerAttention(bucket_size=8), q, k, v, call(False, padding(40, 30))).square().sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0
    assert k.grad is None  # shared-QK: the keys are the normalized queries


# -- accuracy against full shared-QK attention -----------------------------------------------------------------


def clustered_queries(n: int, clusters: int, seed: int):
    """Queries near a few directions (norm 12): attention concentrates on a query's own cluster, LSH's regime."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(2, HEADS, clusters, DIM, generator=gen), dim=-1) * 12
    which = torch.randint(0, clusters, (2, HEADS, n), generator=gen)
    q = centers.gather(2, which[..., None].expand(-1, -1, -1, DIM)) + 0.3 * torch.randn(2, HEADS, n, DIM, generator=gen)
    return q, torch.randn(2, HEADS, n, DIM, generator=gen)


def shared_qk_error(variant: ReformerAttention, q, v, causal: bool) -> float:
    c = call(causal)
    ref = variant.reference(q, q, v, c)
    return float((run_variant(variant, q, q, v, c) - ref).norm() / ref.norm())


def test_error_against_full_shared_qk_attention_shrinks_with_more_hashes():
    means = []
    for n_hashes in (1, 2, 4, 8):
        errors = [shared_qk_error(ReformerAttention(bucket_size=32, n_hashes=n_hashes, seed=s),
                                  *clustered_queries(256, 16, s), causal) for s in range(3) for causal in (False, True)]
        means.append(sum(errors) / len(errors))
    assert all(a > b for a, b in zip(means, means[1:], strict=False)), means
    assert means[-1] < 0.5 * means[0], means


def test_one_chunk_is_full_shared_qk_attention():
    q, _, v = qkv(60)
    assert shared_qk_error(ReformerAttention(bucket_size=64), q, v, causal=False) < 1e-6
    one_bucket = ReformerAttention(bucket_size=64, n_buckets=2, n_hashes=1)
    q = q[..., :1].abs() * q[:1, :1, :1]  # positive multiples of one vector: one bucket, causal sees all earlier
    assert shared_qk_error(one_bucket, q, v, causal=True) < 1e-6


# -- hashing ------------------------------------------------------------------------------------------------


def test_buckets_are_the_argmax_over_plus_and_minus_rotations():
    variant = ReformerAttention(n_buckets=6, n_hashes=2)
    q = torch.randn(1, HEADS, 30, DIM)
    buckets = variant.hash_buckets(q, call())
    rotations = variant.rotations(0, HEADS, DIM, [6], q.device)
    for h in range(HEADS):
        for r in range(2):
            projected = q[0, h] @ rotations[h, r]
            assert torch.equal(buckets[0, h, r], torch.cat([projected, -projected], -1).argmax(-1))
    assert buckets.max() < 6 and len(buckets.unique()) > 3


def test_many_buckets_are_hashed_as_two_factors():
    variant = ReformerAttention(bucket_size=4)
    assert variant.bucket_factors(200) == [100]
    factors = variant.bucket_factors(4096)  # 2048 buckets: 46 x 46 from 92 rotation columns, not 1024
    assert len(factors) == 2 and factors[0] * factors[1] >= 2048 and sum(factors) < 100
    q = torch.randn(1, 1, 4096, DIM)
    buckets = variant.hash_buckets(q, call())
    assert buckets.max() < factors[0] * factors[1] and len(buckets.unique()) > 1000


def test_padded_tokens_get_their_own_last_bucket():
    variant = ReformerAttention(n_buckets=8)
    q = torch.randn(2, HEADS, 20, DIM)
    buckets = variant.hash_buckets(q, call(mask=padding(20, 12)))
    assert (buckets[1, ..., 12:] == 8).all() and (buckets[..., :12] < 8).all()


def test_hashing_is_a_function_of_seed_and_layer_pinned_across_processes():
    q = torch.randn(1, HEADS, 64, DIM, generator=torch.Generator().manual_seed(3))

    def buckets(seed=0, layer=0):
        return ReformerAttention(seed=seed, bucket_size=8).hash_buckets(q, call(layer_idx=layer))

    assert torch.equal(buckets(), buckets())  # a fresh instance: nothing but (seed, layer) and the shapes matter
    assert not torch.equal(buckets(), buckets(seed=1)) and not torch.equal(buckets(), buckets(layer=1))
    # Values written down from another process: a change of seeding (e.g. Python's salted hash) shows up here.
    assert buckets()[0, 0, 0, :24].tolist() == [4, 1, 2, 2, 10, 11, 11, 11, 1, 2, 11, 6, 4, 13, 12, 13, 11, 10, 8, 12,
                                                12, 11, 11, 11]
    assert buckets()[0, 1, 1, :12].tolist() == [12, 7, 7, 8, 15, 1, 3, 15, 7, 0, 1, 7]


# -- cost ---------------------------------------------------------------------------------------------------


def test_no_allocation_of_n_squared_over_8_at_4096():
    n = 4096
    q, k, v = (x.requires_grad_() for x in qkv(n, batch=1, heads=1))
    for causal in (False, True):
        with LargestAllocation() as probe:
            ReformerAttention().attend(q, k, v, call(causal)).sum().backward()
        assert 0 < probe.largest < n * n // 8, f"largest allocation {probe.largest} elements (n²/8 = {n * n // 8})"


def test_largest_allocation_grows_linearly():
    sizes = {}
    for n in (2048, 8192):
        q, k, v = qkv(n, batch=1, heads=1)
        with LargestAllocation() as probe:
            ReformerAttention().attend(q, k, v, call(True))
        sizes[n] = probe.largest
    assert sizes[8192] <= 4.5 * sizes[2048], sizes  # n x 2c scores per round: linear in n


# -- errors -------------------------------------------------------------------------------------------------


def test_a_kv_cache_is_refused_clearly():
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="use_cache=False"):
        ReformerAttention().attend(q[..., -1:, :], k, v, call(True))


def test_odd_bucket_count_is_refused_at_configure():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with pytest.raises(VariantParameterError, match="'n_buckets' = 5 must be even"):
        zoo.configure(config, "reformer", n_buckets=5)


def test_generate_refuses_a_kv_cache_and_decodes_without_one():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, num_key_value_heads=2)
    zoo.configure(config, "reformer", bucket_size=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(ids, **kwargs)
    out = model.generate(ids, use_cache=False, **kwargs)
    assert out.shape == (2, 15)
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as generate numbers a left-padded row
    logits = model(input_ids=out[:, :-1], attention_mask=full_mask, position_ids=positions).logits
    assert torch.equal(logits[:, -1].argmax(-1), out[:, -1])  # the last token is the full forward's greedy choice
