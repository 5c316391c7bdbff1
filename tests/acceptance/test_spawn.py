"""Runs spawned by a handler (``ctx.spawn``, SPEC section 10) against a real PostgreSQL
and real processes: written only with a completion whose CAS held, linked to their
parent, and waited for by a node added with ``wait_for_spawned=True``."""

from __future__ import annotations

import uuid

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import map_handlers as mh
from waiting import wait_for


def children_of(dsn: str, run_id: str) -> list[dict]:
    with connect(dsn) as conn:
        return conn.execute("SELECT id::text AS id, name, state, parent_node, parent_key FROM cyclone_runs "
                            "WHERE parent_id = %s ORDER BY parent_key", (run_id,)).fetchall()


def test_spawned_runs_link_to_their_parent_and_a_node_waits_for_them(cyclone_env):
    env = cyclone_env
    env.mux().register(mh.child)
    run_id = env.enqueue(mh.spawner, {"children": 3, "fail": [1], "sleep": 0.2})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed"
    kids = children_of(env.dsn, run_id)
    assert [(k["name"], k["parent_node"], k["parent_key"]) for k in kids] == [
        ("child", "fanout", "c0"), ("child", "fanout", "c1"), ("child", "fanout", "c2")]
    assert run.steps["fanout"].output == {"spawned": [k["id"] for k in kids]}
    assert [k["state"] for k in kids] == ["completed", "discarded", "completed"]
    assert run.steps["gather"].output == {"c0": ["completed", {"double": 0}, None],
                                          "c1": ["discarded", None, "child 1 failed"],
                                          "c2": ["completed", {"double": 4}, None]}
    finished = {k["id"]: env.status(k["id"]).finished_at for k in kids}
    assert run.steps["gather"].started_at >= max(finished.values())  # it waited for every child
    child = env.status(kids[0]["id"])
    assert (child.parent_id, child.parent_node, child.parent_key) == (run_id, "fanout", "c0")
    assert [c["id"] for c in run.children] == [k["id"] for k in kids]


def test_a_failed_attempt_spawns_nothing_and_its_retry_spawns_once(cyclone_env, tmp_path):
    env = cyclone_env
    env.mux().register(mh.child)
    run_id = env.enqueue(mh.spawner, {"children": 2, "fail_first": True, "dir": str(tmp_path)})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed" and run.steps["fanout"].attempt == 2
    spawned = [line.split() for line in (tmp_path / "items.log").read_text().splitlines()]
    assert [s[1] for s in spawned] == ["1", "2"] and spawned[0][2:] == spawned[1][2:]  # same ids both times
    assert [k["id"] for k in children_of(env.dsn, run_id)] == spawned[1][2:]


def test_spawn_from_an_attempt_that_loses_its_cas_spawns_nothing(cyclone_env):
    """Acceptance 4: two attempts of the spawning node, the first one's lease taken away
    (expired and reclaimed by the sweep, then claimed again); each completes with what its
    handler spawned (different keys, so their runs would differ). The stale attempt's
    completion fails its CAS and writes none of its spawns; the winner's writes its own,
    once however often it is delivered."""
    from cyclone_mp import spawning
    from cyclone_mp.store import Store
    from cyclone_mp.sweep import Sweeper

    env = cyclone_env
    env.mux().register(mh.spawner, mh.child)
    run_id = env.client().enqueue(mh.spawner, {})
    a, b = Store.open(env.dsn), Store.open(env.dsn)

    def spawns(tag: str) -> list[dict]:
        ctx = cy.Context(run_id=run_id, step_name="fanout", node="fanout", attempt=1, deadline=None)
        for i in range(2):
            ctx.spawn(mh.child, {"i": i}, key=f"{tag}{i}")
        return spawning.plan(env.mux(), env.client().config.defaults, run_id, "fanout", ctx.spawns)

    try:
        [stale] = a.claims.claim(owner="a", queues=["default"], names=["fanout"], limit=5, ttl=30).rows
        env.expire_lease(run_id, "fanout")
        assert Sweeper("sweeper", lambda name: lambda attempt: 0.0).run_once(a)["reclaim"] == 1
        [fresh] = b.claims.claim(owner="b", queues=["default"], names=["fanout"], limit=5, ttl=30).rows
        stale_key, fresh_key = (stale["id"], stale["lease_generation"]), (fresh["id"], fresh["lease_generation"])
        assert a.outcomes.complete(owner="a", items=[(*stale_key, {"by": "a"}, None)],
                                   spawns={stale_key: spawns("a")}) == set()
        assert children_of(env.dsn, run_id) == []  # the lost CAS spawned nothing
        won = b.outcomes.complete(owner="b", items=[(*fresh_key, {"by": "b"}, None)], spawns={fresh_key: spawns("b")})
        assert won == {fresh_key}
        again = b.outcomes.complete(owner="b", items=[(*fresh_key, {"by": "b"}, None)], spawns={fresh_key: spawns("b")})
        assert again == set()
        a.outcomes.complete(owner="a", items=[(*stale_key, {"by": "a"}, None)], spawns={stale_key: spawns("a")})
        kids = children_of(env.dsn, run_id)
        assert [(k["parent_key"], k["state"]) for k in kids] == [("b0", "running"), ("b1", "running")]
        run = env.status(run_id)
        assert run.steps["fanout"].output == {"by": "b"}
        assert run.steps["gather"].state == "pending"  # it waits for the two children
    finally:
        a.close()
        b.close()


def test_children_link_to_their_parent_in_status_runs_and_json(cyclone_env):
    import json
    import os
    import subprocess
    import sys

    env = cyclone_env
    env.mux().register(mh.child)
    run_id = env.enqueue(mh.spawner, {"children": 2})
    env.start_worker()
    env.run_until_complete(run_id, timeout=30)
    kids = children_of(env.dsn, run_id)

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", env.dsn, *args],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    parent_text = cli("status", run_id)
    assert "spawned: 2 runs (2 completed)" in parent_text and all(k["id"] in parent_text for k in kids)
    child_text = cli("status", kids[0]["id"])
    assert f"parent: {run_id}  node fanout  key c0" in child_text
    data = json.loads(cli("status", kids[1]["id"], "--json"))
    assert (data["parent_id"], data["parent_node"], data["parent_key"]) == (run_id, "fanout", "c1")
    assert [c["id"] for c in json.loads(cli("status", run_id, "--json"))["children"]] == [k["id"] for k in kids]
    runs = json.loads(cli("runs", "--json"))
    assert {r["id"]: r["parent_id"] for r in runs} == {run_id: None, kids[0]["id"]: run_id, kids[1]["id"]: run_id}
    child_line = next(line for line in cli("runs").splitlines() if kids[0]["id"] in line)
    assert run_id[:8] in child_line  # the parent column, beside the child


def test_an_async_single_step_run_spawns_too(cyclone_env):
    env = cyclone_env
    env.mux().register(mh.child)
    runs = [env.enqueue(mh.aspawn, {"i": i}) for i in range(2)]
    env.start_worker()
    for i, run_id in enumerate(runs):
        run = env.run_until_complete(run_id, timeout=30)
        [kid] = children_of(env.dsn, run_id)
        assert run.step.output == {"child": kid["id"]} and kid["parent_node"] == "aspawn"
        assert env.run_until_complete(kid["id"], timeout=30).step.output == {"double": 2 * i}
