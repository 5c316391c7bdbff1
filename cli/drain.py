"""What a draining ``cyclone-mp worker`` says while it stops.

The first SIGTERM/Ctrl-C drains: claim nothing more, let in-flight steps run on for up to
``shutdown_grace`` seconds, then cancel them, SIGKILL them after ``kill_grace`` and release
them. A :class:`DrainReporter` says at once what the drain waits for (each in-flight step:
name, run id, how long it has run) and for how long at most, that a second Ctrl-C stops
now, then every few seconds what is left.

It reads the supervisor from its own thread, never from the signal handler: the handler
only calls :meth:`DrainReporter.signalled`, which sets an attribute and writes a byte to
a pipe. No lock is taken there, since a signal arriving while the handler runs runs it
again, nested, and a nested ``threading.Event.set`` would deadlock on its own lock.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any, Callable

PREFIX = "cyclone-mp worker:"
REPEAT_EVERY = 5.0  #: seconds between "still waiting" lines


def _in_flight(supervisor: Any) -> list[Any]:
    """The supervisor's in-flight attempts (a copy it makes for other threads)."""
    return supervisor.in_flight() if supervisor is not None else []


def describe(attempts: list[Any], limit: int = 4) -> str:
    """``slow (run 1a2b3c4d), echo (run 5e6f7a8b) and 3 more``: what a drain waits for."""
    names = []
    for att in attempts[:limit]:
        name = str(getattr(att, "step_name", None) or getattr(att, "node", "?"))
        node = getattr(att, "node", None)
        if node and node != name:
            name += f" [{node}]"
        names.append(f"{name} (run {str(getattr(att, 'run_id', '?'))[:8]})")
    more = len(attempts) - limit
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def _steps(n: int) -> str:
    return f"{n} in-flight step{'s' if n != 1 else ''}"


class DrainReporter:
    """Prints (through ``echo``) what a draining worker waits for; see the module docstring.

    Args:
        client: the worker's :class:`cyclone_mp.Client` (its ``supervisor`` appears
            once ``client.run`` has made it).
        echo: prints one line (the CLI passes ``click.echo(..., err=True)``).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, client: Any, echo: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.echo = echo
        self.clock = clock
        self.drain_at: float | None = None
        self.stop_at: float | None = None
        self._done = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="cyclone-mp-drain-reporter", daemon=True)

    def start(self) -> None:
        """Start the reporting thread (it sleeps until a signal arrives)."""
        self._thread.start()

    def signalled(self, event: str) -> None:
        """From the signal handler: ``"drain"`` (first signal) or ``"stop"`` (second).
        Takes no lock (see the module docstring)."""
        now = self.clock()
        if event == "drain" and self.drain_at is None:
            self.drain_at = now
        elif event == "stop" and self.stop_at is None:
            self.stop_at = now
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full (the thread wakes anyway) or closed
            pass

    def close(self) -> None:
        """Stop the reporting thread (the worker has stopped)."""
        self._done = True
        self._wake()
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def _sleep(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if ready:
            os.read(self._wake_r, 4096)

    def _run(self) -> None:
        cfg = self.client.config
        grace, kill = cfg.shutdown_grace, cfg.kill_grace
        said_drain = said_stop = said_grace = False
        next_repeat = 0.0
        while not self._done:
            self._sleep(0.2 if self.drain_at is not None else None)
            if self._done:
                return
            sup = self.client.supervisor
            if sup is None or self.drain_at is None:
                continue
            now = self.clock()
            attempts = _in_flight(sup)
            if self.stop_at is not None and not said_stop:
                said_stop = True
                self.echo(f"{PREFIX} stopping now: {_steps(len(attempts))} cancelled"
                          + (f" ({describe(attempts)}), SIGKILLed after {kill:g}s if still running, and released"
                             if attempts else ""))
                continue
            if said_stop or getattr(sup, "stopped", threading.Event()).is_set():
                continue
            left = grace - (now - self.drain_at)
            if not said_drain:
                said_drain = True
                next_repeat = now + REPEAT_EVERY
                if not attempts:
                    self.echo(f"{PREFIX} draining: nothing in flight, stopping")
                else:
                    self.echo(f"{PREFIX} draining: claiming nothing more; waiting up to {grace:g}s "
                              f"(--shutdown-grace) for {_steps(len(attempts))} to finish: {describe(attempts)}; "
                              f"then they are cancelled, SIGKILLed after {kill:g}s (--kill-grace) and released. "
                              "Press Ctrl-C again (or send SIGTERM) to stop now")
                continue
            if left <= 0 and not said_grace and attempts:
                said_grace = True
                self.echo(f"{PREFIX} shutdown grace of {grace:g}s over: cancelling {_steps(len(attempts))} "
                          f"({describe(attempts)}); SIGKILL after {kill:g}s if still running; they are released")
            elif left > 0 and attempts and now >= next_repeat:
                next_repeat = now + REPEAT_EVERY
                self.echo(f"{PREFIX} still waiting for {_steps(len(attempts))} ({describe(attempts)}), "
                          f"{left:.0f}s of grace left; Ctrl-C again stops now")
