"""How a run is distributed: refuse launches that cannot run here, run FSDP on CPU, record what really ran.

accelerate 1.15 (verified) reads the launcher's choice from environment variables (``ACCELERATE_USE_FSDP``,
``ACCELERATE_USE_DEEPSPEED``, ``FSDP_*``). Without an accelerator, the fine-tune asks for the CPU (``use_cpu``, the only
way to get a multi-process gloo group), and accelerate then decides "MULTI_CPU" and drops both plugins: an FSDP or
DeepSpeed config silently trains with plain DDP. Hence:

* :func:`check_launch` refuses, before any data or model is loaded, what cannot run here (DeepSpeed without a CUDA
  GPU or without its package; FSDP 1 on CPU), naming the alternative.
* :class:`Trainer` turns the launcher's FSDP 2 back on for a CPU group: accelerate's state is set to FSDP with the
  launcher's plugin right after the Accelerator is created (torch's ``fully_shard`` runs on CPU over gloo; only the
  state machine of accelerate excludes it). The recipe test checks that each of 2 ranks then holds half of the
  parameters and that the saved model is a full state dict; the patch is guarded and says so if accelerate changes.
* :func:`describe` records the distributed type (single, DDP, FSDP, DeepSpeed), the world size and the parameters
  each rank holds (``parameters.per_rank``: about total / world size under FSDP, total under DDP).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import transformers
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

KIND_NAMES = {
    DistributedType.NO: "single",
    DistributedType.FSDP: "FSDP",
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}  # every other type (MULTI_CPU, MULTI_GPU, MULTI_XPU, ...) is DistributedDataParallel: "DDP"


def accelerator_available() -> bool:
    """Without ``use_cpu`` on a machine with no accelerator, accelerate would not form a multi-process (gloo) group."""
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or torch.backends.mps.is_available() or bool(xpu and xpu.is_available())


def is_main_process() -> bool:
    """Rank 0 of a launch (torchrun sets RANK), readable before any process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


def _launcher_asks(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def check_launch(accelerator_available: bool) -> None:
    """Refuse a launch configuration that cannot run on this machine (before anything is loaded)."""
    if _launcher_asks("ACCELERATE_USE_DEEPSPEED"):
        if importlib.util.find_spec("deepspeed") is None:
            raise RuntimeError(
                "the launcher asks for DeepSpeed, which is not installed: `pip install deepspeed` (it needs a CUDA "
                "GPU). Without a GPU use recipes/accelerate/fsdp.yaml (sharded) or multi_cpu.yaml (DDP) instead."
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the launcher asks for DeepSpeed, which needs a CUDA GPU, and this machine has none (accelerate "
                "would silently train with plain DDP on the CPU). Use recipes/accelerate/fsdp.yaml to shard the "
                "model over CPU processes, or multi_cpu.yaml for DDP."
            )
    if _launcher_asks("ACCELERATE_USE_FSDP") and not accelerator_available:
        if os.environ.get("FSDP_VERSION", "1") != "2":
            raise RuntimeError(
                "the launcher asks for FSDP version 1, which does not run on CPU. Set `fsdp_version: 2` in the "
                "accelerate config (recipes/accelerate/fsdp.yaml does)."
            )


def prepare_accelerator(trainer: transformers.Trainer) -> None:
    """After transformers' Trainer made its accelerator: shard with the launcher's FSDP 2 config when the group runs
    on CPU (accelerate 1.15 silently drops the plugin there), and keep the input embeddings out of the wrap list."""
    if _launcher_asks("ACCELERATE_USE_FSDP") and trainer.accelerator.distributed_type == DistributedType.MULTI_CPU:
        _enable_fsdp_on_cpu(trainer)
    if trainer.is_fsdp_enabled:
        keep_input_embeddings_unwrapped(trainer.accelerator.state.fsdp_plugin, trainer.model)


def _enable_fsdp_on_cpu(trainer: transformers.Trainer) -> None:
    plugin_args = trainer.args.fsdp_plugin_args or {}
    plugin = FullyShardedDataParallelPlugin(**plugin_args)  # the launcher's FSDP_* settings
    state = trainer.accelerator.state
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    shared = (PartialState._shared_state, AcceleratorState._shared_state)
    if not all(isinstance(s, dict) and s.get("distributed_type") == DistributedType.MULTI_CPU for s in shared):
        raise RuntimeError(
            f"FSDP on CPU: accelerate {_version('accelerate')} keeps its state differently from 1.15, the version "
            "this workaround was written for. Use recipes/accelerate/multi_cpu.yaml (DDP) on this machine."
        )
    # Both singletons: every AcceleratorState() call copies PartialState's fields over its own.
    for s in shared:
        s["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True


def keep_input_embeddings_unwrapped(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> None:
    """Drop from FSDP's per-layer wrap list the classes that hold the input embeddings (BERT's ``BertEmbeddings``).

    accelerate 1.15 (verified) shards every module of the list (by default the model's ``_no_split_modules``), then
    shards the input embedding module on its own; when a wrapped module already holds it, that second
    ``fully_shard`` meets a sharded weight and fails ("Invariant encountered: value was None"). Without the holder
    in the list, the embeddings get their own unit from accelerate and the holder's other parameters go to the root.
    """
    policy = plugin.auto_wrap_policy
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy or embeddings is None:
        return  # size-based or no wrap, or no embeddings: accelerate's carve-out does not meet a sharded weight
    path = next(name for name, module in model.named_modules() if module is embeddings).split(".")
    holders = {type(model.get_submodule(".".join(path[:depth]))).__name__ for depth in range(len(path))}
    names = plugin.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
    plugin.transformer_cls_names_to_wrap = [name for name in names if name not in holders]


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def local_numel(parameter: torch.Tensor) -> int:
    """Elements this rank stores: a sharded (DTensor) parameter's local shard, else the whole parameter."""
    to_local = getattr(parameter, "to_local", None)
    return to_local().numel() if to_local is not None else parameter.numel()


class ParameterCount(transformers.TrainerCallback):
    """Parameters of the prepared model, whole and on this rank, when training starts (every shard at rest:
    FSDP keeps its root unit unsharded after an evaluation forward, so counting at the end would overstate)."""

    total = local = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        parameters = list(model.parameters())
        self.total = sum(p.numel() for p in parameters)  # a DTensor's numel is the full parameter's
        self.local = sum(local_numel(p) for p in parameters)


def describe(trainer: transformers.Trainer, count: ParameterCount) -> dict:
    """Distributed type, world size and parameters per rank (a collective call: every process must make it)."""
    accelerator = trainer.accelerator
    local = torch.tensor([count.local or 0], device=accelerator.device)
    return {
        "distributed_type": KIND_NAMES.get(accelerator.distributed_type, "DDP"),
        "accelerate_distributed_type": str(accelerator.distributed_type.value),
        "world_size": accelerator.num_processes,
        "parameters": {"total": count.total, "per_rank": [int(n) for n in accelerator.gather(local).tolist()]},
    }
