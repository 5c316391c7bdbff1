"""A clock the test moves, for the pure parts that take ``clock`` (a callable returning
seconds, ``time.monotonic``'s scale)."""

from __future__ import annotations


class Clock:
    """A local monotonic clock the test moves (seconds): call it for the time, set ``now``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
