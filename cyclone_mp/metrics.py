"""Prometheus metrics of a supervisor: ``Client(metrics_port=...)``,
``cyclone-mp worker --metrics-port``.

The supervisor process serves them (``prometheus_client``'s HTTP server, on a thread of
its own) from a registry of its own, never the global one, and without multiprocess mode:
children never touch them. Every value comes from an event a part of the supervisor
already handles (:mod:`cyclone_mp.telemetry`); a scrape reads memory only. The one
database read is maintenance's queue depth, at most every :data:`QUEUE_DEPTH_INTERVAL`
seconds, whatever the scrape rate. Completions and failures are counted once per row
written, by whoever wrote it, so they equal what the database holds.

The metrics, their types and labels are listed in ``docs/python-apps.md`` (Metrics).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

from .errors import ConfigurationError
from .httpd import BoundedServer
from .telemetry import Observer, Probes

QUEUE_DEPTH_INTERVAL = 5.0  #: seconds between maintenance's reads of the queues' depth
#: histogram buckets (seconds): pickup latency spans milliseconds (LISTEN) to minutes (a backlog)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)


class Metrics(Observer):
    """The supervisor's Prometheus metrics and the HTTP server that serves them
    (:class:`~cyclone_mp.httpd.BoundedServer`: one thread, a few descriptors at most,
    whatever the clients do).

    Args:
        port: TCP port to serve ``/metrics`` on (0: any free port; see :attr:`port`).
        host: address to bind (default ``127.0.0.1``: this machine only; ``0.0.0.0`` for
            every interface, e.g. a Prometheus on another host, then best with a token).
        token: when set, a scrape must send ``Authorization: Bearer <token>``.

    Raises:
        ConfigurationError: ``prometheus_client`` is not installed, or the port is invalid.
    """

    queue_depth_interval = QUEUE_DEPTH_INTERVAL

    def __init__(self, port: int, *, host: str = "127.0.0.1", token: str | None = None) -> None:
        try:
            import prometheus_client as prom  # lazy: an optional extra, said so when missing
        except ImportError:
            raise ConfigurationError(
                "metrics_port needs prometheus_client: pip install 'cyclone-mp[metrics]'") from None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigurationError(f"metrics_port must be a TCP port (0-65535), got {port!r}")
        self._prom = prom
        self.requested_port = port
        self.host = host
        self._token = token
        self.port: int | None = None  # the bound port, once serving
        self._server: Any = None
        self.registry = registry = prom.CollectorRegistry(auto_describe=True)
        self.claims = prom.Counter("cyclone_claims", "Steps claimed by this supervisor.", ["step"],
                                   registry=registry)
        self.completions = prom.Counter("cyclone_completions", "Attempts written as completed.", ["step"],
                                        registry=registry)
        self.failures = prom.Counter("cyclone_failures", "Attempts written as failed, by the error kind stored.",
                                     ["step", "kind"], registry=registry)
        self.kills = prom.Counter("cyclone_kills", "Child processes SIGKILLed, by what triggered the kill.",
                                  ["trigger"], registry=registry)
        self.pickup = prom.Histogram("cyclone_pickup_latency_seconds",
                                     "Seconds from claimable (scheduled_at) to claimed, on the database clock.",
                                     ["step"], buckets=LATENCY_BUCKETS, registry=registry)
        self.duration = prom.Histogram("cyclone_attempt_duration_seconds",
                                       "Seconds an attempt ran in its child, by how it ended.",
                                       ["step", "outcome"], buckets=DURATION_BUCKETS, registry=registry)
        self.lag = prom.Gauge("cyclone_heartbeat_lag_seconds",
                              "Seconds since the last successful renewal of the oldest lease held.",
                              registry=registry)
        self.depth = prom.Gauge("cyclone_queue_depth", "Claimable steps in a queue this supervisor serves.",
                                ["queue"], registry=registry)
        self.oldest = prom.Gauge("cyclone_queue_oldest_available_seconds",
                                 "Seconds the oldest claimable step of a queue has waited.", ["queue"], registry=registry)
        self.children = prom.Gauge("cyclone_children_alive", "Live child processes of this supervisor.",
                                   registry=registry)
        self.paused = prom.Gauge("cyclone_queue_paused", "1 while a queue this supervisor serves is paused.",
                                 ["queue"], registry=registry)
        self.maintenance_failures = prom.Counter(
            "cyclone_maintenance_failures", "Failed attempts of a maintenance task (sweep, schedules, history, "
            "registry, queue_depths, vacuum_watch).", ["task"], registry=registry)
        self.sweep_age = prom.Gauge(
            "cyclone_last_sweep_age_seconds", "Seconds since the last successful recovery sweep of any supervisor "
            "of the database, as this one knows it (NaN: none seen yet).", registry=registry)

    # -- serving ---------------------------------------------------------------------------------

    def start(self, probes: Probes) -> None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` (:class:`~cyclone_mp.httpd.BoundedServer`,
        a thread of its own)."""
        self.children.set_function(lambda: float(probes.children_alive()))
        self.sweep_age.set_function(lambda: _number(probes.last_sweep_age()))
        prom = self._prom

        def scrape() -> tuple[int, str, bytes]:
            return 200, prom.CONTENT_TYPE_LATEST, prom.generate_latest(self.registry)

        def probe(check: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[int, str, bytes]]:
            def answer() -> tuple[int, str, bytes]:
                ok, reason = check()
                return (200 if ok else 503), "text/plain; charset=utf-8", (reason + "\n").encode()
            return answer

        routes = {"/metrics": scrape, "/healthz": probe(probes.live), "/readyz": probe(probes.ready)}
        try:
            self._server = BoundedServer(self.host, self.requested_port, routes, token=self._token)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {self.host}:{self.requested_port}: "
                                     f"{exc.strerror or exc}") from exc
        self.port = self._server.port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    # -- events ----------------------------------------------------------------------------------

    def claimed(self, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            step = row.get("step_name") or ""
            self.claims.labels(step).inc()
            if row.get("pickup") is not None:
                self.pickup.labels(step).observe(max(0.0, float(row["pickup"])))

    def written(self, step_name: str | None, outcome: str) -> None:
        self.written_many((step_name,), outcome)

    def written_many(self, step_names: Sequence[str | None], outcome: str) -> None:
        for step_name, n in collections.Counter(step_names).items():
            if outcome == "completed":
                self.completions.labels(step_name or "").inc(n)
            else:
                self.failures.labels(step_name or "", outcome).inc(n)

    def attempt_ended(self, attempt: Any, outcome: str, entry: dict[str, Any]) -> None:
        elapsed = entry.get("elapsed")
        if elapsed is not None:
            self.duration.labels(attempt.step_name, outcome).observe(max(0.0, float(elapsed)))

    def killed(self, trigger: str) -> None:
        self.kills.labels(trigger).inc()

    def maintenance_failed(self, task: str) -> None:
        self.maintenance_failures.labels(task).inc()

    def queues_paused(self, served: Sequence[str], paused: Sequence[str]) -> None:
        for queue in served:
            self.paused.labels(queue).set(1.0 if queue in paused else 0.0)

    def heartbeat_lag(self, seconds: float) -> None:
        self.lag.set(seconds)

    def queue_depths(self, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            self.depth.labels(row["queue"]).set(row["depth"])
            self.oldest.labels(row["queue"]).set(row["oldest"] or 0.0)


def _number(value: float | None) -> float:
    """A gauge's value: NaN for unknown."""
    return float("nan") if value is None else float(value)
