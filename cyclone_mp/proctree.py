"""An attempt's process tree read from ``/proc``, and the user namespace that lets
``RLIMIT_NPROC`` count one tree.

The supervisor looks at a running attempt's tree at every sample (:func:`survey`): its
processes (checked against the slot's cgroups, which a cgroup's listing alone would miss
once one leaves it), their descriptors where ``max_open_files`` is set, and, where no
cgroup counts them, its CPU seconds, resident memory and tasks.

``RLIMIT_NPROC`` counts the tasks of a *user* in a *user namespace*: in the user's own
namespace it would count the supervisor and every other program of that user. A child
that makes a user namespace of its own at birth (:func:`own_user_namespace`) is the only
process of its user there, so ``RLIMIT_NPROC`` counts exactly its tree and the kernel
holds the cap even against a fork bomb. That needs an ordinary user (root is never
bound) and unprivileged user namespaces (:func:`user_namespaces_refused` says why not).
Imported by the child runner too (it imports nothing the runner does not).
"""

from __future__ import annotations

import dataclasses
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


PF_EXITING = 0x4  #: a process's flag (``/proc/PID/stat``) from the moment it starts to exit


def exiting(pid: int) -> bool:
    """True when process ``pid`` is gone, a zombie, or on its way out (it then leaves its
    cgroups: ``/proc/PID/cgroup`` reads as the root of each hierarchy)."""
    text = read_text(f"/proc/{pid}/stat")
    if not text:
        return True
    rest = text[text.rfind(")") + 2:].split()
    try:
        return rest[0] in ("Z", "X", "x") or bool(int(rest[6]) & PF_EXITING)
    except (IndexError, ValueError):
        return True


def open_files(pid: int) -> int | None:
    """How many descriptors process ``pid`` holds now (None: gone, or not readable). The
    size of ``/proc/PID/fd`` is that count (Linux 6.2+: about a microsecond, however many);
    where it reads 0 the directory is listed (about 0.2 us a descriptor)."""
    try:
        size = os.stat(f"/proc/{pid}/fd").st_size
        return size if size > 0 else len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclasses.dataclass
class Survey:
    """One look at a process tree (:func:`survey`).

    Attributes:
        pids: the processes found, ``root`` first (zombies too: the kernel counts them
            until they are reaped).
        cpu, rss, tasks: CPU seconds (plus what ``root`` waited for), resident bytes and
            threads of the live ones, summed (only when asked for: ``stats``).
        fds, fds_pid: the most descriptors one process held, and which (only when asked
            for: ``fds``).
    """

    pids: list[int] = dataclasses.field(default_factory=list)
    cpu: float = 0.0
    rss: int = 0
    tasks: int = 0
    fds: int | None = None
    fds_pid: int | None = None


def survey(root: int | None, *, stats: bool = True, fds: bool = False) -> Survey:
    """``root`` and every descendant it has now, found through each thread's
    ``children``: with the child runner a subreaper, that includes what left its process
    group or session and lost its parent (adopted by the runner). ``stats``: read each
    one's ``/proc/PID/stat`` too (CPU, RSS, threads: about 6 us a process); ``fds``:
    count each one's descriptors (:func:`open_files`)."""
    out = Survey()
    if root is None:
        return out
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        kids = child_pids(pid)
        if kids is None:  # gone
            continue
        if stats:
            info = stat(pid)
            if info is None:
                continue
            out.cpu += info[0] + (info[3] if pid == root else 0.0)
            out.tasks += info[1]
            out.rss += info[2]
        if fds:
            count = open_files(pid)
            if count is not None and (out.fds is None or count > out.fds):
                out.fds, out.fds_pid = count, pid
        out.pids.append(pid)
        todo.extend(kids)
    return out


def tree_size(root: int | None = None) -> tuple[int, int]:
    """``(processes, tasks)`` of ``root`` (default: this process) and its descendants now,
    zombies included (the kernel counts them until they are reaped). The child counts its
    own tree with it as its handler ends, so a burst the sampling missed is still seen."""
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
    import ctypes  # lazy: on the child's start-up path; only a capped child needs ctypes

    return ctypes.CDLL(None, use_errno=True).unshare


def own_user_namespace() -> str | None:
    """Make this process the first of a user namespace of its own, its user and group ids
    mapped to themselves (so they read the same inside); None, or why it could not. The
    process must be single-threaded (the kernel's rule): a child calls it at birth. Inside,
    the ids of other users read as the overflow id (65534) and set-user-ID programs gain
    nothing; what a handler may access is unchanged (the kernel checks the real ids)."""
    import ctypes  # lazy: as above

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
    import warnings  # lazy: as above

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
