"""The metrics port is no way into the supervisor: bound to the loopback by default, a
token when asked, and 2,000 idle connections cost it a few descriptors while its steps
finish, its caps hold and a real scrape is answered."""

from __future__ import annotations

import contextlib
import resource
import socket
import time
import urllib.error
import urllib.request

import psutil
import pytest

from cyclone_mp.limits.confinement import Confinement

import handlers as h
import limit_handlers as lh

pytest.importorskip("prometheus_client")

HOST = Confinement.detect("probe-metrics")  # what this machine offers (removed at once)
HOST.close()
KERNEL_PROCESS_CAP = HOST.mechanism.processes in ("cgroup v1", "cgroup v2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, token: str | None = None, timeout: float = 5.0) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def listening(pid: int, port: int) -> list[str]:
    """The addresses process ``pid`` listens on at ``port``."""
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_metrics_bind_the_loopback_by_default_and_take_a_token(cyclone_env_factory):
    port = free_port()
    env = cyclone_env_factory(workers=1, metrics_port=port)
    env.mux().register(h.ok)
    handle = env.start_worker()
    assert listening(handle.pid, port) == ["127.0.0.1"]
    status, text = scrape(port)
    assert status == 200 and "cyclone_children_alive" in text

    guarded = cyclone_env_factory(worker="thread", workers=1, metrics_port=0, metrics_token="s3cret")
    guarded.mux().register(h.ok)
    sup = guarded.start_worker().client.supervisor
    assert scrape(sup.metrics.port)[0] == 401
    assert scrape(sup.metrics.port, token="wrong")[0] == 401
    status, text = scrape(sup.metrics.port, token="s3cret")
    assert status == 200 and "cyclone_claims_total" in text


def test_two_thousand_idle_connections_cannot_take_the_supervisor_down(cyclone_env_factory, tmp_path):
    """2,000 idle connections held open to the metrics port for ~10 s: the supervisor
    keeps under 100 descriptors, its steps keep finishing, a max_processes=20 fork bomb
    is held to its cap, and a real scrape answers within 2 s."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    port = free_port()
    env = cyclone_env_factory(workers=2, lease_ttl=3, kill_grace=0.5, metrics_port=port)
    env.mux().register(h.ok, lh.fork_bomb, lh.forker)
    handle = env.start_worker()
    supervisor = psutil.Process(handle.pid)
    before = supervisor.num_fds()
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            idle.append(sock)
        time.sleep(0.5)
        assert supervisor.num_fds() - before < 100, supervisor.num_fds() - before
        started = time.monotonic()
        status, text = scrape(port, timeout=5)
        assert status == 200 and "cyclone_children_alive" in text
        assert time.monotonic() - started <= 2.0, time.monotonic() - started
        ids = env.client().enqueue_many(h.ok, [{"i": i} for i in range(50)])
        if KERNEL_PROCESS_CAP:
            bomb = env.enqueue(lh.fork_bomb, {"log": str(tmp_path / "bomb")}, max_processes=20)
        else:
            bomb = env.enqueue(lh.forker, {"n": 200, "every": 0.02, "log": str(tmp_path / "bomb")},
                               max_processes=20)
        peak, deadline = 0, time.monotonic() + 30
        while not env.status(bomb).terminal and time.monotonic() < deadline:
            tree = [p for p in supervisor.children(recursive=True) if "_watchdog" not in " ".join(_cmd(p))]
            peak = max(peak, len(tree))
            time.sleep(0.01)
        run = env.status(bomb)
        assert run.step.error_kind == "process_limit", run.step.errors[-1:]
        # the bomb's 20, the other child, the zygote (and a replacement starting)
        assert peak <= 20 + (0 if KERNEL_PROCESS_CAP else 4) + 3, peak
        for run_id in ids:
            assert env.run_until_complete(run_id, timeout=30).state == "completed"
        assert supervisor.num_fds() - before < 100
    finally:
        for sock in idle:
            sock.close()
    assert handle.alive()


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
