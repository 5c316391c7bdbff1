"""One live execution of a step, truly (SPEC 9): after a timeout or a cancel, the retry and
a ``concurrency=1`` sibling wait for the old attempt's child to be dead; cancels are pushed;
a rate limit counts handler starts.

Every handler notes its pid and start time; a watcher polls each pid until it is gone, so
each execution is an interval [start, death] and no two of one step (or of one
concurrency group) may overlap.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import threading
import time

import psutil
import pytest

import live_handlers as lh
from waiting import supervisor_turns
from cli_run import run_cli


class Lives:
    """Watches the pids that the handlers note in ``log``: when each was last seen alive
    and first seen dead (gone, or a zombie), polled every 10 ms on a thread of its own."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.dead: dict[int, float] = {}
        self.alive: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for record in lh.records(self.log, "start"):
                pid = record["pid"]
                if pid in self.dead:
                    continue
                try:
                    gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    gone = True
                if gone:
                    self.dead[pid] = now
                else:
                    self.alive[pid] = time.time()  # alive at least until this instant
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def intervals(self) -> list[tuple[float, float, int]]:
        """(start, end, pid) of every execution noted, by start: ``end`` is when a dead one
        was last seen alive (its death came within the next 10 ms poll), now for one that
        lives. Two intervals that overlap were both alive at one instant, for certain: a
        handler that starts between a death and the poll that sees it is no overlap."""
        now = time.time()
        return sorted((r["t"], self.alive.get(r["pid"], r["t"]) if r["pid"] in self.dead else now, r["pid"])
                      for r in lh.records(self.log, "start"))


def overlaps(intervals: list[tuple[float, float, int]]) -> list[tuple]:
    """Pairs of executions alive at the same instant (a pid noted twice is one process)."""
    found = []
    for i, (start, end, pid) in enumerate(intervals):
        for start2, end2, pid2 in intervals[i + 1:]:
            if pid2 != pid and start2 < end and start < end2:
                found.append(((start, end, pid), (start2, end2, pid2)))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def crash_workers(env) -> None:
    """SIGKILL the test's supervisors once its assertions are made: their wedged children
    die with them (PDEATHSIG), where a drain would wait out ``kill_grace`` again."""
    while any(w.alive() for w in env.workers):
        env.crash_worker()


@pytest.fixture
def lives(tmp_path):
    watcher = Lives(str(tmp_path / "live.log"))
    yield watcher
    watcher.close()


# -- a retry waits for the attempt it replaces ----------------------------------------------------


def test_a_retry_starts_only_after_the_timed_out_child_is_reaped(cyclone_env_factory, lives):
    """timeout=2, kill_grace=5, backoff 0, max_attempts=2, a handler that never looks at
    its context: the sweep settles attempt 1 at its DB deadline (2 s), but attempt 2
    starts only once attempt 1's child is killed (7 s) and reaped, within 1 s of that."""
    env = cyclone_env_factory(workers=2, lease_ttl=3, kill_grace=5, poll_interval=(0.05, 0.5))
    env.mux().register(lh.live_wedge)
    run_id = env.enqueue(lh.live_wedge, {"log": lives.log})
    env.start_worker()
    assert wait_until(lambda: len(lh.records(lives.log, "start")) >= 2, timeout=30)
    first, second = sorted(lh.records(lives.log, "start"), key=lambda r: r["t"])[:2]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert wait_until(lambda: first["pid"] in lives.dead, timeout=5)
    reaped = lives.dead[first["pid"]]
    assert not overlaps(lives.intervals()), overlaps(lives.intervals())
    assert second["t"] >= reaped, (second["t"] - reaped)
    assert second["t"] - reaped <= 1.0, second["t"] - reaped
    # the old attempt lived its grace: killed about timeout + kill_grace after it started
    assert 6.0 <= reaped - first["t"] <= 9.0, reaped - first["t"]
    status = env.run_until_complete(run_id, timeout=30)
    assert (status.state, status.step.attempt, status.step.error_kind) == ("discarded", 2, "timeout")
    crash_workers(env)


