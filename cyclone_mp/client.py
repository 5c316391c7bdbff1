"""The public entry point: enqueue and manage runs, and run the supervisor (SPEC section 2).

``Client`` holds a connection pool (:mod:`cyclone_mp.store.pools`) for API calls; the supervisor it starts opens its
own connections (so it can reconnect on its own after an outage). Each call's checks and
its operation are planned in :mod:`cyclone_mp.planning` (shared with
:class:`~cyclone_mp.AsyncClient`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import tracing
from .admin import RunAdmin
from .config import ARCHIVE_AFTER_DEFAULT, PREFETCH_DEFAULT, START_METHODS, Config
from .connections import Connection, redact
from .durations import Duration
from .errors import ConfigurationError, DatabaseStalled, WaitTimeout
from .hosting import Hosting
from .mux import Mux
from .status import RunStatus
from .steps import Step
from .store import Store, operations
from .store.calls import PooledCalls
from .store.operations import Op
from .waiting import (
    MAP_PAGE,
    Waiter,
    map_output,
    needs_map_outputs,
    reread,
    result_of,
    with_outputs,
)
from .workflow import Workflow

log = logging.getLogger("cyclone_mp.client")

class Client(RunAdmin):
    """A connection to the cyclone tables, and (with ``run``/``start``) a supervisor.

    Durations are seconds (``int``/``float``) or ``datetime.timedelta`` (SPEC section 2).

    The supervisor's options (``workers``, ``lease_ttl``, ``kill_grace``,
    ``poll_interval``, ``shutdown_grace``, ``queues``, ``max_steps_per_child``,
    ``max_child_rss``, ``max_payload``, ``prefetch``, ``registry_interval``,
    ``pgbouncer``, ``prepared_statements``, ``archive_after``, ``retain_completed``,
    ``retain_discarded``, ``retain_cancelled``, ``start_method``) are each described by
    the attribute of that name of :class:`~cyclone_mp.config.Config`; their defaults are
    in the signature. ``timeout``, ``max_attempts``, ``max_reclaims``, ``backoff``,
    ``queue``, ``priority``, ``memory_limit``, ``cpu_limit``, ``max_processes`` and
    ``max_open_files`` are client-wide defaults of the steps this client enqueues, under
    each step's own options (:func:`cyclone_mp.step` describes each).

    Args:
        dsn: PostgreSQL connection string; None means the embedded default server,
            started or reused on first use (SPEC 2).
        mux: the registered steps and workflows; required to run a supervisor, and to
            enqueue by name.
        metrics_port: the supervisor serves Prometheus metrics on this TCP port
            (``/metrics``; 0 picks a free one: ``client.supervisor.metrics.port``); None
            (the default): no metrics. Needs ``pip install 'cyclone-mp[metrics]'``.
        metrics_host: the address the metrics bind: ``"127.0.0.1"`` (the default) or
            another (``"0.0.0.0"``: all); anyone who reaches it reads step names and
            counts, so prefer ``metrics_token`` beyond the loopback.
        metrics_token: when set, a scrape must send ``Authorization: Bearer <token>``.
        listen_dsn: a direct connection string (past PgBouncer) for LISTEN, of the
            supervisor and of :meth:`wait`; default ``dsn``, or none with ``pgbouncer``.
        clock: local monotonic clock in seconds (injectable; schedules local work only). It
            runs at ``time.monotonic``'s rate (an offset is fine: a child's start is mapped onto it).
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
        self._calls = PooledCalls(self, Store)
        self._lock = threading.Lock()
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
        clocks = {name: fn for name, fn in (("clock", clock), ("wall_clock", wall_clock)) if fn is not None}
        self._hosting = Hosting(self, metrics_port=metrics_port, metrics_host=metrics_host, metrics_token=metrics_token,
                                **clocks)

    # -- connection -------------------------------------------------------------------------

    def _call(self, fn: Callable[[Store], Any], within: float | None = None) -> Any:
        """``fn(store)`` on a pooled connection, bounded to ``within`` seconds
        (:meth:`cyclone_mp.store.calls.PooledCalls.call`)."""
        return self._calls.call(fn, within)

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
        self._calls.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hosting.thread is not None and self._hosting.thread.is_alive():
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

    # -- the supervisor -------------------------------------------------------------------------

    def run(self, on_signal: Callable[[str], None] | None = None) -> None:
        """Run the supervisor in this thread until shut down (blocking). The process is the
        supervisor's from then on: any process it adopts is taken for a handler's escapee
        and killed (a program with children of its own should use :meth:`start`).

        In the main thread, the first SIGTERM/SIGINT drains (SPEC 5) and a second one
        stops hard; ``on_signal`` (if given) is then called with ``"drain"`` or
        ``"stop"``, from the signal handler: it should only record the event (the CLI
        prints what the drain waits for from another thread).

        Raises:
            ConfigurationError: the mux registers no steps, or this is a handler's child.
            DatabaseError: the schema could not be set up.
        """
        self._hosting.run(on_signal)

    def start(self) -> None:
        """Run the supervisor in a background thread; returns once it is running.

        Raises:
            CycloneError: this client's supervisor runs already. Else as :meth:`run`.
        """
        self._hosting.start()

    def shutdown(self, wait: bool = True) -> None:
        """Soft stop: claim nothing more; in-flight steps get ``shutdown_grace`` seconds, then
        are cancelled, killed after ``kill_grace`` and released (SPEC 5)."""
        self._hosting.shutdown(wait)

    def stop(self, wait: bool = True) -> None:
        """Hard stop: cancel every in-flight handler now, SIGKILL after ``kill_grace``, release."""
        self._hosting.stop(wait)

    @property
    def supervisor(self) -> Any:
        """The running :class:`~cyclone_mp.supervisor.Supervisor`, or None."""
        return self._hosting.supervisor

    def __repr__(self) -> str:
        return f"Client(dsn={redact(self._dsn) if self._dsn else None!r}, workers={self.config.workers})"


def enqueue(client: Client, target: Step | Workflow | str, input: Any = None, **options: Any) -> str:
    """Seed-style alias of :meth:`Client.enqueue`: ``cy.enqueue(client, step, input)``."""
    return client.enqueue(target, input, **options)
