"""The documentation states no default by hand that the code contradicts (`zoo.docs_tables`).

The variant pages, the variant index and the home page get their tables from the registry at build time (a MkDocs
hook); the README, which MkDocs does not build, holds a generated copy checked here. Hand-written prose may still
state a default; `test_hand_written_defaults_match_the_code` finds such statements by this rule and holds them to the
variant classes' ``params``:

* the parameter is written in backticks and is a parameter of a built-in variant;
* the word "default" stands next to it: `` `P=V` (default ...) ``, `` `P=V` by default ``, ``default `P=V` `` (also
  "defaults to", "the default"), `` `P` ... (..., default V ...) `` (the parenthesis right after it, at most a few
  words away), `` `P` defaults to V ``; or `` `P=V` `` sits in a table column whose header says "default";
* V is a literal (a number, a quoted string, a list, None, True, False; a bare word for a string parameter); other
  values ("the model's max_position_embeddings") are not checked, nor values for a parameter whose default is None
  (they state its meaning);
* the statement is about the variant named in backticks earlier in its sentence (a table row: its first cell), else
  the page's own variant (``docs/variants/NAME.md``), else any variant with that parameter (one must match).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from zoo import docs_tables
from zoo.docs_tables import README_END, README_START

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -m zoo.docs_tables --readme"


def hand_written_pages() -> list[Path]:
    """The user-facing pages: docs/**/*.md but the API pages (generated) and the changelog (history), and README."""
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "api" not in p.relative_to(ROOT / "docs").parts[:1]]
    return [p for p in pages if p.name != "changelog.md"] + [ROOT / "README.md"]


def page_variant(page: Path) -> str | None:
    return page.stem if page.parent == ROOT / "docs" / "variants" else None


def test_readme_variant_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    assert README_START in text and README_END in text, f"the README lost its table markers: add them, run {REGENERATE}"
    assert docs_tables.readme_with_table(text) == text, f"the README's variant table is out of date: run {REGENERATE}"


def test_every_builtin_variant_has_a_family_a_line_and_a_page():
    names = set(docs_tables.builtin_variants())
    placed = {n for _, _, members in docs_tables.by_family() for n in members}
    assert placed == names
    assert names <= set(docs_tables.ABOUT), f"add {sorted(names - set(docs_tables.ABOUT))} to zoo.docs_tables.ABOUT"
    for name in names:
        page = ROOT / "docs" / "variants" / f"{name}.md"
        assert f"<!-- params: {name} -->" in page.read_text(), f"{page} must show the generated parameter table"


def test_no_page_copies_a_parameter_table_by_hand():
    for page in hand_written_pages():
        assert "parameters (defaults) |" not in page.read_text(), f"{page}: use a generated table (zoo.docs_tables)"


def test_hand_written_defaults_match_the_code():
    wrong = [f"{page.relative_to(ROOT)} {message}" for page in hand_written_pages()
             for message in docs_tables.wrong_defaults(page.read_text(), page_variant(page))]
    assert not wrong, "pages state defaults the code does not have:\n" + "\n".join(wrong)


FAKE_PAGE = """# `longformer`

The window is `window=256` (default), and `dilation=1` by default. The default `global_projections=True` is wrong too.
For `dsa`, `top_k` (keys read, default 7) is wrong. For `budget`, `policy` defaults to `tova`.

| variant | parameters (defaults) |
|---|---|
| [`moba`](moba.md) | `block_size=128`, `top_k=3` |
"""


def test_the_checker_finds_every_drift_on_a_fake_page():
    wrong = docs_tables.wrong_defaults(FAKE_PAGE, page_variant="longformer")
    stated = {(w.split("`")[1], w.split("stated as ")[1].split(",")[0]) for w in wrong}
    assert stated == {("window", "256"), ("global_projections", "True"), ("top_k", "7"), ("policy", "`tova`"),
                      ("block_size", "128")}, wrong
    top_k = next(w for w in wrong if "`top_k`" in w)
    assert "dsa: 256" in top_k and "moba" not in top_k, "a statement is about the variant named in its sentence"


def test_the_checker_accepts_the_code_s_own_defaults():
    classes = docs_tables.builtin_variants()
    lines = [f"`{p}={docs_tables.literal(s.default)}` (default)" for n, cls in classes.items()
             for p, s in cls.params.items()]
    text = "\n\n".join(f"`{n}`: {line}." for n, line in zip(
        [n for n, cls in classes.items() for _ in cls.params], lines, strict=True))
    assert docs_tables.wrong_defaults(text) == []
    assert len(docs_tables.stated_defaults(text)) == len(lines)


@pytest.mark.parametrize(("src_uri", "prefix"), [("index.md", "variants/"), ("variants/index.md", ""),
                                                 ("guides/budget.md", "../variants/")])
def test_the_hook_expands_markers_with_links_from_the_page(src_uri, prefix):
    page = SimpleNamespace(file=SimpleNamespace(src_uri=src_uri))
    out = docs_tables.on_page_markdown("<!-- variants-by-family -->\n\n<!-- variants-table -->\n", page=page)
    assert "<!--" not in out
    assert f"[`longformer`]({prefix}longformer.md)" in out
    for family in docs_tables.FAMILIES:
        assert f"## {family}" in out


def test_a_page_table_shows_every_parameter_with_its_default():
    for name, cls in docs_tables.builtin_variants().items():
        table = docs_tables.expand(f"<!-- params: {name} -->", "")
        for pname, spec in cls.params.items():
            assert f"| `{pname}` | `{docs_tables.literal(spec.default)}` |" in table


def test_user_pages_cite_no_internal_issue_numbers():
    """Internal issue numbers mean nothing to a reader ("the goal: 5x at 32K" does); a public issue of another
    project is written with its project and ``#`` (transformers issue #31741)."""
    pattern = re.compile(r"\bissues? \d+|\(issues? \d|the issue's", re.IGNORECASE)
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for page in hand_written_pages()
             for n, line in enumerate(page.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_main_job_rows_come_from_the_latest_record_and_link_its_page():
    """Each ``<!-- main-job: ENTRY -->`` names an entry of the record, whose page exists; the record is the
    main job's own config (its entries, by name)."""
    marker = re.compile(r"<!-- main-job: ([\w.+-]+) -->")
    markers = {m for page in hand_written_pages() for m in marker.findall(page.read_text())}
    assert markers, "the variant pages quote the main job through markers"
    for entry in markers:
        row = docs_tables.main_job_row(entry, "")
        assert f"| {entry} | " in row and "](../benchmarks/" in row
    assert (ROOT / "docs" / docs_tables.MAIN_JOB_PAGE).exists()
    config = yaml.safe_load((ROOT / "recipes" / "configs" / "compare_default.yaml").read_text())
    planned = {entry.get("name", entry["variant"]) for entry in config["variants"]}
    recorded = {row["name"] for row in json.loads(docs_tables.MAIN_JOB.read_text())["summary"]}
    assert planned == recorded, f"the main job's record has {sorted(recorded)}, its config {sorted(planned)}"
    with pytest.raises(KeyError, match="has no entry 'nope'"):
        docs_tables.main_job_row("nope")
