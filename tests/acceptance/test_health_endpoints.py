"""/healthz and /readyz on the metrics port: live while process control turns, ready once
the children run and while the database answers (Kubernetes' probes)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import handlers as h

pytest.importorskip("prometheus_client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
    except OSError as exc:
        return 0, str(exc)


def wait_for(port: int, path: str, status: int, timeout: float) -> float | None:
    """Seconds until ``path`` answered ``status`` (None: not within ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if probe(port, path)[0] == status:
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def test_readyz_follows_the_database_and_healthz_the_loop(cyclone_server, cyclone_env_factory):
    """/readyz answers 503 within 2 s of the database going away and 200 once it is back;
    /healthz stays 200 meanwhile (the loop turns, whatever the database does)."""
    if not cyclone_server.restartable:
        pytest.skip("needs the embedded test server (restartable)")
    # a supervisor process of its own: one in this process would adopt the restarted
    # postmaster (a supervisor is a child subreaper)
    port = free_port()
    env = cyclone_env_factory(workers=1, metrics_port=port, lease_ttl=3)
    env.mux().register(h.ok)
    cyclone_server.checkpoint()  # the restart's recovery replays only what follows
    env.start_worker()
    assert wait_for(port, "/readyz", 200, timeout=10) is not None
    assert probe(port, "/healthz") == (200, "ok")
    healthz: list[int] = []
    restart = threading.Thread(target=cyclone_server.restart, kwargs={"down_for": 4.0})
    stopped = time.monotonic()
    restart.start()
    try:
        went = wait_for(port, "/readyz", 503, timeout=4)
        assert went is not None and time.monotonic() - stopped <= 2.5, went
        status, reason = probe(port, "/readyz")
        assert status == 503 and "database" in reason
        healthz.append(probe(port, "/healthz")[0])
    finally:
        restart.join()
    assert wait_for(port, "/readyz", 200, timeout=15) is not None
    healthz.append(probe(port, "/healthz")[0])
    assert healthz == [200, 200]
    assert env.run_until_complete(env.enqueue(h.ok, {}), timeout=30).state == "completed"


def test_readyz_says_draining(cyclone_env_factory):
    env = cyclone_env_factory(worker="thread", workers=1, metrics_port=0)
    env.mux().register(h.ok)
    handle = env.start_worker()
    port = handle.client.supervisor.metrics.port
    assert wait_for(port, "/readyz", 200, timeout=10) is not None
    assert probe(port, "/nowhere")[0] == 404
    handle.client.supervisor.request_shutdown()
    status, reason = probe(port, "/readyz")
    assert (status, reason) in ((503, "draining"), (0, reason))  # or already gone
