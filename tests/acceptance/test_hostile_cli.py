"""Issue 18 through the real ``cyclone-mp`` command line: every bad input is one clear
line on stderr and exit 2 (fault 6); the DSN comes from the environment, a file or
libpq's variables, and a password given with ``--dsn`` gets a warning and never stays
on a worker's ``ps`` line (fault 7)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys

import psutil
import pytest

from cli_run import APP, REPO, _env, dsn, one_error_line, pg, run_cli  # noqa: F401 - fixtures
from waiting import wait_exited, wait_for

WARNING = "Warning: a password in --dsn is visible to other users (ps)"


@pytest.mark.parametrize("name,args,words", [
    ("deep_file", ["--input", "@{deep}"], "nested deeper than 200 levels"),
    ("not_utf8_file", ["--input", "@{latin1}"], "is not valid UTF-8"),
    ("huge_integer", ["--input", "9" * 5000], "4300 digits"),
    ("priority", ["--priority", str(2**40)], "--priority"),
    ("max_attempts", ["--max-attempts", str(2**40)], "--max-attempts"),
    ("queue", ["--queue", "q" * 10_000], "queue must be at most 200 characters"),
    ("idempotency_key", ["--idempotency-key", "k" * 10_000], "idempotency_key must be at most 1024 bytes"),
    ("timeout", ["--timeout", "9" * 20], "timeout must be at most 100 years"),
])
def test_bad_enqueue_input_is_one_line_and_exit_2(dsn, tmp_path, name, args, words):  # noqa: F811
    """Issue 18 fault 6, the issue's inputs: each used to exit 1 ("unexpected ...") or
    fail in the database (bigint out of range, NOTIFY payload too long, index row too
    large)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"name": "café"}'.encode("latin-1"))
    args = [a.format(deep=deep, latin1=latin1) for a in args]
    proc = run_cli("enqueue", APP, "echo", *args, dsn=dsn)
    line = one_error_line(proc)
    assert proc.returncode == 2, proc.stderr
    assert words in line, line


def test_bad_signal_payload_is_one_line_and_exit_2(dsn, tmp_path):  # noqa: F811
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 300 + "]" * 300 + "}")
    proc = run_cli("signal", "00000000-0000-0000-0000-000000000000", "go", "--payload", f"@{deep}", dsn=dsn)
    assert proc.returncode == 2 and "nested deeper than 200 levels" in one_error_line(proc)


def test_dsn_from_a_file_and_from_libpq_variables(dsn, pg, tmp_path):  # noqa: F811
    """Issue 18 fault 7: the CLI takes the DSN from a file (--dsn-file) or, with none
    given, from libpq's own variables (PGHOST...), besides CYCLONE_DSN."""
    env = _env()
    dsn_file = tmp_path / "dsn"
    dsn_file.write_text(dsn + "\n")
    proc = run_cli("--dsn-file", str(dsn_file), "runs", env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("no runs"), proc.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    proc = run_cli("--dsn-file", str(empty), "runs", env=env)
    assert proc.returncode == 2 and "holds no connection string" in one_error_line(proc)
    # libpq's variables: the embedded server listens on a Unix socket in its data directory
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    libpq = {**env, "PGHOST": info["host"], "PGDATABASE": info["dbname"], "PGUSER": info.get("user", "postgres")}
    if "port" in info:
        libpq["PGPORT"] = str(info["port"])
    proc = run_cli("runs", env=libpq)
    assert proc.returncode == 0 and proc.stdout.startswith("no runs"), proc.stderr


def test_a_password_on_the_command_line_is_warned_about_and_leaves_the_ps_line(dsn):  # noqa: F811
    """Issue 18 fault 7: with --dsn, the worker's ps line showed the password for its
    whole life. Now the CLI warns once and runs the worker again (same pid) with the DSN
    in its environment; its command line no longer holds the password."""
    secret = "pw" + secrets.token_hex(6)
    # the test server trusts local connections: any password is accepted and ignored
    with_password = dsn.replace("postgresql://postgres@", f"postgresql://postgres:{secret}@", 1)
    assert secret in with_password
    cmd = [sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", with_password, "worker", APP, "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        def ready() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            kids = psutil.Process(proc.pid).children(recursive=True)
            seen.update(p.pid for p in kids)
            return len(kids) >= 2  # the child and the watchdog

        wait_for(ready, 30, "the worker's children")
        cmdline = " ".join(psutil.Process(proc.pid).cmdline())
        assert secret not in cmdline and "worker" in cmdline, cmdline
        for pid in seen:
            try:
                line = " ".join(psutil.Process(pid).cmdline())
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    environ = fh.read()
            except (psutil.Error, OSError):
                continue
            assert secret not in line and secret.encode() not in environ, line
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[0].startswith(WARNING) and sum(WARNING in line for line in lines) == 1, stderr
    assert secret not in stderr
    assert wait_exited(seen, 10) == [], "the worker's children to exit"


def test_no_warning_without_a_password_on_the_command_line(dsn):  # noqa: F811
    proc = run_cli("runs", dsn=dsn)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr


def test_dashboard_refuses_a_blank_token(dsn):  # noqa: F811
    """Issue 18 fault 8, through the CLI: `--token " "` on a public bind."""
    proc = run_cli("dashboard", "--host", "0.0.0.0", "--token", " ", dsn=dsn)
    assert proc.returncode == 2 and "white space" in one_error_line(proc)
    proc = run_cli("dashboard", "--host", "0.0.0.0", "--token", "abc", dsn=dsn)
    assert proc.returncode == 2 and "at least 16" in one_error_line(proc)


@pytest.mark.parametrize("value,words", [("2h", "at most 3600 seconds, got 7200"), ("-1", "-1"),
                                         ("soon", "'soon' is not a duration")])
def test_dashboard_refuses_a_bad_refresh(dsn, value, words):  # noqa: F811
    """`dashboard --refresh` takes a duration up to an hour: anything else is one line, exit 2."""
    proc = run_cli("dashboard", "--refresh", value, dsn=dsn)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "--refresh" in line and words in line, line
