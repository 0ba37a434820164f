"""zoo.eval.tasks on SmolLM2's tokenizer: exact lengths, determinism, answers in the context, needles at their depth,
the question at the end, each task's own invariants (distractors, chains, word counts), book text, clear errors; ids
that survive a decode -> encode round trip, the passkey question on its own line, answer budgets that hold every
form of the answers, RULER's singular wording for one asked value."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from zoo.bench import passkey as bench_passkey
from zoo.data import brown, gutenberg
from zoo.data.npm import DataUnavailableError, fetch
from zoo.data.pretrained import PretrainedModelMissing, smollm2_folder
from zoo.eval.tasks import TASKS, Sample, make_samples, minimum_length, task_options
from zoo.eval.tasks import haystack as haystacks
from zoo.eval.tasks.words import default_common_freq

LENGTHS = (256, 1024, 2048)
NEEDLE = re.compile(r" One of the special magic \w+ for \S+ is: \S+\.")
STATEMENT = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")
# The published question wordings (written out here, not read from the modules under test).
HEAD_ONE = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you "
            "about the {kind} afterwards.\n")
HEAD_ALL = ("Some special magic {kind}s are hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the {kind}s afterwards.\n")
ONE = ("What is the special magic {kind} for {key} mentioned in the provided text? The special magic {kind} for {key} "
       "mentioned in the provided text is")
ALL = ("What are all the special magic {kind}s for {key} mentioned in the provided text? The special magic {kind}s for "
       "{key} mentioned in the provided text are")
TRACK = ("Find all variables that are assigned the value {value} in the text above. Answer: According to the chain(s) "
         "of variable assignment in the text above, {count} variables are assigned the value {value}, they are:")
COMMON = ("What are the {count} most common words in the above list? Answer: The top {count} words that appear most "
          "often in the list are:")
FREQUENT = ("What are the 3 most frequently appeared coded words in the above coded text? Answer: According to the "
            "coded text above, the three most frequently appeared words are:")


@pytest.fixture(scope="module")
def tokenizer():
    try:
        folder = smollm2_folder()
        fetch(gutenberg.PACKAGE), fetch(brown.PACKAGE)
    except (PretrainedModelMissing, DataUnavailableError) as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(folder)


def squash(text: str) -> str:
    return " ".join(text.split())


def split(tokenizer, sample: Sample) -> tuple[str, str]:
    """(the decoded context, the decoded question)."""
    cut = len(sample.ids) - sample.question_tokens
    return tokenizer.decode(sample.ids[:cut]), tokenizer.decode(sample.ids[cut:])


def expected_question(sample: Sample) -> str:
    meta, task = sample.meta, sample.meta["task"]
    if task.startswith("niah_"):
        keys = meta.get("keys", [meta.get("key")])
        key = keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"
        return (ONE if len(sample.answers) == 1 else ALL).format(kind=meta["value"], key=key)
    if task == "variable_tracking":
        return TRACK.format(value=meta["chains"][0]["value"], count=len(sample.answers))
    if task == "common_words":
        return COMMON.format(count=len(sample.answers))
    if task == "frequent_words":
        return FREQUENT
    return bench_passkey.QUESTION


def problems(tokenizer, sample: Sample, length: int) -> list[str]:
    """What is wrong with ``sample`` as a prompt of ``length`` tokens (nothing: [])."""
    found = []
    if len(sample.ids) != length or sample.length != length:
        found.append(f"{len(sample.ids)} ids, length {sample.length}, not {length}")
    if not 0 < sample.question_tokens < len(sample.ids):
        found.append(f"question_tokens {sample.question_tokens}")
        return found
    context, question = split(tokenizer, sample)
    if squash(question) != squash(expected_question(sample)):
        found.append(f"the last {sample.question_tokens} ids are {question!r}, not the question")
    for answer in sample.answers:
        if not re.search(rf"(?<![\w-]){re.escape(answer)}(?![\w-])", context):
            found.append(f"answer {answer!r} is not in the context")
    needed = len(tokenizer(", ".join(sample.answers), add_special_tokens=False).input_ids)
    if sample.new_tokens < needed:
        found.append(f"new_tokens {sample.new_tokens} < {needed}, the answers' tokens")
    return found


def at_least(tokenizer, task: str, length: int, **options) -> int:
    return max(length, minimum_length(tokenizer, task, **options))


# ---------------------------------------------------------------- every task


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_makes_prompts_of_exactly_the_length_with_answers_in_the_context(tokenizer, task, length):
    length = at_least(tokenizer, task, length)
    samples = make_samples(tokenizer, task, length, 3, seed=0)
    assert len(samples) == 3
    for sample in samples:
        assert problems(tokenizer, sample, length) == []
        assert all(isinstance(i, int) for i in sample.ids)
    assert len({s.new_tokens for s in samples}) == 1, "one cell generates as one batch"
    assert len({s.seed for s in samples}) == 3 and [s.index for s in samples] == [0, 1, 2]
    assert all((s.depth is not None) == TASKS[task].depth for s in samples)


def test_the_checks_catch_broken_samples(tokenizer):
    """The checks above can fail: a sample one id short, a question cut short, an answer not in the prompt."""
    for task in TASKS:
        sample = make_samples(tokenizer, task, 1024, 1)[0]
        assert problems(tokenizer, sample, 1024) == []
        short = dataclasses.replace(sample, ids=sample.ids[1:])
        assert any("ids" in p for p in problems(tokenizer, short, 1024)), task
        cut = dataclasses.replace(sample, question_tokens=sample.question_tokens - 3)
        assert any("not the question" in p for p in problems(tokenizer, cut, 1024)), task
        absent = dataclasses.replace(sample, answers=[*sample.answers, "8642097"])
        assert any("8642097" in p for p in problems(tokenizer, absent, 1024)), task
        wrong = dataclasses.replace(sample, new_tokens=1)
        assert any("new_tokens" in p for p in problems(tokenizer, wrong, 1024)), task


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_deterministic_in_their_seed(tokenizer, task):
    length = at_least(tokenizer, task, 1024)
    first = make_samples(tokenizer, task, length, 3, seed=7)
    again = make_samples(tokenizer, task, length, 3, seed=7)
    assert [s.to_json() for s in first] == [s.to_json() for s in again]
    assert first[0].ids != first[1].ids != first[2].ids
    assert make_samples(tokenizer, task, length, 1, seed=8)[0].ids != first[0].ids
    relabelled = make_samples(tokenizer, task, length, 1, seed=7, label=f"{task}_other")[0]
    assert relabelled.task == f"{task}_other" and relabelled.seed != first[0].seed
    # a sample is the same whatever else the run draws (more samples, the same depths: the same first ones)
    depths = [s.depth for s in first] if TASKS[task].depth else None
    assert make_samples(tokenizer, task, length, 3, seed=7, depths=depths)[1].ids == first[1].ids
    assert make_samples(tokenizer, task, length, 5, seed=7, depths=depths and depths + depths)[1].ids == first[1].ids


def test_samples_round_trip_through_json(tokenizer):
    for task in TASKS:
        sample = make_samples(tokenizer, task, at_least(tokenizer, task, 512), 1, seed=3)[0]
        row = json.loads(json.dumps(sample.to_json()))
        assert Sample.from_json(row) == sample
        assert Sample.from_json({**row, "added_by_a_later_version": 1}) == sample


def test_depths_spread_evenly_by_default_and_cycle_when_given(tokenizer):
    spread = make_samples(tokenizer, "niah_single", 512, 4)
    assert [s.depth for s in spread] == [0.125, 0.375, 0.625, 0.875]
    cycled = make_samples(tokenizer, "passkey", 512, 5, depths=[0.0, 1.0])
    assert [s.depth for s in cycled] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [s.depth for s in make_samples(tokenizer, "common_words", 512, 2, depths=[0.3])] == [None, None]
    with pytest.raises(ValueError, match=r"depths=\[1.5\]; give numbers from 0 to 1"):
        make_samples(tokenizer, "niah_single", 512, 2, depths=[1.5])
    assert make_samples(tokenizer, "niah_single", 512, 0) == []


# ---------------------------------------------------------------- tokenization, wording, answer budgets


def haystacks_of(task: str) -> list[dict]:
    return [{"haystack": h} for h in haystacks.HAYSTACKS] if "haystack" in task_options(task) else [{}]


def round_trip(tokenizer, ids: list[int]) -> list[int]:
    """The ids of the text that ``ids`` decode to."""
    return tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids


@pytest.mark.parametrize("length", [512, 1000, 2048])
@pytest.mark.parametrize(("task", "options"), [(t, o) for t in TASKS for o in haystacks_of(t)])
def test_prompts_are_the_ids_the_tokenizer_gives_their_text(tokenizer, task, options, length):
    """Decoding a prompt and encoding the text again gives the same ids (so a model sees what the text says, and
    the prompt has exactly its length in tokens as text too): every task, haystack, and needle depths 0 and 1."""
    length = at_least(tokenizer, task, length, **options)
    depths = [0.0, 0.5, 1.0] if TASKS[task].depth else None
    for sample in make_samples(tokenizer, task, length, 3, seed=length, depths=depths, **options):
        assert round_trip(tokenizer, sample.ids) == sample.ids, (task, options, length, sample.index)
        assert sample.meta.get("pad", 0) == 0, "filled with words, not with blank space"


def test_the_round_trip_check_catches_separately_tokenized_pieces(tokenizer):
    """The old noise haystack (the filler's ids repeated: a copy ends in a space token, the next starts " The"
    without it) and blank padding (spaces the tokenizer joins) fail the check above; the noise haystack now passes."""
    filler = haystacks.encode(tokenizer, bench_passkey.FILLER)
    old_noise = (filler * 50)[:1000]
    assert len(round_trip(tokenizer, old_noise)) < 1000
    assert round_trip(tokenizer, haystacks.noise(tokenizer, 1000)) == haystacks.noise(tokenizer, 1000)
    words = haystacks.encode(tokenizer, "one two three")
    padded = words + haystacks.pad_ids(tokenizer, 3) + haystacks.encode(tokenizer, "\nWhat")
    assert round_trip(tokenizer, padded) != padded


def question_on_its_own_line(tokenizer, ids: list[int]) -> bool:
    text = tokenizer.decode(ids)
    at = text.rfind(bench_passkey.QUESTION)
    return at > 0 and text[at - 1] == "\n"


def test_the_passkey_question_starts_a_line(tokenizer):
    for sample in make_samples(tokenizer, "passkey", 1024, 4, depths=[0.0, 0.5, 0.99, 1.0]):
        assert question_on_its_own_line(tokenizer, sample.ids)
        _, question = split(tokenizer, sample)
        assert question == "\n" + bench_passkey.QUESTION
    # the benchmark's prompt glues the question to the filler ("... The sky isWhat is the pass key?")
    assert not question_on_its_own_line(tokenizer, bench_passkey.build_prompt(tokenizer, 1024, 0.5, 12345))


def written_forms(sample: Sample) -> list[str]:
    """Ways a model may write the answers (written out here, not read from the task modules): the comma list, with
    "and", and numbered lists on one line or a line each; variable names also as ``VAR NAME``."""
    answers = sample.answers
    lists = [answers, [f"VAR {a}" for a in answers]] if sample.meta["task"] == "variable_tracking" else [answers]
    forms = []
    for items in lists:
        forms.append(", ".join(items))
        if len(items) > 1:
            forms += [" ".join(f"{n}. {item}" for n, item in enumerate(items, 1)),
                      "\n".join(f"{n}. {item}" for n, item in enumerate(items, 1)),
                      f"{', '.join(items[:-1])}, and {items[-1]}"]
    return forms


def budget_problems(tokenizer, sample: Sample, margin: int = 4) -> list[str]:
    """The forms of the answers that do not fit ``new_tokens`` with ``margin`` tokens to spare."""
    found = []
    for form in written_forms(sample):
        need = len(tokenizer(" " + form, add_special_tokens=False).input_ids)
        if need + margin > sample.new_tokens:
            found.append(f"{form!r}: {need} tokens + {margin} > new_tokens {sample.new_tokens}")
    return found


@pytest.mark.parametrize(("task", "options"), [(t, {}) for t in TASKS] + [
    ("niah_single", {"value": "uuid"}), ("niah_multivalue", {"value": "uuid"}), ("niah_multiquery", {"queries": 6}),
    ("variable_tracking", {"hops": 7}), ("common_words", {"common": 15})])
def test_the_answer_budget_holds_every_form_of_the_answers(tokenizer, task, options):
    for length in (2048, 4096):
        samples = make_samples(tokenizer, task, at_least(tokenizer, task, length, **options), 6, seed=1, **options)
        for sample in samples:
            assert budget_problems(tokenizer, sample) == [], (task, options, length)


def test_the_budget_check_catches_a_numbered_answer_cut_off(tokenizer):
    """frequent_words' old budget (12 tokens) cuts off a numbered three-word answer (15 SmolLM2 tokens)."""
    sample = make_samples(tokenizer, "frequent_words", 1024, 1)[0]
    numbered = " ".join(f"{n}. {word}" for n, word in enumerate(sample.answers, 1))
    assert len(tokenizer(" " + numbered, add_special_tokens=False).input_ids) > 12
    assert any("1. " in p for p in budget_problems(tokenizer, dataclasses.replace(sample, new_tokens=12)))
    assert budget_problems(tokenizer, sample) == []


