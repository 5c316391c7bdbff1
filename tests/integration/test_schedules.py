"""Periodic schedules (issue 21): slots, DST, catch-up, one run per slot across supervisors."""

from __future__ import annotations

import datetime as dt
import json
import os
import time

import pytest
from click.testing import CliRunner

import cyclone_mp as cy
from cyclone_mp import schedules
from cyclone_mp.schedules import Schedule, plan
from cyclone_mp.store import Store, connect

import flow_handlers as fh
from fixed_clock import FixedClock

UTC = dt.timezone.utc
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


# -- pure: slots and the catch-up decision ----------------------------------------------------


def test_interval_slots_are_multiples_of_every_since_the_epoch():
    s = Schedule(name="s", target=fh.tick, every=0.5)
    got = list(zip(range(3), s.slots_after(utc("2026-01-01T00:00:00.200000"))))
    assert [x for _, x in got] == [utc("2026-01-01T00:00:00.500000"), utc("2026-01-01T00:00:01"),
                                  utc("2026-01-01T00:00:01.500000")]
    assert s.next_after(utc("2026-01-01T00:00:01")) == utc("2026-01-01T00:00:01.500000")  # strictly after


@pytest.mark.parametrize("bad", [
    {"cron": "61 * * * *"}, {"cron": "* * * *"}, {"every": 0}, {"every": -1}, {"cron": "* * * * *", "every": 1},
    {}, {"every": 1, "catch_up": "some"}, {"cron": "* * * * *", "tz": "Mars/Olympus"}, {"every": 1, "input": {1, 2}},
    {"every": 1, "input": {"text": "a\x00b"}}, {"every": 1, "name": "a\x00b"}, {"every": 1, "name": "n" * 201},
])
def test_bad_schedules_are_rejected_at_definition(bad):
    with pytest.raises(cy.ConfigurationError):
        cy.Mux().schedule(fh.tick, **bad)


def test_a_schedule_whose_input_has_no_key_is_rejected_at_definition():
    with pytest.raises(cy.ConfigurationError, match="concurrency_key"):
        cy.Mux().schedule(fh.per_tenant, every=10, input={"no_tenant": 1})
    assert cy.Mux().schedule(fh.per_tenant, every=10, input={"tenant": "a"}).name == "per_tenant"


def test_the_decorator_form_registers_the_step_and_the_schedule():
    mux = cy.Mux()

    @mux.schedule(every=5, name="five")
    @cy.step("decorated")
    def decorated(ctx, inp):
        return {}

    assert isinstance(decorated, cy.Step) and "decorated" in mux.step_names
    assert mux.schedules["five"].every == 5.0 and mux.schedules["five"].target is decorated
    with pytest.raises(cy.ConfigurationError):  # the same name, another definition
        mux.schedule(fh.tick, every=6, name="five")


def test_cron_slots_in_a_zone_follow_debian_cron_across_dst():
    paris = Schedule(name="p", target=fh.tick, cron="30 2 * * *", tz="Europe/Paris")
    spring = paris.slots_after(utc("2026-03-28T12:00:00"))
    # 02:30 does not exist on 2026-03-29: it runs right after the jump, at 03:00 CEST, once
    assert [next(spring) for _ in range(2)] == [utc("2026-03-29T01:00:00"), utc("2026-03-30T00:30:00")]
    autumn = paris.slots_after(utc("2026-10-24T12:00:00"))
    # 02:30 happens twice on 2026-10-25: a job at a fixed hour runs once, at the first
    assert [next(autumn) for _ in range(2)] == [utc("2026-10-25T00:30:00"), utc("2026-10-26T01:30:00")]
    half = Schedule(name="h", target=fh.tick, cron="*/30 * * * *", tz="Europe/Paris")
    # a job that runs several times an hour runs in both copies of the repeated hour
    it = half.slots_after(utc("2026-10-24T23:59:00"))
    assert [next(it) for _ in range(5)] == [utc(f"2026-10-25T{h}") for h in
                                           ("00:00:00", "00:30:00", "01:00:00", "01:30:00", "02:00:00")]
    # restarting from any slot gives the same sequence (each tick starts from the row's last slot)
    slots = [next(iter(half.slots_after(utc("2026-10-24T23:59:00"))))]
    for _ in range(4):
        slots.append(half.next_after(slots[-1]))
    assert slots == [utc(f"2026-10-25T{h}") for h in ("00:00:00", "00:30:00", "01:00:00", "01:30:00", "02:00:00")]


