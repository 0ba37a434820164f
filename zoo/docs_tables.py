"""Variant tables for the documentation, generated from the registry so that no page restates a default by hand.

Three uses of the same functions:

* a MkDocs hook (``hooks:`` in mkdocs.yml): `on_page_markdown` replaces markers in a page with tables at build time:
  ``<!-- params: NAME -->`` (a variant page: its kind, modes, complexity and parameter table),
  ``<!-- variants-table -->`` (the variant index, one table per family), ``<!-- variants-by-family -->`` (the home
  page: the variants of each family on one line) and ``<!-- main-job: ENTRY -->`` (an entry's row of the latest main
  job, read from its committed record `MAIN_JOB`);
* the README, which MkDocs does not build: its table lies between ``<!-- variants-table:start -->`` and
  ``<!-- variants-table:end -->``; ``python -m zoo.docs_tables --readme`` rewrites it, ``tests/test_docs.py`` fails
  when it differs;
* `stated_defaults` finds the defaults a hand-written page states (``tests/test_docs.py`` holds them to the code).

Defaults, types and bounds come from each variant class's ``params`` (`zoo.variant.Param`); kind, modes and
complexity from its class attributes. What this module adds is what the classes do not say: each built-in variant's
family, a one-line description and its paper (`FAMILIES`, `ABOUT`).
"""

from __future__ import annotations

import argparse
import ast
import json
import posixpath
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.registry import IN_PROCESS, get_variant_class, names_with_sources, source_of
from zoo.variant import Param, Variant

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_START, README_END = "<!-- variants-table:start -->", "<!-- variants-table:end -->"
# The latest fresh-clone run of the main job (recipes/configs/compare_default.yaml): the one record pages quote.
MAIN_JOB = ROOT / "results" / "recall" / "main_job_2026-12-05" / "results.json"
MAIN_JOB_PAGE = "benchmarks/2026-12-05-main-job.md"

FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "Exact patterns": (
        "softmax attention restricted to a fixed pattern (a window, blocks, strides), equal to the dense reference",
        ("dense", "sdpa", "xformers", "longformer", "bigbird", "sparse_transformer"),
    ),
    "Trainable sparse": (
        "softmax over the keys the content selects (blocks, an indexer), exact for their own selection",
        ("moba", "nsa", "dsa"),
    ),
    "Approximate": (
        "random features, kernels, hashing or low rank in place of softmax, within a stated error bound",
        ("performer", "linear", "reformer", "nystromformer", "linformer"),
    ),
    "Recurrent": (
        "a fixed-size state per head, corrected or decayed by gates: constant memory per decoded token",
        ("deltanet", "gated_deltanet", "gla", "based"),
    ),
    "Composite": (
        "built from the others: a variant per layer or per head, or a bounded KV cache around an exact variant",
        ("hybrid", "budget", "duo", "window_state"),
    ),
}

