"""The rlimits a child sets for a task with resource limits, which its handler's tree inherits.

Where no cgroup holds a cap (see :mod:`cyclone_mp.limits.mechanism`), the child runner
lowers its own rlimits before such a task (:class:`TaskLimits`): the kernel then refuses
what passes them in the handler and in every process it starts, between the
supervisor's looks. Imported by the child runner: nothing here but the standard library's
``os``, ``resource`` and ``threading``.
"""

from __future__ import annotations

import os
import resource
import threading
TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any


class TaskLimits:
    """The rlimits of tasks with resource limits, which what a handler starts inherits.
    They stay set while consecutive tasks have the same limits (a task's check is then
    one comparison, and one ``getrusage`` for a CPU budget) and are put back before a
    task with other limits or none:

    - ``max_open_files``: ``RLIMIT_NOFILE``, soft and hard, = the descriptors this runner
      held when the limit was set + ``max_open_files`` (a new descriptor takes the lowest
      free number, so the handler can open ``max_open_files`` more; a process it starts,
      holding fewer, a few more). A handler cannot raise a hard limit without
      ``CAP_SYS_RESOURCE``; root can, so the supervisor also counts the tree's
      descriptors. Without that capability this runner cannot raise it back either
      (:attr:`nofile_pinned`, said in the task's result): the supervisor then gives it
      only tasks with a ``max_open_files`` as small, and replaces it before any other;
    - ``cpu_limit`` with ``rlimit_cpu`` (no cgroup counts the tree's CPU):
      ``RLIMIT_CPU`` = this process's CPU seconds so far + the limit + 2, moved on before
      a task whose budget it would not leave whole (a backstop: the supervisor kills the
      tree at the limit; SIGXCPU ends a handler that does not ignore it when the
      supervisor cannot, frozen);
    - ``max_processes`` with ``rlimit_nproc`` (no pids cgroup; this runner is the first
      process of a user namespace of its own, where the kernel counts its user's tasks:
      this tree's): ``RLIMIT_NPROC`` = this runner's threads + the cap, one task over
      the cap (the runner counts as one process), so a tree that reaches it is seen
      over its cap (:meth:`Runner.tree_count`) and a fork past it is refused;
    - ``memory_limit`` with ``rlimit_data`` (no cgroup caps the memory):
      ``RLIMIT_DATA`` = this process's data segment + 1.5 times the limit: a backstop for
      one allocation too fast for the supervisor's sampling of the tree (which decides at
      the limit itself, counting resident memory where the data segment counts
      mappings); past it the allocation fails (``MemoryError``, a ``memory_limit`` death
      to the supervisor). The result then also says the largest descendant's peak.

    The others are soft limits only: they can be raised back (and by the handler, which
    the supervisor's sampling or cgroups cover). A limit the system refuses is left as
    it was.
    """

    def __init__(self) -> None:
        self.applied: dict[str, Any] | None = None
        self.saved: list[tuple[int, tuple[int, int]]] = []
        self.cpu_soft: int | None = None
        self.nproc: int | None = None  # the RLIMIT_NPROC set for the task (tasks of this namespace)
        self.can_raise_hard: bool | None = None  # this process may raise a hard limit back (found once)
        self.nofile_pinned = False  # RLIMIT_NOFILE's hard limit was lowered for good

    def apply(self, limits: dict[str, Any] | None) -> None:
        """Set the rlimits of a task with ``limits`` (None: none), before it runs."""
        if limits == self.applied:
            if limits and self.cpu_soft is not None:
                used = self._cpu_used()
                if self.cpu_soft - used < float(limits["cpu_limit"]) + 1:
                    self._lower(resource.RLIMIT_CPU, int(used + float(limits["cpu_limit"])) + 2, save=False)
            return
        self.restore()
        if not limits:
            return
        if limits.get("max_open_files"):
            try:
                held = len(os.listdir("/proc/self/fd")) - 1  # (without the listing's own descriptor)
            except OSError:
                held = 64
            if self.can_raise_hard is None:
                self.can_raise_hard = self._may_raise_hard()
            self._lower(resource.RLIMIT_NOFILE, held + int(limits["max_open_files"]), hard=True)
            self.nofile_pinned = self.nofile_pinned or not self.can_raise_hard
        if limits.get("cpu_limit") and limits.get("rlimit_cpu"):
            self._lower(resource.RLIMIT_CPU, int(self._cpu_used() + float(limits["cpu_limit"])) + 2)
        if limits.get("max_processes") and limits.get("rlimit_nproc"):
            try:
                threads = len(os.listdir("/proc/self/task"))
            except OSError:
                threads = threading.active_count()
            self._lower(resource.RLIMIT_NPROC, threads + int(limits["max_processes"]))
        if limits.get("memory_limit") and limits.get("rlimit_data"):
            data = 0
            try:
                with open("/proc/self/status", "rb") as fh:
                    for line in fh:
                        if line.startswith(b"VmData:"):
                            data = int(line.split()[1]) * 1024
                            break
            except (OSError, ValueError, IndexError):
                pass
            self._lower(resource.RLIMIT_DATA, data + int(limits["memory_limit"]) * 3 // 2)
        self.applied = limits

    def restore(self) -> None:
        """Put back what :meth:`apply` changed (a hard limit this process cannot raise stays
        where it is, the soft one as close to the old one as it allows)."""
        for which, old in reversed(self.saved):
            try:
                resource.setrlimit(which, old)
            except (OSError, ValueError):
                try:
                    hard = resource.getrlimit(which)[1]
                    resource.setrlimit(which, (old[0] if hard == resource.RLIM_INFINITY else min(old[0], hard), hard))
                except (OSError, ValueError):
                    pass
        self.saved, self.applied, self.cpu_soft, self.nproc = [], None, None, None

    @staticmethod
    def _may_raise_hard() -> bool:
        """Whether this process may raise a hard limit (``CAP_SYS_RESOURCE``): it lowers
        ``RLIMIT_NOFILE``'s by one and raises it back (where it cannot, one descriptor of
        the hard limit is lost)."""
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard < 2:
                return False
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard - 1), hard - 1))
        except (OSError, ValueError):
            return False
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            return True
        except (OSError, ValueError):
            return False

    @staticmethod
    def _cpu_used() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def _lower(self, which: int, soft: int, save: bool = True, hard: bool = False) -> None:
        """Set ``which``'s soft limit to ``soft`` (never above the hard one), and its hard
        limit too when ``hard``."""
        try:
            old = resource.getrlimit(which)
            ceiling = old[1]
            if ceiling != resource.RLIM_INFINITY:
                soft = min(soft, ceiling)
            resource.setrlimit(which, (soft, soft if hard else ceiling))
        except (OSError, ValueError):
            return
        if save:
            self.saved.append((which, old))
        if which == resource.RLIMIT_CPU:
            self.cpu_soft = soft
        elif which == resource.RLIMIT_NPROC:
            self.nproc = soft
