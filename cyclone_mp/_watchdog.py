"""The supervisor's watchdog: a process that is not frozen with the supervisor (issue 17).

``_boot.py _watchdog FD SUPERVISOR_ID``. ``FD`` is a ``SOCK_SEQPACKET`` socket to the
supervisor (:class:`cyclone_mp.procs.WatchdogLink`). One message per packet:

- ``child PID`` with the child's pidfd attached (``SCM_RIGHTS``): a new child;
- ``due PID T``: the child must be dead by ``T`` (``time.monotonic()`` seconds, the same
  clock in every process of the machine); ``due PID -``: no bound now (an idle child);
- ``gone PID``: the supervisor reaped it (its pidfd is closed);
- ``bye 0``: the supervisor is stopping cleanly (it reaped its children and swept their
  strays), so the EOF that follows needs no look for marked processes.

When a child's due time passes, the watchdog SIGKILLs it (through its pidfd, so a
recycled pid is never hit), its process group and its descendants, and answers
``killed PID``. Process control sets each due time a little after its own kill (the
local fence, or a cancel's ``kill_grace``): the watchdog acts only when process control
could not, because the supervisor is frozen (SIGSTOP, a paused VM, a stuck thread).

EOF means the supervisor is gone (exited or SIGKILLed): the watchdog kills every child
it was told of, their groups and descendants, and every process carrying the
supervisor's marker in its environment, then exits.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time


def kill_child(pid: int, pidfd: int | None) -> None:
    """SIGKILL the child ``pid`` (through ``pidfd``), its group and its descendants, if
    it is still ours: alive or unreaped (then its pid and group id are not reused)."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except (ProcessLookupError, OSError):
        return  # reaped: nothing of it to kill by pid or group
    descendants = []
    try:
        import psutil

        descendants = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        pass
    for target in descendants:  # stop forks first, then kill
        try:
            target.suspend()
        except Exception:  # noqa: BLE001
            pass
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for target in descendants:
        try:
            target.kill()
        except Exception:  # noqa: BLE001
            pass


def prompt_wakeups() -> None:
    """Run under ``SCHED_FIFO`` (the lowest real-time priority) where allowed (root, or
    ``CAP_SYS_NICE``): a kill due at a given moment then lands within a millisecond of it
    even when every core is busy, which the fence's margin (a tenth of ``lease_ttl``)
    could not absorb under heavy load. The watchdog sleeps but for those kills, and the
    kernel's real-time throttling bounds it anyway. Elsewhere a no-op."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, OSError):
        pass


def main(argv: list[str]) -> None:
    fd, supervisor_id = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prompt_wakeups()
    sock = socket.socket(fileno=fd)
    children: dict[int, int] = {}  # pid -> pidfd
    due: dict[int, float] = {}
    clean = False
    while True:
        wait = None if not due else max(0.0, min(due.values()) - time.monotonic())
        try:
            readable, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        if readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 256, 1)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            words = data.decode().split()
            kind, pid = words[0], int(words[1])
            if kind == "child" and fds:
                old = children.pop(pid, None)
                if old is not None:
                    os.close(old)
                children[pid] = fds[0]
            elif kind == "due":
                if words[2] == "-":
                    due.pop(pid, None)
                else:
                    due[pid] = float(words[2])
            elif kind == "bye":  # a clean stop: every child is reaped, every stray swept
                clean = True
            elif kind == "gone":
                due.pop(pid, None)
                pidfd = children.pop(pid, None)
                if pidfd is not None:
                    os.close(pidfd)
            for extra in fds[1:] if kind == "child" else fds:
                os.close(extra)
        now = time.monotonic()
        for pid, when in list(due.items()):
            if now >= when:
                del due[pid]
                try:  # said first: the supervisor reads it before it sees the child's end
                    sock.send(f"killed {pid}".encode(), socket.MSG_DONTWAIT)
                except OSError:
                    pass
                kill_child(pid, children.get(pid))
    for pid, pidfd in children.items():
        kill_child(pid, pidfd)
    if not clean:
        from .procs import kill_marked

        for _ in range(3):  # a fork may race one pass
            if not kill_marked(supervisor_id, exclude={os.getpid()}):
                break
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
