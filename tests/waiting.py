"""One polling helper for every test module (wait on states, never on bare sleeps)."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.02) -> Any:
    """Poll ``predicate`` every ``interval`` seconds until it returns a truthy value, and
    return that value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
