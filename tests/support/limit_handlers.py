"""Module-level handlers of the resource-limit tests (issue 20) and the scrubbed escapee
(issue 18, fault 4); children import them by path.

Every handler that uses a resource writes what it did to ``inp["log"]`` (one line per
event, flushed at once) so a test can tell when a cap was crossed and when the tree died.
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import subprocess
import sys
import time
from typing import Any

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def note(path: str, *words: Any) -> None:
    with open(path, "a") as fh:
        fh.write(" ".join(str(w) for w in words) + "\n")


def allocate(total: int, chunk: int, log: str) -> list[bytes]:
    """Allocate ``total`` bytes in ``chunk``-byte pieces, touching every page; after each
    piece log ``rss <time> <pid> <rss bytes>``."""
    held = []
    note(log, "rss", time.time(), os.getpid(), rss_bytes())
    while len(held) * chunk < total:
        held.append(b"\x01" * chunk)  # written: resident at once
        note(log, "rss", time.time(), os.getpid(), rss_bytes())
    return held


@cy.step("lim_hog", max_attempts=1)
def hog(ctx: cy.Context, inp: dict) -> dict:
    """Allocates ``inp["total"]`` bytes in ``inp["chunk"]`` pieces, in this process or
    (``inp["grandchild"]``) in a grandchild it waits for."""
    note(inp["log"], "pid", time.time(), os.getpid())
    if inp.get("grandchild"):
        code = (f"import sys; sys.path[:0] = {sys.path!r}; import limit_handlers as h; "
                f"h.note({inp['log']!r}, 'pid', __import__('time').time(), __import__('os').getpid()); "
                f"h.allocate({inp['total']}, {inp['chunk']}, {inp['log']!r})")
        subprocess.run([sys.executable, "-c", code], check=True)
        return {"allocated": inp["total"], "where": "grandchild"}
    allocate(inp["total"], inp["chunk"], inp["log"])
    return {"allocated": inp["total"]}


@cy.step("lim_noop", max_attempts=1)
def noop(ctx: cy.Context, inp: object) -> dict:
    return {"pid": os.getpid(), "at": time.time()}


@cy.step("lim_hog_retried", max_attempts=3, backoff=_no_backoff)
def hog_retried(ctx: cy.Context, inp: dict) -> dict:
    """The poison quarantine's case: dies of the same cap on every attempt."""
    allocate(inp["total"], inp["chunk"], inp["log"])
    return {}


poison_flow = cy.Workflow("lim_poison_wf")
poison_flow.add(hog_retried)


@cy.step("lim_fork_bomb", max_attempts=1)
def fork_bomb(ctx: cy.Context, inp: dict) -> None:
    """A fork bomb: every process forks as fast as it can, forever (a refused fork is
    retried). Only ever run under a process cap verified first."""
    note(inp["log"], "pid", time.time(), os.getpid())
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.001)


@cy.step("lim_forker", max_attempts=1)
def forker(ctx: cy.Context, inp: dict) -> dict:
    """Starts ``inp["n"]`` sleeping processes, ``inp["every"]`` seconds apart (a bounded,
    slow "bomb" for the sampling path), logging each pid."""
    procs = []
    for _ in range(inp["n"]):
        try:
            proc = subprocess.Popen(["sleep", "600"])
        except OSError as exc:
            note(inp["log"], "refused", time.time(), exc.errno)
            raise
        procs.append(proc)
        note(inp["log"], "forked", time.time(), proc.pid, len(procs))
        time.sleep(inp.get("every", 0.02))
    return {"started": len(procs)}


