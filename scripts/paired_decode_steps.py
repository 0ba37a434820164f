"""Paired per-step decode timing: the decode benchmark's tiny models (``zoo bench --decode``), prefilled once each
in one process, then timed forward step by forward step in interleaved rounds, so host noise falls on every
contestant alike. A check beside ``zoo bench --decode`` (one fresh process and one ``generate`` per cell).

    .venv/bin/python scripts/paired_decode_steps.py 32768 longformer mistral_sliding_window xformers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from zoo.bench.decode import PEERS, DecodeContestant, DecodeSettings, build_model, decode_params
from zoo.cache import ZooCache
from zoo.plug.spec import variant_for


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
    running, times = {}, {name: [] for name in args.contestants}
    rounds = {name: [] for name in args.contestants}  # each round's median step, per contestant
    with torch.inference_mode():
        for name in args.contestants:
            contestant = DecodeContestant(name, "peer") if name in PEERS else \
                DecodeContestant(name, "zoo", name, decode_params(name, args.window))
            model = build_model(contestant, settings, args.length)
            cache = DynamicCache(config=model.config) if name in PEERS else ZooCache(variant_for(model.config),
                                                                                     model.config)
            logits = model(prompt, cache=cache, use_cache=True).logits
            running[name] = [model, cache, logits[:, -1:].argmax(-1), torch.ones(1, args.length + 1, dtype=torch.long)]
        for round_ in range(args.rounds):
            for name in args.contestants if round_ % 2 == 0 else args.contestants[::-1]:
                model, cache, token, mask = running[name]
                for _ in range(args.steps):
                    start = time.perf_counter()
                    token = model(token, cache=cache, attention_mask=mask, use_cache=True).logits.argmax(-1)
                    times[name].append(time.perf_counter() - start)
                    mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
                running[name][2:] = [token, mask]
                rounds[name].append(statistics.median(times[name][-args.steps :]))
    first = args.contestants[0]
    for name in args.contestants:
        print(f"n={args.length} {name}: median {1e3 * statistics.median(times[name]):.3f} ms per step "
              f"over {len(times[name])} steps")
    for name in args.contestants[1:]:  # paired: the two ran back to back in each round
        ratios = sorted(a / b for a, b in zip(rounds[first], rounds[name], strict=True))
        print(f"n={args.length} {first} / {name}: median of the {len(ratios)} rounds' ratios "
              f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
