"""The ``zoo`` command line: ``zoo list`` (more subcommands are added by other modules)."""

from __future__ import annotations

import argparse
import sys

from zoo.registry import get_variant_class, list_variants, variant_source


def variant_table() -> list[dict[str, str]]:
    rows = []
    for name in list_variants():
        info = get_variant_class(name).describe()
        source = variant_source(name)
        rows.append(
            {
                "name": name,
                "kind": info["kind"],
                "modes": info["modes"],
                "time": info["time"],
                "memory": info["memory"],
                "params": ", ".join(f"{k}={v!r}" for k, v in info["params"].items()) or "-",
                "package": f"{source.distribution} {source.version}".strip(),
            }
        )
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
    for register in _subcommand_registrars():
        register(sub)
    return parser


def _subcommand_registrars():
    """Subcommands living in other modules (bench, push, ...) expose ``add_subcommand(subparsers)``."""
    import importlib

    for module in ("zoo.bench", "zoo.hub.push"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        yield mod.add_subcommand


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
