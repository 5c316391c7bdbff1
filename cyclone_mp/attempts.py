"""Process control's view of claimed steps: attempts, held steps, and the local fence (pure).

An :class:`Attempt` is one execution of a step in a child, named by its lease
(:data:`~cyclone_mp.messages.LeaseKey`). It lives until its child has ended it or is dead
and reaped, whatever happened to the step's row meanwhile: a due kill is carried out
even after the step was retried, reclaimed, cancelled or completed elsewhere.

The local fence (SPEC 9): the database stamps a lease's expiry as ``now() + lease_ttl``
when a claim or renewal *arrives*, so the lease lasts at least until ``sent +
lease_ttl`` (``sent``: the local monotonic time the claim or renewal was sent). A
handler whose lease is not renewed is killed by ``fence - margin``, before another
supervisor can reclaim the step. The only assumption: both clocks advance at the same
rate. ``margin`` (:data:`FENCE_MARGIN` of ``lease_ttl``, at least
:data:`FENCE_MARGIN_MIN`) is far more than any NTP-kept clock's rate error, and room
for the kill itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .limits.declared import NO_LIMITS, Limits
from .limits.verdicts import Usage
from .messages import LeaseKey

FENCE_MARGIN = 0.1  #: fraction of lease_ttl: a handler whose lease could not be renewed is dead this long before it could expire
FENCE_MARGIN_MIN = 0.01  #: seconds


def fence_margin(lease_ttl: float) -> float:
    """Seconds between the kill of an unrenewed handler and its lease's earliest expiry."""
    return max(FENCE_MARGIN_MIN, lease_ttl * FENCE_MARGIN)


@dataclasses.dataclass(slots=True)
class Attempt:
    """One attempt in a child (or queued in one behind another: pipelining).

    Times are the local monotonic clock in seconds. ``lease_sent``: when the claim or the
    last successful renewal was sent (the fence is ``lease_sent + lease_ttl``).
    ``deadline``: the worker-clock deadline, ``claim sent + timeout`` (never later than the
    database's, SPEC 4). ``kill_at``: when the child is SIGKILLed (set by a cancel).
    """

    key: LeaseKey
    run_id: str
    node: str
    step_name: str
    attempt: int
    timeout: float | None
    token: str
    child: Any  # the ChildProc running (or holding) it
    workflow: bool
    started: float
    deadline: float | None
    lease_sent: float
    backoff_spec: Any = None
    trace: Any = None  # the run's stored trace context (a span per attempt links to it)
    limits: Limits = NO_LIMITS  # its resource caps: sampled while it runs when set
    # When its row was claimed, by this clock: when the claim was sent. The database's
    # now() is its transaction's start, a one-way trip later (and the statement's
    # parameters built): a start delay from here is that much long. The midpoint of the
    # round trip would add half the statement's run, long under load (settles ride with claims).
    claimed: float = 0.0
    progress: Any = None
    cancel_reason: str | None = None
    kill_at: float | None = None
    killed_by: str | None = None
    ended: bool = False  # its outcome is decided (a result came, or its child is dead)
    fenced: bool = False  # cancelled by the local fence: its lease may still be ours (a success is still written)
    cpu_start: float = 0.0  # the child's CPU seconds when the attempt began (children are reused)
    forensics: Mapping[str, Any] | None = None  # its error entry as judged (None until it ends)
    peak_rss_kb: int | None = None  # sampled while it runs (a crashed child cannot be read)
    start_by: float | None = None  # queued in a child: the child never starts it after this (time.monotonic())
    started_wall: float | None = None  # wall-clock epoch seconds it started in its child (None: never started)
    base: Any = None  # where its slot's counters stood when it started (limits.sampling.Baseline), when limited
    usage: Usage | None = None  # the last sample of its tree
    killed_for: str | None = None  # the cap the supervisor killed its tree for (a cause of death)
    lingering: list[str] | None = None  # its handler ended after a cancel, these threads of it did not
    lingering_result: dict[str, Any] | None = None  # the result the child sent meanwhile (used if they end)
    processes_by: str | None = None  # what held its max_processes (a Mechanism word), when it has one
    files: tuple[str, ...] = ()  # the outputs files of its upstream map nodes (cyclone_mp.mapped), deleted at its end

    def began_in_child(self, began: Any, now: float, mono: float) -> None:
        """Take the child's own start of the handler as its start. ``began`` is a result's
        ``began``: CLOCK_MONOTONIC in the child, the one clock of every process on the
        machine (``time.monotonic()``), read as ``mono`` when this attempt's clock read
        ``now``. The start process control noted (when it sent the task; for a step queued
        in the child, when it read the result before it) can be tens of milliseconds off
        under load. A value that is not a float, or lies before the claim or after
        ``now``, is ignored."""
        if type(began) is float:  # the JSON number a child sends (a bool or an int is not one)
            at = now - (mono - began)
            if self.claimed <= at <= now:
                if self.started_wall is not None:
                    self.started_wall += at - self.started
                self.started = at

    def start_delay(self) -> float | None:
        """Seconds from its claim to its handler's start (None: it never started)."""
        return None if self.started_wall is None else max(0.0, self.started - self.claimed)

    @property
    def step_id(self) -> int:
        return self.key[0]

    @property
    def generation(self) -> int:
        return self.key[1]

    def fence(self, lease_ttl: float) -> float:
        """The earliest moment the lease may expire in the database (local clock)."""
        return self.lease_sent + lease_ttl

    def guards_lease(self) -> bool:
        """True while this attempt must die before its lease can expire: always, unless it
        was cancelled for a timeout or by an operator (then the row has moved on by the
        database's own rules and only ``kill_grace`` applies, SPEC 4)."""
        return self.cancel_reason not in ("timeout", "cancelled")


