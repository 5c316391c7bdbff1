"""Client and supervisor configuration: one frozen dataclass, seconds everywhere, checked early.

Defaults follow the seed and River: ``lease_ttl`` 30 s (crash-detection latency),
``poll_interval`` [0.1, 1.0) s (the sweep ticks on it too), ``max_attempts`` 25,
``kill_grace`` 5 s, ``shutdown_grace`` 30 s.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .attempts import fence_margin
from .durations import Duration, seconds
from .errors import ConfigurationError
from .protocol import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD_LIMIT
from .steps import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, StepOptions, check_name

LEASE_TTL_DEFAULT = 30.0
KILL_GRACE_DEFAULT = 5.0
SHUTDOWN_GRACE_DEFAULT = 30.0
POLL_INTERVAL_DEFAULT = (0.1, 1.0)
SWEEP_LIMIT = 100  # candidates per sweep pass (seed)
KILL_SLACK = 0.5  # seconds past a cancel's kill within which the tree is dead and reaped (Config.kill_within)
PREFETCH_MAX_WAIT = 0.5  # seconds a prefetched step may wait for a child before it is released
#: Steps the live supervisors on one database hold together (up to 64 of them; then
#: PREFETCH_SHARE_MIN each): each holds at most its share, so up to 8 hold the default
#: whole. More supervisors each holding the default ran slower and released steps they
#: could not start in time (benchmarks/README.md, "the fleet's prefetch budget").
PREFETCH_FLEET = 2048
PREFETCH_SHARE_MIN = 32  # a supervisor's share of PREFETCH_FLEET is never below this
PREFETCH_DEFAULT = 256  # steps a supervisor may hold beyond its idle children by default (bounded by prefetch_room to what its children start within ~0.25 s)
COALESCE_MAX = 0.1  # seconds: with prefetch, a finished step's outcome may wait this long for others to share its statement (pgqueuer: 0.1 s)
COALESCE_PER_WORKER = 4  # outcomes per child that go at once, without waiting COALESCE_MAX (pgqueuer: 10 in all)
PIPELINE_DEPTH = 128  # steps queued in a busy child, at most (fewer when they would wait over half the hold bound; a child sleeps less: 20,000 no-ops took ~25 % less CPU with 4 than with 1, and ~18 % less again with 16)
PRELOAD_TIMEOUT = 30.0  # seconds a new child may spend importing one handler module before it is killed and the module is left to its steps
PIPELINE_MAX_STEP = 0.01  # seconds: with attempts shorter than this (moving average), a busy child gets up to PIPELINE_DEPTH queued
ARCHIVE_AFTER_DEFAULT = 600.0  # seconds a finished run stays in the hot tables before maintenance archives it
HISTORY_INTERVAL = 5.0  # seconds between two history passes of a supervisor's maintenance (archive, retention)
HISTORY_BUSY_INTERVAL = 0.5  # seconds until the next pass when the last one left work behind (its budget ran out)
HISTORY_BUDGET = 1.0  # seconds of history work per pass at most (its batches; the sweep waits for it)
HISTORY_BATCH = 1000  # finished step rows a history statement looks at, at most (their runs move together)
HISTORY_WALK_RESTART = 60.0  # seconds between two walks of the finished steps from the oldest (history.py)
HISTORY_DDL_LOCK_TIMEOUT = 0.2  # seconds a partition's CREATE or DROP may wait for its lock before it gives up
START_METHODS = ("zygote", "spawn")  # how children start; the first is the default
VACUUM_WATCH_INTERVAL = 5.0  # seconds between two looks of a supervisor's maintenance at the xmin horizon (history.VacuumWatch)
VACUUM_HELD_FOR = 10.0  # seconds the same transaction must stay the oldest one running to count as holding vacuum back
VACUUM_MIN_DEAD = 10_000  # dead row versions in the hot tables worth a VACUUM of them when such a transaction ends
VACUUM_BOUND = 300.0  # seconds that VACUUM may take before its connection is abandoned
PIPELINE_ONE_MAX_STEP = 0.1  # seconds: with attempts shorter than this, one (B2's 20 ms steps: a core no longer idles between two)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a Client and its supervisor need besides the DSN and the mux.

    Attributes:
        workers: child slots (handlers running at once), >= 1. Default 4.
        lease_ttl: seconds a lease lasts without renewal (crash-detection latency);
            renewed every ``lease_ttl/3`` (seed "Lease TTL"). Default 30.
        kill_grace: seconds between the cooperative cancel and the SIGKILL of the
            child's process tree (SPEC 4). Default 5.
        poll_interval: ``(min, max)`` seconds between claims when idle (one number: both);
            the recovery sweep ticks at a random point of this range. Default (0.1, 1.0).
        shutdown_grace: seconds in-flight handlers may run on after a soft shutdown
            before they are cancelled and released (SPEC 5). Default 30.
        queues: the queues this supervisor claims from; default ``("default",)``.
        defaults: client-wide step options (``timeout``, ``max_attempts`` 25,
            ``max_reclaims``, ``backoff``, ``queue``, ``priority``).
        max_steps_per_child: recycle a child after this many steps (None: never).
        max_child_rss: recycle a child whose RSS exceeds this many bytes (None: never).
        max_payload: largest input or output in bytes (default 64 MiB); larger ones are
            rejected with a clear error.
        prefetch: steps the supervisor may claim beyond its idle children, held until a
            child frees up (default :data:`PREFETCH_DEFAULT`, 256; 0: claim only
            for idle children, SPEC 4's rule to the letter). With other supervisors live on
            the database each holds at most its share of :data:`PREFETCH_FLEET`
            (:meth:`cyclone_mp.holding.Holding.prefetch_share`). See
            :meth:`cyclone_mp.holding.Holding.prefetch_room` for the bounds; while
            attempts are short a busy child also gets held steps queued
            (:meth:`cyclone_mp.holding.Holding.pipeline_depth`: up to ``PIPELINE_DEPTH``
            under ``PIPELINE_MAX_STEP``, one under ``PIPELINE_ONE_MAX_STEP``), and a claim
            counts their free places beside ``prefetch``.
        registry_interval: seconds between refreshes of the ``cyclone_workers`` row (what
            ``cyclone-mp workers`` shows; the live rows, refreshed within ``max(5 s, 3 x
            registry_interval)``, size each supervisor's share of the fleet's prefetch).
        pgbouncer: the DSN goes through PgBouncer in transaction mode: no
            session state (every setting is set per transaction), no LISTEN on that DSN
            (a direct ``listen_dsn``, else polling only). See docs/operating.md.
        prepared_statements: named prepared statements (the driver's); default True, and
            False with ``pgbouncer`` unless asked for (PgBouncer 1.21 or later with
            ``max_prepared_statements`` above 0 keeps them per server connection).
        archive_after: seconds (or text: ``"10m"``) a finished (completed, discarded, cancelled) run stays in
            the hot tables before the supervisors' maintenance moves it, with its steps
            and signals, to the archive tables; None: never (the hot tables
            keep everything). Default 600.
        retain_completed, retain_discarded, retain_cancelled: seconds (or ``"7d"``) a run finished in
            that state is kept (hot or archived) before maintenance deletes it, dropping
            whole archive partitions where it can; None (the default): forever.
        start_method: how children start: ``"zygote"`` (default: forked from a
            process that imported the runner and the handlers' modules once, a few
            milliseconds each) or ``"spawn"`` (a fresh interpreter each, tens of
            milliseconds). Both keep every guarantee of SPEC 1; see
            docs/operating.md#how-children-start.
    """

    workers: int = 4
    lease_ttl: float = LEASE_TTL_DEFAULT
    kill_grace: float = KILL_GRACE_DEFAULT
    poll_interval: tuple[float, float] = POLL_INTERVAL_DEFAULT
    shutdown_grace: float = SHUTDOWN_GRACE_DEFAULT
    queues: tuple[str, ...] = (DEFAULT_QUEUE,)
    defaults: StepOptions = StepOptions(max_attempts=DEFAULT_MAX_ATTEMPTS, queue=DEFAULT_QUEUE, priority=0)
    max_steps_per_child: int | None = None
    max_child_rss: int | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD
    prefetch: int = PREFETCH_DEFAULT
    registry_interval: float = 2.0
    pgbouncer: bool = False
    prepared_statements: bool = True
    archive_after: float | None = ARCHIVE_AFTER_DEFAULT
    retain_completed: float | None = None
    retain_discarded: float | None = None
    retain_cancelled: float | None = None
    start_method: str = START_METHODS[0]

    @classmethod
    def build(
        cls,
        *,
        workers: int = 4,
        lease_ttl: Duration = LEASE_TTL_DEFAULT,
        kill_grace: Duration = KILL_GRACE_DEFAULT,
        poll_interval: Duration | Sequence[Duration] = POLL_INTERVAL_DEFAULT,
        shutdown_grace: Duration = SHUTDOWN_GRACE_DEFAULT,
        queues: Sequence[str] | str | None = None,
        max_steps_per_child: int | None = None,
        max_child_rss: int | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        prefetch: int = PREFETCH_DEFAULT,
        registry_interval: Duration = 2.0,
        pgbouncer: bool = False,
        prepared_statements: bool | None = None,
        archive_after: Duration | str | None = ARCHIVE_AFTER_DEFAULT,
        retain_completed: Duration | str | None = None,
        retain_discarded: Duration | str | None = None,
        retain_cancelled: Duration | str | None = None,
        start_method: str = START_METHODS[0],
        **step_defaults: object,
    ) -> "Config":
        """Validate raw options (SPEC 2's ``Client(...)`` keywords). The history options
        (``archive_after``, ``retain_*``) also take a duration as text: ``"7d"``, ``"12h"``.

        Raises:
            ConfigurationError: a value is out of range or of the wrong type.
        """
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ConfigurationError(f"workers must be an int >= 1, got {workers!r}")
        if isinstance(poll_interval, (list, tuple)):
            if len(poll_interval) != 2:
                raise ConfigurationError("poll_interval must be seconds or a (min, max) pair")
            lo = seconds(poll_interval[0], "poll_interval", allow_none=False)
            hi = seconds(poll_interval[1], "poll_interval", allow_none=False)
        else:
            lo = hi = seconds(poll_interval, "poll_interval", allow_none=False)  # type: ignore[arg-type]
        assert lo is not None and hi is not None
        if hi < lo:
            raise ConfigurationError(f"poll_interval max ({hi}) is below min ({lo})")
        if isinstance(queues, str):
            queues = (queues,)
        queue_tuple = tuple(queues) if queues else (str(step_defaults.get("queue") or DEFAULT_QUEUE),)
        for q in queue_tuple:
            check_name(q, "queue")
        for name, value in (("max_steps_per_child", max_steps_per_child), ("max_child_rss", max_child_rss)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigurationError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if (not isinstance(max_payload, int) or isinstance(max_payload, bool)
                or not 1024 <= max_payload <= MAX_PAYLOAD_LIMIT):
            raise ConfigurationError(
                f"max_payload must be an int from 1024 to {MAX_PAYLOAD_LIMIT} bytes (jsonb's limit), got {max_payload!r}")
        if not isinstance(pgbouncer, bool):
            raise ConfigurationError(f"pgbouncer must be True or False, got {pgbouncer!r}")
        if prepared_statements is not None and not isinstance(prepared_statements, bool):
            raise ConfigurationError(f"prepared_statements must be True, False or None, got {prepared_statements!r}")
        if start_method not in START_METHODS:
            raise ConfigurationError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
                                     f"got {start_method!r}")
        unknown = set(step_defaults) - {f.name for f in dataclasses.fields(StepOptions)}
        if unknown:
            raise ConfigurationError(f"unknown option(s): {', '.join(sorted(unknown))}")
        defaults = StepOptions.build(**step_defaults).over(  # type: ignore[arg-type]
            StepOptions(max_attempts=DEFAULT_MAX_ATTEMPTS, queue=DEFAULT_QUEUE, priority=0)
        )
        return cls(
            workers=workers,
            lease_ttl=seconds(lease_ttl, "lease_ttl", allow_none=False),  # type: ignore[arg-type]
            kill_grace=seconds(kill_grace, "kill_grace", allow_none=False, allow_zero=True),  # type: ignore[arg-type]
            poll_interval=(lo, hi),
            shutdown_grace=seconds(shutdown_grace, "shutdown_grace", allow_none=False, allow_zero=True),  # type: ignore[arg-type]
            queues=queue_tuple,
            defaults=defaults,
            max_steps_per_child=max_steps_per_child,
            max_child_rss=max_child_rss,
            max_payload=max_payload,
            prefetch=prefetch,
            registry_interval=seconds(registry_interval, "registry_interval", allow_none=False),  # type: ignore[arg-type]
            pgbouncer=pgbouncer,
            prepared_statements=not pgbouncer if prepared_statements is None else prepared_statements,
            archive_after=seconds(archive_after, "archive_after", allow_zero=True, allow_text=True),
            retain_completed=seconds(retain_completed, "retain_completed", allow_zero=True, allow_text=True),
            retain_discarded=seconds(retain_discarded, "retain_discarded", allow_zero=True, allow_text=True),
            retain_cancelled=seconds(retain_cancelled, "retain_cancelled", allow_zero=True, allow_text=True),
            start_method=start_method,
        )

    @property
    def retention(self) -> dict[str, float | None]:
        """Seconds each finished state is kept (None: forever): ``{"completed": ...,
        "discarded": ..., "cancelled": ...}``."""
        return {"completed": self.retain_completed, "discarded": self.retain_discarded,
                "cancelled": self.retain_cancelled}

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between renewals of one lease: ``lease_ttl / 3`` (seed)."""
        return self.lease_ttl / 3.0

    @property
    def kill_within(self) -> float:
        """Seconds after a cancel by which this supervisor's handler is dead and reaped at
        the latest: ``kill_grace``, then the kill itself, or the watchdog's if this process
        is frozen (a quarter second, or the fence's margin), and :data:`KILL_SLACK` to reap.
        Written on every claimed row: after a timeout or a cancel, the step waits that long
        for its supervisor to report the child dead before it may run again (SPEC 9)."""
        return self.kill_grace + max(0.25, fence_margin(self.lease_ttl)) + KILL_SLACK

    @property
    def call_bound(self) -> float:
        """Seconds a lease keeper's call (a claim, a renewal) may take before its connection
        is abandoned and opened again: ``lease_ttl / 3``, at least 0.5 s. A black-holed
        connection is noticed that fast."""
        return max(0.5, self.lease_ttl / 3.0)

    @property
    def write_bound(self) -> float:
        """Seconds an outcome writer's or maintenance call may take before its connection is
        abandoned: ``lease_ttl / 3``, at least 5 s (settling a batch of a workflow's steps
        on a busy server may take a while; nothing waits on it but the writes themselves)."""
        return max(5.0, self.lease_ttl / 3.0)

    @property
    def reconnect_cap(self) -> float:
        """Seconds at most between two tries to reconnect after an outage (the delay doubles
        from 0.1 s): ``lease_ttl / 4`` within [0.25, 2] s, so a supervisor cut off from the
        database is back within about a lease once it is reachable again."""
        return max(0.25, min(2.0, self.lease_ttl / 4.0))

    @property
    def lock_timeout(self) -> float:
        """Seconds a supervisor's statement waits for a row lock before it gives up and is
        tried again (``lock_timeout``): ``lease_ttl / 6`` within [0.05, 1] s. One locked
        row holds back its own renewal, never the others', the claims or a kill."""
        return max(0.05, min(1.0, self.lease_ttl / 6.0))

    @property
    def idle_in_transaction_limit(self) -> float:
        """Seconds one of this client's sessions may sit idle inside a transaction before
        PostgreSQL ends it: one heartbeat interval, at least 1 s. A process frozen mid-
        transaction (SIGSTOP, a paused VM, a debugger) holds its row locks only that long,
        so other supervisors keep renewing their leases (a frozen supervisor stalled a
        healthy one for the whole freeze)."""
        return max(1.0, self.heartbeat_interval)
