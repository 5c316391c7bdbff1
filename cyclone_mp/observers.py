"""The observers a supervisor reports to: Prometheus metrics, OpenTelemetry traces and the
``on_step_discarded`` hooks, put together by :func:`supervisor_observer`.

The observer interface itself (:class:`~cyclone_mp.telemetry.Observer`) lives in
:mod:`cyclone_mp.telemetry`, which knows none of them; see ``docs/operating.md``.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Sequence

from . import tracing
from .metrics import Metrics
from .telemetry import NO_OBSERVER, Observer, Observers

log = logging.getLogger("cyclone_mp.supervisor")


class DiscardHooks(Observer):
    """Calls ``mux.on_step_discarded`` hooks, on a thread of their own: a slow or failing
    hook never holds up the part that wrote the discard (at most :attr:`QUEUE` events wait;
    past that they are dropped, and said so)."""

    QUEUE = 10_000

    def __init__(self, hooks: Sequence[Callable[[dict[str, Any]], Any]]) -> None:
        self.hooks = list(hooks)
        self._events: "queue.Queue[dict[str, Any] | None]" = queue.Queue(self.QUEUE)
        self._thread = threading.Thread(target=self._run, name="cyclone-hooks", daemon=True)
        self._thread.start()

    def discarded(self, event: dict[str, Any]) -> None:
        try:
            self._events.put_nowait(dict(event))
        except queue.Full:
            log.warning("on_step_discarded: %d events wait already; dropped the one of run %s",
                        self.QUEUE, event.get("run_id"))

    def _run(self) -> None:
        while (event := self._events.get()) is not None:
            for hook in self.hooks:
                try:
                    hook(event)
                except Exception:  # noqa: BLE001 - a hook's failure is logged, never the supervisor's
                    log.exception("on_step_discarded hook %s failed", getattr(hook, "__qualname__", hook))

    def close(self) -> None:
        self._events.put(None)
        self._thread.join(2.0)


def supervisor_observer(metrics_port: int | None, metrics_host: str = "127.0.0.1",
                        metrics_token: str | None = None,
                        discard_hooks: Sequence[Callable[[dict[str, Any]], Any]] = ()) -> Observer:
    """The observer of a supervisor: Prometheus metrics when ``metrics_port`` is given
    (on ``metrics_host``, with ``metrics_token`` if set), traces when
    ``opentelemetry-api`` is importable, else :data:`NO_OBSERVER`.

    Raises:
        ConfigurationError: ``metrics_port`` is given but ``prometheus_client`` is not
            installed.
    """
    observers: list[Observer] = []
    if discard_hooks:
        observers.append(DiscardHooks(discard_hooks))
    if metrics_port is not None:
        observers.append(Metrics(metrics_port, host=metrics_host, token=metrics_token))
    if tracing.available():
        observers.append(tracing.Tracer())
    return Observers(observers) if observers else NO_OBSERVER
