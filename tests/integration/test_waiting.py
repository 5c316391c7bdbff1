"""Waiting for a run (issue 24): ``client.wait`` and ``client.result`` with each client,
woken by LISTEN/NOTIFY on run completion (sql/fragments.sql's run_ended_expr), polling as the
fallback, and one listening connection for 1,000 waits (acceptance 3; its latency is
measured in benchmarks/wait.py, never here)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import psycopg
import pytest

import cyclone_mp as cy
from cyclone_mp import waiting
from cyclone_mp.store import connect
from cyclone_mp.testing.env import through, upstream_of
from cyclone_mp.testing.network import FaultProxy

import handlers as h
import workflow_handlers as wh
from clients import SyncOverAsync
from waiting import wait_for


def sessions(dsn: str, application: str) -> int:
    with connect(dsn) as conn:
        return conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                            " AND application_name = %s", (application,)).fetchone()["n"]


def test_wait_and_result_of_every_ending(api_env, tmp_path):
    client = api_env.client()
    api_env.mux().register(h.ok, h.raises, wh.diamond)
    done = api_env.enqueue(h.ok, {"x": 1})
    failed = api_env.enqueue(h.raises, {})
    flow = api_env.enqueue(wh.diamond, {"dir": str(tmp_path), "x": 42})
    cancelled = api_env.enqueue(h.ok, {}, delay=3600)
    api_env.start_worker()
    status = client.wait(done, timeout=30)
    assert (status.id, status.state, status.terminal) == (done, "completed", True)
    assert client.result(done[:8], timeout=30) == {"echo": {"x": 1}, "attempt": 1, "run_id": done}
    outputs = client.result(flow, timeout=30)
    assert sorted(outputs) == ["a", "b", "c", "d"] and outputs["d"]["node"] == "d"
    with pytest.raises(cy.RunFailed, match="was discarded: raises: error: bad value on attempt 3") as failure:
        client.result(failed, timeout=30)
    assert failure.value.status.state == "discarded" and len(failure.value.status.step.errors) == 3
    with pytest.raises(cy.WaitTimeout, match=r"has not started after 0.2s: it is scheduled for 20\d\d-"):
        client.wait(cancelled, timeout=0.2)
    client.cancel(cancelled)
    with pytest.raises(cy.RunCancelled, match="was cancelled"):
        client.result(cancelled, timeout=5)
    with pytest.raises(cy.RunNotFound):
        client.wait("00000000-0000-0000-0000-000000000000", timeout=1)


def test_a_wait_is_woken_by_the_notification_not_the_poll(api_env, monkeypatch):
    """With the poll 60 s away, only the NOTIFY can end the wait within a second."""
    monkeypatch.setattr(waiting, "POLL_LISTENING", 60.0)
    client = api_env.client()
    run_id = api_env.enqueue(h.sleeper, {"seconds": 0.5})
    api_env.start_worker()
    started = time.monotonic()
    status = client.wait(run_id, timeout=20)
    assert status.state == "completed"
    assert time.monotonic() - started < 10
    woke = time.time()
    assert woke - status.finished_at.timestamp() < 1.0


def test_without_notifications_the_poll_ends_the_wait(api_env, monkeypatch):
    """LISTEN on a channel nobody notifies (as behind a proxy that drops them): the
    fallback poll still ends the wait."""
    monkeypatch.setattr(waiting, "RUNS_CHANNEL", "cyclone_mp_nobody_notifies_this")
    monkeypatch.setattr(waiting, "POLL_LISTENING", 0.3)
    client = api_env.client()
    run_id = api_env.enqueue(h.ok, {})
    api_env.start_worker()
    assert client.wait(run_id, timeout=20).state == "completed"


def test_every_way_a_run_ends_notifies(cyclone_env, tmp_path):
    """A notification names each run that ended, once: a completion (the supervisor's
    CAS), a discard, a cancel, a workflow's refresh; none for a pause."""
    client = cyclone_env.client()
    cyclone_env.mux().register(h.ok, h.permanent, wh.diamond)
    # named as the waiters' listener: runs notify only while one is connected (issue 23)
    listener = psycopg.connect(cyclone_env.dsn, autocommit=True, application_name=waiting.LISTENER_NAME)
    try:
        listener.execute(f"LISTEN {waiting.RUNS_CHANNEL}")
        paused = client.enqueue(h.ok, {}, delay=3600)
        client.pause(paused)
        cancelled = client.enqueue(h.ok, {}, delay=3600)
        client.cancel(cancelled)
        ok = client.enqueue(h.ok, {})
        bad = client.enqueue(h.permanent, {})
        flow = client.enqueue(wh.diamond, {"dir": str(tmp_path)})
        for run_id in (ok, bad, flow):
            cyclone_env.run_until_complete(run_id)
        named: list[str] = []
        deadline = time.monotonic() + 5
        while not {cancelled, ok, bad, flow} <= set(named) and time.monotonic() < deadline:
            for note in listener.notifies(timeout=0.2, stop_after=1):
                named.extend(waiting.run_ids(note.payload))
        assert sorted(named) == sorted([cancelled, ok, bad, flow])  # each once, the paused run never
    finally:
        listener.close()


