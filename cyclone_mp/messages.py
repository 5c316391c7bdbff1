"""What the supervisor's parts tell each other: plain, immutable data.

The supervisor's parts share no mutable state (:mod:`cyclone_mp.supervisor` lists them):
process control (:mod:`cyclone_mp.control`, the supervisor's own thread, never a database
call), the lease keeper (:mod:`cyclone_mp.leases`, renewals only), the listener
(:mod:`cyclone_mp.listener`, LISTEN), the outcome writer (:mod:`cyclone_mp.outcomes`,
claims and the CAS writes of ended attempts), maintenance (:mod:`cyclone_mp.sweep`) and
the payload loader (:mod:`cyclone_mp.loader`). Each part reads an
:class:`~cyclone_mp.mailbox.Inbox`; the others post these messages to it.

A step's lease is named by :data:`LeaseKey`, ``(step id, lease generation)``: one life of
a step. A step retried or reclaimed is a new life with a new key, so nothing about an
old attempt (its kill, its outcome, its forensics) can be mistaken for the new one's.
Times are the local monotonic clock, in seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

LeaseKey = tuple[int, int]  #: ``(step id, lease generation)``

COMPLETE, FAIL, RELEASE, SNOOZE = "complete", "fail", "release", "snooze"  #: kinds of :class:`Outcome`


# -- process control -> lease keeper ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Progress:
    """The latest ``{done, total, message}`` of an attempt: stored with its next renewal (SPEC 2)."""

    wakes: ClassVar[bool] = False  # read on the keeper's next turn (see Track)
    key: LeaseKey
    value: Any


# -- process control, outcome writer -> lease keeper ------------------------------------------

@dataclasses.dataclass(frozen=True)
class Track:
    """Renew these leases from now on: the outcome writer claimed them along with a batch
    of outcomes (one statement for both), at ``sent``.

    It does not wake the keeper (:meth:`~cyclone_mp.mailbox.Inbox.post`): the keeper reads
    it on its next turn, at most a heartbeat interval away, so a new lease's first renewal
    comes at most ``lease_ttl / 3`` after its claim was sent, long before the fence's cancel
    at three quarters of a lease. Waking the keeper for every batch would cost the
    supervisor's loop about a tenth of its throughput in thread switches."""

    wakes: ClassVar[bool] = False
    keys: tuple[LeaseKey, ...]
    sent: float


@dataclasses.dataclass(frozen=True)
class Started:
    """The handlers of these leases started, each ``delay`` seconds after its claim (they
    waited for a child): ``items`` are ``(key, delay)``. The lease keeper stores each with
    its lease's next renewal, so a running step's ``started_at`` tells the truth before its
    outcome does. Process control sends one per turn for the attempts it started."""

    wakes: ClassVar[bool] = False
    items: tuple[tuple[LeaseKey, float], ...]


@dataclasses.dataclass(frozen=True)
class LeaseDone:
    """Stop renewing these leases: their outcomes were written (or are moot), or they were
    released. Read on the keeper's next turn, before it renews anything (see Track)."""

    wakes: ClassVar[bool] = False
    keys: tuple[LeaseKey, ...]


@dataclasses.dataclass(frozen=True)
class Reaped:
    """These attempts ended after a cancel or a timeout, and nothing of them runs any
    more (their handler returned, or their child is dead and reaped; or, ``started``
    False, no handler ever started: held, or queued behind a busy child, when the cancel
    came): the outcome writer records it (``dead_by``), so their steps may run again,
    and their concurrency slots go to others, at once (SPEC 9)."""

    keys: tuple[LeaseKey, ...]
    started: bool = True


# -- lease keeper, outcome writer, maintenance -> process control ---------------------------------

@dataclasses.dataclass(frozen=True)
class Written:
    """The outcome writer is done with ``batches`` of the counted :class:`Batch` messages
    posted to it (written in one statement, or kept to write again). With prefetch,
    process control keeps one statement in flight: what ends meanwhile waits for this,
    then goes in the next statement together, with a claim for all the room there is."""

    batches: int


