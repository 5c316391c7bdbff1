"""The operator dashboard's JSON API and pages against a populated database, checked
against SQL on it; and a real browser on the same database.

* ``world``: one database per module with runs in every state, made by a real
  supervisor process (so a wedged step carries real kill forensics): completed runs, a
  run discarded after three raised errors, one whose child exits, one whose handler
  wedges in C and is SIGKILLed at its timeout, an available, a paused and a cancelled
  run, and a workflow holding pending, waiting_signal and waiting_timer nodes. Every
  count the API returns is checked against SQL on that database.
* Without a token, only loopback host names are served.
* The browser test drives the real ``cyclone-mp dashboard`` in headless Chromium
  (Playwright, the system ``/usr/bin/chromium``) on that database and saves screenshots
  in ``test-artifacts/``. It runs last: it adds a run to the world.
"""

from __future__ import annotations

import dataclasses
import html as htmllib
import os
import re
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

import cyclone_mp as cy
from cyclone_mp.dashboard import create_app
from cyclone_mp.testing import Env

import dashboard_handlers as dh
import handlers as h
from dashboard_support import BASE, REPO, dashboard_process, sql
from waiting import wait_for

ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_STATES = ("running", "paused", "completed", "discarded", "cancelled")
STEP_STATES = ("pending", "available", "running", "waiting_signal", "waiting_timer", "paused", "completed",
               "discarded", "cancelled")


def db_counts(dsn: str) -> dict[str, Any]:
    """What the overview must show, straight from the tables."""
    runs = {r["state"]: r["n"] for r in sql(dsn, "SELECT state, count(*) AS n FROM cyclone_runs GROUP BY 1")}
    steps = {r["state"]: r["n"] for r in sql(dsn, "SELECT state, count(*) AS n FROM cyclone_steps GROUP BY 1")}
    by_name = {(r["name"], r["queue"], r["state"]): r["n"] for r in sql(
        dsn, "SELECT coalesce(step_name, '(' || kind || ')') AS name, queue, state, count(*) AS n "
             "FROM cyclone_steps GROUP BY 1, 2, 3")}
    return {"runs": {s: runs.get(s, 0) for s in RUN_STATES}, "steps": {s: steps.get(s, 0) for s in STEP_STATES},
            "by_name": by_name}


# -- the populated database ---------------------------------------------------------------------


@dataclasses.dataclass
class World:
    dsn: str
    env: Env
    runs: dict[str, str]  # label -> run id


@pytest.fixture(scope="module")
def world(cyclone_server: Any) -> Iterator[World]:
    """Runs in every state, made by a real supervisor process (stopped before the tests)."""
    dsn = cyclone_server.new_database()
    env = Env(dsn, workers=2, kill_grace=0.5)
    env.mux().register(h.ok, h.raises, h.exits, h.deque_wedge, h.sleeper, dh.release)
    runs: dict[str, str] = {}
    try:
        runs["later"] = env.enqueue(h.ok, {"n": "later"}, delay=3600)           # available
        runs["paused"] = env.enqueue(h.ok, {"n": "paused"}, delay=3600)
        env.client().pause(runs["paused"])                                       # paused
        runs["cancelled"] = env.enqueue(h.ok, {"n": "cancelled"}, delay=3600)
        env.client().cancel(runs["cancelled"])                                   # cancelled
        for i in range(3):
            runs[f"ok{i}"] = env.enqueue(h.ok, {"i": i})                         # completed
        runs["raises"] = env.enqueue(h.raises, {})                               # discarded: 3 errors
        runs["exits"] = env.enqueue(h.exits, {"code": 3})                        # discarded: child exited x2
        runs["wedge"] = env.enqueue(h.deque_wedge, {})                           # discarded: killed at timeout
        runs["release"] = env.enqueue(dh.release, {"x": 1})                      # a workflow, left running
        env.start_worker()
        for label in ("ok0", "ok1", "ok2", "raises", "exits", "wedge"):
            env.run_until_complete(runs[label], timeout=30)
        env.wait_for_state(runs["release"], "approve", "waiting_signal", timeout=15)
        env.stop_workers()
        yield World(dsn, env, runs)
    finally:
        env.close()
        cyclone_server.drop_database(dsn)


