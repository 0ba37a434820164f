"""Aggregation tasks over a context full of words. ``common_words``: a numbered list where a few words repeat more
often than the rest; name them. ``frequent_words``: made-up words drawn from a Zipf distribution; name the three most
frequent.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import lru_cache
from itertools import accumulate

from zoo.eval.tasks.haystack import (
    Keyed,
    Prompt,
    brown_words,
    check_count,
    encode,
    encode_many,
    pad_ids,
    too_short,
)
from zoo.eval.tasks.registry import EvalTask, register

COMMON_HEADER = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                 "ones that appear most often.\n")
COMMON_QUESTION = ("\nWhat are the {count} most common words in the above list? Answer: The top {count} words that "
                   "appear most often in the list are:")
FREQUENT_HEADER = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words.\n")
FREQUENT_QUESTION = ("\nWhat are the 3 most frequently appeared coded words in the above coded text? Answer: According "
                     "to the coded text above, the three most frequently appeared words are:")
# RULER's repeat count of the common words at 4K tokens; the default scales it with the length.
COMMON_FREQ_AT_4K = 30
# The least frequent_words text, in words (fewer and "most frequent" means little).
MIN_CODED_WORDS = 50
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def default_common_freq(length: int, uncommon_freq: int) -> int:
    """30 repeats at 4,096 tokens, in proportion to the length (so the common words keep their share of the list),
    and at least one more than ``uncommon_freq``."""
    return max(uncommon_freq + 1, round(COMMON_FREQ_AT_4K * length / 4096))


@lru_cache(maxsize=8)
def _numbers(keyed: Keyed, upto: int) -> tuple[tuple[int, ...], ...]:
    """The ids of the list markers `` 1.`` ... `` {upto}.`` (index 0 is empty)."""
    return ((),) + tuple(tuple(ids) for ids in encode_many(keyed.tokenizer, [f" {n}." for n in range(1, upto + 1)]))


def _markers(tokenizer, entries: int) -> tuple[tuple[int, ...], ...]:
    upto = 1 << max(entries, 1).bit_length()  # a power of two: one cached table serves many lengths
    return _numbers(Keyed(tokenizer), upto)


def common_words(tokenizer, length: int, rng: random.Random, depth: float | None = None, *, common: int = 10,
                 common_freq: int | None = None, uncommon_freq: int = 3) -> Prompt:
    """A shuffled numbered list of Brown words: ``common`` words ``common_freq`` times each (default: scaled with
    the length, :func:`default_common_freq`), as many others ``uncommon_freq`` times each as fit, and words once
    each in the rest (the last few tokens filled by longer words, :func:`_lengthen`); the answer is the common words.
    ``depth`` is not used."""
    task = "common_words"
    check_count(task, "common", common)
    check_count(task, "uncommon_freq", uncommon_freq)
    if common_freq is None:
        common_freq = default_common_freq(length, uncommon_freq)
    check_count(task, "common_freq", common_freq, uncommon_freq + 1)
    head = encode(tokenizer, COMMON_HEADER)
    asked = encode(tokenizer, COMMON_QUESTION.format(count=common))
    room = length - len(head) - len(asked)
    vocabulary = brown_words()
    markers = _markers(tokenizer, common * common_freq + max(room, 0) // 2 + 2 * common * uncommon_freq)
    marker_total = list(accumulate((len(m) for m in markers), initial=0))[1:]  # marker_total[e]: markers 1..e
    # at most this many entries fit (a marker and a word of one token each), so at most this many words are needed
    most_entries = max(room, 0) // (1 + min(len(m) for m in markers[1:]))
    wanted = 2 * common + max(0, most_entries - common * common_freq) // uncommon_freq + 256
    drawn = rng.sample(vocabulary, min(len(vocabulary), wanted))
    word_ids = encode_many(tokenizer, [" " + w for w in drawn])

    counts = [common_freq] * common
    words_cost = sum(common_freq * len(word_ids[i]) for i in range(common))
    least = words_cost + sum(uncommon_freq * len(word_ids[common + i]) for i in range(common))
    least_entries = common * (common_freq + uncommon_freq)
    if least_entries >= len(marker_total) or marker_total[least_entries] + least > room:
        need = len(head) + len(asked) + least + sum(len(m) for m in markers[: least_entries + 1])
        raise too_short(task, length, need, f"the header, question and the shortest list ({common} words x "
                        f"{common_freq} and {common} words x {uncommon_freq}) take {need} tokens")
    entries = common * common_freq
    index = common
    while index < len(drawn) and entries + uncommon_freq < len(marker_total):  # words uncommon_freq times
        cost = marker_total[entries + uncommon_freq] + words_cost + uncommon_freq * len(word_ids[index])
        if cost > room:
            break
        counts.append(uncommon_freq)
        words_cost += uncommon_freq * len(word_ids[index])
        entries += uncommon_freq
        index += 1
    uncommon = index - common
    rest = room - marker_total[entries] - words_cost
    if uncommon > common and entries + 1 < len(markers) and 0 < rest <= len(markers[entries + 1]):
        # too little room left for a word once, and a word listed uncommon_freq times cannot be lengthened by 1 or 2
        # tokens: give the last one's room to words once each (:func:`_lengthen` fills the last tokens with them)
        index, uncommon = index - 1, uncommon - 1
        counts.pop()
        words_cost -= uncommon_freq * len(word_ids[index])
        entries -= uncommon_freq
    while index < len(drawn) and entries + 1 < len(marker_total):  # the rest: words once each, the last that fits
        gap = room - marker_total[entries + 1] - words_cost
        fitting = next((i for i in range(index, min(len(drawn), index + 256)) if len(word_ids[i]) <= gap), None)
        if fitting is None:
            break
        drawn[index], drawn[fitting] = drawn[fitting], drawn[index]
        word_ids[index], word_ids[fitting] = word_ids[fitting], word_ids[index]
        counts.append(1)
        words_cost += len(word_ids[index])
        entries += 1
        index += 1
    gap = room - marker_total[entries] - words_cost
    gap = _lengthen(drawn, word_ids, counts, index, gap)
    order = [i for i, n in enumerate(counts) for _ in range(n)]
    rng.shuffle(order)
    body = [t for number, i in enumerate(order, 1) for t in (*markers[number], *word_ids[i])]
    pad = room - len(body)
    return Prompt(ids=head + body + pad_ids(tokenizer, pad) + asked, answers=drawn[:common],
                  question_tokens=len(asked),
                  meta={"common_freq": common_freq, "uncommon_freq": uncommon_freq, "uncommon_words": uncommon,
                        "single_words": index - common - uncommon, "entries": entries, "pad": pad})


def _lengthen(drawn: list[str], word_ids: list[list[int]], counts: list[int], used: int, gap: int) -> int:
    """Fill ``gap`` tokens by swapping listed words (``drawn[:used]``, listed ``counts[i]`` times each) for unlisted
    ones (``drawn[used:]``) of other token counts, in place: longer ones, the least repeated words first; then, for
    what is left, a pair of swaps (one may shorten a word: a word listed 4 times made a token longer and one listed 3
    times a token shorter fill 1 token). Returns what is left of the gap (0 but for want of words). Blank padding
    instead would decode to a run of spaces that the tokenizer joins into fewer tokens."""
    pool: dict[int, list[int]] = {}
    for j in range(used, len(drawn)):
        pool.setdefault(len(word_ids[j]), []).append(j)

    def swap(i: int, size: int) -> None:
        j = pool[size].pop()
        pool.setdefault(len(word_ids[i]), []).append(j)
        drawn[i], drawn[j] = drawn[j], drawn[i]
        word_ids[i], word_ids[j] = word_ids[j], word_ids[i]

    for i in sorted(range(used), key=lambda i: (counts[i], i)):
        size = len(word_ids[i])
        more = next((m for m in range(gap // counts[i], 0, -1) if pool.get(size + m)), 0)
        if more:
            swap(i, size + more)
            gap -= more * counts[i]
    if gap <= 0:
        return gap
    kinds: dict[tuple[int, int], list[int]] = {}  # (count, tokens) -> listed words
    for i in range(used):
        kinds.setdefault((counts[i], len(word_ids[i])), []).append(i)
    sizes = sorted(pool)
    for (count_a, size_a), words_a in kinds.items():
        for (count_b, size_b), words_b in kinds.items():
            if len(set(words_a[:2]) | set(words_b[:2])) < 2:
                continue
            for new_a in (n for n in sizes if pool[n] and n != size_a):
                rest = gap - (new_a - size_a) * count_a
                new_b = size_b + rest // count_b
                if rest % count_b or new_b == size_b or len(pool.get(new_b, ())) < 1 + (new_b == new_a):
                    continue
                a = words_a[0]
                b = next(i for i in words_b if i != a)
                swap(a, new_a)
                swap(b, new_b)
                return 0
    return gap


def _coined(rng: random.Random) -> str:
    """A made-up pronounceable word: 2 or 3 consonant-vowel syllables."""
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3)))


@lru_cache(maxsize=8)
def coded_word_tokens(keyed: Keyed) -> int:
    """The most common token count of a made-up word (with its leading space) at this tokenizer: every word of the
    coded text has this count, so swapping one word for another keeps the prompt's length."""
    probe = random.Random(0)
    counts = Counter(len(ids) for ids in encode_many(keyed.tokenizer, [" " + _coined(probe) for _ in range(2000)]))
    return min(counts, key=lambda n: (-counts[n], n))


