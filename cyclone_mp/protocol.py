"""Messages between the supervisor and a child: length-prefixed JSON frames.

Nothing crosses the pipe as pickle: a child turns its handler's return value into JSON
and its exceptions into ``{type, message, traceback}`` before sending, so an
unpicklable exception or a non-JSON output can never break the parent (SPEC 2,
scenario SC-10). The cancellation pipe carries one text line per cancel:
``"<task> <reason>\\n"``.
"""

from __future__ import annotations

import json
import os
import struct
TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct(">Q")
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024  # bytes per message; larger outputs become a stored error
PRELOAD_ENV = "CYCLONE_MP_PRELOAD"  # a child's environment: JSON [[module, path or null], ...] to import before "ready"



class ProtocolError(Exception):
    """A frame was malformed or larger than the limit."""


def storable(text: str) -> str:
    """``text`` without what PostgreSQL text and jsonb refuse: NUL and lone surrogates (escaped)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def unstorable(value: Any) -> str | None:
    """Why a JSON value cannot be stored in jsonb (a NUL or a lone surrogate), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return "a NUL character (\\u0000)"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "a lone surrogate (text that is not valid Unicode)"
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
    import os

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
    import os

    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    found: set[int] = set()
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                found.update(int(p) for p in fh.read().split())
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return found


def encode(message: dict[str, Any]) -> bytes:
    """One frame: 8-byte big-endian length, then UTF-8 JSON (raises TypeError/ValueError)."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Incremental decoder: feed bytes, take whole messages. Rejects frames over ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add bytes; return every complete message (raises ProtocolError)."""
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buf)
            if size > self.limit:
                raise ProtocolError(f"message of {size} bytes exceeds the {self.limit}-byte limit")
            if len(self._buf) < HEADER.size + size:
                break
            body = bytes(self._buf[HEADER.size:HEADER.size + size])
            del self._buf[:HEADER.size + size]
            try:
                out.append(json.loads(body))
            except ValueError as exc:
                raise ProtocolError(f"malformed message: {exc}") from exc
        return out

