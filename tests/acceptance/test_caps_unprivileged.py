"""Caps that hold without root: a real supervisor run as an ordinary user.

An ordinary user can write no cgroup on these machines (the hierarchies are root's), so
every cap falls back, and the supervisor says so in one line at start. ``max_processes``
is held there by ``RLIMIT_NPROC`` in a user namespace of each child's own (the kernel
counts only that tree's tasks in it) and by sampling; a tree over its cap is killed or its
attempt failed as ``process_limit``, fork bursts included.

The test runs as root and starts the worker as the user ``cyclone-caps`` (made here if
missing) with the system's Python, which must be the version this test runs on (the
installed packages hold compiled modules) and must be able to read this checkout and its
packages: the test checks with ``runuser`` first and skips, saying why, otherwise.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg
import pytest

import cyclone_mp

import limit_handlers as lh
from waiting import not_zombie

USER = "cyclone-caps"
SYSTEM_PYTHON = "/usr/bin/python3"


def _paths() -> list[str]:
    """What the worker imports: this checkout, the tests' handlers, the installed packages."""
    found = [str(Path(cyclone_mp.__file__).resolve().parents[1]), str(Path(lh.__file__).resolve().parent)]
    for module in (psycopg, psutil):
        where = str(Path(module.__file__).resolve().parents[1])
        if where not in found:
            found.append(where)
    return found


