"""FlexAttention path (:mod:`zoo.ops.backends.flex`) on CPU: outputs against the chunked kernels and the dense
reference, the BlockMask's blocks against the pattern's, the backend choice and the mask cache.

FlexAttention has no backward on CPU (NotImplementedError in torch 2.13), so gradients through Flex cannot be
checked here: the CUDA tests at the end (skipped without a GPU) compare forward and backward with the chunked
kernels. Most CPU tests run Flex's eager reference (``compiled=False``: it applies the kernel's mask function to
dense scores, seconds per call); one slow test compiles the real kernel at two small lengths.
"""

from __future__ import annotations

import logging

import pytest
import torch

from zoo.ops import allowed_mask, expand_kv, limits, softmax_attention
from zoo.ops.backends import flex
from zoo.pattern import Pattern, band
from zoo.plug import backend as backends
from zoo.plug.dispatch import run_variant
from zoo.testing import LargestAllocation, make_call, make_inputs, make_variant, real_rows, reference
from zoo.variant import Variant

CASES = [
    ("longformer", {}),  # test_params: window 16, globals [0, 37]
    ("bigbird", {}),
    ("sparse_transformer", {"layout": "strided"}),
    ("sparse_transformer", {"layout": "fixed"}),
    ("xformers", {}),  # test_params: window 16
    ("dilated_prefix", {}),  # the plugin fixture: a pattern and no kernel of its own (test_params: window 5, prefix 3)
]
CASE_IDS = [f"{name}-{'-'.join(map(str, p.values())) or 'default'}" for name, p in CASES]
HEADS, KV_HEADS = 4, 2
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


class BandOnlyPattern(Variant):
    """A plugin that declares only a pattern (its kernel masks dense scores): Flex runs it from the pattern."""

    name = "band_only_pattern"

    def pattern(self, call, q_len, kv_len):
        return Pattern(band(5))

    def attend(self, q, k, v, call):
        allowed = allowed_mask(call, self.pattern(call, q.shape[-2], k.shape[-2]), *q.shape[:2], q.shape[-2],
                               k.shape[-2], q.device)
        return softmax_attention(q, k, v, allowed, call.scaling)


def gqa_inputs(padding="right", n=100):
    q, k, v, mask = make_inputs(n=n, heads=HEADS, padding=padding)
    return q, k[:, :KV_HEADS], v[:, :KV_HEADS], mask


def run(variant, q, k, v, call, backend):
    with torch.no_grad(), backends.attention_backend(backend, compiled=False):
        return run_variant(variant, q, k, v, call)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_flex_equals_chunked_kernel_and_reference(name, params, causal):
    variant = make_variant(name, **params)
    q, k, v, mask = gqa_inputs(padding="left" if causal else "right")
    call = make_call(causal, mask, heads=HEADS)
    out = run(variant, q, k, v, call, "flex")
    torch.testing.assert_close(out, run(variant, q, k, v, call, "chunked"), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, reference(variant, q, *expand_kv(k, v, HEADS), call), atol=1e-5, rtol=1e-4)


def test_flex_follows_per_batch_global_tokens():
    variant = make_variant("longformer", global_tokens=[])
    q, k, v, mask = gqa_inputs()
    global_mask = torch.zeros(2, 100, dtype=torch.long)
    global_mask[0, [3, 50]] = 1
    global_mask[1, 10] = 1
    call = make_call(False, mask, heads=HEADS, extra={"global_attention_mask": global_mask})
    out = run(variant, q, k, v, call, "flex")
    torch.testing.assert_close(out, reference(variant, q, *expand_kv(k, v, HEADS), call), atol=1e-5, rtol=1e-4)
    without = make_call(False, mask, heads=HEADS)
    assert not torch.allclose(out, run(variant, q, k, v, without, "flex"), atol=1e-3)  # the globals mattered


