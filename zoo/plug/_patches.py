"""Every patch attention-zoo applies to transformers internals, in one guarded place.

transformers has no public hook at these points, so each is a wrapper (``PATCHES``): ``PretrainedConfig.to_dict``
(persist ``attn_implementation``), ``PreTrainedModel.get_correct_attn_implementation`` (validate at construction),
``GenerationMixin._prepare_cache_for_generation`` (decode with the variant's own cache), ``PreTrainedModel.post_init``
(attach variant weights), ``PreTrainedModel._initialize_missing_keys`` (initialise the ones a checkpoint lacked) and
``PreTrainedModel.set_use_kernels`` (hub kernels must not replace the attention a zoo model runs).
Each passes ``*args, **kwargs`` through, binds what it reads by name, acts only on zoo configs and models, and is
left unpatched with a warning when :func:`check_patch_targets` finds the symbol changed. Private symbols used
elsewhere are in ``PRIVATE_USES``; each has a canary in ``tests/test_patches.py``.

Why each patch, the private uses and the versions verified: docs/notes/transformers_patches.md
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

VERIFIED_ON = "5.24"
ORIGINAL = "__attention_zoo_original__"


@dataclass(frozen=True)
class Patch:
    owner: type
    name: str
    parameters: tuple[str, ...]  # the leading parameters the wrapper reads, by name

    @property
    def qualname(self) -> str:
        return f"{self.owner.__name__}.{self.name}"

    def original(self) -> Callable:
        current = self.owner.__dict__[self.name]
        return getattr(current, ORIGINAL, current)


TO_DICT = Patch(PretrainedConfig, "to_dict", ("self",))
RESOLVE_IMPLEMENTATION = Patch(PreTrainedModel, "get_correct_attn_implementation", ("self", "requested_attention"))
PREPARE_CACHE = Patch(
    GenerationMixin, "_prepare_cache_for_generation", ("self", "generation_config", "model_kwargs", "generation_mode")
)
POST_INIT = Patch(PreTrainedModel, "post_init", ("self",))
INITIALIZE_MISSING_KEYS = Patch(PreTrainedModel, "_initialize_missing_keys", ("self",))
SET_USE_KERNELS = Patch(PreTrainedModel, "set_use_kernels", ("self", "use_kernels"))
PATCHES = (TO_DICT, RESOLVE_IMPLEMENTATION, PREPARE_CACHE, POST_INIT, INITIALIZE_MISSING_KEYS, SET_USE_KERNELS)


def _problem(patch: Patch) -> str | None:
    """Why ``patch`` cannot be applied to this transformers (None: it can)."""
    if patch.name not in patch.owner.__dict__:
        problem = f"{patch.qualname} no longer exists"
    else:
        actual = tuple(inspect.signature(patch.original()).parameters)
        if actual[: len(patch.parameters)] == patch.parameters:
            return None
        problem = f"{patch.qualname} has parameters {actual}, the patch expects {patch.parameters}"
    return (
        f"transformers {transformers.__version__} (attention-zoo's patches were verified on {VERIFIED_ON}): "
        f"{problem}. Update zoo/plug/_patches.py."
    )


def check_patch_targets() -> list[str]:
    """One message per patched symbol whose signature no longer starts with the parameters we rely on."""
    return [problem for patch in PATCHES if (problem := _problem(patch)) is not None]


def _wrap(patch: Patch, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``patch``'s symbol by ``make_wrapper(original)``, unless its shape changed (then warn)."""
    problem = _problem(patch)
    if problem is not None:
        logger.warning("attention-zoo leaves a transformers symbol unpatched: %s", problem)
        return
    original = patch.original()
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, ORIGINAL, original)
    setattr(patch.owner, patch.name, wrapper)


