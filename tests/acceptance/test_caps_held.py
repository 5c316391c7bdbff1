"""Caps a handler cannot lift, and forensics that do not carry over from one attempt to
the next.

A handler cannot hold more files than ``max_open_files``: the hard ``RLIMIT_NOFILE`` is
set too, and a root handler that raises it anyway is killed by the supervisor's count of
its tree's descriptors; a root handler that moves a grandchild out of its slot's cgroups
is killed for it; an attempt's memory peak is its own, never a previous attempt's in the
same slot; a double-forked grandchild counts in the tree's processes, also when the OOM
killer took it before the kill. Each runs with this host's cgroups and with the fallback
(``CYCLONE_MP_CGROUPS=off``), and some with one hierarchy only (``v1``, ``v2``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cyclone_mp import decisions
from cyclone_mp.limits import sampling
from cyclone_mp.limits.cgroups import HIERARCHY_NAMES, within
from cyclone_mp.limits.confinement import CGROUPS_ENV, Confinement
from cyclone_mp.limits.declared import Limits, kind_of
from cyclone_mp.limits.verdicts import Usage, cause_of_death, death_summary, over_limit

import limit_handlers as lh
from limits_support import dead, lines, simulated_v2
from waiting import wait_for

pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")

MIB = 1 << 20


def logged_pids(log: Path) -> list[int]:
    return [int(w[2]) for w in lines(log) if w[0] == "pid"]


# -- pure decisions -----------------------------------------------------------------------------------------


def test_a_process_out_of_its_cgroups_or_past_its_descriptors_is_a_trigger_of_kind_error():
    caps = Limits(memory=256 * MIB, open_files=50)
    kernel = {"kernel_memory_cap": True, "kernel_process_cap": True}
    left = Usage(left=[(4242, "memory cgroup /elsewhere")], oom_kills=1, memory_cap_hits=1)
    assert over_limit(caps, left, **kernel) == "left_cgroups"  # first: the counters no longer cover the tree
    assert over_limit(Limits(cpu=1.0), left, **kernel) == "left_cgroups"
    files = Usage(open_files=57, open_files_pid=4242, open_files_allowed=56)
    assert over_limit(caps, files, **kernel) == "max_open_files"
    assert over_limit(caps, Usage(open_files=56, open_files_allowed=56), **kernel) is None  # at the rlimit: allowed
    assert over_limit(caps, Usage(open_files=500), **kernel) is None  # no baseline: nothing to judge against
    assert over_limit(Limits(memory=256 * MIB), files, **kernel) is None
    for trigger in ("max_open_files", "left_cgroups"):
        assert kind_of(trigger) == decisions.ERROR
        assert cause_of_death(caps, Usage(), exit_signal=9, killed_for=trigger) == decisions.ERROR
    assert kind_of("memory_limit") == "memory_limit"
    assert death_summary("max_open_files", caps, files) == "max_open_files 50, 57 open in process 4242"
    assert death_summary("left_cgroups", caps, left) == "process 4242 left the step's cgroups"
    assert Usage(open_files=57).forensics() == {"open_files": 57}
    from cyclone_mp_cli.formats import tree_text

    assert tree_text({"tree": {"processes": 2, "open_files": 57}}) == "2 procs · 57 files"  # cyclone-mp status


def test_a_cgroup_path_is_within_a_slot_whatever_the_mount_or_namespace():
    slot = "/sys/fs/cgroup/memory/svc/cyclone-mp-12-t/slot-0"
    assert within("/svc/cyclone-mp-12-t/slot-0", slot)
    assert within("/svc/cyclone-mp-12-t/slot-0/made-by-the-handler", slot)  # below it: its caps still hold
    assert within("/cyclone-mp-12-t/slot-0", slot)  # a cgroup namespace rooted at /svc
    for outside in ("/svc/cyclone-mp-12-t/slot-0.1", "/svc/cyclone-mp-12-t/slot-1", "/svc/cyclone-mp-12-t", "/svc",
                    "/", "/other/cyclone-mp-12-t/slot-0", None):
        assert not within(outside, slot), outside


def test_the_memory_peak_restarts_or_counts_from_a_floor(tmp_path, monkeypatch):
    """Every limited attempt restarts its slot's memory peak (whatever its caps), so it
    never reports an earlier attempt's. Where the kernel cannot restart it (cgroup v2
    before Linux 6.12), the peak read when the attempt began is a floor: the counter is
    the attempt's only once past it, and until then the most memory sampled stands."""
    conf, _ = simulated_v2(tmp_path, monkeypatch)
    slot = conf.slot(0)
    here = Path(conf.v2) / "slot-0"
    assert slot.enter(4242)
    cpu_only = Limits(cpu=60.0)
    (here / "memory.peak").write_text(str(300 * MIB))  # an earlier attempt's
    (here / "memory.current").write_text(str(10 * MIB))
    base = slot.begin(cpu_only)
    assert base.peak_reset and (here / "memory.peak").read_text().startswith("reset")  # (written over the fake file)
    (here / "memory.peak").write_text(str(12 * MIB))
    assert slot.sample(cpu_only, base, final=True, walk=False).peak_memory == 12 * MIB
    real_pwrite = os.pwrite

    def refused(fd, data, offset):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refused)
    (here / "memory.peak").write_text(str(300 * MIB))
    base = slot.begin(cpu_only)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert not base.peak_reset and base.peak_floor == 300 * MIB
    assert slot.sample(cpu_only, base, final=True, walk=False).peak_memory == 10 * MIB  # the sampled usage
    (here / "memory.peak").write_text(str(320 * MIB))
    assert slot.sample(cpu_only, base, final=True, walk=False).peak_memory == 320 * MIB  # past the floor: its own
    slot.close_fds()


