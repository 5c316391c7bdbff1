"""The public entry point: enqueue and manage runs, and run the supervisor (SPEC section 2).

``Client`` holds a connection pool (:mod:`cyclone_mp.store.pools`) for API calls; the supervisor it starts opens its
own connections (so it can reconnect on its own after an outage). Each call's checks and
its operation are planned in :mod:`cyclone_mp.planning` (shared with
:class:`~cyclone_mp.AsyncClient`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import tracing
from .store import operations
from .config import ARCHIVE_AFTER_DEFAULT, PREFETCH_DEFAULT, START_METHODS, Config
from .connections import Connection, DriverError, answered_within, classify, connect, redact
from .durations import Duration
from .errors import (
    ConfigurationError, CycloneError, DatabaseError, DatabaseReadOnly, DatabaseStalled, DatabaseUnavailable,
    InvalidTransition, WaitTimeout,
)
from .embedded import server_for_dsn
from .procs import refuse_in_child
from .supervisor import Supervisor
from .filters import When
from .store.operations import Op
from .planning import ClientBase
from .schedules import ACTIVE_WITHIN
from .status import RunStatus, StepStatus
from .mux import Mux
from .steps import Step, check_name
from .store import Store
from .store.pools import POOL_TIMEOUT, ConnectionPool, PoolTimeout, api_pool
from .waiting import MAP_PAGE, Waiter, map_output, needs_map_outputs, reread, result_of, with_outputs
from .workflow import Workflow

log = logging.getLogger("cyclone_mp.client")

#: Seconds between checks, while a call waits for a connection, that the server is still
#: there: a server that went away fails the call at once, not after POOL_TIMEOUT.
POOL_PROBE_EVERY = 1.0


class Client(ClientBase):
    """A connection to the cyclone tables, and (with ``run``/``start``) a supervisor.

    Durations are seconds (``int``/``float``) or ``datetime.timedelta`` (SPEC section 2).

    Args:
        dsn: PostgreSQL connection string; None means the embedded default server,
            started or reused on first use (SPEC 2).
        mux: the registered steps and workflows; required to run a supervisor, and to
            enqueue by name.
        workers: child slots of the supervisor (handlers running at once), >= 1.
        lease_ttl: seconds a lease lasts without renewal (crash-detection latency);
            renewed every ``lease_ttl / 3`` (seed "Lease TTL"). Default 30.
        kill_grace: seconds between the cooperative cancel and the SIGKILL of the
            child's process tree (SPEC 4). Default 5.
        poll_interval: seconds, or a ``(min, max)`` pair, between claims when idle;
            the recovery sweep ticks at a random point of it (seed). Default (0.1, 1.0).
        max_reclaims: default bound on lease-expiry reclaims for runs this client
            enqueues (stored on each step row); None is unbounded (SPEC 3).
        shutdown_grace: seconds in-flight handlers may run on after a soft shutdown
            before they are cancelled and released (SPEC 5). Default 30.
        queues: queues the supervisor claims from; default ``("default",)``.
        timeout: default per-attempt timeout, seconds; None means no timeout.
        max_attempts: default attempts before discard (25, River's default).
        backoff: default backoff: ``backoff(attempt) -> seconds``, seconds, or a list
            of seconds per failed attempt; default ``attempt**4`` +-10 %.
        queue: default queue of enqueued steps (``"default"``).
        priority: default priority of enqueued steps; lower runs first (0).
        memory_limit: default memory cap of the steps this client enqueues: bytes (or
            ``"512MiB"``) of each attempt's whole process tree; None: no cap. See
            docs/resource-limits.md.
        cpu_limit: default CPU seconds of each attempt's whole tree; None: no cap.
        max_processes: default cap on the processes of each attempt's tree.
        max_open_files: default cap on the descriptors each process of the tree may open.
        max_steps_per_child: recycle a child after this many steps (None: never).
        max_child_rss: recycle a child whose RSS exceeds this many bytes (None: never),
            judged on the RSS the child reports as each step ends.
        max_payload: largest input or output in bytes (default 64 MiB); larger ones
            are rejected with a clear error.
        prefetch: steps the supervisor may claim beyond its idle children and hold
            until a child frees up, so a child never waits for the database between
            short steps (Celery's prefetch). Default 256, an upper bound: the supervisor
            holds only what its children can start within about 0.25 s, nothing until it
            has seen a step end, and with n supervisors live at most max(32, 2048 // n).
            0 claims only for idle children (SPEC 4's rule to the letter). A prefetched
            step shows ``running`` and its timeout counts from the claim; it is released
            (no attempt used) if no child takes it within min(0.5 s, lease_ttl/4,
            timeout/10). See docs/steps-and-client.md#prefetch.
        registry_interval: seconds between refreshes of this supervisor's row in
            ``cyclone_workers`` (what ``cyclone-mp workers`` shows). Default 2.
        metrics_port: the supervisor serves Prometheus metrics on this TCP port
            (``/metrics``; 0 picks a free one: ``client.supervisor.metrics.port``); None
            (the default): no metrics. Needs ``pip install 'cyclone-mp[metrics]'``; see
            :mod:`cyclone_mp.metrics`.
        metrics_host: the address the metrics bind: ``"127.0.0.1"`` (the default, this
            machine only) or another (``"0.0.0.0"``: all); anyone who reaches it reads
            step names and counts, so prefer ``metrics_token`` beyond the loopback.
        metrics_token: when set, a scrape must send ``Authorization: Bearer <token>``
            (Prometheus: ``authorization: {credentials: ...}``); default none.
        pgbouncer: ``dsn`` goes through PgBouncer in transaction mode: every
            connection keeps no session state (its settings are set per transaction),
            and LISTEN happens only on ``listen_dsn`` (without it, the supervisor and
            :meth:`wait` poll). See docs/operating.md#pgbouncer-in-transaction-mode.
        prepared_statements: named prepared statements; default True directly, False
            with ``pgbouncer``: say True there only for PgBouncer 1.21 or later with
            ``max_prepared_statements`` above 0.
        listen_dsn: a direct connection string (past PgBouncer) for LISTEN, of the
            supervisor and of :meth:`wait`; default ``dsn``, or none with ``pgbouncer``.
        archive_after: seconds (or a duration as text, ``"10m"``) a finished run stays in
            the hot tables before the supervisors' maintenance moves it, with its steps
            and signals, to the archive tables; None: never. Default 600. Archived runs
            are still found by :meth:`status`, :meth:`wait`, :meth:`result`,
            :meth:`retry` and the dashboard (docs/operating.md#history-and-retention).
        retain_completed: seconds (or ``"7d"``) a completed run is kept, hot or archived,
            before the supervisors' maintenance deletes it (a whole archive partition at a
            time where it can); None (the default): forever.
        retain_discarded: the same for discarded runs (keep them longer: they can be retried).
        retain_cancelled: the same for cancelled runs.
        start_method: how the supervisor starts children: ``"zygote"`` (default: forked
            in milliseconds from a process that imported the handlers once) or
            ``"spawn"`` (a fresh interpreter each). See docs/operating.md#how-children-start.
        clock: local monotonic clock in seconds (injectable; schedules local work only).
        wall_clock: local wall clock in epoch seconds (``ctx.deadline`` only).

    ``dsn`` may name several hosts with ``target_session_attrs=read-write`` (a primary
    and its standbys): after a failover every connection is opened again on the new
    primary (docs/operating.md#failover).

    Raises:
        ConfigurationError: an invalid option.
    """

    def __init__(
        self,
        dsn: str | None = None,
        mux: Mux | None = None,
        *,
        workers: int = 4,
        lease_ttl: Duration = 30.0,
        kill_grace: Duration = 5.0,
        poll_interval: Duration | Sequence[Duration] = (0.1, 1.0),
        max_reclaims: int | None = None,
        shutdown_grace: Duration = 30.0,
        queues: Sequence[str] | str | None = None,
        timeout: Duration | None = None,
        max_attempts: int | None = None,
        backoff: Callable[[int], float] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
        max_steps_per_child: int | None = None,
        max_child_rss: int | None = None,
        max_payload: int | None = None,
        prefetch: int = PREFETCH_DEFAULT,
        registry_interval: Duration = 2.0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_token: str | None = None,
        pgbouncer: bool = False,
        prepared_statements: bool | None = None,
        listen_dsn: str | None = None,
        archive_after: Duration | str | None = ARCHIVE_AFTER_DEFAULT,
        retain_completed: Duration | str | None = None,
        retain_discarded: Duration | str | None = None,
        retain_cancelled: Duration | str | None = None,
        start_method: str = START_METHODS[0],
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        if dsn is not None and not isinstance(dsn, str):
            raise ConfigurationError(f"dsn must be a connection string or None (the embedded server), "
                                     f"not {type(dsn).__name__}")
        if mux is not None and not isinstance(mux, Mux):
            raise ConfigurationError(f"mux must be a cy.Mux, not {type(mux).__name__}")
        extra: dict[str, Any] = {}
        if max_payload is not None:
            extra["max_payload"] = max_payload
        self.config = Config.build(
            workers=workers, lease_ttl=lease_ttl, kill_grace=kill_grace, poll_interval=poll_interval,
            shutdown_grace=shutdown_grace, queues=queues, max_steps_per_child=max_steps_per_child,
            max_child_rss=max_child_rss, timeout=timeout, max_attempts=max_attempts,
            max_reclaims=max_reclaims, backoff=backoff, queue=queue, priority=priority,
            memory_limit=memory_limit, cpu_limit=cpu_limit, max_processes=max_processes,
            max_open_files=max_open_files,
            prefetch=prefetch, registry_interval=registry_interval, pgbouncer=pgbouncer,
            prepared_statements=prepared_statements, archive_after=archive_after,
            retain_completed=retain_completed, retain_discarded=retain_discarded,
            retain_cancelled=retain_cancelled, start_method=start_method, **extra,
        )
        if listen_dsn is not None and not isinstance(listen_dsn, str):
            raise ConfigurationError(f"listen_dsn must be a connection string or None, not {type(listen_dsn).__name__}")
        self.listen_dsn = listen_dsn
        self.mux = mux if mux is not None else Mux()
        self._dsn = dsn
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        self._clock = clock
        self._wall_clock = wall_clock
        self._supervisor: Any = None
        self._thread: threading.Thread | None = None
        self._waiting: Waiter | None = None
        if metrics_port is not None and (not isinstance(metrics_port, int) or isinstance(metrics_port, bool)
                                         or not 0 <= metrics_port <= 65535):
            raise ConfigurationError(f"metrics_port must be a TCP port (0-65535) or None, got {metrics_port!r}")
        if not isinstance(metrics_host, str) or not metrics_host:
            raise ConfigurationError(f"metrics_host must be an address to bind, got {metrics_host!r}")
        if metrics_token is not None and (not isinstance(metrics_token, str) or not metrics_token.strip()
                                          or not metrics_token.isprintable()):
            raise ConfigurationError("metrics_token must be a non-empty printable string, or None")
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self._metrics_token = metrics_token

    # -- connection -------------------------------------------------------------------------

    def _store_pool(self, within: float | None = None) -> ConnectionPool:
        """The API pool, made at the first call: a connection is opened first (within
        ``within`` seconds, the first call's bound, else 10), so an unreachable server
        fails that call at once with a clear message."""
        with self._lock:
            if self._pool is None:
                dsn = self.dsn
                try:
                    connect(dsn, timeout=10.0 if within is None else min(10.0, within)).close()
                except DatabaseUnavailable as exc:
                    raise self._explain(exc) from exc.__cause__
                config = self.config
                self._pool = api_pool(dsn, pgbouncer=config.pgbouncer, prepared_statements=config.prepared_statements,
                                      idle_in_transaction=config.idle_in_transaction_limit, lease_ttl=config.lease_ttl)
            return self._pool

    @contextlib.contextmanager
    def _connection(self, pool: ConnectionPool, within: float | None = None) -> Any:
        """A pooled connection, like ``pool.connection()``. While a call waits for one, an
        embedded server that was stopped fails it within POOL_PROBE_EVERY seconds, with
        one line that says so (rather than a 30 s pool timeout per call). Any other server may come back (a restart): the call waits up to
        POOL_TIMEOUT, then fails with why a fresh connection fails; or, given
        ``within`` (the call's bound), raises DatabaseStalled after that many seconds."""
        deadline = time.monotonic() + (POOL_TIMEOUT if within is None else within)
        server: Any = False  # looked up once a wait is long (it reads files: not on every call)
        while True:
            try:
                conn = pool.getconn(timeout=max(0.05, min(POOL_PROBE_EVERY, deadline - time.monotonic())))
                break
            except PoolTimeout:
                if server is False:
                    server = server_for_dsn(self.dsn)
                if server is not None and server.stopping():
                    raise DatabaseUnavailable(server.not_running_message()) from None
                if time.monotonic() >= deadline and within is not None:
                    raise DatabaseStalled(f"no connection to the database within {within:.3g}s") from None
                if time.monotonic() >= deadline:
                    try:
                        connect(self.dsn, timeout=5.0).close()
                    except DatabaseUnavailable as exc:
                        raise exc from None
                    raise
        try:
            with conn:
                yield conn
        finally:
            pool.putconn(conn)

    def _call(self, fn: Callable[[Store], Any], within: float | None = None) -> Any:
        """``fn(store)`` on a pooled connection (once more on another when it surely did
        nothing). ``within``: seconds the call may take, the wait for a connection
        included, on this process's clock (None: the connections' own bounds); past it the
        connection is closed, the pool's other connections are replaced (they came the
        same way), and DatabaseStalled is raised."""
        deadline = None if within is None else time.monotonic() + within
        pool = self._store_pool(within)
        try:
            for tries_left in (1, 0):
                store: Store | None = None
                try:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    with self._connection(pool, left) as conn:
                        store = Store(conn)
                        try:
                            with answered_within(conn, None if deadline is None else deadline - time.monotonic()):
                                return fn(store)
                        except DatabaseReadOnly:  # a failover: no pooled connection is worth keeping
                            conn.close()  # the pool discards it when it comes back
                            pool.drain()
                            raise
                        except DatabaseStalled:
                            pool.drain()
                            raise
                except DatabaseError as exc:
                    if isinstance(exc, DatabaseStalled) or not self._retryable(exc, store, tries_left):
                        raise
        except DriverError as exc:  # from the pool (a timeout waiting for a connection: an outage)
            raise classify(exc) from exc
        except DatabaseError as exc:
            failed = self._call_failed(exc)
            if failed is not exc:
                raise failed from exc
            raise

    def _run(self, plan: Callable[[], Op], within: float | None = None) -> Any:
        """Run the operation ``plan()`` makes on a pooled connection (a retry makes
        another); ``within``: as :meth:`_call`'s."""
        return self._call(lambda store: store.run(plan()), within)

    def close(self) -> None:
        """Close the API connection pool and stop listening for waits (the supervisor, if
        any, is not affected)."""
        with self._lock:
            if self._waiting is not None:
                self._waiting.close()
                self._waiting = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.stop()
        self.close()

    def migrate(self) -> list[str]:
        """Create or upgrade the schema (idempotent, versioned, advisory-locked).

        Returns the migration files applied now (empty when up to date).
        """
        return self._run(operations.migrate)

    # -- enqueue ------------------------------------------------------------------------------

    def enqueue(
        self,
        target: Step | Workflow | str,
        input: Any = None,
        *,
        timeout: Duration | None = None,
        max_attempts: int | None = None,
        max_reclaims: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        backoff: float | Sequence[float] | None = None,
        delay: Duration | None = None,
        scheduled_at: dt.datetime | None = None,
        idempotency_key: str | None = None,
        conn: Connection | None = None,
        concurrency: int | None = None,
        concurrency_key: str | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
    ) -> str:
        """Enqueue one run of a step or workflow; returns the run id (a UUID string).

        Per-enqueue options win over the step's, which win over the client's (SPEC 2).
        ``concurrency_key`` (a string here) names the run's group: its queue serves groups
        round-robin, and ``concurrency`` and ``rate_limit`` (``(count, seconds)``) count
        per (step, key) across every supervisor (see docs/schedules-and-flow-control.md).
        ``delay`` (seconds) or ``scheduled_at`` (aware datetime) postpone the first
        claim. With ``conn`` the run is written in the caller's open transaction. With
        ``idempotency_key`` an existing run with that key is returned instead.
        ``memory_limit``, ``cpu_limit``, ``max_processes`` and ``max_open_files`` cap each
        attempt's process tree (docs/resource-limits.md).

        Raises:
            UnknownStep: a name that is not registered.
            PayloadError: the input is not a JSON value PostgreSQL can store, or too large.
            ConfigurationError: an invalid option.
            DatabaseError: the database failed or cannot be reached.
        """
        name, make = self._plan_enqueue(
            target, input, timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims, queue=queue,
            priority=priority, backoff=backoff, delay=delay, scheduled_at=scheduled_at,
            idempotency_key=idempotency_key, concurrency=concurrency, concurrency_key=concurrency_key,
            rate_limit=rate_limit, memory_limit=memory_limit, cpu_limit=cpu_limit, max_processes=max_processes,
            max_open_files=max_open_files,
        )
        with tracing.enqueue_span(name) as trace:  # the trace context kept on the run
            if conn is not None:
                return Store(conn).run(make(trace), caller_tx=True)[0]
            return self._run(lambda: make(trace))[0]

    def enqueue_many(
        self,
        target: Step | str,
        inputs: Iterable[Any],
        *,
        timeout: Duration | None = None,
        max_attempts: int | None = None,
        max_reclaims: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        backoff: float | Sequence[float] | None = None,
        delay: Duration | None = None,
        scheduled_at: dt.datetime | None = None,
        conn: Connection | None = None,
        concurrency: int | None = None,
        concurrency_key: str | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
    ) -> list[str]:
        """Enqueue one single-step run per input, in one INSERT; returns run ids in order.
        With ``conn`` the runs are written in the caller's open transaction.

        Each run's concurrency key is ``concurrency_key`` if given, else the step's
        ``concurrency_key(input)``. The resource limits are :meth:`enqueue`'s.

        Raises:
            UnknownStep: a name that is not registered.
            PayloadError: an input is not a JSON value PostgreSQL can store, or too large.
            ConfigurationError: an invalid option, or a workflow.
            DatabaseError: the database failed or cannot be reached.
        """
        name, make = self._plan_enqueue_many(
            target, inputs, timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims, queue=queue,
            priority=priority, backoff=backoff, delay=delay, scheduled_at=scheduled_at,
            concurrency=concurrency, concurrency_key=concurrency_key, rate_limit=rate_limit,
            memory_limit=memory_limit, cpu_limit=cpu_limit, max_processes=max_processes,
            max_open_files=max_open_files,
        )
        if make is None:
            return []
        with tracing.enqueue_span(name) as trace:
            if conn is not None:
                return Store(conn).run(make(trace), caller_tx=True)
            return self._run(lambda: make(trace))

    # -- operator actions ------------------------------------------------------------------------

    def status(self, run_id: str) -> RunStatus:
        """The run and each of its steps, as the database has them.

        Raises:
            RunNotFound: no run has that id.
        """
        return RunStatus.from_rows(*self._run(lambda: operations.get_run(run_id)))

    def map_items(self, run_id: str, node: str, *, state: str | Iterable[str] | None = None, after: int = -1,
                  limit: int = 100) -> list[StepStatus]:
        """The items of map node ``node`` (``wf.map``) in item order, a page at a time:
        those after item index ``after`` (-1: from the first), at most ``limit`` (up to
        10,000), in ``state`` (a state or several) when given. Each is a
        :class:`StepStatus` with ``kind="item"`` and ``item`` its index; pass the last
        one's ``item`` as ``after`` for the next page.

        Raises:
            RunNotFound: no run has that id. ConfigurationError: a bad argument.
        """
        plan = self._plan_map_items(run_id, node, state, after, limit)
        return [StepStatus.from_row(row) for row in self._run(plan)]

    def wait(self, run_id: str, timeout: Duration | None = None) -> RunStatus:
        """Block until the run is completed, discarded or cancelled; returns its final status.

        Woken by ``LISTEN/NOTIFY`` the moment the run ends (polling is the fallback); all
        the waits of one client, from any number of threads, share one listening
        connection. A paused run is still waited for. The wait's own timer bounds every
        read it makes: a connection that stops answering (a wedged proxy, a frozen
        server) is closed and the read made again on a fresh one, so the wait returns by
        its deadline, and one without a timeout goes on waiting (docs/python-apps.md).

        Raises:
            RunNotFound: no run has that id.
            WaitTimeout: the run did not end within ``timeout`` seconds (None: no limit);
                raised at most half a second after it, whatever the database does.
        """
        limit = self._wait_timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        try:  # a full id needs no lookup; a prefix is looked up within the deadline
            rid = operations.run_id_or_prefix(run_id) or reread(
                lambda within: self._run(lambda: operations.resolve_run(run_id), within), deadline)
        except DatabaseStalled as exc:
            assert limit is not None
            raise WaitTimeout(f"run {run_id} could not be looked up within {limit:g}s: {exc}") from exc
        return self._waiter().wait(rid, limit, deadline)

    def result(self, run_id: str, timeout: Duration | None = None) -> Any:
        """:meth:`wait` for the run, then return its output: a single-step run's output, or
        a workflow's ``{node: output}``, where a map node's output (``wf.map``, SPEC 10) is
        the list of its items' outputs in item order (an :class:`~cyclone_mp.mapped.ItemFailed`
        for an item discarded under ``allow_failures``), read from its items in pages.

        Raises:
            RunNotFound: no run has that id.
            WaitTimeout: the run did not end within ``timeout`` seconds.
            RunFailed: the run was discarded (``.status`` has every step's errors).
            RunCancelled: the run was cancelled.
        """
        status = self.wait(run_id, timeout)
        return result_of(with_outputs(status, {node: self._map_output(status.id, node)
                                               for node in needs_map_outputs(status)}))

    def _map_output(self, run_id: str, node: str) -> list[Any]:
        """A completed map node's output: its items' outputs in item order, read a page at a time."""
        out: list[Any] = []
        after = -1
        while True:
            page = self.map_items(run_id, node, after=after, limit=MAP_PAGE)
            out += map_output(page)
            if len(page) < MAP_PAGE:
                return out
            after = page[-1].item

    def _status_within(self, run_id: str, within: float) -> RunStatus:
        """:meth:`status`, answered within ``within`` seconds (else DatabaseStalled)."""
        return RunStatus.from_rows(*self._run(lambda: operations.get_run(run_id), within))

    def _waiter(self) -> Waiter:
        with self._lock:
            if self._waiting is None:
                self._waiting = Waiter(lambda: self.dsn, self._status_within, listen_dsn=self.listen_dsn,
                                       pgbouncer=self.config.pgbouncer, prepare=self.config.prepared_statements)
            return self._waiting

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule the supervisors have defined (``mux.schedule``): ``name``,
        ``target`` and ``spec`` (of the definition that decided it last), ``next_at`` (the
        next slot, database clock), ``last_slot``, ``last_run_id``, ``runs``, ``skipped``,
        ``seen_at``, ``active`` (a live supervisor defines it: seen within the last
        minute) and ``definitions``: the definitions live supervisors declare (two during
        a rolling deploy that changed it), each with ``fingerprint``, ``target``, ``spec``,
        ``first_seen_at``, ``seen_at`` and ``in_force``, the one in force first."""
        rows = self._call(lambda store: store.list_schedules(ACTIVE_WITHIN))
        return [{**row, "active": row["age"] is not None and row["age"] < ACTIVE_WITHIN} for row in rows]

    def delete_schedule(self, name: str) -> None:
        """Forget a schedule's row (one no supervisor defines any more: a renamed or removed
        ``mux.schedule``). The runs it enqueued stay.

        Raises:
            LookupError: no schedule has that name.
            InvalidTransition: it is active (a supervisor ticked it within the last
                minute): it would be made again; remove it from the mux first.
        """
        row = self._call(lambda store: store.delete_schedule(name, ACTIVE_WITHIN))
        if row is None:
            raise LookupError(f"no schedule named {name!r}")
        if not row["deleted"]:
            raise InvalidTransition(
                f"schedule {name!r} is active (a supervisor ticked it {row['age']:.0f}s ago) and would be made "
                "again: remove it from the app's mux and restart its supervisors, then delete it")

    def cancel(self, run_id: str) -> int:
        """Cancel the run and all its non-terminal steps in one transaction (seed).

        An in-flight handler learns of it on its next heartbeat and is killed after
        ``kill_grace``. Returns how many steps were cancelled.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is already completed, discarded or cancelled.
        """
        return self._run(lambda: operations.cancel_run(run_id))

    def retry(self, run_id: str) -> int:
        """Reopen the run's discarded steps, or the step of a cancelled single-step run
        (``max_attempts`` raised, no attempt consumed).

        Returns how many steps were reopened.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run has no discarded (or cancelled single) step.
        """
        return self._run(lambda: operations.retry_run(run_id))

    def pause(self, run_id: str) -> int:
        """Pause a run: waiting steps become paused, running ones finish (SPEC 6).

        Returns how many steps were paused.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is not running.
        """
        return self._run(lambda: operations.pause_run(run_id))

    def resume(self, run_id: str) -> int:
        """Resume a paused run: each step returns to the state it was paused from (SPEC 6).

        Returns how many steps were restored.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is not paused.
        """
        return self._run(lambda: operations.resume_run(run_id))

    def pause_queue(self, queue: str, reason: str | None = None) -> bool:
        """Pause a queue: from the moment this returns no supervisor claims a step of it
        (every claim looks); steps already running finish, held ones that had been claimed
        start. Returns True when it was not paused yet. ``reason`` is shown by
        ``cyclone-mp queue list`` and ``workers``.

        Raises:
            ConfigurationError: ``queue`` is not a valid queue name.
            DatabaseError: the database failed.
        """
        check_name(queue, "queue")
        return self._run(lambda: operations.pause_queue(queue, reason))

    def resume_queue(self, queue: str) -> bool:
        """Resume a paused queue: its supervisors are woken and claim its steps at once.
        Returns True when it was paused."""
        check_name(queue, "queue")
        return self._run(lambda: operations.resume_queue(queue))

    def paused_queues(self) -> list[dict[str, Any]]:
        """The paused queues: ``{"queue", "paused_at", "reason"}`` each, oldest first."""
        return self._run(operations.paused_queues)

    def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """Send signal ``name``; the first one per name is kept (returns False for a repeat).

        A signal sent before its node is reached is kept and used when it is (SPEC 6).

        Raises:
            RunNotFound: no run has that id.
            PayloadError: the payload is not a JSON value PostgreSQL can store, or is
                over a limit (see :func:`~cyclone_mp.protocol.check_value`).
            ConfigurationError: an invalid signal name.
        """
        return self._run(self._plan_signal(run_id, name, payload))

    def runs(self, state: str | Iterable[str] | None = None, limit: int = 50, *, step: str | None = None,
             queue: str | None = None, key: str | None = None, schedule: str | None = None,
             since: When | None = None, until: When | None = None, archived: bool = False) -> list[dict[str, Any]]:
        """Recent runs, newest first, at most ``limit``: dicts of ``id``, ``name``, ``kind``,
        ``state``, ``created_at``, ``finished_at``, ``steps`` (how many), ``key`` (the
        concurrency keys of its steps), ``waiting_on`` (the limit that holds one of its
        steps back), ``schedule`` (the schedule that enqueued it) and ``archived``.

        Every filter is optional: ``state`` (one state or several); ``step``, ``queue``
        and ``key``: a step of the run has that step name, queue and concurrency key (one
        step matching all those given); ``schedule``: the schedule that enqueued it;
        ``since`` and ``until``: it was created in that window, each an aware datetime
        or a duration before now on the database clock (seconds, a timedelta, or text
        such as ``"10m"``). Finished runs move to the archive ``archive_after`` (10
        minutes) after they finish: ``archived=True`` lists those too.

        Raises:
            ConfigurationError: an unknown state, an empty name, a naive datetime, a
                negative duration, a limit below 1.
            DatabaseError: the database failed or cannot be reached.
        """
        return self._run(self._plan_runs(state, limit, archived, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    def prune(self, older_than: Duration, *, state: str | Iterable[str] | None = None, step: str | None = None,
              queue: str | None = None, key: str | None = None, schedule: str | None = None,
              since: When | None = None, until: When | None = None) -> int:
        """Delete runs that finished (completed, discarded or cancelled) more than
        ``older_than`` seconds ago, with their steps, hot or archived; returns how many
        runs were deleted. The filters of :meth:`runs` narrow which (``state``: of the
        finished states).

        Running and paused runs are never touched. Deletes in batches, and, unless a
        filter besides ``state`` is given, drops whole archive partitions whose day is
        older, so it is safe to run while supervisors work. The supervisors apply a
        retention by themselves with ``retain_completed`` and friends.

        Raises:
            ConfigurationError: ``older_than`` is negative, or a filter is invalid (a
                state that is not a finished one).
            DatabaseBusy: an archive partition's lock could not be had within 5 s.
            DatabaseError: the database failed or cannot be reached.
        """
        return self._run(self._plan_prune(older_than, state, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    def workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        """Live supervisors (refreshed within ``within`` seconds) and their children."""
        return self._run(lambda: operations.list_workers(within))

    def unserved_steps(self, status: RunStatus, within: float = 15.0) -> list[StepStatus]:
        """The run's unfinished task steps that no live supervisor would claim: none of
        the supervisors seen within ``within`` seconds (the ``cyclone_workers`` registry)
        claims from the step's queue, or (when its registry row lists the step names it
        runs) runs the step, or it is draining. ``enqueue --wait`` warns about them at
        once instead of waiting in silence. Empty when every step is served.

        Raises:
            DatabaseError: the database failed or cannot be reached.
        """
        return self._unserved(status, self.workers(within))

    # -- the supervisor -------------------------------------------------------------------------

    def _make_supervisor(self, dedicated: bool = False) -> Any:
        refuse_in_child()  # before migrate(): a handler's child never touches the cyclone tables
        if not self.mux.step_names:
            raise ConfigurationError("the mux registers no steps: nothing to run")
        self.migrate()
        kwargs: dict[str, Any] = {}
        if self._clock is not None:
            kwargs["clock"] = self._clock
        if self._wall_clock is not None:
            kwargs["wall_clock"] = self._wall_clock
        self._supervisor = Supervisor(self.dsn, self.mux, self.config, metrics_port=self.metrics_port,
                                      metrics_host=self.metrics_host, metrics_token=self._metrics_token,
                                      listen_dsn=self.listen_dsn, dedicated=dedicated, **kwargs)
        return self._supervisor

    def run(self, on_signal: Callable[[str], None] | None = None) -> None:
        """Run the supervisor in this thread until shut down (blocking). The process is the
        supervisor's from then on: any process it adopts is taken for a handler's escapee
        and killed (a program with children of its own should use :meth:`start`).

        In the main thread, the first SIGTERM/SIGINT drains (SPEC 5) and a second one
        stops hard; ``on_signal`` (if given) is then called with ``"drain"`` or
        ``"stop"``, from the signal handler: it should only record the event (the CLI
        prints what the drain waits for from another thread). Raises
        ConfigurationError, DatabaseError (schema could not be set up).
        """
        # client.run() makes this process the supervisor's: whatever it adopts from now on is a
        # handler's (client.start() leaves an embedding program's children alone)
        sup = self._make_supervisor(dedicated=True)
        self.close()  # the supervisor has its own connections; idle API connections would only wait
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal_(signum: int, frame: Any) -> None:
                # Runs again, nested, when a signal comes while it runs: it takes no lock
                # (the supervisor's stop requests set plain flags and write to a pipe).
                if sup.stop_requested:
                    return
                if sup.draining or sup.shutdown_requested:
                    (log.info if on_signal is not None else log.warning)("second signal: hard stop")
                    sup.request_stop()
                    event = "stop"
                else:
                    log.info("signal %s: draining", signal.Signals(signum).name)
                    sup.request_shutdown()
                    event = "drain"
                if on_signal is not None:
                    on_signal(event)

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal_)
        try:
            sup.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start(self) -> None:
        """Run the supervisor in a background thread; returns once it is running."""
        if self._thread is not None and self._thread.is_alive():
            raise CycloneError("this client's supervisor is already running")
        sup = self._make_supervisor()
        self._thread = threading.Thread(target=sup.run, name="cyclone-mp-supervisor", daemon=True)
        self._thread.start()
        sup.running.wait(30.0)

    def shutdown(self, wait: bool = True) -> None:
        """Soft stop: claim nothing more; in-flight steps get ``shutdown_grace`` seconds, then
        are cancelled, killed after ``kill_grace`` and released (SPEC 5)."""
        if self._supervisor is not None:
            self._supervisor.request_shutdown()
            if wait:
                self._join()

    def stop(self, wait: bool = True) -> None:
        """Hard stop: cancel every in-flight handler now, SIGKILL after ``kill_grace``, release."""
        if self._supervisor is not None:
            self._supervisor.request_stop()
            if wait:
                self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        elif self._supervisor is not None:
            self._supervisor.stopped.wait()

    @property
    def supervisor(self) -> Any:
        """The running :class:`~cyclone_mp.supervisor.Supervisor`, or None."""
        return self._supervisor

    def __repr__(self) -> str:
        return f"Client(dsn={redact(self._dsn) if self._dsn else None!r}, workers={self.config.workers})"


def enqueue(client: Client, target: Step | Workflow | str, input: Any = None, **options: Any) -> str:
    """Seed-style alias of :meth:`Client.enqueue`: ``cy.enqueue(client, step, input)``."""
    return client.enqueue(target, input, **options)
