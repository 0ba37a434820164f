"""scripts/kvpress_peer.py, the kvpress peer of ``zoo eval``: its pure functions (groups, batches, pending jobs,
rows) in this environment, without kvpress; end to end in the kvpress environment when scripts/kvpress_env.sh
has built it."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "kvpress_peer.py"
PEER_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"


def _load():
    spec = importlib.util.spec_from_file_location("kvpress_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load()


def _sample(task="niah_single", length=8, index=0, question_tokens=3, new_tokens=5, prompt_len=None):
    """A sample of ``length`` (its cell's) with ``prompt_len`` ids (default: ``length``, as the zoo's own tasks)."""
    return {"task": task, "length": length, "index": index, "seed": index,
            "ids": list(range(length if prompt_len is None else prompt_len)),
            "answers": [str(index)], "question_tokens": question_tokens, "new_tokens": new_tokens, "depth": 0.5,
            "meta": {}}


def test_the_script_imports_neither_torch_nor_kvpress_nor_the_zoo_at_its_top():
    tree = ast.parse(SCRIPT.read_text())
    names = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert not names & {"torch", "transformers", "kvpress", "zoo"}, names
    assert ast.get_docstring(tree) and "zoo eval" in ast.get_docstring(tree)


def test_contestant_names_are_zoo_eval_s():
    assert peer.contestant("no press", 1.0) == "kvpress no press"
    assert peer.contestant("SnapKV", 0.25) == "kvpress SnapKV 25%"
    assert peer.contestant("KNorm", 0.1) == "kvpress KNorm 10%"
    assert peer.contestant("TOVA", 0.125) == "kvpress TOVA 12.5%"
    assert peer.contestant("DecodingPress (KNorm)", 0.1) == "kvpress DecodingPress (KNorm) 10%"


def test_eval_specs_default_and_only():
    specs = peer.eval_specs([0.5, 0.25, 0.1], [0.1])
    assert specs[0] == ("no press", 1.0)
    assert len(specs) == 1 + 5 * 3 + 1
    assert ("DecodingPress (KNorm)", 0.1) in specs and ("DecodingPress (KNorm)", 0.5) not in specs
    assert not {p for p, _ in specs} & {"ObservedAttention", "SnapKV (no question)", "DecodingPress (TOVA)"}
    only = peer.eval_specs([0.5], [0.5], ["KNorm", "ObservedAttention", "DecodingPress (TOVA)"])
    assert only == [("KNorm", 0.5), ("ObservedAttention", 0.5), ("DecodingPress (TOVA)", 0.5)]
    assert peer.unknown_presses(["KNorm", "no press", "Nope"]) == ["Nope"]
    assert len(peer.passkey_specs([0.5, 0.25])) == 1 + 2 * len(peer.PRESSES)


def test_groups_keep_the_file_order_and_sort_by_index():
    samples = [_sample("a", 8, 1), _sample("b", 8, 0), _sample("a", 8, 0), _sample("a", 16, 0)]
    groups = peer.group_samples(samples)
    assert [key for key, _ in groups] == [("a", 8), ("b", 8), ("a", 16)]
    assert [s["index"] for s in groups[0][1]] == [0, 1]
    assert [key for key, _ in peer.group_samples(samples, tasks=["a"], lengths=[16])] == [("a", 16)]


def test_batches_and_the_question_split():
    samples = [_sample(index=i, question_tokens=3 + i % 2) for i in range(5)]
    assert [len(b) for b in peer.batches(samples, 0)] == [5]
    assert [len(b) for b in peer.batches(samples, 2)] == [2, 2, 1]
    split = peer.batches(samples, 2, by_question=True)
    assert [[s["index"] for s in b] for b in split] == [[0, 2], [4], [1, 3]]
    assert all(len({s["question_tokens"] for s in b}) == 1 for b in split)


def _ruler_like() -> list[dict]:
    """A cell of length 16 whose prompts (RULER's own) are shorter, each its own length, two question lengths."""
    lens = [12, 14, 12, 16, 14, 12, 13]
    return [_sample(length=16, index=i, prompt_len=n, question_tokens=3 + i % 2) for i, n in enumerate(lens)]


@pytest.mark.parametrize("size", [0, 1, 2, 3])
@pytest.mark.parametrize("by_question", [False, True])
def test_batches_of_mixed_prompt_lengths_never_mix_lengths(size, by_question):
    samples = _ruler_like()
    split = peer.batches(samples, size, by_question)
    assert all(len({len(s["ids"]) for s in b}) == 1 for b in split)
    if by_question:
        assert all(len({s["question_tokens"] for s in b}) == 1 for b in split)
    assert sorted(s["index"] for b in split for s in b) == list(range(len(samples)))  # each sample once
    assert all(0 < len(b) <= (size or len(samples)) for b in split)
    assert [peer.prompt_length(b) for b in split] == [len(b[0]["ids"]) for b in split]
    if size == 0 and not by_question:
        assert [[s["index"] for s in b] for b in split] == [[0, 2, 5], [1, 4], [3], [6]]


def test_kept_keys_use_the_prompt_length_not_the_cell_length():
    short = [_sample(length=4096, index=0, prompt_len=3000), _sample(length=4096, index=1, prompt_len=3000)]
    assert peer.prompt_length(short) == 3000
    assert peer.kept_keys(0.5, peer.prompt_length(short)) == 1500
    assert peer.kept_keys(0.1, peer.prompt_length([_sample(length=4096, prompt_len=4001)])) == 400
    with pytest.raises(ValueError, match="prompt lengths"):
        peer.prompt_length([_sample(length=16, prompt_len=12), _sample(length=16, prompt_len=14)])


def test_eval_rows_pair_indices_with_outputs_in_index_order():
    samples = [_sample(index=i, length=16, prompt_len=n) for i, n in [(2, 12), (0, 12), (3, 14), (1, 14)]]
    row = peer.eval_row("KNorm", 0.5, samples, [f"answer {s['index']}" for s in samples], 40, 1.0, 2, {})
    assert row["indices"] == [0, 1, 2, 3] and row["length"] == 16
    assert row["outputs"] == [f"answer {i}" for i in row["indices"]]
    assert row["cache_bytes"] == 10


def test_answer_group_batches_by_prompt_length_with_a_press_per_length(monkeypatch):
    """answer_group without kvpress: a fake press per (spec, prompt length), a fake shared prefill that answers
    each sample with its index; the ids of a batch stack, every press sees each sample once, outputs pair."""
    torch = pytest.importorskip("torch")
    made, widths = [], []

    def make_press(press, budget, prompt_len):
        made.append((press, budget, prompt_len))
        return (press, peer.kept_keys(budget, prompt_len))

    def run_shared(model, ids, presses, question, new_tokens):
        widths.append((ids.shape[1], None if question is None else question.shape[1]))
        answer = ids[:, :1] * 0 + torch.tensor(index_of[id(ids)])[:, None]
        return [(answer.expand(-1, new_tokens), 10 * ids.shape[0]) for _ in presses]

    index_of = {}
    real_split = peer.split_question

    def question_of(part, ids):
        index_of[id(ids)] = [s["index"] for s in part]
        return real_split(part, ids)

    monkeypatch.setattr(peer, "torch", torch, raising=False)
    monkeypatch.setattr(peer, "make_press", make_press)
    monkeypatch.setattr(peer, "run_shared", run_shared)
    samples = _ruler_like()
    specs = [("no press", 1.0), ("DecodingPress (KNorm)", 0.5)]
    states = peer.answer_group(None, samples, specs, 2, 3, question_of, by_question=True)
    lens = sorted({len(s["ids"]) for s in samples})
    assert sorted(made) == sorted((p, b, n) for p, b in specs for n in lens)  # one press per spec and length
    assert all(width > q for width, q in widths)
    for state in states:
        assert state["error"] is None and state["bytes"] == 10 * len(samples)
        tokens = torch.cat(state["tokens"])
        assert tokens.shape == (len(samples), 3)
        assert tokens[:, 0].tolist() == [s["index"] for s in state["samples"]]  # tokens in the order of samples
        row = peer.eval_row(*state["spec"], state["samples"], [str(t) for t in tokens[:, 0].tolist()], 0, 0.0, 2, {})
        assert row["indices"] == list(range(len(samples))) and row["outputs"] == [str(i) for i in row["indices"]]


def test_resume_skips_finished_rows_and_retries_errors():
    specs = peer.eval_specs([0.5], [0.5])
    rows = [peer.eval_row("KNorm", 0.5, [_sample()], ["x"], 10, 1.0, 2, {}),
            peer.eval_error_row("TOVA", 0.5, "niah_single", 8, "RuntimeError: no", 2, {})]
    done = peer.finished(rows)
    assert done == {("kvpress KNorm 50%", "niah_single", 8)}
    todo = peer.pending(specs, "niah_single", 8, done)
    assert ("KNorm", 0.5) not in todo and ("TOVA", 0.5) in todo and len(todo) == len(specs) - 1
    assert peer.pending(specs, "niah_single", 16, done) == specs
    assert [k for k, _ in peer.by_kind(peer.eval_specs([0.5], [], ["SnapKV (no question)", "KNorm"]))] == [
        "sdpa", "no question"]


def test_eval_row_format():
    samples = [_sample(index=3), _sample(index=5)]
    row = peer.eval_row("SnapKV", 0.25, samples, [" 3", " 5"], 1000, 2.5, 2, {"transformers": "5.2.0",
                                                                              "kvpress": "0.5.5"})
    assert row == {"contestant": "kvpress SnapKV 25%", "source": "kvpress", "family": "kvpress", "press": "SnapKV",
                   "policy": "SnapKV", "budget": 0.25, "tokens": None, "nbits": None, "decoding": False,
                   "task": "niah_single", "length": 8, "indices": [3, 5], "outputs": [" 3", " 5"],
                   "cache_bytes": 500, "seconds": 2.5, "threads": 2, "shared_prefill": True,
                   "transformers": "5.2.0", "kvpress": "0.5.5"}
    passkey = peer.passkey_row("KNorm", 0.5, [{**samples[0], "answers": ["123"]}], [" 123."], 8, 1.0, 2, True)
    assert passkey["found"] == [True] and passkey["context"] == 8 and passkey["per_prompt_bytes"] == 8


def test_rows_survive_a_line_cut_short(tmp_path):
    path = tmp_path / "kvpress.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"cut": ')
    peer.append_jsonl(path, {"b": 2})
    assert peer.read_jsonl(path) == [{"a": 1}, {"b": 2}]
    assert peer.read_jsonl(tmp_path / "missing.jsonl") == []


def test_passkey_samples_keep_the_first_keys_per_depth():
    prompts = [{"context": 8, "depth": d, "key": k, "ids": [0] * 8} for d, k in
               [(0.1, 1), (0.1, 2), (0.5, 3), (0.5, 4)]]
    samples = peer.passkey_samples(prompts, keys_per_depth=1)
    assert [s["answers"] for s in samples] == [["1"], ["3"]] and [s["index"] for s in samples] == [0, 1]
    assert len(peer.passkey_samples(prompts)) == 4


def _model_folder() -> Path | None:
    from zoo.data.cache import cache_dir
    from zoo.data.pretrained import KEY

    folder = cache_dir() / "models" / KEY
    return folder if folder.is_dir() else None


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="no kvpress environment (scripts/kvpress_env.sh)")
def test_end_to_end_in_the_kvpress_environment(tmp_path):
    folder = _model_folder()
    if folder is None:
        pytest.skip("SmolLM2-135M-Instruct is not converted (zoo.data.pretrained.smollm2_folder)")
    from transformers import AutoTokenizer

    from zoo.eval.report import score_peer_rows
    from zoo.eval.tasks import make_samples

    samples = make_samples(AutoTokenizer.from_pretrained(folder), "passkey", 128, 2, seed=0)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(s.to_json()) + "\n" for s in samples))
    command = [str(PEER_PYTHON), str(SCRIPT), "--eval", str(tmp_path), "--model", str(folder), "--budgets", "0.5",
               "--decoding_budgets", "0.5", "--only", "no press", "KNorm", "TOVA", "DecodingPress (KNorm)"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(command, check=True, env=env, timeout=600, capture_output=True)
    rows = peer.read_jsonl(tmp_path / "kvpress.jsonl")
    assert [r["contestant"] for r in rows] == ["kvpress no press", "kvpress KNorm 50%", "kvpress TOVA 50%",
                                               "kvpress DecodingPress (KNorm) 50%"]
    assert all("error" not in r and r["indices"] == [0, 1] and len(r["outputs"]) == 2 for r in rows)
    assert rows[1]["cache_bytes"] < rows[0]["cache_bytes"]
    assert all(s.answers[0] in text for s, text in zip(samples, rows[0]["outputs"], strict=True))  # full cache
    scored = score_peer_rows(rows, {(s.task, s.length, s.index): s for s in samples})
    assert scored[0]["scores"] == [1.0, 1.0]
    subprocess.run(command, check=True, env=env, timeout=600, capture_output=True)  # resumed: nothing left to run
    assert len(peer.read_jsonl(tmp_path / "kvpress.jsonl")) == len(rows)


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="no kvpress environment (scripts/kvpress_env.sh)")
def test_end_to_end_with_prompts_shorter_than_their_cell(tmp_path):
    """RULER's own prompts: one cell (length 128) whose prompts have 112 or 128 ids, the short ones at indexes 0 and
    2, so batches by prompt length reorder the samples; rows come back in index order, each output its sample's."""
    folder = _model_folder()
    if folder is None:
        pytest.skip("SmolLM2-135M-Instruct is not converted (zoo.data.pretrained.smollm2_folder)")
    from transformers import AutoTokenizer

    from zoo.eval.report import score_peer_rows
    from zoo.eval.tasks import Sample, make_samples

    tokenizer = AutoTokenizer.from_pretrained(folder)
    drawn = make_samples(tokenizer, "passkey", 112, 2, seed=0) + make_samples(tokenizer, "passkey", 128, 2, seed=0)
    samples = [Sample.from_json({**s.to_json(), "length": 128, "index": i, "meta": {**s.meta, "source": "ruler"}})
               for i, s in zip([0, 2, 1, 3], drawn, strict=True)]
    assert [len(s.ids) for s in samples] == [112, 112, 128, 128]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(s.to_json()) + "\n" for s in samples))
    command = [str(PEER_PYTHON), str(SCRIPT), "--eval", str(tmp_path), "--model", str(folder), "--budgets", "0.5",
               "--decoding_budgets", "0.5", "--only", "no press", "KNorm", "SnapKV (no question)",
               "DecodingPress (KNorm)"]
    subprocess.run(command, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600, capture_output=True)
    rows = peer.read_jsonl(tmp_path / "kvpress.jsonl")
    assert sorted(r["contestant"] for r in rows) == sorted(["kvpress no press", "kvpress KNorm 50%",
                                                            "kvpress SnapKV (no question) 50%",
                                                            "kvpress DecodingPress (KNorm) 50%"])
    assert all("error" not in r and r["length"] == 128 and r["indices"] == [0, 1, 2, 3] and len(r["outputs"]) == 4
               for r in rows), rows
    full = next(r for r in rows if r["press"] == "no press")
    assert next(r for r in rows if r["press"] == "KNorm")["cache_bytes"] < full["cache_bytes"]
    scored = score_peer_rows([full], {(s.task, s.length, s.index): s for s in samples})
    assert scored[0]["scores"] == [1.0] * 4, full["outputs"]  # each sample's own key: outputs pair with indices
