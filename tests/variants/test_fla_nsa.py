"""fla's selected-block kernel as the CUDA backend of ``nsa``'s selected branch (``zoo.ops.backends.fla``).

On the CPU (these run everywhere): which calls the dispatch hands fla (a KV group of 16, 32, ... query heads,
selection blocks of a power of two >= 16, no padding, as many queries as keys, no dropout, CUDA half precision), and
the adapter's layout ((B, n, H_kv, S) int32 block numbers, S a power of two, -1 for a slot not chosen), checked by a
stand-in ``ParallelNSAFunction`` that attends densely to the blocks it is given: routed through it, the branch equals
dense softmax attention restricted to the zoo's own choice.

On CUDA with fla installed (``scripts/gpu_check.sh``, step ``fla-tests``): fla's kernel against the zoo's gathered
kernel on the same blocks, bf16, forward and backward, and against the fp32 dense reference; an ``nsa`` Llama with a
KV group of 16 heads runs its selected branch on fla, forward and backward equal to the zoo's kernels. Tolerances as
in ``test_fla_backend.py`` (relative RMS: 0.03 outputs, 0.08 gradients).
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import transformers

import zoo
from zoo.ops.backends import fla as fla_backend
from zoo.ops.chosen_blocks import selected_blocks_mask
from zoo.ops.dense import softmax_attention
from zoo.ops.nsa import kernel as nsa_ops

from .test_fla_backend import GRAD_TOL, OUT_TOL, assert_close_ratio, counted

HAS_FLA = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
cuda_fla = pytest.mark.skipif(not HAS_FLA, reason="needs CUDA and flash-linear-attention (attention-zoo[fla])")


def choice(batch: int, kv_heads: int, n: int, size: int, slots: int, seed: int = 0):
    """blocks, chosen (B, H_kv, n, slots): each query's own block and up to slots - 1 distinct earlier ones, at
    random; unchosen slots hold an arbitrary block number (the adapter must not read it)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, -(-n // size), (batch, kv_heads, n, slots), generator=gen)
    chosen = torch.zeros(batch, kv_heads, n, slots, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            for t in range(n):
                own = t // size
                earlier = torch.randperm(own, generator=gen)[: int(torch.randint(0, slots, (1,), generator=gen))]
                picked = [own, *earlier.tolist()]
                blocks[b, h, t, : len(picked)] = torch.tensor(picked)
                chosen[b, h, t, : len(picked)] = True
    return blocks, chosen


def branch_inputs(batch=2, groups=16, n=100, dim=32, size=16, slots=5, dtype=torch.float32, device="cpu"):
    """q (B, groups, n, D) and one KV head's k, v (B, 1, n, D), leaves; the KV group's blocks, chosen."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, groups, n, dim, generator=gen)
    k, v = (torch.randn(batch, 1, n, dim, generator=gen) for _ in range(2))
    blocks, chosen = choice(batch, 1, n, size, slots)
    tensors = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    return (*tensors, blocks.to(device), chosen.to(device))


def as_the_plug_gives(q, k, v, blocks, chosen):
    """k, v, blocks, chosen with the KV head repeated once per query head, as the plug hands them to a kernel (the
    gradients of the repeats sum back into the KV head)."""
    groups = q.shape[1]
    return q, *(x.repeat_interleave(groups, 1) for x in (k, v, blocks, chosen))


def call_of(q, padding_mask=None, dropout=0.0):
    return types.SimpleNamespace(padding_mask=padding_mask, effective_dropout=dropout, scaling=q.shape[-1] ** -0.5,
                                 training=False)


def selected(q, k, v, blocks, chosen, size):
    """The selected branch of one KV group (``branch_inputs``)."""
    positions = torch.arange(k.shape[-2], device=q.device)
    q, k, v, blocks, chosen = as_the_plug_gives(q, k, v, blocks, chosen)
    return nsa_ops.selected_branch(q, k, v, call_of(q), size, blocks, chosen, positions, q.shape[1])


def reference(q, k, v, blocks, chosen, size):
    q, k, v, blocks, chosen = as_the_plug_gives(q, k, v, blocks, chosen)
    n = k.shape[-2]
    mask = selected_blocks_mask(blocks, chosen, size, n, torch.arange(n, device=q.device), None)
    return softmax_attention(q.float(), k.float(), v.float(), mask, q.shape[-1] ** -0.5)


class StandInNSA:
    """fla 0.6.0's ``ParallelNSAFunction.apply(q, k, v, block_indices, block_counts, block_size, scale, cu_seqlens)``
    checked for its layout, computed densely over the listed blocks (causal, -1 skipped)."""

    calls: list = []

    @staticmethod
    def apply(q, k, v, block_indices, block_counts, block_size, scale, cu_seqlens):
        batch, n, heads, dim = q.shape
        kv_heads, slots = k.shape[2], block_indices.shape[-1]
        assert k.shape == v.shape == (batch, n, kv_heads, dim) and heads % kv_heads == 0 and cu_seqlens is None
        assert block_indices.shape == (batch, n, kv_heads, slots) and block_indices.dtype == torch.int32
        assert block_counts == slots and slots & (slots - 1) == 0 and block_indices.is_contiguous()
        StandInNSA.calls.append(slots)
        numbers = block_indices.long().transpose(1, 2)  # (B, H_kv, n, S)
        real = numbers >= 0
        picked = torch.zeros(batch, kv_heads, n, -(-n // block_size) + 1, dtype=torch.long)
        picked = picked.scatter_add_(-1, torch.where(real, numbers, picked.shape[-1] - 1), real.long())[..., :-1] > 0
        mask = picked.repeat_interleave(block_size, -1)[..., :n] & torch.ones(n, n, dtype=torch.bool).tril()
        mask = mask.repeat_interleave(heads // kv_heads, 1)
        out = softmax_attention(*(x.transpose(1, 2) for x in (q, k, v)), mask, scale)
        return out.transpose(1, 2)


def test_the_dispatch_takes_groups_of_16_and_power_of_two_blocks(monkeypatch):
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    monkeypatch.setattr(fla_backend, "_loaded", {"nsa_selected": StandInNSA})
    monkeypatch.setattr(fla_backend, "applies", lambda q, k, v: True)  # CUDA half precision, as on the GPU
    q = torch.zeros(1, 16, 40, 8)
    k = torch.zeros(1, 16, 40, 8)
    assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q), 16, 16) is StandInNSA
    assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q), 64, 32) is StandInNSA
    for size, groups in ((16, 8), (16, 24), (48, 16), (8, 16)):  # fla's tiles: a group of 16, 32, ...; BS = 2^m
        assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q), size, groups) is None
    assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q, padding_mask=torch.ones(1, 40, dtype=bool)), 16, 16) is None
    assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q, dropout=0.1), 16, 16) is None  # fla has no dropout
    assert fla_backend.fla_nsa_kernel(q[:, :, :1], k, k, call_of(q), 16, 16) is None  # a decoding step
    monkeypatch.setattr(fla_backend, "applies", lambda q, k, v: False)  # CPU, fp32, ATTENTION_ZOO_FLA=0
    assert fla_backend.fla_nsa_kernel(q, k, k, call_of(q), 16, 16) is None


def test_the_adapter_hands_fla_its_layout(monkeypatch):
    """Routed through the stand-in (5 slots -> 8, unchosen -1), the selected branch equals dense softmax attention
    restricted to the zoo's choice; without it the zoo's CPU kernel does too."""
    q, k, v, blocks, chosen = branch_inputs()
    want = reference(q, k, v, blocks, chosen, 16)
    torch.testing.assert_close(selected(q, k, v, blocks, chosen, 16), want, atol=1e-5, rtol=1e-5)
    StandInNSA.calls = []
    monkeypatch.setattr(fla_backend, "_loaded", {"nsa_selected": StandInNSA})
    monkeypatch.setattr(fla_backend, "applies", lambda q, k, v: True)
    got = selected(q, k, v, blocks, chosen, 16)
    assert StandInNSA.calls == [8]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))


def test_routed_gradients_equal_the_gathered_kernel_the_cuda_path_runs(monkeypatch):
    """The CUDA comparison below, on the CPU: the zoo's gathered kernel (what CUDA runs without fla) against the
    stand-in, forward and the gradients of q and of the KV head's k, v (summed over its repeats)."""
    args = branch_inputs(n=120, dim=16)
    monkeypatch.setattr(nsa_ops, "by_key_block_applies", lambda q, k, call: False)
    want = forward_backward(*args, 16)
    monkeypatch.setattr(fla_backend, "_loaded", {"nsa_selected": StandInNSA})
    monkeypatch.setattr(fla_backend, "applies", lambda q, k, v: True)
    assert_close_ratio(want, forward_backward(*args, 16), 1e-5, 1e-5)


def test_nsa_selected_asks_the_backend():
    assert nsa_ops.fla_nsa_kernel is fla_backend.fla_nsa_kernel


# ---------------------------------------------------------------------------------------------------------------
# CUDA with fla


def forward_backward(q, k, v, blocks, chosen, size) -> dict:
    for x in (q, k, v):
        x.grad = None
    out = selected(q, k, v, blocks, chosen, size)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out.float() * d_out).sum().backward()
    return {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}


@cuda_fla
@pytest.mark.parametrize("n, size, slots", [(300, 16, 5), (1000, 64, 16)])
def test_cuda_nsa_selected_on_fla_equals_the_zoo_kernel(monkeypatch, n, size, slots):
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    calls = []
    monkeypatch.setattr(nsa_ops, "fla_nsa_selected", counted(fla_backend.fla_nsa_selected, calls))
    args = branch_inputs(n=n, dim=64, size=size, slots=slots, dtype=torch.bfloat16, device="cuda")
    got = forward_backward(*args, size)
    assert calls, "the selected branch did not reach fla"
    monkeypatch.setenv(fla_backend.ENV, "0")
    calls.clear()
    want = forward_backward(*args, size)
    assert not calls
    assert_close_ratio(want, got, OUT_TOL, GRAD_TOL)
    assert_close_ratio({"out": reference(*args, size)}, {"out": got["out"]}, OUT_TOL, GRAD_TOL)


@cuda_fla
def test_cuda_nsa_model_runs_its_selected_branch_on_fla(monkeypatch):
    """A bf16 Llama with 16 query heads on 1 KV head: forward + backward on fla equals the zoo's kernels."""
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    calls = []
    monkeypatch.setattr(nsa_ops, "fla_nsa_selected", counted(fla_backend.fla_nsa_selected, calls))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                                      num_key_value_heads=1, intermediate_size=256, attention_dropout=0.0,
                                      pad_token_id=0)
    params = {"compress_block": 32, "compress_stride": 16, "select_block": 32, "top_n": 4, "window": 64}
    model = transformers.AutoModelForCausalLM.from_config(zoo.configure(config, "nsa", **params))
    model = model.to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 64, (2, 400), generator=torch.Generator().manual_seed(0)).cuda()

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids).logits.float()
        logits.square().mean().backward()
        grads = {f"d{n}": p.grad.float() for n, p in model.named_parameters() if p.grad is not None and "proj" in n}
        return {"logits": logits.detach(), **grads}

    got = logits_and_grads()
    assert calls, "the selected branch did not reach fla"
    monkeypatch.setenv(fla_backend.ENV, "0")
    calls.clear()
    want = logits_and_grads()
    assert not calls
    assert_close_ratio(want, got, OUT_TOL, 0.15)
