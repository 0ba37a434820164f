"""``performer`` (FAVOR+): the random projection (orthogonal, deterministic in (seed, layer, draw)), redraws that
follow training calls and survive save/reload, the error against softmax shrinking with the number of features,
stable fp32 features, and a kernel that is exact given its features."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.profiler import profile
from zoo.variants.performer import PerformerAttention

import zoo
from zoo.ops import allowed_mask, linear_attention_reference, softmax_attention
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_reloads_identically
from zoo.variant import AttentionCall

HEAD_DIM = 16  # the contract suite's inputs: q/k/v ~ N(0, 1), head_dim 16, softmax scaling 1/4


def qkv(n: int, seed: int = 0, batch: int = 2, heads: int = 2, head_dim: int = HEAD_DIM, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3)]


def call(causal: bool, mask=None, scaling: float = HEAD_DIM**-0.5, **kwargs) -> AttentionCall:
    return AttentionCall(causal=causal, scaling=scaling, padding_mask=mask, **kwargs)


def padding(n: int, real: int) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, real:] = False
    return mask


def softmax_error(variant: PerformerAttention, n: int, seed: int, causal: bool, padded: bool) -> float:
    """Relative Frobenius error vs softmax attention on the real rows."""
    q, k, v = qkv(n, seed)
    mask = padding(n, n * 2 // 3) if padded else None
    c = call(causal, mask)
    out = run_variant(variant, q, k, v, c)
    ref = softmax_attention(q, k, v, allowed_mask(c, None, 2, 2, n, n), c.scaling)
    if mask is not None:
        ref = ref.masked_fill(~mask[:, None, :, None], 0.0)
    return float((out - ref).norm() / ref.norm())


# -- the projection ---------------------------------------------------------------------------------------------


def test_projection_is_orthogonal_blocks_with_rows_of_norm_sqrt_d():
    w = PerformerAttention(nb_features=40).draw_projection(layer=0, draw=0, head_dim=16)
    assert w.shape == (40, 16)
    for block in (w[:16], w[16:32], w[32:]):
        torch.testing.assert_close(block @ block.T, 16 * torch.eye(len(block), dtype=w.dtype))
    assert not torch.allclose(w[:16], w[16:32])  # independent blocks


def test_projection_is_a_function_of_seed_layer_and_draw():
    def draw(seed=0, layer=0, index=0):
        return PerformerAttention(seed=seed).draw_projection(layer, index, 16)

    assert torch.equal(draw(), draw())  # a fresh instance rebuilds it: nothing but (seed, layer, draw) matters
    for other in (draw(seed=1), draw(layer=1), draw(index=1)):
        assert not torch.allclose(other, draw())


def test_projection_cache_keeps_one_draw_per_layer():
    variant = PerformerAttention()
    for index in range(3):
        variant.projection(0, index, 16, torch.device("cpu"), torch.float32)
    variant.projection(1, 0, 16, torch.device("cpu"), torch.float32)
    assert sorted((key[0], key[1]) for key in variant._projections) == [(0, 2), (1, 0)]


# -- accuracy ---------------------------------------------------------------------------------------------------


def test_error_against_softmax_shrinks_as_features_grow():
    means = []
    for m in (16, 64, 256, 1024):
        errors = [softmax_error(PerformerAttention(nb_features=m, seed=s), 100, s, c, True)
                  for s in range(5) for c in (False, True)]
        means.append(sum(errors) / len(errors))
    assert all(a > b for a, b in zip(means, means[1:], strict=False)), means
    assert means[-1] < 0.6 * means[0], means


def test_error_bound_holds_at_the_defaults():
    errors = [softmax_error(PerformerAttention(seed=s), n, s, c, p)
              for s in range(8) for n in (64, 200) for c in (False, True) for p in (False, True)]
    assert max(errors) <= PerformerAttention.error_bound, max(errors)


def test_the_softmax_scaling_is_the_kernels_temperature():
    q, k, v = qkv(100)
    out = PerformerAttention().attend(q, k, v, call(False, scaling=0.05))

    def error(scaling):
        ref = softmax_attention(q, k, v, None, scaling)
        return float((out - ref).norm() / ref.norm())

    assert error(0.05) < 0.15 and error(HEAD_DIM**-0.5) > 0.5


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_is_exact_given_its_features(feature_map, causal):
    """All the approximation is in the random features: the linear-attention part equals its O(n²) form."""
    variant = PerformerAttention(nb_features=32, feature_map=feature_map)
    q, k, v = qkv(77, dtype=torch.float64)
    mask = padding(77, 50)
    c = call(causal, mask)
    w = variant.projection(0, 0, HEAD_DIM, q.device, torch.float64) * c.scaling**0.5
    features = variant.query_features(q, w), variant.key_features(k, w, c.scaling, mask)
    want = linear_attention_reference(*features, v, allowed_mask(c, None, 2, 2, 77, 77))
    got = run_variant(variant, q, k, v, c)
    torch.testing.assert_close(got, want.masked_fill(~mask[:, None, :, None], 0.0))


# -- numerics ---------------------------------------------------------------------------------------------------


def test_features_are_fp32_under_low_precision_and_autocast():
    variant = PerformerAttention()
    q, k, v = qkv(100)
    q, k = q * 4, k * 4  # exponents far beyond fp16's exp range (≈ 11)
    for causal in (False, True):
        full = run_variant(variant, q, k, v, call(causal))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(run_variant(variant, q, k, v, call(causal)), full)
        half = run_variant(variant, *(x.half() for x in (q, k, v)), call(causal))
        assert half.dtype == torch.float16 and torch.isfinite(half).all()
        assert float((half.float() - full).norm() / full.norm()) < 0.02


def test_huge_keys_and_fully_padded_rows_stay_finite():
    q, k, v = qkv(60)
    k[0, 0, 5] = 300.0  # one key far out: the shared shift keeps every feature ≤ 1
    mask = torch.ones(2, 60, dtype=torch.bool)
    mask[1] = False
    for causal in (False, True):
        out = PerformerAttention().attend(q, k, v, call(causal, mask))
        assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_no_allocation_larger_than_the_n_by_m_features_at_4096():
    n, m = 4096, 256
    q, k, v = (x.requires_grad_() for x in qkv(n, batch=1, heads=1, head_dim=64))
    for causal in (False, True):
        with profile(profile_memory=True) as prof:
            PerformerAttention(nb_features=m).attend(q, k, v, call(causal, scaling=0.125)).sum().backward()
        largest = max(event.self_cpu_memory_usage for event in prof.events())  # bytes, per op
        assert 0 < largest <= n * m * 4, f"an op allocated {largest} bytes (n x m fp32 = {n * m * 4}, n x n x 16)"


# -- redraws and persistence ------------------------------------------------------------------------------------


def test_redraws_follow_training_calls_and_eval_uses_the_last_draw():
    variant = PerformerAttention(redraw_interval=3)
    state: dict = {}
    draws = [variant.draw_index(call(False, training=True, state=state, layer_idx=2)) for _ in range(7)]
    assert draws == [0, 0, 0, 1, 1, 1, 2]
    assert state == {"training_calls": {"2": 7}}
    assert [variant.draw_index(call(False, state=state, layer_idx=2)) for _ in range(3)] == [2, 2, 2]
    assert variant.draw_index(call(False, state=state, layer_idx=0)) == 0  # layers count separately
    never = PerformerAttention(redraw_interval=0)
    assert {never.draw_index(call(False, training=True, state=state)) for _ in range(5)} == {0}


def tiny_performer_bert() -> transformers.PreTrainedModel:
    """A 2-layer BERT with performer redrawing every 2 training calls (32 features)."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(zoo.configure(config, "performer", redraw_interval=2, nb_features=32))


