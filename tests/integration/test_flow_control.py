"""Per-key concurrency and rate limits and fair claiming, inside the claim (issue 21)."""

from __future__ import annotations

import collections
import datetime as dt
import json
import signal
import threading
import time

import pytest

import cyclone_mp as cy
from cyclone_mp.store import INLINE_MAX, ClaimResult, Store, connect

import flow_handlers as fh
from fake_control import control_alone

NAMES = ["per_tenant", "unlimited_tenant", "rate_limited", "fair", "flow_noop"]


def claim_result(store: Store, limit: int, names=NAMES) -> ClaimResult:
    return store.claims.claim(owner="test", queues=["default"], names=names, limit=limit, ttl=60)


def claim(store: Store, limit: int, names=NAMES) -> list[dict]:
    return claim_result(store, limit, names).rows


def keys_of(dsn: str, rows: list[dict]) -> list[str]:
    conn = connect(dsn)
    got = {r["id"]: r["concurrency_key"] for r in conn.execute(
        "SELECT id, concurrency_key FROM cyclone_steps WHERE id = ANY(%s)", ([r["id"] for r in rows],)).fetchall()}
    conn.close()
    return [got[r["id"]] for r in rows]


def running_per_key(dsn: str, step: str) -> dict[str, int]:
    conn = connect(dsn)
    rows = conn.execute("SELECT concurrency_key AS k, count(*) AS n FROM cyclone_steps"
                        " WHERE state = 'running' AND step_name = %s GROUP BY 1", (step,)).fetchall()
    conn.close()
    return {r["k"]: r["n"] for r in rows}


# -- the claim statement, driven directly ----------------------------------------------------


