"""OpenTelemetry traces (issue 24, acceptance 5): with the SDK's in-memory exporter, one
enqueue and its execution produce a PRODUCER span and a CONSUMER span per attempt,
linked, with the attempt's outcome and forensics; without OpenTelemetry nothing of it is
imported and nothing is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from cyclone_mp.store import connect

import handlers as h

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    yield EXPORTER
    EXPORTER.clear()


def attempts_of(exporter, run_id):
    return sorted((s for s in exporter.get_finished_spans() if s.attributes.get("cyclone_mp.run_id") == run_id),
                  key=lambda s: s.attributes["cyclone_mp.attempt"])


def test_an_enqueue_and_its_attempts_are_linked_spans(cyclone_env_factory, spans):
    env = cyclone_env_factory(worker="thread", kill_grace=0.3)  # the supervisor exports to this process's SDK
    env.mux().register(h.ok, h.raises, h.deque_wedge)
    client = env.client()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        ok = client.enqueue(h.ok, {"x": 1})
    failing = client.enqueue(h.raises, {})
    wedged = client.enqueue(h.deque_wedge, {})
    env.start_worker()
    for run_id in (ok, failing, wedged):
        client.wait(run_id, timeout=30)

    producers = [s for s in spans.get_finished_spans() if s.name == "cyclone_mp enqueue ok"]
    assert len(producers) == 1
    producer = producers[0]
    assert producer.kind == trace.SpanKind.PRODUCER
    assert producer.parent.span_id == request.get_span_context().span_id  # in the caller's trace
    with connect(env.dsn) as conn:
        stored = conn.execute("SELECT trace FROM cyclone_runs WHERE id = %s", (ok,)).fetchone()["trace"]
    assert stored["traceparent"].split("-")[2] == format(producer.context.span_id, "016x")

    def wait_spans(run_id, n):
        from waiting import wait_for
        return wait_for(lambda: len(found := attempts_of(spans, run_id)) >= n and found, 10, f"{n} span(s) of {run_id}")

    (done,) = wait_spans(ok, 1)
    assert done.name == "cyclone_mp attempt ok" and done.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in done.links] == [producer.context.span_id]
    assert done.context.trace_id != producer.context.trace_id  # a span of its own trace, linked
    attrs = done.attributes
    assert (attrs["cyclone_mp.outcome"], attrs["cyclone_mp.step"], attrs["cyclone_mp.node"]) == ("completed", "ok", "ok")
    assert attrs["cyclone_mp.attempt"] == 1 and attrs["cyclone_mp.pid"] > 0 and "cyclone_mp.elapsed" in attrs
    assert "cyclone_mp.cpu_seconds" in attrs and done.status.status_code != trace.StatusCode.ERROR
    assert done.start_time <= done.end_time

    failed = wait_spans(failing, 3)
    assert [s.attributes["cyclone_mp.attempt"] for s in failed] == [1, 2, 3]
    assert all(s.attributes["cyclone_mp.outcome"] == "error" and s.status.status_code == trace.StatusCode.ERROR
               for s in failed)
    assert failed[0].attributes["cyclone_mp.type"] == "builtins.ValueError"
    assert len({s.links[0].context.span_id for s in failed}) == 1  # every attempt links to its enqueue

    (killed,) = wait_spans(wedged, 1)
    k = killed.attributes
    assert (k["cyclone_mp.outcome"], k["cyclone_mp.killed_by_supervisor"], k["cyclone_mp.trigger"],
            k["cyclone_mp.signal_name"]) == ("timeout", True, "timeout", "SIGKILL")


def test_without_opentelemetry_nothing_is_imported_or_recorded(cyclone_dsn, tmp_path):
    script = tmp_path / "no_otel.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.modules["opentelemetry"] = None  # as if the package were not installed
        sys.path[:0] = {json.dumps([p for p in sys.path if p])}
        import cyclone_mp as cy
        import handlers as h
        mux = cy.Mux().register(h.ok)
        client = cy.Client({cyclone_dsn!r}, mux, workers=1, poll_interval=(0.02, 0.1))
        client.start()
        run_id = client.enqueue(h.ok, {{}})
        state = client.wait(run_id, timeout=30).state
        client.stop()
        loaded = [m for m, mod in sys.modules.items() if m.startswith("opentelemetry") and mod is not None]
        print(json.dumps({{"run_id": run_id, "state": state, "loaded": loaded}}))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["state"], out["loaded"]) == ("completed", [])
    with connect(cyclone_dsn) as conn:
        assert conn.execute("SELECT trace FROM cyclone_runs WHERE id = %s", (out["run_id"],)).fetchone()["trace"] is None
