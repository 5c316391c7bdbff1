"""The supervisor's watchdog: a process that is not frozen when the supervisor is.

Started as ``_boot.py _watchdog FD SUPERVISOR_ID`` and told of each child, its due time
and its cgroups over a socket (:class:`cyclone_mp.watchdoglink.WatchdogLink`; the
messages are listed in :func:`main`). When a child's due time passes, the watchdog
SIGKILLs it and its tree (:func:`kill_child`) and, if it was still alive, answers
``killed PID``. Process control sets each due time a little after its own kill: the
watchdog acts only when process control could not, because the supervisor is frozen
(SIGSTOP, a paused VM, a stuck thread).

EOF means the supervisor is gone: the watchdog kills everything in the supervisor's
cgroups (then removes them), every child it was told of with its tree, every descendant
it was told of that still runs, and every process carrying the supervisor's marker in
its environment, then exits. So a handler's escapee that scrubbed its environment and
left its session is still killed: by its cgroup, else if the supervisor saw it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from .mailbox import readable


def kill_child(pid: int, pidfd: int | None, cgroup: str | None = None) -> None:
    """SIGKILL the child ``pid`` (through ``pidfd``) and its tree, if it is still ours:
    alive or unreaped. Its slot's cgroup is killed whole where there is one; then the
    tree as process control kills it (:func:`cyclone_mp.procs.kill_tree`: descendants
    stopped, then killed, each through a pidfd of its own; orphans of its tree are
    reparented to it, a subreaper)."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except (ProcessLookupError, OSError):
        return  # reaped: nothing of it to kill
    if cgroup:
        try:
            with open(os.path.join(cgroup, "cgroup.kill"), "w") as fh:
                fh.write("1")
        except OSError:
            pass
    from .procs import kill_tree  # lazy: the watchdog imports what a kill needs (psutil) when it kills

    kill_tree(pid, None, pidfd=pidfd)


def exited(pidfd: int) -> bool:
    """The child of ``pidfd`` has exited (a zombie not reaped yet, or reaped): a pidfd
    polls readable from then on."""
    try:
        return bool(readable([pidfd], 0.0))
    except OSError:
        return False


def kill_seen(seen: dict[int, float]) -> int:
    """SIGKILL the handler descendants the supervisor told of (``pid -> start time``) that
    still run as the same process (a pid reused since is left alone); returns how many."""
    hit = 0
    try:
        import psutil  # lazy: the watchdog imports what a kill needs when it kills

        from .procs import signal_process  # lazy: as psutil
    except Exception:  # noqa: BLE001
        return 0
    for pid, started in seen.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 0.01 and signal_process(proc, signal.SIGKILL):
                hit += 1
        except Exception:  # noqa: BLE001 - gone
            continue
    return hit


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
    """Serve the supervisor until EOF. ``FD`` is a ``SOCK_SEQPACKET`` socket, one message
    per packet:

    - ``child PID [CGROUP]`` with the child's pidfd attached (``SCM_RIGHTS``): a new child
      (``CGROUP``: its slot's v2 cgroup);
    - ``cgroup v1|v2 PATH``: one of the supervisor's cgroup directories;
    - ``seen PID START``: a handler's descendant (``START``: its start time per psutil),
      told where no cgroup holds the tree;
    - ``due PID T``: the child must be dead by ``T`` (``time.monotonic()`` seconds, the
      same clock in every process of the machine); ``due PID -``: no bound now (an idle
      child);
    - ``gone PID``: the supervisor reaped it (its pidfd is closed);
    - ``bye 0``: the supervisor is stopping cleanly (it reaped its children and swept
      their strays), so the EOF that follows needs no look for marked processes.
    """
    fd, supervisor_id = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prompt_wakeups()
    sock = socket.socket(fileno=fd)
    children: dict[int, int] = {}  # pid -> pidfd
    groups: dict[int, str] = {}  # pid -> its slot's v2 cgroup
    cgroups: list[tuple[str, str]] = []  # the supervisor's cgroup directories
    seen: dict[int, float] = {}  # handler descendants told of: pid -> start time
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
                data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            words = data.decode().split(" ")
            kind = words[0]
            if kind == "cgroup":
                cgroups.append((words[1], " ".join(words[2:])))
                continue
            pid = int(words[1])
            if kind == "seen":
                if len(seen) > 100_000:  # bounded: forget the oldest half
                    for old_pid in list(seen)[:50_000]:
                        del seen[old_pid]
                seen[pid] = float(words[2])
            elif kind == "child" and fds:
                old = children.pop(pid, None)
                if old is not None:
                    os.close(old)
                children[pid] = fds[0]
                if len(words) > 2:
                    groups[pid] = " ".join(words[2:])
            elif kind == "due":
                if words[2] == "-":
                    due.pop(pid, None)
                else:
                    due[pid] = float(words[2])
            elif kind == "bye":  # a clean stop: every child is reaped, every stray swept
                clean = True
            elif kind == "gone":
                due.pop(pid, None)
                groups.pop(pid, None)
                pidfd = children.pop(pid, None)
                if pidfd is not None:
                    os.close(pidfd)
            for extra in fds[1:] if kind == "child" else fds:
                os.close(extra)
        now = time.monotonic()
        for pid, when in list(due.items()):
            if now >= when:
                del due[pid]
                pidfd = children.get(pid)
                # Said only of a child still alive (one that ended on its own, or was killed
                # by a watchdog this one replaced, is not this kill's), and said first: the
                # supervisor reads it before it sees the child's end.
                if pidfd is not None and not exited(pidfd):
                    try:
                        sock.send(f"killed {pid}".encode(), socket.MSG_DONTWAIT)
                    except OSError:
                        pass
                kill_child(pid, pidfd, groups.get(pid))  # an exited child's cgroup still goes
    if not clean and cgroups:
        from .limits.cgroups import kill_dirs  # lazy: as above

        kill_dirs(cgroups)  # first: whole cgroups at once, no fork can race it
    for pid, pidfd in children.items():
        kill_child(pid, pidfd, groups.get(pid))
    if not clean:
        kill_seen(seen)
        from .procs import kill_marked  # lazy: as above

        for _ in range(3):  # a fork may race one pass
            if not kill_marked(supervisor_id, exclude={os.getpid()}):
                break
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