ABOUT: dict[str, tuple[str, str]] = {
    "dense": ("softmax attention that materializes the scores: the readable reference", "–"),
    "sdpa": ("`torch.nn.functional.scaled_dot_product_attention`: the dense baseline", "–"),
    "xformers": ("xformers' memory-efficient attention on CUDA, padding packed away; optional window",
                 "[Rabe & Staats 2021](https://arxiv.org/abs/2112.05682)"),
    "longformer": ("sliding window + global tokens; converts transformers Longformer checkpoints",
                   "[Beltagy et al. 2020](https://arxiv.org/abs/2004.05150)"),
    "bigbird": ("block-sparse window + global + random blocks (ITC), the same layout in train and eval",
                "[Zaheer et al. 2020](https://arxiv.org/abs/2007.14062)"),
    "sparse_transformer": ("strided and fixed factorized patterns", "[Child et al. 2019](https://arxiv.org/abs/1904.10509)"),
    "performer": ("FAVOR+ positive orthogonal random features",
                  "[Choromanski et al. 2021](https://arxiv.org/abs/2009.14794)"),
    "linear": ("linear attention, φ(x) = elu(x) + 1, or Hedgehog's learned softmax feature maps",
               "[Katharopoulos et al. 2020](https://arxiv.org/abs/2006.16236); "
               "[Zhang et al. 2024 (Hedgehog)](https://arxiv.org/abs/2402.04347)"),
    "deltanet": ("delta rule S ← (I − βkkᵀ)S + βkvᵀ, chunkwise kernel, short convolution",
                 "[Schlag et al. 2021](https://arxiv.org/abs/2102.11174); "
                 "[Yang et al. 2024](https://arxiv.org/abs/2406.06484)"),
    "gated_deltanet": ("the delta rule with Mamba2's per-head decay", "[Yang et al. 2025](https://arxiv.org/abs/2412.06464)"),
    "gla": ("gated linear attention (per channel; scalar = Mamba2/SSD; fixed = RetNet)",
            "[Yang et al. 2024](https://arxiv.org/abs/2312.06635)"),
    "based": ("linear attention with a 2nd-order Taylor feature map; pair with a window layer in `hybrid`",
              "[Arora et al. 2024](https://arxiv.org/abs/2402.18668)"),
    "reformer": ("LSH attention with shared query-key", "[Kitaev et al. 2020](https://arxiv.org/abs/2001.04451)"),
    "nystromformer": ("Nyström approximation with segment-mean landmarks",
                      "[Xiong et al. 2021](https://arxiv.org/abs/2102.03902)"),
    "linformer": ("keys and values projected along the sequence by learned E, F",
                  "[Wang et al. 2020](https://arxiv.org/abs/2006.04768)"),
    "moba": ("content-chosen blocks: each query reads its own block and the top-k earlier blocks whose mean key "
             "matches it best; no learned weights", "[Lu et al. 2025](https://arxiv.org/abs/2502.13189)"),
    "dsa": ("a learned lightning indexer picks each query's top-k keys; trained by KL to the attention it serves",
            "[DeepSeek-AI 2025](https://github.com/deepseek-ai/DeepSeek-V3.2-Exp)"),
    "nsa": ("Native Sparse Attention: compressed blocks, the blocks their scores select and a window, mixed by learned "
            "gates", "[Yuan et al. 2025](https://arxiv.org/abs/2502.11089)"),
    "hybrid": ("a different variant in each layer (local-global, Based-style window + linear)", "–"),
    "budget": ("a bounded KV cache for a pretrained model as it stands: sinks + recent + scored keys",
               "[StreamingLLM](https://arxiv.org/abs/2309.17453), [TOVA](https://arxiv.org/abs/2401.06104), "
               "[H2O](https://arxiv.org/abs/2306.14048), [SnapKV](https://arxiv.org/abs/2404.14469)"),
    "duo": ("a head-level layout: some KV heads keep every key, the others sinks + recent keys (prefill and cache)",
            "[Xiao et al. 2024 (DuoAttention)](https://arxiv.org/abs/2410.10819)"),
    "window_state": ("a softmax window and a recurrent state in one layer: the state holds the keys that left the "
                     "window (one normalizer, or a learned mix)",
                     "[LoLCATs](https://arxiv.org/abs/2410.10254), [Liger](https://arxiv.org/abs/2503.01496)"),
}


def builtin_variants() -> dict[str, type[Variant]]:
    """``{name: class}`` of the variants this repository ships (``zoo.variants``), plugins left out; a built-in
    variant that fails to import raises (`zoo.registry.BrokenVariantError`) rather than leave the docs."""
    names = [n for n in names_with_sources() if source_of(n).distribution != IN_PROCESS
             and source_of(n).entry_point.split("=")[-1].strip().startswith("zoo.variants.")]
    return {name: get_variant_class(name) for name in names}


