"""The supervisor's side of its watchdog process (:mod:`cyclone_mp._watchdog`): a
:class:`WatchdogLink` tells it which children and cgroups to kill if the supervisor dies,
and when each child is due to be killed if the supervisor freezes, over a socket whose
end the watchdog holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import time

import psutil

from .procs import helper_command, helper_env, kill_tree

_UNSENT = object()
SEEN_KEPT = 4096  # descendants seen that a restarted watchdog is told of (the most recent)
REPLAY_WAIT = 2.0  # seconds restart() waits at most, in all, for a new watchdog to read what it is told


def _child(pid: int, cgroup: str | None) -> bytes:
    return f"child {pid}{' ' + cgroup if cgroup else ''}".encode()


def _cgroup(hierarchy: str, path: str) -> bytes:
    return f"cgroup {hierarchy} {path}".encode()


def _due(pid: int, when: float | None) -> bytes:
    return f"due {pid} {'-' if when is None else repr(when)}".encode()


def _seen(pid: int, started: float) -> bytes:
    return f"seen {pid} {started!r}".encode()


def _runs(pid: int, started: float) -> bool:
    """The process ``pid`` still runs and is the one that started at ``started`` (psutil)."""
    try:
        return psutil.Process(pid).create_time() == started
    except psutil.Error:
        return False


class WatchdogLink:
    """The supervisor's end of its watchdog (:mod:`cyclone_mp._watchdog`), a process that
    kills a child whose due time passed while the supervisor could not (frozen), and
    everything the supervisor started once it is gone.

    Messages are tiny and never block the caller: a watchdog that stopped reading loses
    them (it is then gone, and so is its backstop; a warning is logged once).
    """

    def __init__(self, supervisor_id: str) -> None:
        self.supervisor_id = supervisor_id
        self._due: dict[int, float | None] = {}  # the due times sent, by pid
        self._held: dict[int, float | None] = {}  # later due times not sent yet (see due())
        # what a new watchdog is told if this one exits (restart()): the children (a
        # duplicate of each pidfd, ours until the child is gone), the cgroups, the
        # descendants seen (the most recent SEEN_KEPT)
        self._children: dict[int, tuple[int, str | None]] = {}
        self._cgroups: list[tuple[str, str]] = []
        self._seen: dict[int, float] = {}
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                helper_command("_watchdog", str(theirs.fileno()), self.supervisor_id),
                pass_fds=(theirs.fileno(),), process_group=0, stdin=subprocess.DEVNULL, close_fds=True,
                env=helper_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.sock.setblocking(False)
        self._warned = False
        self.exited = False  # the watchdog closed its end (it died): restart() starts another

    def restart(self) -> None:
        """Start a new watchdog in place of one that exited (:attr:`exited`), reap the old
        one, and tell the new one everything the old one knew: the cgroups, the children,
        their due times, then the descendants seen that still run. The new watchdog reads
        nothing until its interpreter is up, so these sends wait for it (REPLAY_WAIT
        seconds at most in all; what does not fit by then is dropped, the descendants
        first). Raises OSError when no process can be started (the link then stays
        without a watchdog; call again later)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(Exception):
            self.popen.wait(timeout=1.0)  # it closed its end: it is gone or going
        self._start()
        messages: list[tuple[bytes, list[int] | None]] = [(_cgroup(*dirs), None) for dirs in self._cgroups]
        messages += [(_child(pid, cgroup), [pidfd]) for pid, (pidfd, cgroup) in self._children.items()]
        messages += [(_due(pid, when), None) for pid, when in self._due.items()]
        for pid, started in list(self._seen.items()):
            if _runs(pid, started):
                messages.append((_seen(pid, started), None))
            else:
                del self._seen[pid]
        deadline = time.monotonic() + REPLAY_WAIT
        try:
            for data, fds in messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.sock.settimeout(left)
                self._send(data, fds)
        finally:
            self.sock.setblocking(False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def fileno(self) -> int:
        """Readable when the watchdog reported kills (:meth:`reports`)."""
        return self.sock.fileno()

    def _send(self, data: bytes, fds: list[int] | None = None) -> None:
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError as exc:
            if not self._warned:
                self._warned = True

                logging.getLogger("cyclone_mp.supervisor").warning("the watchdog does not listen (%s)", exc)

    def child(self, pid: int, pidfd: int | None, cgroup: str | None = None) -> None:
        """A new child (its pidfd, so the watchdog never hits a recycled pid; ``cgroup``:
        its slot's v2 cgroup, killed whole with ``cgroup.kill``)."""
        if pidfd is not None:
            self._forget_child(pid)
            try:  # our copy, for a watchdog that replaces this one (restart)
                self._children[pid] = (os.dup(pidfd), cgroup)
            except OSError:  # out of descriptors: this watchdog still hears of it
                pass
            self._send(_child(pid, cgroup), [pidfd])

    def _forget_child(self, pid: int) -> None:
        kept = self._children.pop(pid, None)
        if kept is not None:
            with contextlib.suppress(OSError):
                os.close(kept[0])

    def cgroups(self, dirs: list[tuple[str, str]]) -> None:
        """The supervisor's cgroup directories (``(hierarchy, path)``): once the supervisor
        is gone, the watchdog kills everything in them, whatever it did to its environment,
        and removes them."""
        for hierarchy, path in dirs:
            self._cgroups.append((hierarchy, path))
            self._send(_cgroup(hierarchy, path))

    def seen(self, pid: int, started: float) -> None:
        """A handler's descendant (``pid``, its start time per psutil): killed by the watchdog
        once the supervisor is gone, if the same process still runs (no cgroups here)."""
        self._seen.pop(pid, None)
        self._seen[pid] = started
        if len(self._seen) > SEEN_KEPT:
            del self._seen[next(iter(self._seen))]  # the oldest: long gone, most likely
        self._send(_seen(pid, started))

    def due(self, pid: int, when: float | None, *, now: float, horizon: float) -> None:
        """The child must be dead by ``when`` (``time.monotonic()``; None: no bound).

        An earlier time is sent at once. A later one (or None) is held back while the time
        last sent is more than ``horizon`` seconds ahead of ``now``: the watchdog keeps the
        earlier time, which is never later than the child's real due, and :meth:`refresh`
        sends the held one before the earlier time comes near. A watchdog kill too early
        would thus take the supervisor's loop standing still for ``horizon`` seconds.
        Pipelined steps move a child's due thousands of times a second; a message each
        time would cost the supervisor a third of its CPU.
        """
        sent = self._due.get(pid, _UNSENT)
        if when == sent:
            self._held.pop(pid, None)
            return
        earlier = when is not None and (sent is _UNSENT or sent is None or when < sent)
        if not earlier and sent is not _UNSENT and sent is not None and sent - now > horizon:
            self._held[pid] = when
            return
        self._held.pop(pid, None)
        self._send_due(pid, when)

    def refresh(self, now: float, horizon: float) -> None:
        """Send the due times held back whose earlier time sent is ``horizon`` seconds away or less."""
        for pid, when in list(self._held.items()):
            sent = self._due.get(pid)
            if sent is None or sent - now <= horizon:
                del self._held[pid]
                self._send_due(pid, when)

    def _send_due(self, pid: int, when: float | None) -> None:
        self._due[pid] = when
        self._send(_due(pid, when))

    def next_refresh(self, horizon: float) -> float | None:
        """When :meth:`refresh` has something to send (``time.monotonic()``), or None."""
        times = [self._due[pid] - horizon for pid in self._held if self._due.get(pid) is not None]
        return min(times) if times else None

    def gone(self, pid: int) -> None:
        """The child was reaped."""
        self._due.pop(pid, None)
        self._held.pop(pid, None)
        self._forget_child(pid)
        self._send(f"gone {pid}".encode())

    def reports(self) -> list[int]:
        """Pids of the children the watchdog killed since the last call."""
        killed = []
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return killed
            except OSError:
                self.exited = True
                return killed
            if not data:  # end of file: the watchdog is gone
                self.exited = True
                return killed
            words = data.decode().split()
            if len(words) == 2 and words[0] == "killed":
                killed.append(int(words[1]))

    def close(self, timeout: float = 10.0, *, clean: bool = False) -> None:
        """Close the link and reap the watchdog. EOF makes it kill what is left; after
        ``clean`` (the supervisor stopped its children and swept their strays itself) it
        skips the slow look for marked processes across the machine."""
        if clean:
            self._send(b"bye 0")
        for pid in list(self._children):
            self._forget_child(pid)
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.popen.wait(timeout=timeout)
        except Exception:  # noqa: BLE001
            kill_tree(self.popen.pid, None)  # our unreaped child
            self.popen.wait()
