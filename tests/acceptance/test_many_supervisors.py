"""Many supervisors on one database (issue 22 acceptance 3, issue 23 target 5): each one's
connections are what docs/operating.md says, its children hold none, and the recovery
sweep runs at most once per interval across all of them (one turn at a time, a row of
``cyclone_maintenance``, no session lock), yet keeps running and recovers a mass expiry
in one turn.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from cyclone_mp.config import SWEEP_LIMIT
from cyclone_mp.store import connect

import handlers as h
from waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def documented_parts() -> dict[str, int]:
    """The supervisor's connections by part, as docs/operating.md's table "The parts of a
    supervisor" gives them ("one", "**none**"; one "opened when" there is work for it is
    not held by a supervisor at rest)."""
    with open(os.path.join(ROOT, "docs", "operating.md")) as fh:
        text = fh.read()
    section = text.split("## The parts of a supervisor", 1)[1].split("\n## ", 1)[0]
    parts: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("part (module)", "---"):
            continue
        name = re.sub(r"\s*\(.*", "", cells[0])
        conns = cells[2]
        if conns.startswith("**none**") or "opened when" in conns:
            continue
        parts[name] = 1
    return parts


def sessions(dsn: str) -> list[dict]:
    with connect(dsn) as conn:
        return conn.execute(
            "SELECT application_name AS app FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()


def test_four_supervisors_hold_the_documented_connections_and_their_children_none(cyclone_env_factory):
    """4 supervisor processes x 2 children: each supervisor's sessions, by the id that ends
    their application_name, are exactly the parts docs/operating.md lists; while they run
    steps, no other session is on the database but the test client's pool."""
    parts = documented_parts()
    assert parts == {"lease keeper": 1, "listener": 1, "outcome writer": 1, "maintenance": 1}, parts
    env = cyclone_env_factory(workers=2, lease_ttl=3.0)
    env.mux().register(h.sleeper)
    handles = [env.start_worker() for _ in range(4)]
    ids = {w.supervisor_id for w in handles}
    runs = [env.enqueue(h.sleeper, {"seconds": 0.5}) for _ in range(8)]
    wait_for(lambda: all(env.status(r).state == "running" for r in runs), 30, "8 steps running on 8 children")

    def by_supervisor() -> dict[str, dict[str, int]]:
        seen: dict[str, dict[str, int]] = {}
        for row in sessions(env.dsn):
            app = row["app"] or ""
            for sid in ids:
                if app.endswith(" " + sid) and app.startswith("cyclone_mp "):
                    part = app[len("cyclone_mp "):-len(sid) - 1]
                    seen.setdefault(sid, {}).setdefault(part, 0)
                    seen[sid][part] += 1
        return seen

    seen = wait_for(lambda: (lambda s: s if len(s) == 4 and all(v == parts for v in s.values()) else None)(
        by_supervisor()), 15, "every supervisor connected")
    assert seen == {sid: parts for sid in ids}
    others = [r["app"] for r in sessions(env.dsn)
              if not any((r["app"] or "").endswith(" " + sid) for sid in ids)]
    assert set(others) <= {"cyclone_mp client"}, others  # the children hold none
    for r in runs:
        assert env.run_until_complete(r, timeout=30).state == "completed"


def test_the_sweep_runs_at_most_once_per_interval_across_supervisors(cyclone_env_factory):
    """4 supervisors sweeping every poll_interval[1] = 0.2 s each would make ~4 passes per
    0.2 s; sharing one turn they make at most one, and still about one per interval."""
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=3.0, poll_interval=(0.05, 0.2))
    env.mux().register(h.ok)
    clients = [env.start_worker().client for _ in range(4)]

    def passes() -> int:
        return sum(c.supervisor.stats["sweeps"] for c in clients)

    wait_for(lambda: passes() >= 1, 10, "a first sweep")
    before, t0 = passes(), time.monotonic()
    time.sleep(3.0)
    made, elapsed = passes() - before, time.monotonic() - t0
    assert made <= elapsed / 0.2 + 2, f"{made} sweep passes in {elapsed:.1f} s across 4 supervisors"
    assert made >= elapsed / (0.2 + 0.05) / 2, f"only {made} sweep passes in {elapsed:.1f} s"
    assert sum(c.supervisor.stats["sweep_turns_skipped"] for c in clients) > 0
    with connect(env.dsn) as conn:
        row = conn.execute("SELECT holder, now() - ran_at AS age FROM cyclone_maintenance WHERE task = 'sweep'").fetchone()
    assert row["holder"] in {c.supervisor.id for c in clients}