def test_catch_up_policies_decide_missed_slots():
    now = utc("2026-06-01T12:17:00")
    last = utc("2026-06-01T12:00:10")  # slots 12:05, 12:10 and 12:15 are due, all missed (over 60 s late)
    defs = {p: Schedule(name=p, target=fh.tick, every=300, catch_up=p) for p in ("all", "latest", "none")}
    assert plan(defs["all"], last_slot=last, now=now).enqueue == [utc(f"2026-06-01T12:{m}:00") for m in ("05", "10", "15")]
    assert plan(defs["latest"], last_slot=last, now=now).enqueue == [utc("2026-06-01T12:15:00")]
    decided = plan(defs["none"], last_slot=last, now=now)
    assert decided.enqueue == [] and decided.skipped == 3
    assert decided.last_slot == utc("2026-06-01T12:15:00") and decided.next_at == utc("2026-06-01T12:20:00")
    # a slot late by less than the grace is never dropped, whatever the policy
    for policy in defs.values():
        assert plan(policy, last_slot=utc("2026-06-01T12:15:00"), now=utc("2026-06-01T12:20:40")).enqueue == [
            utc("2026-06-01T12:20:00")]
    # a schedule seen for the first time starts at the next slot
    first = plan(defs["all"], last_slot=None, now=now)
    assert first.enqueue == [] and first.next_at == utc("2026-06-01T12:20:00")


def test_a_long_outage_is_caught_up_in_bounded_ticks():
    s = Schedule(name="s", target=fh.tick, every=1, catch_up="all")
    last, now, total = utc("2026-06-01T12:00:00"), utc("2026-06-01T12:05:00"), 0
    while True:
        decided = plan(s, last_slot=last, now=now)
        assert len(decided.enqueue) <= schedules.MAX_SLOTS_PER_TICK
        total += len(decided.enqueue)
        last = decided.last_slot
        if decided.next_at > now:
            break
    assert total == 300
    latest = Schedule(name="l", target=fh.tick, every=1, catch_up="latest")
    last, kept = utc("2026-06-01T12:00:00"), []
    while True:
        decided = plan(latest, last_slot=last, now=now)
        kept += decided.enqueue
        last = decided.last_slot
        if decided.next_at > now:
            break
    # the slots of the last 60 s are on time; the 240 missed before them are dropped
    assert kept[0] == utc("2026-06-01T12:04:00") and len(kept) == 61


# -- the database clock, fixed: DST and catch-up through the real statements --------------------


def slots_enqueued(dsn: str, name: str) -> list[dt.datetime]:
    conn = connect(dsn)
    rows = conn.execute("SELECT idempotency_key FROM cyclone_runs WHERE idempotency_key LIKE %s",
                        (f"cyclone-schedule:{name}:%",)).fetchall()
    conn.close()
    prefix = f"cyclone-schedule:{name}:"
    return sorted(dt.datetime.fromisoformat(r["idempotency_key"][len(prefix):]) for r in rows)


def tick_through(clock: FixedClock, mux: cy.Mux, config, start: dt.datetime, end: dt.datetime, every: dt.timedelta):
    t = start
    while t <= end:
        schedules.run_once(clock.at(t), mux, config)
        t += every


