"""The operator dashboard's actions and guards, each on a fresh database of its own:
actions through the confirm page and the API, CSRF on every POST, the token guarding
every request; and what the pages show of schedules, limits, map nodes and spawned
runs."""

from __future__ import annotations

import re
from typing import Iterator

import pytest
from starlette.testclient import TestClient

import cyclone_mp as cy
from cyclone_mp.dashboard import create_app

import dashboard_handlers as dh
import handlers as h
from dashboard_support import BASE, sql


@pytest.fixture
def fresh(cyclone_dsn: str) -> Iterator[tuple[cy.Client, TestClient]]:
    """A client and a dashboard on an empty database of this test only."""
    client = cy.Client(cyclone_dsn, cy.Mux().register(h.ok, dh.release))
    try:
        with TestClient(create_app(client), base_url=BASE) as tc:
            yield client, tc
    finally:
        client.close()


# -- actions, CSRF, token --------------------------------------------------------------------------


def _form_csrf(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "the confirm page has no CSRF field"
    return match.group(1)


def test_actions_through_the_confirm_page_and_the_api(fresh: tuple[cy.Client, TestClient]) -> None:
    client, tc = fresh
    run_id = client.enqueue(h.ok, {}, delay=3600)
    run_page = tc.get(f"/runs/{run_id}").text
    assert f'href="/runs/{run_id}/pause"' in run_page and 'data-action="resume"' not in run_page
    confirm = tc.get(f"/runs/{run_id}/pause")  # the confirm step: GET shows it, changes nothing
    assert confirm.status_code == 200 and "Yes, pause this run" in confirm.text
    assert client.status(run_id).state == "running"
    token = _form_csrf(confirm.text)
    done = tc.post(f"/runs/{run_id}/pause", data={"csrf_token": token, "confirmed": "yes"}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/runs/{run_id}"
    assert client.status(run_id).state == "paused"
    flash = tc.get(f"/runs/{run_id}").text
    assert 'id="flash" class="flash flash-ok"' in flash and "Paused run" in flash
    assert 'id="flash"' not in tc.get(f"/runs/{run_id}").text  # shown once
    # not confirmed: back to the confirm page, nothing done
    back = tc.post(f"/runs/{run_id}/resume", data={"csrf_token": token}, follow_redirects=False)
    assert back.status_code == 303 and back.headers["location"] == f"/runs/{run_id}/resume"
    assert client.status(run_id).state == "paused"
    # a refused transition is reported as an error flash
    refused = tc.post(f"/runs/{run_id}/pause", data={"csrf_token": token, "confirmed": "yes"})  # follows the 303
    assert "flash-error" in refused.text and "only a running run can be paused" in refused.text
    # the API, with the CSRF header
    csrf = tc.get("/api/csrf").json()["csrf_token"]
    headers = {"X-CSRF-Token": csrf}
    resumed = tc.post(f"/api/runs/{run_id}/resume", headers=headers)
    assert resumed.status_code == 200 and resumed.json()["count"] == 1 and client.status(run_id).state == "running"
    assert tc.post(f"/api/runs/{run_id}/resume", headers=headers).status_code == 409
    cancelled = tc.post(f"/api/runs/{run_id}/cancel", headers=headers).json()
    assert cancelled["ok"] and client.status(run_id).state == "cancelled"
    assert tc.post(f"/api/runs/{run_id}/retry", headers=headers).json()["count"] == 1  # a cancelled single step
    assert client.status(run_id).step.state == "available"
    # a signal, by form (payload JSON) and by API (a repeat is not kept)
    flow = client.enqueue(dh.release, {})
    sent = tc.post(f"/runs/{flow}/signal", data={"csrf_token": token, "confirmed": "yes", "name": "approve",
                                                 "payload": '{"by": "ops"}'})
    assert "Signal &#39;approve&#39; sent" in sent.text
    again = tc.post(f"/api/runs/{flow}/signal", headers=headers, json={"name": "approve", "payload": 2}).json()
    assert again["kept"] is False
    assert sql(client.dsn, "SELECT payload FROM cyclone_signals WHERE run_id = %s", flow)[0]["payload"] == {"by": "ops"}
    bad = tc.post(f"/runs/{flow}/signal", data={"csrf_token": token, "confirmed": "yes", "name": "x", "payload": "{"})
    assert "not valid JSON" in bad.text
    assert tc.post(f"/api/runs/{flow}/signal", headers=headers, content=b"[1]",
                   ).status_code == 400  # not application/json
    assert tc.post(f"/api/runs/{flow}/explode", headers=headers).status_code == 400
    assert tc.post("/api/runs/00000000-0000-4000-8000-000000000000/cancel", headers=headers).status_code == 404


def test_csrf_is_required_on_every_post(fresh: tuple[cy.Client, TestClient]) -> None:
    client, tc = fresh
    run_id = client.enqueue(h.ok, {}, delay=3600)
    token = _form_csrf(tc.get(f"/runs/{run_id}/cancel").text)
    for data in ({"confirmed": "yes"}, {"confirmed": "yes", "csrf_token": "x" * 43}):
        response = tc.post(f"/runs/{run_id}/cancel", data=data)
        assert response.status_code == 403 and "CSRF" in response.text
    assert tc.post(f"/api/runs/{run_id}/cancel").status_code == 403
    assert tc.post(f"/api/runs/{run_id}/cancel", headers={"X-CSRF-Token": "nope"}).status_code == 403
    # the right token from another site is refused too
    evil = tc.post(f"/runs/{run_id}/cancel", data={"csrf_token": token, "confirmed": "yes"},
                   headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and "cross-site" in evil.text
    # without the cookie (another browser), the form token alone is not enough
    with TestClient(tc.app, base_url=BASE) as stranger:
        assert stranger.post(f"/runs/{run_id}/cancel", data={"csrf_token": token, "confirmed": "yes"}).status_code == 403
    assert client.status(run_id).state == "running"


def test_token_guards_every_request(cyclone_dsn: str) -> None:
    client = cy.Client(cyclone_dsn)
    secret = "s3cret-token-for-tests"
    try:
        with TestClient(create_app(client, token=secret), base_url="http://dash.example:8777") as tc:
            for url in ("/", "/runs", "/api/overview", "/api/runs", "/static/dashboard.js", "/api/openapi.json"):
                response = tc.get(url)
                assert response.status_code == 401, url
            assert tc.get("/api/overview").json()["error"] == "unauthorized"
            assert tc.get("/api/overview", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert tc.get("/api/overview", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
            # ?token= sets a cookie and drops the token from the URL
            first = tc.get(f"/runs?state=running&token={secret}", follow_redirects=False)
            assert first.status_code == 303 and first.headers["location"] == "/runs?state=running"
            assert secret not in first.headers["set-cookie"]
            assert tc.get("/runs?state=running").status_code == 200  # the cookie now
            assert tc.get("/static/dashboard.css").status_code == 200
            # a Bearer request needs no CSRF token (a browser never adds that header itself)
            run_id = client.enqueue(h.ok, {}, delay=3600)
            tc.cookies.clear()
            assert tc.post(f"/api/runs/{run_id}/cancel", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    finally:
        client.close()


# -- schedules, limits, map nodes and spawned runs on the pages ------------------------------------


def test_schedules_and_limits_are_shown(fresh: tuple[cy.Client, TestClient]) -> None:
    """Issue 21: the overview lists schedules with their next slot; a run's page shows a
    step's key, its limit and the limit it waits on."""
    import datetime as dt
    import zoneinfo

    from cyclone_mp import schedules
    from cyclone_mp.store import Store

    import flow_handlers as fh

    client, tc = fresh
    mux = cy.Mux()
    mux.schedule(fh.tick, cron="0 6 * * *", tz="Europe/Paris", name="morning")
    store = Store.open(client.dsn)
    schedules.run_once(store, mux, client.config)  # the row, with its next slot
    store.close()
    (row,) = tc.get("/api/overview").json()["schedules"]
    next_at = dt.datetime.fromisoformat(row["next_at"])
    assert row["name"] == "morning" and row["period"] == 'cron "0 6 * * *" Europe/Paris' and row["active"]
    assert next_at.astimezone(zoneinfo.ZoneInfo("Europe/Paris")).hour == 6
    assert "morning" in tc.get("/").text
    ids = client.enqueue_many(fh.per_tenant, [{"tenant": "acme"}] * 3)
    store = Store.open(client.dsn)
    store.claims.claim(owner="t", queues=["default"], names=["per_tenant"], limit=3, ttl=60)  # two take the slots
    store.close()
    views = [tc.get(f"/api/runs/{i}").json()["steps"][0] for i in ids]
    waiting = [v for v in views if v["state"] == "available"]
    assert len(waiting) == 1 and waiting[0]["waiting_on"] == "concurrency"
    assert waiting[0]["limits"] == "key acme, 2/2 running, waiting on concurrency"
    waiting_id = ids[[v["state"] for v in views].index("available")]
    assert "waiting on concurrency" in tc.get(f"/runs/{waiting_id}").text


def test_a_map_node_is_summarised_on_its_run_page(fresh: tuple[cy.Client, TestClient]) -> None:
    """Issue 37: a map node's row says how many items it has in each state, and counts the
    completed ones as its progress."""
    from cyclone_mp.store import Store

    import map_handlers as mh

    client, tc = fresh
    run_id = client.enqueue(mh.squares, {"n": 3})
    store = Store.open(client.dsn)
    try:
        [row] = store.claims.claim(owner="t", queues=["default"], names=["numbers"], limit=1, ttl=60).rows
        store.outcomes.complete(owner="t", items=[(row["id"], row["lease_generation"], [{"x": 1}, {"x": 2}, {"x": 3}],
                                                   None)])
        [item] = store.claims.claim(owner="t", queues=["default"], names=["square"], limit=1, ttl=60).rows
        store.outcomes.complete(owner="t", items=[(item["id"], item["lease_generation"], 1, None)])
    finally:
        store.close()
    square = next(s for s in tc.get(f"/api/runs/{run_id}").json()["steps"] if s["name"] == "square")
    assert (square["kind"], square["state"], square["items_summary"]) == ("map", "running",
                                                                         "3 items: 1 completed, 2 available")
    assert square["progress"] == {"done": 1, "total": 3, "message": "items"}
    assert "3 items: 1 completed, 2 available" in tc.get(f"/runs/{run_id}").text


def test_spawned_runs_link_to_their_parent_and_back(fresh: tuple[cy.Client, TestClient]) -> None:
    """Issue 37: a run's page lists the runs its handlers spawned; a spawned run's page and
    its line in the runs list link to the run that spawned it."""
    from cyclone_mp import spawning
    from cyclone_mp.store import Store

    import map_handlers as mh

    client, tc = fresh
    mux = cy.Mux().register(mh.spawner, mh.child)
    run_id = client.enqueue(mh.spawner, {})
    ctx = cy.Context(run_id=run_id, step_name="fanout", node="fanout", attempt=1, deadline=None)
    kid = ctx.spawn(mh.child, {"i": 1}, key="only")
    store = Store.open(client.dsn)
    try:
        [row] = store.claims.claim(owner="t", queues=["default"], names=["fanout"], limit=1, ttl=60).rows
        lease = (row["id"], row["lease_generation"])
        plans = spawning.plan(mux, client.config.defaults, run_id, "fanout", ctx.spawns)
        assert store.outcomes.complete(owner="t", items=[(*lease, {}, None)], spawns={lease: plans}) == {lease}
    finally:
        store.close()
    parent = tc.get(f"/api/runs/{run_id}").json()
    assert [(c["id"], c["parent_key"]) for c in parent["children"]] == [(kid, "only")]
    assert kid[:8] in tc.get(f"/runs/{run_id}").text
    child = tc.get(f"/api/runs/{kid}").json()
    assert child["parent"] == {"id": run_id, "node": "fanout", "key": "only"}
    assert "spawned by" in tc.get(f"/runs/{kid}").text
    line = next(r for r in tc.get("/api/runs").json()["runs"] if r["id"] == kid)
    assert line["parent_id"] == run_id
