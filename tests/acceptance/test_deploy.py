"""The production files of ``examples/deploy/``: the systemd unit, the Kubernetes
manifests, the Prometheus alerting rules and the Grafana dashboard.

Each parses; every metric they name is one a supervisor serves (read from
``cyclone_mp.metrics.Metrics``' own registry); the grace periods cover a drain
(``shutdown_grace + kill_grace`` read from the worker's own options there); the probes
point at ``/healthz`` and ``/readyz`` on the metrics port, and the probe script of the
Kubernetes manifest answers a real supervisor's metrics port with its token.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "examples" / "deploy"
METRIC = re.compile(r"\bcyclone_[a-z_]+\b")
SETTLE_MARGIN = 5  # seconds past shutdown_grace + kill_grace a platform should wait, at least


def served_metrics() -> set[str]:
    """Every sample name a supervisor's metrics endpoint can serve."""
    from cyclone_mp.metrics import Metrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
    names = set()
    for family in Metrics(0).registry.collect():
        names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


def _option(args: list[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args``."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not given in {args}")


def _drain_seconds(args: list[str]) -> float:
    return float(_option(args, "--shutdown-grace")) + float(_option(args, "--kill-grace"))


# -- systemd ---------------------------------------------------------------------------------------


def systemd_unit(path: pathlib.Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values]}}`` of a unit file (keys may repeat; lines ending in a
    backslash continue)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None and _, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_systemd_unit_drains_on_sigterm_within_its_stop_timeout() -> None:
    unit = systemd_unit(DEPLOY / "cyclone-mp-worker.service")
    service = unit["Service"]
    args = service["ExecStart"][0].split()
    assert args[0].endswith("cyclone-mp") and args[1] == "worker"
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["KillMode"] == ["mixed"]  # the SIGTERM reaches the supervisor only, not its handlers
    assert float(service["TimeoutStopSec"][0]) >= _drain_seconds(args) + SETTLE_MARGIN
    assert service["Delegate"] == ["yes"]  # cgroups for the resource limits
    assert service["Restart"][0] in ("on-failure", "always")
    assert service["EnvironmentFile"]  # the DSN and the metrics token, out of the command line
    assert "--dsn" not in args and "--metrics-token" not in args
    assert int(_option(args, "--metrics-port")) > 0
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in unit["Unit"]["After"][0]


# -- Kubernetes ------------------------------------------------------------------------------------


def _manifests(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def _worker() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = next(d for d in _manifests("kubernetes.yaml") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == "worker")


def test_the_deployment_waits_for_the_drain_and_probes_the_metrics_port() -> None:
    pod, worker = _worker()
    args = worker["args"]
    assert worker["command"] == ["cyclone-mp"] and args[0] == "worker"
    assert pod["terminationGracePeriodSeconds"] >= _drain_seconds(args) + SETTLE_MARGIN
    port = int(_option(args, "--metrics-port"))
    assert _option(args, "--metrics-host") == "0.0.0.0"
    assert [p["containerPort"] for p in worker["ports"] if p["name"] == "metrics"] == [port]
    env = {e["name"]: e for e in worker["env"]}
    assert env["CYCLONE_DSN"]["valueFrom"]["secretKeyRef"]["key"] == "dsn"
    assert env["CYCLONE_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "metrics-token"
    paths = {}
    for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
        command = worker[kind]["exec"]["command"]
        assert command[:2] == ["python3", "-c"] and f"127.0.0.1:{port}" in command[2]
        paths[kind] = command[3]
    assert paths == {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}


def test_the_podmonitor_scrapes_the_workers_with_the_token() -> None:
    (monitor,) = _manifests("kubernetes-podmonitor.yaml")
    pod, worker = _worker()
    deployment = next(d for d in _manifests("kubernetes.yaml") if d["kind"] == "Deployment")
    assert monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [p["name"] for p in worker["ports"]] and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"]["key"] == "metrics-token"


def test_the_probe_script_answers_a_real_supervisor(cyclone_env_factory) -> None:
    """The manifest's probe, run as Kubernetes runs it, against a supervisor serving its
    metrics with a token: 0 for /healthz and /readyz, not 0 without the token."""
    pytest.importorskip("prometheus_client")
    import handlers as h

    env = cyclone_env_factory(worker="thread", metrics_port=0, metrics_token="s3cret-token")
    from waiting import wait_for

    env.mux().register(h.ok)
    client = env.start_worker().client
    port = wait_for(lambda: client.supervisor.metrics.port, 20, "the metrics port")
    _, worker = _worker()
    script = worker["readinessProbe"]["exec"]["command"][2].replace(":9464", f":{port}")

    def probe(path: str, token: str | None) -> int:
        environ = {k: v for k, v in os.environ.items() if k != "CYCLONE_METRICS_TOKEN"}
        if token is not None:
            environ["CYCLONE_METRICS_TOKEN"] = token
        return subprocess.run([sys.executable, "-c", script, path], env=environ, capture_output=True,
                              timeout=30).returncode

    wait_for(lambda: probe("/readyz", "s3cret-token") == 0, 20, "/readyz to answer 200")
    assert probe("/healthz", "s3cret-token") == 0
    assert probe("/healthz", "wrong") != 0


# -- Prometheus and Grafana ------------------------------------------------------------------------


def test_the_alert_rules_parse_and_name_served_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yaml").read_text())
    served = served_metrics()
    alerts = {}
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert re.fullmatch(r"\d+[smh]", rule["for"])
            named = set(METRIC.findall(rule["expr"]))
            assert named and named <= served, (rule["alert"], named - served)
            alerts[rule["alert"]] = " ".join(rule["expr"].split())
    assert "cyclone_last_sweep_age_seconds) > 60" in alerts["CycloneSweepStuck"]
    assert "rate(cyclone_maintenance_failures_total[5m])) > 0" in alerts["CycloneMaintenanceFailing"]
    assert "cyclone_kills_total" in alerts["CycloneKillRateHigh"]
    assert "cyclone_queue_oldest_available_seconds" in alerts["CycloneQueueBacklogOld"]


def test_the_grafana_dashboard_loads_and_names_served_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    served = served_metrics()
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    named: set[str] = set()
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            found = set(METRIC.findall(target["expr"]))
            assert found, (panel["title"], target["expr"])
            named |= found
    assert len(ids) == len(set(ids))
    assert named <= served, named - served
    from cyclone_mp.metrics import Metrics

    families = {family.name for family in Metrics(0).registry.collect()}
    unshown = {f for f in families if not any(name.startswith(f) for name in named)}
    assert not unshown, f"metrics without a panel: {unshown}"
    template = METRIC.findall(json.dumps(dashboard["templating"]))
    assert set(template) <= served
