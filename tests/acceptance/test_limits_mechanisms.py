"""How a step's tree is capped and killed underneath: signals go through pidfds (never
to a recycled pid); the pure cgroup v2 path on a fake cgroup tree (detection, caps,
evidence, the kill, a child that moves itself into its slot, the supervisor's own leaf);
the hierarchies read from mountinfo; and what this host offers, as it is reported.

The pure cgroup v2 path (memory and pids controllers in v2) cannot run on a host whose
memory controller is bound to v1; it is simulated on a fake cgroup tree, and run for
real where a host has it (the test says why it skips otherwise).
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import psutil
import pytest

from cyclone_mp import procs
from cyclone_mp.limits import cgroups
from cyclone_mp.limits import slot as slot_module
from cyclone_mp.limits.confinement import Confinement
from cyclone_mp.limits.declared import MIB, Limits
from cyclone_mp.limits.verdicts import death_summary, over_limit

import limit_handlers as lh
from limits_support import HOST, fake_v2, simulated_v2

pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")


# -- pidfds ---------------------------------------------------------------------------------------------


def test_signals_go_through_pidfds_and_never_hit_a_recycled_pid():
    """A psutil handle whose process is gone (its pid possibly reused) is never signalled:
    the pidfd is opened first, then the start time is checked (issue 20)."""
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        handle = psutil.Process(proc.pid)
        stale = psutil.Process(proc.pid)
        stale._ident = (proc.pid, stale._ident[1] - 1000.0)  # a handle of an older process that had this pid
        assert procs.open_pidfd(stale) is None
        assert procs.signal_process(stale, signal.SIGKILL) is False
        assert proc.poll() is None  # untouched
        calls = []
        real = signal.pidfd_send_signal
        signal.pidfd_send_signal = lambda fd, sig, *a: (calls.append(sig), real(fd, sig, *a))[1]
        try:
            assert procs.kill_tree(proc.pid, None, [handle]) == [proc.pid]
        finally:
            signal.pidfd_send_signal = real
        assert signal.SIGKILL in calls
        assert proc.wait(5) == -signal.SIGKILL
        assert procs.signal_process(handle, signal.SIGKILL) is False  # reaped: gone, nothing is hit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the pure cgroup v2 path, simulated ---------------------------------------------------------------


def test_pure_cgroup_v2_path_simulated(tmp_path, monkeypatch):
    """Detection, caps, evidence and the kill of the pure v2 path (memory and pids
    controllers in v2), on a fake cgroup tree: what a v2-only host (systemd with
    Delegate=yes, most distributions since 2021) runs."""
    conf, mine = simulated_v2(tmp_path, monkeypatch)
    # pid 4242 is a fake runner with two threads, whatever process holds that pid on this host
    monkeypatch.setattr(slot_module, "stat", lambda pid: (0.0, 2, 20 * MIB, 0.0) if pid == 4242 else None)
    mech = conf.mechanism
    assert (mech.kill, mech.memory, mech.processes, mech.cpu) == ("cgroup v2", "cgroup v2", "cgroup v2", "cgroup v2")
    assert (mine / "cgroup.subtree_control").read_text() == "+memory +pids"  # our cgroup is the only one holding us
    base = Path(conf.v2)
    assert base.parent == mine and base.name.startswith("cyclone-mp-")
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    slot = conf.slot(0)
    assert slot.enter(4242) and (base / "slot-0" / "cgroup.procs").read_text() == "4242"
    caps = Limits(memory=256 * MIB, cpu=2.0, processes=20)
    assert slot.configure(caps)
    assert (base / "slot-0" / "memory.max").read_text() == str(256 * MIB)
    assert (base / "slot-0" / "pids.max").read_text() == "21"  # a runner's two threads count as one process
    (base / "slot-0" / "memory.current").write_text(str(300 * MIB))
    slot.caps = (None, None)
    assert not slot.configure(caps)  # the reused child holds more than the cap: it is replaced, never OOM-killed idle
    (base / "slot-0" / "memory.current").write_text(str(20 * MIB))
    assert slot.configure(caps)
    (base / "slot-0" / "cpu.stat").write_text("usage_usec 5000000\n")
    start_at = slot.begin(caps)
    assert (base / "slot-0" / "memory.peak").read_text() == "reset"
    assert over_limit(caps, slot.sample(caps, start_at), kernel_memory_cap=True, kernel_process_cap=True) is None
    (base / "slot-0" / "cpu.stat").write_text("usage_usec 7100000\n")
    usage = slot.sample(caps, start_at)
    assert usage.cpu == pytest.approx(2.1)
    assert over_limit(caps, usage, kernel_memory_cap=True, kernel_process_cap=True) == "cpu_limit"
    (base / "slot-0" / "cpu.stat").write_text("usage_usec 5100000\n")
    (base / "slot-0" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    (base / "slot-0" / "memory.peak").write_text(str(256 * MIB))
    usage = slot.sample(caps, start_at)
    assert over_limit(caps, usage, kernel_memory_cap=True, kernel_process_cap=True) == "memory_limit"
    assert death_summary("memory_limit", caps, usage) == "memory_limit 256 MiB, peak 256 MiB"
    (base / "slot-0" / "pids.events").write_text("max 1\n")  # a refused fork since the last look...
    start_at = slot.begin(caps)
    usage = slot.sample(caps, start_at)
    assert usage.fork_failures == 1 and not usage.at_process_cap  # ...but the tree is below its cap: not its doing
    assert over_limit(caps, usage, kernel_memory_cap=True, kernel_process_cap=True) is None
    (base / "slot-0" / "pids.events").write_text("max 2\n")
    (base / "slot-0" / "pids.current").write_text("21\n")  # the tree at its cap, a fork refused: this attempt's
    usage = slot.sample(caps, start_at)
    assert usage.at_process_cap and over_limit(caps, usage, kernel_memory_cap=True, kernel_process_cap=True) == \
        "process_limit"
    (base / "slot-0" / "cgroup.procs").write_text("4242\n4243\n")
    (base / "slot-0" / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert slot.kill() == [4242, 4243]
    assert (base / "slot-0" / "cgroup.kill").read_text() == "1"
    assert (base / "slot-0" / "cgroup.freeze").read_text() == "0"  # frozen for the listing, thawed after the kill
    assert conf.dirs == [("v2", str(base))]
    slot.close_fds()


def test_a_child_that_moves_itself_is_killed_through_its_slot_and_judged_from_its_counters(tmp_path, monkeypatch):
    """A forked child moves itself into its slot (issue 23). Until it says so, a kill still
    goes through the slot's cgroup (it may be in it already, with whatever it started);
    once it says so, the slot's counters as they stand are its baseline (an OOM kill or
    refused fork of an earlier child is not its doing); a cgroup it could not enter is
    entered from the supervisor, that one only."""
    conf, _ = simulated_v2(tmp_path, monkeypatch)
    slot = conf.slot(0)
    here = Path(conf.v2) / "slot-0"
    assert [key for key, _ in slot.entry()] == ["v2"]
    (here / "memory.events").write_text("low 0\nhigh 0\nmax 1\noom 1\noom_kill 1\n")  # an earlier child's
    (here / "pids.events").write_text("max 2\n")
    assert not slot.enter(4242, by_child=True)  # books only: no write from here
    assert (here / "cgroup.procs").read_text() == "" and slot.entering and not slot.confined
    (here / "cgroup.procs").write_text("4242\n4243\n")  # it moved, and started something
    (here / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert slot.kill() == [4242, 4243]  # killed through the slot before it said "entered"
    (here / "cgroup.procs").write_text("")
    assert not slot.enter(4343, by_child=True)
    assert slot.entered(4343, []) and slot.confined and not slot.entering
    assert (slot.last.oom_kills, slot.last.fork_failures) == (1, 2)
    assert (here / "cgroup.procs").read_text() == ""  # it moved itself: nothing written here
    slot.entered(4242, ["v2"], "stale")  # a stale message of another child changes nothing
    assert (here / "cgroup.procs").read_text() == ""
    slot.enter(4444, by_child=True)
    assert slot.entered(4444, ["v2"], "v2: Permission denied") and slot.confined
    assert (here / "cgroup.procs").read_text() == "4444"  # moved from here, as a spawned child is
    slot.close_fds()


def test_pure_v2_moves_the_supervisor_into_a_leaf_to_enable_controllers(tmp_path, monkeypatch):
    """A delegated non-root cgroup holding the supervisor cannot enable controllers for
    its children (EBUSY, no internal processes): the supervisor moves itself into a leaf
    of its own first, as systemd advises; with another process there it leaves it."""
    mountinfo, proc_cgroup, mine = fake_v2(tmp_path)
    writes = []
    real_write = cgroups.write_text

    def write(path, text):
        writes.append((path, text))
        if path == str(mine / "cgroup.subtree_control") and (mine / "cgroup.procs").read_text().strip():
            raise OSError(errno.EBUSY, "Device or resource busy")
        if path.endswith("cgroup.procs") and "supervisor-" in path:
            (mine / "cgroup.procs").write_text("")  # we left our cgroup
        real_write(path, text)

    monkeypatch.setattr(cgroups, "write_text", write)
    conf = Confinement.detect("leaf", environ={}, mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
    leaf = mine / f"cyclone-mp-supervisor-{os.getpid()}"
    assert (str(leaf / "cgroup.procs"), str(os.getpid())) in writes
    assert conf.v2_controllers == {"memory", "pids"}
    # another process shares our cgroup: nothing is moved, the controllers stay off
    mountinfo, proc_cgroup, mine = fake_v2(tmp_path / "b")
    (mine / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")
    writes.clear()
    conf = Confinement.detect("busy", environ={}, mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
    assert conf.v2_controllers == frozenset() and conf.mechanism.memory != "cgroup v2"
    assert not any("supervisor-" in path for path, _ in writes)


def test_hierarchies_are_found_from_mountinfo():
    info = ("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
            "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    own = "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
    found = cgroups.find_hierarchies(info, own)
    assert found == cgroups.Hierarchies(v2="/sys/fs/cgroup/unified", memory_v1="/sys/fs/cgroup/memory/process_api/abc",
                                      pids_v1="/sys/fs/cgroup/pids")
    # a namespaced mount showing only our part of the hierarchy
    found = cgroups.find_hierarchies("41 31 0:38 /user.slice /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                                   "0::/user.slice/app\n")
    assert found.v2 == "/sys/fs/cgroup/app"


def test_this_host_is_detected_and_reported():
    """What this machine takes, in the words `cyclone-mp workers` and the log use. On a
    host with a usable cgroup v2 and v1 memory/pids (these VMs, as root) that is cgroups
    for everything but open files; elsewhere the fallbacks (said, not skipped)."""
    mech = HOST.mechanism
    text = mech.describe()
    assert "memory_limit by" in text and "max_open_files by rlimit + sampling" in text
    v2 = os.path.exists("/sys/fs/cgroup/unified/cgroup.procs") or os.path.exists("/sys/fs/cgroup/cgroup.procs")
    if os.geteuid() == 0 and v2:
        assert mech.kill == "cgroup v2" and mech.cpu == "cgroup v2"
        assert mech.memory in ("cgroup v1", "cgroup v2") and mech.processes in ("cgroup v1", "cgroup v2")
    else:
        assert mech.kill in ("cgroup v2", "signals")
    for _, path in HOST.dirs:
        assert not os.path.exists(path)  # closed: removed


@pytest.mark.skipif(HOST.mechanism.memory != "cgroup v2",
                    reason="this host's cgroup v2 has no memory controller (it is bound to cgroup v1 here); "
                           "the pure v2 path is covered by test_pure_cgroup_v2_path_simulated")
def test_pure_cgroup_v2_memory_cap_for_real(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    log = tmp_path / "log"
    run = env.run_until_complete(env.enqueue(lh.hog, {"total": 256 * MIB, "chunk": 16 * MIB, "log": str(log)},
                                             memory_limit="64MiB"), timeout=60)
    assert run.step.error_kind == "memory_limit"
