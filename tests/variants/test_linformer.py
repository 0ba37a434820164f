"""``linformer``: softmax attention exactly when the projections are the identity (padding included), padded tokens
that never reach real outputs, the three sharings' weight shapes and init, the error beyond max_length, learned
projections training inside BERT, no n x n tensor, and the benchmark layer building the projections."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from zoo.variants.linformer import LengthProjections, LinformerAttention

import zoo
from zoo import testing
from zoo.bench.contestants import QKVProjections, ZooContestant
from zoo.plug.dispatch import run_variant
from zoo.testing import make_call, make_inputs, real_rows, reference
from zoo.variant import VariantParameterError


def identity_projections(variant: LinformerAttention, n: int, heads: int = testing.HEADS) -> LengthProjections:
    """E = F = identity on the first n positions (k >= n rows, the rest zero)."""
    weights = testing.make_weights(variant, heads=heads)
    with torch.no_grad():
        for matrix in (weights.key_projection, weights.value_projection):
            if matrix is not None:
                matrix.zero_()
                matrix[:, :n, :n] = torch.eye(n)
    return weights


@pytest.mark.parametrize("sharing", ["headwise", "key_value", "none"])
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_identity_projections_give_softmax_attention_exactly(sharing, padding):
    variant = LinformerAttention(k=128, sharing=sharing)  # k >= n = 100
    q, k, v, mask = make_inputs(0, padding=padding)
    call = make_call(False, mask, weights=identity_projections(variant, testing.N))
    out = run_variant(variant, q, k, v, call)
    expected = reference(variant, q, k, v, call)
    torch.testing.assert_close(real_rows(out, mask), real_rows(expected, mask), atol=1e-5, rtol=1e-4)


def test_identity_projections_with_dropout_drop_probabilities():
    """Dropout acts on the (n x k) probabilities: with identity projections it equals dropout on softmax's."""
    variant = LinformerAttention(k=100)
    q, k, v, mask = make_inputs(1)
    call = make_call(False, mask, weights=identity_projections(variant, testing.N), dropout=0.3, training=True)
    torch.manual_seed(3)
    out = run_variant(variant, q, k, v, call)
    torch.manual_seed(3)
    scores = (q @ k.transpose(-1, -2) * call.scaling).masked_fill(~mask[:, None, None, :], torch.finfo(q.dtype).min)
    expected = torch.nn.functional.dropout(scores.softmax(-1), 0.3) @ v
    torch.testing.assert_close(real_rows(out, mask), real_rows(expected, mask), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("sharing", ["headwise", "none"])
def test_padded_tokens_never_reach_real_outputs(sharing):
    """Random projections: real outputs do not change whatever the padded keys and values hold, and a batch row
    padded to length m equals the same row run alone at length m (right padding: the same columns of E, F)."""
    variant = LinformerAttention(k=16, sharing=sharing)
    q, k, v, mask = make_inputs(2)
    out = run_variant(variant, q, k, v, make_call(False, mask, variant=variant))
    pad = ~mask[:, None, :, None]
    noisy = [x + 1000 * torch.randn_like(x) * pad for x in (k, v)]
    out_noisy = run_variant(variant, q, *noisy, make_call(False, mask, variant=variant))
    torch.testing.assert_close(out_noisy, out, atol=1e-5, rtol=1e-4)
    real = testing.REAL_LENGTH
    alone = run_variant(variant, *(x[-1:, :, :real] for x in (q, k, v)), make_call(False, variant=variant))
    torch.testing.assert_close(out[-1:, :, :real], alone, atol=1e-5, rtol=1e-4)


def test_weights_follow_sharing_and_the_reference_init():
    shapes = {}
    for sharing in ("headwise", "key_value", "none"):
        weights = testing.make_weights(LinformerAttention(k=32, sharing=sharing), heads=4, max_positions=512)
        shapes[sharing] = {name: tuple(p.shape) for name, p in weights.named_parameters()}
        bound = math.sqrt(3 / (32 + 512))  # xavier_uniform, gain 1/sqrt(2), on (k, max_length)
        for p in weights.parameters():
            assert p.abs().max() <= bound and p.abs().max() > 0.95 * bound
            assert p.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert shapes == {
        "headwise": {"key_projection": (1, 32, 512), "value_projection": (1, 32, 512)},
        "key_value": {"key_projection": (1, 32, 512)},
        "none": {"key_projection": (4, 32, 512), "value_projection": (4, 32, 512)},
    }
    first, again = (testing.make_weights(LinformerAttention(), layer_idx=1) for _ in range(2))
    assert torch.equal(first.key_projection, again.key_projection)  # seeded per layer
    assert not torch.equal(first.key_projection, testing.make_weights(LinformerAttention()).key_projection)
    assert not torch.equal(first.key_projection, first.value_projection)


def test_longer_than_max_length_is_a_clear_error():
    variant = LinformerAttention(k=16)
    q, k, v, _ = make_inputs(n=80, padding=None)
    call = make_call(False, weights=testing.make_weights(variant, max_positions=64))
    fix = r"80 tokens .* max_length = 64\. Truncate inputs to 64 tokens, or .*max_length=N"
    with pytest.raises(ValueError, match=fix):
        run_variant(variant, q, k, v, call)


def test_max_length_defaults_to_max_position_embeddings_and_can_be_set():
    def projection_length(**params) -> int:
        config = testing.tiny_model_config("modernbert", "linformer", **params)  # RoPE: 8192 positions
        model = transformers.AutoModel.from_config(config)
        return {p.shape[-1] for name, p in model.named_parameters() if "attention_zoo" in name}.pop()

    assert projection_length() == 8192
    assert projection_length(max_length=1024) == 1024
    config = transformers.PretrainedConfig(hidden_size=32, num_attention_heads=2)
    with pytest.raises(VariantParameterError, match="no max_position_embeddings .* max_length="):
        LinformerAttention().make_module(0, config, 16, 2)


def test_causal_is_refused():
    variant = LinformerAttention(k=16)
    q, k, v, _ = make_inputs(padding=None)
    with pytest.raises(ValueError, match="does not support causal"):
        run_variant(variant, q, k, v, make_call(True, variant=variant))


@pytest.mark.parametrize("sharing", ["key_value", "none"])
def test_projections_train_and_reload_inside_bert(sharing):
    """The contract checks the default sharing; here the other two (one tensor, per-head tensors)."""
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(testing.tiny_model_config("bert", "linformer", sharing=sharing))
    ids, mask = testing.model_inputs()
    testing.assert_weights_train_and_reload(model, {"input_ids": ids, "attention_mask": mask})


def test_memory_stays_below_quadratic_with_per_head_projections():
    testing.assert_memory_below_quadratic(LinformerAttention(sharing="none"), heads=2)


def test_bench_layer_builds_and_trains_the_projections():
    contestant = ZooContestant(LinformerAttention, {"k": 16})
    layer = contestant.build(QKVProjections(32, 2), n=300, causal=False)
    weights = {name: p for name, p in layer.named_parameters() if name.startswith("attention_zoo.")}
    assert {name: p.shape[-1] for name, p in weights.items()} == {
        "attention_zoo.key_projection": 300, "attention_zoo.value_projection": 300,  # max_length = the bench's n
    }
    layer(torch.randn(1, 300, 32)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weights.values())
    sdpa_layer = ZooContestant(zoo.get_variant_class("sdpa"), {}).build(QKVProjections(32, 2), 300, causal=False)
    assert "attention_zoo" not in dict(sdpa_layer.named_children())  # a stateless kernel gets none


def test_listed_and_in_the_listops_comparisons():
    assert "linformer" in zoo.list_variants()
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2] / "recipes" / "configs"
    compare = yaml.safe_load((root / "compare_smoke.yaml").read_text())  # the ListOps comparison (not the main job's)
    assert compare["tasks"][0]["name"] == "listops"
    assert any(entry["variant"] == "linformer" for entry in compare["variants"])
