"""Two definitions of one schedule at once (a rolling deploy): each slot gets one run, or is
counted as skipped, and which definition's input it gets follows the documented rule."""

from __future__ import annotations

import datetime as dt
import time

import pytest

import cyclone_mp as cy
from cyclone_mp import schedules
from cyclone_mp.schedules import Schedule, take_over
from cyclone_mp.store import Store, connect

import flow_handlers as fh
from fixed_clock import FixedClock

UTC = dt.timezone.utc
PREFIX = "cyclone-schedule:deploy:"


def utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def fired(dsn: str) -> list[tuple[dt.datetime, str]]:
    """(slot, the run's input "v") of every run of the schedule "deploy", by slot."""
    with connect(dsn) as conn:
        rows = conn.execute("SELECT idempotency_key AS key, input FROM cyclone_runs WHERE idempotency_key LIKE %s",
                            (PREFIX + "%",)).fetchall()
    return sorted((dt.datetime.fromisoformat(r["key"][len(PREFIX):]), r["input"]["v"]) for r in rows)


def row_of(dsn: str) -> dict:
    with connect(dsn) as conn:
        return conn.execute("SELECT * FROM cyclone_schedules WHERE name = 'deploy'").fetchone()


def definition(v: str, **options) -> cy.Mux:
    mux = cy.Mux()
    mux.schedule(fh.tick, name="deploy", input={"v": v}, **{"every": 1, **options})
    return mux


def test_a_handover_inherits_the_previous_definitions_pending_slots_within_the_grace():
    previous = Schedule(name="s", target=fh.tick, every=10, input={"v": "old"}, catch_up="all")
    new = Schedule(name="s", target=fh.tick, every=15, input={"v": "new"})
    assert previous.fingerprint != new.fingerprint
    assert Schedule.from_spec("s", fh.tick, previous.spec) == previous
    decided = take_over(new, previous, last_slot=utc("2026-06-01T12:00:00"), since=utc("2026-06-01T12:01:35"),
                        now=utc("2026-06-01T12:01:40"))
    # the old slots 12:00:10 to 12:01:30 were not enqueued: the last 60 s of them are
    assert decided.inherited == tuple(utc(f"2026-06-01T12:{m}") for m in ("00:40", "00:50", "01:00", "01:10",
                                                                          "01:20", "01:30"))
    assert decided.skipped == 3 and decided.enqueue == [] and decided.next_at == utc("2026-06-01T12:01:45")
    # the new definition's slots start after it came into force, not after the row's last slot
    later = take_over(new, previous, last_slot=utc("2026-06-01T12:01:30"), since=utc("2026-06-01T12:01:35"),
                      now=utc("2026-06-01T12:02:01"))
    assert later.inherited == () and later.enqueue == [utc("2026-06-01T12:01:45"), utc("2026-06-01T12:02:00")]
    # a new row starts after the definition was first declared
    fresh = take_over(new, None, last_slot=None, since=utc("2026-06-01T12:01:35"), now=utc("2026-06-01T12:01:36"))
    assert fresh.enqueue == [] and fresh.next_at == utc("2026-06-01T12:01:45")
    # an older definition taking over (its first declaration before the row's last slot)
    # resumes from the row's last slot under its own catch-up policy
    back = take_over(previous, new, last_slot=utc("2026-06-01T12:01:45"), since=utc("2026-06-01T11:00:00"),
                     now=utc("2026-06-01T12:03:05"))
    assert back.inherited == () and back.enqueue[0] == utc("2026-06-01T12:01:50") and back.skipped == 0
    assert (len(back.enqueue), Schedule.from_spec("s", fh.tick, {"every": "soon"})) == (8, None)


