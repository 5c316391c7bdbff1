"""Errors no retry can heal are permanent: ``output_invalid`` (the output or a progress
value is not a JSON value PostgreSQL can store, within the limits) and ``not_importable``
(the child cannot import the handler's module, find the handler in it, or call it).

Their step is discarded at its first attempt whatever ``max_attempts`` (25 by default
here, with the default ``attempt**4`` backoff: a retried step would still be waiting),
with a stored message that says what to fix and one line in the worker's log.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cyclone_mp as cy
import cyclone_mp.sql
import handlers as h
import permanent_handlers as ph
from cyclone_mp import decisions
from cyclone_mp.store import Q

MAIN_GUARD = "`if __name__ == '__main__':`"


def discarded_at_once(step: cy.StepStatus, kind: str) -> str:
    """Assert ``step`` was discarded by its first attempt with ``kind``; return its error."""
    assert (step.state, step.attempt, step.max_attempts, step.error_kind) == ("discarded", 1, 25, kind), \
        (step.state, step.attempt, step.error_kind, step.errors)
    assert [e["kind"] for e in step.errors] == [kind]
    assert step.error == step.errors[0]["message"] and step.errors[0]["type"]
    return step.error


# -- output_invalid --------------------------------------------------------------------------------


@pytest.mark.parametrize("handler,fix", [
    (ph.returns_set, "return a JSON value"),
    (ph.returns_object, "return a JSON value"),
    (ph.returns_nan, "return a JSON value"),
    (ph.async_returns_set, "return a JSON value"),
    (ph.bad_progress, "ctx.set_progress takes numbers"),
    (ph.too_big, "return less"),
    (ph.huge_int, "return a JSON value within the payload rules"),
], ids=lambda v: getattr(v, "name", None))
def test_an_output_that_is_not_json_is_discarded_at_its_first_attempt(cyclone_env_factory, caplog, handler, fix):
    caplog.set_level(logging.ERROR, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(worker="thread", workers=1, max_payload=16384)
    env.mux().register(handler, h.ok)
    run_id = env.enqueue(handler, {"bytes": 20_000})
    after = env.enqueue(h.ok, {})
    run = env.run_until_complete(run_id, timeout=20)
    assert run.state == "discarded"
    error = discarded_at_once(run.step, "output_invalid")
    assert fix in error, error
    assert env.run_until_complete(after, timeout=20).state == "completed"  # the worker goes on
    lines = [r.getMessage() for r in caplog.records if "cannot succeed" in r.getMessage()]
    assert len(lines) == 1 and handler.name in lines[0] and "output_invalid" in lines[0] and fix in lines[0], lines


def test_the_log_says_it_once_a_minute_per_step_with_a_count(cyclone_env_factory, caplog):
    """A broken deploy fails every queued run of a step at once: one line says it."""
    caplog.set_level(logging.ERROR, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(worker="thread", workers=2)
    env.mux().register(ph.returns_set)
    ids = env.client().enqueue_many(ph.returns_set, [{}] * 5)
    for run_id in ids:
        discarded_at_once(env.run_until_complete(run_id, timeout=20).step, "output_invalid")
    lines = [r.getMessage() for r in caplog.records if "cannot succeed" in r.getMessage()]
    assert len(lines) == 1, lines


# -- not_importable --------------------------------------------------------------------------------


@pytest.mark.parametrize("how,error_type,fix", [
    ("supervisor", "cyclone_mp.errors.SupervisorInChild", f"put that code under {MAIN_GUARD}"),
    ("import_error", "builtins.ModuleNotFoundError", "install what it imports"),
    ("raises", "builtins.RuntimeError", "fix its module-level code"),
    ("exit", "builtins.SystemExit", f"sys.exit(2) at module level: put the script's own code under {MAIN_GUARD}"),
])
def test_a_module_the_child_cannot_import_is_discarded_at_its_first_attempt(cyclone_env_factory, monkeypatch,
                                                                             caplog, how, error_type, fix):
    caplog.set_level(logging.ERROR, logger="cyclone_mp.supervisor")
    monkeypatch.setenv("PERMANENT_HANDLERS_BREAK", how)
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(ph.fine, h.ok)
    run_id = env.enqueue(ph.fine, {})
    after = env.enqueue(h.ok, {})
    step = env.run_until_complete(run_id, timeout=20).step
    error = discarded_at_once(step, "not_importable")
    assert fix in error and "permanent_handlers" in error, error
    assert step.errors[0]["type"] == error_type
    assert "permanent_handlers.py" in step.errors[0]["traceback"]  # the import's own traceback
    assert env.run_until_complete(after, timeout=20).state == "completed"  # other modules' steps run
    lines = [r.getMessage() for r in caplog.records if "cannot succeed" in r.getMessage()]
    assert len(lines) == 1 and "'perm_fine'" in lines[0] and "not_importable" in lines[0] and fix in lines[0], lines


@pytest.mark.parametrize("handler,fix", [
    (ph.parent_only, "has no attribute 'parent_only'"),
    (ph.rebound, "is a dict, not a callable handler"),
], ids=["unknown_qualname", "not_callable"])
def test_a_handler_the_child_cannot_find_or_call_is_discarded_at_its_first_attempt(cyclone_env_factory, handler,
                                                                                    fix):
    env = cyclone_env_factory(worker="process", workers=1)
    run_id = env.enqueue(handler, {})
    error = discarded_at_once(env.run_until_complete(run_id, timeout=20).step, "not_importable")
    assert fix in error and "module permanent_handlers" in error, error


def test_retry_gives_a_discarded_not_importable_step_one_more_attempt(cyclone_env):
    """Fixed (or not), ``client.retry`` runs it once more, as for any consumed attempt."""
    run_id = cyclone_env.enqueue(ph.parent_only, {})
    discarded_at_once(cyclone_env.run_until_complete(run_id, timeout=20).step, "not_importable")
    assert cyclone_env.client().retry(run_id) == 1
    step = cyclone_env.run_until_complete(run_id, timeout=20).step
    assert (step.state, step.attempt, step.max_attempts, [e["kind"] for e in step.errors]) == \
        ("discarded", 2, 25, ["not_importable", "not_importable"])


def test_a_script_without_its_main_guard_is_discarded_at_its_first_attempt(cyclone_dsn, tmp_path):
    """The bug report's case: a script that starts its Client at module level. Each
    child imports the script to find its handler and refuses to start a supervisor;
    with the default 25 attempts the step was retried for three weeks."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import time\n"
        "import cyclone_mp as cy\n"
        "@cy.step('hello')\n"
        "def hello(ctx, inp):\n"
        "    return 1\n"
        "mux = cy.Mux().register(hello)\n"
        f"client = cy.Client({cyclone_dsn!r}, mux, workers=1, poll_interval=(0.02, 0.1))\n"
        "client.start()\n"
        "run_id = client.enqueue(hello, {})\n"
        "deadline = time.monotonic() + 30\n"
        "while not client.status(run_id).terminal and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "st = client.status(run_id).step\n"
        "print(st.state, st.attempt, st.error_kind)\n"
        "print(st.error)\n"
        "client.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    state, error = proc.stdout.splitlines()[:2]
    assert state == "discarded 1 not_importable", proc.stdout
    assert f"put that code under {MAIN_GUARD}" in error and "unguarded.py" in error, error
    # the worker's log (here Python's last-resort handler on stderr) says it once
    lines = [line for line in proc.stderr.splitlines() if "cannot succeed" in line]
    assert len(lines) == 1 and "not_importable" in lines[0] and MAIN_GUARD in lines[0], proc.stderr


