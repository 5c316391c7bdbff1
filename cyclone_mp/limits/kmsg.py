"""The kernel's own word that it OOM-killed a given process: ``/dev/kmsg``.

Where no cgroup counts a child's memory (no cgroups, or a hybrid host's child outside
the v1 memory cgroup), a child that died of a SIGKILL nobody here sent is named
``oom_killed`` only if the kernel log says it killed *that* pid ("Out of memory: Killed
process 4242 (python3) ..." or "Memory cgroup out of memory: Killed process 4242 ...").
A machine-wide counter (``/proc/vmstat``'s ``oom_kill``) is never evidence: it moves
when any process anywhere is OOM-killed. Reading ``/dev/kmsg`` needs root or
``kernel.dmesg_restrict = 0``; without it there is no such evidence, and the death is
``child_exited`` with signal 9.

The log is opened once, at its end, and read without blocking when a death is judged
(new records only: the few since the last look).
"""

from __future__ import annotations

import collections
import errno
import os
import re

KMSG = "/dev/kmsg"
KEPT = 1024  #: OOM kills remembered (pid -> when), newest last
_KILLED = re.compile(rb"Killed process (\d+) ")


class KernelLog:
    """The OOM kills the kernel logged since this object was made (none when ``path``
    cannot be read: :attr:`readable`). A record's time is the kernel's clock since boot,
    which ``time.monotonic()`` reads too."""

    def __init__(self, path: str = KMSG) -> None:
        self.path = path
        self.killed: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.fd: int | None = None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None

    @property
    def readable(self) -> bool:
        return self.fd is not None

    def read(self) -> None:
        """Take in the records written since the last look (never blocks)."""
        if self.fd is None:
            return
        while True:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten before we read them: go on
                    continue
                return
            if not record:
                return
            for line in record.split(b"\n"):  # one record per read; a file holds several
                if line and not line.startswith(b" "):  # (" KEY=value" lines continue a record)
                    self.take(line)

    def take(self, record: bytes) -> None:
        """One record (``prio,seq,usec,flags;message``): note an OOM kill it reports."""
        head, _, message = record.partition(b";")
        found = _KILLED.search(message)
        if found is None:
            return
        try:
            at = int(head.split(b",")[2]) / 1e6
        except (IndexError, ValueError):
            at = 0.0
        pid = int(found.group(1))
        self.killed.pop(pid, None)
        self.killed[pid] = at
        while len(self.killed) > KEPT:
            self.killed.popitem(last=False)

    def oom_killed(self, pid: int, since: float) -> bool:
        """True when the kernel logged that it OOM-killed ``pid`` at or after ``since``
        (``CLOCK_MONOTONIC`` seconds, with one second of slack: the pid's process was born
        then, so an earlier process with that pid is not taken for it)."""
        self.read()
        at = self.killed.get(pid)
        return at is not None and at >= since - 1.0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