@pytest.mark.parametrize(("task", "options", "one"), [
    ("niah_single", {}, True), ("niah_multikey", {}, True), ("niah_multivalue", {}, False),
    ("niah_multiquery", {}, False), ("niah_multivalue", {"values": 1}, True), ("niah_multiquery", {"queries": 1}, True),
    ("niah_single", {"value": "uuid"}, True), ("niah_multivalue", {"value": "uuid"}, False)])
def test_one_asked_value_is_spoken_of_in_the_singular(tokenizer, task, options, one):
    """RULER's wording: "A special magic number is hidden ..." when the question asks for one value (whatever the
    needles), "Some special magic numbers are hidden ..." when it asks for several."""
    for sample in make_samples(tokenizer, task, 1024, 2, **options):
        context, question = split(tokenizer, sample)
        kind = sample.meta["value"]
        assert context.startswith((HEAD_ONE if one else HEAD_ALL).format(kind=kind))
        assert (len(sample.answers) == 1) == one
        assert squash(question).startswith("What is the special" if one else "What are all the special")
        assert f"One of the special magic {kind}s for " in context  # the needles keep RULER's plural


# ---------------------------------------------------------------- needles


def haystack_share(context: str, needle: str, header_end: int, needles: re.Pattern[str]) -> float:
    """The share of the haystack's text (the other needles left out) that comes before ``needle``."""
    body = context[header_end:]
    at = body.index(needle)
    before, after = needles.sub("", body[:at]), needles.sub("", body[at + len(needle) :])
    return len(before) / (len(before) + len(after))