def test_keys_are_claimed_round_robin(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    client.enqueue_many(fh.fair, [{"tenant": "a"}] * 50)
    client.enqueue_many(fh.fair, [{"tenant": "b"}] * 3)
    client.enqueue(fh.fair, {"tenant": "c"})
    store = Store.open(cyclone_dsn)
    first = claim(store, 2)
    second = claim(store, 2)
    # b and c were enqueued after a's 50: each is served within the first two claims of two
    assert sorted(keys_of(cyclone_dsn, first + second)) == ["a", "a", "b", "c"]
    third = claim(store, 4)
    assert sorted(keys_of(cyclone_dsn, third)) == ["a", "a", "b", "b"]  # c is empty: a and b share
    store.close()
    client.close()


def test_a_key_from_the_step_or_the_enqueue(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    by_step = client.enqueue(fh.fair, {"tenant": "t9"})
    by_enqueue = client.enqueue(fh.fair, {"tenant": "t9"}, concurrency_key="override")
    assert client.status(by_step).step.concurrency_key == "t9"
    assert client.status(by_enqueue).step.concurrency_key == "override"
    with pytest.raises(cy.ConfigurationError):
        client.enqueue(fh.fair, {"no_tenant": 1})  # the callable failed: one clear error
    with pytest.raises(cy.ConfigurationError):
        client.enqueue(fh.noop, {}, concurrency_key=lambda inp: "x")
    with pytest.raises(cy.ConfigurationError):
        client.enqueue(fh.noop, {}, rate_limit=(0, 1))
    with pytest.raises(cy.ConfigurationError):
        cy.step("bad", concurrency=0)
    client.close()


def test_concurrency_limit_holds_in_the_claim_and_frees_with_the_attempt(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    client.enqueue_many(fh.per_tenant, [{"tenant": "t1"}] * 6)
    store = Store.open(cyclone_dsn)
    got = claim(store, 10)
    assert len(got) == 2 and claim(store, 10) == []
    # a completion frees its slot for the claim of the same statement (the settle path)
    settled = store.outcomes.settle(owner="test", completions=[(got[0]["id"], got[0]["lease_generation"], {}, None)],
                                    queues=["default"], names=NAMES, limit=10, ttl=60)
    assert settled.completed == {(got[0]["id"], got[0]["lease_generation"])} and len(settled.claimed) == 1
    assert running_per_key(cyclone_dsn, "per_tenant") == {"t1": 2}
    # a late completion of an attempt that no longer holds the row frees nothing
    late = store.outcomes.settle(owner="test", completions=[(got[0]["id"], got[0]["lease_generation"], {}, None)],
                                 queues=["default"], names=NAMES, limit=10, ttl=60)
    assert late.completed == set() and late.claimed == []
    # a crash: the lease expires and the sweep reclaims; then the slot is free again
    held = settled.claimed[0]["id"]
    conn = connect(cyclone_dsn)
    conn.execute("UPDATE cyclone_steps SET lease_expiry = now() - interval '1 second' WHERE id = %s", (held,))
    conn.close()
    assert claim(store, 10) == []  # expired but not reclaimed yet: still running, still holds its slot
    assert store.sweep.expire(held, lambda name: (lambda n: 0.0), {}).action == "reclaim"
    again = claim(store, 10)
    assert len(again) == 1 and running_per_key(cyclone_dsn, "per_tenant") == {"t1": 2}
    status = client.status(client.runs(limit=1)[0]["id"])  # a queued one: waits on concurrency
    waiting = [s for s in (client.status(r["id"]).step for r in client.runs()) if s.state == "available"]
    assert waiting and all(s.waiting_on == "concurrency" and s.running_in_group == 2 for s in waiting)
    assert status.step.concurrency == 2
    store.close()
    client.close()


def test_concurrent_claims_never_exceed_the_limit(cyclone_dsn):
    """Four connections claim at once, round after round, while the attempts end at random:
    the committed state never has more than two running per key."""
    client = cy.Client(cyclone_dsn)
    for tenant in ("a", "b", "c"):
        client.enqueue_many(fh.per_tenant, [{"tenant": tenant}] * 80)
    stores = [Store.open(cyclone_dsn) for _ in range(4)]
    held: list[list[dict]] = [[] for _ in stores]
    barrier = threading.Barrier(len(stores))
    peaks: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for round_ in range(40):
                barrier.wait()
                done = [(r["id"], r["lease_generation"], {}, None) for r in held[i] if (r["id"] + round_) % 2]
                held[i] = [r for r in held[i] if not (r["id"] + round_) % 2]
                settled = stores[i].outcomes.settle(owner=f"w{i}", completions=done, queues=["default"], names=NAMES,
                                                    limit=3, ttl=60)
                held[i] += settled.claimed
                barrier.wait()
                if i == 0:
                    peaks.append(running_per_key(cyclone_dsn, "per_tenant"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert max(max(p.values(), default=0) for p in peaks) == 2  # the limit is reached, never passed
    assert all(n <= 2 for p in peaks for n in p.values())
    for s in stores:
        s.close()
    client.close()


def test_a_rate_limit_holds_back_and_says_when_to_claim_again(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    client.enqueue_many(fh.rate_limited, [{"key": "k"}] * 15)
    client.enqueue_many(fh.rate_limited, [{"key": "other"}] * 3)
    store = Store.open(cyclone_dsn)
    got = claim_result(store, 30)
    assert sorted(keys_of(cyclone_dsn, got.rows)) == ["k"] * 10 + ["other"] * 3
    # a rate slot counts from 50 ms after its claim (the handler's start)
    assert got.wait is not None and 0.9 <= got.wait <= 1.05
    again = claim_result(store, 30)
    assert again.rows == [] and 0 < again.wait <= 1.05
    time.sleep(again.wait + 0.05)
    last = claim_result(store, 30)
    assert len(last.rows) == 5 and last.wait is None  # all five start: no wait left
    store.close()
    client.close()


def test_claim_stays_index_driven_with_many_keys(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    conn = connect(cyclone_dsn)
    ids = client.enqueue_many(fh.fair, [{"tenant": f"t{i % 1000:04d}"} for i in range(20_000)])
    assert len(ids) == 20_000
    conn.execute("ANALYZE cyclone_steps")
    store = Store.open(cyclone_dsn, generic_plans=True)
    claim(store, 8)
    plan = "\n".join(r["QUERY PLAN"] for r in store.conn.execute(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + __import__("cyclone_mp.store", fromlist=["Q"]).Q["claim"],
        {"owner": "x", "queues": ["default"], "cursors": [None], "names": NAMES, "limit": 8, "ttl_us": 60_000_000, "kill_within_us": 0, "start_now": 8,
         "limits": True, "rates": True, "inline_max": INLINE_MAX},
    ).fetchall())
    assert "Seq Scan on cyclone_steps" not in plan, plan
    assert "cyclone_steps_claim_key_idx" in plan
    conn.close()
    store.close()
    client.close()


def test_a_slots_holder_is_looked_up_by_id_not_by_scanning_the_running_steps(cyclone_dsn):
    """The limited claim checks each slot's holder by primary key: it must not read every
    running step (whose index keeps dead entries until a vacuum) at every claim."""
    client = cy.Client(cyclone_dsn)
    client.enqueue_many(fh.per_tenant, [{"tenant": f"t{i % 4}"} for i in range(40)])
    store = Store.open(cyclone_dsn, generic_plans=True)
    held = claim(store, 8)  # two per tenant: every slot has a running holder
    store.outcomes.settle(owner="test", completions=[(r["id"], r["lease_generation"], {}, None) for r in held[:4]],
                          queues=["default"], names=NAMES, limit=0, ttl=60)
    plan = "\n".join(r["QUERY PLAN"] for r in store.conn.execute(
        "EXPLAIN (ANALYZE, COSTS OFF) " + __import__("cyclone_mp.store", fromlist=["Q"]).Q["claim"],
        {"owner": "x", "queues": ["default"], "cursors": [None], "names": NAMES, "limit": 8, "ttl_us": 60_000_000, "kill_within_us": 0, "start_now": 8,
         "limits": True, "rates": True, "inline_max": INLINE_MAX},
    ).fetchall())
    assert "cyclone_slots_pkey" in plan  # the slots were looked at
    assert "cyclone_steps_running_idx" not in plan, plan
    store.close()
    client.close()


@pytest.mark.parametrize("step, variant", [(fh.noop, "plain"), (fh.fair, "fair"), (fh.per_tenant, "concurrency"),
                                           (fh.rate_limited, "limited")])
def test_every_claim_returns_payloads_as_text_and_leaves_big_ones_out(cyclone_dsn, step, variant):
    """The plain, fair, concurrency and full limited claims, alone (Claims.claim: the lease keeper's) and with
    a batch of outcomes (Outcomes.settle: the outcome writer's), return the input as JSON text,
    unparsed, and leave out an input stored bigger than INLINE_MAX (``big``: the payload loader
    loads it alone); (id, generation) pairs say which outcomes were written."""
    import base64
    import json
    import os

    from cyclone_mp.store import FailedAttempt

    client = cy.Client(cyclone_dsn)
    huge = base64.b64encode(os.urandom(INLINE_MAX)).decode()  # ~700 kB that pglz cannot shrink under INLINE_MAX
    small = {"tenant": "t1", "key": "t1", "sleep": 0, "text": "é \"quoted\" \\"}
    client.enqueue(step, small)
    client.enqueue(step, {"tenant": "t1", "key": "t1", "huge": huge})
    client.enqueue_many(step, [{"tenant": "t1", "key": "t1", "n": i} for i in range(2)])
    store = Store.open(cyclone_dsn, generic_plans=True)
    assert claim(store, 1, names=["no_such_step"]) == []  # marks learnt
    expected = {"plain": "claim_plain", "fair": "claim_fair", "concurrency": "claim_concurrency",
                "limited": "claim"}[variant]
    assert store.claims.statement("claim", ["default"], 1) == expected
    a, b = claim(store, 2, names=[step.name])
    assert isinstance(a["input"], str) and json.loads(a["input"]) == small and a["upstream"] is None
    assert a["big"] is False
    assert b["input"] is None and b["big"] is True  # left out: loaded alone
    assert json.loads(store.payloads.load(b["id"])["input"])["huge"] == huge
    # the writer's statement: one success, one failure, and the next claim in the same statement
    settled = store.outcomes.settle(
        owner="test", completions=[(a["id"], a["lease_generation"], {}, None)],
        failures=[FailedAttempt(b["id"], b["lease_generation"], "error", {"message": "x"}, 0.0, False)],
        queues=["default"], names=[step.name], limit=5, ttl=60)
    assert settled.completed == {(a["id"], a["lease_generation"])}
    assert settled.failed == {(b["id"], b["lease_generation"])}
    claimed = sorted(settled.claimed, key=lambda r: r["id"])
    assert [json.loads(r["input"])["n"] for r in claimed if not r["big"]] == [0, 1]
    assert [r["big"] for r in claimed] == [False, False] and settled.wait is None
    # the failed one is available again (not to the statement that failed it): still big
    done = [(r["id"], r["lease_generation"], {}, None) for r in claimed]
    again = store.outcomes.settle(owner="test", completions=done, queues=["default"], names=[step.name], limit=5,
                                  ttl=60)
    assert len(again.completed) == 2 and [(r["id"], r["input"], r["big"]) for r in again.claimed] == [(b["id"], None, True)]
    store.close()
    client.close()


# -- real supervisors --------------------------------------------------------------------------


AUDIT = """
CREATE TABLE flow_audit (step_id bigint, key text, event text, at timestamptz, tx xid8);
CREATE FUNCTION flow_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'running' AND OLD.state <> 'running' THEN
        INSERT INTO flow_audit VALUES (NEW.id, NEW.concurrency_key, 'start', clock_timestamp(), pg_current_xact_id());
    ELSIF OLD.state = 'running' AND NEW.state <> 'running' THEN
        INSERT INTO flow_audit VALUES (NEW.id, NEW.concurrency_key, 'end', clock_timestamp(), pg_current_xact_id());
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER flow_audit AFTER UPDATE OF state ON cyclone_steps FOR EACH ROW EXECUTE FUNCTION flow_audit();
"""


def max_running_per_key(dsn: str) -> dict[str, int]:
    """From the audit: the most attempts of one key that ran at one instant. Events of one
    transaction count at its first event's time, ends before starts (a statement that ends
    one attempt and starts the next hands the slot over)."""
    conn = connect(dsn)
    rows = conn.execute("""
        SELECT key, event, min(at) OVER (PARTITION BY tx) AS at_tx, at, step_id FROM flow_audit
    """).fetchall()
    conn.close()
    events = collections.defaultdict(list)
    for r in rows:
        at = r["at_tx"] if r["event"] == "end" else r["at"]
        events[r["key"]].append((at, 0 if r["event"] == "end" else 1, r["step_id"]))
    peaks = {}
    for key, evs in events.items():
        n = peak = 0
        for _, kind, _ in sorted(evs):
            n += 1 if kind else -1
            peak = max(peak, n)
        peaks[key] = peak
    return peaks


@pytest.mark.long  # 7 s of four supervisors; racing claimers hold the bound in the default run (test_concurrent_claims_never_exceed_the_limit)
def test_concurrency_two_per_tenant_over_four_supervisors(cyclone_env_factory):
    env = cyclone_env_factory(workers=4, lease_ttl=1.0, poll_interval=(0.02, 0.1))
    conn = connect(env.dsn)
    conn.execute(AUDIT)
    env.mux().register(fh.per_tenant, fh.unlimited_tenant)
    client = env.client()
    for _ in range(4):
        env.start_worker()
    ids = []
    for tenant in ("a", "b", "c"):
        ids += client.enqueue_many(fh.per_tenant, [{"tenant": tenant, "sleep": 0.1}] * (67 if tenant != "c" else 66))
    ids += client.enqueue_many(fh.unlimited_tenant, [{"tenant": "free", "sleep": 0.3}] * 12)  # the control
    # SIGKILL a supervisor while it holds slots; they free when its leases expire
    owners = {w.supervisor_id: w for w in env.workers}
    deadline = time.monotonic() + 20
    victim = None
    while victim is None and time.monotonic() < deadline:
        row = conn.execute("SELECT lease_owner FROM cyclone_steps WHERE state = 'running' AND step_name = 'per_tenant'"
                           " LIMIT 1").fetchone()
        victim = owners.get(row["lease_owner"]) if row else None
        time.sleep(0.005)
    assert victim is not None
    victim.popen.send_signal(signal.SIGKILL)
    victim.popen.wait()
    victim = victim.supervisor_id
    killed_at = time.monotonic()
    while conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE state = 'running' AND lease_owner = %s",
                       (victim,)).fetchone()["n"]:
        time.sleep(0.02)
    freed_after = time.monotonic() - killed_at
    # the lease runs out within lease_ttl of the last renewal; the sweep (every poll) reclaims
    assert freed_after < 1.0 + 0.5, freed_after
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    peaks = max_running_per_key(env.dsn)
    assert peaks["a"] == peaks["b"] == peaks["c"] == 2, peaks
    assert peaks["free"] > 2, peaks  # the audit sees parallelism where no limit applies
    n = conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE step_name = 'per_tenant' AND state = 'completed'"
                     ).fetchone()["n"]
    assert n == 200
    conn.close()


def _rate(cyclone_env_factory, seconds: float):
    env = cyclone_env_factory(workers=4, lease_ttl=2.0, poll_interval=(0.02, 0.1))
    env.mux().register(fh.rate_limited)
    env.client().enqueue_many(fh.rate_limited, [{"key": "k"}] * int(10 * seconds + 40))
    env.start_worker()
    env.start_worker()
    time.sleep(seconds + 1.5)
    env.stop_workers()
    conn = connect(env.dsn)
    starts = [r["started_at"] for r in conn.execute(
        "SELECT started_at FROM cyclone_steps WHERE started_at IS NOT NULL ORDER BY started_at").fetchall()]
    conn.close()
    # never more than 10 starts in any window of one second (database clock)
    j = 0
    for i, t in enumerate(starts):
        while starts[j] <= t - dt.timedelta(seconds=1):
            j += 1
        assert i - j + 1 <= 10, (t, i - j + 1)
    # and the rate holds within one step per second over the whole run
    span = (starts[-1] - starts[0]).total_seconds()
    assert span >= seconds - 1
    assert 9.0 <= (len(starts) - 10) / span <= 10.0 + 1e-9, (len(starts), span)


@pytest.mark.long
def test_rate_limit_ten_per_second(cyclone_env_factory):
    _rate(cyclone_env_factory, 8)


@pytest.mark.slow
def test_rate_limit_ten_per_second_over_30s(cyclone_env_factory):
    _rate(cyclone_env_factory, 30)


def test_a_small_tenant_is_not_stuck_behind_a_big_one(cyclone_env_factory):
    env = cyclone_env_factory(workers=2, lease_ttl=2.0, poll_interval=(0.02, 0.1))
    env.mux().register(fh.fair)
    client = env.client()
    env.start_worker()
    client.enqueue_many(fh.fair, [{"tenant": "A"} for _ in range(20_000)])
    time.sleep(0.5)  # A's steps are being worked through
    conn = connect(env.dsn)
    b_at = conn.execute("SELECT now() AS now").fetchone()["now"]
    b_ids = client.enqueue_many(fh.fair, [{"tenant": "B"}] * 10)
    visible = conn.execute("SELECT now() AS now").fetchone()["now"]  # B's steps are committed
    for run_id in b_ids:
        env.run_until_complete(run_id, timeout=10)
    rows = conn.execute("SELECT concurrency_key AS k, started_at FROM cyclone_steps WHERE started_at >= %s"
                        " ORDER BY started_at, id", (b_at,)).fetchall()
    env.stop_workers()
    conn.close()
    b_times = [r["started_at"] for r in rows if r["k"] == "B"]
    # a claim's steps share its started_at (the claim's now()): count the claims of A that
    # began after B's steps were visible and before B's first start
    a_batches = {r["started_at"] for r in rows if r["k"] == "A" and visible < r["started_at"] < b_times[0]}
    assert len(a_batches) <= 1, sorted(a_batches)  # B's first step is in the first or second claim
    assert (b_times[-1] - b_at).total_seconds() < 1.0, (b_times[-1] - b_at)


def test_each_claim_takes_what_it_is_made_for_and_the_marks_choose_it(cyclone_dsn):
    """A queue no keyed or limited step entered is claimed by the plain statement, one
    with keys by the fair one, with concurrency limits by the concurrency one, with rate
    limits by the full one. Each leaves alone what it is not made for, so a claim chosen
    from older marks passes no limit. The marks come back in every claim's meta row (no
    round trip of their own): a store that does not know them yet claims with the full
    statement, and one whose marks were out of date claims the rest at once with the
    statement the new marks call for."""
    from cyclone_mp.store import Q

    def run(store: Store, statement: str) -> tuple[list[str], dict]:
        rows = store.conn.execute(Q[statement], {
            "owner": "test", "names": NAMES, "limit": 10, "ttl_us": 60_000_000, "kill_within_us": 0, "start_now": 8, "inline_max": INLINE_MAX,
            **store.claims.params(["default"], statement)}).fetchall()
        return sorted(keys_of(cyclone_dsn, [r for r in rows if r["id"] is not None])), next(
            json.loads(r["step_name"]) for r in rows if r["id"] is None)

    client = cy.Client(cyclone_dsn)
    store = Store.open(cyclone_dsn)
    assert store.claims.statement("claim", ["default"], 1) == "claim"  # marks not known yet: the full claim
    assert claim(store, 1) == [] and store.claims.marks == {}
    assert store.claims.statement("claim", ["default"], 1) == "claim_plain"
    client.enqueue_many(fh.noop, [{}] * 2)
    client.enqueue_many(fh.fair, [{"tenant": "k"}] * 2)  # keys, no limit: the queue is marked "keys"
    client.enqueue_many(fh.per_tenant, [{"tenant": "t"}] * 4)  # "limits" (concurrency 2)
    client.enqueue_many(fh.rate_limited, [{"key": "r"}] * 2)  # "rates"
    assert run(store, "claim_plain") == (["", ""], {"default": "rates"})
    assert run(store, "claim_fair")[0] == ["k", "k"]  # no limited step
    assert run(store, "claim_concurrency")[0] == ["t", "t"]  # the limit holds; no rate-limited step
    assert run(store, "claim")[0] == ["r", "r"]
    # a store whose marks are out of date claims the rest with the full claim at once
    client.enqueue_many(fh.noop, [{}] * 2)
    client.enqueue_many(fh.rate_limited, [{"key": "s"}] * 2)
    stale = Store.open(cyclone_dsn)
    stale.claims.marks, stale.claims.marks_for = {}, frozenset(["default"])
    assert sorted(keys_of(cyclone_dsn, claim(stale, 10))) == ["", "", "s", "s"]
    assert stale.claims.marks == {"default": "rates"} and stale.claims.statement("claim", ["default"], 1) == "claim"
    # a queue the store has no marks for (another queue set) gets the full claim again
    assert stale.claims.statement("claim", ["default", "other"], 1) == "claim"
    stale.close()
    store.close()
    client.close()


def test_process_control_polls_when_the_rate_limit_frees_a_slot():
    """A claim's ``wait`` (Claimed.wait, from ClaimResult.wait or Settled.wait) brings the
    next poll forward to when the held-back step may start, never later than the poll
    interval's backoff would."""
    from cyclone_mp.config import Config
    from cyclone_mp.messages import Claimed

    now = [100.0]
    control, watchdog, _ = control_alone(Config.build(workers=2, poll_interval=(0.5, 5.0)), clock=lambda: now[0])
    try:
        control.poll_delay = 4.0
        control.claims.on_claimed(Claimed((), sent=100.0, limit=2))
        assert control.next_poll == pytest.approx(105.0)  # empty: the backoff doubles (capped at 5 s)
        control.claims.on_claimed(Claimed((), sent=100.0, limit=2, wait=0.3))
        assert control.next_poll == pytest.approx(100.3)  # a rate slot frees then
        control.claims.on_claimed(Claimed((), sent=100.0, limit=2, wait=60.0))
        assert control.next_poll == pytest.approx(105.0)  # never later than without a wait
    finally:
        control.close()
        watchdog.close()


def test_a_rate_limited_queue_is_claimed_again_when_its_slots_free(cyclone_env_factory):
    """With a long poll backoff (1.5 s doubling to 5 s), 30 steps at 10 starts per second
    start in three waves a second apart: the claims that found the bucket empty said when
    it refills, and the supervisor polled then (not 3 or 5 s later)."""
    env = cyclone_env_factory(worker="thread", workers=4, lease_ttl=2.0, poll_interval=(1.5, 5.0))
    env.mux().register(fh.rate_limited)
    ids = env.client().enqueue_many(fh.rate_limited, [{"key": "k"}] * 30)
    env.start_worker()
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=15).state == "completed"
    env.stop_workers()
    conn = connect(env.dsn)
    starts = [r["started_at"] for r in conn.execute(
        "SELECT started_at FROM cyclone_steps WHERE step_name = 'rate_limited' ORDER BY started_at").fetchall()]
    conn.close()
    span = (starts[-1] - starts[0]).total_seconds()
    assert 2.0 <= span < 2.6, span