def test_an_unpadded_batch_runs_past_its_length():
    """Batch 2 without a padding mask, n = 100 run at 128 tokens (the CPU bucket): the keys past n are hidden by one
    row of key padding, read by every batch row (indexed per batch row, it read past its end)."""
    variant = make_variant("xformers")
    q, k, v, _ = gqa_inputs(padding=None)
    call = make_call(True, heads=HEADS)
    out = run(variant, q, k, v, call, "flex")
    torch.testing.assert_close(out, reference(variant, q, *expand_kv(k, v, HEADS), call), atol=1e-5, rtol=1e-4)


def test_a_plugin_with_only_a_pattern_runs_on_flex():
    variant = BandOnlyPattern()
    q, k, v, mask = gqa_inputs()
    call = make_call(True, mask, heads=HEADS)
    out = run(variant, q, k, v, call, "flex")
    torch.testing.assert_close(out, reference(variant, q, *expand_kv(k, v, HEADS), call), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_block_mask_holds_exactly_the_blocks_the_pattern_touches(name, params):
    n, heads = 4096, 2
    variant = make_variant(name, **{"window": 512} if name in ("longformer", "xformers") else {}, **params)
    if name == "bigbird":
        variant = make_variant(name, block_size=64)
    call = make_call(False)
    block_mask = flex.block_mask_for(variant.pattern(call, n, n), call, 1, heads, n, "cpu")
    touched = allowed_mask(call, variant.pattern(call, n, n), 1, heads, n, n)
    touched = touched.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)).any(-1).any(-2)  # (1, H, 32, 32)
    nonempty = block_mask.to_dense().bool().expand_as(touched)
    assert torch.equal(nonempty, touched)
    if name != "sparse_transformer":  # its every-l-th / summary columns touch every 128-tile: Flex would be dense
        assert nonempty.float().mean() < 0.35


@pytest.mark.parametrize("n", [256, 300])
def test_a_whole_blocks_pattern_is_constant_on_its_blocks(n):
    variant = make_variant("bigbird", block_size=32)
    call = make_call(False)
    pattern = variant.pattern(call, n, n)
    assert pattern.whole_blocks
    allowed = allowed_mask(call, pattern, 1, 2, n, n)[0]
    table = flex.block_table(pattern, 1, 2, n, "cpu")[0]
    blocks = torch.arange(n) // pattern.block_size
    assert torch.equal(allowed, table[:, blocks][:, :, blocks])


def test_block_mask_build_evaluates_only_the_candidate_tiles(monkeypatch):
    n = 4096
    variant = make_variant("longformer", window=512)  # one global token: its row and column of tiles, and the band
    pattern = variant.pattern(make_call(False), n, n)
    evaluated = []
    counted = Pattern(lambda b, h, q, kv: evaluated.append(torch.broadcast_shapes(q.shape, kv.shape).numel())
                      or pattern(b, h, q, kv), reach=pattern.reach, sinks=pattern.sinks,
                      global_queries=pattern.global_queries)
    flex.build_block_mask(counted, False, None, 1, 2, n, "cpu")
    assert sum(evaluated) < n * n // 4


def test_block_mask_is_built_without_an_n_by_n_tensor(monkeypatch):
    monkeypatch.setattr(limits, "FLEX_EVAL_CHUNK_ELEMENTS", 1 << 20)
    n = 4096
    variant = make_variant("longformer", window=512)
    with LargestAllocation() as probe:
        flex.build_block_mask(variant.pattern(make_call(True), n, n), True, None, 1, 2, n, "cpu")
    assert probe.largest < n * n // 8


def _block_mask(variant, call, n=100):
    return flex.block_mask_for(variant.pattern(call, n, n), call, 1, 2, n, "cpu")


def runs_on_flex(variant, q, k, v, call) -> bool:
    return backends.flex_pattern(variant, q, k, v, call) is not None


