"""The supervisor's side of one child process: spawn or fork, pipes, kill, reap.

A :class:`ChildProc` is forked from the zygote (:mod:`cyclone_mp.zygote`: a process
that imported the runner and the handlers' modules once; the default
``start_method="zygote"``) or is a fresh interpreter (``cyclone_mp._child`` started through
:func:`cyclone_mp.procs.helper_command`, ``start_method="spawn"``), never a fork of the
grown supervisor. Either way it is this process's own child, runs in its own process
group, in its slot's cgroups where the host has them (:mod:`cyclone_mp.slots`), carries the supervisor's marker in its environment,
and is reused for many steps until it is killed or recycled. It has imported the
handlers' modules before it says it is ready.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import select
import selectors
import socket
import subprocess
import time
from typing import Any, Sequence

import psutil

from . import procs, protocol
from .config import PRELOAD_TIMEOUT
from .slots import Confinement, Slot
from .zygote import Zygote, ZygoteError

READS_PER_CALL = 16  # reads of protocol.READ_CHUNK bytes (1 MiB) a turn takes from one child at most


class ChildProc:
    """One child: its Popen, control socket (non-blocking), cancellation pipe, buffers.

    Attributes:
        pid: the child's pid (also its process group id).
        ready: the child said hello and can take a task.
        attempt: the attempt it is running (set by the supervisor), or None.
        steps_run: tasks finished by this child (for ``max_steps_per_child``).
    """

    def __init__(self, supervisor_id: str, limit: int, preload: Sequence[tuple[str, str | None]] = (), *,
                 zygote: Zygote | None = None, cgroup_fd: int | None = None,
                 enter: Sequence[tuple[str, int]] = (), userns: bool = False) -> None:
        """Start a child. ``limit``: the largest message in bytes; ``preload``: the
        ``(module, script path or None)`` of the handlers, imported before it is ready;
        ``zygote``: fork it from this ready zygote instead of spawning a fresh
        interpreter. A forked child imports the modules of ``preload`` the zygote had not,
        once it is in its slot's cgroups; it is created in the cgroup v2 directory
        ``cgroup_fd`` names where the kernel can (:attr:`in_cgroup`), and moves itself
        into the cgroup directories of ``enter`` (``(key, descriptor)``, the slot's
        :meth:`~cyclone_mp.slots.Slot.entry`), then says ``entered`` (:attr:`entering`
        until then). Without ``enter`` the caller moves it, then calls :meth:`start`.
        ``userns``: it makes a user namespace of its own at birth, where RLIMIT_NPROC then
        counts its tree alone (:mod:`cyclone_mp.proctree`); its ``ready`` says whether it
        could (:attr:`userns`).

        Raises:
            OSError: the system refused a process or a descriptor.
            ZygoteError: the zygote could not fork it (the caller spawns it instead).
        """
        self.spawned = time.monotonic()
        parent_sock, child_sock = socket.socketpair()
        cancel_r, cancel_w = os.pipe()
        self.popen: subprocess.Popen[bytes] | None = None
        self.leftover: list[list[Any]] = []  # forked: the handlers' modules it imports itself, once in its slot
        self.in_cgroup = False  # forked into its slot's cgroup v2 directory (CLONE_INTO_CGROUP)
        self.entering = False  # forked and moving itself into its slot's cgroups: "entered" not seen yet
        try:
            if zygote is not None:
                self.leftover = [list(m) for m in preload if tuple(m) not in zygote.imported]
                self.pid, self.in_cgroup = zygote.fork(child_sock.fileno(), cancel_r, self.leftover, cgroup_fd, enter,
                                                       userns=userns)
                self.entering = bool(enter)
            else:
                env = procs.helper_env({procs.MARKER_ENV: supervisor_id,
                                        protocol.PRELOAD_ENV: json.dumps([list(m) for m in preload]),
                                        protocol.USERNS_ENV: "1" if userns else ""})
                self.popen = subprocess.Popen(
                    procs.helper_command("_child", str(child_sock.fileno()), str(cancel_r), str(os.getpid()),
                                         str(limit)),
                    pass_fds=(child_sock.fileno(), cancel_r),
                    process_group=0,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    close_fds=True,
                )
                self.pid = self.popen.pid
        except BaseException:
            parent_sock.close()
            os.close(cancel_w)
            raise
        finally:
            child_sock.close()
            os.close(cancel_r)
        self.forked = zygote is not None
        if self.forked:  # it takes its own group at once; so it has when this returns
            with contextlib.suppress(OSError):
                os.setpgid(self.pid, self.pid)
        self.pidfd: int | None = None  # for the watchdog: a handle no recycled pid can alias
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)
        self.sock = parent_sock
        self.sock.setblocking(False)
        self.cancel_w = cancel_w
        self.reader = protocol.FrameReader(limit + protocol.FRAME_ENVELOPE)
        self.outbox = bytearray()
        self.events = 0  # the selector events registered for the socket (the supervisor's)
        self.ready = False
        self.attempt: Any = None  # the attempt it runs (or starts next)
        self.queued: collections.deque[Any] = collections.deque()  # sent after it, not started yet
        self.concurrent: dict[str, Any] = {}  # token -> an async attempt running beside others (async_concurrency)
        self.recycle_due = False  # over max_steps_per_child or max_child_rss: retired once idle
        self.steps_run = 0
        self.cpu_total = 0.0  # the child's CPU seconds as of its last report (ready or result)
        self.cpu_at_ready = 0.0  # the CPU seconds it took to start (imports), before any step
        self.preloading: tuple[str, str | None] | None = None  # the handler module it imports before it is ready
        self.preloading_since = 0.0
        self.ready_after: float | None = None
        self.returncode: int | None = None
        self.rusage: Any = None
        self.proc: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):
            self.proc = psutil.Process(self.pid)
        # pid -> the psutil handle taken when it was seen: psutil refuses to signal a
        # handle whose pid was since reused, so a stranger is never hit.
        self.descendants_seen: dict[int, psutil.Process] = {}
        self.killed = False  # the supervisor SIGKILLed it
        self.userns = False  # it said it is the first process of a user namespace of its own (max_processes)
        #: the smallest max_open_files it ran with where it cannot raise RLIMIT_NOFILE's hard
        #: limit back (an ordinary user): it takes only tasks with a max_open_files as small
        self.open_files_ceiling: int | None = None
        self.unread: list[dict[str, Any]] = []  # what it sent before it died, read once it was reaped
        self.peak_rss_kb: int | None = None
        self.slot: Slot | None = None  # its slot (cgroups, sampling), set by the pool
        self.last_rss: int | None = None  # bytes, as the child reported when its last task ended (max_child_rss)

    # -- I/O ------------------------------------------------------------------------------

    def queue(self, message: dict[str, Any]) -> None:
        """Queue a message for the child (written when the socket is writable)."""
        self.outbox += protocol.encode(message)

    def flush(self) -> None:
        """Write as much of the outbox as the socket takes now (never blocks)."""
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox[: 1 << 20])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.outbox.clear()  # the child is gone; its exit is handled on EOF
                return
            del self.outbox[:sent]

    def receive(self, max_reads: int | None = READS_PER_CALL) -> tuple[list[dict[str, Any]], bool]:
        """Read what is available, in at most ``max_reads`` reads of ``READ_CHUNK`` bytes
        (None: all of it): ``(messages, eof)``. A child streaming a large result does not
        hold process control: the selector reports the rest on its next turn. Raises
        ProtocolError on a bad frame."""
        messages: list[dict[str, Any]] = []
        reads = 0
        while max_reads is None or reads < max_reads:
            reads += 1
            try:
                data = self.sock.recv(protocol.READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return messages, False
            except OSError:
                return messages, True
            if not data:
                return messages, True
            messages.extend(self.reader.feed(data))
            if len(data) < protocol.READ_CHUNK:
                return messages, False  # drained for now (saves a recv that would block)
        return messages, False

    def start(self) -> None:
        """Let a child forked from the zygote with :attr:`leftover` modules go on (it is in
        its slot now): it imports them, then says ready."""
        self.queue({"t": "start"})
        self.flush()

    def cancel(self, token: str, reason: str) -> None:
        """Send a cancel line over the cancellation pipe (never blocks the parent)."""
        with contextlib.suppress(OSError):
            os.set_blocking(self.cancel_w, False)
            os.write(self.cancel_w, f"{token} {reason}\n".encode())

    # -- life and death -------------------------------------------------------------------

    def note_descendants(self) -> None:
        """Remember the child's current descendants (so their zombies can be reaped later)."""
        self.descendants_seen.update({p.pid: p for p in procs.descendants(self.pid)})

    def kill(self) -> list[int]:
        """SIGKILL the child's tree, then reap; returns pids hit. Its slot's cgroup is
        killed first where there is one (no fork can race that); then its process group
        and every descendant psutil finds (through pidfds), as without cgroups."""
        self.killed = True
        self.peak_rss_kb = protocol.peak_rss_kb(self.pid)  # wait4's maxrss includes the pre-exec parent
        hit = self.slot.kill() if self.slot is not None else []
        hit += procs.kill_tree(self.pid, self.pid, list(self.descendants_seen.values()), pidfd=self.pidfd)
        self.wait(timeout=5.0)
        procs.reap([p for p in set(hit) if p != self.pid], timeout=2.0)
        return sorted(set(hit))

    def kill_descendants(self) -> list[int]:
        """Kill whatever a finished task left running under the (reused) child."""
        left = procs.descendants(self.pid)
        if not left:
            return []
        hit: list[int] = []
        for proc in left:
            hit.extend(procs.kill_tree(proc.pid, None))
        procs.reap(sorted(set(hit)), timeout=2.0)
        return hit

    def wait(self, timeout: float) -> int | None:
        """Reap the child with ``wait4`` (keeping its rusage); None if still alive at timeout."""
        if self.returncode is not None:
            return self.returncode
        deadline = time.monotonic() + timeout
        while True:
            try:
                pid, status, rusage = os.wait4(self.pid, os.WNOHANG)
            except ChildProcessError:
                if self.popen is not None:
                    self.returncode = self.popen.poll() if self.popen.returncode is None else self.popen.returncode
                if self.returncode is None:
                    self.returncode = -9
                break
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.rusage = rusage
                if self.popen is not None:
                    self.popen.returncode = self.returncode
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.pidfd is not None:  # readable once it has exited: no polling delay
                with contextlib.suppress(OSError, ValueError):
                    select.select([self.pidfd], [], [], min(left, 0.05))
                    continue
            time.sleep(0.002)
        # What it sent before it died (a result that crossed our kill) is still in the
        # socket: the supervisor handles it before deciding what the death means.
        with contextlib.suppress(protocol.ProtocolError):
            self.unread += self.receive(max_reads=None)[0]
        self.close()
        return self.returncode

    def retire(self) -> None:
        """Ask an idle child to exit (recycling or shutdown); the caller reaps it."""
        with contextlib.suppress(Exception):
            self.outbox.clear()
            self.queue({"t": "exit"})
            self.flush()
        self.close()

    def close(self) -> None:
        """Close our ends of the pipes, and the pidfd once reaped (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.pidfd is not None and self.returncode is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        if self.cancel_w >= 0:
            with contextlib.suppress(OSError):
                os.close(self.cancel_w)
            self.cancel_w = -1

    def usage(self, since: float = 0.0) -> dict[str, Any]:
        """Forensics of the dead child (from wait4): CPU seconds used since ``since`` (its
        CPU total when the attempt began) and the child's peak RSS in KiB."""
        if self.rusage is None:
            return {}
        return {
            "cpu_seconds": round(max(0.0, self.rusage.ru_utime + self.rusage.ru_stime - since), 3),
            "peak_rss_kb": self.peak_rss_kb if self.peak_rss_kb is not None else int(self.rusage.ru_maxrss),
        }

    def rss(self) -> int | None:
        """Current RSS in bytes, or None."""
        if self.proc is None:
            return None
        with contextlib.suppress(psutil.Error):
            return int(self.proc.memory_info().rss)
        return None