def test_the_retry_waits_for_dead_by_when_the_holder_cannot_report(cyclone_env_factory, lives):
    """The sweep settles the timeout and records dead_by; while it has not passed and the
    owner has not reported the child dead, status says the step waits on its previous
    attempt."""
    env = cyclone_env_factory(workers=1, lease_ttl=3, kill_grace=5, poll_interval=(0.05, 0.5))
    env.mux().register(lh.live_wedge)
    run_id = env.enqueue(lh.live_wedge, {"log": lives.log})
    env.start_worker()

    def waiting():
        step = env.status(run_id).step
        return step if step.state == "available" and step.attempt == 2 else None

    step = wait_until(waiting, timeout=15)
    assert step is not None and step.dead_by is not None and step.waiting_on == "previous_attempt"
    assert len(lh.records(lives.log, "start")) == 1
    crash_workers(env)


# -- a concurrency slot waits for the holder's death ----------------------------------------------


@pytest.mark.parametrize("fault", ["none", pytest.param("sigkill", marks=pytest.mark.long),
                                   pytest.param("sigstop", marks=pytest.mark.long)])  # (CI runs the long ones too)
def test_concurrency_one_never_admits_a_second_handler_while_the_first_lives(cyclone_env_factory, lives, fault):
    """Two wedged steps of a concurrency=1 group: the second starts only after the first's
    child is dead, also when the holder's supervisor is SIGKILLed or SIGSTOPped during its
    kill_grace (another supervisor then waits for dead_by, or the watchdog's kill)."""
    env = cyclone_env_factory(workers=2, lease_ttl=2, kill_grace=3, poll_interval=(0.05, 0.3))
    env.mux().register(lh.live_exclusive)
    holder = env.start_worker()
    first = env.enqueue(lh.live_exclusive, {"log": lives.log, "key": 1})
    assert wait_until(lambda: lh.records(lives.log, "start"), timeout=15)
    second = env.enqueue(lh.live_exclusive, {"log": lives.log, "key": 2})
    env.start_worker()
    start = lh.records(lives.log, "start")[0]
    if fault != "none":
        wait_until(lambda: time.time() >= start["t"] + 3.0, timeout=10)  # inside the first's kill_grace
        if fault == "sigkill":
            os.kill(holder.pid, signal.SIGKILL)
            holder.popen.wait()
        else:
            os.kill(holder.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: len(lh.records(lives.log, "start")) >= 2, timeout=40)
        assert wait_until(lambda: len(lives.dead) >= 1, timeout=10)
        assert not overlaps(lives.intervals()), overlaps(lives.intervals())
    finally:
        if fault == "sigstop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder.pid, signal.SIGCONT)
    for run_id in (first, second):
        assert env.run_until_complete(run_id, timeout=40).step.error_kind == "timeout"
    assert not overlaps(lives.intervals()), overlaps(lives.intervals())
    crash_workers(env)


def test_a_cancelled_holder_keeps_its_slot_until_its_child_is_dead(cyclone_env_factory, lives):
    """client.cancel of the running holder of a concurrency=1 group: the next step of the
    group starts only once the cancelled handler's child is dead (kill_grace later)."""
    env = cyclone_env_factory(workers=2, lease_ttl=30, kill_grace=2, poll_interval=(0.05, 0.3))
    env.mux().register(lh.live_exclusive)
    env.start_worker()
    first = env.enqueue(lh.live_exclusive, {"log": lives.log, "key": 1}, timeout=60)
    assert wait_until(lambda: lh.records(lives.log, "start"), timeout=15)
    env.enqueue(lh.live_exclusive, {"log": lives.log, "key": 2, "wedge": False}, timeout=60)
    supervisor_turns(env.dsn, "claim_statements", 2)  # the second was asked for while the first holds the slot
    assert len(lh.records(lives.log, "start")) == 1
    env.client().cancel(first)
    assert wait_until(lambda: len(lh.records(lives.log, "start")) >= 2, timeout=15)
    assert not overlaps(lives.intervals()), overlaps(lives.intervals())
    holder_pid = lh.records(lives.log, "start")[0]["pid"]
    second = lh.records(lives.log, "start")[1]
    assert second["t"] - lives.dead[holder_pid] <= 1.0


