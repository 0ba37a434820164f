"""``python -m zoo.retrofit CONFIG [--output_dir DIR] [--stages stage1 stage2 eval]`` (= ``recipes/retrofit.py``)."""

from __future__ import annotations

import argparse
import logging

from zoo.retrofit.config import load_config
from zoo.retrofit.recipe import run
from zoo.retrofit.report import describe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="retrofit", description=__doc__)
    parser.add_argument("config", help="a retrofit YAML (recipes/configs/retrofit/*.yaml)")
    parser.add_argument("--output_dir", "--output-dir", default=None, help="override the config's output_dir")
    stages = ["stage1", "stage2", "eval"]
    parser.add_argument("--stages", nargs="+", default=stages, choices=stages,
                        help="stage 1 always runs (or is read back); leave out stage2 / eval to skip them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    summary = run(load_config(args.config, {"output_dir": args.output_dir}), tuple(args.stages))
    print(describe(summary))


if __name__ == "__main__":
    main()
