"""The transformers patches (zoo/plug/_patches.py): canary for their shape, and models without the zoo untouched."""

import inspect
import logging

import pytest
import torch
import transformers
from transformers import BertConfig, PretrainedConfig, PreTrainedModel

import zoo
from zoo.plug import _patches


def test_canary_patched_symbols_keep_the_shape_the_patches_rely_on():
    problems = _patches.check_patch_targets()
    assert not problems, "\n".join(problems)


def test_every_patch_is_installed_as_a_wrapper_of_the_original():
    for patch in _patches.PATCHES:
        current = patch.owner.__dict__[patch.name]
        original = getattr(current, _patches.ORIGINAL)
        assert current is not original and current.__wrapped__ is original, patch.qualname
        # The original's own parameters (functools.wraps copies them onto the wrapper, so compare the original's
        # code object, which wraps cannot fake): the names the wrapper binds by name are really there.
        names = original.__code__.co_varnames[: original.__code__.co_argcount]
        assert names[: len(patch.parameters)] == patch.parameters, (patch.qualname, names)


# ---------------------------------------------------------------------------------------------------
# canaries: the behaviour each patch and private use relies on, observed on tiny models


def _tiny_bert_config(**kwargs):
    return BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                      vocab_size=50, max_position_embeddings=32, **kwargs)


class _Probe(transformers.BertModel):
    """Records when transformers calls the methods the patches wrap, and what it hands them."""

    seen: dict = {}

    def post_init(self):
        _Probe.seen["post_init_after_layers"] = hasattr(self, "encoder")
        super().post_init()
        extra = torch.nn.Linear(2, 2)  # a foreign submodule, as zoo.plug.weights attaches (marked, ignored if missing)
        extra.weight.data.fill_(7.0)
        _patches.mark_initialized(extra)
        self.encoder.layer[0].attention.self.add_module("attention_zoo", extra)
        _patches.ignore_missing_keys(self, r"\.attention_zoo\.")

    def get_correct_attn_implementation(self, *args, **kwargs):
        bound = inspect.signature(_patches.RESOLVE_IMPLEMENTATION.original()).bind(self, *args, **kwargs)
        _Probe.seen.setdefault("requested", []).append(bound.arguments.get("requested_attention"))
        return super().get_correct_attn_implementation(*args, **kwargs)

    def _initialize_missing_keys(self, *args, **kwargs):
        _Probe.seen["loaded_flags"] = {n: _patches.was_loaded(t) for n, t in self.state_dict(keep_vars=True).items()}
        return super()._initialize_missing_keys(*args, **kwargs)


def _fail(use_or_patch, what: str):
    if isinstance(use_or_patch, _patches.PrivateUse):
        pytest.fail(use_or_patch.outdated(what))
    pytest.fail(f"transformers {transformers.__version__} (patches verified on {_patches.VERIFIED_ON}): "
                f"{use_or_patch.qualname}: {what}. Update zoo/plug/_patches.py.")


def _use(symbol_start: str) -> _patches.PrivateUse:
    return next(u for u in _patches.PRIVATE_USES if u.symbol.startswith(symbol_start))


@pytest.fixture(scope="module")
def probe_loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    _Probe.seen = {}
    torch.manual_seed(0)
    _Probe(_tiny_bert_config()).save_pretrained(folder)
    state = {k: v for k, v in transformers.BertModel.from_pretrained(folder).state_dict().items()}
    # a checkpoint without the foreign submodule (as a base BERT lacks the zoo weights)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    _Probe.seen = {}
    model, info = _Probe.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    return model, info, dict(_Probe.seen)


def test_canary_construction_calls_post_init_last_and_resolves_the_requested_implementation(probe_loaded):
    _, _, seen = probe_loaded
    if not seen.get("post_init_after_layers"):
        _fail(_patches.POST_INIT, "post_init is no longer called after the layers are built")
    if "eager" not in seen.get("requested", []):
        _fail(_patches.RESOLVE_IMPLEMENTATION, f"from_pretrained no longer hands it requested_attention "
              f"(saw {seen.get('requested')})")


