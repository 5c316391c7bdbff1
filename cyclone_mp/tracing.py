"""OpenTelemetry traces, when the ``opentelemetry-api`` package is importable.

* **Enqueue** opens a ``PRODUCER`` span, ``cyclone_mp enqueue <name>`` (a child of the
  caller's current span, if any), and records its trace context on the run (the
  ``trace`` column, W3C ``traceparent``/``tracestate`` as JSON; migration 0015).
* **Every attempt** becomes a ``CONSUMER`` span, ``cyclone_mp attempt <step>``, emitted by
  the supervisor (the parent process; children never import OpenTelemetry) once the
  attempt has ended, from its start to its end, *linked* to the enqueue's span. Its
  attributes are the attempt's outcome and forensics (``cyclone_mp.*``: run id, node,
  step, attempt, outcome, error kind, pid, exit code or signal, killed by the
  supervisor and after which trigger, CPU seconds, peak RSS, elapsed); a failed attempt
  has status ERROR.

Spans go wherever the process's tracer provider sends them (the application configures
the SDK and its exporters, as for any instrumented library). Without
``opentelemetry-api`` installed nothing here imports it and enqueue records nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from typing import Any, Iterator

from .telemetry import Observer

INSTRUMENTATION = "cyclone_mp"
#: Seconds for which the supervisor takes "no OpenTelemetry SDK is configured" as still
#: true: an SDK configured while a supervisor runs gets its attempts' spans within this.
SDK_RECHECK = 1.0
_available: bool | None = None


def available() -> bool:
    """True when ``opentelemetry-api`` can be imported (checked once, without importing it)."""
    global _available
    if _available is None:
        try:
            _available = importlib.util.find_spec("opentelemetry") is not None and \
                importlib.util.find_spec("opentelemetry.trace") is not None
        except (ImportError, ValueError):
            _available = False
    return _available


_modules: tuple[Any, Any] | None = None


def _api() -> tuple[Any, Any]:
    """``opentelemetry.propagate`` and ``opentelemetry.trace``, imported on first use."""
    global _modules
    if _modules is None:
        from opentelemetry import propagate, trace  # lazy: an optional extra (tracing is off without it)

        _modules = (propagate, trace)
    return _modules


def tracing_enqueue() -> bool:
    """False when :func:`enqueue_span` would record nothing: no OpenTelemetry, or no SDK
    configured (the API's proxy or no-op provider) and no current trace to continue (the
    span would be the invalid one, its carrier empty). Cheap: the single enqueue asks it
    on its hot path and skips the span altogether."""
    if not available():
        return False
    _, trace = _api()
    return not (isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
                and not trace.get_current_span().get_span_context().is_valid)


_NO_SPAN = contextlib.nullcontext(None)


def enqueue_span(name: str) -> contextlib.AbstractContextManager[dict[str, str] | None]:
    """Around an enqueue: a PRODUCER span; yields its context as a carrier dict to store
    on the run(s), or None without OpenTelemetry (or when the span is not sampled, or
    would record nothing: :func:`tracing_enqueue`)."""
    return _span(name) if tracing_enqueue() else _NO_SPAN


@contextlib.contextmanager
def _span(name: str) -> Iterator[dict[str, str] | None]:
    propagate, trace = _api()
    tracer = trace.get_tracer(INSTRUMENTATION)
    with tracer.start_as_current_span(f"cyclone_mp enqueue {name}", kind=trace.SpanKind.PRODUCER,
                                      attributes={"cyclone_mp.name": name}) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield carrier if carrier and span.get_span_context().is_valid else None


def link_to(trace_context: Any) -> list[Any]:
    """The span links to a run's stored trace context (none when it has none)."""
    if not isinstance(trace_context, dict) or not trace_context:
        return []
    propagate, trace = _api()

    ctx = propagate.extract(trace_context)
    span_context = trace.get_current_span(ctx).get_span_context()
    return [trace.Link(span_context)] if span_context.is_valid else []


#: forensics copied from an attempt's error entry to its span
FORENSIC_ATTRIBUTES = ("pid", "exit_code", "signal", "signal_name", "killed_by_supervisor", "trigger", "killed_by",
                       "cpu_seconds", "peak_rss_kb", "elapsed", "cancel_reason", "type", "message")


class Tracer(Observer):
    """The supervisor's side: a span per attempt (see the module docstring)."""

    def __init__(self) -> None:
        _propagate, trace = _api()
        self._trace = trace
        self._tracer = trace.get_tracer(INSTRUMENTATION)
        self._no_sdk_until = 0.0  # time.monotonic() until which "no SDK" is taken as still true

    def attempt_ended(self, attempt: Any, outcome: str, entry: dict[str, Any]) -> None:
        trace = self._trace
        now_mono = time.monotonic()
        if now_mono < self._no_sdk_until:
            return
        if isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            # No SDK configured (yet): a span would record nothing, and cost a tenth of B1's
            # loop. Asking the API (an environment lookup) for every attempt cost 5 % of the
            # supervisor's loop, so the answer holds for SDK_RECHECK seconds.
            self._no_sdk_until = now_mono + SDK_RECHECK
            return
        attributes: dict[str, Any] = {
            "cyclone_mp.run_id": attempt.run_id, "cyclone_mp.node": attempt.node,
            "cyclone_mp.step": attempt.step_name, "cyclone_mp.attempt": attempt.attempt,
            "cyclone_mp.outcome": outcome, "cyclone_mp.step_id": attempt.key[0],
            "cyclone_mp.lease_generation": attempt.key[1],
        }
        for key in FORENSIC_ATTRIBUTES:
            value = entry.get(key)
            if isinstance(value, (str, bool, int, float)):
                attributes[f"cyclone_mp.{key}"] = value[:1000] if isinstance(value, str) else value
        if outcome not in ("completed", "released"):
            attributes["cyclone_mp.error_kind"] = outcome
        now = time.time_ns()
        started = int(attempt.started_wall * 1e9) if attempt.started_wall else now
        span = self._tracer.start_span(f"cyclone_mp attempt {attempt.step_name}", kind=trace.SpanKind.CONSUMER,
                                       links=link_to(attempt.trace), attributes=attributes,
                                       start_time=min(started, now), context=trace.set_span_in_context(
                                           trace.INVALID_SPAN))
        if outcome not in ("completed", "released"):
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(entry.get("message") or outcome)[:500]))
        span.end(end_time=now)