def test_runs_notify_only_while_a_waiting_listener_is_connected(cyclone_env):
    """A NOTIFY makes its commit wait for every other notifying commit (issue 23): a run
    that ends while no waiting listener (application_name 'cyclone_mp waiting') is
    connected to its database notifies nobody; one that ends while one is, notifies."""
    client = cyclone_env.client()
    cyclone_env.mux().register(h.ok)
    other = psycopg.connect(cyclone_env.dsn, autocommit=True, application_name="someone else")
    try:
        other.execute(f"LISTEN {waiting.RUNS_CHANNEL}")
        cyclone_env.start_worker()
        quiet = client.enqueue(h.ok, {"n": 1})
        assert cyclone_env.run_until_complete(quiet).state == "completed"
        assert [n.payload for n in other.notifies(timeout=1.0, stop_after=1)] == []
        named = psycopg.connect(cyclone_env.dsn, autocommit=True, application_name=waiting.LISTENER_NAME)
        try:
            heard = client.enqueue(h.ok, {"n": 2})
            assert cyclone_env.run_until_complete(heard).state == "completed"
            assert [n.payload for n in other.notifies(timeout=5.0, stop_after=1)] == [heard]
        finally:
            named.close()
    finally:
        other.close()


def test_a_run_that_ended_unheard_as_the_listener_connected_is_found_by_the_catch_up(api_env, monkeypatch):
    """A statement that ends a run looked for a listener before the waiter's connected (so
    it notifies nobody) and commits after the waiter's own look: the listener's poll
    CATCH_UP seconds after it starts listening ends the wait (POLL_LISTENING made 60 s)."""
    from cyclone_mp.store import Q

    monkeypatch.setattr(waiting, "POLL_LISTENING", 60.0)
    looks: list[tuple[str, str]] = []  # (run id, state) of every waiter's own look (either client's)
    sync_status, async_status = cy.Client._status_within, cy.AsyncClient._status_within

    def sync_look(self, run_id, within):
        status = sync_status(self, run_id, within)
        looks.append((run_id, status.state))
        return status

    async def async_look(self, run_id, within):
        status = await async_status(self, run_id, within)
        looks.append((run_id, status.state))
        return status

    monkeypatch.setattr(cy.Client, "_status_within", sync_look)
    monkeypatch.setattr(cy.AsyncClient, "_status_within", async_look)
    client = api_env.client()
    run_id = api_env.enqueue(h.ok, {})
    ender = psycopg.connect(api_env.dsn)  # one transaction, not committed yet
    try:
        ender.execute("UPDATE cyclone_steps SET state = 'completed', finished_at = now() WHERE run_id = %s", (run_id,))
        ender.execute(f"UPDATE cyclone_runs r SET state = 'completed', finished_at = now() WHERE r.id = %s"
                      f" RETURNING {Q['run_ended_expr']}", (run_id,))  # no listener yet: no NOTIFY
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(status=client.wait(run_id, timeout=30)))
        waiter.start()
        wait_for(lambda: sessions(api_env.dsn, waiting.LISTENER_NAME) == 1, 10, "the listener")
        wait_for(lambda: (run_id, "running") in looks, 10, "the waiter's own look to see the run running")
        ender.commit()
        committed = time.monotonic()
        waiter.join(30)
        assert result["status"].state == "completed"
        assert time.monotonic() - committed < 5  # the catch-up, not the 60 s poll
    finally:
        ender.close()