@pytest.fixture(scope="module")
def api(world: World) -> Iterator[TestClient]:
    client = cy.Client(world.dsn)
    try:
        with TestClient(create_app(client), base_url=BASE) as tc:
            yield tc
    finally:
        client.close()


# -- the API against the database ------------------------------------------------------------------


def test_overview_counts_match_the_database_and_the_page(world: World, api: TestClient) -> None:
    data = api.get("/api/overview").json()
    expected = db_counts(world.dsn)
    assert data["runs"]["by_state"] == expected["runs"]
    assert data["steps"]["by_state"] == expected["steps"]
    assert data["runs"]["total"] == sum(expected["runs"].values())
    shown = {(g["name"], g["queue"], s): n for g in data["steps"]["by_name"] for s, n in g["by_state"].items() if n}
    assert shown == expected["by_name"]
    # every state is represented in this world (the workflow holds pending/waiting nodes)
    assert all(expected["runs"][s] for s in RUN_STATES if s != "running") and expected["runs"]["running"] >= 2
    assert all(expected["steps"][s] for s in STEP_STATES if s != "running")
    # throughput: the task steps completed in the last 30 minutes, by finished_at
    done = sql(world.dsn, "SELECT count(*) AS n FROM cyclone_steps WHERE kind = 'task' AND state = 'completed' "
                          "AND finished_at >= date_trunc('minute', now()) - interval '29 minutes'")[0]["n"]
    assert data["throughput"]["completed"] == done and len(data["throughput"]["per_minute"]) == 30
    # recent kills: the wedged step (killed at its timeout) and the exiting child, newest first
    kills = {k["run_id"]: k for k in data["kills"]}
    wedge, exits = kills[world.runs["wedge"]], kills[world.runs["exits"]]
    assert (wedge["kind"], wedge["killed_by_supervisor"], wedge["trigger"], wedge["exit"]) == \
        ("timeout", True, "timeout", "SIGKILL")
    assert (exits["kind"], exits["killed_by_supervisor"], exits["exit"]) == ("child_exited", False, "exit 3")
    assert world.runs["raises"] not in kills  # a raised error is not a kill
    # the page shows the numbers the API returns
    html = api.get("/").text
    for state in RUN_STATES:
        assert re.search(rf'data-count="runs\.{state}">{data["runs"]["by_state"][state]}<', html), state
    for state in STEP_STATES:
        assert re.search(rf'data-count="steps\.{state}">{data["steps"]["by_state"][state]}<', html), state
    assert 'id="chart"' in html and "<svg" in html and "SIGKILL" in html


