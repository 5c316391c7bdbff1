"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
from fake_clock import Clock


@pytest.fixture
def clock() -> Clock:
    """A clock the test moves, at 100.0 s."""
    return Clock()
