"""Finding runs: the filters of ``client.runs()`` / ``AsyncClient.runs()`` / ``cyclone-mp
runs`` and of ``client.prune()`` / ``cyclone-mp prune`` (states, step name, queue,
concurrency key, schedule, created since and until; archived runs on request), on a
real PostgreSQL. Runs are enqueued for later (no supervisor needed), finished by a
cancel, moved to the archive by a history pass, and dated by hand where a test needs
old ones. The acceptance: one run found among 10,000 scheduled ones in under a second.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from typing import Any

import pytest
from click.testing import CliRunner

import cyclone_mp as cy
from cyclone_mp.store import connect

import handlers as h
from history_db import db_now, finished_at, history, where

from cyclone_mp_cli.main import cli  # noqa: E402 - the project is installed (pip install -e)

SLOT = "2026-12-04T10:00:00+00:00"


def _created(dsn: str, run_ids: list[str], ago: dt.timedelta) -> None:
    """Make runs look as if created ``ago`` before now (finished ones then finished too)."""
    with connect(dsn) as conn:
        conn.execute("UPDATE cyclone_runs SET created_at = now() - %s, "
                     "finished_at = CASE WHEN finished_at IS NULL THEN NULL ELSE now() - %s END "
                     "WHERE id = ANY(%s::uuid[])", (ago, ago, run_ids))
        conn.execute("UPDATE cyclone_steps SET finished_at = CASE WHEN finished_at IS NULL THEN NULL "
                     "ELSE now() - %s END WHERE run_id = ANY(%s::uuid[])", (ago, run_ids))


def _ids(rows: list[dict[str, Any]]) -> set[str]:
    return {row["id"] for row in rows}


@pytest.fixture
def runs(cyclone_dsn: str) -> dict[str, Any]:
    """A client and runs of every kind: ``resize`` in queue images under keys acme and
    globex (one of them created two hours ago), ``ok`` in the default queue, one run a
    schedule enqueued, two cancelled (one of them then archived)."""
    client = cy.Client(cyclone_dsn)
    client.migrate()
    later = 3600
    made = {
        "acme": client.enqueue(h.flaky, {}, queue="images", concurrency_key="acme", delay=later),
        "globex": client.enqueue(h.flaky, {}, queue="images", concurrency_key="globex", delay=later),
        "old": client.enqueue(h.flaky, {}, queue="images", concurrency_key="acme", delay=later),
        "plain": client.enqueue(h.ok, {}, delay=later),
        "nightly": client.enqueue(h.ok, {}, delay=later, idempotency_key=f"cyclone-schedule:nightly:{SLOT}"),
        "cancelled": client.enqueue(h.ok, {}, delay=later),
        "archived": client.enqueue(h.flaky, {}, queue="images", concurrency_key="acme", delay=later),
    }
    client.cancel(made["cancelled"])
    client.cancel(made["archived"])
    _created(cyclone_dsn, [made["old"]], dt.timedelta(hours=2))
    # only the one meant for the archive finished long enough ago to move there
    finished_at(cyclone_dsn, made["archived"], db_now(cyclone_dsn) - dt.timedelta(minutes=30))
    history(cyclone_dsn, archive_after=600)
    assert where(cyclone_dsn, made["archived"]) == "archive" and where(cyclone_dsn, made["cancelled"]) == "hot"
    try:
        yield {"client": client, "dsn": cyclone_dsn, **made}
    finally:
        client.close()


def test_each_filter_of_client_runs(runs: dict[str, Any]) -> None:
    client = runs["client"]
    hot = {k for k in ("acme", "globex", "old", "plain", "nightly", "cancelled")}
    assert _ids(client.runs()) == {runs[k] for k in hot}  # the archive only on request
    assert _ids(client.runs(archived=True)) == {runs[k] for k in hot | {"archived"}}
    assert [r["archived"] for r in client.runs(archived=True) if r["id"] == runs["archived"]] == [True]

    assert _ids(client.runs(step="flaky")) == {runs["acme"], runs["globex"], runs["old"]}
    assert _ids(client.runs(step="flaky", archived=True)) == {runs["acme"], runs["globex"], runs["old"],
                                                               runs["archived"]}
    assert _ids(client.runs(queue="images")) == {runs["acme"], runs["globex"], runs["old"]}
    assert _ids(client.runs(queue="default")) == {runs["plain"], runs["nightly"], runs["cancelled"]}
    assert _ids(client.runs(key="acme")) == {runs["acme"], runs["old"]}
    assert _ids(client.runs(key="acme", archived=True)) == {runs["acme"], runs["old"], runs["archived"]}
    assert _ids(client.runs(step="ok", key="acme")) == set()  # one step matches all of them
    assert _ids(client.runs(schedule="nightly")) == {runs["nightly"]}
    assert client.runs(schedule="nightly")[0]["schedule"] == "nightly"
    assert _ids(client.runs(state="cancelled", archived=True)) == {runs["cancelled"], runs["archived"]}
    assert _ids(client.runs(state=["cancelled", "running"])) == {runs[k] for k in hot}
    assert _ids(client.runs(since="1h")) == {runs[k] for k in hot - {"old"}}
    assert _ids(client.runs(since=dt.timedelta(hours=1), key="acme")) == {runs["acme"]}
    assert _ids(client.runs(until=3600)) == {runs["old"]}
    assert _ids(client.runs(since="3h", until="1h")) == {runs["old"]}
    now = dt.datetime.now(dt.timezone.utc)
    assert _ids(client.runs(since=now - dt.timedelta(hours=3), until=now - dt.timedelta(hours=1))) == {runs["old"]}
    assert len(client.runs(limit=2)) == 2


def test_the_async_client_takes_the_same_filters(runs: dict[str, Any]) -> None:
    async def read() -> tuple[set[str], set[str]]:
        async with cy.AsyncClient(runs["dsn"]) as aclient:
            return (_ids(await aclient.runs(step="flaky", since="1h", archived=True)),
                    _ids(await aclient.runs(state="cancelled")))

    assert asyncio.run(read()) == ({runs["acme"], runs["globex"], runs["archived"]}, {runs["cancelled"]})


@pytest.mark.parametrize("bad", [dict(state="done"), dict(step=""), dict(since=-5), dict(limit=0),
                                 dict(since=dt.datetime(2026, 1, 1)), dict(since="1h", until="2h"),
                                 dict(since="soon")])
def test_bad_filters_are_refused(runs: dict[str, Any], bad: dict[str, Any]) -> None:
    with pytest.raises(cy.ConfigurationError):
        runs["client"].runs(**bad)


def test_the_cli_filters(runs: dict[str, Any]) -> None:
    runner = CliRunner()

    def listed(*args: str) -> set[str]:
        result = runner.invoke(cli, ["--dsn", runs["dsn"], "runs", "--json", *args])
        assert result.exit_code == 0, result.output
        return _ids(json.loads(result.output))

    assert listed("--step", "flaky", "--since", "1h") == {runs["acme"], runs["globex"]}
    assert listed("--queue", "images", "--key", "acme") == {runs["acme"], runs["old"]}
    assert listed("--state", "cancelled", "--state", "paused", "--archived") == {runs["cancelled"], runs["archived"]}
    assert listed("--schedule", "nightly") == {runs["nightly"]}
    assert listed("--until", "1h") == {runs["old"]}
    local = (dt.datetime.now() - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")  # local time, no offset
    assert listed("--until", local) == {runs["old"]}
    result = runner.invoke(cli, ["--dsn", runs["dsn"], "runs", "--step", "nothing-like-it"])
    assert result.exit_code == 0 and "no runs match" in result.output and "--archived" in result.output
    result = runner.invoke(cli, ["--dsn", runs["dsn"], "runs", "--since", "yesterday-ish"])
    assert result.exit_code == 2 and "neither a duration" in result.output


def test_prune_with_filters(runs: dict[str, Any]) -> None:
    client, dsn = runs["client"], runs["dsn"]
    assert client.prune(0, step="flaky") == 1  # the archived resize (the others are not finished)
    assert where(dsn, runs["archived"]) == "gone" and where(dsn, runs["cancelled"]) == "hot"
    assert client.prune(0, key="acme") == 0
    assert client.prune(3600, state="cancelled") == 0  # finished only now
    assert client.prune(0, state="cancelled", since="1h") == 1
    assert where(dsn, runs["cancelled"]) == "gone"
    with pytest.raises(cy.ConfigurationError):
        client.prune(0, state="running")  # prune deletes finished runs only
    result = CliRunner().invoke(cli, ["--dsn", dsn, "prune", "--older-than", "0", "--state", "running"])
    assert result.exit_code == 2
    for run_id in (runs["acme"], runs["globex"], runs["old"], runs["plain"], runs["nightly"]):
        assert where(dsn, run_id) == "hot"  # never a running run


def test_prune_by_state_drops_only_that_states_partitions(runs: dict[str, Any]) -> None:
    client, dsn = runs["client"], runs["dsn"]
    done = client.enqueue(h.ok, {}, delay=3600)
    client.cancel(done)
    with connect(dsn) as conn:  # a discarded run in the archive, from three days ago
        conn.execute("UPDATE cyclone_runs SET state = 'discarded' WHERE id = %s", (done,))
        conn.execute("UPDATE cyclone_steps SET state = 'discarded' WHERE run_id = %s", (done,))
    finished_at(dsn, done, db_now(dsn) - dt.timedelta(days=3))
    history(dsn, archive_after=600)
    assert where(dsn, done) == "archive"
    assert client.prune(86400, state="cancelled") == 0  # the archived cancelled run is an hour old
    assert where(dsn, done) == "archive"
    assert client.prune(86400, state="discarded") == 1
    assert where(dsn, done) == "gone" and where(dsn, runs["archived"]) == "archive"


def test_one_run_among_10000_scheduled_ones_in_under_a_second(cyclone_dsn: str) -> None:
    """The acceptance: ``runs --step X --since 10m`` finds the one run of step X among
    10,000 runs scheduled for later (over 100 keys), in under a second."""
    client = cy.Client(cyclone_dsn)
    client.migrate()
    for key in range(100):
        client.enqueue_many(h.ok, [{"i": i} for i in range(100)], delay=3600, concurrency_key=f"tenant-{key}")
    wanted = client.enqueue(h.flaky, {}, delay=3600, concurrency_key="tenant-7")
    with connect(cyclone_dsn) as conn:
        conn.execute("ANALYZE cyclone_runs")
        conn.execute("ANALYZE cyclone_steps")
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        found = client.runs(step="flaky", since="10m")
        timings.append(time.perf_counter() - started)
        assert _ids(found) == {wanted}
    runner = CliRunner()
    started = time.perf_counter()
    result = runner.invoke(cli, ["--dsn", cyclone_dsn, "runs", "--step", "flaky", "--since", "10m", "--json"])
    cli_took = time.perf_counter() - started
    assert result.exit_code == 0 and _ids(json.loads(result.output)) == {wanted}
    print(f"runs --step --since among 10,001 runs: client {min(timings) * 1000:.1f} ms "
          f"(max {max(timings) * 1000:.1f}), CLI in-process {cli_took * 1000:.0f} ms")
    assert min(timings) < 1.0 and cli_took < 1.0
    assert _ids(client.runs(key="tenant-7", step="flaky")) == {wanted}
    client.close()
