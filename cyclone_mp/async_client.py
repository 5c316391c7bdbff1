"""``cy.AsyncClient``: :class:`~cyclone_mp.Client`'s methods, awaitable.

Built on async connections and an async pool (:mod:`cyclone_mp.store.pools`). It
plans every call as :class:`~cyclone_mp.Client` does (:class:`~cyclone_mp.planning.ClientBase`)
and runs the same operations (:mod:`cyclone_mp.store.operations`), so the SQL, its parameters
and the handling of its rows exist once. It enqueues and manages runs; the supervisor
runs elsewhere (``cyclone-mp worker``, or ``Client.run`` in a worker process).

Use it from one event loop (its pool and its waiting task belong to that loop)::

    async with cy.AsyncClient(dsn, mux) as client:
        run_id = await client.enqueue(resize, {"path": "a.png"})
        output = await client.result(run_id, timeout=30)
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, Callable, Iterable, Sequence

from . import tracing
from .async_waiting import AsyncWaiter, areread
from .config import Config
from .connections import AsyncConnection, redact
from .durations import Duration
from .errors import ConfigurationError, DatabaseStalled, WaitTimeout
from .filters import When
from .mux import Mux
from .planning import ClientBase
from .status import RunStatus, StepStatus
from .steps import Step, check_name
from .store import AsyncStore, operations
from .store.calls import AsyncPooledCalls
from .store.operations import Op
from .waiting import MAP_PAGE, map_output, needs_map_outputs, result_of, with_outputs
from .workflow import Workflow


class AsyncClient(ClientBase):
    """The awaitable twin of :class:`~cyclone_mp.Client` for asyncio applications.

    Args:
        dsn: PostgreSQL connection string; None means the embedded default server.
        mux: the registered steps and workflows (to enqueue by name).
        pool_size: most connections its pool opens (default 4; waits use one more).
        **options: the enqueue defaults :class:`~cyclone_mp.Client` takes (``timeout``,
            ``max_attempts``, ``max_reclaims``, ``backoff``, ``queue``, ``priority``,
            ``max_payload``), its connection options (``pgbouncer``,
            ``prepared_statements``, ``listen_dsn``: docs/operating.md), and its
            supervisor options, which only a supervisor uses.

    Raises:
        ConfigurationError: an invalid option.
    """

    def __init__(self, dsn: str | None = None, mux: Mux | None = None, *, pool_size: int = 4,
                 **options: Any) -> None:
        if dsn is not None and not isinstance(dsn, str):
            raise ConfigurationError(f"dsn must be a connection string or None (the embedded server), "
                                     f"not {type(dsn).__name__}")
        if mux is not None and not isinstance(mux, Mux):
            raise ConfigurationError(f"mux must be a cy.Mux, not {type(mux).__name__}")
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise ConfigurationError(f"pool_size must be an int >= 1, got {pool_size!r}")
        for supervisor_only in ("clock", "wall_clock", "metrics_port", "metrics_host", "metrics_token"):
            options.pop(supervisor_only, None)
        listen_dsn = options.pop("listen_dsn", None)
        if listen_dsn is not None and not isinstance(listen_dsn, str):
            raise ConfigurationError(f"listen_dsn must be a connection string or None, not {type(listen_dsn).__name__}")
        self.listen_dsn: str | None = listen_dsn
        self.config = Config.build(**options)
        self.mux = mux if mux is not None else Mux()
        self._dsn = dsn
        self._pool_size = pool_size
        self._calls = AsyncPooledCalls(self, pool_size)
        self._waiting: AsyncWaiter | None = None

    # -- connection -------------------------------------------------------------------------

    async def _run(self, plan: Callable[[], Op], within: float | None = None) -> Any:
        """Run the operation ``plan()`` makes on a pooled connection, bounded to ``within``
        seconds (:meth:`cyclone_mp.store.calls.AsyncPooledCalls.run`)."""
        return await self._calls.run(plan, within)

    async def close(self) -> None:
        """Stop listening for waits and close the pool."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            await waiting.close()
        await self._calls.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def migrate(self) -> list[str]:
        """:meth:`Client.migrate <cyclone_mp.Client.migrate>`, awaitable."""
        return await self._run(operations.migrate)

    # -- enqueue ----------------------------------------------------------------------------

    async def enqueue(
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
        conn: AsyncConnection[Any] | None = None,
        concurrency: int | None = None,
        concurrency_key: str | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
    ) -> str:
        """:meth:`Client.enqueue <cyclone_mp.Client.enqueue>`, awaitable. With ``conn`` (an
        ``AsyncConnection`` in an open transaction) the run is written in the caller's
        transaction: it exists only if that transaction commits."""
        name, make = self._plan_enqueue(
            target, input, timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims, queue=queue,
            priority=priority, backoff=backoff, delay=delay, scheduled_at=scheduled_at,
            idempotency_key=idempotency_key, concurrency=concurrency, concurrency_key=concurrency_key,
            rate_limit=rate_limit, memory_limit=memory_limit, cpu_limit=cpu_limit, max_processes=max_processes,
            max_open_files=max_open_files,
        )
        with tracing.enqueue_span(name) as trace:
            if conn is not None:
                return (await AsyncStore(conn).run(make(trace), caller_tx=True))[0]
            return (await self._run(lambda: make(trace)))[0]

    async def enqueue_many(
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
        conn: AsyncConnection[Any] | None = None,
        concurrency: int | None = None,
        concurrency_key: str | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
    ) -> list[str]:
        """:meth:`Client.enqueue_many <cyclone_mp.Client.enqueue_many>`, awaitable; with
        ``conn``, in the caller's open transaction."""
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
                return await AsyncStore(conn).run(make(trace), caller_tx=True)
            return await self._run(lambda: make(trace))

    # -- runs --------------------------------------------------------------------------------

    async def status(self, run_id: str) -> RunStatus:
        """:meth:`Client.status <cyclone_mp.Client.status>`, awaitable."""
        return RunStatus.from_rows(*await self._run(lambda: operations.get_run(run_id)))

    async def map_items(self, run_id: str, node: str, *, state: str | Iterable[str] | None = None, after: int = -1,
                        limit: int = 100) -> list[StepStatus]:
        """:meth:`Client.map_items <cyclone_mp.Client.map_items>`, awaitable."""
        plan = self._plan_map_items(run_id, node, state, after, limit)
        return [StepStatus.from_row(row) for row in await self._run(plan)]

    async def wait(self, run_id: str, timeout: Duration | None = None) -> RunStatus:
        """:meth:`Client.wait <cyclone_mp.Client.wait>`, awaitable: every wait of this
        client shares one listening connection and one task, and its own timer bounds
        every read it makes, as the sync client's does."""
        limit = self._wait_timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        try:  # a full id needs no lookup; a prefix is looked up within the deadline
            rid = operations.run_id_or_prefix(run_id) or await areread(
                lambda within: self._run(lambda: operations.resolve_run(run_id), within), deadline)
        except DatabaseStalled as exc:
            assert limit is not None
            raise WaitTimeout(f"run {run_id} could not be looked up within {limit:g}s: {exc}") from exc
        if self._waiting is None:
            self._waiting = AsyncWaiter(lambda: self.dsn, self._status_within, listen_dsn=self.listen_dsn,
                                        pgbouncer=self.config.pgbouncer, prepare=self.config.prepared_statements)
        return await self._waiting.wait(rid, limit, deadline)

    async def _status_within(self, run_id: str, within: float) -> RunStatus:
        """:meth:`status`, answered within ``within`` seconds (else DatabaseStalled)."""
        return RunStatus.from_rows(*await self._run(lambda: operations.get_run(run_id), within))

    async def result(self, run_id: str, timeout: Duration | None = None) -> Any:
        """:meth:`Client.result <cyclone_mp.Client.result>`, awaitable."""
        status = await self.wait(run_id, timeout)
        outputs = {}
        for node in needs_map_outputs(status):
            out, after = [], -1
            while True:
                page = await self.map_items(status.id, node, after=after, limit=MAP_PAGE)
                out += map_output(page)
                if len(page) < MAP_PAGE:
                    break
                after = page[-1].item
            outputs[node] = out
        return result_of(with_outputs(status, outputs))

    async def cancel(self, run_id: str) -> int:
        """:meth:`Client.cancel <cyclone_mp.Client.cancel>`, awaitable."""
        return await self._run(lambda: operations.cancel_run(run_id))

    async def retry(self, run_id: str) -> int:
        """:meth:`Client.retry <cyclone_mp.Client.retry>`, awaitable."""
        return await self._run(lambda: operations.retry_run(run_id))

    async def pause(self, run_id: str) -> int:
        """:meth:`Client.pause <cyclone_mp.Client.pause>`, awaitable."""
        return await self._run(lambda: operations.pause_run(run_id))

    async def resume(self, run_id: str) -> int:
        """:meth:`Client.resume <cyclone_mp.Client.resume>`, awaitable."""
        return await self._run(lambda: operations.resume_run(run_id))

    async def pause_queue(self, queue: str, reason: str | None = None) -> bool:
        """:meth:`Client.pause_queue <cyclone_mp.Client.pause_queue>`, awaitable."""
        check_name(queue, "queue")
        return await self._run(lambda: operations.pause_queue(queue, reason))

    async def resume_queue(self, queue: str) -> bool:
        """:meth:`Client.resume_queue <cyclone_mp.Client.resume_queue>`, awaitable."""
        check_name(queue, "queue")
        return await self._run(lambda: operations.resume_queue(queue))

    async def paused_queues(self) -> list[dict[str, Any]]:
        """:meth:`Client.paused_queues <cyclone_mp.Client.paused_queues>`, awaitable."""
        return await self._run(operations.paused_queues)

    async def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """:meth:`Client.signal <cyclone_mp.Client.signal>`, awaitable."""
        return await self._run(self._plan_signal(run_id, name, payload))

    async def runs(self, state: str | Iterable[str] | None = None, limit: int = 50, *, step: str | None = None,
                   queue: str | None = None, key: str | None = None, schedule: str | None = None,
                   since: When | None = None, until: When | None = None,
                   archived: bool = False) -> list[dict[str, Any]]:
        """:meth:`Client.runs <cyclone_mp.Client.runs>`, awaitable."""
        return await self._run(self._plan_runs(state, limit, archived, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    async def prune(self, older_than: Duration, *, state: str | Iterable[str] | None = None,
                    step: str | None = None, queue: str | None = None, key: str | None = None,
                    schedule: str | None = None, since: When | None = None, until: When | None = None) -> int:
        """:meth:`Client.prune <cyclone_mp.Client.prune>`, awaitable."""
        return await self._run(self._plan_prune(older_than, state, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    async def workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        """:meth:`Client.workers <cyclone_mp.Client.workers>`, awaitable."""
        return await self._run(lambda: operations.list_workers(within))

    async def unserved_steps(self, status: RunStatus, within: float = 15.0) -> list[StepStatus]:
        """:meth:`Client.unserved_steps <cyclone_mp.Client.unserved_steps>`, awaitable."""
        return self._unserved(status, await self.workers(within))

    def __repr__(self) -> str:
        return f"AsyncClient(dsn={redact(self._dsn) if self._dsn else None!r})"
