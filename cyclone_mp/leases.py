"""The lease keeper: renewals, on a connection of its own (SPEC 4).

It renews every lease its supervisor holds until it is told the lease is done
(:class:`~cyclone_mp.messages.LeaseDone`): one renewal per step, addressed by id, with
the seed's WHERE clause, every ``lease_ttl / 3`` with a random initial phase
(:func:`first_beat`) and +-10 % jitter. Renewals due together go in one round trip
(:meth:`~cyclone_mp.store.Leases.renew_many`). It does nothing else that could delay a
renewal: claims are the outcome writer's. It tells process control
:class:`~cyclone_mp.messages.Renewed` (with the time the renewal was sent: the local
fence, SPEC 9) or :class:`~cyclone_mp.messages.LeaseLost` (the row says why), and never
decides what happens to a handler: :meth:`cyclone_mp.kills.Kills.on_lease_lost` does.

``LISTEN`` (new work, cancels) is the :class:`~cyclone_mp.listener.Listener`'s, on a
thread of its own: opening that connection can take seconds, which a renewal must
never wait for.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Any, Callable

from . import decisions
from .config import Config
from .dbloop import DatabaseThread
from .errors import DatabaseError, DatabaseUnavailable
from .messages import (
    DatabaseState, LeaseDone, LeaseKey, LeaseLost, Progress, Renewed, Started, Track,
)
from .telemetry import NO_OBSERVER, Observer

log = logging.getLogger("cyclone_mp.supervisor")


@dataclasses.dataclass
class Lease:
    """A lease the keeper renews: when next, and the progress to store with it."""

    key: LeaseKey
    next_beat: float
    progress: Any = None
    progress_dirty: bool = False
    start_delay: float | None = None  # its handler started this long after the claim: stored with the next renewal
    renewed: float = 0.0  # when the claim or the last renewal that held was sent (heartbeat lag)


class LeaseKeeper(DatabaseThread):
    """Renewals for one supervisor (see the module docstring).

    Args:
        dsn: PostgreSQL connection string (claims and renewals).
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        owner: the supervisor's id (``lease_owner``).
        tell: posts a message to process control.
        observer: told of the heartbeat lag (:mod:`cyclone_mp.telemetry`).
        clock: local monotonic clock in seconds.
    """

    def __init__(self, dsn: str, config: Config, *, owner: str, tell: Callable[[Any], None],
                 observer: Observer = NO_OBSERVER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("lease keeper", dsn, config, owner=owner, bound=config.call_bound, clock=clock)
        self.observer = observer
        self.config = config
        self.owner = owner
        self.tell = tell
        self.leases: dict[LeaseKey, Lease] = {}
        self.leases_lock = threading.Lock()  # adding and removing leases, against held() on other threads

    # -- messages ----------------------------------------------------------------------------

    def held(self) -> list[LeaseKey]:
        """The ``(step id, lease generation)`` of every lease this keeper renews now: the
        attempts running or held, and those whose outcomes are not yet written. Safe to
        call from any thread (the recovery sweep's: :class:`cyclone_mp.sweep.Sweeper`)."""
        with self.leases_lock:
            return list(self.leases)

    def _read_inbox(self) -> None:
        messages = self.inbox.take()
        if messages:
            with self.leases_lock:
                self._take(messages)

    def _take(self, messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, Progress):
                lease = self.leases.get(message.key)
                if lease is not None:
                    lease.progress, lease.progress_dirty = message.value, True
            elif isinstance(message, Started):
                for key, delay in message.items:
                    lease = self.leases.get(key)
                    if lease is not None:
                        lease.start_delay = delay
            elif isinstance(message, LeaseDone):
                for key in message.keys:
                    self.leases.pop(key, None)
            elif isinstance(message, Track):  # claimed by the outcome writer with a batch
                for key in message.keys:
                    self.leases[key] = Lease(key, message.sent + first_beat(self.config.heartbeat_interval),
                                             renewed=message.sent)

    # -- the turn ------------------------------------------------------------------------------

    def turn(self, now: float) -> float:
        self._read_inbox()
        if self.db_ok:
            self._renew_due(now)
        if self.observer is not NO_OBSERVER:
            oldest = min((lease.renewed for lease in self.leases.values()), default=None)
            self.observer.heartbeat_lag(0.0 if oldest is None else max(0.0, self.clock() - oldest))
        interval = self.config.heartbeat_interval
        beats = [lease.next_beat for lease in self.leases.values()]
        return min([self.clock() + interval, *beats])

    def _renew_due(self, now: float) -> None:
        due = [lease for lease in self.leases.values() if now >= lease.next_beat]
        if not due:
            return
        interval = self.config.heartbeat_interval
        for lease in due:
            lease.next_beat = now + interval * random.uniform(0.9, 1.1)
        sent = self.clock()
        items = [(l.key[0], l.key[1], l.progress if l.progress_dirty else None, l.start_delay) for l in due]
        try:
            matched = self.call(self.config.call_bound, lambda store: store.leases.renew_many(
                owner=self.owner, items=items, ttl=self.config.lease_ttl))
        except DatabaseUnavailable:
            self._retry_soon(due)
            return
        except DatabaseError:  # one of them waited on a row lock: renew them one by one
            for lease in due:
                if not self._renew_one(lease):
                    return
            return
        for lease, ok in zip(due, matched):
            self._renewed(lease, ok, sent)

    def _renew_one(self, lease: Lease) -> bool:
        """Renew one lease alone; False when the connection was lost."""
        sent = self.clock()
        try:
            matched = self.call(self.config.call_bound, lambda store: store.leases.renew_many(
                owner=self.owner, items=[(lease.key[0], lease.key[1], lease.progress if lease.progress_dirty else None,
                                          lease.start_delay)],
                ttl=self.config.lease_ttl))
        except DatabaseUnavailable:
            self._retry_soon([lease])
            return False
        except DatabaseError as exc:  # its row is locked (or the call was rejected): the next beat tries again
            log.info("renewal of step %d failed (%s); trying again", lease.key[0], exc)
            self._retry_soon([lease])
            return True
        self._renewed(lease, matched[0], sent)
        return True

    def _retry_soon(self, leases: list[Lease]) -> None:
        """A renewal that did not happen is tried again after half an interval."""
        soon = self.clock() + self.config.heartbeat_interval / 2
        for lease in leases:
            lease.next_beat = min(lease.next_beat, soon)

    def _renewed(self, lease: Lease, ok: bool, sent: float) -> None:
        if ok:
            if self.leases.get(lease.key) is lease:
                lease.progress_dirty = False
                lease.start_delay = None  # stored
                lease.renewed = max(lease.renewed, sent)
            self.tell(Renewed(lease.key, sent))
            return
        self._lost(lease)

    def _lost(self, lease: Lease) -> None:
        """A renewal matched nothing (seed: Heartbeats): find out why and say so."""
        step_id, generation = lease.key
        try:
            row = self.call(self.config.call_bound, lambda store: store.leases.state(step_id))
        except DatabaseError:
            self._retry_soon([lease])  # asked again on the next beat (it matches nothing again)
            return
        reason = lost_reason(row, self.owner, generation)
        with self.leases_lock:
            self.leases.pop(lease.key, None)
        if reason == "lease_lost":
            self.count("lease_lost")
        log.info("renewal of step %d matched nothing (%s)", step_id, reason)
        self.tell(LeaseLost(lease.key, reason))

    # -- the connection -------------------------------------------------------------------------

    def connected(self) -> None:
        self.tell(DatabaseState(True))
        log.info("connected; supervisor %s", self.owner)

    def disconnected(self) -> None:
        self.tell(DatabaseState(False))


def first_beat(interval: float) -> float:
    """Seconds from a claim (the first heartbeat) to a lease's first renewal: a random
    phase in the second half of the interval (SPEC 4's random initial phase). Leases
    claimed together still renew spread out, and a step that ends within half an
    interval (most do: 5 s with the default 30 s lease) is never renewed at all; from
    the whole interval, some short steps would each cost a renewal statement, which adds
    up over many supervisors. The lease stays at least two intervals ahead of its expiry."""
    return interval * random.uniform(0.5, 1.0)


def lost_reason(row: dict[str, Any] | None, owner: str, generation: int) -> str:
    """Why a renewal of ``(step, generation)`` by ``owner`` matched nothing, from the row's
    :meth:`~cyclone_mp.store.Leases.state` (pure)."""
    if row is None or row["state"] == "cancelled":
        return "cancelled"
    if row["state"] == "running" and row["lease_owner"] == owner and row["lease_generation"] == generation:
        return "timeout" if row["timed_out"] else "lease_lost"
    if row["last_error_kind"] == decisions.TIMEOUT and row["last_error_generation"] == generation:
        return "timeout"  # the sweep settled this attempt's timeout first
    if row["state"] in ("completed", "discarded") and row["lease_generation"] == generation:
        return "finished"  # our own outcome was written (it crossed the renewal)
    return "lease_lost"