def apply(
    *,
    saved_implementation: Callable[[PretrainedConfig], str | None],
    check_model: Callable[[PreTrainedModel, str | None], None],
    prepare_generation_cache: Callable[[Any, dict[str, Any], Callable[[], Any]], Any],
    model_built: Callable[[PreTrainedModel], None] | None = None,
    checkpoint_loaded: Callable[[PreTrainedModel], None] | None = None,
    kernels_set: Callable[[PreTrainedModel], None] | None = None,
) -> None:
    """Install the wrappers (idempotent: a second call wraps the originals again, never a wrapper).

    ``saved_implementation(config)`` returns the implementation name to write into the config's dict (None:
    leave the dict alone); ``check_model(model, requested)`` raises if the model cannot run ``requested``;
    ``prepare_generation_cache(model, arguments, run_original)`` gets generate's arguments bound by name and a
    callable running the original (it must call it: it alone knows whether the model is a zoo model).
    ``model_built(model)`` runs after ``post_init``, ``checkpoint_loaded(model)`` after
    ``_initialize_missing_keys``, ``kernels_set(model)`` after ``set_use_kernels`` (which ``from_pretrained`` calls
    to kernelize; each of these patches is installed only when its callback is given).
    """

    def make_to_dict(original: Callable) -> Callable:
        def to_dict(self: PretrainedConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
            output = original(self, *args, **kwargs)
            name = saved_implementation(self)
            if name is not None:
                output["attn_implementation"] = name
            return output

        return to_dict

    def make_resolve(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def get_correct_attn_implementation(self: PreTrainedModel, *args: Any, **kwargs: Any) -> str:
            check_model(self, signature.bind(self, *args, **kwargs).arguments.get("requested_attention"))
            return original(self, *args, **kwargs)

        return get_correct_attn_implementation

    def make_prepare_cache(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def _prepare_cache_for_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(self, *args, **kwargs).arguments
            return prepare_generation_cache(self, arguments, lambda: original(self, *args, **kwargs))

        return _prepare_cache_for_generation

    def run_after(callback: Callable[[PreTrainedModel], None]) -> Callable[[Callable], Callable]:
        def make_wrapper(original: Callable) -> Callable:
            def wrapper(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
                result = original(self, *args, **kwargs)
                callback(self)
                return result

            return wrapper

        return make_wrapper

    _wrap(TO_DICT, make_to_dict)
    _wrap(RESOLVE_IMPLEMENTATION, make_resolve)
    _wrap(PREPARE_CACHE, make_prepare_cache)
    if model_built is not None:
        _wrap(POST_INIT, run_after(model_built))
    if checkpoint_loaded is not None:
        _wrap(INITIALIZE_MISSING_KEYS, run_after(checkpoint_loaded))
    if kernels_set is not None:
        _wrap(SET_USE_KERNELS, run_after(kernels_set))


# ---------------------------------------------------------------------------------------------------
# Private symbols and calling conventions relied on outside the patches. The accessors below are the only code
# of the package that names them; each has a canary in PRIVATE_USES that checks the behaviour on a tiny model.

INITIALIZED_FLAG = "_is_hf_initialized"  # transformers' init skips modules flagged so; loading flags what it loaded
ATTENTION_OUTPUTS = ("attentions", "cross_attentions")


def mark_initialized(module: torch.nn.Module) -> None:
    """transformers' weight init (``post_init``, ``_initialize_missing_keys``) must not redraw ``module``."""
    for part in module.modules():
        setattr(part, INITIALIZED_FLAG, True)


def was_loaded(tensor: torch.Tensor) -> bool:
    """True for a parameter or buffer ``from_pretrained`` filled from the checkpoint."""
    return bool(getattr(tensor, INITIALIZED_FLAG, False))


def ignore_missing_keys(model: PreTrainedModel, pattern: str) -> None:
    """Keep keys matching the regex ``pattern`` out of transformers' "newly initialized" loading report."""
    ignored = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignored or ()), pattern}


def declared_attention_classes(model: torch.nn.Module) -> tuple[set[type], set[str]]:
    """The attention module classes (and class names) the model's families declare in ``_can_record_outputs``
    (what ``output_attentions`` records from): the declared, not parsed, list of attention modules."""
    classes: set[type] = set()
    names: set[str] = set()
    owners = {type(m) for m in model.modules() if isinstance(m, PreTrainedModel)}
    for owner in owners:
        declared = getattr(owner, "_can_record_outputs", None) or {}
        for key in ATTENTION_OUTPUTS:
            entries = declared.get(key, [])
            for entry in entries if isinstance(entries, (list, tuple)) else [entries]:
                target = getattr(entry, "target_class", None) or entry
                if isinstance(target, type):
                    classes.add(target)
                elif isinstance(target, str) or getattr(entry, "class_name", None):
                    names.add(getattr(entry, "class_name", None) or target)
    return classes, names


def forward_replaced(module: torch.nn.Module) -> bool:
    """True when ``module.forward`` was replaced on the instance, as the ``kernels`` library's ``kernelize`` does
    (``module.forward = MethodType(layer.forward, module)``) to swap in a hub kernel; a reset binds the class's own."""
    forward = vars(module).get("forward")
    return forward is not None and getattr(forward, "__func__", forward) is not type(module).forward


def calls_attention_interface(cls: type) -> bool:
    """Fallback for a family that declares no attention outputs: its ``forward`` dispatches through
    ``ALL_ATTENTION_FUNCTIONS`` (the source heuristic transformers itself uses in ``_can_set_attn_implementation``)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def compute_global_attention_mask(input_ids: torch.Tensor, sep_token_id: int, before_sep: bool = True):
    """transformers' Longformer task models' default global attention (private there; :mod:`zoo.convert`)."""
    from transformers.models.longformer import modeling_longformer

    return modeling_longformer._compute_global_attention_mask(input_ids, sep_token_id, before_sep)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread: where activation checkpointing (reentrant or
    not) recomputes a forward. torch has no public query for it; ``torch.utils.checkpoint`` uses the same one."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class PrivateUse:
    """A private symbol or calling convention the package relies on, and the file that relies on it."""

    library: str  # "transformers", "accelerate" or "torch"
    symbol: str
    used_in: str

    def outdated(self, what: str) -> str:
        """The canary's message when the behaviour changed: the library version and the file to update."""
        version = importlib.metadata.version(self.library)
        verified = {"transformers": VERIFIED_ON, "torch": TORCH_VERIFIED_ON}.get(self.library, ACCELERATE_VERIFIED_ON)
        return (f"{self.library} {version} (attention-zoo verified {self.symbol} on {verified}): {what}. "
                f"Update {self.used_in} and zoo/plug/_patches.py.")


ACCELERATE_VERIFIED_ON = "1.15"
TORCH_VERIFIED_ON = "2.13"
PRIVATE_USES = (
    PrivateUse("torch", "torch._C._current_graph_task_id() (-1 outside a backward; in_backward)",
               "zoo/plug/dispatch.py"),
    PrivateUse("transformers", "PreTrainedModel._is_hf_initialized (modules and tensors)", "zoo/plug/weights.py"),
    PrivateUse("transformers", "PreTrainedModel._keys_to_ignore_on_load_missing", "zoo/plug/weights.py"),
    PrivateUse("transformers", "PreTrainedModel._can_record_outputs['attentions']", "zoo/plug/weights.py"),
    PrivateUse("transformers", "modeling_longformer._compute_global_attention_mask", "zoo/convert/longformer.py"),
    PrivateUse("transformers", "Cache.update(k, v, layer_idx, kwargs=attention_kwargs)", "zoo/cache.py"),
    PrivateUse("accelerate", "PartialState._shared_state / AcceleratorState._shared_state",
               "zoo/training/distributed.py"),
    PrivateUse("transformers", "Trainer.create_accelerator_and_postprocess / is_fsdp_enabled / "
               "TrainingArguments.fsdp_plugin_args", "zoo/training/distributed.py"),
    PrivateUse("transformers", "Trainer._save_checkpoint(model, trial): the one place checkpoints are written "
               "(overridden to name write failures and remove the partial folder)", "zoo/training/run_folder.py"),
)
