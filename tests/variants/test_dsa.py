"""What is specific to ``dsa`` (the contract suite covers the rest): the indexer's selection against a per-query loop
written from the paper's formula, ties to the later key, ``top_k`` >= length equals causal dense attention, gradients
of both kernels, the refusal of bidirectional calls, the indexer's KL loss (its value, where its gradient goes, that
an optimizer lowers it) and the decoding cache of indexer keys."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import outputs_and_gradients
from zoo.variants.dsa import DSAAttention, DSAIndexer, DSALayer, indexer_losses

import zoo
from zoo.cache import GrowingLayer, cache_nbytes
from zoo.ops import dsa as dsa_ops
from zoo.ops import limits, softmax_attention
from zoo.ops.dsa import dense_indexer_kl, indexer_kl, top_tokens
from zoo.ops.dsa.naive import dsa_naive, dsa_naive_mask, selected_mask
from zoo.plug.dispatch import run_variant
from zoo.testing import make_call, make_weights, reference

HEADS, DIM = 2, 16


def qkv(n: int, batch: int = 2, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, n, DIM, generator=gen).to(dtype) for _ in range(3)]


def left_padded(n: int, pad: int) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[-1, :pad] = False
    return mask


def indexer_of(variant: DSAAttention, dtype=torch.float32) -> DSAIndexer:
    return make_weights(variant, heads=HEADS, head_dim=DIM).to(dtype)


def indexer_inputs(k, weights: DSAIndexer):
    """The indexer's queries, weights and keys in float64 from the keys with the heads merged (what the indexer reads
    outside a model)."""
    source = k.detach().transpose(1, 2).flatten(2).double()
    index_q = (source @ weights.query.weight.detach().double().T).unflatten(-1, (weights.heads, weights.dim))
    index_w = source @ weights.head_weights.weight.detach().double().T
    index_k = source @ weights.key.weight.detach().double().T
    return index_q, index_w, index_k


def naive_allowed(k, mask, weights: DSAIndexer, top_k: int) -> torch.Tensor:
    """(B, 1, n, n) bool: the indexer's rule one query at a time (:func:`zoo.ops.dsa.naive.dsa_naive_mask`)."""
    return dsa_naive_mask(*indexer_inputs(k, weights), mask, top_k)


def naive_attention(q, k, v, mask, weights, top_k):
    return dsa_naive(q, k, v, *indexer_inputs(k, weights), mask, top_k, DIM**-0.5)


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("top_k", [1, 7, 20])
def test_kernel_reads_the_keys_the_per_query_loop_selects(padding, top_k):
    n = 53
    q, k, v = qkv(n)
    mask = None
    if padding == "left":
        mask = left_padded(n, 8)
    elif padding == "right":
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[-1, n - 8 :] = False
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=top_k)
    weights = indexer_of(variant)
    call = make_call(True, mask, head_dim=DIM, weights=weights)
    out = run_variant(variant, q, k, v, call)
    torch.testing.assert_close(out, naive_attention(q, k, v, mask, weights, top_k), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(reference(variant, q, k, v, call), out, atol=1e-5, rtol=1e-4)
    allowed = naive_allowed(k, mask, weights, top_k)
    assert int(allowed.sum(-1).max()) == top_k  # sparse: no query reads more than top_k keys


def test_ties_go_to_the_later_keys():
    """Zero head weights score every key 0: each query reads its last top_k keys (a sliding window)."""
    n, top_k = 40, 5
    q, k, v = qkv(n)
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=top_k)
    weights = indexer_of(variant)
    with torch.no_grad():
        weights.head_weights.weight.zero_()
    out = run_variant(variant, q, k, v, make_call(True, None, head_dim=DIM, weights=weights))
    positions = torch.arange(n)
    offset = positions[:, None] - positions[None, :]
    window = (offset >= 0) & (offset < top_k)
    torch.testing.assert_close(out, softmax_attention(q, k, v, window, DIM**-0.5), atol=1e-5, rtol=1e-4)
    index, chosen = top_tokens(torch.tensor([[2.0, 1.0, 1.0, 1.0, 3.0]]), torch.ones(1, 5, dtype=torch.bool), 3)
    assert index.tolist() == [[0, 3, 4]] and chosen.all()


@pytest.mark.parametrize("padding", [None, "left"])
def test_top_k_at_least_the_length_is_causal_dense_attention(padding):
    n = 30
    q, k, v = qkv(n)
    mask = left_padded(n, 6) if padding else None
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=n)
    out = run_variant(variant, q, k, v, make_call(True, mask, head_dim=DIM, weights=indexer_of(variant)))
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    want = softmax_attention(q, k, v, allowed, DIM**-0.5)
    if mask is not None:
        want = want.masked_fill(~mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "padded", "chunks"),
                         [(torch.float32, False, 0), (torch.float64, False, 0), (torch.float32, True, 0),
                          (torch.float64, True, 7)],
                         ids=["flash", "gathered-sdpa", "left-padded", "gathered-sdpa-in-chunks"])
