"""RULER's own tasks (Hsieh et al. 2024) in ``zoo eval``, as lm-evaluation-harness ships them
(``lm_eval/tasks/ruler/``, the zoo's ``lm_eval`` extra): lm-eval's generators, templates, answer prefixes, answer
budgets (``max_gen_toks``) and length rule (prompt plus answer budget fit in the length), its chat-template handling
and RULER's scoring, all called, not rewritten.

A RULER sample of a task is the one lm-eval makes for it with the same tokenizer, seed and lengths
(``lm_eval --tasks TASK --metadata '{"max_seq_lengths": LENGTHS}'``, its default seeds): the zoo seeds Python's and
NumPy's generators as lm-eval's ``simple_evaluate`` does, loads the task through lm-eval's ``TaskManager``, keeps the
first ``samples`` documents of each length (lm-eval's ``--limit`` on one length) and builds each request's context
with lm-eval's own ``build_all_requests``. The context is tokenized as lm-eval's ``HFLM`` does; the report scores
the greedy answer with RULER's ``string_match_all`` (:mod:`zoo.eval.scoring`).

Deliberate differences, each recorded in the samples' ``meta``: where the machine cannot download Paul Graham's
essays (RULER's ``essay`` haystack), the zoo's held-out Gutenberg books stand in (``haystack: essay→book``), and
where NLTK's ``punkt_tab`` sentence model cannot be downloaded, an untrained Punkt model splits the sentences
(``sentences: untrained punkt``). The QA tasks need SQuAD and HotpotQA downloads; offline they are refused.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoo.eval.tasks.haystack import book_texts

# lm-eval's 13 RULER tasks, by the names its ``ruler`` group uses.
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe",
               "ruler_qa_squad", "ruler_qa_hotpot")
# Tasks whose data lm-eval downloads and nothing here stands in for.
DOWNLOADS = {"ruler_qa_squad": "SQuAD", "ruler_qa_hotpot": "HotpotQA"}
ESSAYS_DATASET = "baber/paul_graham_essays"  # what lm-eval's essay haystack downloads
# The seeds lm-eval's simple_evaluate sets before it builds a task's documents (its --seed defaults).
NUMPY_SEED = 1234
ESSAYS = ("auto", "download", "books")
CHAT_TEMPLATE = ("auto", True, False)


def offline() -> bool:
    """Whether downloads are switched off (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``)."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def expand_tasks(value: Any) -> list[str]:
    """The task names of a ``{source: ruler, tasks: ...}`` entry: a list of names, ``all`` (the 13), ``offline``
    (every task but the QA ones) or ``available`` (``all`` where downloads are on, else ``offline``)."""
    if value == "available":
        value = "offline" if offline() else "all"
    if value in ("all", None):
        return list(RULER_TASKS)
    if value == "offline":
        return [name for name in RULER_TASKS if name not in DOWNLOADS]
    names = [value] if isinstance(value, str) else list(value)
    unknown = [name for name in names if name not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; lm-eval's RULER tasks are: {', '.join(RULER_TASKS)} "
                         "(or `all`, `offline`, `available`).")
    return names


def check_options(name: str, essays: Any, chat_template: Any) -> None:
    """Refuse what cannot run here before any model is loaded: a task that needs a download while downloads are off,
    ``essays: download`` offline, or an unknown option value."""
    missing = [module for module in ("lm_eval", "nltk", "wonderwords") if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"{name}: RULER's tasks run through lm-evaluation-harness's RULER port, and "
                         f"{', '.join(missing)} is not installed: pip install \"attention-zoo[lm_eval]\".")
    if essays not in ESSAYS:
        raise ValueError(f"{name}: essays={essays!r}; use one of {', '.join(map(str, ESSAYS))}.")
    if chat_template not in CHAT_TEMPLATE:
        raise ValueError(f"{name}: chat_template={chat_template!r}; use auto, true or false.")
    if name in DOWNLOADS and offline():
        raise ValueError(f"{name} needs a {DOWNLOADS[name]} download and downloads are off (HF_HUB_OFFLINE / "
                         "HF_DATASETS_OFFLINE): drop it (`tasks: offline` lists the others) or run where the Hub "
                         "is reachable.")
    if essays == "download" and offline():
        raise ValueError(f"{name}: essays=download, but downloads are off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); "
                         "use essays: books (the held-out Gutenberg books stand in) or auto.")


@contextlib.contextmanager
def essay_haystack(essays: str, note: dict[str, str]) -> Iterator[None]:
    """While building: lm-eval's ``essay`` haystack from the essays (``download``), the held-out books (``books``),
    or the essays when downloads are on and the books otherwise (``auto``); ``note["haystack"]`` says which was used
    when a task asked for essays. The books enter where the essays would (lm-eval's ``datasets.load_dataset`` call
    for them), so lm-eval joins and splits them as it does the essays."""
    import datasets

    original = datasets.load_dataset
    use_books = essays == "books" or (essays == "auto" and offline())

    def load_dataset(path, *args, **kwargs):
        if path != ESSAYS_DATASET:
            return original(path, *args, **kwargs)
        note["haystack"] = "essay→book" if use_books else "essay"
        return {"text": list(book_texts().values())} if use_books else original(path, *args, **kwargs)

    forget_modules()  # lm-eval keeps the haystack it read: read it again here, and not again after
    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original
        forget_modules()


