"""The ``zoo`` command line: ``zoo list`` (more subcommands are added by other modules)."""

from __future__ import annotations

import argparse
import sys

from zoo import bench
from zoo.eval import cli as eval_cli
from zoo.hub import push
from zoo.registry import get_variant_class, names_with_sources, problem, source_of


def variant_table() -> list[dict[str, str]]:
    """One row per announced variant; a broken one (it fails to import, or raises when built, asked for its pattern
    or its cache) says so with the reason, and the others are listed as usual."""
    rows = []
    for name in names_with_sources():
        source = source_of(name)
        row = {"name": name, "kind": "-", "modes": "-", "time": "-", "memory": "-", "params": "-",
               "package": f"{source.distribution} {source.version}".strip()}
        reason = problem(name)
        if reason is None:
            info = get_variant_class(name).describe()
            row.update(kind=info["kind"], modes=info["modes"], time=info["time"], memory=info["memory"],
                       params=", ".join(f"{k}={v!r}" for k, v in info["params"].items()) or "-")
        row["status"] = "ok" if reason is None else f"broken: {reason}"
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no variants)"
    headers = list(rows[0])
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in headers}
    lines = ["  ".join(h.ljust(widths[h]) for h in headers), "  ".join("-" * widths[h] for h in headers)]
    lines += ["  ".join(str(r[h]).ljust(widths[h]) for h in headers) for r in rows]
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    print(format_table(variant_table()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description="attention-zoo: long-context attention variants")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="table of the available attention variants")
    p.set_defaults(func=cmd_list)
    for module in (bench, eval_cli, push):  # subcommands living in other modules expose add_subcommand(subparsers)
        module.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
