"""The listener: ``LISTEN`` for new work and for cancels, on a thread and a connection of its own.

A ``NOTIFY`` on the work channel (an enqueue, a retry, a step made available) makes
process control claim at once instead of at its next poll; one on the cancel channel
(``client.cancel``, sent at commit, payload ``"<step id>.<lease generation>"``) makes it
cancel that attempt's handler within a second instead of at its lease's next renewal
(SPEC 9: cancels are pushed). The listener is only a shortcut: without it (PgBouncer in
transaction mode and no ``listen_dsn``, or its server unreachable) the supervisor still
claims on its poll interval and learns of a cancel at the next renewal.

It has its own thread so that nothing it does, such as opening its connection to a
``listen_dsn`` that does not answer (up to ``max(2, call_bound)`` seconds), can delay a
lease renewal: the lease keeper only renews.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .config import Config
from .connections import connect
from .mailbox import Inbox
from .messages import LeaseKey
from .store import CANCEL_CHANNEL, NOTIFY_CHANNEL

log = logging.getLogger("cyclone_mp.supervisor")

RECONNECT_FIRST = 0.1  # seconds before the first try to listen again; it doubles up to Config.reconnect_cap
STABLE_AFTER = 10.0  # seconds a LISTEN connection must have lived for its loss to be retried at once


def cancelled_key(payload: str) -> LeaseKey | None:
    """The lease a cancel notification names (``"<step id>.<generation>"``), or None."""
    try:
        step_id, generation = (int(part) for part in payload.split("."))
    except ValueError:
        return None
    return step_id, generation


class Listener:
    """LISTEN on ``listen_dsn`` and pass on what is heard (see the module docstring).

    Args:
        listen_dsn: where to LISTEN (a direct connection, never through PgBouncer in
            transaction mode).
        config: the supervisor's :class:`~cyclone_mp.config.Config` (``call_bound`` bounds
            the connect; ``reconnect_cap`` caps the backoff between tries).
        owner: the supervisor's id (in the connection's ``application_name``).
        poll: called (on this thread) when new work was announced, and after each
            (re)connection (a notification may have been missed meanwhile).
        cancelled: called (on this thread) with the lease key of a cancelled attempt;
            whether it is this supervisor's is for the callee to say.
        clock: local monotonic clock in seconds.
    """

    name = "cyclone-listener"

    def __init__(self, listen_dsn: str, config: Config, *, owner: str, poll: Callable[[], None],
                 cancelled: Callable[[LeaseKey], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.listen_dsn = listen_dsn
        self.config = config
        self.owner = owner
        self.poll = poll
        self.cancelled = cancelled
        self.clock = clock
        self.inbox = Inbox()  # only to wake the thread (a stop)
        self.conn: Any = None
        self.stats = {"listen_connects": 0, "cancels_heard": 0}
        self._reconnect_at = clock()
        self._reconnect_delay = RECONNECT_FIRST
        self._since = 0.0  # when the connection open now was opened
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        self._stopping.set()
        self.inbox.wake()

    def join(self, timeout: float, *, hung_after: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True if it did. A connect
        that hangs is left behind (a daemon thread); ``hung_after`` is accepted for the
        supervisor's other parts' sake."""
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self.conn is None and self.clock() >= self._reconnect_at:
                    self._listen()
                if self.conn is None:
                    self.inbox.wait(max(0.0, self._reconnect_at - self.clock()))
                    continue
                try:
                    fd = self.conn.pgconn.socket
                except Exception:  # noqa: BLE001 - closed under us
                    self._lost("its socket is gone")
                    continue
                if self.inbox.wait(None, fd):
                    self._read()
        finally:
            self._close()
            self.inbox.close()

    # -- the connection --------------------------------------------------------------------------

    def _listen(self) -> None:
        try:
            conn = connect(self.listen_dsn, timeout=max(2.0, self.config.call_bound),
                           dead_after=self.config.call_bound, application_name=f"cyclone_mp listener {self.owner}")
        except Exception as exc:  # noqa: BLE001 - polling still works without LISTEN
            self._retry_later(f"LISTEN unavailable ({exc}); polling only")
            return
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            conn.execute(f"LISTEN {CANCEL_CHANNEL}")
        except Exception as exc:  # noqa: BLE001
            conn.close()
            self._retry_later(f"LISTEN failed ({exc}); polling only")
            return
        if self._stopping.is_set():
            conn.close()
            return
        self.conn = conn
        self.stats["listen_connects"] += 1
        self._since = self.clock()
        self.poll()  # whatever was announced while nobody listened

    def _retry_later(self, why: str) -> None:
        log.warning("%s; trying again in %.1fs", why, self._reconnect_delay)
        self._reconnect_at = self.clock() + self._reconnect_delay
        self._reconnect_delay = min(self.config.reconnect_cap, self._reconnect_delay * 2)

    def _read(self) -> None:
        conn = self.conn
        try:
            conn.pgconn.consume_input()
            work = False
            while (note := conn.pgconn.notifies()) is not None:
                if note.relname.decode() == CANCEL_CHANNEL:
                    key = cancelled_key(note.extra.decode())
                    if key is not None:
                        self.stats["cancels_heard"] += 1
                        self.cancelled(key)
                else:
                    work = True
            if work:
                self.poll()
        except Exception as exc:  # noqa: BLE001 - a lost LISTEN connection is opened again
            self._lost(str(exc))

    def _lost(self, why: str) -> None:
        """Listen again at once after a connection that lived a while (STABLE_AFTER), after
        the growing backoff when they keep dying young (never a tight loop)."""
        log.info("the LISTEN connection was lost (%s); listening again", why)
        self._close()
        if self.clock() - self._since >= STABLE_AFTER:
            self._reconnect_delay = RECONNECT_FIRST
            self._reconnect_at = self.clock()
        else:
            self._reconnect_at = self.clock() + self._reconnect_delay
            self._reconnect_delay = min(self.config.reconnect_cap, self._reconnect_delay * 2)

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.conn = None
