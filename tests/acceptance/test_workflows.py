"""Runs of several steps against a real PostgreSQL and real processes: SPEC section 6 (issue 5).

Workflows and their handlers live in ``workflow_handlers`` (module level, so worker
processes find them). Each task node logs ``start``/``end`` lines to ``<dir>/<node>.log``,
which is how these tests count executions.
"""

from __future__ import annotations

import dataclasses

import datetime as dt
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest
from psycopg import sql

import cyclone_mp as cy
from cyclone_mp.store import connect

import workflow_handlers as wh
from clients import use_async_client

UTC = dt.timezone.utc
LA = ZoneInfo("America/Los_Angeles")
SUPPORT_DIR = Path(__file__).resolve().parents[1] / "support"  # the handlers' modules


# -- helpers -----------------------------------------------------------------------------------


def lines(folder: Path, node: str, kind: str | None = None) -> list[list[str]]:
    """The log lines of ``node`` (split), optionally only those starting with ``kind``."""
    path = folder / f"{node}.log"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r[0] == kind]


def starts(folder: Path, node: str) -> int:
    return len(lines(folder, node, "start"))


def ends(folder: Path, node: str) -> int:
    return len(lines(folder, node, "end"))


from waiting import not_zombie, supervisor_turns, supervisors_idle
from waiting import wait_for as wait_until

def wait_run_state(env, run_id: str, state: str, timeout: float = 15.0) -> cy.RunStatus:
    def check():
        run = env.status(run_id)
        return run if run.state == state else None

    return wait_until(check, timeout, f"run {run_id} to be {state}")


def db_now(dsn: str) -> dt.datetime:
    with connect(dsn) as conn:
        return conn.execute("SELECT now() AS n").fetchone()["n"]


def states(run: cy.RunStatus) -> dict[str, str]:
    return {name: step.state for name, step in run.steps.items()}


def utc(value: dt.datetime) -> dt.datetime:
    """The same instant as an aware UTC datetime.

    Compare instants in one zone: Python never finds an aware datetime inside a fold
    (01:30 on 2026-11-01 in Los Angeles) equal to one in another zone (PEP 495).
    """
    assert value.tzinfo is not None and value.utcoffset() is not None, value
    return value.astimezone(UTC)


