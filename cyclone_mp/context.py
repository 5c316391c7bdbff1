"""The ``ctx`` a handler receives in its child process (SPEC section 2).

Cancellation is cooperative first: ``ctx.cancelled`` turns true when the supervisor
sends a cancel over the cancellation pipe (reason ``"timeout"``, ``"cancelled"``,
``"lease_lost"`` or ``"shutdown"``); after ``kill_grace`` seconds the supervisor
SIGKILLs the child whatever the handler does. An ``async def`` handler's task is
cancelled at the same moment (its ``await`` raises ``asyncio.CancelledError``), and
``await ctx.cancellation`` waits for the cancel in any other task.
"""

from __future__ import annotations

import threading
import time
TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    import datetime as dt
    from typing import Any, Callable

from .errors import Cancelled, ConfigurationError

#: The namespace of spawned runs' ids: uuid5 of ``"<parent run>/<node>/<key>"``, so a spawn
#: has one id whichever attempt makes it, and the id is known before it commits.
SPAWN_NAMESPACE = "6b3f3c1e-8a53-4c2e-9a61-0c5e2f7d9b10"
MAX_SPAWN_KEY = 200  #: characters of a spawn's key


class Cancellation:
    """The cancellation handle (the Ruby SDK's ``ctx.cancellation``).

    Awaitable in an ``async def`` handler: ``reason = await ctx.cancellation`` returns
    once the attempt is cancelled (at once if it already is). The handler's own task is
    cancelled then too, so await it from another task (a watcher in a ``TaskGroup``, say):
    in the handler's task the cancel arrives as ``asyncio.CancelledError``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tripped = False
        self._event: threading.Event | None = None  # made by the first wait(): most attempts never wait
        self._callbacks: list[Callable[[str], None]] = []
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        """Trip the handle (first reason wins), wake a :meth:`wait` and call what
        :meth:`on_set` registered."""
        with self._lock:
            if self._tripped:
                return
            self.reason = reason
            self._tripped = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, []
        if event is not None:
            event.set()
        for callback in callbacks:
            callback(reason)

    def on_set(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once the handle trips (now, if it has). It runs on the
        thread that trips it (the child's cancel watcher): it must not block."""
        with self._lock:
            if not self._tripped:
                self._callbacks.append(callback)
                return
        callback(self.reason or "cancelled")

    def __await__(self) -> Any:
        import asyncio  # here, not at import: a child of sync handlers starts faster without it

        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def resolve(reason: str) -> None:
            if not future.done():
                future.set_result(reason)

        def wake(reason: str) -> None:
            try:
                loop.call_soon_threadsafe(resolve, reason)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        self.on_set(wake)
        return future.__await__()

    def is_set(self) -> bool:
        """True once cancellation was requested."""
        return self._tripped

    def wait(self, seconds: float | None = None) -> bool:
        """Sleep up to ``seconds``; return True at once when woken by cancellation."""
        with self._lock:
            if self._tripped:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(seconds)


