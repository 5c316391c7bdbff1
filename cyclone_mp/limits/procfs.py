"""One process as ``/proc`` shows it: its children, CPU, memory, threads and descriptors.

Small readers, each a file or two of ``/proc/PID`` (Linux; None where it does not tell),
used by the supervisor to sample an attempt's tree and find leftover processes, and by
the child to report its own peak memory and whether it left children behind. Imported by
the child runner too: nothing here but ``os``.
"""

from __future__ import annotations

import os

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # bytes (/proc counts pages)
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


def peak_rss_kb(pid: int | str = "self") -> int | None:
    """Peak resident set size (``VmHWM``, KiB) of a process since exec or since the last
    :meth:`PeakRss.reset`; None where /proc does not tell (non-Linux, process gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRss:
    """Per-task peak RSS of this process: :meth:`reset` restarts ``VmHWM`` from the
    current RSS (Linux ``clear_refs`` 5, on a descriptor kept open: under a microsecond),
    :func:`peak_rss_kb` reads it (about 16 us, so a child reads it only when it matters)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/clear_refs", os.O_WRONLY)
        except OSError:
            self._fd = None

    def reset(self) -> None:
        """Restart the peak from the current RSS (a no-op where /proc does not allow it)."""
        if self._fd is not None:
            try:
                os.write(self._fd, b"5")
            except OSError:
                self._fd = None



def has_own_children() -> bool:
    """True when this process still has a live child. Exited ones (zombies a handler
    never waited for) are reaped first, so they do not count as leftovers forever.
    Usually one ``waitpid``; cheaper than :func:`has_children` for the calling process."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass  # reaped a zombie: look again
    except ChildProcessError:
        return False
    return True


def has_children(pid: int | str = "self") -> bool:
    """True when the process has a child now (``/proc/PID/task/*/children``; True if unsure)."""
    pids = child_pids(pid)
    return pids is None or bool(pids)


def child_pids(pid: int | str = "self") -> set[int] | None:
    """The pids of the process's children now, from ``/proc/PID/task/*/children``
    (every thread's); None when they cannot be read."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    found: set[int] = set()
    for tid in tasks:  # (os.open and os.read: half the cost of open(), at every look at a limited attempt)
        try:
            fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        try:
            data = chunk = os.read(fd, 65536)
            while len(chunk) == 65536:  # (a /proc file reads short only at its end)
                chunk = os.read(fd, 65536)
                data += chunk
        except OSError:
            return None
        finally:
            os.close(fd)
        found.update(int(p) for p in data.split())
    return found


def current_rss() -> int | None:
    """This process's resident set now, in bytes (``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None
