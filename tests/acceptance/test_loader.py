"""Payloads too big for their claim are read by the payload loader, on a thread and a
connection of its own: a slow read holds back no sweep, and the connection goes away
when there is nothing to read."""

from __future__ import annotations

import base64
import os
import time

import flow_handlers as fh
import psycopg
from cyclone_mp import loader
from cyclone_mp.store import INLINE_MAX, Payloads
from waiting import wait_for


def test_a_slow_load_holds_back_no_sweep_and_its_connection_closes_when_idle(cyclone_env_factory, monkeypatch):
    slow = 4.0
    real = Payloads.load

    def slow_load(self, *args, **kwargs):
        time.sleep(slow)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Payloads, "load", slow_load)
    monkeypatch.setattr(loader, "IDLE_CLOSE", 1.0)
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=10)
    env.mux().register(fh.noop)
    sup = env.start_worker().client.supervisor
    wait_for(lambda: sup.maintenance is not None and sup.maintenance.stats.get("sweeps", 0) > 0, 15, "a sweep")
    assert sup.loader is not None and sup.loader.store is None  # nothing to read: no connection
    huge = base64.b64encode(os.urandom(INLINE_MAX)).decode()  # stored over INLINE_MAX: left out of the claim
    run_id = env.enqueue(fh.noop, {"huge": huge})
    wait_for(lambda: sup.loader.call_started is not None, 15, "the load to begin")
    sweeps = sup.maintenance.stats.get("sweeps", 0)
    time.sleep(slow / 2)
    assert sup.loader.call_started is not None  # still reading
    assert sup.maintenance.stats.get("sweeps", 0) > sweeps  # maintenance went on meanwhile
    status = env.run_until_complete(run_id, timeout=30)
    assert (status.state, status.step.attempt) == ("completed", 1)
    assert sup.loader.stats["loads"] == 1
    wait_for(lambda: sup.loader.store is None, 10, "the idle loader to close its connection")


def test_a_load_that_waits_past_lock_timeout_is_given_back_and_read_again(cyclone_env_factory, monkeypatch):
    """A lock held a moment elsewhere (a vacuum truncating the table takes an exclusive one)
    makes the load wait past ``lock_timeout``: nothing was done, so the step is given back
    and read again, never failed as unreadable (a map's join was discarded so on a busy
    machine)."""
    real = Payloads.load
    calls = []

    def locked_once(self, *args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) > 1:
            return real(self, *args, **kwargs)
        with psycopg.connect(env.dsn) as holder:  # ends its transaction itself if this load never gives up
            holder.execute("SET idle_in_transaction_session_timeout = '5s'")
            holder.execute("LOCK TABLE cyclone_steps IN ACCESS EXCLUSIVE MODE")
            try:
                return real(self, *args, **kwargs)  # waits lock_timeout for the table: SQLSTATE 55P03
            finally:
                holder.rollback()

    monkeypatch.setattr(Payloads, "load", locked_once)
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=3)
    env.mux().register(fh.noop)
    sup = env.start_worker().client.supervisor
    huge = base64.b64encode(os.urandom(INLINE_MAX)).decode()  # stored over INLINE_MAX: left out of the claim
    run_id = env.enqueue(fh.noop, {"huge": huge})
    status = env.run_until_complete(run_id, timeout=30)
    assert (status.state, status.step.state, status.step.attempt) == ("completed", "completed", 1)
    assert len(calls) >= 2 and calls[1] - calls[0] < 4.0  # read again at once, not after the holder gave up
    assert sup.loader.stats["loads"] >= 2