def test_a_step_cancelled_before_its_handler_started_waits_for_nothing(cyclone_env_factory, tmp_path):
    """One child, prefetch, lease_ttl=10 and kill_grace=5 (a cancelled running step's
    dead_by is about 15 s away): while a 1.5 s step runs, no-ops wait queued behind it in
    its child and held in the supervisor. One of each is cancelled: neither handler
    starts, the supervisor reports both dead at once (nothing of them runs), so a retry of
    each completes within 3 s instead of waiting for dead_by, and each one's history
    entry says it was cancelled before it started (no started_at, no elapsed)."""
    log = str(tmp_path / "queued.log")
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=10, kill_grace=5, poll_interval=(0.02, 0.2))
    env.mux().register(lh.live_noted)
    client = env.client()
    client.enqueue_many(lh.live_noted, [{"log": log, "seconds": 0}] * 300)  # short steps: pipelined
    slow = env.enqueue(lh.live_noted, {"log": log, "seconds": 1.5})
    behind = client.enqueue_many(lh.live_noted, [{"log": log, "seconds": 0}] * 300)
    control = env.start_worker().client.supervisor.control
    assert wait_until(lambda: any(r["run_id"] == slow for r in lh.records(log, "start")), timeout=30)

    def queued_and_held() -> tuple[str, str] | None:
        with contextlib.suppress(RuntimeError):  # (read while process control changes them)
            queued = [a.run_id for child in list(control.pool.children) for a in list(child.queued)]
            held = [h.row["run_id"] for h in list(control.held)]
            queued, held = [r for r in behind if r in queued], [r for r in behind if r in held]
            if queued and held:
                return queued[-1], held[-1]
        return None

    picked = wait_until(queued_and_held, timeout=1.0, interval=0.005)
    assert picked, "no step was both queued in the child and held in the supervisor"
    for run_id in picked:
        client.cancel(run_id)
    assert wait_until(lambda: all(client.status(r).step.dead_by is None for r in picked), timeout=3)  # reported
    retried_at = time.time()
    for run_id in picked:
        client.retry(run_id)
    for run_id in picked:
        assert env.run_until_complete(run_id, timeout=3).state == "completed"
        starts = [r for r in lh.records(log, "start") if r["run_id"] == run_id]
        assert len(starts) == 1 and starts[0]["t"] >= retried_at, starts  # only the retry ran
        entry = client.status(run_id).step.errors[-1]
        assert entry["kind"] == "cancelled" and entry["message"] == "cancelled before it started (client.cancel)"
        assert "started_at" not in entry and "elapsed" not in entry and "claimed_at" in entry, entry


# -- cancels are pushed -----------------------------------------------------------------------------


def test_a_cancel_reaches_the_handler_within_a_second(cyclone_env_factory, tmp_path):
    """`cyclone-mp cancel` of a running step with lease_ttl=30 (a renewal every 10 s): the
    handler's cancellation trips within 1 s of the command (median of 5), pushed by
    NOTIFY rather than learned at the next renewal."""
    env = cyclone_env_factory(workers=2, lease_ttl=30, kill_grace=2)
    env.mux().register(lh.live_waits_for_cancel)
    env.start_worker()
    delays = []
    for i in range(5):
        log = str(tmp_path / f"cancel-{i}.log")
        run_id = env.enqueue(lh.live_waits_for_cancel, {"log": log})
        assert wait_until(lambda: lh.records(log, "start"), timeout=15)
        time.sleep(0.2)
        done = run_cli("cancel", run_id, dsn=env.dsn)
        cancelled_at = time.time()
        assert done.returncode == 0, done.stderr
        woke = wait_until(lambda: lh.records(log, "woke"), timeout=15)
        assert woke and woke[0]["cancelled"] and woke[0]["reason"] == "cancelled"
        delays.append(woke[0]["t"] - cancelled_at)
    assert statistics.median(delays) <= 1.0, delays


