"""Registry: entry-point discovery (built-ins and the installed plugin fixture), in-process registration,
broken plugins and name conflicts, exercised with real dist-info metadata on sys.path."""

import subprocess
import sys
import textwrap

import pytest

import zoo
from zoo import registry


@pytest.fixture
def fresh_registry(monkeypatch):
    """Rediscover entry points from scratch and restore the registry afterwards."""
    monkeypatch.setattr(registry, "_entries", {})
    monkeypatch.setattr(registry, "_discovered", False)
    return registry


def _fake_distribution(root, dist_name, entry_points: dict[str, str], module_source: str | None = None):
    info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    lines = ["[attention_zoo.variants]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if module_source is not None:
        module = entry_points[next(iter(entry_points))].split(":")[0]
        (root / f"{module}.py").write_text(textwrap.dedent(module_source))


def test_builtin_variants_come_through_entry_points():
    names = zoo.list_variants()
    assert {"dense", "sdpa"} <= set(names)
    source = registry.variant_source("sdpa")
    assert source.distribution == "attention-zoo" and "zoo.variants.sdpa:SDPAAttention" in source.entry_point


def test_plugin_fixture_is_discovered_from_its_own_distribution():
    assert "chunked_exact" in zoo.list_variants()
    assert registry.variant_source("chunked_exact").distribution == "zoo-chunked-plugin"


def test_broken_plugin_warns_and_the_rest_still_works(fresh_registry, tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "broken-zoo-plugin", {"broken": "broken_zoo_module:Nope"},
                       "raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"'broken'.*broken-zoo-plugin.*boom at import"):
        names = fresh_registry.list_variants()
    assert "broken" not in names and "sdpa" in names
    with pytest.raises(zoo.BrokenVariantError, match="broken-zoo-plugin") as info:
        fresh_registry.get_variant_class("broken")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_two_sources_claiming_one_name_is_a_clear_error(fresh_registry, tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "rival-zoo-plugin", {"sdpa": "rival_zoo_module:RivalSDPA"}, """
        from zoo import Variant
        class RivalSDPA(Variant):
            name = "sdpa"
            def attend(self, q, k, v, call):
                return q
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="claimed by two sources"):
        assert "sdpa" not in fresh_registry.list_variants()
    with pytest.raises(zoo.VariantConflictError, match=r"attention-zoo .*rival-zoo-plugin"):
        fresh_registry.get_variant_class("sdpa")


def test_in_process_registration_and_unknown_names():
    @zoo.register_variant
    class Notebook(zoo.Variant):
        name = "notebook_variant"

        def attend(self, q, k, v, call):
            return v

    try:
        assert "notebook_variant" in zoo.list_variants()
        assert "in-process" in str(registry.variant_source("notebook_variant"))
    finally:
        zoo.unregister_variant("notebook_variant")
    with pytest.raises(zoo.UnknownVariantError, match="Did you mean 'sdpa'"):
        zoo.get_variant_class("sdpaa")


def test_zoo_list_cli_prints_every_variant():
    out = subprocess.run([sys.executable, "-m", "zoo.cli", "list"], capture_output=True, text=True, check=True).stdout
    for name in zoo.list_variants():
        assert name in out
    assert "zoo-chunked-plugin" in out and "chunk_size=256" in out
