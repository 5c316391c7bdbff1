"""Prometheus metrics of the supervisor (issue 24, acceptance 4): scraped while it works,
its counters equal the database at the end, and a scrape reads memory only (the queue
depth is read by maintenance at most every QUEUE_DEPTH_INTERVAL seconds)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from cyclone_mp import metrics as metrics_module
from cyclone_mp.store import connect

import handlers as h

prometheus_parser = pytest.importorskip("prometheus_client.parser")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def by(samples, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    out = {}
    for (sample, labelset), value in samples.items():
        if sample == name:
            d = dict(labelset)
            out[tuple(d.get(label, "") for label in labels)] = value
    return {k: v for k, v in out.items() if v}


def db_truth(dsn: str) -> dict[str, dict]:
    with connect(dsn) as conn:
        completed = {(r["step_name"],): float(r["n"]) for r in conn.execute(
            "SELECT step_name, count(*) AS n FROM cyclone_steps WHERE state = 'completed' GROUP BY 1")}
        failures = {(r["step_name"], r["kind"]): float(r["n"]) for r in conn.execute(
            "SELECT s.step_name, e ->> 'kind' AS kind, count(*) AS n FROM cyclone_steps s, jsonb_array_elements(s.errors) e"
            " WHERE e ->> 'kind' <> 'cancelled' GROUP BY 1, 2")}
        claims = {(r["step_name"],): float(r["n"]) for r in conn.execute(
            "SELECT step_name, sum(lease_generation) AS n FROM cyclone_steps GROUP BY 1 HAVING sum(lease_generation) > 0")}
        kills = {(r["trigger"],): float(r["n"]) for r in conn.execute(
            "SELECT e ->> 'trigger' AS trigger, count(*) AS n FROM cyclone_steps s, jsonb_array_elements(s.errors) e"
            " WHERE (e ->> 'killed_by_supervisor')::boolean GROUP BY 1")}
    return {"completed": completed, "failures": failures, "claims": claims, "kills": kills}


def test_metrics_match_the_database_and_a_scrape_reads_no_table(cyclone_env_factory, monkeypatch):
    monkeypatch.setattr(metrics_module, "QUEUE_DEPTH_INTERVAL", 0.5)
    monkeypatch.setattr(metrics_module.Metrics, "queue_depth_interval", 0.5)
    # lease_ttl 2: the kills counted are the test's own (a 0.2 s lease lost under CI load added one)
    env = cyclone_env_factory(worker="thread", workers=2, metrics_port=0, kill_grace=0.3, lease_ttl=2)
    env.mux().register(h.ok, h.raises, h.permanent, h.deque_wedge)
    client = env.client()
    ids = client.enqueue_many(h.ok, [{"i": i} for i in range(400)])
    ids += [client.enqueue(h.raises, {}) for _ in range(2)]
    ids += [client.enqueue(h.permanent, {}), client.enqueue(h.deque_wedge, {})]
    backlog = client.enqueue_many(h.ok, [{}] * 5, queue="default", delay=3600)  # claimable later: not in the depth
    handle = env.start_worker()
    sup = handle.client.supervisor
    port = sup.metrics.port
    scrapes = [scrape(port)]  # during the run
    while not all(client.status(run_id).terminal for run_id in ids[-4:]) or \
            sup.stats["completed"] < 400:
        scrapes.append(scrape(port))
        time.sleep(0.05)
    for run_id in ids:
        client.wait(run_id, timeout=30)
    time.sleep(0.3)  # the kill's forensics, and the last writes' events
    truth = db_truth(env.dsn)
    end = scrape(port)
    assert by(end, "cyclone_completions_total", "step") == truth["completed"]
    assert by(end, "cyclone_failures_total", "step", "kind") == truth["failures"]
    assert truth["failures"][("raises", "error")] == 6 and truth["failures"][("permanent", "permanent")] == 1
    assert truth["failures"][("deque_wedge", "timeout")] == 1
    assert by(end, "cyclone_claims_total", "step") == truth["claims"]
    assert by(end, "cyclone_kills_total", "trigger") == truth["kills"] == {("timeout",): 1.0}
    assert by(end, "cyclone_pickup_latency_seconds_count", "step") == truth["claims"]
    durations = by(end, "cyclone_attempt_duration_seconds_count", "step", "outcome")
    assert durations[("ok", "completed")] == 400 and durations[("raises", "error")] == 6
    assert end[("cyclone_children_alive", ())] == 2
    assert end[("cyclone_queue_depth", (("queue", "default"),))] == 0
    assert ("cyclone_heartbeat_lag_seconds", ()) in end
    # counters only grow between scrapes
    done = [by(s, "cyclone_completions_total", "step").get(("ok",), 0) for s in scrapes + [end]]
    assert done == sorted(done) and len(scrapes) >= 2
    # a scrape reads memory: 200 scrapes in a burst add no read of the queues beyond the interval's
    reads = sup.stats["queue_depth_reads"]
    started = time.monotonic()
    for _ in range(200):
        scrape(port)
    took = time.monotonic() - started
    assert sup.stats["queue_depth_reads"] - reads <= took / 0.5 + 1
    assert len(backlog) == 5


def test_metrics_port_needs_a_port_and_the_cli_takes_it(cyclone_dsn):
    import cyclone_mp as cy

    with pytest.raises(cy.ConfigurationError, match="metrics_port"):
        cy.Client(cyclone_dsn, metrics_port=70000)
    from click.testing import CliRunner
    from cyclone_mp_cli.main import cli

    out = CliRunner().invoke(cli, ["worker", "--help"])
    assert "--metrics-port" in out.output
