"""Where a ``window_state`` layer starts before any training: per layer of SmolLM2-135M-Instruct, the normalized error
(:func:`zoo.retrofit.transfer.normalized_error`, 1.0 = predicting the mean) of the window part alone, the state part
alone and the two combined, against the original attention's output on the retrofit's held-out book windows. A probe
for docs/recipes/retrofit.md (why the Liger-style retrofit trails), not a benchmark: two sequences, no training.

    .venv/bin/python scripts/window_state_start_errors.py --output results/retrofit/window_state_start_errors.json

Each setting is a ``window_state`` configuration; "alone" sets the mix's initial logit to ±30 (μ = 1 or 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from zoo.eval.contestants import load_model
from zoo.plug.install import configure
from zoo.plug.weights import attention_modules
from zoo.retrofit.capture import capture
from zoo.retrofit.recipe import book_sequences
from zoo.retrofit.transfer import held_out_error

HEDGEHOG = {"variant": "linear", "params": {"feature_map": "hedgehog"}}


def gated_deltanet(output_norm: bool) -> dict:
    """The Liger-style state of ``smollm2_liger_cpu.yaml``, with or without the variant's per-head output norm."""
    return {"variant": "gated_deltanet", "params": {"gates": "keys", "short_conv": 0, "output_norm": output_norm}}


def gla(output_norm: bool) -> dict:
    """Liger's GLA gates (per key channel, from the keys) without its softmax feature map on q and k."""
    return {"variant": "gla", "params": {"gates": "keys", "short_conv": 0, "output_norm": output_norm}}


def settings(window: int) -> dict[str, dict]:
    mix = {"window": window, "combine": "mix"}
    return {
        "window alone": {**mix, "state": gated_deltanet(True), "factor_init": 30.0},
        "gated_deltanet alone (output norm)": {**mix, "state": gated_deltanet(True), "factor_init": -30.0},
        "gated_deltanet alone (no output norm)": {**mix, "state": gated_deltanet(False), "factor_init": -30.0},
        "Liger-style mix (output norm)": {**mix, "state": gated_deltanet(True)},
        "Liger-style mix (no output norm)": {**mix, "state": gated_deltanet(False)},
        "LoLCATs-style shared": {"window": window, "combine": "shared", "state": HEDGEHOG},
        "gla alone (output norm)": {**mix, "state": gla(True), "factor_init": -30.0},
        "gla alone (no output norm)": {**mix, "state": gla(False), "factor_init": -30.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=2, help="held-out book windows of --length tokens")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, required=True, help="a JSON file: setting -> error per layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2", None, None)
    model.requires_grad_(False)
    configure(model, "sdpa")
    original = {i: {k: v.clone() for k, v in m.state_dict().items()} for _, i, m in attention_modules(model)}
    held_out = book_sequences(tokenizer, "validation", args.length, args.sequences)
    rows = list(range(args.sequences))
    errors = {}
    with tempfile.TemporaryDirectory() as scratch:
        captured = capture(model, held_out, Path(scratch))
        for name, params in settings(args.window).items():
            configure(model, "window_state", **params)
            errors[name] = []
            for _, layer, module in attention_modules(model):
                module.load_state_dict(original[layer], strict=False)
                errors[name].append(round(held_out_error(module, captured, layer, rows), 4))
            print(f"{name}: min {min(errors[name]):.3g}, median {statistics.median(errors[name]):.3g}, "
                  f"max {max(errors[name]):.3g}", flush=True)
    record = {"window": args.window, "sequences": args.sequences, "length": args.length,
              "settings": settings(args.window), "errors": errors}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
