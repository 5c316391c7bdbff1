"""Mapped nodes (``wf.map``, SPEC section 10) against a real PostgreSQL and real processes.

The workflows and steps live in ``map_handlers`` (module level, so worker processes find
them). Items log ``start``/``end`` lines to ``<dir>/items.log``: how these tests count
executions.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import map_handlers as mh
from waiting import wait_for


def log_lines(folder: Path, kind: str) -> list[list[str]]:
    path = folder / "items.log"
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.startswith(kind + " ")]


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def item_rows(dsn: str, run_id: str) -> list[dict]:
    with connect(dsn) as conn:
        return conn.execute("SELECT node, item, state, attempt, input, output FROM cyclone_steps "
                            "WHERE run_id = %s AND map_node IS NOT NULL ORDER BY item", (run_id,)).fetchall()


def test_map_runs_each_item_once_and_the_join_sees_outputs_in_order(cyclone_env, tmp_path):
    env = cyclone_env
    run_id = env.enqueue(mh.squares, {"n": 25, "dir": str(tmp_path)})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed"
    assert list(run.steps) == ["numbers", "square", "total"]  # items are not steps of the status
    square = run.steps["square"]
    assert (square.kind, square.state, square.items) == ("map", "completed", {"total": 25, "completed": 25})
    assert square.items_summary == "25 items: 25 completed"
    assert run.steps["total"].output == {"count": 25, "sum": sum(i * i for i in range(25)), "first": [0, 1, 4],
                                         "failed": [], "ordered": True, "kind": "list"}
    rows = item_rows(env.dsn, run_id)
    assert [r["node"] for r in rows] == [f"square[{i}]" for i in range(25)]
    assert [r["output"] for r in rows] == [i * i for i in range(25)]
    assert all(r["state"] == "completed" and r["attempt"] == 1 for r in rows)
    ends = sorted(int(line[1]) for line in log_lines(tmp_path, "end"))
    assert ends == list(range(25))  # each item ran once
    items = env.client().map_items(run_id, "square", limit=10)
    assert [(i.name, i.item, i.kind, i.output) for i in items[:2]] == [("square[0]", 0, "item", 0), ("square[1]", 1, "item", 1)]
    more = env.client().map_items(run_id, "square", after=items[-1].item, limit=100)
    assert [i.item for i in more] == list(range(10, 25))
    # client.result: the map node's output is the list of its items' outputs, in item order (SPEC 10)
    result = env.client().result(run_id)
    assert result["square"] == [i * i for i in range(25)] and result["total"]["count"] == 25


def test_result_reads_a_big_maps_output_in_pages_sync_and_async(cyclone_env, monkeypatch):
    import asyncio

    from cyclone_mp import AsyncClient, client, async_client

    monkeypatch.setattr(client, "MAP_PAGE", 7)
    monkeypatch.setattr(async_client, "MAP_PAGE", 7)
    env = cyclone_env
    run_id = env.enqueue(mh.squares, {"n": 30})
    env.start_worker()
    assert env.run_until_complete(run_id, timeout=30).state == "completed"
    assert env.client().result(run_id)["square"] == [i * i for i in range(30)]

    async def read():
        async with AsyncClient(env.dsn) as aclient:
            return await aclient.result(run_id)

    assert asyncio.run(read())["square"] == [i * i for i in range(30)]


def test_an_output_that_is_not_a_list_discards_the_run_with_a_clear_error(cyclone_env):
    env = cyclone_env
    run_id = env.enqueue(mh.squares, {"items": {"not": "a list"}})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "discarded"
    square = run.steps["square"]
    assert (square.state, square.error_kind) == ("discarded", "output_invalid")
    assert "the output of numbers is not a JSON list (it is object)" in square.error
    assert run.steps["total"].state == "pending"


def test_an_empty_list_completes_the_map_at_once(cyclone_env):
    env = cyclone_env
    run_id = env.enqueue(mh.squares, {"items": []})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed"
    assert run.steps["square"].items == {"total": 0}
    assert run.steps["total"].output["count"] == 0


def test_a_discarded_item_discards_the_run_once_the_others_end_and_retry_reruns_only_it(cyclone_env, tmp_path):
    env = cyclone_env
    fixed = tmp_path / "fixed"
    run_id = env.enqueue(mh.squares, {"n": 6, "dir": str(tmp_path), "fail": [2], "permanent": True,
                                      "fail_until": str(fixed)})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "discarded"
    square = run.steps["square"]
    assert (square.state, square.error_kind) == ("discarded", "permanent")
    assert square.error == "item 2 of 6 discarded: item 2 is bad"
    assert square.items == {"total": 6, "completed": 5, "discarded": 1}
    assert run.steps["total"].state == "pending"
    assert [i.item for i in env.client().map_items(run_id, "square", state="discarded")] == [2]
    assert sorted(int(line[1]) for line in log_lines(tmp_path, "end")) == [0, 1, 3, 4, 5]

    fixed.write_text("ok")
    assert env.client().retry(run_id) == 2  # the map row and its one discarded item
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed"
    assert run.steps["total"].output["sum"] == sum(i * i for i in range(6))
    starts = sorted(int(line[1]) for line in log_lines(tmp_path, "start"))
    assert starts == [0, 1, 2, 2, 3, 4, 5]  # only the discarded item ran again
    rows = {r["item"]: r for r in item_rows(env.dsn, run_id)}
    assert rows[2]["attempt"] == 2 and all(rows[i]["attempt"] == 1 for i in (0, 1, 3, 4, 5))


def test_allow_failures_lets_the_join_see_each_failed_item(cyclone_env, tmp_path):
    env = cyclone_env
    run_id = env.enqueue(mh.tolerant, {"n": 5, "fail": [1, 3], "permanent": True})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed"
    assert run.steps["square"].state == "completed" and run.steps["square"].error is None
    assert run.steps["square"].items == {"total": 5, "completed": 3, "discarded": 2}
    out = run.steps["total"].output
    assert (out["count"], out["failed"], out["sum"]) == (5, [1, 3], 0 + 4 + 16)
    listed = env.client().result(run_id)["square"]
    assert [x if not isinstance(x, cy.ItemFailed) else ("failed", x.item) for x in listed] == [
        0, ("failed", 1), 4, ("failed", 3), 16]


def test_cancel_mid_map_cancels_every_item_and_kills_the_deaf_ones_after_kill_grace(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=3, lease_ttl=0.6, kill_grace=0.5, prefetch=0)
    run_id = env.enqueue(mh.squares, {"n": 8, "dir": str(tmp_path), "hold": str(tmp_path / "never"),
                                      "stubborn": [0, 1]})
    env.start_worker()
    wait_for(lambda: len(log_lines(tmp_path, "start")) == 3, 20, "three items to start")
    started = {int(line[1]): int(line[3]) for line in log_lines(tmp_path, "start")}
    assert sorted(started) == [0, 1, 2]  # claimed in item order
    t0 = time.monotonic()
    assert env.client().cancel(run_id) == 10  # the map row, its 8 items and the join
    run = env.status(run_id)
    assert run.state == "cancelled"
    assert {n: s.state for n, s in run.steps.items()} == {"numbers": "completed", "square": "cancelled",
                                                          "total": "cancelled"}
    assert run.steps["square"].items == {"total": 8, "cancelled": 8}
    # the cooperative item returns (its child lives on), the two deaf ones are killed after kill_grace
    wait_for(lambda: not alive(started[0]) and not alive(started[1]), 0.6 + 0.5 + 3.0, "the deaf children's kill")
    assert time.monotonic() - t0 >= 0.5  # not before kill_grace
    wait_for(lambda: len(log_lines(tmp_path, "cancelled")) == 1, 5, "the cooperative item to see the cancel")
    assert alive(started[2])
    assert log_lines(tmp_path, "end") == []
    assert len(log_lines(tmp_path, "start")) == 3  # nothing started after the cancel
    items = env.client().map_items(run_id, "square")
    running_before = [i for i in items if i.errors]
    assert len(running_before) == 3 and all(i.errors[-1]["kind"] == "cancelled" for i in running_before)
    assert all(i.attempt == 1 and i.error is None for i in items)


def test_pause_holds_the_items_and_resume_finishes_the_map(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=2, prefetch=0)
    release = tmp_path / "release"
    run_id = env.enqueue(mh.squares, {"n": 6, "dir": str(tmp_path), "hold": str(release)})
    env.start_worker()
    wait_for(lambda: len(log_lines(tmp_path, "start")) == 2, 20, "two items to start")
    assert env.client().pause(run_id) == 5  # four available items and the pending join
    release.write_text("go")
    wait_for(lambda: env.status(run_id).steps["square"].items.get("completed") == 2, 20, "the running items to end")
    run = env.status(run_id)
    assert run.state == "paused" and run.steps["square"].items == {"total": 6, "completed": 2, "paused": 4}
    assert len(log_lines(tmp_path, "start")) == 2
    env.client().resume(run_id)
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed" and run.steps["total"].output["count"] == 6


def test_the_upstream_result_arriving_twice_maps_once(cyclone_env):
    """A stale attempt of the node mapped over (its lease expired, the step was reclaimed
    and completed by another supervisor) completes late, and the winner's completion is
    delivered twice: the list is mapped once, by the completion whose CAS held."""
    from cyclone_mp.store import Store
    from cyclone_mp.sweep import Sweeper

    env = cyclone_env
    env.mux().register(mh.squares)
    run_id = env.client().enqueue(mh.squares, {"n": 4})
    a, b = Store.open(env.dsn), Store.open(env.dsn)
    try:
        [stale] = a.claims.claim(owner="a", queues=["default"], names=["numbers"], limit=5, ttl=30).rows
        env.expire_lease(run_id, "numbers")
        assert Sweeper("sweeper", lambda name: lambda attempt: 0.0).run_once(a)["reclaim"] == 1
        [fresh] = b.claims.claim(owner="b", queues=["default"], names=["numbers"], limit=5, ttl=30).rows
        assert fresh["lease_generation"] == stale["lease_generation"] + 1
        listed = [{"x": i} for i in range(4)]
        won = b.outcomes.complete(owner="b", items=[(fresh["id"], fresh["lease_generation"], listed, None)])
        assert won == {(fresh["id"], fresh["lease_generation"])}
        assert len(item_rows(env.dsn, run_id)) == 4
        late = [{"x": i} for i in range(9)]  # the stale attempt's (different) list
        assert a.outcomes.complete(owner="a", items=[(stale["id"], stale["lease_generation"], late, None)]) == set()
        assert b.outcomes.complete(owner="b", items=[(fresh["id"], fresh["lease_generation"], listed, None)]) == set()
        rows = item_rows(env.dsn, run_id)
        assert [(r["node"], r["input"]) for r in rows] == [(f"square[{i}]", {"x": i}) for i in range(4)]
        square = env.status(run_id).steps["square"]
        assert (square.state, square.items) == ("running", {"total": 4, "available": 4})
    finally:
        a.close()
        b.close()


def _map_across_two_supervisors_with_a_crash(env, tmp_path, n: int, crash_after: int, timeout: float,
                                            sleep: float = 0.0) -> None:
    """Acceptance 1: a map of ``n`` items across 2 supervisors completes, one of them
    SIGKILLed once ``crash_after`` items completed: nothing is lost, the join sees the
    ``n`` outputs in item order, and no item runs again after its completion was written
    (an item whose handler ended on the crashed supervisor, its completion unwritten, ran
    twice: only those, each reclaimed once)."""
    run_id = env.enqueue(mh.squares, {"n": n, "dir": str(tmp_path), "sleep": sleep})
    first, second = env.start_worker(), env.start_worker()
    wait_for(lambda: (env.status(run_id).steps["square"].items or {}).get("completed", 0) >= crash_after,
             timeout, f"{crash_after} items to complete")
    env.crash_worker()  # the newest: second
    run = env.run_until_complete(run_id, timeout=timeout)
    assert run.state == "completed"
    assert run.steps["square"].items == {"total": n, "completed": n}
    out = run.steps["total"].output
    assert (out["count"], out["sum"], out["ordered"]) == (n, sum(i * i for i in range(n)), True)
    items, after = [], -1
    while True:
        page = env.client().map_items(run_id, "square", after=after, limit=10_000)
        if not page:
            break
        items += page
        after = page[-1].item
    assert [i.item for i in items] == list(range(n))
    assert all(i.state == "completed" and i.attempt == 1 and i.output == i.item ** 2 for i in items)
    ends: dict[int, int] = {}
    for line in log_lines(tmp_path, "end"):
        ends[int(line[1])] = ends.get(int(line[1]), 0) + 1
    assert sorted(ends) == list(range(n))
    twice = {x for x, count in ends.items() if count > 1}
    reclaimed = {i.item for i in items if i.reclaims}
    assert twice <= reclaimed and all(ends[x] == 2 for x in twice)
    assert all(i.reclaims <= 1 for i in items)
    assert reclaimed and {i.lease_owner for i in items} == {first.supervisor_id, second.supervisor_id}


@pytest.mark.long  # 7 s: the smaller maps above take the same SIGKILL in the default run (CI runs the long ones)
def test_a_map_of_10000_items_across_two_supervisors_survives_a_sigkill(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=2, lease_ttl=1.0)
    _map_across_two_supervisors_with_a_crash(env, tmp_path, n=10_000, crash_after=3_000, timeout=300)


def test_a_big_map_reaches_its_join_as_a_sequence_read_in_pages(cyclone_env_factory, monkeypatch):
    """Past LIST_BYTES the join's child gets a lazy sequence over the outputs file, which
    its supervisor wrote PAGE_ITEMS items per statement (both made small here: the
    supervisor runs in this process); the file is gone once the join ended."""
    import os

    from cyclone_mp import mapped

    monkeypatch.setattr(mapped, "LIST_BYTES", 0)
    monkeypatch.setattr(mapped, "PAGE_ITEMS", 7)
    env = cyclone_env_factory(worker="thread")
    run_id = env.enqueue(mh.squares, {"n": 50})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    out = run.steps["total"].output
    assert (out["kind"], out["count"], out["sum"], out["first"], out["ordered"]) == (
        "Outputs", 50, sum(i * i for i in range(50)), [0, 1, 4], True)
    assert os.listdir(mapped.folder()) == []


def test_map_options_apply_to_every_item_and_a_concurrency_limit_holds_across_them(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=3, queues=["default", "maps"], lease_ttl=2.0)  # no lease lost under load
    run_id = env.enqueue(mh.one_at_a_time, {"n": 5, "dir": str(tmp_path), "sleep": 0.1})
    env.start_worker()
    run = env.run_until_complete(run_id, timeout=30)
    assert run.state == "completed" and run.steps["total"].output["count"] == 5
    items = env.client().map_items(run_id, "square")
    assert {(i.queue, i.priority, i.concurrency, i.max_attempts) for i in items} == {("maps", 5, 1, 4)}
    spans = {int(s[1]): (float(s[4]), float(e[4]))
             for s in log_lines(tmp_path, "start") for e in log_lines(tmp_path, "end") if s[1] == e[1]}
    ordered = sorted(spans.values())
    assert len(ordered) == 5 and all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])), ordered  # one at a time


def test_a_big_map_of_one_tenant_does_not_starve_a_small_map_of_another(cyclone_env_factory, tmp_path):
    """Items are claimed round-robin by concurrency key (here the enqueue's, one per
    tenant), as any steps are: the small map ends while the big one is far from done."""
    env = cyclone_env_factory(workers=2, prefetch=0)
    big = env.enqueue(mh.squares, {"n": 200, "sleep": 0.01}, concurrency_key="tenant-a")
    small = env.enqueue(mh.squares, {"n": 10, "sleep": 0.01}, concurrency_key="tenant-b")
    env.start_worker()
    assert env.run_until_complete(small, timeout=30).state == "completed"
    left = env.status(big).steps["square"].items
    assert left.get("completed", 0) < 100, left
    assert env.run_until_complete(big, timeout=60).state == "completed"


def test_cli_status_summarises_a_map_and_lists_its_items(cyclone_env, tmp_path):
    import json
    import subprocess
    import sys

    env = cyclone_env
    fixed = tmp_path / "never"
    run_id = env.enqueue(mh.squares, {"n": 4, "fail": [3], "permanent": True, "fail_until": str(fixed)})
    env.start_worker()
    env.run_until_complete(run_id, timeout=30)

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", env.dsn, *args],
                              capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                               "COLUMNS": "200"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    text = cli("status", run_id)
    assert "square: 4 items: 3 completed, 1 discarded" in text
    assert "square[0]" not in text  # items are listed only when asked
    listed = cli("status", run_id, "--items")
    assert "items of square:" in listed and all(f"square[{i}]" in listed for i in range(4))
    data = json.loads(cli("status", run_id, "--json", "--items"))
    assert data["steps"]["square"]["items"] == {"total": 4, "completed": 3, "discarded": 1}
    assert [(i["name"], i["item"], i["state"]) for i in data["items"]["square"]] == [
        ("square[0]", 0, "completed"), ("square[1]", 1, "completed"), ("square[2]", 2, "completed"),
        ("square[3]", 3, "discarded")]
    assert data["items"]["square"][3]["error"] == "item 3 is bad"


def test_a_list_over_the_most_items_a_map_may_have_fails_the_map_alone(cyclone_env, monkeypatch):
    from cyclone_mp.store import Store
    from cyclone_mp.store.operations import enqueue

    monkeypatch.setattr(enqueue, "MAX_MAP_ITEMS", 3)  # where advance() reads it
    env = cyclone_env
    env.mux().register(mh.squares)
    run_id = env.client().enqueue(mh.squares, {})
    store = Store.open(env.dsn)
    try:
        [row] = store.claims.claim(owner="t", queues=["default"], names=["numbers"], limit=1, ttl=30).rows
        lease = (row["id"], row["lease_generation"])
        assert store.outcomes.complete(owner="t", items=[(*lease, [1, 2, 3, 4], None)]) == {lease}
    finally:
        store.close()
    run = env.status(run_id)
    square = run.steps["square"]
    assert (run.state, square.state, square.error_kind) == ("discarded", "discarded", "output_invalid")
    assert square.error == "map square: the list of numbers has 4 items, over the 3 a map may have (map over a list of batches instead)"
    assert item_rows(env.dsn, run_id) == []