def test_a_handler_cannot_hold_more_files_than_its_cap(cyclone_env_factory, tmp_path, mechanism):
    """A handler lifts its RLIMIT_NOFILE as far as it may (soft and hard to 4096, else
    the soft one to the hard one) under ``max_open_files=50`` and holds 500 files open.
    The hard limit is set too: where the handler cannot raise it (an ordinary user; root
    without ``CAP_SYS_RESOURCE``, as in the containers these tests run in) the kernel
    refuses the 51st-or-so file and the attempt fails with that ``error``; where it can
    (root with ``CAP_SYS_RESOURCE``) the supervisor's count of the tree's descriptors
    sees 500 and kills the tree, naming the cap. Either way it never completes."""
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.files_lifted, lh.files)
    env.start_worker()
    log = tmp_path / "files"
    run = env.run_until_complete(env.enqueue(lh.files_lifted, {"to": 4096, "n": 500, "hold": 20, "log": str(log)},
                                             max_open_files=50), timeout=30)
    step = run.step
    entry = step.errors[-1]
    lifted = next(w for w in lines(log) if w[0] == "lifted")
    opened = int(next(w for w in lines(log) if w[0] == "opened")[2])
    assert step.state == "discarded" and step.error_kind == "error", entry
    if int(lifted[3]) >= 4096:  # the hard limit was raised (CAP_SYS_RESOURCE): the sampling caught it
        assert entry["killed_by_supervisor"] is True and entry["trigger"] == "max_open_files", entry
        assert entry["cause"].startswith("max_open_files 50, "), entry
        assert "raised its own RLIMIT_NOFILE" in entry["message"] and entry["elapsed"] < 15, entry
    else:  # the hard limit held: the kernel refused the files past the cap
        assert int(lifted[3]) <= 50 + 20 and opened <= 50, (lifted, opened)
        assert "Too many open files" in step.error and not entry.get("killed_by_supervisor"), entry
    ok = env.run_until_complete(env.enqueue(lh.files, {"n": 20}, max_open_files=50), timeout=30)
    assert ok.step.output == {"opened": 20}


