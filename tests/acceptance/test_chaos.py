"""Chaos (issues 4 and 17): 3 supervisors, 300 mixed steps, and at random: SIGKILLs of
supervisors and of children, freezes (SIGSTOP), network partitions and latency spikes
between a supervisor and PostgreSQL, and one PostgreSQL restart. Nothing is lost, nothing
completes twice, no two executions of a step overlap (judged on the handlers' own
timestamps), and no process is left."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import psutil
import pytest

import chaos_handlers as ch
from cyclone_mp.store import connect
from waiting import not_zombie

N_STEPS = 300


def overlaps(log, skip: set[str]) -> list[str]:
    """Runs (not in ``skip``) two of whose executions overlapped in time: each execution
    is a pid's span from its first line to its last (a tick every 20 ms)."""
    spans: dict[str, dict[int, list[float]]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            _, run, pid, t = line.split()
            span = spans.setdefault(run, {}).setdefault(int(pid), [float(t), float(t)])
            span[0], span[1] = min(span[0], float(t)), max(span[1], float(t))
    bad = []
    for run, by_pid in spans.items():
        if run in skip:
            continue
        ordered = sorted(by_pid.values())
        if any(later[0] < earlier[1] for earlier, later in zip(ordered, ordered[1:])):
            bad.append(run)
    return bad


@pytest.mark.slow  # a soak (three supervisors, 300 steps, 10 s of faults): both prefetch paths
@pytest.mark.parametrize("prefetch", [0, 8])
def test_chaos_three_supervisors_random_kills(cyclone_env_factory, cyclone_dsn, cyclone_server, tmp_path, prefetch):
    with connect(cyclone_dsn) as conn:
        conn.execute("CREATE TABLE chaos_effects (run_id uuid PRIMARY KEY, attempt int, pid int)")
        conn.execute("CREATE TABLE chaos_log (run_id uuid, attempt int)")
    env = cyclone_env_factory(workers=2, lease_ttl=1.0, kill_grace=0.3, poll_interval=(0.02, 0.1), prefetch=prefetch,
                              proxy=True)
    rng = random.Random(20261130 + prefetch)
    log = tmp_path / "executions"
    kinds = [ch.chaos_fast] * 120 + [ch.chaos_slow] * 50 + [ch.chaos_cpu] * 100 + [ch.chaos_wedged] * 10 + [ch.chaos_crash] * 20
    rng.shuffle(kinds)
    assert len(kinds) == N_STEPS
    for step in {k.name: k for k in kinds}.values():
        env.mux().register(step)
    client = env.client()
    ids = {}
    for step in kinds:
        inp = {"dsn": cyclone_dsn, "seconds": rng.uniform(0.2, 0.8), "log": str(log)}
        ids[client.enqueue(step, inp)] = step.name

    if cyclone_server.restartable:
        cyclone_server.checkpoint()  # the restart's recovery replays only what follows
    handles = [env.start_worker() for _ in range(3)]
    ours = {hd.supervisor_id for hd in handles}
    faults = ("supervisor", "child", "freeze", "partition", "latency")
    kills = dict.fromkeys(faults, 0)
    restarted = not cyclone_server.restartable  # one PostgreSQL restart, where the server is ours
    chaos_until, give_up = time.monotonic() + 10.0, time.monotonic() + 40.0
    while time.monotonic() < give_up and (time.monotonic() < chaos_until or min(kills.values()) < 2 or not restarted):
        time.sleep(rng.uniform(0.2, 0.6))
        live = [hd for hd in handles if hd.alive()]
        victim = rng.choice(live)
        short = min(kills, key=lambda k: kills[k])
        fault = short if rng.random() < 0.6 else rng.choice(faults)
        if not restarted and time.monotonic() > chaos_until - 5:
            cyclone_server.restart(down_for=1.0)
            restarted = True
        elif fault == "supervisor":
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait()
            kills[fault] += 1
            handles.remove(victim)
            handles.append(env.start_worker())
            ours.add(handles[-1].supervisor_id)
        elif fault == "child":
            kids = []
            for p in psutil.Process(victim.pid).children():
                with contextlib.suppress(psutil.Error):  # a child just killed is a zombie until reaped
                    if "cyclone_mp._child" in " ".join(p.cmdline()):
                        kids.append(p)
            if kids:
                os.kill(rng.choice(kids).pid, signal.SIGKILL)
                kills[fault] += 1
        elif fault == "freeze":  # longer than the lease now and then: its handlers must die first
            os.kill(victim.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.3, 2.0))
            os.kill(victim.pid, signal.SIGCONT)
            kills[fault] += 1
        elif fault == "partition":
            env.partition(victim)
            time.sleep(rng.uniform(0.3, 2.5))
            env.heal(victim)
            kills[fault] += 1
        else:
            env.add_latency(rng.uniform(0.1, 0.4), victim)
            time.sleep(rng.uniform(0.5, 1.5))
            env.add_latency(0, victim)
            kills[fault] += 1
    assert min(kills.values()) >= 2 and restarted, kills

    deadline = time.monotonic() + 180
    while True:
        with connect(cyclone_dsn) as conn:
            left = conn.execute(
                "SELECT count(*) AS n FROM cyclone_steps WHERE state NOT IN ('completed', 'discarded', 'cancelled')"
            ).fetchone()["n"]
        if left == 0:
            break
        assert time.monotonic() < deadline, f"{left} steps still not terminal"
        time.sleep(0.2)

    with connect(cyclone_dsn) as conn:
        rows = conn.execute(
            "SELECT s.run_id::text AS run_id, s.step_name, s.state, s.error_kind, e.run_id IS NOT NULL AS effect "
            "FROM cyclone_steps s LEFT JOIN chaos_effects e ON e.run_id = s.run_id"
        ).fetchall()
        running = conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE state = 'running'").fetchone()["n"]
    assert len(rows) == N_STEPS and running == 0
    by_state = {}
    for row in rows:
        by_state.setdefault((row["step_name"], row["state"]), 0)
        by_state[(row["step_name"], row["state"])] += 1
        if row["step_name"] == "chaos_wedged":
            assert row["state"] == "discarded" and row["error_kind"] == "timeout", row
        else:
            assert row["state"] == "completed", row
            assert row["effect"], f"completed without its side effect: {row}"
    # no two executions of one step overlapped (but a timed-out one's retry, which the
    # sweep may start while the attempt before waits for its kill: seed, "Non-Cooperative Handlers")
    wedged = {r for r, name in ids.items() if name == "chaos_wedged"}
    bad = overlaps(log, wedged)
    details = {r: (ids[r], [line for line in log.read_text().splitlines() if r in line and "tick" not in line],
                   env.status(r).step) for r in bad}
    assert bad == [], details
    # every supervisor still alive takes new work, and nothing of ours is left when they stop
    assert all(hd.alive() for hd in handles)
    env.stop_workers()
    strays = [p for p in psutil.process_iter(["environ"]) if (p.info.get("environ") or {}).get("CYCLONE_MP_SUPERVISOR") in ours]
    time.sleep(0.5)
    strays = [p for p in strays if p.is_running() and not_zombie(p.pid)]  # (reaped meanwhile: gone)
    assert not strays, f"handler processes left: {[p.pid for p in strays]}"