def first_needle(sample: Sample) -> str:
    meta = sample.meta
    key = meta["keys"][0] if "keys" in meta else meta["key"]
    return f" One of the special magic {meta['value']}s for {key} is: {sample.answers[0]}."


@pytest.mark.parametrize("haystack", ["noise", "book"])
@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needles_sit_at_their_depth(tokenizer, task, haystack):
    depths = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    for sample in make_samples(tokenizer, task, 2048, len(depths), depths=depths, haystack=haystack):
        context, _ = split(tokenizer, sample)
        needle = first_needle(sample)
        assert context.count(needle) == 1
        share = haystack_share(context, needle, context.index("\n") + 1, NEEDLE)
        assert abs(share - sample.depth) < 0.04, (sample.depth, share)
        assert len(NEEDLE.findall(context)) == sample.meta["needles"]


def test_the_passkey_sits_at_its_depth(tokenizer):
    depths = [0.0, 0.3, 0.7, 1.0]
    for sample in make_samples(tokenizer, "passkey", 1024, 4, depths=depths):
        context, _ = split(tokenizer, sample)
        needle = bench_passkey.NEEDLE.format(key=sample.answers[0]).strip()
        assert context.startswith(bench_passkey.HEADER) and context.count(needle) == 1
        share = haystack_share(context, needle, len(bench_passkey.HEADER), re.compile("^$"))
        assert abs(share - sample.depth) < 0.02