def test_outputs_and_gradients_match_the_per_query_loop(monkeypatch, dtype, padded, chunks):
    if chunks:  # the off-CPU-flash path in many chunks of at most 7 SDPA entries (CUDA: 2^15)
        monkeypatch.setattr(limits, "DEVICE_CHUNK_ENTRIES", chunks)
    n, top_k = 37, 6
    q, k, v = qkv(n, dtype=dtype)
    mask = left_padded(n, 5) if padded else None
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=top_k)
    weights = indexer_of(variant, dtype)
    grad_out = torch.randn(2, HEADS, n, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    call = make_call(True, mask, head_dim=DIM, weights=weights)
    kernel = outputs_and_gradients(lambda *x: run_variant(variant, *x, call), (q, k, v), grad_out)
    loop = outputs_and_gradients(lambda *x: naive_attention(*x, mask, weights, top_k), (q, k, v), grad_out)
    for got, want in zip(kernel, loop, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_bidirectional_calls_are_refused():
    q, k, v = qkv(8)
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=4)
    with pytest.raises(ValueError, match="causal attention only"):
        run_variant(variant, q, k, v, make_call(False, None, head_dim=DIM, weights=indexer_of(variant)))


# -- the indexer's loss ---------------------------------------------------------------------------------------


def test_indexer_kl_is_the_kl_of_the_head_summed_attention_against_the_indexer():
    n, top_k = 12, 4
    q, k, _ = qkv(n, batch=1)
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=top_k)
    weights = indexer_of(variant)
    with torch.no_grad():
        index_q, index_w, index_k = weights.project(k.transpose(1, 2).flatten(2))
    allowed = naive_allowed(k, None, weights, top_k)[0, 0]
    index = torch.zeros(1, n, top_k, dtype=torch.long)
    chosen = torch.zeros(1, n, top_k, dtype=torch.bool)
    for t in range(n):
        keys = allowed[t].nonzero()[:, 0]
        index[0, t, : len(keys)], chosen[0, t, : len(keys)] = keys, True
    loss = indexer_kl(q, k, index_q, index_w, index_k, index, chosen, DIM**-0.5)
    expected = 0.0
    for t in range(n):
        keys = allowed[t].nonzero()[:, 0]
        attention = torch.einsum("hd,hkd->hk", q[0, :, t], k[0, :, keys]) * DIM**-0.5
        probs = torch.softmax(attention, -1).sum(0)
        target = probs / probs.sum()
        scores = ((index_q[0, t] @ index_k[0, keys].T).relu() * index_w[0, t, :, None]).sum(0)
        expected += float((target * (target.log() - torch.log_softmax(scores, -1))).sum())
    assert float(loss) == pytest.approx(expected / n, rel=1e-5)
    assert float(loss) > 0


