"""Paired per-step decode timing: the decode benchmark's tiny models (``zoo bench --decode``), prefilled once each
in one process, then timed forward step by forward step in interleaved rounds (the benchmarks' decode timer,
:func:`zoo.bench.timer.take_turns`), so host noise falls on every contestant alike. A check of ``zoo bench --decode``
without ``generate`` around the steps.

    .venv/bin/python scripts/paired_decode_steps.py 32768 longformer mistral_sliding_window xformers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from zoo.bench.decode import PEERS, DecodeContestant, DecodeSettings, build_model, decode_params
from zoo.bench.timer import take_turns
from zoo.cache import ZooCache
from zoo.plug.spec import variant_for


def stepper(name: str, settings: DecodeSettings, prompt: torch.Tensor, steps: int):
    """The timer's (prefill, turn) of one contestant: a forward over the prompt into a cache, then ``steps`` timed
    single-token forward steps per turn (no ``generate`` around them)."""
    state = {}

    def prefill() -> dict:
        contestant = DecodeContestant(name, "peer") if name in PEERS else \
            DecodeContestant(name, "zoo", name, decode_params(name, settings.window))
        model = build_model(contestant, settings, prompt.shape[1])
        cache = DynamicCache(config=model.config) if name in PEERS else ZooCache(variant_for(model.config),
                                                                                 model.config)
        logits = model(prompt, cache=cache, use_cache=True).logits
        state.update(model=model, cache=cache, token=logits[:, -1:].argmax(-1),
                     mask=torch.ones(1, prompt.shape[1] + 1, dtype=torch.long))
        return {}

    def turn() -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state["token"] = state["model"](state["token"], cache=state["cache"], attention_mask=state["mask"],
                                            use_cache=True).logits.argmax(-1)
            times.append(time.perf_counter() - start)
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(1, 1)], dim=1)
        return times

    return prefill, turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("length", type=int, help="prompt tokens")
    parser.add_argument("contestants", nargs="+", help=f"zoo variants or peers ({', '.join(PEERS)})")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="steps per contestant and round")
    args = parser.parse_args()
    settings = DecodeSettings(lengths=[args.length], window=args.window)
    prompt = torch.randint(3, settings.vocab, (1, args.length), generator=torch.Generator().manual_seed(args.length))
    players = {name: stepper(name, settings, prompt, args.steps) for name in args.contestants}
    with torch.inference_mode():
        results = take_turns(players, args.rounds, catch=False)
    first = args.contestants[0]
    for name in args.contestants:
        times = results[name]["gaps"]
        print(f"n={args.length} {name}: median {1e3 * statistics.median(times):.3f} ms per step "
              f"over {len(times)} steps")
    for name in args.contestants[1:]:  # paired: the two ran back to back in each round
        ratios = sorted(a / b for a, b in zip(results[first]["round_ms"], results[name]["round_ms"], strict=True))
        print(f"n={args.length} {first} / {name}: median of the {len(ratios)} rounds' ratios "
              f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
