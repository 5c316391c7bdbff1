"""The async twin of :class:`~cyclone_mp.waiting.Waiter`: an :class:`AsyncWaiter` serves the
waits of one :class:`~cyclone_mp.AsyncClient` with one listening connection on its event
loop, woken by ``LISTEN/NOTIFY`` (polling is the fallback); everything else (the book of
waits, the bounds of reads, what a run's end means) is shared with the sync waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

from .connections import AsyncConnection, DriverError, aanswered_within
from .errors import DatabaseError, DatabaseStalled, WaitTimeout
from .status import RunStatus
from .store import AsyncStore, operations
from .store.pools import aconnect
from .waiting import (CATCH_UP, GRACE, IDLE_CLOSE, LISTEN_READY_WITHIN, LISTENER_NAME, POLL_FALLBACK, POLL_LISTENING,
                      RUNS_CHANNEL, STALLED_AFTER, TURN_MAX, WaitBook, after_stall, listener_target, read_bound,
                      run_ids, say_lost, statuses, timeout_message)

log = logging.getLogger("cyclone_mp.client")


async def areread(read: Callable[[float], Any], end: float | None, on_stall: Callable[[], None] | None = None,
                  settled: Callable[[], bool] | None = None) -> Any:
    """:func:`reread` of an awaitable ``read(within)``."""
    stalls = 0
    while True:
        try:
            return await read(read_bound(stalls, end, time.monotonic()))
        except DatabaseStalled as exc:
            stalls += 1
            after_stall(exc, end, on_stall, settled)


class _AsyncSlot:
    def __init__(self) -> None:
        self.future: asyncio.Future[RunStatus] = asyncio.get_running_loop().create_future()

    def deliver(self, status: RunStatus) -> None:
        if not self.future.done():
            self.future.set_result(status)


class AsyncWaiter:
    """:class:`Waiter` for an :class:`~cyclone_mp.AsyncClient`: one listening connection
    and one task of its event loop for every wait."""

    def __init__(self, dsn: Callable[[], str], read_status: Callable[[str, float], Any], *,
                 listen_dsn: str | None = None, pgbouncer: bool = False, prepare: bool = True) -> None:
        self._listen_dsn, self._pgbouncer, self._prepare = listen_dsn, pgbouncer, prepare
        self._dsn = dsn
        self._read_status = read_status
        self.book = WaitBook()
        self._task: asyncio.Task[None] | None = None
        self._listening: asyncio.Event | None = None
        self._closed = False
        self._poked = False
        self.listening_connections = 0

    async def wait(self, run_id: str, timeout: float | None, deadline: float | None = None) -> RunStatus:
        """Await the end of ``run_id`` (a full id); returns its status. ``deadline``: as
        :meth:`Waiter.wait`'s.

        Raises:
            WaitTimeout: still not finished after ``timeout`` seconds (raised at most
                :data:`GRACE` seconds after the deadline, whatever the database does).
        """
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        slot = _AsyncSlot()
        self._ensure_task()
        assert self._listening is not None
        self.book.add(run_id, slot)
        try:
            left = LISTEN_READY_WITHIN if deadline is None else max(0.0, min(LISTEN_READY_WITHIN, deadline - time.monotonic()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._listening.wait(), left)
            status = await self._look(run_id, deadline, slot.future.done)  # subscribed first, then look
            if status is not None and status.terminal:
                return status
            try:
                return await asyncio.wait_for(asyncio.shield(slot.future),
                                              None if deadline is None else max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                assert deadline is not None and timeout is not None
                with contextlib.suppress(DatabaseError):  # what it says comes from the latest look
                    status = await self._look(run_id, deadline + GRACE, slot.future.done) or status
                if status is not None and status.terminal:  # it ended right at the deadline
                    return status
                raise WaitTimeout(timeout_message(run_id, status, timeout)) from None
        finally:
            self.book.remove(run_id, slot)

    async def _look(self, run_id: str, end: float | None, delivered: Callable[[], bool]) -> RunStatus | None:
        """:meth:`Waiter._look`, awaited."""
        if end is not None and time.monotonic() >= end:
            return None
        try:
            return await areread(lambda within: self._read_status(run_id, within), end, self.poke, delivered)
        except DatabaseStalled as exc:
            log.info("waiting: %s", exc)
            return None

    def poke(self) -> None:
        """:meth:`Waiter.poke`."""
        self._poked = True

    async def close(self) -> None:
        """Stop listening and close the connection."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._closed = False
            self._listening = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cyclone-mp-waiter")

    async def _run(self) -> None:
        conn: AsyncConnection[Any] | None = None
        listening = False
        next_poll = reconnect_at = time.monotonic()
        catch_up = False
        stalls = 0  # polls in a row whose connection stalled (each on a fresh one)
        assert self._listening is not None
        try:
            while not self._closed:
                now = time.monotonic()
                if self.book.idle_for(now) >= IDLE_CLOSE or (conn is None and not self.book.slots and now > next_poll):
                    return
                if conn is None and now >= reconnect_at:
                    conn, listening = await self._connect()
                    next_poll = time.monotonic()  # whatever ended meanwhile
                    catch_up = listening  # and once more CATCH_UP later (see the module docstring)
                    reconnect_at = next_poll + POLL_FALLBACK
                    self._listening.set()
                if conn is None:  # the server cannot be reached: try again later
                    await asyncio.sleep(max(0.0, min(TURN_MAX, reconnect_at - time.monotonic())))
                    continue
                if self._poked:
                    self._poked, next_poll = False, time.monotonic()
                ids: list[str] = []
                wait = max(0.0, min(TURN_MAX, next_poll - time.monotonic()))
                try:
                    if conn is not None and listening:
                        async for note in conn.notifies(timeout=wait, stop_after=1):
                            ids.extend(run_ids(note.payload))
                        if ids:  # and whatever else has come: one read for all of them
                            async for note in conn.notifies(timeout=0.0):
                                ids.extend(run_ids(note.payload))
                    else:
                        await asyncio.sleep(wait)
                    if time.monotonic() >= next_poll:
                        next_poll = time.monotonic() + (CATCH_UP if catch_up else POLL_LISTENING if listening
                                                        else POLL_FALLBACK)
                        catch_up = False
                        wanted = self.book.wanted()
                    else:
                        wanted = self.book.wanted(ids)
                    if wanted and conn is not None:
                        async with aanswered_within(conn, read_bound(stalls, None, 0.0)):
                            rows = await AsyncStore(conn).run(operations.finished_runs(wanted))
                        stalls = 0
                        self.book.deliver(statuses(*rows))
                except Exception as exc:  # noqa: BLE001 - a waiter must never be left without its listener
                    stalls = stalls + 1 if isinstance(exc, DatabaseStalled) else 0
                    say_lost(exc)
                    with contextlib.suppress(Exception):
                        assert conn is not None
                        await conn.close()
                    conn, listening = None, False
                    self.listening_connections = 0
                    await asyncio.sleep(min(POLL_FALLBACK, TURN_MAX))
        finally:
            self.listening_connections = 0
            if self._listening is not None:
                self._listening.set()
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _connect(self) -> tuple[AsyncConnection[Any] | None, bool]:
        dsn, listen = listener_target(self._dsn(), self._listen_dsn, self._pgbouncer)
        try:
            conn = await aconnect(dsn, application_name=LISTENER_NAME, timeout=10, dead_after=30.0)
        except DriverError as exc:
            log.info("waiting: cannot connect (%s); polling", exc)
            return None, False
        if not (self._prepare or dsn == self._listen_dsn):
            conn.prepare_threshold = None
        if not listen:
            return conn, False
        try:
            async with aanswered_within(conn, STALLED_AFTER):
                await conn.execute(f"LISTEN {RUNS_CHANNEL}")
        except DatabaseStalled as exc:
            log.info("waiting: %s; connecting again", exc)
            await conn.close()
            return None, False
        except DriverError as exc:
            log.info("waiting: LISTEN unavailable (%s); polling", exc)
            return conn, False
        self.listening_connections = 1
        return conn, True