def test_dst_transitions_with_a_fixed_database_clock(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    mux.schedule(fh.tick, cron="30 2 * * *", tz="Europe/Paris", name="paris", catch_up="none")
    mux.schedule(fh.tick, cron="*/30 * * * *", tz="Europe/Paris", name="paris_half", catch_up="none")
    clock = FixedClock(cyclone_dsn)
    ten = dt.timedelta(minutes=10)
    tick_through(clock, mux, client.config, utc("2026-03-28T22:00:00"), utc("2026-03-30T02:00:00"), ten)
    assert slots_enqueued(cyclone_dsn, "paris") == [utc("2026-03-29T01:00:00"), utc("2026-03-30T00:30:00")]
    tick_through(clock, mux, client.config, utc("2026-10-24T22:00:00"), utc("2026-10-26T02:00:00"), ten)
    assert slots_enqueued(cyclone_dsn, "paris")[2:] == [utc("2026-10-25T00:30:00"), utc("2026-10-26T01:30:00")]
    half = [s for s in slots_enqueued(cyclone_dsn, "paris_half") if utc("2026-10-25T00:00:00") <= s < utc("2026-10-25T02:00:00")]
    assert len(half) == 4  # local 02:00 to 03:00 happens twice: four runs
    half_spring = [s for s in slots_enqueued(cyclone_dsn, "paris_half")
                   if utc("2026-03-29T00:00:00") <= s < utc("2026-03-29T02:00:00")]
    assert half_spring == [utc("2026-03-29T00:00:00"), utc("2026-03-29T00:30:00"), utc("2026-03-29T01:00:00"),
                           utc("2026-03-29T01:30:00")]  # 02:00-03:00 local does not exist: nothing in it
    clock.store.close()
    client.close()


def test_catch_up_after_downtime_and_a_removed_schedule_stops(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    for policy in ("all", "latest", "none"):
        mux.schedule(fh.tick, every=300, name=f"cu_{policy}", catch_up=policy)
    clock = FixedClock(cyclone_dsn)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:10")), mux, client.config)  # first sight
    counts = schedules.run_once(clock.at(utc("2026-06-01T12:17:00")), mux, client.config)  # after downtime
    assert counts == {"enqueued": 4, "skipped": 5, "schedules": 3}
    assert len(slots_enqueued(cyclone_dsn, "cu_all")) == 3
    assert slots_enqueued(cyclone_dsn, "cu_latest") == [utc("2026-06-01T12:15:00")]
    assert slots_enqueued(cyclone_dsn, "cu_none") == []
    schedules.run_once(clock.at(utc("2026-06-01T12:20:30")), mux, client.config)  # on time again
    assert slots_enqueued(cyclone_dsn, "cu_none") == [utc("2026-06-01T12:20:00")]
    schedules.run_once(clock.at(utc("2026-06-01T12:20:40")), mux, client.config)  # the same slot: nothing new
    assert len(slots_enqueued(cyclone_dsn, "cu_all")) == 4
    # the code no longer defines cu_none: supervisors with that mux enqueue nothing for it
    smaller = cy.Mux()
    smaller.schedule(fh.tick, every=300, name="cu_all", catch_up="all")
    schedules.run_once(clock.at(utc("2026-06-01T12:25:30")), smaller, client.config)
    assert len(slots_enqueued(cyclone_dsn, "cu_none")) == 1 and len(slots_enqueued(cyclone_dsn, "cu_all")) == 5
    # the rows say what the CLI shows: next slot, runs, skipped
    rows = {r["name"]: r for r in clock.store.schedules.list_all()}
    assert rows["cu_all"]["next_at"] == utc("2026-06-01T12:30:00") and rows["cu_all"]["runs"] == 5
    assert rows["cu_none"]["skipped"] == 3 and rows["cu_none"]["next_at"] == utc("2026-06-01T12:25:00")
    clock.store.close()
    client.close()


def test_a_changed_definition_starts_afresh(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    daily = cy.Mux()
    daily.schedule(fh.tick, cron="0 6 * * *", name="job")
    schedules.run_once(clock.at(utc("2026-06-01T12:00:00")), daily, client.config)
    minutely = cy.Mux()
    minutely.schedule(fh.tick, every=60, name="job")
    schedules.run_once(clock.at(utc("2026-06-01T12:00:30")), minutely, client.config)  # new definition seen
    schedules.run_once(clock.at(utc("2026-06-01T12:01:10")), minutely, client.config)
    assert slots_enqueued(cyclone_dsn, "job") == [utc("2026-06-01T12:01:00")]
    clock.store.close()
    client.close()


# -- real supervisors ------------------------------------------------------------------------


def _one_run_per_slot(cyclone_env_factory, seconds: float):
    env = cyclone_env_factory(workers=2, lease_ttl=1.0, poll_interval=(0.05, 0.3))
    env.mux().schedule(fh.tick, every=1, name="every_second", catch_up="all", input={"n": 1})
    environ = {}
    if os.path.exists(FAKETIME_LIB):
        # libfaketime moves every clock of the process (the monotonic one by the same
        # constant): a slot computed from the local clock would be 90 s early or late here
        environ = {"LD_PRELOAD": FAKETIME_LIB}
    for skew in (-90, 0, 90):
        env.skew_worker_clock(skew)
        env.start_worker(environ={**environ, "FAKETIME": f"{skew:+d}"} if environ else None)
    time.sleep(seconds / 2)
    env.crash_worker()  # the +90 s one, SIGKILLed mid-way
    time.sleep(seconds / 2)
    conn = connect(env.dsn)
    rows = conn.execute(
        "SELECT r.idempotency_key AS key, r.created_at, r.state FROM cyclone_runs r"
        " WHERE r.idempotency_key LIKE 'cyclone-schedule:every_second:%' ORDER BY r.created_at").fetchall()
    conn.close()
    env.stop_workers()
    slots = sorted(dt.datetime.fromisoformat(r["key"][len("cyclone-schedule:every_second:"):]) for r in rows)
    assert len(slots) >= seconds - 3
    assert len(set(slots)) == len(slots)
    # no slot missed between the first and the last: consecutive seconds
    assert [(b - a).total_seconds() for a, b in zip(slots, slots[1:])] == [1.0] * (len(slots) - 1)
    for r in rows:  # enqueued at or after its slot, by the database clock, and soon after it
        slot = dt.datetime.fromisoformat(r["key"][len("cyclone-schedule:every_second:"):])
        assert slot <= r["created_at"] < slot + dt.timedelta(seconds=2.5), (slot, r["created_at"])
    assert sum(r["state"] == "completed" for r in rows) >= len(rows) - 3  # the last ones may still run


@pytest.mark.long
def test_one_run_per_slot_with_skewed_supervisors_one_killed(cyclone_env_factory):
    _one_run_per_slot(cyclone_env_factory, 12)


@pytest.mark.slow
def test_one_run_per_slot_with_skewed_supervisors_one_killed_60s(cyclone_env_factory):
    _one_run_per_slot(cyclone_env_factory, 60)


def test_cli_schedules_lists_next_fire_times(cyclone_dsn):
    from cyclone_mp_cli.main import cli

    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    mux.schedule(fh.tick, cron="0 6 * * *", tz="Europe/Paris", name="morning", input={"a": 1})
    clock = FixedClock(cyclone_dsn)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:00")), mux, client.config)
    result = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["name"] == "morning" and row["target"] == "flow_tick"
    assert row["next_at"].startswith("2026-06-02T04:00:00")  # 06:00 in Paris (CEST)
    assert row["spec"]["cron"] == "0 6 * * *" and row["spec"]["tz"] == "Europe/Paris"
    table = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules"])
    assert table.exit_code == 0 and "morning" in table.output and "0 6 * * *" in table.output
    clock.store.close()
    client.close()


def test_cli_deletes_a_stale_schedule_row_and_refuses_an_active_one(cyclone_dsn):
    """``schedules --delete NAME`` forgets a row no supervisor defines any more (a renamed
    or removed ``mux.schedule``); an active one would be made again, so it is refused."""
    from cyclone_mp.store import connect
    from cyclone_mp_cli.main import cli

    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    mux.schedule(fh.tick, every=60, name="old_name", input={"a": 1})
    clock = FixedClock(cyclone_dsn)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:30")), mux, client.config)
    runs = slots_enqueued(cyclone_dsn, "old_name")
    with connect(cyclone_dsn) as conn:  # a supervisor ticked it just now (the fixed clock wrote June's)
        conn.execute("UPDATE cyclone_schedules SET seen_at = now() WHERE name = 'old_name'")
    refused = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--delete", "old_name"])
    assert refused.exit_code == 1 and "is active" in refused.output, refused.output
    with connect(cyclone_dsn) as conn:  # no supervisor has ticked it for two minutes
        conn.execute("UPDATE cyclone_schedules SET seen_at = now() - interval '2 minutes' WHERE name = 'old_name'")
    done = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--delete", "old_name"])
    assert done.exit_code == 0 and "deleted schedule 'old_name'" in done.output, done.output
    assert client.schedules() == [] and slots_enqueued(cyclone_dsn, "old_name") == runs  # its runs stay
    missing = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--delete", "old_name"])
    assert missing.exit_code == 1 and "no schedule named 'old_name'" in missing.output, missing.output
    clock.store.close()
    client.close()


def test_a_schedule_enqueues_a_workflow_run(cyclone_dsn):
    import workflow_handlers as wh

    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    mux.schedule(wh.diamond, every=60, input={"x": 1}, name="wf_every_minute")
    clock = FixedClock(cyclone_dsn)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:30")), mux, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:01:05")), mux, client.config)
    (slot,) = slots_enqueued(cyclone_dsn, "wf_every_minute")
    run = client.status(client.runs(limit=1)[0]["id"])
    assert run.kind == "workflow" and run.name == "diamond" and run.input == {"x": 1}
    assert set(run.steps) == {"a", "b", "c", "d"} and run.steps["a"].state == "available"
    assert run.schedule["name"] == "wf_every_minute" and run.schedule["slot"] == slot == utc("2026-06-01T12:01:00")
    assert run.schedule["next_at"] == utc("2026-06-01T12:02:00")
    clock.store.close()
    client.close()