def test_bert_reloads_with_the_same_features_after_training(tmp_path):
    model = tiny_performer_bert()
    ids = torch.randint(0, 64, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(5):
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    reloaded = assert_reloads_identically(model, {"input_ids": ids, "attention_mask": mask}, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attention_zoo"]["state"]
    assert saved == {"training_calls": {"0": 5, "1": 5}}  # eval uses draw (5 - 1) // 2 = 2, not the first one
    assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, out)
    counters = {k: v for k, v in reloaded.state_dict().items() if k.endswith("attention_zoo.training_calls")}
    assert sorted(int(v) for v in counters.values()) == [5, 5]  # the buffers, saved with the weights
    reloaded.config.attention_zoo["state"].clear()  # the buffers win over the config's copy
    assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, out)
    for module in reloaded.modules():  # forgetting the counters changes the features
        if hasattr(module, "training_calls"):
            module.load_state_dict({"training_calls": torch.tensor(0)})
    assert not torch.allclose(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, out)


def test_a_checkpoint_saved_before_the_counter_buffer_reads_the_configs_copy(tmp_path):
    """Older checkpoints have the counters only in config.json: the missing buffers start from them."""
    from safetensors.torch import load_file, save_file

    model = tiny_performer_bert()
    ids = torch.randint(0, 64, (2, 40))
    model.train()
    for _ in range(5):
        model(input_ids=ids)
    model.eval()
    out = model(input_ids=ids).last_hidden_state
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "training_calls" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    reloaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded(input_ids=ids).last_hidden_state, out)