def test_layers_with_the_same_pattern_share_one_mask(monkeypatch):
    builds = []
    monkeypatch.setattr(flex, "_masks", type(flex._masks)())
    real_build = flex.build_block_mask
    monkeypatch.setattr(flex, "build_block_mask", lambda *a: builds.append(a) or real_build(*a))
    longformer, bigbird = make_variant("longformer"), make_variant("bigbird")
    for layer in range(3):
        _block_mask(longformer, make_call(False, layer_idx=layer))
    assert len(builds) == 1  # same window and globals in every layer: one mask
    for layer in range(3):
        _block_mask(bigbird, make_call(False, layer_idx=layer))
        _block_mask(bigbird, make_call(False, layer_idx=layer))
    assert len(builds) == 4  # a random layout per layer, each built once


def test_backend_choice_on_cpu(monkeypatch):
    variant = make_variant("longformer")
    q, k, v, _ = gqa_inputs(padding=None)
    call = make_call(False)
    assert not runs_on_flex(variant, q, k, v, call)  # auto: no measured CPU crossover for this variant
    monkeypatch.setitem(backends.CPU_CROSSOVER, "longformer", 64)
    assert runs_on_flex(variant, q, k, v, call)
    assert not runs_on_flex(variant, q[..., :32, :], k[..., :32, :], v[..., :32, :], call)  # below the crossover
    with backends.attention_backend("chunked"):
        assert not runs_on_flex(variant, q, k, v, call)
    grad_q = q.clone().requires_grad_()
    assert not runs_on_flex(variant, grad_q, k, v, call)  # no backward on CPU
    assert not runs_on_flex(variant, q, k, v.clone().requires_grad_(), call)  # e.g. LoRA on the values only
    with backends.attention_backend("flex"), pytest.raises(backends.FlexUnavailableError, match="no backward on CPU"):
        runs_on_flex(variant, grad_q, k, v, call)
    with backends.attention_backend("flex"):  # dense and approximate variants keep their own kernel
        assert not runs_on_flex(make_variant("dense"), q, k, v, call)
        assert not runs_on_flex(make_variant("performer"), q, k, v, call)
    with pytest.raises(ValueError, match="unknown; use one of auto, flex, chunked"):
        with backends.attention_backend("triton"):
            pass


def test_dropout_falls_back_to_the_chunked_kernel_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setitem(backends.CPU_CROSSOVER, "bigbird", 1)
    backends._log_fallback_once.cache_clear()
    variant = make_variant("bigbird")
    q, k, v, _ = gqa_inputs(padding=None)
    call = make_call(False, dropout=0.1, training=True)
    with caplog.at_level(logging.INFO, logger="zoo.plug.backend"):
        for _ in range(2):
            assert not runs_on_flex(variant, q, k, v, call)
    assert [r.getMessage() for r in caplog.records].count(
        "attention-zoo variant 'bigbird' runs its chunked kernel instead of FlexAttention: attention dropout p=0.1 "
        "(FlexAttention has none, pytorch#141784).") == 1


