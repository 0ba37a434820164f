"""The configuration of a retrofit: one YAML file (``recipes/configs/retrofit/*.yaml``; every key below).

Example::

    model: smollm2                        # the bundled SmolLM2-135M-Instruct, or a folder / Hub id
    output_dir: outputs/retrofit/smollm2_gated_deltanet
    variant: gated_deltanet               # any causal zoo variant, plugins included
    variant_params: {short_conv: 4}
    data: {sequence_length: 1024, train_sequences: 16, held_out_sequences: 2}
    transfer: {steps: 100, learning_rate: 1.0e-3, batch: 2, lora: {r: 8}}  # loss: output (default) | attention
    layouts:                              # one model each, all from the same stage 1
      - {name: every4, every: 4}          # full attention in layers 3, 7, 11, ...
      - {name: selected, keep_full: 7, by: kl}
    stage2: {max_steps: 40, max_length: 2048, learning_rate: 1.0e-4, distill_weight: 0.5, trainable: attention}
    eval: {config: recipes/configs/eval/retrofit_cpu.yaml}
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from zoo.registry import get_variant_class
from zoo.retrofit.selection import check_layout
from zoo.retrofit.transfer import TransferSettings, loss_problem
from zoo.training.config import FinetuneConfig
from zoo.variant import TransferStage

DATA_KEYS = {"sequence_length", "train_sequences", "held_out_sequences"}
STAGE1_DECIDES = {"model_name_or_path", "model_config", "variant", "variant_params", "output_dir"}
STAGE2_OWN = {"processes"}  # stage2 keys the retrofit reads; every other key goes to the fine-tune (FinetuneConfig)


class RetrofitConfigError(ValueError):
    """A retrofit config that cannot run, with the key to fix named."""


@dataclass
class RetrofitConfig:
    model: str
    output_dir: Path
    variant: str
    variant_params: dict = field(default_factory=dict)
    seed: int = 0
    threads: int | None = None
    device: str | None = None  # where stage 1 runs (default CPU; "cuda"); stage 2 runs where accelerate puts it
    dtype: str | None = None  # the model's dtype while converting (default the checkpoint's; float32 for SmolLM2)
    layers: list[int] | None = None  # the layers to convert (default: all)
    data: dict = field(default_factory=dict)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    layouts: list[dict] = field(default_factory=lambda: [{"name": "selected", "keep_full": 0.25}])
    stage2: dict | None = None
    eval: dict | None = None
    hub_model_id: str | None = None
    source: dict = field(default_factory=dict)

    @property
    def entry(self) -> dict[str, Any]:
        """The converted layers' ``hybrid`` entry."""
        return {"variant": self.variant, "params": dict(self.variant_params)}

    @property
    def stage(self) -> TransferStage | None:
        """The variant's own stage 1 (:meth:`zoo.variant.Variant.transfer_stage`; DSA's dense warm-up), or None."""
        return get_variant_class(self.variant)(**self.variant_params).transfer_stage()

    @property
    def stage_entry(self) -> dict[str, Any]:
        """The ``hybrid`` entry of a converted layer while stage 1 trains it (:attr:`entry` without a stage)."""
        stage = self.stage
        return (
            self.entry
            if stage is None
            else {"variant": self.variant, "params": {**self.variant_params, **stage.params}}
        )

    def data_setting(self, key: str) -> int:
        return int(self.data.get(key, {"sequence_length": 1024, "train_sequences": 16, "held_out_sequences": 2}[key]))


