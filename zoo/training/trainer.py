"""The zoo's one ``Trainer``: transformers' Trainer with two fixes, each a function of the module that owns its
concern: FSDP 2 on a CPU process group (:func:`zoo.training.distributed.prepare_accelerator`), and a checkpoint write
that fails (disk full, no permission) removing its partial folder and naming the folder and the free space
(:func:`zoo.training.run_folder.checkpoint_write_failed`).
"""

from __future__ import annotations

from pathlib import Path

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from zoo.training import distributed
from zoo.training.run_folder import checkpoint_write_failed


class Trainer(transformers.Trainer):
    """transformers' Trainer that shards with the launcher's FSDP 2 config on CPU and cleans up a failed checkpoint
    write. Overrides the private ``Trainer._save_checkpoint`` (the one place checkpoints are written; no public hook
    sees the error), calling it unchanged."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        distributed.prepare_accelerator(self)

    def _save_checkpoint(self, model, trial) -> None:
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as exc:
            checkpoint_write_failed(folder, exc, self.args.should_save)