def by_family() -> list[tuple[str, str, list[str]]]:
    """``(family, description, names)`` in reading order; a built-in variant in no family is an error."""
    names = builtin_variants()
    placed = {n for _, members in FAMILIES.values() for n in members}
    missing = sorted(set(names) - placed)
    if missing:
        raise KeyError(f"zoo.docs_tables: built-in variants {missing} belong to no family: add them to FAMILIES")
    return [(family, text, [n for n in members if n in names]) for family, (text, members) in FAMILIES.items()]


# ------------------------------------------------------------------------------------------------------
# formatting


def literal(value: Any) -> str:
    """A Python value as the docs write it: strings in double quotes, lists of literals."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_of(spec: Param) -> str:
    if spec.list_of is not None:
        kind = f"list of {spec.list_of.__name__}"
    elif isinstance(spec.type, tuple):
        kind = " or ".join(t.__name__ for t in spec.type)
    else:
        kind = spec.type.__name__
    return kind + (" or None" if spec.optional else "")


def _bounds_of(spec: Param) -> str:
    parts = []
    if spec.choices is not None:
        parts.append("one of " + ", ".join(f"`{literal(c)}`" for c in spec.choices))
    if spec.min is not None and spec.max is not None:
        parts.append(f"{spec.min} to {spec.max}")
    elif spec.min is not None:
        parts.append(f"≥ {spec.min}")
    elif spec.max is not None:
        parts.append(f"≤ {spec.max}")
    if spec.per_layer:
        parts.append("or a list, one per layer")
    return "; ".join(parts) or "–"


def _table(header: list[str], rows: Iterable[list[str]], align: list[str] | None = None) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align or ["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(_cell(c) if i else c for i, c in enumerate(row)) + " |" for row in rows]
    return "\n".join(lines)


def _modes(cls: type[Variant]) -> str:
    if cls.supports_causal and cls.supports_bidirectional:
        return "both"
    return "causal" if cls.supports_causal else "bidirectional"


def _defaults(cls: type[Variant]) -> str:
    return ", ".join(f"`{name}={literal(spec.default)}`" for name, spec in cls.params.items()) or "–"


def params_table(name: str) -> str:
    """A variant page's header: kind, modes and complexity, then one row per parameter."""
    cls = builtin_variants().get(name) or get_variant_class(name)
    head = _table(["kind", "causal / bidirectional", "time", "memory"],
                  [["exact" if cls.exact else "approximate", _modes(cls), cls.time_complexity, cls.memory_complexity]])
    if not cls.params:
        return head + "\n\nNo parameters."
    rows = [[f"`{p}`", f"`{literal(s.default)}`", _type_of(s), _bounds_of(s), s.doc] for p, s in cls.params.items()]
    return head + "\n\n" + _table(["parameter", "default", "type", "allowed", "meaning"], rows)


def _link(name: str, prefix: str) -> str:
    return f"[`{name}`]({prefix}{name}.md)"


def variants_table(prefix: str = "") -> str:
    """The variant index: a section per family, one row per variant; links are ``prefix + name + .md``."""
    classes = builtin_variants()
    parts = []
    for family, text, names in by_family():
        rows = []
        for name in names:
            cls, (what, paper) = classes[name], ABOUT.get(name, ("", "–"))
            rows.append([_link(name, prefix), "exact" if cls.exact else "approximate", _modes(cls),
                         f"{cls.time_complexity} / {cls.memory_complexity}", _defaults(cls), what, paper])
        header = ["variant", "kind", "causal / bidirectional", "time / memory", "parameters (defaults)", "what it is",
                  "paper"]
        parts.append(f"## {family}\n\n{text[0].upper()}{text[1:]}.\n\n{_table(header, rows)}")
    return "\n\n".join(parts)


def family_list(prefix: str = "variants/") -> str:
    """The home page's list: one line per family naming its variants."""
    return "\n".join(f"- **{family}**: " + ", ".join(_link(n, prefix) for n in names) + f" — {text}."
                     for family, text, names in by_family())


