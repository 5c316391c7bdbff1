"""Mapped nodes (``wf.map``, SPEC section 10) against a real PostgreSQL and real processes.

The workflows and steps live in ``map_handlers`` (module level, so worker processes find
them). Items log ``start``/``end`` lines to ``<dir>/items.log``: how these tests count
executions.
"""

from __future__ import annotations

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
