"""The lease keeper's pure parts: why a renewal matched nothing, and when a lease is
first renewed."""

from __future__ import annotations

import pytest

from cyclone_mp import decisions
from cyclone_mp.leases import first_beat, lost_reason

OWNER = "host:1:abc"


def row(**overrides):
    base = {"state": "running", "lease_owner": OWNER, "lease_generation": 3, "timed_out": False,
            "last_error_kind": None, "last_error_generation": None}
    return {**base, **overrides}


@pytest.mark.parametrize("found, reason", [
    (None, "cancelled"),  # the run was deleted (pruned): nothing to keep
    (row(state="cancelled"), "cancelled"),
    (row(timed_out=True), "timeout"),  # still ours, past its DB deadline
    (row(), "lease_lost"),  # still ours and in time: the renewal itself failed to match (an expired lease)
    (row(state="available", lease_generation=4, last_error_kind=decisions.TIMEOUT, last_error_generation=3),
     "timeout"),  # the sweep settled this attempt's timeout first
    (row(state="completed"), "finished"),  # our own outcome crossed the renewal
    (row(state="discarded"), "finished"),
    (row(state="completed", lease_generation=4), "lease_lost"),  # someone else's attempt finished it
    (row(lease_owner="other:2:def", lease_generation=4), "lease_lost"),  # reclaimed by another supervisor
])
def test_lost_reason(found, reason):
    assert lost_reason(found, OWNER, 3) == reason


def test_first_beat_is_in_the_second_half_of_the_interval():
    beats = [first_beat(10.0) for _ in range(2000)]
    assert all(5.0 <= b <= 10.0 for b in beats)
    assert min(beats) < 5.5 and max(beats) > 9.5  # spread over the whole half
