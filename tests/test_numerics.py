"""Pinning the CPU code paths of a comparison's runs (``cpu_isa``): the environment reaches the launched process,
takes effect in torch there, is recorded in results.json, and a bad value is refused before any run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zoo.training import compare_launch, compare_plan
from zoo.training.compare_plan import Run
from zoo.training.numerics import CPU_ISA_ENV, numerics_record, pinned_env

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import json, sys, torch; from zoo.training.numerics import numerics_record; "
         "json.dump({'numerics': numerics_record()}, open(sys.argv[1], 'w'))")


def test_pinned_env_names_atens_dispatch_and_mkls_reproducible_branch():
    assert pinned_env(None) == {}
    assert pinned_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
    pinned_env("avx2")["MKL_CBWR"] = "changed"  # a copy: the table stays as it is
    assert CPU_ISA_ENV["avx2"]["MKL_CBWR"] == "AVX2"
    with pytest.raises(ValueError, match=r"cpu_isa 'avx512' is not known; use one of 'avx2'"):
        pinned_env("avx512")


def test_a_compare_config_with_an_unknown_cpu_isa_is_refused_when_read(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump({"cpu_isa": "sse9", "variants": [{"variant": "sdpa"}],
                                    "tasks": [{"name": "mqar", "config": "recipes/configs/mqar/llama_cpu.yaml"}]}))
    with pytest.raises(ValueError, match="cpu_isa 'sse9' is not known"):
        compare_plan.load_compare_config(str(path))


def test_the_record_names_the_paths_this_process_takes():
    record = numerics_record()
    assert record["aten_cpu_capability"] == __import__("torch").backends.cpu.get_cpu_capability()
    assert record["threads"] >= 1 and set(record) >= {"cpu", "env"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="x86 dispatch levels")
def test_the_pinned_environment_reaches_the_launched_run_and_takes_effect(tmp_path, monkeypatch):
    """The launch runs a probe in place of the fine-tune: it must see the pins, and torch must obey them."""
    run_dir = tmp_path / "runs" / "seed0"
    monkeypatch.setattr(compare_launch, "command_for",
                        lambda config, launcher: [sys.executable, "-c", PROBE, str(run_dir / "results.json")])
    run = Run("mqar", "sdpa", 0, {"variant": "sdpa"}, run_dir)
    outcome = compare_launch.launch(run, None, 120, pinned_env("avx2"))
    assert outcome.status == "ok", outcome.error
    record = json.loads((run_dir / "results.json").read_text())["numerics"]
    assert record["env"]["MKL_CBWR"] == "AVX2" and record["aten_cpu_capability"] in ("AVX2", "DEFAULT")
    unpinned = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert unpinned != "AVX2" or record["aten_cpu_capability"] == "AVX2"  # pinned at most to AVX2