def fence_cancel_at(att: Attempt, lease_ttl: float, kill_grace: float) -> float:
    """When to cancel an attempt whose lease is not being renewed: ``kill_grace`` before
    the fence's kill where possible, but never before two renewals were due and had time
    to come back (three quarters of a lease after the last good one was sent): a renewal
    that is merely late (a busy machine) does not doom a healthy attempt, whose
    ``kill_grace`` may be longer than its ``lease_ttl``. A cancel is never taken back."""
    kill_by = att.fence(lease_ttl) - fence_margin(lease_ttl)
    return max(kill_by - kill_grace, att.lease_sent + 0.75 * lease_ttl)


@dataclasses.dataclass(slots=True)
class Held:
    """A claimed step that no child has taken yet (free slots fill at once; more are held
    with ``prefetch``). ``sent``: when its claim was sent (its lease and DB timeout count
    from then); ``arrived``: when the row came back; ``release_at``: released (available
    at once, no attempt used) if still held then; ``lease_sent``: when the last renewal
    of its lease that held was sent (the claim's ``sent`` until one is)."""

    key: LeaseKey
    row: dict[str, Any]
    sent: float
    arrived: float
    release_at: float
    lease_sent: float


def hold_bound(lease_ttl: float, timeout: float | None, cap: float) -> float:
    """Seconds a held step may wait for a child after it arrived (fairness to other
    supervisors, and its timeout already counting): min(``cap``, ``lease_ttl / 4``,
    ``timeout / 10``). Counted from arrival, never from the claim's sending: a step is
    never released for having taken long to arrive."""
    bound = min(cap, lease_ttl / 4)
    return bound if timeout is None else min(bound, timeout / 10)


def startable(now: float, *, claim_sent: float, lease_sent: float, lease_ttl: float, timeout: float | None) -> bool:
    """A claimed row may start while its lease can be kept (less than half of it spent
    since the claim or the last renewal was sent) and its DB deadline (``claim_sent +
    timeout``) has not passed on the local clock."""
    if now >= lease_sent + lease_ttl / 2:
        return False
    return timeout is None or now < claim_sent + timeout