def _coined_vocabulary(tokenizer, rng: random.Random, size: int, tokens: int) -> tuple[list[str], list[list[int]]]:
    """``size`` distinct made-up words of ``tokens`` tokens each, and their ids."""
    words: list[str] = []
    ids: list[list[int]] = []
    seen: set[str] = set()
    for _ in range(200):
        if len(words) >= size:
            break
        batch = [w for w in dict.fromkeys(_coined(rng) for _ in range(2 * size)) if w not in seen]
        seen.update(batch)
        for word, word_ids in zip(batch, encode_many(tokenizer, [" " + w for w in batch]), strict=True):
            if len(word_ids) == tokens and len(words) < size:
                words.append(word)
                ids.append(word_ids)
    if len(words) < size:
        raise ValueError(f"frequent_words: could not make {size} distinct made-up words of {tokens} tokens")
    return words, ids


def _separate_top(picks: list[int], rng: random.Random) -> None:
    """Make the 4 most frequent picks' counts strictly decreasing, by turning picks of rarer words into them."""
    for _ in range(len(picks)):
        counts = Counter(picks)
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        if len(ranked) < 4:
            raise ValueError("frequent_words: the text has fewer than 4 distinct words; use a smaller alpha")
        tied = next((i for i in range(3) if counts[ranked[i]] <= counts[ranked[i + 1]]), None)
        if tied is None:
            return
        rare = [p for p, w in enumerate(picks) if w not in ranked[:4]]
        if not rare:
            break
        picks[rng.choice(rare)] = ranked[tied]
    raise ValueError("frequent_words: the text is too short to separate its most frequent words; use a longer length")


