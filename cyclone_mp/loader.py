"""The payload loader: reads the inputs and upstream outputs too big to come with a claim.

A claim brings each row's input and upstream outputs inline up to a size; a bigger row
comes without them, and the outcome writer hands it here (:class:`~cyclone_mp.messages.Load`).
One load may take up to LOAD_BOUND seconds (a statement of its own, with its own
``statement_timeout``), so it runs on a thread and a connection of its own: the sweep,
schedules and the registry (maintenance's) never wait behind one. The connection is
opened when a load arrives and closed after IDLE_CLOSE seconds without one, so a
supervisor whose payloads all fit in their claims holds no connection for it.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from . import decisions, mapped
from .config import Config
from .dbloop import DatabaseThread
from .errors import DatabaseBusy, DatabaseError, DatabaseUnavailable
from .messages import FAIL, RELEASE, Claimed, Load, Outcome
from .protocol import upstream_limit, upstream_too_big

log = logging.getLogger("cyclone_mp.supervisor")

LOAD_BOUND = 120.0  # seconds a big payload's statement may take (its own statement_timeout)
#: Seconds the call of a load may take beyond LOAD_BOUND before its connection is taken for
#: lost: the server's statement_timeout ends a slow load first, as that row's error.
LOAD_MARGIN = 10.0
IDLE_CLOSE = 30.0  # seconds without a load after which the loader's connection is closed


class PayloadLoader(DatabaseThread):
    """Loads of big rows, one after another (see the module docstring).

    Args:
        dsn: PostgreSQL connection string.
        config: the supervisor's :class:`~cyclone_mp.config.Config` (``max_payload``).
        owner: the supervisor's id.
        tell_control: posts a message to process control (a loaded row, as a
            :class:`~cyclone_mp.messages.Claimed` of its own).
        post_outcome: hands an :class:`~cyclone_mp.messages.Outcome` to the outcome writer
            (a row that cannot be read fails; one met by an outage is released).
        clock: local monotonic clock in seconds.
    """

    def __init__(self, dsn: str, config: Config, *, owner: str, tell_control: Callable[[Any], None],
                 post_outcome: Callable[[Outcome], None], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("payload loader", dsn, config, owner=owner, bound=config.write_bound, generic_plans=False,
                         clock=clock)
        self.config = config
        self.tell_control = tell_control
        self.post_outcome = post_outcome
        self.loads: collections.deque[Load] = collections.deque()
        self.last_load = clock()

    def wants_connection(self) -> bool:
        return bool(self.loads) or len(self.inbox) > 0

    def turn(self, now: float) -> float:
        self.loads.extend(m for m in self.inbox.take() if isinstance(m, Load))
        while self.loads:
            load = self.loads.popleft()
            for row in load.rows:
                self.load(row, load.sent)
            self.last_load = self.clock()
        now = self.clock()
        if self.db_ok and now - self.last_load >= IDLE_CLOSE:  # idle: give the connection back
            self._close()
            self.db_ok = False
        return now + IDLE_CLOSE

    def load(self, row: dict[str, Any], sent: float) -> None:
        """Read one big row's payload and hand the row to process control (the outputs
        of its upstream map nodes are written to files, page by page:
        :func:`cyclone_mp.mapped.write_outputs`). A row that cannot be read fails alone (``permanent``): its upstream outputs over
        :func:`~cyclone_mp.protocol.upstream_limit` (the message says their size), a
        statement past LOAD_BOUND, a value the database refuses. One met by an outage, or by
        a lock wait past ``lock_timeout`` (a lock held a moment elsewhere: a vacuum
        truncating a table), is released and read again once claimed again."""
        key = (row["id"], row["lease_generation"])
        limit = upstream_limit(self.config.max_payload)
        unreadable = "the step's input or upstream outputs cannot be read: "
        try:
            payload = self.call(LOAD_BOUND + LOAD_MARGIN, lambda store: store.payloads.load(
                row["id"], statement_timeout=LOAD_BOUND, max_upstream=limit))
        except DatabaseError as exc:
            payload = None
            if _given_back(exc):
                message = None
            elif isinstance(exc, DatabaseBusy):  # its own statement_timeout
                message = f"{unreadable}not within {LOAD_BOUND:g}s ({exc})"
            else:
                message = f"{unreadable}{exc}"
        else:
            message = None if payload is not None else f"{unreadable}the step is gone"
        self.count("loads")
        if payload is not None:
            outputs, size = payload.pop("upstream_outputs"), payload.pop("upstream_bytes")
            if outputs and payload["upstream"] is None:
                payload, message = None, upstream_too_big(row["node"], outputs, size, limit)
        if payload is not None and payload.get("maps"):  # upstream map nodes: their outputs, page by page, to files
            try:
                payload["maps"] = mapped.write_outputs(
                    lambda fn: self.call(LOAD_BOUND + LOAD_MARGIN, fn), row["run_id"], payload["maps"])
            except (DatabaseError, OSError) as exc:
                payload, message = None, None if _given_back(exc) else f"{unreadable}{exc}"
        if payload is not None:
            self.tell_control(Claimed(({**row, **payload, "big": False},), sent, 0))
            return
        workflow = row["run_kind"] != "step"  # (a workflow run, or a spawned one: "child")
        if message is None:  # an outage or a lock wait: give it back (its lease is kept until the writer can)
            self.post_outcome(Outcome(key, RELEASE, row["step_name"], row["attempt"], workflow, held=True))
            return
        log.error("step %d: %s", row["id"], message)
        self.post_outcome(Outcome(key, FAIL, row["step_name"], row["attempt"], workflow, row.get("backoff"),
                                  error_kind=decisions.PERMANENT, entry={
                                      "type": "cyclone_mp.errors.PayloadError", "message": message[:2000]}))


def _given_back(exc: BaseException) -> bool:
    """A load met an outage or a lock held a moment elsewhere (a vacuum truncating a
    table): nothing is wrong with the row, so it is given back and read again."""
    return isinstance(exc, DatabaseUnavailable) or (isinstance(exc, DatabaseBusy) and exc.lock_wait)
