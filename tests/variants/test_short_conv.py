"""The short causal convolution (zoo.ops.causal_conv, zoo.modules.ShortConv) on every recurrent-state variant: it is
the written-out depthwise sum, continues across calls from the kept inputs, ignores left padding; ``linear`` and
``performer`` keep their behaviour at the default 0 and gain learned weights that train, reload and decode with it on;
every recurrent variant decodes like the full forward with and without it, alone and in a ``hybrid`` with a window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from zoo import testing
from zoo.modules import ShortConv
from zoo.ops.causal_conv import causal_conv
from zoo.testing import run_variant

RECURRENT = ["deltanet", "gated_deltanet", "gla", "based", "linear", "performer"]


@pytest.mark.parametrize("n", [11, 2])  # 2: fewer tokens than the taps before the current one
def test_is_the_depthwise_causal_sum_then_silu(n):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 1, 4, generator=gen, dtype=torch.float64)
    out, last = causal_conv(x, weight)
    taps = weight.view(3, 4, 4)  # (head, channel, tap); tap K-1 is the current token
    want = torch.zeros_like(x)
    for t in range(n):
        for j in range(4):
            if t - j >= 0:
                want[:, :, t] += taps[None, :, :, 3 - j] * x[:, :, t - j]
    torch.testing.assert_close(out, F.silu(want))
    kept = F.pad(x, (0, 0, 3, 0))[:, :, -3:]  # the last 3 inputs, zeros before the first
    torch.testing.assert_close(last, kept.transpose(-1, -2).reshape(2, 12, 3))


def test_continues_across_calls_and_ignores_left_padding():
    conv = ShortConv(heads=2, head_dim=3, kernel_size=4).double()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 13, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    whole = conv(q, k, v)
    state: dict = {}
    pieces = [conv(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state=state) for a, b in ((0, 5), (5, 6), (6, 13))]
    for i in range(3):
        torch.testing.assert_close(torch.cat([p[i] for p in pieces], dim=2), whole[i])
    noise = torch.randn(1, 2, 6, 3, generator=gen, dtype=torch.float64) * 100
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.bool), torch.ones(1, 13, dtype=torch.bool)], dim=-1)
    padded = conv(*(torch.cat([noise, x], dim=2) for x in (q, k, v)), padding_mask=mask)
    for i in range(3):
        torch.testing.assert_close(padded[i][:, :, 6:], whole[i])


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_off_by_default_on_the_2020_variants(name):
    variant = testing.make_variant(name)
    assert variant.short_conv == 0 and not testing.declares_weights(variant)  # performer: a counter, no parameters
    on = testing.make_variant(name, short_conv=4)
    q, k, v, mask = testing.make_inputs(padding="left")
    call = testing.make_call(True, mask, variant=on)
    conv = call.weights if isinstance(call.weights, ShortConv) else call.weights.conv  # performer: in its counter
    assert isinstance(conv, ShortConv)
    out = run_variant(on, q, k, v, call)
    convolved = conv(q, k, v, mask)  # the variant without the convolution, on its outputs
    want = testing.reference(variant, *convolved, testing.make_call(True, mask))
    testing.assert_matches_reference(on, testing.real_rows(out, mask), testing.real_rows(want, mask))
    assert not torch.allclose(out, run_variant(variant, q, k, v, testing.make_call(True, mask)))


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_conv_weights_train_and_reload_on_the_2020_variants(name):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(testing.tiny_model_config("llama", name, short_conv=4))
    ids, mask = testing.model_inputs()
    testing.assert_weights_train_and_reload(model, {"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("name", RECURRENT)
@pytest.mark.parametrize("short_conv", [0, 4])
def test_decodes_like_the_full_forward(name, short_conv):
    testing.assert_decodes_like_the_full_forward(name, short_conv=short_conv)


@pytest.mark.parametrize("recurrent", ["deltanet", "gla", "based"])
def test_hybrid_of_a_recurrent_layer_and_a_window_decodes_like_the_full_forward(recurrent):
    layers = [{"variant": recurrent, "params": {"chunk_size": 8}},
              {"variant": "longformer", "params": {"window": 16}}]
    testing.assert_decodes_like_the_full_forward("hybrid", layers=layers)
    testing.assert_cache_bytes_bounded("hybrid", layers=layers)


def test_hand_written_backward_passes_gradcheck():
    """The shifted multiply-adds' hand-written backward (input, the inputs kept from before, weights): fp64 finite
    differences."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    previous = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: causal_conv(x, w)[0], (x, weight))
    assert torch.autograd.gradcheck(lambda x, w, p: causal_conv(x, w, previous=p), (x, weight, previous))
    short = x[:, :, :2].detach().requires_grad_()  # fewer tokens than taps
    assert torch.autograd.gradcheck(lambda x, w: causal_conv(x, w)[0], (short, weight))
