"""The caps' fallbacks where no cgroup holds them: an attempt's process tree read from
``/proc``, and the user namespace that lets ``RLIMIT_NPROC`` count one tree.

The supervisor samples a running attempt's tree (:func:`tree`: its CPU seconds, resident
memory, processes and tasks) where no cgroup counts them. ``RLIMIT_NPROC`` counts the
tasks of a *user* in a *user namespace*, and binds every process but root's: in the
user's own namespace it would count the supervisor, every other slot and every other
program of that user, so a cap set from it would refuse a fork for someone else's
processes or let a tree past its cap when others exit. A child that makes a user
namespace of its own at birth (:func:`own_user_namespace`, while it is single-threaded)
is the only process of its user there, so ``RLIMIT_NPROC`` then counts exactly its tree:
the kernel holds the cap even against a fork bomb. That needs an ordinary user (root is
never bound) and unprivileged user namespaces (:func:`user_namespaces_refused` says why
not). The child counts its own tree when its handler ends (:func:`tree_size`), so a
burst the 50 ms sampling missed is still seen.

Imported by the child runner too (it imports nothing the runner does not).
"""

from __future__ import annotations

import os

from .protocol import PAGE_SIZE, child_pids

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CLONE_NEWUSER = 0x10000000


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode()
    except OSError:
        return None


def stat(pid: int) -> tuple[float, int, int, float] | None:
    """``(CPU seconds, threads, RSS bytes, CPU seconds of waited-for children)`` of a process."""
    text = read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    rest = text[text.rfind(")") + 2:].split()
    try:
        return ((int(rest[11]) + int(rest[12])) / CLK_TCK, int(rest[17]), int(rest[21]) * PAGE_SIZE,
                (int(rest[13]) + int(rest[14])) / CLK_TCK)
    except (IndexError, ValueError):
        return None


def tree(root: int | None) -> tuple[float, int, int, int]:
    """``(CPU seconds, RSS bytes, processes, tasks)`` of ``root`` and its live descendants
    (plus the CPU of the children ``root`` waited for)."""
    if root is None:
        return 0.0, 0, 0, 0
    cpu = 0.0
    rss = procs = tasks = 0
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        info = stat(pid)
        if info is None:
            continue
        cpu += info[0] + (info[3] if pid == root else 0.0)
        tasks += info[1]
        rss += info[2]
        procs += 1
        todo.extend(child_pids(pid) or ())
    return cpu, rss, procs, tasks


def tree_size(root: int | None = None) -> tuple[int, int]:
    """``(processes, tasks)`` of ``root`` (default: this process) and its descendants now,
    zombies included (the kernel counts them until they are reaped)."""
    root = os.getpid() if root is None else root
    procs = tasks = 0
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            tasks += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        procs += 1
        todo.extend(child_pids(pid) or ())
    return procs, tasks


def _unshare() -> object:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).unshare


def own_user_namespace() -> str | None:
    """Make this process the first of a user namespace of its own, its user and group ids
    mapped to themselves (so they read the same inside); None, or why it could not. The
    process must be single-threaded (the kernel's rule): a child calls it at birth. Inside,
    the ids of other users read as the overflow id (65534) and set-user-ID programs gain
    nothing; what a handler may access is unchanged (the kernel checks the real ids)."""
    import ctypes

    uid, gid = os.getuid(), os.getgid()
    if _unshare()(CLONE_NEWUSER) != 0:  # type: ignore[operator]
        return f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}"
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
        except OSError:
            break  # unmapped ids read as 65534; the count, all this is for, holds anyway
    return None


def user_namespaces_refused() -> str | None:
    """Why this process's children cannot each hold ``max_processes`` with RLIMIT_NPROC in a
    user namespace of their own, or None when they can (a short-lived child of this process
    tried: a few milliseconds, once per supervisor)."""
    if os.geteuid() == 0:
        return "root is never bound by RLIMIT_NPROC"
    if (read_text("/proc/sys/user/max_user_namespaces") or "").strip() == "0":
        return "user namespaces are disabled (user.max_user_namespaces = 0)"
    if (read_text("/proc/sys/kernel/unprivileged_userns_clone") or "").strip() == "0":
        return "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0)"
    import warnings

    unshare = _unshare()
    with warnings.catch_warnings():  # (3.12+ warns of fork in a threaded process: the child below is safe)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # only the bound C function and _exit: other threads may hold locks
        os._exit(0 if unshare(CLONE_NEWUSER) == 0 else 1)  # type: ignore[operator]
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # reaped by someone else: the children find out at birth
        return None
    return None if os.waitstatus_to_exitcode(status) == 0 else "the kernel refused an unprivileged user namespace"