def test_two_definitions_ticking_in_turn_fire_every_slot_once(cyclone_dsn):
    """An old and a new definition tick alternately for 13 s (the database clock fixed per
    tick): 13 slots, one run each, none skipped; the old input until the new definition
    was first declared, the new one after."""
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    old, new = definition("old"), definition("new")
    start = utc("2026-06-01T12:00:00.100000")
    schedules.run_once(clock.at(start), old, client.config)
    schedules.run_once(clock.at(start + dt.timedelta(seconds=3)), old, client.config)
    deploy = start + dt.timedelta(seconds=3.3)  # the new definition is first declared here
    for k in range(14):
        t = deploy + dt.timedelta(seconds=k)
        schedules.run_once(clock.at(t), new, client.config)
        schedules.run_once(clock.at(t + dt.timedelta(seconds=0.5)), old, client.config)
    got = fired(cyclone_dsn)
    slots = [s for s, _ in got]
    assert slots == [utc("2026-06-01T12:00:01") + dt.timedelta(seconds=i) for i in range(16)]
    assert [v for s, v in got if s <= deploy] == ["old"] * 3
    assert [v for s, v in got if s > deploy] == ["new"] * 13
    row = row_of(cyclone_dsn)
    assert (row["runs"], row["skipped"]) == (16, 0)
    listed = {r["name"]: r for r in clock.store.schedules.list_all()}["deploy"]  # on the fixed clock
    assert listed["spec"]["input"] == {"v": "new"} and len(listed["definitions"]) == 2
    assert [d["in_force"] for d in listed["definitions"]] == [True, False]
    clock.store.close()
    client.close()


def test_the_old_definitions_slot_due_before_the_new_one_appeared_keeps_its_input(cyclone_dsn):
    """The new definition is first declared just after a slot that the old one has not
    enqueued yet: the new one's first tick enqueues that slot with the old input."""
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    old, new = definition("old"), definition("new")
    schedules.run_once(clock.at(utc("2026-06-01T12:00:00.500000")), old, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:01.200000")), old, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:02.050000")), new, client.config)  # 12:00:02 not enqueued yet
    schedules.run_once(clock.at(utc("2026-06-01T12:00:02.200000")), old, client.config)  # not in force: nothing
    schedules.run_once(clock.at(utc("2026-06-01T12:00:03.100000")), new, client.config)
    assert fired(cyclone_dsn) == [(utc("2026-06-01T12:00:01"), "old"), (utc("2026-06-01T12:00:02"), "old"),
                                  (utc("2026-06-01T12:00:03"), "new")]
    assert row_of(cyclone_dsn)["skipped"] == 0
    clock.store.close()
    client.close()


