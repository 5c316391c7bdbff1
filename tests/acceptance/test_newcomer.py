"""Issue 19, "A newcomer's first hour": each fault a test (items 2, 4, 5, 6, 8 and 11;
items 1 and 7 are in test_shared_server.py, 9 in test_dashboard_api.py, 10 in test_docs.py).

Real PostgreSQL and real processes: the CLI and its workers run as subprocesses on a
fresh database (the ``dsn`` and ``worker`` fixtures of test_cli.py); terminal widths are
rich's ``Console(width=80)``, and the real CLI with ``COLUMNS=80``.
"""

from __future__ import annotations

import datetime as dt
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest
from rich.console import Console

from cyclone_mp.apps import load_app
from cyclone_mp.errors import ConfigurationError

import handlers as h
from cli_run import APP, REPO, Worker, _env, client_for, dsn, pg, run_cli, worker  # noqa: F401 - fixtures
from waiting import wait_for

from cyclone_mp_cli import render  # noqa: E402 - test_cli makes it importable

ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _console(width: int = 80) -> Console:
    return Console(width=width, record=True, color_system=None, force_terminal=False, highlight=False)


def _lines(con: Console) -> list[str]:
    return con.export_text().splitlines()


def _fits(lines: list[str], width: int = 80) -> None:
    long = [line for line in lines if len(line) > width]
    assert not long, "lines wider than the terminal:\n" + "\n".join(long)


def _row(lines: list[str], needle: str) -> str:
    found = [line for line in lines if needle in line]
    assert found, f"no line shows {needle!r}:\n" + "\n".join(lines)
    return found[0]


class Lines:
    """Reads a process's stream line by line in a thread, with the time each line came."""

    def __init__(self, stream: Any) -> None:
        self.items: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self.items.append((time.monotonic(), line.rstrip("\n")))

    def first(self, needle: str, timeout: float) -> tuple[float, str]:
        return wait_for(lambda: next(((t, line) for t, line in self.items if needle in line), None), timeout,
                        f"a line with {needle!r}; got {[line for _, line in self.items]}")

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "\n".join(line for _, line in self.items)


# -- item 2: tables at 80 columns ------------------------------------------------------------------


@pytest.mark.long  # 8 s: every table; the demo's table is checked in the default run (CI runs the long ones)
def test_every_table_fits_80_columns_and_shows_state_attempts_and_run_id(
        dsn: str, worker: Callable[..., Worker]) -> None:  # noqa: F811
    w = worker(APP, workers=2)
    client = client_for(dsn)
    try:
        done = run_cli("enqueue", APP, "echo", "--input", "{}", "--wait", dsn=dsn)
        failed = run_cli("enqueue", APP, "reject", "--input", "{}", "--wait", dsn=dsn)
        assert done.returncode == 0 and failed.returncode == 1, done.stderr + failed.stderr
        running = run_cli("enqueue", APP, "slow", "--input", '{"seconds": 30}', dsn=dsn).stdout.strip()
        later = run_cli("enqueue", APP, "echo", "--input", "{}", "--delay", "1h", dsn=dsn).stdout.strip()
        flow = run_cli("enqueue", APP, "approval", "--input", "{}", dsn=dsn).stdout.strip()
        wait_for(lambda: client.status(running).state == "running" and client.status(running).step.state == "running"
                 and any(k.get("run_id") == running for r in client.workers() for k in r["info"]["children"]),
                 20, "the slow step to run and show in the registry")
        wait_for(lambda: client.status(flow).steps["approve"].state == "waiting_signal", 20, "the workflow to wait")

        con = _console()
        rows = client.runs()
        con.print(render.runs_table(rows))
        lines = _lines(con)
        _fits(lines)
        for row in rows:
            assert row["state"] in _row(lines, row["id"])  # the full id and its state on one line

        for run_id in (done.stdout.split()[0], failed.stdout.split()[0], running, later, flow):
            status = client.status(run_id)
            con = _console()
            render.print_status(con, status)
            lines = _lines(con)
            _fits(lines)
            assert run_id in "\n".join(lines)
            # a run no supervisor has taken yet says so beside its "running" (item 6)
            header = " ".join(" ".join(lines[:2]).split())  # at 80 columns the run's line may wrap once
            assert ("(queued: no step started yet)" in header) == (run_id == later), lines[:2]
            for step in status.steps.values():
                line = _row(lines, f"│ {step.name} ")
                assert step.state in line and render.attempt_text(step) in line, line
        assert render.attempt_text(client.status(later).step) == "0/3"  # never started (item 6)

        con = _console()
        render.print_workers(con, client.workers())
        lines = _lines(con)
        _fits(lines)
        line = _row(lines, running)
        assert " 1 " in line and "slow" in "\n".join(lines)

        con = _console()
        con.print(render.wait_view(client.status(flow), 1.0))
        lines = _lines(con)
        _fits(lines)
        assert "waiting_signal" in _row(lines, "│ approve ")

        # --wide: every column, whatever the width; the real CLI honours COLUMNS when piped
        con = _console()
        render.print_status(con, client.status(failed.stdout.split()[0]), wide=True)
        text = con.export_text()
        assert "reclaims" in text and "started" in text
        env = {**_env(), "COLUMNS": "80"}
        for args in (["runs"], ["status", running], ["workers"], ["status", flow, "--traceback"]):
            proc = run_cli(*args, dsn=dsn, env=env)
            assert proc.returncode == 0, proc.stderr
            _fits(proc.stdout.splitlines())
        assert all(run_id in run_cli("runs", dsn=dsn, env=env).stdout for run_id in (running, later, flow))
        wide = run_cli("runs", "--wide", dsn=dsn, env=env)
        assert "created" in wide.stdout and "finished" in wide.stdout
        client.cancel(running)  # the worker stops at once, not after draining a 30 s step
    finally:
        client.close()
        w.stop()


