"""A ``zoo eval`` run's RULER answers against lm-evaluation-harness on the same samples, sample by sample.

For each RULER task of the run (one length), lm-eval runs in a fresh process through ``python -m zoo.interop.lm_eval``
(``--tasks TASK --limit N --metadata '{"max_seq_lengths": [LENGTH]}' --batch_size 1 --log_samples``, with the run's
seed, chat template and essay stand-in); then, per sample, the prompt ids (lm-eval's logged context, tokenized as its
HFLM does), the greedy output and RULER's score are compared with the run's full-cache row.

    python scripts/ruler_vs_lm_eval.py outputs/eval/ruler_smollm2_cpu            # every RULER task of the run
    python scripts/ruler_vs_lm_eval.py RUN_DIR --tasks niah_single_1 ruler_vt     # some

Writes ``RUN_DIR/lm_eval/`` (lm-eval's outputs, a log per task) and ``RUN_DIR/lm_eval_comparison.json``; prints a
table; exits 1 when any sample differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from zoo.eval import ruler
from zoo.eval.config import load_config
from zoo.eval.contestants import model_path
from zoo.reporting import markdown_table, read_jsonl


def lm_eval_command(folder: str, task: str, length: int, limit: int, seed: int, chat: bool, essays: str,
                    out: Path) -> list[str]:
    command = [sys.executable, "-m", "zoo.interop.lm_eval", "--model", "hf", "--model_args",
               f"pretrained={folder}", "--tasks", task, "--limit", str(limit), "--batch_size", "1",
               "--metadata", json.dumps({"max_seq_lengths": [length]}), "--seed", f"{seed},1234,1234,1234",
               "--log_samples", "--output_path", str(out), "--ruler_essays", essays]
    return command + (["--apply_chat_template"] if chat else [])


def logged_samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"lm-eval wrote no samples for {task} under {out}; see its log there.")
    return sorted(read_jsonl(files[-1]), key=lambda s: s["doc_id"])


def compare(task: str, length: int, prompts: list[dict], row: dict, logged: list[dict], tokenizer) -> dict:
    """Per sample: ids, output and score equal (lm-eval's logged context tokenized as HFLM does)."""
    same_ids = same_outputs = same_scores = 0
    for prompt, sample, output, mine in zip(prompts, logged, row["outputs"], row["scores"], strict=True):
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ids, _ = ruler.encode(tokenizer, context, "")
        same_ids += ids == prompt["ids"]
        same_outputs += output == sample["resps"][0][0]
        same_scores += mine == sample[str(length)]
    n = len(prompts)
    return {"task": task, "samples": n, "ids equal": same_ids, "outputs equal": same_outputs,
            "scores equal": same_scores, "zoo score": row["score"],
            "lm-eval score": sum(s[str(length)] for s in logged) / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a zoo eval run folder with RULER tasks")
    parser.add_argument("--tasks", nargs="+", help="these RULER tasks only (default: all of the run's)")
    parser.add_argument("--contestant", default="full cache", help="the run's row to compare (default: full cache)")
    args = parser.parse_args(argv)
    config = load_config(args.run / "config.yaml", {"output_dir": str(args.run)})
    specs = [s for s in config.tasks if s.source == "ruler" and (not args.tasks or s.task in args.tasks)]
    folder = model_path(config.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = read_jsonl(args.run / "prompts.jsonl")
    rows = {(r["task"], r["length"]): r for r in read_jsonl(args.run / "answers.jsonl")
            if r["contestant"] == args.contestant and "error" not in r}
    table = []
    for spec in specs:
        if len(spec.lengths) != 1:
            raise SystemExit(f"{spec.task}: lm-eval's --limit takes the first documents of all lengths together; "
                             "compare a run of one length.")
        length = spec.lengths[0]
        mine = sorted((p for p in prompts if p["task"] == spec.label and p["length"] == length),
                      key=lambda p: p["index"])
        out = args.run / "lm_eval" / spec.task
        out.mkdir(parents=True, exist_ok=True)
        chat = bool(mine[0]["meta"]["chat_template"])
        command = lm_eval_command(folder, spec.task, length, len(mine), config.seed, chat,
                                  spec.options.get("essays", "auto"), out)
        start = time.perf_counter()
        with (out / "lm_eval.log").open("w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
        result = compare(spec.task, length, mine, rows[(spec.label, length)], logged_samples(out, spec.task),
                         tokenizer)
        table.append({**result, "lm-eval seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(table[-1]), flush=True)
    (args.run / "lm_eval_comparison.json").write_text(json.dumps(
        {"run": args.run.name, "contestant": args.contestant, "command": " ".join(command[1:]), "tasks": table},
        indent=1) + "\n")
    print("\n".join(markdown_table(list(table[0]), [list(r.values()) for r in table])) if table else "no RULER tasks")
    return int(any(r["ids equal"] < r["samples"] or r["outputs equal"] < r["samples"]
                   or r["scores equal"] < r["samples"] for r in table))


if __name__ == "__main__":
    raise SystemExit(main())
