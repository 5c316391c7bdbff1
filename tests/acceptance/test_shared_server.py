"""The embedded default server as a shared service (issue 19, items 1 and 7).

Every test points "the embedded default" at a temporary data directory of its own
(``CYCLONE_EMBEDDED_DATA_DIR``), so the machine's default server, which other people may
be using, is never started or stopped here. The CLI runs as real processes.

* Two ``cyclone-mp demo`` processes started 1.5 s apart and a ``cyclone-mp worker`` on the
  default database all finish correctly; the worker never loses its database; the
  server is still running at the end and no demo database is left (issue 19, acceptance 1).
* A command that finds the server gone says so in one line at once, never after the
  pool's 30 s timeout (the second demo used to hang 858 s).
* The demo removes its data unless ``--keep``: its own database on the embedded server,
  its runs on a given DSN (item 7).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import psycopg
import pytest

import cyclone_mp as cy
from cyclone_mp.embedded import DATA_DIR_ENV, EmbeddedServer, server_for_dsn
from cyclone_mp.errors import DatabaseUnavailable
from cyclone_mp.store import list_databases

from cli_run import REPO, _env, dsn, pg, run_cli  # noqa: F401 - fixtures used by name
from waiting import wait_for

DEMO_PREFIX = "cyclone_demo_"


@pytest.fixture
def default_dir() -> Iterator[pathlib.Path]:
    """A data directory standing in for the machine's default one (mode 755 so that, as
    root, the server user can traverse it); the server on it is destroyed at the end."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-mp-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    data_dir = base / "pgdata"
    try:
        yield data_dir
    finally:
        EmbeddedServer(data_dir).destroy()
        shutil.rmtree(base, ignore_errors=True)


def _default_env(data_dir: pathlib.Path) -> dict[str, str]:
    env = _env()
    env[DATA_DIR_ENV] = str(data_dir)
    return env


def _cli(data_dir: pathlib.Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cyclone_mp_cli.main", *args], cwd=REPO,
                            env=_default_env(data_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{proc.args[3:]} still running after {timeout}s; stderr: {err[-800:]}")


@pytest.mark.long  # 11 s: three processes on one default server (CI runs the long ones)
def test_two_demos_and_a_worker_share_the_default_server(default_dir: pathlib.Path) -> None:
    server = EmbeddedServer(default_dir)
    assert not server.is_running()
    demo_a = _cli(default_dir, "demo", "--json", "--cpu-steps", "12")  # starts the server
    worker = _cli(default_dir, "worker", "examples.app:mux", "--workers", "1", "--lease-ttl", "3",
                  "--poll-interval", "0.05,0.5")
    time.sleep(1.5)
    demo_b = _cli(default_dir, "demo", "--json", "--cpu-steps", "12")
    procs = [demo_a, demo_b, worker]
    try:
        reports = []
        for demo in (demo_a, demo_b):
            out, err = _finish(demo, 150)
            assert demo.returncode == 0, f"rc {demo.returncode}: {err[-1200:]}"
            reports.append(json.loads(out))
        for report in reports:
            failed = [name for name, ok in report["checks"].items() if not ok]
            assert report["ok"] and not failed, failed
            assert report["embedded"] and report["own_database"] and not report["kept"]
        assert sum(r["server_started"] for r in reports) <= 1
        assert reports[0]["database"] != reports[1]["database"]
        # the server outlived both demos, and the worker still has its database
        assert server.is_running()
        proc = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "enqueue", "examples.app:mux", "greet",
                               "--input", '{"name": "still here"}', "--wait", "--wait-timeout", "30"],
                              cwd=REPO, env=_default_env(default_dir), capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr
        assert "hello, still here!" in proc.stdout
        assert list_databases(server.uri(), DEMO_PREFIX) == []  # each demo dropped its database
        worker.send_signal(signal.SIGTERM)
        _, werr = _finish(worker, 60)
        assert worker.returncode == 0, werr
        assert "lost" not in werr and "unavailable" not in werr, werr
        assert server.is_running()  # nobody that merely used it stopped it
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)


