"""The decode timer of the benchmarks: every contestant prefills once, then the contestants take turns decoding, in
rounds, so that host noise lasting longer than a round (other tenants, frequency changes) falls on each alike.

What a contestant does in its prefill and in its turn is the caller's (``generate`` continuing its own sequence and
cache in ``zoo bench --decode`` and the passkey benchmark, single forward steps in
``scripts/paired_decode_steps.py``); each turn returns its tokens' times, measured with
:class:`zoo.training.lm.TokenClock` where it runs ``generate``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from zoo.reporting import describe_error
from zoo.training.lm import TokenClock

# name -> (prefill, turn): prefill() returns what it measured; turn() decodes one round, returns seconds per token
Players = dict[str, tuple[Callable[[], dict[str, Any]], Callable[[], list[float]]]]

__all__ = ["Players", "TokenClock", "take_turns"]


def take_turns(players: Players, rounds: int, *, alternate: bool = True, catch: bool = True) -> dict[str, dict]:
    """Prefill every player once, then ``rounds`` rounds in which each player takes one turn.

    Args:
        players: name -> (prefill, turn), in the order of the first round.
        rounds: turns per player.
        alternate: every other round runs in the reverse order (A B, B A, ...).
        catch: a player that raises gets ``{"status": "error", "error": ...}`` and leaves, the others go on
            (False: the exception propagates).

    Returns:
        name -> ``{"status": "ok", **what prefill returned, "gaps": [seconds per token over all turns], "round_ms":
        [each turn's median, ms], "seconds": time spent in the player's calls}`` or the error result.
    """
    results: dict[str, dict[str, Any]] = {}
    running: list[str] = []

    def attempt(name: str, step: Callable[[], Any]) -> Any:
        started, value = time.perf_counter(), None
        try:
            value = step()
        except Exception as exc:  # recorded; the other players go on
            if not catch:
                raise
            if name in running:
                running.remove(name)
            results[name] = {"status": "error", "error": describe_error(exc)}
        if name in results:
            results[name]["seconds"] = results[name].get("seconds", 0.0) + time.perf_counter() - started
        return value

    def prefill(name: str) -> None:
        measured = players[name][0]()
        running.append(name)
        results[name] = {"status": "ok", **measured, "gaps": [], "round_ms": []}

    def turn(name: str) -> None:
        gaps = players[name][1]()
        results[name]["gaps"] += gaps
        results[name]["round_ms"].append(1e3 * statistics.median(gaps))

    for name in players:
        attempt(name, lambda name=name: prefill(name))
    names = list(players)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 or not alternate else names[::-1]:
            if name in running:
                attempt(name, lambda name=name: turn(name))
    return results
