"""What a row of a ``zoo eval`` run folder says about its contestant: the fields the report finds rows by, never the
display name (a user may rename any contestant with ``name:``).

Fields: ``source`` (``zoo``, or ``kvpress`` for the peer's presses), ``family`` (the zoo's families; ``kvpress``),
``policy`` (a ``budget`` contestant's KV policy as a label, ``snapkv`` or ``snapkv(window=64,pool=5)``, or the peer's
press; else None), ``budget`` (the fraction of the
context kept as configured; None when a contestant keeps a token count or everything), ``tokens`` (a token count
kept), ``nbits`` (QuantizedCache), ``decoding`` (a press that evicts while decoding, not at prefill).
:func:`row_fields` gives them for a contestant as the run writes them; :func:`with_fields` derives them once for
records written before rows carried them (their names were the zoo's defaults).
"""

from __future__ import annotations

from typing import Any

from zoo.cache.policies import policy_label

FIELDS = ("source", "family", "policy", "budget", "tokens", "nbits", "decoding")
PEER = "kvpress"
NO_PRESS = "no press"  # the peer's uncompressed run (scripts/kvpress_peer.py)


def row_fields(contestant: dict[str, Any]) -> dict[str, Any]:
    """The fields of a zoo contestant (an expanded config entry) that its rows carry."""
    policy = contestant.get("policy")
    return {"source": "zoo", "family": contestant["family"], "policy": None if policy is None else policy_label(policy),
            "budget": contestant.get("budget"), "tokens": contestant.get("tokens"), "nbits": contestant.get("nbits"),
            "decoding": False}


def with_fields(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every field; a record written before rows carried them gets them from what it has (a peer row:
    its ``press`` and ``budget``; a zoo row: its family and the zoo's default name, ``budget tova 50%``,
    ``QuantizedCache 4-bit``, ``window + 4 sinks 512 keys``)."""
    if all(key in row for key in FIELDS):
        return row
    if row.get("family") == PEER:
        press = row.get("press") or row["contestant"].split(" ", 1)[1].rsplit(" ", 1)[0]
        return {**row, "source": PEER, "policy": press, "budget": row.get("budget"), "tokens": None, "nbits": None,
                "decoding": press.startswith("DecodingPress"), **{k: row[k] for k in FIELDS if k in row}}
    words = str(row.get("contestant", "")).split()
    family = row.get("family")
    derived = {"source": "zoo", "family": family, "policy": None, "budget": None, "tokens": None, "nbits": None,
               "decoding": False}
    if family == "budget" and len(words) > 1:
        derived["policy"] = words[1]
    if family in ("budget", "window") and words and words[-1].endswith("%"):
        derived["budget"] = row.get("kept", float(words[-1][:-1]) / 100)
    if family in ("budget", "window") and words[-1:] == ["keys"]:
        derived["tokens"] = int(words[-2])
    if family == "quantized" and words and words[-1].endswith("-bit"):
        derived["nbits"] = int(words[-1].split("-")[0])
    return {**row, **derived, **{k: row[k] for k in FIELDS if k in row}}


def is_reference(row: dict[str, Any]) -> bool:
    """The zoo's full cache: the row every share ("of full") is taken of."""
    return row["source"] == "zoo" and row["family"] == "full"


def is_peer_reference(row: dict[str, Any]) -> bool:
    """The peer's run without a press (kvpress's full cache)."""
    return row["source"] == PEER and row["policy"] == NO_PRESS
