"""Which part of the passkey prompt a ``duo`` layout misses: the passkey benchmark's prompt (:mod:`zoo.bench.passkey`)
at 1,024 tokens with one part changed at a time, answered greedily by the full model and by a ``duo`` layout, the key
found or not. A probe for docs/guides/memory-frontier.md, not a benchmark: few prompts, one seed.

    .venv/bin/python scripts/passkey_wording_probe.py --heads results/duo_passkey/heads.json --method needle \\
        --share 0.25 --output results/eval/duo_passkey_wording/probe.jsonl

Wordings: ``original``; ``no_header`` (the benchmark's header left out); ``key_once`` (the needle states the key
once); ``named`` (needle and question name what the key opens: "The pass key of the blue door is …" / "What is the
pass key of the blue door? The pass key of the blue door is"). With ``--eval-prompts`` (a ``zoo eval`` run's
``prompts.jsonl``) instead: that run's passkey prompts of ``--length`` as they are (``eval``, the question on a line of
its own) and with the line break before the question made a space (``eval_space``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from zoo.bench import passkey as bench
from zoo.data.pretrained import smollm2
from zoo.plug.install import configure

WORDINGS = {
    "original": (bench.HEADER, bench.NEEDLE, bench.QUESTION),
    "no_header": ("", bench.NEEDLE, bench.QUESTION),
    "key_once": (bench.HEADER, "The pass key is {key}. Remember it. ", bench.QUESTION),
    "named": (bench.HEADER, "The pass key of the blue door is {key}. Remember it. ",
              "What is the pass key of the blue door? The pass key of the blue door is"),
}


def prompt(tokenizer, wording: str, length: int, depth: float, key: int) -> list[int]:
    """``length`` token ids: the wording's header, the benchmark's filler with its needle at ``depth``, its question."""
    header, needle, question = WORDINGS[wording]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids if text else []

    head, needle_ids, question_ids, filler = ids(header), ids(needle.format(key=key)), ids(question), ids(bench.FILLER)
    room = length - len(head) - len(needle_ids) - len(question_ids)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(depth * room)
    return head + body[:cut] + needle_ids + body[cut:] + question_ids


def eval_cases(path: str, tokenizer, length: int) -> list[tuple[str, list[int], int, float]]:
    """(wording, ids, key, depth) of the run's passkey prompts: as they are, and with a space before the question."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    rows = [row for row in rows if row["task"] == "passkey" and row["length"] == length]
    line = tokenizer("\n" + bench.QUESTION, add_special_tokens=False).input_ids
    space = tokenizer(" " + bench.QUESTION, add_special_tokens=False).input_ids
    cases = []
    for row in rows:
        if row["ids"][-len(line):] != line:
            raise ValueError(f"{path}: a passkey prompt that does not end with its question on a line of its own")
        key = int(row["answers"][0])
        cases += [("eval", row["ids"], key, row["depth"]), ("eval_space", row["ids"][: -len(line)] + space, key,
                                                            row["depth"])]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="a recipes/duo.py heads.json")
    parser.add_argument("--method", default="needle")
    parser.add_argument("--share", default="0.25")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    parser.add_argument("--keys", type=int, default=2, help="keys per depth")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sinks", type=int, default=4, help="streaming heads' first tokens (the first runs: 4)")
    parser.add_argument("--recent", type=int, default=256, help="the streaming heads' last tokens")
    parser.add_argument("--eval-prompts", help="a zoo eval run's prompts.jsonl: its passkey prompts instead")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    full_heads = json.loads(Path(args.heads).read_text())["chosen"][args.method][args.share]
    model, tokenizer = smollm2()
    rng = random.Random(args.seed)
    drawn = [(depth, rng.randrange(10**4, 10**5)) for depth in args.depths for _ in range(args.keys)]
    cases = (eval_cases(args.eval_prompts, tokenizer, args.length) if args.eval_prompts else
             [(w, prompt(tokenizer, w, args.length, depth, key), key, depth) for w in WORDINGS for depth, key in drawn])
    rows = []
    for contestant in ("full cache", f"duo {args.method} {args.share} sinks {args.sinks} recent {args.recent}"):
        if contestant == "full cache":
            model.set_attn_implementation("sdpa")
        else:
            configure(model, "duo", full_heads=full_heads, sinks=args.sinks, recent=args.recent)
        for wording, ids, key, depth in cases:
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=bench.NEW_TOKENS, do_sample=False)
            answer = tokenizer.decode(out[0, len(ids):])
            rows.append({"contestant": contestant, "wording": wording, "depth": depth, "key": key,
                         "found": str(key) in answer, "answer": answer})
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(json.dumps(row) + "\n" for row in rows))
    for contestant in dict.fromkeys(row["contestant"] for row in rows):
        mine = [row for row in rows if row["contestant"] == contestant]
        wordings = dict.fromkeys(row["wording"] for row in mine)
        print(contestant, {w: f"{sum(r['found'] for r in mine if r['wording'] == w)}/"
                              f"{sum(r['wording'] == w for r in mine)}" for w in wordings})


if __name__ == "__main__":
    main()