def forget_modules() -> None:
    """Drop lm-eval's RULER modules from ``sys.modules``, so that the next build imports them afresh, as a new
    ``lm_eval`` process does: their module-level state (cwe's word generator, the haystack read) would otherwise
    carry one build's draws into the next."""
    for name in [name for name in sys.modules if name.startswith("lm_eval.tasks.ruler.")]:
        del sys.modules[name]


def sentence_model() -> str:
    """Make sure NLTK can split sentences (the essay haystack's needles go between sentences): its ``punkt_tab``
    model if present or downloadable, else an untrained Punkt model (empty parameters) in a folder added to NLTK's
    data path. Returns which: ``punkt`` or ``untrained punkt``."""
    import nltk

    folder = Path(tempfile.gettempdir()) / "zoo-untrained-punkt"
    if str(folder) in nltk.data.path:
        return "untrained punkt"

    def present() -> bool:
        try:
            nltk.data.find("tokenizers/punkt_tab")
            return True
        except LookupError:
            return False

    if present() or (not offline() and nltk.download("punkt_tab", quiet=True) and present()):
        return "punkt"
    english = folder / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True, exist_ok=True)
    for file in ("abbrev_types.txt", "collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (english / file).touch()
    nltk.data.path.append(str(folder))
    return "untrained punkt"


def uses_chat_template(tokenizer, chat_template: Any) -> bool:
    """``auto``: when the tokenizer has one (RULER's published figures for instruct models use it)."""
    return bool(getattr(tokenizer, "chat_template", None)) if chat_template == "auto" else bool(chat_template)


def chat(tokenizer):
    """lm-eval HFLM's ``apply_chat_template`` for the builder: the history as text, ready for the answer."""
    def apply(history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)
    return apply


def encode(tokenizer, context: str, question: str) -> tuple[list[int], int]:
    """The context's ids as lm-eval's HFLM makes them for a causal model (the tokenizer's special tokens, unless the
    text starts with the BOS token already, as a chat template does), and how many of the last ids are the question
    and answer prefix: the tokens from the last occurrence of ``question`` on."""
    bos = tokenizer.bos_token
    encoded = tokenizer(context, add_special_tokens=not (bos and context.startswith(bos)),
                        return_offsets_mapping=True)
    start = context.rfind(question)
    asked = sum(1 for begin, end in encoded.offset_mapping if begin >= start and end > begin) if start >= 0 else 0
    return encoded.input_ids, asked


@functools.cache
def _manager(model_folder: str, lengths: tuple[int, ...]):
    """lm-eval's task index (seconds to build: once per process) with the metadata RULER's builders read."""
    from lm_eval.tasks import TaskManager

    return TaskManager(metadata={"pretrained": model_folder, "max_seq_lengths": list(lengths)})


def build(tokenizer, model_folder: str, name: str, lengths: list[int], counts: dict[int, int], *, seed: int,
          label: str, essays: str = "auto", chat_template: Any = "auto") -> list[dict[str, Any]]:
    """The samples (dicts of :class:`zoo.eval.tasks.Sample` fields) of RULER task ``name``: the first
    ``counts[length]`` documents lm-eval builds at each of ``lengths``.

    Args:
        tokenizer: the model's tokenizer (ids as HFLM makes them).
        model_folder: the folder or Hub id lm-eval loads the tokenizer from to size its prompts.
        name: a name of :data:`RULER_TASKS`.
        lengths: RULER's ``max_seq_lengths``.
        counts: samples per length.
        seed: Python's seed before building (lm-eval's ``--seed``'s first value; default 0 there and here).
        label: the task's label in the run.
        essays, chat_template: see :func:`check_options` and :func:`uses_chat_template`.

    Python's and NumPy's generators are seeded and the RULER modules imported afresh before each task, as in a new
    lm-eval process: the samples do not depend on what the process built before.
    """
    import numpy as np

    check_options(name, essays, chat_template)
    note = {"sentences": sentence_model()}
    with essay_haystack(essays, note):
        random.seed(seed)
        np.random.seed(NUMPY_SEED)
        task = _manager(model_folder, tuple(lengths)).load([name])["tasks"][name]
    docs = list(task.eval_docs)
    chosen = [i for length in lengths for i in [j for j, doc in enumerate(docs)
                                                  if doc["max_length"] == length][:counts[length]]]
    templated = uses_chat_template(tokenizer, chat_template)
    task.build_all_requests(samples=chosen, apply_chat_template=templated, chat_template=chat(tokenizer),
                            tokenizer_name=model_folder)
    samples, numbers = [], dict.fromkeys(lengths, 0)
    for instance in sorted(task.instances, key=lambda i: i.doc_id):
        doc, (context, generation) = instance.doc, instance.args
        # every RULER template ends its input with the question on a line of its own
        ids, asked = encode(tokenizer, context, doc["input"].rsplit("\n", 1)[-1])
        length = doc["max_length"]
        samples.append({"task": label, "length": length, "index": numbers[length], "seed": seed, "ids": ids,
                        "answers": list(doc["outputs"]),
                        "question_tokens": asked,
                        "new_tokens": generation["max_gen_toks"], "depth": None,
                        "meta": {"task": name, "source": "ruler", "scoring": "ruler", "doc_id": instance.doc_id,
                                 "chat_template": templated, "haystack": note.get("haystack"),
                                 "sentences": note["sentences"] if "haystack" in note else None,
                                 "essays": essays}})
        numbers[length] += 1
    short = {length: numbers[length] for length in lengths if numbers[length] < counts[length]}
    if short:
        raise ValueError(f"{label}: lm-eval built fewer documents than asked at lengths {short} (of "
                         f"{ {n: counts[n] for n in short} }); ask for fewer samples.")
    return samples