def test_a_thousand_async_waits_share_one_listening_connection(cyclone_env_factory):
    """Acceptance 3 (the connection part): 1,000 concurrent ``await client.wait`` in one
    process use one listening connection, and each returns its own run's status."""
    env = cyclone_env_factory(workers=2)
    env.mux().register(h.ok)
    ids = env.client().enqueue_many(h.ok, [{"i": i} for i in range(1000)], delay=2)
    peak = {"listening": 0, "pool": 0}

    async def main() -> list[cy.RunStatus]:
        async with cy.AsyncClient(env.dsn, env.mux()) as client:
            waits = [asyncio.ensure_future(client.wait(run_id, timeout=60)) for run_id in ids]
            await asyncio.sleep(0.5)
            peak["listening"] = await asyncio.to_thread(sessions, env.dsn, "cyclone_mp waiting")
            env.start_worker()
            while not all(w.done() for w in waits):
                peak["listening"] = max(peak["listening"], await asyncio.to_thread(sessions, env.dsn, "cyclone_mp waiting"))
                await asyncio.sleep(0.1)
            return [w.result() for w in waits]

    statuses = asyncio.run(main())
    assert [s.id for s in statuses] == ids
    assert all(s.state == "completed" and s.step.output["echo"] == {"i": i} for i, s in enumerate(statuses))
    assert peak["listening"] == 1


def test_many_threads_waiting_on_a_sync_client_share_one_listening_connection(cyclone_env_factory):
    env = cyclone_env_factory(workers=2)
    env.mux().register(h.ok)
    client = env.client()
    ids = client.enqueue_many(h.ok, [{"i": i} for i in range(200)], delay=1.5)
    results: dict[str, str] = {}

    def wait_one(run_id: str) -> None:
        results[run_id] = client.wait(run_id, timeout=60).state

    threads = [threading.Thread(target=wait_one, args=(run_id,)) for run_id in ids]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(client._waiter().book.slots) == len(ids), 20, "every thread to wait")
    assert sessions(env.dsn, "cyclone_mp waiting") == 1
    env.start_worker()
    for thread in threads:
        thread.join(60)
    assert results == {run_id: "completed" for run_id in ids}
    assert sessions(env.dsn, "cyclone_mp waiting") == 1
    client.close()
    wait_for(lambda: sessions(env.dsn, "cyclone_mp waiting") == 0, 5, "the listening connection to close")


def test_a_wait_outlives_the_loss_of_its_listening_connection(api_env):
    """The server ends the listening session (a restart, a proxy): the listener connects
    and listens again, reads what ended meanwhile, and the wait still returns."""
    client = api_env.client()
    run_id = api_env.enqueue(h.ok, {}, delay=2)
    api_env.start_worker()
    outcome: dict[str, str] = {}

    def wait() -> None:
        outcome["state"] = client.wait(run_id, timeout=30).state

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(lambda: sessions(api_env.dsn, "cyclone_mp waiting") == 1, 10, "the listening connection")
    with connect(api_env.dsn) as conn:
        ended = conn.execute("SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
                             " WHERE datname = current_database() AND application_name = 'cyclone_mp waiting'"
                             ).fetchone()["n"]
    assert ended == 1
    waiter.join(30)
    assert outcome == {"state": "completed"}
    assert sessions(api_env.dsn, "cyclone_mp waiting") == 1  # listening again


# -- a link that stops answering while TCP stays up ----------------------------------------------
#
# A wedged PgBouncer or proxy, or a frozen backend: the client's connections stay open and
# acknowledged, and nothing answers. The wait's own timer bounds every read it makes.