def test_status_shows_what_to_fix(cyclone_env):
    """``cyclone-mp status`` shows the whole message of a step discarded this way."""
    from click.testing import CliRunner
    from cyclone_mp_cli.main import cli

    run_id = cyclone_env.enqueue(ph.returns_set, {})
    error = discarded_at_once(cyclone_env.run_until_complete(run_id, timeout=20).step, "output_invalid")
    out = CliRunner().invoke(cli, ["--dsn", cyclone_env.dsn, "status", run_id], env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    assert " ".join(error.split()[-8:]) in " ".join(out.output.split()), out.output


# -- the decision, in Python and in SQL ------------------------------------------------------------


def test_unhealable_kinds_discard_at_once_in_python_and_in_sql():
    for kind in ("output_invalid", "not_importable", "permanent"):
        assert kind in decisions.PERMANENT_KINDS and kind in decisions.FAILURE_KINDS
        end = decisions.end_attempt(attempt=1, max_attempts=25, kind=kind, timed_out=False, backoff=1.0)
        assert (end.state, end.attempt, end.error_kind) == ("discarded", 1, kind)
        # past the database deadline the attempt is a timeout, retried as any timeout
        end = decisions.end_attempt(attempt=1, max_attempts=25, kind=kind, timed_out=True, backoff=1.0)
        assert (end.state, end.error_kind) == ("available", "timeout")
    assert decisions.reported_kind("not_importable") == "not_importable"
    # every statement that discards at once lists the same kinds (each is written whole)
    lists = re.findall(r"kind IN \(([^)]*'permanent'[^)]*)\)", "".join(
        path.read_text() for path in Path(cyclone_mp.sql.__file__).parent.glob("*.sql")))
    assert lists, "no statement lists the permanent kinds"
    assert all({k.strip(" '") for k in found.split(",")} == set(decisions.PERMANENT_KINDS) for found in lists), lists
    assert {k.strip(" '") for k in Q["attempt_kinds_expr"].split(",")} == set(decisions.FAILURE_KINDS)
