"""The plugin API holds still: a plugin written for plugin API 1 (attention-zoo 0.1.0) keeps working behind one
DeprecationWarning, and a plugin that crashes fails its own contract tests without breaking anyone else's.

The broken plugins (``tests/plugin_fixture_legacy``) are installed beside the built-ins in subprocesses only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from conftest import install_plugin_fixture

import zoo
from zoo.call import AttentionCall
from zoo.pattern import Pattern, PredicateOnly
from zoo.plug.backend import FlexUnavailableError, attention_backend
from zoo.testing import make_call, make_inputs, reference, run_variant

LEGACY_SRC = Path(__file__).parent / "plugin_fixture_legacy"
BROKEN = ("raising_pattern", "raising_cache")


@pytest.fixture(scope="module")
def legacy_target() -> Path:
    return install_plugin_fixture(LEGACY_SRC, "zoo_legacy_plugin")


def _env(target: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def contract_run(legacy_target, tmp_path_factory) -> dict[str, list[str]]:
    """``pytest --pyargs zoo.contract`` over sdpa, the legacy plugin and the two crashing ones: outcome per test."""
    out = tmp_path_factory.mktemp("contract")
    report = out / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "zoo.contract", "-q", "-p", "no:cacheprovider",
         "-k", "sdpa or legacy_band or " + " or ".join(BROKEN), f"--junitxml={report}"],
        cwd=out, env=_env(legacy_target), capture_output=True, text=True, timeout=900,
    )
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": [], "output": [done.stdout + done.stderr]}
    for case in ET.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes["failed" if kind in ("failure", "error") else kind].append(case.get("name"))
    return outcomes


def test_an_old_plugin_and_two_crashing_ones_do_not_break_a_built_ins_contract_run(contract_run):
    output = contract_run["output"][0]
    assert "error during collection" not in output and "ERROR collecting" not in output, output[-3000:]
    sdpa = [name for bucket in ("passed", "failed") for name in contract_run[bucket] if "[sdpa" in name]
    assert sdpa and not [name for name in contract_run["failed"] if "[sdpa" in name], output[-3000:]


def test_the_old_style_plugin_passes_its_contract_with_one_deprecation_warning(contract_run):
    legacy = [name for name in contract_run["passed"] if "[legacy_band" in name]
    assert len(legacy) >= 10 and not [name for name in contract_run["failed"] if "[legacy_band" in name]
    assert "returns a bare predicate from pattern()" in contract_run["output"][0]


@pytest.mark.parametrize("name", BROKEN)
def test_a_crashing_plugin_turns_into_its_own_failed_tests(contract_run, name):
    failed = [test for test in contract_run["failed"] if f"[{name}" in test]
    assert failed, f"{name}: no failed test"


def test_the_deprecation_warning_names_the_class_the_distribution_and_the_fix(legacy_target, monkeypatch):
    monkeypatch.syspath_prepend(str(legacy_target))
    from zoo_legacy_plugin import LegacyBandAttention

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = LegacyBandAttention().pattern(AttentionCall(causal=False, scaling=1.0), 32, 32)
    assert isinstance(pattern, PredicateOnly) and pattern.reach is None and not pattern.runs_on_flex
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    text = str(warning.message)
    assert "zoo_legacy_plugin.LegacyBandAttention" in text and "zoo-legacy-plugin" in text
    assert "return zoo.pattern.Pattern(" in text and "CHANGELOG.md" in text


def test_a_bare_predicate_runs_as_a_pattern_without_hints(legacy_target, monkeypatch):
    """Dense reference, every key cached, never Flex (forcing Flex names why)."""
    monkeypatch.syspath_prepend(str(legacy_target))
    from zoo_legacy_plugin import LegacyBandAttention

    variant = LegacyBandAttention(width=4)
    q, k, v, mask = make_inputs(n=40)
    call = make_call(False, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.testing.assert_close(run_variant(variant, q, k, v, call), reference(variant, q, k, v, call))
        assert type(variant.cache_layer(0, None)).__name__ == "DynamicLayer"
        with torch.no_grad(), attention_backend("flex"), pytest.raises(FlexUnavailableError, match="bare predicate"):
            run_variant(variant, q, k, v, call)


def test_a_pattern_that_is_neither_a_pattern_nor_a_predicate_is_refused_naming_the_fix():
    class WrongPattern(zoo.Variant):
        name = "wrong_pattern"

        def pattern(self, call, q_len, kv_len):
            return [1, 2, 3]

    with pytest.raises(TypeError, match=r"'wrong_pattern'.*returned a list.*zoo\.pattern\.Pattern"):
        WrongPattern().pattern(AttentionCall(causal=False, scaling=1.0), 8, 8)
    assert isinstance(zoo.get_variant_class("longformer")().pattern(make_call(False), 8, 8), Pattern)


def test_zoo_list_marks_broken_plugins_and_other_variants_still_train_and_generate(legacy_target, tmp_path):
    script = textwrap.dedent("""
        import torch, transformers, zoo
        from zoo.cli import variant_table
        rows = {row["name"]: row["status"] for row in variant_table()}
        print("STATUS", rows)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=64)
        zoo.configure(config, "longformer", window=8)
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, 64, (2, 20))
        model(input_ids=ids, labels=ids).loss.backward()
        print("GENERATED", model.eval().generate(ids, max_new_tokens=3, do_sample=False).shape)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(legacy_target),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    status = eval(done.stdout.split("STATUS ", 1)[1].splitlines()[0])  # a dict literal printed by the script
    assert status["raising_pattern"].startswith("broken: RuntimeError: raising_pattern: pattern() is broken")
    assert status["raising_cache"].startswith("broken: RuntimeError: raising_cache: cache_layer() is broken")
    assert status["legacy_band"] == "ok" and status["sdpa"] == "ok" and status["reformer"] == "ok"
    assert "GENERATED torch.Size([2, 23])" in done.stdout