def test_a_process_past_its_descriptors_is_killed_for_it(cyclone_env_factory, tmp_path, monkeypatch, mechanism):
    """The supervisor's side of ``max_open_files``, for a root handler that raised its
    hard limit (which the root of these containers cannot: simulated). Each process of
    the tree may hold the descriptors its child held when the attempt began plus the
    cap: here the child's are counted as none, so a handler holding its cap's worth
    holds more than it may, as one that raised its limit would. The supervisor (in this
    process) sees it at its next look and kills the tree: kind ``error``, trigger
    ``max_open_files``, the process and its count named, in the error entry and the log."""
    monkeypatch.setattr(sampling, "open_files", lambda pid: 0)  # the count when the attempt begins
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5, worker="thread")
    env.mux().register(lh.files_lifted, lh.noop)
    env.start_worker()
    log = tmp_path / "files"
    run = env.run_until_complete(env.enqueue(lh.files_lifted, {"to": 4096, "n": 49, "hold": 20, "log": str(log)},
                                             max_open_files=50), timeout=30)
    step = run.step
    entry = step.errors[-1]
    pid = logged_pids(log)[0]
    assert step.state == "discarded" and step.error_kind == "error", entry
    assert entry["killed_by_supervisor"] is True and entry["trigger"] == "max_open_files", entry
    assert entry["cause"].startswith("max_open_files 50, ") and entry["cause"].endswith(f" open in process {pid}"), entry
    assert f"process {pid} of the tree held " in entry["message"] and entry["enforced_by"] == "rlimit + sampling", entry
    assert entry["tree"]["open_files"] > 50 and entry["elapsed"] < 15, entry
    assert "max_open_files 50" in step.error
    assert dead(pid)
    assert env.run_until_complete(env.enqueue(lh.noop, {}), timeout=10).state == "completed"


@pytest.mark.parametrize("hierarchies", ["host", "v1", "v2"])
def test_a_grandchild_that_leaves_its_cgroups_is_killed(cyclone_env_factory, tmp_path, monkeypatch, hierarchies):
    """A root handler's grandchild, seen in its slot's cgroups by a few looks, writes its
    pid into another cgroup's ``cgroup.procs`` (out of its slot's, in every hierarchy),
    then holds 400 MiB: at the next look the supervisor sees a process of the step
    outside the step's cgroups, kills it and the tree, and says so in the error entry
    (and the log)."""
    if os.geteuid() != 0:
        pytest.skip("moving a process between cgroups needs root")
    if hierarchies != "host":
        monkeypatch.setenv(CGROUPS_ENV, hierarchies)
    probe = Confinement.detect("escape-probe")
    where = probe.mechanism.where
    memory_in_cgroup = probe.mechanism.kernel_memory_cap
    probe.close()
    if not where:
        pytest.skip(f"no cgroup is usable here ({hierarchies}): nothing to leave")
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.cgroup_escape, lh.noop)
    env.start_worker()
    log = tmp_path / "escape"
    # a memory cap where a cgroup holds it; else a CPU budget (counted by the v2 cgroup the grandchild leaves)
    caps = {"memory_limit": "100MiB"} if memory_in_cgroup else {"cpu_limit": 60}
    run = env.run_until_complete(env.enqueue(lh.cgroup_escape, {"total": 400 * MIB, "hold": 20, "after": 0.3,
                                                                "log": str(log)}, **caps), timeout=60)
    step = run.step
    entry = step.errors[-1]
    escaped = [w for w in lines(log) if w[0] == "escaped"]
    assert escaped and escaped[0][3] != "-", lines(log)
    grandchild = int(escaped[0][2])
    assert step.state == "discarded" and step.error_kind == "error", entry
    assert entry["killed_by_supervisor"] is True and entry["trigger"] == "left_cgroups", entry
    assert f"process {grandchild} left the step's cgroups" in entry["cause"], entry
    assert f"process {grandchild} left the step's cgroups" in step.error, entry
    assert not any(w[0] == "holding" for w in lines(log)) or entry["elapsed"] < 15, entry
    wait_for(lambda: all(dead(pid) for pid in logged_pids(log)), 5, "the tree and the escapee to die")
    assert env.run_until_complete(env.enqueue(lh.noop, {}), timeout=10).state == "completed"


def test_an_attempts_peak_is_its_own(cyclone_env_factory, tmp_path, mechanism):
    """A ``cpu_limit`` kill after a ``memory_limit`` attempt in the same slot reports its
    own peak: the slot's memory cgroup keeps the last attempt's high-water mark, which
    is reset when an attempt begins."""
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.hog, lh.spin)
    env.start_worker()
    hog = env.run_until_complete(env.enqueue(lh.hog, {"total": 400 * MIB, "chunk": 16 * MIB,
                                                      "log": str(tmp_path / "hog")}, memory_limit="100MiB"), timeout=60)
    assert hog.step.error_kind == "memory_limit", hog.step.errors[-1]
    if hog.step.errors[-1]["enforced_by"] in ("cgroup v1", "cgroup v2"):  # the slot's counter reached the cap
        assert hog.step.errors[-1]["tree"]["peak_memory_kb"] * 1024 >= 90 * MIB, hog.step.errors[-1]
    spin = env.run_until_complete(env.enqueue(lh.spin, {"log": str(tmp_path / "spin")}, cpu_limit=1), timeout=60)
    entry = spin.step.errors[-1]
    assert spin.step.error_kind == "cpu_limit", entry
    peak = entry["tree"].get("peak_memory_kb")
    assert peak is None or peak * 1024 < 64 * MIB, entry
    assert "peak 100 MiB" not in entry["message"], entry


