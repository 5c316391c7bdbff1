"""Waiting for runs to end: ``client.wait`` and ``client.result``.

A run that becomes completed, discarded or cancelled sends a ``NOTIFY`` on
:data:`RUNS_CHANNEL` with its id (``run_ended_expr`` in ``sql/fragments.sql``; a payload may
name several runs, comma-separated), but only while a listener is connected to its
database (a session named :data:`LISTENER_NAME`, ``waiting_expr``): a NOTIFY makes its
commit wait for every other notifying commit of the server, so with no one waiting the
supervisors' writes commit side by side. A client keeps **one** listening connection for
all its waits (a thread for :class:`~cyclone_mp.Client`, a task for
:class:`~cyclone_mp.AsyncClient`) and hands each waiter its :class:`~cyclone_mp.RunStatus`.
A waiter subscribes before it looks, so no end is missed; the listener also polls
(:data:`POLL_LISTENING`, :data:`POLL_FALLBACK` without LISTEN or through PgBouncer with no
``listen_dsn``, once more :data:`CATCH_UP` after it starts). Every read is bounded by the
wait's own timer (:data:`STALLED_AFTER`, :func:`~cyclone_mp.connections.answered_within`),
since a wedged connection answers nothing: a wait with a ``timeout`` returns or raises
:class:`~cyclone_mp.errors.WaitTimeout` at most :data:`GRACE` seconds after its deadline.
See docs/python-apps.md ("Waiting for a run").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from typing import Any, Callable

from .connections import Connection, DriverError, answered_within, connect
from .errors import CycloneError, DatabaseError, DatabaseStalled, RunCancelled, RunFailed, WaitTimeout
from .mapped import ItemFailed
from .status import TERMINAL_RUN_STATES, RunStatus, StepStatus
from .store import Store, operations

log = logging.getLogger("cyclone_mp.client")

RUNS_CHANNEL = "cyclone_mp_runs"  #: the NOTIFY channel of runs that ended (sql/fragments.sql: run_ended_expr)
#: The listener's application_name: runs that end notify only while a session of that name
#: is connected to their database (sql/fragments.sql: waiting_expr).
LISTENER_NAME = "cyclone_mp waiting"
#: Seconds after a listener starts listening at which it polls once more: a statement that
#: ended runs and looked for a listener just before this one connected notifies nobody.
CATCH_UP = 0.5
POLL_LISTENING = 5.0  #: seconds between polls of every waited run while LISTEN works
POLL_FALLBACK = 0.5  #: seconds between polls when LISTEN cannot be had
IDLE_CLOSE = 30.0  #: seconds without a waiter after which the listening connection is closed
LISTEN_READY_WITHIN = 10.0  #: seconds a wait gives the listener to start listening before it polls alone
TURN_MAX = 1.0  #: seconds at most between two looks of the listener at its own state
#: Seconds a read of a wait (or of its listener) may go unanswered before its connection
#: is taken for stalled: closed, and the read made again on a fresh connection. Doubled
#: after each stall in a row, up to :data:`STALLED_AFTER_MAX`.
STALLED_AFTER = 3.0
STALLED_AFTER_MAX = 60.0  #: the longest bound of a read after stalls in a row
#: Seconds past its deadline a wait may spend on its last look at the run (so that the
#: timeout's message says the state now, and a run that ended at the deadline is returned).
GRACE = 0.5


def run_ids(payload: str) -> list[str]:
    """The run ids a notification names (comma-separated)."""
    return [part for part in payload.split(",") if part]


def outputs(status: RunStatus) -> Any:
    """What ``client.result`` returns for a completed run: the output of a single-step run,
    else ``{node: output}`` of every node."""
    if status.kind == "step":
        return status.step.output
    return {name: step.output for name, step in status.steps.items()}


MAP_PAGE = 10_000  # items read per statement when a map node's outputs are gathered for client.result


def map_output(items: list[StepStatus]) -> list[Any]:
    """A map node's output from its items (in item order): each completed item's output,
    and an :class:`~cyclone_mp.mapped.ItemFailed` for one discarded under ``allow_failures``."""
    return [item.output if item.state == "completed" else ItemFailed(item.item, item.error, item.error_kind)
            for item in items]


def needs_map_outputs(status: RunStatus) -> list[str]:
    """The map nodes of a completed run, whose output (the list of their items' outputs,
    SPEC 10) is read from the items rather than stored on the node."""
    if status.state != "completed":
        return []
    return [name for name, step in status.steps.items() if step.kind == "map" and step.output is None]


def with_outputs(status: RunStatus, outputs_by_node: dict[str, list[Any]]) -> RunStatus:
    """``status`` with each map node's output given."""
    if not outputs_by_node:
        return status
    steps = {name: dataclasses.replace(step, output=outputs_by_node[name]) if name in outputs_by_node else step
             for name, step in status.steps.items()}
    return dataclasses.replace(status, steps=steps)


