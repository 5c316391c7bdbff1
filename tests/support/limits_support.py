"""What the resource-limit tests share (``test_limits_*.py``, ``test_caps_held.py``): the
mechanism this host offers, the supervisor cgroups on it, the handlers' logs, and a fake
cgroup v2 tree for the pure v2 path. Their fixtures are in ``tests/acceptance/conftest.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

from cyclone_mp.limits.confinement import Confinement
from cyclone_mp.limits.mechanism import Mechanism
from waiting import not_zombie

HOST = Confinement.detect("probe")  # what this machine offers (removed at once below)
HOST.close()
# What a supervisor without cgroups offers here, probed once like HOST: user namespaces are
# a property of the host, and late in a suite this process's probe was refused (twice in a
# row) where the supervisor it had just started was not.
FALLBACK = Confinement.none().mechanism


def cgroup_dirs() -> set[str]:
    """Every supervisor cgroup directory on this host now (``cyclone-mp-<pid>-<tag>``)."""
    found = set()
    for parent in {os.path.dirname(p) for p in HOST.mechanism.where}:
        if os.path.isdir(parent):
            found |= {os.path.join(parent, n) for n in os.listdir(parent)
                      if n.startswith("cyclone-mp-") and not n.startswith("cyclone-mp-supervisor-")}
    return found


def left_behind(before: set[str]) -> list[str]:
    """The supervisor cgroup directories made since ``before`` by this test process or
    its descendants, or by a supervisor that is gone: a live supervisor of something
    else on this host (another test run, a worker) keeps its own."""
    me = os.getpid()
    left = []
    for path in sorted(cgroup_dirs() - before):
        pid = int(os.path.basename(path)[len("cyclone-mp-"):].split("-", 1)[0])
        try:
            ours = pid == me or me in {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            ours = True  # its supervisor is gone: the directory should be too
        if ours:
            left.append(path)
    return left


def expect(mechanism: str) -> Mechanism:
    return HOST.mechanism if mechanism == "host" else FALLBACK


def lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def dead(pid: int) -> bool:
    return not not_zombie(pid)


def start(env, **options: Any):
    return env.start_worker(**options)


def fake_v2(tmp_path: Path, controllers: str = "memory pids cpu", own: str = "/svc") -> tuple[Path, Path, Path]:
    """A fake cgroup v2 tree: mountinfo and /proc/self/cgroup texts and the directory of
    our own cgroup, whose children get the files the kernel would give them."""
    root = tmp_path / "cg"
    mine = root / own.strip("/")
    mine.mkdir(parents=True)
    (mine / "cgroup.controllers").write_text(controllers + "\n")
    (mine / "cgroup.subtree_control").write_text("")
    (mine / "cgroup.procs").write_text(f"{os.getpid()}\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n")
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text(f"0::{own}\n")
    return mountinfo, proc_cgroup, mine


def v2_files(directory: Path) -> None:
    for name, text in {"cgroup.procs": "", "cgroup.kill": "", "cgroup.freeze": "0", "cgroup.events":
                       "populated 0\nfrozen 0\n", "memory.max": "max", "memory.current": "0", "memory.peak": "0",
                       "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", "pids.max": "max",
                       "pids.current": "1", "pids.events": "max 0\n", "cpu.stat": "usage_usec 0\n",
                       "cgroup.subtree_control": ""}.items():
        if not (directory / name).exists():
            (directory / name).write_text(text)


def simulated_v2(tmp_path, monkeypatch) -> tuple[Confinement, Path]:
    """A confinement detected on a fake cgroup v2 tree (``fake_v2``) whose new
    directories get the kernel's files; and our own fake cgroup."""
    mountinfo, proc_cgroup, mine = fake_v2(tmp_path)
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # the kernel fills a new cgroup with its files
        real_mkdir(path, *args, **kwargs)
        if str(path).startswith(str(mine)):
            v2_files(Path(path))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "makedirs", lambda p, exist_ok=False: None if os.path.isdir(p) else mkdir(p))
    return Confinement.detect("sim", environ={}, mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)), mine
