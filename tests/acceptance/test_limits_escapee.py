"""The scrubbed escapee (``sh -c '(setsid env -i sleep 600 &)'``: no marker in its
environment, a session of its own) does not outlive its step: it dies when the handler
returns, when its child crashes, when the supervisor exits on SIGTERM and when it is
SIGKILLed; an embedding program's own children are left alone. Each with this host's
mechanism and with the fallback (no cgroups) where it takes ``mechanism``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from cyclone_mp import procs

import limit_handlers as lh
from limits_support import HOST, dead, expect, lines, start
from waiting import counter_grows, wait_for

pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")


# -- issue 18, fault 4: the scrubbed escapee --------------------------------------------------------------------------


ESCAPEE_WAIT = 3.0  # seconds an escapee may take to be found and killed (a stray check every 0.25 s)


def escapee_of(log: Path) -> int:
    pid = wait_for(lambda: next((int(w[2]) for w in lines(log) if w[0] == "escapee" and w[2] != "None"), None), 15,
                   "the escapee's pid")
    return pid


def test_the_scrubbed_escapee_dies_with_its_step(cyclone_env_factory, tmp_path, mechanism):
    """Issue 18 fault 4, the issue's exact command: ``sh -c '(setsid env -i sleep 600 &)'``
    from a handler that then returns: the escapee (no marker in its environment, a
    session of its own) does not outlive its step."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    log = tmp_path / "esc"
    run = env.run_until_complete(env.enqueue(lh.escapee, {"log": str(log)}), timeout=30)
    pid = escapee_of(log)
    try:
        assert run.step.state == "completed" and run.step.output == {"escapee": pid}
        wait_for(lambda: dead(pid), ESCAPEE_WAIT, f"escapee {pid} to die with its step")
    finally:
        _kill_if_alive(pid)


def test_the_scrubbed_escapee_of_a_crashed_child_is_killed(cyclone_env_factory, tmp_path, mechanism):
    """The child dies on its own (os._exit) right after the escape: the escapee is then
    reparented to the supervisor (a subreaper), which kills it: it is in the slot's
    cgroup, or (the fallback) the supervisor runs alone in its process (client.run()),
    so whatever it adopts is a handler's."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    log = tmp_path / "esc"
    run = env.run_until_complete(env.enqueue(lh.escapee, {"log": str(log), "crash": True}), timeout=30)
    pid = escapee_of(log)
    try:
        assert run.step.error_kind == "child_exited" and run.step.errors[-1]["exit_code"] == 3
        wait_for(lambda: dead(pid), ESCAPEE_WAIT, f"escapee {pid} of a crashed child to die")
    finally:
        _kill_if_alive(pid)


def test_the_scrubbed_escapee_dies_with_a_sigterm_exit(cyclone_env_factory, tmp_path, mechanism):
    env = cyclone_env_factory(workers=1, lease_ttl=2, shutdown_grace=0.3, kill_grace=0.3)
    log = tmp_path / "esc"
    env.enqueue(lh.escapee, {"log": str(log), "stay": 60})
    handle = start(env)
    pid = escapee_of(log)
    try:
        env.terminate_worker()
        handle.popen.wait(timeout=20)
        wait_for(lambda: dead(pid), ESCAPEE_WAIT, f"escapee {pid} to die with the supervisor's exit")
    finally:
        _kill_if_alive(pid)


def test_the_scrubbed_escapee_dies_with_a_sigkilled_supervisor(cyclone_env_factory, tmp_path, mechanism):
    """After a SIGKILL of the supervisor the watchdog kills its cgroups (the escapee is in
    its slot's, whatever it did to its environment); without cgroups it kills the
    handler descendants the supervisor told it of (a stray check every 0.25 s saw it)."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    log = tmp_path / "esc"
    env.enqueue(lh.escapee, {"log": str(log), "stay": 60})
    handle = start(env)
    pid = escapee_of(log)
    try:
        # past a few stray checks (every 0.25 s): the fallback tells the watchdog what it saw
        # (nothing outside shows it; a loaded host has delayed process control's look by 0.7 s)
        time.sleep(1.5)
        env.crash_worker()
        wait_for(lambda: dead(pid), ESCAPEE_WAIT, f"escapee {pid} to die after the supervisor's SIGKILL")
        if expect(mechanism).where:
            wait_for(lambda: not any(os.path.exists(d) for d in _dirs_of(handle.pid)), 5, "its cgroups to be removed")
    finally:
        _kill_if_alive(pid)


def _dirs_of(pid: int) -> list[str]:
    """The cgroup directories the supervisor ``pid`` made (``cyclone-mp-<pid>-*``)."""
    found = []
    for parent in {os.path.dirname(p) for p in HOST.mechanism.where}:
        if os.path.isdir(parent):
            found += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f"cyclone-mp-{pid}-")]
    return found


def _kill_if_alive(pid: int) -> None:
    """A test's own escapee, if a failure left it: killed by pid (started by this test)."""
    try:
        proc = psutil.Process(pid)
        if proc.cmdline() == ["sleep", "600"]:
            procs.signal_process(proc, signal.SIGKILL)
    except psutil.Error:
        pass


def test_an_embedding_programs_own_children_are_left_alone(cyclone_env_factory, tmp_path, monkeypatch):
    """client.start() in a program: the program's own children (started after the
    supervisor, with a session of their own, no marker) are not the supervisor's to
    kill; an escapee of a handler is."""
    import subprocess

    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=2)
    env.mux().register(lh.escapee)
    pool = env.start_worker().client.supervisor.control.pool
    checks = [0]
    reap_orphans = pool.reap_orphans

    def counted() -> int:
        checks[0] += 1
        return reap_orphans()

    monkeypatch.setattr(pool, "reap_orphans", counted)  # process control's stray checks, counted
    own = subprocess.Popen(["sleep", "30"], start_new_session=True, env={})
    try:
        log = tmp_path / "esc"
        env.run_until_complete(env.enqueue(lh.escapee, {"log": str(log)}), timeout=30)
        pid = escapee_of(log)
        wait_for(lambda: dead(pid), ESCAPEE_WAIT, "the handler's escapee to die")
        counter_grows(lambda: checks[0], 2, 5, "stray checks")
        assert own.poll() is None
    finally:
        own.kill()
        own.wait()