def result_of(status: RunStatus) -> Any:
    """The outputs of a finished run (:func:`outputs`).

    Raises:
        RunFailed: the run was discarded (the message names its failed steps and their errors).
        RunCancelled: the run was cancelled.
    """
    if status.state == "completed":
        return outputs(status)
    if status.state == "cancelled":
        raise RunCancelled(f"run {status.id} ({status.name}) was cancelled", status)
    failed = [s for s in status.steps.values() if s.state == "discarded"]
    detail = "; ".join(f"{s.name}: {s.error_kind}: {(s.error or '')[:200]}" for s in failed) or "no step discarded"
    raise RunFailed(f"run {status.id} ({status.name}) was discarded: {detail}", status)


def statuses(runs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, RunStatus]:
    """RunStatus objects by run id, from run rows and the step rows of those runs."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in steps:
        by_run.setdefault(row["run_id"], []).append(row)
    return {run["id"]: RunStatus.from_rows(run, by_run.get(run["id"], [])) for run in runs}



def read_bound(stalls: int, end: float | None, now: float) -> float:
    """Seconds the next read of a wait may take: :data:`STALLED_AFTER`, doubled per
    ``stalls`` in a row (at most :data:`STALLED_AFTER_MAX`), and never past ``end`` (a
    monotonic time; None: no end). At least 50 ms, so a read at the end is still tried."""
    bound = min(STALLED_AFTER * 2 ** min(stalls, 16), STALLED_AFTER_MAX)
    return max(0.05, bound if end is None else min(bound, end - now))


def reread(read: Callable[[float], Any], end: float | None, on_stall: Callable[[], None] | None = None,
           settled: Callable[[], bool] | None = None) -> Any:
    """``read(within)`` until the database answers it: a read whose connection stalled
    (:class:`~cyclone_mp.errors.DatabaseStalled`) is made again, on a fresh connection,
    within :func:`read_bound` (``on_stall()`` is called after each); errors other than
    a stall leave at once.

    Raises:
        DatabaseStalled: still no answer at ``end`` (a monotonic time; None: never), or
            once ``settled()`` says the answer is no longer needed.
    """
    stalls = 0
    while True:
        try:
            return read(read_bound(stalls, end, time.monotonic()))
        except DatabaseStalled as exc:
            stalls += 1
            after_stall(exc, end, on_stall, settled)


def after_stall(exc: DatabaseStalled, end: float | None, on_stall: Callable[[], None] | None,
                settled: Callable[[], bool] | None) -> None:
    """One read of :func:`reread` stalled: tell ``on_stall``; raise ``exc`` again once
    ``end`` (a monotonic time) has passed or ``settled()`` says the answer is no longer
    needed, else say that the read is made again."""
    if on_stall is not None:
        on_stall()
    if end is not None and time.monotonic() >= end or settled is not None and settled():
        raise exc
    log.info("waiting: %s; reading again on a fresh connection", exc)


def timeout_message(run_id: str, status: RunStatus | None, timeout: float) -> str:
    """What :class:`~cyclone_mp.errors.WaitTimeout` says: the run's state now, and for a
    run none of whose steps has started, where it waits (a newcomer's report: "still
    running" for a run no supervisor had touched). ``status`` None: the database never
    answered the wait's reads."""
    if status is None:
        return (f"run {run_id} was not seen to end within {timeout:g}s: the database did not answer "
                f"(its connections stalled)")
    steps = list(status.steps.values())
    if status.state == "running" and steps and all(s.started_at is None and s.state == "available" for s in steps):
        now = dt.datetime.now(dt.timezone.utc)
        later = [s.scheduled_at for s in steps if s.scheduled_at is not None and s.scheduled_at > now]
        if later:
            return (f"run {run_id} has not started after {timeout:g}s: it is scheduled for "
                    f"{min(later).isoformat(timespec='seconds')}")
        queues = ", ".join(sorted({repr(s.queue) for s in steps}))
        return (f"run {run_id} has not started after {timeout:g}s: it waits in queue {queues} "
                f"(is a supervisor serving it? see 'cyclone-mp workers')")
    return f"run {run_id} is still {status.state} after {timeout:g}s"


def say_lost(exc: Exception) -> None:
    """Log why a listener starts over: a lost or stalled connection (info) or anything
    else (with its traceback)."""
    if isinstance(exc, (DriverError, DatabaseError)):
        log.info("the waiting connection was lost (%s); listening again", exc)
    else:
        log.exception("waiting: unexpected error; listening again")

class WaitBook:
    """Who waits for which run (the pure part, shared by both listeners): ``slots`` maps a
    run id to the waiters' slots (an object with ``deliver(status)``)."""

    def __init__(self) -> None:
        self.slots: dict[str, list[Any]] = {}
        self.idle_since: float | None = time.monotonic()

    def add(self, run_id: str, slot: Any) -> None:
        self.slots.setdefault(run_id, []).append(slot)
        self.idle_since = None

    def remove(self, run_id: str, slot: Any) -> None:
        slots = self.slots.get(run_id)
        if slots is not None:
            with contextlib.suppress(ValueError):
                slots.remove(slot)
            if not slots:
                del self.slots[run_id]
        if not self.slots and self.idle_since is None:
            self.idle_since = time.monotonic()

    def wanted(self, ids: list[str] | None = None) -> list[str]:
        """Of ``ids`` (None: all), those someone waits for."""
        if ids is None:
            return list(self.slots)
        return [i for i in dict.fromkeys(ids) if i in self.slots]

    def deliver(self, found: dict[str, RunStatus]) -> None:
        """Hand each finished run's status to its waiters (they unregister themselves)."""
        for run_id, status in found.items():
            if status.state in TERMINAL_RUN_STATES:
                for slot in list(self.slots.get(run_id, ())):
                    slot.deliver(status)

    def idle_for(self, now: float) -> float:
        return 0.0 if self.idle_since is None else now - self.idle_since


# -- the thread of a sync Client ----------------------------------------------------------------


class _Slot:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.status: RunStatus | None = None

    def deliver(self, status: RunStatus) -> None:
        self.status = status
        self.event.set()


def listener_target(dsn: str, listen_dsn: str | None, pgbouncer: bool) -> tuple[str, bool]:
    """Where a waiter connects, and whether it LISTENs there: ``listen_dsn`` (listening)
    when given, else ``dsn``, listening unless it goes through PgBouncer in transaction mode."""
    if listen_dsn:
        return listen_dsn, True
    return dsn, not pgbouncer


class Waiter:
    """One listening connection and thread for every wait of a sync client (see the module
    docstring). ``read_status(run_id, within) -> RunStatus`` is a waiter's own look at its
    run, answered within ``within`` seconds or raising
    :class:`~cyclone_mp.errors.DatabaseStalled`; ``listen_dsn``, ``pgbouncer``,
    ``prepare``: the client's options (:class:`~cyclone_mp.Client`)."""

    def __init__(self, dsn: Callable[[], str], read_status: Callable[[str, float], RunStatus], *,
                 listen_dsn: str | None = None, pgbouncer: bool = False, prepare: bool = True) -> None:
        self._listen_dsn, self._pgbouncer, self._prepare = listen_dsn, pgbouncer, prepare
        self._dsn = dsn
        self._read_status = read_status
        self._lock = threading.Lock()
        self.book = WaitBook()
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._closed = False
        self._poked = False
        self.listening_connections = 0  # connections that LISTEN now (0 or 1)

    def wait(self, run_id: str, timeout: float | None, deadline: float | None = None) -> RunStatus:
        """Block until ``run_id`` (a full id) ends; returns its status. ``deadline``: the
        monotonic time at which ``timeout`` ends (default: ``timeout`` from now).

        Raises:
            WaitTimeout: still not finished after ``timeout`` seconds (raised at most
                :data:`GRACE` seconds after the deadline, whatever the database does).
        """
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        slot = _Slot()
        with self._lock:
            self._ensure_thread()
            self.book.add(run_id, slot)
        try:
            self._listening.wait(LISTEN_READY_WITHIN if deadline is None
                                 else max(0.0, min(LISTEN_READY_WITHIN, deadline - time.monotonic())))
            status = self._look(run_id, deadline, slot.event.is_set)  # subscribed first, then look
            if status is not None and status.terminal:
                return status
            while not slot.event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                if deadline is not None and time.monotonic() >= deadline:
                    with contextlib.suppress(DatabaseError):  # what it says comes from the latest look
                        status = self._look(run_id, deadline + GRACE, slot.event.is_set) or status
                    if status is not None and status.terminal:  # it ended right at the deadline
                        return status
                    assert timeout is not None
                    raise WaitTimeout(timeout_message(run_id, status, timeout))
            assert slot.status is not None
            return slot.status
        finally:
            with self._lock:
                self.book.remove(run_id, slot)

    def _look(self, run_id: str, end: float | None, delivered: Callable[[], bool]) -> RunStatus | None:
        """The run's status, read by ``end`` (a monotonic time; None: no end) on fresh
        connections while they stall (:func:`reread`), or None when none answered by then
        or the listener ``delivered()`` it meanwhile. A stall also makes the listener poll
        at once: its connection came the same way.

        Raises:
            DatabaseError: the read failed otherwise (the server refused the connection...).
        """
        if end is not None and time.monotonic() >= end:
            return None
        try:
            return reread(lambda within: self._read_status(run_id, within), end, self.poke, delivered)
        except DatabaseStalled as exc:
            log.info("waiting: %s", exc)
            return None

    def poke(self) -> None:
        """Make the listener poll now (within :data:`TURN_MAX` seconds): a read of a wait
        stalled, and the listener's connection may have stalled too."""
        self._poked = True

    def close(self) -> None:
        """Stop listening (the thread ends within :data:`TURN_MAX` seconds)."""
        self._closed = True

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closed = False
            self._listening.clear()
            self._thread = threading.Thread(target=self._run, name="cyclone-mp-waiter", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        conn: Connection[Any] | None = None
        listening = False
        next_poll = reconnect_at = time.monotonic()
        catch_up = False
        stalls = 0  # polls in a row whose connection stalled (each on a fresh one)
        try:
            while not self._closed:
                now = time.monotonic()
                with self._lock:
                    if self.book.idle_for(now) >= IDLE_CLOSE or (conn is None and not self.book.slots and now > next_poll):
                        self._thread = None
                        return
                if conn is None and now >= reconnect_at:
                    conn, listening = self._connect()
                    next_poll = time.monotonic()  # whatever ended meanwhile
                    catch_up = listening  # and once more CATCH_UP later (see the module docstring)
                    reconnect_at = next_poll + POLL_FALLBACK
                    self._listening.set()
                if conn is None:  # the server cannot be reached: try again later
                    time.sleep(max(0.0, min(TURN_MAX, reconnect_at - time.monotonic())))
                    continue
                if self._poked:
                    self._poked, next_poll = False, time.monotonic()
                ids: list[str] = []
                wait = max(0.0, min(TURN_MAX, next_poll - time.monotonic()))
                try:
                    if conn is not None and listening:
                        for note in conn.notifies(timeout=wait, stop_after=1):
                            ids.extend(run_ids(note.payload))
                        if ids:  # and whatever else has come: one read for all of them
                            for note in conn.notifies(timeout=0.0):
                                ids.extend(run_ids(note.payload))
                    else:
                        time.sleep(wait)
                    if time.monotonic() >= next_poll:
                        next_poll = time.monotonic() + (CATCH_UP if catch_up else POLL_LISTENING if listening
                                                        else POLL_FALLBACK)
                        catch_up = False
                        with self._lock:
                            wanted = self.book.wanted()
                    else:
                        with self._lock:
                            wanted = self.book.wanted(ids)
                    if wanted and conn is not None:
                        with answered_within(conn, read_bound(stalls, None, 0.0)):
                            found = self._statuses(conn, wanted)
                        stalls = 0
                        with self._lock:
                            self.book.deliver(found)
                except Exception as exc:  # noqa: BLE001 - a waiter must never be left without its listener
                    stalls = stalls + 1 if isinstance(exc, DatabaseStalled) else 0
                    say_lost(exc)
                    with contextlib.suppress(Exception):
                        assert conn is not None
                        conn.close()
                    conn, listening = None, False
                    self.listening_connections = 0
                    time.sleep(min(POLL_FALLBACK, TURN_MAX))
        finally:
            self.listening_connections = 0
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _connect(self) -> tuple[Connection[Any] | None, bool]:
        dsn, listen = listener_target(self._dsn(), self._listen_dsn, self._pgbouncer)
        pooled = self._pgbouncer and dsn != self._listen_dsn
        try:
            conn = connect(dsn, application_name=LISTENER_NAME, pgbouncer=pooled,
                           prepare=self._prepare or not pooled)
        except CycloneError as exc:
            log.info("waiting: cannot connect (%s); polling", exc)
            return None, False
        if not listen:
            return conn, False
        try:
            with answered_within(conn, STALLED_AFTER):
                conn.execute(f"LISTEN {RUNS_CHANNEL}")
        except DatabaseStalled as exc:
            log.info("waiting: %s; connecting again", exc)
            conn.close()
            return None, False
        except DriverError as exc:
            log.info("waiting: LISTEN unavailable (%s); polling", exc)
            return conn, False
        self.listening_connections = 1
        return conn, True

    @staticmethod
    def _statuses(conn: Connection[Any], ids: list[str]) -> dict[str, RunStatus]:
        return statuses(*Store(conn).run(operations.finished_runs(ids)))


# -- the task of an AsyncClient ------------------------------------------------------------------