@pytest.mark.parametrize("value", ["number", "uuid"])
def test_multikey_distractors_have_other_keys_and_values(tokenizer, value):
    for sample in make_samples(tokenizer, "niah_multikey", 2048, 6, value=value, distractors=5):
        context, _ = split(tokenizer, sample)
        found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", context)
        keys, values = [k for k, _ in found], [v for _, v in found]
        assert len(found) == 6 and len(set(keys)) == 6 and len(set(values)) == 6
        assert keys.count(sample.meta["key"]) == 1 and sample.meta["key"] not in sample.meta["distractor_keys"]
        assert dict(found)[sample.meta["key"]] == sample.answers[0]
        assert set(sample.answers).isdisjoint(sample.meta["distractor_values"])
        if value == "uuid":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                                sample.answers[0])
        else:
            assert re.fullmatch(r"[1-9]\d{6}", sample.answers[0])
        assert re.fullmatch(r"[a-z]+-[a-z]+", sample.meta["key"])


def test_multivalue_files_distinct_values_under_one_key(tokenizer):
    for sample in make_samples(tokenizer, "niah_multivalue", 1024, 4, values=5):
        context, _ = split(tokenizer, sample)
        found = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", context)
        assert {k for k, _ in found} == {sample.meta["key"]}
        assert sorted(v for _, v in found) == sorted(sample.answers) and len(set(sample.answers)) == 5


