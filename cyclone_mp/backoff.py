"""Retry backoff (SPEC section 3): ``attempt**4`` seconds with +-10 % jitter by default."""

from __future__ import annotations

import random
from typing import Callable

BackoffFn = Callable[[int], float]
#: A backoff that can be stored on the step row: constant seconds, or a schedule of seconds
#: (the n-th failed attempt waits ``schedule[n - 1]``, the last entry repeating).
BackoffSpec = float | int | list[float] | tuple[float, ...]
Backoff = BackoffFn | BackoffSpec

JITTER = 0.10


def default_backoff(attempt: int, *, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before the attempt after ``attempt`` (River's default).

    ``attempt`` is the number of the attempt that just failed (1 for the first).
    Returns ``attempt**4`` seconds, jittered by up to +-10 %.
    """
    base = float(attempt) ** 4
    return base * (1.0 + JITTER * (2.0 * rand() - 1.0))


def check_backoff(value: object) -> None:
    """Raise ValueError unless ``value`` is None, a callable, seconds >= 0, or a non-empty
    list of seconds >= 0."""
    if value is None or callable(value):
        return
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf") for x in items):
        raise ValueError(
            "backoff must be backoff(attempt) -> seconds, seconds >= 0, or a non-empty list of seconds >= 0"
        )


def storable_backoff(value: object) -> BackoffSpec | None:
    """The JSON form of a backoff that can be stored on the row (None for a callable)."""
    if value is None or callable(value):
        return None
    return [float(x) for x in value] if isinstance(value, (list, tuple)) else float(value)  # type: ignore[arg-type]


def from_spec(spec: BackoffSpec, attempt: int) -> float:
    """Seconds before the attempt after ``attempt`` under a stored spec (no jitter)."""
    if isinstance(spec, (list, tuple)):
        return float(spec[min(max(attempt, 1), len(spec)) - 1])
    return float(spec)


def delay_after(attempt: int, spec: BackoffSpec | None, fallback: BackoffFn) -> float:
    """Seconds before the attempt after ``attempt``: the step row's stored spec wins,
    else ``fallback(attempt)`` (the step's or client's callable, or the default)."""
    return from_spec(spec, attempt) if spec is not None else fallback(attempt)


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
