"""The zoo's one ``Trainer``: transformers' Trainer with two fixes, each a function of the module that owns its
concern: FSDP 2 on a CPU process group (:func:`zoo.training.distributed.prepare_accelerator`), and a checkpoint write
that fails (disk full, no permission) removing its partial folder and naming the folder and the free space
(:func:`zoo.training.run_folder.checkpoint_write_failed`). It also logs, beside ``loss``, the mean since the last log
of each auxiliary loss the model's variant weights compute (DSA's ``indexer_kl``: :func:`zoo.variant.auxiliary_losses`)
and of what a subclass adds with :meth:`Trainer.add_logged` (``distill_kl``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from zoo.training import distributed
from zoo.training.run_folder import checkpoint_write_failed
from zoo.variant import auxiliary_losses


class Trainer(transformers.Trainer):
    """transformers' Trainer that shards with the launcher's FSDP 2 config on CPU, cleans up a failed checkpoint
    write and logs the model's auxiliary losses. Overrides the private ``Trainer._save_checkpoint`` (the one place
    checkpoints are written; no public hook sees the error), calling it unchanged."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logged_sums: dict[str, list] = {}  # name -> [sum, count] since the last log
        self.logged_names: set[str] = set()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        distributed.prepare_accelerator(self)

    def add_logged(self, name: str, total: float | torch.Tensor, count: float = 1) -> None:
        """Add ``total`` over ``count`` items to the value ``name`` that the next log reports (their mean)."""
        kept = self.logged_sums.setdefault(name, [0.0, 0.0])
        kept[0], kept[1] = kept[0] + total, kept[1] + count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = model.training
        if training:
            auxiliary_losses(model, reset=True)  # a value from another forward (a recomputed one) is not this batch's
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if training:
            for name, value in auxiliary_losses(model, reset=True).items():
                self.add_logged(name, value)  # one per micro-batch: the mean is over them, as the logged loss
        return result

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self.logged_sums:
            names = sorted(self.logged_sums)
            sums = torch.tensor(
                [[float(self.logged_sums[n][0]), float(self.logged_sums[n][1])] for n in names],
                device=self.accelerator.device,
                dtype=torch.float64,
            )
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")  # every process logs at the same steps
            logs.update(
                {n: float(total / count) for n, (total, count) in zip(names, sums.tolist(), strict=True) if count}
            )
            self.logged_names.update(names)
            self.logged_sums = {}
        super().log(logs, *args, **kwargs)

    def logged_curves(self) -> dict[str, list[list[float]]]:
        """``{name: [[step, value], ...]}`` of the values logged beside the loss (auxiliary losses, ``distill_kl``)."""
        curves: dict[str, list[list[float]]] = {}
        for record in self.state.log_history:
            for name in sorted(self.logged_names & set(record)):
                curves.setdefault(name, []).append([record["step"], float(record[name])])
        return curves

    def _save_checkpoint(self, model, trial) -> None:
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as exc:
            checkpoint_write_failed(folder, exc, self.args.should_save)