class Context:
    """What a handler knows about its attempt.

    Attributes:
        run_id: the run's id (str, a UUID); use it to make side effects idempotent.
        step_name: the step's registered name; node: the node name in its run.
        attempt: 1 on the first execution, one higher after each consumed attempt;
            a reclaim re-runs with the same number.
        deadline: worker-clock deadline of this attempt (aware UTC datetime) or None.
            The database clock stays authoritative (seed).
        upstream: ``{node: output}`` of the nodes this one depends on (a map node's: the
            list of its items' outputs, see ``wf.map``).
        spawned: for a node added with ``wait_for_spawned=True``: ``{node: {key: run}}``,
            the runs each node it depends on spawned (``ctx.spawn``), each
            ``{"run_id", "state", "output", "error", "error_kind"}`` once it ended; else {}.
        cancellation: the :class:`Cancellation` handle.
    """

    def __init__(
        self,
        *,
        run_id: str,
        step_name: str,
        node: str,
        attempt: int,
        deadline: dt.datetime | None,
        upstream: dict[str, Any] | None = None,
        progress_sink: Callable[[Any, Any, Any], None] | None = None,
        cancellation: Cancellation | None = None,
        spawned: dict[str, Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.step_name = step_name
        self.node = node
        self.attempt = attempt
        self.deadline = deadline
        self.upstream = dict(upstream or {})
        self.spawned = dict(spawned or {})
        self.cancellation = cancellation or Cancellation()
        self._progress_sink = progress_sink
        self.spawns: list[dict[str, Any]] = []  # what ctx.spawn asked for, sent with a successful result

    @property
    def cancelled(self) -> bool:
        """True once the supervisor asked this attempt to stop."""
        return self.cancellation.is_set()

    @property
    def cancel_reason(self) -> str | None:
        """``"timeout"``, ``"cancelled"``, ``"lease_lost"``, ``"shutdown"`` or None."""
        return self.cancellation.reason

    def check_cancellation(self) -> None:
        """Raise :class:`cyclone_mp.Cancelled` if the attempt was cancelled."""
        if self.cancellation.is_set():
            raise Cancelled(self.cancellation.reason)

    def time_left(self) -> float | None:
        """Seconds until the worker-clock deadline (may be negative), or None."""
        if self.deadline is None:
            return None
        import datetime as dt  # here, not at import: a child starts faster without it

        return (self.deadline - dt.datetime.now(dt.timezone.utc)).total_seconds()

    def set_progress(self, done: float, total: float | None = None, message: str | None = None) -> None:
        """Report progress; the parent stores the latest value with its next heartbeat,
        and with the attempt's end (SPEC 2; a timed-out attempt's too).

        ``done``/``total`` are numbers (any unit), ``message`` a short string.
        """
        if self._progress_sink is not None:
            self._progress_sink(done, total, message)

    def spawn(self, step: Any, input: Any = None, *, key: str | None = None) -> str:
        """Enqueue a child run of ``step`` (a ``cy.step``, a workflow or a registered name)
        with ``input``, linked to this run and node; returns its run id.

        The child is written in the transaction of this attempt's completion, and only if
        this attempt's result wins its CAS (SPEC 1): an attempt that fails, times out or
        loses its lease spawns nothing. Its id is derived from this run, node and ``key``
        (default: the spawn's number in this attempt, "0", "1", ...), so a retried
        attempt spawning the same key never makes a second run. The supervisor that runs
        this step enqueues it: ``step`` must be registered in its mux. A node added with
        ``wait_for_spawned=True`` after this one waits until the children have ended.

        Raises:
            ConfigurationError: not a step or name, a key that is not a non-empty string
                of at most 200 characters or was used already in this attempt, an input
                that is not JSON.
        """
        import json  # lazy: this module is on the child's start-up path, kept light
        import uuid  # lazy: as json

        name = step if isinstance(step, str) else getattr(step, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"ctx.spawn takes a cy.step, a cy.Workflow or a registered name, "
                                     f"not {type(step).__name__}")
        key = str(len(self.spawns)) if key is None else key
        if not isinstance(key, str) or not key or len(key) > MAX_SPAWN_KEY:
            raise ConfigurationError(f"ctx.spawn: key must be a non-empty string of at most {MAX_SPAWN_KEY} "
                                     f"characters, got {key!r:.80}")
        if any(s["key"] == key for s in self.spawns):
            raise ConfigurationError(f"ctx.spawn: key {key!r} was used already in this attempt")
        if hasattr(type(input), "__dataclass_fields__") and not isinstance(input, type):
            import dataclasses  # lazy: on the child's start-up path (dataclasses imports inspect)

            input = dataclasses.asdict(input)
        elif hasattr(input, "model_dump") and callable(input.model_dump):
            input = input.model_dump(mode="json")
        try:
            json.dumps(input, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"ctx.spawn: the input of {name!r} is not JSON ({exc})") from None
        run_id = str(uuid.uuid5(uuid.UUID(SPAWN_NAMESPACE), f"{self.run_id}/{self.node}/{key}"))
        self.spawns.append({"step": name, "input": input, "key": key, "run_id": run_id})
        return run_id

    def __repr__(self) -> str:
        return f"Context(run_id={self.run_id!r}, node={self.node!r}, attempt={self.attempt})"


def monotonic() -> float:
    """The clock local timers use (seconds)."""
    return time.monotonic()