def test_a_pending_slot_whose_target_the_new_code_lacks_is_counted_as_skipped(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    old = definition("old")
    new = cy.Mux()
    new.schedule(fh.noop, every=1, name="deploy", input={"v": "new"})  # another step; flow_tick unknown here
    schedules.run_once(clock.at(utc("2026-06-01T12:00:00.500000")), old, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:01.200000")), old, client.config)
    counts = schedules.run_once(clock.at(utc("2026-06-01T12:00:02.050000")), new, client.config)
    assert counts == {"enqueued": 0, "skipped": 1, "schedules": 1}  # 12:00:02 is the old definition's
    schedules.run_once(clock.at(utc("2026-06-01T12:00:03.100000")), new, client.config)
    assert fired(cyclone_dsn) == [(utc("2026-06-01T12:00:01"), "old"), (utc("2026-06-01T12:00:03"), "new")]
    assert row_of(cyclone_dsn)["skipped"] == 1 and row_of(cyclone_dsn)["target"] == "flow_noop"
    clock.store.close()
    client.close()


def test_a_row_made_before_definitions_were_kept_goes_on_as_it_was(cyclone_dsn):
    """After the migration that added definitions (a row without a fingerprint, no
    definition rows), the same definition's first tick is no handover: its catch-up
    policy decides the slots missed meanwhile."""
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    mux = definition("same", every=10, catch_up="all")
    schedules.run_once(clock.at(utc("2026-06-01T12:00:05")), mux, client.config)
    schedules.run_once(clock.at(utc("2026-06-01T12:00:11")), mux, client.config)
    with connect(cyclone_dsn) as conn:
        conn.execute("UPDATE cyclone_schedules SET fingerprint = NULL")
        conn.execute("DELETE FROM cyclone_schedule_definitions")
    counts = schedules.run_once(clock.at(utc("2026-06-01T12:02:01")), mux, client.config)
    assert counts == {"enqueued": 11, "skipped": 0, "schedules": 1}  # 12:00:20 to 12:02:00, all caught up
    assert len(fired(cyclone_dsn)) == 12 and row_of(cyclone_dsn)["fingerprint"] == mux.schedules["deploy"].fingerprint
    clock.store.close()
    client.close()


def test_when_the_newest_definition_is_gone_the_older_one_takes_over_counting_what_was_missed(cyclone_dsn):
    """The supervisors of the new definition stop (a deploy rolled back) while the old one's
    still run: a minute later the old definition takes over; slots of the gap late by less
    than the grace get their run, older ones are counted as skipped: none is lost silently."""
    client = cy.Client(cyclone_dsn)
    clock = FixedClock(cyclone_dsn)
    old, new = definition("old", every=10), definition("new", every=10)
    t = utc("2026-06-01T12:00:05")
    schedules.run_once(clock.at(t), old, client.config)
    schedules.run_once(clock.at(t + dt.timedelta(seconds=1)), new, client.config)
    for k in range(1, 4):  # both tick; the new one fires 12:00:10 to 12:00:30
        schedules.run_once(clock.at(t + dt.timedelta(seconds=10 * k)), new, client.config)
        schedules.run_once(clock.at(t + dt.timedelta(seconds=10 * k + 1)), old, client.config)
    for k in range(4, 16):  # the new definition's supervisors are gone
        schedules.run_once(clock.at(t + dt.timedelta(seconds=10 * k)), old, client.config)
    got = fired(cyclone_dsn)
    row = row_of(cyclone_dsn)
    every_slot = [utc("2026-06-01T12:00:10") + dt.timedelta(seconds=10 * i) for i in range(15)]  # to 12:02:30
    assert len({s for s, _ in got}) == len(got)
    assert set(s for s, _ in got) <= set(every_slot)
    assert len(got) + row["skipped"] == len(every_slot)  # each slot fired once or counted
    assert row["skipped"] >= 1 and [v for _, v in got][:3] == ["new"] * 3 and got[-1][1] == "old"
    clock.store.close()
    client.close()


@pytest.mark.long  # 13 s of two supervisors: the fixed-clock test above runs the same turns in the default suite
def test_two_supervisors_with_two_definitions_fire_each_slot_once(cyclone_env_factory):
    """A rolling deploy for real: a supervisor of the old definition runs, one of the new
    definition joins, both run together for 13 s. Every one-second slot from the first to
    the last has exactly one run (or is counted as skipped on the schedule's row), the
    old input before the new definition appeared and the new one after."""
    envs = {}
    for v in ("old", "new"):
        envs[v] = cyclone_env_factory(workers=2, lease_ttl=1.0, poll_interval=(0.05, 0.3))
        envs[v].mux().schedule(fh.tick, every=1, name="deploy", input={"v": v})
    dsn = envs["old"].dsn
    envs["old"].start_worker()
    deadline = time.monotonic() + 30
    while len(fired(dsn)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(fired(dsn)) >= 2
    envs["new"].start_worker()
    with connect(dsn) as conn:
        joined = conn.execute("SELECT now() AS t").fetchone()["t"]
    time.sleep(13)
    with connect(dsn) as conn:
        ended = conn.execute("SELECT now() AS t").fetchone()["t"]
    for env in envs.values():
        env.stop_workers()
    got = fired(dsn)
    row = row_of(dsn)
    slots = [s for s, _ in got]
    assert len(set(slots)) == len(slots)
    span = round((slots[-1] - slots[0]).total_seconds()) + 1
    assert len(slots) + row["skipped"] == span, (slots, row["skipped"])
    assert row["runs"] == len(slots)
    # every slot of the 13 s overlap but its last two (perhaps not due yet) has its run
    first = joined.replace(microsecond=0) + dt.timedelta(seconds=1)
    overlap = {first + dt.timedelta(seconds=i) for i in range(13)} - {
        s for s in (first + dt.timedelta(seconds=i) for i in range(13)) if s > ended - dt.timedelta(seconds=2)}
    assert len(overlap) >= 11 and len(overlap - set(slots)) <= row["skipped"], (overlap - set(slots), row["skipped"])
    inputs = [v for _, v in got]
    assert inputs == sorted(inputs, key=["old", "new"].index)  # old, then new: one handover
    assert inputs.count("new") >= 10


def test_cli_schedules_shows_two_live_definitions(cyclone_dsn):
    import json

    from click.testing import CliRunner
    from cyclone_mp_cli.main import cli

    client = cy.Client(cyclone_dsn)
    store = Store.open(cyclone_dsn)
    for mux in (definition("old", every=60), definition("new", every=60)):
        schedules.run_once(store, mux, client.config)
    table = CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--wide"])
    assert table.exit_code == 0 and "yes, 2 definitions" in table.output, table.output
    (row,) = json.loads(CliRunner().invoke(cli, ["--dsn", cyclone_dsn, "schedules", "--json"]).output)
    assert [(d["spec"]["input"], d["in_force"]) for d in row["definitions"]] == [({"v": "new"}, True),
                                                                                ({"v": "old"}, False)]
    store.close()
    client.close()