def readme_table() -> str:
    """The README's table: family, variant, what it is, paper."""
    rows = [[family if i == 0 else "", _link(name, "docs/variants/"), *ABOUT.get(name, ("", "–"))]
            for family, _, names in by_family() for i, name in enumerate(names)]
    return _table(["family", "variant", "what it is", "paper"], rows)


def main_job_row(entry: str, prefix: str = "") -> str:
    """One entry of the main job's record: accuracy over seeds, accuracy by query-key distance, decoding state; a
    link to the run's page (``prefix`` leads from the page to docs/variants/)."""
    summary = {row["name"]: row for row in json.loads(MAIN_JOB.read_text())["summary"]}
    if entry not in summary:
        raise KeyError(f"zoo.docs_tables: the main job ({MAIN_JOB.relative_to(ROOT)}) has no entry {entry!r}; "
                       f"it has {sorted(summary)}")
    row = summary[entry]
    buckets = [b for b in row["accuracy_by_distance"] if b["answers"]]
    cells = [entry, f"{row['eval_accuracy']:.3f} ± {row['eval_accuracy_std']:.3f}",
             *(f"{b['accuracy']:.3f}" for b in buckets), f"{row['decoding_state_bytes']:,.0f} B"]
    header = ["entry", f"accuracy ({row['seeds_ok']} seeds)", *(b["bucket"] for b in buckets), "decoding state"]
    page = posixpath.normpath(posixpath.join(prefix, "..", MAIN_JOB_PAGE))
    return (_table(header, [cells], ["---"] + ["---:"] * (len(header) - 1))
            + f"\n\nThe whole table, its seeds and the machine: [the main job]({page}).")


# ------------------------------------------------------------------------------------------------------
# the MkDocs hook and the README

MARKER = re.compile(r"<!-- (params: (?P<name>\w+)|main-job: (?P<entry>[\w.+-]+)|variants-table|variants-by-family) -->")


def expand(markdown: str, prefix: str) -> str:
    """``markdown`` with each marker replaced by its table; ``prefix`` leads from the page to docs/variants/."""
    def table(match: re.Match) -> str:
        if match.group("name"):
            return params_table(match.group("name"))
        if match.group("entry"):
            return main_job_row(match.group("entry"), prefix)
        return variants_table(prefix) if match.group(1) == "variants-table" else family_list(prefix)

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs hook: expand the markers of one page (`expand`)."""
    folder = posixpath.dirname(page.file.src_uri)
    prefix = posixpath.relpath("variants", folder or ".") + "/"
    return expand(markdown, "" if prefix == "./" else prefix)


def readme_with_table(text: str) -> str:
    """``text`` (the README) with the generated table between its two markers."""
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    return text[:start] + "\n" + readme_table() + "\n" + text[end:]


# ------------------------------------------------------------------------------------------------------
# defaults stated by hand

_VALUE = r"""(?:"[^"]*"|'[^']*'|\[[^\]]*\]|-?\d[\d_.]*(?:e-?\d+)?|None|True|False|`[^`]+`)"""
_STATEMENTS = [
    re.compile(r"`(?P<p>\w+)=(?P<v>[^`]+)`\s*\((?:the )?defaults?\b"),  # `window=512` (default)
    re.compile(r"\b[Dd]efaults?(?:\s+(?:is|to|of|value))*:?\s+`(?P<p>\w+)=(?P<v>[^`]+)`"),  # default `top_k=256`
    re.compile(r"`(?P<p>\w+)(?:=[^`]*)?`[^()|`.;]{0,25}\((?:[^()|]*?[,;:]\s*)??defaults?(?:\s+is|\s+to)?:?\s+"
               rf"(?P<v>{_VALUE})"),  # `k` (projected length, default 256)
    re.compile(rf"`(?P<p>\w+)`\s+defaults\s+to\s+(?P<v>{_VALUE})"),  # `policy` defaults to `snapkv`
    re.compile(r"`(?P<p>\w+)=(?P<v>[^`]+)`\s+by\s+default\b"),  # `window=512` by default
]
_NOT_CHECKABLE = object()