def test_multiquery_asks_for_every_key(tokenizer):
    for sample in make_samples(tokenizer, "niah_multiquery", 1024, 4, queries=3, key="number"):
        context, question = split(tokenizer, sample)
        found = dict(re.findall(r"One of the special magic numbers for (\d+) is: (\d+)\.", context))
        assert [found[k] for k in sample.meta["keys"]] == sample.answers and len(set(sample.answers)) == 3
        assert all(k in question for k in sample.meta["keys"])


# ---------------------------------------------------------------- variable tracking, words


@pytest.mark.parametrize("chains", [1, 3])
def test_variable_tracking_answers_are_exactly_the_first_chain(tokenizer, chains):
    for sample in make_samples(tokenizer, "variable_tracking", 1024, 4, chains=chains, hops=4):
        context, _ = split(tokenizer, sample)
        value_of: dict[str, str] = {}
        for name, source, number in STATEMENT.findall(context):
            assert name not in value_of and (number or source in value_of), "each hop after what it copies"
            value_of[name] = number or value_of[source]
        assert len(value_of) == chains * 5
        value = sample.meta["chains"][0]["value"]
        assert sorted(n for n, v in value_of.items() if v == value) == sorted(sample.answers)
        assert len(sample.answers) == 5 and sample.answers == sample.meta["chains"][0]["names"]
        assert len({c["value"] for c in sample.meta["chains"]}) == chains


@pytest.mark.parametrize("length", [496, 1024, 2048, 4096])
def test_common_words_answers_are_strictly_the_most_frequent(tokenizer, length):
    for sample in make_samples(tokenizer, "common_words", length, 3):
        context, _ = split(tokenizer, sample)
        body = context[context.index("\n") + 1 :]
        entries = re.findall(r"(\d+)\. ([a-z]+)", body)
        assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
        assert len(re.findall(r"[a-z]+", body)) == len(entries), "every word is an entry"
        counts = Counter(word for _, word in entries)
        assert len(set(sample.answers)) == 10
        assert min(counts[a] for a in sample.answers) > max(c for w, c in counts.items() if w not in sample.answers)
        assert {counts[a] for a in sample.answers} == {default_common_freq(length, 3)}
        assert sum(1 for c in counts.values() if c == 3) >= 10
    assert default_common_freq(4096, 3) == 30 and default_common_freq(8192, 3) == 60
    assert default_common_freq(256, 3) == 4