def test_demo_table_fits_80_columns(dsn: str) -> None:  # noqa: F811
    proc = run_cli("demo", "--cpu-steps", "4", dsn=dsn, env={**_env(), "COLUMNS": "80"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-500:]
    lines = proc.stdout.splitlines()
    _fits([line for line in lines if not line.startswith(("database:", "look at"))])  # a DSN stays whole
    rows = [line for line in lines if line.startswith("│ demo.")]
    assert len(rows) == 7, lines
    for line in rows:  # the folding table: state and attempts stay columns; the run id folds in, whole
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert any(c in ("completed", "discarded") for c in cells), line
        assert any(re.fullmatch(r"\d+/\d+", c) for c in cells), line
    assert len(set(re.findall(r"\brun ([0-9a-f]{8})\b", proc.stdout))) == 7, proc.stdout  # every run's id, never cut
    assert "2 children killed" in proc.stdout


# -- item 4: a draining worker says what it waits for ------------------------------------------------


def _draining_worker(dsn: str, *options: str) -> tuple[Worker, Lines, str]:
    w = Worker(APP, dsn, "--workers", "1", "--lease-ttl", "3", "--kill-grace", "0.5", "--poll-interval", "0.05,0.5",
               *options)
    w.wait_ready(1)
    err = Lines(w.proc.stderr)
    run_id = run_cli("enqueue", APP, "slow", "--input", '{"seconds": 60}', dsn=dsn).stdout.strip()
    client = client_for(dsn)
    try:
        wait_for(lambda: client.status(run_id).step.state == "running", 20, "the slow step to run")
    finally:
        client.close()
    return w, err, run_id


def test_first_signal_says_what_the_drain_waits_for(dsn: str) -> None:  # noqa: F811
    w, err, run_id = _draining_worker(dsn, "--shutdown-grace", "3")
    try:
        sent = time.monotonic()
        w.proc.send_signal(signal.SIGINT)
        at, line = err.first("draining", 5)
        assert at - sent < 2.0, f"said {at - sent:.1f}s after the signal"
        for words in ("slow", run_id[:8], "up to 3s", "Ctrl-C again"):
            assert words in line, line
        w.proc.wait(timeout=30)
        text = err.text()
        assert "grace of 3s over" in text and "cancelling 1 in-flight step" in text, text
        assert "stopped; 0 completed, 0 failed, 1 released, 1 child killed" in text, text
        assert w.proc.returncode == 0
    finally:
        if w.proc.poll() is None:
            w.kill()


def test_second_signal_says_it_stops_now(dsn: str) -> None:  # noqa: F811
    w, err, run_id = _draining_worker(dsn, "--shutdown-grace", "60")
    try:
        w.proc.send_signal(signal.SIGINT)
        err.first("draining", 5)
        sent = time.monotonic()
        w.proc.send_signal(signal.SIGINT)
        at, line = err.first("stopping now", 5)
        assert at - sent < 2.0 and "slow" in line and "SIGKILLed after 0.5s" in line, line
        w.proc.wait(timeout=30)
        assert time.monotonic() - sent < 15
        assert w.proc.returncode == 0 and "1 child killed" in err.text()
    finally:
        if w.proc.poll() is None:
            w.kill()


# -- item 5: status names nodes, exception types, and shows the traceback -------------------------


def test_status_shows_node_names_exception_types_and_the_traceback(
        dsn: str, worker: Callable[..., Worker]) -> None:  # noqa: F811
    w = worker(APP, workers=2)
    try:
        runs = {}
        for name in ("echo", "interrupt", "boom"):
            proc = run_cli("enqueue", APP, name, "--input", "{}", "--wait", dsn=dsn)
            runs[name] = proc.stdout.split()[0]
        echo = run_cli("status", runs["echo"], dsn=dsn)
        assert re.search(r"output of echo: \{\"echo\": \{\}", echo.stdout), echo.stdout
        interrupted = run_cli("status", runs["interrupt"], dsn=dsn)
        assert "KeyboardInterrupt" in interrupted.stdout, interrupted.stdout
        boom = run_cli("status", runs["boom"], dsn=dsn)
        assert "ValueError: bad [value] in the input" in boom.stdout, boom.stdout  # brackets are not markup
        assert "--traceback" in boom.stdout
        tb = run_cli("status", runs["boom"], "--traceback", dsn=dsn)
        assert tb.returncode == 0, tb.stderr
        assert "last traceback: boom, attempt 1" in tb.stdout
        assert "Traceback (most recent call last)" in tb.stdout and 'raise ValueError("bad [value]' in tb.stdout
        none = run_cli("status", runs["echo"], "--traceback", dsn=dsn)
        assert "no traceback recorded" in none.stdout
    finally:
        w.stop()


# -- item 6: enqueue --wait to a queue nobody serves ---------------------------------------------------


def test_enqueue_wait_warns_at_once_when_no_supervisor_serves_the_queue(
        dsn: str, worker: Callable[..., Worker]) -> None:  # noqa: F811
    w = worker(APP, workers=1)  # serves queue "default" only
    try:
        served = run_cli("enqueue", APP, "echo", "--input", "{}", "--wait", dsn=dsn)
        assert served.returncode == 0 and "Warning" not in served.stderr, served.stderr
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", dsn, "enqueue", APP, "echo",
                                 "--input", "{}", "--queue", "nowhere", "--wait", "--wait-timeout", "3"],
                                cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err = Lines(proc.stderr)
        at, line = err.first("Warning: no live supervisor serves queue 'nowhere'", 5)
        assert at - started < 5 and "--queue nowhere" in line and "with step echo" in line, line
        proc.wait(timeout=30)
        proc.stdout.close()
        text = err.text()
        assert proc.returncode == 1 and "has not started after 3s: it waits in queue 'nowhere'" in text, text
        frame = [line for line in text.splitlines() if "│ echo" in line]
        assert frame and "0/3" in frame[-1] and "1/3" not in text, text  # it never ran
        assert "running (queued: no step started yet)" in text, text  # the header says so too, not a bare "running"
    finally:
        w.stop()