def _percentile(values: list[float], q: float) -> float:
    """PostgreSQL's percentile_cont: linear interpolation between the closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def test_hour_charts_match_the_database(world: World, api: TestClient) -> None:
    """Issue 24: beside the throughput chart, pickup latency and kills by trigger over the
    last hour, and per-step run time percentiles, each checked against the rows."""
    data = api.get("/api/overview").json()
    rows = sql(world.dsn, "SELECT step_name, state, kind, started_at, scheduled_at, finished_at, errors, "
                          "now() - interval '59 minutes' AS since FROM cyclone_steps")
    since = rows[0]["since"].replace(second=0, microsecond=0)
    finished = [r for r in rows if r["kind"] == "task" and r["finished_at"] and r["started_at"]
                and r["finished_at"] >= since]
    pickup = data["pickup"]
    assert len(pickup["per_minute"]) == 60 and pickup["steps"] == len(finished) > 0
    waits = [max(0.0, (r["started_at"] - r["scheduled_at"]).total_seconds()) for r in finished]
    p95s = [p["p95"] for p in pickup["per_minute"] if p["p95"] is not None]
    assert min(p95s) <= _percentile(waits, 0.95) + 1e-6 and pickup["worst_p95"] == max(p95s)
    assert len(pickup["chart"]["bars"]) == 60
    # kills: error entries the supervisor killed, in the last hour, by trigger
    kills: dict[str, int] = {}
    for r in rows:
        for e in r["errors"] or []:
            if e.get("killed_by_supervisor") is True and e["at"] >= since.isoformat():
                kills[e.get("trigger") or "kill"] = kills.get(e.get("trigger") or "kill", 0) + 1
    triggers = data["kill_triggers"]
    assert {t["trigger"]: t["n"] for t in triggers["by_trigger"]} == kills and kills.get("timeout", 0) >= 1
    assert triggers["total"] == sum(kills.values())
    # run time percentiles per step, of the steps completed in the last hour
    runtimes: dict[str, list[float]] = {}
    for r in finished:
        if r["state"] == "completed":
            runtimes.setdefault(r["step_name"], []).append((r["finished_at"] - r["started_at"]).total_seconds())
    shown = {d["step"]: d for d in data["durations"]}
    assert set(shown) == set(runtimes) and "ok" in shown
    for step, values in runtimes.items():
        d = shown[step]
        assert d["n"] == len(values)
        for key, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            assert abs(d[key] - _percentile(values, q)) < 1e-6, (step, key)
        assert abs(d["max"] - max(values)) < 1e-6
    html = api.get("/").text
    assert 'id="pickup-chart"' in html and 'id="kills-chart"' in html
    assert 'data-step="ok"' in html and "timeout <strong>" in html


def test_runs_filters_and_both_paginations(world: World, api: TestClient) -> None:
    total = sql(world.dsn, "SELECT count(*) AS n FROM cyclone_runs")[0]["n"]
    data = api.get("/api/runs").json()
    assert data["total"] == total == len(data["runs"]) and data["next_cursor"] is None
    for state in RUN_STATES:
        got = api.get("/api/runs", params={"state": state}).json()
        want = sql(world.dsn, "SELECT id::text AS id FROM cyclone_runs WHERE state = %s", state)
        assert {r["id"] for r in got["runs"]} == {r["id"] for r in want} and got["total"] == len(want)
    named = api.get("/api/runs", params={"name": "ok"}).json()
    assert named["total"] == 6 and {r["name"] for r in named["runs"]} == {"ok"}
    # keyset pages of 4 and offset pages of 4 both walk every run once, newest first
    seen, cursor = [], None
    while True:
        page = api.get("/api/runs", params={"limit": 4, **({"cursor": cursor} if cursor else {})}).json()
        seen += [r["id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    by_offset = [r["id"] for off in range(0, total, 4)
                 for r in api.get("/api/runs", params={"limit": 4, "offset": off}).json()["runs"]]
    assert seen == by_offset and len(seen) == len(set(seen)) == total
    created = [r["created_at"] for r in data["runs"]]
    assert created == sorted(created, reverse=True)
    # a time range: everything since the oldest run, nothing before it
    oldest = min(created)
    assert api.get("/api/runs", params={"since": oldest}).json()["total"] == total
    assert api.get("/api/runs", params={"until": oldest}).json()["total"] == 0
    # the page lists the same runs, with the filters in its form
    html = api.get("/runs", params={"state": "discarded"}).text
    for label in ("raises", "exits", "wedge"):
        assert f'data-run="{world.runs[label]}"' in html
    assert f'data-run="{world.runs["ok0"]}"' not in html


def test_run_detail_has_attempts_forensics_and_graph(world: World, api: TestClient) -> None:
    wedge = api.get(f"/api/runs/{world.runs['wedge']}").json()
    (attempt,) = wedge["attempts"]
    assert attempt["outcome"] == "timeout" and attempt["killed_by_supervisor"] is True
    assert attempt["trigger"] == "timeout" and attempt["signal_name"] == "SIGKILL" and attempt["exit"] == "SIGKILL"
    assert attempt["cpu_seconds"] > 0.3 and attempt["peak_rss_kb"] > 1000  # a C loop that burned CPU
    assert wedge["steps"][0]["state"] == "discarded" and wedge["steps"][0]["error_kind"] == "timeout"
    raises = api.get(f"/api/runs/{world.runs['raises']}").json()
    assert [a["attempt"] for a in raises["attempts"]] == [1, 2, 3]
    assert all(a["outcome"] == "error" and "ValueError" in a["traceback"] for a in raises["attempts"])
    flow = api.get(f"/api/runs/{world.runs['release']}").json()
    states = {s["name"]: s["state"] for s in flow["steps"]}
    assert states == {"fetch": "completed", "approve": "waiting_signal", "cooldown": "waiting_timer",
                      "publish": "pending"}
    graph = flow["graph"]
    assert {n["name"]: n["state"] for n in graph["nodes"]} == states
    assert {(e["from"], e["to"]) for e in graph["edges"]} == {
        ("fetch", "approve"), ("fetch", "cooldown"), ("approve", "publish"), ("cooldown", "publish")}
    assert flow["signal_names"] == ["approve"]
    assert flow["actions"] == {"cancel": True, "retry": False, "pause": True, "resume": False, "signal": True}
    # the page shows the same forensics, with the traceback, and the graph
    html = api.get(f"/runs/{world.runs['raises']}").text
    assert html.count('class="attempt"') == 3 and "Traceback" in html
    html = api.get(f"/runs/{world.runs['wedge']}").text
    assert 'class="killed"><strong class="bad">yes</strong>' in html and '<td class="trigger">timeout<' in html
    html = api.get(f"/runs/{world.runs['release']}").text
    assert html.count('class="node s-') == 4 and 'data-node="cooldown"' in html


def test_run_outputs_say_why_a_finished_step_has_none(world: World, api: TestClient) -> None:
    """Issue 19, item 9: a finished step never says "no output yet"; a step that never
    started shows attempt 0."""
    wedge = api.get(f"/api/runs/{world.runs['wedge']}").json()
    assert wedge["outputs"] == [{"node": "deque_wedge", "state": "discarded", "output": None,
                                 "note": "no output: discarded (timeout)"}]
    assert wedge["outputs_note"] is None
    done = api.get(f"/api/runs/{world.runs['ok0']}").json()
    assert done["outputs"][0]["output"]["echo"] == {"i": 0} and done["outputs"][0]["note"] is None
    flow = api.get(f"/api/runs/{world.runs['release']}").json()
    assert [o["node"] for o in flow["outputs"]] == ["fetch"] and flow["outputs_note"] is None
    later = api.get(f"/api/runs/{world.runs['later']}").json()
    assert later["outputs"] == [] and later["outputs_note"] == "no output yet"
    assert later["steps"][0]["attempt_shown"] == 0 and done["steps"][0]["attempt_shown"] == 1
    cancelled = api.get(f"/api/runs/{world.runs['cancelled']}").json()
    assert cancelled["outputs"][0]["note"] == "no output: cancelled"
    for label in ("wedge", "cancelled", "ok0"):
        html = api.get(f"/runs/{world.runs[label]}").text
        assert "no output yet" not in html
    assert "no output yet" in api.get(f"/runs/{world.runs['later']}").text
    # recent kills show each message whole (it wraps), not cut at 90 characters
    page = api.get("/").text
    kills = api.get("/api/overview").json()["kills"]
    assert kills and all(htmllib.escape(k["message"], quote=False) in page for k in kills)


@pytest.mark.parametrize("url, needle", [
    ("/api/runs?state=sleeping", "state must be one of"),
    ("/api/runs?limit=-1", "limit must be between 1 and 500"),
    ("/api/runs?limit=abc", "limit must be an integer"),
    ("/api/runs?offset=-5", "offset must be between 0"),
    ("/api/runs?since=yesterday", "since must be an ISO 8601"),
    ("/api/runs?until=2026-13-45", "until must be an ISO 8601"),
    ("/api/runs?since=2026-01-02&until=2026-01-01", "since must be earlier than until"),
    ("/api/runs?cursor=%%%", "cursor is malformed"),
    ("/api/runs?name=" + "x" * 201, "name is longer than 200"),
    ("/api/overview?minutes=0", "minutes must be between 1 and 1440"),
    ("/api/runs/not-a-uuid", "run id must be a UUID"),
    ("/api/runs/123", "run id must be a UUID"),
])
def test_malformed_parameters_are_400_with_a_message(api: TestClient, url: str, needle: str) -> None:
    response = api.get(url)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "bad_request" and needle in response.json()["message"]
    page_url = url.replace("/api/overview", "/", 1).replace("/api", "", 1)  # the page behind it
    page = api.get(page_url)
    assert page.status_code == 400 and needle in htmllib.unescape(page.text), page_url


def test_unknown_run_is_404_and_openapi_documents_the_api(api: TestClient) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    response = api.get(f"/api/runs/{missing}")
    assert response.status_code == 404 and response.json() == {"error": "not_found", "message": f"no run with id {missing}"}
    assert api.get(f"/runs/{missing}").status_code == 404
    assert api.get("/api/nothing").json()["error"] == "not_found"
    assert api.get("/api/runs/" + missing + "/cancel").status_code == 405  # actions are POST only
    schema = api.get("/api/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    assert {"/api/overview", "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/{action}"} <= set(schema["paths"])
    params = {p["name"] for p in schema["paths"]["/api/runs"]["get"]["parameters"]}
    assert params == {"state", "name", "since", "until", "cursor", "limit", "offset"}
    assert "post" in schema["paths"]["/api/runs/{run_id}/{action}"]


# -- the host guard --------------------------------------------------------------------------------


def test_without_a_token_only_loopback_host_names_are_served(api: TestClient) -> None:
    assert api.get("/api/overview", headers={"Host": "localhost:8777"}).status_code == 200
    assert api.get("/api/overview", headers={"Host": "[::1]:8777"}).status_code == 200
    rebound = api.get("/api/overview", headers={"Host": "attacker.example"})
    assert rebound.status_code == 400 and "loopback" in rebound.json()["message"]


# -- the browser ---------------------------------------------------------------------------------------


OVERFLOW_JS = """() => {
  const wide = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth) wide.push(`page ${doc.scrollWidth} > ${doc.clientWidth}`);
  document.querySelectorAll(".scroll, table, pre, section, main").forEach((el) => {
    if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== "visible")
      wide.push(`${el.tagName.toLowerCase()}#${el.id}.${el.className} ${el.scrollWidth} > ${el.clientWidth}`);
  });
  document.querySelectorAll("td.msg").forEach((el) => {
    if (el.scrollWidth > el.clientWidth + 1) wide.push(`clipped message: ${el.textContent.slice(0, 60)}`);
  });
  return wide;
}"""


def assert_no_overflow(page: Any) -> None:
    """Nothing wider than the window: no horizontal scrollbar on the page, and no table
    hidden behind one of its own (issue 19: progress and errors were behind a scrollbar)."""
    wide = page.evaluate(OVERFLOW_JS)
    assert not wide, f"{page.url}: {wide}"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)")
@pytest.mark.long  # 11 s of Chromium (the script's refresh, the layout); the pages and actions are checked over HTTP in the default run
def test_browser_overview_run_forensics_and_cancel(world: World) -> None:
    from playwright.sync_api import expect, sync_playwright

    env = world.env
    ARTIFACTS.mkdir(exist_ok=True)
    env.start_worker()
    try:
        sleeper = env.enqueue(h.sleeper, {"seconds": 60})
        env.wait_for_state(sleeper, None, "running", timeout=15)
        wait_for(lambda: any(k.get("run_id") == sleeper for w in env.client().workers()
                             for k in (w["info"] or {}).get("children", [])), 10, "the registry to show the child")
        with dashboard_process(world.dsn, "--refresh", "0.5") as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})  # issue 19: fits 1,280 px
                problems: list[str] = []  # script errors and CSP violations (reported on the console)
                page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
                page.on("pageerror", lambda exc: problems.append(str(exc)))
                page.goto(url)
                expect(page.locator("body")).to_have_attribute("data-refresh", "0.5")  # --refresh 0.5
                expected = db_counts(world.dsn)
                assert expected["steps"]["running"] == 1 and expected["runs"]["running"] >= 3
                for state in RUN_STATES:
                    expect(page.locator(f'[data-count="runs.{state}"]')).to_have_text(str(expected["runs"][state]))
                for state in STEP_STATES:
                    expect(page.locator(f'[data-count="steps.{state}"]')).to_have_text(str(expected["steps"][state]))
                expect(page.locator("#workers")).to_contain_text("sleeper")
                expect(page.locator("#kills")).to_contain_text("SIGKILL")
                # issue 24: pickup latency, kills by trigger and run time by step, redrawn by the script too
                expect(page.locator("#kill-triggers")).to_contain_text("timeout")
                expect(page.locator('#durations tr[data-step="ok"]')).to_have_count(1)
                assert page.locator("#pickup-chart rect").count() >= 60
                assert page.locator("#kills-chart rect.trig-0").count() >= 1
                # the script refreshed the page from the API and it still shows the same numbers
                expect(page.locator("body")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"), timeout=10_000)
                expect(page.locator('[data-count="steps.running"]')).to_have_text("1")
                expect(page.locator("#live")).to_have_text("live")
                assert_no_overflow(page)
                page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

                # the wedged step's run: its attempt and how the supervisor killed it
                page.goto(f"{url}runs/{world.runs['wedge']}")
                row = page.locator('tr.attempt[data-node="deque_wedge"][data-attempt="1"]')
                expect(row).to_have_attribute("data-outcome", "timeout")
                expect(row.locator("td.exit")).to_have_text("SIGKILL")
                expect(row.locator("td.killed")).to_have_text("yes")
                expect(row.locator("td.trigger")).to_have_text("timeout")
                expect(page.locator("#outputs")).to_contain_text("no output: discarded (timeout)")
                assert_no_overflow(page)
                page.screenshot(path=str(ARTIFACTS / "dashboard-run-killed.png"), full_page=True)

                # a workflow's graph, refreshed in place
                page.goto(f"{url}runs/{world.runs['release']}")
                expect(page.locator('#graph g.node[data-node="approve"]')).to_have_class("node s-waiting_signal")
                assert_no_overflow(page)
                page.screenshot(path=str(ARTIFACTS / "dashboard-run-graph.png"), full_page=True)
                for label in ("raises", "exits", "ok0", "later", "paused"):
                    page.goto(f"{url}runs/{world.runs[label]}")
                    expect(page.locator("body")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
                    assert_no_overflow(page)  # also after the script redrew the page from the API
                page.goto(f"{url}runs")
                assert_no_overflow(page)

                # cancel the running step: button, confirm page, flash; the database says cancelled
                watcher = browser.new_page()  # a second tab on the run, left alone: it must update itself
                watcher.goto(f"{url}runs/{sleeper}")
                expect(watcher.locator("body")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
                expect(watcher.locator('tr.attempt[data-outcome="running"]')).to_have_count(1)
                page.goto(f"{url}runs/{sleeper}")
                expect(page.locator('tr.attempt[data-outcome="running"]')).to_have_count(1)
                page.click('a[data-action="cancel"]')
                expect(page.locator("h1")).to_contain_text("Cancel run")
                assert env.status(sleeper).state == "running"  # nothing happens before the confirm
                page.click("#confirm")
                expect(page.locator("#flash")).to_contain_text("Cancelled run")
                status = env.status(sleeper)
                assert status.state == "cancelled" and status.step.state == "cancelled"
                assert sql(world.dsn, "SELECT state FROM cyclone_steps WHERE run_id = %s", sleeper) == \
                    [{"state": "cancelled"}]
                expect(page.locator("#run-state")).to_have_text("cancelled")
                expect(page.locator('a[data-action="cancel"]')).to_have_count(0)
                page.screenshot(path=str(ARTIFACTS / "dashboard-run-cancelled.png"), full_page=True)
                # the other tab shows it without a reload (its script redraws from /api/runs/{id})
                expect(watcher.locator("#run-state")).to_have_text("cancelled", timeout=10_000)
                expect(watcher.locator('tr.attempt[data-outcome="cancelled"]')).to_have_count(1)
                expect(watcher.locator('a[data-action="cancel"]')).to_have_count(0)
                assert_no_overflow(watcher)
                watcher.screenshot(path=str(ARTIFACTS / "dashboard-run-live-update.png"), full_page=True)
                assert not problems, problems
                # the supervisor takes the slot back: the child is killed, no worker runs the step
                wait_for(lambda: not any(k.get("run_id") == sleeper for w in env.client().workers()
                                         for k in (w["info"] or {}).get("children", [])), 10,
                         "the supervisor to kill the cancelled child")
            finally:
                browser.close()
    finally:
        env.stop_workers()