def test_runs_and_status_show_keys_limits_and_schedules(cyclone_dsn):
    from cyclone_mp_cli.main import cli

    client = cy.Client(cyclone_dsn)
    mux = cy.Mux()
    mux.schedule(fh.tick, every=60, name="minutely")
    clock = FixedClock(cyclone_dsn)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:30")), mux, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:01:05")), mux, client.config)
    ids = client.enqueue_many(fh.per_tenant, [{"tenant": "acme"}] * 3)
    store = Store.open(cyclone_dsn)
    store.claims.claim(owner="t", queues=["default"], names=["per_tenant"], limit=5, ttl=60)
    store.close()
    runner = CliRunner()
    rows = json.loads(runner.invoke(cli, ["--dsn", cyclone_dsn, "runs", "--json"]).output)
    by_id = {r["id"]: r for r in rows}
    assert {by_id[i]["key"] for i in ids} == {"acme"}
    assert sorted(str(by_id[i]["waiting_on"]) for i in ids) == ["None", "None", "concurrency"]
    assert [r["schedule"] for r in rows if r["name"] == "flow_tick"] == ["minutely"]
    table = runner.invoke(cli, ["--dsn", cyclone_dsn, "runs"]).output
    assert "waiting on" in table and "concurrency" in table and "minutely" in table
    waiting = next(i for i in ids if by_id[i]["waiting_on"])
    status = json.loads(runner.invoke(cli, ["--dsn", cyclone_dsn, "status", waiting, "--json"]).output)
    step = status["steps"]["per_tenant"]
    assert (step["concurrency_key"], step["concurrency"], step["waiting_on"], step["running_in_group"]) == (
        "acme", 2, "concurrency", 2)
    shown = runner.invoke(cli, ["--dsn", cyclone_dsn, "status", waiting]).output
    assert "key acme, 2/2 running" in shown and "waiting on concurrency" in shown
    scheduled = next(r["id"] for r in rows if r["schedule"])
    shown = runner.invoke(cli, ["--dsn", cyclone_dsn, "status", scheduled]).output
    assert "schedule: minutely" in shown and "next slot" in shown
    clock.store.close()
    client.close()


