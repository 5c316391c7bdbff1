"""Fixtures of the resource-limit tests (``test_limits_*.py``, ``test_caps_held.py``).

``no_cgroup_left_behind`` is not autouse here: each of those modules applies it to every
test it holds with ``pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")``.
"""

from __future__ import annotations

import time

import pytest

from cyclone_mp.limits.confinement import CGROUPS_ENV

# The helpers the acceptance modules share assert as a test module does (pytest rewrites
# their asserts too, for the same failure reports).
pytest.register_assert_rewrite("dashboard_support", "limits_support", "scenario_support")

MECHANISMS = ["host", "fallback"]


@pytest.fixture
def no_cgroup_left_behind():
    """A test leaves no cgroup behind: its supervisors remove theirs when they stop, and
    the watchdog of a SIGKILLed one removes them for it."""
    from limits_support import cgroup_dirs, left_behind  # not at the top: its import probes the host's cgroups

    before = cgroup_dirs()
    yield
    deadline = time.monotonic() + 5
    while left_behind(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left_behind(before), left_behind(before)


@pytest.fixture(params=MECHANISMS)
def mechanism(request, monkeypatch):
    """Run a test with the host's mechanism and with the fallback (no cgroups)."""
    if request.param == "fallback":
        monkeypatch.setenv(CGROUPS_ENV, "off")
    return request.param
