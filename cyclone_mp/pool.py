"""The supervisor's side of one child process: spawn, pipes, kill, reap.

A :class:`ChildProc` is a fresh interpreter (``cyclone_mp._child`` started through
:func:`cyclone_mp.procs.helper_command`), never a
fork of the grown supervisor. It runs in its own process group, carries the
supervisor's marker in its environment (so reparented grandchildren can be recognised),
and is reused for many steps until it is killed or recycled. It imports the handlers'
modules before it says it is ready.
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


class ChildProc:
    """One child: its Popen, control socket (non-blocking), cancellation pipe, buffers.

    Attributes:
        pid: the child's pid (also its process group id).
        ready: the child said hello and can take a task.
        attempt: the attempt it is running (set by the supervisor), or None.
        steps_run: tasks finished by this child (for ``max_steps_per_child``).
    """

    def __init__(self, supervisor_id: str, limit: int, preload: Sequence[tuple[str, str | None]] = ()) -> None:
        """Start a child. ``limit``: the largest message in bytes; ``preload``: the
        ``(module, script path or None)`` of the handlers, imported before it is ready."""
        parent_sock, child_sock = socket.socketpair()
        cancel_r, cancel_w = os.pipe()
        env = procs.helper_env({procs.MARKER_ENV: supervisor_id,
                                protocol.PRELOAD_ENV: json.dumps([list(m) for m in preload])})
        try:
            self.popen = subprocess.Popen(
                procs.helper_command("_child", str(child_sock.fileno()), str(cancel_r), str(os.getpid()), str(limit)),
                pass_fds=(child_sock.fileno(), cancel_r),
                process_group=0,
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        finally:
            child_sock.close()
            os.close(cancel_r)
        self.pid = self.popen.pid
        self.sock = parent_sock
        self.sock.setblocking(False)
        self.cancel_w = cancel_w
        self.reader = protocol.FrameReader(limit)
        self.outbox = bytearray()
        self.events = 0  # the selector events registered for the socket (the supervisor's)
        self.ready = False
        self.attempt: Any = None  # the attempt it runs (or starts next)
        self.queued: collections.deque[Any] = collections.deque()  # sent after it, not started yet
        self.recycle_due = False  # over max_steps_per_child or max_child_rss: retired once idle
        self.steps_run = 0
        self.cpu_total = 0.0  # the child's CPU seconds as of its last report (ready or result)
        self.cpu_at_ready = 0.0  # the CPU seconds it took to start (imports), before any step
        self.preloading: tuple[str, str | None] | None = None  # the handler module it imports before it is ready
        self.preloading_since = 0.0
        self.spawned = time.monotonic()
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
        self.unread: list[dict[str, Any]] = []  # what it sent before it died, read once it was reaped
        self.peak_rss_kb: int | None = None

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

    def receive(self) -> tuple[list[dict[str, Any]], bool]:
        """Read what is available: ``(messages, eof)``. Raises ProtocolError on a bad frame."""
        messages: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return messages, False
            except OSError:
                return messages, True
            if not data:
                return messages, True
            messages.extend(self.reader.feed(data))
            if len(data) < 1 << 20:
                return messages, False  # drained for now (saves a recv that would block)

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
        """SIGKILL the child's process group and every descendant, then reap; returns pids hit."""
        self.killed = True
        self.peak_rss_kb = protocol.peak_rss_kb(self.pid)  # wait4's maxrss includes the pre-exec parent
        hit = procs.kill_tree(self.pid, self.pid, list(self.descendants_seen.values()))
        self.wait(timeout=5.0)
        procs.reap([p for p in hit if p != self.pid], timeout=2.0)
        return hit

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
                self.returncode = self.popen.poll() if self.popen.returncode is None else self.popen.returncode
                if self.returncode is None:
                    self.returncode = -9
                break
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.rusage = rusage
                self.popen.returncode = self.returncode
                break
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)
        # What it sent before it died (a result that crossed our kill) is still in the
        # socket: the supervisor handles it before deciding what the death means.
        with contextlib.suppress(protocol.ProtocolError):
            self.unread += self.receive()[0]
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
        """Close our ends of the pipes (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.close()
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