def test_canary_loading_flags_what_it_loaded_before_initializing_the_rest(probe_loaded):
    _, _, seen = probe_loaded
    flags = seen.get("loaded_flags")
    if flags is None:
        _fail(_patches.INITIALIZE_MISSING_KEYS, "from_pretrained no longer calls it")
    if not flags["embeddings.word_embeddings.weight"] or flags["encoder.layer.0.attention.self.attention_zoo.bias"]:
        _fail(_use("PreTrainedModel._is_hf_initialized"), "loaded tensors are no longer flagged (or missing ones are)")


def test_canary_marked_modules_are_not_redrawn_and_ignored_keys_are_not_reported(probe_loaded):
    model, info, _ = probe_loaded
    marked, unmarked = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for linear in (marked, unmarked):
        linear.weight.data.fill_(7.0)
        model.encoder.layer[0].add_module(f"canary_{len(model.encoder.layer[0]._modules)}", linear)
    _patches.mark_initialized(marked)
    model.initialize_weights()
    if not torch.all(marked.weight == 7.0) or torch.all(unmarked.weight == 7.0):
        _fail(_use("PreTrainedModel._is_hf_initialized"), "weight init no longer skips exactly the marked modules")
    if any("attention_zoo" in key for key in info["missing_keys"]):
        _fail(_use("PreTrainedModel._keys_to_ignore_on_load_missing"), f"missing keys {info['missing_keys']}")


def test_canary_to_dict_leaves_out_the_implementation_and_from_dict_reads_it_back():
    config = _tiny_bert_config()
    config._attn_implementation = "eager"
    if "attn_implementation" in _patches.TO_DICT.original()(config):
        _fail(_patches.TO_DICT, "config dicts now carry attn_implementation themselves")
    restored = BertConfig.from_dict({**config.to_dict(), "attn_implementation": "eager"})
    if restored._attn_implementation != "eager":
        _fail(_patches.TO_DICT, "from_dict no longer reads attn_implementation")


@pytest.mark.parametrize("name", ["BertModel", "RobertaModel", "DistilBertModel", "LlamaModel", "GPT2Model"])
def test_canary_families_declare_their_attention_modules(name):
    from zoo.plug.weights import attention_modules

    model_class = getattr(transformers, name)
    classes, names = _patches.declared_attention_classes(model_class(model_class.config_class(
        hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64, n_embd=32, n_head=2,
        n_layer=2, dim=32, n_heads=2, n_layers=2, hidden_dim=64, vocab_size=50)))
    found = [type(m) for _, _, m in attention_modules(model_class(model_class.config_class(
        hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64, n_embd=32, n_head=2,
        n_layer=2, dim=32, n_heads=2, n_layers=2, hidden_dim=64, vocab_size=50)))]
    if not classes and not names or len(found) != 2 or not all(_patches.calls_attention_interface(c) for c in found):
        _fail(_use("PreTrainedModel._can_record_outputs"), f"{name} declares {classes or names}, found {found}")


def test_canary_longformer_default_global_attention():
    ids = torch.tensor([[0, 5, 6, 2, 2, 7, 8, 2]])  # <s> question </s></s> context </s>
    mask = _patches.compute_global_attention_mask(ids, sep_token_id=2)
    if mask.tolist() != [[1, 1, 1, 0, 0, 0, 0, 0]]:
        _fail(_use("modeling_longformer._compute_global_attention_mask"), f"question tokens are {mask.tolist()}")