def _demo_databases(server: EmbeddedServer) -> list[str]:
    try:
        return list_databases(server.uri(), DEMO_PREFIX)
    except cy.CycloneError:  # not started, or not ready yet
        return []


def _demo_runs_completed(server: EmbeddedServer) -> int:
    """How many runs the demo's database holds completed (0 before it is made and migrated)."""
    names = _demo_databases(server)
    if not names:
        return 0
    try:
        with psycopg.connect(server.uri(names[0]), autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM cyclone_runs WHERE state = 'completed'").fetchone()[0]
    except psycopg.Error:  # not migrated yet
        return 0


def test_a_demo_whose_server_is_stopped_says_so_at_once(default_dir: pathlib.Path) -> None:
    server = EmbeddedServer(default_dir)
    demo = _cli(default_dir, "demo", "--json", "--cpu-steps", "200")
    try:
        wait_for(lambda: _demo_databases(server), 60, "the demo's database")
        # the demo is enqueueing and polling: its workers have completed some of its runs
        wait_for(lambda: _demo_runs_completed(server), 60, "the demo's first completed runs")
        assert demo.poll() is None
        server.stop()
        stopped = time.monotonic()
        out, err = _finish(demo, 60)
        took = time.monotonic() - stopped
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert demo.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("Error: the embedded PostgreSQL server was stopped"), err
    assert took < 20, f"the demo needed {took:.1f}s to notice"
    print(f"demo ended {took:.1f}s after the server stopped")


def test_client_finds_the_server_gone_in_a_second(default_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(default_dir))
    monkeypatch.setattr("cyclone_mp.embedded._default", None)  # the default server of this test
    server = EmbeddedServer(default_dir)
    client = cy.Client(None)
    try:
        client.migrate()
        assert server_for_dsn(client.dsn) is not None
        assert client.runs() == []
        server.stop()
        for _ in range(2):  # once with a pooled (broken) connection, once with none
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="embedded PostgreSQL server was stopped"):
                client.runs()
            assert time.monotonic() - started < 5.0
    finally:
        client.close()


def test_db_stop_says_which_sessions_it_ended(default_dir: pathlib.Path) -> None:
    env = _default_env(default_dir)
    started = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "db", "start"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    with psycopg.connect(EmbeddedServer(default_dir).uri()):
        status = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "db", "status", "--json"], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=60)
        assert json.loads(status.stdout)["sessions"] == 1
        stop = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "db", "stop"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and stop.stdout.strip() == "stopped (ended 1 connected session)", stop.stdout


def _runs_in(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM cyclone_runs").fetchone()[0]


@pytest.mark.slow  # test_cli runs the demo on a given DSN and on the default server
def test_demo_on_a_given_dsn_removes_its_runs_unless_kept(dsn: str) -> None:  # noqa: F811
    proc = run_cli("demo", "--json", "--cpu-steps", "4", dsn=dsn, timeout=90)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stderr[-500:]
    assert not report["own_database"] and not report["kept"]
    assert _runs_in(dsn) == 0
    kept = run_cli("demo", "--json", "--keep", "--cpu-steps", "4", dsn=dsn, timeout=90)
    assert kept.returncode == 0 and json.loads(kept.stdout)["kept"], kept.stderr[-500:]
    assert _runs_in(dsn) == 7  # 4 CPU steps and the three bad ones


@pytest.mark.slow  # a third demo on the shared server (--keep); the cleanup is tested without it
def test_demo_keep_keeps_its_own_database(default_dir: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "demo", "--keep", "--cpu-steps", "4"],
                          cwd=REPO, env=_default_env(default_dir), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    server = EmbeddedServer(default_dir)
    kept = list_databases(server.uri(), DEMO_PREFIX)
    assert len(kept) == 1 and f"--dsn '{server.uri(kept[0])}' runs" in proc.stdout, proc.stdout[-600:]
    assert _runs_in(server.uri(kept[0])) == 7
    assert "left running" in proc.stdout
    again = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "demo", "--cpu-steps", "2"], cwd=REPO,
                           env=_default_env(default_dir), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-800:]
    assert list_databases(server.uri(), DEMO_PREFIX) == kept  # a kept database is never taken for a stale one
