"""The failure scenarios SC-04 and SC-05 of the shared scenarios/README.md: a supervisor
SIGKILLed mid-step: its child stops within about a second, and once the lease expired a
new supervisor reclaims the step, which completes exactly once (SC-04); recovery is
decided by the lease alone, never by the workers' registry, deleted or impersonated
(SC-05).

Every test ends with the README's "check after every scenario"
(``scenario_support.check_after``); the autouse fixture in ``tests/conftest.py`` also
fails a test that leaves any descendant of the test process. Handlers live in
``scenario_handlers.py`` (module level, so child processes can import them) and report
what they did as JSON lines in files under ``tmp_path``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable

import pytest

from cyclone_mp.config import Config
from cyclone_mp.store import connect
from cyclone_mp.supervisor import Supervisor

import scenario_handlers as sh
from scenario_support import check_after, gone_at, records, registry_row, wait_records
from waiting import wait_for as wait_until


class Repeater:
    """Run ``fn`` every ``interval`` seconds on a thread until stopped (a context manager)."""

    def __init__(self, fn: Callable[[], Any], interval: float = 0.05) -> None:
        self.fn, self.interval = fn, interval
        self.stop = threading.Event()
        self.runs = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.fn()
                self.runs += 1
            except BaseException as exc:  # noqa: BLE001 - reported by __exit__
                self.error = exc
                return
            self.stop.wait(self.interval)

    def __enter__(self) -> "Repeater":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        if self.error is not None:
            raise self.error


# -- SC-04 ----------------------------------------------------------------------------------------------


@pytest.mark.long  # 9 s; test_engine's crash reclaim and SC-05 below take a SIGKILLed supervisor in the default run
def test_sc04_supervisor_sigkilled_mid_step(cyclone_env_factory, tmp_path):
    """SC-04: the handler appends a line every 100 ms for 5 s; 2 s in, only the
    supervisor is SIGKILLed. The old child stops writing within about 1 s; after
    ``lease_ttl`` + one tick the new supervisor reclaims the step (``reclaims=1``, same
    ``attempt``, new ``lease_generation``) and it completes exactly once."""
    ttl, tick = 1.0, 0.1
    env = cyclone_env_factory(workers=1, lease_ttl=ttl, poll_interval=(0.02, tick))
    for s in (sh.sc_ok, sh.sc04_writer):
        env.mux().register(s)
    log = tmp_path / "writer.log"
    run_id = env.enqueue(sh.sc04_writer, {"log": str(log), "seconds": 5.0})
    w1 = env.start_worker()
    running = env.wait_for_state(run_id, None, "running", owner=w1)
    first = wait_records(log, "tick")[0]
    old_pid = first["pid"]
    wait_until(lambda: time.time() >= first["t"] + 2.0, timeout=5)
    env.crash_worker()
    t_kill = time.time()

    died = gone_at([old_pid], timeout=3.0)
    assert old_pid in died and died[old_pid] - t_kill <= 1.0, "the child outlived its SIGKILLed supervisor"
    time.sleep(0.3)
    old_lines = [r for r in records(log, "tick") if r["pid"] == old_pid]
    assert max(r["t"] for r in old_lines) <= t_kill + 1.0, "the orphan kept writing"
    assert 15 <= len(old_lines) < 50

    w2 = env.start_worker()
    t_ready = time.time()
    step = env.wait_for_state(run_id, None, "running", timeout=10, owner=w2)
    t_owned = time.time()
    assert (step.reclaims, step.attempt) == (1, running.attempt)
    assert step.lease_generation == running.lease_generation + 1
    # reclaimed once the lease expired (<= ttl after the crash) and one sweep tick passed
    assert t_owned - max(t_kill + ttl, t_ready) <= tick + 1.0, (t_owned - t_kill, t_ready - t_kill)

    run = env.run_until_complete(run_id, timeout=20)
    st = run.step
    assert (run.state, st.state, st.attempt, st.reclaims) == ("completed", "completed", 1, 1)
    assert st.errors == [] and st.output == {"lines": 50}
    done = records(log, "done")
    assert len(done) == 1 and done[0]["pid"] != old_pid
    check_after(env, w2, pids=[old_pid])


# -- SC-05 ----------------------------------------------------------------------------------------------


def test_sc05_recovery_never_depends_on_worker_bookkeeping(cyclone_env_factory, tmp_path):
    """SC-05: recovery is decided by the lease alone.

    (a) The supervisor is SIGKILLed and every ``cyclone_workers`` row (the informational
    registry) is deleted before any sweep can run, and kept deleted during recovery:
    the step is still reclaimed. (b) The supervisor is restarted on the same host while
    a registry row for the *dead* supervisor's id is kept fresh (as if a reused name made
    it look alive): the step is still reclaimed. Two supervisors made in one process
    (same host name, same pid) get distinct ids, so a reused pid cannot make a new
    supervisor the owner of a dead one's lease. (A real pid reuse across supervisor
    processes cannot be forced without a new pid namespace; the id check covers it.)
    """
    env = cyclone_env_factory(workers=1, lease_ttl=1.0)
    for s in (sh.sc_ok, sh.sc04_writer):
        env.mux().register(s)

    # (a) registry rows deleted
    log_a = tmp_path / "a.log"
    run_a = env.enqueue(sh.sc04_writer, {"log": str(log_a), "seconds": 1.5})
    w1 = env.start_worker()
    env.wait_for_state(run_a, None, "running", owner=w1)
    wait_records(log_a, "tick")
    wait_until(lambda: registry_row(env, w1.supervisor_id), timeout=5, what="w1 registry row")
    env.crash_worker()
    with connect(env.dsn) as conn:
        deleted = conn.execute("DELETE FROM cyclone_workers").rowcount
    assert deleted >= 1, "the crashed supervisor's registry row should have existed"

    def prune() -> None:
        with connect(env.dsn) as conn:
            conn.execute("DELETE FROM cyclone_workers")

    with Repeater(prune) as pruner:
        w2 = env.start_worker()
        st = env.wait_for_state(run_a, None, "running", timeout=10, owner=w2)
        assert (st.reclaims, st.attempt) == (1, 1)
        run = env.run_until_complete(run_a, timeout=20)
    assert pruner.runs > 5
    assert run.state == "completed" and run.step.reclaims == 1 and run.step.errors == []
    assert len(records(log_a, "done")) == 1

    # (b) restart on the same host while the dead supervisor's row looks alive
    log_b = tmp_path / "b.log"
    run_b = env.enqueue(sh.sc04_writer, {"log": str(log_b), "seconds": 1.5})
    env.wait_for_state(run_b, None, "running", timeout=10, owner=w2)
    wait_records(log_b, "tick")
    env.crash_worker()
    dead_id = w2.supervisor_id

    def impersonate() -> None:
        with connect(env.dsn) as conn:
            conn.execute(
                "INSERT INTO cyclone_workers (id, hostname, pid, info) VALUES (%s, %s, %s, '{}') "
                "ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()",
                (dead_id, socket.gethostname(), w2.pid),
            )

    with Repeater(impersonate) as impostor:
        w3 = env.start_worker()
        assert w3.supervisor_id.split(":")[0] == dead_id.split(":")[0] == socket.gethostname()
        assert w3.supervisor_id != dead_id
        st = env.wait_for_state(run_b, None, "running", timeout=10, owner=w3)
        assert (st.reclaims, st.attempt) == (1, 1)
        run = env.run_until_complete(run_b, timeout=20)
    assert impostor.runs > 5
    assert run.state == "completed" and run.step.reclaims == 1 and run.step.errors == []
    assert len(records(log_b, "done")) == 1

    # same host name and pid: still distinct owners
    a = Supervisor(env.dsn, env.mux(), Config.build())  # (built, not run: it holds nothing yet)
    b = Supervisor(env.dsn, env.mux(), Config.build())
    prefix = f"{socket.gethostname()}:{os.getpid()}:"
    assert a.id.startswith(prefix) and b.id.startswith(prefix) and a.id != b.id

    old_pids = [r["pid"] for r in records(log_a, "tick") + records(log_b, "tick") if r["pid"]]
    check_after(env, w3, pids=[p for p in set(old_pids) if p not in env.child_pids()])