# -- a rate limit counts handler starts -------------------------------------------------------------


def most_in_window(times: list[float], seconds: float) -> int:
    """The most of ``times`` inside any half-open window of ``seconds``."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= seconds:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_a_rate_limit_bounds_the_handlers_starts(cyclone_env_factory, tmp_path):
    """rate_limit=(10, 1.0), 60 steps, 2 children, the default prefetch: no window of 1 s
    of the handlers' own start times holds more than 10 (+1 for clock granularity), and
    each handler starts within milliseconds of its claim."""
    log = str(tmp_path / "rated.log")
    env = cyclone_env_factory(workers=2, lease_ttl=5, poll_interval=(0.02, 0.2))
    env.mux().register(lh.live_rated)
    ids = env.client().enqueue_many(lh.live_rated, [{"log": log, "seconds": 0.02}] * 60)
    env.start_worker()
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    starts = [r["t"] for r in lh.records(log, "start")]
    assert len(starts) == 60
    assert most_in_window(starts, 1.0) <= 11, most_in_window(starts, 1.0)
    # the rows' claims bound them too (the slots are taken at claim), and nothing was held
    statuses = [env.status(run_id).step for run_id in ids]
    claims = [s.started_at.timestamp() for s in statuses]
    assert most_in_window(claims, 1.0) <= 10
    assert all(s.attempt == 1 and s.reclaims == 0 for s in statuses)


# -- a child is reused only when nothing of the last attempt runs in it ------------------------------


def test_threads_of_a_timed_out_async_attempt_die_before_the_retry_starts(cyclone_env_factory, tmp_path):
    """An async handler awaiting asyncio.to_thread(<15 s of work>) times out (timeout 1 s,
    kill_grace 2 s): its task is cancelled at once but the thread runs on, so its child is
    killed at kill_grace and not reused; no tick of attempt 1's thread is written once
    attempt 2 has started."""
    log = str(tmp_path / "async.log")
    env = cyclone_env_factory(workers=1, lease_ttl=3, kill_grace=2, poll_interval=(0.05, 0.3))
    env.mux().register(lh.live_async_thread)
    run_id = env.enqueue(lh.live_async_thread, {"log": log, "seconds": 15})
    env.start_worker()
    assert wait_until(lambda: len(lh.records(log, "start")) >= 2, timeout=30)
    first, second = sorted(lh.records(log, "start"), key=lambda r: r["t"])[:2]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["pid"] != second["pid"], "the child of the cancelled attempt was reused"
    late = [r for r in lh.records(log, "tick") if r["pid"] == first["pid"] and r["t"] >= second["t"]]
    assert not late, f"attempt 1's thread ticked {len(late)} times after attempt 2 started"
    status = env.run_until_complete(run_id, timeout=40)
    assert status.step.error_kind == "timeout"
    entry = status.step.errors[0]
    assert entry.get("lingering_threads") and entry.get("killed_by_supervisor")
    crash_workers(env)


def test_threads_of_a_failed_attempt_die_before_its_retry_starts(cyclone_env_factory, tmp_path):
    """A sync handler starts a thread (15 s of ticks) and raises: the attempt is not over
    while the thread runs, so its retry waits; the thread outlives kill_grace (1 s), the
    child is killed, and no tick of attempt 1's thread is written once attempt 2 started.
    The attempt's entry is the handler's failure, with the threads named."""
    log = str(tmp_path / "failed.log")
    env = cyclone_env_factory(workers=2, lease_ttl=3, kill_grace=1, poll_interval=(0.05, 0.3))
    env.mux().register(lh.live_fails_beside_a_thread)
    run_id = env.enqueue(lh.live_fails_beside_a_thread, {"log": log, "seconds": 15})
    env.start_worker()
    status = env.run_until_complete(run_id, timeout=40)
    assert status.state == "completed" and status.step.attempt == 2
    time.sleep(0.5)  # (a tick of a thread still alive would be written by now)
    first, second = sorted(lh.records(log, "start"), key=lambda r: r["t"])
    late = [r for r in lh.records(log, "tick") if r["pid"] == first["pid"] and r["t"] >= second["t"]]
    assert not late, f"attempt 1's thread ticked {len(late)} times after attempt 2 started"
    assert second["t"] - first["t"] >= 1.0, second["t"] - first["t"]  # (0.2 s without the wait)
    entry = status.step.errors[0]
    assert (entry["kind"], entry["type"], entry["message"]) == (
        "error", "builtins.RuntimeError", "failed after handing work to a thread")
    assert entry.get("lingering_threads") and entry.get("killed_by_supervisor")
    crash_workers(env)


def test_a_thread_that_stops_on_cancel_lets_its_child_be_reused(cyclone_env_factory, tmp_path):
    """The same, but the thread stops 0.3 s after the cancel: the attempt ends then (no
    kill) and the retry runs in the same child, after the thread is gone."""
    log = str(tmp_path / "polite.log")
    env = cyclone_env_factory(workers=1, lease_ttl=3, kill_grace=3, poll_interval=(0.05, 0.3))
    env.mux().register(lh.live_async_polite)
    run_id = env.enqueue(lh.live_async_polite, {"log": log, "seconds": 15})
    env.start_worker()
    assert wait_until(lambda: len(lh.records(log, "start")) >= 2, timeout=30)
    first, second = sorted(lh.records(log, "start"), key=lambda r: r["t"])[:2]
    assert first["pid"] == second["pid"]
    # attempt 1's thread stopped 0.3 s after the cancel (at 1 s): the retry came after it
    assert second["t"] - first["t"] >= 1.2, second["t"] - first["t"]
    env.client().cancel(run_id)
    status = env.run_until_complete(run_id, timeout=30)
    entry = status.step.errors[0]
    assert entry["kind"] == "timeout" and not entry.get("killed_by_supervisor")


def test_started_at_is_the_handlers_start_and_claimed_at_the_claim(cyclone_env_factory, tmp_path):
    """Steps claimed ahead (prefetch) wait for the child: status says when each row was
    claimed (claimed_at, the timeout's base) and when its handler started (started_at,
    the child's own start: within 0.1 s of the handler's clock, where some waited over
    0.15 s, so the claim would be off by more), also in `status --json`."""
    log = str(tmp_path / "noted.log")
    env = cyclone_env_factory(workers=1, lease_ttl=5, poll_interval=(0.02, 0.2))
    env.mux().register(lh.live_noted)
    ids = env.client().enqueue_many(lh.live_noted, [{"log": log, "seconds": 0.2}] * 12)
    env.start_worker()
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    noted = {r["run_id"]: r["t"] for r in lh.records(log, "start")}
    waited, off = [], []
    for run_id in ids:
        step = env.status(run_id).step
        assert step.claimed_at <= step.started_at
        waited.append((step.started_at - step.claimed_at).total_seconds())
        off.append(round(step.started_at.timestamp() - noted[run_id], 4))
    assert max(map(abs, off)) <= 0.1, off
    assert max(waited) > 0.15, waited  # some were claimed ahead and waited for a step of 0.2 s
    shown = json.loads(run_cli("status", ids[-1], "--json", dsn=env.dsn).stdout)
    node = next(iter(shown["steps"].values()))
    assert node["claimed_at"] and node["started_at"] and node["claimed_at"] <= node["started_at"]


def test_a_retry_shows_its_own_start_and_a_cancel_keeps_the_start_status_showed(cyclone_env_factory, tmp_path):
    """Steps of 0.2 s on one child with prefetch: the last of a batch is held and waits.
    It fails, and is retried at once on the free child: while the retry runs, status shows
    the retry's own start, not its claim plus the last attempt's wait. Another held one,
    once its renewal reported its wait, is cancelled: its history entry keeps started_at
    exactly as status showed it, and its claimed_at."""
    log = str(tmp_path / "held.log")
    env = cyclone_env_factory(workers=1, lease_ttl=3, prefetch=4, poll_interval=(0.02, 0.2))
    env.mux().register(lh.live_noted)
    env.mux().register(lh.live_fails_once)
    client = env.client()
    env.start_worker()
    assert env.run_until_complete(env.enqueue(lh.live_noted, {"log": log, "seconds": 0.2}), timeout=30).state \
        == "completed"  # the supervisor knows how long a step takes: it prefetches from now on
    client.enqueue_many(lh.live_noted, [{"log": log, "seconds": 0.2}] * 4)
    retried = env.enqueue(lh.live_fails_once, {"log": log, "seconds": 8})
    assert wait_until(lambda: len(lh.records(log, "start")) >= 7, timeout=30)  # 5 noted, attempts 1 and 2
    step = client.status(retried).step
    assert step.state == "running" and step.attempt == 2, step
    waited = step.errors[0]["start_delay"]
    assert waited > 0.1, step.errors  # attempt 1 was held while the child ran the others
    assert (step.started_at - step.claimed_at).total_seconds() < min(0.05, waited / 2), (step, waited)
    client.cancel(retried)

    client.enqueue_many(lh.live_noted, [{"log": log, "seconds": 0.2}] * 3)
    held = env.enqueue(lh.live_noted, {"log": log, "seconds": 30})

    def reported() -> bool:
        step = client.status(held).step
        return step.state == "running" and (step.started_at - step.claimed_at).total_seconds() > 0.1

    assert wait_until(reported, timeout=20)
    seen = client.status(held).step
    client.cancel(held)
    entry = next(e for e in client.status(held).step.errors if e["kind"] == "cancelled")
    assert dt.datetime.fromisoformat(entry["started_at"]) == seen.started_at
    assert dt.datetime.fromisoformat(entry["claimed_at"]) == seen.claimed_at
    assert 0 <= entry["elapsed"] < 30, entry


def test_started_at_is_the_childs_own_start_when_its_task_reaches_it_late(cyclone_env_factory, tmp_path, monkeypatch):
    """Process control notes an attempt's start as it sends the task. Here every task
    reaches its child 0.4 s later (a stalled write, as on a loaded machine): started_at is
    still the handler's own start, because the child says when it began, for an attempt
    alone in its child and for async ones side by side."""
    from cyclone_mp.childproc import ChildProc

    queue = ChildProc.queue

    def late(self: ChildProc, message: dict) -> None:
        if message.get("t") == "task":
            time.sleep(0.4)  # after process control noted the start
        queue(self, message)

    log = str(tmp_path / "late.log")
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=30)
    env.mux().register(lh.live_noted)
    env.mux().register(lh.live_async_noted)
    env.start_worker()
    warm = env.enqueue(lh.live_noted, {"log": str(tmp_path / "warm.log"), "seconds": 0.0})
    assert env.run_until_complete(warm, timeout=60).state == "completed"  # the child is up: none waits for it
    monkeypatch.setattr(ChildProc, "queue", late)
    ids = [env.enqueue(lh.live_noted, {"log": log, "seconds": 0.05}),
           *env.client().enqueue_many(lh.live_async_noted, [{"log": log, "seconds": 0.3}] * 2)]
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    noted = {r["run_id"]: r["t"] for r in lh.records(log, "start")}
    for run_id in ids:
        step = env.status(run_id).step
        assert (step.started_at - step.claimed_at).total_seconds() >= 0.35, step  # the task's late arrival
        assert abs(step.started_at.timestamp() - noted[run_id]) <= 0.1, (step.started_at, noted[run_id])
