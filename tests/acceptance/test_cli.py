"""Acceptance tests of the ``cyclone-mp`` CLI, ``cyclone_mp.apps`` and the demo.

Pure parsing runs in-process with click's CliRunner; everything else runs the real
CLI as a subprocess (``python -m cyclone_mp_cli.main``) against a dedicated database:
one embedded server per session on a temp data dir (the ``pg`` fixture; small and
self-contained so a shared conftest fixture can replace it), one fresh database per
test (``dsn``). The demo test uses the embedded default server, as a user would, pointed
at a private data dir (``default_env``) so the machine's own default is never touched.

Every test must leave no process behind: the autouse fixture of ``tests/conftest.py``
asserts that no child of the test process is alive afterwards, and the ``worker``
fixture checks that every child a stopped worker ever had is gone too (they are the
worker's children, not ours, so only that check sees them).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable, Iterator

import psutil
import psycopg
import pytest
from click.testing import CliRunner

import cyclone_mp as cy
from cyclone_mp.apps import load_app
from cyclone_mp.embedded import EmbeddedServer
from cyclone_mp.errors import ConfigurationError

from cli_run import (  # noqa: F401 - dsn, pg and worker are fixtures
    APP, REPO, UNREACHABLE, Worker, _env, client_for, dsn, one_error_line, pg, run_cli, worker)
from cyclone_mp_cli import main as cli_main  # noqa: E402
from cyclone_mp_cli import params  # noqa: E402
from waiting import wait_for


# -- apps.load_app ---------------------------------------------------------------------------------


def test_load_app_module_and_file() -> None:
    mux = load_app("examples.app:mux")
    assert mux.step_names == ["count", "greet"]
    assert load_app("examples.app").step_names == ["count", "greet"]  # attr defaults to mux
    file_mux = load_app(str(REPO / APP))
    assert {"echo", "slow", "reject", "publish"} <= set(file_mux.step_names)
    assert file_mux.steps["echo"].ref.module == "cyclone_mp_app_cli_app"
    assert file_mux.steps["echo"].ref.path == str(REPO / "tests" / "support" / "cli_app.py")
    assert load_app(str(REPO / "tests" / "support" / "cli_app.py") + ":echo").step_names == ["echo"]  # a Step is wrapped
    assert "approval" in load_app(str(REPO / "tests" / "support" / "cli_app.py") + ":approval").workflows


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:mux", "no module named 'no_such_module_xyz'"),
    ("examples.app:nope", "has no attribute 'nope'"),
    ("examples.app:greet.fn", "not a cy.Mux"),
    ("/nonexistent/app.py:mux", "no such file"),
    (":mux", "malformed"),
])
def test_load_app_errors_are_one_line(spec: str, words: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_app(spec)
    message = str(info.value)
    assert words in message and "\n" not in message


def test_load_app_broken_file(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import cyclone_mp\nraise RuntimeError('boom\\nsecond line')\n")
    with pytest.raises(ConfigurationError) as info:
        load_app(f"{bad}:mux")
    assert "RuntimeError: boom second line" in str(info.value) and str(bad) in str(info.value)
    (tmp_path / "syntax.py").write_text("def (:\n")
    with pytest.raises(ConfigurationError, match="SyntaxError"):
        load_app(f"{tmp_path / 'syntax.py'}:mux")


# -- pure parsing (CliRunner) -------------------------------------------------------------------------


def test_param_types() -> None:
    assert params.SECONDS.convert("2.5", None, None) == 2.5
    assert params.SECONDS.convert("500ms", None, None) == 0.5
    assert params.SECONDS.convert("5m", None, None) == 300.0
    assert params.BYTES.convert("512K", None, None) == 512 * 1024
    assert params.BYTES.convert("2G", None, None) == 2 * 1024**3
    assert params.POLL.convert("0.1,1.0", None, None) == (0.1, 1.0)
    assert params.POLL.convert("0.5", None, None) == (0.5, 0.5)
    assert params.JSON.convert('{"a": [1, null]}', None, None) == {"a": [1, None]}


def test_json_input_from_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "in.json"
    path.write_text('{"from": "file"}')
    assert params.JSON.convert(f"@{path}", None, None) == {"from": "file"}


@pytest.mark.parametrize("args", [
    ["worker", "x:mux", "--workers", "0"],
    ["worker", "x:mux", "--poll-interval", "1,0.5"],
    ["worker", "x:mux", "--max-child-rss", "lots"],
    ["enqueue", "x:mux", "s", "--input", "{bad"],
    ["enqueue", "x:mux", "s", "--timeout", "soon"],
    ["runs", "--state", "bogus"],
    ["runs", "--limit", "0"],
    ["signal", "r", "n", "--payload", "[1,"],
    ["status"],
    ["nosuchcommand"],
])
def test_bad_usage_exits_2(args: list[str]) -> None:
    result = CliRunner().invoke(cli_main.cli, args)
    assert result.exit_code == 2, result.output


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(cli_main.cli, ["--help"])
    assert result.exit_code == 0
    for name in ("worker", "migrate", "enqueue", "status", "runs", "cancel", "retry", "pause", "resume",
                 "signal", "workers", "db", "demo"):
        assert name in result.output


# -- bad input through the real CLI: one line on stderr, right exit code --------------------------------


def test_unknown_run_id(dsn: str) -> None:
    missing = str(uuid.uuid4())
    for args in (["status", missing], ["status", missing, "--json"], ["cancel", missing], ["retry", missing],
                 ["pause", missing], ["resume", missing], ["signal", missing, "approve"]):
        proc = run_cli(*args, dsn=dsn)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "no run" in one_error_line(proc)
    proc = run_cli("status", "not-a-uuid", dsn=dsn)
    assert proc.returncode == 1 and "not-a-uuid" in one_error_line(proc)


@pytest.mark.parametrize("args, words", [
    (["enqueue", APP, "echo", "--input", "{bad json"], "not valid JSON"),
    (["enqueue", APP, "echo", "--input", "@/nonexistent.json"], "cannot read"),
    (["enqueue", APP, "no_such_step", "--input", "{}"], "unknown step 'no_such_step'"),
    (["enqueue", "no_such_module_xyz:mux", "echo"], "no_such_module_xyz"),
    (["enqueue", "examples.app:missing", "greet"], "no attribute 'missing'"),
    (["worker", "no_such_module_xyz:mux"], "no_such_module_xyz"),
    (["worker", APP, "--workers", "0"], "--workers"),
    (["signal", str(uuid.uuid4()), "approve", "--payload", "{"], "not valid JSON"),
    (["enqueue", APP], "Missing argument 'NAME'"),
    (["enqueue", APP, "echo", "--rate-limit", "ten"], "is not COUNT/SECONDS"),
    (["enqueue", APP, "echo", "--rate-limit", "0/1s"], "rate_limit count must be an int from 1"),
    (["enqueue", APP, "echo", "--concurrency", "0"], "--concurrency"),
    (["enqueue", APP, "echo", "--backoff", "1s,,2s"], "is not SECONDS or a comma list"),
    (["enqueue", APP, "echo", "--backoff", "soon"], "is not a duration"),
])
def test_bad_usage_one_line(dsn: str, args: list[str], words: str) -> None:
    proc = run_cli(*args, dsn=dsn)
    assert proc.returncode == 2, proc.stderr
    assert words in one_error_line(proc)


def test_enqueue_with_a_key_and_limits(dsn: str) -> None:
    """Issue 21 from the command line: the key and limits given at enqueue are stored on
    the step (and shown by status)."""
    proc = run_cli("enqueue", APP, "echo", "--input", "{}", "--concurrency-key", "acme", "--concurrency", "2",
                   "--rate-limit", "10/1m", dsn=dsn)
    assert proc.returncode == 0, proc.stderr
    step = json.loads(run_cli("status", proc.stdout.strip(), "--json", dsn=dsn).stdout)["steps"]["echo"]
    assert (step["concurrency_key"], step["concurrency"], step["rate_limit"]) == ("acme", 2, [10, 60.0])
    shown = run_cli("status", proc.stdout.strip(), dsn=dsn).stdout
    assert "key acme, 0/2 running, 0/10 starts per 60s" in shown


def test_enqueue_with_a_backoff(dsn: str) -> None:
    """--backoff stores the step's retry schedule on its row: one duration, or one per
    failed attempt (the last repeats)."""
    import psycopg

    for given, stored in (("30s", 30.0), ("1s,10s,1m", [1.0, 10.0, 60.0])):
        proc = run_cli("enqueue", APP, "echo", "--input", "{}", "--backoff", given, dsn=dsn)
        assert proc.returncode == 0, proc.stderr
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT backoff FROM cyclone_steps WHERE run_id = %s", (proc.stdout.strip(),)).fetchone()
        assert row == (stored,)


def test_app_that_raises_on_import(dsn: str, tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "explodes.py"
    bad.write_text("raise RuntimeError('kaboom')\n")
    proc = run_cli("enqueue", f"{bad}:mux", "echo", dsn=dsn)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "kaboom" in line and "explodes.py" in line


@pytest.mark.parametrize("args", [
    ["status", str(uuid.uuid4())], ["runs"], ["workers", "--json"], ["migrate"], ["cancel", str(uuid.uuid4())],
    ["enqueue", APP, "echo", "--input", "{}"], ["worker", APP],
])
def test_unreachable_database(args: list[str]) -> None:
    proc = run_cli(*args, dsn=UNREACHABLE, timeout=30)
    assert proc.returncode == 1, proc.stderr
    # a password given with --dsn gets one warning line first (issue 18), then the error
    warning, _, rest = proc.stderr.partition("\n")
    assert warning.startswith("Warning: a password in --dsn is visible"), proc.stderr
    line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, rest))
    assert "cannot connect" in line
    assert "s3cret" not in proc.stderr + proc.stdout  # the password is never printed


def test_unreachable_database_from_env() -> None:
    env = {**_env(), "CYCLONE_DSN": UNREACHABLE}
    proc = run_cli("runs", env=env)
    assert proc.returncode == 1 and "cannot connect" in one_error_line(proc)


# -- real work -----------------------------------------------------------------------------------------


def test_worker_and_enqueue_wait(dsn: str, worker: Callable[..., Worker]) -> None:
    w = worker()
    proc = run_cli("enqueue", APP, "echo", "--input", '{"x": 1}', "--wait", dsn=dsn)
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.splitlines()[0].strip()
    assert f"run {run_id} completed" in proc.stdout
    assert '"echo": {"x": 1}' in proc.stdout

    proc = run_cli("status", run_id, "--json", dsn=dsn)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["state"] == "completed" and data["steps"]["echo"]["output"]["echo"] == {"x": 1}

    proc = run_cli("status", run_id, dsn=dsn)
    assert proc.returncode == 0 and "completed" in proc.stdout and "echo" in proc.stdout

    proc = run_cli("runs", "--json", "--state", "completed", dsn=dsn)
    assert [r["id"] for r in json.loads(proc.stdout)] == [run_id]

    proc = run_cli("workers", "--json", dsn=dsn)
    rows = json.loads(proc.stdout)
    assert len(rows) == 1 and len(rows[0]["info"]["children"]) == 2
    assert {k["pid"] for k in rows[0]["info"]["children"]} <= set(w.children())
    assert run_cli("workers", dsn=dsn).returncode == 0
    assert w.stop() == 0


def test_worker_with_prefetch_runs_every_step_once(dsn: str, worker: Callable[..., Worker]) -> None:
    w = worker(APP, "--prefetch", "8")  # (it migrates the fresh database)
    client = cy.Client(dsn, load_app(str(REPO / APP)))
    try:
        ids = client.enqueue_many("echo", [{"i": i} for i in range(40)])
        wait_for(lambda: all(client.status(r).state == "completed" for r in ids), 60, "40 echo runs")
        steps = [client.status(r).steps["echo"] for r in ids]
    finally:
        client.close()
    assert [s.output["echo"] for s in steps] == [{"i": i} for i in range(40)]
    assert all((s.attempt, s.reclaims, s.errors) == (1, 0, []) for s in steps)
    assert w.stop() == 0


def test_enqueue_wait_failed_run_exits_1(dsn: str, worker: Callable[..., Worker]) -> None:
    worker()
    proc = run_cli("enqueue", APP, "reject", "--wait", dsn=dsn)
    assert proc.returncode == 1
    run_id = proc.stdout.splitlines()[0].strip()
    assert "discarded" in proc.stdout and "permanent" in proc.stderr
    data = json.loads(run_cli("status", run_id, "--json", dsn=dsn).stdout)
    step = data["steps"]["reject"]
    assert step["error_kind"] == "permanent" and step["errors"][0]["message"] == "rejected by the test app"
    proc = run_cli("enqueue", APP, "reject", "--wait", "--json", dsn=dsn)
    assert proc.returncode == 1 and json.loads(proc.stdout)["state"] == "discarded"


def test_readme_tour(dsn: str, worker: Callable[..., Worker]) -> None:
    """``cyclone-mp worker examples.app:mux`` + ``enqueue ... --wait`` from the repo root."""
    worker("examples.app:mux")
    proc = run_cli("enqueue", "examples.app:mux", "greet", "--input", '{"name": "Ada"}', "--wait", dsn=dsn)
    assert proc.returncode == 0, proc.stderr
    assert "hello, Ada!" in proc.stdout
    proc = run_cli("enqueue", "examples.app:mux", "count", "--input", '{"to": 4, "every": 0.1}', "--wait",
                   "--json", dsn=dsn)
    assert proc.returncode == 0, proc.stderr
    step = json.loads(proc.stdout)["steps"]["count"]
    assert step["output"] == {"counted": 4} and step["progress"]["done"] == 4


def test_cancel_a_running_step(dsn: str, worker: Callable[..., Worker]) -> None:
    worker("examples.app:mux")
    run_id = run_cli("enqueue", "examples.app:mux", "count", "--input", '{"to": 600, "every": 0.1}',
                     dsn=dsn).stdout.strip()
    client = client_for(dsn)
    try:
        wait_for(lambda: client.status(run_id).step.state == "running", 20, "the step to run")
        proc = run_cli("cancel", run_id, dsn=dsn)
        assert proc.returncode == 0 and "cancelled" in proc.stdout
        assert client.status(run_id).state == "cancelled"
        again = run_cli("cancel", run_id, dsn=dsn)
        assert again.returncode == 1 and one_error_line(again)
    finally:
        client.close()


def test_signal_command_completes_a_workflow(dsn: str, worker: Callable[..., Worker]) -> None:
    worker()
    run_id = run_cli("enqueue", APP, "approval", "--input", '{"doc": 7}', dsn=dsn).stdout.strip()
    client = client_for(dsn)
    try:
        wait_for(lambda: client.status(run_id).steps["approve"].state == "waiting_signal", 20, "the signal node")
        proc = run_cli("signal", run_id, "approve", "--payload", '{"by": "ops"}', dsn=dsn)
        assert proc.returncode == 0, proc.stderr
        status = wait_for(lambda: (s := client.status(run_id)).terminal and s, 20, "the run to end")
        assert status.state == "completed"
        assert status.steps["publish"].output == {"approved_with": {"by": "ops"}}
        repeat = run_cli("signal", run_id, "approve", "--payload", "1", dsn=dsn)
        assert repeat.returncode in (0, 1) and "Traceback" not in repeat.stderr
    finally:
        client.close()


def test_signals_that_keep_coming_after_the_drain_still_exit_0(dsn: str, worker: Callable[..., Worker]) -> None:
    """A service manager may signal again while the worker exits: once the supervisor
    has stopped, a further SIGTERM changes nothing (it used to kill the exiting worker,
    rc -15)."""
    w = worker(workers=1)
    w.wait_ready(1)
    w.children()
    while w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    _, w.stderr = w.proc.communicate(timeout=30)
    assert w.proc.returncode == 0, w.stderr
    assert "stopped" in w.stderr and "Traceback" not in w.stderr


def test_sigterm_drains_a_step_in_flight(dsn: str, worker: Callable[..., Worker]) -> None:
    w = worker(workers=1)
    run_id = run_cli("enqueue", APP, "slow", "--input", '{"seconds": 2.5}', dsn=dsn).stdout.strip()
    client = client_for(dsn)
    try:
        wait_for(lambda: client.status(run_id).step.state == "running", 20, "the step to run")
        time.sleep(0.3)
        started = time.monotonic()
        assert w.stop(signal.SIGTERM, timeout=30) == 0, w.stderr
        assert time.monotonic() - started >= 1.0  # it waited for the step instead of killing it
        status = client.status(run_id)
        assert status.state == "completed", status
        assert status.step.output == {"slept": 2.5} and status.step.attempt == 1
        assert "drain" in w.stderr or "stopped" in w.stderr
        assert "Traceback" not in w.stderr
    finally:
        client.close()


def test_db_commands(pg: EmbeddedServer) -> None:
    data_dir = str(pg.data_dir)
    proc = run_cli("db", "--data-dir", data_dir, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["running"] is True and info["data_dir"] == data_dir
    proc = run_cli("db", "--data-dir", data_dir, "uri")
    assert proc.returncode == 0 and proc.stdout.strip() == pg.uri()
    missing = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-mp-cli-nodb-", dir="/tmp"))
    try:
        proc = run_cli("db", "--data-dir", str(missing / "pgdata"), "uri")
        assert proc.returncode == 1 and "not running" in one_error_line(proc)
        proc = run_cli("db", "--data-dir", str(missing / "pgdata"), "status", "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["running"] is False
    finally:
        shutil.rmtree(missing, ignore_errors=True)


def test_migrate_is_idempotent(dsn: str) -> None:
    first = run_cli("migrate", dsn=dsn)
    assert first.returncode == 0 and "applied" in first.stdout
    second = run_cli("migrate", dsn=dsn)
    assert second.returncode == 0 and "up to date" in second.stdout


# -- the demo -------------------------------------------------------------------------------------------


@pytest.fixture
def default_env() -> Iterator[dict[str, str]]:
    """The environment of a CLI whose embedded default server is a private one, on a temp
    data dir (``CYCLONE_EMBEDDED_DATA_DIR``): the machine's default server may be in use
    by others, and is never started or stopped by a test. Destroyed at the end."""
    from cyclone_mp.embedded import DATA_DIR_ENV

    base = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-mp-default-", dir="/tmp"))
    os.chmod(base, 0o755)
    env = _env()
    env[DATA_DIR_ENV] = str(base / "pgdata")
    try:
        yield env
    finally:
        EmbeddedServer(base / "pgdata").destroy()
        shutil.rmtree(base, ignore_errors=True)


def test_demo_on_the_embedded_default(default_env: dict[str, str]) -> None:
    """``cyclone-mp demo`` as a newcomer runs it: the embedded default server, a table,
    exit 0, under a minute, nothing left behind."""
    started = time.monotonic()
    proc = run_cli("demo", timeout=90, env=default_env)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-1200:] + proc.stderr[-500:]
    assert took < 60, f"the demo took {took:.1f}s"
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "cyclone-mp demo" in out and "all checks passed" in out
    for word in ("demo.wedge", "demo.crash", "demo.grandchild", "child_exited", "timeout", "no handler process left"):
        assert word in out


@pytest.mark.long  # 6 s: the demo on the embedded default above runs in the default run (CI runs the long ones)
def test_demo_json_on_a_given_dsn(dsn: str) -> None:
    proc = run_cli("demo", "--json", "--cpu-steps", "8", dsn=dsn, timeout=90)
    report = json.loads(proc.stdout)
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert proc.returncode == 0 and report["ok"] is True, f"failed checks: {failed}; stderr: {proc.stderr[-500:]}"
    assert report["embedded"] is False
    roles = {row["role"]: row for row in report["rows"] if row["role"] != "cpu"}
    assert roles["wedged"]["error_kind"] == "timeout" and roles["crasher"]["error_kind"] == "child_exited"
    assert len(report["grandchildren"]) == 2 and report["grandchildren_alive"] == []
    assert report["leftover_pids"] == [] and report["completed"] == 8
    # SPEC 4 forensics reach the report: who killed what, and how the crasher died.
    assert roles["wedged"]["forensics"]["killed_by_supervisor"] is True
    assert roles["wedged"]["forensics"]["signal_name"] == "SIGKILL"
    assert roles["crasher"]["forensics"]["signal_name"] == "SIGABRT"
    assert roles["crasher"]["forensics"]["killed_by_supervisor"] is False
    assert all(not psutil.pid_exists(pid) for pid in report["grandchildren"])


def test_worker_and_enqueue_on_the_embedded_default(default_env: dict[str, str]) -> None:
    """Issue 3, acceptance 2: ``cyclone-mp worker examples.app:mux`` in one terminal and
    ``cyclone-mp enqueue ... --wait`` in another, both on the default (embedded) database."""
    from cyclone_mp.embedded import DATA_DIR_ENV

    server = EmbeddedServer(default_env[DATA_DIR_ENV])
    worker = subprocess.Popen(
        [sys.executable, "-m", "cyclone_mp_cli.main", "worker", "examples.app:mux", "--workers", "1",
         "--lease-ttl", "3", "--poll-interval", "0.05,0.5"],
        cwd=REPO, env=default_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: server.is_running() and len(psutil.Process(worker.pid).children()) >= 1, 60,
                 "the worker on the default server")
        proc = run_cli("enqueue", "examples.app:mux", "greet", "--input", '{"name": "default"}', "--wait",
                       "--wait-timeout", "60", timeout=90, env=default_env)
        assert proc.returncode == 0, proc.stderr
        assert "hello, default!" in proc.stdout
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err


def test_prune_deletes_only_old_finished_runs(dsn: str) -> None:
    client = client_for(dsn)
    try:
        client.migrate()
        done = run_cli("enqueue", APP, "echo", "--input", "{}", dsn=dsn)
        assert done.returncode == 0, done.stderr
        finished_id = done.stdout.strip()
        waiting = run_cli("enqueue", APP, "echo", "--input", "{}", "--delay", "1h", dsn=dsn)
        waiting_id = waiting.stdout.strip()
        client.cancel(finished_id)  # cancelled: finished, so prunable
        kept = run_cli("prune", "--older-than", "1d", dsn=dsn)
        assert kept.returncode == 0 and "pruned 0" in kept.stdout, kept.stderr
        gone = run_cli("prune", "--older-than", "0", dsn=dsn)
        assert gone.returncode == 0 and "pruned 1" in gone.stdout, gone.stderr
        with pytest.raises(cy.RunNotFound):
            client.status(finished_id)
        assert client.status(waiting_id).state == "running"
        with psycopg.connect(dsn) as conn:  # its steps went with it (no foreign key cascades them)
            steps = conn.execute("SELECT run_id::text FROM cyclone_steps").fetchall()
        assert steps == [(waiting_id,)]
    finally:
        client.close()


def test_a_metrics_port_in_use_stops_the_worker_with_one_error_line(dsn: str) -> None:
    """Found by a new user: the worker logged a traceback and ran on without metrics (a
    scrape then reached the other process on that port)."""
    pytest.importorskip("prometheus_client")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", dsn, "worker", APP, "--metrics-port", str(port)]
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        marked = []  # processes carrying its supervisor's marker (host:PID:...): a child or the zygote
        while proc.poll() is None:
            for p in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    if f":{proc.pid}:" in p.environ().get("CYCLONE_MP_SUPERVISOR", ""):
                        marked.append(p.pid)
            time.sleep(0.01)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == f"Error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
    assert not marked  # it started no child (and no zygote)



def test_worker_start_method_spawn_and_a_bad_one(dsn: str, worker: Callable[..., Worker]) -> None:
    """``--start-method spawn`` starts children as fresh interpreters (no zygote among the
    worker's children); an unknown method is bad usage: one line, exit 2 (issue 23)."""
    bad = run_cli("worker", APP, "--start-method", "fork", dsn=dsn)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "'fork' is not one of 'zygote', 'spawn'" in bad.stderr
    w = worker(APP, "--start-method", "spawn")
    client = cy.Client(dsn, load_app(str(REPO / APP)))
    try:
        run_id = client.enqueue("echo", {"i": 1})
        wait_for(lambda: client.status(run_id).state == "completed", 30, "the echo run")
    finally:
        client.close()
    kids = [psutil.Process(p) for p in w.children()]
    cmdlines = [" ".join(p.cmdline()) for p in kids if p.is_running()]
    assert any("cyclone_mp._child" in c for c in cmdlines), cmdlines
    assert not any(" zygote " in c or " forked " in c for c in cmdlines), cmdlines
    assert w.stop() == 0