def tiny_llama(**params):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    zoo.configure(config, "dsa", **{"index_heads": 2, "index_dim": 8, "top_k": 6, **params})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_dense_warmup_attends_densely_and_its_loss_is_the_kl_against_the_dense_distribution():
    n = 14
    q, k, v = qkv(n)
    mask = left_padded(n, 3)
    variant = DSAAttention(index_heads=2, index_dim=8, top_k=2, dense_warmup=True)
    weights = indexer_of(variant)
    out = run_variant(variant, q, k, v, make_call(True, mask, head_dim=DIM, weights=weights))
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & mask[:, None, None, :]
    want = softmax_attention(q, k, v, allowed, DIM**-0.5).masked_fill(~mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        index_q, index_w, index_k = weights.project(k.transpose(1, 2).flatten(2))
    loss = dense_indexer_kl(q, k, index_q, index_w, index_k, DIM**-0.5, mask)
    expected, queries = 0.0, 0
    for b in range(2):
        for t in range(n):
            keys = [s for s in range(t + 1) if mask[b, s]]
            if not mask[b, t]:
                continue
            attention = torch.einsum("hd,hkd->hk", q[b, :, t], k[b, :, keys]) * DIM**-0.5
            target = torch.softmax(attention, -1).sum(0)
            target = target / target.sum()
            scores = ((index_q[b, t] @ index_k[b, keys].T).relu() * index_w[b, t, :, None]).sum(0)
            expected += float((target * (target.log() - torch.log_softmax(scores, -1))).sum())
            queries += 1
    assert float(loss) == pytest.approx(expected / queries, rel=1e-5)


@pytest.mark.parametrize("dense_warmup", [False, True], ids=["sparse", "dense-warmup"])
def test_training_adds_the_indexer_loss_to_the_backward_and_nothing_else(dense_warmup):
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = {}
    for weight in (1.0, 0.0):
        model = tiny_llama(indexer_loss_weight=weight, dense_warmup=dense_warmup).train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[weight] = {name: p.grad for name, p in model.named_parameters()}
        if weight:
            assert indexer_losses(model) is not None and float(indexer_losses(model)) > 0
    for name, grad in grads[1.0].items():
        if ".attention_zoo." in name:
            assert grad is not None and grad.abs().max() > 0, name
            assert grads[0.0][name] is None, f"{name}: the indexer trains by its loss only"
        else:
            torch.testing.assert_close(grad, grads[0.0][name], msg=lambda m, n=name: f"{n}: {m}")
    # without its loss the indexer has no gradient: distributed training must look for unused parameters
    assert DSAAttention().trains_every_parameter and not DSAAttention(indexer_loss_weight=0.0).trains_every_parameter


@pytest.mark.parametrize("dense_warmup", [False, True], ids=["sparse", "dense-warmup"])
def test_an_optimizer_lowers_the_indexer_loss(dense_warmup):
    model = tiny_llama(dense_warmup=dense_warmup).train()
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    indexer = [p for name, p in model.named_parameters() if ".attention_zoo." in name]
    optimizer = torch.optim.Adam(indexer, lr=3e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        losses.append(float(indexer_losses(model)))
        optimizer.step()
    assert losses[-1] < 0.7 * losses[0]


# -- decoding -------------------------------------------------------------------------------------------------


def test_decoding_cache_keeps_every_indexer_key_and_counts_it():
    model = tiny_llama().eval()
    ids = torch.randint(3, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, return_dict_in_generate=True, **greedy)
        full = model.generate(ids, use_cache=False, **greedy)
    assert torch.equal(out.sequences, full)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, DSALayer) and layer.index_keys.shape == (2, layer.seen, 8)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(out.sequences[:, :-1]))
        torch.testing.assert_close(layer.index_keys, attention.attention_zoo.key(hidden), atol=1e-5, rtol=1e-4)
    assert layer.nbytes() == GrowingLayer.nbytes(layer) + layer.index_keys.numel() * 4
    assert cache_nbytes(out.past_key_values) == sum(x.nbytes() for x in out.past_key_values.layers)


def test_cache_rollback_forgets_the_indexer_keys_of_the_dropped_tokens():
    layer = DSALayer()
    keys = torch.randn(1, 2, 10, DIM)
    layer.update(keys, keys.clone(), kwargs={})
    layer.add_index_keys(torch.randn(1, 10, 8))
    layer.crop(-3)
    layer.update(keys[:, :, :1], keys[:, :, :1].clone(), kwargs={})
    new = torch.randn(1, 1, 8)
    kept = layer.index_keys[:, :7].clone()
    assert torch.equal(layer.add_index_keys(new), torch.cat([kept, new], 1))


# -- the kernel over a given selection ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [2**20, 3 * 16 * 2 * DIM], ids=["one-chunk", "many-chunks"])
def test_token_kernel_equals_dense_softmax_over_the_same_keys(chunk, monkeypatch):
    """The CPU kernel on a random selection (some slots unchosen, a query without keys, chunks all chosen and not):
    outputs, gradients and the KL target against dense softmax restricted to the same keys."""
    monkeypatch.setattr(limits, "DSA_GATHER_CHUNK_ELEMENTS", chunk)
    n, slots = 29, 5
    q, k, v = qkv(n)
    gen = torch.Generator().manual_seed(4)
    index = torch.stack([torch.stack([torch.randperm(t + 1, generator=gen)[:slots].sort().values
                                      if t + 1 >= slots else torch.arange(slots).clamp(max=t) for t in range(n)])
                         for _ in range(2)])
    chosen = torch.ones(2, n, slots, dtype=torch.bool)
    chosen[:, :slots - 1] = torch.arange(slots) <= torch.arange(slots - 1)[:, None]  # the first queries: t + 1 keys
    chosen[1, 20, :] = False  # no key at all: zero output and gradients
    allowed = selected_mask(index, chosen, n)[:, None]
    call = make_call(True, None, head_dim=DIM)
    grad_out = torch.randn(2, HEADS, n, DIM, generator=gen)
    kernel = outputs_and_gradients(lambda *x: dsa_ops.token_attention(*x, index, chosen, call), (q, k, v), grad_out)
    dense = outputs_and_gradients(lambda *x: softmax_attention(*x, allowed, DIM**-0.5), (q, k, v), grad_out)
    for got, want in zip(kernel, dense, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    _, target = dsa_ops.token_attention(q, k, v, index, chosen, call, with_target=True)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k).mul(DIM**-0.5).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0).sum(1)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(target * chosen, probs.gather(-1, index) * chosen, atol=1e-6, rtol=1e-5)
