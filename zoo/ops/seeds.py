"""Seeds that are the same in every process and on every platform, for variants that draw random structure
(BigBird's random blocks, Performer's features, Reformer's hash rotations) from their parameters."""

from __future__ import annotations

import hashlib


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of ``parts`` (Python's ``hash`` is salted per process for strings)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