def test_unserved_steps_reads_the_registry(cyclone_env: Any) -> None:
    env = cyclone_env
    env.mux().register(h.ok)
    client = env.client()
    run_id = env.enqueue(h.ok, {}, delay=3600)
    assert [s.name for s in client.unserved_steps(client.status(run_id))] == ["ok"]  # no supervisor at all
    env.start_worker()
    wait_for(lambda: client.workers(), 15, "the supervisor's registry row")
    assert client.unserved_steps(client.status(run_id)) == []
    elsewhere = env.enqueue(h.ok, {}, delay=3600, queue="elsewhere")
    assert [s.queue for s in client.unserved_steps(client.status(elsewhere))] == ["elsewhere"]


# -- item 8: a cancelled attempt leaves a trace ---------------------------------------------------------


def test_cancel_retry_cancel_keeps_both_attempts_in_the_history(cyclone_env: Any) -> None:
    env = cyclone_env
    env.mux().register(h.sleeper)
    env.start_worker()
    client = env.client()
    run_id = env.enqueue(h.sleeper, {"seconds": 60})
    starts, claims = [], []
    for _ in range(2):
        env.wait_for_state(run_id, None, "running", timeout=20)
        running = client.status(run_id).step
        starts.append(running.started_at)
        claims.append(running.claimed_at)
        client.cancel(run_id)
        wait_for(lambda: not any(k.get("run_id") == run_id for r in client.workers()
                                 for k in (r["info"] or {}).get("children", [])), 30, "the child to be taken back")
        if len(starts) == 1:
            client.retry(run_id)
    step = client.status(run_id).step
    assert step.state == "cancelled" and step.error is None and step.error_kind is None
    assert step.attempt == 1  # a cancel consumes no attempt
    entries = [e for e in step.errors if e["kind"] == "cancelled"]
    assert len(entries) == 2, step.errors
    assert [e["attempt"] for e in entries] == [1, 1]
    assert [dt.datetime.fromisoformat(e["claimed_at"]) for e in entries] == claims  # each attempt's own claim
    got = [dt.datetime.fromisoformat(e["started_at"]) for e in entries]
    # and its handler's start as status said it (once reported, a delay after the claim)
    assert all(claim <= start and abs((start - seen).total_seconds()) <= 1.0
               for claim, start, seen in zip(claims, got, starts)), (claims, got, starts)
    assert got[0] < got[1]
    assert all(e["lease_owner"] and e["lease_generation"] for e in entries)
    assert entries[0]["lease_generation"] < entries[1]["lease_generation"]


