"""Retry backoff (SPEC section 3): ``attempt**4`` seconds with +-10 % jitter by default."""

from __future__ import annotations

import random
from typing import Callable

BackoffFn = Callable[[int], float]

JITTER = 0.10


def default_backoff(attempt: int, *, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before the attempt after ``attempt`` (River's default).

    ``attempt`` is the number of the attempt that just failed (1 for the first).
    Returns ``attempt**4`` seconds, jittered by up to +-10 %.
    """
    base = float(attempt) ** 4
    return base * (1.0 + JITTER * (2.0 * rand() - 1.0))


def compute_backoff(fn: BackoffFn | None, attempt: int) -> float:
    """Apply a step's own ``backoff(attempt) -> seconds`` or the default; never negative.

    A user backoff that raises or returns a non-number falls back to the default.
    """
    if fn is None:
        return default_backoff(attempt)
    try:
        value = float(fn(attempt))
    except Exception:  # noqa: BLE001 - a broken user backoff must not kill the supervisor
        return default_backoff(attempt)
    return max(0.0, value) if value == value else default_backoff(attempt)