@pytest.mark.parametrize("length", [256, 1024, 2048])
def test_frequent_words_answers_are_the_top_three_with_no_tie(tokenizer, length):
    for sample in make_samples(tokenizer, "frequent_words", length, 4, alpha=2.0):
        context, _ = split(tokenizer, sample)
        counts = Counter(context[context.index("\n") + 1 :].split())
        top = counts.most_common(4)
        assert top[0][1] > top[1][1] > top[2][1] > top[3][1]
        assert sample.answers == [word for word, _ in top[:3]]
        assert all(re.fullmatch(r"(?:[bdfgklmnprstvz][aeiou]){2,3}", w) for w in counts)


# ---------------------------------------------------------------- the book haystack


def test_the_book_haystack_is_text_of_a_held_out_book(tokenizer):
    books = gutenberg.read_books(fetch(gutenberg.PACKAGE))
    seen = set()
    for sample in make_samples(tokenizer, "niah_single", 2048, 6, haystack="book"):
        assert sample.meta["book"] in gutenberg.LM_TEST_BOOKS
        author, title = sample.meta["book"].split("-", 1)
        book = squash(books[author][title])
        context, _ = split(tokenizer, sample)
        pieces = [squash(piece) for piece in NEEDLE.split(context[context.index("\n") + 1 :])]
        assert sum(len(p) for p in pieces) > 5000
        longest = max(pieces, key=len)
        for start in range(0, len(longest) - 300, 700):
            assert longest[start : start + 300] in book
        seen.add(sample.meta["book"])
    assert len(seen) == 2


def test_books_are_tokenized_once(tokenizer):
    make_samples(tokenizer, "niah_single", 1024, 2, haystack="book")
    before = haystacks._book_ids.cache_info()
    make_samples(tokenizer, "niah_multikey", 2048, 4, haystack="book", seed=5)
    after = haystacks._book_ids.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


# ---------------------------------------------------------------- errors


def test_an_unknown_task_or_option_names_the_known_ones(tokenizer):
    with pytest.raises(ValueError, match="unknown task 'niah_triple'; known tasks: niah_single, niah_multikey"):
        make_samples(tokenizer, "niah_triple", 1024, 1)
    with pytest.raises(ValueError, match=r"niah_single: unknown option\(s\) needles; the options of niah_single are: "
                                         r"haystack \(default 'noise'\), value \(default 'number'\)"):
        make_samples(tokenizer, "niah_single", 1024, 1, needles=2)
    with pytest.raises(ValueError, match="the options of passkey are: none"):
        make_samples(tokenizer, "passkey", 1024, 1, haystack="book")
    with pytest.raises(ValueError, match="haystack='web'; use one of noise, book"):
        make_samples(tokenizer, "niah_multivalue", 1024, 1, haystack="web")
    with pytest.raises(ValueError, match="hops=0; use a whole number >= 1"):
        make_samples(tokenizer, "variable_tracking", 1024, 1, hops=0)
    with pytest.raises(ValueError, match="common_freq=3; use a whole number >= 4"):
        make_samples(tokenizer, "common_words", 1024, 1, common_freq=3)
    assert task_options("niah_multikey") == {"haystack": "noise", "value": "number", "key": "word", "distractors": 3}


@pytest.mark.parametrize("task", list(TASKS))
def test_a_length_too_short_says_the_minimum_and_the_minimum_works(tokenizer, task):
    with pytest.raises(ValueError, match=r"too short.*use a length of at least \d+ tokens") as caught:
        make_samples(tokenizer, task, 96, 4, seed=2)
    stated = int(re.search(r"at least (\d+) tokens", str(caught.value)).group(1))
    assert stated > 96
    assert len(make_samples(tokenizer, task, stated, 4, seed=2)) == 4
    assert len(make_samples(tokenizer, task, minimum_length(tokenizer, task), 8, seed=11)) == 8
