"""One `zoo eval` row's average as a share of another's on the same prompts, with the paired 95 % bootstrap interval
the report gives against the full cache (:func:`zoo.eval.scoring.paired_share`), for any two rows of a record:

    .venv/bin/python scripts/paired_share.py results/eval/duo_gates_long_comparison_cpu/answers.jsonl \\
        "duo gates 128 steps 25%" "duo needle 25%"
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from zoo.eval.scoring import paired_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", help="a zoo eval answers.jsonl")
    parser.add_argument("row", help="the contestant whose share is stated")
    parser.add_argument("reference", help="the contestant it is a share of")
    args = parser.parse_args()
    cells: dict[str, dict] = defaultdict(dict)
    with open(args.answers) as handle:
        for line in handle:
            answer = json.loads(line)
            cells[answer["contestant"]][(answer["task"], answer["length"])] = answer["scores"]
    for name in (args.row, args.reference):
        if name not in cells:
            raise SystemExit(f"{args.answers} has no contestant {name!r}; it has: {', '.join(sorted(cells))}")
    shared = sorted(set(cells[args.row]) & set(cells[args.reference]))
    result = paired_share([cells[args.row][c] for c in shared], [cells[args.reference][c] for c in shared])
    if result is None:
        raise SystemExit(f"{args.reference!r} scores 0 on every shared cell: no share to state")
    print(json.dumps({"row": args.row, "reference": args.reference, "cells": len(shared), **result}))


if __name__ == "__main__":
    main()
