"""What holds each cap on a host, and the one line that says so at start.

Hosts are simulated from synthetic ``/proc/self/mountinfo`` and ``/proc/self/cgroup``
files over a fake cgroup tree whose new directories get the files the kernel would give
them (:meth:`Confinement.detect` takes both paths): cgroup v2 only (with and without the
memory and pids controllers), cgroup v1 only, hybrid, none mounted, and mounted but not
writable. Then this host for real, as ``CYCLONE_MP_CGROUPS`` shapes it, and the start
line of a real supervisor with cgroups off. Fast: no handler runs but in the last test.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest

from cyclone_mp.limits.confinement import CGROUPS_ENV, Confinement
from cyclone_mp.limits.mechanism import PROCESSES_USERNS

import limit_handlers as lh

KERNEL_FILES = {
    "v2": {"cgroup.procs": "", "cgroup.kill": "", "cgroup.freeze": "0", "cgroup.events": "populated 0\nfrozen 0\n",
           "memory.max": "max", "memory.current": "0", "memory.events": "oom_kill 0\n", "pids.max": "max",
           "pids.events": "max 0\n", "cpu.stat": "usage_usec 0\n", "cgroup.subtree_control": ""},
    "memory": {"cgroup.procs": "", "memory.limit_in_bytes": "9223372036854771712", "memory.oom_control":
               "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", "memory.usage_in_bytes": "0"},
    "pids": {"cgroup.procs": "", "pids.max": "max", "pids.events": "max 0\n", "pids.current": "0"},
}
_tags = itertools.count()
NO_USERNS = "unprivileged user namespaces are disabled (simulated)"


def fake_host(tmp_path: Path, monkeypatch, *, v2: str | None = None, v1: bool = False,
              writable: bool = True) -> tuple[Path, Path]:
    """``(mountinfo, proc_cgroup)`` of a simulated host: a cgroup v2 hierarchy offering the
    controllers ``v2`` names (None: no v2 mount), v1 memory and pids hierarchies (``v1``),
    each mounted on a directory of ``tmp_path`` (one that does not exist unless
    ``writable``); the kernel's files appear in every directory made under them."""
    mounts, own, kinds = [], [], {}
    if v2 is not None:
        root = tmp_path / "unified"
        mounts.append(f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw")
        own.append("0::/svc")
        kinds[root] = "v2"
        if writable:
            (root / "svc").mkdir(parents=True)
            (root / "svc" / "cgroup.controllers").write_text(v2 + "\n")
            (root / "svc" / "cgroup.subtree_control").write_text("")
            (root / "svc" / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if v1:
        for n, name in ((4, "memory"), (8, "pids")):
            root = tmp_path / name
            mounts.append(f"3{n} 31 0:3{n} / {root} rw,relatime - cgroup cgroup rw,{name}")
            own.append(f"{n}:{name}:/svc")
            kinds[root] = name
            if writable:
                (root / "svc").mkdir(parents=True)
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # the kernel fills a new cgroup with its files
        real_mkdir(path, *args, **kwargs)
        for root, kind in kinds.items():
            if str(path).startswith(str(root) + os.sep):
                for name, text in KERNEL_FILES[kind].items():
                    Path(path, name).write_text(text)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "makedirs", lambda p, exist_ok=False: None if os.path.isdir(p) else mkdir(p))
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    mountinfo.write_text("".join(f"{line}\n" for line in mounts) + "22 1 0:21 / /proc rw - proc proc rw\n")
    proc_cgroup.write_text("".join(f"{line}\n" for line in own) or "0::/\n")
    return mountinfo, proc_cgroup


def detect(files: tuple[Path, Path], environ: dict[str, str] | None = None, userns=lambda: None):
    """Detection on a simulated host (a new supervisor directory each time: a tag of its own)."""
    mountinfo, proc_cgroup = files
    return Confinement.detect(f"t{next(_tags)}", environ=environ or {}, mountinfo=str(mountinfo),
                                    proc_cgroup=str(proc_cgroup), userns=userns, kmsg="/nonexistent")


def caps(conf: Confinement) -> tuple[str, str, str, str]:
    mech = conf.mechanism
    return mech.kill, mech.memory, mech.processes, mech.cpu


def test_a_v2_only_host_with_controllers_holds_every_cap_in_cgroups(tmp_path, monkeypatch):
    conf = detect(fake_host(tmp_path, monkeypatch, v2="memory pids cpu"))
    assert caps(conf) == ("cgroup v2", "cgroup v2", "cgroup v2", "cgroup v2")
    level, line = conf.mechanism.start_line()
    assert level == logging.INFO and "falls back" not in line and "memory_limit by cgroup v2" in line


def test_a_v2_only_host_without_controllers_says_what_falls_back(tmp_path, monkeypatch):
    """A v2 hierarchy that offers no memory or pids controller: the tree kill and the CPU
    count are v2's, the memory and process caps fall back, and the line says why."""
    conf = detect(fake_host(tmp_path, monkeypatch, v2="cpu"))
    assert caps(conf) == ("cgroup v2", "rlimit + sampling", PROCESSES_USERNS, "cgroup v2")
    level, line = conf.mechanism.start_line()
    assert level == logging.WARNING
    assert "without the memory and pids controllers" in line
    assert "cgroups hold cpu_limit" in line
    assert "memory_limit falls back to RLIMIT_DATA + sampling" in line
    assert "max_processes to RLIMIT_NPROC in a user namespace per child + sampling" in line
    assert "tree kills by cgroup v2" in line


def test_a_v1_only_host_holds_memory_and_processes_and_kills_with_signals(tmp_path, monkeypatch):
    conf = detect(fake_host(tmp_path, monkeypatch, v1=True))
    assert caps(conf) == ("signals", "cgroup v1", "cgroup v1", "sampling")
    assert conf.v1_at_birth  # no v2 cgroup holds the tree: children are born in the v1 ones
    level, line = conf.mechanism.start_line()
    assert level == logging.WARNING
    assert "cgroups hold memory_limit, max_processes" in line and "cpu_limit falls back to RLIMIT_CPU + sampling" in line
    assert "tree kills by signals" in line and "max_processes to" not in line


def test_a_hybrid_host_takes_v2_for_the_kill_and_v1_for_the_caps(tmp_path, monkeypatch):
    files = fake_host(tmp_path, monkeypatch, v2="", v1=True)
    conf = detect(files)
    assert caps(conf) == ("cgroup v2", "cgroup v1", "cgroup v1", "cgroup v2")
    assert conf.mechanism.start_line()[0] == logging.INFO
    # CYCLONE_MP_CGROUPS keeps one hierarchy: the v1-only and v2-only hosts' mechanisms
    assert caps(detect(files, {"CYCLONE_MP_CGROUPS": "v1"})) == ("signals", "cgroup v1", "cgroup v1", "sampling")
    assert caps(detect(files, {"CYCLONE_MP_CGROUPS": "v2"})) == ("cgroup v2", "rlimit + sampling", PROCESSES_USERNS,
                                                                  "cgroup v2")


@pytest.mark.parametrize("host", ["none mounted", "not writable", "off"])
def test_no_cgroup_falls_back_for_every_cap_and_says_it_in_one_line(tmp_path, monkeypatch, host):
    if host == "none mounted":
        conf, why = detect(fake_host(tmp_path, monkeypatch)), "no cgroup v2, v1 memory or v1 pids hierarchy"
    elif host == "not writable":
        conf, why = detect(fake_host(tmp_path, monkeypatch, v2="memory pids", v1=True, writable=False)), "cgroup v2 at "
    else:
        conf, why = detect(fake_host(tmp_path, monkeypatch, v2="memory pids"), {"CYCLONE_MP_CGROUPS": "off"}), \
            "CYCLONE_MP_CGROUPS=off"
    assert caps(conf) == ("signals", "rlimit + sampling", PROCESSES_USERNS, "sampling")
    assert conf.dirs == []
    level, line = conf.mechanism.start_line()
    assert level == logging.WARNING and line.count("\n") == 0
    assert line.startswith("resource limits: no writable cgroup (") and why in line
    for words in ("memory_limit falls back to RLIMIT_DATA + sampling",
                  "max_processes to RLIMIT_NPROC in a user namespace per child + sampling",
                  "cpu_limit to RLIMIT_CPU + sampling", "max_open_files by RLIMIT_NOFILE + sampling", "tree kills by signals",
                  "OOM evidence: none readable here (a SIGKILL nobody here sent is child_exited)"):
        assert words in line, (words, line)
    if host == "not writable":
        assert "No such file or directory" in line and "cgroup v1 memory at " in line and "cgroup v1 pids at " in line


def test_without_user_namespaces_max_processes_is_sampling_alone_and_says_why(tmp_path, monkeypatch):
    """Root, or a kernel without unprivileged user namespaces: nothing but sampling holds
    max_processes, and the line says a burst between two looks is not bounded, and why."""
    conf = detect(fake_host(tmp_path, monkeypatch), userns=lambda: NO_USERNS)
    assert conf.mechanism.processes == "sampling" and conf.mechanism.no_userns == NO_USERNS
    line = conf.mechanism.start_line()[1]
    assert "max_processes to sampling alone" in line and "not bounded" in line and NO_USERNS in line
    conf.wants_userns()
    assert not conf.userns_at_birth  # nothing to be born into
    # a child that cannot make its namespace turns the mechanism to sampling, said once
    (tmp_path / "b").mkdir()
    conf = detect(fake_host(tmp_path / "b", monkeypatch))
    conf.wants_userns()
    assert conf.userns_at_birth and conf.mechanism.userns_processes
    conf.userns_failed("unshare(CLONE_NEWUSER): Operation not permitted")
    assert conf.mechanism.processes == "sampling" and not conf.userns_at_birth
    assert conf.mechanism.as_dict()["processes"] == "sampling"


def test_this_host_as_cyclone_mp_cgroups_shapes_it():
    """This host for real with each hierarchy alone, and with none (as root the supervisor
    can write cgroups here; as an ordinary user every one is the fallback): the v1 ones
    never count CPU nor kill the tree, the v2 one does both; every cap no cgroup holds is
    named in the start line."""
    for value in ("off", "v1", "v2"):
        conf = Confinement.detect("shape", environ={CGROUPS_ENV: value})
        try:
            mech, line = conf.mechanism, conf.mechanism.start_line()[1]
            hierarchies = {h for h, _ in conf.dirs}
            assert hierarchies <= {"off": set(), "v1": {"v1"}, "v2": {"v2"}}[value]
            if not hierarchies:
                assert (mech.kill, mech.memory, mech.cpu) == ("signals", "rlimit + sampling", "sampling")
                assert line.startswith("resource limits: no writable cgroup")
            elif value == "v1":
                assert (mech.kill, mech.cpu) == ("signals", "sampling") and "cpu_limit falls back" in line
            else:
                assert (mech.kill, mech.cpu) == ("cgroup v2", "cgroup v2")
            assert ("memory_limit falls back" in line) == (not mech.kernel_memory_cap)
        finally:
            conf.close()
        for _, path in conf.dirs:
            assert not os.path.exists(path)


def test_a_supervisor_with_cgroups_off_says_each_caps_mechanism_in_one_line(cyclone_env_factory, monkeypatch,
                                                                             caplog):
    """Acceptance: with ``CYCLONE_MP_CGROUPS=off`` the supervisor logs one line at start
    (a warning) naming what holds each cap instead."""
    monkeypatch.setenv(CGROUPS_ENV, "off")
    caplog.set_level(logging.INFO, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(workers=1, lease_ttl=2, worker="thread")
    env.mux().register(lh.noop)
    env.start_worker()
    found = [r for r in caplog.records if "resource limits:" in r.getMessage()]
    assert len(found) == 1, [r.getMessage() for r in found]
    line = found[0].getMessage()
    assert found[0].levelno == logging.WARNING
    assert "no writable cgroup (CYCLONE_MP_CGROUPS=off)" in line
    for cap, words in (("memory_limit", "falls back to RLIMIT_DATA + sampling"),
                       ("max_processes", "to "), ("cpu_limit", "to RLIMIT_CPU + sampling"),
                       ("max_open_files", "by RLIMIT_NOFILE + sampling")):
        assert f"{cap} {words}" in line, (cap, line)
    assert "tree kills by signals" in line and "OOM evidence:" in line
