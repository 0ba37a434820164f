"""zoo.testing, the helpers behind the contract suite: the memory check flags a variant that masks dense scores
and calls itself sparse, the complexity parser, the reference, and the reload check."""

from __future__ import annotations

import pytest
import torch
import transformers

import zoo
from zoo.ops import allowed_mask, softmax_attention
from zoo.pattern import Pattern
from zoo.plug.dispatch import run_variant
from zoo.testing import (
    LargestAllocation,
    assert_matches_reference,
    assert_memory_below_quadratic,
    assert_reloads_identically,
    contract,
    declares_subquadratic_memory,
    make_call,
    make_inputs,
    model_inputs,
    real_rows,
    reference,
    tiny_model_config,
)
from zoo.variant import Param, Variant


class MaskedDenseWindow(Variant):
    """A toy: the right outputs of a sliding window, computed by masking n x n dense scores."""

    name = "masked_dense_window"
    exact = True
    time_complexity = "O(n·w)"
    memory_complexity = "O(n)"
    params = {"width": Param(8, int, "|i − j| < width", min=1)}

    def pattern(self, call, q_len, kv_len):
        width = self.width
        return Pattern(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < width)

    def attend(self, q, k, v, call):
        allowed = allowed_mask(call, self.pattern(call, q.shape[-2], k.shape[-2]), *q.shape[:2], q.shape[-2],
                               k.shape[-2], q.device)
        return softmax_attention(q, k, v, allowed, call.scaling)


@pytest.fixture
def registered_toy():
    zoo.register_variant(MaskedDenseWindow)
    yield MaskedDenseWindow.name
    zoo.unregister_variant(MaskedDenseWindow.name)


def test_a_variant_masking_dense_scores_fails_the_memory_check(registered_toy):
    # it is exact, so the output checks cannot tell ...
    contract.test_matches_reference_restricted_to_its_pattern(registered_toy)
    # ... but the declared memory check does, naming the declaration and the allocation
    with pytest.raises(AssertionError, match=r"declares memory O\(n\) but allocated a tensor of 16777216 elements"):
        contract.test_declared_subquadratic_memory_allocates_no_quadratic_tensor(registered_toy)


def test_the_memory_check_passes_a_blocked_kernel_and_skips_declared_quadratic_ones():
    assert_memory_below_quadratic(zoo.get_variant_class("xformers")(window=64))
    assert not declares_subquadratic_memory(zoo.get_variant_class("dense"))


@pytest.mark.parametrize(
    ("declared", "subquadratic"),
    [("O(n)", True), ("O(n·d) on CPU, else O(n·w)", True), ("O(n·(l + n/l))", True), ("O(n·c)", True),
     ("O(n²)", False), ("O(n^2)", False), ("O(n**2)", False), ("O(n·n)", False), ("O(n x n)", False),
     ("O(n) forward, O(n²) backward", False)],
)
def test_declared_memory_is_read_from_the_complexity_string(declared, subquadratic):
    toy = type("Toy", (Variant,), {"name": "toy", "memory_complexity": declared})
    assert declares_subquadratic_memory(toy) is subquadratic


def test_largest_allocation_sees_an_n_by_n_tensor():
    with LargestAllocation() as probe:
        torch.ones(300, 200) @ torch.ones(200, 300)
    assert probe.largest == 300 * 300


def test_reference_is_softmax_restricted_to_the_pattern_with_padded_rows_zero():
    variant = MaskedDenseWindow(width=3)
    q, k, v, mask = make_inputs(n=20, padding="left")
    call = make_call(True, mask)
    ref = reference(variant, q, k, v, call)
    assert (ref[1, :, :1] == 0).all()  # the padded row: REAL_LENGTH capped at n - 1 real tokens, on the left
    scores = (q @ k.transpose(-1, -2)) * call.scaling
    i = torch.arange(20)
    banned = ((i[:, None] - i[None, :]).abs() >= 3) | (i[None, :] > i[:, None]) | ~mask[:, None, None, :]
    want = torch.softmax(scores.masked_fill(banned, float("-inf")), -1).nan_to_num() @ v
    assert_matches_reference(variant, real_rows(ref, mask), real_rows(want, mask))
    assert_matches_reference(variant, real_rows(run_variant(variant, q, k, v, call), mask), real_rows(ref, mask))


def test_reload_check_catches_a_model_that_reloads_differently(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_model_config("bert", "sdpa"))
    ids, mask = model_inputs()
    inputs = {"input_ids": ids, "attention_mask": mask}
    reloaded = assert_reloads_identically(model, inputs, tmp_path)
    assert (tmp_path / "config.json").exists() and zoo.variant_spec(reloaded.config)["variant"] == "sdpa"
    original = transformers.BertModel.from_pretrained

    def drifted(*args, **kwargs):
        out = original(*args, **kwargs)
        out.config.attention_zoo["params"] = {"changed": 1}
        return out

    monkeypatch.setattr(transformers.BertModel, "from_pretrained", drifted)
    with pytest.raises(AssertionError, match="differs from the saved"):
        assert_reloads_identically(model, inputs)


def test_the_test_kit_keeps_every_name_importable_from_zoo_testing():
    """The kit's code lives in modules under zoo/testing/; the package re-exports each of their public names (plugin
    API: ``from zoo.testing import X``), and its __init__ holds no code of its own."""
    import ast
    import importlib
    from pathlib import Path

    import zoo.testing

    init = Path(zoo.testing.__file__)
    assert not [node for node in ast.parse(init.read_text()).body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
    for module in ("inputs", "comparison", "memory", "persistence", "decoding"):
        kit = importlib.import_module(f"zoo.testing.{module}")
        tree = ast.parse(Path(kit.__file__).read_text())
        public = [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
        public += [target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                   if isinstance(target, ast.Name)]
        assert public, module
        for name in public:
            assert getattr(zoo.testing, name) is getattr(kit, name), f"zoo.testing.{name} (from {module})"
    assert all(hasattr(zoo.testing, name) for name in zoo.testing.__all__)
