"""An inbox between the supervisor's parts: a thread-safe queue with a wake-up descriptor.

Every part of the supervisor waits in ``select`` (on its children's sockets, its LISTEN
connection, or nothing but time); a message posted to its inbox writes one byte to a pipe
that the waiting part watches, so it wakes at once. Messages are the plain values of
:mod:`cyclone_mp.messages`; posting never blocks.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import threading
from typing import Any, Sequence

_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(objs: Sequence[Any], timeout: float | None) -> list[Any]:
    """Those of ``objs`` (descriptors, or objects with ``fileno()``) readable within
    ``timeout`` seconds (None: no limit), end of file and errors included, as ``select``
    reports them. Uses ``poll``, which takes descriptors past 1,023 where ``select`` raises
    ValueError: a supervisor inside an application with many open files. Raises OSError
    (EBADF) when one of them is closed."""
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for obj in objs:
        fd = obj if isinstance(obj, int) else obj.fileno()
        if fd < 0:
            raise OSError(errno.EBADF, "a closed descriptor")
        by_fd[fd] = obj
        poller.register(fd, select.POLLIN | select.POLLPRI)
    events = poller.poll(None if timeout is None else max(0.0, timeout) * 1000.0)
    if any(event & select.POLLNVAL for _, event in events):
        raise OSError(errno.EBADF, "a closed descriptor")
    return [by_fd[fd] for fd, event in events if event & _READY]


class Inbox:
    """A queue of messages for one part, readable by ``select`` (:meth:`fileno`)."""

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        # Reentrant: a wake from a signal handler (the supervisor's SIGTERM) runs on the
        # main thread, which may hold the lock at that moment (process control's take).
        self._lock = threading.RLock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._signalled = False
        self.closed = False

    def fileno(self) -> int:
        """The read end of the wake-up pipe (readable while messages wait)."""
        return self._r

    def post(self, message: Any) -> None:
        """Add ``message`` and wake the reader (never blocks; a closed inbox drops it). A
        message whose class says ``wakes = False`` waits for the reader's next turn."""
        with self._lock:
            if self.closed:
                return
            self._items.append(message)
            if self._signalled or not getattr(message, "wakes", True):
                return
            self._signalled = True
        self.wake()

    def wake(self) -> None:
        """Wake the reader without a message (a shutdown request, say). Under the lock:
        once :meth:`close` released the pipe, its number may be another file's. Safe in a
        signal handler, which may interrupt a thread holding the lock (it is reentrant)."""
        with self._lock:
            if self.closed:
                return
            try:
                os.write(self._w, b"x")
            except (BlockingIOError, OSError):
                pass

    def take(self) -> list[Any]:
        """Every message posted so far, oldest first (empties the inbox)."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            self._signalled = False
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def wait(self, timeout: float | None, *others: Any) -> list[Any]:
        """Block up to ``timeout`` seconds (None: forever) until a message arrives or one of
        ``others`` (objects with ``fileno()``, or descriptors) is readable; returns those
        of ``others`` that are readable."""
        if self._items:
            timeout = 0.0
        try:
            ready = readable([self._r, *others], timeout)
        except (OSError, ValueError):  # a descriptor of ``others`` was closed meanwhile
            return []
        return [r for r in ready if r is not self._r and r != self._r]

    def close(self) -> None:
        """Drop what is queued and release the pipe (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._items.clear()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