@pytest.fixture(scope="module")
def ordinary_user() -> dict[str, str]:
    """The user and the environment its worker runs with (skips, saying why, where it cannot)."""
    if os.geteuid() != 0:
        pytest.skip("runs a worker as an ordinary user: the test must run as root to switch to one")
    if shutil.which("runuser") is None:
        pytest.skip("runuser is missing: cannot check what an ordinary user can import")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is missing (an ordinary user cannot run root's interpreter)")
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"{SYSTEM_PYTHON} is {version}, the installed packages are for {sys.version_info[:2]}")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                        "/usr/sbin/nologin", USER], check=True)
    environ = {"PYTHONPATH": os.pathsep.join(_paths()), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    probe = subprocess.run(["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in environ.items()),
                            SYSTEM_PYTHON, "-c", "import cyclone_mp.testing.worker, limit_handlers"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{USER} cannot import this checkout or its packages: {probe.stderr.strip()[-300:]}")
    return environ


@pytest.fixture
def shared_dir():
    """A directory the ordinary user's handlers can write their logs in."""
    path = Path(tempfile.mkdtemp(prefix="cyclone-caps-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_as_user(env, environ: dict[str, str]):
    # through a TCP proxy: the test server's socket directory is not the user's to enter
    return env.start_worker(proxy=True, user=USER, python=SYSTEM_PYTHON, environ=environ)


def lines(path: Path, word: str) -> list[list[str]]:
    if not path.exists():
        return []
    return [w for w in (line.split() for line in path.read_text().splitlines()) if w and w[0] == word]


def test_max_processes_holds_a_fork_burst_without_root(cyclone_env_factory, ordinary_user, shared_dir, capfd):
    """Acceptance: as an ordinary user, ``max_processes=4`` and a step that forks 10
    sleeping processes at once (no pause between forks, then it returns at once, before
    any look of the 50 ms sampling): the step fails with ``process_limit`` saying so, no
    fork got past one over the cap, and the supervisor said at start which caps fall
    back to what. Then a real fork bomb under ``max_processes=20`` is held by the kernel
    and killed; and the slot runs the next step."""
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.burst, lh.fork_bomb, lh.noop)
    handle = start_as_user(env, ordinary_user)
    assert psutil.Process(handle.pid).uids().real == pwd.getpwnam(USER).pw_uid
    log = shared_dir / "burst"
    run = env.run_until_complete(env.enqueue(lh.burst, {"n": 10, "log": str(log)}, max_processes=4), timeout=60)
    step = run.step
    assert step.error_kind == "process_limit", (run.state, step.output, step.errors[-1:])
    entry = step.errors[-1]
    assert "max_processes 4" in step.error, step.error
    assert entry["enforced_by"] == "rlimit in a user namespace + sampling", entry
    # killed by the supervisor (it saw the tree one over the cap), or failed at the refused fork
    assert entry["killed_by_supervisor"] or "RLIMIT_NPROC" in entry["message"], entry
    assert entry["tree"]["processes"] <= 5, entry
    forked = lines(log, "forked")
    assert len(forked) <= 4, forked  # the runner and 3 more make 4; the kernel allows one over, never more
    start = [line for line in capfd.readouterr().err.splitlines() if "resource limits:" in line]
    assert len(start) == 1, start
    for words in ("no writable cgroup", "memory_limit falls back to RLIMIT_DATA + sampling",
                  "max_processes to RLIMIT_NPROC in a user namespace per child + sampling",
                  "cpu_limit to RLIMIT_CPU + sampling", "max_open_files by RLIMIT_NOFILE + sampling", "tree kills by signals"):
        assert words in start[0], (words, start[0])

    # a fork bomb: only the kernel can stop it between two looks
    log = shared_dir / "bomb"
    run_id = env.enqueue(lh.fork_bomb, {"log": str(log)}, max_processes=20)
    peak = 0
    deadline = time.monotonic() + 60
    while not env.status(run_id).terminal and time.monotonic() < deadline:
        kids = [p for p in env.child_pids() if not _zombie(p)]
        tree = sum(len(_descendants(p)) + 1 for p in kids)
        peak = max(peak, tree)
        time.sleep(0.005)
    run = env.status(run_id)
    assert run.step.error_kind == "process_limit", run.step.errors[-1:]
    assert peak <= 21, peak  # the cap and one over it (RLIMIT_NPROC counts the runner's two threads as two)
    nxt = env.run_until_complete(env.enqueue(lh.noop, {}), timeout=30)
    assert nxt.state == "completed", nxt.step.errors[-1:]


def test_every_other_cap_holds_without_root(cyclone_env_factory, ordinary_user, shared_dir):
    """The other caps as an ordinary user: memory (RLIMIT_DATA + sampling), CPU (sampling +
    RLIMIT_CPU) and open files (RLIMIT_NOFILE), each checked on a handler that breaks it."""
    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.hog, lh.spin, lh.files, lh.noop)
    start_as_user(env, ordinary_user)
    hog = env.run_until_complete(env.enqueue(lh.hog, {"total": 512 << 20, "chunk": 16 << 20,
                                                      "log": str(shared_dir / "hog")}, memory_limit="64MiB"),
                                 timeout=60)
    assert hog.step.error_kind == "memory_limit", hog.step.errors[-1:]
    assert hog.step.errors[-1]["enforced_by"] == "rlimit + sampling"
    assert hog.step.errors[-1]["tree"]["peak_memory_kb"] * 1024 < 64 * 5 // 2 * (1 << 20) + 3 * (16 << 20)
    spin = env.run_until_complete(env.enqueue(lh.spin, {"log": str(shared_dir / "spin")}, cpu_limit=1), timeout=60)
    assert spin.step.error_kind == "cpu_limit", spin.step.errors[-1:]
    assert spin.step.errors[-1]["tree"]["cpu_seconds"] < 1.5, spin.step.errors[-1]
    files = env.run_until_complete(env.enqueue(lh.files, {"n": 50}, max_open_files=10), timeout=30)
    assert files.step.error_kind == "error" and "Too many open files" in files.step.error, files.step.errors[-1:]
    assert env.run_until_complete(env.enqueue(lh.files, {"n": 5}, max_open_files=10), timeout=30).state == "completed"


def test_an_ordinary_handler_cannot_lift_its_open_file_cap(cyclone_env_factory, ordinary_user, shared_dir):
    """As an ordinary user ``max_open_files`` is a hard ``RLIMIT_NOFILE``: a handler that
    tries to raise it past the cap (soft and hard to 4096, else the soft one to the hard
    one) is refused and cannot hold 500 files (the attempt fails on "Too many open
    files"). Its runner cannot raise the hard limit back either: it takes a step with the
    same cap, and a step without one runs in a fresh runner, with the system's limits."""
    import resource

    env = cyclone_env_factory(workers=1, lease_ttl=2, kill_grace=0.5)
    env.mux().register(lh.files_lifted, lh.files, lh.rlimits, lh.noop)
    start_as_user(env, ordinary_user)
    log = shared_dir / "files"
    run = env.run_until_complete(env.enqueue(lh.files_lifted, {"to": 4096, "n": 500, "log": str(log)},
                                             max_open_files=20), timeout=30)
    step = run.step
    assert step.error_kind == "error" and "Too many open files" in step.error, step.errors[-1:]
    lifted, opened = lines(log, "lifted")[0], lines(log, "opened")[0]
    assert int(lifted[3]) < 4096 and int(opened[2]) <= 20, (lifted, opened)  # the hard limit held
    pinned = int(lines(log, "pid")[0][2])
    again = env.run_until_complete(env.enqueue(lh.noop, {}, max_open_files=20), timeout=30)
    assert again.step.output["pid"] == pinned  # the same cap: the same runner
    free = env.run_until_complete(env.enqueue(lh.rlimits, {}), timeout=30)
    assert free.state == "completed", free.step.errors[-1:]
    assert free.step.output["RLIMIT_NOFILE"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # a fresh runner's
    nxt = env.run_until_complete(env.enqueue(lh.noop, {}), timeout=30)
    assert nxt.step.output["pid"] != pinned


def _zombie(pid: int) -> bool:
    return not not_zombie(pid)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
