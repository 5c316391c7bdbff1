"""A primary that fails over while supervisors run (issue 22, acceptance 2).

A real primary and a real streaming standby (``pg_basebackup -R``, synchronous
replication), both from the embedded server's PostgreSQL binaries; the supervisors' DSN
names both hosts with ``target_session_attrs=read-write``. The primary is killed
(``pg_ctl stop -m immediate``) while 3 supervisors work, the standby is promoted
(``pg_ctl promote``), and every supervisor, without a restart, reconnects to it: all
steps complete, none runs twice, and completions stop for less than ``lease_ttl`` + 5 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from cyclone_mp.embedded import EmbeddedServer
from cyclone_mp.errors import DatabaseReadOnly
from cyclone_mp.store import Store, classify, connect, create_database, database_dsn
from cyclone_mp.testing import Env

import handlers as h

LEASE_TTL = 10.0


@dataclasses.dataclass
class Pair:
    """A primary, its synchronous standby, and the multi-host DSN of both."""

    primary: EmbeddedServer
    standby: EmbeddedServer
    dsn: str  # database "cyclone" on either host, read-write only
    standby_dsn: str  # the standby alone


def _socket_dir(server: EmbeddedServer) -> str:
    return str(conninfo_to_dict(server.uri())["host"])


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(psycopg.Error):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout} s")
        time.sleep(0.05)


@pytest.fixture
def pair() -> Iterator[Pair]:
    root = tempfile.mkdtemp(prefix="cyclone-failover-")
    os.chmod(root, 0o755)  # the servers run as their own user when we are root
    primary, standby = EmbeddedServer(os.path.join(root, "primary")), EmbeddedServer(os.path.join(root, "standby"))
    try:
        uri = primary.start()
        store = Store.open(create_database(uri, "cyclone"))
        try:
            store.migrate()
        finally:
            store.close()
        standby.init_standby(primary)
        standby.start()
        with psycopg.connect(uri, autocommit=True) as conn:  # commits wait for the standby from now on
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")
            _wait(lambda: conn.execute("SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'").fetchone(),
                  30, "the standby is not synchronous")
        hosts = f"{_socket_dir(primary)},{_socket_dir(standby)}"
        yield Pair(primary, standby, f"postgresql://postgres@/cyclone?host={hosts}&target_session_attrs=read-write",
                   database_dsn(standby.uri(), "cyclone"))
    finally:
        for server in (standby, primary):
            server.destroy()  # stops its postmaster by pid (none left running), removes its files
            assert server.pid() is None
        shutil.rmtree(root, ignore_errors=True)


def _completed(dsn: str) -> int:
    with psycopg.connect(dsn, connect_timeout=2) as conn:
        return conn.execute("SELECT count(*) FROM cyclone_steps WHERE state = 'completed'").fetchone()[0]


def run_failover(pair: Pair, tmp_path: Path, *, steps: int, supervisors: int, workers: int, seconds: float,
                 kill_after: int) -> dict:
    """Run ``steps`` steps on ``supervisors`` supervisors, fail over after ``kill_after``
    completions, check acceptance 2 and return the numbers measured."""
    log = tmp_path / "executions"
    env = Env(pair.dsn, workers=workers, lease_ttl=LEASE_TTL, kill_grace=1.0, poll_interval=(0.05, 0.2))
    try:
        env.mux().register(h.logged)
        run_ids = env.client().enqueue_many(h.logged, [{"log": str(log), "seconds": seconds, "n": i}
                                                       for i in range(steps)])
        handles = [env.start_worker() for _ in range(supervisors)]
        pids = [handle.pid for handle in handles]
        _wait(lambda: _completed(pair.dsn) >= kill_after, 60, f"{kill_after} steps did not complete")
        killed_at = time.monotonic()
        pair.primary.stop(mode="immediate")
        pair.standby.promote()
        promoted_at = time.monotonic()
        with psycopg.connect(pair.dsn) as conn:
            promoted_db = conn.execute("SELECT now()").fetchone()[0]
        _wait(lambda: _completed(pair.dsn) >= steps, 120, "the steps did not all complete")
        runs = [env.status(run_id) for run_id in run_ids]  # the Env's client reconnected too
        assert all(w.alive() for w in handles) and [w.pid for w in handles] == pids  # no restart
        with psycopg.connect(pair.dsn) as conn:
            rows = conn.execute("SELECT finished_at, lease_owner, reclaims FROM cyclone_steps"
                                " ORDER BY finished_at").fetchall()
            # each supervisor's registry row, written on the new primary by that supervisor
            reconnected = {r[0] for r in conn.execute("SELECT id FROM cyclone_workers WHERE heartbeat_at > %s",
                                                      (promoted_db,))}
    finally:
        env.close()
    # all complete, no attempt consumed, and every handler ran to its end exactly once
    assert [r.state for r in runs] == ["completed"] * steps
    assert all(r.step.attempt == 1 for r in runs)
    executions = [line.split()[0] for line in log.read_text().splitlines()]
    assert sorted(executions) == sorted(run_ids)
    finished = [row[0] for row in rows]
    gap = max((b - a).total_seconds() for a, b in zip(finished, finished[1:]))
    assert gap < LEASE_TTL + 5.0, f"completions stopped for {gap:.1f} s"
    after = [row for row in rows if row[0] > promoted_db]
    # Each one reconnected to the new primary, and the work went on there. (Not "each one
    # finished a step there": with prefetch, the first two back could take the ~2 s of
    # steps left before a third, slower on a loaded machine, was back.)
    assert reconnected >= {w.supervisor_id for w in handles}, reconnected
    assert after and {row[1] for row in after} <= {w.supervisor_id for w in handles}
    return {"gap": round(gap, 2), "promote": round(promoted_at - killed_at, 2),
            "first_after_promotion": round((after[0][0] - promoted_db).total_seconds(), 2),
            "reclaims": sum(row[2] for row in rows)}


@pytest.mark.long  # 5 s: a standby promoted (CI runs the long ones)
def test_failover_to_a_promoted_standby_short(pair, tmp_path, capsys):
    assert_a_standby_is_refused_as_read_only(pair)  # on the same pair: one cluster setup less
    # 0.2 s steps: the 45 left take about 3 s, so a loaded machine cannot finish them all
    # before the promotion (then no completion would be after it to check)
    numbers = run_failover(pair, tmp_path, steps=60, supervisors=3, workers=1, seconds=0.2, kill_after=15)
    with capsys.disabled():
        print(f"\nfailover (60 steps, 3 supervisors): {numbers}")


@pytest.mark.slow
def test_failover_of_300_steps_on_3_supervisors(pair, tmp_path, capsys):
    numbers = run_failover(pair, tmp_path, steps=300, supervisors=3, workers=2, seconds=0.1, kill_after=100)
    with capsys.disabled():
        print(f"\nfailover (300 steps, 3 supervisors x 2 children): {numbers}")


def assert_a_standby_is_refused_as_read_only(pair: Pair) -> None:
    """A connection that reaches a standby (a DSN without target_session_attrs) is a
    read-only outage at once, and a write there is too: never a bug-level error."""
    with pytest.raises(DatabaseReadOnly):
        connect(pair.standby_dsn)
    with psycopg.connect(pair.standby_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute("UPDATE cyclone_steps SET priority = 0 WHERE false")
        assert isinstance(classify(info.value), DatabaseReadOnly)


class _ReadOnlyStore:
    """A connection that opens fine and whose every call is refused: a host still in recovery."""

    broken = False

    def refuse(self) -> None:
        raise DatabaseReadOnly("database read-only: cannot execute UPDATE in a read-only transaction (SQLSTATE 25006)")

    def close(self) -> None:
        pass


def test_a_host_that_connects_then_refuses_every_write_backs_off():
    """No tight error loop (issue 22): a connect that succeeds does not reset the backoff;
    only a call that succeeds does, so connect-then-refuse cycles slow down to the cap."""
    from cyclone_mp.config import Config
    from cyclone_mp.dbloop import DatabaseThread
    from cyclone_mp.errors import DatabaseError

    connects: list[float] = []

    class Part(DatabaseThread):
        def turn(self, now: float) -> float:
            if self.db_ok:
                with contextlib.suppress(DatabaseError):
                    self.call(1.0, lambda store: store.refuse())
            return now + 0.01

    part = Part("test part", "", Config.build(lease_ttl=10.0), owner="test", bound=1.0)

    def open_store():
        connects.append(time.monotonic())
        return _ReadOnlyStore()

    part._open_store = open_store
    part.start()
    time.sleep(1.6)
    assert part.stop(5.0)
    gaps = [round(b - a, 2) for a, b in zip(connects, connects[1:])]
    assert 3 <= len(connects) <= 6, gaps  # 0, 0.1, 0.3, 0.7, 1.5 s: not one every 0.1 s
    assert all(b > a for a, b in zip(gaps, gaps[1:])), gaps  # each wait longer than the one before


def test_the_client_drops_a_read_only_connection_and_retries_on_a_new_one(cyclone_dsn):
    """A pooled connection that became read-only (what a failover leaves behind where a
    host came back as a replica) fails a write with 25006: the client closes it, empties
    its pool and writes once more on a fresh connection."""
    import cyclone_mp as cy

    client = cy.Client(cyclone_dsn, cy.Mux())
    try:
        client.mux.register(h.ok)
        first = client.enqueue(h.ok, {"x": 1})
        pool = client._calls.pool()
        poisoned = pool.getconn()
        poisoned.execute("SET default_transaction_read_only = on")  # session-level: this connection only
        pool.putconn(poisoned)
        second = client.enqueue(h.ok, {"x": 2})
        assert poisoned.closed
        assert {client.status(first).state, client.status(second).state} == {"running"}
    finally:
        client.close()