def test_read_bounds_double_after_each_stall_and_never_pass_the_end():
    assert waiting.read_bound(0, None, 100.0) == waiting.STALLED_AFTER
    assert waiting.read_bound(2, None, 100.0) == 4 * waiting.STALLED_AFTER
    assert waiting.read_bound(50, None, 100.0) == waiting.STALLED_AFTER_MAX
    assert waiting.read_bound(0, 101.0, 100.0) == 1.0  # the wait's end comes first
    assert waiting.read_bound(0, 99.0, 100.0) == 0.05  # past it: one short try still


def test_a_wait_whose_reads_never_answered_says_so():
    message = waiting.timeout_message("r1", None, 5)
    assert message == "run r1 was not seen to end within 5s: the database did not answer (its connections stalled)"


@contextlib.contextmanager
def proxied(kind: str, env):
    """A client of ``kind`` ("Client" or "AsyncClient", the latter driven from a loop of
    its own) whose every connection goes through a FaultProxy: ``(client, proxy)``."""
    proxy = FaultProxy(upstream_of(env.dsn))
    dsn = through(env.dsn, proxy)
    client = cy.Client(dsn, env.mux()) if kind == "Client" else SyncOverAsync(cy.AsyncClient(dsn, env.mux()))
    try:
        yield client, proxy
    finally:
        proxy.heal()
        client.close()
        proxy.close()


def bounded(fn, limit: float):
    """Call ``fn`` on a thread of its own; ``(seconds it took, what it returned or raised)``,
    or fail the test after ``limit`` seconds (it never returned: the bug itself)."""
    box: dict = {}

    def call() -> None:
        started = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["value"] = exc
        box["took"] = time.monotonic() - started

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"the call had not returned after {limit:g}s")
    return box["took"], box["value"]


@pytest.mark.parametrize("kind", ["Client", pytest.param("AsyncClient", marks=pytest.mark.long)])
def test_wait_and_result_keep_their_deadline_when_every_connection_stops_answering(cyclone_env, kind):
    """Every connection of the client, open and new, black-holed (TCP up, nothing
    answers): ``wait`` and ``result`` with ``timeout=5`` raise WaitTimeout within 6 s."""
    cyclone_env.mux().register(h.ok)
    run_id = cyclone_env.enqueue(h.ok, {}, delay=3600)
    with proxied(kind, cyclone_env) as (client, proxy):
        with pytest.raises(cy.WaitTimeout):  # the pool and the listener are connected
            client.wait(run_id, timeout=0.5)
        proxy.partition()
        for call in (client.wait, client.result):
            took, outcome = bounded(lambda: call(run_id, timeout=5), 30)
            assert isinstance(outcome, cy.WaitTimeout), outcome
            assert took < 6.0, f"{call.__name__} returned after {took:.1f}s"


@pytest.mark.parametrize("kind,timeout,seconds", [  # 8 s each, the 5 s runs: long (CI runs the long ones)
    ("Client", 30, 1.0), pytest.param("Client", None, 5.0, marks=pytest.mark.long),
    pytest.param("AsyncClient", 30, 5.0, marks=pytest.mark.long), ("AsyncClient", None, 1.0)])
def test_a_run_that_ends_while_the_open_connections_are_frozen_is_seen_by_a_fresh_one(cyclone_env, kind, timeout,
                                                                                     seconds):
    """The connections open when the link froze never answer again; new ones work. A run
    that completes meanwhile is seen as completed: the wait's reads and its listener
    give up on their frozen connections and read again on fresh ones (``timeout=None``
    too: it reconnects and goes on waiting). A run of 1 s ends before the wait's first
    look gives up on its frozen connection; one of 5 s ends after it, and is heard by
    the listener on its fresh connection."""
    cyclone_env.mux().register(h.sleeper)
    run_id = cyclone_env.enqueue(h.sleeper, {"seconds": seconds})
    with proxied(kind, cyclone_env) as (client, proxy):
        with pytest.raises(cy.WaitTimeout):  # the pool and the listener are connected
            client.wait(run_id, timeout=0.5)
        proxy.freeze()
        cyclone_env.start_worker()  # on a direct connection
        took, outcome = bounded(lambda: client.result(run_id, timeout=timeout), 60)
        assert outcome == {"slept": seconds}, outcome
        assert took < seconds + 3 * waiting.STALLED_AFTER, took
