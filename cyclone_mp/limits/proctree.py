"""An attempt's process tree read from ``/proc``: its processes, and what they use.

The supervisor looks at a running attempt's tree at every sample (:func:`survey`): its
processes (checked against the slot's cgroups, which a cgroup's listing alone would miss
once one leaves it), their descriptors where ``max_open_files`` is set, and, where no
cgroup counts them, its CPU seconds, resident memory and tasks. The child counts its own
tree as its handler ends (:func:`tree_size`). Imported by the child runner too.
"""

from __future__ import annotations

import dataclasses
import os

TYPE_CHECKING = False  # annotations only: the child imports this module at its start
if TYPE_CHECKING:
    from typing import Callable

from .procfs import child_pids, open_files, stat


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

    def visit(pid: int) -> list[int] | None:
        kids = child_pids(pid)
        if kids is None:  # gone
            return None
        if stats:
            info = stat(pid)
            if info is None:
                return None
            out.cpu += info[0] + (info[3] if pid == root else 0.0)
            out.tasks += info[1]
            out.rss += info[2]
        if fds:
            count = open_files(pid)
            if count is not None and (out.fds is None or count > out.fds):
                out.fds, out.fds_pid = count, pid
        out.pids.append(pid)
        return kids

    _walk(root, visit)
    return out


def tree_size(root: int | None = None) -> tuple[int, int]:
    """``(processes, tasks)`` of ``root`` (default: this process) and its descendants now,
    zombies included (the kernel counts them until they are reaped). The child counts its
    own tree with it as its handler ends, so a burst the sampling missed is still seen."""
    root = os.getpid() if root is None else root
    counts = [0, 0]  # processes, tasks

    def visit(pid: int) -> list[int] | None:
        try:
            counts[1] += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            return None
        counts[0] += 1
        return child_pids(pid) or []

    _walk(root, visit)
    procs, tasks = counts
    return procs, tasks


def _walk(root: int, visit: Callable[[int], list[int] | None]) -> None:
    """Call ``visit(pid)`` once for ``root`` and each of its descendants; ``visit`` returns
    the pid's children to walk, or None when it is gone (its children are not walked)."""
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        kids = visit(pid)
        if kids:
            todo.extend(kids)