def _fill(tokenizer, rng: random.Random, picks: list[int], words: list[str], word_ids: list[list[int]],
          gap: int) -> None:
    """Fill the ``gap`` (fewer tokens than a word) left after the last whole word: ``gap`` picks of words outside the
    top 4 become new made-up words of one token more, once each (so the top 4 stay as they are). In place; nothing
    changes when there are too few such picks or words (the prompt is then padded with blank space)."""
    if gap <= 0:
        return
    counts = Counter(picks)
    top = set(sorted(counts, key=lambda w: (-counts[w], w))[:4])
    rare = [p for p, w in enumerate(picks) if w not in top]
    if len(rare) < gap:
        return
    try:
        longer, longer_ids = _coined_vocabulary(tokenizer, rng, gap, len(word_ids[0]) + 1)
    except ValueError:
        return
    for p, word, ids in zip(rng.sample(rare, gap), longer, longer_ids, strict=True):
        picks[p] = len(words)
        words.append(word)
        word_ids.append(ids)


def frequent_words(tokenizer, length: int, rng: random.Random, depth: float | None = None, *, alpha: float = 2.0,
                   vocabulary: int = 1000) -> Prompt:
    """Made-up words drawn from a Zipf distribution (exponent ``alpha``) over ``vocabulary`` words, space-separated
    until the context is full (the last few tokens: a few words once each, of one token more); the answer is the 3
    most frequent words of the text, with no tie among the first 4. ``depth`` is not used."""
    task = "frequent_words"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"frequent_words: alpha={alpha!r}; use a positive number.")
    check_count(task, "vocabulary", vocabulary, 4)
    head = encode(tokenizer, FREQUENT_HEADER)
    asked = encode(tokenizer, FREQUENT_QUESTION)
    tokens = coded_word_tokens(Keyed(tokenizer))
    room = length - len(head) - len(asked)
    if room < MIN_CODED_WORDS * tokens:
        need = len(head) + len(asked) + MIN_CODED_WORDS * tokens
        raise too_short(task, length, need, f"the header, question and {MIN_CODED_WORDS} words of {tokens} tokens "
                        f"take {need} tokens")
    words, word_ids = _coined_vocabulary(tokenizer, rng, vocabulary, tokens)
    weights = list(accumulate(1 / (rank + 1) ** alpha for rank in range(vocabulary)))
    picks = rng.choices(range(vocabulary), cum_weights=weights, k=room // tokens)
    _separate_top(picks, rng)
    _fill(tokenizer, rng, picks, words, word_ids, room - tokens * len(picks))
    counts = Counter(picks)
    top = sorted(counts, key=lambda w: (-counts[w], w))[:3]
    body = [t for w in picks for t in word_ids[w]]
    pad = room - len(body)
    return Prompt(ids=head + body + pad_ids(tokenizer, pad) + asked, answers=[words[w] for w in top],
                  question_tokens=len(asked),
                  meta={"alpha": alpha, "vocabulary": vocabulary, "words": len(picks), "word_tokens": tokens,
                        "top_counts": [counts[w] for w in sorted(counts, key=lambda w: (-counts[w], w))[:4]],
                        "pad": pad})


register(EvalTask("common_words", common_words), EvalTask("frequent_words", frequent_words))  # lists: numbered too
