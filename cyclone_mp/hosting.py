"""The supervisor a :class:`~cyclone_mp.Client` runs in its own process: made from the
client's mux and options, run in this thread (``client.run``, the process becomes the
supervisor's, signals drain then stop) or in a background thread (``client.start``),
and stopped softly or hard (SPEC 5).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable

from .errors import ConfigurationError, CycloneError
from .procs import refuse_in_child
from .supervisor import Supervisor

log = logging.getLogger("cyclone_mp.client")


class Hosting:
    """The supervisor of ``client`` (None until made) and the thread it runs on, if any.
    ``options`` are the Supervisor's keyword arguments besides the client's (metrics,
    clocks)."""

    def __init__(self, client: Any, **options: Any) -> None:
        self.client = client
        self.options = options
        self.supervisor: Supervisor | None = None
        self.thread: threading.Thread | None = None

    def make(self, dedicated: bool = False) -> Supervisor:
        """A supervisor for the client's mux and options, after ``client.migrate()``."""
        client = self.client
        refuse_in_child()  # before migrate(): a handler's child never touches the cyclone tables
        if not client.mux.step_names:
            raise ConfigurationError("the mux registers no steps: nothing to run")
        client.migrate()
        self.supervisor = Supervisor(client.dsn, client.mux, client.config, listen_dsn=client.listen_dsn,
                                     dedicated=dedicated, **self.options)
        return self.supervisor

    def run(self, on_signal: Callable[[str], None] | None = None) -> None:
        """:meth:`Client.run <cyclone_mp.Client.run>`."""
        # client.run() makes this process the supervisor's: whatever it adopts from now on is a
        # handler's (client.start() leaves an embedding program's children alone)
        sup = self.make(dedicated=True)
        self.client.close()  # the supervisor has its own connections; idle API connections would only wait
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal_(signum: int, frame: Any) -> None:
                # Runs on the main thread, between two of its bytecodes, and again, nested,
                # when a signal comes while it runs: what it calls takes no lock that thread
                # may hold (stop requests set plain flags and wake an inbox, whose lock is
                # reentrant; logging's are too).
                if sup.stop_requested:
                    return
                if sup.draining or sup.shutdown_requested:
                    (log.info if on_signal is not None else log.warning)("second signal: hard stop")
                    sup.request_stop()
                    event = "stop"
                else:
                    log.info("signal %s: draining", signal.Signals(signum).name)
                    sup.request_shutdown()
                    event = "drain"
                if on_signal is not None:
                    on_signal(event)

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal_)
        try:
            sup.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start(self) -> None:
        """:meth:`Client.start <cyclone_mp.Client.start>`."""
        if self.thread is not None and self.thread.is_alive():
            raise CycloneError("this client's supervisor is already running")
        sup = self.make()
        self.thread = threading.Thread(target=sup.run, name="cyclone-mp-supervisor", daemon=True)
        self.thread.start()
        sup.running.wait(30.0)

    def shutdown(self, wait: bool = True) -> None:
        if self.supervisor is not None:
            self.supervisor.request_shutdown()
            if wait:
                self.join()

    def stop(self, wait: bool = True) -> None:
        if self.supervisor is not None:
            self.supervisor.request_stop()
            if wait:
                self.join()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        elif self.supervisor is not None:
            self.supervisor.stopped.wait()
