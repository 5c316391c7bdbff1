"""Process control's children: started (forked from the zygote or spawned), replaced,
recycled, killed and reaped, with the strays a handler left behind.

A child (:class:`~cyclone_mp.childproc.ChildProc`) is forked from the zygote
(:mod:`cyclone_mp.zygote`, the default ``start_method="zygote"``) or is a fresh
interpreter (``start_method="spawn"``), never a fork of the grown supervisor. Either way
it is this process's own child, in its own process group and its slot's cgroups where
the host has them (:mod:`cyclone_mp.limits.slot`), carries the supervisor's marker in its
environment, imports the handlers' modules before it says it is ready, and is reused
for many steps until it is killed or recycled.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from typing import Any

import psutil

from . import procs
from .childproc import ChildProc
from .config import PRELOAD_TIMEOUT
from .limits.confinement import Confinement
from .limits.procfs import child_pids, has_children
from .mailbox import readable
from .zygote import Zygote, ZygoteError

RESPAWN_BACKOFF = (0.05, 5.0)  # seconds between starts of children that die before they are ready
SPAWN_RETRY_MAX = 1.0  # seconds: the longest wait between tries when the system refuses to start a child


class ChildPool:
    """Process control's children: start, replace, recycle, kill and reap them (SPEC 1, 4).

    Every child's socket is registered in process control's ``selector`` with the data
    ``("child", child)``. Each child is announced to the watchdog with its pidfd. The
    pool never decides what an attempt's end means: process control does.

    Args:
        owner: the supervisor's id (the children's environment marker).
        workers: how many children to keep.
        limit: the largest message in bytes.
        preload: ``(module, path)`` of the handlers' modules, imported before "ready".
        selector: process control's selector.
        watchdog: the :class:`~cyclone_mp.watchdoglink.WatchdogLink`.
        clock: local monotonic clock in seconds.
        confinement: the slots' cgroups (:class:`~cyclone_mp.limits.confinement.Confinement`).
        dedicated: the process runs only the supervisor (``client.run()``, the CLI), so
            every process it adopts is a handler's (:func:`~cyclone_mp.procs.strays`).
    """

    def __init__(self, owner: str, *, workers: int, limit: int, preload: list[tuple[str, str | None]],
                 selector: Any, watchdog: Any, clock: Any = time.monotonic,
                 on_kill: Any = None, confinement: Confinement | None = None, dedicated: bool = False,
                 start_method: str = "spawn") -> None:
        self.owner = owner
        self.on_kill = on_kill or (lambda trigger: None)  # told each SIGKILL's trigger (metrics)
        self.confinement = confinement or Confinement.none()
        self.dedicated = dedicated  # this process runs only the supervisor: all it adopts is a handler's
        self.workers = workers
        self.limit = limit
        self.preload = preload
        self.selector = selector
        self.watchdog = watchdog
        self.clock = clock
        self.children: list[ChildProc] = []
        self.respawn_at = clock()
        self.respawn_delay = RESPAWN_BACKOFF[0]
        self.refused_delay = RESPAWN_BACKOFF[0]  # the wait before the next try after the system refused a child
        self.ready_seconds: float | None = None  # moving average of a new child's spawn to ready
        self.descended: set[int] = set()  # pids seen as descendants of our children (their zombies are ours to reap)
        # children of this process that are no handler's: those it had before the supervisor
        # started, and (embedded) the program's own, once looked at
        self._foreign: set[int] = child_pids() or set()
        self.stats = {"children_spawned": 0, "children_forked": 0, "killed": 0, "grandchildren_killed": 0}
        # children forked from a zygote that imported the runner and the handlers once
        self.zygote = Zygote(owner, limit, self.preload, selector=selector, clock=clock,
                             preload_timeout=PRELOAD_TIMEOUT) if start_method == "zygote" else None

    # -- starting ----------------------------------------------------------------------------

    def spawn(self) -> ChildProc | None:
        """Start one child, forked from the zygote when it is ready, else spawned (None
        when the system refuses: tried again after a backoff)."""
        log = logging.getLogger("cyclone_mp.supervisor")
        zygote = self.zygote if self.zygote is not None and self.zygote.ready else None
        used = {c.slot.index for c in self.children if c.slot is not None}
        slot = self.confinement.slot(min(i for i in range(len(self.children) + 1) if i not in used))
        userns = self.confinement.userns_at_birth
        try:
            try:
                # a forked child is born in a fresh v2 cgroup of its slot (its caps reset
                # first) and moves itself into any v1 one it must join at birth: process
                # control never waits for the kernel
                child = ChildProc(self.owner, self.limit, self.preload, zygote=zygote,
                                  cgroup_fd=slot.prepare() if zygote is not None else None,
                                  enter=slot.entry() if zygote is not None else (), userns=userns)
            except ZygoteError as exc:
                log.warning("the zygote could not fork a child (%s); spawning one", exc)
                child = ChildProc(self.owner, self.limit, self.preload, userns=userns)
        except OSError as exc:
            log.error("cannot start a child process (next try in %.2fs): %s", self.refused_delay, exc)
            return None
        child.slot = slot
        # before it runs anything of the handlers
        slot.enter(child.pid, born_in_v2=child.in_cgroup, by_child=child.entering)
        self.children.append(child)
        self.stats["children_spawned"] += 1  # every child started, however
        if child.forked:
            self.stats["children_forked"] += 1  # ... of which forked from the zygote
        self.selector.register(child.sock, selectors.EVENT_READ, ("child", child))
        child.events = selectors.EVENT_READ
        self.watchdog.child(child.pid, child.pidfd, child.slot.v2_dir)
        if child.forked and child.leftover and not child.entering:
            child.start()
        return child

    def on_entered(self, child: ChildProc, message: dict[str, Any]) -> None:
        """A forked child moved itself into its slot's cgroups (or says why it could not:
        then it is moved from here, and told to go on if it waits for that)."""
        child.entering = False
        if child.slot is None or child.returncode is not None:  # (read after its death: nothing to do)
            return
        failed = [str(key) for key in message.get("failed") or []]
        child.slot.entered(child.pid, failed, message.get("error"))
        if failed and child.leftover:
            child.start()
        if child.slot.v2_dir is not None:  # the watchdog kills it through its cgroup from now on
            self.watchdog.child(child.pid, child.pidfd, child.slot.v2_dir)

    def maintain(self, now: float, draining: bool) -> None:
        """Keep ``workers`` children alive (a killed or recycled one is replaced at once).
        With a zygote, its messages are read here; while it starts (it imports what a
        spawned child would), children wait for it."""
        zygote = self.zygote
        if zygote is not None:
            if zygote.state == "off" and zygote.gave_up is None and not draining:
                zygote.start()
            zygote.poll()
        if draining or now < self.respawn_at:
            return
        if zygote is not None and zygote.state == "starting":
            return
        while len(self.children) < self.workers:
            if self.spawn() is None:  # refused (out of descriptors or processes): back off up to SPAWN_RETRY_MAX
                self.respawn_at = now + self.refused_delay
                self.refused_delay = min(SPAWN_RETRY_MAX, self.refused_delay * 2)
                return
            self.refused_delay = RESPAWN_BACKOFF[0]

    def await_zygote(self, timeout: float, stop: Any = lambda: False) -> bool:
        """Wait up to ``timeout`` seconds (or until ``stop()``) for a starting zygote to be
        ready or given up; True when it is ready."""
        zygote = self.zygote
        deadline = time.monotonic() + timeout
        while zygote is not None and zygote.state == "starting" and time.monotonic() < deadline and not stop():
            if zygote.sock is not None:
                with contextlib.suppress(OSError, ValueError):
                    readable([zygote.sock], 0.05)
            zygote.poll()
        return zygote is not None and zygote.ready

    def idle(self) -> list[ChildProc]:
        """Ready children with no attempt, not due for recycling."""
        return [c for c in self.children if c.ready and c.attempt is None and not c.concurrent
                and c.returncode is None and not c.recycle_due]

    def on_ready(self, child: ChildProc, message: dict[str, Any]) -> None:
        child.preloading = None
        child.ready = True
        child.ready_after = self.clock() - child.spawned
        prev = self.ready_seconds
        self.ready_seconds = child.ready_after if prev is None else 0.8 * prev + 0.2 * child.ready_after
        child.cpu_total = child.cpu_at_ready = float(message.get("cpu_total") or 0.0)
        child.userns = message.get("userns") is True
        if message.get("userns_error"):
            self.confinement.userns_failed(str(message["userns_error"]))

    def stuck_preloads(self, now: float) -> list[ChildProc]:
        """New children stuck importing one handler module for PRELOAD_TIMEOUT: killed here,
        returned so their exit is handled."""
        stuck = [c for c in self.children
                 if not c.ready and c.preloading is not None and now - c.preloading_since > PRELOAD_TIMEOUT]
        for child in stuck:
            self.kill(child, "preload_timeout")
        return stuck

    # -- I/O registration ------------------------------------------------------------------------

    def update_write_interest(self, child: ChildProc) -> None:
        """Watch the child's socket for writability while its outbox holds data."""
        if child.returncode is not None:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if child.outbox else 0)
        if events == child.events:
            return
        child.events = events
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.modify(child.sock, events, ("child", child))

    def unregister(self, child: ChildProc) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(child.sock)

    # -- ending ----------------------------------------------------------------------------------

    def kill(self, child: ChildProc, trigger: str) -> None:
        """SIGKILL the child's tree and reap it (SPEC 4)."""
        child.note_descendants()
        self.unregister(child)
        hit = child.kill()
        self.stats["killed"] += 1
        self.on_kill(trigger)
        self.count_grandchildren(child, hit)
        logging.getLogger("cyclone_mp.supervisor").warning(
            "killed child %d (%s) and %d descendant(s)", child.pid, trigger, len([p for p in hit if p != child.pid]))

    def count_grandchildren(self, child: ChildProc, hit: list[int]) -> None:
        self.stats["grandchildren_killed"] += len([p for p in hit if p != child.pid])

    def reap(self, child: ChildProc, *, ended_alone: bool) -> int | None:
        """A child whose socket closed: kill what it left (if it ``ended_alone``, its group
        and descendants go with it, done before reaping it, while its pid cannot be
        reused), reap it and its strays, and forget it. Returns its exit status."""
        self.unregister(child)
        hit: list[int] = []
        if child.returncode is None and ended_alone:
            child.note_descendants()
            hit += child.kill_tree()  # with what it left in its cgroup (an escapee that left its session too)
        code = child.wait(timeout=5.0)
        if code is None:  # still alive after SIGKILL (uninterruptible sleep): kill and wait again
            self.kill(child, "protocol_error")
            code = child.returncode
        if child in self.children:
            self.children.remove(child)
        self.watchdog.gone(child.pid)
        if hit:
            procs.reap([p for p in hit if p != child.pid], timeout=1.0)
            self.count_grandchildren(child, hit)
        self.reap_strays(child)
        return code

    def after_exit(self, child: ChildProc, code: int | None) -> None:
        """Preload bookkeeping and the respawn backoff after a child is gone."""
        log = logging.getLogger("cyclone_mp.supervisor")
        if not child.ready and child.preloading in self.preload:
            # Importing that module killed or wedged the child: later children leave it to
            # its steps' first attempt (where it fails them, not every child).
            self.preload.remove(child.preloading)
            log.error("a child %s while importing %s (code %s); its steps import it at their first attempt",
                      "hung" if child.killed else "died", child.preloading[0], code)
            self.respawn_delay = RESPAWN_BACKOFF[0]
        elif not child.ready and not child.killed:
            self.respawn_delay = min(RESPAWN_BACKOFF[1], self.respawn_delay * 2)
            self.respawn_at = self.clock() + self.respawn_delay
            log.error("a child exited before it was ready (code %s); next start in %.1fs", code, self.respawn_delay)
        else:
            self.respawn_delay = RESPAWN_BACKOFF[0]

    def retire(self, child: ChildProc) -> None:
        """Recycle an idle child: ask it to exit, reap it (kill it if it does not go)."""
        self.unregister(child)
        child.retire()
        if child.wait(timeout=2.0) is None:
            child.kill()
            self.stats["killed"] += 1
            self.on_kill("recycle")
        if child in self.children:
            self.children.remove(child)
        self.watchdog.gone(child.pid)
        self._clear_slot(child)

    def _clear_slot(self, child: ChildProc) -> None:
        """Kill what a child that exited left in its slot's cgroup, and reap it."""
        if child.slot is not None and child.slot.populated():
            hit = child.slot.kill()
            procs.reap(hit, timeout=1.0)
            self.descended.update(hit)
            self.count_grandchildren(child, hit)

    def sweep_leftovers(self, child: ChildProc) -> None:
        """A finished task left processes under the (reused) child: kill them, then let it go on."""
        killed = child.kill_descendants()
        self.count_grandchildren(child, killed)
        child.queue({"t": "go", "reap": killed})  # the child reaps those it adopted
        child.flush()
        self.update_write_interest(child)

    def reap_strays(self, child: ChildProc) -> None:
        if len(self.descended) > 10_000:
            self.descended = {pid for pid in self.descended if psutil.pid_exists(pid)}
        self.descended.update(child.descendants_seen)
        self.stats["grandchildren_killed"] += self._reap_strays(self._known())

    def _reap_strays(self, known: set[int]) -> int:
        pids = child_pids()  # cheap: a look at every process (psutil) only when one is unknown
        if pids is not None and not pids - known - self._foreign:
            return 0
        return procs.reap_strays(self.owner, known | self._foreign, self.descended, dedicated=self.dedicated,
                                 held=self.confinement.holds if self.confinement.mechanism.where else None)

    def reap_orphans(self) -> int:
        """Kill handler processes reparented to us (we are a subreaper): those of a child
        that died on its own, or that escaped its tree while the child was killed. Each
        child is a subreaper too, so while it lives its tree's orphans are its own (and
        swept with its attempt's leftovers). Returns how many."""
        pids = child_pids()
        known = self._known()
        if pids is not None and not pids - known - self._foreign:
            return 0
        n = self._reap_strays(known)
        self.stats["grandchildren_killed"] += n
        left = child_pids()
        self._foreign = (left or set()) - known  # not ours (the embedding program's): not looked at again
        return n

    def tell_descendants(self) -> None:
        """Without cgroups, tell the watchdog of the busy children's descendants, so it can
        kill them if this supervisor is SIGKILLed (their children die with it, and what
        they adopted is reparented away, out of reach of any other rule)."""
        if self.confinement.mechanism.where:
            return
        for child in self.children:
            if child.attempt is None or not has_children(child.pid):
                continue
            for proc in procs.descendants(child.pid):
                if proc.pid not in child.descendants_seen:
                    child.descendants_seen[proc.pid] = proc
                    with contextlib.suppress(psutil.Error):
                        self.watchdog.seen(proc.pid, proc.create_time())

    def _known(self) -> set[int]:
        zygote = self.zygote.pid if self.zygote is not None else None
        return {c.pid for c in self.children} | {self.watchdog.pid} | ({zygote} if zygote else set())

    def teardown(self) -> None:
        """Stop every child: idle ones are asked to exit, busy ones (or slow ones) killed.
        The zygote goes first (no child is forked after this)."""
        if self.zygote is not None:
            self.zygote.close()
        for child in list(self.children):
            self.unregister(child)
            if child.attempt is None:
                child.retire()
        deadline = time.monotonic() + 2.0
        for child in list(self.children):
            if child.attempt is not None or child.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                child.kill()
                self.stats["killed"] += 1
                self.on_kill("teardown")
            self.watchdog.gone(child.pid)
        self.children.clear()
        self.confinement.close()  # anything left in the slots' cgroups dies; the cgroups go
        self._reap_strays({self.watchdog.pid})