RESPAWN_BACKOFF = (0.05, 5.0)  # seconds between starts of children that die before they are ready


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
        watchdog: the :class:`~cyclone_mp.procs.WatchdogLink`.
        clock: local monotonic clock in seconds.
        confinement: the slots' cgroups (:class:`~cyclone_mp.slots.Confinement`).
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
        self.ready_seconds: float | None = None  # moving average of a new child's spawn to ready
        self.descended: set[int] = set()  # pids seen as descendants of our children (their zombies are ours to reap)
        # children of this process that are no handler's: those it had before the supervisor
        # started, and (embedded) the program's own, once looked at
        self._foreign: set[int] = protocol.child_pids() or set()
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
            log.error("cannot start a child process: %s", exc)
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
            if self.spawn() is None:
                self.respawn_at = now + self.respawn_delay
                return

    def await_zygote(self, timeout: float, stop: Any = lambda: False) -> bool:
        """Wait up to ``timeout`` seconds (or until ``stop()``) for a starting zygote to be
        ready or given up; True when it is ready."""
        zygote = self.zygote
        deadline = time.monotonic() + timeout
        while zygote is not None and zygote.state == "starting" and time.monotonic() < deadline and not stop():
            if zygote.sock is not None:
                with contextlib.suppress(OSError, ValueError):
                    select.select([zygote.sock], [], [], 0.05)
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
            if child.slot is not None:  # what it left in its cgroup (an escapee that left its session too)
                hit += child.slot.kill()
            hit += procs.kill_tree(child.pid, child.pid, list(child.descendants_seen.values()), pidfd=child.pidfd)
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
        pids = protocol.child_pids()  # cheap: a look at every process (psutil) only when one is unknown
        if pids is not None and not pids - known - self._foreign:
            return 0
        return procs.reap_strays(self.owner, known | self._foreign, self.descended, dedicated=self.dedicated,
                                 held=self.confinement.holds if self.confinement.mechanism.where else None)

    def reap_orphans(self) -> int:
        """Kill handler processes reparented to us (we are a subreaper): those of a child
        that died on its own, or that escaped its tree while the child was killed. Each
        child is a subreaper too, so while it lives its tree's orphans are its own (and
        swept with its attempt's leftovers). Returns how many."""
        pids = protocol.child_pids()
        known = self._known()
        if pids is not None and not pids - known - self._foreign:
            return 0
        n = self._reap_strays(known)
        self.stats["grandchildren_killed"] += n
        left = protocol.child_pids()
        self._foreign = (left or set()) - known  # not ours (the embedding program's): not looked at again
        return n

    def tell_descendants(self) -> None:
        """Without cgroups, tell the watchdog of the busy children's descendants, so it can
        kill them if this supervisor is SIGKILLed (their children die with it, and what
        they adopted is reparented away, out of reach of any other rule)."""
        if self.confinement.mechanism.where:
            return
        for child in self.children:
            if child.attempt is None or not protocol.has_children(child.pid):
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