def set_database_timezone(dsn: str, zone: str) -> None:
    """``ALTER DATABASE <db> SET timezone``: applies to every connection opened afterwards."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with connect(dsn) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = {}").format(sql.Identifier(dbname), sql.Literal(zone)))
    with connect(dsn) as conn:  # a new session picks the setting up
        assert conn.execute("SHOW timezone").fetchone()["TimeZone"] == zone


def run_input(tmp_path: Path, **extra) -> dict:
    folder = tmp_path / "execs"
    folder.mkdir(exist_ok=True)
    return {"dir": str(folder), "x": 42, **extra}


# -- definition-time validation ------------------------------------------------------------------


def test_definition_errors_raise_configuration_error():
    wf = cy.Workflow("bad")
    first = wf.add(wh.a)
    with pytest.raises(cy.ConfigurationError, match="duplicate node name"):
        wf.add(wh.a)  # named by its step name: "a" again
    with pytest.raises(cy.ConfigurationError, match="duplicate node name"):
        wf.signal("a")  # names are unique across kinds
    with pytest.raises(cy.ConfigurationError, match="duplicate node name"):
        wf.timer("a", seconds=1)
    with pytest.raises(cy.ConfigurationError, match="unknown dependency"):
        wf.add(wh.b, after=["nope"])
    other = cy.Workflow("other")
    foreign = other.add(wh.c)
    with pytest.raises(cy.ConfigurationError, match="unknown dependency"):
        wf.add(wh.b, after=[foreign])  # a node of another workflow
    with pytest.raises(cy.ConfigurationError, match="unknown dependency"):
        wf.add(wh.b, after=["b"])  # itself: a node must be added before what depends on it
    with pytest.raises(cy.ConfigurationError):
        wf.timer("t", seconds=1, until=dt.datetime.now(UTC))
    with pytest.raises(cy.ConfigurationError):
        wf.timer("t")
    with pytest.raises(cy.ConfigurationError):
        wf.timer("t", until=dt.datetime(2030, 1, 1))  # naive
    # the failed calls left the definition unchanged
    assert [n.name for n in wf.nodes] == ["a"]
    wf.add(wh.b, after=[first], name="b2")
    assert [(n.name, n.after) for n in wf.nodes] == [("a", ()), ("b2", ("a",))]


# -- 1. the diamond -------------------------------------------------------------------------------


def test_diamond_runs_each_node_once_and_joins_upstream_outputs(api_env, tmp_path):
    inp = run_input(tmp_path)
    run_id = api_env.enqueue(wh.diamond, inp)
    run = api_env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed" and run.kind == "workflow" and run.finished_at is not None
    assert states(run) == {"a": "completed", "b": "completed", "c": "completed", "d": "completed"}
    folder = Path(inp["dir"])
    for node in "abcd":
        assert (starts(folder, node), ends(folder, node)) == (1, 1), node
    s = run.steps
    # every node got the run's input; each saw exactly its dependencies' outputs
    assert all(s[n].output["x"] == 42 and s[n].output["node"] == n for n in "abcd")
    assert s["a"].output["upstream"] == {}
    assert s["b"].output["upstream"] == {"a": s["a"].output}
    assert s["c"].output["upstream"] == {"a": s["a"].output}
    assert s["d"].output["upstream"] == {"b": s["b"].output, "c": s["c"].output}
    # the order the edges ask for, on the database clock
    assert s["b"].started_at >= s["a"].finished_at and s["c"].started_at >= s["a"].finished_at
    assert s["d"].started_at >= max(s["b"].finished_at, s["c"].finished_at)
    assert all((s[n].attempt, s[n].reclaims, s[n].errors) == (1, 0, []) for n in "abcd")


# -- 2. supervisor crash in the middle of the diamond -----------------------------------------------


def test_supervisor_crash_mid_diamond_reclaims_only_the_running_node(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(lease_ttl=1.0, workers=2)
    release = tmp_path / "release-b"
    inp = run_input(tmp_path, hold={"b": str(release)})
    folder = Path(inp["dir"])
    run_id = env.enqueue(wh.diamond, inp)
    first = env.start_worker()
    env.wait_for_state(run_id, "c", "completed", timeout=15)
    running = env.wait_for_state(run_id, "b", "running", timeout=15, owner=first)
    wait_until(lambda: starts(folder, "b") == 1, 5, "b to start")
    old_child = int(lines(folder, "b", "start")[0][2])
    env.crash_worker()
    # the crashed supervisor's child dies with it
    wait_until(lambda: not not_zombie(old_child), 3, "the old child of b to die")
    second = env.start_worker()
    step = env.wait_for_state(run_id, "b", "running", timeout=15, owner=second)
    assert (step.reclaims, step.attempt, step.errors) == (1, 1, [])
    assert step.lease_generation == running.lease_generation + 1
    assert env.status(run_id).steps["d"].state == "pending"  # d waits for the reclaimed b
    release.write_text("go")
    run = env.run_until_complete(run_id, timeout=30)
    assert states(run) == {n: "completed" for n in "abcd"}
    s = run.steps
    assert (s["b"].reclaims, s["b"].attempt) == (1, 1)
    assert all(s[n].reclaims == 0 for n in "acd")
    # a and c ran once, b was started twice and finished once, d ran once after both
    assert [starts(folder, n) for n in "abcd"] == [1, 2, 1, 1]
    assert [ends(folder, n) for n in "abcd"] == [1, 1, 1, 1]
    assert s["d"].started_at >= s["b"].finished_at
    assert s["d"].output["upstream"] == {"b": s["b"].output, "c": s["c"].output}
    assert s["c"].lease_owner == first.supervisor_id and s["d"].lease_owner == second.supervisor_id


# -- 3. signals --------------------------------------------------------------------------------------


def test_signal_sent_before_the_node_is_reached_is_kept(api_env, tmp_path):
    release = tmp_path / "release-prepare"
    inp = run_input(tmp_path, hold={"prepare": str(release)})
    folder = Path(inp["dir"])
    run_id = api_env.enqueue(wh.approval, inp)
    api_env.start_worker()
    api_env.wait_for_state(run_id, "prepare", "running")
    client = api_env.client()
    assert client.signal(run_id, "approve", {"by": "alice"}) is True
    assert client.signal(run_id, "approve", {"by": "mallory"}) is False  # a repeat is ignored
    run = api_env.status(run_id)
    assert (run.steps["approve"].state, run.steps["publish"].state) == ("pending", "pending")
    release.write_text("go")
    run = api_env.run_until_complete(run_id)
    assert run.state == "completed"
    approve = run.steps["approve"]
    assert (approve.state, approve.output) == ("completed", {"by": "alice"})
    assert approve.finished_at >= run.steps["prepare"].finished_at
    assert run.steps["publish"].output["upstream"] == {"approve": {"by": "alice"}}
    assert [starts(folder, n) for n in ("prepare", "publish")] == [1, 1]


def test_signal_sent_after_the_node_is_reached_and_sent_twice(api_env, tmp_path):
    inp = run_input(tmp_path)
    folder = Path(inp["dir"])
    run_id = api_env.enqueue(wh.approval, inp)
    api_env.start_worker()
    waiting = api_env.wait_for_state(run_id, "approve", "waiting_signal", timeout=15)
    assert waiting.output is None
    supervisor_turns(api_env.dsn, "claim_statements", 3)  # several polls: nothing moves without the signal
    run = api_env.status(run_id)
    assert (run.state, run.steps["approve"].state, run.steps["publish"].state) == ("running", "waiting_signal", "pending")
    client = api_env.client()
    assert client.signal(run_id, "approve", ["first", 1]) is True
    assert client.signal(run_id, "approve", ["second", 2]) is False
    run = api_env.run_until_complete(run_id)
    assert run.state == "completed"
    assert run.steps["approve"].output == ["first", 1]
    assert run.steps["publish"].output["upstream"] == {"approve": ["first", 1]}
    # a signal after completion changes nothing either
    assert client.signal(run_id, "approve", ["third", 3]) is False
    assert api_env.status(run_id).steps["approve"].output == ["first", 1]
    assert [starts(folder, n) for n in ("prepare", "publish")] == [1, 1]


# -- 4. timers on the database clock (SC-12) ------------------------------------------------------------


@pytest.mark.parametrize("skew", [pytest.param(3600.0, marks=pytest.mark.long),
                                  pytest.param(-3600.0, marks=pytest.mark.long), "below_zero"],
                         ids=["worker+1h", "worker-1h", "worker-clock-below-zero"])  # (CI runs the long ones too)
def test_timers_fire_once_on_the_database_clock(cyclone_dsn, cyclone_env_factory, tmp_path, skew):
    if skew == "below_zero":
        # -1 h on a host up for less than an hour: the supervisor's local clock reads below
        # zero. Made deterministic here, whatever this host's uptime.
        skew = -(time.monotonic() + 3600.0)
    set_database_timezone(cyclone_dsn, "America/Los_Angeles")
    env = cyclone_env_factory(lease_ttl=0.6)
    env.skew_worker_clock(skew)
    env.mux().register(wh.work)
    env.start_worker()
    until = db_now(cyclone_dsn).astimezone(UTC) + dt.timedelta(seconds=3)
    inp = run_input(tmp_path)
    run_id = env.client().enqueue(wh.timers_workflow(until, seconds=2), inp)

    # Watch both timers on the database clock until they fired: never before due_at.
    seen_early: list[tuple] = []
    query = "SELECT now() AS now, node, state, due_at, finished_at FROM cyclone_steps WHERE run_id = %s AND kind = 'timer'"
    with connect(cyclone_dsn) as conn:
        deadline = time.monotonic() + 12  # due in 2 s and 3 s
        while True:
            rows = {r["node"]: r for r in conn.execute(query, (run_id,)).fetchall()}
            for r in rows.values():
                assert r["state"] in ("waiting_timer", "completed"), r
                if r["state"] == "completed" and utc(r["now"]) < utc(r["due_at"]):
                    seen_early.append((r["node"], r["now"], r["due_at"]))
            if all(r["state"] == "completed" for r in rows.values()):
                break
            assert time.monotonic() < deadline, f"timers did not fire: {rows}"
            time.sleep(0.02)
    assert not seen_early, f"a timer fired before it was due: {seen_early}"

    run = env.run_until_complete(run_id, timeout=15)
    assert run.state == "completed", [e.get("message") for e in run.steps["done"].errors]
    at, after, done = run.steps["at"], run.steps["after"], run.steps["done"]
    # until=: stored as exactly that UTC instant, whatever the session zone
    assert utc(at.due_at) == until and at.due_at.timestamp() == until.timestamp()
    # seconds=: due exactly that long after the node was reached (a root: at enqueue)
    assert utc(after.due_at) - utc(run.created_at) == dt.timedelta(seconds=2)
    for timer in (at, after):
        assert utc(timer.finished_at) >= utc(timer.due_at)
        assert utc(timer.finished_at) - utc(timer.due_at) < dt.timedelta(seconds=3)  # one sweep tick, bounded generously
    # the fired timers' outputs are their instants, rendered by the supervisor's session in LA time
    for name, timer in (("at", at), ("after", after)):
        fired = dt.datetime.fromisoformat(done.output["upstream"][name])
        assert utc(fired) == utc(timer.due_at)
        assert fired.utcoffset() == timer.due_at.astimezone(LA).utcoffset()
    # exactly once: the successor ran once and nothing moves afterwards
    folder = Path(inp["dir"])
    assert (starts(folder, "done"), ends(folder, "done")) == (1, 1)
    supervisor_turns(env.dsn, "sweeps", 2)  # timers fire in sweeps, successors start in claims
    supervisor_turns(env.dsn, "claim_statements", 2)
    again = env.status(run_id)
    assert (again.steps["at"].finished_at, again.steps["after"].finished_at) == (at.finished_at, after.finished_at)
    assert starts(folder, "done") == 1


def test_timer_instants_in_the_fall_back_hour_are_stored_exactly(cyclone_dsn, cyclone_env_factory):
    set_database_timezone(cyclone_dsn, "America/Los_Angeles")
    env = cyclone_env_factory()
    # 2026-11-01 in Los Angeles: 02:00 PDT falls back to 01:00 PST, so 01:30 happens twice.
    first = dt.datetime(2026, 11, 1, 8, 30, tzinfo=UTC)    # 01:30 PDT (-07)
    second = dt.datetime(2026, 11, 1, 9, 30, tzinfo=UTC)   # 01:30 PST (-08)
    untils = {
        "utc_first": first,
        "utc_second": second,
        "la_fold0": dt.datetime(2026, 11, 1, 1, 30, tzinfo=LA),          # the first 01:30
        "la_fold1": dt.datetime(2026, 11, 1, 1, 30, fold=1, tzinfo=LA),  # the second 01:30
        "offset_second": dt.datetime(2026, 11, 1, 1, 30, tzinfo=dt.timezone(dt.timedelta(hours=-8))),
    }
    expected = {"utc_first": first, "utc_second": second, "la_fold0": first, "la_fold1": second,
                "offset_second": second}
    run_id = env.client().enqueue(wh.instants_workflow(untils, day_after="utc_first"), {})

    with connect(cyclone_dsn) as conn:  # a new session: zone America/Los_Angeles
        assert conn.execute("SHOW timezone").fetchone()["TimeZone"] == "America/Los_Angeles"
        rows = {r["node"]: r for r in conn.execute(
            "SELECT s.node, s.state, s.due_at, s.finished_at, s.output, r.created_at AS enqueued_at, "
            "       s.due_at::text AS shown, extract(epoch FROM s.due_at)::numeric AS epoch, "
            "       extract(epoch FROM ('2026-10-31 09:00:00+00'::timestamptz + s.timer_delay)"
            "                      - '2026-10-31 09:00:00+00'::timestamptz)::numeric AS delay_across_fall_back "
            "  FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id WHERE s.run_id = %s", (run_id,)).fetchall()}
    enqueued_at = rows["utc_first"]["enqueued_at"]  # the enqueue transaction's now()
    for name, instant in expected.items():
        row = rows[name]
        assert utc(row["due_at"]) == instant, name                 # aware datetimes, same instant
        assert row["due_at"].utcoffset() == instant.astimezone(LA).utcoffset(), name  # read back in LA time
        assert row["epoch"] == int(instant.timestamp()), name      # and the same epoch
        if instant <= utc(enqueued_at):
            # already due when reached (this host's date is past 2026-11-01): fired once, at enqueue,
            # not before its instant, with the instant as output
            assert row["state"] == "completed" and utc(row["finished_at"]) == utc(enqueued_at) >= instant, name
            assert utc(dt.datetime.fromisoformat(row["output"])) == instant, name
        else:
            assert (row["state"], row["finished_at"], row["output"]) == ("waiting_timer", None, None), name
    assert rows["utc_first"]["shown"] == "2026-11-01 01:30:00-07"
    assert rows["utc_second"]["shown"] == "2026-11-01 01:30:00-08"
    assert utc(rows["utc_second"]["due_at"]) - utc(rows["utc_first"]["due_at"]) == dt.timedelta(hours=1)
    if first <= utc(enqueued_at):  # the outputs were rendered by the enqueuing session, in LA time
        assert rows["utc_first"]["output"] == rows["la_fold0"]["output"] == "2026-11-01T01:30:00-07:00"
        assert rows["utc_second"]["output"] == rows["la_fold1"]["output"] == "2026-11-01T01:30:00-08:00"
    # seconds= is an absolute duration: 86400 s stays 86400 s across the 25-hour local day
    assert rows["day"]["delay_across_fall_back"] == 86400
    if first <= utc(enqueued_at):  # reached when utc_first fired: due exactly 86400 s later
        assert rows["day"]["state"] == "waiting_timer"
        assert utc(rows["day"]["due_at"]) - utc(rows["utc_first"]["finished_at"]) == dt.timedelta(days=1)
    else:
        assert (rows["day"]["state"], rows["day"]["due_at"]) == ("pending", None)
    status = env.status(run_id)
    assert all(utc(status.steps[n].due_at) == instant for n, instant in expected.items())
    # nothing fires twice: a second look (another advance of the run) changes nothing
    assert env.client().signal(run_id, "unrelated", None) is True  # runs the run's advance again
    again = env.status(run_id)
    assert {n: (s.state, s.finished_at, s.output) for n, s in again.steps.items()} == \
        {n: (s.state, s.finished_at, s.output) for n, s in status.steps.items()}
    env.client().cancel(run_id)


# -- 5. pause, resume, cancel ---------------------------------------------------------------------------


@pytest.mark.parametrize("client_kind", ["Client", pytest.param("AsyncClient", marks=pytest.mark.long)])  # 5 s each
def test_pause_holds_everything_but_the_running_step_and_resume_restores(cyclone_env_factory, tmp_path, client_kind):
    env = cyclone_env_factory(workers=1)
    if client_kind == "AsyncClient":
        use_async_client(env)
    env.mux().register(wh.pausable)
    release = tmp_path / "release-slow"
    inp = run_input(tmp_path, hold={"slow": str(release)})
    folder = Path(inp["dir"])
    env.start_worker()
    run_id = env.enqueue(wh.pausable, inp)
    env.wait_for_state(run_id, "slow", "running")
    before = states(env.status(run_id))
    assert before == {"slow": "running", "other": "available", "gate": "waiting_signal", "tick": "waiting_timer",
                      "after_slow": "pending", "final": "pending"}

    client = env.client()
    assert client.pause(run_id) == 5
    run = env.status(run_id)
    assert run.state == "paused"
    assert {n: (s.state, s.paused_from) for n, s in run.steps.items()} == {
        "slow": ("running", None), "other": ("paused", "available"), "gate": ("paused", "waiting_signal"),
        "tick": ("paused", "waiting_timer"), "after_slow": ("paused", "pending"), "final": ("paused", "pending"),
    }
    with pytest.raises(cy.InvalidTransition):
        client.pause(run_id)

    # the running step finishes; its successor stays held, now remembering it is ready
    release.write_text("go")
    slow = env.wait_for_state(run_id, "slow", "completed", timeout=15)
    assert slow.output["node"] == "slow"
    tick_due = env.status(run_id).steps["tick"].due_at
    wait_until(lambda: db_now(env.dsn) > tick_due + dt.timedelta(seconds=0.5), 10, "the paused timer to be overdue")
    run = env.status(run_id)
    assert run.state == "paused"
    assert {n: (s.state, s.paused_from) for n, s in run.steps.items()} == {
        "slow": ("completed", None), "other": ("paused", "available"), "gate": ("paused", "waiting_signal"),
        "tick": ("paused", "waiting_timer"), "after_slow": ("paused", "available"), "final": ("paused", "pending"),
    }
    assert [starts(folder, n) for n in ("slow", "other", "after_slow", "final")] == [1, 0, 0, 0]

    # resume with the supervisor frozen, so the restored states can be read before any claim
    env.freeze_worker()
    try:
        resumed_at = db_now(env.dsn)
        assert client.resume(run_id) == 5
        run = env.status(run_id)
        assert run.state == "running"
        assert {n: (s.state, s.paused_from) for n, s in run.steps.items()} == {
            "slow": ("completed", None), "other": ("available", None), "gate": ("waiting_signal", None),
            "tick": ("completed", None),  # restored to waiting_timer, overdue, so it fired at resume
            "after_slow": ("available", None), "final": ("pending", None),
        }
        assert run.steps["tick"].finished_at >= resumed_at  # it did not fire while paused
        with pytest.raises(cy.InvalidTransition):
            client.resume(run_id)
    finally:
        env.thaw_worker()

    env.wait_for_state(run_id, "other", "completed", timeout=15)
    env.wait_for_state(run_id, "after_slow", "completed", timeout=15)
    assert env.status(run_id).steps["final"].state == "pending"  # still waiting for the gate
    assert client.signal(run_id, "gate", "open") is True
    run = env.run_until_complete(run_id, timeout=15)
    assert run.state == "completed" and set(states(run).values()) == {"completed"}
    assert [starts(folder, n) for n in ("slow", "other", "after_slow", "final")] == [1, 1, 1, 1]
    assert set(run.steps["final"].output["upstream"]) == {"after_slow", "other", "gate", "tick"}
    assert run.steps["final"].output["upstream"]["gate"] == "open"


def test_cancel_of_a_paused_run_cancels_everything_in_one_transaction(cyclone_env_factory, tmp_path, client_kind):
    env = cyclone_env_factory(workers=1)
    if client_kind == "AsyncClient":
        use_async_client(env)
    env.mux().register(wh.pausable)
    inp = run_input(tmp_path, hold={"slow": str(tmp_path / "never")})
    folder = Path(inp["dir"])
    env.start_worker()
    run_id = env.enqueue(wh.pausable, inp)
    env.wait_for_state(run_id, "slow", "running")
    client = env.client()
    assert client.pause(run_id) == 5
    assert env.status(run_id).state == "paused"

    assert client.cancel(run_id) == 6  # the running step and the five paused ones
    run = env.status(run_id)
    assert run.state == "cancelled"
    assert {n: (s.state, s.paused_from) for n, s in run.steps.items()} == {
        n: ("cancelled", None) for n in ("slow", "other", "gate", "tick", "after_slow", "final")
    }
    # one transaction: the same now() on the run and on every step
    assert {s.finished_at for s in run.steps.values()} == {run.finished_at}
    with pytest.raises(cy.InvalidTransition):
        client.resume(run_id)
    with pytest.raises(cy.InvalidTransition):
        client.cancel(run_id)

    # the in-flight handler learns of it on its next heartbeat; its late end changes nothing
    wait_until(lambda: lines(folder, "slow", "cancelled"), 5, "the slow handler to see the cancel")
    # its end settled (no child busy), then the writer took claims after it
    wait_until(lambda: supervisors_idle(env.dsn), 10, "the cancelled attempt to be settled")
    supervisor_turns(env.dsn, "claim_statements", 2)
    after = env.status(run_id)
    # (only dead_by may move: the cancelled attempt's death is recorded once its child is gone)
    assert dataclasses.replace(after, steps={n: dataclasses.replace(s, dead_by=None) for n, s in after.steps.items()}) \
        == dataclasses.replace(run, steps={n: dataclasses.replace(s, dead_by=None) for n, s in run.steps.items()})
    assert [starts(folder, n) for n in ("slow", "other", "after_slow", "final")] == [1, 0, 0, 0]


def test_a_step_that_fails_while_paused_is_not_retried_until_resume(api_env, tmp_path):
    release = tmp_path / "release-flaky"
    marker = tmp_path / "fixed"
    inp = run_input(tmp_path, hold={"flaky": str(release)}, fail_until={"flaky": str(marker)})
    folder = Path(inp["dir"])
    run_id = api_env.enqueue(wh.fragile, inp)
    api_env.start_worker()
    api_env.wait_for_state(run_id, "flaky", "running", timeout=15)
    client = api_env.client()
    client.pause(run_id)
    release.write_text("go")  # attempt 1 fails while the run is paused
    wait_until(lambda: lines(folder, "flaky", "fail"), 10, "flaky's first attempt to fail")
    wait_until(lambda: api_env.status(run_id).steps["flaky"].paused_from == "available", 10, "the failure written")
    supervisor_turns(api_env.dsn, "claim_statements", 3)  # polls: a retry claimable now would have been claimed
    flaky = api_env.status(run_id).steps["flaky"]
    assert starts(folder, "flaky") == 1, "the failed step was retried while its run was paused"
    assert (flaky.state, flaky.paused_from, flaky.attempt) == ("paused", "available", 2)
    marker.write_text("fixed")
    client.resume(run_id)
    run = api_env.run_until_complete(run_id)
    assert run.state == "completed" and starts(folder, "flaky") == 2


# -- 6. discard and retry -----------------------------------------------------------------------------------


def test_discarded_step_discards_the_run_and_retry_completes_it(api_env, tmp_path):
    marker = tmp_path / "fixed"
    release = tmp_path / "release-side"
    inp = run_input(tmp_path, fail_until={"flaky": str(marker)}, hold={"side": str(release)})
    folder = Path(inp["dir"])
    run_id = api_env.enqueue(wh.fragile, inp)
    api_env.start_worker()
    flaky = api_env.wait_for_state(run_id, "flaky", "discarded", timeout=15)
    assert (flaky.attempt, flaky.max_attempts, flaky.error_kind) == (2, 2, "error")
    # side is still running: something can progress, so the run is not discarded yet
    run = api_env.status(run_id)
    assert run.state == "running" and run.steps["side"].state == "running"
    release.write_text("go")
    run = wait_run_state(api_env, run_id, "discarded")
    assert states(run) == {"start": "completed", "flaky": "discarded", "side": "completed", "finish": "pending"}
    assert run.finished_at is not None
    assert starts(folder, "finish") == 0

    marker.write_text("fixed")
    api_env.freeze_worker()  # else the reopened run may complete before it is read back
    try:
        assert api_env.client().retry(run_id) == 1
        reopened = api_env.status(run_id)
    finally:
        api_env.thaw_worker()
    assert reopened.state == "running" and reopened.finished_at is None
    run = api_env.run_until_complete(run_id)
    assert run.state == "completed" and set(states(run).values()) == {"completed"}
    flaky = run.steps["flaky"]
    assert (flaky.attempt, flaky.max_attempts, flaky.error, flaky.error_kind) == (3, 3, None, None)
    assert [e["attempt"] for e in flaky.errors] == [1, 2]
    assert [starts(folder, n) for n in ("start", "flaky", "side", "finish")] == [1, 3, 1, 1]
    assert run.steps["finish"].output["upstream"] == {"flaky": flaky.output, "side": run.steps["side"].output}
    with pytest.raises(cy.InvalidTransition):
        api_env.client().retry(run_id)


# -- idempotency keys ------------------------------------------------------------------------------------------


def test_idempotency_key_returns_the_same_run(api_env, tmp_path):
    inp = run_input(tmp_path)
    first = api_env.enqueue(wh.diamond, inp, idempotency_key="order-1")
    again = api_env.enqueue(wh.diamond, {**inp, "x": 7}, idempotency_key="order-1")
    other = api_env.enqueue(wh.diamond, {"x": 1}, idempotency_key="order-2")
    assert first == again and other != first
    with connect(api_env.dsn) as conn:
        runs = conn.execute("SELECT id::text AS id, input FROM cyclone_runs WHERE idempotency_key = 'order-1'").fetchall()
        steps = conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE run_id = %s", (first,)).fetchone()["n"]
    assert [r["id"] for r in runs] == [first] and runs[0]["input"]["x"] == 42 and steps == 4
    run = api_env.run_until_complete(first)
    assert run.state == "completed" and run.idempotency_key == "order-1"
    assert api_env.enqueue(wh.diamond, inp, idempotency_key="order-1") == first  # also once finished
    assert starts(Path(inp["dir"]), "a") == 1


CONCURRENT_ENQUEUE = textwrap.dedent("""
    import os, sys, time
    import cyclone_mp as cy
    import workflow_handlers as wh

    dsn, key, ready, go, who = sys.argv[1:6]
    client = cy.Client(dsn)
    client.runs(limit=1)  # open the pool before the race
    open(ready, "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.001)
    run_id = client.enqueue(wh.diamond, {"who": int(who)}, idempotency_key=key)
    client.close()
    print(run_id)
""")


def test_idempotency_key_under_concurrent_enqueues_from_several_processes(cyclone_dsn, tmp_path):
    n = 4
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT_DIR), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_ENQUEUE, cyclone_dsn, "shared-key", str(tmp_path / f"ready-{i}"), str(go), str(i)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        )
        for i in range(n)
    ]
    try:
        wait_until(lambda: all((tmp_path / f"ready-{i}").exists() for i in range(n)), 30, "every enqueuer to be ready")
        go.write_text("go")
        results = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    ids = [out.strip() for out, _ in results]
    assert len(ids) == n and len(set(ids)) == 1, ids
    with connect(cyclone_dsn) as conn:
        runs = conn.execute("SELECT id::text AS id, input FROM cyclone_runs").fetchall()
        nodes = conn.execute("SELECT node FROM cyclone_steps WHERE run_id = %s ORDER BY node", (ids[0],)).fetchall()
    assert [r["id"] for r in runs] == [ids[0]]
    assert runs[0]["input"]["who"] in range(n)
    assert [r["node"] for r in nodes] == ["a", "b", "c", "d"]
