"""What trains in a fine-tune, and distillation from a teacher: the keys ``trainable``, ``lora`` and ``distill_*``.

- ``trainable``: ``all`` (every parameter), ``attention`` (the attention modules: projections and the variant's weights)
  or ``variant`` (only the variant's learned weights, ``<attention>.attention_zoo.*``).
- ``lora``: peft LoRA adapters (``LoraConfig`` keys: ``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``) in
  the model itself (``peft.inject_adapter_in_model``: checkpoints hold the whole model, so a resume is exact), merged
  into the adapted weights before the final model is saved (:func:`merge_lora`): the output folder is a plain model.
- ``distill_from``: a causal LM run in the same process as a frozen teacher; the training loss becomes
  ``(1 - distill_weight) * LM loss + distill_weight * T² * KL(teacher || student)`` over the predicted tokens, both
  at temperature ``T = distill_temperature`` (Hinton et al. 2015). Evaluation keeps the LM loss alone (perplexity).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.data.labels import IGNORE_INDEX
from zoo.plug.weights import WEIGHTS_NAME, attention_modules
from zoo.training.trainer import Trainer


def select_trainable(model: torch.nn.Module, trainable: str, lora: dict | None) -> int:
    """Freeze what ``trainable`` leaves out and add the ``lora`` adapters; returns the number of trained parameters."""
    if lora:
        import peft

        options = {"lora_dropout": 0.0, **lora}
        if "r" in options:
            options.setdefault("lora_alpha", 2 * int(options["r"]))
        peft.inject_adapter_in_model(peft.LoraConfig(**options), model)
    if trainable != "all":
        inside = [module for _, _, module in attention_modules(model)]
        if trainable == "variant":
            inside = [module._modules[WEIGHTS_NAME] for module in inside if WEIGHTS_NAME in module._modules]
        chosen = {id(p) for module in inside for p in module.parameters()}
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(id(parameter) in chosen or "lora_" in name)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count == 0:
        raise ValueError(f"trainable: {trainable} selects no parameter (the variant has no learned weights); set "
                         "trainable: attention, or add lora.")
    return count


def merge_lora(model: torch.nn.Module) -> int:
    """Fold every LoRA adapter into its base layer and put the base layer back; returns how many were merged."""
    from peft.tuners.lora import LoraLayer

    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    for name, module in adapted:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    return len(adapted)


def load_teacher(path: str, student: torch.nn.Module) -> torch.nn.Module:
    """The frozen teacher, on the student's device and dtype, with the student's vocabulary (checked)."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=student.dtype).to(student.device).eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    sizes = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if sizes[0] != sizes[1]:
        raise ValueError(f"distill_from={path!r} predicts {sizes[0]} tokens but the model {sizes[1]}: a teacher must "
                         "share the student's tokenizer.")
    return teacher


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of T² · KL(teacher || student), tokens)`` over the positions whose next token is a label."""
    predicted = labels[:, 1:] != IGNORE_INDEX
    student = F.log_softmax(student_logits[:, :-1][predicted].float() / temperature, -1)
    teacher = F.log_softmax(teacher_logits[:, :-1][predicted].float() / temperature, -1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="sum") * temperature**2
    return kl, predicted.sum()


class DistillingTrainer(Trainer):
    """The zoo's Trainer whose training loss mixes the LM loss with the KL to a frozen teacher's next-token
    distribution, normalized like the LM loss (by the batch's label tokens, over accumulation steps and processes).
    Logs ``distill_kl``: the mean per-token KL since the last log (:meth:`Trainer.add_logged`)."""

    def __init__(self, *args, teacher: torch.nn.Module, weight: float, temperature: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.teacher, self.weight, self.temperature = teacher, weight, temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=inputs["input_ids"],
                                              attention_mask=inputs.get("attention_mask"), use_cache=False).logits
            kl, tokens = token_kl(outputs.logits, teacher_logits, inputs["labels"], self.temperature)
            self.add_logged("distill_kl", float(kl.detach()) / self.temperature**2, int(tokens))
            scaled = num_items_in_batch is not None and self.model_accepts_loss_kwargs
            kl = kl / (num_items_in_batch if scaled else tokens.clamp_min(1))
            if scaled and self.args.average_tokens_across_devices:
                kl = kl * self.accelerator.num_processes  # as transformers scales the LM loss
            loss = (1 - self.weight) * loss + self.weight * kl
        return (loss, outputs) if return_outputs else loss
