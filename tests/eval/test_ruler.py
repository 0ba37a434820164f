"""RULER's own tasks in ``zoo eval`` (zoo/eval/ruler.py) equal lm-evaluation-harness on the same samples: the
prompt ids HFLM feeds the model, the greedy outputs and the per-sample scores, on a tiny random Llama with SmolLM2's
tokenizer; RULER's scoring equals lm-eval's; the refusals come before any model is loaded."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")
pytest.importorskip("nltk")
pytest.importorskip("wonderwords")

from zoo.eval import ruler  # noqa: E402
from zoo.eval.cli import main  # noqa: E402
from zoo.eval.config import EvalConfigError, load_config  # noqa: E402
from zoo.eval.scoring import score  # noqa: E402
from zoo.reporting import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 1024
LIMIT = 2
# a repeat haystack, a haystack of needles with UUIDs, variable tracking (NumPy's seed), common words, and an essay
# task with the held-out books standing in on both sides
TASKS = ["niah_single_1", "niah_multikey_3", "ruler_vt", "ruler_cwe", "niah_single_2"]


@pytest.fixture(scope="module")
def tiny_folder(tiny_smollm2_llama):
    return tiny_smollm2_llama(layers=2, max_positions=2048)


@pytest.fixture(scope="module")
def zoo_rows(tiny_folder, tmp_path_factory):
    """``zoo eval`` on the RULER tasks: the full cache only, one sample per batch as lm-eval's default."""
    out = tmp_path_factory.mktemp("ruler") / "run"
    path = out.parent / "eval.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(tiny_folder), "output_dir": str(out), "lengths": [LENGTH], "samples": LIMIT, "threads": 1,
        "batch": 1, "tasks": [{"source": "ruler", "tasks": TASKS, "essays": "books"}],
        "contestants": [{"family": "full"}]}))
    assert main([str(path), "--stages", "answers", "report"]) == 0
    prompts = {(r["task"], r["index"]): r for r in read_jsonl(out / "prompts.jsonl")}
    return prompts, {r["task"]: r for r in read_jsonl(out / "answers.jsonl")}, out


def lm_eval_run(folder, task: str) -> tuple[list[list[int]], list[dict]]:
    """lm-eval itself on one task (``lm_eval --tasks TASK --limit 2 --apply_chat_template``): the ids its HFLM fed
    the model, and its logged samples."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), batch_size=1, device="cpu")
    fed = []
    generate = lm._model_generate

    def recording(context, *args, **kwargs):
        fed.append(context[0].tolist())
        return generate(context, *args, **kwargs)

    lm._model_generate = recording
    note = {}
    ruler.sentence_model()
    with ruler.essay_haystack("books", note):  # and lm-eval's RULER modules imported afresh, as in a new process
        results = simple_evaluate(model=lm, tasks=[task], limit=LIMIT, apply_chat_template=True, log_samples=True,
                                  metadata={"max_seq_lengths": [LENGTH], "pretrained": str(folder)})
    return fed, sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.parametrize("task", TASKS)
def test_zoo_eval_equals_lm_eval_sample_by_sample(task, tiny_folder, zoo_rows):
    prompts, rows, _ = zoo_rows
    fed, logged = lm_eval_run(tiny_folder, task)
    row = rows[task]
    assert "error" not in row, row.get("error")
    assert row["scoring"] == "ruler" and len(logged) == LIMIT == row["n"]
    for index, sample in enumerate(logged):
        prompt = prompts[(task, index)]
        assert prompt["answers"] == sample["target"] or prompt["answers"] == sample["doc"]["outputs"]
        assert prompt["ids"] in fed, f"{task} #{index}: the zoo's prompt is not one lm-eval fed its model"
        assert row["outputs"][index] == sample["resps"][0][0]
        assert row["scores"][index] == sample[str(LENGTH)]
        assert prompt["new_tokens"] == sample["arguments"][0][1]["max_gen_toks"]
    if task == "niah_single_2":
        assert prompts[(task, 0)]["meta"]["haystack"] == "essay→book"


def test_the_comparison_script_runs_lm_evals_cli_with_the_books_and_finds_it_equal(zoo_rows):
    """scripts/ruler_vs_lm_eval.py: ``python -m zoo.interop.lm_eval ... --ruler_essays books`` in its own process."""
    *_, out = zoo_rows
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "ruler_vs_lm_eval.py"), str(out), "--tasks",
                           "niah_single_2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads((out / "lm_eval_comparison.json").read_text())["tasks"]
    assert row["task"] == "niah_single_2" and row["samples"] == LIMIT
    assert row["ids equal"] == row["outputs equal"] == row["scores equal"] == LIMIT


def test_ruler_scoring_is_lm_evals_string_match_all():
    from lm_eval.tasks.ruler.common_utils import process_results

    rng = random.Random(0)
    pieces = ["1234567", "12345678", "porch", "Porches", " ", "\n", "\t", "\x01", "a-b", "UUID-9f"]
    for _ in range(500):
        answers = rng.sample(pieces[:4] + pieces[8:], rng.randint(1, 3))
        output = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        expected = process_results({"max_length": 4096, "outputs": answers}, [output])["4096"]
        assert score(answers, output, "ruler") == expected, (answers, output)
    assert score(["1234567"], "12345678", "ruler") == 1.0
    assert score(["1234567"], "12345678", "strict") == 0.0


def write(tmp_path, folder, **changes):
    config = {"model": str(folder), "output_dir": str(tmp_path / "out"), "lengths": [LENGTH], "samples": 1,
              "tasks": [{"source": "ruler", "tasks": ["niah_single_1"]}], "contestants": [{"family": "full"}],
              **changes}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_refusals_name_the_problem_before_any_model_loads(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for tasks, words in [(["ruler_qa_squad"], "SQuAD download"), (["niah_single"], "unknown RULER task"),
                         ("offline", None)]:
        path = write(tmp_path, tiny_folder, tasks=[{"source": "ruler", "tasks": tasks}])
        if words is None:
            names = [spec.task for spec in load_config(path).tasks]
            assert names == [n for n in ruler.RULER_TASKS if not n.startswith("ruler_qa")]
            continue
        with pytest.raises(EvalConfigError, match=words):
            load_config(path)
    with pytest.raises(EvalConfigError, match="downloads are off"):
        load_config(write(tmp_path, tiny_folder, tasks=[{"source": "ruler", "tasks": "all", "essays": "download"}]))
    with pytest.raises(EvalConfigError, match="unknown keys"):
        load_config(write(tmp_path, tiny_folder, tasks=[{"source": "ruler", "tasks": "all", "haystack": "book"}]))
    with pytest.raises(EvalConfigError, match="scoring"):
        load_config(write(tmp_path, tiny_folder, tasks=[{"task": "niah_single", "scoring": "loose"}]))
    with pytest.raises(EvalConfigError, match="beyond the model.s 2048 positions"):  # read before any model loads
        main([str(write(tmp_path, tiny_folder, lengths=[4096])), "--dry_run"])
