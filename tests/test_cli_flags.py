"""One spelling of multi-word flags across `zoo bench`, the fine-tune and the compare recipes: `--output_dir`
(the Hugging Face convention), with the hyphenated `--output-dir` accepted as an alias."""

from pathlib import Path

import pytest

from zoo.training import compare
from zoo.training.config import parse_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--output_dir", "--output-dir"])
def test_finetune_takes_both_spellings(flag):
    config = parse_config([str(REPO / "recipes/configs/smoke.yaml"), flag, "outputs/elsewhere",
                                 "--max_steps", "3", "--overwrite-output-dir", "true"])
    assert config.output_dir == "outputs/elsewhere" and config.max_steps == 3 and config.overwrite_output_dir


@pytest.mark.parametrize("flag", ["--output_dir", "--output-dir"])
def test_compare_takes_both_spellings(flag, monkeypatch):
    called = {}
    monkeypatch.setattr(compare, "compare", lambda *args: called.update(args=args) or [])  # a summary: no run failed
    compare.main(["recipes/configs/compare_smoke.yaml", flag, "outputs/elsewhere", "--overwrite"])
    assert called["args"] == ("recipes/configs/compare_smoke.yaml", "outputs/elsewhere", True)


@pytest.mark.parametrize("flag", ["--output_dir", "--output-dir"])
def test_eval_takes_both_spellings(flag, monkeypatch):
    from zoo.eval import cli  # noqa: PLC0415

    called = {}
    monkeypatch.setattr(cli, "run", lambda config, **kw: called.update(config=config, **kw) or config.output_dir)
    cli.main(["recipes/configs/eval/smollm2_cpu.yaml", flag, "outputs/elsewhere", "--dry-run"])
    assert str(called["config"].output_dir) == "outputs/elsewhere" and called["dry_run"]