@cy.step("lim_spin", max_attempts=1)
def spin(ctx: cy.Context, inp: dict) -> None:
    """A C loop that ignores every signal it can: one C call that never returns to the
    bytecode loop (holds the GIL, runs no signal handler, ignores cancellation)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU,
                signal.SIGALRM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    note(inp["log"], "pid", time.time(), os.getpid())
    collections.deque(itertools.repeat(None, 10**13), maxlen=0)


@cy.step("lim_files", max_attempts=1)
def files(ctx: cy.Context, inp: dict) -> dict:
    """Opens ``/dev/null`` ``inp["n"]`` times (kept open)."""
    kept = [open(os.devnull) for _ in range(inp["n"])]
    return {"opened": len(kept)}


@cy.step("lim_rlimits", max_attempts=1)
def rlimits(ctx: cy.Context, inp: object) -> dict:
    """The soft rlimits this handler runs under."""
    import resource

    return {name: resource.getrlimit(getattr(resource, name))[0]
            for name in ("RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_DATA")}


@cy.step("lim_escapee", max_attempts=1)
def escapee(ctx: cy.Context, inp: dict) -> dict:
    """Issue 18, fault 4: ``sh -c '(setsid env -i sleep 600 &)'``, exactly; logs the
    escapee's pid, then returns (``inp["stay"]`` seconds later: it may keep running)."""
    subprocess.run(["sh", "-c", "(setsid env -i sleep 600 &)"], check=True)
    import psutil

    deadline = time.monotonic() + 5
    found = None
    while found is None and time.monotonic() < deadline:  # this process is a subreaper: it adopted the escapee
        for proc in psutil.Process().children():
            try:
                if proc.cmdline() == ["sleep", "600"] and proc.environ() == {}:
                    found = proc.pid
            except psutil.Error:
                continue
        time.sleep(0.01)
    note(inp["log"], "escapee", time.time(), found)
    time.sleep(inp.get("stay", 0))
    if inp.get("crash"):  # the child dies on its own: the escapee is reparented to the supervisor
        os._exit(3)
    return {"escapee": found}


@cy.step("lim_burst", max_attempts=1)
def burst(ctx: cy.Context, inp: dict) -> dict:
    """Starts ``inp["n"]`` sleeping processes at once (no pause between them), logging
    each pid, then waits ``inp.get("hold", 0)`` seconds and returns (they live on)."""
    started = []
    for _ in range(inp["n"]):
        try:
            proc = subprocess.Popen(["sleep", str(inp.get("sleep", 600))])
        except OSError as exc:
            note(inp["log"], "refused", time.time(), exc.errno)
            raise
        started.append(proc.pid)
        note(inp["log"], "forked", time.time(), proc.pid, len(started))
    time.sleep(inp.get("hold", 0))
    return {"started": len(started)}


