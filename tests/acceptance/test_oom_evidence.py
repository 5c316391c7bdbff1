"""Causes of death from evidence about that process, never a machine-wide counter.

A child that dies of a SIGKILL nobody here sent is ``oom_killed`` only when its slot's
memory cgroup counted an OOM kill, or the kernel log names that child's pid; another
process's OOM kill anywhere on the machine (``/proc/vmstat``'s ``oom_kill`` moving) says
nothing about it: it is then ``child_exited`` with signal 9. Here for real: an unrelated
process OOM-killed in a memory cgroup of the test's while a child SIGKILLs itself, and a
child the kernel OOM-kills (moved by the test into a small memory cgroup, the
supervisor's cgroups off) named from the kernel log. Both need root and a memory
cgroup the test can make; the first is also simulated, for any host.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cyclone_mp.limits import cgroups, confinement
from cyclone_mp.limits.confinement import CGROUPS_ENV

import limit_handlers as lh
from waiting import wait_for

MIB = 1 << 20
_made = itertools.count()


def machine_oom_kills() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup of the test's own, capped at ``limit`` bytes (removed after: what is
    left in it is killed first). Skips where the test cannot make one (not root, no
    memory controller)."""
    if os.geteuid() != 0:
        pytest.skip("makes a memory cgroup: needs root")
    found = cgroups.find_hierarchies(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    name = f"cyclone-test-oom-{os.getpid()}-{next(_made)}"
    if found.memory_v1:
        path = Path(found.memory_v1, name)
        files = {"memory.limit_in_bytes": str(limit)}
        if Path(found.memory_v1, "memory.memsw.limit_in_bytes").exists():
            files["memory.memsw.limit_in_bytes"] = str(limit)
    elif found.v2 and "memory" in (Path(found.v2, "cgroup.subtree_control").read_text().split()):
        path = Path(found.v2, name)
        files = {"memory.max": str(limit), "memory.swap.max": "0"}
    else:
        pytest.skip("no memory cgroup controller this test can use")
    path.mkdir()
    try:
        for file, value in files.items():
            (path / file).write_text(value)
        yield path
    finally:
        deadline = time.monotonic() + 10
        while True:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def oom_kill_a_stranger() -> None:
    """Have the kernel OOM-kill a process that is nothing of the supervisor's (a Python
    that moves itself into a 32 MiB memory cgroup, then touches 256 MiB), and see the
    machine-wide counter move."""
    before = machine_oom_kills()
    with memory_cgroup(32 * MIB) as cgroup:
        code = (f"import os; open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                "held = b'x' * (256 << 20)")
        stranger = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert stranger.returncode == -signal.SIGKILL, stranger
    wait_for(lambda: machine_oom_kills() > before, 5, "the machine's OOM counter to move")


def test_a_sigkill_while_another_process_is_oom_killed_is_child_exited(cyclone_env_factory, tmp_path):
    """Acceptance: a child that SIGKILLs itself just after an unrelated process on the
    machine was OOM-killed is ``child_exited`` with signal 9, not ``oom_killed``."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    env.mux().register(lh.sigkill_self)
    env.start_worker()
    log, go = tmp_path / "log", tmp_path / "go"
    run_id = env.enqueue(lh.sigkill_self, {"log": str(log), "go": str(go)})
    wait_for(lambda: log.exists() and log.read_text(), 30, "the handler to start")
    oom_kill_a_stranger()
    go.touch()  # now the child kills itself
    run = env.run_until_complete(run_id, timeout=30)
    entry = run.step.errors[-1]
    assert run.step.error_kind == "child_exited", entry
    assert entry["signal"] == signal.SIGKILL and not entry["killed_by_supervisor"], entry


def test_a_sigkill_while_the_machine_wide_counter_moves_is_child_exited(cyclone_env_factory, tmp_path, monkeypatch):
    """The same on any host: the machine's OOM counter is made to move at every look (a
    supervisor that reads it would blame the OOM killer); the cause stays ``child_exited``."""
    counter = itertools.count(100)
    monkeypatch.setattr(confinement, "vm_oom_kills", lambda: next(counter), raising=False)
    env = cyclone_env_factory(workers=1, lease_ttl=2, worker="thread")
    env.mux().register(lh.sigkill_self)
    env.start_worker()
    run = env.run_until_complete(env.enqueue(lh.sigkill_self, {"log": str(tmp_path / "log")}), timeout=30)
    entry = run.step.errors[-1]
    assert run.step.error_kind == "child_exited", entry
    assert entry["signal"] == signal.SIGKILL, entry


def test_a_child_the_kernel_log_names_is_oom_killed(cyclone_env_factory, tmp_path, monkeypatch):
    """Without the supervisor's cgroups, a child the kernel OOM-kills is ``oom_killed``
    from the kernel log's record of its pid (read from ``/dev/kmsg``, which root can)."""
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here: no kernel-log evidence to name an OOM kill from")
    monkeypatch.setenv(CGROUPS_ENV, "off")
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    env.mux().register(lh.oom_victim)
    env.start_worker()
    log, go = tmp_path / "log", tmp_path / "go"
    run_id = env.enqueue(lh.oom_victim, {"log": str(log), "go": str(go), "total": 512 * MIB})
    wait_for(lambda: log.exists() and log.read_text(), 30, "the handler to start")
    pid = int(log.read_text().split()[2])
    with memory_cgroup(64 * MIB) as cgroup:
        (cgroup / "cgroup.procs").write_text(str(pid))  # what it allocates from now on is charged there
        go.touch()
        run = env.run_until_complete(run_id, timeout=60)
    entry = run.step.errors[-1]
    assert run.step.error_kind == "oom_killed", entry
    assert entry["signal"] == signal.SIGKILL and "kernel log" in entry["message"], entry