def test_canary_cache_update_hands_the_attention_kwargs_to_the_attention_function():
    """zoo.cache puts its layer into the dict cache.update gets as kwargs=; the attention function must get it."""
    from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    class Marking(DynamicCache):
        def update(self, *args, **kwargs):
            seen["update"] = kwargs
            if isinstance(kwargs.get("kwargs"), dict):
                kwargs["kwargs"]["zoo_canary"] = True
            return super().update(*args, **kwargs)

    def attention(module, *args, **kwargs):
        seen["attention"] = kwargs.pop("zoo_canary", False)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("zoo_canary", attention)
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=64, vocab_size=50, attn_implementation="zoo_canary")
    LlamaForCausalLM(config).eval()(torch.tensor([[1, 2, 3]]), cache=Marking(config=config), use_cache=True)
    if not seen.get("attention"):
        _fail(_use("Cache.update"), f"cache.update got {sorted(seen.get('update', {}))}, the attention function "
              "did not get what was put there")


def test_canary_accelerate_state_and_trainer_hooks_used_by_distributed():
    from accelerate.state import AcceleratorState, PartialState

    if not all(isinstance(getattr(c, "_shared_state", None), dict) for c in (PartialState, AcceleratorState)):
        _fail(_use("PartialState._shared_state"), "the states no longer share a class-level dict")
    source = inspect.getsource(transformers.Trainer.create_accelerator_and_postprocess)
    if "self.is_fsdp_enabled" not in source or "fsdp_plugin_args" not in inspect.getsource(transformers.Trainer):
        _fail(_use("Trainer.create_accelerator_and_postprocess"), "it no longer sets is_fsdp_enabled")


def test_canary_trainer_writes_checkpoints_through_save_checkpoint():
    parameters = list(inspect.signature(transformers.Trainer._save_checkpoint).parameters)
    if parameters != ["self", "model", "trial"]:
        _fail(_use("Trainer._save_checkpoint"), f"its parameters are now {parameters}")
    if "self._save_checkpoint(" not in inspect.getsource(transformers.Trainer):
        _fail(_use("Trainer._save_checkpoint"), "the training loop no longer saves checkpoints through it")


@pytest.mark.parametrize("reentrant", [False, True])
def test_canary_checkpoint_recomputes_inside_the_backward(reentrant):
    """``in_backward`` (``torch._C._current_graph_task_id``) is False in a forward and True in the forward that
    activation checkpointing recomputes (what ``AttentionCall.recomputed`` reports)."""
    import torch.utils.checkpoint

    seen = []

    def layer(x):
        seen.append(_patches.in_backward())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
    if seen != [False, True]:
        _fail(_use("torch._C._current_graph_task_id"), f"forward then recompute saw in_backward() = {seen}")


def test_canary_message_names_the_version_and_the_file():
    use = _use("Cache.update")
    message = use.outdated("it changed")
    assert transformers.__version__ in message and "zoo/cache.py" in message and "zoo/plug/_patches.py" in message


def test_private_symbols_are_named_only_in_zoo_patches():
    from pathlib import Path

    root = Path(zoo.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "_patches.py" or path.name == "distributed.py":  # distributed.py: see PRIVATE_USES
            continue
        text = path.read_text()
        for symbol in ("_is_hf_initialized", "_keys_to_ignore_on_load_missing", "_compute_global_attention_mask"):
            assert symbol not in text, f"{path} names {symbol}: use the accessor in zoo/plug/_patches.py"


def test_a_changed_signature_is_reported_with_the_transformers_version_and_left_unpatched(monkeypatch, caplog):
    class Owner:
        def to_dict(self, flatten):  # a parameter the patch does not expect
            return {"flatten": flatten}

    patch = _patches.Patch(Owner, "to_dict", ("self", "requested_attention"))
    monkeypatch.setattr(_patches, "PATCHES", (patch,))
    (message,) = _patches.check_patch_targets()
    assert transformers.__version__ in message and "Owner.to_dict" in message and "zoo/plug/_patches.py" in message
    with caplog.at_level(logging.WARNING, logger="zoo.plug._patches"):
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