# -- item 11: wording ----------------------------------------------------------------------------------


def test_messages_read_right() -> None:
    with pytest.raises(ConfigurationError, match=r"is an int, not a cy\.Mux"):
        load_app("os:SEEK_END")
    proc = run_cli("--dsn", "host=127.0.0.1 port=1 user=bob dbname=x password=s3cret", "runs")
    assert proc.returncode == 1 and "s3cret" not in proc.stderr
    assert "password=***: " in proc.stderr, proc.stderr  # the colon after the redacted value stays


def test_worker_stop_summary_counts_children_in_english(dsn: str) -> None:  # noqa: F811
    w = Worker(APP, dsn, "--workers", "1", "--poll-interval", "0.05,0.5")
    w.wait_ready(1)
    assert w.stop() == 0
    assert "0 children killed" in w.stderr, w.stderr  # "1 child killed": the drain tests above


def test_wide_keeps_every_column_whole_however_many_there_are() -> None:
    """Found by a new user: with --wide (or piped), a forensics table wider than 160
    columns squeezed its wrappable columns (node, error) to nothing."""
    from rich.table import Table

    table = Table()
    for name in ("node", "attempt", "kind", "exit", "killed by supervisor", "trigger", "tree", "at", "error"):
        table.add_column(name, no_wrap=name not in ("node", "error"))
    message = "killed 2 times: memory_limit 64 MiB, peak 64 MiB; and a message long enough to need room"
    table.add_row("spin", "1", "memory_limit", "SIGKILL", "yes", "memory_limit",
                  "1.04 CPU s · 1 process · peak 64 MiB", "2026-12-01T23:48:02.820000+00:00", message)
    con = _console()  # 80 columns
    render.put(con, table, wide=True)
    text = con.export_text()
    assert "┃ node ┃" in text and "┃ error " in text, text
    assert message in text  # whole, on one line
    assert con.width == 80  # the console is given back its width