def check_stage2(stage2: dict, path: str | Path) -> None:
    """The stage2 block: keys of the fine-tune (:class:`~zoo.training.config.FinetuneConfig`) and ``processes``;
    what stage 1 decides (the model, the variant, the output folder) is refused."""
    if not isinstance(stage2, dict):
        raise RetrofitConfigError(f"{path}: stage2 must be a mapping of fine-tune keys, e.g. {{max_steps: 40}}.")
    decided = sorted(set(stage2) & STAGE1_DECIDES)
    if decided:
        raise RetrofitConfigError(f"{path}: stage2 sets {decided}, which stage 1 decides; drop them.")
    known = {f.name for f in fields(FinetuneConfig)} | STAGE2_OWN
    unknown = sorted(set(stage2) - known)
    if unknown:
        raise RetrofitConfigError(f"{path}: stage2 has keys {unknown} that are not fine-tune keys "
                                  "(docs/recipes/finetune.md lists them) nor `processes`.")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RetrofitConfig:
    """Read and check a retrofit YAML config; ``overrides`` replace top-level keys (``output_dir`` ...)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f.name for f in fields(RetrofitConfig)} - {"source"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RetrofitConfigError(f"{path}: unknown keys {unknown}; known: {', '.join(sorted(known))}.")
    for key in ("model", "output_dir", "variant"):
        if key not in raw:
            raise RetrofitConfigError(f"{path}: `{key}` is missing.")
    try:
        variant = get_variant_class(raw["variant"])(**(raw.get("variant_params") or {}))  # checks the parameters
        stage = variant.transfer_stage()
    except (KeyError, ValueError) as exc:
        raise RetrofitConfigError(f"{path}: variant {raw['variant']!r}: {exc}") from exc
    if not variant.supports_causal:
        raise RetrofitConfigError(f"{path}: variant {raw['variant']!r} has no causal attention; a causal LM needs one.")
    data = dict(raw.get("data") or {})
    if set(data) - DATA_KEYS:
        raise RetrofitConfigError(f"{path}: data has unknown keys {sorted(set(data) - DATA_KEYS)}; "
                                  f"known: {', '.join(sorted(DATA_KEYS))}.")
    transfer_raw = dict(raw.get("transfer") or {})
    transfer_keys = {f.name for f in fields(TransferSettings)} - {"seed"}
    if set(transfer_raw) - transfer_keys:
        raise RetrofitConfigError(f"{path}: transfer has unknown keys {sorted(set(transfer_raw) - transfer_keys)}; "
                                  f"known: {', '.join(sorted(transfer_keys))}.")
    problem = loss_problem(transfer_raw.get("loss", "output"), transfer_raw.get("lora"), variant)
    if problem:
        raise RetrofitConfigError(f"{path}: {problem}")
    if stage is not None and transfer_raw.get("loss", "output") != "output":
        raise RetrofitConfigError(f"{path}: transfer.loss: stage 1 of {raw['variant']!r} is its own (its weights "
                                  f"train by {stage.measure}); drop transfer.loss.")
    if stage is not None and transfer_raw.get("lora"):
        raise RetrofitConfigError(
            f"{path}: transfer.lora: stage 1 of {raw['variant']!r} runs its layers with "
            f"{dict(stage.params)} and trains its own weights by {stage.measure}, so LoRA on "
            "q/k/v has nothing to learn there; drop transfer.lora (stage 2 can take lora)."
        )
    layouts = list(raw.get("layouts") or [{"name": "selected", "keep_full": 0.25}])
    for number, layout in enumerate(layouts):
        if not isinstance(layout, dict) or not layout.get("name"):
            raise RetrofitConfigError(f"{path}: layouts[{number}] needs a name, e.g. {{name: every4, every: 4}}.")
        try:
            check_layout(layout, f"{path}: layouts[{number}]")
        except ValueError as exc:
            raise RetrofitConfigError(str(exc)) from exc
    names = [layout["name"] for layout in layouts]
    if len(set(names)) != len(names):
        raise RetrofitConfigError(f"{path}: layout names {names} repeat; give each a distinct name.")
    stage2 = raw.get("stage2")
    if stage2 is not None:
        check_stage2(stage2, path)
    evaluation = raw.get("eval")
    if evaluation is not None and "config" not in evaluation:
        raise RetrofitConfigError(f"{path}: eval needs `config: EVAL_YAML` (a zoo eval config; the retrofitted "
                                  "models join its contestants).")
    return RetrofitConfig(
        model=str(raw["model"]), output_dir=Path(raw["output_dir"]), variant=raw["variant"],
        variant_params=dict(raw.get("variant_params") or {}), seed=int(raw.get("seed", 0)),
        threads=raw.get("threads"), device=raw.get("device"), dtype=raw.get("dtype"), layers=raw.get("layers"),
        data=data,
        transfer=TransferSettings(**transfer_raw, seed=int(raw.get("seed", 0))), layouts=layouts,
        stage2=stage2, eval=evaluation, hub_model_id=raw.get("hub_model_id"), source=raw,
    )