def _wait_for_file(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


@cy.step("lim_sigkill_self", max_attempts=1)
def sigkill_self(ctx: cy.Context, inp: dict) -> None:
    """Logs its pid, waits for ``inp["go"]`` (a file) if given, then SIGKILLs itself."""
    note(inp["log"], "pid", time.time(), os.getpid())
    if inp.get("go"):
        _wait_for_file(inp["go"])
    os.kill(os.getpid(), signal.SIGKILL)


@cy.step("lim_oom_victim", max_attempts=1)
def oom_victim(ctx: cy.Context, inp: dict) -> dict:
    """Logs its pid, waits for ``inp["go"]`` (a file: by then the test put this process in
    a small memory cgroup of its own), then touches ``inp["total"]`` bytes."""
    note(inp["log"], "pid", time.time(), os.getpid())
    _wait_for_file(inp["go"])
    held = allocate(inp["total"], 16 << 20, inp["log"])
    return {"held": len(held)}


@cy.step("lim_files_lifted", max_attempts=1)
def files_lifted(ctx: cy.Context, inp: dict) -> dict:
    """Lifts its ``RLIMIT_NOFILE`` to ``inp["to"]``, soft and hard (root with
    ``CAP_SYS_RESOURCE`` may raise a hard limit), else the soft one to the hard one, and
    logs which (``lifted SOFT HARD``, the limits it then has); opens ``/dev/null``
    ``inp["n"]`` times and holds them ``inp["hold"]`` seconds."""
    import resource

    note(inp["log"], "pid", time.time(), os.getpid())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (inp["to"], max(hard, inp["to"])))
    except (OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    note(inp["log"], "lifted", time.time(), *resource.getrlimit(resource.RLIMIT_NOFILE))
    kept = []
    try:
        for _ in range(inp["n"]):
            kept.append(open(os.devnull))
    except OSError:
        opened = len(kept)
        kept.pop().close()  # (a descriptor to write the log with)
        note(inp["log"], "opened", time.time(), opened)
        raise
    note(inp["log"], "opened", time.time(), len(kept))
    time.sleep(inp.get("hold", 0))
    return {"opened": len(kept)}


def escape_targets() -> list[str]:
    """The ``cgroup.procs`` of the cgroup just above this process's supervisor's, in each
    hierarchy where this process is in a supervisor's cgroup (``cyclone-mp-<pid>-<tag>``)."""
    from cyclone_mp.limits.cgroups import find_hierarchies

    with open("/proc/self/mountinfo") as fh:
        info = fh.read()
    with open("/proc/self/cgroup") as fh:
        own = fh.read()
    found = find_hierarchies(info, own)
    out = []
    for path in (found.v2, found.memory_v1, found.pids_v1):
        if path and "/cyclone-mp-" in path:
            out.append(os.path.join(path[:path.index("/cyclone-mp-")], "cgroup.procs"))
    return out


@cy.step("lim_cgroup_escape", max_attempts=1)
def cgroup_escape(ctx: cy.Context, inp: dict) -> dict:
    """Starts a grandchild that, ``inp["after"]`` seconds later (the supervisor has seen it
    in its cgroups by then), moves itself out of its step's cgroups (into the cgroup
    above its supervisor's, in every hierarchy: root can), logs it, then touches
    ``inp["total"]`` bytes and holds them ``inp["hold"]`` seconds; waits for it."""
    note(inp["log"], "pid", time.time(), os.getpid())
    code = (f"import sys, os, time; sys.path[:0] = {sys.path!r}; import limit_handlers as h; "
            f"h.note({inp['log']!r}, 'pid', time.time(), os.getpid()); "
            f"time.sleep({inp.get('after', 0)}); "
            "targets = h.escape_targets(); "
            "[open(t, 'w').write(str(os.getpid())) for t in targets]; "
            f"h.note({inp['log']!r}, 'escaped', time.time(), os.getpid(), ','.join(targets) or '-'); "
            f"held = h.allocate({inp['total']}, 16 << 20, {inp['log']!r}); "
            f"h.note({inp['log']!r}, 'holding', time.time(), os.getpid()); "
            f"time.sleep({inp.get('hold', 0)})")
    subprocess.run([sys.executable, "-c", code], check=True)
    return {"escaped": True}


@cy.step("lim_double_fork_spin", max_attempts=1)
def double_fork_spin(ctx: cy.Context, inp: dict) -> None:
    """Double-forks ``inp["n"]`` sleeping grandchildren (each in a session of its own, its
    parent gone: adopted by the child runner), logs their pids, then spins until killed
    (``cpu_limit``)."""
    note(inp["log"], "pid", time.time(), os.getpid())
    for _ in range(inp["n"]):
        subprocess.run(["sh", "-c", "(setsid sleep 600 & echo $! >> " + inp["log"] + ".pids)"], check=True)
    note(inp["log"], "forked", time.time())
    collections.deque(itertools.repeat(None, 10**13), maxlen=0)


@cy.step("lim_double_fork_hog", max_attempts=1)
def double_fork_hog(ctx: cy.Context, inp: dict) -> None:
    """Double-forks a grandchild (a session of its own, its parent gone: adopted by the
    child runner) that touches ``inp["total"]`` bytes in 16 MiB pieces and holds them;
    then waits (until its tree is killed)."""
    note(inp["log"], "pid", time.time(), os.getpid())
    code = (f"import sys, os, time; sys.path[:0] = {sys.path!r}; import limit_handlers as h; "
            f"h.note({inp['log']!r}, 'pid', time.time(), os.getpid()); "
            f"held = h.allocate({inp['total']}, 16 << 20, {inp['log']!r}); time.sleep(600)")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", code])
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(inp.get("hold", 30))