def test_a_double_forked_grandchild_counts_in_the_trees_processes(cyclone_env_factory, tmp_path, mechanism):
    """Two grandchildren double-forked (each in a session of its own, their parent gone)
    under a ``cpu_limit`` that kills the tree: ``tree.processes`` counts them and the
    child (3), found by the slot's cgroup or the supervisor's walk of the tree (the child
    is a subreaper: it adopted them)."""
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.double_fork_spin)
    env.start_worker()
    log = tmp_path / "spin"
    run = env.run_until_complete(env.enqueue(lh.double_fork_spin, {"n": 2, "log": str(log)}, cpu_limit=1),
                                 timeout=60)
    entry = run.step.errors[-1]
    assert run.step.error_kind == "cpu_limit", entry
    assert entry["tree"]["processes"] >= 3, entry
    assert "3 processes" in entry["message"], entry
    grandchildren = [int(p) for p in Path(f"{log}.pids").read_text().split()]
    assert len(grandchildren) == 2
    wait_for(lambda: all(dead(pid) for pid in grandchildren), 5, "the grandchildren to die with the tree")


@pytest.mark.parametrize("hierarchies", ["host", "v1", "v2", "off"])
def test_a_double_forked_grandchild_the_oom_killer_took_still_counts(cyclone_env_factory, tmp_path, monkeypatch,
                                                                     hierarchies):
    """A double-forked grandchild holds the memory under ``memory_limit``: where a cgroup
    holds the cap the kernel's OOM killer takes it (then the supervisor kills the rest);
    else the sampling kills the tree. Either way the tree had two processes at once, and
    ``tree.processes`` says so (not the one left when the kill came). The grandchild holds
    120 MiB: over the cap, under the ``RLIMIT_DATA`` backstop it inherits (1.5 times the cap
    over the runner's data), so without a cgroup the sampling meets it however loaded the
    host (a grandchild that met the backstop first would fail alone, unseen)."""
    if hierarchies != "host":
        monkeypatch.setenv(CGROUPS_ENV, hierarchies)
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.double_fork_hog)
    env.start_worker()
    log = tmp_path / "hog"
    run = env.run_until_complete(env.enqueue(lh.double_fork_hog, {"total": 120 * MIB, "log": str(log)},
                                             memory_limit="100MiB"), timeout=60)
    entry = run.step.errors[-1]
    assert run.step.error_kind == "memory_limit", entry
    assert entry["tree"]["processes"] >= 2, entry
    wait_for(lambda: all(dead(pid) for pid in logged_pids(log)), 5, "the tree to die")


@pytest.mark.parametrize("hierarchies", ["v1", "v2"])
def test_membership_sees_a_process_leave_after_it_was_listed(hierarchies):
    """The slot's own check, on this host's cgroups for real: a process listed in the
    slot's cgroups at one look and moved out before the next is seen out at the next
    (a v1 ``cgroup.procs`` read through a kept descriptor would repeat its first
    listing: it is read anew each time)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("moving a process between cgroups needs root")
    conf = Confinement.detect("membership", environ={CGROUPS_ENV: hierarchies})
    proc = subprocess.Popen(["sleep", "60"])
    try:
        if not conf.mechanism.where:
            pytest.skip(f"no cgroup is usable here ({hierarchies})")
        slot = conf.slot(0)
        assert slot.enter(proc.pid) and slot.joined
        for _ in range(2):
            listed, left = slot.membership([proc.pid])
            assert proc.pid in listed and left == []
        for key in slot.joined:  # out of every one of them, as a root handler may do
            parent = os.path.dirname(os.path.dirname(slot.dirs[key]))
            Path(parent, "cgroup.procs").write_text(str(proc.pid))
        listed, left = slot.membership([proc.pid])
        assert proc.pid not in listed and [pid for pid, _ in left] == [proc.pid], (listed, left)
        assert all(HIERARCHY_NAMES[key] in left[0][1] for key in slot.joined), left
    finally:
        proc.kill()
        proc.wait()
        conf.close()