@dataclass(frozen=True)
class Statement:
    """A default a page states: where, the parameter, the value as written and the variants it may be about."""

    line: int
    param: str
    written: str
    variants: tuple[str, ...]


def _parse(written: str, spec: Param) -> Any:
    text = written.strip().strip("`")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        takes_str = spec.type is str or (isinstance(spec.type, tuple) and str in spec.type)
        return text if takes_str and re.fullmatch(r"[\w.-]+", text) else _NOT_CHECKABLE


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return value == default


def _candidates(param: str, classes: dict[str, type[Variant]], named_in: str, page_variant: str | None) -> tuple:
    """The variants a statement about ``param`` may be about: those named in backticks in ``named_in``, else the
    page's own variant, else every variant with that parameter (empty: not a variant parameter)."""
    candidates = tuple(n for n, cls in classes.items() if param in cls.params)
    named = tuple(n for n in candidates if f"`{n}`" in named_in)
    own = (page_variant,) if page_variant in candidates else ()
    return named or own or candidates


def _table_statements(text: str, classes: dict[str, type[Variant]], page_variant: str | None) -> list[Statement]:
    """`` `P=V` `` in the cells under a table header that says "default", about the variant of the row's first cell."""
    found, header, columns = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = line.strip().strip("|").split("|")
        if header is None:
            header, columns = cells, [i for i, c in enumerate(cells) if "default" in c.lower()]
            continue
        for i in columns:
            for match in re.finditer(r"`(?P<p>\w+)=(?P<v>[^`]+)`", cells[i] if i < len(cells) else ""):
                variants = _candidates(match.group("p"), classes, cells[0], page_variant)
                if variants:
                    found.append(Statement(number, match.group("p"), match.group("v"), variants))
    return found


def stated_defaults(text: str, page_variant: str | None = None) -> list[Statement]:
    """Every statement of a built-in variant parameter's default in ``text``: the phrases of `_STATEMENTS` (the
    parameter in backticks, the word "default" next to it) and `` `P=V` `` in a table column headed "default...".
    A statement is about the variants named in backticks earlier in its sentence (a table row: its first cell), else
    the page's own variant (``page_variant``), else every variant with that parameter."""
    classes = builtin_variants()
    found = _table_statements(text, classes, page_variant)
    for pattern in _STATEMENTS:
        for match in pattern.finditer(text):
            sentence = re.split(r"[.!?]\s|\n\s*\n", text[: match.start()])[-1]
            variants = _candidates(match.group("p"), classes, sentence, page_variant)
            if variants:
                line = text.count("\n", 0, match.start()) + 1
                found.append(Statement(line, match.group("p"), match.group("v"), variants))
    return found


def wrong_defaults(text: str, page_variant: str | None = None) -> list[str]:
    """The statements of `stated_defaults` whose value is no candidate variant's default, as messages. A value that
    is not a literal is not checked, nor a non-None value for a parameter whose default is None (its meaning,
    e.g. longformer's ``global_tokens``: ``[0]`` bidirectional)."""
    classes = builtin_variants()
    wrong = []
    for st in stated_defaults(text, page_variant):
        specs = {n: classes[n].params[st.param] for n in st.variants}
        values = [_parse(st.written, spec) for spec in specs.values()]
        if any(v is _NOT_CHECKABLE for v in values):
            continue
        if any(spec.default is None or _same(v, spec.default) for v, spec in zip(values, specs.values(), strict=True)):
            continue
        code = ", ".join(f"{n}: {literal(s.default)}" for n, s in specs.items())
        wrong.append(f"line {st.line}: `{st.param}` default stated as {st.written}, the code says {code}")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.docs_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", action="store_true", help="rewrite the README's variant table")
    args = parser.parse_args(argv)
    if args.readme:
        README.write_text(readme_with_table(README.read_text()))
        print(f"wrote the variant table of {README}")
    else:
        print(readme_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