@dataclasses.dataclass(frozen=True)
class Claimed:
    """The rows a claim took (possibly none): one a :class:`Batch` asked for. ``sent``: when the claim
    was sent; the database stamped the leases later, so they last at least until
    ``sent + lease_ttl``. ``failed``: the claim did not run (an outage, a rejected call).
    ``wait``: seconds after which a step that a rate limit held back from this claim may
    start (:attr:`cyclone_mp.store.ClaimResult.wait`), or None: process control
    polls again no later than that."""

    rows: tuple[dict[str, Any], ...]
    sent: float
    limit: int
    failed: bool = False
    wait: float | None = None


@dataclasses.dataclass(frozen=True)
class Renewed:
    """A renewal of ``key`` sent at ``sent`` matched its row: the lease lasts at least until
    ``sent + lease_ttl`` in the database (the local fence, SPEC 9)."""

    key: LeaseKey
    sent: float


@dataclasses.dataclass(frozen=True)
class LeaseLost:
    """A renewal of ``key`` matched nothing; ``reason`` says why: ``"cancelled"``,
    ``"timeout"``, ``"lease_lost"`` or ``"finished"`` (the outcome was already written)."""

    key: LeaseKey
    reason: str


@dataclasses.dataclass(frozen=True)
class DatabaseState:
    """The lease keeper's connection went down (``ok=False``) or came back."""

    ok: bool


@dataclasses.dataclass(frozen=True)
class Poll:
    """Something may be claimable now (a NOTIFY, a reclaim, a retry without backoff)."""


@dataclasses.dataclass(frozen=True)
class Fleet:
    """How many supervisors are live on the database (this one included), as the
    registry said: process control holds its share of :data:`~cyclone_mp.config.PREFETCH_FLEET`."""

    wakes: ClassVar[bool] = False  # read on the next turn
    live: int


# -- outcome writer -> payload loader -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Load:
    """Claimed rows whose input or upstream outputs were too big to come with the claim
    (``big``): the payload loader reads them alone, with a bound of their own, and hands
    the rows to process control (:class:`Claimed`, ``limit`` 0); a row it cannot read
    fails alone."""

    rows: tuple[dict[str, Any], ...]
    sent: float


# -- process control -> outcome writer ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Batch:
    """Outcomes to write, and (``claim`` > 0) the next claim to make in the same statement:
    a child freed by one of these attempts gets its next step in one round trip, and the
    finished row is written before its slot is claimed again (SPEC 4: as many steps as
    there are free child slots)."""

    outcomes: tuple["Outcome", ...]
    claim: int = 0
    start_now: int = 0  #: of ``claim``, how many idle children can start at once (rate-limited steps: no more)
    #: process control counts it in ``batches_out`` and waits for its :class:`Written`
    #: (False: a held step's release, posted outside that count)
    counted: bool = True


class Outcome(NamedTuple):
    """How one attempt ended, to be written with the CAS guard (SPEC 1).

    ``kind`` is :data:`COMPLETE` (``output``), :data:`FAIL` (``error_kind``, a
    :data:`~cyclone_mp.decisions.FAILURE_KINDS` value, and ``entry``, its error entry;
    ``require_timed_out``: written only once the DB deadline has passed) or
    :data:`RELEASE` (a step given back unstarted or at shutdown: available at once,
    nothing counted; ``held``: it had been claimed ahead, for prefetch) or
    :data:`SNOOZE` (the handler raised ``cy.Snooze``: available ``snooze`` seconds later,
    no attempt spent).
    ``attempt`` and ``backoff_spec`` decide the backoff of a retried failure.

    A named tuple, not a frozen dataclass: one is made per attempt, and a frozen
    dataclass's ``__init__`` sets each of its fields through ``object.__setattr__``.
    Change one with ``outcome._replace(...)``.
    """

    key: LeaseKey
    kind: str
    step_name: str
    attempt: int
    workflow: bool
    backoff_spec: Any = None
    output: Any = None
    progress: Any = None
    error_kind: str | None = None
    entry: dict[str, Any] | None = None
    require_timed_out: bool = False
    held: bool = False
    start_delay: float | None = None  # seconds from the claim to the handler's start (None: it never started)
    snooze: float = 0.0  # SNOOZE: seconds until the step runs again (no attempt spent)
    run_id: str = ""  # its run and node (what on_step_discarded hooks are told)
    node: str = ""
    spawns: tuple[dict[str, Any], ...] = ()  # COMPLETE: the runs its handler spawned (ctx.spawn), written with it

    @property
    def step_id(self) -> int:
        return self.key[0]

    @property
    def generation(self) -> int:
        return self.key[1]
