"""What the hostile-data tests share (``tests/acceptance/test_hostile_*.py`` and
``tests/unit/test_payload_rules.py``): the words of the depth limit's message, and a
frame as the protocol sends one."""

from __future__ import annotations

from cyclone_mp import protocol

LIMIT_WORDS = f"deeper than {protocol.MAX_DEPTH} levels"


def frame(body: bytes) -> bytes:
    return protocol.HEADER.pack(len(body)) + body
