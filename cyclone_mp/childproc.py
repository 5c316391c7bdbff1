"""One handler child as the supervisor sees it: :class:`ChildProc` starts it (a fresh
interpreter, or a fork of the zygote), frames messages to and from it over its socket,
sends cancels over its cancellation pipe, kills it and its descendants by pidfd, and
reaps it. :class:`~cyclone_mp.pool.ChildPool` keeps the set of them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import subprocess
import time
from typing import Any, Sequence

import psutil

from . import procs, protocol
from .limits.procfs import peak_rss_kb
from .limits.slot import Slot
from .limits.userns import USERNS_ENV
from .mailbox import readable
from .zygote import Zygote

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
        :meth:`~cyclone_mp.limits.slot.Slot.entry`), then says ``entered`` (:attr:`entering`
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
                                        USERNS_ENV: "1" if userns else ""})
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
        self.outbox += protocol.encode_own(message)

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
        """SIGKILL the child's tree (:meth:`kill_tree`), then reap; returns pids hit."""
        self.killed = True
        self.peak_rss_kb = peak_rss_kb(self.pid)  # wait4's maxrss includes the pre-exec parent
        hit = self.kill_tree()
        self.wait(timeout=5.0)
        procs.reap([p for p in set(hit) if p != self.pid], timeout=2.0)
        return sorted(set(hit))

    def kill_tree(self) -> list[int]:
        """SIGKILL the child's tree, its slot's cgroup first where there is one (no fork can
        race that), then its process group and every descendant psutil finds or the
        supervisor saw (:func:`cyclone_mp.procs.kill_tree`); returns the pids hit. Reaps
        nothing: the child must still be unreaped (its pid and group are ours)."""
        hit = self.slot.kill() if self.slot is not None else []
        return hit + procs.kill_tree(self.pid, self.pid, list(self.descendants_seen.values()), pidfd=self.pidfd)

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
                    readable([self.pidfd], min(left, 0.05))
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
