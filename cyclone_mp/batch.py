"""The supervisor's batch writer: the hot statement runs off the loop thread (issue 8).

Each tick's completions, failed attempts and the next claim go to PostgreSQL as one
statement (:meth:`cyclone_mp.store.Store.settle`). Run on the loop thread, that
round trip (about a millisecond) left every child idle until it returned. Here it runs
on one helper thread, over a second connection, while the loop goes on reading results
and starting prefetched steps; the helper wakes the loop when the statement is done.

Without prefetch there is nothing to start before the claim returns, so the supervisor
runs the statement inline (same connection, no thread handoff). One statement is in
flight at a time, so completions keep their order and a claim is
never doubled. The loop alone decides what a result means (CAS misses, outages); this
module only carries statements and results.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable

from .errors import DatabaseUnavailable
from .store import Store


class BatchWriter:
    """One helper thread and its own connection for the supervisor's hot statement.

    Args:
        dsn: PostgreSQL connection string.
        wake: called on the helper thread when a statement finishes (wakes the loop).
        idle_in_transaction: seconds, see :func:`cyclone_mp.store.configure_session`.
    """

    def __init__(self, dsn: str, wake: Callable[[], None], idle_in_transaction: float | None = None) -> None:
        self.dsn = dsn
        self.idle_in_transaction = idle_in_transaction
        self._wake = wake
        self.store: Store | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cyclone-batch")
        self._future: concurrent.futures.Future[Any] | None = None
        self._context: Any = None
        self._close_when_done = False

    @property
    def busy(self) -> bool:
        """A statement is in flight (its result not yet taken)."""
        return self._future is not None

    @property
    def done(self) -> bool:
        """The statement in flight has finished and its result can be taken."""
        return self._future is not None and self._future.done()

    def open(self) -> Store:
        """The writer's connection, opened unless it is open (the first statement would).

        Raises:
            DatabaseUnavailable: the connection cannot be opened.
        """
        if self.store is None or self.store.broken:
            self._close_store()
            self.store = Store.open(self.dsn, generic_plans=True, idle_in_transaction=self.idle_in_transaction)
        return self.store

    def submit(self, context: Any, fn: Callable[[Store], Any], *, inline: bool = False) -> None:
        """Run ``fn(store)`` on the helper thread (``inline``: on the calling thread, when
        there is nothing to do meanwhile and a thread handoff would only add latency);
        ``context`` comes back with the result from :meth:`take`.

        Raises:
            DatabaseUnavailable: the writer's connection cannot be opened.
            RuntimeError: a statement is already in flight.
        """
        if self._future is not None:
            raise RuntimeError("a batch statement is already in flight")
        store = self.open()
        self._context = context
        if inline:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            try:
                future.set_result(fn(store))
            except BaseException as exc:  # noqa: BLE001 - handed to take() as the helper would
                future.set_exception(exc)
            self._future = future
            return
        self._future = self._executor.submit(fn, store)
        self._future.add_done_callback(lambda _f: self._wake())

    def take(self) -> tuple[Any, concurrent.futures.Future[Any]] | None:
        """``(context, finished future)`` of the statement in flight, or None if it is
        still running (or there is none). Call ``future.result()`` to get the result or
        the :class:`~cyclone_mp.errors.DatabaseError` it raised."""
        future = self._future
        if future is None or not future.done():
            return None
        context, self._future, self._context = self._context, None, None
        if self._close_when_done or (self.store is not None and self.store.broken):
            self._close_when_done = False
            self._close_store()
        return context, future

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the statement in flight."""
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout=timeout)

    def close_connection(self) -> None:
        """Drop the connection (an outage): now if idle, else once the statement ends."""
        if self._future is None:
            self._close_store()
        else:
            self._close_when_done = True

    def ensure_idle(self) -> None:
        """Raise DatabaseUnavailable while a statement from before an outage is in flight
        (a new connection must not race it)."""
        if self._future is not None:
            raise DatabaseUnavailable("a batch statement from before the outage is still in flight")

    def shutdown(self) -> None:
        """Stop the helper thread (after the statement in flight) and close the connection."""
        self._executor.shutdown(wait=True)
        self._close_store()

    def _close_store(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
            self.store = None
