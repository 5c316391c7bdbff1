"""A handler's progress (``ctx.set_progress``) as the child runner sends it: checked
against the payload boundary, then at most one message every
:data:`PROGRESS_MIN_INTERVAL` seconds for the running task, a held-back value sent by a
timer so the latest always lands; a concurrent task's progress is sent at once.
Child-side: it imports no more than the runner.
"""

from __future__ import annotations

import threading
import time

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from . import protocol, unhealable
from ._process import OWN_THREAD_PREFIX
from .errors import PayloadError
from .protocol import storable

PROGRESS_MIN_INTERVAL = 0.05  # seconds between progress messages; the latest value always lands
PROGRESS_MAX_BYTES = 64 * 1024  # a progress value (done, total) as JSON; it is written with every heartbeat


class Progress:
    """The progress of one runner's tasks, sent on its socket.

    Attributes:
        runner: the child's :class:`~cyclone_mp._child.Runner` (its ``lock``, the running
            ``task`` and ``send``); ``pending`` and ``last`` are read and written under its lock.
        pending: the progress message held back for the running task (None: none).
        last: when (``time.monotonic()``) the running task's progress was last sent.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.last = 0.0
        self.pending: dict[str, Any] | None = None

    def report(self, done: Any, total: Any, message: Any) -> None:
        """Send progress at most every PROGRESS_MIN_INTERVAL seconds; a held-back value
        is sent by a timer once the interval has passed, so the latest always lands.

        Raises:
            PayloadError: ``done``/``total`` are not JSON values within the payload
                boundary (:data:`PROGRESS_MAX_BYTES`): raised in the handler, at its
                ``set_progress`` call; uncaught, the attempt fails as ``output_invalid``.
        """
        try:
            protocol.check_value([done, total], "progress (done, total)", PROGRESS_MAX_BYTES)
        except PayloadError as exc:
            raise unhealable.bad_progress(exc) from None
        runner = self.runner
        msg = {"t": "progress", "task": runner.task, "done": done, "total": total,
               "message": None if message is None else storable(str(message)[:500])}
        with runner.lock:
            wait = self.last + PROGRESS_MIN_INTERVAL - time.monotonic()
            if wait > 0:
                schedule = self.pending is None
                self.pending = msg
                if schedule:
                    timer = threading.Timer(wait, self.flush)
                    timer.name = OWN_THREAD_PREFIX + "progress"
                    timer.daemon = True
                    timer.start()
                return
            self.pending = None
            self.last = time.monotonic()
        self.send(msg)

    def sink_for(self, token: str) -> Any:
        """The ``ctx.set_progress`` sink of a concurrent task: sent at once (checked)."""
        def sink(done: Any, total: Any, message: Any) -> None:
            protocol.check_value([done, total], "progress (done, total)", PROGRESS_MAX_BYTES)
            self.send({"t": "progress", "task": token, "done": done, "total": total,
                       "message": None if message is None else storable(str(message)[:500])})
        return sink

    def flush(self) -> None:
        """Send the held-back message, if its task still runs (the timer's target)."""
        with self.runner.lock:
            msg, self.pending = self.pending, None
            if msg is None or msg["task"] != self.runner.task:
                return
            self.last = time.monotonic()
        self.send(msg)

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.runner.send(msg)
        except (TypeError, ValueError):
            pass  # a non-JSON progress value is dropped, never fatal