@pytest.mark.slow
def test_compiled_flex_equals_the_chunked_kernel_without_recompiling_within_a_length_bucket():
    from torch._dynamo.utils import counters

    variant = make_variant("longformer", global_tokens=[])  # captures no tensor of n entries (globals would)
    assert flex.bucket_length(200, torch.device("cpu")) == flex.bucket_length(250, torch.device("cpu")) == 256
    for n in (200, 250):
        q, k, v, mask = gqa_inputs(n=n)
        call = make_call(False, mask, heads=HEADS)
        with torch.no_grad(), backends.attention_backend("flex"):
            out = run_variant(variant, q, k, v, call)
        if n == 200:
            graphs = counters["stats"]["unique_graphs"]
        torch.testing.assert_close(out, run(variant, q, k, v, call, "chunked"), atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # the second length reused the bucket's compilation


@pytest.mark.slow
def test_compiled_flex_follows_global_tokens_under_left_padding_and_per_row_marks():
    """Global tokens run inside the compiled kernel: offsets counted from each row's first real token (left padding)
    and a per-row ``global_attention_mask``; their predicate must trace (no tensor made inside the kernel)."""
    q, k, v, mask = gqa_inputs(padding="left", n=200)
    variant = make_variant("longformer", global_tokens=[0, 3])
    marks = torch.zeros(2, 200, dtype=torch.long)
    marks[0, 150] = marks[1, 120] = 1
    for call in (make_call(True, mask, heads=HEADS),
                 make_call(False, mask, heads=HEADS, extra={"global_attention_mask": marks})):
        with torch.no_grad(), backends.attention_backend("flex"):
            out = run_variant(variant, q, k, v, call)
        want = reference(variant, q, *expand_kv(k, v, HEADS), call)
        torch.testing.assert_close(real_rows(out, mask), real_rows(want, mask), atol=1e-5, rtol=1e-4)


def _largest_cpu_allocation(fn) -> int:
    """Bytes of the largest CPU allocation while ``fn`` runs (torch's profiler: it sees compiled kernels too, which
    a TorchDispatchMode such as zoo.testing.LargestAllocation would stop from compiling)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0] or [0])


@pytest.mark.slow
def test_past_the_recompile_limit_flex_falls_back_to_the_chunked_kernel_never_to_eager_scores(monkeypatch, caplog):
    """More distinct patterns than dynamo's recompile limit (lowered to 2 here; 8 by default): compiled Flex would run
    eagerly from the third on and build every (B·H, n, n) score. Under "auto" the chunked kernel runs them (one log
    line naming why), under a forced "flex" the call raises (issue 29, item 3)."""
    n, heads = 1024, 2
    scores = heads * n * n * 4  # bytes of the n x n fp32 scores of every head
    monkeypatch.setitem(backends.CPU_CROSSOVER, "longformer", 1)
    q, k, v, _ = make_inputs(n=n, padding=None, batch=1, heads=heads)
    backends._log_fallback_once.cache_clear()
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.INFO, logger=backends.__name__):
            for window in (8, 16, 24, 32):
                variant = make_variant("longformer", window=window, global_tokens=[])
                call = make_call(True)
                out = []

                def forward(variant=variant, call=call, out=out):
                    with torch.no_grad(), backends.attention_backend("auto"):
                        out.append(run_variant(variant, q, k, v, call))

                assert _largest_cpu_allocation(forward) < scores / 2, window  # compiling allocates up to ~3/8
                torch.testing.assert_close(out[0], reference(variant, q, k, v, call), atol=1e-5, rtol=1e-4)
            with pytest.raises(backends.FlexUnavailableError, match="recompile_limit"):
                with torch.no_grad(), backends.attention_backend("flex"):
                    run_variant(make_variant("longformer", window=40, global_tokens=[]), q, k, v, make_call(True))
    finally:
        torch._dynamo.reset()
    ours = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    fallbacks = [message for message in ours if "recompile" in message]
    assert len(fallbacks) == 1, fallbacks


# ---------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): forward and backward through Flex against the chunked kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention's backward runs only there)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_cuda_flex_forward_and_backward_equal_the_chunked_kernel(name, params, dtype):
    variant = make_variant(name, **params)
    q, k, v, mask = (x.cuda() for x in gqa_inputs(n=300))
    call = make_call(True, mask, heads=HEADS)
    results = []
    for choice in ("flex", "chunked"):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        # every case compiles its own graph in this one process: dynamo's default limit (8) stops the 9th (H200 run)
        with backends.attention_backend(choice), torch._dynamo.config.patch(recompile_limit=64):
            out = run_variant(variant, *leaves, call)
        out.float().square().sum().backward()
        results.append([out.float()] + [x.grad.float() for x in leaves])
    for got, want in zip(*results, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:  # two kernels round bf16 differently: a few elements 1 ulp apart (0.25 at 32-64, H200 run); a wrong
            # pattern moves the whole tensor (relative RMS of order 1)
            error = (got - want).square().mean().sqrt() / want.square().mean().sqrt()
            assert error < 2e-2, f"relative RMS error {error:.3g}"
