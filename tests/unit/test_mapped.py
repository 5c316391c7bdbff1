"""The pure parts of mapped nodes and spawned runs: a join's outputs file, the map
summary, ``wf.map``'s definition checks and ``ctx.spawn``'s (no database, no process)."""

from __future__ import annotations

import uuid

import pytest

import cyclone_mp as cy


@cy.step("u_list")
def u_list(ctx: cy.Context, inp: dict) -> list:
    return []


@cy.step("u_item")
def u_item(ctx: cy.Context, inp: object) -> object:
    return inp


def test_outputs_read_from_a_file_index_slice_and_compare(tmp_path):
    from cyclone_mp import mapped

    path = str(tmp_path / "out.jsonl")
    with mapped.OutputsFile(path) as out:
        out.write_page([{"item": 0, "ok": True, "output": '{"a": 1}', "error": None, "error_kind": None},
                        {"item": 1, "ok": False, "output": "null", "error": "boom", "error_kind": "permanent"}])
        out.write_page([{"item": 2, "ok": True, "output": "[1, 2]", "error": None, "error_kind": None}])
    assert (out.count, out.last) == (3, 2)
    seq = mapped.read(path, 3, as_list=False)
    failed = cy.ItemFailed(1, "boom", "permanent")
    assert len(seq) == 3 and list(seq) == [{"a": 1}, failed, [1, 2]]
    assert (seq[2], seq[-3], seq[1:]) == ([1, 2], {"a": 1}, [failed, [1, 2]])
    assert seq == [{"a": 1}, failed, [1, 2]] and seq != [{"a": 1}]
    with pytest.raises(IndexError):
        seq[3]
    assert mapped.read(path, 3, as_list=True) == [{"a": 1}, failed, [1, 2]]
    assert mapped.summary({"total": 10000, "completed": 9120, "running": 850, "available": 30}) == \
        "10,000 items: 9,120 completed, 850 running, 30 available"



def test_map_definition_errors_are_configuration_errors():
    wf = cy.Workflow("u_maps")
    listed = wf.add(u_list)
    with pytest.raises(cy.ConfigurationError, match="takes a cy.step"):
        wf.map(len, over=listed)
    with pytest.raises(cy.ConfigurationError, match="unknown dependency"):
        wf.map(u_item, over="nope")
    with pytest.raises(cy.ConfigurationError, match="takes a string"):
        wf.map(u_item, over=listed, concurrency_key=lambda inp: "k")
    with pytest.raises(cy.ConfigurationError):
        wf.map(u_item, over=listed, max_attempts=0)
    with pytest.raises(cy.ConfigurationError, match="an option of cy.step"):
        wf.map(u_item, over=listed, max_snoozes=3)
    node = wf.map(u_item, over=listed, allow_failures=True, queue="maps", priority=3)
    assert (node.kind, node.after, node.allow_failures, node.options.queue, node.options.priority) == (
        "map", ("u_list",), True, "maps", 3)
    with pytest.raises(cy.ConfigurationError, match="wait_for_spawned needs after="):
        cy.Workflow("u_wait").add(u_item, wait_for_spawned=True)
    assert [n.name for n in wf.task_nodes()] == ["u_list", "u_item"]


def test_spawn_ids_are_derived_from_run_node_and_key_and_inputs_must_be_json():
    ctx = cy.Context(run_id="r1", step_name="s", node="n", attempt=1, deadline=None)
    again = cy.Context(run_id="r1", step_name="s", node="n", attempt=2, deadline=None)
    first = ctx.spawn(u_item, {"a": 1})
    assert first == again.spawn("u_item", {"b": 2}) and uuid.UUID(first)  # the same key "0": the same run
    assert ctx.spawn(u_item, None, key="x") != first
    assert [(s["step"], s["key"]) for s in ctx.spawns] == [("u_item", "0"), ("u_item", "x")]
    with pytest.raises(cy.ConfigurationError, match="used already"):
        ctx.spawn(u_item, None, key="x")
    with pytest.raises(cy.ConfigurationError, match="not JSON"):
        ctx.spawn(u_item, {"when": object()})
    with pytest.raises(cy.ConfigurationError, match="key must be"):
        ctx.spawn(u_item, None, key="")
    with pytest.raises(cy.ConfigurationError, match="takes a cy.step"):
        ctx.spawn(42, None)
    assert len(ctx.spawns) == 2  # the refused spawns left nothing behind