def test_schedules_fire_in_maintenance_and_a_locked_schedule_table_delays_no_step(cyclone_env_factory):
    """The schedule pass runs in maintenance, on its sweep tick, on its own connection: with
    the schedules table locked by another session for 3 s, steps still start, complete and
    a wedged one is killed on time; once the lock goes, the due slots are enqueued and
    counted (``scheduled``)."""
    import handlers as h

    env = cyclone_env_factory(worker="thread", workers=2, lease_ttl=1.0, kill_grace=0.2, poll_interval=(0.05, 0.2))
    env.mux().register(h.ok, h.ignores_cancel)
    env.mux().schedule(fh.tick, every=0.5, name="half_second", catch_up="all", input={"n": 1})
    sup = env.start_worker().client.supervisor
    deadline = time.monotonic() + 10
    while sup.stats["scheduled"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.stats["scheduled"] >= 1  # the first tick saw the schedule, a later one fired it
    locker = connect(env.dsn)
    locker.autocommit = False
    locker.execute("LOCK TABLE cyclone_schedules IN ACCESS EXCLUSIVE MODE")
    try:
        fired = sup.stats["scheduled"]
        t0 = time.monotonic()
        wedged = env.enqueue(h.ignores_cancel, {"sleep": 30})
        done = [env.enqueue(h.ok, {"n": i}) for i in range(5)]
        for run_id in done:
            assert env.run_until_complete(run_id, timeout=5).state == "completed"
        assert env.wait_for_state(wedged, None, ("available", "discarded"), timeout=5).error_kind == "timeout"
        while sup.stats["killed"] == 0 and time.monotonic() - t0 < 2.5:
            time.sleep(0.01)
        # 0.5 s timeout + 0.2 s grace, with room; never the lock's 3 s (its retry may be killed too by now)
        assert sup.stats["killed"] >= 1
        assert sup.stats["scheduled"] == fired  # the schedule pass waits on the lock meanwhile
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
    finally:
        locker.rollback()
        locker.close()
    deadline = time.monotonic() + 5
    while sup.stats["scheduled"] <= fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.stats["scheduled"] > fired  # the missed slots (catch_up="all") once the lock went
    env.stop_workers()
