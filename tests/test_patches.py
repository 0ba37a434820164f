"""The transformers patches (zoo/_patches.py): canary for their shape, and models without the zoo untouched."""

import inspect
import logging

import pytest
import transformers
from transformers import BertConfig, PretrainedConfig, PreTrainedModel

import zoo
from zoo import _patches


def test_canary_patched_symbols_keep_the_shape_the_patches_rely_on():
    problems = _patches.check_patch_targets()
    assert not problems, "\n".join(problems)


def test_every_patch_is_installed_as_a_wrapper_of_the_original():
    for patch in _patches.PATCHES:
        current = patch.owner.__dict__[patch.name]
        original = getattr(current, _patches.ORIGINAL)
        assert current is not original and current.__wrapped__ is original, patch.qualname
        assert inspect.signature(current) == inspect.signature(original), patch.qualname


def test_a_changed_signature_is_reported_with_the_transformers_version_and_left_unpatched(monkeypatch, caplog):
    class Owner:
        def to_dict(self, flatten):  # a parameter the patch does not expect
            return {"flatten": flatten}

    patch = _patches.Patch(Owner, "to_dict", ("self", "requested_attention"))
    monkeypatch.setattr(_patches, "PATCHES", (patch,))
    (message,) = _patches.check_patch_targets()
    assert transformers.__version__ in message and "Owner.to_dict" in message and "zoo/_patches.py" in message
    with caplog.at_level(logging.WARNING, logger="zoo._patches"):
        _patches._wrap(patch, lambda original: lambda self, *a, **k: "patched")
    assert Owner().to_dict(True) == {"flatten": True}
    assert "unpatched" in caplog.text


def test_configs_without_the_zoo_serialize_exactly_as_transformers_does():
    config = BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64)
    config._attn_implementation = "sdpa"
    assert config.to_dict() == _patches.TO_DICT.original()(config)
    zoo.configure(config, "sdpa")
    assert config.to_dict()["attn_implementation"] == zoo.IMPLEMENTATION


@pytest.mark.parametrize("requested", ["sdpa", "eager", None])
def test_models_without_the_zoo_resolve_their_attention_exactly_as_transformers_does(requested):
    config = BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64)
    model = transformers.BertModel(config)
    original = _patches.RESOLVE_IMPLEMENTATION.original()
    assert model.get_correct_attn_implementation(requested) == original(model, requested)


def test_the_wrappers_pass_new_keywords_through(monkeypatch):
    """A keyword transformers adds later reaches the original untouched; the zoo hook still sees the request."""
    seen = {}

    def original(self, requested_attention, is_init_check=False, new_flag=None):
        seen.update(requested=requested_attention, new_flag=new_flag)
        return "sdpa"

    monkeypatch.setattr(PretrainedConfig, "to_dict", PretrainedConfig.__dict__["to_dict"])  # restored after
    monkeypatch.setattr(PreTrainedModel, "get_correct_attn_implementation", original)
    prepare_cache = _patches.PREPARE_CACHE
    monkeypatch.setattr(prepare_cache.owner, prepare_cache.name, prepare_cache.owner.__dict__[prepare_cache.name])
    _patches.apply(saved_implementation=lambda config: None, check_model=lambda m, r: seen.update(checked=r),
                   prepare_generation_cache=lambda model, arguments, run_original: run_original())
    model = transformers.BertModel(BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1))
    seen.clear()
    assert model.get_correct_attn_implementation("eager", new_flag=3) == "sdpa"
    assert seen == {"requested": "eager", "new_flag": 3, "checked": "eager"}
