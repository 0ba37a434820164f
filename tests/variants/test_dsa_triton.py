"""``dsa``'s Triton kernels (:mod:`zoo.ops.backends.triton_dsa_kernels`) against the zoo's kernel: outputs, the
indexer's KL target and the gradients of q, k, v and of the indexer, on the CPU under ``TRITON_INTERPRET=1`` (small
shapes: the interpreter runs each program in Python) and, skipped without a GPU, compiled on CUDA; and the kernels
compiled for an H100 (sm_90) by triton's own ptxas without a GPU, so that a kernel the interpreter accepts but the
compiler refuses fails here. Skipped without triton (``pip install "attention-zoo[triton]"``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: pip install 'attention-zoo[triton]'")

from zoo.ops.backends import triton_dsa, triton_dsa_kernels  # noqa: E402
from zoo.ops.dsa import kernel as dsa_kernel  # noqa: E402
from zoo.ops.dsa import select_tokens, token_attention  # noqa: E402
from zoo.plug.dispatch import run_variant  # noqa: E402
from zoo.testing import make_call, make_variant  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# triton picks its interpreter when it is first imported, and `import zoo` imports it (through torch._dynamo): the
# interpreted tests run in a process started with TRITON_INTERPRET=1 (test_the_interpreted_tests_pass)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED or CUDA, reason="runs in the TRITON_INTERPRET=1 process that "
                                 "test_the_interpreted_tests_pass starts (CUDA: the test_cuda_* tests)")


@pytest.mark.skipif(INTERPRETED or CUDA, reason="the interpreted process itself (CUDA: the kernels are compiled)")
def test_the_interpreted_tests_pass():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "interpreted"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout, result.stdout[-2000:]


def selection_inputs(n=64, top_k=16, dim=16, heads=2, kv_heads=1, batch=2, dtype=torch.float32, seed=0):
    """q (B, H, n, D), k/v (B, H_kv, n, D), a top-k selection (B, n, k') by a random indexer and a left-padded last
    row (its first queries see fewer than k' keys, its padded ones none)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, n, dim, generator=gen) for _ in range(2))
    index_q, index_w, index_k = (torch.randn(*shape, generator=gen) for shape in
                                 ((batch, n, 2, 8), (batch, n, 2), (batch, n, 8)))
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, :9] = False
    index, chosen = select_tokens(index_q, index_w, index_k, torch.arange(n), mask, top_k)
    moved = [x.to(DEVICE, dtype) for x in (q, k, v)]
    return *moved, index.to(DEVICE), chosen.to(DEVICE), mask.to(DEVICE)


def outputs_and_grads(attention, q, k, v, grad):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, target = attention(*leaves)
    (out.float() * grad).sum().backward()
    return [out.float(), target] + [x.grad.float() for x in leaves]


def zoo_kernel(q, k, v, index, chosen, call):
    """The zoo's own kernel (keys expanded to the query heads; their gradients summed back per KV head)."""
    groups = q.shape[1] // k.shape[1]

    def attention(q, k, v):
        return token_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), index, chosen,
                               call, with_target=True)

    return attention


@interpreted
def test_interpreted_kernels_equal_the_zoo_kernel_forward_target_and_backward():
    q, k, v, index, chosen, mask = selection_inputs()
    call = make_call(True, mask, head_dim=q.shape[-1])
    grad = torch.randn(*q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(triton_dsa.ENV, "0")  # the zoo's kernel, on CUDA too
        want = outputs_and_grads(zoo_kernel(q, k, v, index, chosen, call), q, k, v, grad)
    got = outputs_and_grads(
        lambda *x: triton_dsa_kernels.topk_attention(*x, index, chosen, call.scaling, True), q, k, v, grad)
    for name, g, w in zip(("out", "target", "dq", "dk", "dv"), got, want, strict=True):
        assert w is not None, name
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=name)
    assert bool((want[0][-1, :, :9] == 0).all())  # padded queries: no key, zeros
    with torch.no_grad():  # inference (no target pass), and a decoding step's few queries over every key
        plain, target = triton_dsa_kernels.topk_attention(q, k, v, index, chosen, call.scaling)
        step, _ = triton_dsa_kernels.topk_attention(q[:, :, -3:], k, v, index[:, -3:], chosen[:, -3:], call.scaling)
    assert target is None
    torch.testing.assert_close(plain, got[0])
    torch.testing.assert_close(step, got[0][:, :, -3:])