def test_a_mass_expiry_is_swept_within_one_turn(cyclone_env_factory):
    """More expired leases than one page (SWEEP_LIMIT): the supervisor whose turn it is
    goes on page after page, not one page per interval (a 30 s interval here: a second
    turn cannot come while the test runs)."""
    n = SWEEP_LIMIT * 3 + 17
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=30.0, poll_interval=(0.05, 30.0))
    env.mux().register(h.ok)
    env.client().enqueue_many(h.ok, [{"i": i} for i in range(n)])
    with connect(env.dsn) as conn:  # as if a supervisor had claimed them all and died
        conn.execute("UPDATE cyclone_steps SET state = 'running', lease_owner = 'dead', lease_generation = 1,"
                     " started_at = now() - interval '1 minute', lease_expiry = now() - interval '1 second',"
                     " attempt = 1")
        conn.execute("UPDATE cyclone_maintenance SET ran_at = '-infinity' WHERE task = 'sweep'")
    client = env.start_worker(queues=["nowhere"]).client  # sweeps, claims nothing back
    with connect(env.dsn) as conn:
        wait_for(lambda: conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE reclaims = 1").fetchone()["n"] == n,
                 20, f"{n} expired leases reclaimed")
        turn = conn.execute("SELECT now() - ran_at AS age FROM cyclone_maintenance WHERE task = 'sweep'").fetchone()
    assert turn["age"].total_seconds() < 30  # one turn did it all
    wait_for(lambda: client.supervisor.stats["reclaimed"] == n, 10, "the last page counted")
    assert client.supervisor.stats["sweeps"] >= 4  # page after page


@pytest.mark.parametrize("rows", [0, 1])
def test_a_missing_turn_row_is_made_and_taken(cyclone_env_factory, rows):
    """The turn row is made by the migration; if it was deleted, the first supervisor to
    ask makes it again and sweeps (nobody is left without a sweep)."""
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=3.0, poll_interval=(0.05, 0.2))
    env.mux().register(h.ok)
    with connect(env.dsn) as conn:
        if rows == 0:
            conn.execute("DELETE FROM cyclone_maintenance")
        assert conn.execute("SELECT count(*) AS n FROM cyclone_maintenance").fetchone()["n"] == rows
    client = env.start_worker().client
    wait_for(lambda: client.supervisor.stats["sweeps"] >= 2, 10, "sweeps")
    with connect(env.dsn) as conn:
        assert conn.execute("SELECT holder FROM cyclone_maintenance WHERE task = 'sweep'").fetchone()["holder"] == \
            client.supervisor.id


def test_each_supervisor_holds_its_share_of_the_fleets_prefetch(cyclone_env_factory):
    """Each supervisor counts the live ones in the registry (issue 23): alone, it may hold
    its whole prefetch (4,096); with a second one live, each holds half of PREFETCH_FLEET
    (1,024), as their registry rows say; and once the other is gone (its row removed), the
    whole again."""
    from cyclone_mp.config import PREFETCH_FLEET

    env = cyclone_env_factory(workers=1, prefetch=4096, registry_interval=0.2)
    env.mux().register(h.sleeper)
    client = env.client()

    def shares() -> dict[str, int]:
        return {w["id"]: w["info"].get("prefetch") for w in client.workers()}

    a = env.start_worker()
    wait_for(lambda: shares().get(a.supervisor_id) == 4096, 15, "A alone to hold its whole prefetch")
    time.sleep(0.5)  # registry refreshes that counted the fleet (the first snapshot predates them)
    assert shares().get(a.supervisor_id) == 4096
    b = env.start_worker()
    half = PREFETCH_FLEET // 2
    assert half < 4096
    wait_for(lambda: shares() == {a.supervisor_id: half, b.supervisor_id: half}, 15,
             "each of two to hold half of the fleet's prefetch")
    assert env.terminate_worker() is b  # it drains (nothing to do) and removes its row
    wait_for(lambda: not b.alive(), 15, "B to exit")
    wait_for(lambda: shares().get(a.supervisor_id) == 4096, 15, "A alone again to hold its whole prefetch")
    env.stop_workers()


def test_an_idle_supervisor_spends_almost_no_cpu(cyclone_env_factory):
    """No part of an idle supervisor spins: with nothing to do (no steps, no big payloads,
    a poll interval of 0.05-0.5 s), its process uses well under a tenth of a core over
    3 s, threads and all. A part that waits for nothing (a zero timeout in a loop) would
    use a whole core."""
    import psutil

    env = cyclone_env_factory(workers=1, lease_ttl=3.0, poll_interval=(0.05, 0.5))
    env.mux().register(h.ok)
    handle = env.start_worker()
    assert env.run_until_complete(env.enqueue(h.ok, {}), timeout=30).state == "completed"
    proc = psutil.Process(handle.pid)
    time.sleep(1.0)  # settled
    before = proc.cpu_times()
    time.sleep(3.0)
    after = proc.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.3, f"an idle supervisor used {used:.2f} s of CPU in 3 s"
