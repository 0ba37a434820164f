"""The supported transformers range (zoo/compat.py) and the behaviours that went wrong silently on older releases:
each test here would fail if one of them came back (scripts/compat_check.sh runs this file on every release)."""

import importlib.metadata
import json
import subprocess
import sys
import types
import warnings

import pytest
import torch
import transformers
from packaging.requirements import Requirement

import zoo
import zoo.plug.install
from zoo import compat
from zoo.cache import ZooCache
from zoo.plug import _patches

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             num_key_value_heads=2)


def test_an_older_transformers_is_refused_with_the_version_the_range_and_the_fix():
    with pytest.raises(compat.UnsupportedTransformersError) as caught:
        compat.check_transformers("5.23.0")
    message = str(caught.value)
    assert "5.23.0" in message and f">={compat.FLOOR}" in message
    assert f'pip install "transformers>={compat.FLOOR}"' in message


def test_a_newer_transformers_imports_with_one_warning_naming_both_versions():
    with pytest.warns(compat.UntestedTransformersWarning) as caught:
        compat.check_transformers("5.99.1")
    assert len(caught) == 1
    assert "5.99.1" in str(caught[0].message) and compat.NEWEST_TESTED in str(caught[0].message)


@pytest.mark.parametrize("version", [f"{compat.FLOOR}.0", f"{compat.NEWEST_TESTED}.0", f"{compat.NEWEST_TESTED}.3"])
def test_the_tested_releases_import_without_a_word(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_transformers(version)


def test_pyproject_declares_the_range_zoo_compat_checks():
    requirements = [Requirement(r) for r in importlib.metadata.requires("attention-zoo")]
    spec = next(r.specifier for r in requirements if r.name == "transformers")
    assert f"{compat.FLOOR}.0" in spec and f"{compat.NEWEST_TESTED}.9" in spec
    assert compat.BELOW_FLOOR_CHECKED not in spec and f"{compat._next_minor(compat.NEWEST_TESTED)}.0" not in spec


def test_import_zoo_refuses_an_older_transformers_before_importing_anything_else():
    """In a fresh interpreter whose transformers reports 5.3.0: `import zoo` raises, no zoo module ran."""
    code = (
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "m.version = lambda name: '5.3.0' if name == 'transformers' else real(name)\n"
        "try:\n"
        "    import zoo\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
        "    print(sorted(n for n in sys.modules if n.startswith('zoo.') and n != 'zoo.compat'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    first, loaded = result.stdout.strip().splitlines()
    assert first.startswith("UnsupportedTransformersError") and "5.3.0" in first
    assert loaded == "[]"


# ---------------------------------------------------------------------------------------------------
# the silent rows of issue 37's table, on the release installed


def _llama(variant: str, **params):
    config = zoo.configure(transformers.LlamaConfig(**SMALL), variant, **params)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("variant", "params"), [("sdpa", {}), ("longformer", {"window": 4}), ("deltanet", {})])
def test_a_zoo_cache_passed_as_cache_is_used_by_every_layer(variant, params):
    """The README's own loop: `model(ids, cache=cache, use_cache=True)` token by token gives the logits of one
    forward over the whole sequence (before 5.24 `cache=` was swallowed and each step saw one token)."""
    model = _llama(variant, **params)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
        cache = zoo.make_cache(model)
        steps = [model(ids[:, :6], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 12 and all(layer.get_seq_length() == 12 for layer in cache.layers)


@pytest.mark.parametrize(("variant", "params"), [("longformer", {"window": 4}), ("deltanet", {})])
def test_generate_installs_the_variant_cache(variant, params):
    """Without a cache argument, generate decodes with the variant's own (bounded) cache, not a DynamicCache."""
    model = _llama(variant, **params)
    ids = torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert type(out.past_key_values) is ZooCache
    dense = _llama("sdpa").generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True).past_key_values
    assert zoo.cache_nbytes(out.past_key_values) < zoo.cache_nbytes(dense)


def test_a_reloaded_model_keeps_its_variant_and_saves_it_again(tmp_path):
    model = _llama("longformer", window=4)
    model.save_pretrained(tmp_path / "first")
    assert json.loads((tmp_path / "first" / "config.json").read_text())["attn_implementation"] == zoo.IMPLEMENTATION
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "first").eval()
    assert reloaded.config._attn_implementation == zoo.IMPLEMENTATION
    assert zoo.variant_spec(reloaded.config)["params"]["window"] == 4
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    reloaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["attn_implementation"] == zoo.IMPLEMENTATION and saved["attention_zoo"]["variant"] == "longformer"


# ---------------------------------------------------------------------------------------------------
# hub kernels (transformers 5.25 kernelizes in from_pretrained by default): the zoo's attention keeps running


def _count_zoo_calls(monkeypatch):
    from zoo.plug import dispatch

    calls = []
    real = dispatch.run_variant

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "run_variant", counting)
    return calls


def _standin_kernelize(replace_attention: bool):
    """A stand-in for `kernels`' kernelize as transformers' set_use_kernels runs it: the forward of each mapped layer
    (the norms; the attention layers too when asked) replaced on the instance by a hub layer's, here the same math."""

    def hub_forward(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    def set_use_kernels(self, use_kernels, kernel_config=None, mode=None, **kwargs):
        for module in self.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm") or (replace_attention and name.endswith("Attention")):
                module.forward = types.MethodType(hub_forward, module)

    return set_use_kernels


def _install_over(monkeypatch, set_use_kernels):
    """Put ``set_use_kernels`` where transformers' own is and let the zoo wrap it as it wraps the real one."""
    monkeypatch.setattr(transformers.PreTrainedModel, "set_use_kernels", set_use_kernels)
    monkeypatch.setattr(zoo.plug.install, "_installed", False)
    zoo.plug.install.install()


def test_without_kernels_a_loaded_model_runs_the_zoo_attention(tmp_path, monkeypatch):
    _llama("longformer", window=4).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    calls = _count_zoo_calls(monkeypatch)
    model(torch.tensor([[5, 6, 7, 8]]))
    assert len(calls) == SMALL["num_hidden_layers"]


def test_kernelized_norms_leave_the_zoo_attention_running(tmp_path, monkeypatch):
    model = _llama("longformer", window=4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = model(ids).logits
    _install_over(monkeypatch, _standin_kernelize(replace_attention=False))
    model.set_use_kernels(True)
    assert any(_patches.forward_replaced(m) for m in model.modules())  # the stand-in did kernelize
    calls = _count_zoo_calls(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)
    assert len(calls) == SMALL["num_hidden_layers"]


def test_a_kernel_that_replaces_the_attention_layers_is_refused(monkeypatch):
    model = _llama("longformer", window=4)
    _install_over(monkeypatch, _standin_kernelize(replace_attention=True))
    with pytest.raises(ValueError, match="use_kernels=False"):
        model.set_use_kernels(True)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    plain.set_use_kernels(True)  # models without the zoo: whatever transformers does