@interpreted
def test_interpreted_variant_trains_its_indexer_on_the_kernels_as_on_the_zoo_kernel(monkeypatch):
    """The whole training step of ``dsa`` (the KL target from the kernels, the indexer's loss and gradients) with the
    Triton kernels forced on, against the zoo's kernel."""
    variant = make_variant("dsa")
    q, k, v, _, _, mask = selection_inputs(batch=1, heads=2, kv_heads=2)
    results = []
    for kernels in (None, triton_dsa_kernels.topk_attention):
        if kernels is not None:
            monkeypatch.setattr(dsa_kernel, "triton_kernel", lambda *args, kernels=kernels: kernels)
        call = make_call(True, head_dim=q.shape[-1], variant=variant, training=True)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run_variant(variant, *leaves, call)
        out.square().sum().backward()
        weights = call.weights
        results.append([out, weights.last_loss] + [x.grad for x in leaves] + [p.grad for p in weights.parameters()])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert results[0][1] > 0 and all(bool(g.abs().sum() > 0) for g in results[0][5:])  # the indexer trained


def test_a_cpu_call_never_loads_the_kernels(monkeypatch):
    monkeypatch.setattr(triton_dsa, "load", lambda: pytest.fail("the Triton kernels were loaded for a CPU call"))
    variant = make_variant("dsa")
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    run_variant(variant, q, k, v, make_call(True, variant=variant))
    assert not triton_dsa.applies(q, k, v, make_call(True))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_an_h100_without_a_gpu(dtype, monkeypatch):
    """triton's compiler and ptxas (in the triton wheel) build both kernels for sm_90: what the interpreter cannot
    tell (types carried through loops, atomics, masks) is checked by the real compiler."""
    compiler = pytest.importorskip("triton.compiler")
    target = pytest.importorskip("triton.backends.compiler").GPUTarget("cuda", 90, 32)
    pointers = {"index_ptr": "*i32", "lse_ptr": "*fp32", "target_ptr": "*fp32", "delta_ptr": "*fp32",
                "dk_ptr": "*fp32", "dv_ptr": "*fp32"}
    blocks = {"BLOCK": triton_dsa_kernels.BLOCK_K, "BLOCK_D": 64, "BLOCK_DV": 64}
    helper = triton_dsa_kernels._scores  # the kernels' callee, compiled too
    monkeypatch.setattr(triton_dsa_kernels, "_scores", triton.runtime.jit.JITFunction(helper.fn))
    for kernel, constants in ((triton_dsa_kernels._forward, {**blocks, "WITH_TARGET": True}),
                              (triton_dsa_kernels._backward, blocks)):
        function = triton.runtime.jit.JITFunction(kernel.fn)  # the interpreter's wrapper holds the same function
        signature = {name: "constexpr" if name in constants else "fp32" if name == "scale"
                     else pointers.get(name, f"*{dtype}") if name.endswith("_ptr") else "i32"
                     for name in function.arg_names}
        binary = compiler.compile(compiler.ASTSource(function, signature, constants), target=target)
        assert binary.asm["cubin"], kernel.fn.__name__


@pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_triton_topk_attention_equals_the_zoo_kernel(dtype, monkeypatch):
    q, k, v, index, chosen, mask = selection_inputs(n=300, top_k=48, dim=64, heads=4, kv_heads=2, dtype=dtype)
    call = make_call(True, mask, head_dim=64)
    grad = torch.randn(*q.shape, device=DEVICE)
    monkeypatch.setenv(triton_dsa.ENV, "0")
    want = outputs_and_grads(zoo_kernel(q, k, v, index, chosen, call), q, k, v, grad)
    monkeypatch.setenv(triton_dsa.ENV, "1")
    assert triton_dsa.triton_kernel(q, k, v, call) is not None
    got = outputs_and_grads(
        lambda *x: triton_dsa_kernels.topk_attention(*x, index, chosen, call.scaling, True), q, k, v, grad)
    for name, g, w in zip(("out", "target", "dq", "dk", "dv"), got, want, strict=True):
        if w is None:  # the zoo's CUDA path computes no target
            continue
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)
        else:  # two kernels round bf16 differently; a wrong key moves the whole tensor
            error = (g - w).square().mean().sqrt() / w.square().mean().sqrt()
            assert error < 2e-2, f"{name}: relative RMS error {error:.3g}"
