"""The prepared GPU check without a GPU: ``scripts/gpu_check.sh --rehearse`` resolves every step (imports, the bench
argument lists, the CUDA tests' collection, writable folders, the summary; each step fits one device call), and the
wheel checks of ``scripts/gpu_tools.py`` (what ``scripts/gpu_wheels.sh`` carries) judge requirements against the GPU
machine."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = ["install", "env", "cuda-tests", "bench-patterns", "bench-content", "bench-recurrent", "decode"]
PRELUDE = ("install", "env")  # run before every step named with --steps
# the test_cuda_* tests: Flex (6 pattern cases x fp32, bf16; moba, nsa x 2 paddings), dsa's Triton kernels (fp32,
# bf16; their module skips without triton), fla's (4 kernels x (bf16, fp32 fallback) + 4 models; nsa: 2 shapes + 1)
CUDA_TESTS = 12 + 4 + (2 if importlib.util.find_spec("triton") else 0) + 15


def load_tools():
    spec = importlib.util.spec_from_file_location("gpu_tools", REPO / "scripts" / "gpu_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_the_scripts_parse_and_are_executable(script):
    path = REPO / "scripts" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert os.access(path, os.X_OK)


def test_the_rehearsal_resolves_every_step_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))  # as in CI: no .whl/
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse", str(tmp_path / "check")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=900)
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert result.returncode == 0, summary
    for step in STEPS:
        assert f"| {step} | ok | 0 |" in summary
        assert f"## {step}: ok" in summary
    budgets = dict(re.findall(r"^\| ([\w-]+) \| [^|]+ \| -?\d+ \| [\d.]+ \| (\d+) \|", summary, re.M))
    assert list(budgets) == STEPS
    prelude = sum(int(budgets[step]) for step in PRELUDE)
    for step in STEPS[len(PRELUDE):]:  # one step a device call: under 8 minutes, and with install and env under the
        assert int(budgets[step]) <= 480 and prelude + int(budgets[step]) <= 560, step  # 600 s a command allows
    assert f"{CUDA_TESTS}/" in summary and "tests collected" in summary
    assert re.search(r"\| zoo package \| imports .* \| carried \|", summary)  # the wheel, not the tree
    # (b), (c), (d): two runs each (Flex or fla or Triton, then the zoo's kernels); (e): zoo bench --decode refuses CUDA
    assert summary.count("zoo bench --dry_run: would run") == 6
    assert "not measured: zoo bench --decode refuses --device cuda" in summary
    for step in STEPS:
        assert (tmp_path / "check" / "logs" / f"{step}.log").is_file()


def make_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
                   + [f"Requires-Dist: {r}\n" for r in requires])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_wheel_requirements_are_judged_against_the_gpu_machine(tmp_path):
    tools = load_tools()
    make_wheel(tmp_path, "alpha", "1.0", ["torch>=2.10", "beta==2.0", "tqdm", 'pytest; extra == "dev"',
                                          'importlib-metadata; python_version < "3.8"'])
    make_wheel(tmp_path, "beta", "2.0", ["transformers==5.17.0"])
    make_wheel(tmp_path, "gamma", "0.1", ["torch==2.10.0", "no-such-package"])
    wheels, lines, problems = tools.check_wheels(tmp_path)
    assert [name for _, name, _ in wheels] == ["alpha", "beta", "gamma"]
    verdicts = {line.split()[1]: line.split()[2] for line in lines}
    assert verdicts == {"torch>=2.10": "ok", "beta==2.0": "ok", "tqdm": "assumed", "transformers==5.17.0": "ok",
                        "torch==2.10.0": "CONFLICT", "no-such-package": "MISSING"}
    assert problems == ["gamma needs torch==2.10.0: conflict (machine 2.11.0)",
                        "gamma needs no-such-package: missing (-)"]


def test_the_manifest_lists_each_wheel_with_its_size_and_reason(tmp_path, capsys):
    tools = load_tools()
    make_wheel(tmp_path, "alpha", "1.0", ["numpy"])
    make_wheel(tmp_path, "alpha", "1.1", [])
    manifest = tmp_path / "MANIFEST.txt"
    code = tools.main(["wheels", str(tmp_path), "--manifest", str(manifest), "--why", "alpha=because",
                       "--tree-bytes", str(70 * 2**20)])
    text = manifest.read_text()
    assert code == 1 and text == capsys.readouterr().out
    assert re.search(r"^alpha-1\.0-py3-none-any\.whl +0\.00  because$", text, re.M)
    assert "two wheels of alpha (1.0, 1.1)" in text and "over 64 MiB" in text


def test_a_stale_project_wheel_is_named(tmp_path, capsys):
    tools = load_tools()
    record = tmp_path / "attention_zoo-0.1.0.dist-info" / "RECORD"
    record.parent.mkdir()
    record.write_text("zoo/variants/dense.py,,\nattention_zoo-0.1.0.dist-info/RECORD,,\n")
    (tmp_path / "zoo" / "variants").mkdir(parents=True)
    (tmp_path / "zoo" / "variants" / "dense.py").write_text("# an older dense.py\n")
    assert tools.tree_path("zoo/variants/dense.py", {"zoo.variants": "variants"}) == "variants/dense.py"
    assert tools.main(["fresh", str(tmp_path)]) == 1
    assert "zoo/variants/dense.py" in capsys.readouterr().out


def test_bench_dry_run_checks_the_flags_without_a_gpu(capsys):
    tools = load_tools()
    args = ["zoo", "bench", "--variants", "longformer", "sdpa", "--device", "cuda", "--dtype", "bf16",
            "--lengths", "8192", "--dry_run"]
    assert tools.main(args) == 0
    assert "--device cuda --backend auto" in capsys.readouterr().out
    assert tools.main([*args, "--variant_params", "longformer.no_such_param=1"]) == 2
    assert tools.main(["zoo", "bench", "--decode", "--device", "cuda", "--dry_run"]) == 2  # decode: CPU only


def test_the_api_check_names_what_torch_or_transformers_lacks():
    tools = load_tools()
    assert tools.missing_api("torch.nn.attention.flex_attention", tools.FLEX_API) == []
    assert tools.missing_api("transformers", tools.TRANSFORMERS_API) == []
    assert tools.missing_api("transformers", {"masking_utils.no_such_mask": [], "AttentionInterface.register": [
        "no_such_keyword"]}) == ["masking_utils.no_such_mask", "AttentionInterface.register(no_such_keyword=)"]


def test_steps_selects_install_env_and_the_steps_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))

    def check(*args):
        return subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse", *args, str(tmp_path / "check")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    result = check("--steps=decode,bench-content,install")
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert result.returncode == 0, summary
    assert re.findall(r"^\| ([\w-]+) \| ok \|", summary, re.M) == ["install", "env", "bench-content", "decode"]
    result = check("--steps=no-such-step")
    assert result.returncode == 2 and "no step no-such-step" in result.stderr
