"""Hostile handlers: every death is named right (a MemoryError with a message, sys.exit
with its code, each with its own error kind, and the exception type beside the message
in ``status``), and secrets stay out of handlers' reach (no DSN or password in the
environment of a child or of the watchdog; redaction hides escaped characters too)."""

from __future__ import annotations

import json
import secrets

import pytest

from cyclone_mp import decisions, procs
from cyclone_mp.store import Q, redact

import handlers as h
import hostile_handlers as hh


# -- 5. misnamed deaths (the child's half) -------------------------------------------------------


def test_memory_error_is_named(cyclone_env):
    """Issue 18 fault 5: MemoryError was stored with an empty message."""
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.memory_error, {}), timeout=15)
    entry = run.step.errors[0]
    assert entry["type"] == "builtins.MemoryError"
    assert entry["message"].startswith("MemoryError: ") and len(entry["message"]) > len("MemoryError: ")
    assert run.step.error == entry["message"]


@pytest.mark.parametrize("code,message", [
    (0, "SystemExit: exit code 0"), (3, "SystemExit: exit code 3"), ("bye", "SystemExit: exit code 1 (bye)"),
])
def test_sys_exit_is_named(cyclone_env, code, message):
    """Issue 18 fault 5: sys.exit(0) was stored as SystemExit "0"."""
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.sys_exit, {"code": code}), timeout=15)
    entry = run.step.errors[0]
    assert (entry["type"], entry["message"], run.step.error) == ("builtins.SystemExit", message, message)
    assert "exit_code" not in entry  # the child did not exit: the handler raised


def test_memory_error_and_exit_have_their_kinds(cyclone_env):
    cyclone_env.mux().register(hh.memory_error, hh.sys_exit)
    mem_id = cyclone_env.enqueue(hh.memory_error, {})
    ex_id = cyclone_env.enqueue(hh.sys_exit, {"code": 0})
    mem = cyclone_env.run_until_complete(mem_id, timeout=15)
    ex = cyclone_env.run_until_complete(ex_id, timeout=15)
    assert (mem.step.error_kind, ex.step.error_kind) == ("memory_error", "exit")


def test_new_kinds_are_attempts_everywhere():
    """Every kind a failed attempt can have consumes an attempt in decisions and in the
    SQL of client.retry (which raises max_attempts for them); output_invalid, which no
    retry can heal, discards at once (tests/acceptance/test_permanent_errors.py)."""
    for kind in ("output_invalid", "memory_error", "exit"):
        assert kind in decisions.FAILURE_KINDS
        end = decisions.end_attempt(attempt=1, max_attempts=3, kind=kind, timed_out=False, backoff=1.0)
        expected = ("discarded", 1, kind) if kind == "output_invalid" else ("available", 2, kind)
        assert (end.state, end.attempt, end.error_kind) == expected
    listed = {k.strip(" '") for k in Q["attempt_kinds_expr"].split(",")}
    assert listed == set(decisions.FAILURE_KINDS)
    assert decisions.reported_kind("memory_error") == "memory_error"
    assert decisions.reported_kind("timeout") == "error" and decisions.reported_kind(None) == "error"


def test_status_shows_the_exception_type_beside_the_message(cyclone_env):
    """Issue 18 fault 5: `cyclone-mp status` did not show the exception type."""
    from cyclone_mp_cli import render

    from rich.console import Console

    run = cyclone_env.run_until_complete(cyclone_env.enqueue(h.raises, {}))
    con = Console(width=400, highlight=False)
    with con.capture() as captured:
        render.print_status(con, run)
    text = captured.get()
    assert "ValueError: bad value on attempt 3" in text  # the steps table
    assert "ValueError: bad value on attempt 1" in text  # the failed attempts table
    assert render.error_text("builtins.SystemExit", "SystemExit: exit code 0") == "SystemExit: exit code 0"


# -- 7. credentials out of handlers' reach -------------------------------------------------------


def test_redact_hides_escaped_characters_too():
    """Issue 18 fault 7: the redaction of `password=S3cret\\ more` left `more`."""
    assert redact(r"host=db password=S3cret\ more dbname=x") == "host=db password=*** dbname=x"
    assert "more" not in redact(r"password=S3cret\ more")
    assert redact(r"password='S3 \' cret' dbname=x") == "password=*** dbname=x"


def test_helper_env_drops_the_dsn_and_every_password(monkeypatch):
    monkeypatch.setenv("CYCLONE_DSN", "host=db user=u")
    monkeypatch.setenv("PGPASSWORD", "pw1")
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:pw2@db/app")
    monkeypatch.setenv("OTHER_CONNINFO", "host=db password=pw3")
    monkeypatch.setenv("PLAIN_URL", "postgresql://u@db/app")
    monkeypatch.setenv("KEEP_ME", "postgres://u:visible@db/x")
    monkeypatch.setenv(procs.KEEP_ENV, "KEEP_ME,PGPASSWORD")
    env = procs.helper_env({"EXTRA": "1"})
    for name in ("CYCLONE_DSN", "PGPASSWORD", "DATABASE_URL", "OTHER_CONNINFO"):
        assert name not in env
    assert env["PLAIN_URL"] == "postgresql://u@db/app" and env["KEEP_ME"] and env["EXTRA"] == "1"
    assert not any(p in "".join(env.values()) for p in ("pw1", "pw2", "pw3"))


def test_children_and_the_watchdog_never_see_the_dsn(cyclone_env_factory, monkeypatch):
    """Issue 18 fault 7: with CYCLONE_DSN set, every child and the watchdog inherited it
    in /proc/PID/environ, where handler code can read the password."""
    secret = "pw-" + secrets.token_hex(8)
    monkeypatch.setenv("CYCLONE_DSN", f"postgresql://someone:{secret}@db.invalid/app")
    monkeypatch.setenv("PGPASSWORD", secret)
    monkeypatch.setenv("APP_DB", f"host=db.invalid password={secret}")
    env = cyclone_env_factory()
    env.mux().register(hh.environment)
    handle = env.start_worker()
    run = env.run_until_complete(env.enqueue(hh.environment, {}))
    seen = run.step.output
    assert secret not in json.dumps(seen)
    assert "CYCLONE_DSN" not in seen["environ"] and "PGPASSWORD" not in seen["environ"]
    import psutil

    watchdogs = [p for p in psutil.Process(handle.pid).children() if "_watchdog" in " ".join(p.cmdline())]
    assert watchdogs, "no watchdog found"
    for proc in watchdogs:
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            assert secret.encode() not in fh.read()
