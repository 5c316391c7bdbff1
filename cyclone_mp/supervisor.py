"""The supervisor (parent process): holds every lease, owns every child (SPEC 1, 4, 5).

Six parts with one job each, sharing no mutable state, talking by the messages of
:mod:`cyclone_mp.messages`: process control (:mod:`~cyclone_mp.control`: children,
deadlines, the local fence, cancels, kills; never a database call; on this thread);
on threads of their own, renewals (:mod:`~cyclone_mp.leases`: nothing delays them),
LISTEN (:mod:`~cyclone_mp.listener`: new work, cancels), claims and the CAS write of
every ended attempt (:mod:`~cyclone_mp.outcomes`), the sweep, timers, schedules and
registry (:mod:`~cyclone_mp.sweep`), payloads too big to come with their claim
(:mod:`~cyclone_mp.loader`). Each database part bounds every call
(:mod:`cyclone_mp.dbloop`), so a slow or partitioned database delays durable
transitions, never a kill. The watchdog process (:mod:`cyclone_mp._watchdog`) kills a
child whose fence passed while this process was frozen, and all it started once this
process is gone (docs/operating.md explains the whole).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from . import procs, spawning
from .config import Config
from .control import ProcessControl
from .errors import ConfigurationError
from .health import DatabaseProbe, liveness, readiness
from .leases import LeaseKeeper
from .limits.confinement import Confinement
from .listener import Listener
from .loader import PayloadLoader
from .messages import LeaseLost, Poll
from .mux import Mux
from .observers import supervisor_observer
from .outcomes import FINAL_FLUSH, OutcomeWriter
from .sweep import Maintenance, Sweeper
from .telemetry import Observer, Probes, Stats
from .watchdoglink import WatchdogLink

log = logging.getLogger("cyclone_mp.supervisor")


class Supervisor:
    """The multiprocess supervisor; see the module docstring.

    Args:
        dsn: PostgreSQL connection string.
        mux: the steps this supervisor may claim (by name).
        config: a :class:`~cyclone_mp.config.Config`.
        listen_dsn: where to LISTEN for new work (default ``dsn``; a direct connection
            when ``dsn`` goes through PgBouncer in transaction mode).
        metrics_port: serve Prometheus metrics on this port (0: any free one); None: none.
        metrics_host: the address the metrics bind (default ``127.0.0.1``).
        metrics_token: the bearer token a scrape must carry, or None.
        observer: what the parts report to (default: :func:`~cyclone_mp.observers.supervisor_observer`).
        clock: local monotonic clock in seconds (injectable; only schedules work).
        wall_clock: local wall clock in epoch seconds, for ``ctx.deadline`` only.
        dedicated: this process runs only the supervisor (``client.run()``, ``cyclone-mp
            worker``): every process it adopts is then a handler's; False in a
            program that embeds it (``client.start()``), whose own children are left alone.

    Raises:
        ConfigurationError: a registered handler cannot be imported by a child.
        SupervisorInChild: this process is itself a handler's child (a module-level
            ``client.start()``), see :func:`cyclone_mp.procs.refuse_in_child`.
    """

    def __init__(self, dsn: str, mux: Mux, config: Config, *, listen_dsn: str | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 metrics_token: str | None = None, observer: Observer | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 dedicated: bool = False) -> None:
        procs.refuse_in_child()
        for step in mux.steps.values():
            if not step.ref.importable():
                raise ConfigurationError(
                    f"step {step.name!r}: handler {step.ref.qualname} is not importable by module path "
                    f"(define it at module level in {step.ref.module}); children import handlers by name"
                )
        self.dsn = dsn
        self.listen_dsn = listen_dsn
        self.mux = mux
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.dedicated = dedicated
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.confinement: Confinement | None = None
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.control: ProcessControl | None = None
        self.keeper: LeaseKeeper | None = None
        self.listener: Listener | None = None
        self.loader: PayloadLoader | None = None
        self.writer: OutcomeWriter | None = None
        self.maintenance: Maintenance | None = None
        self._requests: list[str] = []
        self._readiness: DatabaseProbe | None = None
        self.observer = observer if observer is not None else supervisor_observer(
            metrics_port, metrics_host, metrics_token, discard_hooks=mux.hooks["discarded"])

    # -- control from other threads / signal handlers -----------------------------------

    def request_shutdown(self) -> None:
        """Soft stop: claim nothing more; in-flight handlers get ``shutdown_grace`` (SPEC 5)."""
        self._requests.append("shutdown")
        if self.control is not None:
            self.control.request_shutdown()

    def request_stop(self) -> None:
        """Hard stop: cancel every in-flight handler now, kill after ``kill_grace``."""
        self._requests.append("stop")
        if self.control is not None:
            self.control.request_stop()

    # -- the parts ---------------------------------------------------------------------

    def backoff_for(self, step_name: str | None) -> Callable[[int], float]:
        """The callable backoff of a row that stores none (:meth:`cyclone_mp.mux.Mux.backoff_for`)."""
        return self.mux.backoff_for(step_name, self.config.defaults.backoff)

    def run(self) -> None:
        """Run until shut down, on this thread (children are created from it: PDEATHSIG
        follows the thread that creates a child)."""
        # Metrics first: a port in use is a ConfigurationError before any child or lease exists.
        try:
            if self.observer.find("Metrics") is not None:  # /readyz: does the database answer?
                self._readiness = DatabaseProbe.started(self.dsn, pgbouncer=self.config.pgbouncer, owner=self.id)
            self.observer.start(Probes(
                children_alive=lambda: len(self.control.pool.children) if self.control is not None else 0,
                last_sweep_age=lambda: self.maintenance.health.last_sweep_age() if self.maintenance else None,
                live=lambda: liveness(self.control, self.stopped.is_set()),
                ready=lambda: readiness(self.running.is_set(), self.draining or self.shutdown_requested,
                                        self._readiness)))
        except BaseException:
            self._close_observers()
            self.stopped.set()
            raise
        was_subreaper = procs.set_subreaper(True)
        watchdog = WatchdogLink(self.id)
        try:
            self.confinement = confinement = Confinement.detect(self.id.rsplit(":", 1)[-1])  # the slots' cgroups
            watchdog.cgroups(confinement.dirs)
            log.log(*confinement.mechanism.start_line())  # one line: what holds each cap here
            # Each part reaches the others only through their inboxes (posted messages).
            self.keeper = LeaseKeeper(self.dsn, self.config, owner=self.id, tell=lambda m: control.tell(m),
                                      observer=self.observer, clock=self.clock)
            listen_dsn = self.listen_dsn or (None if self.config.pgbouncer else self.dsn)  # PgBouncer: poll only
            if listen_dsn is not None:
                self.listener = Listener(listen_dsn, self.config, owner=self.id, poll=lambda: control.tell(Poll()),
                                         cancelled=lambda key: control.tell(LeaseLost(key, "cancelled")),
                                         clock=self.clock)
            self.writer = OutcomeWriter(self.dsn, self.config, owner=self.id, names=self.mux.step_names,
                                        backoff_for=self.backoff_for, max_snoozes=self.mux.max_snoozes,
                                        plan_spawns=lambda o: spawning.plan(self.mux, self.config.defaults, o.run_id,
                                                                            o.node, o.spawns),
                                        tell_keeper=self.keeper.inbox.post,
                                        tell_control=lambda m: control.tell(m),
                                        load=lambda m: loader.inbox.post(m), observer=self.observer,
                                        clock=self.clock)
            control = ProcessControl(self.id, self.mux, self.config, keeper=self.keeper.inbox.post,
                                     writer=self.writer, watchdog=watchdog, clock=self.clock,
                                     wall_clock=self.wall_clock, observer=self.observer, confinement=confinement,
                                     dedicated=self.dedicated)
            self.control = control
            sweeper = Sweeper(self.id, self.backoff_for, written=self.observer.written, discarded=self.observer.discarded,
                              held=self.keeper.held)
            self.maintenance = Maintenance(self.dsn, self.config, sweeper=sweeper, mux=self.mux, owner=self.id,
                                           snapshot=self._snapshot, tell_control=control.tell, started=self.running,
                                           observer=self.observer, clock=self.clock)
            self.loader = loader = PayloadLoader(self.dsn, self.config, owner=self.id, tell_control=control.tell,
                                                 post_outcome=self.writer.post, clock=self.clock)
            for request in self._requests:  # asked before the parts existed
                (control.request_stop if request == "stop" else control.request_shutdown)()
            for part in self._threads():
                part.start()
            control.run(self.running)
        finally:
            self._teardown(watchdog)
            if was_subreaper is False:
                procs.set_subreaper(False)
            self.stopped.set()

    def _snapshot(self) -> dict[str, Any]:
        info = dict(self.control.snapshot) if self.control is not None else {}
        info["stats"] = dict(self.stats)
        return info

    def _teardown(self, watchdog: WatchdogLink) -> None:
        """Stop the children, write what is left, stop the database parts, then the
        watchdog. At most about :data:`~cyclone_mp.outcomes.FINAL_FLUSH` seconds once the
        children are gone: a call that hangs (a partition) is left behind, never waited
        for; its lease expires and another supervisor reclaims the step."""
        if self.control is not None:
            try:
                self.control.close()
            except Exception:  # noqa: BLE001 - the rest must still stop
                log.exception("stopping the children failed")
        elif self.confinement is not None:
            self.confinement.close()
        parts = self._threads()
        for part in parts:
            part.request_stop()
        # What is left is written while calls come back; one that has hung past the lease
        # keeper's bound is a partition: it is left behind rather than waited for.
        deadline = time.monotonic() + FINAL_FLUSH + 2.0
        for part in parts:
            if not part.join(deadline - time.monotonic(), hung_after=self.config.call_bound):
                log.warning("%s did not stop in time (a database call hangs); leaving it", part.name)
        watchdog.close(clean=True)
        self._close_observers()

    def _threads(self) -> list[Any]:
        """The parts on threads of their own (the writer first: what is left is written first)."""
        return [p for p in (self.writer, self.keeper, self.maintenance, self.loader, self.listener) if p is not None]

    def _close_observers(self) -> None:
        self.observer.close()  # the metrics server stops (an observer's failure is only logged)
        if self._readiness is not None:
            self._readiness.close()

    # -- what callers read -----------------------------------------------------------------

    @property
    def metrics(self) -> Any:
        """The :class:`~cyclone_mp.metrics.Metrics` served (``metrics.port``), or None."""
        return self.observer.find("Metrics")

    @property
    def stats(self) -> Stats:
        """Counters of every part, summed by name, read live (claimed, completed, failed,
        released, prefetch_released, killed, grandchildren_killed, lease_lost, reclaimed,
        swept_timeouts, fence_kills, watchdog_kills, ...)."""
        return Stats(self.counters)

    def counters(self) -> list[dict[str, int]]:
        """Each part's own counters."""
        parts: list[dict[str, int]] = []
        if self.control is not None:
            parts += [self.control.stats, self.control.pool.stats]
        parts += [p.stats for p in (self.keeper, self.writer, self.maintenance, self.loader) if p is not None]
        return parts

    @property
    def shutdown_requested(self) -> bool:
        """A soft or hard stop was asked for."""
        return bool(self._requests)

    @property
    def stop_requested(self) -> bool:
        """A hard stop was asked for."""
        return "stop" in self._requests

    @property
    def children(self) -> list[Any]:
        """The live child processes (:class:`~cyclone_mp.pool.ChildProc`)."""
        return self.control.children if self.control is not None else []

    @property
    def prefetched(self) -> Any:
        """Claimed steps no child has taken yet."""
        return self.control.held if self.control is not None else []

    @property
    def attempts(self) -> dict[Any, Any]:
        """Running attempts by lease ``(step id, generation)`` (process control's own
        dict: from another thread, read :meth:`in_flight`)."""
        return self.control.attempts if self.control is not None else {}

    def in_flight(self) -> list[Any]:
        """The attempts running now (``step_name``, ``node``, ``run_id``...), a copy safe
        to read from any thread."""
        return self.control.in_flight() if self.control is not None else []

    @property
    def drain_deadline(self) -> float | None:
        """When a drain gives up waiting (the supervisor's clock), once draining."""
        return self.control.drain_deadline if self.control is not None else None

    @property
    def draining(self) -> bool:
        return self.control is not None and self.control.draining

    @property
    def db_ok(self) -> bool:
        """The lease keeper is connected."""
        return self.keeper is not None and self.keeper.db_ok
